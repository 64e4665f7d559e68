//! The router service against a real relay over loopback: `/readyz` turns ready once
//! every pool's replica is current, `POST /v1/route` answers exactly what the in-process
//! consumer scores for the same request, batches answer in order, `/v1/pools` and
//! `/metrics` describe the replicas, and a relay that goes away turns `/readyz` to 503
//! naming it. Against a relay with TLS and a token (and with mutual TLS) the right
//! credentials are served while a wrong CA, a missing client certificate and a wrong token
//! are refused, counted and named by `/readyz`; after a relay restart and a router
//! restart the router converges again.

use std::net::SocketAddr;
use std::time::Duration;

use kvrelay_consumer::{ReplicaState, ScoreRequest};
use kvrelay_router::api::RouteResponse;
use kvrelay_router::{RelaySection, RouterConfig, RouterService};
use kvrelay_server::{AuthConfig, ListenerTls, Relay, WORKLOAD_TOKEN_SEED};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bound on every wait of these tests.
const DEADLINE: Duration = Duration::from_secs(30);
/// Pools of the example deployment.
const EXAMPLE_POOLS: usize = 4;

/// One HTTP/1.1 exchange (`Connection: close`); returns the status and the JSON body
/// (a JSON string when the body is not JSON).
async fn http(addr: SocketAddr, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let payload = body.map(Value::to_string).unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            payload.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(payload.as_bytes()).await.unwrap();
        let mut raw = Vec::new();
        stream.read_to_end(&mut raw).await.unwrap();
        raw
    };
    let raw = tokio::time::timeout(DEADLINE, exchange)
        .await
        .expect("the router answers");
    let text = String::from_utf8(raw).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").expect("a complete response");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("a status line");
    let body = serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.to_owned()));
    (status, body)
}

use crate::support;

/// A router on a free loopback port following the relay at `relay`.
async fn start_router(relay: SocketAddr) -> RouterService {
    start_router_with(RelaySection::new(&relay.to_string(), "dc-test", 5.0)).await
}

/// A router on a free loopback port following `relay`, reconnecting quickly.
async fn start_router_with(relay: RelaySection) -> RouterService {
    let mut config = RouterConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..RouterConfig::default()
    };
    config.relays.push(relay);
    config.consumer.connect_timeout_ms = 1_000;
    config.consumer.backoff_initial_ms = 20;
    config.consumer.backoff_max_ms = 200;
    RouterService::start(&config, |_| None).await.unwrap()
}

/// Waits until the router's `/readyz` answers `status`; returns its body.
async fn wait_ready(router: &RouterService, status: u16) -> Value {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let (got, body) = http(router.local_addr(), "GET", "/readyz", None).await;
        if got == status {
            return body;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "/readyz stayed {got}, wanted {status}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The value of the first sample of `family` in the router's `/metrics`.
async fn metric(router: &RouterService, family: &str) -> f64 {
    let (_, body) = http(router.local_addr(), "GET", "/metrics", None).await;
    body.as_str()
        .unwrap()
        .lines()
        .find(|line| line.starts_with(family))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("{family} in {body}"))
}

/// The relay's token in these tests.
const TOKEN: &str = "router-test-token";

/// The example deployment with TLS (client certificates required when `mutual`) and the
/// bearer token on its WAN listener.
async fn secured_relay(material: &support::Material, mutual: bool) -> Relay {
    let mut config = support::example_config("dc-test");
    config.wan.tls = Some(ListenerTls {
        cert: material.server_cert.clone(),
        key: material.server_key.clone(),
        client_ca: mutual.then(|| material.ca_pem.clone()),
    });
    config.wan.auth = Some(AuthConfig {
        token: Some(TOKEN.to_owned()),
        token_file: None,
    });
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(EXAMPLE_POOLS))
        .await
        .expect("every example pool is published");
    relay
}

/// A secured relay section: `ca` trusted, `token` from a file in `dir`.
fn secured_section(
    relay: &Relay,
    dir: &std::path::Path,
    ca: &std::path::Path,
    token: &str,
) -> RelaySection {
    let token_file = dir.join(format!("token-{token}"));
    std::fs::write(&token_file, token).unwrap();
    let mut section = RelaySection::new(&relay.wan_addr().to_string(), "dc-test", 0.0);
    section.tls_ca = Some(ca.to_owned());
    section.token_file = Some(token_file);
    section
}

/// Requests of the built-in trace for every served base model.
fn trace_requests(relay: &Relay, n: usize) -> Vec<ScoreRequest> {
    let models = kvrelay_consumer::served_base_models(&relay.catalog());
    let records = kvrelay_ingest::parse_request_trace(kvrelay_ingest::BUILTIN_REQUEST_TRACE)
        .expect("the built-in trace parses");
    let mut requests = Vec::new();
    for record in records.iter().take(n) {
        for served in &models {
            requests.push(ScoreRequest {
                tokens: kvrelay_ingest::request_tokens(
                    &record.hash_ids,
                    served.kv_block_size,
                    WORKLOAD_TOKEN_SEED,
                ),
                model: served.model.clone(),
                lora: None,
                cache_namespace: None,
            });
        }
    }
    requests
}

fn request_json(request: &ScoreRequest) -> Value {
    json!({ "tokens": request.tokens, "model": request.model })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_answers_what_the_consumer_scores_and_tells_readiness() {
    let relay = Relay::start(support::example_config("dc-test"))
        .await
        .unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(EXAMPLE_POOLS))
        .await
        .expect("every example pool is published");
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .expect("the workload finishes");
    relay.flush().await;
    let router = start_router(relay.wan_addr()).await;
    let addr = router.local_addr();

    // Ready once every pool's replica is current at the producer's final sequence.
    let mut sequences = Vec::new();
    for pool in &relay.catalog().pools {
        sequences.push(relay.producer_table(&pool.producer).await.unwrap().sequence);
    }
    let converged = router
        .consumer()
        .wait_until(DEADLINE, |state, now| {
            let pools = state.pools(now);
            pools.len() == EXAMPLE_POOLS
                && pools.iter().all(|pool| {
                    pool.replica == ReplicaState::Current
                        && pool.sequence.is_some_and(|seq| sequences.contains(&seq))
                })
        })
        .await;
    assert!(
        converged,
        "replicas converge: {:?}",
        router.consumer().pools()
    );
    let (status, ready) = http(addr, "GET", "/readyz", None).await;
    assert_eq!(status, 200, "{ready}");
    assert_eq!(ready["ready"], true);
    assert_eq!(ready["pools_current"], EXAMPLE_POOLS);

    // Every answer equals the in-process ranking of the same request.
    let requests = trace_requests(&relay, 20);
    assert!(!requests.is_empty());
    let mut hits = 0;
    for request in &requests {
        let expected = router.consumer().score(request).unwrap();
        let (status, answer) = http(addr, "POST", "/v1/route", Some(&request_json(request))).await;
        assert_eq!(status, 200, "{answer}");
        // The whole answer, field for field, is the ranking's schema view.
        assert_eq!(
            answer,
            serde_json::to_value(RouteResponse::from(&expected)).unwrap()
        );
        assert_eq!(answer["model"], expected.model.as_str());
        let candidates = answer["candidates"].as_array().unwrap();
        assert_eq!(candidates.len(), expected.candidates.len());
        for (got, want) in candidates.iter().zip(&expected.candidates) {
            assert_eq!(got["dc"], &*want.dc);
            assert!((got["score"].as_f64().unwrap() - want.score).abs() < 1e-12);
            for (leg, want_leg) in got["legs"].as_array().unwrap().iter().zip(&want.legs) {
                assert_eq!(leg["pool"], &*want_leg.pool);
                assert_eq!(leg["replica"], want_leg.replica.as_str());
                assert_eq!(
                    leg["prefix_tokens"].as_u64(),
                    want_leg.prefix_tokens.map(u64::from)
                );
                if want_leg.prefix_tokens.is_some_and(|tokens| tokens > 0) {
                    hits += 1;
                }
            }
        }
    }
    assert!(hits > 0, "the router finds replayed prefixes");

    // top_k keeps the best; a batch answers in order, errors in place.
    let mut top = request_json(&requests[0]);
    top["top_k"] = json!(1);
    let (_, answer) = http(addr, "POST", "/v1/route", Some(&top)).await;
    assert_eq!(answer["candidates"].as_array().unwrap().len(), 1);
    // The runtime threads' kept rankings grow back after a short answer.
    let full = router.consumer().score(&requests[0]).unwrap();
    for _ in 0..4 {
        let (_, answer) = http(addr, "POST", "/v1/route", Some(&request_json(&requests[0]))).await;
        assert_eq!(
            answer,
            serde_json::to_value(RouteResponse::from(&full)).unwrap()
        );
    }
    let batch = json!({ "requests": [request_json(&requests[0]), {"tokens": [1], "model": "no-such-model"}] });
    let (status, answers) = http(addr, "POST", "/v1/route/batch", Some(&batch)).await;
    assert_eq!(status, 200);
    assert_eq!(answers["answers"][0]["model"], requests[0].model.as_str());
    assert_eq!(answers["answers"][1]["error"]["code"], "unknown_model");

    // Pools and metrics describe the replicas.
    let (_, pools) = http(addr, "GET", "/v1/pools", None).await;
    assert_eq!(pools["pools"].as_array().unwrap().len(), EXAMPLE_POOLS);
    assert!(pools["relays"][0]["catalog_revision"].is_u64(), "{pools}");
    assert_eq!(pools["pools"][0]["replica"], "current");
    let (_, metrics) = http(addr, "GET", "/metrics", None).await;
    let text = metrics.as_str().unwrap();
    assert!(
        text.contains(r#"kvrelay_router_http_requests_total{route="route",status="200"}"#),
        "{text}"
    );
    assert!(text.contains("kvrelay_consumer_"), "{text}");

    // The relay goes away: readiness names it.
    relay.shutdown().await.unwrap();
    let unready = router
        .consumer()
        .wait_until(DEADLINE, |state, _| {
            state.relay_statuses().iter().any(|relay| relay.suspended)
        })
        .await;
    assert!(unready, "the consumer notices the relay is gone");
    let (status, ready) = http(addr, "GET", "/readyz", None).await;
    assert_eq!(status, 503, "{ready}");
    assert!(
        ready["reasons"][0].as_str().unwrap().contains("dc-test"),
        "{ready}"
    );

    tokio::time::timeout(DEADLINE, router.shutdown())
        .await
        .expect("the router stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_reaches_a_tls_token_relay_and_refuses_wrong_credentials_visibly() {
    let material = support::material(&["127.0.0.1"]);
    let dir = material.dir.path();
    let relay = secured_relay(&material, false).await;

    let good = start_router_with(secured_section(&relay, dir, &material.ca_pem, TOKEN)).await;
    let ready = wait_ready(&good, 200).await;
    assert_eq!(ready["pools_current"], EXAMPLE_POOLS, "{ready}");

    let wrong_ca =
        start_router_with(secured_section(&relay, dir, &material.stranger_pem, TOKEN)).await;
    let unready = wait_ready(&wrong_ca, 503).await;
    assert!(
        unready["reasons"][0].as_str().unwrap().contains("dc-test"),
        "{unready}"
    );
    let failed = wrong_ca
        .consumer()
        .wait_for_metrics(DEADLINE, |m| m.relay_tls_failures > 0)
        .await;
    assert!(failed, "a wrong CA is counted as a TLS failure");
    assert!(metric(&wrong_ca, "kvrelay_consumer_relay_tls_failures").await >= 1.0);

    let wrong_token = start_router_with(secured_section(
        &relay,
        dir,
        &material.ca_pem,
        "not-the-token",
    ))
    .await;
    let refused = wrong_token
        .consumer()
        .wait_for_metrics(DEADLINE, |m| m.relay_refusals > 0)
        .await;
    assert!(refused, "a wrong token is counted as a refusal");
    let unready = wait_ready(&wrong_token, 503).await;
    let (_, pools) = http(wrong_token.local_addr(), "GET", "/v1/pools", None).await;
    assert!(
        pools["relays"][0]["last_error"].is_string(),
        "the refusal is explained: {pools} {unready}"
    );

    for router in [good, wrong_ca, wrong_token] {
        router.shutdown().await;
    }
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_with_a_client_certificate_reaches_a_mutual_tls_relay() {
    let material = support::material(&["127.0.0.1"]);
    let dir = material.dir.path();
    let relay = secured_relay(&material, true).await;

    let anonymous = start_router_with(secured_section(&relay, dir, &material.ca_pem, TOKEN)).await;
    let failed = anonymous
        .consumer()
        .wait_for_metrics(DEADLINE, |m| {
            m.relay_tls_failures > 0 || m.relay_refusals > 0
        })
        .await;
    assert!(
        failed,
        "a missing client certificate is refused and counted"
    );
    wait_ready(&anonymous, 503).await;

    let (cert, key) = material
        .ca
        .issue_to(
            dir,
            "router",
            &["router.kvrelay.test"],
            kvrelay_tls::test_ca::Purpose::Client,
        )
        .unwrap();
    let mut section = secured_section(&relay, dir, &material.ca_pem, TOKEN);
    section.tls_cert = Some(cert);
    section.tls_key = Some(key);
    let mutual = start_router_with(section).await;
    let ready = wait_ready(&mutual, 200).await;
    assert_eq!(ready["pools_current"], EXAMPLE_POOLS, "{ready}");

    anonymous.shutdown().await;
    mutual.shutdown().await;
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_converges_after_a_relay_restart_and_a_router_restart() {
    let config = support::example_config("dc-test");
    let first = Relay::start(config.clone()).await.unwrap();
    let addr = first.wan_addr();
    let router = start_router(addr).await;
    wait_ready(&router, 200).await;
    let old = first.incarnation();

    first.shutdown().await.unwrap();
    let down = wait_ready(&router, 503).await;
    assert!(
        down["reasons"][0].as_str().unwrap().contains("dc-test"),
        "{down}"
    );

    // The relay comes back on the same address as a new incarnation.
    let mut again = config;
    again.wan.listen = addr;
    let second = Relay::start(again).await.unwrap();
    assert_ne!(second.incarnation(), old);
    tokio::time::timeout(DEADLINE, second.wait_for_pools(EXAMPLE_POOLS))
        .await
        .expect("the restarted relay publishes its pools");
    let ready = wait_ready(&router, 200).await;
    assert_eq!(ready["pools_current"], EXAMPLE_POOLS, "{ready}");

    // A restarted router converges from nothing.
    router.shutdown().await;
    let restarted = start_router(addr).await;
    let ready = wait_ready(&restarted, 200).await;
    assert_eq!(ready["pools_current"], EXAMPLE_POOLS, "{ready}");
    restarted.shutdown().await;
    second.shutdown().await.unwrap();
}
