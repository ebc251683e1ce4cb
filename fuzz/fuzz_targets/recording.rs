//! Any bytes as a recording: `nccltrace report`'s whole path (reader, decoder, attribution,
//! renderers) must return an error or outputs, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nccltrace::attribute::StepRule;
use nccltrace::record::Reader;

fuzz_target!(|data: &[u8]| {
    let Ok(reader) = Reader::new(std::io::Cursor::new(data), std::path::Path::new("fuzz.nctr"))
    else {
        return;
    };
    let Ok(outputs) = nccltrace::pipeline::replay_from(reader, StepRule::Auto, 64, None) else {
        return;
    };
    let sink = &mut std::io::sink();
    let symbols = nccltrace::symbolize::Symbols::default();
    for kind in nccltrace::render::flamegraph::Kind::ALL {
        let lines = nccltrace::render::flamegraph::folded(&outputs.detail, &symbols, kind);
        let _ = nccltrace::render::flamegraph::write_folded(&lines, sink);
    }
    let _ = nccltrace::render::summary::write_json(&outputs.summary, sink);
    let _ = nccltrace::render::summary::write_text(&outputs.summary, sink);
    let _ = nccltrace::render::steps::write_json(&outputs.steps, sink);
    let _ = nccltrace::render::steps::write_csv(&outputs.steps, sink);
    let table = nccltrace::render::steps::StepTable::of(&outputs.steps.steps);
    let _ = nccltrace::render::steps::write_table(&outputs.steps, &table, sink);
    let _ = nccltrace::render::trace::write(&outputs.header, &outputs.detail, &outputs.steps, sink);
});
