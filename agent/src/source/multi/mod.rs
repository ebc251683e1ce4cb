//! Uprobes as one link per file and program (`BPF_TRACE_UPROBE_MULTI`, Linux 6.6+).
//!
//! One perf-event uprobe per probed function costs an RCU grace period under a kernel-wide
//! mutex to detach: ~70–130 ms each, one after another (measured here; 74 probes kept a
//! 3-s trace of the H200's DDP rank running ~7 s past its outputs). A uprobe-multi link
//! registers all of a file's probes in one call and unregisters them with one grace
//! period, outside that mutex.
//!
//! aya 0.14 cannot load a uprobe program for such links (the kernel wants the program
//! loaded with `expected_attach_type = BPF_TRACE_UPROBE_MULTI`), and the aya release that
//! can needs a newer Rust than this project's. So the two uprobe programs are loaded here:
//! the embedded object is parsed again with aya-obj, its map references are pointed at the
//! maps aya already created (by name, so both copies of the programs share every map), and
//! the instructions go to `BPF_PROG_LOAD` with that attach type. Where the kernel has no
//! uprobe-multi links (before 6.6), the agent attaches one perf-event uprobe per function
//! with aya, as before.

use std::collections::{BTreeMap, HashSet};
use std::ffi::CString;
use std::os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd};
use std::sync::OnceLock;

use std::num::NonZeroU32;
use std::path::Path;

use aya::Ebpf;
use aya::maps::Map;
use aya::programs::uprobe::{UProbeAttachLocation, UProbeAttachPoint, UProbeScope};
use aya::programs::{ProgramError, UProbe};

use super::{Link, SourceError, load_program, names, program_error};

mod sys;
use sys::{FuncInfo, link, load_btf, load_insns, prog_info};

/// Whether this kernel makes uprobe-multi links (checked once): a two-instruction program
/// loaded for them, linked to a path that is not a regular file, is refused with `EBADF`
/// by a kernel that has them and with `EINVAL` by one that does not.
pub(super) fn supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        let Ok(prog) = return_zero("probe_multi") else {
            return false;
        };
        let offsets = [0u64];
        let root = c"/";
        match link(prog.as_fd(), root, &offsets, None, false, 0) {
            Err(e) => e.raw_os_error() == Some(libc::EBADF),
            Ok(_) => false,
        }
    })
}

/// The descriptors of every map of `ebpf` by name, taken before any is moved out of it.
pub(super) fn map_fds(ebpf: &Ebpf) -> BTreeMap<String, OwnedFd> {
    ebpf.maps()
        .filter_map(|(name, map)| {
            let fd = map_data(map).fd().as_fd().try_clone_to_owned().ok()?;
            Some((name.to_owned(), fd))
        })
        .collect()
}

fn map_data(map: &Map) -> &aya::maps::MapData {
    match map {
        Map::Array(m)
        | Map::ArrayOfMaps(m)
        | Map::BloomFilter(m)
        | Map::CgroupArray(m)
        | Map::CgroupStorage(m)
        | Map::CgrpStorage(m)
        | Map::CpuMap(m)
        | Map::DevMap(m)
        | Map::DevMapHash(m)
        | Map::HashMap(m)
        | Map::HashOfMaps(m)
        | Map::InodeStorage(m)
        | Map::LpmTrie(m)
        | Map::LruHashMap(m)
        | Map::PerCpuArray(m)
        | Map::PerCpuCgroupStorage(m)
        | Map::PerCpuHashMap(m)
        | Map::PerCpuLruHashMap(m)
        | Map::PerfEventArray(m)
        | Map::ProgramArray(m)
        | Map::Queue(m)
        | Map::ReusePortSockArray(m)
        | Map::RingBuf(m)
        | Map::SockHash(m)
        | Map::SockMap(m)
        | Map::SkStorage(m)
        | Map::Stack(m)
        | Map::StackTraceMap(m)
        | Map::Unsupported(m)
        | Map::XskMap(m) => m,
    }
}

/// The programs `names` of the embedded `object`, their map references pointed at
/// `maps`, ready to load (instructions, license, kernel version, function records), with
/// the object's BTF where the kernel takes BTF.
pub(super) struct Relocated {
    programs: BTreeMap<String, Program>,
    btf: Option<OwnedFd>,
}

/// One relocated program.
struct Program {
    insns: Vec<aya_obj::generated::bpf_insn>,
    license: CString,
    version: u32,
    func_info: FuncInfo,
}

impl Relocated {
    pub(super) fn new(
        object: &[u8],
        maps: &BTreeMap<String, OwnedFd>,
        names: &[&str],
    ) -> Result<Relocated, String> {
        let mut obj = aya_obj::Object::parse(object).map_err(|e| format!("object: {e}"))?;
        if obj.has_btf_relocations() {
            return Err("the object has BTF relocations, which this loader does not do".into());
        }
        let btf = load_btf(&mut obj)?;
        let defs = std::mem::take(&mut obj.maps);
        let mut with_fds = Vec::new();
        for (name, def) in &defs {
            let fd = maps
                .get(name)
                .ok_or_else(|| format!("map {name} was not created"))?;
            with_fds.push((name.as_str(), fd.as_raw_fd(), def));
        }
        let text: HashSet<usize> = obj.functions.keys().map(|(section, _)| *section).collect();
        obj.relocate_maps(with_fds.into_iter(), &text)
            .map_err(|e| format!("map relocation: {e}"))?;
        obj.relocate_calls(&text)
            .map_err(|e| format!("call relocation: {e}"))?;
        let mut programs = BTreeMap::new();
        for name in names {
            let prog = obj
                .programs
                .get(*name)
                .ok_or_else(|| format!("no program {name} in the object"))?;
            let function = obj
                .functions
                .get(&prog.function_key())
                .ok_or_else(|| format!("no code for {name}"))?;
            let func_info = FuncInfo {
                bytes: function.func_info.func_info_bytes(),
                rec_size: u32::try_from(function.func_info_rec_size).unwrap_or(0),
                // The records themselves: aya-obj's `num_info` can count those of every
                // function in the program's section.
                count: u32::try_from(function.func_info.func_info.len()).unwrap_or(0),
            };
            programs.insert(
                (*name).to_owned(),
                Program {
                    insns: function.instructions.clone(),
                    license: prog.license.clone(),
                    version: prog.kernel_version.unwrap_or(0),
                    func_info,
                },
            );
        }
        Ok(Relocated { programs, btf })
    }

    /// Loads the program `name` for uprobe-multi links; a refusal carries the verifier's
    /// log.
    pub(super) fn load(&self, name: &str) -> Result<OwnedFd, String> {
        let prog = self
            .programs
            .get(name)
            .ok_or_else(|| format!("{name} not relocated"))?;
        let ptr = prog.insns.as_ptr() as u64;
        let btf = self.btf.as_ref().map(|fd| (fd.as_fd(), &prog.func_info));
        let load = |log: Option<&mut Vec<u8>>| {
            load_insns(
                ptr,
                prog.insns.len(),
                &prog.license,
                prog.version,
                name,
                btf,
                log,
            )
        };
        load(None).map_err(|e| {
            let mut log = vec![0u8; 1 << 20];
            let _ = load(Some(&mut log));
            let end = log.iter().position(|b| *b == 0).unwrap_or(log.len());
            let log = String::from_utf8_lossy(&log[..end]);
            let tail: Vec<&str> = log.lines().rev().take(20).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            format!("{e}; verifier:\n{}", tail.join("\n"))
        })
    }
}

/// Uprobe registration kept from waiting while the programs verify. The first uprobe
/// registered after a quiet spell waits for an RCU grace period (registering takes a
/// per-CPU rw-semaphore for writing, `dup_mmap_sem`; a writer that finds it idle waits for
/// every reader to see it), later ones within a grace period of the previous do not:
/// measured here, 5–21 ms for the first `perf_event_open` of a uprobe, 10–90 µs for the
/// next ones. That wait came after verification, in the "uprobes" phase. From before
/// verification until the real uprobes are attached, a thread links a two-instruction
/// program to offset 0 of a one-page memfd every [`WARM_EVERY`]: nothing maps the memfd,
/// so no breakpoint is written anywhere, and the wait is paid beside the verification.
/// The throwaway links are released together on threads of their own (each release waits
/// for a grace period, outside any mutex the rest of attaching needs).
pub(super) struct Warm {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// `None` once stopped.
    thread: Option<std::thread::JoinHandle<Vec<OwnedFd>>>,
}

/// How often a throwaway uprobe is registered: under a grace period (several ms).
pub(super) const WARM_EVERY: std::time::Duration = std::time::Duration::from_millis(2);
/// At most this many (a quarter of a second of verification).
const WARM_MOST: usize = 128;

impl Warm {
    /// Starts keeping registration warm, where the kernel makes uprobe-multi links (whose
    /// release does not wait under the perf events' mutex).
    pub(super) fn start() -> Option<Warm> {
        use std::sync::atomic::{AtomicBool, Ordering};
        if !supported() {
            return None;
        }
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let flag = std::sync::Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("nccltrace-warm".into())
            .spawn(move || {
                let mut held = Vec::new();
                let Ok(file) = page_file() else {
                    return held;
                };
                let path = format!("/proc/self/fd/{}", file.as_raw_fd());
                let Ok(path) = CString::new(path) else {
                    return held;
                };
                let Ok(prog) = return_zero("nccltrace_warm") else {
                    return held;
                };
                while !flag.load(Ordering::Relaxed) && held.len() < WARM_MOST {
                    match link(prog.as_fd(), &path, &[0], None, false, 0) {
                        Ok(link) => held.push(link),
                        Err(e) => {
                            log::debug!("uprobe registration not kept warm: {e}");
                            break;
                        }
                    }
                    std::thread::sleep(WARM_EVERY);
                }
                held.push(prog);
                held.push(file);
                held
            })
            .ok()?;
        Some(Warm {
            stop,
            thread: Some(thread),
        })
    }

    /// Stops registering (within a period) and releases the throwaway links in the
    /// background, each on a thread of its own (also when dropped: an attach that fails
    /// half-way). Returns how many there were.
    pub(super) fn stop(mut self) -> usize {
        self.finish()
    }

    fn finish(&mut self) -> usize {
        let Some(thread) = self.thread.take() else {
            return 0;
        };
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let held = thread.join().unwrap_or_default();
        let links = held.len().saturating_sub(2);
        let _ = std::thread::Builder::new()
            .name("nccltrace-warm-release".into())
            .spawn(move || release_each(held, || ()));
        links
    }
}

impl Drop for Warm {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Drops each of `links` on a thread of its own, while this thread runs `meanwhile`, and
/// waits for all: uprobe-multi links wait for their grace periods side by side, outside
/// the mutex perf events take turns on.
pub(super) fn release_each<T: Send>(links: Vec<T>, meanwhile: impl FnOnce()) {
    std::thread::scope(|scope| {
        for link in links {
            scope.spawn(move || drop(link));
        }
        meanwhile();
    });
}

/// A one-page anonymous file: something a uprobe can name that no process maps.
fn page_file() -> std::io::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name and valid flags.
    let fd = unsafe { libc::memfd_create(c"nccltrace-warm".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor the kernel just gave us, owned from here.
    let file = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: an open descriptor of ours.
    if unsafe { libc::ftruncate(file.as_raw_fd(), 4096) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(file)
}

/// A program of two instructions (`r0 = 0; exit`) loaded for uprobe-multi links.
fn return_zero(name: &str) -> std::io::Result<OwnedFd> {
    const RETURN_ZERO: [u64; 2] = [0x0000_0000_0000_00b7, 0x0000_0000_0000_0095];
    load_insns(
        RETURN_ZERO.as_ptr() as u64,
        RETURN_ZERO.len(),
        c"GPL",
        0,
        name,
        None,
        None,
    )
}

/// A function to probe: its file offset, the cookie its programs read, and whether its
/// return is traced too.
pub(super) struct Site {
    pub offset: u64,
    pub cookie: u64,
    pub returned: bool,
}

/// The file probed: its path, how errors name it, and the process probed (`None`: every
/// process mapping it).
pub(super) struct Probed<'a> {
    pub path: &'a Path,
    pub place: &'a str,
    pub pid: Option<NonZeroU32>,
}

/// The two uprobe programs (entry and return), and how they attach on this kernel.
pub(super) enum UprobePrograms {
    /// Loaded here, for a uprobe-multi link per file and program (Linux 6.6+).
    Multi { entry: OwnedFd, ret: OwnedFd },
    /// aya's, one perf-event uprobe per function (older kernels, or where loading them
    /// here failed): made for the target process when there is one target
    /// (`per_target`), else once for every process (each costs a grace period under a
    /// kernel-wide mutex to release: per target they would multiply).
    PerFunction { per_target: bool },
}

impl UprobePrograms {
    /// Loads the two programs for uprobe-multi links where the kernel makes them and their
    /// maps' descriptors were taken (`maps`); otherwise, or where that fails (said in the
    /// log), they are aya's, one uprobe per function.
    pub(super) fn load(maps: Option<&BTreeMap<String, OwnedFd>>) -> UprobePrograms {
        let Some(maps) = maps else {
            return UprobePrograms::PerFunction { per_target: false };
        };
        let names = names::UPROBE_PROGRAMS;
        let loaded = Relocated::new(super::PROGRAMS, maps, &names).and_then(|r| {
            // Each verified on a thread of its own, as `preload` does with the others.
            let timed = |name: &str| {
                let started = std::time::Instant::now();
                let loaded = r.load(name);
                log::debug!(
                    "{name} verified in {:?} ({} instructions processed)",
                    started.elapsed(),
                    loaded
                        .as_ref()
                        .ok()
                        .and_then(|fd| prog_info(fd.as_fd()).ok())
                        .map_or(0, |i| i.verified_insns)
                );
                loaded
            };
            let (entry, ret) = std::thread::scope(|scope| {
                let ret = scope.spawn(|| timed(names[1]));
                (timed(names[0]), ret.join())
            });
            Ok((
                entry?,
                ret.map_err(|_| "verification thread panicked".to_owned())??,
            ))
        });
        match loaded {
            Ok((entry, ret)) => UprobePrograms::Multi { entry, ret },
            Err(e) => {
                log::warn!("uprobes attached one by one (uprobe-multi programs not loaded: {e})");
                UprobePrograms::PerFunction { per_target: false }
            }
        }
    }

    /// Whether the probes are made for each target process ([`super::probe_library`]).
    pub(super) fn per_target(&self) -> bool {
        match self {
            UprobePrograms::Multi { .. } => true,
            UprobePrograms::PerFunction { per_target } => *per_target,
        }
    }

    /// Decides, for per-function uprobes, from the targets found at the start: for the
    /// target process when there is one (`--pid` of one rank: the other processes mapping
    /// the libraries then never trap), else for every process. Targets found later
    /// (`--follow`) get theirs the same way.
    pub(super) fn scope_for(&mut self, targets: usize) {
        if let UprobePrograms::PerFunction { per_target } = self {
            *per_target = targets == 1;
        }
    }

    /// How the uprobes are attached, in words (summary.json).
    pub(super) fn describe(&self) -> &'static str {
        match self {
            UprobePrograms::Multi { .. } => {
                "uprobe-multi links, one per target process, file and program"
            }
            UprobePrograms::PerFunction { per_target: true } => {
                "one perf-event uprobe per function, for the target process"
            }
            UprobePrograms::PerFunction { per_target: false } => {
                "one perf-event uprobe per function, for every process"
            }
        }
    }

    /// Attaches the entry program to every site of the file `path` (`place` names it in
    /// errors) and the return program to those whose return is traced; in the process
    /// `pid` only, or in every process.
    pub(super) fn attach(
        &self,
        ebpf: &mut Ebpf,
        path: &Path,
        place: &str,
        sites: &[Site],
        pid: Option<NonZeroU32>,
        links: &mut Vec<Link>,
    ) -> Result<(), SourceError> {
        let returned: Vec<&Site> = sites.iter().filter(|s| s.returned).collect();
        let every: Vec<&Site> = sites.iter().collect();
        let to = Probed { path, place, pid };
        self.attach_one(ebpf, names::UPROBE_LIB_CALL, &to, &every, links)?;
        self.attach_one(ebpf, names::URETPROBE_LIB_CALL, &to, &returned, links)
    }

    /// Attaches `program` (the entry or the return one) to `sites` of a file.
    pub(super) fn attach_one(
        &self,
        ebpf: &mut Ebpf,
        program: &str,
        to: &Probed<'_>,
        sites: &[&Site],
        links: &mut Vec<Link>,
    ) -> Result<(), SourceError> {
        if sites.is_empty() {
            return Ok(());
        }
        let returns = program == names::URETPROBE_LIB_CALL;
        match self {
            UprobePrograms::Multi { entry, ret } => {
                let failed = |io_error| {
                    program_error(
                        program,
                        to.place,
                        ProgramError::SyscallError(aya::sys::SyscallError {
                            call: "bpf_link_create (uprobe-multi)",
                            io_error,
                        }),
                    )
                };
                let c_path = CString::new(to.path.as_os_str().as_encoded_bytes())
                    .map_err(|_| failed(std::io::ErrorKind::InvalidInput.into()))?;
                let offsets: Vec<u64> = sites.iter().map(|s| s.offset).collect();
                let cookies: Vec<u64> = sites.iter().map(|s| s.cookie).collect();
                let pid = to.pid.map_or(0, NonZeroU32::get);
                let prog = if returns { ret } else { entry };
                let link = link(
                    prog.as_fd(),
                    &c_path,
                    &offsets,
                    Some(&cookies),
                    returns,
                    pid,
                )
                .map_err(failed)?;
                links.push(Link::Multi(link));
            }
            UprobePrograms::PerFunction { .. } => {
                let prog: &mut UProbe = load_program(ebpf, program)?;
                let scope = to
                    .pid
                    .map_or(UProbeScope::AllProcesses, UProbeScope::OneProcess);
                for site in sites {
                    let point = UProbeAttachPoint {
                        location: UProbeAttachLocation::AbsoluteOffset(site.offset),
                        cookie: Some(site.cookie),
                    };
                    let id = prog
                        .attach(point, to.path, scope)
                        .map_err(|e| program_error(program, to.place, e))?;
                    let link = prog
                        .take_link(id)
                        .map_err(|e| program_error(program, to.place, e))?;
                    links.push(Link::Uprobe(link));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod live {
    use super::*;

    /// On the real kernel (root, Linux 6.6+): the thread registers throwaway uprobes until
    /// stopped, one a period after the first (which may wait for a grace period: bounds
    /// wide enough for a loaded 2-CPU machine), and stops within a registration or so.
    #[test]
    #[ignore = "needs root: cargo xtask test"]
    fn registration_kept_warm_until_stopped() {
        assert!(supported(), "this kernel makes uprobe-multi links");
        let warm = Warm::start().expect("the warming thread starts");
        std::thread::sleep(std::time::Duration::from_millis(150));
        let asked = std::time::Instant::now();
        let registered = warm.stop();
        assert!(
            asked.elapsed() < std::time::Duration::from_millis(100),
            "stopped in {:?}",
            asked.elapsed()
        );
        // At most one a period; at least a few after a first wait of up to ~100 ms.
        assert!(
            (3..=76).contains(&registered),
            "{registered} registered in 150 ms"
        );
    }
}
