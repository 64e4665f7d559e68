//! The trace replay driver: feeds the workload's events into the pool actors of the
//! connected sources, observes each source's exact resident blocks as its load, and
//! flushes every actor at the end.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvrelay_ckf::{EventPayload, SourceId};
use kvrelay_pool::{LoadObservation, PoolRegistry};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::host::RelayError;
use crate::host::state::{self, HostState};
use kvrelay_ingest::{RequestRecord, WorkerCache, route_by_first_block};

use crate::host::WORKLOAD_TOKEN_SEED;

/// Replays the trace into the pool actors of the connected sources.
pub(crate) struct WorkloadDriver {
    pub(crate) state: Arc<HostState>,
    pub(crate) registry: PoolRegistry,
    pub(crate) requests: Vec<RequestRecord>,
    pub(crate) speed: f64,
    pub(crate) loops: u32,
    pub(crate) done: watch::Sender<bool>,
}

/// How often the driver re-reads whether the pools have settled before it starts.
const SETTLE_POLL: Duration = Duration::from_millis(10);
/// Longest wait for the discovered pools to attach before replaying anyway.
const SETTLE_WAIT_MAX: Duration = Duration::from_secs(10);

/// Requests between load observations of a source.
const LOAD_OBSERVATION_EVERY: u64 = 64;

impl WorkloadDriver {
    pub(crate) async fn run(self, cancel: CancellationToken) {
        // Start once the discovered pools have attached: attaches finish one by one, and a
        // source list taken at the first route would leave later pools unfed. Settling is
        // polled (it is not a watch); a relay that never settles starts after the bound.
        let mut routes_rx = self.state.routes.subscribe();
        let waiting_since = tokio::time::Instant::now();
        let routes = loop {
            let current = routes_rx.borrow_and_update().clone();
            let settled = !self.state.facts().settling;
            let waited_out = waiting_since.elapsed() >= SETTLE_WAIT_MAX;
            if !current.routes.is_empty() && (settled || waited_out) {
                if !settled {
                    warn!(
                        waited_ms = SETTLE_WAIT_MAX.as_millis() as u64,
                        "pools still attaching; replaying into the routes present"
                    );
                }
                break current;
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                changed = routes_rx.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(SETTLE_POLL) => {}
            }
        };
        let sources: Vec<SourceId> = routes.routes.keys().copied().collect();
        let mut caches: Vec<WorkerCache> = sources
            .iter()
            .map(|source| {
                let (capacity, block_size) = routes
                    .routes
                    .get(source)
                    .map_or((1, 16), |route| (route.capacity, route.block_size));
                WorkerCache::new(
                    *source,
                    usize::try_from(capacity).unwrap_or(usize::MAX),
                    block_size,
                    WORKLOAD_TOKEN_SEED,
                )
            })
            .collect();
        info!(
            sources = sources.len(),
            requests = self.requests.len(),
            "replaying trace"
        );
        let counters = &self.state.workload;
        let started = tokio::time::Instant::now();
        let mut pass = 0u32;
        'passes: loop {
            for request in &self.requests {
                if cancel.is_cancelled() {
                    break 'passes;
                }
                if self.speed > 0.0 {
                    let at =
                        Duration::from_secs_f64(request.timestamp as f64 / 1000.0 / self.speed);
                    tokio::select! {
                        () = cancel.cancelled() => break 'passes,
                        () = tokio::time::sleep_until(started + at) => {}
                    }
                }
                let Some(at) = route_by_first_block(&request.hash_ids, sources.len()) else {
                    continue;
                };
                let Some(cache) = caches.get_mut(at) else {
                    continue;
                };
                let source = sources[at];
                let events = cache.serve(&request.hash_ids);
                let route = self.state.routes.borrow().routes.get(&source).cloned();
                let Some(route) = route else {
                    counters
                        .events_dropped
                        .fetch_add(events.len() as u64, Ordering::Relaxed);
                    continue;
                };
                for event in events {
                    match &event.payload {
                        EventPayload::Stored(stored) => {
                            counters
                                .blocks_stored
                                .fetch_add(stored.blocks.len() as u64, Ordering::Relaxed);
                        }
                        EventPayload::Removed(removed) => {
                            counters.blocks_removed.fetch_add(
                                removed.engine_block_ids.len() as u64,
                                Ordering::Relaxed,
                            );
                        }
                        EventPayload::AllCleared => {}
                    }
                    let submitted = tokio::select! {
                        () = cancel.cancelled() => break 'passes,
                        submitted = route.actor.submit(event) => submitted,
                    };
                    let disposition = if submitted.is_ok() {
                        counters.events.fetch_add(1, Ordering::Relaxed);
                        "submitted"
                    } else {
                        counters.events_dropped.fetch_add(1, Ordering::Relaxed);
                        "dropped"
                    };
                    self.state
                        .metrics
                        .events
                        .get_or_create(&crate::metrics::DispositionLabel { disposition })
                        .inc();
                }
                let served = counters.requests.fetch_add(1, Ordering::Relaxed) + 1;
                if served.is_multiple_of(LOAD_OBSERVATION_EVERY) {
                    self.observe(&route, source, cache.resident());
                }
            }
            pass += 1;
            if self.loops != 0 && pass >= self.loops {
                break;
            }
        }
        let routes = self.state.routes.borrow().clone();
        for (source, cache) in sources.iter().zip(&caches) {
            if let Some(route) = routes.routes.get(source) {
                self.observe(route, *source, cache.resident());
            }
        }
        let mut flushed = std::collections::BTreeSet::new();
        for route in routes.routes.values() {
            if flushed.insert(route.generation) {
                let _ = route.actor.settle().await;
            }
        }
        info!(
            requests = counters.requests.load(Ordering::Relaxed),
            "trace replay finished"
        );
        counters.done.store(true, Ordering::SeqCst);
        self.done.send_replace(true);
    }

    fn observe(&self, route: &state::Route, source: SourceId, resident: usize) {
        self.registry.observe_load(
            route.pool,
            route.generation,
            LoadObservation {
                worker_id: source.worker_id,
                dp_rank: source.dp_rank,
                kv_used_blocks: Some(resident as u64),
                active_decode_blocks: None,
                active_prefill_tokens: None,
            },
        );
    }
}

/// Reads and parses the workload's request trace.
pub(crate) fn read_trace(
    path: &std::path::Path,
) -> Result<Vec<kvrelay_ingest::RequestRecord>, RelayError> {
    let trace_error = |message: String| RelayError::Trace {
        path: path.to_path_buf(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|err| trace_error(err.to_string()))?;
    kvrelay_ingest::parse_request_trace(&text).map_err(|err| trace_error(err.to_string()))
}
