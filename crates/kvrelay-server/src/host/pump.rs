//! Engine event sources: one ingest ZMQ source per engine source (a `[[sources]]` entry or
//! an advertised one, per worker and rank), and one Dynamo NATS subscription per attached
//! endpoint when `[nats]` is set. Their events go to whichever pool generation currently
//! routes their source. Each source's lifecycle signals become its state in
//! [`SourceStates`], which the supervisor drains into its core.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use kvrelay_ckf::{RouterEvent, SourceId};
use tokio::sync::Notify;

use kvrelay_identity::{EndpointId, KvQuerySemantics};
use kvrelay_ingest::{
    CanonicalConfig, NatsSourceConfig, ResumePoint, SourceHandle, SourceOutput, SourceProbe,
    SourceSignal, SourceState, ZmqSourceConfig, ZmqWire, dynamo_kv_event_subject,
    spawn_nats_source, spawn_zmq_source,
};
use kvrelay_pacing::{Backoff, NO_JITTER};
use kvrelay_pool::{ActorError, MAX_EVENTS_PER_BATCH};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use crate::config::{SourceConfig, SourceEngine};
use crate::host::state::HostState;
use crate::host::supervisor::SourceKey;
use crate::metrics::DispositionLabel;

/// The latest state each source reported and the supervisor has not taken yet: bounded by
/// the number of sources, and a newer state replaces an older one (nothing is lost that
/// matters, nothing queues without bound).
#[derive(Debug, Clone, Default)]
pub(crate) struct SourceStates {
    shared: Arc<SourceStatesShared>,
}

#[derive(Debug, Default)]
struct SourceStatesShared {
    latest: Mutex<BTreeMap<SourceKey, SourceState>>,
    /// The probe of every running source: its own state, read again on every health tick,
    /// so readiness and `kvrelay_sources{state}` read the same truth (a replay that ends
    /// without a signal shows as connected in both).
    probes: Mutex<BTreeMap<SourceKey, SourceProbe>>,
    notify: Notify,
}

/// Keeps a source's probe in [`SourceStates`] while its pump runs.
pub(crate) struct WatchedProbe {
    shared: Arc<SourceStatesShared>,
    key: SourceKey,
}

impl Drop for WatchedProbe {
    fn drop(&mut self) {
        self.shared
            .probes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.key);
    }
}

impl SourceStates {
    pub(crate) fn report(&self, key: SourceKey, state: SourceState) {
        self.shared
            .latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, state);
        self.shared.notify.notify_one();
    }

    /// Reads `probe` on every [`SourceStates::observe`] until the guard drops.
    pub(crate) fn watch(&self, key: SourceKey, probe: SourceProbe) -> WatchedProbe {
        self.shared
            .probes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.clone(), probe);
        WatchedProbe {
            shared: self.shared.clone(),
            key,
        }
    }

    /// The state every running source's probe holds now.
    pub(crate) fn observe(&self) -> Vec<(SourceKey, SourceState)> {
        self.shared
            .probes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(key, probe)| (key.clone(), probe.state()))
            .collect()
    }

    /// Resolves once a state was reported since the last `take`.
    pub(crate) async fn changed(&self) {
        self.shared.notify.notified().await;
    }

    pub(crate) fn take(&self) -> BTreeMap<SourceKey, SourceState> {
        std::mem::take(
            &mut *self
                .shared
                .latest
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }
}

/// What one engine source is started with.
pub(crate) struct EngineSource<'a> {
    pub(crate) config: &'a SourceConfig,
    pub(crate) limits: kvrelay_ingest::Limits,
    /// How its pool hashes.
    pub(crate) semantics: KvQuerySemantics,
    /// The batch it resumes after, when its state was restored from a checkpoint.
    pub(crate) resume_after: Option<kvrelay_ingest::ResumePoint>,
    /// Whether its pool keeps lower-tier lanes (the source then yields tier events).
    pub(crate) lower_tiers: bool,
}

/// Starts the ZMQ source of `source`, until `cancel` fires.
pub(crate) fn spawn_zmq(
    tracker: &TaskTracker,
    source: EngineSource<'_>,
    state: Arc<HostState>,
    states: SourceStates,
    cancel: CancellationToken,
) {
    let EngineSource {
        config,
        limits,
        semantics,
        resume_after,
        lower_tiers,
    } = source;
    let key = SourceKey::Engine(SourceId::new(config.worker_id, config.dp_rank));
    // Dotted, as the pool's stats view names it (configured and advertised alike).
    let pool_endpoint = config.endpoint.clone();
    let zmq = ZmqSourceConfig {
        worker_id: config.worker_id,
        dp_rank: config.dp_rank,
        wire: match config.engine {
            SourceEngine::Vllm => ZmqWire::Engine(kvrelay_ingest::EngineKind::Vllm),
            SourceEngine::Sglang => ZmqWire::Engine(kvrelay_ingest::EngineKind::Sglang),
            // Validated (configured) or set from the advert (discovered).
            SourceEngine::Dynamo => ZmqWire::DynamoEventPlane {
                publisher_id: config.publisher_id.unwrap_or_default(),
            },
        },
        endpoint: config.zmq.clone(),
        replay_endpoint: config.replay.clone(),
        topic: String::new(),
        canonical: CanonicalConfig {
            lower_tiers,
            ..CanonicalConfig::new(semantics.kv_block_size(), semantics.hash_format())
        },
        limits,
        // A `[[sources]]` entry or an advertised source names one rank.
        declared_ranks: config.dp_rank..config.dp_rank.saturating_add(1),
        fault: kvrelay_ingest::FaultInjection::default(),
        resume_after,
        queue_budget: Some(state.ingest_budget.clone()),
    };
    let span = info_span!(
        "source",
        worker_id = config.worker_id,
        dp_rank = config.dp_rank
    );
    tracker.spawn(
        async move {
            let source = spawn_zmq_source(zmq);
            forward(source, &state, &states, &key, pool_endpoint, &cancel).await;
            if !cancel.is_cancelled() {
                states.report(key, SourceState::Failed);
            }
        }
        .instrument(span),
    );
}

/// What one endpoint's NATS subscription is started with.
pub(crate) struct NatsSource<'a> {
    pub(crate) server: &'a crate::config::NatsConfig,
    pub(crate) limits: kvrelay_ingest::Limits,
    /// Whether the endpoint's pool keeps lower-tier lanes.
    pub(crate) lower_tiers: bool,
}

/// Subscribes to `endpoint`'s Dynamo KV-event subject on `server` (reconnecting under the
/// `[ingest] restart_backoff_*` backoff, like every engine source) until `cancel` fires.
pub(crate) fn spawn_nats(
    tracker: &TaskTracker,
    source: NatsSource<'_>,
    endpoint: &EndpointId,
    state: Arc<HostState>,
    states: SourceStates,
    cancel: CancellationToken,
) {
    let NatsSource {
        server: nats,
        limits,
        lower_tiers,
    } = source;
    let key = SourceKey::Nats(endpoint.clone());
    let mut backoff = Backoff::new(limits.restart_backoff());
    let pool_endpoint = endpoint.dotted();
    let config = NatsSourceConfig {
        server: nats.server.clone(),
        subject: dynamo_kv_event_subject(
            endpoint.namespace(),
            endpoint.component(),
            endpoint.name(),
        ),
        limits,
        lower_tiers,
        // Validated when the configuration was loaded.
        auth: nats.auth().unwrap_or_default(),
        tls: nats.tls(),
    };
    let span = info_span!("nats_source", endpoint = %endpoint.dotted());
    tracker.spawn(
        async move {
            loop {
                let started = Instant::now();
                let connected = tokio::select! {
                    biased;
                    () = cancel.cancelled() => return,
                    connected = spawn_nats_source(config.clone()) => connected,
                };
                match connected {
                    Ok(source) => {
                        states.report(key.clone(), SourceState::Connected);
                        forward(
                            source,
                            &state,
                            &states,
                            &key,
                            pool_endpoint.clone(),
                            &cancel,
                        )
                        .await;
                        states.report(key.clone(), SourceState::Connecting);
                    }
                    Err(err) => {
                        warn!(error = %err, "nats source failed; retrying");
                        states.report(key.clone(), SourceState::Failed);
                    }
                }
                tokio::select! {
                    biased;
                    () = cancel.cancelled() => return,
                    // A subscription that outlived the longest sleep starts the backoff over.
                    () = tokio::time::sleep(backoff.on_failure(started.elapsed(), NO_JITTER)) => {}
                }
            }
        }
        .instrument(span),
    );
}

/// Forwards a source's events to the current route of their source until the source stops
/// or `cancel` fires, then shuts the source down.
async fn forward(
    mut source: SourceHandle,
    state: &HostState,
    states: &SourceStates,
    key: &SourceKey,
    pool_endpoint: String,
    cancel: &CancellationToken,
) {
    let _registration = state.metrics.ingest.register(source.probe(), pool_endpoint);
    let _watched = states.watch(key.clone(), source.probe());
    // Every change of the source's state is reported at once, not only those a signal
    // carries: a source that finished joining (its replay ended) makes its pool complete
    // again without waiting for the next health reading.
    let mut probe = source.probe();
    let mut probe_open = true;
    // An output taken from the queue while gathering a batch that did not belong to it.
    let mut carried = None;
    loop {
        let output = match carried.take() {
            Some(output) => Some(output),
            None => tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                open = probe.changed(), if probe_open => {
                    probe_open = open;
                    states.report(key.clone(), probe.state());
                    continue;
                }
                output = source.next() => output,
            },
        };
        match output {
            None => break,
            Some(SourceOutput::Event(event)) => {
                // An engine batch arrives as a burst of events from one source: what is
                // already queued behind this event goes to the actor in as few commands as
                // its limits allow (one route lookup, one permit wait and one mailbox slot
                // per chunk).
                let origin = event.source;
                let Burst {
                    events: batch,
                    applied,
                    next,
                } = gather_burst(event, || source.try_next());
                carried = next;
                let total = batch.len();
                let route = state.routes.borrow().routes.get(&origin).cloned();
                let (queued, cancelled) = match route {
                    Some(route) => match route.actor.submit_batch(batch, cancel).await {
                        Ok(()) => (total, false),
                        Err(err) => (err.queued, err.cause == ActorError::Cancelled),
                    },
                    None => (0, false),
                };
                count_events(state, "submitted", queued);
                count_events(state, "dropped", total - queued);
                if cancelled {
                    break;
                }
                if let (Some(point), SourceKey::Engine(engine)) = (applied, key) {
                    state.positions.record(*engine, point);
                }
            }
            Some(SourceOutput::Tier(event)) => {
                // In order behind the source's device events: the pool's actor resolves
                // an offload against the device blocks of that moment.
                let route = state.routes.borrow().routes.get(&event.source).cloned();
                let queued = match route {
                    Some(route) => tokio::select! {
                        biased;
                        () = cancel.cancelled() => break,
                        queued = route.actor.submit_tier(event) => queued.is_ok(),
                    },
                    None => false,
                };
                count_events(state, if queued { "submitted" } else { "dropped" }, 1);
            }
            Some(SourceOutput::Applied { seq, digest }) => {
                // Everything before it was submitted (in order) above.
                if let SourceKey::Engine(engine) = key {
                    state.positions.record(
                        *engine,
                        ResumePoint {
                            last_applied: seq,
                            digest,
                        },
                    );
                }
            }
            Some(SourceOutput::Signal(signal)) => {
                // The source's own state (what its metrics show), not one derived from
                // the signal: the two can never disagree.
                states.report(key.clone(), source.state());
                match signal {
                    SourceSignal::Connected { endpoint } => info!(%endpoint, "source connected"),
                    SourceSignal::Lost { endpoint } => {
                        warn!(%endpoint, "source lost; reconnecting")
                    }
                    SourceSignal::Gap { expected, got } => {
                        warn!(expected, got, "source gap; replaying")
                    }
                    SourceSignal::Reset { reason, .. } => {
                        warn!(?reason, "source reset");
                        if let SourceKey::Engine(engine) = key {
                            state.positions.forget(*engine);
                        }
                    }
                }
            }
        }
    }
    // A source that ended by itself no longer continues what it applied; one stopped by
    // the relay (shutdown) keeps its position for the final checkpoint.
    if let (false, SourceKey::Engine(engine)) = (cancel.is_cancelled(), key) {
        state.positions.forget(*engine);
    }
    if !source.shutdown().await {
        warn!("source tasks did not stop within their shutdown bound");
    }
}

/// Events gathered from one source in one go.
struct Burst {
    events: Vec<RouterEvent>,
    /// The last batch whose end marker was passed while gathering: fully in `events` or
    /// earlier, so recorded once `events` are submitted.
    applied: Option<ResumePoint>,
    /// The output that ended the burst, handled next.
    next: Option<SourceOutput>,
}

/// Takes the events already queued behind `first` that come from the same source, up to
/// [`MAX_EVENTS_PER_BATCH`] in all, in order, passing over batch end markers (the last one
/// is returned, to record after the events are submitted). Returns them and the output
/// that ended the burst, if any (a signal, or another source's event), which the caller
/// handles next: nothing is reordered and nothing is skipped.
fn gather_burst(first: RouterEvent, mut try_next: impl FnMut() -> Option<SourceOutput>) -> Burst {
    let origin = first.source;
    let mut burst = Burst {
        events: vec![first],
        applied: None,
        next: None,
    };
    while burst.events.len() < MAX_EVENTS_PER_BATCH {
        match try_next() {
            Some(SourceOutput::Event(next)) if next.source == origin => burst.events.push(next),
            Some(SourceOutput::Applied { seq, digest }) => {
                burst.applied = Some(ResumePoint {
                    last_applied: seq,
                    digest,
                });
            }
            Some(other) => {
                burst.next = Some(other);
                break;
            }
            None => break,
        }
    }
    burst
}

fn count_events(state: &HostState, disposition: &'static str, events: usize) {
    if events > 0 {
        state
            .metrics
            .events
            .get_or_create(&DispositionLabel { disposition })
            .inc_by(u64::try_from(events).unwrap_or(u64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use kvrelay_ckf::EventPayload;

    use super::*;

    /// Readiness reads each running source's own probe (what `kvrelay_sources{state}`
    /// shows) on every observation, and forgets it when its pump ends.
    #[tokio::test]
    async fn observed_states_are_the_sources_own_while_they_run() {
        let source = kvrelay_ingest::spawn_trace_replay(
            Vec::new(),
            kvrelay_ingest::TraceReplayConfig {
                speedup: 0.0,
                limits: kvrelay_ingest::Limits::default(),
            },
        );
        let states = SourceStates::default();
        let key = SourceKey::Engine(SourceId::new(7, 0));
        let watched = states.watch(key.clone(), source.probe());
        assert_eq!(states.observe(), vec![(key.clone(), source.state())]);
        drop(watched);
        assert_eq!(states.observe(), Vec::new());
        assert!(source.shutdown().await);
    }

    fn event(worker: u64, dp_rank: u32, event_id: u64) -> RouterEvent {
        RouterEvent {
            source: SourceId::new(worker, dp_rank),
            event_id,
            payload: EventPayload::AllCleared,
        }
    }

    /// Gathers bursts from `queue` the way `forward` does; returns each burst's
    /// `(source, event ids)` and every non-event output, in the order handled.
    fn drain(mut queue: VecDeque<SourceOutput>) -> (Vec<(SourceId, Vec<u64>)>, Vec<SourceSignal>) {
        let mut bursts = Vec::new();
        let mut signals = Vec::new();
        let mut carried = None;
        for _ in 0..10_000 {
            let Some(output) = carried.take().or_else(|| queue.pop_front()) else {
                return (bursts, signals);
            };
            match output {
                SourceOutput::Event(first) => {
                    let Burst {
                        events: burst,
                        next,
                        ..
                    } = gather_burst(first, || queue.pop_front());
                    carried = next;
                    let source = burst[0].source;
                    assert!(burst.iter().all(|event| event.source == source));
                    assert!(burst.len() <= MAX_EVENTS_PER_BATCH);
                    bursts.push((source, burst.iter().map(|event| event.event_id).collect()));
                }
                SourceOutput::Signal(signal) => signals.push(signal),
                SourceOutput::Applied { .. } | SourceOutput::Tier(_) => {}
            }
        }
        panic!("the queue never drained");
    }

    #[test]
    fn interleaved_ranks_split_bursts_without_reordering() {
        let queue: VecDeque<_> = [
            event(1, 0, 1),
            event(1, 0, 2),
            event(1, 1, 3),
            event(1, 0, 4),
            event(2, 0, 5),
            event(2, 0, 6),
        ]
        .into_iter()
        .map(SourceOutput::Event)
        .collect();
        let (bursts, signals) = drain(queue);
        assert!(signals.is_empty());
        assert_eq!(
            bursts,
            vec![
                (SourceId::new(1, 0), vec![1, 2]),
                (SourceId::new(1, 1), vec![3]),
                (SourceId::new(1, 0), vec![4]),
                (SourceId::new(2, 0), vec![5, 6]),
            ]
        );
    }

    #[test]
    fn a_signal_mid_burst_ends_it_and_is_handled_before_the_next_events() {
        let gap = SourceSignal::Gap {
            expected: 3,
            got: 9,
        };
        let mut queue: VecDeque<_> = vec![
            SourceOutput::Event(event(1, 0, 1)),
            SourceOutput::Event(event(1, 0, 2)),
            SourceOutput::Signal(gap.clone()),
            SourceOutput::Event(event(1, 0, 9)),
        ]
        .into();
        let Some(SourceOutput::Event(first)) = queue.pop_front() else {
            unreachable!("the queue starts with an event");
        };
        let Burst {
            events: burst,
            next,
            ..
        } = gather_burst(first, || queue.pop_front());
        assert_eq!(burst.iter().map(|e| e.event_id).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(next, Some(SourceOutput::Signal(gap)));
        // The event after the signal is still queued, for the next burst.
        assert_eq!(queue.len(), 1);
    }

    /// Batch end markers do not cut a burst: several batches go to the actor as one
    /// chunk, and the last marker passed is returned to record after it.
    #[test]
    fn batch_end_markers_inside_a_burst_are_passed_and_the_last_is_kept() {
        let mut queue: VecDeque<_> = vec![
            SourceOutput::Applied { seq: 4, digest: 40 },
            SourceOutput::Event(event(1, 0, 2)),
            SourceOutput::Applied { seq: 5, digest: 50 },
            SourceOutput::Event(event(2, 0, 3)),
        ]
        .into();
        let burst = gather_burst(event(1, 0, 1), || queue.pop_front());
        assert_eq!(
            burst.events.iter().map(|e| e.event_id).collect::<Vec<_>>(),
            [1, 2]
        );
        assert_eq!(
            burst.applied,
            Some(ResumePoint {
                last_applied: 5,
                digest: 50
            })
        );
        assert_eq!(burst.next, Some(SourceOutput::Event(event(2, 0, 3))));
    }

    #[test]
    fn a_long_burst_is_cut_at_the_batch_bound_and_loses_nothing() {
        let total = MAX_EVENTS_PER_BATCH as u64 * 2 + 5;
        let queue: VecDeque<_> = (1..=total)
            .map(|id| SourceOutput::Event(event(3, 0, id)))
            .collect();
        let (bursts, _) = drain(queue);
        let sizes: Vec<_> = bursts.iter().map(|(_, ids)| ids.len()).collect();
        assert_eq!(sizes, [MAX_EVENTS_PER_BATCH, MAX_EVENTS_PER_BATCH, 5]);
        let ids: Vec<u64> = bursts.into_iter().flat_map(|(_, ids)| ids).collect();
        assert_eq!(ids, (1..=total).collect::<Vec<_>>());
    }
}
