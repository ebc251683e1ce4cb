//! Python frames: a CPython rank started without any perf flag, attached while it runs,
//! its stacks naming the functions and lines that called NCCL and waited.

use super::*;

/// The line of `tests/fixtures/py_rank.py` marked `MARK:name`.
fn marked_line(name: &str) -> usize {
    marked_line_of("py_rank.py", name)
}

/// The line of `tests/fixtures/FILE` marked `MARK:name`.
fn marked_line_of(file: &str, name: &str) -> usize {
    let text = std::fs::read_to_string(workspace().join("tests/fixtures").join(file)).unwrap();
    let mark = format!("# MARK:{name}");
    text.lines()
        .position(|l| l.trim_end().ends_with(&mark))
        .unwrap_or_else(|| panic!("no {mark} in {file}"))
        + 1
}

/// The stand-in Python rank run by `python` (under the command `wrap`, when not empty),
/// waiting for `dir/go`.
fn python_rank(
    wrap: &[&str],
    python: &Path,
    dir: &Path,
    steps: u32,
    env: &[(&str, &str)],
) -> Target {
    let go = dir.join("go");
    let script = workspace().join("tests/fixtures/py_rank.py");
    let (fixtures, steps) = (fixtures(), steps.to_string());
    let mut args: Vec<&str> = wrap.iter().skip(1).copied().collect();
    if !wrap.is_empty() {
        args.push(python.to_str().unwrap());
    }
    args.extend([
        script.to_str().unwrap(),
        fixtures.to_str().unwrap(),
        &steps,
        go.to_str().unwrap(),
    ]);
    let program = wrap.first().map_or(python, |w| Path::new(*w));
    // 3 ms of "GPU work" per collective: the sync waits for it.
    let mut all = vec![("FAKE_NCCL_US", "3000")];
    all.extend(env);
    Target::spawn(program, &args, &all, dir)
}

/// CPython interpreters on this machine, by minor version: Debian's python3.11 (a static
/// executable, `cargo xtask setup` installs it) and those pyenv keeps (shared libpython).
fn interpreters() -> Vec<(u32, PathBuf)> {
    let mut found = vec![(11, PathBuf::from("/usr/bin/python3.11"))];
    let root =
        std::env::var_os("PYENV_ROOT").map_or_else(|| PathBuf::from("/root/.pyenv"), PathBuf::from);
    if let Ok(dir) = std::fs::read_dir(root.join("versions")) {
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let python = entry.path().join("bin/python3");
            if let Some(minor) = name
                .strip_prefix("3.")
                .and_then(|r| r.split('.').next()?.parse().ok())
                && python.exists()
            {
                found.push((minor, python));
            }
        }
    }
    found.sort();
    found
}

/// Attaches for 3 s to the stand-in rank run by `python`: (exit code, summary, all it
/// said on stderr, outputs folder), with the folder kept in `dir`.
pub(crate) fn traced_python_rank(python: &Path, dir: &Path) -> (i32, Value, String, PathBuf) {
    traced_wrapped_rank(&[], python, dir)
}

/// [`traced_python_rank`] with the rank started under `wrap` (the rank is its only child).
fn traced_wrapped_rank(wrap: &[&str], python: &Path, dir: &Path) -> (i32, Value, String, PathBuf) {
    traced_rank_with(wrap, python, dir, &[], &[])
}

/// [`traced_wrapped_rank`] with `args` added to the attach command and `env` to the
/// rank's.
pub(crate) fn traced_rank_with(
    wrap: &[&str],
    python: &Path,
    dir: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> (i32, Value, String, PathBuf) {
    let mut rank = python_rank(wrap, python, dir, 100_000, env);
    rank.release();
    std::thread::sleep(Duration::from_millis(300));
    let out = dir.join("out");
    let id = rank.child.id();
    let pid = if wrap.is_empty() {
        id
    } else {
        let children = std::fs::read_to_string(format!("/proc/{id}/task/{id}/children")).unwrap();
        children.split_whitespace().next().unwrap().parse().unwrap()
    };
    // Killed however this ends: a rank left running would be found by other tests' `--all`.
    let guard = KillOnDrop(pid);
    let mut all = vec!["--duration", "3s"];
    all.extend(args);
    let agent = Agent::attach(pid, &out, &all);
    // What it said up to attaching, then after.
    let said = [agent.before.join("\n"), agent.attached.clone()].join("\n");
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    let stderr = format!("{said}\n{stderr}");
    drop(guard);
    let _ = rank.child.kill();
    let _ = rank.child.wait();
    (code, summary, stderr, out)
}

/// Kills a process when dropped (a panic included). Under `unshare --fork` the rank
/// outlives its parent, so the rank itself is killed.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: a signal to a process this test started.
        unsafe { libc::kill(self.0 as i32, libc::SIGKILL) };
    }
}

/// The folded lines of `out/flamegraph-NAME.folded` with their weights.
fn folded(out: &Path, name: &str) -> Vec<(String, u64)> {
    std::fs::read_to_string(out.join(format!("flamegraph-{name}.folded")))
        .unwrap()
        .lines()
        .filter_map(|l| {
            let (stack, w) = l.rsplit_once(' ')?;
            Some((stack.to_owned(), w.parse().ok()?))
        })
        .collect()
}

/// Share of the weight of `lines` whose stack has every frame of `frames`, in order.
fn share_with(lines: &[(String, u64)], frames: &[String]) -> f64 {
    let total: u64 = lines.iter().map(|(_, w)| w).sum();
    let with: u64 = lines
        .iter()
        .filter(|(s, _)| {
            let mut rest = s.as_str();
            frames.iter().all(|f| match rest.find(f.as_str()) {
                Some(i) => {
                    rest = &rest[i + f.len()..];
                    true
                }
                None => false,
            })
        })
        .map(|(_, w)| w)
        .sum();
    if total == 0 {
        0.0
    } else {
        with as f64 / total as f64
    }
}

/// Issue 21: attached to a running CPython started without a perf flag (Debian's 3.11,
/// and every 3.10–3.13 pyenv keeps here), the nccl-wait flamegraph names the Python
/// function and line that waited (`wait_for_gpu (py_rank.py:N)` under
/// `train_step (py_rank.py:M)`), the on-CPU graph names the busy loop, the summary says
/// which interpreter was found, and `report` names the same frames from the recording
/// alone.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn python_frames_name_the_lines_that_wait() {
    let _serial = privileged();
    let supported: Vec<(u32, PathBuf)> = interpreters()
        .into_iter()
        .filter(|(minor, _)| (10..=13).contains(minor))
        .collect();
    println!("interpreters: {supported:?}");
    for (minor, python) in &supported {
        let dir = tempfile::tempdir().unwrap();
        let (code, summary, stderr, out) = traced_python_rank(python, dir.path());
        assert_eq!(code, 0, "{}: {stderr}", python.display());
        let target = &summary["targets"][0];
        assert!(
            target["python"]["version"]
                .as_str()
                .unwrap()
                .starts_with(&format!("3.{minor}")),
            "{target}"
        );
        assert_eq!(target["python"]["frames"], true, "{target}");
        let walked = target["python_stacks"].as_u64().unwrap();
        assert!(walked > 100, "{target}");
        // The default profile reuses the Python frames of a thread blocked where it was
        // last time (`reuse_stacks`): the rank syncs from the same line every step. The
        // lines checked below are drawn from them.
        let reused = target["python_stacks_reused"].as_u64().unwrap();
        assert!(
            reused * 2 > walked,
            "{reused} of {walked} Python stacks reused"
        );
        assert_eq!(summary["stacks_reused_unresolved"], 0, "{summary}");
        assert_eq!(
            summary["agent"]["python_walk"], "bpf_loop callback",
            "{}",
            summary["agent"]
        );
        check_python_frames(&out, python);
        // From the recording alone, as on another machine after the rank has exited.
        check_python_frames(&report(&out, dir.path()), python);
    }
}

/// Issue 22: the Python frames walked by the unrolled loop that kernels before 5.17 get
/// (forced here by the profile) name the same lines as the `bpf_loop` walk, for CPython
/// 3.11 (entry flags) and 3.12 (shim frames) where pyenv has it, and the summary says
/// which walk ran.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn python_frames_walked_by_the_unrolled_loop() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let profile = default_profile_with(
        dir.path(),
        "unrolled.toml",
        &[("python_loop = true", "python_loop = false")],
    );
    let chosen: Vec<(u32, PathBuf)> = interpreters()
        .into_iter()
        .filter(|(minor, python)| {
            *minor == 12 || python.as_path() == Path::new("/usr/bin/python3.11")
        })
        .collect();
    assert!(!chosen.is_empty(), "no CPython 3.11 or 3.12 here");
    for (_, python) in &chosen {
        let run = tempfile::tempdir().unwrap();
        let (code, summary, stderr, out) = traced_rank_with(
            &[],
            python,
            run.path(),
            &["--profile", profile.to_str().unwrap()],
            &[],
        );
        assert_eq!(code, 0, "{}: {stderr}", python.display());
        assert_eq!(
            summary["agent"]["python_walk"], "unrolled loop (profile python_loop = false)",
            "{}",
            summary["agent"]
        );
        let target = &summary["targets"][0];
        assert!(target["python_stacks"].as_u64().unwrap() > 100, "{target}");
        check_python_frames(&out, python);
    }
}

/// A rank that enters its sync at one line and leaves the CPU at another (it spins in
/// the sync and sleeps after it, as a DDP rank blocks in backward()): its call-entry and
/// off-CPU stacks keep a Python walk each, so both are reused from step to step. With
/// one walk kept a thread, each replaced the other and none was reused.
#[test]
#[ignore = "needs root: cargo xtask test"]
fn python_frames_reused_by_stack_kind() {
    let _serial = privileged();
    let python = Path::new("/usr/bin/python3.11");
    let dir = tempfile::tempdir().unwrap();
    let (code, summary, stderr, out) = traced_rank_with(
        &[],
        python,
        dir.path(),
        &[],
        &[("FAKE_CUDA_SPIN", "1"), ("PY_RANK_NAP", "1")],
    );
    assert_eq!(code, 0, "{stderr}");
    // Every sync's entry after the first of each second reuses the walk of the one
    // before (with one walk kept, the nap in between had replaced it: 14-16 of ~1,360
    // stacks were reused, against ~1,050 now, 2026-12-06). Preemptions, frequent on a
    // 2-vCPU machine, take walks of their own.
    let target = &summary["targets"][0];
    let walked = target["python_stacks"].as_u64().unwrap();
    let reused = target["python_stacks_reused"].as_u64().unwrap();
    let calls = summary["call_stacks"].as_u64().unwrap();
    assert!(calls > 100, "{summary}");
    assert!(
        reused * 10 >= calls * 9,
        "{reused} of {walked} Python stacks reused, {calls} sync entries"
    );
    assert_eq!(summary["stacks_reused_unresolved"], 0, "{summary}");
    // The reused frames are the right ones: the main thread's sleeps name the nap's line,
    // none the sync's (where its call-entry stacks are).
    let nap = format!("train_step (py_rank.py:{})", marked_line("nap"));
    let slept: Vec<(String, u64)> = folded(&out, "offcpu")
        .into_iter()
        .filter(|(l, _)| l.contains("(main (rank))") && l.contains("clock_nanosleep"))
        .collect();
    let named: u64 = slept
        .iter()
        .filter(|(l, _)| l.contains(&nap))
        .map(|(_, w)| w)
        .sum();
    let all: u64 = slept.iter().map(|(_, w)| w).sum();
    assert!(
        all > 0 && named == all,
        "{named} of {all} µs of sleep at {nap}: {slept:?}"
    );
}

/// The frames `python_frames_name_the_lines_that_wait` expects in `out`'s flamegraphs.
pub(crate) fn check_python_frames(out: &Path, python: &Path) {
    let at = |func: &str, mark: &str| format!("{func} (py_rank.py:{})", marked_line(mark));
    let waited = [
        at("<module>", "loop"),
        at("train_step", "step_sync"),
        at("wait_for_gpu", "sync"),
        "cuStreamSynchronize".to_owned(),
    ];
    let wait = folded(out, "nccl-wait");
    let share = share_with(&wait, &waited);
    assert!(
        share > 0.8,
        "{}: {:.0}% of the NCCL wait is drawn at {waited:?}:\n{wait:?}",
        python.display(),
        share * 100.0
    );
    // steps.json: the rank thread's heaviest wait stack ends in that line (gpu_wait: the
    // script's communicator has one rank).
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    let top = steps["gpu_wait_top_stacks"][0]["stack"]
        .as_str()
        .unwrap_or_default();
    assert!(
        top.contains(&waited[2]),
        "{}: top NCCL wait stack {top:?}",
        python.display()
    );
    // trace.json: the sync calls' slices say which Python line made them.
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let syncs: Vec<&Value> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["name"] == "cuStreamSynchronize" && e["ph"] == "X")
        .collect();
    let named = syncs
        .iter()
        .filter(|e| e["args"]["python"] == waited[2].as_str())
        .count();
    eprintln!(
        "{}: {named} of {} sync slices name {}",
        python.display(),
        syncs.len(),
        waited[2]
    );
    assert!(
        syncs.len() > 50 && named * 100 >= syncs.len() * 99,
        "{}: {named} of {} sync slices name {}",
        python.display(),
        syncs.len(),
        waited[2]
    );
    let oncpu = folded(out, "oncpu");
    // The busy loop's samples fall on its two lines: the function and file suffice.
    let compute = [at("<module>", "loop"), "compute (py_rank.py:".to_owned()];
    // The thread that started a second after attach: named from the next refresh on.
    assert!(
        oncpu
            .iter()
            .any(|(s, _)| s.contains(&at("worker_loop", "worker"))),
        "{}: no on-CPU sample of the later thread named {}:\n{oncpu:?}",
        python.display(),
        at("worker_loop", "worker")
    );
    let share = share_with(&oncpu, &compute);
    assert!(
        share > 0.3,
        "{}: {:.0}% of on-CPU samples at {compute:?}:\n{oncpu:?}",
        python.display(),
        share * 100.0
    );
}

/// Issue 21: a CPython whose frame layout this build does not know (3.9 and older here)
/// is said once, with the reason, in the output and summary.json, and its stacks stay
/// native: no Python frame is made up.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn unknown_python_keeps_native_stacks_and_says_why() {
    let _serial = privileged();
    let (minor, python) = interpreters()
        .into_iter()
        .rfind(|(minor, _)| *minor < 10)
        .expect("a CPython older than 3.10 (pyenv's 3.9 on these machines)");
    let dir = tempfile::tempdir().unwrap();
    let (code, summary, stderr, out) = traced_python_rank(&python, dir.path());
    assert_eq!(code, 0, "{stderr}");
    let target = &summary["targets"][0];
    assert_eq!(target["python"]["frames"], false, "{target}");
    let note = target["python"]["note"].as_str().unwrap();
    assert!(
        note.contains(&format!("CPython 3.{minor}")) && note.contains("stacks stay native"),
        "{note}"
    );
    assert_eq!(target["python_stacks"], 0, "{target}");
    assert_eq!(
        stderr.matches("frame layout is not known").count(),
        1,
        "{stderr}"
    );
    let wait = folded(&out, "nccl-wait");
    assert!(
        wait.iter().any(|(s, _)| s.contains("cuStreamSynchronize")),
        "{wait:?}"
    );
    assert!(
        wait.iter().all(|(s, _)| !s.contains("py_rank.py")),
        "a Python frame from an unknown layout: {wait:?}"
    );
}

/// Issue 21: a rank in a PID namespace of its own (a container: `unshare --pid`, where the
/// interpreter is pid 1 and keeps that namespace's thread ids) gets its Python frames
/// named like any other: thread ids are translated through `NSpid`.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn python_frames_in_a_pid_namespace() {
    let _serial = privileged();
    let python = Path::new("/usr/bin/python3.11");
    let dir = tempfile::tempdir().unwrap();
    let wrap = ["unshare", "--pid", "--fork", "--mount-proc"];
    let (code, summary, stderr, out) = traced_wrapped_rank(&wrap, python, dir.path());
    assert_eq!(code, 0, "{stderr}");
    let target = &summary["targets"][0];
    assert_eq!(target["python"]["frames"], true, "{target}");
    check_python_frames(&out, python);
}

/// Issue 21: DataLoader-like workers are processes of their own (forked from the rank, so
/// they map its libraries): `attach --all` traces them beside the rank, each with its own
/// interpreter found and its Python frames named.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn python_frames_of_worker_processes_with_all() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let go = dir.path().join("go");
    let script = workspace().join("tests/fixtures/py_loader.py");
    let mut cmd = Command::new("/usr/bin/python3.11");
    cmd.arg(&script)
        .arg(fixtures())
        .arg(&go)
        .env("FAKE_NCCL_US", "3000")
        .stdout(Stdio::piped());
    let mut rank = cmd.spawn().unwrap();
    let rank_guard = KillOnDrop(rank.id());
    let mut lines = BufReader::new(rank.stdout.take().unwrap()).lines();
    let ready = lines.next().unwrap().unwrap();
    let worker: u32 = ready
        .strip_prefix("ready ")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let worker_guard = KillOnDrop(worker);
    std::fs::write(&go, b"").unwrap();
    let out = dir.path().join("out");
    let agent = Agent::attach_many(&[], &out, &["--all", "--duration", "3s"]);
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    drop((rank_guard, worker_guard));
    let _ = rank.wait();
    assert_eq!(code, 0, "{stderr}");
    let targets = summary["targets"].as_array().unwrap();
    for pid in [rank.id(), worker] {
        let t = targets
            .iter()
            .find(|t| t["pid"] == pid)
            .unwrap_or_else(|| panic!("pid {pid} not traced: {targets:?}"));
        assert_eq!(t["python"]["frames"], true, "{t}");
    }
    // The worker issues no collective: a worker of the rank that forked it, not a rank
    // (issue 51), with its own totals — by the script, 2 ms busy then 2 ms asleep.
    let ranks: Vec<&Value> = summary["ranks"].as_array().unwrap().iter().collect();
    assert_eq!(ranks.len(), 1, "{ranks:?}");
    assert_eq!(ranks[0]["pid"], rank.id());
    let workers = summary["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 1, "{workers:?}");
    let w = &workers[0];
    assert_eq!(
        (&w["pid"], &w["rank_pid"], &w["parent_pid"]),
        (
            &Value::from(worker),
            &Value::from(rank.id()),
            &Value::from(rank.id())
        ),
        "{w}"
    );
    let c = &w["categories_ns"];
    let ns = |k: &str| c[k].as_u64().unwrap_or(0) as f64;
    let total: f64 = [
        "compute",
        "page_fault",
        "runqueue",
        "other_offcpu",
        "cpu_migration",
    ]
    .iter()
    .map(|k| ns(k))
    .sum();
    let busy = (ns("compute") + ns("page_fault")) / total;
    assert!(
        (0.3..0.7).contains(&busy),
        "busy {busy:.2} of its time: {w}"
    );
    let trace = std::fs::read_to_string(out.join("trace.json")).unwrap();
    assert!(
        trace.contains(&format!("worker of rank 0 (pid {worker})")),
        "trace.json names the worker"
    );
    let line = marked_line_of("py_loader.py", "load_batch");
    let want = format!("load_batch (py_loader.py:{line})");
    let oncpu = folded(&out, "oncpu");
    let in_worker: u64 = oncpu
        .iter()
        .filter(|(s, _)| s.starts_with(&format!("python3.11 {worker} ")) && s.contains(&want))
        .map(|(_, w)| w)
        .sum();
    assert!(
        in_worker > 0,
        "no on-CPU sample of the worker at {want}:\n{oncpu:?}"
    );
}
