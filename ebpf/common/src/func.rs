pub const NCCL_ALL_REDUCE: u32 = 1;
pub const NCCL_ALL_GATHER: u32 = 2;
pub const NCCL_REDUCE_SCATTER: u32 = 3;
pub const NCCL_BROADCAST: u32 = 4;
pub const NCCL_BCAST: u32 = 5;
pub const NCCL_REDUCE: u32 = 6;
pub const NCCL_ALLTOALL: u32 = 7;
pub const NCCL_GATHER: u32 = 8;
pub const NCCL_SCATTER: u32 = 9;
pub const NCCL_SEND: u32 = 10;
pub const NCCL_RECV: u32 = 11;
pub const NCCL_GROUP_START: u32 = 12;
pub const NCCL_GROUP_END: u32 = 13;
pub const NCCL_COMM_INIT_RANK: u32 = 14;
pub const NCCL_COMM_INIT_RANK_CONFIG: u32 = 15;
pub const NCCL_COMM_INIT_ALL: u32 = 16;
pub const NCCL_COMM_SPLIT: u32 = 17;
pub const NCCL_COMM_DESTROY: u32 = 18;
pub const NCCL_COMM_ABORT: u32 = 19;
pub const CU_STREAM_SYNCHRONIZE: u32 = 64;
pub const CU_STREAM_SYNCHRONIZE_PTSZ: u32 = 65;
pub const CU_EVENT_SYNCHRONIZE: u32 = 66;
pub const CU_CTX_SYNCHRONIZE: u32 = 67;
/// First CUDA id: ids at or above this are CUDA driver calls.
pub const FIRST_CUDA: u32 = 64;
/// A user function called once per training step (`--step-symbol`).
pub const STEP_MARKER: u32 = 128;
/// `nvtxRangePushA(const char *message)` of an NVTX library (`--step-nvtx`): the entry
/// program copies the message into the call's arguments 1 to 7 (`NVTX_MESSAGE_BYTES`).
pub const NVTX_RANGE_PUSH_A: u32 = 129;
/// Bytes of an NVTX message kept (NUL-terminated when shorter).
pub const NVTX_MESSAGE_BYTES: usize = 56;
/// Set in an entry probe's attach cookie (beside the id) when the function has no
/// return probe (`call_returns = "needed"`): the entry program writes the call's record
/// itself. Set in that record's `func` too, so user space knows no return was traced.
pub const ENTRY_ONLY: u32 = 1 << 31;
/// Set in the attach cookie of a probe that fires only in one target process (an
/// uprobe-multi link made with its pid, or a per-function uprobe opened for that
/// process): the programs skip the target check and do not time themselves, the
/// kernel's run time of every run being a target's.
pub const IN_TARGET: u32 = 1 << 30;

/// Whether the breakdown needs function `id`'s return when the profile asks only for
/// the returns needed: CUDA syncs (their duration is the wait), the calls that create
/// a communicator (its handle is written at return), ncclGroupEnd (grouped calls launch
/// there and can block) and communicator destruction (it can block). Collectives,
/// point-to-point calls, ncclGroupStart, step markers and NVTX pushes are traced at
/// entry only.
#[must_use]
pub const fn return_needed(id: u32) -> bool {
    (id >= FIRST_CUDA && id < STEP_MARKER)
        || out_comm_arg(id).is_some()
        || matches!(id, NCCL_GROUP_END | NCCL_COMM_DESTROY | NCCL_COMM_ABORT)
}

/// How many arguments the function takes, counting a by-value `ncclUniqueId` as none
/// since the x86-64 ABI passes it in memory without using a register.
#[must_use]
pub const fn nargs(id: u32) -> u32 {
    match id {
        NCCL_REDUCE => 8,
        NCCL_ALL_REDUCE | NCCL_REDUCE_SCATTER | NCCL_BROADCAST | NCCL_GATHER | NCCL_SCATTER => 7,
        NCCL_ALL_GATHER | NCCL_BCAST | NCCL_ALLTOALL | NCCL_SEND | NCCL_RECV => 6,
        NCCL_COMM_SPLIT => 5,
        NCCL_COMM_INIT_RANK_CONFIG => 4,
        NCCL_COMM_INIT_RANK | NCCL_COMM_INIT_ALL => 3,
        NCCL_COMM_DESTROY
        | NCCL_COMM_ABORT
        | CU_STREAM_SYNCHRONIZE
        | CU_STREAM_SYNCHRONIZE_PTSZ
        | CU_EVENT_SYNCHRONIZE
        | NVTX_RANGE_PUSH_A => 1,
        _ => 0,
    }
}

/// How many arguments the entry program reads off the user stack (those past the
/// sixth, or the start of CommInitRank's unique id). The communicator is always read; the stream of a collective (its last
/// argument, the only one on the stack for the seven-argument calls) only when
/// `streams` is set: reading user memory costs about 100 ns a call.
#[must_use]
pub const fn stack_args(id: u32, streams: bool) -> u32 {
    if id == NCCL_COMM_INIT_RANK || id == NCCL_COMM_INIT_RANK_CONFIG {
        // The ncclUniqueId passed by value sits above the return address: its first 16
        // bytes (the bootstrap's random magic and the root's address) name the
        // communicator on every rank.
        return 2;
    }
    match (nargs(id), streams) {
        (n, true) if n > 6 => n - 6,
        // ncclReduce's communicator is its seventh argument.
        (8, false) => 1,
        _ => 0,
    }
}

/// The argument that points at a communicator the call writes (`ncclComm_t*`), read at
/// return so the new handle is known.
#[must_use]
pub const fn out_comm_arg(id: u32) -> Option<usize> {
    match id {
        NCCL_COMM_INIT_RANK | NCCL_COMM_INIT_RANK_CONFIG | NCCL_COMM_INIT_ALL => Some(0),
        NCCL_COMM_SPLIT => Some(3),
        _ => None,
    }
}
