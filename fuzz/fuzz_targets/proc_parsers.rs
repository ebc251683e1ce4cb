//! Any text as the /proc, /sys and tracefs files the agent parses: never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nccltrace_core::procfs;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let maps = procfs::parse_maps(&text);
    let _ = procfs::mapped_files(&maps);
    let _ = procfs::maps_added(&text, &text);
    let _ = procfs::parse_cpu_list(&text);
    let _ = procfs::kallsyms_ranges(data, &["exc_page_fault", "handle_mm_fault"]);
    let ips = [0xffff_ffff_8100_0000, u64::MAX].into();
    let _ = nccltrace_core::symbolize::kernel_names(std::io::Cursor::new(data), &ips);
    let _ = procfs::missing_capabilities(&text);
    let _ = nccltrace_core::symbolize::parse_perf_map(&text);
    let _ = procfs::field_offset(&text, "prev_pid");
    let _ = procfs::last_cpu(&text);
    let _ = procfs::pages_per_node(&text);
    let _ = procfs::numa_maps_fields(&text).count();
    let _ = procfs::numa_maps_unscanned(&text);
    let _ = procfs::executable_ranges(&text, "/usr/lib/libcuda.so.1");
});
