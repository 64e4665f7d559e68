//! Dynamo over NATS: subscribe to an endpoint's KV-event subject and decode its JSON
//! router events. One subscription carries every worker of the endpoint.
//!
//! The connection authenticates as configured (token, user and password, NKey seed or a
//! credentials file) and can require TLS with the operator's CA and client certificate.
//! Payloads over `limits.max_payload_bytes` ([`Limits::nats`]: 1 MiB) are rejected before
//! decoding; decoding streams (no whole-document buffering). The client's connection
//! events drive the source's state; rejections are counted and logged rate-limited.
//!
//! The task's loop is one biased `select!`: cancellation, then the next message (the
//! subscriber is a stream; dropping its `next()` future loses nothing).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use crate::dynamo_event::decode_dynamo_events;
use crate::error::{RejectionKind, SourceError};
use crate::limits::Limits;
use crate::log_limit::RejectionLog;
use crate::source::{
    SourceHandle, SourceOutput, SourceSignal, SourceState, StateCell, Transport, emit,
};
use crate::stats::Counters;

/// How the NATS connection authenticates.
#[derive(Clone, Default, PartialEq, Eq)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// A server token.
    Token(String),
    /// A user name and password.
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: String,
    },
    /// An NKey seed (`SU...`): the server's nonce is signed with it.
    NKey {
        /// The seed.
        seed: String,
    },
    /// A `.creds` file (JWT and NKey seed), as `nsc` writes it.
    CredentialsFile(PathBuf),
}

impl std::fmt::Debug for NatsAuth {
    // Secrets never reach logs or debug output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NatsAuth::None => f.write_str("None"),
            NatsAuth::Token(_) => f.write_str("Token(<redacted>)"),
            NatsAuth::UserPassword { user, .. } => {
                write!(f, "UserPassword {{ user: {user:?}, password: <redacted> }}")
            }
            NatsAuth::NKey { .. } => f.write_str("NKey(<redacted>)"),
            NatsAuth::CredentialsFile(path) => write!(f, "CredentialsFile({path:?})"),
        }
    }
}

/// TLS towards the NATS server.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// Refuse a connection the server does not upgrade to TLS.
    pub required: bool,
    /// PEM file of CA certificates to trust (in addition to none: the server must chain
    /// to one of them when set).
    pub root_certificates: Option<PathBuf>,
    /// PEM client certificate, with `client_key`, for mutual TLS.
    pub client_certificate: Option<PathBuf>,
    /// PEM private key of `client_certificate`.
    pub client_key: Option<PathBuf>,
}

/// Where to subscribe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsSourceConfig {
    /// The NATS server, e.g. `nats://127.0.0.1:4222`.
    pub server: String,
    /// The subject, e.g. from [`crate::dynamo_kv_event_subject`].
    pub subject: String,
    /// Bounds; `max_payload_bytes` is the largest payload decoded ([`Limits::nats`]).
    pub limits: Limits,
    /// Whether host and disk events become tier events (the pool keeps lower-tier
    /// lanes) instead of being filtered.
    pub lower_tiers: bool,
    /// Credentials.
    pub auth: NatsAuth,
    /// TLS options.
    pub tls: NatsTls,
}

async fn connect_options(
    config: &NatsSourceConfig,
    state: &StateCell,
) -> Result<async_nats::ConnectOptions, SourceError> {
    let config_error = |reason: String| SourceError::Config { reason };
    let mut options = async_nats::ConnectOptions::new();
    options = match &config.auth {
        NatsAuth::None => options,
        NatsAuth::Token(token) => options.token(token.clone()),
        NatsAuth::UserPassword { user, password } => {
            options.user_and_password(user.clone(), password.clone())
        }
        NatsAuth::NKey { seed } => options.nkey(seed.clone()),
        NatsAuth::CredentialsFile(path) => options
            .credentials_file(path)
            .await
            .map_err(|err| config_error(format!("nats credentials {}: {err}", path.display())))?,
    };
    let tls = &config.tls;
    if tls.required {
        options = options.require_tls(true);
    }
    if let Some(roots) = &tls.root_certificates {
        options = options.add_root_certificates(roots.clone());
    }
    options = match (&tls.client_certificate, &tls.client_key) {
        (Some(cert), Some(key)) => options.add_client_certificate(cert.clone(), key.clone()),
        (None, None) => options,
        _ => {
            return Err(config_error(
                "nats TLS client certificate and key must be given together".to_owned(),
            ));
        }
    };
    let state = state.clone();
    Ok(options.event_callback(move |event| {
        match event {
            async_nats::Event::Connected => state.set_transport(SourceState::Connected),
            async_nats::Event::Disconnected => state.set_transport(SourceState::Connecting),
            _ => {}
        }
        async {}
    }))
}

/// Connects, subscribes and starts the source; must be called inside a tokio runtime.
pub async fn spawn_nats_source(config: NatsSourceConfig) -> Result<SourceHandle, SourceError> {
    let state = StateCell::new(SourceState::Connecting);
    let options = connect_options(&config, &state).await?;
    let client = options
        .connect(config.server.as_str())
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
    state.set_transport(SourceState::Connected);
    info!(peer = %config.server, subject = %config.subject, "nats source subscribed");
    let limits = config.limits;
    let lower_tiers = config.lower_tiers;
    let counters = Counters::shared();
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let (tx, rx) = mpsc::channel(limits.output_queue_depth.max(1));
    let task_counters = counters.clone();
    let task_cancel = cancel.child_token();
    let task_state = state.clone();
    let span = info_span!("nats_source", peer = %config.server);
    tracker.spawn(
        async move {
            // Keep the client alive for the subscription's lifetime.
            let _client = client;
            let mut rejections = RejectionLog::new(Duration::from_millis(limits.log_interval_ms));
            let mut reject = |kind: RejectionKind, error: &dyn std::fmt::Display| {
                task_counters.reject(kind);
                if let Some(count) = rejections.note(kind, Instant::now()) {
                    warn!(reason = kind.as_str(), count, error = %error, "rejected nats payload");
                }
            };
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
                    task_state.set_transport(SourceState::Connecting);
                    let lost = SourceSignal::Lost {
                        endpoint: config.server.clone(),
                    };
                    let _ = emit(&tx, &task_cancel, SourceOutput::Signal(lost)).await;
                    return;
                };
                task_counters.message();
                if message.payload.len() > limits.max_payload_bytes {
                    let reason = format!(
                        "payload of {} bytes exceeds max_payload_bytes {}",
                        message.payload.len(),
                        limits.max_payload_bytes
                    );
                    reject(RejectionKind::Framing, &reason);
                    continue;
                }
                let decoded = match decode_dynamo_events(&message.payload, &limits, lower_tiers) {
                    Ok(decoded) => decoded,
                    Err(err) => {
                        reject(err.rejection_kind(), &err);
                        continue;
                    }
                };
                task_counters.filtered(decoded.n_filtered);
                task_counters.events(decoded.events.len());
                for event in decoded.events {
                    if !emit(&tx, &task_cancel, event.into()).await {
                        return;
                    }
                }
            }
        }
        .instrument(span),
    );
    tracker.close();
    let probe = state.probe(Transport::Nats, counters);
    Ok(SourceHandle::with_probe(
        rx,
        probe,
        cancel,
        tracker,
        Duration::from_millis(limits.shutdown_timeout_ms),
    ))
}
