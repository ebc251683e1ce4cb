//! `cargo xtask vm-test`: the privileged tests that need what this machine lacks (two NUMA
//! nodes, older kernels), run inside QEMU guests.
//!
//! Each guest is Debian's kernel package booted by virtme-ng under QEMU's software
//! emulation (TCG: KVM does not boot stock kernels here), with two NUMA nodes of one CPU
//! each and the host's root shared read-only, so the guest runs the test binary, the
//! release agent and the fixtures built here. Guests are ~17× slower than the host:
//! functional checks, not timing.

use std::fmt::Write as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

/// The kernels a guest can boot: (name on the command line, the Debian package that
/// depends on the newest build of that series).
pub const KERNELS: [(&str, &str); 2] = [
    ("6.1", "linux-image-amd64"),
    ("6.12", "linux-image-6.12-amd64"),
];

/// The virtme-ng release that boots the guests (PyPI).
const VIRTME_NG_VERSION: &str = "1.42";

/// A test that runs longer than this in a guest is killed and reported as hung (the
/// longest takes about a minute under TCG).
const TEST_BOUND: Duration = Duration::from_secs(180);

/// Kernel arguments that keep the guest on the TSC clocksource.
const GUEST_CLOCK: &str = "tsc=reliable clocksource=tsc";

/// Booting and shutting down a guest, at most.
const BOOT_BOUND: Duration = Duration::from_secs(120);

/// The tests run in a guest: every test of the `guest` module, the counting test, and
/// the steps begun during an attach that takes seconds there.
pub const GUEST_TESTS: [&str; 3] = [
    "guest::",
    "counts::counts_every_call_of_the_trainer",
    "steps::steps_begun_before_attach_are_left_out",
];

fn say(what: &str, status: &str) {
    eprintln!("vm-test: {what:<44} {status}");
}

/// Installs what booting a guest needs: QEMU, kmod (virtme-ng runs depmod), udev and
/// busybox (its initramfs), virtme-ng in a virtual environment of its own; and what the
/// soft-RoCE test runs in it (the guest shares this machine's root).
pub fn setup() -> anyhow::Result<PathBuf> {
    super::setup::apt_packages(
        "QEMU guest tools",
        &[
            "qemu-system-x86",
            "kmod",
            "udev",
            "busybox-static",
            // A soft-RoCE port in the guest: `rdma link`, the rxe verbs provider, rping.
            "iproute2",
            "ibverbs-providers",
            "rdmacm-utils",
        ],
    )?;
    let venv = super::setup::cache_dir().join(format!("virtme-ng-{VIRTME_NG_VERSION}"));
    let vng = venv.join("bin/vng");
    if vng.is_file() {
        say(&format!("virtme-ng {VIRTME_NG_VERSION} (PyPI)"), "present");
        return Ok(venv.join("bin"));
    }
    say(
        &format!("virtme-ng {VIRTME_NG_VERSION} (PyPI)"),
        "installing in a virtual environment",
    );
    let _ = std::fs::remove_dir_all(&venv);
    super::run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
    super::run(
        Command::new(venv.join("bin/pip"))
            .args(["install", "-q", "--disable-pip-version-check"])
            .arg(format!("virtme-ng=={VIRTME_NG_VERSION}")),
    )?;
    Ok(venv.join("bin"))
}

/// The kernel image of `series` (downloaded and unpacked once into the cache), with its
/// modules beside it where virtme-ng looks for them.
pub fn kernel(series: &str) -> anyhow::Result<PathBuf> {
    let Some((_, meta)) = KERNELS.iter().find(|(s, _)| *s == series) else {
        bail!(
            "unknown kernel {series:?}: choose one of {} or all",
            KERNELS.map(|k| k.0).join(", ")
        );
    };
    let dir = super::setup::cache_dir().join("kernels");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // The package the meta-package depends on today, e.g. linux-image-6.1.0-57-amd64.
    let resolve = || {
        super::setup::output(Command::new("apt-cache").args(["depends", meta]))
            .lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .find(|p| p.starts_with("linux-image-"))
            .map(str::to_owned)
    };
    let package = resolve().or_else(|| {
        // No package lists yet on a fresh machine.
        let _ = super::run(Command::new("apt-get").args(["update", "-q"]));
        resolve()
    });
    let cached = |package: &str| -> Option<PathBuf> {
        let version = package.strip_prefix("linux-image-")?;
        let image = dir.join(version).join(format!("boot/vmlinuz-{version}"));
        image.is_file().then_some(image)
    };
    let Some(package) = package else {
        // No package lists (offline): any kernel of the series already here.
        let found = std::fs::read_dir(&dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|v| v.starts_with(&format!("{series}.")))
            .find_map(|v| cached(&format!("linux-image-{v}")));
        return found.with_context(|| {
            format!("apt-cache depends {meta} named no kernel package, and none is cached")
        });
    };
    if let Some(image) = cached(&package) {
        say(&format!("kernel {package}"), "cached");
        return Ok(image);
    }
    say(
        &format!("kernel {package}"),
        "downloading (apt-get download)",
    );
    let version = package.trim_start_matches("linux-image-");
    let unpack = dir.join(version);
    let _ = std::fs::remove_dir_all(&unpack);
    std::fs::create_dir_all(&unpack)?;
    super::run(
        Command::new("apt-get")
            .args(["download", "-q", &package])
            .current_dir(&unpack),
    )?;
    let deb = std::fs::read_dir(&unpack)?
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "deb"))
        .context("apt-get download left no .deb")?;
    super::run(Command::new("dpkg").arg("-x").arg(&deb).arg(&unpack))?;
    std::fs::remove_file(&deb)?;
    cached(&package).with_context(|| format!("{package} has no boot/vmlinuz-{version}"))
}

/// What one guest run came to.
pub struct Verdict {
    pub kernel: String,
    pub passed: bool,
    pub summary: String,
    pub log: PathBuf,
}

/// The path of the `attach` integration-test binary, built.
fn attach_tests(root: &Path) -> anyhow::Result<PathBuf> {
    let out = Command::new("cargo")
        .current_dir(root)
        .args([
            "test",
            "-q",
            "-p",
            "nccltrace",
            "--test",
            "attach",
            "--no-run",
            "--message-format=json",
        ])
        .stderr(Stdio::inherit())
        .output()
        .context("cargo test --no-run")?;
    if !out.status.success() {
        bail!("building the attach tests failed");
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|m| m["target"]["name"] == "attach")
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .context("cargo named no attach test executable")
}

/// The full names of the tests of the `attach` binary that `filters` choose.
fn test_names(tests: &Path, filters: &[String]) -> anyhow::Result<Vec<String>> {
    let out = Command::new(tests)
        .args(["--list", "--include-ignored"])
        .args(filters)
        .output()
        .context("listing the attach tests")?;
    let names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_suffix(": test"))
        .map(str::to_owned)
        .collect();
    if names.is_empty() {
        bail!("no attach test matches {filters:?}");
    }
    Ok(names)
}

/// Run first in every guest (issue 23): the kernel code the agent's attaches patch is
/// patched once here, while no test runs, and stays patched. Enabling a tracepoint flips
/// a static key, which rewrites code other vCPUs may be running; under QEMU's
/// multi-threaded TCG the patch's int3 was seen executing after the patch completed
/// (an oops at a jump label in `__schedule` or `try_to_wake_up`, then a panic: the guest
/// died mid-test). With the scheduler and memory events enabled through tracefs (their
/// output off: `tracing_on` 0) the keys stay on, so the agent's attaches only add probes;
/// a kprobe event on each kernel function the agent kprobes keeps its ftrace site armed;
/// kprobe jump optimization, which patches later from a worker, is off.
const PRE_ARM: &str = "T=/sys/kernel/tracing; [ -d $T/events ] || mount -t tracefs nodev $T\n\
    echo 0 > /proc/sys/debug/kprobes-optimization 2>/dev/null\n\
    for e in sched/sched_switch sched/sched_waking sched/sched_migrate_task \
    sched/sched_process_fork sched/sched_process_exit exceptions/page_fault_user \
    migrate/mm_migrate_pages sched/sched_move_numa sched/sched_swap_numa \
    sched/sched_stick_numa; do [ -e $T/events/$e/enable ] && echo 1 > $T/events/$e/enable; done\n\
    i=0; for f in $(grep -o -E ' (finish_task_switch[.a-z0-9]*|task_numa_fault)$' /proc/kallsyms); do \
    i=$((i+1)); echo \"p:nccltrace_prearm$i $f\" >> $T/kprobe_events && \
    echo 1 > $T/events/kprobes/nccltrace_prearm$i/enable; done\n\
    echo 0 > $T/tracing_on\n";

/// The script a guest runs: each test alone, in a session of its own, killed with all it
/// started when it runs past [`TEST_BOUND`] — after what the guest was running at that
/// moment (processes and kernel stacks) is written to the log. One line per test in
/// `results`: the exit status or `hung`. Output is not captured, so that the log keeps
/// what passing tests print too (the breakdown's figures against the trainer's).
fn guest_script(env: &str, tests: &Path, names: &[String], log: &Path, results: &Path) -> String {
    let bound = TEST_BOUND.as_secs();
    let (log, results, tests) = (log.display(), results.display(), tests.display());
    let mut script = format!(
        "#!/bin/sh\n{env}\n: > {log}\n: > {results}\n{PRE_ARM}\
         echo \"vm-test: armed before the tests: $(grep -c . $T/kprobe_events) kprobe events, \
         $(grep -l 1 $T/events/*/*/enable | wc -l) events\" >> {log}\n"
    );
    for name in names {
        let _ = write!(
            script,
            "echo \"vm-test: ---- {name}\" >> {log}\n\
             setsid {tests} --exact {name} --include-ignored --test-threads 1 --nocapture >> {log} 2>&1 &\n\
             pid=$!; waited=0\n\
             while kill -0 $pid 2>/dev/null && [ $waited -lt {bound} ]; do sleep 1; waited=$((waited+1)); done\n\
             if kill -0 $pid 2>/dev/null; then\n\
             echo \"vm-test: {name} still running after {bound} s; the guest's processes:\" >> {log}\n\
             ps -eo pid,pgid,stat,etime,time,wchan:24,args >> {log}\n\
             for p in $(ps -o pid= --sid $pid); do echo \"-- kernel stack of $p\"; cat /proc/$p/stack; done >> {log} 2>&1\n\
             kill -9 -- -$pid; wait $pid; echo \"hung {name}\" >> {results}\n\
             else wait $pid; echo \"$? {name}\" >> {results}; fi\n"
        );
    }
    script
}

/// Which agent build the guests run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Build {
    /// The release agent (built for the purpose): what the counting test needs, since a
    /// debug build drains too slowly for an emulated CPU and loses events.
    Release,
    /// The debug agent the host tests already built: enough for the smoke part of
    /// `cargo xtask test`, and no release build on top of it.
    Debug,
    /// A binary given on the command line (an earlier release, to reproduce what it did).
    Given(PathBuf),
}

/// How QEMU runs the two vCPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tcg {
    /// One host thread runs both in turn: what the guests run by default (text patching
    /// is then seen whole by the other vCPU).
    Single,
    /// One host thread each (QEMU's own default): kernel text patched by one vCPU while the
    /// other runs it was seen executing the patch's transient int3 after the patch
    /// completed (issue 59, docs/design.md).
    Multi,
}

impl Tcg {
    /// Its QEMU option, as virtme-ng passes it on (`=` before a word that starts with a
    /// dash).
    fn qemu_opt(self) -> &'static str {
        match self {
            Tcg::Single => "--qemu-opts=tcg,thread=single",
            Tcg::Multi => "--qemu-opts=tcg,thread=multi",
        }
    }
}

/// The agent binary the guests run, and the folder their files go to (made empty).
fn agent_and_work(root: &Path, build: Build) -> anyhow::Result<(PathBuf, PathBuf)> {
    let fresh = || super::fresh_work(root, "vm-test");
    Ok(match build {
        Build::Release => super::release_agent(root, "vm-test")?,
        Build::Debug => {
            super::run(Command::new("cargo").current_dir(root).args([
                "build",
                "-q",
                "-p",
                "nccltrace",
            ]))?;
            (root.join("target/debug/nccltrace"), fresh()?)
        }
        Build::Given(path) => {
            let agent = std::fs::canonicalize(&path)
                .with_context(|| format!("the agent {} given to vm-test", path.display()))?;
            (agent, fresh()?)
        }
    })
}

/// Boots one guest per kernel and runs the guest tests (`filters`, or [`GUEST_TESTS`]).
pub fn run(
    root: &Path,
    kernels: &[&str],
    filters: &[String],
    build: Build,
    tcg: Tcg,
) -> anyhow::Result<Vec<Verdict>> {
    let bin = setup()?;
    let images: Vec<(String, PathBuf)> = kernels
        .iter()
        .map(|k| Ok(((*k).to_owned(), kernel(k)?)))
        .collect::<anyhow::Result<_>>()?;
    let (agent, work) = agent_and_work(root, build)?;
    let fixtures = super::build_fixtures(root)?;
    let speedscope = super::setup::speedscope()?;
    let real_nccl = super::setup::real_nccl()?;
    let tests = attach_tests(root)?;
    let filters: Vec<String> = if filters.is_empty() {
        GUEST_TESTS.iter().map(|s| (*s).to_owned()).collect()
    } else {
        filters.to_vec()
    };
    let names = test_names(&tests, &filters)?;
    let env = format!(
        "cd {root} && export NCCLTRACE_GUEST=1 NCCLTRACE_FIXTURES={fixtures} \
         NCCLTRACE_AGENT={agent} NCCLTRACE_SPEEDSCOPE={speedscope} NCCLTRACE_REAL_NCCL={real_nccl}",
        root = root.display(),
        fixtures = fixtures.display(),
        speedscope = speedscope.display(),
        real_nccl = real_nccl.display(),
        agent = agent.display(),
    );
    let guest = Guest {
        vng: bin.join("vng"),
        path: format!(
            "{}:{}:/usr/sbin:/sbin",
            bin.display(),
            std::env::var("PATH").unwrap_or_default()
        ),
        env,
        tests,
        work,
        tcg,
    };
    let mut verdicts = Vec::new();
    for (series, image) in images {
        let first = guest.boot(&series, &image, &names, &series)?;
        let mut summary = first.summary.clone();
        let mut passed = first.outcome.passed() && first.oops.is_none();
        first.tell_oops(&mut summary, "the guest's");
        // A guest that died between tests, or stopped making progress in one (the
        // emulated machine, not a test: its own bound would have reported a slow test),
        // without any test failing: a second guest runs what it did not finish. A test
        // that stalls that one too fails. Not after a kernel oops: the guest fails
        // whatever else it ran, and a second one would hide the crash.
        let retry: Vec<String> = first
            .outcome
            .stalled
            .iter()
            .chain(&first.outcome.not_run)
            .filter(|_| first.oops.is_none())
            .cloned()
            .collect();
        if first.outcome.failed.is_empty() && first.outcome.hung.is_empty() && !retry.is_empty() {
            let label = format!("{series}-again");
            let again = guest.boot(&series, &image, &retry, &label)?;
            passed = first.outcome.passed > 0 && again.outcome.passed() && again.oops.is_none();
            summary = format!(
                "{summary} (console: {}); a second guest ran the rest: {}",
                first.console.display(),
                again.summary
            );
            again.tell_oops(&mut summary, "its");
        }
        say(&format!("guest {series}"), &summary);
        verdicts.push(Verdict {
            kernel: series,
            passed,
            summary,
            log: first.log,
        });
    }
    Ok(verdicts)
}

/// How to boot a guest that runs the tests.
struct Guest {
    vng: PathBuf,
    path: String,
    env: String,
    tests: PathBuf,
    work: PathBuf,
    tcg: Tcg,
}

/// One guest's run.
struct Boot {
    outcome: Outcome,
    summary: String,
    log: PathBuf,
    console: PathBuf,
    /// The kernel's first oops or panic on the console, quoted.
    oops: Option<String>,
    console_err: PathBuf,
}

impl Guest {
    /// Boots `image` and runs `names`; its files are `guest-<label>.*` in the work folder.
    fn boot(
        &self,
        series: &str,
        image: &Path,
        names: &[String],
        label: &str,
    ) -> anyhow::Result<Boot> {
        let file = |ext: &str| self.work.join(format!("guest-{label}.{ext}"));
        let (log, results, script) = (file("log"), file("results"), file("sh"));
        std::fs::write(
            &script,
            guest_script(&self.env, &self.tests, names, &log, &results),
        )?;
        // The guest's console (kernel messages, virtme-ng's own) beside the tests' output.
        let (console, console_err) = (file("console"), file("console-stderr"));
        say(
            &format!("guest {label}"),
            &format!(
                "booting {series} (2 NUMA nodes, TCG), {} tests",
                names.len()
            ),
        );
        let started = Instant::now();
        let mut child = Command::new(&self.vng)
            .arg("--run")
            .arg(image)
            .args([
                "--disable-kvm",
                "--force-9p",
                "--verbose",
                "--cpus",
                "2",
                "--memory",
                "2G",
            ])
            .args(["--numa", "1G,cpus=0", "--numa", "1G,cpus=1"])
            // The TSC as the clock: 6.1 finds the emulated TSCs unsynchronized and falls
            // back to the HPET, whose every read is an MMIO exit that takes QEMU's global
            // lock; with both vCPUs reading the clock in loops (the trainer, the agent)
            // that is a suspect for the guests that stopped making progress.
            .args(["--append", GUEST_CLOCK])
            .arg("--rwdir")
            .arg(&self.work)
            .arg("--exec")
            .arg(format!("sh {}", script.display()))
            // One host thread runs both vCPUs in turn. With one thread each, the kernel's
            // text patching (a tracepoint's static key in __schedule, the fentry call in
            // handle_mm_fault, written while the other vCPU runs that code) sometimes left
            // that vCPU executing the transient int3 after the patch was done: "Oops: int3"
            // and a panic, in 4 of 9 boots of the 6.12 guest on 2026-12-04 (each QEMU word
            // its own --qemu-opts, `=` before one that starts with a dash).
            .args(["--qemu-opts=-accel", self.tcg.qemu_opt()])
            .env("PATH", &self.path)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&console)?)
            .stderr(std::fs::File::create(&console_err)?)
            // Its own process group: QEMU goes with it when it is killed.
            .process_group(0)
            .spawn()
            .context("starting vng")?;
        // The guest's own bound per test needs its clock and shell to run; an emulated
        // machine that stops making progress altogether (seen with 6.1 and 6.12: both
        // vCPUs busy, no test line, no kernel message) is stopped from here, when no test
        // has finished for a test's bound (the first after the boot's too).
        let done = || std::fs::read_to_string(&results).map_or(0, |r| r.lines().count());
        let (mut finished, mut progress) = (0, Instant::now());
        let mut stalled = false;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            std::thread::sleep(Duration::from_secs(1));
            let now = done();
            if now != finished {
                (finished, progress) = (now, Instant::now());
            }
            let allowed = TEST_BOUND
                + if finished == 0 {
                    BOOT_BOUND
                } else {
                    Duration::ZERO
                };
            if progress.elapsed() > allowed + Duration::from_secs(30) {
                stalled = true;
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &format!("-{}", child.id())])
                    .status();
                let _ = child.wait();
                break None;
            }
        };
        let took = started.elapsed().as_secs();
        let mut outcome = verdict(
            names,
            &std::fs::read_to_string(&results).unwrap_or_default(),
        );
        let summary = if stalled {
            // The test it was running: the first without a result.
            if !outcome.not_run.is_empty() {
                outcome.stalled.push(outcome.not_run.remove(0));
            }
            format!("{outcome}; the guest stopped making progress and was killed after {took} s")
        } else {
            format!(
                "{outcome} ({took} s, exit {:?})",
                status.and_then(|s| s.code())
            )
        };
        // virtme-ng writes the kernel's messages to its standard error, its own to its
        // standard output.
        let oops = [&console_err, &console]
            .iter()
            .find_map(|file| first_oops(&std::fs::read_to_string(file).unwrap_or_default()));
        Ok(Boot {
            outcome,
            summary,
            log,
            console,
            oops,
            console_err,
        })
    }
}

impl Boot {
    /// Adds the kernel's oops, if there was one, to `summary` (`whose` kernel).
    fn tell_oops(&self, summary: &mut String, whose: &str) {
        if let Some(oops) = &self.oops {
            let _ = write!(
                summary,
                "; {whose} kernel oopsed (console {}):\n{oops}",
                self.console_err.display()
            );
        }
    }
}

/// The first oops, BUG or panic the guest's kernel printed on its console, with the lines
/// after it that say where (registers, call trace), at most [`OOPS_LINES`].
fn first_oops(console: &str) -> Option<String> {
    let lines: Vec<&str> = console.lines().collect();
    let at = lines.iter().position(|l| {
        ["Oops:", "BUG:", "Kernel panic", "general protection fault"]
            .iter()
            .any(|mark| l.contains(mark))
    })?;
    Some(lines[at..lines.len().min(at + OOPS_LINES)].join("\n"))
}

/// How much of an oops is quoted.
const OOPS_LINES: usize = 30;

/// The tests of one guest, from its results file.
#[derive(Debug, Default, PartialEq)]
struct Outcome {
    passed: usize,
    failed: Vec<String>,
    hung: Vec<String>,
    /// Running when the whole guest stopped making progress (killed from the host).
    stalled: Vec<String>,
    not_run: Vec<String>,
}

impl Outcome {
    fn passed(&self) -> bool {
        self.passed > 0
            && self.failed.is_empty()
            && self.hung.is_empty()
            && self.stalled.is_empty()
            && self.not_run.is_empty()
    }
}

impl std::fmt::Display for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} passed", self.passed)?;
        for (what, names) in [
            ("failed", &self.failed),
            ("hung", &self.hung),
            ("stalled the guest", &self.stalled),
            ("not run", &self.not_run),
        ] {
            if !names.is_empty() {
                write!(f, ", {} {what} ({})", names.len(), names.join(", "))?;
            }
        }
        Ok(())
    }
}

fn verdict(names: &[String], results: &str) -> Outcome {
    let mut outcome = Outcome::default();
    for name in names {
        let status = results
            .lines()
            .filter_map(|l| l.split_once(' '))
            .find(|(_, n)| n == name)
            .map(|(s, _)| s);
        match status {
            Some("0") => outcome.passed += 1,
            Some("hung") => outcome.hung.push(name.clone()),
            Some(_) => outcome.failed.push(name.clone()),
            None => outcome.not_run.push(name.clone()),
        }
    }
    outcome
}

/// `cargo xtask vm-test`: every chosen kernel, the logs of failures printed, a verdict.
pub fn task(
    root: &Path,
    kernel: &str,
    filters: &[String],
    build: Build,
    tcg: Tcg,
) -> anyhow::Result<()> {
    let kernels: Vec<&str> = if kernel == "all" {
        KERNELS.iter().map(|k| k.0).collect()
    } else {
        vec![kernel]
    };
    let verdicts = run(root, &kernels, filters, build, tcg)?;
    report(&verdicts)
}

/// Prints the log of each failed guest and a line per guest; fails if any failed.
pub fn report(verdicts: &[Verdict]) -> anyhow::Result<()> {
    for v in verdicts.iter().filter(|v| !v.passed) {
        eprintln!("----- guest {} ({}) -----", v.kernel, v.log.display());
        eprintln!("{}", std::fs::read_to_string(&v.log).unwrap_or_default());
        for console in ["console", "console-stderr"] {
            let text = std::fs::read_to_string(v.log.with_extension(console)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("----- guest {} {console}, last lines -----", v.kernel);
            for line in tail.iter().rev() {
                eprintln!("{line}");
            }
        }
    }
    for v in verdicts {
        eprintln!(
            "vm-test: kernel {:<5} {} — {}",
            v.kernel,
            if v.passed { "PASS" } else { "FAIL" },
            v.summary
        );
    }
    if verdicts.iter().any(|v| !v.passed) {
        bail!("guest tests failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests;
