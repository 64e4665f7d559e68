//! Dynamo over NATS: subscribe to an endpoint's KV-event subject and decode its JSON
//! router events. One subscription carries every worker of the endpoint.
//!
//! The task's loop is one biased `select!`: cancellation, then the next message (the
//! subscriber is a stream; dropping its `next()` future loses nothing).

use std::time::Duration;

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use crate::dynamo_event::decode_dynamo_events;
use crate::error::{RejectionKind, SourceError};
use crate::limits::Limits;
use crate::source::{SourceHandle, SourceOutput, SourceSignal, emit};
use crate::stats::Counters;

/// Where to subscribe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsSourceConfig {
    /// The NATS server, e.g. `nats://127.0.0.1:4222`.
    pub server: String,
    /// The subject, e.g. from [`crate::dynamo_kv_event_subject`].
    pub subject: String,
    /// Bounds.
    pub limits: Limits,
}

/// Connects, subscribes and starts the source; must be called inside a tokio runtime.
pub async fn spawn_nats_source(config: NatsSourceConfig) -> Result<SourceHandle, SourceError> {
    let client = async_nats::connect(config.server.as_str())
        .await
        .map_err(|err| SourceError::Connect {
            endpoint: config.server.clone(),
            reason: err.to_string(),
        })?;
    let mut subscriber = client
        .subscribe(config.subject.clone())
        .await
        .map_err(|err| SourceError::Subscribe {
            subject: config.subject.clone(),
            reason: err.to_string(),
        })?;
    // The subscription is registered once the server has seen it.
    client.flush().await.map_err(|err| SourceError::Subscribe {
        subject: config.subject.clone(),
        reason: err.to_string(),
    })?;
    info!(peer = %config.server, subject = %config.subject, "nats source subscribed");
    let limits = config.limits;
    let counters = Counters::shared();
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let (tx, rx) = mpsc::channel(limits.output_queue_depth.max(1));
    let task_counters = counters.clone();
    let task_cancel = cancel.child_token();
    let span = info_span!("nats_source", peer = %config.server);
    tracker.spawn(
        async move {
            // Keep the client alive for the subscription's lifetime.
            let _client = client;
            let connected = SourceSignal::Connected {
                endpoint: config.server.clone(),
            };
            if !emit(&tx, &task_cancel, SourceOutput::Signal(connected)).await {
                return;
            }
            loop {
                let message = tokio::select! {
                    biased;
                    () = task_cancel.cancelled() => return,
                    message = subscriber.next() => message,
                };
                let Some(message) = message else {
                    let lost = SourceSignal::Lost {
                        endpoint: config.server.clone(),
                    };
                    let _ = emit(&tx, &task_cancel, SourceOutput::Signal(lost)).await;
                    return;
                };
                task_counters.message();
                if message.payload.len() > limits.max_payload_bytes {
                    task_counters.reject(RejectionKind::Framing);
                    warn!(
                        bytes = message.payload.len(),
                        "rejected oversized nats payload"
                    );
                    continue;
                }
                let decoded = match decode_dynamo_events(&message.payload) {
                    Ok(decoded) => decoded,
                    Err(err) => {
                        task_counters.reject(RejectionKind::Malformed);
                        warn!(error = %err, "rejected nats payload");
                        continue;
                    }
                };
                task_counters.filtered(decoded.n_filtered);
                task_counters.events(decoded.events.len());
                for event in decoded.events {
                    if !emit(&tx, &task_cancel, SourceOutput::Event(event)).await {
                        return;
                    }
                }
            }
        }
        .instrument(span),
    );
    tracker.close();
    Ok(SourceHandle::new(
        rx,
        counters,
        cancel,
        tracker,
        Duration::from_millis(limits.shutdown_timeout_ms),
    ))
}
