//! What the host publishes to the WAN server, admin HTTP and the workload.
//!
//! Complete wire states live in `watch` channels (one writer: the supervisor). Status for
//! people (pools, stats, readiness facts) is a small snapshot replaced whole under a lock
//! that is never held across an await.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use kvrelay_ckf::SourceId;
use kvrelay_codec::v1::{CatalogUpdate, LoadWindow, RelayIdentity, TopologyUpdate};
use kvrelay_identity::PoolId;
use kvrelay_pool::{PoolActorHandle, PoolActorStats};
use tokio::sync::watch;

use crate::limits::Limits;
use crate::metrics::RelayMetrics;

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
    pub(crate) sources: usize,
    pub(crate) stats: Option<PoolActorStats>,
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
    discovery_listed: AtomicBool,
    pools: Mutex<BTreeMap<String, PoolStatus>>,
}

impl HostState {
    pub(crate) fn new(
        relay: RelayIdentity,
        limits: Limits,
        metrics: Arc<RelayMetrics>,
        window_ms: u64,
    ) -> Self {
        Self {
            relay,
            limits,
            metrics,
            catalog: watch::Sender::new(Arc::new(CatalogUpdate {
                relay,
                revision: 0,
                pools: Vec::new(),
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
            discovery_listed: AtomicBool::new(false),
            pools: Mutex::new(BTreeMap::new()),
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
        let mut current = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
        let mut next = pools;
        for (key, status) in next.iter_mut() {
            if let Some(previous) = current.get(key)
                && previous.generation == status.generation
            {
                status.stats.clone_from(&previous.stats);
            }
        }
        *current = next;
        drop(current);
        // `kvrelay_sources{state}` comes from the sources' real states (source_metrics).
    }

    pub(crate) fn record_pool_stats(&self, stats: Vec<(String, PoolActorStats)>) {
        let mut omissions = 0u64;
        let mut load_max = 0f64;
        {
            let mut pools = self.pools.lock().unwrap_or_else(PoisonError::into_inner);
            for (key, stats) in stats {
                omissions = omissions.saturating_add(stats.filter.counters.capacity_omissions);
                load_max = load_max.max(filter_load(&stats));
                if let Some(status) = pools.get_mut(&key) {
                    status.stats = Some(stats);
                }
            }
        }
        self.metrics
            .filter_omissions
            .set(i64::try_from(omissions).unwrap_or(i64::MAX));
        self.metrics.filter_load_max.set(load_max);
    }

    pub(crate) fn pools(&self) -> BTreeMap<String, PoolStatus> {
        self.pools
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    pub(crate) fn mark_discovery_listed(&self) {
        self.discovery_listed.store(true, Ordering::SeqCst);
    }

    pub(crate) fn discovery_listed(&self) -> bool {
        self.discovery_listed.load(Ordering::SeqCst)
    }
}

/// Occupied slots over all slots (4 per bucket), 0 for an empty filter.
pub(crate) fn filter_load(stats: &PoolActorStats) -> f64 {
    let slots = stats.filter.bucket_count.saturating_mul(4);
    if slots == 0 {
        0.0
    } else {
        stats.filter.occupied_slots as f64 / slots as f64
    }
}
