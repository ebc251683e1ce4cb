//! Any bytes as a recording: `nccltrace report`'s whole path (reader, decoder, attribution,
//! renderers) must return an error or outputs, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nccltrace_core::attribute::StepRule;
use nccltrace_core::record::Reader;

fuzz_target!(|data: &[u8]| {
    let Ok(reader) = Reader::new(std::io::Cursor::new(data), std::path::Path::new("fuzz.nctr"))
    else {
        return;
    };
    let Ok(outputs) = nccltrace_core::pipeline::replay_from(reader, StepRule::Auto, 64, None) else {
        return;
    };
    let sink = &mut std::io::sink();
    let symbols = nccltrace_core::symbolize::Symbols::default();
    for kind in nccltrace_core::render::flamegraph::Kind::ALL {
        let lines = nccltrace_core::render::flamegraph::folded(&outputs.detail, &symbols, kind);
        let _ = nccltrace_core::render::flamegraph::write_folded(&lines, sink);
    }
    let _ = nccltrace_core::render::summary::write_json(&outputs.summary, sink);
    let _ = nccltrace_core::render::summary::write_text(&outputs.summary, sink);
    let _ = nccltrace_core::render::steps::write_json(&outputs.steps, sink);
    let _ = nccltrace_core::render::steps::write_csv(&outputs.steps, sink);
    let table = nccltrace_core::render::steps::StepTable::of(&outputs.steps.steps);
    let _ = nccltrace_core::render::steps::write_table(&outputs.steps, &table, sink);
    let _ = nccltrace_core::render::trace::write(&(&outputs.header).into(), &outputs.detail, &outputs.steps, sink);
});
