//! The WAN server: one TCP listener, one task per connection, one stream per connection.
//!
//! The accept loop admits at most `max_connections` sockets at once and at most
//! `max_connections_per_peer` from one IP address (extra sockets are closed at once, counted
//! and logged rate-limited), backs off while the process is out of descriptors
//! ([`crate::accept`]), hands each socket to [`connection::serve`] in a task owned by the
//! server's `TaskTracker`, and stops accepting when its token is cancelled. Shutdown cancels
//! the token (every stream sends `publication_unavailable` and closes) and waits for the
//! tracker.

pub(crate) mod connection;
pub(crate) mod request;
pub(crate) mod source;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info_span, warn};

use crate::metrics::OutcomeLabel;
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
        let cancel: CancellationToken = self.ctx.cancel.clone();
        let connections = ConnectionAdmission::new(
            self.ctx.limits.max_connections,
            self.ctx.limits.max_connections_per_peer,
        );
        let mut backoff = AcceptBackoff::new("wan");
        let accept_errors = crate::http::ListenerMetrics {
            listener: "wan",
            metrics: self.ctx.metrics.clone(),
        };
        let mut refusals = LogBudget::default();
        loop {
            let accepted = tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                accepted = self.listener.accept() => accepted,
            };
            let (tcp, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    let sleep = backoff.failed(&err, &accept_errors);
                    if !sleep.is_zero() {
                        tokio::select! {
                            biased;
                            () = cancel.cancelled() => break,
                            () = tokio::time::sleep(sleep) => {}
                        }
                    }
                    continue;
                }
            };
            backoff.accepted();
            let permit = match connections.admit(peer.ip()) {
                Ok(permit) => permit,
                Err(refusal) => {
                    self.ctx
                        .metrics
                        .connections
                        .get_or_create(&OutcomeLabel {
                            outcome: refusal.outcome().label(),
                        })
                        .inc();
                    if let Some(suppressed) = refusals.admit(Instant::now()) {
                        warn!(%peer, %refusal, suppressed, "connection refused; closing");
                    }
                    drop(tcp);
                    continue;
                }
            };
            let ctx = self.ctx.clone();
            tracker.spawn(
                async move {
                    connection::serve(ctx, tcp, peer).await;
                    drop(permit);
                }
                .instrument(info_span!("wan_connection", %peer)),
            );
        }
    }
}
