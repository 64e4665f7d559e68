//! Engine event sources configured in `[[sources]]`: one ingest ZMQ source per (worker,
//! rank), its events forwarded to whichever pool generation currently routes that source.

use std::sync::Arc;

use kvrelay_identity::KvQuerySemantics;
use kvrelay_ingest::{
    CanonicalConfig, SourceOutput, SourceSignal, ZmqSourceConfig, spawn_zmq_source,
};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use crate::config::{EngineKind, SourceConfig};
use crate::host::state::HostState;
use crate::metrics::DispositionLabel;

/// Starts the source of `config`, hashing with `semantics`, until `cancel` fires.
pub(crate) fn spawn(
    tracker: &TaskTracker,
    config: &SourceConfig,
    semantics: KvQuerySemantics,
    state: Arc<HostState>,
    cancel: CancellationToken,
) {
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
        limits: kvrelay_ingest::Limits::default(),
    };
    let span = info_span!(
        "source",
        worker_id = config.worker_id,
        dp_rank = config.dp_rank
    );
    tracker.spawn(run(zmq, state, cancel).instrument(span));
}

async fn run(config: ZmqSourceConfig, state: Arc<HostState>, cancel: CancellationToken) {
    let mut source = spawn_zmq_source(config);
    loop {
        let output = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            output = source.next() => output,
        };
        match output {
            None => break,
            Some(SourceOutput::Event(event)) => {
                let route = state.routes.borrow().routes.get(&event.source).cloned();
                let submitted = match route {
                    Some(route) => tokio::select! {
                        biased;
                        () = cancel.cancelled() => break,
                        submitted = route.actor.submit(event) => submitted.is_ok(),
                    },
                    None => false,
                };
                let disposition = if submitted { "submitted" } else { "dropped" };
                state
                    .metrics
                    .events
                    .get_or_create(&DispositionLabel { disposition })
                    .inc();
            }
            Some(SourceOutput::Signal(signal)) => match signal {
                SourceSignal::Connected { endpoint } => info!(%endpoint, "source connected"),
                SourceSignal::Lost { endpoint } => warn!(%endpoint, "source lost; reconnecting"),
                SourceSignal::Gap { expected, got } => {
                    warn!(expected, got, "source gap; replaying")
                }
                SourceSignal::Reset { reason, .. } => warn!(?reason, "source reset"),
            },
        }
    }
    if !source.shutdown().await {
        warn!("source tasks did not stop within their shutdown bound");
    }
}
