//! Disposition counters, per-call outcomes and memory accounting of a [`crate::PoolFilter`].

use crate::ownership::ApplyError;

/// Cumulative counters of one producer filter; every disposition is counted once.
///
/// Identities that always hold (checked by the model tests):
/// - `blocks_mapped - mappings_removed` = live (source, engine block id) mappings;
/// - `fingerprints_inserted - fingerprints_removed` = occupied slots in the table;
/// - `events_applied + events_rejected` = `stored_events + removed_events + cleared_events`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FilterCounters {
    /// Router events applied (state possibly changed).
    pub events_applied: u64,
    /// Router events rejected by validation (state unchanged).
    pub events_rejected: u64,
    /// Stored events seen (applied or rejected).
    pub stored_events: u64,
    /// Removed events seen (applied or rejected).
    pub removed_events: u64,
    /// All-cleared events seen (applied or rejected).
    pub cleared_events: u64,
    /// Stored events rejected because their parent is not in the source's lineage.
    pub parent_not_found: u64,
    /// Stored events rejected because an engine block id was mapped to another hash.
    pub contradictory_block_ids: u64,
    /// Events rejected because an owner count would overflow.
    pub ownership_overflows: u64,
    /// Operations rejected because an allocation failed.
    pub allocation_failures: u64,
    /// New (source, engine block id) → canonical mappings.
    pub blocks_mapped: u64,
    /// Stored blocks whose mapping already existed (re-offers).
    pub blocks_reoffered: u64,
    /// Mappings removed (by removal, clear or reset).
    pub mappings_removed: u64,
    /// Removals of unknown (source, engine block id): counted no-ops.
    pub unknown_removals: u64,
    /// Canonical hashes that gained their first owner.
    pub canonicals_created: u64,
    /// Canonical hashes that lost their last owner.
    pub canonicals_dropped: u64,
    /// Fingerprints physically inserted.
    pub fingerprints_inserted: u64,
    /// Fingerprints physically removed.
    pub fingerprints_removed: u64,
    /// Full admissions that failed for capacity (omissions: ownership kept, not resident).
    pub capacity_omissions: u64,
    /// Omitted hashes admitted later by a re-offer or a new owner.
    pub late_admissions: u64,
    /// Relocation-free re-offer attempts that found no free slot (not omissions again).
    pub reoffer_misses: u64,
    /// Removals whose fingerprint was missing from both buckets (a bug if nonzero).
    pub invariant_violations: u64,
    /// Sources cleared or reset by an explicit call (not by an event).
    pub source_resets: u64,
    /// Deltas published.
    pub deltas_published: u64,
    /// Bucket images published in deltas.
    pub images_published: u64,
    /// Touched buckets whose word ended a window unchanged (dropped from the delta).
    pub net_reverted_buckets: u64,
    /// Snapshots taken.
    pub snapshots_taken: u64,
}

/// What one call changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ApplyOutcome {
    /// New mappings.
    pub blocks_mapped: u64,
    /// Re-offered mappings.
    pub blocks_reoffered: u64,
    /// Mappings removed.
    pub mappings_removed: u64,
    /// Unknown removals (no-ops).
    pub unknown_removals: u64,
    /// Fingerprints inserted.
    pub fingerprints_inserted: u64,
    /// Fingerprints removed.
    pub fingerprints_removed: u64,
    /// Capacity omissions: owned hashes that did not fit.
    pub capacity_omissions: u64,
}

/// Bytes held by a producer filter, by part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryUsage {
    /// Bucket words (the lossy projection that is published).
    pub table_bytes: u64,
    /// Dirty-tracking bitsets and touched list.
    pub dirty_window_bytes: u64,
    /// Per-source lineage maps (engine block id → canonical hash), by capacity.
    pub lineage_bytes: u64,
    /// Owner counts and residency per canonical hash, by capacity.
    pub owner_bytes: u64,
}

impl MemoryUsage {
    /// All parts together.
    pub fn total_bytes(&self) -> u64 {
        self.table_bytes + self.dirty_window_bytes + self.lineage_bytes + self.owner_bytes
    }
}

impl FilterCounters {
    /// Counts one rejected event or source operation under its reason.
    pub(crate) fn count_rejection(&mut self, err: &ApplyError) {
        self.events_rejected += 1;
        match err {
            ApplyError::ParentNotFound { .. } => self.parent_not_found += 1,
            ApplyError::ContradictoryBlockId { .. } => self.contradictory_block_ids += 1,
            ApplyError::OwnershipOverflow { .. } => self.ownership_overflows += 1,
            ApplyError::AllocationFailed { .. } => self.allocation_failures += 1,
        }
    }
}
