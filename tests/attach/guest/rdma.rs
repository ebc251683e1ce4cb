//! A live RDMA port: the kernel's soft-RoCE driver (`rdma_rxe`, in Debian's kernels) over
//! a dummy network device of the guest, with `rping` (rdmacm-utils) moving packets through
//! it. Soft-RoCE has no `counters/` folder (no management datagrams to query); its
//! `hw_counters/` count packets, as an adapter's do. These machines have no RDMA adapter
//! and no `rdma_rxe` module; Debian's guest kernels have it.

use super::super::*;

/// The test's own port, over its own network device, removed on drop.
struct SoftRoce;

const NETDEV: &str = "ncctrace0";
const DEVICE: &str = "ncctrace_rxe";
const ADDRESS: &str = "10.77.0.1";

fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{program}: {e} (cargo xtask setup installs it)"));
    assert!(
        out.status.success(),
        "{program} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl SoftRoce {
    fn up() -> SoftRoce {
        run("modprobe", &["rdma_rxe"]);
        run("ip", &["link", "add", NETDEV, "type", "dummy"]);
        let port = SoftRoce;
        run(
            "ip",
            &["addr", "add", &format!("{ADDRESS}/24"), "dev", NETDEV],
        );
        run("ip", &["link", "set", NETDEV, "up"]);
        run(
            "rdma",
            &["link", "add", DEVICE, "type", "rxe", "netdev", NETDEV],
        );
        port
    }

    /// One of the port's `hw_counters/`.
    fn counter(name: &str) -> u64 {
        let path = format!("/sys/class/infiniband/{DEVICE}/ports/1/hw_counters/{name}");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        text.trim().parse().unwrap()
    }
}

impl Drop for SoftRoce {
    fn drop(&mut self) {
        let _ = Command::new("rdma")
            .args(["link", "delete", DEVICE])
            .status();
        let _ = Command::new("ip").args(["link", "delete", NETDEV]).status();
    }
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &raw mut ts) };
    u64::try_from(ts.tv_sec).unwrap() * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap()
}

/// `rping` server and a client making `count` round trips; killed if still there when
/// dropped.
struct Pings(Vec<Child>);

impl Pings {
    fn start(count: u32) -> Pings {
        let rping = |args: &[&str]| {
            Command::new("rping")
                .args(args)
                .args(["-a", ADDRESS, "-S", "1024"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("rping (rdmacm-utils; cargo xtask setup installs it)")
        };
        let server = rping(&["-s"]);
        std::thread::sleep(Duration::from_millis(500));
        Pings(vec![server, rping(&["-c", "-C", &count.to_string()])])
    }

    /// Waits (at most a minute) for the client to finish and disconnect, and the server
    /// to exit with it: a connection torn down by killing its ends has the kernel's
    /// connection manager retry its disconnect for seconds after (seen: packets 1.5 s
    /// and more after the kill).
    fn finish(&mut self) {
        let started = Instant::now();
        for child in self.0.iter_mut().rev() {
            while child.try_wait().unwrap().is_none() {
                assert!(
                    started.elapsed() < Duration::from_secs(60),
                    "rping did not finish"
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

impl Drop for Pings {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// The moment the port's `sent_pkts` last moved, once it has stood still for a second.
fn quiet_since() -> u64 {
    let (mut last, mut moved) = (SoftRoce::counter("sent_pkts"), monotonic_ns());
    let started = Instant::now();
    while monotonic_ns() - moved < 1_000_000_000 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the port never went quiet"
        );
        std::thread::sleep(Duration::from_millis(100));
        let now = SoftRoce::counter("sent_pkts");
        if now != last {
            (last, moved) = (now, monotonic_ns());
        }
    }
    moved
}

/// Where the steps end against the pings' last packet, and what was not a step: for a
/// failure's message.
fn tail_said(steps: &Value, pings_until: u64) -> String {
    let last_end = steps["steps"]
        .as_array()
        .and_then(|s| s.last())
        .and_then(|s| s["end_ns"].as_u64())
        .unwrap_or(0);
    format!(
        "the last step ends {:.3} s after the pings' last packet; idle: {}",
        (last_end as f64 - pings_until as f64) / 1e9,
        steps["idle"]
    )
}

/// A traced trainer while the port is quiet, busy, then quiet again: each step gets the
/// packets sent in it, from the port's `hw_counters/` as the agent read them while
/// tracing. The steps' packets add up to exactly what the port counted (the quiet ends
/// hold the counter still at the first step's start and the last one's end); steps well
/// before and after the pings have none; the port's error counters are read and zero.
#[test]
#[ignore = "runs in a QEMU guest with soft-RoCE: cargo xtask vm-test"]
fn infiniband_counters_of_a_live_port() {
    let _serial = privileged();
    assert!(
        in_a_guest(),
        "needs the guest's rdma_rxe: run `cargo xtask vm-test`"
    );
    let _port = SoftRoce::up();
    let dir = tempfile::tempdir().unwrap();
    let trainer = waiting_trainer(dir.path(), 1_000_000, 20_000);
    let out = dir.path().join("out");
    let sent_before = SoftRoce::counter("sent_pkts");
    let agent = Agent::attach(trainer.child.id(), &out, &[]);
    // Its output read as it comes (unread, it blocked in write(): no step after the pings).
    let (mut child, _drain) = released_and_drained(trainer);
    // Quiet for 3.5 s, 200 round trips, the connection closed by the client, quiet again
    // for 3.5 s.
    std::thread::sleep(Duration::from_millis(3500));
    let pings_from = monotonic_ns();
    let mut pings = Pings::start(200);
    let flowing = Instant::now();
    while SoftRoce::counter("sent_pkts") == sent_before {
        assert!(
            flowing.elapsed() < Duration::from_secs(30),
            "rping sent nothing"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let pings_first = monotonic_ns();
    pings.finish();
    let pings_until = quiet_since();
    assert!(
        SoftRoce::counter("sent_pkts") > sent_before,
        "rping sent nothing"
    );
    std::thread::sleep(Duration::from_millis(3500));
    drop(pings);
    let _ = child.kill();
    let _ = child.wait();
    let (code, summary, stderr) = agent.wait(Duration::from_secs(120));
    assert_eq!(code, 0, "{stderr}");
    let sent = SoftRoce::counter("sent_pkts") - sent_before;
    assert!(sent > 0);
    let port = format!("{DEVICE}/1");
    let steps: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("steps.json")).unwrap()).unwrap();
    let method = steps["methods"]["infiniband"].as_str().unwrap();
    assert!(
        method.starts_with("estimated") && method.contains(&port),
        "{method}"
    );
    let tail = tail_said(&steps, pings_until);
    let steps = steps["steps"].as_array().unwrap();
    let of = |s: &Value, name: &str| s["infiniband"][&port][name].as_u64();
    // Quiet steps: 2 s from the pings' ends, as a reading interval is spread evenly over
    // the steps in it and the emulated guest's debug agent reads every few hundred ms
    // (seen: a packet 0.5 s after the last one, smeared over the interval that held it).
    // Busy steps: 200 ms inside them.
    let (margin, inside) = (2_000_000_000, 200_000_000);
    let (mut before, mut during, mut after, mut total) = (0, 0, 0, 0);
    // Every step has a reading on each side: the ports are read once before any probe is
    // attached (the first steps of the emulated guest's run came before the loop's first
    // reading, ~0.4 s after the trainer started), and then on a thread of their own (the
    // trap calibration's rounds, seconds long under emulation, held the loop's readings
    // back for 5.5 s once, and 2.5 s of steps had none).
    let (mut unread, mut unread_first, mut errors_read) = (0, 0, 0);
    for s in steps {
        let (a, b) = (
            s["start_ns"].as_u64().unwrap(),
            s["end_ns"].as_u64().unwrap(),
        );
        let Some(packets) = of(s, "sent_pkts") else {
            assert!(s.get("infiniband").is_none(), "{s}");
            unread += 1;
            unread_first += u64::from(total == 0 && before == 0);
            continue;
        };
        // The error counters are read every second: where such readings surround it.
        if let Some(errors) = of(s, "retry_exceeded_err") {
            assert_eq!(errors, 0, "{s}");
            errors_read += 1;
        }
        total += packets;
        if b + margin < pings_from {
            assert_eq!(packets, 0, "{s}");
            before += 1;
        } else if a > pings_until + margin {
            assert_eq!(packets, 0, "{s}");
            after += 1;
        } else if a > pings_first + inside && b + inside < pings_until {
            during += u64::from(packets > 0);
        }
    }
    eprintln!(
        "{} steps, {unread} without a reading ({unread_first} before the first with one): \
         {before} before the pings, {after} after, {during} during with packets, \
         {errors_read} with the error counters; {total} packets in steps, {sent} counted by \
         the port",
        steps.len()
    );
    assert_eq!(
        unread_first, 0,
        "the first steps have no reading: the ports were not read before attaching"
    );
    assert_eq!(
        unread, 0,
        "steps without a reading after the first with one"
    );
    assert!(
        before >= 3 && after >= 3 && during >= 3,
        "{before} {after} {during}; {tail}"
    );
    assert!(errors_read >= 3, "{errors_read}");
    // The steps follow each other: their packets add up to the port's count from the
    // first step to the last, which the quiet ends make the pings' all.
    assert_eq!(total, sent, "the steps' packets against the port's");
    // The run's totals, from its first reading to its last: every packet.
    assert_eq!(summary["infiniband"][&port]["sent_pkts"], sent, "{summary}");
}
