//! [`serve`]: the hardened HTTP/1.1 accept loop behind every kvrelay HTTP listener.
//!
//! `axum::serve` sets no timer, so a peer could hold a connection open forever by sending
//! half a request head or by idling on keep-alive. This loop runs its own accept loop
//! (HTTP/1.1 only) instead:
//! - at most [`HttpBounds::max_connections`] connections, and at most
//!   [`HttpBounds::max_connections_per_peer`] from one peer address, so one host holding
//!   idle connections cannot shut out everyone else (orchestrator probes included);
//!   extra sockets are closed at accept (counted, logged at warn at most once per
//!   interval);
//! - hyper's header-read timer ([`HttpBounds::header_read_timeout`]) runs from the moment
//!   a request head is awaited, so it bounds both a slow head and an idle keep-alive;
//! - a connection lives at most [`HttpBounds::connection_timeout`];
//! - accept errors back off ([`crate::AcceptBackoff`]);
//! - with a [`Handshake`] (TLS, say), the handshake runs in the connection's task and must
//!   finish within the header-read timeout (`handshake_failed` otherwise), so a peer that
//!   opens a socket and never speaks TLS holds one connection slot at most that long.
//!
//! Routes, authentication and request limits are the caller's business (axum layers on the
//! router it passes); this module only carries requests to them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::accept::{AcceptBackoff, ConnectionOutcome, ListenerEvents};
use crate::admission::ConnectionAdmission;
use kvrelay_pacing::LogBudget;

/// The connection bounds of one HTTP listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HttpBounds {
    /// Time to send a complete request head; also the keep-alive idle bound.
    pub header_read_timeout: Duration,
    /// Longest life of one connection.
    pub connection_timeout: Duration,
    /// Concurrent connections.
    pub max_connections: u32,
    /// Concurrent connections from one peer IP address.
    pub max_connections_per_peer: u32,
}

impl HttpBounds {
    /// Default [`HttpBounds::header_read_timeout`]: 5 s.
    pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(5);
    /// Default [`HttpBounds::connection_timeout`]: 60 s.
    pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(60);
    /// Default [`HttpBounds::max_connections`].
    pub const DEFAULT_MAX_CONNECTIONS: u32 = 16;

    /// The per-peer cap a listener uses when its operator sets none: a quarter of the
    /// connection cap (at least one), so three quarters of the slots stay for other hosts.
    pub const fn default_per_peer(max_connections: u32) -> u32 {
        let quarter = max_connections / 4;
        if quarter == 0 { 1 } else { quarter }
    }
}

impl Default for HttpBounds {
    fn default() -> Self {
        Self {
            header_read_timeout: Self::DEFAULT_HEADER_READ_TIMEOUT,
            connection_timeout: Self::DEFAULT_CONNECTION_TIMEOUT,
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
            max_connections_per_peer: Self::default_per_peer(Self::DEFAULT_MAX_CONNECTIONS),
        }
    }
}

/// Turns an accepted socket into the stream HTTP is served over: TLS, or nothing.
pub trait Handshake: Send + Sync + 'static {
    /// The stream after the handshake.
    type Stream: AsyncRead + AsyncWrite + Send + Unpin + 'static;

    /// Runs the handshake on `tcp` (the caller bounds it in time).
    fn handshake(
        &self,
        tcp: TcpStream,
    ) -> impl std::future::Future<Output = std::io::Result<Self::Stream>> + Send;
}

/// No handshake: HTTP over the plain TCP socket.
#[derive(Debug, Clone, Copy, Default)]
pub struct Plaintext;

impl Handshake for Plaintext {
    type Stream = TcpStream;

    async fn handshake(&self, tcp: TcpStream) -> std::io::Result<TcpStream> {
        Ok(tcp)
    }
}

/// Serves `router` on `listener` under `bounds` until `cancel` fires; then stops accepting,
/// lets in-flight requests finish (each connection is bounded anyway) and returns.
/// `name` labels the listener in logs; `events` counts what happened.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    bounds: HttpBounds,
    name: &'static str,
    events: Arc<dyn ListenerEvents>,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    serve_with(
        listener,
        router,
        bounds,
        name,
        events,
        cancel,
        Arc::new(Plaintext),
    )
    .await
}

/// [`serve`] with a [`Handshake`] on every accepted socket (TLS).
pub async fn serve_with<H: Handshake>(
    listener: TcpListener,
    router: Router,
    bounds: HttpBounds,
    name: &'static str,
    events: Arc<dyn ListenerEvents>,
    cancel: CancellationToken,
    handshake: Arc<H>,
) -> std::io::Result<()> {
    let connections =
        ConnectionAdmission::new(bounds.max_connections, bounds.max_connections_per_peer);
    let tracker = TaskTracker::new();
    let mut backoff = AcceptBackoff::new(name);
    let mut refusals = LogBudget::default();
    loop {
        let accepted = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                let sleep = backoff.failed(&err, events.as_ref());
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
                events.connection(refusal.outcome());
                if let Some(suppressed) = refusals.admit(Instant::now()) {
                    warn!(listener = name, %peer, %refusal, suppressed, "HTTP connection refused; closing");
                }
                drop(tcp);
                continue;
            }
        };
        events.connection(ConnectionOutcome::Accepted);
        // Request/response traffic: an answer must not wait for the peer's delayed ACK.
        if let Err(err) = tcp.set_nodelay(true) {
            debug!(listener = name, %peer, error = %err, "could not set TCP_NODELAY");
        }
        let service = TowerToHyperService::new(router.clone());
        let events = events.clone();
        let cancel = cancel.clone();
        let handshake = handshake.clone();
        tracker.spawn(async move {
            let stream = match tokio::time::timeout(
                bounds.header_read_timeout,
                handshake.handshake(tcp),
            )
            .await
            {
                Ok(Ok(stream)) => stream,
                Ok(Err(err)) => {
                    events.connection(ConnectionOutcome::HandshakeFailed);
                    debug!(listener = name, %peer, error = %err, "handshake failed");
                    return;
                }
                Err(_) => {
                    events.connection(ConnectionOutcome::HandshakeFailed);
                    debug!(listener = name, %peer, "handshake timed out");
                    return;
                }
            };
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(bounds.header_read_timeout)
                .keep_alive(true);
            let connection = builder.serve_connection(TokioIo::new(stream), service);
            let mut connection = std::pin::pin!(connection);
            let life = tokio::time::sleep(bounds.connection_timeout);
            let mut life = std::pin::pin!(life);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = &mut life => {
                    debug!(listener = name, %peer, "HTTP connection reached its connection timeout; closing");
                    Ok(())
                }
                () = cancel.cancelled() => {
                    // Finish the request in flight (bounded by the connection's life), then close.
                    connection.as_mut().graceful_shutdown();
                    tokio::select! {
                        result = connection.as_mut() => result,
                        () = &mut life => Ok(()),
                    }
                }
            };
            if let Err(err) = result {
                if err.is_timeout() {
                    events.connection(ConnectionOutcome::HeaderTimeout);
                }
                debug!(listener = name, %peer, error = %err, "HTTP connection ended with an error");
            }
            drop(permit);
        });
    }
    tracker.close();
    tracker.wait().await;
    Ok(())
}
