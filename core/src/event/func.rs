//! The traced functions (NCCL, CUDA, NVTX, markers) and how their arguments read: NCCL's
//! datatypes and reduction ops.

use serde::Serialize;

/// A traced library function, named as users know it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Func {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Bcast,
    Reduce,
    AlltoAll,
    Gather,
    Scatter,
    Send,
    Recv,
    GroupStart,
    GroupEnd,
    CommInitRank,
    CommInitRankConfig,
    CommInitAll,
    CommSplit,
    CommDestroy,
    CommAbort,
    CuStreamSynchronize,
    CuStreamSynchronizePtsz,
    CuEventSynchronize,
    CuCtxSynchronize,
    /// The function named by `--step-symbol`.
    StepMarker,
    /// `nvtxRangePushA` of an NVTX library (`--step-nvtx`).
    NvtxRangePushA,
}

/// Which library a function lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    Nccl,
    Cuda,
    /// The step marker (`--step-symbol`), in whatever object defines it.
    Marker,
    /// NVTX range pushes (`--step-nvtx`), in libnvToolsExt or whatever object exports them.
    Nvtx,
}

impl Func {
    /// Every traced function with its id (the BPF cookie) and the symbols that define it,
    /// strong name first. NCCL exports `pnccl*` and weak `nccl*` aliases at one address.
    pub const ALL: [(Func, u32, &'static [&'static str]); 25] = {
        use nccltrace_common::func as f;
        [
            (
                Func::AllReduce,
                f::NCCL_ALL_REDUCE,
                &["pncclAllReduce", "ncclAllReduce"],
            ),
            (
                Func::AllGather,
                f::NCCL_ALL_GATHER,
                &["pncclAllGather", "ncclAllGather"],
            ),
            (
                Func::ReduceScatter,
                f::NCCL_REDUCE_SCATTER,
                &["pncclReduceScatter", "ncclReduceScatter"],
            ),
            (
                Func::Broadcast,
                f::NCCL_BROADCAST,
                &["pncclBroadcast", "ncclBroadcast"],
            ),
            (Func::Bcast, f::NCCL_BCAST, &["pncclBcast", "ncclBcast"]),
            (Func::Reduce, f::NCCL_REDUCE, &["pncclReduce", "ncclReduce"]),
            (
                Func::AlltoAll,
                f::NCCL_ALLTOALL,
                &["pncclAlltoAll", "ncclAlltoAll"],
            ),
            (Func::Gather, f::NCCL_GATHER, &["pncclGather", "ncclGather"]),
            (
                Func::Scatter,
                f::NCCL_SCATTER,
                &["pncclScatter", "ncclScatter"],
            ),
            (Func::Send, f::NCCL_SEND, &["pncclSend", "ncclSend"]),
            (Func::Recv, f::NCCL_RECV, &["pncclRecv", "ncclRecv"]),
            (
                Func::GroupStart,
                f::NCCL_GROUP_START,
                &["pncclGroupStart", "ncclGroupStart"],
            ),
            (
                Func::GroupEnd,
                f::NCCL_GROUP_END,
                &["pncclGroupEnd", "ncclGroupEnd"],
            ),
            (
                Func::CommInitRank,
                f::NCCL_COMM_INIT_RANK,
                &["pncclCommInitRank", "ncclCommInitRank"],
            ),
            (
                Func::CommInitRankConfig,
                f::NCCL_COMM_INIT_RANK_CONFIG,
                &["pncclCommInitRankConfig", "ncclCommInitRankConfig"],
            ),
            (
                Func::CommInitAll,
                f::NCCL_COMM_INIT_ALL,
                &["pncclCommInitAll", "ncclCommInitAll"],
            ),
            (
                Func::CommSplit,
                f::NCCL_COMM_SPLIT,
                &["pncclCommSplit", "ncclCommSplit"],
            ),
            (
                Func::CommDestroy,
                f::NCCL_COMM_DESTROY,
                &["pncclCommDestroy", "ncclCommDestroy"],
            ),
            (
                Func::CommAbort,
                f::NCCL_COMM_ABORT,
                &["pncclCommAbort", "ncclCommAbort"],
            ),
            (
                Func::CuStreamSynchronize,
                f::CU_STREAM_SYNCHRONIZE,
                &["cuStreamSynchronize"],
            ),
            (
                Func::CuStreamSynchronizePtsz,
                f::CU_STREAM_SYNCHRONIZE_PTSZ,
                &["cuStreamSynchronize_ptsz"],
            ),
            (
                Func::CuEventSynchronize,
                f::CU_EVENT_SYNCHRONIZE,
                &["cuEventSynchronize"],
            ),
            (
                Func::CuCtxSynchronize,
                f::CU_CTX_SYNCHRONIZE,
                &["cuCtxSynchronize"],
            ),
            (Func::StepMarker, f::STEP_MARKER, &["step_marker"]),
            (
                Func::NvtxRangePushA,
                f::NVTX_RANGE_PUSH_A,
                &["nvtxRangePushA"],
            ),
        ]
    };

    /// The function with this id, if the id is known.
    #[must_use]
    pub fn from_id(id: u32) -> Option<Func> {
        Self::ALL
            .iter()
            .find(|(_, i, _)| *i == id)
            .map(|(f, _, _)| *f)
    }

    /// The function with this output name ([`Func::name`]).
    #[must_use]
    pub fn from_name(name: &str) -> Option<Func> {
        Self::ALL
            .iter()
            .map(|(f, _, _)| *f)
            .find(|f| f.name() == name)
    }

    /// The id used as BPF cookie and in recordings.
    #[must_use]
    pub fn id(self) -> u32 {
        Self::ALL
            .iter()
            .find(|(f, _, _)| *f == self)
            .map_or(0, |(_, i, _)| *i)
    }

    /// Symbols that define this function, strong name first.
    #[must_use]
    pub fn symbols(self) -> &'static [&'static str] {
        Self::ALL
            .iter()
            .find(|(f, _, _)| *f == self)
            .map_or(&[], |(_, _, s)| s)
    }

    #[must_use]
    pub fn library(self) -> Library {
        let id = self.id();
        if id == nccltrace_common::func::NVTX_RANGE_PUSH_A {
            Library::Nvtx
        } else if id >= nccltrace_common::func::STEP_MARKER {
            Library::Marker
        } else if id >= nccltrace_common::func::FIRST_CUDA {
            Library::Cuda
        } else {
            Library::Nccl
        }
    }

    /// The name used in outputs: NCCL functions without their `nccl` prefix, CUDA ones as
    /// the driver spells them.
    #[must_use]
    pub fn name(self) -> &'static str {
        let strong = self.symbols()[0];
        match self.library() {
            Library::Nccl => &strong["pnccl".len()..],
            Library::Cuda | Library::Marker | Library::Nvtx => strong,
        }
    }

    /// Collectives and point-to-point calls that move data.
    #[must_use]
    pub fn is_collective(self) -> bool {
        matches!(
            self,
            Func::AllReduce
                | Func::AllGather
                | Func::ReduceScatter
                | Func::Broadcast
                | Func::Bcast
                | Func::Reduce
                | Func::AlltoAll
                | Func::Gather
                | Func::Scatter
                | Func::Send
                | Func::Recv
        )
    }
}

/// NCCL's `ncclDataType_t`, with element sizes.
#[must_use]
pub fn datatype_size(datatype: u32) -> Option<u64> {
    // nccl.h: Int8/Char=0, Uint8=1, Int32=2, Uint32=3, Int64=4, Uint64=5, Float16=6,
    // Float32=7, Float64=8, Bfloat16=9, Float8e4m3=10, Float8e5m2=11.
    Some(match datatype {
        0 | 1 | 10 | 11 => 1,
        6 | 9 => 2,
        2 | 3 | 7 => 4,
        4 | 5 | 8 => 8,
        _ => return None,
    })
}

/// NCCL's `ncclDataType_t` name.
#[must_use]
pub fn datatype_name(datatype: u32) -> &'static str {
    match datatype {
        0 => "int8",
        1 => "uint8",
        2 => "int32",
        3 => "uint32",
        4 => "int64",
        5 => "uint64",
        6 => "float16",
        7 => "float32",
        8 => "float64",
        9 => "bfloat16",
        10 => "float8e4m3",
        11 => "float8e5m2",
        _ => "unknown",
    }
}

/// NCCL's `ncclRedOp_t` name.
#[must_use]
pub fn redop_name(op: u32) -> &'static str {
    match op {
        0 => "sum",
        1 => "prod",
        2 => "max",
        3 => "min",
        4 => "avg",
        _ => "custom",
    }
}
