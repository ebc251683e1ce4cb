//! Reused stacks: `StackSame` records standing for a thread's previous native frames and
//! Python walks, by stack kind.

use super::*;

/// `StackSame` records (`reuse_stacks`) stand for the native frames of the thread's
/// previous stack of that kind, with the Python frames walked for them; one with no
/// earlier stack of its thread leaves its stretch without a stack.
#[test]
fn reused_stacks_take_the_threads_previous_native_frames() {
    let mut tl = Timeline::new(&Setup::from(&header()));
    let py = |code: u64, ts: u64, tid: u32| py_stack(ts, tid, code, Some(0));
    let same = |ts: u64, tid: u32| stack_same(ts, tid, nccltrace_common::kind::OFFCPU);
    let mut events = vec![];
    for k in 0..4u64 {
        let out = 1_000_000 + k * 2_000_000;
        events.push(switch(out, true, 1));
        // The Python frames change at the third stretch: the native ones are reused.
        events.push(py(if k < 2 { 0x100 } else { 0x200 }, out, 10));
        events.push(if k == 0 {
            Event::OffCpu {
                ts_ns: out,
                task: task(10),
                kstack: vec![],
                ustack: vec![7, 8],
            }
        } else {
            same(out, 10)
        });
        events.push(switch(out + 1_000_000, false, 0));
    }
    // Another thread's reused stack with nothing before it.
    events.push(same(2_500_000, 11));
    events.sort_by_key(Event::ts_ns);
    for e in &events {
        tl.push(e);
    }
    let (_, detail) = tl.finish(10_000_000, StepRule::Window(1_000_000));
    let thread = detail.threads.iter().find(|t| t.tid == 10).unwrap();
    let stacks: Vec<&detail::StackKey> = thread
        .offcpu
        .iter()
        .map(|o| &detail.stacks[o.stack.expect("every stretch has its stack") as usize])
        .collect();
    assert_eq!(stacks.len(), 4, "{:?}", thread.offcpu);
    for (k, s) in stacks.iter().enumerate() {
        assert_eq!(s.ustack, vec![7, 8], "stretch {k}");
        let code = if k < 2 { 0x100 } else { 0x200 };
        assert_eq!(s.py, vec![PyFrame { code, offset: 4 }], "stretch {k}");
    }
    assert!(
        detail
            .threads
            .iter()
            .filter(|t| t.tid == 11)
            .all(|t| t.offcpu.iter().all(|o| o.stack.is_none()))
    );
}

/// Since format 5 a thread keeps two walks, one for its call-entry stacks and one for its
/// off-CPU stacks: a training loop enters its sync at one line and blocks at another
/// (in backward), and each reused walk stands for the last of its own kind.
#[test]
fn reused_python_frames_are_kept_by_stack_kind() {
    use nccltrace_common::kind::{CALL_STACK, OFFCPU, PY_FRAMES};
    let mut tl = Timeline::new(&Setup::from(&header()));
    let mut events = vec![];
    for k in 0..3u64 {
        let at = 1_000_000 + k * 3_000_000;
        // The sync's entry at code 0x100, then a block at code 0x200.
        let (entry, out) = (at, at + 1_000_000);
        // Walked the first time, reused after.
        let python = |ts: u64, code: u64, with: u16| {
            if k == 0 {
                py_stack(ts, 10, code, Some(with))
            } else {
                py_same(ts, 10, PY_FRAMES, with)
            }
        };
        events.push(python(entry, 0x100, CALL_STACK));
        events.push(Event::CallStack {
            ts_ns: entry,
            task: task(10),
            ustack: vec![1, 2],
        });
        events.push(switch(out, true, 1));
        events.push(python(out, 0x200, OFFCPU));
        events.push(Event::OffCpu {
            ts_ns: out,
            task: task(10),
            kstack: vec![],
            ustack: vec![7, 8],
        });
        events.push(switch(out + 1_000_000, false, 0));
    }
    events.sort_by_key(Event::ts_ns);
    for e in &events {
        tl.push(e);
    }
    let (_, detail) = tl.finish(10_000_000, StepRule::Window(1_000_000));
    let thread = detail.threads.iter().find(|t| t.tid == 10).unwrap();
    let frame = |code: u64| vec![PyFrame { code, offset: 4 }];
    let offcpu: Vec<&Vec<PyFrame>> = thread
        .offcpu
        .iter()
        .map(|o| &detail.stacks[o.stack.expect("every stretch has its stack") as usize].py)
        .collect();
    assert_eq!(offcpu, vec![&frame(0x200); 3]);
    let calls: Vec<&Vec<PyFrame>> = detail
        .stacks
        .iter()
        .filter(|s| s.ustack == vec![1, 2])
        .map(|s| &s.py)
        .collect();
    assert_eq!(
        calls,
        vec![&frame(0x100)],
        "one call-entry stack, its frames the sync's"
    );
}

/// `StackSame` records of Python frames stand for the thread's previous keyed walk (an
/// off-CPU or call-entry stack's, not a sample's); one with no earlier walk of its thread
/// leaves the stack without Python frames. Format 4: one walk kept a thread for both.
#[test]
fn reused_python_frames_take_the_threads_previous_walk() {
    let mut tl = Timeline::new(&Setup::from(&header()));
    let same = |ts: u64, tid: u32| stack_same(ts, tid, nccltrace_common::kind::PY_FRAMES);
    let mut events = vec![];
    for k in 0..4u64 {
        let out = 1_000_000 + k * 2_000_000;
        events.push(switch(out, true, 1));
        // Walked whole at the first and third stretches, reused at the others.
        events.push(if k % 2 == 0 {
            py_stack(out, 10, 0x100 * (k + 1), Some(0))
        } else {
            same(out, 10)
        });
        // An on-CPU sample's walk in between: not what the reused frames stand for.
        events.push(py_stack(out + 1_500_000, 10, 0x999, None));
        events.push(Event::Sample {
            ts_ns: out + 1_500_000,
            task: task(10),
            kstack: vec![],
            ustack: vec![5],
        });
        events.push(Event::OffCpu {
            ts_ns: out,
            task: task(10),
            kstack: vec![],
            ustack: vec![7, 8 + k],
        });
        events.push(switch(out + 1_000_000, false, 0));
    }
    // Another thread's reused Python frames with no walk before them.
    events.push(same(2_500_000, 11));
    events.push(Event::OffCpu {
        ts_ns: 2_500_000,
        task: task(11),
        kstack: vec![],
        ustack: vec![9],
    });
    events.sort_by_key(Event::ts_ns);
    for e in &events {
        tl.push(e);
    }
    let (_, detail) = tl.finish(10_000_000, StepRule::Window(1_000_000));
    let thread = detail.threads.iter().find(|t| t.tid == 10).unwrap();
    let py: Vec<&Vec<PyFrame>> = thread
        .offcpu
        .iter()
        .map(|o| &detail.stacks[o.stack.expect("every stretch has its stack") as usize].py)
        .collect();
    let frame = |code: u64| vec![PyFrame { code, offset: 4 }];
    assert_eq!(
        py,
        vec![&frame(0x100), &frame(0x100), &frame(0x300), &frame(0x300)]
    );
    let other = detail.stacks.iter().find(|s| s.ustack == vec![9]).unwrap();
    assert!(other.py.is_empty(), "{other:?}");
}

/// Since format 6 a switch record says that the off-CPU stack its thread left with is the
/// previous one's (`offcpu_same`), where `StackSame` records said it before: `Some(true)`
/// for the native and the Python frames, `Some(false)` for the native frames alone, after
/// a Python walk of their own.
#[test]
fn a_switch_record_says_its_stack_was_reused() {
    use nccltrace_common::kind::OFFCPU;
    let mut tl = Timeline::new(&Setup::from(&header()));
    let folded = |ts: u64, python: bool| {
        let mut e = switch(ts, true, 1);
        if let Event::Switch { offcpu_same, .. } = &mut e {
            *offcpu_same = Some(python);
        }
        e
    };
    let mut events = vec![];
    for k in 0..4u64 {
        let out = 1_000_000 + k * 2_000_000;
        match k {
            // Walked and unwound whole, as the kernel writes them: frames, stack, switch.
            0 => {
                events.push(py_stack(out, 10, 0x200, Some(OFFCPU)));
                events.push(Event::OffCpu {
                    ts_ns: out,
                    task: task(10),
                    kstack: vec![],
                    ustack: vec![7, 8],
                });
                events.push(switch(out, true, 1));
            }
            // Both reused.
            1 | 2 => events.push(folded(out, true)),
            // Native frames reused, the Python frames walked again.
            _ => {
                events.push(py_stack(out, 10, 0x300, Some(OFFCPU)));
                events.push(folded(out, false));
            }
        }
        events.push(switch(out + 1_000_000, false, 0));
    }
    for e in &events {
        tl.push(e);
    }
    let (_, detail) = tl.finish(10_000_000, StepRule::Window(1_000_000));
    let thread = detail.threads.iter().find(|t| t.tid == 10).unwrap();
    let stacks: Vec<(Vec<u64>, Vec<u64>)> = thread
        .offcpu
        .iter()
        .map(|o| {
            let s = &detail.stacks[o.stack.expect("every stretch has its stack") as usize];
            (s.ustack.clone(), s.py.iter().map(|f| f.code).collect())
        })
        .collect();
    assert_eq!(
        stacks,
        [
            (vec![7, 8], vec![0x200]),
            (vec![7, 8], vec![0x200]),
            (vec![7, 8], vec![0x200]),
            (vec![7, 8], vec![0x300]),
        ]
    );
}
