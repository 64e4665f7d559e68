//! [`MembershipLimits`]: every bound of this crate, each default a documented const.

/// Default for [`MembershipLimits::max_pending_diagnostics`].
pub const DEFAULT_MAX_PENDING_DIAGNOSTICS: usize = 1024;
/// Default for [`MembershipLimits::max_card_file_bytes`]: 4 MiB.
pub const DEFAULT_MAX_CARD_FILE_BYTES: u64 = 4 * 1024 * 1024;
/// Default for [`MembershipLimits::memory_watch_queue_depth`].
pub const DEFAULT_MEMORY_WATCH_QUEUE_DEPTH: usize = 4096;

/// The bounds of the projection and the discovery backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MembershipLimits {
    /// Undrained soft errors kept by the projection; older ones are dropped and counted.
    pub max_pending_diagnostics: usize,
    /// Largest card file the file backend reads, in bytes; larger files are skipped.
    pub max_card_file_bytes: u64,
    /// Events one memory-backend watch may queue before it is closed (and rebinds).
    pub memory_watch_queue_depth: usize,
}

impl Default for MembershipLimits {
    fn default() -> Self {
        Self {
            max_pending_diagnostics: DEFAULT_MAX_PENDING_DIAGNOSTICS,
            max_card_file_bytes: DEFAULT_MAX_CARD_FILE_BYTES,
            memory_watch_queue_depth: DEFAULT_MEMORY_WATCH_QUEUE_DEPTH,
        }
    }
}
