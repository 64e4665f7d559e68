//! Why a pool filter operation fails: [`ApplyError`] for events and source operations,
//! [`PublishError`] for deltas and snapshots. Both leave the filter unchanged.

use crate::event::SourceId;

/// Why an event or a source operation was rejected. The filter is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApplyError {
    /// The parent block is not in this source's lineage.
    #[error("{source_id}: parent engine block {parent_engine_block_id} not found")]
    ParentNotFound {
        /// The reporting source.
        source_id: SourceId,
        /// The unknown parent.
        parent_engine_block_id: u64,
    },
    /// An engine block id is already mapped to a different canonical hash.
    #[error(
        "{source_id}: engine block {engine_block_id} is mapped to {mapped:#018x}, event offers {offered:#018x}"
    )]
    ContradictoryBlockId {
        /// The reporting source.
        source_id: SourceId,
        /// The engine block id.
        engine_block_id: u64,
        /// The canonical hash it already maps to.
        mapped: u64,
        /// The canonical hash the event derives for it.
        offered: u64,
    },
    /// A canonical hash's owner count would exceed `u32::MAX`.
    #[error("owner count of canonical hash {canonical:#018x} would overflow u32")]
    OwnershipOverflow {
        /// The canonical hash.
        canonical: u64,
    },
    /// A fallible allocation failed before anything changed.
    #[error("allocation of {bytes} bytes for {what} failed")]
    AllocationFailed {
        /// What was being allocated.
        what: &'static str,
        /// How many bytes were requested (approximate).
        bytes: u64,
    },
}

/// Why a delta or snapshot could not be built. Pending changes are kept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// A fallible allocation failed.
    #[error("allocation of {bytes} bytes for publication failed")]
    AllocationFailed {
        /// How many bytes were requested.
        bytes: u64,
    },
    /// The stream sequence reached `u64::MAX`; a new producer generation is needed.
    #[error("publication sequence exhausted at {sequence}")]
    SequenceExhausted {
        /// The last sequence.
        sequence: u64,
    },
}

/// An [`ApplyError::AllocationFailed`] for `bytes` bytes of `what`.
pub(crate) fn alloc(what: &'static str, bytes: u64) -> ApplyError {
    ApplyError::AllocationFailed { what, bytes }
}
