//! Symbolize stage: user frames with blazesym (ELF symbols and DWARF, demangled), one pass
//! per file, from the maps kept in the recording; kernel frames from the names recorded
//! out of /proc/kallsyms at the end of the live run. Works after the target has exited.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use blazesym::symbolize::source::{Elf, Source};
use blazesym::symbolize::{Input, Symbolized, Symbolizer};

use crate::attribute::StackKey;
use crate::record::Header;
use crate::source::discover::{MapEntry, parse_maps};

/// Frame names for every address in the stacks.
#[derive(Clone, Debug, Default)]
pub struct Symbols {
    pub(crate) user: HashMap<(u32, u64), String>,
    pub(crate) kernel: BTreeMap<u64, String>,
}

impl Symbols {
    /// A user frame's name (`addr` as it appears in the stack).
    #[must_use]
    pub fn user(&self, pid: u32, addr: u64) -> String {
        self.user
            .get(&(pid, addr))
            .cloned()
            .unwrap_or_else(|| format!("[unknown] {addr:#x}"))
    }

    /// A kernel frame's name.
    #[must_use]
    pub fn kernel(&self, addr: u64) -> String {
        self.kernel
            .get(&addr)
            .cloned()
            .unwrap_or_else(|| format!("[kernel] {addr:#x}"))
    }
}

/// Kernel function names for `ips`, from a kallsyms text.
#[must_use]
pub fn kernel_names(kallsyms: &str, ips: &BTreeSet<u64>) -> Vec<(u64, String)> {
    let syms = crate::host::parse_kallsyms(kallsyms);
    ips.iter()
        .filter_map(|ip| {
            let i = syms.partition_point(|(a, _)| *a <= *ip).checked_sub(1)?;
            Some((*ip, syms[i].1.to_owned()))
        })
        .collect()
}

/// Every kernel address in `stacks`.
#[must_use]
pub fn kernel_addresses(stacks: &[StackKey]) -> BTreeSet<u64> {
    stacks
        .iter()
        .flat_map(|s| s.kstack.iter().copied())
        .collect()
}

/// The file to read for `path` of process `pid`: through its root while it runs, else
/// the same path here.
fn readable(pid: u32, path: &str) -> PathBuf {
    let through_root = Path::new("/proc")
        .join(pid.to_string())
        .join("root")
        .join(path.trim_start_matches('/'));
    if through_root.exists() {
        through_root
    } else {
        PathBuf::from(path)
    }
}

/// Symbolizes every user frame of `stacks` (one blazesym pass per file) and takes the
/// kernel names as recorded.
#[must_use]
pub fn symbolize(header: &Header, stacks: &[StackKey], kernel: &BTreeMap<u64, String>) -> Symbols {
    let maps: HashMap<u32, Vec<MapEntry>> = header
        .targets
        .iter()
        .map(|t| {
            let mut m: Vec<MapEntry> = parse_maps(&t.maps_text)
                .into_iter()
                .filter(|m| m.path.is_some())
                .collect();
            m.sort_by_key(|m| m.start);
            (t.pid, m)
        })
        .collect();
    // (pid, path) → [(address as in the stack, file offset)]
    let mut by_file: BTreeMap<(u32, String), Vec<(u64, u64)>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for s in stacks {
        let Some(entries) = maps.get(&s.pid) else {
            continue;
        };
        for (i, addr) in s.ustack.iter().copied().enumerate() {
            if !seen.insert((s.pid, addr)) {
                continue;
            }
            // Outer frames are return addresses: look up the call instruction before them.
            let lookup = if i == 0 { addr } else { addr.saturating_sub(1) };
            let j = entries.partition_point(|m| m.start <= lookup);
            let Some(m) = j
                .checked_sub(1)
                .map(|j| &entries[j])
                .filter(|m| lookup < m.end)
            else {
                continue;
            };
            let path = m.path.clone().unwrap_or_default();
            by_file
                .entry((s.pid, path))
                .or_default()
                .push((addr, lookup - m.start + m.offset));
        }
    }
    let symbolizer = Symbolizer::new();
    let mut user = HashMap::new();
    for ((pid, path), addrs) in by_file {
        let offsets: Vec<u64> = addrs.iter().map(|(_, off)| *off).collect();
        let source = Source::Elf(Elf::new(readable(pid, &path)));
        let base = Path::new(&path)
            .file_name()
            .map_or(path.clone(), |n| n.to_string_lossy().into_owned());
        let names = symbolizer
            .symbolize(&source, Input::FileOffset(&offsets))
            .unwrap_or_default();
        for (i, (addr, offset)) in addrs.iter().enumerate() {
            let name = match names.get(i) {
                Some(Symbolized::Sym(sym)) => sym.name.to_string(),
                _ => format!("[{base}+{offset:#x}]"),
            };
            user.insert((pid, *addr), name);
        }
    }
    Symbols {
        user,
        kernel: kernel.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An address inside a function is named after it; one before the first is not.
    #[test]
    fn kernel_lookup() {
        let text = "ffffffff81000000 T start\nffffffff81000100 t exc_page_fault\nffffffff81000200 T after\n";
        let ips: BTreeSet<u64> = [0xffff_ffff_8100_0150, 0xffff_ffff_8000_0000].into();
        assert_eq!(
            kernel_names(text, &ips),
            vec![(0xffff_ffff_8100_0150, "exc_page_fault".to_owned())]
        );
    }

    /// This test binary's own code symbolizes to a demangled Rust name through a fake
    /// maps line covering the file.
    #[test]
    fn user_frames_from_maps() {
        let exe = std::env::current_exe().unwrap();
        let resolved =
            crate::source::discover::resolve(&exe, &["main"], crate::source::discover::Tables::All)
                .unwrap();
        let main_off = resolved["main"].file_offset;
        let size = std::fs::metadata(&exe).unwrap().len();
        let header = Header {
            targets: vec![crate::record::TargetInfo {
                pid: 1,
                maps_text: format!(
                    "100000000-{:x} r-xp 00000000 08:01 1 {}\n",
                    0x1_0000_0000 + size,
                    exe.display()
                ),
                ..Default::default()
            }],
            ..Default::default()
        };
        let stacks = vec![StackKey {
            pid: 1,
            kstack: vec![5],
            ustack: vec![0x1_0000_0000 + main_off],
        }];
        let kernel: BTreeMap<u64, String> = [(5, "schedule".to_owned())].into();
        let s = symbolize(&header, &stacks, &kernel);
        assert_eq!(s.user(1, 0x1_0000_0000 + main_off), "main");
        assert_eq!(s.kernel(5), "schedule");
        assert!(s.user(1, 7).starts_with("[unknown]"));
    }
}
