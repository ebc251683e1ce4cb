//! Render stage: one module per output format, each writing to any `impl Write`.
pub mod steps;
pub mod summary;
