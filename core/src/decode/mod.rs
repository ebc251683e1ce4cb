//! Decode stage: raw kernel records (as the ring buffer and the recording hold them) into
//! the event model. Pure; the only place that knows the record layouts and the NCCL ABI.

use nccltrace_common::{
    CallEvent, FaultEvent, FaultTimeEvent, Header, IbCountersEvent, IbReadingEvent, KSTACK_DEPTH,
    MemSampleEvent, MigrateEvent, NOT_READ, NodeLoadsEvent, NumaHintEvent, NumaPagesEvent,
    NumaTaskEvent, PY_DEPTH, PageMigrationEvent, PyFramesEvent, PyStackEvent, SampleEvent,
    StackSameEvent, SwitchEvent, TaskEvent, USTACK_DEPTH, WakeupEvent, kind, numa_hint, numa_task,
    switch_flags,
};

use crate::event::{Call, CallExtra, Event, Func, NumaTaskKind, PyFrame, Task, datatype_size};

/// A record that cannot be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DecodeError {
    #[error("record of {len} bytes is shorter than its {what} ({expected} bytes)")]
    TooShort {
        what: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("unknown record kind {kind}")]
    UnknownKind { kind: u16 },
    #[error("unknown traced function id {id}")]
    UnknownFunc { id: u32 },
    #[error("stack-same record for kind {of}, which is not a stack record")]
    NotAStack { of: u32 },
}

/// Fails unless `bytes` hold a whole `T`.
fn long_enough<T>(bytes: &[u8], what: &'static str) -> Result<(), DecodeError> {
    let expected = size_of::<T>();
    if bytes.len() < expected {
        return Err(DecodeError::TooShort {
            what,
            len: bytes.len(),
            expected,
        });
    }
    Ok(())
}

fn read<T: Copy>(bytes: &[u8], what: &'static str) -> Result<T, DecodeError> {
    long_enough::<T>(bytes, what)?;
    // SAFETY: length checked; T is a #[repr(C)] integer-only record from nccltrace-common,
    // valid for any bit pattern; read_unaligned because ring-buffer slices are 8-aligned
    // but recording buffers need not be.
    Ok(unsafe { bytes.as_ptr().cast::<T>().read_unaligned() })
}

/// The record's kind, from its header.
pub fn record_kind(bytes: &[u8]) -> Result<u16, DecodeError> {
    Ok(read::<Header>(bytes, "header")?.kind)
}

fn task(h: &Header) -> Task {
    Task {
        tgid: h.tgid,
        tid: h.tid,
        cpu: h.cpu,
    }
}

/// A communicator's name from the first 16 bytes of its ncclUniqueId (FNV-1a over them).
#[must_use]
pub fn unique_id(a: u64, b: u64) -> u64 {
    a.to_le_bytes()
        .iter()
        .chain(&b.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, byte| {
            (h ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
        })
}

/// Bytes before the frames of a stack record, in both layouts.
const STACK_HEAD: usize = std::mem::offset_of!(SampleEvent, kstack);
/// Where the parts of a Python stack record lie ([`PyStackEvent`] or [`PyFramesEvent`]).
#[derive(Clone, Copy)]
struct PyShape {
    /// Bytes before the code objects, in both layouts.
    head: usize,
    /// Where the offsets begin in the ring buffer's layout, and its size.
    offsets: usize,
    size: usize,
}

const PY_STACK_SHAPE: PyShape = PyShape {
    head: std::mem::offset_of!(PyStackEvent, codes),
    offsets: std::mem::offset_of!(PyStackEvent, offsets),
    size: size_of::<PyStackEvent>(),
};

const PY_FRAMES_SHAPE: PyShape = PyShape {
    head: std::mem::offset_of!(PyFramesEvent, codes),
    offsets: std::mem::offset_of!(PyFramesEvent, offsets),
    size: size_of::<PyFramesEvent>(),
};

/// A little-endian `u32` of `bytes` at `at` (in range).
fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or_default())
}

/// (kernel frames, user frames, where each begins) of a stack record as the ring buffer
/// holds it (every slot, 800 bytes) or as the recording keeps it ([`compact`]: the frames
/// in use only, user frames right after the kernel's).
fn stack_layout(bytes: &[u8]) -> Result<(usize, usize, usize, usize), DecodeError> {
    long_enough::<[u8; STACK_HEAD]>(bytes, "stack record's header")?;
    let k =
        (u32_at(bytes, std::mem::offset_of!(SampleEvent, kstack_len)) as usize).min(KSTACK_DEPTH);
    let u =
        (u32_at(bytes, std::mem::offset_of!(SampleEvent, ustack_len)) as usize).min(USTACK_DEPTH);
    if bytes.len() >= size_of::<SampleEvent>() {
        return Ok((k, u, STACK_HEAD, std::mem::offset_of!(SampleEvent, ustack)));
    }
    let expected = STACK_HEAD + 8 * (k + u);
    if bytes.len() < expected {
        return Err(DecodeError::TooShort {
            what: "compact stack record",
            len: bytes.len(),
            expected,
        });
    }
    Ok((k, u, STACK_HEAD, STACK_HEAD + 8 * k))
}

/// (frames, where the code objects and the offsets begin) of a Python stack record, in
/// the ring buffer's layout or the recording's compact one (as [`stack_layout`]).
fn py_layout(bytes: &[u8], shape: PyShape) -> Result<(usize, usize, usize), DecodeError> {
    if bytes.len() < shape.head {
        return Err(DecodeError::TooShort {
            what: "python stack record's header",
            len: bytes.len(),
            expected: shape.head,
        });
    }
    let n = (u32_at(bytes, std::mem::offset_of!(PyStackEvent, len)) as usize).min(PY_DEPTH);
    if bytes.len() >= shape.size {
        return Ok((n, shape.head, shape.offsets));
    }
    let expected = shape.head + 12 * n;
    if bytes.len() < expected {
        return Err(DecodeError::TooShort {
            what: "compact python stack record",
            len: bytes.len(),
            expected,
        });
    }
    Ok((n, shape.head, shape.head + 8 * n))
}

/// The shape of a Python stack record of kind `kind`.
fn py_shape(kind: u16) -> PyShape {
    if kind == kind::PY_FRAMES {
        PY_FRAMES_SHAPE
    } else {
        PY_STACK_SHAPE
    }
}

/// What the recording keeps of a kernel record, in order: a stack or Python stack record
/// as the ring buffer holds it (every slot) without the slots not in use (a stack of 6
/// frames: 80 bytes, not 800); `None` for any other record, kept whole. [`decode`] reads
/// both layouts; a record whose every slot is in use is the same bytes in both.
#[must_use]
pub fn compact(bytes: &[u8]) -> Option<[&[u8]; 2]> {
    let kind = record_kind(bytes).ok()?;
    match kind {
        kind::SAMPLE | kind::OFFCPU | kind::CALL_STACK
            if bytes.len() == size_of::<SampleEvent>() =>
        {
            let (k, u, kstack_at, ustack_at) = stack_layout(bytes).ok()?;
            Some([
                &bytes[..kstack_at + 8 * k],
                &bytes[ustack_at..ustack_at + 8 * u],
            ])
        }
        kind::PY_STACK | kind::PY_FRAMES if bytes.len() == py_shape(kind).size => {
            let (n, codes_at, offsets_at) = py_layout(bytes, py_shape(kind)).ok()?;
            Some([
                &bytes[..codes_at + 8 * n],
                &bytes[offsets_at..offsets_at + 4 * n],
            ])
        }
        _ => None,
    }
}

/// Decodes one raw record.
#[allow(clippy::many_single_char_names, clippy::too_many_lines)] // one short arm per kind
pub fn decode(bytes: &[u8]) -> Result<Event, DecodeError> {
    let h = read::<Header>(bytes, "header")?;
    let t = task(&h);
    Ok(match h.kind {
        kind::CALL => Event::Call(decode_call(&read::<CallEvent>(bytes, "call record")?)?),
        kind::SWITCH => {
            let e = read::<SwitchEvent>(bytes, "sched_switch record")?;
            Event::Switch {
                ts_ns: h.ts_ns,
                task: t,
                prev_tid: e.prev_tid,
                next_tid: e.next_tid,
                next_tgid: e.next_tgid,
                prev_state: e.prev_state,
                prev_is_target: e.flags & switch_flags::PREV_TARGET != 0,
                next_is_target: e.flags & switch_flags::NEXT_TARGET != 0,
                offcpu_same: (e.flags & switch_flags::OFFCPU_SAME != 0)
                    .then_some(e.flags & switch_flags::OFFCPU_PY_SAME != 0),
            }
        }
        kind::WAKEUP => {
            let e = read::<WakeupEvent>(bytes, "sched_waking record")?;
            Event::Wakeup {
                ts_ns: h.ts_ns,
                task: t,
                waker_tid: e.waker_tid,
                waker_tgid: e.waker_tgid,
            }
        }
        kind::MIGRATE => {
            let e = read::<MigrateEvent>(bytes, "sched_migrate_task record")?;
            Event::Migrate {
                ts_ns: h.ts_ns,
                task: t,
                orig_cpu: e.orig_cpu as i32,
                dest_cpu: e.dest_cpu as i32,
            }
        }
        kind::FORK => {
            let e = read::<TaskEvent>(bytes, "fork record")?;
            Event::Fork {
                ts_ns: h.ts_ns,
                task: t,
                child_tid: e.child_tid,
            }
        }
        kind::EXIT => {
            let e = read::<TaskEvent>(bytes, "exit record")?;
            Event::Exit {
                ts_ns: h.ts_ns,
                task: t,
                group_dead: e.group_dead != 0,
            }
        }
        kind::FAULT => {
            let e = read::<FaultEvent>(bytes, "page fault record")?;
            Event::Fault {
                ts_ns: h.ts_ns,
                task: t,
                address: e.address,
                ip: e.ip,
                error_code: e.error_code,
            }
        }
        kind::FAULT_TIME => {
            let e = read::<FaultTimeEvent>(bytes, "timed page fault record")?;
            Event::FaultTime {
                ts_ns: h.ts_ns,
                task: t,
                start_ns: e.start_ns.min(h.ts_ns),
                address: e.address,
            }
        }
        kind::PAGE_MIGRATION => {
            let e = read::<PageMigrationEvent>(bytes, "page migration record")?;
            Event::PageMigration {
                ts_ns: h.ts_ns,
                task: t,
                succeeded: e.succeeded,
                failed: e.failed,
                mode: e.mode,
                reason: e.reason,
            }
        }
        kind::NUMA_TASK => {
            let e = read::<NumaTaskEvent>(bytes, "NUMA task record")?;
            let kind = match e.subkind {
                numa_task::SWAP => NumaTaskKind::Swap,
                numa_task::STICK => NumaTaskKind::Stick,
                _ => NumaTaskKind::Move,
            };
            Event::NumaTask {
                ts_ns: h.ts_ns,
                task: t,
                kind,
                src_cpu: e.src_cpu,
                src_nid: e.src_nid,
                dst_cpu: e.dst_cpu,
                dst_nid: e.dst_nid,
            }
        }
        kind::NUMA_HINT => {
            let e = read::<NumaHintEvent>(bytes, "NUMA hinting fault record")?;
            Event::NumaHint {
                ts_ns: h.ts_ns,
                task: t,
                cpu: h.cpu,
                mem_node: e.mem_node,
                pages: u32::try_from(e.pages).unwrap_or(0),
                local: e.flags & numa_hint::LOCAL != 0,
                migrated: e.flags & numa_hint::MIGRATED != 0,
            }
        }
        kind::MEM_SAMPLE => {
            let e = read::<MemSampleEvent>(bytes, "PMU load sample record")?;
            Event::MemSample {
                ts_ns: h.ts_ns,
                task: t,
                weight: e.weight,
                data_src: e.data_src,
            }
        }
        kind::NODE_LOADS => {
            let e = read::<NodeLoadsEvent>(bytes, "node-load counters record")?;
            Event::NodeLoads {
                ts_ns: h.ts_ns,
                task: t,
                dram: e.dram,
                remote: e.remote,
                multiplexed: e.running_ns < e.enabled_ns,
                full: e.flags & nccltrace_common::node_loads::FULL != 0,
            }
        }
        kind::NUMA_PAGES => {
            let e = read::<NumaPagesEvent>(bytes, "resident pages record")?;
            let nodes = (e.nodes as usize).min(e.kib.len());
            Event::NumaPages {
                ts_ns: h.ts_ns,
                task: t,
                kib: e.kib[..nodes].to_vec(),
            }
        }
        kind::COMM_SIZE => {
            let e = read::<nccltrace_common::CommSizeEvent>(bytes, "communicator size record")?;
            Event::CommSize {
                ts_ns: h.ts_ns,
                task: t,
                comm: e.comm,
                nranks: e.nranks,
                rank: (e.rank >= 0).then_some(e.rank),
            }
        }
        kind::IB_COUNTERS => {
            let e = read::<IbCountersEvent>(bytes, "InfiniBand counters record")?;
            Event::IbCounters {
                ts_ns: h.ts_ns,
                task: t,
                port: e.port,
                counters: (0..e.values.len())
                    .filter(|&i| e.present & (1 << i) != 0)
                    .map(|i| (i as u8, e.values[i]))
                    .collect(),
            }
        }
        kind::IB_READING => {
            let e = read::<IbReadingEvent>(bytes, "InfiniBand reading")?;
            let head = size_of::<IbReadingEvent>();
            let values = &bytes[head..];
            let n = e.present.count_ones() as usize;
            if values.len() < n * 8 {
                return Err(DecodeError::TooShort {
                    what: "InfiniBand reading's values",
                    len: bytes.len(),
                    expected: head + n * 8,
                });
            }
            let bits = (0..64u8).filter(|&i| e.present & (1 << i) != 0);
            Event::IbCounters {
                ts_ns: h.ts_ns,
                task: t,
                port: e.port,
                counters: bits
                    .zip(values.chunks_exact(8))
                    .map(|(i, v)| (i, u64::from_le_bytes(v.try_into().unwrap_or_default())))
                    .collect(),
            }
        }
        kind::GPU_READING => Event::Gpu {
            ts_ns: h.ts_ns,
            task: t,
            reading: crate::event::GpuReading::of(&read::<nccltrace_common::GpuReadingEvent>(
                bytes,
                "GPU reading",
            )?),
        },
        kind::STACK_SAME => {
            let e = read::<StackSameEvent>(bytes, "stack-same record")?;
            let of = u16::try_from(e.of)
                .ok()
                .filter(|of| matches!(*of, kind::OFFCPU | kind::CALL_STACK | kind::PY_FRAMES))
                .ok_or(DecodeError::NotAStack { of: e.of })?;
            // Before format 5 the field was padding (0); of native frames, `of` itself.
            let with = u16::try_from(e.with)
                .ok()
                .filter(|w| matches!(*w, 0 | kind::OFFCPU | kind::CALL_STACK))
                .ok_or(DecodeError::NotAStack { of: e.with })?;
            Event::StackSame {
                ts_ns: h.ts_ns,
                task: t,
                of,
                with: if of == kind::PY_FRAMES { with } else { 0 },
            }
        }
        kind::SAMPLE | kind::OFFCPU | kind::CALL_STACK => {
            // The frames in use, straight from the record (not copying its 800 bytes).
            let (k, u, kstack_at, ustack_at) = stack_layout(bytes)?;
            let frames = |at: usize, n: usize| -> Vec<u64> {
                bytes[at..at + 8 * n]
                    .chunks_exact(8)
                    .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect()
            };
            let (kstack, ustack) = (frames(kstack_at, k), frames(ustack_at, u));
            if h.kind == kind::SAMPLE {
                Event::Sample {
                    ts_ns: h.ts_ns,
                    task: t,
                    kstack,
                    ustack,
                }
            } else if h.kind == kind::CALL_STACK {
                Event::CallStack {
                    ts_ns: h.ts_ns,
                    task: t,
                    ustack,
                }
            } else {
                Event::OffCpu {
                    ts_ns: h.ts_ns,
                    task: t,
                    kstack,
                    ustack,
                }
            }
        }
        kind::PY_STACK | kind::PY_FRAMES => {
            let (n, codes_at, offsets_at) = py_layout(bytes, py_shape(h.kind))?;
            let word = |at: usize, n: usize| -> u64 {
                let mut b = [0u8; 8];
                b[..n].copy_from_slice(&bytes[at..at + n]);
                u64::from_le_bytes(b)
            };
            // PY_FRAMES: the entry markers as a mask beside the frames, made entries here.
            let entries = if h.kind == kind::PY_FRAMES {
                word(std::mem::offset_of!(PyFramesEvent, entries), 8)
            } else {
                0
            };
            let mut frames = Vec::with_capacity(n + entries.count_ones() as usize);
            for i in 0..n {
                frames.push(PyFrame {
                    code: word(codes_at + 8 * i, 8),
                    offset: word(offsets_at + 4 * i, 4) as u32,
                });
                if entries >> i & 1 != 0 {
                    frames.push(PyFrame {
                        code: nccltrace_common::PY_ENTRY,
                        offset: 0,
                    });
                }
            }
            // Before format version 4 the field was 0 or 1 (truncated).
            let flags = word(std::mem::offset_of!(PyStackEvent, truncated), 4);
            Event::PyStack {
                ts_ns: h.ts_ns,
                task: t,
                frames,
                truncated: flags & u64::from(nccltrace_common::PY_TRUNCATED) != 0,
                keyed: (flags & u64::from(nccltrace_common::PY_KEYED) != 0).then(|| {
                    if flags & u64::from(nccltrace_common::PY_KEYED_OFFCPU) != 0 {
                        kind::OFFCPU
                    } else if flags & u64::from(nccltrace_common::PY_KEYED_CALL) != 0 {
                        kind::CALL_STACK
                    } else {
                        0
                    }
                }),
            }
        }
        other => return Err(DecodeError::UnknownKind { kind: other }),
    })
}

/// Argument positions of a data-moving call: (count, datatype, redop, peer/root, comm,
/// stream).
type ArgLayout = (usize, usize, Option<usize>, Option<usize>, usize, usize);

/// Interprets a call's raw arguments by the NCCL / CUDA driver ABI (nccl.h, cuda.h).
fn decode_call(e: &CallEvent) -> Result<Call, DecodeError> {
    let id = e.func & !nccltrace_common::func::ENTRY_ONLY;
    let func = Func::from_id(id).ok_or(DecodeError::UnknownFunc { id: e.func })?;
    let a = &e.args;
    // Traced at entry only: no return time, value or written communicator.
    let returned = e.func & nccltrace_common::func::ENTRY_ONLY == 0;
    let mut call = Call {
        ret: returned.then_some(e.ret),
        ..Call::new(
            task(&e.hdr),
            func,
            e.start_ns,
            if returned { e.hdr.ts_ns } else { e.start_ns },
        )
    };
    let layout: Option<ArgLayout> = match func {
        Func::AllReduce | Func::ReduceScatter => Some((2, 3, Some(4), None, 5, 6)),
        Func::AllGather | Func::AlltoAll => Some((2, 3, None, None, 4, 5)),
        Func::Broadcast | Func::Gather | Func::Scatter => Some((2, 3, None, Some(4), 5, 6)),
        Func::Bcast | Func::Send | Func::Recv => Some((1, 2, None, Some(3), 4, 5)),
        Func::Reduce => Some((2, 3, Some(4), Some(5), 6, 7)),
        _ => None,
    };
    if let Some((count, dtype, redop, peer, comm, stream)) = layout {
        let datatype = a[dtype] as u32;
        call.count = Some(a[count]);
        call.datatype = Some(datatype);
        call.bytes = datatype_size(datatype).map(|size| a[count].saturating_mul(size));
        call.redop = redop.map(|i| a[i] as u32);
        call.peer = peer.map(|i| a[i] as i32);
        call.comm = Some(a[comm]);
        call.stream = Some(a[stream]).filter(|s| *s != NOT_READ);
    }
    match func {
        Func::CommInitRank | Func::CommInitRankConfig => {
            *call.extra_mut() = CallExtra {
                nranks: Some(a[1] as i32),
                rank: Some(a[2] as i32),
                new_comm: Some(e.out),
                // All zero: a recording from before the id was read.
                comm_id: (a[6] | a[7] != 0).then(|| unique_id(a[6], a[7])),
                message: None,
            };
        }
        Func::CommInitAll => {
            let extra = call.extra_mut();
            extra.nranks = Some(a[1] as i32);
            extra.new_comm = Some(e.out);
        }
        Func::CommSplit => {
            call.comm = Some(a[0]);
            call.extra_mut().new_comm = Some(e.out);
        }
        Func::CommDestroy | Func::CommAbort => call.comm = Some(a[0]),
        Func::CuStreamSynchronize | Func::CuStreamSynchronizePtsz => call.stream = Some(a[0]),
        Func::NvtxRangePushA => {
            let bytes: Vec<u8> = a[1..].iter().flat_map(|w| w.to_le_bytes()).collect();
            let end = bytes.iter().position(|b| *b == 0).unwrap_or(bytes.len());
            call.extra_mut().message = Some(String::from_utf8_lossy(&bytes[..end]).into_owned());
        }
        _ => {}
    }
    Ok(call)
}

/// The bytes of a record, as the ring buffer delivers them. Used by tests and benchmarks
/// to build records without the kernel.
#[must_use]
pub fn as_bytes<T: nccltrace_common::Record>(record: &T) -> Vec<u8> {
    // SAFETY: a `Record` is #[repr(C)] with every byte a field (no implicit padding).
    unsafe { std::slice::from_raw_parts(std::ptr::from_ref(record).cast::<u8>(), size_of::<T>()) }
        .to_vec()
}

/// An `IB_READING` record: port `port`'s counters `(index in IB_COUNTER_NAMES, value)`,
/// read at `ts_ns` (indexes of 64 and above are left out).
#[must_use]
pub fn ib_reading(ts_ns: u64, port: u32, counters: &[(u8, u64)]) -> Vec<u8> {
    let mut head = IbReadingEvent {
        port,
        ..Default::default()
    };
    head.hdr.ts_ns = ts_ns;
    head.hdr.kind = kind::IB_READING;
    head.hdr.cpu = u16::MAX;
    let mut sorted: Vec<(u8, u64)> = counters.iter().copied().filter(|c| c.0 < 64).collect();
    sorted.sort_unstable_by_key(|c| c.0);
    sorted.dedup_by_key(|c| c.0);
    for &(i, _) in &sorted {
        head.present |= 1 << i;
    }
    let mut out = as_bytes(&head);
    for (_, v) in sorted {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests;
