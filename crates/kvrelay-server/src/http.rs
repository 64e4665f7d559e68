//! The hardened admin HTTP listener: bounded connections, a request-head deadline, a
//! lifetime bound per connection, and an optional bearer token.
//!
//! `axum::serve` sets no timer, so a peer could hold a connection open forever by sending
//! half a request head or by idling on keep-alive. This module runs its own accept loop
//! (HTTP/1.1 only) instead:
//! - at most `admin.max_connections` connections; extra sockets are closed at accept;
//! - hyper's header-read timer (`admin.header_read_timeout_ms`) runs from the moment a
//!   request head is awaited, so it bounds both a slow head and an idle keep-alive;
//! - a connection lives at most `admin.connection_timeout_ms`;
//! - with `admin.auth`, every path except `/healthz` and `/readyz` needs
//!   `Authorization: Bearer <token>` (401 otherwise, counted);
//! - accept errors back off ([`crate::accept`]).
//!
//! Routes and views are `admin.rs`'s business; this module only carries requests to them.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, warn};

use crate::accept::AcceptBackoff;
use crate::metrics::{OutcomeLabel, RelayMetrics};
use crate::throttle::LogThrottle;
use crate::wan::auth::BearerToken;

/// Paths served without a token, so orchestrator probes need no secret.
const OPEN_PATHS: [&str; 2] = ["/healthz", "/readyz"];

/// The bounds and the optional token of the admin listener.
#[derive(Debug, Clone)]
pub(crate) struct HttpBounds {
    /// Time to send a complete request head; also the keep-alive idle bound.
    pub(crate) header_read_timeout: Duration,
    /// Longest life of one connection.
    pub(crate) connection_timeout: Duration,
    /// Concurrent connections.
    pub(crate) max_connections: u32,
    /// Required on every path except [`OPEN_PATHS`], when set.
    pub(crate) token: Option<BearerToken>,
}

#[cfg(test)]
impl HttpBounds {
    /// Short bounds for tests (the admin tests' listener).
    pub(crate) fn for_tests() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(60),
            max_connections: 16,
            token: None,
        }
    }
}

#[derive(Clone)]
struct Gate {
    token: BearerToken,
    metrics: Arc<RelayMetrics>,
}

/// Serves `router` on `listener` under `bounds` until `cancel` fires; then stops accepting,
/// lets in-flight requests finish (each connection is bounded anyway) and returns.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    bounds: HttpBounds,
    metrics: Arc<RelayMetrics>,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    let router = match &bounds.token {
        Some(token) => router.layer(axum::middleware::from_fn_with_state(
            Gate {
                token: token.clone(),
                metrics: metrics.clone(),
            },
            require_token,
        )),
        None => router,
    };
    let permits = Arc::new(Semaphore::new(
        usize::try_from(bounds.max_connections).unwrap_or(Semaphore::MAX_PERMITS),
    ));
    let tracker = TaskTracker::new();
    let mut backoff = AcceptBackoff::new("admin");
    let refusals = LogThrottle::default();
    loop {
        let accepted = tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (tcp, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                let sleep = backoff.failed(&err, &metrics);
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
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            outcome(&metrics, "rejected_limit");
            if let Some(suppressed) = refusals.admit(Instant::now()) {
                warn!(%peer, limit = bounds.max_connections, suppressed, "admin connection limit reached; closing");
            }
            drop(tcp);
            continue;
        };
        outcome(&metrics, "accepted");
        let service = TowerToHyperService::new(router.clone());
        let metrics = metrics.clone();
        let cancel = cancel.clone();
        let bounds = bounds.clone();
        tracker.spawn(async move {
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(bounds.header_read_timeout)
                .keep_alive(true);
            let connection = builder.serve_connection(TokioIo::new(tcp), service);
            let mut connection = std::pin::pin!(connection);
            let life = tokio::time::sleep(bounds.connection_timeout);
            let mut life = std::pin::pin!(life);
            let result = tokio::select! {
                result = connection.as_mut() => result,
                () = &mut life => {
                    debug!(%peer, "admin connection reached connection_timeout_ms; closing");
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
                    outcome(&metrics, "header_timeout");
                }
                debug!(%peer, error = %err, "admin connection ended with an error");
            }
            drop(permit);
        });
    }
    tracker.close();
    tracker.wait().await;
    Ok(())
}

fn outcome(metrics: &RelayMetrics, outcome: &'static str) {
    metrics
        .admin_connections
        .get_or_create(&OutcomeLabel { outcome })
        .inc();
}

async fn require_token(State(gate): State<Gate>, request: Request, next: Next) -> Response {
    if OPEN_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "));
    if gate.token.matches(presented) {
        next.run(request).await
    } else {
        gate.metrics.admin_unauthorized.inc();
        (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "missing or wrong bearer token\n",
        )
            .into_response()
    }
}
