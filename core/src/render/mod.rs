//! Render stage: one module per output format, each writing to any `impl Write`.
pub mod flamegraph;
pub(crate) mod json;
pub mod steps;
pub mod summary;
pub mod trace;

/// Golden-file check for renderer tests: compares `actual` with `tests/data/golden/NAME`,
/// or rewrites the file when `NCCLTRACE_BLESS=1`.
#[cfg(test)]
pub(crate) fn golden(name: &str, actual: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/golden")
        .join(name);
    if std::env::var_os("NCCLTRACE_BLESS").is_some_and(|v| v == "1") {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, actual).unwrap();
        return;
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with NCCLTRACE_BLESS=1 to create it",
            path.display()
        )
    });
    assert_eq!(
        actual, expected,
        "{name} differs from its golden file (NCCLTRACE_BLESS=1 to update)"
    );
}

#[cfg(test)]
pub(crate) mod fixture {
    //! A small, fixed timeline for renderer golden tests.
    use crate::attribute::{Cat, Detail, OffCpu, StackKey, ThreadDetail};
    use crate::event::{Call, Func, Task};
    use crate::symbolize::Symbols;

    #[allow(clippy::too_many_lines)] // a literal timeline
    pub fn detail() -> (Detail, Symbols) {
        let stacks = vec![
            StackKey {
                pid: 10,
                kstack: vec![],
                ustack: vec![0x1010, 0x1100, 0x1200],
                py: vec![],
            },
            StackKey {
                pid: 10,
                kstack: vec![0xffff_0010, 0xffff_0020],
                ustack: vec![0x1010, 0x1100, 0x1200],
                py: vec![],
            },
            StackKey {
                pid: 10,
                kstack: vec![0xffff_0030],
                ustack: vec![0x2000, 0x1300, 0x1200],
                py: vec![],
            },
        ];
        let rank = ThreadDetail {
            tid: 10,
            pid: 10,
            name: "trainer".into(),
            role: "main (rank)",
            segments: vec![
                (0, 4_000_000, Cat::Compute),
                (4_000_000, 7_000_000, Cat::NcclWait),
                (7_000_000, 8_000_000, Cat::Runqueue),
            ],
            samples: vec![
                (1_000_000, 0, Cat::Compute, 1_000_000),
                (2_000_000, 1, Cat::PageFault, 1_000_000),
                (3_000_000, 0, Cat::Compute, 1_000_000),
            ],
            offcpu: vec![
                OffCpu {
                    start_ns: 4_500_000,
                    end_ns: 6_500_000,
                    runnable: false,
                    stack: Some(2),
                    waker: Some((11, 10)),
                    woken_ns: Some(6_400_000),
                },
                OffCpu {
                    start_ns: 7_000_000,
                    end_ns: 8_000_000,
                    runnable: true,
                    stack: Some(0),
                    waker: None,
                    woken_ns: None,
                },
            ],
            migrations: vec![(7_000_000, 0, 1)],
            faults: vec![1_900_000, 1_950_000, 2_100_000],
            call_stacks: Vec::new(),
            open: None,
        };
        let call = |func, start, end| Call {
            count: (func == Func::AllReduce).then_some(1024),
            datatype: (func == Func::AllReduce).then_some(7),
            bytes: (func == Func::AllReduce).then_some(4096),
            redop: (func == Func::AllReduce).then_some(0),
            comm: (func == Func::AllReduce).then_some(0xc0),
            stream: Some(0x50),
            ..Call::new(
                Task {
                    tgid: 10,
                    tid: 10,
                    cpu: 0,
                },
                func,
                start,
                end,
            )
        };
        let detail = Detail {
            first_ns: 0,
            end_ns: 8_000_000,
            threads: vec![rank],
            stacks,
            calls: vec![
                call(Func::AllReduce, 3_900_000, 3_910_000),
                call(Func::CuStreamSynchronize, 4_000_000, 7_000_000),
            ]
            .into(),
            cpu_nodes: vec![0, 1],
            sample_period_ns: 1_000_000,
            offcpu_min_ns: 0,
            step_bounds: vec![(0, 8_000_000)],
            rank_tid: Some(10),
            rank_pid: Some(10),
        };
        let mut symbols = Symbols::default();
        for (addr, name) in [
            (0x1010, "compute"),
            (0x1100, "main"),
            (0x1200, "__libc_start_main"),
            (0x2000, "nanosleep"),
            (0x1300, "cuStreamSynchronize"),
        ] {
            symbols.user.insert((10, addr), name.to_owned());
        }
        for (addr, name) in [
            (0xffff_0010, "clear_page_erms"),
            (0xffff_0020, "exc_page_fault"),
            (0xffff_0030, "schedule"),
        ] {
            symbols.kernel.insert(addr, name.to_owned());
        }
        (detail, symbols)
    }
}
