//! Pool load accounting: per-rank KV occupancy against capacity from worker configs.
//!
//! Pure and synchronous. A pool declares its ranks through [`WorkerCapacity`] entries
//! (one per worker, covering `data_parallel_size` ranks from `data_parallel_start_rank`).
//! Only worker-authoritative `kv_used_blocks` observations count; scheduler-only numbers
//! are accepted and ignored. A [`PoolLoadSnapshot`] is authoritative only when every
//! declared rank has reported and has a known, non-zero capacity; sums saturate.

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_identity::ProducerIdentity;
use serde::Serialize;

use crate::error::LoadCapacityError;

/// The most data-parallel ranks one worker may declare.
pub const MAX_DATA_PARALLEL_RANKS: u32 = 4096;

/// What one worker's runtime config says about its KV capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerCapacity {
    /// The worker's instance id.
    pub worker_id: u64,
    /// The first data-parallel rank the worker serves.
    pub data_parallel_start_rank: u32,
    /// How many data-parallel ranks the worker serves (1..=4096).
    pub data_parallel_size: u32,
    /// KV blocks per rank (blocks); `None` or `Some(0)` means unknown.
    pub total_kv_blocks: Option<u64>,
}

impl WorkerCapacity {
    /// A worker without data parallelism (one rank, rank 0).
    pub fn single_rank(worker_id: u64, total_kv_blocks: Option<u64>) -> Self {
        Self {
            worker_id,
            data_parallel_start_rank: 0,
            data_parallel_size: 1,
            total_kv_blocks,
        }
    }
}

/// One load report for one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadObservation {
    /// The worker's instance id.
    pub worker_id: u64,
    /// The data-parallel rank.
    pub dp_rank: u32,
    /// KV blocks in use on that rank (blocks); the only authoritative field.
    pub kv_used_blocks: Option<u64>,
    /// Scheduler view of active decode blocks (advisory, ignored).
    pub active_decode_blocks: Option<u64>,
    /// Scheduler view of active prefill tokens (advisory, ignored).
    pub active_prefill_tokens: Option<u64>,
}

/// What [`PoolLoadState::observe`] did with a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadObservationOutcome {
    /// The rank is not declared by the pool's capacity.
    UnknownRank,
    /// The report had no `kv_used_blocks`; accepted and ignored.
    IgnoredAdvisory,
    /// The rank's observation was stored.
    Updated,
}

/// A complete load view of one pool generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct PoolLoadSnapshot {
    /// The producer generation this load belongs to.
    pub producer: ProducerIdentity,
    /// Sum of used blocks, only when every declared rank has reported.
    pub kv_used_blocks: Option<u64>,
    /// Sum of capacities, only when every declared rank has a known capacity.
    pub total_kv_blocks: Option<u64>,
    /// Declared ranks that have reported.
    pub kv_observed_ranks: u32,
    /// Declared ranks with a known capacity.
    pub kv_capacity_ranks: u32,
    /// Declared ranks.
    pub kv_expected_ranks: u32,
}

impl PoolLoadSnapshot {
    /// True when the snapshot is not authoritative: no declared ranks, or some rank has
    /// not reported or has no known capacity.
    pub fn has_degraded_coverage(&self) -> bool {
        self.kv_expected_ranks == 0
            || self.kv_observed_ranks < self.kv_expected_ranks
            || self.kv_capacity_ranks < self.kv_expected_ranks
    }
}

/// The load state of one pool generation.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolLoadState {
    /// Declared ranks and their capacity (`None` = unknown).
    capacity: BTreeMap<(u64, u32), Option<u64>>,
    /// Latest used blocks per declared rank.
    observations: BTreeMap<(u64, u32), u64>,
}

impl PoolLoadState {
    /// Builds the state from the workers' capacities.
    pub fn from_capacities(workers: &[WorkerCapacity]) -> Result<Self, LoadCapacityError> {
        Ok(Self {
            capacity: declared_ranks(workers)?,
            observations: BTreeMap::new(),
        })
    }

    /// Replaces the declared capacity.
    ///
    /// Invalid input clears capacities and observations (the snapshot becomes degraded)
    /// and returns the error. Identical capacity returns `Ok(false)`. Otherwise keeps only
    /// the observations of ranks whose capacity is unchanged and returns `Ok(true)`.
    pub fn replace_capacity(
        &mut self,
        workers: &[WorkerCapacity],
    ) -> Result<bool, LoadCapacityError> {
        let capacity = match declared_ranks(workers) {
            Ok(capacity) => capacity,
            Err(error) => {
                self.capacity.clear();
                self.observations.clear();
                return Err(error);
            }
        };
        if capacity == self.capacity {
            return Ok(false);
        }
        let previous = std::mem::replace(&mut self.capacity, capacity);
        let current = &self.capacity;
        self.observations.retain(|rank, _| {
            previous
                .get(rank)
                .is_some_and(|old| current.get(rank) == Some(old))
        });
        Ok(true)
    }

    /// Records one rank's report.
    pub fn observe(&mut self, observation: LoadObservation) -> LoadObservationOutcome {
        let rank = (observation.worker_id, observation.dp_rank);
        if !self.capacity.contains_key(&rank) {
            return LoadObservationOutcome::UnknownRank;
        }
        match observation.kv_used_blocks {
            None => LoadObservationOutcome::IgnoredAdvisory,
            Some(used) => {
                self.observations.insert(rank, used);
                LoadObservationOutcome::Updated
            }
        }
    }

    /// Drops every observation; true if there was one.
    pub fn clear_observations(&mut self) -> bool {
        let had_any = !self.observations.is_empty();
        self.observations.clear();
        had_any
    }

    /// The pool's load view for `producer`.
    pub fn snapshot(&self, producer: ProducerIdentity) -> PoolLoadSnapshot {
        let expected = self.capacity.len();
        let observed = self.observations.len();
        let known: Vec<u64> = self.capacity.values().filter_map(|c| *c).collect();
        let used = (expected > 0 && observed == expected).then(|| {
            self.observations
                .values()
                .fold(0u64, |sum, used| sum.saturating_add(*used))
        });
        let total = (expected > 0 && known.len() == expected).then(|| {
            known
                .iter()
                .fold(0u64, |sum, blocks| sum.saturating_add(*blocks))
        });
        PoolLoadSnapshot {
            producer,
            kv_used_blocks: used,
            total_kv_blocks: total,
            kv_observed_ranks: saturate(observed),
            kv_capacity_ranks: saturate(known.len()),
            kv_expected_ranks: saturate(expected),
        }
    }
}

fn saturate(count: usize) -> u32 {
    u32::try_from(count).unwrap_or(u32::MAX)
}

fn declared_ranks(
    workers: &[WorkerCapacity],
) -> Result<BTreeMap<(u64, u32), Option<u64>>, LoadCapacityError> {
    let mut seen = BTreeSet::new();
    let mut ranks = BTreeMap::new();
    for worker in workers {
        let worker_id = worker.worker_id;
        if !seen.insert(worker_id) {
            return Err(LoadCapacityError::DuplicateWorker { worker_id });
        }
        if worker.data_parallel_size == 0 {
            return Err(LoadCapacityError::ZeroDataParallelSize { worker_id });
        }
        if worker.data_parallel_size > MAX_DATA_PARALLEL_RANKS {
            return Err(LoadCapacityError::TooManyRanks {
                worker_id,
                ranks: worker.data_parallel_size,
                max: MAX_DATA_PARALLEL_RANKS,
            });
        }
        let start = worker.data_parallel_start_rank;
        let end = start.checked_add(worker.data_parallel_size).ok_or(
            LoadCapacityError::RankRangeOverflow {
                worker_id,
                start,
                size: worker.data_parallel_size,
            },
        )?;
        let blocks = worker.total_kv_blocks.filter(|blocks| *blocks > 0);
        for rank in start..end {
            ranks.insert((worker_id, rank), blocks);
        }
    }
    Ok(ranks)
}

#[cfg(test)]
mod tests {
    use kvrelay_identity::{
        CacheSemanticsId, CkfFormat, DcId, IdentitySource, IndexerDomainId, PoolId, RoutingScopeId,
    };

    use super::*;

    fn producer() -> ProducerIdentity {
        let digest = CacheSemanticsId::new([1; 16], IdentitySource::Explicit);
        let pool = PoolId {
            indexer_domain: IndexerDomainId {
                cache_semantics: digest,
                routing_scope: RoutingScopeId::new([2; 16], IdentitySource::Explicit),
            },
            dc_id: DcId(9),
        };
        ProducerIdentity::new(pool, 1, 1, CkfFormat::v1(1, 16).unwrap()).unwrap()
    }

    fn used(worker_id: u64, dp_rank: u32, blocks: u64) -> LoadObservation {
        LoadObservation {
            worker_id,
            dp_rank,
            kv_used_blocks: Some(blocks),
            ..LoadObservation::default()
        }
    }

    fn dp(worker_id: u64, start: u32, size: u32, blocks: Option<u64>) -> WorkerCapacity {
        WorkerCapacity {
            worker_id,
            data_parallel_start_rank: start,
            data_parallel_size: size,
            total_kv_blocks: blocks,
        }
    }

    #[test]
    fn load_is_authoritative_only_with_every_rank_reported() {
        let mut state = PoolLoadState::from_capacities(&[dp(1, 0, 2, Some(100))]).unwrap();
        assert_eq!(
            state.observe(used(1, 0, 30)),
            LoadObservationOutcome::Updated
        );
        let partial = state.snapshot(producer());
        assert_eq!(
            (partial.kv_used_blocks, partial.total_kv_blocks),
            (None, Some(200))
        );
        assert!(partial.has_degraded_coverage());
        state.observe(used(1, 1, 20));
        let full = state.snapshot(producer());
        assert_eq!(
            (
                full.kv_used_blocks,
                full.kv_observed_ranks,
                full.kv_expected_ranks
            ),
            (Some(50), 2, 2)
        );
        assert!(!full.has_degraded_coverage());
    }

    #[test]
    fn zero_capacity_means_unknown() {
        let state =
            PoolLoadState::from_capacities(&[dp(1, 0, 1, Some(0)), dp(2, 0, 1, Some(10))]).unwrap();
        let snapshot = state.snapshot(producer());
        assert_eq!(
            (snapshot.total_kv_blocks, snapshot.kv_capacity_ranks),
            (None, 1)
        );
        assert!(snapshot.has_degraded_coverage());
    }

    #[test]
    fn sums_saturate() {
        let mut state = PoolLoadState::from_capacities(&[dp(1, 0, 2, Some(u64::MAX))]).unwrap();
        state.observe(used(1, 0, u64::MAX));
        state.observe(used(1, 1, 5));
        let snapshot = state.snapshot(producer());
        assert_eq!(
            (snapshot.kv_used_blocks, snapshot.total_kv_blocks),
            (Some(u64::MAX), Some(u64::MAX))
        );
    }

    #[test]
    fn undeclared_ranks_and_advisory_reports_are_not_stored() {
        let mut state = PoolLoadState::from_capacities(&[dp(1, 4, 1, Some(10))]).unwrap();
        assert_eq!(
            state.observe(used(1, 0, 3)),
            LoadObservationOutcome::UnknownRank
        );
        assert_eq!(
            state.observe(LoadObservation {
                worker_id: 1,
                dp_rank: 4,
                active_decode_blocks: Some(9),
                ..LoadObservation::default()
            }),
            LoadObservationOutcome::IgnoredAdvisory
        );
        assert!(!state.clear_observations());
    }

    #[test]
    fn invalid_capacity_is_rejected_with_the_worker() {
        let cases = [
            (
                vec![dp(3, 0, 0, None)],
                LoadCapacityError::ZeroDataParallelSize { worker_id: 3 },
            ),
            (
                vec![dp(3, 0, 4097, None)],
                LoadCapacityError::TooManyRanks {
                    worker_id: 3,
                    ranks: 4097,
                    max: 4096,
                },
            ),
            (
                vec![dp(3, u32::MAX, 2, None)],
                LoadCapacityError::RankRangeOverflow {
                    worker_id: 3,
                    start: u32::MAX,
                    size: 2,
                },
            ),
            (
                vec![dp(3, 0, 1, None), dp(3, 1, 1, None)],
                LoadCapacityError::DuplicateWorker { worker_id: 3 },
            ),
        ];
        for (workers, expected) in cases {
            assert_eq!(PoolLoadState::from_capacities(&workers), Err(expected));
        }
    }

    #[test]
    fn capacity_change_keeps_only_unchanged_ranks_and_invalid_change_clears() {
        let mut state =
            PoolLoadState::from_capacities(&[dp(1, 0, 1, Some(10)), dp(2, 0, 1, Some(10))])
                .unwrap();
        state.observe(used(1, 0, 1));
        state.observe(used(2, 0, 2));
        assert_eq!(
            state.replace_capacity(&[dp(1, 0, 1, Some(10)), dp(2, 0, 1, Some(10))]),
            Ok(false)
        );
        assert_eq!(
            state.replace_capacity(&[dp(1, 0, 1, Some(10)), dp(2, 0, 1, Some(20))]),
            Ok(true)
        );
        assert_eq!(state.snapshot(producer()).kv_observed_ranks, 1);
        assert!(state.replace_capacity(&[dp(1, 0, 0, None)]).is_err());
        let degraded = state.snapshot(producer());
        assert_eq!(
            (degraded.kv_expected_ranks, degraded.kv_observed_ranks),
            (0, 0)
        );
        assert!(degraded.has_degraded_coverage());
    }
}
