//! What the host publishes to the WAN server, admin HTTP and the workload.
//!
//! Complete wire states live in `watch` channels (one writer: the supervisor). Status for
//! people (attached pools with their actor handles, the supervision core's readiness facts)
//! is a small snapshot replaced whole under a lock that is never held across an await.
//! Per-pool figures are read fresh from each actor's health (O(1)) when asked for.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, PoisonError};

use kvrelay_ckf::SourceId;
use kvrelay_codec::v1::{CatalogUpdate, LoadWindow, RelayIdentity, TopologyUpdate};
use kvrelay_identity::PoolId;
use kvrelay_pool::{FaultCategory, PoolActorHandle, PoolHealth};
use tokio::sync::watch;

use crate::host::checkpoint::SourcePositions;
use crate::host::supervisor::{HostFacts, PoolFacts};
use crate::limits::Limits;
use crate::metrics::{CategoryLabel, RelayMetrics};

/// Where one source's events go.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    pub(crate) pool: PoolId,
    pub(crate) generation: u64,
    pub(crate) actor: PoolActorHandle,
    /// Per-rank KV capacity, in blocks.
    pub(crate) capacity: u64,
    /// Tokens per block of the pool's query semantics.
    pub(crate) block_size: u32,
}

/// Every connected source's route.
#[derive(Debug, Clone, Default)]
pub(crate) struct Routes {
    pub(crate) routes: BTreeMap<SourceId, Route>,
}

/// One attached pool, for people.
#[derive(Debug, Clone)]
pub(crate) struct PoolStatus {
    pub(crate) endpoint: String,
    pub(crate) generation: u64,
    /// Sources whose events route to this pool (cards' ranks plus configured sources).
    pub(crate) routed_sources: usize,
    /// Its actor, for fresh health reads.
    pub(crate) actor: PoolActorHandle,
}

/// Counters of the trace workload.
#[derive(Debug, Default)]
pub(crate) struct WorkloadCounters {
    pub(crate) requests: AtomicU64,
    pub(crate) events: AtomicU64,
    pub(crate) blocks_stored: AtomicU64,
    pub(crate) blocks_removed: AtomicU64,
    pub(crate) events_dropped: AtomicU64,
    pub(crate) done: AtomicBool,
}

pub(crate) struct HostState {
    pub(crate) relay: RelayIdentity,
    pub(crate) limits: Limits,
    pub(crate) metrics: Arc<RelayMetrics>,
    pub(crate) catalog: watch::Sender<Arc<CatalogUpdate>>,
    pub(crate) load: watch::Sender<Arc<LoadWindow>>,
    pub(crate) topology: watch::Sender<Arc<TopologyUpdate>>,
    pub(crate) routes: watch::Sender<Arc<Routes>>,
    pub(crate) workload: WorkloadCounters,
    pub(crate) live: AtomicBool,
    /// The last batch each engine source applied (for checkpoints).
    pub(crate) positions: SourcePositions,
    /// What all ZMQ sources hold queued together (`[ingest] max_queued_bytes_total`).
    pub(crate) ingest_budget: kvrelay_ingest::QueueBudget,
    pools: Mutex<BTreeMap<String, PoolStatus>>,
    facts: Mutex<HostFacts>,
    /// Cumulative figures of each pool generation already added to the metric counters.
    counted: Mutex<BTreeMap<String, CountedHealth>>,
}

/// What a generation has contributed to the relay-wide counters so far.
#[derive(Debug, Clone, Copy, Default)]
struct CountedHealth {
    generation: u64,
    faults: [u64; 3],
    unroutable_blocks: u64,
    contradiction_resets: u64,
    tier_events_without_lane: u64,
    offloads_unmapped: u64,
}

impl HostState {
    pub(crate) fn new(
        relay: RelayIdentity,
        limits: Limits,
        metrics: Arc<RelayMetrics>,
        window_ms: u64,
        ingest_budget: kvrelay_ingest::QueueBudget,
    ) -> Self {
        Self {
            relay,
            limits,
            metrics,
            catalog: watch::Sender::new(Arc::new(CatalogUpdate {
                relay,
                revision: 0,
                pools: Vec::new(),
                coverage: Vec::new(),
                stalled: Vec::new(),
                tier_lanes: Vec::new(),
            })),
            load: watch::Sender::new(Arc::new(LoadWindow {
                relay,
                window_sequence: 0,
                observed_unix_ms: 0,
                window_ms,
                pools: Vec::new(),
            })),
            topology: watch::Sender::new(Arc::new(TopologyUpdate {
                relay,
                revision: 0,
                entries: Vec::new(),
            })),
            routes: watch::Sender::new(Arc::new(Routes::default())),
            workload: WorkloadCounters::default(),
            live: AtomicBool::new(true),
            positions: SourcePositions::default(),
            ingest_budget,
            pools: Mutex::new(BTreeMap::new()),
            facts: Mutex::new(HostFacts {
                unready: vec!["discovery has not listed yet".to_owned()],
                ..HostFacts::default()
            }),
            counted: Mutex::new(BTreeMap::new()),
        }
    }

    pub(crate) fn publish_catalog(&self, update: CatalogUpdate) {
        self.metrics
            .pools
            .set(i64::try_from(update.pools.len()).unwrap_or(i64::MAX));
        self.metrics
            .catalog_revision
            .set(i64::try_from(update.revision).unwrap_or(i64::MAX));
        self.catalog.send_replace(Arc::new(update));
    }

    pub(crate) fn catalog_snapshot(&self) -> Arc<CatalogUpdate> {
        self.catalog.borrow().clone()
    }

    pub(crate) fn publish_load(&self, window: LoadWindow) {
        self.load.send_replace(Arc::new(window));
    }

    pub(crate) fn publish_topology(&self, update: TopologyUpdate) {
        self.topology.send_replace(Arc::new(update));
    }

    pub(crate) fn publish_routes(&self, routes: Routes, pools: BTreeMap<String, PoolStatus>) {
        self.routes.send_replace(Arc::new(routes));
        *self.pools.lock().unwrap_or_else(PoisonError::into_inner) = pools;
    }

    /// The supervision core's facts after its latest step.
    pub(crate) fn publish_facts(&self, facts: HostFacts) {
        // `kvrelay_sources{state}` is written from the sources' own probes (source_metrics),
        // the one place that sees every transport state change.
        let count = |counts: fn(&PoolFacts) -> bool| {
            let pools = facts.pools.values().filter(|pool| counts(pool)).count();
            i64::try_from(pools).unwrap_or(i64::MAX)
        };
        self.metrics.pools_stalled.set(count(|pool| pool.stalled));
        self.metrics
            .pools_degraded
            .set(count(|pool| pool.degraded.is_some()));
        self.metrics
            .pools_overfull
            .set(count(|pool| pool.overfull.is_some()));
        *self.facts.lock().unwrap_or_else(PoisonError::into_inner) = facts;
    }

    pub(crate) fn facts(&self) -> HostFacts {
        self.facts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Folds one health reading per attached pool generation (and per lower-tier lane)
    /// into the metrics: counters grow by what each generation added since its last
    /// reading; gauges are relay-wide maxima and sums (no per-pool labels).
    pub(crate) fn record_health(&self, healths: &[(String, u64, PoolHealth)]) {
        let mut omissions = 0u64;
        let mut load_max = 0f64;
        let mut depth_max = 0usize;
        let mut oldest_max = 0f64;
        let mut counted = self.counted.lock().unwrap_or_else(PoisonError::into_inner);
        let mut next = BTreeMap::new();
        for (key, generation, health) in healths {
            let stats = &health.stats;
            omissions = omissions.saturating_add(stats.filter.counters.capacity_omissions);
            load_max = load_max.max(filter_load(health));
            depth_max = depth_max.max(health.mailbox_depth);
            oldest_max = oldest_max.max(
                health
                    .oldest_pending_age
                    .map_or(0.0, |age| age.as_secs_f64()),
            );
            let before = counted
                .get(key)
                .filter(|before| before.generation == *generation)
                .copied()
                .unwrap_or(CountedHealth {
                    generation: *generation,
                    ..CountedHealth::default()
                });
            let now = CountedHealth {
                generation: *generation,
                faults: FaultCategory::ALL.map(|category| stats.faults.get(category)),
                unroutable_blocks: stats.unroutable_blocks,
                contradiction_resets: stats.contradiction_resets,
                tier_events_without_lane: stats.tier_events_without_lane,
                offloads_unmapped: stats.offloads_unmapped,
            };
            for (index, category) in FaultCategory::ALL.into_iter().enumerate() {
                self.metrics
                    .pool_faults
                    .get_or_create(&CategoryLabel {
                        category: category.label(),
                    })
                    .inc_by(now.faults[index].saturating_sub(before.faults[index]));
            }
            self.metrics.pool_unroutable_blocks.inc_by(
                now.unroutable_blocks
                    .saturating_sub(before.unroutable_blocks),
            );
            self.metrics.pool_contradiction_resets.inc_by(
                now.contradiction_resets
                    .saturating_sub(before.contradiction_resets),
            );
            self.metrics.tier_events_without_lane.inc_by(
                now.tier_events_without_lane
                    .saturating_sub(before.tier_events_without_lane),
            );
            self.metrics.tier_offloads_unmapped.inc_by(
                now.offloads_unmapped
                    .saturating_sub(before.offloads_unmapped),
            );
            next.insert(key.clone(), now);
        }
        *counted = next;
        drop(counted);
        self.metrics
            .filter_omissions
            .set(i64::try_from(omissions).unwrap_or(i64::MAX));
        self.metrics.filter_load_max.set(load_max);
        self.metrics
            .pool_mailbox_depth_max
            .set(i64::try_from(depth_max).unwrap_or(i64::MAX));
        self.metrics.pool_oldest_pending_seconds_max.set(oldest_max);
    }

    pub(crate) fn pools(&self) -> BTreeMap<String, PoolStatus> {
        self.pools
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Occupied slots over all slots (4 per bucket), 0 for an empty filter.
pub(crate) fn filter_load(health: &PoolHealth) -> f64 {
    let filter = &health.stats.filter;
    let slots = filter.bucket_count.saturating_mul(4);
    if slots == 0 {
        0.0
    } else {
        filter.occupied_slots as f64 / slots as f64
    }
}
