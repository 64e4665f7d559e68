//! [`MembershipLimits`]: every bound of this crate, each default a documented const.

/// Default for [`MembershipLimits::max_pending_diagnostics`].
pub const DEFAULT_MAX_PENDING_DIAGNOSTICS: usize = 1024;
/// Default for [`MembershipLimits::max_card_file_bytes`]: 4 MiB.
pub const DEFAULT_MAX_CARD_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// Default for [`MembershipLimits::memory_watch_queue_depth`].
pub const DEFAULT_MEMORY_WATCH_QUEUE_DEPTH: usize = 4096;

/// Default for [`MembershipLimits::max_card_files`].
pub const DEFAULT_MAX_CARD_FILES: usize = 4096;

/// Most data-parallel ranks one card may declare (`data_parallel_size`); the pool's load
/// table accepts the same number per worker.
pub const MAX_CARD_DATA_PARALLEL_SIZE: u32 = 4096;
/// Highest first rank a card may declare, so `start + size` never overflows a `u32`.
pub const MAX_CARD_START_RANK: u32 = u32::MAX - MAX_CARD_DATA_PARALLEL_SIZE;
/// Most KV blocks one rank may declare (`total_kv_blocks`): 2^26, the slots of the largest
/// filter (2^24 buckets of 4 slots). A rank claiming more than any filter can hold is a
/// broken or hostile card, not a sizing input.
pub const MAX_CARD_TOTAL_KV_BLOCKS: u64 = 1 << 26;

/// The bounds of the projection and the discovery backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MembershipLimits {
    /// Undrained soft errors kept by the projection; older ones are dropped and counted.
    pub max_pending_diagnostics: usize,
    /// Largest card file the file backend reads, in bytes; larger files are skipped.
    pub max_card_file_bytes: u64,
    /// Events one memory-backend watch may queue before it is closed (and rebinds).
    pub memory_watch_queue_depth: usize,
    /// Most card files the file backend reads per scan (in name order); the rest are
    /// skipped and counted as `too_many_files`.
    pub max_card_files: usize,
}

impl Default for MembershipLimits {
    fn default() -> Self {
        Self {
            max_pending_diagnostics: DEFAULT_MAX_PENDING_DIAGNOSTICS,
            max_card_file_bytes: DEFAULT_MAX_CARD_FILE_BYTES,
            memory_watch_queue_depth: DEFAULT_MEMORY_WATCH_QUEUE_DEPTH,
            max_card_files: DEFAULT_MAX_CARD_FILES,
        }
    }
}
