//! The HTTP service: routes, request limits, and the lifecycle of the listener and the
//! consumer behind it.
//!
//! Handlers only move bytes: parsing and validation are [`crate::api`]'s, readiness is
//! [`crate::readiness`]'s, scoring is the consumer's. Each route request takes one of
//! `max_concurrent_requests` permits without waiting (`503` + `Retry-After` when none is
//! free, so overload sheds instead of queueing); bodies are read up to `max_body_bytes`
//! (`413` above, checked against `Content-Length` before anything is read). Scoring runs
//! on the request's task: one request is tens of microseconds at hundreds of pools, and a
//! batch is bounded by `max_batch`.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use http_body_util::BodyExt as _;
use kvrelay_consumer::{BearerToken, Consumer, Ranking, ScoreError};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::api::{self, ApiError, BatchRequest, PoolsView, RouteRequest};
use crate::config::{HttpSection, RouterConfig, RouterConfigError};
use crate::metrics::RouterMetrics;
use crate::readiness::{self, PoolState};

/// What the handlers share.
#[derive(Debug)]
pub struct AppState {
    consumer: Arc<Consumer>,
    metrics: Arc<RouterMetrics>,
    http: HttpSection,
    permits: Semaphore,
    /// Required on every path but the probes, when set.
    token: Option<BearerToken>,
}

impl AppState {
    /// The state of an app serving `consumer` under `http`'s bounds.
    pub fn new(consumer: Arc<Consumer>, metrics: Arc<RouterMetrics>, http: HttpSection) -> Self {
        let permits = usize::try_from(http.max_concurrent_requests)
            .unwrap_or(Semaphore::MAX_PERMITS)
            .min(Semaphore::MAX_PERMITS);
        Self {
            consumer,
            metrics,
            http,
            permits: Semaphore::new(permits),
            token: None,
        }
    }

    /// Requires `token` (`Authorization: Bearer <token>`) on every path except `/healthz`
    /// and `/readyz`.
    #[must_use]
    pub fn with_token(mut self, token: Option<BearerToken>) -> Self {
        self.token = token;
        self
    }
}

/// Paths answered without a token: the orchestrator's probes.
const OPEN_PATHS: [&str; 2] = ["/healthz", "/readyz"];

/// Refuses a request without the configured token (401, counted), before any handler or
/// body read runs.
async fn require_token(
    State(state): State<Arc<AppState>>,
    request: Request,
    next: axum::middleware::Next,
) -> Response {
    let Some(token) = &state.token else {
        return next.run(request).await;
    };
    if OPEN_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let authorization = request
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .map(axum::http::HeaderValue::as_bytes);
    if token.matches_authorization(authorization) {
        return next.run(request).await;
    }
    state.metrics.unauthorized();
    let mut response = error_response(&ApiError::unauthorized());
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    response
}

/// The router's HTTP routes over `state`.
pub fn app(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/route", post(route))
        .route("/v1/route/batch", post(route_batch))
        .route("/v1/pools", get(pools))
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_token,
        ))
        .with_state(state)
}

fn json_response(status: StatusCode, body: &impl serde::Serialize) -> Response {
    match serde_json::to_vec(body) {
        Ok(bytes) => json_bytes(status, bytes),
        Err(err) => encode_failure(&err),
    }
}

/// `body`, already JSON, with its content type.
fn json_bytes(status: StatusCode, body: Vec<u8>) -> Response {
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        body,
    )
        .into_response()
}

fn encode_failure(err: &serde_json::Error) -> Response {
    (
        StatusCode::INTERNAL_SERVER_ERROR,
        format!("could not encode the answer: {err}\n"),
    )
        .into_response()
}

fn error_response(error: &ApiError) -> Response {
    let status = StatusCode::from_u16(error.status).unwrap_or(StatusCode::BAD_REQUEST);
    let mut response = json_response(status, &error.body());
    if status == StatusCode::SERVICE_UNAVAILABLE {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

/// Counts and returns `response` for `route`.
fn answered(
    state: &AppState,
    route: &'static str,
    started: Instant,
    response: Response,
) -> Response {
    state
        .metrics
        .observe(route, response.status().as_u16(), started.elapsed());
    response
}

/// Admits one route request: reads its JSON body within `max_body_bytes` and
/// `body_timeout_ms`, then takes a scoring permit without waiting (held by the caller
/// while it parses and scores). A slow body holds no permit, so slow clients cannot shut
/// out the fast ones.
async fn admit<'a>(
    state: &'a AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(tokio::sync::SemaphorePermit<'a>, axum::body::Bytes), ApiError> {
    let bytes = read_json_body(state, headers, body).await?;
    let Ok(permit) = state.permits.try_acquire() else {
        return Err(ApiError::overloaded(state.http.max_concurrent_requests));
    };
    Ok((permit, bytes))
}

/// Reads a JSON body within `max_body_bytes` and `body_timeout_ms`.
async fn read_json_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<axum::body::Bytes, ApiError> {
    let is_json = headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| {
            value
                .split(';')
                .next()
                .is_some_and(|mime| mime.trim().eq_ignore_ascii_case("application/json"))
        });
    if !is_json {
        return Err(ApiError::not_json());
    }
    let limit = state.http.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(ApiError::too_large(limit));
    }
    let timeout_ms = state.http.body_timeout_ms;
    let read = tokio::time::timeout(
        Duration::from_millis(timeout_ms),
        http_body_util::Limited::new(body, limit).collect(),
    );
    match read.await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        // A chunked body over the limit.
        Ok(Err(error)) if error.is::<http_body_util::LengthLimitError>() => {
            Err(ApiError::too_large(limit))
        }
        // The client closed or broke the connection mid-body.
        Ok(Err(_)) => Err(ApiError::body_aborted()),
        Err(_) => Err(ApiError::body_timeout(timeout_ms)),
    }
}

/// A scoring failure as an API error. An unknown model or adapter while some relay is out
/// of view (connection broken, or no catalog yet) is `503 relays_unavailable` with
/// `Retry-After`: the model may be served behind that relay, and a client that trusts a
/// `404` would drop a request a retry serves. With every relay in view, `404` is the truth.
fn scoring_error(state: &AppState, err: &ScoreError) -> ApiError {
    if matches!(
        err,
        ScoreError::UnknownModel { .. } | ScoreError::UnknownAdapter { .. }
    ) {
        let out_of_view: Vec<String> = state
            .consumer
            .relays()
            .into_iter()
            .filter(|relay| !relay.in_view())
            .map(|relay| relay.dc)
            .collect();
        if !out_of_view.is_empty() {
            return ApiError::relays_unavailable(&out_of_view);
        }
    }
    api::score_error(err)
}

// The handlers take the whole request (not the `HeaderMap` extractor, which copies every
// header) and read the two headers they need in place.
async fn route(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let response = route_one(&state, &parts.headers, body)
        .await
        .unwrap_or_else(|err| error_response(&err));
    answered(&state, "route", started, response)
}

async fn route_one(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let (_permit, bytes) = admit(state, headers, body).await?;
    let request: RouteRequest = api::parse(&bytes, &state.http)?;
    let (request, top_k) = request.validate(&state.http)?;
    KEPT_RANKING.with_borrow_mut(|ranking| {
        state
            .consumer
            .score_top_into(&request, top_k, ranking)
            .map_err(|err| scoring_error(state, &err))?;
        state.metrics.scored(1);
        let mut body = Vec::new();
        api::write_ranking(&mut body, ranking);
        Ok(json_bytes(StatusCode::OK, body))
    })
}

thread_local! {
    /// Each runtime thread's ranking, refilled by every single route request it answers:
    /// `score_top_into` reuses a kept ranking's candidates and legs instead of allocating
    /// them per request (at 256 candidates that is most of the scoring time the handler
    /// adds over the benchmark's back-to-back baseline). It holds at most the largest
    /// answer given (bounded by the pools followed) and is borrowed only between scoring
    /// and writing the answer, with no await in between.
    static KEPT_RANKING: RefCell<Ranking> = RefCell::new(Ranking::default());
}

async fn route_batch(State(state): State<Arc<AppState>>, request: Request) -> Response {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let response = route_many(&state, &parts.headers, body)
        .await
        .unwrap_or_else(|err| error_response(&err));
    answered(&state, "route_batch", started, response)
}

/// A batch answers every request in order: a ranking, or that request's error (one bad
/// request does not fail the others).
async fn route_many(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let (_permit, bytes) = admit(state, headers, body).await?;
    let batch: BatchRequest = api::parse(&bytes, &state.http)?;
    let requests = batch.validate(&state.http)?;
    // Every ranking is kept until the answer is written from it (no copy of its strings
    // into an intermediate JSON tree).
    let scored: Vec<Result<Ranking, serde_json::Value>> = requests
        .iter()
        .map(|(request, top_k)| {
            let mut ranking = Ranking::default();
            state
                .consumer
                .score_top_into(request, *top_k, &mut ranking)
                .map(|()| ranking)
                .map_err(|err| scoring_error(state, &err).body())
        })
        .collect();
    state.metrics.scored(requests.len() as u64);
    let mut body = Vec::new();
    Ok(match api::write_batch(&mut body, &scored) {
        Ok(()) => json_bytes(StatusCode::OK, body),
        Err(err) => encode_failure(&err),
    })
}

async fn pools(State(state): State<Arc<AppState>>) -> Response {
    let started = Instant::now();
    let view = PoolsView::new(
        &state.consumer.relays(),
        &state.consumer.pools(),
        &state.consumer.quarantined(),
    );
    answered(
        &state,
        "pools",
        started,
        json_response(StatusCode::OK, &view),
    )
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let started = Instant::now();
    let mut text = String::new();
    let encoded = state
        .metrics
        .encode_without_eof(&mut text)
        .and_then(|()| kvrelay_consumer::encode_prometheus(&state.consumer.metrics(), &mut text));
    let response = match encoded {
        Ok(()) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static(
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                ),
            )],
            text,
        )
            .into_response(),
        Err(_) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            "could not encode metrics\n",
        )
            .into_response(),
    };
    answered(&state, "metrics", started, response)
}

async fn healthz(State(state): State<Arc<AppState>>) -> Response {
    let started = Instant::now();
    answered(
        &state,
        "healthz",
        started,
        (StatusCode::OK, "ok\n").into_response(),
    )
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    let started = Instant::now();
    let pools = state.consumer.pools();
    let answer = readiness::assess(&state.consumer.relays(), pools.iter().map(PoolState::from));
    let status = if answer.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    answered(&state, "readyz", started, json_response(status, &answer))
}

async fn not_found(State(state): State<Arc<AppState>>) -> Response {
    let started = Instant::now();
    let error = ApiError {
        status: 404,
        code: "not_found",
        field: None,
        message: "no such route; see docs/consumer.md (router API)".to_owned(),
    };
    answered(&state, "other", started, error_response(&error))
}

async fn method_not_allowed(State(state): State<Arc<AppState>>) -> Response {
    let started = Instant::now();
    let error = ApiError {
        status: 405,
        code: "method_not_allowed",
        field: None,
        message: "method not allowed on this route".to_owned(),
    };
    answered(&state, "other", started, error_response(&error))
}

/// The router could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterError {
    /// The configuration is unusable.
    #[error(transparent)]
    Config(#[from] RouterConfigError),
    /// The listener's TLS material cannot be used.
    #[error("[tls]: {0}")]
    Tls(#[from] kvrelay_tls::TlsError),
    /// The listen address could not be bound.
    #[error("binding the router listener on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// TLS on the router's listener, as the shared HTTP loop runs it.
struct TlsHandshake(kvrelay_tls::ServerTls);

impl kvrelay_http::Handshake for TlsHandshake {
    type Stream = kvrelay_tls::ServerTlsStream;

    async fn handshake(&self, tcp: tokio::net::TcpStream) -> std::io::Result<Self::Stream> {
        self.0.accept(tcp).await
    }
}

/// A running router: the consumer following every relay and the HTTP listener.
#[derive(Debug)]
pub struct RouterService {
    addr: SocketAddr,
    consumer: Arc<Consumer>,
    cancel: CancellationToken,
    serving: JoinHandle<std::io::Result<()>>,
}

impl RouterService {
    /// Validates `config` (`env` resolves `token_env`), starts the consumer and serves the
    /// API on `config.listen`. Must run inside a tokio runtime.
    pub async fn start(
        config: &RouterConfig,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Self, RouterError> {
        let consumer_config = config.consumer_config(&env)?;
        let descriptor_demand = config.max_open_descriptors(&consumer_config);
        let token = config.api_token(&env)?;
        let tls = config
            .tls
            .as_ref()
            .map(kvrelay_tls::ServerTls::load)
            .transpose()?;
        let listener =
            TcpListener::bind(config.listen)
                .await
                .map_err(|source| RouterError::Bind {
                    addr: config.listen,
                    source,
                })?;
        let addr = listener.local_addr().map_err(|source| RouterError::Bind {
            addr: config.listen,
            source,
        })?;
        if !addr.ip().is_loopback() && token.is_none() {
            warn!(%addr, "the router API has no authentication ([auth] token_file/token_env) and listens beyond loopback; keep it behind your network policy");
        }
        if !addr.ip().is_loopback() && token.is_some() && tls.is_none() {
            warn!(%addr, "the router API token travels in plaintext beyond loopback: set [tls]");
        }
        let consumer = Arc::new(
            Consumer::start(consumer_config)
                .map_err(|err| RouterError::Config(RouterConfigError::Consumer(err)))?,
        );
        let metrics = Arc::new(RouterMetrics::new());
        // Read, never raised here: the binary raises it before the runtime starts.
        let open_file_limit = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
        metrics.descriptor_budget(open_file_limit, descriptor_demand);
        let state = Arc::new(
            AppState::new(consumer.clone(), metrics.clone(), config.http).with_token(token),
        );
        let cancel = CancellationToken::new();
        let serving = match tls {
            None => tokio::spawn(kvrelay_http::serve(
                listener,
                app(state),
                config.http.bounds(),
                "router",
                metrics,
                cancel.clone(),
            )),
            Some(tls) => tokio::spawn(kvrelay_http::serve_with(
                listener,
                app(state),
                config.http.bounds(),
                "router",
                metrics,
                cancel.clone(),
                Arc::new(TlsHandshake(tls)),
            )),
        };
        info!(%addr, relays = config.relays.len(), "router serving");
        Ok(Self {
            addr,
            consumer,
            cancel,
            serving,
        })
    }

    /// The bound HTTP address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The consumer behind the API.
    pub fn consumer(&self) -> &Consumer {
        &self.consumer
    }

    /// Graceful stop: no new connections, in-flight requests finish (each connection is
    /// bounded by `connection_timeout_ms`), then the consumer stops.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        match self.serving.await {
            Ok(Ok(())) => {}
            Ok(Err(err)) => warn!(error = %err, "router listener ended with an error"),
            Err(err) => warn!(error = %err, "router listener task failed"),
        }
        // Every connection (and its clone of the state) is gone once serving returned.
        match Arc::try_unwrap(self.consumer) {
            Ok(consumer) => consumer.shutdown().await,
            Err(_) => warn!("router consumer still referenced at shutdown; dropping it"),
        }
    }
}

#[cfg(test)]
mod tests;
