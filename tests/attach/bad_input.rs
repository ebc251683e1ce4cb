//! Bad input and refusals: exit code 2 with the problem and the fix, and nothing left behind.

use super::*;

/// A `--step-symbol` the target does not define: exit code 2, the name and the fix said.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn unknown_step_symbol_is_bad_input() {
    // Its trainer maps NCCL: keep it out of the `--all` test's way.
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let out = refused_attach(dir.path(), &["--step-symbol", "no_such_function"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("no function no_such_function") && stderr.contains("SYMBOL@LIBRARY"),
        "{stderr}"
    );
    // Regression (issue 17): the failed attach left an empty --out that refused the retry.
    assert!(
        !dir.path().join("out").exists(),
        "a failed attach left its folder"
    );
}

/// Regression (issue 17): `--wait-for-nccl` on a process that never loads NCCL ends with
/// the true reason and leaves no folder: the process exited (it said "check the pid with
/// ps"), `--duration` passed (it did not bound the wait), or Ctrl-C (exit 130).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn waiting_for_nccl_ends_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let wait = |seconds: &str, extra: &[&str]| {
        let mut target = Command::new("sleep").arg(seconds).spawn().unwrap();
        let pid = target.id();
        let run = agent()
            .args([
                "attach",
                "--wait-for-nccl",
                "--pid",
                &target.id().to_string(),
                "--out",
            ])
            .arg(&out)
            .args(extra)
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        (pid, run, move || {
            let _ = target.kill();
            let _ = target.wait();
        })
    };
    let (_, run, mut end) = wait("1", &[]);
    let result = run.wait_with_output().unwrap();
    end();
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("exited after") && stderr.contains("without loading NCCL"),
        "{stderr}"
    );
    assert!(!out.exists());

    let (_, run, mut end) = wait("30", &["--duration", "700ms"]);
    let started = Instant::now();
    let result = run.wait_with_output().unwrap();
    end();
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert_eq!(result.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("did not load NCCL within --duration"),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(20));
    assert!(!out.exists());

    let (_, mut run, mut end) = wait("30", &[]);
    let mut lines = BufReader::new(run.stderr.take().unwrap()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.contains("waiting for pid"), "{first}");
    unsafe { libc::kill(run.id() as i32, libc::SIGINT) };
    let status = run.wait().unwrap();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    end();
    assert_eq!(status.code(), Some(130), "{rest:?}");
    assert!(
        rest.join("\n").contains("SIGINT received while waiting"),
        "{rest:?}"
    );
    assert!(!out.exists());
}

/// Bad input: exit code 2 and a message naming the problem and the fix.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn bad_input_exits_2() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "attach".into(),
                "--pid".into(),
                "999999999".into(),
                "--out".into(),
                dir.path().join("a").display().to_string(),
            ],
            "no process with pid",
        ),
        (
            vec![
                "attach".into(),
                "--pid".into(),
                std::process::id().to_string(),
                "--out".into(),
                dir.path().join("b").display().to_string(),
            ],
            "has not loaded NCCL: no mapped object defines ncclAllReduce. Attach once the job \
             has initialised NCCL, or pass --wait-for-nccl",
        ),
        (
            vec![
                "attach".into(),
                "--pid".into(),
                "1".into(),
                "--duration".into(),
                "soon".into(),
            ],
            "invalid duration",
        ),
        (
            vec![
                "attach".into(),
                "--pid".into(),
                "1".into(),
                "--profile".into(),
                "nope".into(),
            ],
            "no profile named",
        ),
        (
            vec![
                "report".into(),
                "/etc/hostname".into(),
                "--out".into(),
                dir.path().join("c").display().to_string(),
            ],
            "not an nccltrace recording",
        ),
        (
            vec![
                "report".into(),
                "/nonexistent.nctr".into(),
                "--out".into(),
                dir.path().join("d").display().to_string(),
            ],
            "cannot read",
        ),
    ];
    let cases = cases.into_iter().chain([
        (
            vec!["doctor".into(), "--root".into(), "/nonexistent".into()],
            "a folder holding proc/",
        ),
        (
            vec!["doctor".into(), "--pid".into(), "999999999".into()],
            "invalid --pid",
        ),
        (
            vec![
                "snapshot".into(),
                "--pid".into(),
                "999999999".into(),
                "-o".into(),
                dir.path().join("s").display().to_string(),
            ],
            "invalid --pid",
        ),
    ]);
    for (args, expected) in cases {
        refused_with(dir.path(), &args, expected);
    }
    // An existing output folder is refused without --force.
    let existing = dir.path().join("exists");
    std::fs::create_dir(&existing).unwrap();
    let out = agent()
        .args(["attach", "--pid", "1", "--out"])
        .arg(&existing)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--force"));
}

/// Regression (issue 17): an --out that is a file or cannot be made, a negative or zero
/// --duration, --follow without --all: each was exit 1, a misleading reason, or accepted.
/// Now exit 2 with the rule said, and no failed command leaves a folder behind (the
/// default --out included).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn bad_output_and_arguments_exit_2() {
    let dir = tempfile::tempdir().unwrap();
    // Regression (issue 17): each of these was exit 1, a misleading reason, or accepted.
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let me = std::process::id().to_string();
    let file = file.display().to_string();
    let attach = |extra: &[&str]| -> Vec<String> {
        ["attach", "--pid", me.as_str()]
            .iter()
            .chain(extra)
            .map(ToString::to_string)
            .collect()
    };
    let issue_17: Vec<(Vec<String>, &str)> = vec![
        (attach(&["--out", &file]), "is a file, not a folder"),
        (
            attach(&["--force", "--out", &file]),
            "is a file, not a folder",
        ),
        (
            attach(&["--out", "/proc/x"]),
            "choose an --out folder this user can create and write",
        ),
        (attach(&["--duration", "-5s"]), "a length of time above 0"),
        (attach(&["--duration", "0"]), "a length of time above 0"),
        (attach(&["--follow"]), "--all --follow"),
    ];
    for (args, expected) in issue_17 {
        refused_with(dir.path(), &args, expected);
    }
    // No failed command above left a folder behind (the default --out included).
    let mut left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["a-file"], "folders left by failed runs");
}

/// Without root: exit 2 at once, the message names the missing capabilities and the fix,
/// and no output folder is made.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn not_root_is_bad_input() {
    let _guard = privileged();
    let dir = open_to_all();
    let out = dir.path().join("out");
    let output = as_nobody()
        .args(["attach", "--pid", &std::process::id().to_string(), "--out"])
        .arg(&out)
        .output()
        .expect("setpriv (util-linux)");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("lacks CAP_BPF, CAP_PERFMON, CAP_SYS_PTRACE") && stderr.contains("sudo"),
        "{stderr}"
    );
    assert!(!out.exists(), "an output folder was made");
}

/// Regression (issue 17): without root, `doctor` said the target's files "were not there"
/// when they were unreadable, and `snapshot` skipped them silently with exit 0. Both now
/// say permission denied and to run as root, exit 2; `doctor` still prints what it could
/// read and `snapshot` keeps what it captured.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn unreadable_files_are_named_without_root() {
    let dir = open_to_all();
    let me = std::process::id().to_string();
    let run = |args: &[&str]| {
        as_nobody()
            .args(args)
            .output()
            .expect("setpriv (util-linux)")
    };
    let doctor = run(&["doctor", "--pid", &me]);
    let stdout = String::from_utf8_lossy(&doctor.stdout);
    let stderr = String::from_utf8_lossy(&doctor.stderr);
    assert_eq!(doctor.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("permission denied") && stderr.contains("root"),
        "{stderr}"
    );
    assert!(stdout.contains("may not read"), "{stdout}");
    assert!(
        !stdout.contains(&format!("proc/{me}/environ) were not there")),
        "{stdout}"
    );
    let snap = dir.path().join("snap");
    let snapshot = run(&["snapshot", "--pid", &me, "-o", snap.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&snapshot.stderr);
    assert_eq!(snapshot.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("partial capture") && stderr.contains("root"),
        "{stderr}"
    );
    assert!(snap.join("proc").is_dir(), "what was captured is kept");
}

/// A program the kernel's verifier rejects (a C fixture that reads through a null
/// pointer), loaded through the agent's own loading path: the error names the program and
/// the kernel release, carries the verifier's words, and is a runtime failure (exit 1).
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn verifier_rejection_names_program_and_kernel() {
    let _guard = privileged();
    let mut ebpf = aya::Ebpf::load_file(fixtures().join("reject.bpf.o")).unwrap();
    let err = nccltrace::source::load_program::<aya::programs::TracePoint>(&mut ebpf, "reject")
        .unwrap_err();
    let text = err.to_string();
    let release =
        String::from_utf8(Command::new("uname").arg("-r").output().unwrap().stdout).unwrap();
    assert!(
        text.contains("rejected program reject") && text.contains(release.trim()),
        "{text}"
    );
    assert!(text.contains("invalid mem access"), "{text}");
    assert_eq!(nccltrace::Error::from(err).exit_code(), 1);
}
