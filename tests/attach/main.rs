//! Privileged integration tests: the real agent binary loads and attaches its eBPF
//! programs to fixture processes built from C source, and its outputs are compared with
//! what the processes say they did. Run as root (`cargo xtask test`, which passes
//! `--include-ignored`), one at a time; a plain `cargo test` as a normal user skips them
//! (they are `#[ignore]`d with the reason) and runs the unit and replay tests.
//!
//! This file is the harness (fixtures, the agent as a child process, shared checks); the
//! tests are split by feature into the modules below.

mod bad_input;
mod checks;
mod cost;
mod counts;
mod deploy;
mod environment;
mod gpu;
mod guest;
mod lifecycle;
mod merge;
mod metrics;
mod python;
mod steps;
mod symbols;
mod targets;

use std::io::{BufRead as _, BufReader, Lines};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, ChildStdout, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;

use checks::*;
use cost::programs_accounted;
use counts::default_profile_with;

/// Privileged tests share the kernel's probes and the CPUs: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// A JSON file the agent wrote.
fn json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap())
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn fixtures() -> PathBuf {
    if let Some(dir) = std::env::var_os("NCCLTRACE_FIXTURES") {
        return PathBuf::from(dir);
    }
    let out = workspace().join("target/fixtures");
    let status = Command::new("make")
        .arg("-s")
        .arg("-C")
        .arg(workspace().join("tests/fixtures"))
        .arg(format!("OUT={}", out.display()))
        .status()
        .expect("make");
    assert!(status.success(), "building the C fixtures failed");
    out
}

/// The agent under test: this build's, or `NCCLTRACE_AGENT` (`cargo xtask vm-test` runs
/// the release agent in its emulated guests, where a debug build drains too slowly).
fn agent() -> Command {
    Command::new(std::env::var_os("NCCLTRACE_AGENT").map_or_else(
        || PathBuf::from(env!("CARGO_BIN_EXE_nccltrace")),
        PathBuf::from,
    ))
}

/// The lock every privileged test holds, after checking it runs as root.
fn privileged() -> std::sync::MutexGuard<'static, ()> {
    let guard = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    require_root();
    kill_leftover_fixtures();
    guard
}

/// Kills the fixtures an earlier test of this process started and left behind when it
/// failed: one left waiting for its go-file was found by a later test attaching with
/// `--all`, which then waited for it (seen: one failed test hung the suite).
fn kill_leftover_fixtures() {
    let me = std::process::id();
    let fixtures = fixtures();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        // The parent pid is the second field after the command name's closing parenthesis.
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        let exe = std::fs::read_link(entry.path().join("exe")).unwrap_or_default();
        if parent == Some(me) && exe.starts_with(&fixtures) {
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
        }
    }
}

fn require_root() {
    let uid = unsafe { libc::geteuid() };
    assert_eq!(
        uid, 0,
        "these tests load eBPF programs for real: run them as root (cargo xtask test)"
    );
}

/// `nccltrace` run as user nobody with no capabilities (util-linux's setpriv).
fn as_nobody() -> Command {
    let mut cmd = Command::new("setpriv");
    cmd.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
    ])
    .arg(env!("CARGO_BIN_EXE_nccltrace"));
    cmd
}

/// A temporary folder every user may write in (for runs as nobody).
fn open_to_all() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        dir.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o777),
    )
    .unwrap();
    dir
}

/// A fixture process that waits for a go-file before doing its work.
struct Target {
    child: Child,
    stdout: Lines<BufReader<ChildStdout>>,
    go: PathBuf,
}

impl Target {
    fn spawn(program: &Path, args: &[&str], env: &[(&str, &str)], dir: &Path) -> Target {
        let go = dir.join("go");
        let mut cmd = Command::new(program);
        cmd.args(args).stdout(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn fixture");
        let mut stdout = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = stdout.next().expect("fixture output").unwrap();
        assert!(first.contains("ready"), "fixture said {first}");
        Target { child, stdout, go }
    }

    fn release(&self) {
        std::fs::write(&self.go, b"").unwrap();
    }

    /// The last JSON line the fixture printed, after it exits.
    fn finish(mut self) -> Value {
        let last = self
            .stdout
            .by_ref()
            .map_while(Result::ok)
            .last()
            .unwrap_or_default();
        assert!(self.child.wait().unwrap().success());
        serde_json::from_str(&last).unwrap_or_else(|e| panic!("fixture printed {last:?}: {e}"))
    }
}

/// Three ranks of one job, waiting for `dir/go`: the stand-in's collectives complete only
/// when all three have arrived (shared memory named by the returned string, to remove
/// after), rank 1 sleeps 3 ms a step, ranks given by `RANK`.
fn straggler_job(dir: &Path, steps: &str, extra: &[&str]) -> (Vec<Target>, String) {
    straggler_job_named(dir, steps, extra, "", &[])
}

/// As [`straggler_job`], the job's shared memory named with `tag` (jobs started beside
/// each other need their own) and `env` set in every rank's environment.
fn straggler_job_named(
    dir: &Path,
    steps: &str,
    extra: &[&str],
    tag: &str,
    env: &[(&str, &str)],
) -> (Vec<Target>, String) {
    straggler_job_late(dir, steps, extra, tag, env, "3000")
}

/// As [`straggler_job_named`], rank 1 sleeping `late_us` a step.
fn straggler_job_late(
    dir: &Path,
    steps: &str,
    extra: &[&str],
    tag: &str,
    env: &[(&str, &str)],
    late_us: &str,
) -> (Vec<Target>, String) {
    let go = dir.join("go");
    let shm = format!("/nccltrace-test-{}-{steps}{tag}", std::process::id());
    let mut trainers = Vec::new();
    for rank in 0..3 {
        let rank_s = rank.to_string();
        let mut args = vec!["--steps", steps, "--compute-us", "1000", "--no-migrate"];
        args.extend(["--go-file", go.to_str().unwrap()]);
        args.extend(extra);
        if rank == 1 {
            args.extend(["--step-sleep-us", late_us]);
        }
        let mut all = vec![
            ("FAKE_NCCL_WORLD", "3"),
            ("FAKE_NCCL_RANK", rank_s.as_str()),
            ("FAKE_NCCL_SHM", shm.as_str()),
            ("RANK", rank_s.as_str()),
            ("FAKE_NCCL_US", "100"),
            ("FAKE_NCCL_UID", shm.as_str()),
        ];
        all.extend(env);
        trainers.push(Target::spawn(&fixtures().join("trainer"), &args, &all, dir));
    }
    (trainers, shm)
}

/// A running `nccltrace attach`, after it said it attached.
struct Agent {
    child: Child,
    stderr: Lines<BufReader<ChildStderr>>,
    /// What it prints on stdout, read as it comes (so a long table never blocks it).
    stdout: std::thread::JoinHandle<String>,
    out: PathBuf,
    /// Its "attached to pid" line, and what it said before.
    attached: String,
    before: Vec<String>,
}

impl Agent {
    fn attach(pid: u32, out: &Path, extra: &[&str]) -> Agent {
        Agent::attach_many(&[pid], out, extra)
    }

    fn attach_many(pids: &[u32], out: &Path, extra: &[&str]) -> Agent {
        Agent::attach_env(pids, out, extra, &[])
    }

    /// As `attach_many`, with variables set in the agent's environment.
    fn attach_env(pids: &[u32], out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Agent {
        let pids: Vec<String> = pids.iter().map(u32::to_string).collect();
        let mut child = agent();
        child.arg("attach").envs(env.iter().copied());
        if !pids.is_empty() {
            child.args(["--pid", &pids.join(",")]);
        }
        let mut child = child
            .arg("--out")
            .arg(out)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn nccltrace");
        let mut pipe = child.stdout.take().unwrap();
        let stdout = std::thread::spawn(move || {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut pipe, &mut text);
            text
        });
        let mut stderr = BufReader::new(child.stderr.take().unwrap()).lines();
        let started = Instant::now();
        let mut said = Vec::new();
        loop {
            let Some(Ok(line)) = stderr.next() else {
                let status = child.wait().unwrap();
                panic!("nccltrace exited before attaching ({status}): {said:?}");
            };
            said.push(line.clone());
            if line.contains("attached to pid") {
                break;
            }
            assert!(!line.contains("error"), "nccltrace: {line}");
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "attach took over 60 s"
            );
        }
        let attached = said.pop().unwrap_or_default();
        Agent {
            child,
            stderr,
            stdout,
            out: out.to_owned(),
            attached,
            before: said,
        }
    }

    /// Waits (at most `limit`) for the agent to exit by itself; returns its summary.
    fn wait(self, limit: Duration) -> (i32, Value, String) {
        let out = self.out.clone();
        let (code, _, stderr) = self.wait_for_exit(limit);
        let summary = std::fs::read_to_string(out.join("summary.json"))
            .unwrap_or_else(|e| panic!("no summary.json ({e}); stderr: {stderr}"));
        (code, serde_json::from_str(&summary).unwrap(), stderr)
    }

    /// Waits (at most `limit`) for the agent to exit by itself; returns its exit code,
    /// stdout and stderr.
    fn wait_for_exit(mut self, limit: Duration) -> (i32, String, String) {
        let started = Instant::now();
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > limit {
                let _ = self.child.kill();
                panic!("nccltrace did not exit within {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let stderr: Vec<String> = self.stderr.map_while(Result::ok).collect();
        (
            status.code().unwrap_or(-1),
            self.stdout.join().unwrap_or_default(),
            stderr.join("\n"),
        )
    }
}

/// The trainer with `args` (and `env`) traced with the software stand-in for the PMU's
/// node-load counters (`NCCLTRACE_NODE_COUNTERS=software-faults`); the agent's summary,
/// steps.json, the outputs' folder and the folder that holds it.
fn trainer_counting_loads(
    args: &[&str],
    env: &[(&str, &str)],
) -> (Value, Value, PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let mut all = args.to_vec();
    all.extend(["--go-file", go.to_str().unwrap()]);
    let mut trainer = Target::spawn(&fixtures().join("trainer"), &all, env, dir.path());
    let out = dir.path().join("out");
    let agent = Agent::attach_env(
        &[trainer.child.id()],
        &out,
        &[],
        &[("NCCLTRACE_NODE_COUNTERS", "software-faults")],
    );
    trainer.release();
    for _ in trainer.stdout.by_ref() {}
    assert!(trainer.child.wait().unwrap().success());
    let (code, summary, stderr) = agent.wait(Duration::from_secs(120));
    assert_eq!(code, 0, "nccltrace failed: {stderr}");
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    (summary, steps, out, dir)
}

/// Runs `nccltrace report` on `out/recording.nctr` into `dir/again`; returns that folder.
fn report(out: &Path, dir: &Path) -> PathBuf {
    let again = dir.join("again");
    let status = agent()
        .arg("report")
        .arg(out.join("recording.nctr"))
        .arg("--out")
        .arg(&again)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());
    again
}

/// No program of the agent is left once it has exited. The kernel frees a program whose
/// last link was a uprobe-multi one after an RCU grace period, after the process is gone:
/// up to two seconds are allowed for that.
fn no_programs_left() {
    let names = [
        "uprobe_lib_call",
        "uretprobe_lib_c",
        "tracepoint_sche",
        "tracepoint_page",
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    loop {
        let out = Command::new("bpftool")
            .args(["prog", "show"])
            .output()
            .expect("bpftool");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let left: Vec<&str> = names.into_iter().filter(|n| text.contains(n)).collect();
        if left.is_empty() {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "programs {left:?} still loaded 2 s after exit:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Trains `steps` steps with the stand-in NCCL and CUDA, attached from the first step.
fn traced_trainer(steps: u32, env: &[(&str, &str)]) -> (Value, Value, PathBuf, tempfile::TempDir) {
    let (truth, summary, out, dir, _) = traced_trainer_with(
        steps,
        env,
        &["--compute-us", "500", "--fault-pages", "512"],
        &[],
    );
    (truth, summary, out, dir)
}

/// As `traced_trainer`, with extra trainer and agent arguments; also returns the
/// trainer's per-step lines.
fn traced_trainer_with(
    steps: u32,
    env: &[(&str, &str)],
    trainer_args: &[&str],
    agent_args: &[&str],
) -> (Value, Value, PathBuf, tempfile::TempDir, Vec<Value>) {
    let (truth, summary, out, dir, lines, _) =
        traced_trainer_said(steps, env, trainer_args, agent_args);
    (truth, summary, out, dir, lines)
}

/// As `traced_trainer_with`, also returning what the agent said on stderr.
fn traced_trainer_said(
    steps: u32,
    env: &[(&str, &str)],
    trainer_args: &[&str],
    agent_args: &[&str],
) -> (Value, Value, PathBuf, tempfile::TempDir, Vec<Value>, String) {
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let steps_s = steps.to_string();
    let mut args = vec!["--steps", &steps_s, "--go-file", go.to_str().unwrap()];
    args.extend_from_slice(trainer_args);
    let trainer = Target::spawn(&fixtures().join("trainer"), &args, env, dir.path());
    let out = dir.path().join("out");
    let agent = Agent::attach(trainer.child.id(), &out, agent_args);
    trainer.release();
    let (lines, truth) = steps_and_totals(trainer);
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    assert_eq!(code, 0, "nccltrace failed: {stderr}");
    (truth, summary, out, dir, lines, stderr)
}

/// Attaches to a trainer that would run for a long time, lets `stop` end the agent's run
/// (or not), kills the trainer, and returns the agent's exit code and summary.
fn traced_long_run(agent_args: &[&str], stop: impl FnOnce(&Agent, u32)) -> (i32, Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let go = go.to_str().unwrap();
    let args = ["--steps", "100000", "--compute-us", "200", "--go-file", go];
    let mut trainer = Target::spawn(&fixtures().join("trainer"), &args, &[], dir.path());
    trainer.release();
    let agent = Agent::attach(trainer.child.id(), &dir.path().join("out"), agent_args);
    stop(&agent, trainer.child.id());
    let result = agent.wait(Duration::from_secs(30));
    let _ = trainer.child.kill();
    let _ = trainer.child.wait();
    result
}

/// The files every complete run writes.
const OUTPUTS: [&str; 7] = [
    "recording.nctr",
    "summary.json",
    "steps.json",
    "steps.csv",
    "trace.json",
    "doctor.json",
    "flamegraph-attributed.svg",
];

/// The real libnccl.so.2 of the nvidia-nccl-cu12 wheel (`NCCLTRACE_REAL_NCCL`).
fn real_nccl() -> PathBuf {
    std::env::var_os("NCCLTRACE_REAL_NCCL")
        .map(PathBuf::from)
        .expect(
            "NCCLTRACE_REAL_NCCL is not set: run `cargo xtask test`, which downloads the \
             nvidia-nccl-cu12 wheel once and points this test at its libnccl.so.2",
        )
}

/// `nccl_caller` making `n` ncclAllReduce calls into `lib` once released, its go file in
/// `dir`.
fn nccl_caller(lib: &Path, n: u64, dir: &Path) -> Target {
    let go = dir.join("go");
    Target::spawn(
        &fixtures().join("nccl_caller"),
        &[lib.to_str().unwrap(), &n.to_string(), go.to_str().unwrap()],
        &[],
        dir,
    )
}

/// The trainer's step lines and its totals, once it exited.
fn steps_and_totals(mut t: Target) -> (Vec<Value>, Value) {
    let lines: Vec<Value> = t
        .stdout
        .by_ref()
        .map_while(Result::ok)
        .map(|l| serde_json::from_str(&l).unwrap())
        .collect();
    assert!(t.child.wait().unwrap().success());
    let (totals, steps) = lines.split_last().unwrap();
    (steps.to_vec(), totals["total"].clone())
}

/// Releases `trainer` and reads its line a step as it comes, on a thread (the count of
/// lines when joined): with the pipe full (64 KiB, about 240 of its lines) it would block
/// in write() while traced.
fn released_and_drained(trainer: Target) -> (Child, std::thread::JoinHandle<usize>) {
    trainer.release();
    let Target { child, stdout, .. } = trainer;
    (
        child,
        std::thread::spawn(move || stdout.map_while(Result::ok).count()),
    )
}

/// The demo trainer for `steps` steps of `compute_us`, waiting for `dir/go` to start.
fn waiting_trainer(dir: &Path, steps: u32, compute_us: u32) -> Target {
    let go = dir.join("go");
    Target::spawn(
        &fixtures().join("trainer"),
        &[
            "--steps",
            &steps.to_string(),
            "--compute-us",
            &compute_us.to_string(),
            "--go-file",
            go.to_str().unwrap(),
        ],
        &[],
        dir,
    )
}

/// `nccltrace attach EXTRA` on a trainer waiting to start (in `dir`, created), which is
/// then released: the agent's output.
fn refused_attach(dir: &Path, extra: &[&str]) -> std::process::Output {
    std::fs::create_dir_all(dir).unwrap();
    let go = dir.join("go");
    let mut trainer = Target::spawn(
        &fixtures().join("trainer"),
        &["--steps", "1", "--go-file", go.to_str().unwrap()],
        &[],
        dir,
    );
    let out = agent()
        .arg("attach")
        .args(extra)
        .arg("--pid")
        .arg(trainer.child.id().to_string())
        .arg("--out")
        .arg(dir.join("out"))
        .output()
        .unwrap();
    trainer.release();
    let _ = trainer.child.wait();
    out
}

/// Runs `nccltrace ARGS` in `dir`: exit code 2 and `expected` in the message.
fn refused_with(dir: &Path, args: &[String], expected: &str) {
    let out = agent().current_dir(dir).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
    assert!(stderr.contains(expected), "{args:?}: {stderr}");
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Running inside a QEMU guest of `cargo xtask vm-test` (emulated, ~17× slower).
fn in_a_guest() -> bool {
    std::env::var_os("NCCLTRACE_GUEST").is_some()
}

/// Unmounts on drop.
struct Unmount<'a>(&'a Path);

impl Drop for Unmount<'_> {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0).status();
    }
}
