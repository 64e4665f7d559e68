//! The pool actor's adapter over its producer: a `kvrelay_ckf::PoolFilter` fed events (a
//! pool or a lower tier's lane), or a `kvrelay_ckf::MembershipFilter` fed its pool's
//! membership log (a format twin). Wraps their typed errors in [`PoolFault`] and keeps the
//! per-source block counts load accounting needs. Every read here is O(1) or O(sources),
//! never a table scan: the actor refreshes its health after every command.

use std::collections::BTreeMap;

use kvrelay_ckf::tier::{Resolved, ResolvedChange};
use kvrelay_ckf::{
    ApplyOutcome, CkfConfig, ConfigError, Delta, FilterCounters, Membership, MembershipFilter,
    PoolFilter, RouterEvent, SourceId, TierEvent,
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
    /// Bytes held by the filter (table, dirty window, lineage, owners; a format twin's
    /// are its table, window and omitted hashes).
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
    producer: Producer,
    blocks_per_source: BTreeMap<SourceId, u64>,
}

/// What feeds the actor's table.
enum Producer {
    /// Events (a pool, or a lower tier's lane): an exact index of its own.
    Events(PoolFilter),
    /// Its pool's membership log (a format twin): the pool's exact index decides.
    Memberships(MembershipFilter),
}

/// The fault of sending `operation` (events, tier changes, mappings) to a format twin.
fn not_for_twin(operation: &'static str) -> PoolFault {
    PoolFault::WrongFeed {
        kind: "format twin",
        operation,
    }
}

/// Sets `source`'s block count in `blocks_per_source` from `filter`'s lineage; returns it.
fn recount(
    filter: &PoolFilter,
    blocks_per_source: &mut BTreeMap<SourceId, u64>,
    source: SourceId,
) -> u64 {
    let held = filter.source_mappings(source).count() as u64;
    if held == 0 {
        blocks_per_source.remove(&source);
    } else {
        blocks_per_source.insert(source, held);
    }
    held
}

/// Dispatches a read to whichever producer the state holds.
macro_rules! producer {
    ($state:expr, $filter:ident => $read:expr) => {
        match &$state.producer {
            Producer::Events($filter) => $read,
            Producer::Memberships($filter) => $read,
        }
    };
}

impl FilterState {
    /// Builds a filter as `config` sizes it (allocates the whole table).
    /// Its lineages and owner table place keys by a seed the engines cannot know (see
    /// `PoolFilter::with_placement_seed`), so crafted block ids or token hashes cannot
    /// lengthen probe runs; the seed changes no result, word or delta.
    pub(crate) fn build(config: CkfConfig) -> Result<Self, ConfigError> {
        let filter = PoolFilter::with_placement_seed(config, unpredictable_seed())?;
        Ok(Self {
            producer: Producer::Events(filter),
            blocks_per_source: BTreeMap::new(),
        })
    }

    /// Builds a format twin's filter as `config` sizes it: fed its pool's membership log
    /// ([`FilterState::apply_memberships`]), no exact index of its own.
    pub(crate) fn build_twin(config: CkfConfig) -> Result<Self, ConfigError> {
        Ok(Self {
            producer: Producer::Memberships(MembershipFilter::new(config)?),
            blocks_per_source: BTreeMap::new(),
        })
    }

    pub(crate) fn format(&self) -> CkfFormat {
        producer!(self, filter => filter.format())
    }

    /// The filter fed events, or the fault of sending `operation` to a twin.
    fn events_mut(&mut self, operation: &'static str) -> Result<&mut PoolFilter, PoolFault> {
        match &mut self.producer {
            Producer::Events(filter) => Ok(filter),
            Producer::Memberships(_) => Err(not_for_twin(operation)),
        }
    }

    /// Starts recording the owned-set changes a format twin is fed (see
    /// `PoolFilter::record_memberships`); a twin has nothing to record.
    pub(crate) fn record_memberships(&mut self) {
        if let Producer::Events(filter) = &mut self.producer {
            filter.record_memberships(true);
        }
    }

    /// The owned-set changes since the last call (empty unless recording).
    pub(crate) fn take_memberships(&mut self) -> Vec<Membership> {
        match &mut self.producer {
            Producer::Events(filter) => filter.take_memberships(),
            Producer::Memberships(_) => Vec::new(),
        }
    }

    /// Applies one event; on `Err` nothing changed.
    pub(crate) fn apply(&mut self, event: &RouterEvent) -> Result<ApplyOutcome, PoolFault> {
        let outcome = self.events_mut("engine events")?.apply(event)?;
        self.account(event.source, &outcome);
        Ok(outcome)
    }

    /// Applies a pool's membership log (this is its format twin); on `Err` nothing
    /// changed.
    pub(crate) fn apply_memberships(
        &mut self,
        changes: &[Membership],
    ) -> Result<ApplyOutcome, PoolFault> {
        match &mut self.producer {
            Producer::Memberships(twin) => twin.apply(changes).map_err(PoolFault::TwinDiverged),
            Producer::Events(_) => Err(PoolFault::WrongFeed {
                kind: "filter fed events",
                operation: "a membership log",
            }),
        }
    }

    /// Resolves a lower-tier event against this (device) filter as it stands now.
    pub(crate) fn resolve_tier(&self, event: &TierEvent) -> Result<Resolved, PoolFault> {
        match &self.producer {
            Producer::Events(filter) => Ok(kvrelay_ckf::tier::resolve(filter, event)?),
            Producer::Memberships(_) => Err(not_for_twin("tier events")),
        }
    }

    /// Applies a resolved lower-tier change of `source` (this is a lane's filter); on
    /// `Err` nothing changed.
    pub(crate) fn apply_resolved(
        &mut self,
        source: SourceId,
        change: &ResolvedChange,
    ) -> Result<ApplyOutcome, PoolFault> {
        let filter = self.events_mut("tier changes")?;
        let outcome = kvrelay_ckf::tier::apply_resolved(filter, source, change)?;
        self.account(source, &outcome);
        Ok(outcome)
    }

    /// Drops every block of `source` (a twin has no sources: its pool's log carries a
    /// clear's removals).
    pub(crate) fn clear_source(&mut self, source: SourceId) -> Result<ApplyOutcome, PoolFault> {
        let Producer::Events(filter) = &mut self.producer else {
            return Ok(ApplyOutcome::default());
        };
        let outcome = filter.clear_source(source)?;
        self.blocks_per_source.remove(&source);
        Ok(outcome)
    }

    /// Drains the pending window into a delta (`None` when nothing changed net).
    pub(crate) fn take_delta(&mut self) -> Result<Option<Delta>, PoolFault> {
        Ok(match &mut self.producer {
            Producer::Events(filter) => filter.take_delta()?,
            Producer::Memberships(twin) => twin.take_delta()?,
        })
    }

    /// Distinct buckets changed since the last delta.
    pub(crate) fn pending_buckets(&self) -> usize {
        producer!(self, filter => filter.pending_buckets())
    }

    /// The sequence of the last delta.
    pub(crate) fn sequence(&self) -> u64 {
        producer!(self, filter => filter.sequence())
    }

    /// A copy of the table, allocated fallibly.
    pub(crate) fn copy_words(&self) -> Result<Vec<u64>, PoolFault> {
        let words = producer!(self, filter => filter.words());
        let mut copy = Vec::new();
        copy.try_reserve_exact(words.len())
            .map_err(|_| PoolFault::SnapshotAllocation {
                bytes: words.len() as u64 * 8,
            })?;
        copy.extend_from_slice(words);
        Ok(copy)
    }

    /// Every source's mappings (engine block id → canonical), in ascending source order;
    /// copied fallibly. A twin has none (it is rebuilt from its pool's).
    pub(crate) fn export_mappings(&self) -> Result<Vec<SourceMappings>, PoolFault> {
        let Producer::Events(filter) = &self.producer else {
            return Ok(Vec::new());
        };
        let mut sources: Vec<SourceId> = filter.sources().collect();
        sources.sort_unstable();
        let mut exported = Vec::with_capacity(sources.len());
        for source in sources {
            let n = filter.source_mappings(source).count();
            let mut mappings = Vec::new();
            mappings
                .try_reserve_exact(n)
                .map_err(|_| PoolFault::SnapshotAllocation {
                    bytes: n as u64 * 16,
                })?;
            mappings.extend(filter.source_mappings(source));
            exported.push(SourceMappings { source, mappings });
        }
        Ok(exported)
    }

    /// Makes each listed source hold exactly its mappings, all or nothing: when one is
    /// refused, the sources restored before it get back what they held (a copy taken
    /// first; empty for the fresh generation a restore is meant for) and the fault is
    /// returned.
    pub(crate) fn restore(&mut self, sources: &[SourceMappings]) -> Result<u64, PoolFault> {
        let Self {
            producer,
            blocks_per_source,
        } = self;
        let Producer::Events(filter) = producer else {
            return Err(not_for_twin("restored mappings"));
        };
        let mut previous = Vec::with_capacity(sources.len());
        for entry in sources {
            let held: Vec<(u64, u64)> = filter.source_mappings(entry.source).collect();
            previous.push(SourceMappings {
                source: entry.source,
                mappings: held,
            });
        }
        let mut restored_blocks = 0u64;
        for (index, entry) in sources.iter().enumerate() {
            if let Err(fault) = filter.restore_source(entry.source, &entry.mappings) {
                for undone in previous[..index].iter().rev() {
                    // Mappings the filter held a moment ago: only an allocation can fail.
                    let _ = filter.restore_source(undone.source, &undone.mappings);
                    recount(filter, blocks_per_source, undone.source);
                }
                return Err(fault.into());
            }
            restored_blocks += recount(filter, blocks_per_source, entry.source);
        }
        Ok(restored_blocks)
    }

    pub(crate) fn source_blocks(&self) -> Vec<(SourceId, u64)> {
        self.blocks_per_source
            .iter()
            .map(|(source, n)| (*source, *n))
            .collect()
    }

    pub(crate) fn stats(&self) -> FilterStats {
        let owned_blocks = match &self.producer {
            Producer::Events(filter) => filter.n_canonicals(),
            Producer::Memberships(twin) => twin.n_owned(),
        };
        producer!(self, filter => FilterStats {
            bucket_count: u64::from(filter.format().bucket_count()),
            occupied_slots: filter.occupied_slots(),
            resident_blocks: filter.n_resident(),
            owned_blocks,
            sources: self.blocks_per_source.len() as u64,
            memory_bytes: filter.memory().total_bytes(),
            counters: *filter.counters(),
        })
    }

    /// A copy of the table (tests: compare replicas bit for bit).
    #[cfg(test)]
    pub(crate) fn words(&self) -> &[u64] {
        producer!(self, filter => filter.words())
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

    /// What a format twin refuses is the sender's fault (counted, the generation kept);
    /// a log it could not apply means it no longer mirrors its pool (the generation is
    /// rebuilt).
    #[test]
    fn a_twins_faults_are_categorised_by_who_must_act() {
        use crate::actor::FaultCategory;
        let mut twin = FilterState::build_twin(CkfConfig::new(64)).unwrap();
        let refused = twin.resolve_tier(&TierEvent {
            source: SourceId::new(1, 0),
            event_id: 1,
            tier: kvrelay_ckf::CacheTier::Host,
            change: kvrelay_ckf::TierChange::Cleared,
        });
        let fault = refused.unwrap_err();
        assert!(matches!(fault, PoolFault::WrongFeed { .. }), "{fault:?}");
        assert_eq!(fault.category(), FaultCategory::SourceProtocol);
        assert!(twin.restore(&[]).is_err());
        let diverged = PoolFault::TwinDiverged(kvrelay_ckf::ApplyError::AllocationFailed {
            what: "dirty window",
            bytes: 1 << 40,
        });
        assert_eq!(diverged.category(), FaultCategory::ProducerInvariant);
        let mut pool = FilterState::build(CkfConfig::new(64)).unwrap();
        let fault = pool.apply_memberships(&[]).unwrap_err();
        assert_eq!(fault.category(), FaultCategory::SourceProtocol);
    }

    #[test]
    fn placement_seeds_differ_between_filters() {
        let seeds: BTreeMap<u64, ()> = (0..8).map(|_| (unpredictable_seed(), ())).collect();
        assert_eq!(seeds.len(), 8);
    }
}
