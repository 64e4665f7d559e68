//! One relay of a DC followed through its connection epochs: the relay-info handshake,
//! the catalog, load and topology streams, and a pool subscription task per pool the
//! epoch's [`EpochSession`] names. Every decision is the session's and the
//! [`RelayLink`]'s; this only opens streams, moves messages, counts and logs.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvrelay_codec::PROTOCOL_MAJOR;
use kvrelay_codec::v1::{ErrorReason, Message, RelayIdentity, StreamRpc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use super::Shared;
use super::subscription::run_subscription;
use crate::catalog::PoolKey;
use crate::config::StandbyMode;
use crate::link::epoch::{EpochFault, EpochSession, SilenceStep};
use crate::link::{EpochEnd, Reach, RelayLink, SideStream, ViewAfterEpoch};
use crate::metrics::{Counter, ResubscribeReason};
use crate::wire::{Endpoint, WireError, WireStream};

/// Why a relay epoch ended.
#[derive(Debug, thiserror::Error)]
pub(super) enum EpochError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("relay {addr} speaks protocol major {major}, we speak {PROTOCOL_MAJOR}")]
    ContractMismatch { addr: String, major: u16 },
    /// What the relay sent (or did not send) ended the epoch ([`EpochSession`] decides).
    #[error("relay {addr} {fault}")]
    Session { addr: String, fault: EpochFault },
    #[error("relay {addr} refused the connection ({reason}): {message}")]
    Refused {
        addr: String,
        reason: ErrorReason,
        message: String,
    },
    #[error("relay {addr} sent error {reason}: {message}")]
    Relay {
        addr: String,
        reason: ErrorReason,
        message: String,
    },
    #[error("relay {addr} sent an unexpected {kind} message on the {stream} stream")]
    Unexpected {
        addr: String,
        kind: &'static str,
        stream: &'static str,
    },
    #[error("relay {addr} closed the {stream} stream")]
    Closed { addr: String, stream: &'static str },
}

pub(super) async fn run_relay(shared: Arc<Shared>, relay: usize, cancel: CancellationToken) {
    let mut link = RelayLink::new(
        shared.config.backoff,
        shared.config.limits.resume_hold,
        shared.config.limits.failover_hold,
        shared.endpoints[relay].len(),
    )
    .with_rejoin(
        shared.config.limits.rejoin_interval,
        shared.config.limits.rejoin_window,
    );
    let dc = shared.dc(relay).to_owned();
    loop {
        if link.handle_epoch_start(Instant::now()) == Some(ViewAfterEpoch::StartOver) {
            // Held too long to be worth resuming: start this relay over.
            shared.update(|state| state.reset_relay(relay));
        }
        let addr = shared.endpoint(relay).addr.clone();
        let started = Instant::now();
        let mut connected = false;
        let result = relay_epoch(&shared, relay, &cancel, &mut connected, &mut link).await;
        let end = match &result {
            Err(err) if err.invalidates_view() => EpochEnd::Invalidated,
            _ => EpochEnd::Broken,
        };
        let reach = match &result {
            _ if connected => Reach::Answered,
            Err(err) if err.unreachable() => Reach::Unreachable,
            _ => Reach::Declined,
        };
        let (view, delay) = link.handle_epoch_end(
            Instant::now(),
            end,
            started.elapsed(),
            reach,
            rand::random::<f64>(),
        );
        let why = match &result {
            Ok(()) => "relay epoch ended".to_owned(),
            Err(err) => err.to_string(),
        };
        let previous =
            shared.active[relay].swap(link.active(), std::sync::atomic::Ordering::Relaxed);
        if previous != link.active() && !cancel.is_cancelled() {
            // Left for a failure: no working standby until a probe hears from it.
            shared.record_standby(relay, previous, Instant::now(), Err(why.clone()));
            shared.metrics.incr(Counter::RelayFailovers);
            info!(dc = %dc, from = %addr, to = %shared.endpoint(relay).addr, delay_ms = delay.as_millis() as u64, "following the DC's other relay");
        }
        let dropped = match view {
            ViewAfterEpoch::StartOver => shared.update(|state| state.reset_relay(relay)),
            ViewAfterEpoch::Suspend => {
                shared.update(|state| state.suspend_relay(relay));
                Vec::new()
            }
        };
        shared.bump();
        if cancel.is_cancelled() {
            return;
        }
        shared.metrics.incr(Counter::RelayEpochFailures);
        match &result {
            Err(EpochError::Wire(WireError::Tls { .. })) => {
                shared.metrics.incr(Counter::RelayTlsFailures);
            }
            Err(EpochError::Refused { .. }) => shared.metrics.incr(Counter::RelayRefusals),
            Err(EpochError::Session {
                fault: EpochFault::Silent { .. },
                ..
            }) => shared.metrics.incr(Counter::RelaySilences),
            Err(EpochError::Session {
                fault: EpochFault::Stalled { .. },
                ..
            }) => shared.metrics.incr(Counter::RelayStalls),
            _ => {}
        }
        shared.last_errors.lock()[relay] = Some(why);
        if let Err(EpochError::Session {
            fault: EpochFault::RelayRestart { .. },
            ..
        }) = &result
        {
            for _ in &dropped {
                shared.metrics.resubscribe(ResubscribeReason::RelayRestart);
            }
        }
        match &result {
            Ok(()) => warn!(dc = %dc, peer = %addr, "relay epoch ended"),
            Err(err) => warn!(dc = %dc, peer = %addr, error = %err, "relay epoch failed"),
        }
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

impl EpochError {
    /// Whether the attempt reached no relay: refused, timed out or broken at the transport
    /// before any answer, on either protocol (retrying costs the relay nothing; a TLS
    /// failure or a refusal would cost it a handshake each time).
    fn unreachable(&self) -> bool {
        matches!(
            self,
            Self::Wire(
                WireError::ConnectTimeout { .. }
                    | WireError::Io { .. }
                    | WireError::Contract {
                        source: kvrelay_dynamo::ClientError::Transport(_),
                        ..
                    }
            )
        )
    }

    /// A relay that restarted, whose catalog broke the rules or that speaks another major
    /// version starts over; one whose connection merely broke keeps its catalog and
    /// suspended replicas for resuming.
    fn invalidates_view(&self) -> bool {
        matches!(
            self,
            Self::Session {
                fault: EpochFault::RelayRestart { .. } | EpochFault::Catalog(_),
                ..
            } | Self::ContractMismatch { .. }
        )
    }
}

pub(super) async fn open(
    shared: &Shared,
    relay: usize,
    suffix: &str,
    rpc: StreamRpc,
) -> Result<WireStream, WireError> {
    open_at(shared, shared.endpoint(relay), suffix, rpc).await
}

/// Opens a stream to one given address of a DC (the followed one: [`open`]).
async fn open_at(
    shared: &Shared,
    endpoint: &Endpoint,
    suffix: &str,
    rpc: StreamRpc,
) -> Result<WireStream, WireError> {
    let config = &shared.config;
    WireStream::open(
        endpoint,
        &format!("{}/{suffix}", config.subscriber_id),
        rpc,
        config.limits.max_frame_len,
        config.limits.connect_timeout,
        &shared.metrics,
    )
    .await
}

/// One connection epoch: relay info, catalog and load streams, subscriptions. Returns
/// `Ok` only when cancelled.
/// One connection epoch to the relay `relay`'s DC is followed through; `connected` is set
/// once the relay answered.
async fn relay_epoch(
    shared: &Arc<Shared>,
    relay: usize,
    cancel: &CancellationToken,
    connected: &mut bool,
    link: &mut RelayLink,
) -> Result<(), EpochError> {
    let addr = shared.endpoint(relay).addr.clone();
    let identity = relay_info(shared, relay).await?;
    *connected = true;
    let mut session = EpochSession::new(
        relay,
        identity,
        &shared.config.limits,
        shared.config.backoff,
        Instant::now(),
    );
    // Restarted while we were away: what we kept is of another incarnation.
    let dropped = shared.update(|state| session.begin(state));
    for _ in 0..dropped {
        shared.metrics.resubscribe(ResubscribeReason::RelayRestart);
    }
    shared.metrics.incr(Counter::RelayConnects);
    info!(dc = %shared.dc(relay), peer = %addr, incarnation = identity.relay_incarnation, "relay connected");
    let fault = |fault: EpochFault| EpochError::Session {
        addr: addr.clone(),
        fault,
    };

    let mut catalog = open(shared, relay, "catalog", StreamRpc::WatchCatalog).await?;
    // The load stream is independent: losing it clears this relay's load samples and
    // reopens it after backoff, without touching catalogs or replicas.
    let mut load = Some(open(shared, relay, "load", StreamRpc::WatchLoad).await?);
    // The topology stream likewise: losing it (or never getting it) only makes
    // readiness unknown; it opens on the first loop turn and reopens with backoff.
    let mut topology: Option<WireStream> = None;
    let epoch_cancel = cancel.child_token();
    let subscriptions = TaskTracker::new();
    let mut tokens: HashMap<PoolKey, CancellationToken> = HashMap::new();

    let result = loop {
        let catalog_deadline = tokio::time::Instant::from_std(session.catalog_deadline());
        tokio::select! {
            biased;
            () = cancel.cancelled() => break Ok(()),
            () = tokio::time::sleep_until(catalog_deadline) => {
                if let Some(stale) = session.handle_catalog_timeout(Instant::now()) {
                    break Err(fault(stale));
                }
            }
            // `WireStream::next` is cancel safe (its buffer lives in the stream).
            message = catalog.next() => {
                let message = match message {
                    Err(err) => break Err(err.into()),
                    Ok(None) => break Err(EpochError::Closed { addr: addr.clone(), stream: "catalog" }),
                    Ok(Some(message)) => message,
                };
                let step = shared.update(|state| session.handle_catalog(Instant::now(), &message, state, link));
                let step = match step {
                    Ok(step) => step,
                    Err(err) => break Err(fault(err)),
                };
                shared.metrics.incr(Counter::CatalogsApplied);
                if step.newly_quarantined > 0 {
                    shared.metrics.add(Counter::QuarantinedTotal, step.newly_quarantined as u64);
                    shared.metrics.add(Counter::OverBudgetTotal, step.newly_over_budget as u64);
                    for entry in shared.state.read().quarantined() {
                        warn!(dc = %entry.dc, pool = %entry.entry, reason = %entry.reason, "catalog entry quarantined");
                    }
                }
                for key in &step.unsubscribe {
                    if let Some(token) = tokens.remove(key) {
                        token.cancel();
                    }
                }
                for key in step.subscribe {
                    let token = epoch_cancel.child_token();
                    tokens.insert(key, token.clone());
                    subscriptions.spawn(run_subscription(Arc::clone(shared), relay, key, identity, token));
                }
                shared.bump();
            }
            message = next_or_pending(&mut load) => {
                let now = Instant::now();
                let jitter = rand::random::<f64>();
                // A message the session refuses loses the stream there; a closed or
                // failed stream is reported lost here.
                let lost = match message {
                    Ok(Some(message)) => shared
                        .update(|state| session.handle_load(now, &message, state, jitter))
                        .err()
                        .map(|loss| loss.to_string()),
                    Ok(None) | Err(_) => {
                        shared.update(|state| session.handle_load_lost(now, state, jitter));
                        Some(message.err().map_or_else(|| "load stream closed".to_owned(), |err| err.to_string()))
                    }
                };
                match lost {
                    None => shared.metrics.incr(Counter::LoadWindows),
                    Some(failure) => {
                        warn!(dc = %shared.dc(relay), peer = %addr, error = %failure, "load stream lost; loads unknown until it reopens");
                        load = None;
                    }
                }
                shared.bump();
            }
            message = next_or_pending(&mut topology) => {
                let now = Instant::now();
                let jitter = rand::random::<f64>();
                let lost = match message {
                    Ok(Some(message)) => {
                        match shared.update(|state| session.handle_topology(now, &message, state, jitter)) {
                            Ok(n_invalid) => {
                                if n_invalid > 0 {
                                    warn!(dc = %shared.dc(relay), peer = %addr, n_invalid, "topology entries failed validation; their readiness is unknown");
                                }
                                shared.metrics.incr(Counter::TopologiesApplied);
                                None
                            }
                            Err(loss) => Some(loss.to_string()),
                        }
                    }
                    Ok(None) | Err(_) => {
                        shared.update(|state| session.handle_topology_lost(now, state, jitter));
                        Some(message.err().map_or_else(|| "topology stream closed".to_owned(), |err| err.to_string()))
                    }
                };
                if let Some(failure) = lost {
                    warn!(dc = %shared.dc(relay), peer = %addr, error = %failure, "topology stream lost; readiness unknown until it reopens");
                    topology = None;
                }
                shared.bump();
            }
            () = sleep_until_std(session.poll_silence()) => {
                let step = shared.update(|state| session.handle_silence_timeout(Instant::now(), state, link));
                match step {
                    Err(silent) => break Err(fault(silent)),
                    Ok(SilenceStep::Marked) => {
                        let dc = &shared.config.relays[shared.relays[relay].0];
                        if shared.config.standby == StandbyMode::Hot && !dc.standby.is_empty() {
                            // A hot pair's relay: counted like a pair's relay left for
                            // silence (its DC is scored through another meanwhile).
                            shared.metrics.incr(Counter::RelaySilences);
                        }
                        shared.bump();
                    }
                    Ok(SilenceStep::Nothing) => {}
                }
            }
            () = sleep_until_std(session.topology_stream().poll_timeout()), if topology.is_none() => {
                topology = open_side(shared, relay, "topology", StreamRpc::WatchTopology, session.topology_stream()).await;
            }
            () = sleep_until_std(session.load_stream().poll_timeout()), if load.is_none() => {
                load = open_side(shared, relay, "load", StreamRpc::WatchLoad, session.load_stream()).await;
            }
        }
    };
    epoch_cancel.cancel();
    subscriptions.close();
    subscriptions.wait().await;
    result
}

/// Opens a side stream (`load`, `topology`) now and tells its `side` link how that went
/// (on failure it schedules the next try).
async fn open_side(
    shared: &Shared,
    relay: usize,
    suffix: &'static str,
    rpc: StreamRpc,
    side: &mut SideStream,
) -> Option<WireStream> {
    match open(shared, relay, suffix, rpc).await {
        Ok(stream) => {
            side.handle_opened(Instant::now());
            Some(stream)
        }
        Err(err) => {
            debug!(peer = %shared.endpoint(relay).addr, stream = suffix, error = %err, "side stream open failed");
            side.handle_open_failed(Instant::now(), rand::random::<f64>());
            None
        }
    }
}

/// Sleeps until `deadline` (a std instant of the same clock), or forever without one.
async fn sleep_until_std(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)).await,
        None => std::future::pending().await,
    }
}

/// The next message of `stream`, or pending forever when there is no stream.
async fn next_or_pending(stream: &mut Option<WireStream>) -> Result<Option<Message>, WireError> {
    match stream {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

async fn relay_info(shared: &Shared, relay: usize) -> Result<RelayIdentity, EpochError> {
    relay_info_at(shared, shared.endpoint(relay)).await
}

/// The relay info of one given address (a followed relay's, or a standby's when probed).
pub(super) async fn relay_info_at(
    shared: &Shared,
    endpoint: &Endpoint,
) -> Result<RelayIdentity, EpochError> {
    let addr = &endpoint.addr;
    let mut stream = open_at(shared, endpoint, "info", StreamRpc::RelayInfo).await?;
    let message = tokio::time::timeout(shared.config.limits.connect_timeout, stream.next())
        .await
        .map_err(|_| {
            EpochError::Wire(WireError::ConnectTimeout {
                addr: addr.clone(),
                timeout: shared.config.limits.connect_timeout,
            })
        })??;
    match message {
        Some(Message::RelayInfo(info)) if info.protocol_major == PROTOCOL_MAJOR => Ok(info.relay),
        Some(Message::RelayInfo(info)) => Err(EpochError::ContractMismatch {
            addr: addr.clone(),
            major: info.protocol_major,
        }),
        // The first answer of an epoch: an error here is the relay refusing us (a missing
        // or wrong token, typically), counted apart from errors on established streams.
        Some(Message::Error(err)) => Err(EpochError::Refused {
            addr: addr.clone(),
            reason: err.effective_reason(),
            message: err.message,
        }),
        Some(other) => Err(unexpected(addr, &other, "relay info")),
        None => Err(EpochError::Closed {
            addr: addr.clone(),
            stream: "relay info",
        }),
    }
}

fn unexpected(addr: &str, message: &Message, stream: &'static str) -> EpochError {
    match message {
        Message::Error(err) => EpochError::Relay {
            addr: addr.to_owned(),
            reason: err.effective_reason(),
            message: err.message.clone(),
        },
        other => EpochError::Unexpected {
            addr: addr.to_owned(),
            kind: other.kind().name(),
            stream,
        },
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Only an attempt that reached no relay (on either protocol) may be retried at the
    /// rejoin interval: a TLS failure, a refusal or a closed stream cost the relay work.
    #[test]
    fn only_attempts_that_reached_no_relay_are_unreachable() {
        let addr = || "127.0.0.1:9".to_owned();
        let io = |kind| std::io::Error::from(kind);
        let unreachable = [
            EpochError::Wire(WireError::ConnectTimeout {
                addr: addr(),
                timeout: Duration::from_secs(5),
            }),
            EpochError::Wire(WireError::Io {
                addr: addr(),
                source: io(std::io::ErrorKind::ConnectionRefused),
            }),
            EpochError::Wire(WireError::Contract {
                addr: addr(),
                source: kvrelay_dynamo::ClientError::Transport(Box::new(
                    tonic::Status::unavailable("tcp connect error"),
                )),
            }),
        ];
        for error in &unreachable {
            assert!(error.unreachable(), "{error}");
        }
        let declined = [
            EpochError::Wire(WireError::Tls {
                addr: addr(),
                source: io(std::io::ErrorKind::InvalidData),
            }),
            EpochError::Refused {
                addr: addr(),
                reason: ErrorReason::ResourceLimit,
                message: "max_connections".to_owned(),
            },
            EpochError::Closed {
                addr: addr(),
                stream: "relay info",
            },
            EpochError::Wire(WireError::Contract {
                addr: addr(),
                source: kvrelay_dynamo::ClientError::Token,
            }),
        ];
        for error in &declined {
            assert!(!error.unreachable(), "{error}");
        }
    }
}
