//! The Dynamo-contract door (`[dynamo]`): Dynamo's relay contract over gRPC, beside the
//! WAN port, publishing the same pools through the same [`StreamOpener`].
//!
//! This module only wires: the shared accept loop (connection caps in total and per peer,
//! the WAN's `max_connections*` limits, counted apart), the TLS handshake under the WAN's
//! `request_timeout_ms`, the bearer-token check, and metrics. The contract itself is
//! `kvrelay_dynamo`; the streams' rules are the relay's own. Differences from our WAN
//! door, all the contract's: pool subscribers are never sent coalesced deltas (a lagging
//! one is cut off with `SUBSCRIBER_LAGGED`) and never resume (every stream starts with a
//! snapshot).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use futures::StreamExt;
use futures::future::BoxFuture;
use kvrelay_codec::v1::{ErrorMessage, StreamRequest};
use kvrelay_dynamo::{DoorEvent, DoorIo, DoorSettings, Feed, Opened, Rpc};
use kvrelay_tls::{BearerToken, ServerTls};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info_span, warn};

use crate::limits::Limits;
use crate::metrics::{OutcomeLabel, RelayMetrics, RpcLabel, RpcReasonLabels};
use crate::wan::AcceptLoop;
use crate::wan::open::{StreamFeed, StreamOpener};
use crate::wan::source::StreamFailure;

/// Connections past TLS waiting for the gRPC server to take them.
const HANDED_OVER_QUEUE: usize = 64;

/// The relay's publication as the door sees it.
struct DoorPublication {
    opener: StreamOpener,
    metrics: Arc<RelayMetrics>,
    cancel: CancellationToken,
}

fn refusal(failure: StreamFailure) -> ErrorMessage {
    ErrorMessage::new(failure.reason, &failure.message)
}

impl kvrelay_dynamo::Publication for DoorPublication {
    fn open(
        &self,
        request: StreamRequest,
        peer: IpAddr,
    ) -> BoxFuture<'static, Result<Opened, ErrorMessage>> {
        let opener = self.opener.clone();
        let cancel = self.cancel.clone();
        Box::pin(async move {
            // The contract has no coalesced deltas: a lagging subscriber is cut off.
            let opened = opener
                .open(request, peer, false, &cancel)
                .await
                .map_err(refusal)?;
            let feed = match opened.feed {
                StreamFeed::Info(info) => Feed::Info(info),
                StreamFeed::Catalog(rx) => Feed::Catalog(rx),
                StreamFeed::Topology(rx) => Feed::Readiness(rx),
                StreamFeed::Load(rx) => Feed::Load(rx),
                StreamFeed::Pool(frames) => {
                    Feed::Pool(frames.map(|next| next.map_err(refusal)).boxed())
                }
            };
            Ok(Opened {
                feed,
                permit: Box::new(opened.permit),
            })
        })
    }

    fn observe(&self, event: DoorEvent) {
        match event {
            DoorEvent::Sent {
                rpc,
                bytes,
                heartbeat,
            } => {
                let label = RpcLabel { rpc: rpc.label() };
                self.metrics
                    .dynamo_messages_sent
                    .get_or_create(&label)
                    .inc();
                self.metrics
                    .dynamo_bytes_sent
                    .get_or_create(&label)
                    .inc_by(bytes as u64);
                if heartbeat {
                    self.metrics.dynamo_heartbeats.get_or_create(&label).inc();
                }
            }
            DoorEvent::Failed { rpc, reason } => {
                self.metrics
                    .dynamo_errors
                    .get_or_create(&RpcReasonLabels {
                        rpc: rpc.label(),
                        reason: reason.name().unwrap_or("internal"),
                    })
                    .inc();
            }
        }
    }
}

/// What the door needs from the relay.
pub(crate) struct DynamoDoor {
    pub(crate) opener: StreamOpener,
    pub(crate) metrics: Arc<RelayMetrics>,
    pub(crate) limits: Limits,
    pub(crate) tls: Option<ServerTls>,
    pub(crate) token: Option<BearerToken>,
    pub(crate) cancel: CancellationToken,
}

impl DynamoDoor {
    /// Binds `listen`; the returned future serves until the door's token is cancelled.
    pub(crate) async fn bind(
        self,
        listen: SocketAddr,
        tracker: TaskTracker,
    ) -> std::io::Result<(SocketAddr, BoxFuture<'static, ()>)> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        for rpc in Rpc::ALL {
            // Every series exists from the start, so a dashboard sees zeros, not gaps.
            let label = RpcLabel { rpc: rpc.label() };
            let _ = self.metrics.dynamo_messages_sent.get_or_create(&label);
            let _ = self.metrics.dynamo_bytes_sent.get_or_create(&label);
        }
        Ok((addr, Box::pin(self.run(listener, tracker))))
    }

    async fn run(self, listener: TcpListener, tracker: TaskTracker) {
        let (handed_tx, handed_rx) = mpsc::channel::<std::io::Result<DoorIo>>(HANDED_OVER_QUEUE);
        let accept = AcceptLoop {
            listener,
            label: "dynamo",
            max_connections: self.limits.max_connections,
            max_connections_per_peer: self.limits.max_connections_per_peer,
            refused: self.metrics.dynamo_connections.clone(),
            metrics: self.metrics.clone(),
            cancel: self.cancel.clone(),
        };
        let tls = self.tls.clone();
        let metrics = self.metrics.clone();
        let handshake_timeout = self.limits.request_timeout();
        let handshakes = tracker.clone();
        let accepting = accept.run(move |tcp, peer, permit| {
            let tls = tls.clone();
            let metrics = metrics.clone();
            let handed_tx = handed_tx.clone();
            handshakes.spawn(
                async move {
                    let _ = tcp.set_nodelay(true);
                    let stream: Box<dyn kvrelay_dynamo::door::DoorStream> = match tls {
                        None => Box::new(tcp),
                        Some(tls) => {
                            match tokio::time::timeout(handshake_timeout, tls.accept(tcp)).await {
                                Ok(Ok(stream)) => Box::new(stream),
                                Ok(Err(err)) => {
                                    debug!(%peer, error = ?err.to_string(), "tls handshake failed");
                                    outcome(&metrics, "tls_failed");
                                    return;
                                }
                                Err(_) => {
                                    debug!(%peer, "tls handshake timed out");
                                    outcome(&metrics, "tls_failed");
                                    return;
                                }
                            }
                        }
                    };
                    outcome(&metrics, "served");
                    let _ = handed_tx
                        .send(Ok(DoorIo::new(stream, peer, Box::new(permit))))
                        .await;
                }
                .instrument(info_span!("dynamo_connection", %peer)),
            );
        });
        let publication = Arc::new(DoorPublication {
            opener: self.opener.clone(),
            metrics: self.metrics.clone(),
            cancel: self.cancel.clone(),
        });
        let settings = DoorSettings {
            heartbeat_interval: self.limits.heartbeat_interval(),
            write_timeout: self.limits.write_timeout(),
            snapshot_progress_timeout: self.limits.snapshot_progress_timeout(),
            queue_messages: 2,
            codec_limits: self.limits.codec(),
            max_streams_per_connection: self.limits.max_streams_admitted(),
        };
        let service = kvrelay_dynamo::RelayService::new(publication, settings, self.cancel.clone());
        let authorize = self.token.map(|token| {
            let metrics = self.metrics.clone();
            let authorize: kvrelay_dynamo::door::Authorize = Arc::new(move |metadata| {
                let presented = metadata.get("authorization").map(|value| value.as_bytes());
                let allowed = token.matches_authorization(presented);
                if !allowed {
                    metrics.dynamo_unauthorized.inc();
                }
                allowed
            });
            authorize
        });
        let incoming = tokio_stream::wrappers::ReceiverStream::new(handed_rx);
        let serving = kvrelay_dynamo::serve(incoming, service, authorize, self.cancel.clone());
        let (_, served) = tokio::join!(accepting, serving);
        if let Err(err) = served {
            warn!(error = %err, "Dynamo-contract door stopped");
        }
    }
}

fn outcome(metrics: &RelayMetrics, outcome: &'static str) {
    metrics
        .dynamo_connections
        .get_or_create(&OutcomeLabel { outcome })
        .inc();
}
