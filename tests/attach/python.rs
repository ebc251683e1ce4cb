//! Python frames: a CPython rank started without any perf flag, attached while it runs,
//! its stacks naming the functions and lines that called NCCL and waited.

use super::*;

/// The line of `tests/fixtures/py_rank.py` marked `MARK:name`.
fn marked_line(name: &str) -> usize {
    let text = std::fs::read_to_string(workspace().join("tests/fixtures/py_rank.py")).unwrap();
    let mark = format!("# MARK:{name}");
    text.lines()
        .position(|l| l.trim_end().ends_with(&mark))
        .unwrap_or_else(|| panic!("no {mark} in py_rank.py"))
        + 1
}

/// The stand-in Python rank, waiting for `dir/go`.
fn python_rank(dir: &Path, steps: u32) -> Target {
    let go = dir.join("go");
    Target::spawn(
        Path::new("python3"),
        &[
            workspace()
                .join("tests/fixtures/py_rank.py")
                .to_str()
                .unwrap(),
            fixtures().to_str().unwrap(),
            &steps.to_string(),
            go.to_str().unwrap(),
        ],
        // 3 ms of "GPU work" per collective: the sync waits for it.
        &[("FAKE_NCCL_US", "3000")],
        dir,
    )
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

/// Issue 21: attached to a running CPython (Debian's 3.11) that was started without a
/// perf flag, the nccl-wait flamegraph names the Python function and line that waited
/// (`wait_for_gpu (py_rank.py:N)` under `train_step (py_rank.py:M)`), the on-CPU graph
/// names the busy loop's line, the summary says which interpreter was found, and
/// `report` names the same frames from the recording alone.
#[test]
#[ignore = "needs root, loads eBPF programs: run `cargo xtask test`"]
fn python_frames_name_the_lines_that_wait() {
    let _serial = privileged();
    let dir = tempfile::tempdir().unwrap();
    let rank = python_rank(dir.path(), 100_000);
    rank.release();
    std::thread::sleep(Duration::from_millis(300));
    let out = dir.path().join("out");
    let agent = Agent::attach(rank.child.id(), &out, &["--duration", "3s"]);
    let (code, summary, stderr) = agent.wait(Duration::from_secs(60));
    let mut child = rank.child;
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(code, 0, "{stderr}");
    let python = &summary["targets"][0]["python"];
    assert!(
        python["version"].as_str().unwrap().starts_with("3.11"),
        "{python}"
    );
    assert_eq!(python["frames"], true, "{python}");
    assert!(summary["targets"][0]["python_stacks"].as_u64().unwrap() > 100);

    let at = |func: &str, mark: &str| format!("{func} (py_rank.py:{})", marked_line(mark));
    let waited = [
        at("<module>", "loop"),
        at("train_step", "step_sync"),
        at("wait_for_gpu", "sync"),
        "cuStreamSynchronize".to_owned(),
    ];
    let check = |out: &Path| {
        let wait = folded(out, "nccl-wait");
        let share = share_with(&wait, &waited);
        assert!(
            share > 0.8,
            "{:.0}% of the NCCL wait is drawn at {waited:?}:\n{wait:?}",
            share * 100.0
        );
        let oncpu = folded(out, "oncpu");
        // The busy loop's samples fall on its two lines: the function and file suffice.
        let compute = [at("<module>", "loop"), "compute (py_rank.py:".to_owned()];
        let share = share_with(&oncpu, &compute);
        assert!(
            share > 0.3,
            "{:.0}% of on-CPU samples at {compute:?}:\n{oncpu:?}",
            share * 100.0
        );
    };
    check(&out);
    // From the recording alone, as on another machine after the rank has exited.
    check(&report(&out, dir.path()));
}
