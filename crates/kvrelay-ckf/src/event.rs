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

impl StoredBlocks {
    /// A new sequence (no parent) of blocks with the given token hashes, in order, whose
    /// engine ids count up from `first_engine_block_id` (wrapping).
    ///
    /// ```
    /// use kvrelay_ckf::{StoredBlock, StoredBlocks};
    ///
    /// let chain = StoredBlocks::new_chain(7, [0xa, 0xb]);
    /// assert_eq!(chain.parent_engine_block_id, None);
    /// assert_eq!(
    ///     chain.blocks,
    ///     [
    ///         StoredBlock { engine_block_id: 7, token_hash: 0xa },
    ///         StoredBlock { engine_block_id: 8, token_hash: 0xb },
    ///     ]
    /// );
    /// ```
    pub fn new_chain(
        first_engine_block_id: u64,
        token_hashes: impl IntoIterator<Item = u64>,
    ) -> Self {
        let blocks = token_hashes
            .into_iter()
            .zip(0u64..)
            .map(|(token_hash, offset)| StoredBlock {
                engine_block_id: first_engine_block_id.wrapping_add(offset),
                token_hash,
            })
            .collect();
        Self {
            parent_engine_block_id: None,
            blocks,
        }
    }
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

/// Where a worker keeps a block: the tier a filter lane describes.
///
/// Device memory is the pool's main lane (today's filter). Lower tiers (host memory,
/// local disk or storage) hold blocks an engine offloaded; restoring one costs a copy
/// rather than a prefill, so routers weight a hit there below a device hit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CacheTier {
    /// GPU (device) memory: the pool's main filter.
    Device,
    /// Host memory (vLLM `CPU`, `CPU_PINNED`; Dynamo KVBM `host_pinned`).
    Host,
    /// Local disk or storage (vLLM `DISK`; Dynamo KVBM `disk`).
    Disk,
}

impl CacheTier {
    /// Every tier, device first (the order lanes are searched in).
    pub const ALL: [CacheTier; 3] = [CacheTier::Device, CacheTier::Host, CacheTier::Disk];

    /// The tier's wire code (device 0, host 1, disk 2).
    pub const fn code(self) -> u8 {
        match self {
            CacheTier::Device => 0,
            CacheTier::Host => 1,
            CacheTier::Disk => 2,
        }
    }

    /// The tier with wire code `code`, if one is defined.
    pub const fn from_code(code: u8) -> Option<Self> {
        match code {
            0 => Some(CacheTier::Device),
            1 => Some(CacheTier::Host),
            2 => Some(CacheTier::Disk),
            _ => None,
        }
    }

    /// The tier's name in configuration, metrics and JSON (`device`, `host`, `disk`).
    pub const fn name(self) -> &'static str {
        match self {
            CacheTier::Device => "device",
            CacheTier::Host => "host",
            CacheTier::Disk => "disk",
        }
    }
}

impl std::fmt::Display for CacheTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for CacheTier {
    type Err = UnknownTier;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        CacheTier::ALL
            .into_iter()
            .find(|tier| tier.name() == text)
            .ok_or_else(|| UnknownTier(text.to_owned()))
    }
}

/// A tier name that is not `device`, `host` or `disk`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown cache tier {0:?} (expected \"device\", \"host\" or \"disk\")")]
pub struct UnknownTier(pub String);

/// One KV-cache event about a tier below device memory, from one source.
///
/// Device events stay [`RouterEvent`]s (the pool's main filter is unchanged by tiers);
/// these feed the pool's lower-tier lanes (see [`crate::tier::TierLane`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierEvent {
    /// The source that reported the event.
    pub source: SourceId,
    /// The engine's event id (diagnostics only).
    pub event_id: u64,
    /// The tier the event is about; never [`CacheTier::Device`].
    pub tier: CacheTier,
    /// What happened there.
    pub change: TierChange,
}

/// What a lower-tier event reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TierChange {
    /// Blocks stored with their tokens' hashes, a chain inside the tier: the parent is a
    /// block this source reported on the same tier (SGLang's hierarchical cache, Dynamo's
    /// KVBM, whose events carry token hashes).
    Stored(StoredBlocks),
    /// Blocks copied from device memory, each named by the engine id of the device block
    /// its tokens end with (vLLM's offloading connector: its events carry no tokens, and
    /// an offloaded block of `k` device blocks is keyed by the last one's hash). The lane
    /// takes each block's canonical hash from the source's device lineage.
    Offloaded {
        /// The engine ids of the device blocks that end the offloaded blocks.
        engine_block_ids: Vec<u64>,
    },
    /// Blocks evicted from the tier, named by engine block id.
    Removed(RemovedBlocks),
    /// The source dropped everything it held on the tier.
    Cleared,
}

impl TierChange {
    /// Blocks the change names (1 for a clear): what it weighs in a pool's permits.
    pub fn n_blocks(&self) -> usize {
        match self {
            TierChange::Stored(stored) => stored.blocks.len(),
            TierChange::Offloaded { engine_block_ids } => engine_block_ids.len(),
            TierChange::Removed(removed) => removed.engine_block_ids.len(),
            TierChange::Cleared => 1,
        }
    }
}
