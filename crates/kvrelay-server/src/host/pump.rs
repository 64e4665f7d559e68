//! Engine event sources: one ingest ZMQ source per engine source (a `[[sources]]` entry or
//! an advertised one, per worker and rank), and one Dynamo NATS subscription per attached
//! endpoint when `[nats]` is set. Their events go to whichever pool generation currently
//! routes their source. Each source's lifecycle signals become its state in
//! [`SourceStates`], which the supervisor drains into its core.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use kvrelay_ckf::SourceId;
use tokio::sync::Notify;

use kvrelay_identity::{EndpointId, KvQuerySemantics};
use kvrelay_ingest::{
    CanonicalConfig, NatsSourceConfig, SourceHandle, SourceOutput, SourceSignal, ZmqSourceConfig,
    dynamo_kv_event_subject, spawn_nats_source, spawn_zmq_source,
};
use kvrelay_pool::MAX_EVENTS_PER_BATCH;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use crate::config::{EngineKind, SourceConfig};
use crate::host::state::HostState;
use crate::host::supervisor::{SourceKey, SourceState};
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
    notify: Notify,
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

/// The state a lifecycle signal puts its source in.
fn state_after(signal: &SourceSignal) -> SourceState {
    match signal {
        SourceSignal::Connected { .. } | SourceSignal::Reset { .. } => SourceState::Connected,
        SourceSignal::Gap { .. } => SourceState::Replaying,
        SourceSignal::Lost { .. } => SourceState::Connecting,
    }
}

/// First delay before reconnecting a NATS source.
const NATS_BACKOFF_INITIAL: Duration = Duration::from_millis(100);
/// Longest delay before reconnecting a NATS source.
const NATS_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// Starts the ZMQ source of `config`, hashing with `semantics`, until `cancel` fires.
pub(crate) fn spawn_zmq(
    tracker: &TaskTracker,
    config: &SourceConfig,
    limits: kvrelay_ingest::Limits,
    semantics: KvQuerySemantics,
    state: Arc<HostState>,
    states: SourceStates,
    cancel: CancellationToken,
) {
    let key = SourceKey::Engine(SourceId::new(config.worker_id, config.dp_rank));
    // Dotted, as the pool's stats view names it (configured and advertised alike).
    let pool_endpoint = config.endpoint.clone();
    let zmq = ZmqSourceConfig {
        worker_id: config.worker_id,
        dp_rank: config.dp_rank,
        engine: match config.engine {
            EngineKind::Vllm => kvrelay_ingest::EngineKind::Vllm,
            EngineKind::Sglang => kvrelay_ingest::EngineKind::Sglang,
        },
        endpoint: config.zmq.clone(),
        replay_endpoint: config.replay.clone(),
        topic: String::new(),
        canonical: CanonicalConfig {
            block_size: semantics.kv_block_size(),
            hash_format: semantics.hash_format(),
        },
        limits,
        // A `[[sources]]` entry or an advertised source names one rank.
        declared_ranks: config.dp_rank..config.dp_rank.saturating_add(1),
        fault: kvrelay_ingest::FaultInjection::default(),
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

/// Subscribes to `endpoint`'s Dynamo KV-event subject on `server` (reconnecting with
/// backoff) until `cancel` fires.
pub(crate) fn spawn_nats(
    tracker: &TaskTracker,
    nats: &crate::config::NatsConfig,
    limits: kvrelay_ingest::Limits,
    endpoint: &EndpointId,
    state: Arc<HostState>,
    states: SourceStates,
    cancel: CancellationToken,
) {
    let key = SourceKey::Nats(endpoint.clone());
    let pool_endpoint = endpoint.dotted();
    let config = NatsSourceConfig {
        server: nats.server.clone(),
        subject: dynamo_kv_event_subject(
            endpoint.namespace(),
            endpoint.component(),
            endpoint.name(),
        ),
        limits,
        // Validated when the configuration was loaded.
        auth: nats.auth().unwrap_or_default(),
        tls: nats.tls(),
    };
    let span = info_span!("nats_source", endpoint = %endpoint.dotted());
    tracker.spawn(
        async move {
            let mut backoff = NATS_BACKOFF_INITIAL;
            loop {
                let connected = tokio::select! {
                    biased;
                    () = cancel.cancelled() => return,
                    connected = spawn_nats_source(config.clone()) => connected,
                };
                match connected {
                    Ok(source) => {
                        backoff = NATS_BACKOFF_INITIAL;
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
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(NATS_BACKOFF_MAX);
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
    // An output taken from the queue while gathering a batch that did not belong to it.
    let mut carried = None;
    loop {
        let output = match carried.take() {
            Some(output) => Some(output),
            None => tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                output = source.next() => output,
            },
        };
        match output {
            None => break,
            Some(SourceOutput::Event(event)) => {
                // An engine batch arrives as a burst of events from one source: what is
                // already queued behind this event goes to the actor as one command (one
                // route lookup, one permit wait, one mailbox slot).
                let origin = event.source;
                let mut batch = vec![event];
                while batch.len() < MAX_EVENTS_PER_BATCH {
                    match source.try_next() {
                        Some(SourceOutput::Event(next)) if next.source == origin => {
                            batch.push(next)
                        }
                        Some(other) => {
                            carried = Some(other);
                            break;
                        }
                        None => break,
                    }
                }
                let events = u64::try_from(batch.len()).unwrap_or(u64::MAX);
                let route = state.routes.borrow().routes.get(&origin).cloned();
                let submitted = match route {
                    Some(route) => tokio::select! {
                        biased;
                        () = cancel.cancelled() => break,
                        submitted = route.actor.submit_batch(batch) => submitted.is_ok(),
                    },
                    None => false,
                };
                let disposition = if submitted { "submitted" } else { "dropped" };
                state
                    .metrics
                    .events
                    .get_or_create(&DispositionLabel { disposition })
                    .inc_by(events);
            }
            Some(SourceOutput::Signal(signal)) => {
                states.report(key.clone(), state_after(&signal));
                match signal {
                    SourceSignal::Connected { endpoint } => info!(%endpoint, "source connected"),
                    SourceSignal::Lost { endpoint } => {
                        warn!(%endpoint, "source lost; reconnecting")
                    }
                    SourceSignal::Gap { expected, got } => {
                        warn!(expected, got, "source gap; replaying")
                    }
                    SourceSignal::Reset { reason, .. } => warn!(?reason, "source reset"),
                }
            }
        }
    }
    if !source.shutdown().await {
        warn!("source tasks did not stop within their shutdown bound");
    }
}
