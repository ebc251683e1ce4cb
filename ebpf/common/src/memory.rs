//! Memory records: page faults and their time, page migrations, NUMA-balancing decisions and
//! hinting faults, the PMU's load samples and node-load counts, resident memory per node, and
//! InfiniBand port counters.

use crate::Header;

/// A user page fault in a target thread.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultEvent {
    pub hdr: Header,
    pub address: u64,
    pub ip: u64,
    pub error_code: u64,
}
const _: () = assert!(core::mem::size_of::<FaultEvent>() == 48);

/// `handle_mm_fault`'s `FAULT_FLAG_USER`: the fault came from user mode.
pub const FAULT_FLAG_USER: u32 = 1 << 6;

/// A user page fault of a target thread, timed from entry to return of `handle_mm_fault`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultTimeEvent {
    pub hdr: Header,
    pub start_ns: u64,
    pub address: u64,
    /// `handle_mm_fault`'s `FAULT_FLAG_*` and its `vm_fault_t` result, high half.
    pub flags: u32,
    pub result: u32,
}
const _: () = assert!(core::mem::size_of::<FaultTimeEvent>() == 48);

/// Pages migrated between nodes in a target thread's context (NUMA balancing, mbind...).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageMigrationEvent {
    pub hdr: Header,
    pub succeeded: u64,
    pub failed: u64,
    pub mode: u32,
    pub reason: u32,
}
const _: () = assert!(core::mem::size_of::<PageMigrationEvent>() == 48);

/// A NUMA-balancing decision about a target task.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NumaTaskEvent {
    pub hdr: Header,
    /// One of [`crate::numa_task`].
    pub subkind: u32,
    pub src_tid: u32,
    pub src_tgid: u32,
    pub src_cpu: i32,
    pub src_nid: i32,
    pub dst_tid: u32,
    pub dst_tgid: u32,
    pub dst_cpu: i32,
    pub dst_nid: i32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<NumaTaskEvent>() == 64);

/// A NUMA hinting fault: `task_numa_fault(last_cpupid, mem_node, pages, flags)` in the
/// faulting thread's context (the header's CPU is the one it ran on).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NumaHintEvent {
    pub hdr: Header,
    /// The node the page is on after the fault (its target, when it was migrated).
    pub mem_node: i32,
    /// Pages the fault stands for (1, or a huge page's).
    pub pages: i32,
    /// The kernel's `TNF_*` flags: [`crate::numa_hint::LOCAL`], [`crate::numa_hint::MIGRATED`], ...
    pub flags: i32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<NumaHintEvent>() == 40);

/// A load sampled by the PMU (PEBS load latency, AMD IBS), in the programs' record layout
/// so that recordings carry it like the rest (the header's CPU: `u16::MAX`, unknown).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemSampleEvent {
    pub hdr: Header,
    /// The load's latency in core cycles.
    pub weight: u32,
    pub _pad: u32,
    /// `perf_mem_data_src`: where the load was served from.
    pub data_src: u64,
}
const _: () = assert!(core::mem::size_of::<MemSampleEvent>() == 40);

/// A thread's node-load counters since they were opened (`node-loads`: its loads that DRAM
/// served, any node's; `node-load-misses`: those another node's DRAM served, as perf's
/// generic events map them on Intel), read by the agent
/// (the header's tgid and tid are the thread's, its CPU `u16::MAX`). Each count is already
/// scaled by the time the counter was enabled over the time it ran (the PMU multiplexes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeLoadsEvent {
    pub hdr: Header,
    pub dram: u64,
    pub remote: u64,
    /// Nanoseconds the counters were enabled, and counting (less when multiplexed).
    pub enabled_ns: u64,
    pub running_ns: u64,
    /// [`node_loads`] flags.
    pub flags: u32,
    pub _pad: u32,
}
const _: () = assert!(core::mem::size_of::<NodeLoadsEvent>() == 64);

/// Flags of a [`NodeLoadsEvent`]. A thread's counts are written only when they moved
/// since its last record (and its last still reading first, where they start moving
/// again), so that a reading not written means "unchanged"; a full reading writes every
/// thread, so that every step up to it can be interpolated.
pub mod node_loads {
    /// Part of a full reading: every counted thread was written at this time.
    pub const FULL: u32 = 1;
}

/// Nodes a [`NumaPagesEvent`] has room for (a host with more adds the rest to the last).
pub const NUMA_PAGES_NODES: usize = 16;

/// A target's resident memory per NUMA node, read from `/proc/PID/numa_maps` (the header's
/// tgid and tid are the target's pid, its CPU `u16::MAX`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NumaPagesEvent {
    pub hdr: Header,
    /// Nodes filled in `kib`.
    pub nodes: u32,
    pub _pad: u32,
    /// Resident KiB on each node.
    pub kib: [u64; NUMA_PAGES_NODES],
}
const _: () = assert!(core::mem::size_of::<NumaPagesEvent>() == 160);

/// The counters of an InfiniBand port an [`IbReadingEvent`] can carry, in its order (bit
/// `i` of its `present`). The first [`IB_PMA_COUNTERS`] are the port's `counters/` folder
/// (the IBA's PortCounters and PortCountersExtended as Linux names them; the two data
/// counters count 4-byte words); the rest are the adapter's own `hw_counters/` (RDMA
/// transport: retransmissions, sequence errors, RoCE congestion notifications; mlx5 and
/// the kernel's soft-RoCE `rdma_rxe` name them so). A name is read from `counters/` where
/// the port has it there, else from `hw_counters/`.
pub const IB_COUNTER_NAMES: [&str; 44] = [
    "port_xmit_data",
    "port_rcv_data",
    "port_xmit_packets",
    "port_rcv_packets",
    "port_xmit_discards",
    "port_xmit_wait",
    "port_rcv_errors",
    "symbol_error",
    "link_downed",
    "link_error_recovery",
    "port_rcv_remote_physical_errors",
    "port_rcv_switch_relay_errors",
    "port_xmit_constraint_errors",
    "port_rcv_constraint_errors",
    "local_link_integrity_errors",
    "excessive_buffer_overrun_errors",
    "VL15_dropped",
    // hw_counters/: packets (soft-RoCE has no `counters/`)
    "sent_pkts",
    "rcvd_pkts",
    "rdma_sends",
    "rdma_recvs",
    // retransmissions and the requests and responses that caused them
    "duplicate_request",
    "out_of_sequence",
    "out_of_seq_request",
    "packet_seq_err",
    "implied_nak_seq_err",
    "rcvd_seq_err",
    "local_ack_timeout_err",
    "retry_exceeded_err",
    "retry_rnr_exceeded_err",
    "completer_retry_err",
    "rnr_nak_retry_err",
    "rcvd_rnr_err",
    "send_rnr_err",
    "roce_adp_retrans",
    "roce_slow_restart",
    // receive buffers and completions in error
    "out_of_buffer",
    "send_err",
    "req_cqe_error",
    "resp_cqe_error",
    "ack_deferred",
    // RoCE congestion control (ECN marks, congestion notification packets)
    "np_ecn_marked_roce_packets",
    "np_cnp_sent",
    "rp_cnp_handled",
];

/// The first this many of [`IB_COUNTER_NAMES`] are the port's `counters/` (all an
/// [`IbCountersEvent`], the record of recordings before `hw_counters/`, has).
pub const IB_PMA_COUNTERS: usize = 17;

/// The counters read more often than the rest (bit `i`: [`IB_COUNTER_NAMES`]`[i]`): data
/// and packets.
pub const IB_FAST: u64 = 0b1111 | 1 << 17 | 1 << 18;

/// One reading of an InfiniBand port's counters (the header's tgid and tid 0, its CPU
/// `u16::MAX`): `port` indexes the recording header's port list. The record is this head
/// followed by one `u64` value for each bit set in `present`, in bit order.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IbReadingEvent {
    pub hdr: Header,
    pub port: u32,
    pub _pad: u32,
    /// Bit `i` set: the port's [`IB_COUNTER_NAMES`]`[i]` was read, its value follows.
    pub present: u64,
}
const _: () = assert!(core::mem::size_of::<IbReadingEvent>() == 40);

/// One reading of an InfiniBand port's `counters/` as recordings before `hw_counters/`
/// have it ([`crate::kind::IB_COUNTERS`]): still decoded, no longer written.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IbCountersEvent {
    pub hdr: Header,
    pub port: u32,
    /// Bit `i` set: `values[i]` was read (the port has [`IB_COUNTER_NAMES`]`[i]`).
    pub present: u32,
    pub values: [u64; IB_PMA_COUNTERS],
}
const _: () = assert!(core::mem::size_of::<IbCountersEvent>() == 168);

/// `TNF_*` flags of `task_numa_fault` (include/linux/sched/numa_balancing.h).
pub mod numa_hint {
    /// The page was migrated to the faulting CPU's node.
    pub const MIGRATED: i32 = 0x01;
    /// The page was on the faulting CPU's node (a local access).
    pub const LOCAL: i32 = 0x08;
    /// Migrating it failed.
    pub const MIGRATE_FAIL: i32 = 0x10;
}

/// Bits of [`GpuReadingEvent::present`]: which of its fields were read.
pub mod gpu {
    /// `busy_pct` over `[busy_from_ns, hdr.ts_ns)`.
    pub const BUSY: u32 = 1;
    pub const SM_CLOCK: u32 = 1 << 1;
    pub const MEM_CLOCK: u32 = 1 << 2;
    pub const TEMPERATURE: u32 = 1 << 3;
    pub const POWER: u32 = 1 << 4;
    pub const THROTTLE: u32 = 1 << 5;
    pub const MEMORY_USED: u32 = 1 << 6;
    pub const PROCESSES: u32 = 1 << 7;
}

/// One reading of a GPU through NVML (the header's tgid and tid 0, its CPU `u16::MAX`):
/// `gpu` indexes the recording header's GPU list, `present` ([`gpu`]) says which fields
/// hold a value. `busy_pct` is NVML's GPU utilization sample: the share of
/// `[busy_from_ns, hdr.ts_ns)` (CLOCK_MONOTONIC) in which a kernel ran.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuReadingEvent {
    pub hdr: Header,
    pub gpu: u32,
    pub present: u32,
    pub busy_from_ns: u64,
    pub busy_pct: u32,
    pub sm_clock_mhz: u32,
    pub mem_clock_mhz: u32,
    pub temperature_c: u32,
    pub power_mw: u32,
    /// Processes with a compute context on the GPU (NVML's list: every process of the
    /// host, of any job).
    pub processes: u32,
    /// NVML's clock-event (throttle) reason bits.
    pub throttle: u64,
    pub memory_used: u64,
}
const _: () = assert!(core::mem::size_of::<GpuReadingEvent>() == 80);
