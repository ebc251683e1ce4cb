//! What the agent reads of a target's NCCL communicators.

use crate::Header;

/// A communicator of the target (the header's tgid and tid are the target's pid, its CPU
/// `u16::MAX`): read from the target's memory at the offsets its library's
/// `ncclCommCount` and `ncclCommUserRank` load from, for communicators made before attach.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommSizeEvent {
    pub hdr: Header,
    /// The communicator's handle, as the target's calls pass it.
    pub comm: u64,
    /// Its number of ranks.
    pub nranks: i32,
    /// The target's rank in it; -1 where not read.
    pub rank: i32,
}
const _: () = assert!(core::mem::size_of::<CommSizeEvent>() == 40);
