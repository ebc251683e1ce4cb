//! Decoding each record kind, and refusing short or damaged ones.

use super::*;
use nccltrace_common::func;

fn call_record(func_id: u32, args: [u64; 8]) -> CallEvent {
    CallEvent {
        hdr: Header {
            ts_ns: 2_000,
            tgid: 10,
            tid: 11,
            kind: kind::CALL,
            cpu: 1,
            _pad: 0,
        },
        start_ns: 1_500,
        func: func_id,
        ret: 0,
        args,
        out: 0xabc,
    }
}

/// ncclAllReduce's count × float32 size gives bytes; comm and stream come from the
/// 6th and 7th arguments (the 7th read from the stack by the kernel program).
#[test]
fn all_reduce_arguments() {
    let rec = call_record(func::NCCL_ALL_REDUCE, [1, 2, 1000, 7, 0, 0x77, 0x88, 0]);
    let Event::Call(c) = decode(&as_bytes(&rec)).unwrap() else {
        panic!("not a call")
    };
    assert_eq!(c.func, Func::AllReduce);
    assert_eq!(c.bytes, Some(4000));
    assert_eq!(c.redop, Some(0));
    assert_eq!((c.comm, c.stream), (Some(0x77), Some(0x88)));
    assert_eq!(c.duration_ns(), 500);
}

/// A collective traced at entry only (`call_returns = "needed"`): the function named
/// without the flag, no return value, no duration; its arguments as usual.
#[test]
fn entry_only_call_has_no_return() {
    let mut rec = call_record(
        func::NCCL_ALL_REDUCE | func::ENTRY_ONLY,
        [1, 2, 1000, 7, 0, 0x77, 0x88, 0],
    );
    rec.hdr.ts_ns = rec.start_ns;
    let Event::Call(c) = decode(&as_bytes(&rec)).unwrap() else {
        panic!("not a call")
    };
    assert_eq!(c.func, Func::AllReduce);
    assert_eq!((c.ret, c.returned(), c.duration_ns()), (None, false, 0));
    assert_eq!((c.bytes, c.comm), (Some(4000), Some(0x77)));
    let Event::Call(c) = decode(&as_bytes(&call_record(func::NCCL_ALL_REDUCE, [0; 8]))).unwrap()
    else {
        panic!("not a call")
    };
    assert_eq!((c.ret, c.returned()), (Some(0), true));
}

/// The agent's own PMU load-sample records decode like the programs' (recordings
/// replay them), and a short one is refused.
#[test]
fn mem_sample_round_trip() {
    let rec = MemSampleEvent {
        hdr: Header {
            ts_ns: 9_000,
            tgid: 10,
            tid: 12,
            kind: kind::MEM_SAMPLE,
            cpu: u16::MAX,
            _pad: 0,
        },
        weight: 420,
        _pad: 0,
        data_src: 0x2_0000_0042,
    };
    let bytes = as_bytes(&rec);
    let Event::MemSample {
        ts_ns,
        task,
        weight,
        data_src,
    } = decode(&bytes).unwrap()
    else {
        panic!("not a load sample")
    };
    assert_eq!((ts_ns, task.tid, task.tgid), (9_000, 12, 10));
    assert_eq!((weight, data_src), (420, 0x2_0000_0042));
    assert!(decode(&bytes[..32]).is_err());
}

/// An InfiniBand reading carries the counters it read, `counters/` and `hw_counters/`
/// alike, in index order; one cut short is refused; the older fixed record of
/// `counters/` alone still decodes.
#[test]
fn infiniband_readings_old_and_new() {
    let counters = |e: Event| match e {
        Event::IbCounters {
            ts_ns,
            port,
            counters,
            ..
        } => (ts_ns, port, counters),
        other => panic!("not a reading: {other:?}"),
    };
    // hw_counters' np_cnp_sent is the last name; given out of order, and one twice.
    let last = u8::try_from(nccltrace_common::IB_COUNTER_NAMES.len() - 1).unwrap();
    let bytes = ib_reading(7_000, 3, &[(last, 9), (0, 1_000), (17, 40), (0, 1_000)]);
    assert_eq!(
        bytes.len(),
        size_of::<nccltrace_common::IbReadingEvent>() + 3 * 8
    );
    assert_eq!(
        counters(decode(&bytes).unwrap()),
        (7_000, 3, vec![(0, 1_000), (17, 40), (last, 9)])
    );
    assert!(matches!(
        decode(&bytes[..bytes.len() - 1]),
        Err(DecodeError::TooShort { .. })
    ));
    let mut old = IbCountersEvent {
        port: 1,
        present: 0b1000_0001,
        ..Default::default()
    };
    old.hdr.kind = kind::IB_COUNTERS;
    old.hdr.ts_ns = 5;
    old.values[0] = 4;
    old.values[7] = 2;
    assert_eq!(
        counters(decode(&as_bytes(&old)).unwrap()),
        (5, 1, vec![(0, 4), (7, 2)])
    );
}

/// A stack-same record names the kind of stack it stands for; any other kind is
/// refused, as is a short record.
#[test]
fn stack_same_names_a_stack_kind() {
    let mut rec = StackSameEvent {
        hdr: Header {
            ts_ns: 5_000,
            tgid: 10,
            tid: 11,
            kind: kind::STACK_SAME,
            cpu: 3,
            _pad: 0,
        },
        of: u32::from(kind::CALL_STACK),
        with: u32::from(kind::CALL_STACK),
    };
    let Event::StackSame {
        ts_ns,
        task,
        of,
        with,
    } = decode(&as_bytes(&rec)).unwrap()
    else {
        panic!("not a stack-same record")
    };
    assert_eq!(
        (ts_ns, task.tid, task.tgid, of, with),
        (5_000, 11, 10, kind::CALL_STACK, 0)
    );
    // Python frames reused: format 4 (one walk kept a thread), then 5 (one per stack kind).
    rec.of = u32::from(kind::PY_FRAMES);
    for with in [0, kind::OFFCPU, kind::CALL_STACK] {
        rec.with = u32::from(with);
        let Event::StackSame { of, with: w, .. } = decode(&as_bytes(&rec)).unwrap() else {
            panic!("not a stack-same record")
        };
        assert_eq!((of, w), (kind::PY_FRAMES, with));
    }
    rec.with = u32::from(kind::SWITCH);
    assert!(decode(&as_bytes(&rec)).is_err());
    rec.with = 0;
    rec.of = u32::from(kind::SWITCH);
    assert_eq!(
        decode(&as_bytes(&rec)),
        Err(DecodeError::NotAStack {
            of: u32::from(kind::SWITCH)
        })
    );
    assert!(decode(&as_bytes(&rec)[..24]).is_err());
}

/// ncclReduce has eight arguments: root 6th, comm 7th, stream 8th.
#[test]
fn reduce_reads_eight_arguments() {
    let rec = call_record(func::NCCL_REDUCE, [1, 2, 10, 8, 2, 3, 0x70, 0x80]);
    let Event::Call(c) = decode(&as_bytes(&rec)).unwrap() else {
        panic!("not a call")
    };
    assert_eq!(c.bytes, Some(80));
    assert_eq!(c.peer, Some(3));
    assert_eq!((c.comm, c.stream), (Some(0x70), Some(0x80)));
}

/// A stream the kernel program left unread (profile `streams = false`) is no stream,
/// not stream 0 (the legacy default stream); the communicator is still there.
#[test]
fn unread_stream_is_none() {
    let rec = call_record(
        func::NCCL_ALL_REDUCE,
        [1, 2, 10, 7, 0, 0x77, NOT_READ, NOT_READ],
    );
    let Event::Call(c) = decode(&as_bytes(&rec)).unwrap() else {
        panic!("not a call")
    };
    assert_eq!((c.comm, c.stream), (Some(0x77), None));
    let rec = call_record(func::NCCL_REDUCE, [1, 2, 10, 8, 2, 3, 0x70, NOT_READ]);
    let Event::Call(c) = decode(&as_bytes(&rec)).unwrap() else {
        panic!("not a call")
    };
    assert_eq!((c.comm, c.stream), (Some(0x70), None));
}

/// The entry program reads the stack only for what the profile asks: ncclReduce's
/// communicator always, streams only with `streams = true`.
#[test]
fn stack_arguments_read() {
    assert_eq!(func::stack_args(func::NCCL_ALL_REDUCE, false), 0);
    assert_eq!(func::stack_args(func::NCCL_ALL_REDUCE, true), 1);
    assert_eq!(func::stack_args(func::NCCL_REDUCE, false), 1);
    assert_eq!(func::stack_args(func::NCCL_REDUCE, true), 2);
    assert_eq!(func::stack_args(func::NCCL_SEND, true), 0);
}

/// ncclCommInitRank passes the 128-byte ncclUniqueId in memory, so rank is the third
/// register argument; the new handle is read through the out pointer; the id's first
/// 16 bytes (read off the stack into the last two slots) name the communicator, and a
/// recording from before they were read (zeros) names none.
#[test]
fn comm_init_rank() {
    assert_eq!(func::stack_args(func::NCCL_COMM_INIT_RANK, false), 2);
    assert_eq!(func::stack_args(func::NCCL_COMM_INIT_RANK_CONFIG, true), 2);
    let rec = call_record(
        func::NCCL_COMM_INIT_RANK,
        [0x1000, 8, 3, 0, 0, 0, 0x5eed, 7],
    );
    let Event::Call(c) = decode(&as_bytes(&rec)).unwrap() else {
        panic!("not a call")
    };
    assert_eq!(
        (c.nranks(), c.rank(), c.new_comm(), c.comm_id()),
        (Some(8), Some(3), Some(0xabc), Some(unique_id(0x5eed, 7)))
    );
    assert_ne!(unique_id(0x5eed, 7), unique_id(0x5eed, 8));
    let old = call_record(func::NCCL_COMM_INIT_RANK, [0x1000, 8, 3, 0, 0, 0, 0, 0]);
    let Event::Call(c) = decode(&as_bytes(&old)).unwrap() else {
        panic!("not a call")
    };
    assert_eq!(c.comm_id(), None);
}

/// Truncated and unknown records are errors, not panics.
#[test]
fn bad_records() {
    assert!(matches!(
        decode(&[0u8; 10]),
        Err(DecodeError::TooShort { .. })
    ));
    let mut rec = call_record(999, [0; 8]);
    assert_eq!(
        decode(&as_bytes(&rec)),
        Err(DecodeError::UnknownFunc { id: 999 })
    );
    rec.hdr.kind = 77;
    assert_eq!(
        decode(&as_bytes(&rec)),
        Err(DecodeError::UnknownKind { kind: 77 })
    );
    let short = &as_bytes(&call_record(func::NCCL_SEND, [0; 8]))[..60];
    assert!(matches!(decode(short), Err(DecodeError::TooShort { .. })));
}

/// A keyed Python walk says which of its thread's kept walks it is: format 4's one for
/// both (`PY_KEYED` alone), or since format 5 its call-entry or its off-CPU stacks'.
#[test]
fn keyed_python_walks_name_their_stack_kind() {
    use nccltrace_common::{
        PY_DEPTH, PY_KEYED, PY_KEYED_CALL, PY_KEYED_OFFCPU, PY_TRUNCATED, PyFramesEvent,
    };
    let mut e = PyFramesEvent {
        hdr: Header {
            ts_ns: 7_000,
            tgid: 10,
            tid: 11,
            kind: kind::PY_FRAMES,
            cpu: 0,
            _pad: 0,
        },
        len: 1,
        truncated: 0,
        entries: 0,
        codes: [0x100; PY_DEPTH],
        offsets: [4; PY_DEPTH],
    };
    for (flags, want) in [
        (0, None),
        (PY_KEYED, Some(0)),
        (PY_KEYED | PY_KEYED_CALL, Some(kind::CALL_STACK)),
        (PY_KEYED | PY_KEYED_OFFCPU, Some(kind::OFFCPU)),
        (
            PY_TRUNCATED | PY_KEYED | PY_KEYED_OFFCPU,
            Some(kind::OFFCPU),
        ),
    ] {
        e.truncated = flags;
        let Event::PyStack {
            keyed, truncated, ..
        } = decode(&as_bytes(&e)).unwrap()
        else {
            panic!("not a Python stack")
        };
        assert_eq!(keyed, want, "flags {flags:#b}");
        assert_eq!(truncated, flags & PY_TRUNCATED != 0);
    }
}

/// A switch record's flags: which task is a target, and (format 6) whether the off-CPU
/// stack of the task switched out was reused whole, its Python frames with it or not.
#[test]
fn switch_flags_say_the_reused_offcpu_stack() {
    use nccltrace_common::switch_flags::{NEXT_TARGET, OFFCPU_PY_SAME, OFFCPU_SAME, PREV_TARGET};
    let decoded = |flags: u32| {
        let rec = SwitchEvent {
            hdr: Header {
                ts_ns: 5_000,
                tgid: 10,
                tid: 11,
                kind: kind::SWITCH,
                cpu: 2,
                _pad: 0,
            },
            prev_tid: 11,
            next_tid: 12,
            prev_state: 1,
            next_tgid: 10,
            flags,
        };
        let Event::Switch {
            prev_is_target,
            next_is_target,
            offcpu_same,
            ..
        } = decode(&as_bytes(&rec)).unwrap()
        else {
            panic!("not a switch");
        };
        (prev_is_target, next_is_target, offcpu_same)
    };
    assert_eq!(decoded(PREV_TARGET), (true, false, None));
    assert_eq!(decoded(NEXT_TARGET), (false, true, None));
    assert_eq!(
        decoded(PREV_TARGET | NEXT_TARGET | OFFCPU_SAME),
        (true, true, Some(false))
    );
    assert_eq!(
        decoded(PREV_TARGET | OFFCPU_SAME | OFFCPU_PY_SAME),
        (true, false, Some(true))
    );
}
