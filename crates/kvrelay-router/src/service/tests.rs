//! The HTTP layer in memory (no socket): status codes, JSON errors, limits, readiness and
//! metrics, over a consumer whose only relay is unreachable (so it has no catalog).
//! The pairing with a real relay is tested in `crates/kvrelay/tests/router.rs`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail loudly"
)]

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use futures::StreamExt as _;
use kvrelay_consumer::{BearerToken, ConsumerConfig, RelayEndpoint};
use tower::ServiceExt;

use super::*;

/// A state whose consumer follows a relay that refuses connections (port 1 on loopback).
fn state(http: HttpSection) -> Arc<AppState> {
    let config = ConsumerConfig::new(vec![RelayEndpoint::new("127.0.0.1:1", "dc-gone")]);
    let consumer = Arc::new(Consumer::start(config).unwrap());
    Arc::new(AppState::new(
        consumer,
        Arc::new(RouterMetrics::new()),
        http,
    ))
}

async fn call(
    state: &Arc<AppState>,
    request: Request<Body>,
) -> (StatusCode, HeaderMap, serde_json::Value) {
    let response = app(state.clone()).oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    let body = serde_json::from_slice(&bytes).unwrap_or_else(|_| {
        serde_json::Value::String(String::from_utf8_lossy(&bytes).into_owned())
    });
    (status, headers, body)
}

fn post_json(path: &str, body: &str) -> Request<Body> {
    Request::builder()
        .method(Method::POST)
        .uri(path)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap()
}

fn get(path: &str) -> Request<Body> {
    Request::builder().uri(path).body(Body::empty()).unwrap()
}

#[tokio::test]
async fn health_is_ok_and_readiness_names_the_relay_without_catalog() {
    let state = state(HttpSection::default());
    let (status, _, body) = call(&state, get("/healthz")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "ok\n");
    let (status, _, body) = call(&state, get("/readyz")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["ready"], false);
    let reason = body["reasons"][0].as_str().unwrap();
    assert!(
        reason.contains("dc-gone") && reason.contains("no catalog"),
        "{body}"
    );
}

/// While a relay is out of view, a model nobody in view serves may be served behind it:
/// the answer is a retryable 503 naming the DC, never a 404 a client would trust. (With
/// every relay in view, an unknown model is 404: `crates/kvrelay/tests/router.rs`.)
#[tokio::test]
async fn an_unknown_model_while_a_relay_is_out_of_view_is_503_with_retry_after() {
    let state = state(HttpSection::default());
    let (status, headers, body) = call(
        &state,
        post_json("/v1/route", r#"{"tokens":[1,2],"model":"llama"}"#),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(headers.get(header::RETRY_AFTER).unwrap(), "1");
    assert_eq!(body["error"]["code"], "relays_unavailable");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("dc-gone"),
        "{body}"
    );
}

/// A body that trickles in holds no scoring permit: with one permit and a slow body in
/// flight, a whole request is still admitted; the slow one ends with 408 at its deadline.
#[tokio::test]
async fn a_slow_body_holds_no_permit_and_times_out_with_408() {
    let state = state(HttpSection {
        max_concurrent_requests: 1,
        body_timeout_ms: 300,
        ..HttpSection::default()
    });
    let first: Vec<Result<String, std::io::Error>> = vec![Ok(r#"{"tokens":[1"#.to_owned())];
    let never_ends = futures::stream::iter(first).chain(futures::stream::pending());
    let slow = Request::builder()
        .method(Method::POST)
        .uri("/v1/route")
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, "100000")
        .body(Body::from_stream(never_ends))
        .unwrap();
    let slow_state = state.clone();
    let slow_call = tokio::spawn(async move { call(&slow_state, slow).await });
    // While the slow body is pending, whole requests keep getting answers (not 503
    // `overloaded`: the permit is free).
    for _ in 0..3 {
        let (_, _, body) = call(
            &state,
            post_json("/v1/route", r#"{"tokens":[1],"model":"m"}"#),
        )
        .await;
        assert_ne!(body["error"]["code"], "overloaded", "{body}");
    }
    let (status, _, body) = slow_call.await.unwrap();
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "{body}");
    assert_eq!(body["error"]["code"], "body_timeout");
}

/// A body whose stream breaks mid-way is counted as aborted (400), not as too large.
#[tokio::test]
async fn a_body_cut_short_is_400_body_aborted() {
    let state = state(HttpSection::default());
    let chunks: Vec<Result<String, std::io::Error>> = vec![
        Ok(r#"{"tokens":[1"#.to_owned()),
        Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionReset,
            "peer reset",
        )),
    ];
    let cut = Request::builder()
        .method(Method::POST)
        .uri("/v1/route")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(futures::stream::iter(chunks)))
        .unwrap();
    let (status, _, body) = call(&state, cut).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["code"], "body_aborted");
}

#[tokio::test]
async fn malformed_bodies_are_400_with_the_field_and_non_json_is_415() {
    let state = state(HttpSection::default());
    let (status, _, body) = call(
        &state,
        post_json("/v1/route", r#"{"tokens":[1,"x"],"model":"m"}"#),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["field"], "tokens[1]");
    let (status, _, body) = call(&state, post_json("/v1/route", "{not json")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let plain = Request::builder()
        .method(Method::POST)
        .uri("/v1/route")
        .body(Body::from(r#"{"tokens":[1],"model":"m"}"#))
        .unwrap();
    let (status, _, body) = call(&state, plain).await;
    assert_eq!(status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert_eq!(body["error"]["code"], "unsupported_media_type");
}

#[tokio::test]
async fn bodies_over_the_limit_are_413_declared_or_streamed() {
    let state = state(HttpSection {
        max_body_bytes: 64,
        ..HttpSection::default()
    });
    let big = format!(r#"{{"tokens":[{}],"model":"m"}}"#, vec!["1"; 100].join(","));
    let (status, _, body) = call(&state, post_json("/v1/route", &big)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(body["error"]["code"], "body_too_large");
    // Without Content-Length (a streamed body), the read itself stops at the limit.
    let chunks: Vec<Result<String, std::io::Error>> = vec![Ok(big.clone())];
    let streamed = Request::builder()
        .method(Method::POST)
        .uri("/v1/route")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(futures::stream::iter(chunks)))
        .unwrap();
    let (status, _, _) = call(&state, streamed).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn requests_beyond_the_concurrency_limit_are_shed_with_retry_after() {
    let state = state(HttpSection {
        max_concurrent_requests: 1,
        ..HttpSection::default()
    });
    let held = state.permits.try_acquire().unwrap();
    let (status, headers, body) = call(
        &state,
        post_json("/v1/route", r#"{"tokens":[1],"model":"m"}"#),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers.get(header::RETRY_AFTER).unwrap(), "1");
    assert_eq!(body["error"]["code"], "overloaded");
    drop(held);
    let (status, _, body) = call(
        &state,
        post_json("/v1/route", r#"{"tokens":[1],"model":"m"}"#),
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        body["error"]["code"], "relays_unavailable",
        "a free permit lets the request through to scoring"
    );
}

#[tokio::test]
async fn a_batch_answers_each_request_in_order() {
    let state = state(HttpSection::default());
    let (status, _, body) = call(
        &state,
        post_json(
            "/v1/route/batch",
            r#"{"requests":[{"tokens":[1],"model":"a"},{"tokens":[2],"model":"b"}]}"#,
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let answers = body["answers"].as_array().unwrap();
    assert_eq!(answers.len(), 2);
    assert_eq!(answers[1]["error"]["code"], "relays_unavailable", "{body}");
    let (status, _, body) = call(
        &state,
        post_json(
            "/v1/route/batch",
            r#"{"requests":[{"tokens":[1],"model":"a","top_k":0}]}"#,
        ),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["field"], "requests[0].top_k");
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_json() {
    let state = state(HttpSection::default());
    let (status, _, body) = call(&state, get("/v2/nothing")).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(body["error"]["code"], "not_found");
    let (status, _, body) = call(&state, get("/v1/route")).await;
    assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(body["error"]["code"], "method_not_allowed");
}

#[tokio::test]
async fn pools_lists_every_relay_and_metrics_hold_both_registries() {
    let state = state(HttpSection::default());
    let (status, _, body) = call(&state, get("/v1/pools")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body["relays"][0]["dc"], "dc-gone");
    assert!(body["relays"][0]["catalog_revision"].is_null());
    assert_eq!(body["pools"].as_array().unwrap().len(), 0);

    let (status, headers, body) = call(&state, get("/metrics")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        headers[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text")
    );
    let text = body.as_str().unwrap();
    assert!(
        text.contains(r#"kvrelay_router_http_requests_total{route="pools",status="200"} 1"#),
        "{text}"
    );
    assert!(
        text.contains("kvrelay_router_http_request_duration_seconds_bucket"),
        "{text}"
    );
    assert!(text.contains("kvrelay_consumer_"), "{text}");
    assert_eq!(text.matches("# EOF").count(), 1, "{text}");
    assert!(text.trim_end().ends_with("# EOF"));
}

/// With `[auth]` set, every path but the probes needs the token: none or a wrong one is
/// 401 with `WWW-Authenticate: Bearer` (counted) before the body is read; the right one
/// reaches the handler.
#[tokio::test]
async fn the_api_token_guards_every_path_but_the_probes() {
    let config = ConsumerConfig::new(vec![RelayEndpoint::new("127.0.0.1:1", "dc-gone")]);
    let consumer = Arc::new(Consumer::start(config).unwrap());
    let metrics = Arc::new(RouterMetrics::new());
    let token = BearerToken::new("s3cret").unwrap();
    let state = Arc::new(
        AppState::new(consumer, metrics.clone(), HttpSection::default()).with_token(Some(token)),
    );
    let route = |authorization: Option<&str>| {
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri("/v1/route")
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(value) = authorization {
            builder = builder.header(header::AUTHORIZATION, value);
        }
        builder
            .body(Body::from(r#"{"tokens":[1],"model":"m"}"#))
            .unwrap()
    };
    for refused in [
        None,
        Some("Bearer wrong"),
        Some("Bearer s3cret "),
        Some("s3cret"),
    ] {
        let (status, headers, body) = call(&state, route(refused)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{refused:?}");
        assert_eq!(headers.get(header::WWW_AUTHENTICATE).unwrap(), "Bearer");
        assert_eq!(body["error"]["code"], "unauthorized");
    }
    let (status, _, body) = call(&state, route(Some("Bearer s3cret"))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(body["error"]["code"], "relays_unavailable");
    for path in ["/v1/pools", "/metrics"] {
        let (status, _, _) = call(&state, get(path)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{path}");
    }
    let (status, _, _) = call(&state, get("/healthz")).await;
    assert_eq!(status, StatusCode::OK);
    let (status, _, _) = call(&state, get("/readyz")).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "readiness answers without a token"
    );
    let mut exposition = String::new();
    metrics.encode_without_eof(&mut exposition).unwrap();
    assert!(
        exposition.contains("kvrelay_router_http_unauthorized_total 6"),
        "{exposition}"
    );
}
