//! A relay discovering its endpoints from a real etcd (Debian package `etcd-server`) on a
//! loopback port: a card put into etcd becomes a published pool, and deleting it withdraws
//! the pool; KV event sources advertised in etcd the way Dynamo's workers advertise them
//! attach, and detach when their lease ends; and real Dynamo 1.6.1 workers registered in
//! etcd attach the same pool and sources in our relay as in Dynamo's own.

use crate::support;

use crate::interop;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;

use kvrelay_codec::v1::{Message, StreamRpc};
use kvrelay_dynamo::CONTRACT_MARKER;
use kvrelay_dynamo::proto::kv_event_relay_client::KvEventRelayClient;
use kvrelay_dynamo::proto::{
    KvPoolCatalogUpdate, SubscribeKvPoolLoadRequest, WatchKvPoolCatalogRequest,
};
use kvrelay_membership::{
    DEFAULT_ETCD_TIMEOUT, EtcdDiscovery, ModelCardInstance, ModelCardInstanceId,
};
use kvrelay_server::{DiscoveryBackend, Relay, RelayConfig, WorkloadConfig};
use support::{
    DEADLINE, Feed, advert_records, first_message, next, publish_until_resident, request,
};
use zeromq::{PubSocket, Socket};

/// The log line etcd prints once it serves clients.
const READY_LINE: &str = "ready to serve client requests";

struct EtcdServer {
    child: Child,
    url: String,
}

impl EtcdServer {
    fn start(data_dir: &Path) -> Self {
        let free_port = || {
            std::net::TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        };
        let binary = std::env::var_os("ETCD_BIN")
            .map_or_else(|| PathBuf::from("/usr/bin/etcd"), PathBuf::from);
        let client_url = format!("http://127.0.0.1:{}", free_port());
        let peer_url = format!("http://127.0.0.1:{}", free_port());
        let mut child = Command::new(&binary)
            .arg("--name=kvrelay-server-test")
            .arg(format!("--data-dir={}", data_dir.display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=kvrelay-server-test={peer_url}"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|err| {
                panic!(
                    "cannot start {} ({err}); apt-get install -y etcd-server",
                    binary.display()
                )
            });
        let stderr = child.stderr.take().unwrap();
        let (ready_tx, ready) = mpsc::channel();
        std::thread::spawn(move || {
            let mut ready_tx = Some(ready_tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains(READY_LINE)
                    && let Some(sender) = ready_tx.take()
                {
                    let _ = sender.send(());
                }
            }
        });
        let server = Self {
            child,
            url: client_url,
        };
        ready
            .recv_timeout(DEADLINE)
            .expect("etcd ready within the deadline");
        server
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn card(worker: u64) -> ModelCardInstance {
    ModelCardInstance {
        id: ModelCardInstanceId::from_path(&format!("prod/backend/generate/{worker:x}")).unwrap(),
        card_json: serde_json::json!({
            "display_name": "llama", "source_path": "models/llama", "kv_cache_block_size": 16,
            "worker_type": "aggregated",
            "runtime_config": {"total_kv_blocks": 1024, "data_parallel_size": 1}
        }),
    }
}

/// A relay of DC `dc-etcd` on loopback (free ports) discovering from the etcd at `url`;
/// with `trace_dir`, an empty trace there connects every discovered worker as a source.
fn etcd_relay_config(url: &str, trace_dir: Option<&Path>) -> RelayConfig {
    let mut config = RelayConfig {
        dc_id: "dc-etcd".to_owned(),
        ..RelayConfig::default()
    };
    config.wan.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.discovery.backend = DiscoveryBackend::Etcd;
    config.discovery.etcd_endpoints = vec![url.to_owned()];
    config.workload = trace_dir.map(|dir| {
        let trace = dir.join("empty.jsonl");
        std::fs::write(&trace, "").unwrap();
        WorkloadConfig {
            trace: Some(trace),
            speed: 0.0,
            loops: 1,
        }
    });
    config
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cards_in_etcd_become_pools_and_deleting_them_withdraws_the_pool() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start(&dir.path().join("etcd"));
    let store = EtcdDiscovery::connect(std::slice::from_ref(&etcd.url), DEFAULT_ETCD_TIMEOUT)
        .await
        .unwrap();
    store.put_card(&card(0x51)).await.unwrap();

    let mut config = etcd_relay_config(&etcd.url, Some(dir.path()));
    config.admin.enabled = false;
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .expect("the etcd card becomes a pool");

    let (mut watcher, _) = first_message(relay.wan_addr(), &request(StreamRpc::WatchCatalog)).await;
    store.delete_card(&card(0x51).id).await.unwrap();
    loop {
        match next(&mut watcher).await {
            Some(Message::CatalogUpdate(catalog)) if catalog.pools.is_empty() => break,
            Some(Message::CatalogUpdate(_)) => {}
            other => panic!("expected catalog updates, got {other:?}"),
        }
    }
    relay.shutdown().await.unwrap();
}

/// A GET of `path` on the admin listener; the body.
async fn admin_get(addr: std::net::SocketAddr, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut out))
        .await
        .expect("the admin answer within the deadline")
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// More than tonic's default 4 MiB receive limit of card records under `v1/mdc/` (one
/// unpaginated range read used to stop the relay from starting: about 3,500 real cards),
/// plus a junk record: the relay starts, attaches all 40 pools and counts the junk. Then two
/// routers' worth of pool streams (one per pool each, 80 in all: more than the old
/// default of 64 `max_pool_streams_total`) are all served under the default limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_mebibytes_of_cards_start_and_two_routers_of_forty_pools_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start(&dir.path().join("etcd"));
    let store = EtcdDiscovery::connect(std::slice::from_ref(&etcd.url), DEFAULT_ETCD_TIMEOUT)
        .await
        .unwrap();
    let padding = "p".repeat(130 * 1024);
    const POOLS: u64 = 40;
    for n in 0..POOLS {
        let mut instance = card(0x100 + n);
        instance.id.endpoint = format!("generate{n}");
        instance.card_json["padding"] = serde_json::Value::String(padding.clone());
        store.put_card(&instance).await.unwrap();
    }
    store
        .client()
        .put(b"v1/mdc/prod/backend/junk/ff", b"{not a record", 0)
        .await
        .unwrap();
    let listed = store.client().list_prefix(b"v1/mdc/").await.unwrap();
    let bytes: usize = listed.records.iter().map(|r| r.value.len()).sum();
    assert!(bytes > 5 << 20, "{bytes} bytes of records");

    let config = etcd_relay_config(&etcd.url, Some(dir.path()));
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(POOLS as usize))
        .await
        .expect("every card becomes a pool");
    let catalog = relay.catalog();
    assert_eq!(catalog.pools.len(), POOLS as usize);

    let metrics = admin_get(relay.admin_addr().unwrap(), "/metrics").await;
    assert!(
        metrics.contains("kvrelay_discovery_skipped_total{reason=\"malformed\"} 1"),
        "{metrics}"
    );

    let mut open = Vec::new();
    for router in 0..2 {
        for pool in &catalog.pools {
            let rpc = StreamRpc::SubscribePool {
                expected_producer: pool.producer,
                resume_from_sequence: None,
            };
            let (stream, first) = first_message(relay.wan_addr(), &request(rpc)).await;
            assert!(
                matches!(first, Message::PoolFrame(_)),
                "router {router}, pool {:?}: {first:?}",
                pool.serving_endpoint
            );
            open.push(stream);
        }
    }
    assert_eq!(open.len(), 2 * POOLS as usize);
    drop(open);
    relay.shutdown().await.unwrap();
}

/// An etcd nobody answers stops the start with a typed error naming the endpoints (no
/// string flattening between the membership crate and the relay's caller).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_etcd_stops_the_start_with_a_typed_error() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let mut config = etcd_relay_config(&url, None);
    config.admin.enabled = false;
    let err = tokio::time::timeout(DEADLINE, Relay::start(config))
        .await
        .expect("the start fails within the deadline")
        .unwrap_err();
    assert!(
        matches!(
            &err,
            kvrelay_server::RelayError::Discovery(kvrelay_server::DiscoveryStartError::Etcd {
                endpoints,
                ..
            }) if *endpoints == vec![url.clone()]
        ),
        "{err:?}"
    );
}

/// The advert pair a Dynamo worker writes under its lease for one KV event publisher
/// (`v1/event_sources/...` and `v1/event_channels/...`, JSON tagged by `type`).
async fn advertise_in_etcd(
    store: &EtcdDiscovery,
    worker: u64,
    publisher: u64,
    zmq: &str,
    lease: i64,
) {
    let (source, channel) = advert_records(worker, publisher, zmq);
    let tail =
        format!("namespace/prod/component/backend/endpoint/generate/topic/kv-events/{publisher:x}");
    for (bucket, record) in [("v1/event_channels", channel), ("v1/event_sources", source)] {
        let key = format!("{bucket}/{tail}");
        store
            .client()
            .put(key.as_bytes(), record.to_string().as_bytes(), lease)
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_sources_advertised_in_etcd_attach_and_leave_with_their_lease() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start(&dir.path().join("etcd"));
    let store = EtcdDiscovery::connect(std::slice::from_ref(&etcd.url), DEFAULT_ETCD_TIMEOUT)
        .await
        .unwrap();
    store.put_card(&card(0x51)).await.unwrap();
    // A junk advert is skipped, never fatal.
    store
        .client()
        .put(b"v1/event_sources/namespace/prod/junk/1", b"{not json", 0)
        .await
        .unwrap();
    let mut publisher = PubSocket::new();
    let zmq = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();

    // A channel of a transport the relay does not read (NATS) is skipped and counted.
    let (_, mut nats_channel) = advert_records(0x52, 0x2000, "tcp://127.0.0.1:1");
    nats_channel["transport"] = serde_json::json!({"kind": "Nats"});
    store
        .client()
        .put(
            b"v1/event_channels/namespace/prod/component/backend/endpoint/generate/topic/kv-events/2000",
            nats_channel.to_string().as_bytes(),
            0,
        )
        .await
        .unwrap();

    let relay = Relay::start(etcd_relay_config(&etcd.url, None))
        .await
        .unwrap();
    assert!(relay.catalog().pools.is_empty(), "no source yet, no pool");
    let admin = relay.admin_addr().unwrap();
    // Each skipped record is counted once, however many relistings see it.
    let skipped =
        |reason: &str| format!("kvrelay_discovery_skipped_total{{reason=\"{reason}\"}} 1\n");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let page = admin_get(admin, "/metrics").await;
        if page.contains(&skipped("malformed_advert"))
            && page.contains(&skipped("unsupported_channel"))
        {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{page}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // Two relistings (every 500 ms) later, still once.
    tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
    let page = admin_get(admin, "/metrics").await;
    assert!(page.contains(&skipped("malformed_advert")), "{page}");
    assert!(page.contains(&skipped("unsupported_channel")), "{page}");

    let lease = store.client().grant_lease(60).await.unwrap();
    advertise_in_etcd(&store, 0x51, 0x1092, &zmq, lease).await;
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .expect("the advertised source attaches its pool");
    publish_until_resident(
        &relay,
        &mut publisher,
        Feed::DynamoEventPlane {
            publisher: 0x1092,
            worker: 0x51,
        },
        "no advertised worker's event reached the pool",
    )
    .await;
    assert_eq!(relay.sources().len(), 1);
    // Its recovery target is not called, and said so once, not on every relisting.
    tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
    let page = admin_get(admin, "/metrics").await;
    assert!(
        page.contains("kvrelay_discovery_recovery_targets_unused_total 1\n"),
        "{page}"
    );

    // The worker's lease ends: its adverts go, the source detaches and the pool retires.
    store.client().revoke_lease(lease).await.unwrap();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !relay.catalog().pools.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "pool not withdrawn after the adverts' lease ended"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert!(relay.sources().is_empty());
    relay.shutdown().await.unwrap();
}

/// An etcd outage is not a departure: the relay keeps the sources it last listed, and
/// counts the failed listings (`discovery_advert_listing_failures_total`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_outage_keeps_the_advertised_sources_and_counts_the_failed_listings() {
    let dir = tempfile::tempdir().unwrap();
    let mut etcd = EtcdServer::start(&dir.path().join("etcd"));
    let store = EtcdDiscovery::connect(std::slice::from_ref(&etcd.url), DEFAULT_ETCD_TIMEOUT)
        .await
        .unwrap();
    store.put_card(&card(0x51)).await.unwrap();
    let lease = store.client().grant_lease(60).await.unwrap();
    advertise_in_etcd(&store, 0x51, 0x1092, "tcp://127.0.0.1:1", lease).await;
    let relay = Relay::start(etcd_relay_config(&etcd.url, None))
        .await
        .unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .expect("the advertised source attaches its pool");
    assert_eq!(relay.sources().len(), 1);

    let _ = etcd.child.kill();
    let _ = etcd.child.wait();
    let admin = relay.admin_addr().unwrap();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let page = admin_get(admin, "/metrics").await;
        let failures = page.lines().find_map(|line| {
            line.strip_prefix("kvrelay_discovery_advert_listing_failures_total ")
                .and_then(|value| value.trim().parse::<f64>().ok())
        });
        if failures.is_some_and(|failures| failures >= 1.0) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{page}");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(relay.sources().len(), 1, "an outage detached the source");
    assert_eq!(relay.catalog().pools.len(), 1);
    relay.shutdown().await.unwrap();
}

/// A Dynamo script of the benchmark (`benches/dynamo/`), run with the interop venv.
fn dynamo_script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/dynamo")
        .join(name)
}

/// Starts a Dynamo script (interop venv, loopback, etcd discovery at `etcd_url`) and
/// returns it with its stdout lines.
fn start_dynamo(
    script: &str,
    etcd_url: &str,
    args: &[String],
) -> (
    tokio::process::Child,
    tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
) {
    use tokio::io::AsyncBufReadExt;
    let mut command = tokio::process::Command::new(interop::python());
    interop::loopback(&mut command)
        .arg(dynamo_script(script))
        .args(["--discovery", "etcd"])
        .args(args)
        .env("ETCD_ENDPOINTS", etcd_url)
        .env("DYN_LOG", "error")
        .env_remove("DYN_SYSTEM_PORT")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true);
    let mut child = command.spawn().expect("the interop python starts");
    let lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}

/// Discovery parity with the real thing: two Dynamo 1.6.1 workers (the wheel's own
/// runtime, a separate process) register their model cards and KV event publishers in a
/// real etcd under their leases; Dynamo's own relay and ours, both on that etcd, attach
/// the same pool: Dynamo's, asked over its contract, publishes one pool whose load window
/// expects both workers' ranks; ours attaches that pool and exactly the two workers as
/// sources (their ids as Dynamo assigned them). When the workers leave, both withdraw it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_dynamo_workers_in_etcd_attach_the_same_pool_and_sources_as_dynamos_relay() {
    let dir = tempfile::tempdir().unwrap();
    let etcd = EtcdServer::start(&dir.path().join("etcd"));
    let engine_port = |_| {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    };
    let engines: Vec<u16> = (0..2).map(engine_port).collect();
    let mut worker_args = vec![
        "--endpoint".to_owned(),
        "prod.backend.generate".to_owned(),
        "--model".to_owned(),
        "llama".to_owned(),
        "--total-kv-blocks".to_owned(),
        "1024".to_owned(),
    ];
    for (label, port) in engines.iter().enumerate() {
        worker_args.push("--engine".to_owned());
        worker_args.push(format!("{label}=tcp://127.0.0.1:{port}"));
    }
    let (mut workers, mut worker_lines) =
        start_dynamo("dynamo_workers.py", &etcd.url, &worker_args);
    let ready = interop::expect_line(&mut worker_lines, "ready").await;
    // `ready 0=ID 1=ID`: the worker ids Dynamo gave its runtimes.
    let mut dynamo_ids: Vec<u64> = ready
        .split_whitespace()
        .filter_map(|pair| pair.split_once('=')?.1.parse().ok())
        .collect();
    dynamo_ids.sort_unstable();
    assert_eq!(dynamo_ids.len(), 2, "{ready:?}");

    let (mut dynamo_relay, mut relay_lines) = start_dynamo(
        "dynamo_relay.py",
        &etcd.url,
        &[
            "--namespace".to_owned(),
            "prod".to_owned(),
            "--health-ms".to_owned(),
            "0".to_owned(),
        ],
    );
    let dynamo_addr = interop::expect_line(&mut relay_lines, "bound ").await;
    let relay = Relay::start(etcd_relay_config(&etcd.url, None))
        .await
        .unwrap();

    // Dynamo's relay, asked over its contract: one pool, whose load window expects the
    // two workers' ranks.
    let channel = tonic::transport::Channel::from_shared(format!("http://{dynamo_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut dynamo = KvEventRelayClient::new(channel);
    let mut dynamo_catalog = dynamo
        .watch_kv_pool_catalog(WatchKvPoolCatalogRequest {
            subscriber_id: "parity".to_owned(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    let mut dynamo_load = dynamo
        .subscribe_kv_pool_load(SubscribeKvPoolLoadRequest {
            subscriber_id: "parity".to_owned(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    let pools_in = |update: &KvPoolCatalogUpdate| {
        update
            .snapshot
            .as_ref()
            .map_or(0, |snapshot| snapshot.pools.len())
    };
    tokio::time::timeout(DEADLINE, async {
        while pools_in(&dynamo_catalog.message().await.unwrap().unwrap()) != 1 {}
        loop {
            let window = dynamo_load.message().await.unwrap().unwrap();
            if window.pools.iter().any(|pool| pool.kv_expected_ranks == 2) {
                break;
            }
        }
    })
    .await
    .expect("Dynamo's relay publishes the pool of both workers");

    // Ours: the same pool, the same two sources.
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .expect("our relay attaches the workers' pool");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let mut ours: Vec<u64> = relay
            .sources()
            .iter()
            .map(|source| source.worker_id)
            .collect();
        ours.sort_unstable();
        if ours == dynamo_ids {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "our relay attached {ours:?}, Dynamo's workers are {dynamo_ids:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let catalog = relay.catalog();
    assert_eq!(catalog.pools.len(), 1);
    assert_eq!(catalog.pools[0].serving_endpoint.name, "generate");

    // The workers leave (their runtimes shut down and revoke their leases): both relays
    // withdraw the pool.
    drop(workers.stdin.take());
    let _ = tokio::time::timeout(DEADLINE, workers.wait()).await;
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !relay.sources().is_empty() || !relay.catalog().pools.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "our relay kept {:?} after the workers left",
            relay.sources()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    tokio::time::timeout(DEADLINE, async {
        while pools_in(&dynamo_catalog.message().await.unwrap().unwrap()) != 0 {}
    })
    .await
    .expect("Dynamo's relay withdraws the pool too");
    drop(dynamo_relay.stdin.take());
    let _ = tokio::time::timeout(DEADLINE, dynamo_relay.wait()).await;
    relay.shutdown().await.unwrap();
}
