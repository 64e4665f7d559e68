//! The pool actor's adapter over `kvrelay_ckf::PoolFilter`: wraps its typed errors in
//! [`PoolFault`] and keeps the per-source block counts load accounting needs. Every read
//! here is O(1) or O(sources), never a table scan: the actor refreshes its health after
//! every command.

use std::collections::BTreeMap;

use kvrelay_ckf::{
    ApplyOutcome, CkfConfig, ConfigError, Delta, FilterCounters, PoolFilter, RouterEvent, SourceId,
};
use kvrelay_identity::CkfFormat;

use crate::error::PoolFault;

/// Filter statistics reported by a pool actor; each field is maintained incrementally, so
/// reading them costs the same at any table size.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FilterStats {
    /// Buckets in the filter.
    pub bucket_count: u64,
    /// Occupied fingerprint slots (4 per bucket).
    pub occupied_slots: u64,
    /// Canonical blocks whose fingerprint is in the filter.
    pub resident_blocks: u64,
    /// Canonical blocks owned by at least one source (resident or omitted).
    pub owned_blocks: u64,
    /// Sources holding at least one block.
    pub sources: u64,
    /// Bytes held by the filter (table, dirty window, lineage, owners).
    pub memory_bytes: u64,
    /// The filter's cumulative counters (applied, rejected, omissions, unknown removals…).
    pub counters: FilterCounters,
}

/// A seed nobody outside this process can predict: std's per-process random hash keys,
/// which also differ between calls.
fn unpredictable_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(0x006C_696E_6561_6765_u64)
}

/// The filter state one actor owns.
pub(crate) struct FilterState {
    filter: PoolFilter,
    blocks_per_source: BTreeMap<SourceId, u64>,
}

impl FilterState {
    /// Builds a filter sized for `expected_unique_blocks` (allocates the whole table).
    /// Its lineages and owner table place keys by a seed the engines cannot know (see
    /// `PoolFilter::with_placement_seed`), so crafted block ids or token hashes cannot
    /// lengthen probe runs; the seed changes no result, word or delta.
    pub(crate) fn build(expected_unique_blocks: u64) -> Result<Self, ConfigError> {
        let filter = PoolFilter::with_placement_seed(
            CkfConfig::new(expected_unique_blocks),
            unpredictable_seed(),
        )?;
        Ok(Self {
            filter,
            blocks_per_source: BTreeMap::new(),
        })
    }

    pub(crate) fn format(&self) -> CkfFormat {
        self.filter.format()
    }

    /// Applies one event; on `Err` nothing changed.
    pub(crate) fn apply(&mut self, event: &RouterEvent) -> Result<ApplyOutcome, PoolFault> {
        let outcome = self.filter.apply(event)?;
        self.account(event.source, &outcome);
        Ok(outcome)
    }

    /// Drops every block of `source`.
    pub(crate) fn clear_source(&mut self, source: SourceId) -> Result<ApplyOutcome, PoolFault> {
        let outcome = self.filter.clear_source(source)?;
        self.blocks_per_source.remove(&source);
        Ok(outcome)
    }

    /// Drains the pending window into a delta (`None` when nothing changed net).
    pub(crate) fn take_delta(&mut self) -> Result<Option<Delta>, PoolFault> {
        Ok(self.filter.take_delta()?)
    }

    /// Distinct buckets changed since the last delta.
    pub(crate) fn pending_buckets(&self) -> usize {
        self.filter.pending_buckets()
    }

    /// The sequence of the last delta.
    pub(crate) fn sequence(&self) -> u64 {
        self.filter.sequence()
    }

    /// A copy of the table, allocated fallibly.
    pub(crate) fn copy_words(&self) -> Result<Vec<u64>, PoolFault> {
        let words = self.filter.words();
        let mut copy = Vec::new();
        copy.try_reserve_exact(words.len())
            .map_err(|_| PoolFault::SnapshotAllocation {
                bytes: words.len() as u64 * 8,
            })?;
        copy.extend_from_slice(words);
        Ok(copy)
    }

    pub(crate) fn source_blocks(&self) -> Vec<(SourceId, u64)> {
        self.blocks_per_source
            .iter()
            .map(|(source, n)| (*source, *n))
            .collect()
    }

    pub(crate) fn stats(&self) -> FilterStats {
        FilterStats {
            bucket_count: u64::from(self.filter.format().bucket_count()),
            occupied_slots: self.filter.occupied_slots(),
            resident_blocks: self.filter.n_resident(),
            owned_blocks: self.filter.n_canonicals(),
            sources: self.blocks_per_source.len() as u64,
            memory_bytes: self.filter.memory().total_bytes(),
            counters: *self.filter.counters(),
        }
    }

    /// A copy of the table (tests: compare replicas bit for bit).
    #[cfg(test)]
    pub(crate) fn words(&self) -> &[u64] {
        self.filter.words()
    }

    fn account(&mut self, source: SourceId, outcome: &ApplyOutcome) {
        let count = self.blocks_per_source.entry(source).or_insert(0);
        *count = count
            .saturating_add(outcome.blocks_mapped)
            .saturating_sub(outcome.mappings_removed);
        if *count == 0 {
            self.blocks_per_source.remove(&source);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placement_seeds_differ_between_filters() {
        let seeds: BTreeMap<u64, ()> = (0..8).map(|_| (unpredictable_seed(), ())).collect();
        assert_eq!(seeds.len(), 8);
    }
}
