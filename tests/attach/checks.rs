//! Checks on a run's outputs that several features' tests share: the breakdown against the
//! trainer's own truth, the off-CPU stacks as taken, well-formed flamegraphs and trace, and
//! speedscope importing trace.json.

use super::*;

/// Runs the trainer in one mode and compares the per-step breakdown with its own truth:
/// steps found within ±1, the medians of its waits and `page_fault` and the mean of
/// `compute` (with the scheduler's categories) within 5%. Its communicator has one rank
/// (made before attach: its size read from its memory): the waits in its syncs are
/// `gpu_wait` and no step has `nccl_wait`, but where its collectives block the host
/// (`FAKE_NCCL_BLOCKING=1`: time inside NCCL).
pub(crate) fn breakdown_matches_truth(env: &[(&str, &str)], extra: &[&str]) {
    breakdown_within(env, extra, &ON_THE_HOST);
}

/// A breakdown comparison: the trainer's step, the sampling rate, and how close each
/// category must come to the trainer's own figure (a fraction of it).
pub(crate) struct Accuracy {
    pub(crate) steps: u32,
    pub(crate) compute_us: &'static str,
    pub(crate) fault_pages: &'static str,
    pub(crate) sample_hz: &'static str,
    /// nccl_wait and compute.
    pub(crate) bound: f64,
    pub(crate) page_fault: f64,
}

/// On this machine, at the default profile's sampling rate. The trainer's faults are back
/// to back (a loop over fresh pages), measured between them where fentry/fexit is
/// refused: within 5%. (From samples alone, which took 20,000 samples a second to be
/// right per step, they ran 5–7% over. At that rate a sample's handler lands between
/// faults and lengthens the gap past what is taken as a fault's: the estimate then read
/// 5–27% under the trainer's clock, which counts the handlers too.)
pub(crate) const ON_THE_HOST: Accuracy = Accuracy {
    steps: 60,
    compute_us: "2000",
    fault_pages: "300",
    sample_hz: "99",
    bound: 0.05,
    page_fault: 0.05,
};

/// Host-blocking collectives: the trainer times each call from before its entry to after
/// its return, so its wait holds the probes' own traps (uprobe and uretprobe), which fall
/// outside the call's timestamps and read as compute here — 0.10 to 0.12 ms a step of 10
/// calls on this VM (2026-12-07), 3–4% of the step's compute. Its compute within 10%;
/// until faults were measured between back-to-back faults, page_fault's 5–7% over-count
/// hid this in compute.
pub(crate) const BLOCKING: Accuracy = Accuracy {
    bound: 0.10,
    ..ON_THE_HOST
};

pub(crate) fn breakdown_within(env: &[(&str, &str)], extra: &[&str], accuracy: &Accuracy) {
    // A timing comparison on a shared 2-vCPU VM: a run disturbed by the host (steal time)
    // is run again, up to three times in all; one run must meet every bound.
    let mut failures = Vec::new();
    for _ in 0..3 {
        match breakdown_run(env, extra, accuracy) {
            Ok(()) => return,
            Err(e) => {
                eprintln!("breakdown run outside the bounds: {e}");
                failures.push(e);
            }
        }
    }
    panic!("three runs outside the bounds: {failures:#?}");
}

/// The sum of a step's measured categories (those not null), ns.
pub(crate) fn category_sum(step: &Value) -> u64 {
    step["categories_ns"]
        .as_object()
        .unwrap()
        .values()
        .filter_map(Value::as_u64)
        .sum()
}

/// InfiniBand counters per step where the host has ports (issue 19), else why not.
pub(crate) fn infiniband_as_the_host_has(steps: &Value, summary: &Value) {
    let ib = steps["methods"]["infiniband"].as_str().unwrap();
    let first = &steps["steps"][0];
    if nccltrace::host::Host::live().ib_ports().is_empty() {
        assert_eq!(
            ib,
            "not read: no InfiniBand port under /sys/class/infiniband"
        );
        assert!(first.get("infiniband").is_none(), "{first}");
        assert!(summary.get("infiniband").is_none());
    } else {
        assert!(ib.starts_with("estimated"), "{ib}");
        assert!(first["infiniband"].is_object(), "{first}");
    }
}

/// One traced run of the comparison; `Err` names the first category outside 5%.
pub(crate) fn breakdown_run(
    env: &[(&str, &str)],
    extra: &[&str],
    accuracy: &Accuracy,
) -> Result<(), String> {
    let steps = accuracy.steps;
    let mut trainer_args = vec![
        "--compute-us",
        accuracy.compute_us,
        "--fault-pages",
        accuracy.fault_pages,
    ];
    trainer_args.extend_from_slice(extra);
    let (_, _, out, _dir, truth) = traced_trainer_with(
        steps,
        env,
        &trainer_args,
        &["--sample-hz", accuracy.sample_hz],
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    assert_eq!(report["method"], "auto");
    // How faults were timed, and when not by fentry/fexit, why not.
    let method = report["methods"]["page_fault"].as_str().unwrap();
    assert!(
        method.starts_with("fentry/fexit on handle_mm_fault")
            || method.contains("refused fentry/fexit on handle_mm_fault ("),
        "{method}"
    );
    // remote_memory: measured where the host has a PMU memory sampler, else the reason
    // (these machines and the QEMU guests have none), and the summary's PMU count with it.
    let remote = report["methods"]["remote_memory"].as_str().unwrap();
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let pmu_samples = &summary["memory"]["pmu_load_samples"];
    match nccltrace::pmu::detect(Path::new(nccltrace::pmu::DEVICES)) {
        Ok(_) => assert!(
            remote.starts_with("measured by") && pmu_samples.is_u64(),
            "{remote}"
        ),
        Err(why) => {
            assert!(remote.contains(&why), "{remote}");
            assert!(pmu_samples.is_null(), "{pmu_samples}");
        }
    }
    infiniband_as_the_host_has(&report, &summary);
    // numastat over the run (issue 23): the pages the trainer faults in are allocations.
    let node0 = &summary["memory"]["numastat_pages"]["node0"];
    assert!(node0["numa_hit"].as_u64().unwrap() > 0, "{node0}");
    // The training loop's thread (the process's main thread), whichever thread issues the
    // collectives.
    assert_eq!(report["rank_tid"], report["rank_pid"]);
    let found = report["steps"].as_array().unwrap();
    assert!(
        found.len().abs_diff(steps as usize) <= 1,
        "{} steps found for {steps}",
        found.len()
    );
    let cat = |c: &Value, k: &str| c[k].as_f64().unwrap();
    // Our first step starts at the return of the trainer's first sync: ours[k] is the
    // trainer's step k + 1.
    let truth = &truth[1..];
    let ours_of = |f: &dyn Fn(&Value) -> f64| -> Vec<f64> {
        found.iter().map(|s| f(&s["categories_ns"])).collect()
    };
    let theirs_of =
        |key: &str| -> Vec<f64> { truth.iter().map(|s| s[key].as_f64().unwrap()).collect() };
    let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len() as f64;
    // The trainer cannot tell its compute from what the scheduler took, and its compute
    // is a residual (wall − faults − waits): a median of residuals is not the residual of
    // medians, so compute is compared by its mean, which adds up. Nor can it tell a stall
    // on remote memory from compute: where remote_memory was estimated (the two-node
    // guests, whose trainer runs on both nodes' CPUs) it was carved out of our compute,
    // and is counted back in here.
    let ours_compute = ours_of(&compute_with_stalls);
    one_rank_waits_for_the_gpu(env, &report)?;
    let checks = [
        (
            "gpu_wait + nccl_wait (median)",
            median(ours_of(&|c| cat(c, "nccl_wait") + cat(c, "gpu_wait"))),
            median(theirs_of("wait_ns")),
        ),
        (
            "page_fault (median)",
            median(ours_of(&|c| cat(c, "page_fault"))),
            median(theirs_of("fault_ns")),
        ),
        (
            "compute (mean)",
            mean(ours_compute),
            mean(theirs_of("compute_ns")),
        ),
    ];
    let line = format!(
        "{env:?}: {checks:?}; late events left out: {}; by step [wall, page_fault, compute, \
         faults]: {:?}",
        report["late_events_left_out"],
        by_step(found, truth)
    );
    eprintln!("{line}");
    for (name, ours, truth) in checks {
        let err = (ours - truth).abs() / truth;
        let bound = if name.starts_with("page_fault") {
            accuracy.page_fault
        } else {
            accuracy.bound
        };
        if err > bound {
            return Err(format!(
                "{name}: ours {ours:.0} ns vs truth {truth:.0} ns ({:.1}%); {line}",
                err * 100.0
            ));
        }
    }
    Ok(())
}

/// The trainer's communicator has one rank: no step has `nccl_wait`, but where its
/// collectives block the host (`FAKE_NCCL_BLOCKING=1`).
fn one_rank_waits_for_the_gpu(env: &[(&str, &str)], report: &Value) -> Result<(), String> {
    if env.contains(&("FAKE_NCCL_BLOCKING", "1")) {
        return Ok(());
    }
    let steps = report["steps"].as_array().unwrap();
    let in_syncs: Vec<&Value> = steps
        .iter()
        .map(|s| &s["categories_ns"]["nccl_wait"])
        .filter(|w| w.as_u64() != Some(0))
        .collect();
    if in_syncs.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "nccl_wait on a one-rank communicator: {in_syncs:?}; communicators {}",
            report["communicators"]
        ))
    }
}

/// What the trainer counts as its compute, from our categories: on-CPU compute, what the
/// scheduler took, and the remote-memory stalls carved out of compute (null where not
/// measured or estimated: none carved).
fn compute_with_stalls(c: &Value) -> f64 {
    ["compute", "runqueue", "cpu_migration", "other_offcpu"]
        .iter()
        .map(|k| c[k].as_f64().unwrap())
        .sum::<f64>()
        + c["remote_memory"].as_f64().unwrap_or(0.0)
}

/// Step by step, ms (ours, the trainer's): wall, page_fault, and compute with the
/// scheduler's categories; and the faults counted against those the trainer made at
/// least (its fresh pages). Printed with the figures, to tell noise from a bias.
fn by_step(found: &[Value], truth: &[Value]) -> Vec<[(f64, f64); 4]> {
    let ms = |v: f64| (v / 1e5).round() / 10.0;
    found
        .iter()
        .zip(truth)
        .map(|(s, t)| {
            let c = &s["categories_ns"];
            let ours = |k: &str| c[k].as_f64().unwrap_or(0.0);
            let theirs = |k: &str| t[k].as_f64().unwrap();
            let compute = compute_with_stalls(c);
            [
                (ms(s["wall_ns"].as_f64().unwrap()), ms(theirs("wall_ns"))),
                (ms(ours("page_fault")), ms(theirs("fault_ns"))),
                (ms(compute), ms(theirs("compute_ns"))),
                (s["faults"].as_f64().unwrap_or(-1.0), theirs("fault_pages")),
            ]
        })
        .collect()
}

/// The off-CPU stacks as the run says it took them (summary.json `offcpu_stacks_taken`;
/// the default profile's minimum is 100 µs): as threads came back to the CPU, with the
/// shorter stretches counted and drawn as one frame of about their time; or, where the
/// kernel has no kprobes (these CPU machines), at every switch-out, saying why. In a
/// guest (Debian's kernels have kprobes) it must be the former.
///
/// Where stacks are taken as threads come back, the stretches the kernel counted as
/// shorter than 100 µs are checked against the off-CPU slices of trace.json, which come
/// from the scheduler's switch tracepoint alone: how many stretches are short is the
/// scheduler's business (under emulation a guest's handoffs may all be longer), but the
/// two views of them must agree.
pub(crate) fn offcpu_stacks_as_taken(out: &Path, summary: &Value) {
    let folded = std::fs::read_to_string(out.join("flamegraph-offcpu.folded")).unwrap();
    assert!(summary["offcpu_stacks"].as_u64().unwrap() > 0, "{summary}");
    // No kernel frames: none of the kernel's blocking functions is drawn.
    assert!(
        !folded.contains("_[k]") && folded.contains(";[blocked] "),
        "{folded}"
    );
    let short_frame = "[off-CPU under 100 µs: no stack taken]";
    let weight = |l: &str| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap();
    let short_us: u64 = folded
        .lines()
        .filter(|l| l.contains(short_frame))
        .map(weight)
        .sum();
    let skipped = summary["counters"]["offcpu_stacks_skipped_short"]
        .as_u64()
        .unwrap();
    let skipped_us = summary["counters"]["offcpu_stacks_skipped_short_ns"]
        .as_u64()
        .unwrap()
        / 1000;
    let taken = summary["offcpu_stacks_taken"].as_str().unwrap();
    eprintln!("off-CPU stacks {taken}: {skipped} shorter, {skipped_us} µs ({short_us} µs drawn)");
    // The default profile's off-CPU stacks have no kernel frames.
    assert!(
        taken.starts_with("user and Python frames, no kernel frames"),
        "{taken}"
    );
    // It reuses native frames (`reuse_stacks`): the trainer blocks in the same sync from
    // the same call site every step, so most stacks after the first are reused, and each
    // has its earlier stack in the recording (the graphs above are drawn from them).
    let stacks =
        summary["offcpu_stacks"].as_u64().unwrap() + summary["call_stacks"].as_u64().unwrap();
    let reused = summary["stacks_reused"].as_u64().unwrap();
    assert!(
        reused > 0 && reused < stacks,
        "{reused} of {stacks} stacks reused"
    );
    assert_eq!(summary["stacks_reused_unresolved"], 0);
    if taken.contains("taken as threads come back to the CPU") {
        assert!(folded.lines().any(|l| !l.contains(short_frame)), "{folded}");
        // The scheduler's view: off-CPU slices of the traced threads, clearly under
        // (90 µs) and up to just over (110 µs) the minimum; a stretch near it may fall
        // either side, its ends read by different programs. Two either way for the
        // stretches cut by the run's start and end (seen in the guest: 2 counted by the
        // kernel, 3 slices under 90 µs).
        let (under, near) = (
            offcpu_slices_shorter(out, 90.0),
            offcpu_slices_shorter(out, 110.0),
        );
        eprintln!("trace.json: {under} off-CPU slices under 90 µs, {near} under 110 µs");
        assert!(
            skipped * 10 + 20 >= under * 8 && skipped <= near + near / 5 + 2,
            "{skipped} short stretches counted by the kernel; trace.json has {under} under \
             90 µs and {near} under 110 µs"
        );
        // The kernel's count and the graph's frame cover the same stretches, but for
        // those cut by the run's start and end.
        assert!(
            short_us * 10 >= skipped_us * 7 && short_us * 10 <= skipped_us * 13,
            "short stretches: {short_us} µs drawn, {skipped_us} µs counted"
        );
    } else {
        assert!(!in_a_guest(), "{taken}");
        assert!(taken.contains(", taken at every switch-out: "), "{taken}");
        assert_eq!((skipped, short_us), (0, 0));
    }
}

/// The off-CPU slices of trace.json shorter than `us` microseconds.
fn offcpu_slices_shorter(out: &Path, us: f64) -> u64 {
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let short = trace["traceEvents"].as_array().unwrap().iter().filter(|e| {
        e["ph"] == "X"
            && e["name"].as_str().is_some_and(|n| n.starts_with("off-CPU"))
            && e["dur"].as_f64().is_some_and(|d| d < us)
    });
    short.count() as u64
}

/// Every SVG is well-formed XML and names the trainer's own functions; every `.folded`
/// line is `frames weight`; trace.json holds named tracks, one slice per NCCL call and
/// per step, with timestamps inside the trace.
pub(crate) fn flamegraphs_and_trace_are_valid(out: &Path, summary: &Value) {
    for name in ["oncpu", "offcpu", "nccl-wait", "attributed"] {
        let svg = std::fs::read_to_string(out.join(format!("flamegraph-{name}.svg"))).unwrap();
        let mut reader = quick_xml::Reader::from_str(&svg);
        loop {
            match reader.read_event() {
                Ok(quick_xml::events::Event::Eof) => break,
                Ok(_) => {}
                Err(e) => panic!("flamegraph-{name}.svg is not XML: {e}"),
            }
        }
        let folded =
            std::fs::read_to_string(out.join(format!("flamegraph-{name}.folded"))).unwrap();
        for line in folded.lines() {
            let (_, weight) = line.rsplit_once(' ').unwrap();
            assert!(weight.parse::<u64>().unwrap() > 0, "{line}");
        }
        if name == "oncpu" || name == "attributed" {
            assert!(
                svg.contains("compute") && svg.contains("main"),
                "flamegraph-{name}.svg lacks trainer frames"
            );
        }
    }
    // The default profile captures each CUDA sync's entry stack: the wait is drawn at the
    // trainer's call site (main calls cuStreamSynchronize).
    let wait = std::fs::read_to_string(out.join("flamegraph-nccl-wait.folded")).unwrap();
    assert!(
        wait.lines()
            .any(|l| l.contains(";main;")
                && l.contains("cuStreamSynchronize;[in cuStreamSynchronize] ")),
        "{wait}"
    );
    offcpu_stacks_as_taken(out, summary);
    let attributed = std::fs::read_to_string(out.join("flamegraph-attributed.folded")).unwrap();
    // The trainer's one-rank communicator: its syncs wait for the GPU.
    assert!(attributed.lines().any(|l| l.starts_with("gpu_wait;")));
    assert!(attributed.lines().any(|l| l.starts_with("page_fault;")));
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let end_us = summary["duration_ns"].as_f64().unwrap() / 1000.0;
    let mut nccl_slices = 0;
    let mut step_slices = 0;
    for e in events {
        let ph = e["ph"].as_str().unwrap();
        assert!(e["pid"].is_u64(), "{e}");
        assert!(e["name"].is_string(), "{e}");
        if ph == "X" {
            let ts = e["ts"].as_f64().unwrap();
            assert!(ts >= 0.0 && ts <= end_us + 1.0, "{e}");
            assert!(e["dur"].as_f64().unwrap() >= 0.0, "{e}");
            nccl_slices += u64::from(e["cat"] == "nccl");
            step_slices += u64::from(e["cat"] == "step");
        }
    }
    assert_eq!(nccl_slices, summary["nccl"]["calls"].as_u64().unwrap());
    assert!(step_slices > 0);
    // The default profile leaves streams on the user stack unread (~100 ns a call): only
    // those passed in a register are shown, none as 0x0.
    let in_registers = calls_of(summary, &REGISTER_STREAM);
    assert!(in_registers > 0 && calls_of(summary, &STACK_STREAM) > 0);
    assert_eq!(slices_with_stream(out), (in_registers, in_registers));
    assert!(events.iter().any(|e| {
        e["ph"] == "M"
            && e["args"]["name"]
                .as_str()
                .is_some_and(|n| n.contains("main (rank)"))
    }));
    assert!(trace["otherData"]["realtime_ns_at_0"].is_u64());
    speedscope_reads(&out.join("trace.json"));
}

/// An importer written by others reads trace.json: speedscope's web app (from npm, path in
/// NCCLTRACE_SPEEDSCOPE, set by `cargo xtask test`) in headless Chromium, served from a
/// local HTTP server, must import it and list the rank thread and the steps track.
pub(crate) fn speedscope_reads(trace: &Path) {
    if in_a_guest() {
        // In an emulated guest headless Chromium takes minutes: the import is checked on
        // the host run of the same test.
        return;
    }
    let app = PathBuf::from(std::env::var_os("NCCLTRACE_SPEEDSCOPE").expect(
        "NCCLTRACE_SPEEDSCOPE is unset: run the tests with `cargo xtask test`, which fetches speedscope",
    ));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let trace = trace.to_owned();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let mut request = String::new();
            let _ = BufReader::new(&stream).read_line(&mut request);
            let path = request.split_whitespace().nth(1).unwrap_or("/").to_owned();
            let file = if path == "/trace.json" {
                trace.clone()
            } else {
                app.join(
                    path.trim_start_matches('/')
                        .split(['?', '#'])
                        .next()
                        .unwrap(),
                )
            };
            let kind = match file.extension().and_then(|e| e.to_str()) {
                Some("html") => "text/html",
                Some("js") => "text/javascript",
                Some("css") => "text/css",
                Some("json") => "application/json",
                _ => "application/octet-stream",
            };
            let reply = match std::fs::read(&file) {
                Ok(body) => {
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n\
                         Connection: close\r\n\r\n",
                        body.len()
                    );
                    [head.into_bytes(), body].concat()
                }
                Err(_) => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_vec(),
            };
            let _ = std::io::Write::write_all(&mut stream, &reply);
        }
    });
    let url =
        format!("http://127.0.0.1:{port}/index.html#profileURL=http://127.0.0.1:{port}/trace.json");
    let profile = tempfile::tempdir().unwrap();
    let dom = Command::new("chromium")
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=30000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(["--dump-dom", &url])
        .output()
        .expect("chromium (cargo xtask setup installs it)");
    let dom = String::from_utf8_lossy(&dom.stdout);
    assert!(
        dom.contains("<title>trace.json - speedscope</title>"),
        "speedscope did not import trace.json: {}",
        &dom[..dom.len().min(2000)]
    );
    assert!(
        dom.contains("(main (rank))") && dom.contains("steps (tid"),
        "{dom}"
    );
}

/// The recording's kernel records are in time order: records of different CPUs come from
/// different ring buffers and are merged by time as they are drained. What a drain pass
/// can leave out of order is what was written while it ran; nothing may be more than a
/// millisecond behind a record before it. Off-CPU stacks taken as a thread comes back
/// (kernels with kprobes, `offcpu_min_us`) are written then but timed at the switch-out:
/// they are left out of the check there.
pub(crate) fn recording_in_time_order(out: &Path) {
    use nccltrace_common::kind;
    let mut reader = nccltrace::record::Reader::open(&out.join("recording.nctr")).unwrap();
    let taken_at_switch_in = reader.header.offcpu_min_ns > 0;
    let (mut latest, mut records, mut behind) = (0u64, 0u64, Vec::new());
    while let Some(record) = reader.next_raw().unwrap() {
        let nccltrace::record::RawRecord::Kernel(bytes) = record else {
            continue;
        };
        let ts = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        let record_kind = nccltrace::decode::record_kind(bytes).unwrap();
        if taken_at_switch_in
            && matches!(
                record_kind,
                kind::OFFCPU | kind::PY_STACK | kind::PY_FRAMES | kind::STACK_SAME
            )
        {
            continue;
        }
        records += 1;
        if ts + 1_000_000 < latest {
            behind.push((records, latest - ts));
        }
        latest = latest.max(ts);
    }
    assert!(records > 1000, "{records} records");
    assert!(
        behind.is_empty(),
        "{} of {records} records over 1 ms behind (record, ns): {:?}",
        behind.len(),
        &behind[..behind.len().min(10)]
    );
}

/// How the agent must have attached the uprobes on this kernel with `multi` asked for
/// (profile `uprobe_multi`): uprobe-multi links from Linux 6.6 on, one per function before
/// (for the target when there is one, else for every process).
pub(crate) fn uprobes_attached_as(summary: &Value, multi: bool) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let version = (numbers.next().unwrap_or(0), numbers.next().unwrap_or(0));
    let targets = summary["targets"].as_array().map_or(0, Vec::len);
    let expected = if multi && version >= (6, 6) {
        "uprobe-multi links, one per target process, file and program"
    } else if targets == 1 {
        "one perf-event uprobe per function, for the target process"
    } else {
        "one perf-event uprobe per function, for every process"
    };
    assert_eq!(summary["agent"]["uprobes"], expected, "kernel {release}");
}

/// Collectives whose stream is the sixth argument (a register) and those whose stream is
/// on the user stack.
pub(crate) const REGISTER_STREAM: [&str; 5] = ["AllGather", "AlltoAll", "Bcast", "Send", "Recv"];
pub(crate) const STACK_STREAM: [&str; 5] = [
    "AllReduce",
    "ReduceScatter",
    "Broadcast",
    "Gather",
    "Reduce",
];

/// Calls of these operations in summary.json.
pub(crate) fn calls_of(summary: &Value, ops: &[&str]) -> u64 {
    ops.iter()
        .filter_map(|op| summary["nccl"]["by_op"][op]["calls"].as_u64())
        .sum()
}

/// (NCCL slices in trace.json with a stream argument, those whose stream is the trainer's
/// 0x5000).
pub(crate) fn slices_with_stream(out: &Path) -> (u64, u64) {
    let trace: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("trace.json")).unwrap()).unwrap();
    let streams: Vec<&Value> = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "nccl")
        .filter_map(|e| e["args"].get("stream"))
        .collect();
    let trainers = streams.iter().filter(|s| **s == "0x5000").count();
    (streams.len() as u64, trainers as u64)
}
