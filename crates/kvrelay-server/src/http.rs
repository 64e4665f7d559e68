//! The admin HTTP listener: the shared hardened loop ([`kvrelay_http::serve`]: at most
//! `admin.max_connections` connections, `admin.header_read_timeout_ms` for a request head
//! and an idle keep-alive, `admin.connection_timeout_ms` per connection, accept backoff)
//! plus an optional bearer token: with `admin.auth`, every path except `/healthz` and
//! `/readyz` needs `Authorization: Bearer <token>` (401 otherwise, counted).
//!
//! Routes and views are `admin.rs`'s business; this module only carries requests to them.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use kvrelay_http::{AcceptErrorKind, ConnectionOutcome, ListenerEvents};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metrics::{AcceptErrorLabels, OutcomeLabel, RelayMetrics};
use kvrelay_tls::BearerToken;

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

/// Serves `router` on `listener` under `bounds` (and its token, if any) until `cancel`
/// fires, through the shared hardened loop ([`kvrelay_http::serve`]).
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
    let events = Arc::new(ListenerMetrics {
        listener: "admin",
        metrics,
    });
    kvrelay_http::serve(
        listener,
        router,
        kvrelay_http::HttpBounds {
            header_read_timeout: bounds.header_read_timeout,
            connection_timeout: bounds.connection_timeout,
            max_connections: bounds.max_connections,
            max_connections_per_peer: kvrelay_http::HttpBounds::default_per_peer(
                bounds.max_connections,
            ),
        },
        "admin",
        events,
        cancel,
    )
    .await
}

/// Counts a listener's events in the relay's metrics: accept errors in
/// `kvrelay_accept_errors_total{listener}`, connection outcomes (reported by the admin
/// listener only; the WAN loop counts its own in `kvrelay_connections_total`) in
/// `kvrelay_admin_connections_total`.
#[derive(Debug)]
pub(crate) struct ListenerMetrics {
    /// `wan` or `admin`.
    pub(crate) listener: &'static str,
    pub(crate) metrics: Arc<RelayMetrics>,
}

impl ListenerEvents for ListenerMetrics {
    fn accept_error(&self, kind: AcceptErrorKind) {
        self.metrics
            .accept_errors
            .get_or_create(&AcceptErrorLabels {
                listener: self.listener,
                kind: kind.label(),
            })
            .inc();
    }

    fn connection(&self, outcome: ConnectionOutcome) {
        self.metrics
            .admin_connections
            .get_or_create(&OutcomeLabel {
                outcome: outcome.label(),
            })
            .inc();
    }
}

async fn require_token(State(gate): State<Gate>, request: Request, next: Next) -> Response {
    if OPEN_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let authorization = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .map(axum::http::HeaderValue::as_bytes);
    if gate.token.matches_authorization(authorization) {
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
