//! The pool actor's adapter over `kvrelay_ckf::PoolFilter`: wraps its typed errors in
//! [`PoolFault`] and keeps the per-source block counts load accounting needs. Every read
//! here is O(1) or O(sources), never a table scan: the actor refreshes its health after
//! every command.

use std::collections::BTreeMap;

use kvrelay_ckf::tier::{Resolved, ResolvedChange};
use kvrelay_ckf::{
    ApplyOutcome, CkfConfig, ConfigError, Delta, FilterCounters, PoolFilter, RouterEvent, SourceId,
    TierEvent,
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

/// One source's exact ownership: `(engine block id, canonical hash)` mappings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceMappings {
    /// The engine source.
    pub source: SourceId,
    /// Its mappings, in no particular order.
    pub mappings: Vec<(u64, u64)>,
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
    /// Builds a filter as `config` sizes it (allocates the whole table).
    /// Its lineages and owner table place keys by a seed the engines cannot know (see
    /// `PoolFilter::with_placement_seed`), so crafted block ids or token hashes cannot
    /// lengthen probe runs; the seed changes no result, word or delta.
    pub(crate) fn build(config: CkfConfig) -> Result<Self, ConfigError> {
        let filter = PoolFilter::with_placement_seed(config, unpredictable_seed())?;
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

    /// Resolves a lower-tier event against this (device) filter as it stands now.
    pub(crate) fn resolve_tier(&self, event: &TierEvent) -> Result<Resolved, PoolFault> {
        Ok(kvrelay_ckf::tier::resolve(&self.filter, event)?)
    }

    /// Applies a resolved lower-tier change of `source` (this is a lane's filter); on
    /// `Err` nothing changed.
    pub(crate) fn apply_resolved(
        &mut self,
        source: SourceId,
        change: &ResolvedChange,
    ) -> Result<ApplyOutcome, PoolFault> {
        let outcome = kvrelay_ckf::tier::apply_resolved(&mut self.filter, source, change)?;
        self.account(source, &outcome);
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

    /// Every source's mappings (engine block id → canonical), in ascending source order;
    /// copied fallibly.
    pub(crate) fn export_mappings(&self) -> Result<Vec<SourceMappings>, PoolFault> {
        let mut sources: Vec<SourceId> = self.filter.sources().collect();
        sources.sort_unstable();
        let mut exported = Vec::with_capacity(sources.len());
        for source in sources {
            let n = self.filter.source_mappings(source).count();
            let mut mappings = Vec::new();
            mappings
                .try_reserve_exact(n)
                .map_err(|_| PoolFault::SnapshotAllocation {
                    bytes: n as u64 * 16,
                })?;
            mappings.extend(self.filter.source_mappings(source));
            exported.push(SourceMappings { source, mappings });
        }
        Ok(exported)
    }

    /// Makes each listed source hold exactly its mappings, all or nothing: when one is
    /// refused, the sources restored before it get back what they held (a copy taken
    /// first; empty for the fresh generation a restore is meant for) and the fault is
    /// returned.
    pub(crate) fn restore(&mut self, sources: &[SourceMappings]) -> Result<u64, PoolFault> {
        let mut previous = Vec::with_capacity(sources.len());
        for entry in sources {
            let held: Vec<(u64, u64)> = self.filter.source_mappings(entry.source).collect();
            previous.push(SourceMappings {
                source: entry.source,
                mappings: held,
            });
        }
        let mut restored_blocks = 0u64;
        for (index, entry) in sources.iter().enumerate() {
            if let Err(fault) = self.filter.restore_source(entry.source, &entry.mappings) {
                for undone in previous[..index].iter().rev() {
                    // Mappings the filter held a moment ago: only an allocation can fail.
                    let _ = self.filter.restore_source(undone.source, &undone.mappings);
                    self.recount(undone.source);
                }
                return Err(fault.into());
            }
            restored_blocks += self.recount(entry.source);
        }
        Ok(restored_blocks)
    }

    /// Sets `source`'s block count from its lineage; returns it.
    fn recount(&mut self, source: SourceId) -> u64 {
        let held = self.filter.source_mappings(source).count() as u64;
        if held == 0 {
            self.blocks_per_source.remove(&source);
        } else {
            self.blocks_per_source.insert(source, held);
        }
        held
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
