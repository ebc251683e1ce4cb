//! The text of the /proc, /sys and tracefs files the agent reads, parsed: pure functions of
//! the text (fuzzed by `fuzz/proc_parsers`), shared by the live agent and `report`.

use std::collections::BTreeMap;

/// One line of `/proc/PID/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapEntry {
    pub start: u64,
    pub end: u64,
    pub perms: String,
    pub offset: u64,
    pub inode: u64,
    pub path: Option<String>,
}

/// Parses `/proc/PID/maps`; malformed lines are skipped.
#[must_use]
pub fn parse_maps(text: &str) -> Vec<MapEntry> {
    text.lines().filter_map(parse_maps_line).collect()
}

fn parse_maps_line(line: &str) -> Option<MapEntry> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let perms = fields.next()?;
    let offset = fields.next()?;
    let _dev = fields.next()?;
    let inode = fields.next()?;
    let path = fields
        .next()
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned);
    let (start, end) = range.split_once('-')?;
    Some(MapEntry {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        perms: perms.to_owned(),
        offset: u64::from_str_radix(offset, 16).ok()?,
        inode: inode.parse().ok()?,
        path,
    })
}

/// The lines of `now` (a process's maps read later) that map a file where `then` maps
/// nothing: libraries loaded since `then` was read, to symbolize their frames. Lines that
/// overlap a mapping of `then` are left out: the stacks taken before kept `then`'s meaning.
#[must_use]
pub fn maps_added(then: &str, now: &str) -> String {
    let old = parse_maps(then);
    let mut added = String::new();
    for line in now.lines() {
        let Some(m) = parse_maps_line(line).filter(|m| m.path.is_some()) else {
            continue;
        };
        if old.iter().all(|o| o.end <= m.start || m.end <= o.start) {
            added.push_str(line);
            added.push('\n');
        }
    }
    added
}

/// Files mapped by a process, each once, in map order: regular paths only (no
/// `[vdso]`, no deleted files, no devices).
#[must_use]
pub fn mapped_files(maps: &[MapEntry]) -> Vec<String> {
    let mut seen = std::collections::BTreeSet::new();
    maps.iter()
        .filter(|m| m.inode != 0)
        .filter_map(|m| m.path.as_deref())
        .filter(|p| p.starts_with('/') && !p.ends_with(" (deleted)") && !p.starts_with("/dev/"))
        .filter(|p| seen.insert(p.to_string()))
        .map(str::to_owned)
        .collect()
}

/// Parses a node's `numastat` (`numa_hit 76305701` a line): (counter, pages), the lines
/// that read as numbers.
#[must_use]
pub fn parse_numastat(text: &str) -> Vec<(String, u64)> {
    text.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            Some((words.next()?.to_owned(), words.next()?.parse().ok()?))
        })
        .collect()
}

/// Parses a kernel CPU list such as `0-3,8,10-11`.
#[must_use]
pub fn parse_cpu_list(text: &str) -> Vec<u32> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<u32>(), b.parse::<u32>()) {
                    cpus.extend(a..=b.min(a.saturating_add(65_535)));
                }
            }
            None => cpus.extend(part.parse::<u32>().ok()),
        }
    }
    cpus
}

/// How often a target's `/proc/PID/numa_maps` is read while NUMA balancing is off (the
/// kernel walks every page table of the process for it: a second or two of a core for
/// hundreds of GiB).
pub const NUMA_MAPS_EVERY: std::time::Duration = std::time::Duration::from_secs(2);

/// The address ranges `path` is mapped executable at in a `/proc/PID/maps` text.
#[must_use]
pub fn executable_ranges(maps: &str, path: &str) -> Vec<(u64, u64)> {
    parse_maps(maps)
        .into_iter()
        .filter(|m| m.perms.contains('x') && m.path.as_deref() == Some(path))
        .map(|m| (m.start, m.end))
        .collect()
}

/// The memory policy, other than the default, that NUMA balancing does not scan under and
/// that holds the most resident KiB of a numa_maps text, with those KiB: a policy set with
/// `mbind`/`set_mempolicy` (`numactl --membind`, `--interleave`, `--preferred`) lacks the
/// migrate-on-fault flag unless made with `MPOL_F_NUMA_BALANCING` (shown `=balancing`),
/// so the kernel makes no hinting fault in it. `None` where every resident page is under
/// the default policy or one balancing scans.
#[must_use]
pub fn numa_maps_unscanned(text: &str) -> Option<(String, u64)> {
    let mut by_policy: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
    for line in text.lines() {
        let Some(policy) = line.split_whitespace().nth(1) else {
            continue;
        };
        if policy == "default" || policy.contains("balancing") {
            continue;
        }
        let kib = numa_maps_fields(line).fold(0u64, |sum, (_, pages, page_kib)| {
            sum.saturating_add(pages.saturating_mul(page_kib))
        });
        let entry = by_policy.entry(policy).or_default();
        *entry = entry.saturating_add(kib);
    }
    by_policy
        .into_iter()
        .filter(|(_, kib)| *kib > 0)
        .max_by_key(|(_, kib)| *kib)
        .map(|(policy, kib)| (policy.to_owned(), kib))
}

/// The `N<node>=<pages>` fields of a numa_maps text, each with its mapping's page size
/// in KiB (`kernelpagesize_kB`, 4 unless it says otherwise: huge pages).
pub fn numa_maps_fields(text: &str) -> impl Iterator<Item = (usize, u64, u64)> + '_ {
    text.lines().flat_map(|line| {
        let page_kib = line
            .split_whitespace()
            .find_map(|f| f.strip_prefix("kernelpagesize_kB="))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(4);
        line.split_whitespace().filter_map(move |field| {
            let (node, pages) = field.strip_prefix('N')?.split_once('=')?;
            Some((node.parse().ok()?, pages.parse().ok()?, page_kib))
        })
    })
}

/// Calls `each(address, kind, name)` for every line of a kallsyms text read from `reader`,
/// a line at a time: /proc/kallsyms is 5–10 MB, and held whole it was most of the agent's
/// memory at its start and at the end of each window. Lines that do not parse are
/// skipped; a read error ends the text there.
pub fn each_kallsyms_line(
    mut reader: impl std::io::BufRead,
    mut each: impl FnMut(u64, &str, &str),
) {
    let mut line = Vec::with_capacity(128);
    loop {
        line.clear();
        if !matches!(reader.read_until(b'\n', &mut line), Ok(n) if n > 0) {
            return;
        }
        let Ok(text) = std::str::from_utf8(&line) else {
            continue;
        };
        let mut fields = text.split_whitespace();
        if let (Some(addr), Some(kind), Some(name)) = (fields.next(), fields.next(), fields.next())
            && let Ok(addr) = u64::from_str_radix(addr, 16)
        {
            each(addr, kind, name);
        }
    }
}

/// A text (function) symbol at a known address (hidden ones read as 0).
#[must_use]
pub fn is_function(addr: u64, kind: &str) -> bool {
    addr != 0 && matches!(kind, "t" | "T" | "w" | "W")
}

/// The address ranges `[start, end)` of some kernel functions, gathered from kallsyms
/// lines: the end is the next function's address.
#[derive(Debug)]
pub struct FunctionRanges<'a> {
    names: &'a [&'a str],
    /// Every function's address (8 bytes a symbol, not its line).
    addrs: Vec<u64>,
    starts: Vec<u64>,
}

impl<'a> FunctionRanges<'a> {
    #[must_use]
    pub fn new(names: &'a [&'a str]) -> FunctionRanges<'a> {
        FunctionRanges {
            names,
            addrs: Vec::new(),
            starts: Vec::new(),
        }
    }

    pub fn line(&mut self, addr: u64, kind: &str, name: &str) {
        if is_function(addr, kind) {
            self.addrs.push(addr);
            if self.names.contains(&name) {
                self.starts.push(addr);
            }
        }
    }

    /// The ranges, by address; a function with no function after it is left out.
    #[must_use]
    pub fn finish(mut self) -> Vec<(u64, u64)> {
        self.addrs.sort_unstable();
        self.addrs.dedup();
        self.starts.sort_unstable();
        self.starts.dedup();
        self.starts
            .iter()
            .filter_map(|&start| {
                let next = self.addrs.partition_point(|&a| a <= start);
                Some((start, *self.addrs.get(next)?))
            })
            .collect()
    }
}

/// Address ranges `[start, end)` of the named kernel functions, from a kallsyms text (the
/// end is the next function's address).
#[must_use]
pub fn kallsyms_ranges(reader: impl std::io::BufRead, names: &[&str]) -> Vec<(u64, u64)> {
    let mut ranges = FunctionRanges::new(names);
    each_kallsyms_line(reader, |addr, kind, name| ranges.line(addr, kind, name));
    ranges.finish()
}

/// The capabilities `attach` needs that a process with this `/proc/PID/status` lacks:
/// loading programs (CAP_BPF), perf events and uprobes (CAP_PERFMON), reading other
/// processes' maps and files (CAP_SYS_PTRACE). CAP_SYS_ADMIN stands in for the first two,
/// as on kernels before 5.8.
#[must_use]
pub fn missing_capabilities(status: &str) -> Vec<&'static str> {
    const SYS_PTRACE: u32 = 19;
    const SYS_ADMIN: u32 = 21;
    const PERFMON: u32 = 38;
    const BPF: u32 = 39;
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    let has = |cap: u32| effective & (1u64 << cap) != 0;
    let mut missing = Vec::new();
    if !has(BPF) && !has(SYS_ADMIN) {
        missing.push("CAP_BPF");
    }
    if !has(PERFMON) && !has(SYS_ADMIN) {
        missing.push("CAP_PERFMON");
    }
    if !has(SYS_PTRACE) {
        missing.push("CAP_SYS_PTRACE");
    }
    missing
}

/// The byte offset of `field` in a tracepoint `format` file's text.
#[must_use]
pub fn field_offset(format: &str, field: &str) -> Option<u32> {
    format.lines().find_map(|line| {
        let line = line.trim();
        let decl = line.strip_prefix("field:")?.split(';').next()?;
        let name = decl.rsplit([' ', '*']).next()?;
        let name = name.split('[').next()?;
        if name != field {
            return None;
        }
        let offset = line
            .split(';')
            .find_map(|p| p.trim().strip_prefix("offset:"))?;
        offset.trim().parse().ok()
    })
}

/// The last CPU a task ran on: field 39 of `stat`, counted after the `(comm)`.
#[must_use]
pub fn last_cpu(stat: &str) -> Option<u32> {
    let (_, rest) = stat.rsplit_once(')')?;
    // rest starts at field 3 (state); field 39 is index 36 of it.
    rest.split_whitespace().nth(36)?.parse().ok()
}

/// Resident pages per node from `numa_maps` (`N0=12 N1=3` fields; damaged counts
/// saturate).
#[must_use]
pub fn pages_per_node(numa_maps: &str) -> BTreeMap<i32, u64> {
    let mut pages = BTreeMap::new();
    for (node, count, _) in numa_maps_fields(numa_maps) {
        let Ok(node) = i32::try_from(node) else {
            continue;
        };
        let n = pages.entry(node).or_insert(0u64);
        *n = n.saturating_add(count);
    }
    pages
}

/// The calling thread's CPU time so far (`/proc/thread-self/schedstat`'s first field, in
/// ns); `None` where it cannot be read. For the debug log of each thread's share of a
/// report (`RUST_LOG=debug`).
#[must_use]
pub fn thread_cpu_ns() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    text.split_whitespace().next()?.parse().ok()
}

/// Logs (debug) the calling thread's CPU time so far under its name.
pub fn log_thread_cpu() {
    if log::log_enabled!(log::Level::Debug)
        && let Some(ns) = thread_cpu_ns()
    {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed thread");
        log::debug!("{name}: {:.1} ms of CPU", ns as f64 / 1e6);
    }
}

#[cfg(test)]
mod tests {
    use super::numa_maps_unscanned;

    /// `numactl --membind=1` binds every mapping (the task's policy shows on each); a
    /// policy made with `MPOL_F_NUMA_BALANCING` and the default are scanned.
    #[test]
    fn memory_balancing_does_not_scan() {
        let bound = "7f0000000000 bind:1 anon=512 dirty=512 N1=512 kernelpagesize_kB=4\n\
                     7f0000200000 bind:1 file=/usr/lib/libc.so.6 mapped=100 N1=100 kernelpagesize_kB=4\n\
                     7f0000400000 default anon=4 dirty=4 N0=4 kernelpagesize_kB=4\n";
        assert_eq!(
            numa_maps_unscanned(bound),
            Some(("bind:1".to_owned(), 612 * 4))
        );
        let huge = "7f0000000000 interleave:0-1 anon=2 N0=1 N1=1 kernelpagesize_kB=2048\n";
        assert_eq!(
            numa_maps_unscanned(huge),
            Some(("interleave:0-1".to_owned(), 4096))
        );
        let scanned = "7f0000000000 bind=balancing:1 anon=512 N1=512 kernelpagesize_kB=4\n\
                       7f0000400000 default anon=4 N0=4 kernelpagesize_kB=4\n\
                       7f0000800000 bind:1 anon=0\n";
        assert_eq!(numa_maps_unscanned(scanned), None);
        assert_eq!(numa_maps_unscanned(""), None);
    }
    use super::*;

    /// A function ends at the next function's address, even where another name shares
    /// its address (an alias): read whole and sorted by (address, name), an alias named
    /// after it made the range empty.
    #[test]
    fn function_ranges_skip_aliases() {
        let text = "ffffffff81000100 T exc_page_fault\nffffffff81000100 T zz_alias\n\
                    ffffffff81000180 t next_fn\nffffffff81000200 D data_after\n";
        assert_eq!(
            kallsyms_ranges(text.as_bytes(), &["exc_page_fault"]),
            vec![(0xffff_ffff_8100_0100, 0xffff_ffff_8100_0180)]
        );
        // The last function has no end.
        assert!(kallsyms_ranges(text.as_bytes(), &["next_fn"]).is_empty());
    }

    /// Lines are read one at a time: one that is not UTF-8 or has too few fields is
    /// skipped, and the lines after it are still read.
    #[test]
    fn kallsyms_lines_one_at_a_time() {
        let mut text = b"ffffffff81000000 T first\n".to_vec();
        text.extend_from_slice(b"ffffffff81000040 T bad\xff\xfe\n");
        text.extend_from_slice(b"not a line\nffffffff81000080 t\nffffffff810000c0 t last");
        let mut seen = Vec::new();
        each_kallsyms_line(text.as_slice(), |addr, kind, name| {
            seen.push((addr, kind.to_owned(), name.to_owned()));
        });
        assert_eq!(
            seen,
            vec![
                (0xffff_ffff_8100_0000, "T".to_owned(), "first".to_owned()),
                (0xffff_ffff_8100_00c0, "t".to_owned(), "last".to_owned()),
            ]
        );
    }
}
