//! Admin HTTP (axum): health, readiness, Prometheus metrics and JSON views.
//!
//! Routes: `GET /healthz` (200 while the relay runs), `GET /readyz` (200 once discovery has
//! listed, every pool has a connected source and no pool is stalled, else 503 with the
//! reasons, each naming its pool), `GET /metrics` (OpenMetrics text), `GET /v1/catalog`,
//! `/v1/load`, `/v1/topology`, `/v1/pools` (every attached pool with its key and links) and
//! `/v1/pools/{pool}/stats` (404 for an unknown pool). The views are read from an
//! [`AdminView`] so this module knows nothing about pools or discovery.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::http::HttpBounds;
use crate::metrics::RelayMetrics;

/// Readiness as reported by `/readyz`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Readiness {
    pub(crate) ready: bool,
    pub(crate) reasons: Vec<String>,
}

/// What the admin server shows; implemented by the host.
pub(crate) trait AdminView: Send + Sync + 'static {
    /// Whether the relay is running (not shutting down, no fatal host error).
    fn live(&self) -> bool;
    fn readiness(&self) -> Readiness;
    fn catalog(&self) -> serde_json::Value;
    fn load(&self) -> serde_json::Value;
    fn topology(&self) -> serde_json::Value;
    /// Every attached pool with its key, endpoint, generation, state and links.
    fn pools(&self) -> serde_json::Value;
    /// Stats of the pool whose id renders as `pool` (hex), or `None`.
    fn pool_stats(&self, pool: &str) -> Option<serde_json::Value>;
    /// Refreshes sampled gauges just before `/metrics` is encoded.
    fn refresh_metrics(&self);
}

#[derive(Clone)]
struct AdminState {
    view: Arc<dyn AdminView>,
    metrics: Arc<RelayMetrics>,
}

/// Binds the admin listener; the returned future serves (under `bounds`, see
/// [`crate::http`]) until `cancel` fires.
pub(crate) async fn bind(
    addr: SocketAddr,
    view: Arc<dyn AdminView>,
    metrics: Arc<RelayMetrics>,
    bounds: HttpBounds,
    cancel: CancellationToken,
) -> std::io::Result<(SocketAddr, impl Future<Output = std::io::Result<()>> + Send)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    let app = router(AdminState {
        view,
        metrics: metrics.clone(),
    });
    let serve = crate::http::serve(listener, app, bounds, metrics, cancel);
    Ok((local, serve))
}

fn router(state: AdminState) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/v1/catalog", get(catalog))
        .route("/v1/load", get(load))
        .route("/v1/topology", get(topology))
        .route("/v1/pools", get(pools))
        .route("/v1/pools/{pool}/stats", get(pool_stats))
        .with_state(state)
}

async fn healthz(State(state): State<AdminState>) -> Response {
    if state.view.live() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response()
    }
}

async fn readyz(State(state): State<AdminState>) -> Response {
    let readiness = state.view.readiness();
    let status = if readiness.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(readiness)).into_response()
}

async fn metrics(State(state): State<AdminState>) -> Response {
    state.view.refresh_metrics();
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        state.metrics.encode(),
    )
        .into_response()
}

async fn catalog(State(state): State<AdminState>) -> Response {
    axum::Json(state.view.catalog()).into_response()
}

async fn load(State(state): State<AdminState>) -> Response {
    axum::Json(state.view.load()).into_response()
}

async fn topology(State(state): State<AdminState>) -> Response {
    axum::Json(state.view.topology()).into_response()
}

async fn pools(State(state): State<AdminState>) -> Response {
    axum::Json(state.view.pools()).into_response()
}

async fn pool_stats(State(state): State<AdminState>, Path(pool): Path<String>) -> Response {
    match state.view.pool_stats(&pool) {
        Some(stats) => axum::Json(stats).into_response(),
        None => (StatusCode::NOT_FOUND, format!("pool {pool} not found\n")).into_response(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    struct FakeView {
        ready: AtomicBool,
    }

    impl AdminView for FakeView {
        fn live(&self) -> bool {
            true
        }
        fn readiness(&self) -> Readiness {
            if self.ready.load(Ordering::SeqCst) {
                Readiness {
                    ready: true,
                    reasons: Vec::new(),
                }
            } else {
                Readiness {
                    ready: false,
                    reasons: vec!["discovery has not listed".into()],
                }
            }
        }
        fn catalog(&self) -> serde_json::Value {
            serde_json::json!({"revision": 4, "pools": []})
        }
        fn load(&self) -> serde_json::Value {
            serde_json::json!({"pools": []})
        }
        fn topology(&self) -> serde_json::Value {
            serde_json::json!({"entries": []})
        }
        fn pools(&self) -> serde_json::Value {
            serde_json::json!({"pools": [{"pool": "abcd", "stats": "/v1/pools/abcd/stats"}]})
        }
        fn pool_stats(&self, pool: &str) -> Option<serde_json::Value> {
            (pool == "abcd").then(|| serde_json::json!({"sequence": 9}))
        }
        fn refresh_metrics(&self) {}
    }

    /// One HTTP/1.1 GET against an admin listener: status and body.
    pub(crate) async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).await.unwrap();
        let status = response[9..12].parse().unwrap();
        let body = response
            .split("\r\n\r\n")
            .nth(1)
            .unwrap_or_default()
            .to_owned();
        (status, body)
    }

    async fn start(
        view: Arc<FakeView>,
    ) -> (SocketAddr, CancellationToken, tokio::task::JoinHandle<()>) {
        let cancel = CancellationToken::new();
        let metrics = Arc::new(RelayMetrics::new());
        let (addr, serve) = bind(
            "127.0.0.1:0".parse().unwrap(),
            view,
            metrics,
            crate::http::HttpBounds::for_tests(),
            cancel.clone(),
        )
        .await
        .unwrap();
        let task = tokio::spawn(async move {
            serve.await.unwrap();
        });
        (addr, cancel, task)
    }

    #[tokio::test]
    async fn readyz_reports_unready_with_reasons_then_ready() {
        let view = Arc::new(FakeView {
            ready: AtomicBool::new(false),
        });
        let (addr, cancel, task) = start(view.clone()).await;
        let (status, body) = get(addr, "/readyz").await;
        assert_eq!(status, 503);
        assert!(body.contains("discovery has not listed"), "{body}");
        view.ready.store(true, Ordering::SeqCst);
        assert_eq!(get(addr, "/readyz").await.0, 200);
        cancel.cancel();
        task.await.unwrap();
    }

    #[tokio::test]
    async fn json_views_and_metrics_are_served() {
        let view = Arc::new(FakeView {
            ready: AtomicBool::new(true),
        });
        let (addr, cancel, task) = start(view).await;
        assert_eq!(get(addr, "/healthz").await.0, 200);
        let (status, body) = get(addr, "/v1/catalog").await;
        assert_eq!(status, 200);
        assert!(body.contains("\"revision\":4"), "{body}");
        let (status, body) = get(addr, "/metrics").await;
        assert_eq!(status, 200);
        assert!(body.contains("kvrelay_streams"), "{body}");
        let (status, body) = get(addr, "/v1/pools").await;
        assert_eq!(status, 200);
        assert!(body.contains("/v1/pools/abcd/stats"), "{body}");
        assert_eq!(get(addr, "/v1/pools/abcd/stats").await.0, 200);
        assert_eq!(get(addr, "/v1/pools/ffff/stats").await.0, 404);
        cancel.cancel();
        task.await.unwrap();
    }
}
