//! Tests of `pmu`.

use super::*;

/// A sysfs `event_source/devices` tree as the kernel lays it out.
fn devices(pmus: &[(&str, &[(&str, &str)])]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for (pmu, files) in pmus {
        for (path, text) in *files {
            let p = dir.path().join(pmu).join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, text).unwrap();
        }
    }
    dir
}

const SAPPHIRE_RAPIDS: &[(&str, &str)] = &[
    ("type", "4\n"),
    ("events/mem-loads", "event=0xcd,umask=0x1,ldlat=3\n"),
    ("format/event", "config:0-7\n"),
    ("format/umask", "config:8-15\n"),
    ("format/ldlat", "config1:0-15\n"),
];

#[test]
fn pebs_load_latency_encoded_from_the_format_files() {
    let d = devices(&[("cpu", SAPPHIRE_RAPIDS), ("software", &[("type", "1\n")])]);
    let s = detect(d.path()).unwrap();
    assert_eq!(s.pmu, "cpu");
    assert_eq!(s.pmu_type, 4);
    assert_eq!(s.config, 0x1cd);
    assert_eq!(s.config1, LDLAT_CYCLES);
    assert!(s.describe().contains("PEBS"));
}

#[test]
fn ibs_on_amd_and_the_hybrid_core_pmu() {
    let d = devices(&[("ibs_op", &[("type", "11\n")]), ("cpu", &[("type", "4\n")])]);
    let s = detect(d.path()).unwrap();
    assert_eq!((s.pmu.as_str(), s.pmu_type, s.config), ("ibs_op", 11, 0));
    let d = devices(&[
        ("cpu_core", SAPPHIRE_RAPIDS),
        ("cpu_atom", &[("type", "10\n")]),
    ]);
    assert_eq!(detect(d.path()).unwrap().pmu, "cpu_core");
}

#[test]
fn no_pmu_says_what_is_there_and_why() {
    // What a VM without a virtual PMU has (the H200 machine and this one).
    let d = devices(&[
        ("software", &[("type", "1\n")]),
        ("tracepoint", &[("type", "2\n")]),
        ("uprobe", &[("type", "7\n")]),
    ]);
    let why = detect(d.path()).unwrap_err();
    assert!(why.starts_with("no PMU memory sampling"), "{why}");
    assert!(why.contains("only software, tracepoint, uprobe"), "{why}");
    assert!(why.contains("no hardware CPU PMU"), "{why}");
    // A CPU PMU without the event.
    let d = devices(&[("cpu", &[("type", "4\n")])]);
    assert!(detect(d.path()).unwrap_err().contains("no mem-loads event"));
    // A format the agent cannot place.
    let d = devices(&[(
        "cpu",
        &[
            ("type", "4\n"),
            ("events/mem-loads", "event=0xcd,frontend=0x1\n"),
            ("format/event", "config:0-7\n"),
            ("format/frontend", "config3:0-23\n"),
        ],
    )]);
    assert!(detect(d.path()).unwrap_err().contains("config3"));
}

#[test]
fn this_machine_reports_its_own_answer() {
    // Whatever the host has, detection answers without panicking; a refusal names
    // the sysfs folder.
    match detect(Path::new(DEVICES)) {
        Ok(s) => assert!(s.pmu_type > 0),
        Err(why) => assert!(why.contains("/sys/bus/event_source/devices"), "{why}"),
    }
}

fn data_src(op: u32, lvl: u32, lvl_num: u32, remote: bool) -> u64 {
    u64::from(op) << sys::PERF_MEM_OP_SHIFT
        | u64::from(lvl) << sys::PERF_MEM_LVL_SHIFT
        | u64::from(lvl_num) << sys::PERF_MEM_LVLNUM_SHIFT
        | u64::from(remote) << sys::PERF_MEM_REMOTE_SHIFT
}

const LOAD: u32 = sys::PERF_MEM_OP_LOAD;
const HIT: u32 = sys::PERF_MEM_LVL_HIT;

#[test]
fn data_sources_old_and_new_encodings() {
    let na = sys::PERF_MEM_LVLNUM_NA;
    // Older encoding (level bits), as Intel PEBS writes it.
    let rem = data_src(LOAD, HIT | sys::PERF_MEM_LVL_REM_RAM1, na, false);
    assert_eq!(served(rem), Some(Served::RemoteDram));
    let loc = data_src(LOAD, HIT | sys::PERF_MEM_LVL_LOC_RAM, na, false);
    assert_eq!(served(loc), Some(Served::LocalDram));
    let l3 = data_src(LOAD, HIT | sys::PERF_MEM_LVL_L3, na, false);
    assert_eq!(served(l3), Some(Served::Cache));
    let cce = data_src(LOAD, HIT | sys::PERF_MEM_LVL_REM_CCE1, na, false);
    assert_eq!(served(cce), Some(Served::Cache));
    let miss = data_src(
        LOAD,
        sys::PERF_MEM_LVL_MISS | sys::PERF_MEM_LVL_L3,
        na,
        false,
    );
    assert_eq!(served(miss), Some(Served::Unknown));
    // Newer encoding (level number and remote bit), as AMD IBS and newer Intel do.
    let ram = sys::PERF_MEM_LVLNUM_RAM;
    assert_eq!(
        served(data_src(LOAD, 0, ram, true)),
        Some(Served::RemoteDram)
    );
    assert_eq!(
        served(data_src(LOAD, 0, ram, false)),
        Some(Served::LocalDram)
    );
    let any = sys::PERF_MEM_LVLNUM_ANY_CACHE;
    assert_eq!(served(data_src(LOAD, 0, any, true)), Some(Served::Cache));
    // A store is not a load.
    let store = data_src(
        sys::PERF_MEM_OP_STORE,
        HIT | sys::PERF_MEM_LVL_REM_RAM1,
        na,
        false,
    );
    assert_eq!(served(store), None);
}

/// A PERF_RECORD_SAMPLE of [`SAMPLE_TYPE`] as the kernel writes it.
fn sample_record(tid: u32, time: u64, weight: u64, src: u64) -> Vec<u8> {
    let mut r = Vec::new();
    r.extend(sys::PERF_RECORD_SAMPLE.to_ne_bytes());
    r.extend(0u16.to_ne_bytes());
    r.extend(40u16.to_ne_bytes());
    r.extend(7u32.to_ne_bytes()); // pid
    r.extend(tid.to_ne_bytes());
    r.extend(time.to_ne_bytes());
    r.extend(weight.to_ne_bytes());
    r.extend(src.to_ne_bytes());
    r
}

fn lost_record(n: u64) -> Vec<u8> {
    let mut r = Vec::new();
    r.extend(sys::PERF_RECORD_LOST.to_ne_bytes());
    r.extend(0u16.to_ne_bytes());
    r.extend(24u16.to_ne_bytes());
    r.extend(1u64.to_ne_bytes()); // id
    r.extend(n.to_ne_bytes());
    r
}

#[test]
fn a_ring_of_samples_lost_records_and_damage() {
    let ram = sys::PERF_MEM_LVLNUM_RAM;
    let far = data_src(LOAD, 0, ram, true);
    let near = data_src(LOAD, 0, ram, false);
    let mut ring = sample_record(9, 100, 300, far);
    ring.extend(lost_record(5));
    // A weight struct: latency in the low 32 bits, instruction latency above.
    ring.extend(sample_record(9, 200, (12 << 32) | 0xfa, near));
    // An unknown record type (PERF_RECORD_COMM) is skipped.
    ring.extend(3u32.to_ne_bytes());
    ring.extend(0u16.to_ne_bytes());
    ring.extend(16u16.to_ne_bytes());
    ring.extend(0u64.to_ne_bytes());
    let r = parse_records(&ring);
    assert_eq!(r.lost, 5);
    assert!(!r.damaged);
    assert_eq!(r.samples.len(), 2);
    assert_eq!(
        r.samples[0],
        MemSample {
            pid: 7,
            tid: 9,
            time_ns: 100,
            weight: 300,
            data_src: far
        }
    );
    assert_eq!(r.samples[1].weight, 250);
    // Cut short: what came before is kept, the rest marked damaged.
    let r = parse_records(&ring[..ring.len() - 4]);
    assert!(r.damaged);
    assert_eq!(r.samples.len(), 2);
}

#[test]
fn a_step_from_its_remote_dram_samples() {
    let ram = sys::PERF_MEM_LVLNUM_RAM;
    let far = data_src(LOAD, 0, ram, true);
    let near = data_src(LOAD, 0, ram, false);
    let l1 = data_src(
        LOAD,
        HIT | sys::PERF_MEM_LVL_L1,
        sys::PERF_MEM_LVLNUM_NA,
        false,
    );
    let s = |t, w, src| MemSample {
        pid: 1,
        tid: 1,
        time_ns: t,
        weight: w,
        data_src: src,
    };
    let samples = [
        s(5, 900, far),
        s(10, 400, far),
        s(20, 200, near),
        s(30, 5, l1),
        s(40, 500, far),
    ];
    let step = measure(&samples, 10, 40, 1000);
    assert_eq!((step.dram_samples, step.remote_samples), (2, 1));
    assert_eq!(step.share(), Some(0.5));
    // 400 cycles × 1000 loads at 2 GHz: 200 µs.
    assert_eq!(step.remote_cycles, 400_000);
    assert_eq!(step.stall_ns(2_000_000), Some(200_000));
    assert_eq!(step.stall_ns(0), None);
    // No DRAM load sampled: no share (not 0).
    let none = measure(&samples, 25, 35, 1000);
    assert_eq!(none.share(), None);
    let json = serde_json::to_value(step).unwrap();
    assert_eq!(json["share"], 0.5);
    assert_eq!(json["remote_samples"], 1);
    assert!(serde_json::to_value(none).unwrap()["share"].is_null());
}
