//! Any text as the /proc, /sys and tracefs files the agent parses: never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let maps = nccltrace::source::discover::parse_maps(&text);
    let _ = nccltrace::source::discover::mapped_files(&maps);
    let _ = nccltrace::host::parse_cpu_list(&text);
    let _ = nccltrace::host::parse_kallsyms(&text);
    let _ = nccltrace::host::kallsyms_ranges(&text, &["exc_page_fault", "handle_mm_fault"]);
    let _ = nccltrace::host::missing_capabilities(&text);
    let _ = nccltrace::symbolize::parse_perf_map(&text);
    let _ = nccltrace::source::tracefs::field_offset(&text, "prev_pid");
    let _ = nccltrace::doctor::topology::last_cpu(&text);
    let _ = nccltrace::doctor::topology::pages_per_node(&text);
});
