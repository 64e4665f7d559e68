//! The WAN server: one TCP listener, one task per connection, one stream per connection.
//!
//! The accept loop admits at most `max_connections` sockets at once (extra sockets are
//! closed at once and counted), hands each to [`connection::serve`] in a task owned by the
//! server's `TaskTracker`, and stops accepting when its token is cancelled. Shutdown cancels
//! the token (every stream sends `publication_unavailable` and closes) and waits for the
//! tracker.

pub(crate) mod auth;
pub(crate) mod connection;
pub(crate) mod source;

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info_span, warn};

use crate::metrics::OutcomeLabel;
use connection::ConnectionContext;

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
        let connections = Arc::new(Semaphore::new(
            usize::try_from(self.ctx.limits.max_connections).unwrap_or(Semaphore::MAX_PERMITS),
        ));
        loop {
            let accepted = tokio::select! {
                biased;
                () = cancel.cancelled() => break,
                accepted = self.listener.accept() => accepted,
            };
            let (tcp, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Per-connection accept errors (e.g. a reset before accept) are not fatal.
                    debug!(error = %err, "accept failed");
                    continue;
                }
            };
            let Ok(permit) = connections.clone().try_acquire_owned() else {
                warn!(%peer, limit = self.ctx.limits.max_connections, "connection limit reached; closing");
                self.ctx
                    .metrics
                    .connections
                    .get_or_create(&OutcomeLabel {
                        outcome: "rejected_limit",
                    })
                    .inc();
                drop(tcp);
                continue;
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
