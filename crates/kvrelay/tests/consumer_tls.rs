//! The consumer against a real relay secured with TLS and a bearer token, over loopback,
//! with certificates generated per test by the TLS crate's test CA: the right CA and token reach current
//! replicas; a wrong CA, a wrong server name, a missing or foreign client certificate and
//! a missing or wrong token are refused, counted and explained, never a panic; and
//! `kvrelay route` does the same from the command line.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use kvrelay_consumer::{
    BearerToken, Consumer, ConsumerConfig, ConsumerMetrics, RelayTls, ReplicaState, ScoreRequest,
};
use kvrelay_server::{AuthConfig, ListenerTls, Relay};
use kvrelay_tls::test_ca::Purpose;
use support::{Authority, Material, example_config, material};

use crate::support;

/// Bound on every wait of these tests.
const DEADLINE: Duration = Duration::from_secs(30);
/// Pools of the example deployment.
const EXAMPLE_POOLS: usize = 4;
/// The relay's token in these tests.
const TOKEN: &str = "s3cret-relay-token";

/// The example deployment with TLS (client certificates required when `mutual`) and
/// the bearer token on its WAN listener, replayed once as fast as possible.
async fn secured_relay(material: &Material, mutual: bool) -> Relay {
    start_relay(Some(ListenerTls {
        cert: material.server_cert.clone(),
        key: material.server_key.clone(),
        client_ca: mutual.then(|| material.ca_pem.clone()),
    }))
    .await
}

/// The example deployment with the token and `tls` (none: plaintext) on its WAN listener.
async fn start_relay(tls: Option<ListenerTls>) -> Relay {
    let mut config = example_config("dc-tls");
    config.wan.tls = tls;
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

/// A consumer of the relay at `addr` with `tls` and `token`, reconnecting quickly.
fn start_consumer(addr: SocketAddr, tls: RelayTls, token: Option<&str>) -> Consumer {
    consumer_of(
        kvrelay_consumer::RelayEndpoint::new(&addr.to_string(), "dc-tls"),
        tls,
        token,
    )
}

/// A consumer of `relay` with `tls` and `token`, reconnecting quickly.
fn consumer_of(
    relay: kvrelay_consumer::RelayEndpoint,
    tls: RelayTls,
    token: Option<&str>,
) -> Consumer {
    let mut relay = relay.with_tls(tls);
    relay.token = token.map(|token| BearerToken::new(token).unwrap());
    support::quick_consumer(vec![relay])
}

/// Waits until every example pool has a current replica.
async fn assert_all_current(consumer: &Consumer) {
    let current = consumer
        .wait_until(DEADLINE, |state, now| {
            let pools = state.pools(now);
            pools.len() == EXAMPLE_POOLS
                && pools
                    .iter()
                    .all(|pool| pool.replica == ReplicaState::Current)
        })
        .await;
    assert!(
        current,
        "replicas not current: {:?}; errors {:?}",
        consumer.pools(),
        consumer.relay_errors()
    );
}

/// Waits until `counter` has counted two failed epochs (so the failure repeats, with
/// backoff, rather than happening once), then checks nothing was admitted and the error
/// the consumer reports contains `expected`.
async fn assert_refused(consumer: Consumer, counter: fn(&ConsumerMetrics) -> u64, expected: &str) {
    let counted = consumer
        .wait_for_metrics(DEADLINE, |metrics| counter(metrics) >= 2)
        .await;
    let metrics = consumer.metrics();
    assert!(
        counted,
        "failure not counted: {metrics:?}; errors {:?}",
        consumer.relay_errors()
    );
    assert_eq!(metrics.relay_connects, 0, "{metrics:?}");
    assert!(metrics.relay_epoch_failures >= 2, "{metrics:?}");
    assert!(consumer.pools().is_empty());
    let errors = consumer.relay_errors();
    let error = errors[0].1.clone().unwrap_or_default();
    assert!(
        error.contains(expected),
        "error {error:?} should contain {expected:?}"
    );
    consumer.shutdown().await;
}

fn tls_failures(metrics: &ConsumerMetrics) -> u64 {
    metrics.relay_tls_failures
}

fn refusals(metrics: &ConsumerMetrics) -> u64 {
    metrics.relay_refusals
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn right_ca_and_token_reach_current_replicas() {
    // The certificate names the loopback IP: the default server name is the address's host.
    let material = material(&["127.0.0.1"]);
    let relay = secured_relay(&material, false).await;
    let consumer = start_consumer(
        relay.wan_addr(),
        RelayTls::new(&material.ca_pem),
        Some(TOKEN),
    );
    assert_all_current(&consumer).await;
    let catalog = relay.catalog();
    let model = kvrelay_consumer::served_base_models(&catalog)
        .first()
        .expect("the example deployment serves a model")
        .model
        .clone();
    let ranking = consumer
        .score(&ScoreRequest {
            tokens: (0..256).collect(),
            model,
            ..ScoreRequest::default()
        })
        .unwrap();
    assert!(!ranking.candidates.is_empty());
    let metrics = consumer.metrics();
    assert!(metrics.relay_connects >= 1);
    assert_eq!(metrics.relay_tls_failures, 0);
    assert_eq!(metrics.relay_refusals, 0);
    consumer.shutdown().await;
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_ca_fails_the_handshake_and_is_counted() {
    let material = material(&["127.0.0.1"]);
    let relay = secured_relay(&material, false).await;
    let consumer = start_consumer(
        relay.wan_addr(),
        RelayTls::new(&material.stranger_pem),
        Some(TOKEN),
    );
    assert_refused(consumer, tls_failures, "TLS handshake failed").await;
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_name_is_checked_and_can_be_overridden() {
    let material = material(&["relay.kvrelay.test"]);
    let relay = secured_relay(&material, false).await;
    // By default the name checked is 127.0.0.1, which the certificate does not carry.
    let mismatched = start_consumer(
        relay.wan_addr(),
        RelayTls::new(&material.ca_pem),
        Some(TOKEN),
    );
    assert_refused(mismatched, tls_failures, "TLS handshake failed").await;
    let overridden = start_consumer(
        relay.wan_addr(),
        RelayTls {
            server_name: Some("relay.kvrelay.test".to_owned()),
            ..RelayTls::new(&material.ca_pem)
        },
        Some(TOKEN),
    );
    assert_all_current(&overridden).await;
    overridden.shutdown().await;
    relay.shutdown().await.unwrap();
}

/// The example deployment with TLS and the token on its Dynamo-contract door (`[dynamo]`).
async fn secured_door(material: &Material) -> Relay {
    let mut config = example_config("dc-tls");
    config.dynamo = Some(kvrelay_server::DynamoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tls: Some(ListenerTls {
            cert: material.server_cert.clone(),
            key: material.server_key.clone(),
            client_ca: None,
        }),
        auth: Some(AuthConfig {
            token: Some(TOKEN.to_owned()),
            token_file: None,
        }),
        plaintext: false,
    });
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(EXAMPLE_POOLS))
        .await
        .expect("every example pool is published");
    relay
}

/// A consumer of the relay's Dynamo-contract door with `tls` and `token`.
fn start_grpc_consumer(relay: &Relay, tls: RelayTls, token: Option<&str>) -> Consumer {
    let addr = relay.dynamo_addr().expect("the door is on");
    let endpoint = kvrelay_consumer::RelayEndpoint::new(&addr.to_string(), "dc-tls")
        .with_protocol(kvrelay_consumer::RelayProtocol::DynamoGrpc);
    consumer_of(endpoint, tls, token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_dynamo_contract_tls_and_the_token_guard_the_door_too() {
    let material = material(&["127.0.0.1"]);
    let relay = secured_door(&material).await;
    let trusted = start_grpc_consumer(&relay, RelayTls::new(&material.ca_pem), Some(TOKEN));
    assert_all_current(&trusted).await;
    trusted.shutdown().await;
    for token in [None, Some("wrong-token")] {
        let refused = start_grpc_consumer(&relay, RelayTls::new(&material.ca_pem), token);
        assert_refused(refused, refusals, "missing or wrong bearer token").await;
    }
    let stranger = start_grpc_consumer(&relay, RelayTls::new(&material.stranger_pem), Some(TOKEN));
    assert_refused(stranger, tls_failures, "TLS handshake failed").await;
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_or_wrong_token_is_refused_and_counted() {
    let material = material(&["127.0.0.1"]);
    let relay = secured_relay(&material, false).await;
    for token in [None, Some("wrong-token")] {
        let consumer = start_consumer(relay.wan_addr(), RelayTls::new(&material.ca_pem), token);
        assert_refused(consumer, refusals, "missing or wrong bearer token").await;
    }
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_admits_a_trusted_client_certificate_only() {
    let material = material(&["127.0.0.1"]);
    let relay = secured_relay(&material, true).await;
    let addr = relay.wan_addr();
    let dir = material.dir.path();

    let without = start_consumer(addr, RelayTls::new(&material.ca_pem), Some(TOKEN));
    assert_refused(without, tls_failures, "TLS handshake failed").await;

    let stranger = Authority::new("client stranger ca").unwrap();
    let (foreign_cert, foreign_key) = stranger
        .issue_to(dir, "foreign", &["client"], Purpose::Client)
        .unwrap();
    let foreign = start_consumer(
        addr,
        RelayTls {
            cert: Some(foreign_cert),
            key: Some(foreign_key),
            ..RelayTls::new(&material.ca_pem)
        },
        Some(TOKEN),
    );
    assert_refused(foreign, tls_failures, "TLS handshake failed").await;

    let (cert, key) = material
        .ca
        .issue_to(dir, "client", &["client"], Purpose::Client)
        .unwrap();
    let trusted = start_consumer(
        addr,
        RelayTls {
            cert: Some(cert),
            key: Some(key),
            ..RelayTls::new(&material.ca_pem)
        },
        Some(TOKEN),
    );
    assert_all_current(&trusted).await;
    trusted.shutdown().await;
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_plaintext_mismatches_fail_cleanly() {
    let material = material(&["127.0.0.1"]);
    let plain = start_relay(None).await;
    let tls_to_plain = start_consumer(
        plain.wan_addr(),
        RelayTls::new(&material.ca_pem),
        Some(TOKEN),
    );
    assert_refused(tls_to_plain, tls_failures, "TLS handshake failed").await;
    plain.shutdown().await.unwrap();

    let relay = secured_relay(&material, false).await;
    let plain_to_tls = support::quick_consumer(vec![
        kvrelay_consumer::RelayEndpoint::new(&relay.wan_addr().to_string(), "dc-tls")
            .with_token(BearerToken::new(TOKEN).unwrap()),
    ]);
    // The relay answers the plaintext request with a TLS alert, which is no frame.
    assert_refused(plain_to_tls, |m| m.relay_epoch_failures, "is not KVRW").await;
    relay.shutdown().await.unwrap();
}

#[test]
fn unreadable_tls_material_fails_at_start_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing-ca.pem");
    let relay =
        kvrelay_consumer::RelayEndpoint::new("127.0.0.1:1", "dc").with_tls(RelayTls::new(&missing));
    let config = ConsumerConfig::new(vec![relay]);
    let err = config.validate().unwrap_err();
    assert!(
        err.to_string().contains(&missing.display().to_string()),
        "{err}"
    );
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let started = runtime.block_on(async { Consumer::start(config).map(|_| ()) });
    assert!(started.is_err());
}

// ---- `kvrelay route` as a binary ----

struct RouteRun {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Settle time of runs expected to succeed (they return as soon as replicas are current).
const SETTLE_OK: &str = "10000";
/// Settle time of runs expected to be refused (they wait it out).
const SETTLE_REFUSED: &str = "1500";

/// Runs `kvrelay route` for `model` against `addr` with `args` (and `token_env` as
/// KVRELAY_ROUTE_TOKEN), with no `KVRELAY_ROUTE_*` variable inherited.
async fn route(
    addr: SocketAddr,
    model: &str,
    dir: &Path,
    args: &[&str],
    token_env: Option<&str>,
    settle_ms: &str,
) -> RouteRun {
    let tokens = dir.join("tokens.txt");
    let text = (0..256).map(|t: u32| t.to_string()).collect::<Vec<_>>();
    std::fs::write(&tokens, text.join(" ")).unwrap();
    let mut command = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrelay"));
    command
        .arg("route")
        .arg("--relay")
        .arg(format!("{addr}=dc-tls"))
        .arg("--model")
        .arg(model)
        .arg("--tokens-file")
        .arg(&tokens)
        .arg("--settle-ms")
        .arg(settle_ms)
        .args(args)
        .env_remove("KVRELAY_ROUTE_TOKEN")
        .env_remove("KVRELAY_ROUTE_TOKEN_FILE")
        .env_remove("KVRELAY_ROUTE_TLS_CA")
        .env_remove("KVRELAY_ROUTE_TLS_CERT")
        .env_remove("KVRELAY_ROUTE_TLS_KEY")
        .env_remove("KVRELAY_ROUTE_TLS_SERVER_NAME");
    if let Some(token) = token_env {
        command.env("KVRELAY_ROUTE_TOKEN", token);
    }
    let output = tokio::time::timeout(DEADLINE, command.output())
        .await
        .expect("kvrelay route finishes")
        .unwrap();
    RouteRun {
        code: output.status.code(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kvrelay_route_reaches_a_tls_token_relay_and_explains_refusals() {
    let material = material(&["localhost"]);
    let relay = secured_relay(&material, false).await;
    let addr = relay.wan_addr();
    let model = kvrelay_consumer::served_base_models(&relay.catalog())
        .first()
        .expect("the example deployment serves a model")
        .model
        .clone();
    let dir = material.dir.path();
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let ca = material.ca_pem.to_str().unwrap();
    let token_path = token_file.to_str().unwrap();
    let secure = [
        "--tls-ca",
        ca,
        "--tls-server-name",
        "localhost",
        "--token-file",
        token_path,
    ];

    let served = route(addr, &model, dir, &secure, None, SETTLE_OK).await;
    assert_eq!(served.code, Some(0), "{}", served.stderr);
    let report: serde_json::Value = serde_json::from_str(&served.stdout).unwrap();
    assert_eq!(report["settled"], true, "{report}");
    assert!(
        report["candidates"]
            .as_array()
            .is_some_and(|c| !c.is_empty()),
        "{report}"
    );

    // The token from the environment works as well as from a file.
    let from_env = route(addr, &model, dir, &secure[..4], Some(TOKEN), SETTLE_OK).await;
    assert_eq!(from_env.code, Some(0), "{}", from_env.stderr);

    let wrong_token = route(
        addr,
        &model,
        dir,
        &secure[..4],
        Some("wrong"),
        SETTLE_REFUSED,
    )
    .await;
    assert_eq!(wrong_token.code, Some(1), "{}", wrong_token.stderr);
    assert!(
        wrong_token.stderr.contains("missing or wrong bearer token"),
        "{}",
        wrong_token.stderr
    );

    let stranger = material.stranger_pem.to_str().unwrap();
    let wrong_ca = [&["--tls-ca", stranger], &secure[2..]].concat();
    let refused = route(addr, &model, dir, &wrong_ca, None, SETTLE_REFUSED).await;
    assert_eq!(refused.code, Some(1), "{}", refused.stderr);
    assert!(
        refused.stderr.contains("TLS handshake failed"),
        "{}",
        refused.stderr
    );
    let report: serde_json::Value = serde_json::from_str(&refused.stdout).unwrap();
    assert!(
        report["relay_errors"][0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("TLS handshake failed")),
        "{report}"
    );

    // Usage errors (exit 2): a token on the command line, an unreadable CA bundle.
    let flag = route(addr, &model, dir, &["--token", TOKEN], None, SETTLE_REFUSED).await;
    assert_eq!(flag.code, Some(2), "{}", flag.stderr);
    assert!(
        flag.stderr.contains("--token is refused"),
        "{}",
        flag.stderr
    );
    assert!(
        !flag.stderr.contains(TOKEN),
        "the refusal must not echo the token"
    );
    let missing = dir.join("no-such-ca.pem");
    let bad_ca = route(
        addr,
        &model,
        dir,
        &["--tls-ca", missing.to_str().unwrap()],
        None,
        SETTLE_REFUSED,
    )
    .await;
    assert_eq!(bad_ca.code, Some(2), "{}", bad_ca.stderr);
    assert!(
        bad_ca.stderr.contains(missing.to_str().unwrap()),
        "{}",
        bad_ca.stderr
    );
    relay.shutdown().await.unwrap();
}
