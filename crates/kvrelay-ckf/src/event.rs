//! The router-event model the filter consumes: what one engine source reported.
//!
//! Events arrive per source `(worker_id, dp_rank)` in the source's own order. Blocks are
//! named by the engine's own block ids (opaque, engine-specific, only meaningful inside
//! one source) and carry the token hash of the block's tokens, from which the filter
//! derives canonical sequence hashes (see `kvrelay_identity::hashing`).

/// One engine source: a worker and its data-parallel rank (0 when the engine has no DP).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct SourceId {
    /// The engine worker's instance id.
    pub worker_id: u64,
    /// The data-parallel rank inside that worker (0 = no data parallelism).
    pub dp_rank: u32,
}

impl SourceId {
    /// A source from its worker id and data-parallel rank.
    pub const fn new(worker_id: u64, dp_rank: u32) -> Self {
        Self { worker_id, dp_rank }
    }
}

/// One KV-cache event from one source, as the pool's filter consumes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterEvent {
    /// The source that reported the event.
    pub source: SourceId,
    /// The engine's event id (monotone per source; kept for diagnostics, not interpreted).
    pub event_id: u64,
    /// What happened.
    pub payload: EventPayload,
}

/// What one event reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventPayload {
    /// New blocks were stored, each extending the previous one (a chain).
    Stored(StoredBlocks),
    /// Blocks were evicted, named by engine block id.
    Removed(RemovedBlocks),
    /// The source dropped its whole cache.
    AllCleared,
}

/// A chain of stored blocks.
///
/// The first block extends `parent_engine_block_id` (a block this same source reported
/// earlier) or starts a new sequence when there is no parent; each later block extends
/// the block before it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StoredBlocks {
    /// The engine id of the block the first block extends, if any.
    pub parent_engine_block_id: Option<u64>,
    /// The stored blocks, in chain order.
    pub blocks: Vec<StoredBlock>,
}

/// One stored block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct StoredBlock {
    /// The engine's id for this block (opaque, only meaningful inside its source).
    pub engine_block_id: u64,
    /// The hash of this block's tokens (`kvrelay_identity::hashing::block_hash`).
    pub token_hash: u64,
}

/// Blocks evicted by a source.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RemovedBlocks {
    /// The engine ids of the removed blocks.
    pub engine_block_ids: Vec<u64>,
}

impl std::fmt::Display for SourceId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "worker {} rank {}", self.worker_id, self.dp_rank)
    }
}
