//! The WAN server: one TCP listener, one task per connection, one stream per connection.
//!
//! The accept loop admits at most `max_connections` sockets at once and at most
//! `max_connections_per_peer` from one IP address (extra sockets are closed at once, counted
//! and logged rate-limited), backs off while the process is out of descriptors
//! ([`kvrelay_http::AcceptBackoff`]), hands each socket to [`connection::serve`] in a task
//! owned by the server's `TaskTracker`, and stops accepting when its token is cancelled.
//! Shutdown cancels the token (every stream sends `publication_unavailable` and closes) and
//! waits for the tracker.

pub(crate) mod connection;
pub(crate) mod open;
pub(crate) mod request;
pub(crate) mod source;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use kvrelay_http::ConnectionPermit;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info_span, warn};

use crate::metrics::{OutcomeLabel, RelayMetrics};
use connection::ConnectionContext;
use kvrelay_http::AcceptBackoff;
use kvrelay_http::ConnectionAdmission;
use kvrelay_pacing::LogBudget;

/// A bound WAN listener, not yet accepting.
pub(crate) struct WanServer {
    listener: TcpListener,
    ctx: Arc<ConnectionContext>,
}

impl WanServer {
    pub(crate) async fn bind(addr: SocketAddr, ctx: ConnectionContext) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        Ok(Self {
            listener,
            ctx: Arc::new(ctx),
        })
    }

    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts until `ctx.cancel` fires; connection tasks join `tracker`.
    pub(crate) async fn run(self, tracker: TaskTracker) {
        let ctx = self.ctx;
        let accept = AcceptLoop {
            listener: self.listener,
            label: "wan",
            max_connections: ctx.limits.max_connections,
            max_connections_per_peer: ctx.limits.max_connections_per_peer,
            refused: ctx.metrics.connections.clone(),
            metrics: ctx.metrics.clone(),
            cancel: ctx.cancel.clone(),
        };
        accept
            .run(|tcp, peer, permit| {
                let ctx = ctx.clone();
                tracker.spawn(
                    async move {
                        connection::serve(ctx, tcp, peer).await;
                        drop(permit);
                    }
                    .instrument(info_span!("wan_connection", %peer)),
                );
            })
            .await;
    }
}

/// One listener's accept loop: caps in total and per peer address (extra sockets closed at
/// once, counted under `refused` and logged rate-limited), backoff while the process is
/// out of descriptors, stop on `cancel`. Every stream listener of the relay runs this one.
pub(crate) struct AcceptLoop {
    pub(crate) listener: TcpListener,
    /// `wan` or `dynamo`, for accept-error metrics and logs.
    pub(crate) label: &'static str,
    pub(crate) max_connections: u32,
    pub(crate) max_connections_per_peer: u32,
    /// Where refusals are counted, by outcome.
    pub(crate) refused: Family<OutcomeLabel, Counter>,
    pub(crate) metrics: Arc<RelayMetrics>,
    pub(crate) cancel: CancellationToken,
}

impl AcceptLoop {
    /// Hands every admitted socket, with the permit that holds its slot, to `admitted`.
    pub(crate) async fn run(
        self,
        mut admitted: impl FnMut(TcpStream, SocketAddr, ConnectionPermit),
    ) {
        let connections =
            ConnectionAdmission::new(self.max_connections, self.max_connections_per_peer);
        let mut backoff = AcceptBackoff::new(self.label);
        let accept_errors = crate::http::ListenerMetrics {
            listener: self.label,
            metrics: self.metrics.clone(),
        };
        let mut refusals = LogBudget::default();
        loop {
            let accepted = tokio::select! {
                biased;
                () = self.cancel.cancelled() => break,
                accepted = self.listener.accept() => accepted,
            };
            let (tcp, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    let sleep = backoff.failed(&err, &accept_errors);
                    if !sleep.is_zero() {
                        tokio::select! {
                            biased;
                            () = self.cancel.cancelled() => break,
                            () = tokio::time::sleep(sleep) => {}
                        }
                    }
                    continue;
                }
            };
            backoff.accepted();
            match connections.admit(peer.ip()) {
                Ok(permit) => admitted(tcp, peer, permit),
                Err(refusal) => {
                    self.refused
                        .get_or_create(&OutcomeLabel {
                            outcome: refusal.outcome().label(),
                        })
                        .inc();
                    if let Some(suppressed) = refusals.admit(Instant::now()) {
                        warn!(listener = self.label, %peer, %refusal, suppressed, "connection refused; closing");
                    }
                    drop(tcp);
                }
            }
        }
    }
}
