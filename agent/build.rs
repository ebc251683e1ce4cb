//! Compiles the kernel programs (package `nccltrace-ebpf`) with aya-build and leaves the
//! object in `OUT_DIR`, where `source::load` embeds it: an installed binary needs no toolchain.
use anyhow::{Context as _, anyhow};

fn main() -> anyhow::Result<()> {
    let metadata = cargo_metadata::MetadataCommand::new()
        .no_deps()
        .exec()
        .context("cargo metadata")?;
    let ebpf = metadata
        .packages
        .iter()
        .find(|p| p.name.as_str() == "nccltrace-ebpf")
        .ok_or_else(|| anyhow!("package nccltrace-ebpf not found in the workspace"))?;
    let root_dir = ebpf
        .manifest_path
        .parent()
        .ok_or_else(|| anyhow!("nccltrace-ebpf manifest has no parent directory"))?;
    // aya-build relays every line the inner cargo prints as a build warning; keep the
    // progress lines out, errors still show.
    // SAFETY: build scripts are single-threaded.
    unsafe { std::env::set_var("CARGO_TERM_QUIET", "true") };
    aya_build::build_ebpf(
        [aya_build::Package {
            name: ebpf.name.as_str(),
            root_dir: root_dir.as_str(),
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    )
}
