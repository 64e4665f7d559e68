//! The kvrelay consumer following *Dynamo's own relay* (`ai-dynamo-runtime` 1.6.1, with a
//! Dynamo worker publishing through Dynamo's `KvEventPublisher`, a separate process on
//! loopback) over the contract: Dynamo's catalog, snapshot, deltas and readiness become
//! current replicas, and every prefix the worker stored is found at exactly its depth
//! (Dynamo's block hashing, CBI1 images and filter layout read by our code), while
//! sequences it never stored, or evicted, are not; and a restart of Dynamo's relay (a new
//! incarnation on the same address) drops the old replica and converges on the new one.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly"
)]

use std::time::Duration;

use kvrelay_consumer::{
    BackoffConfig, Consumer, ConsumerConfig, RelayEndpoint, RelayProtocol, ReplicaStatus,
    ScoreRequest,
};

#[path = "../../kvrelay-dynamo/tests/interop/mod.rs"]
mod interop;
mod support;

const DEADLINE: Duration = Duration::from_secs(30);
const BLOCK: u32 = 16;

fn request(first: u32, blocks: u32) -> ScoreRequest {
    ScoreRequest {
        tokens: (first..first + BLOCK * blocks).collect(),
        model: "model-a".to_owned(),
        ..ScoreRequest::default()
    }
}

/// The deepest cached prefix any candidate of `consumer` finds for `request`, once every
/// replica is current; `None` while the model is unknown or no replica is current.
fn depth(consumer: &Consumer, request: &ScoreRequest) -> Option<u32> {
    let ranking = consumer.score(request).ok()?;
    ranking
        .candidates
        .iter()
        .flat_map(|candidate| &candidate.legs)
        .filter(|leg| leg.replica == ReplicaStatus::Current)
        .filter_map(|leg| leg.prefix_blocks)
        .max()
}

/// Waits until `consumer` finds exactly `expected` blocks for `request`.
async fn wait_depth(consumer: &Consumer, request: &ScoreRequest, expected: u32) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let found = depth(consumer, request);
        if found == Some(expected) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "expected depth {expected}, found {found:?}; pools {:?}; errors {:?}",
            consumer.pools(),
            consumer.relay_errors()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_follows_dynamos_relay_and_finds_what_its_worker_cached() {
    let mut fleet = interop::DynamoFleet::start().await;
    // Stored before the consumer subscribes: it arrives in the snapshot.
    fleet.store(10_000, 6).await;

    let mut config = ConsumerConfig::new(vec![
        RelayEndpoint::new(&fleet.addr, "dc-dynamo").with_protocol(RelayProtocol::DynamoGrpc),
    ]);
    config.backoff = BackoffConfig {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(200),
        ..BackoffConfig::default()
    };
    let consumer = Consumer::start(config).unwrap();
    wait_depth(&consumer, &request(10_000, 6), 6).await;
    // A prefix of it, and the sequence continued past what was stored.
    assert_eq!(depth(&consumer, &request(10_000, 2)), Some(2));
    assert_eq!(depth(&consumer, &request(10_000, 9)), Some(6));
    // Tokens nobody stored.
    assert_eq!(depth(&consumer, &request(50_000, 4)), Some(0));

    // Stored while the consumer follows: it arrives as deltas.
    fleet.store(20_000, 3).await;
    wait_depth(&consumer, &request(20_000, 3), 3).await;
    // Evicted: gone from the replica too.
    fleet.remove(10_000, 6).await;
    wait_depth(&consumer, &request(10_000, 6), 0).await;
    assert_eq!(depth(&consumer, &request(20_000, 3)), Some(3));

    let pools = consumer.pools();
    assert_eq!(pools.len(), 1, "{pools:?}");
    assert_eq!(pools[0].replica, ReplicaStatus::Current);

    // Dynamo's relay restarts on the same address, with a worker that cached something
    // else: the old replica is dropped (never scored), the new incarnation's is used.
    let port = fleet
        .addr
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .expect("host:port");
    let old_producer = pools[0].producer;
    fleet.stop().await;
    let mut restarted = interop::DynamoFleet::start_on(port).await;
    restarted.store(30_000, 4).await;
    wait_depth(&consumer, &request(30_000, 4), 4).await;
    assert_eq!(depth(&consumer, &request(20_000, 3)), Some(0));
    let pools = consumer.pools();
    assert_eq!(pools.len(), 1, "{pools:?}");
    assert_ne!(
        pools[0].producer, old_producer,
        "a new incarnation is a new producer"
    );
    consumer.shutdown().await;
}

/// A script of the Dynamo benchmark (`benches/dynamo/`).
fn dynamo_script(name: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../benches/dynamo")
        .join(name)
}

/// A Dynamo process of the benchmark's scripts (interop venv, loopback, file discovery in
/// `discovery`), and its stdout lines.
struct DynamoProcess {
    child: tokio::process::Child,
    lines: tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>,
}

impl DynamoProcess {
    fn start(script: &str, discovery: &std::path::Path, args: &[&str]) -> Self {
        use tokio::io::AsyncBufReadExt;
        let mut command = tokio::process::Command::new(interop::python());
        interop::loopback(&mut command)
            .arg(dynamo_script(script))
            .args(args)
            .env("DYN_FILE_KV", discovery)
            .env("DYN_LOG", "error")
            .env_remove("DYN_SYSTEM_PORT")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true);
        let mut child = command.spawn().expect("the interop python starts");
        let lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
        Self { child, lines }
    }

    async fn expect(&mut self, prefix: &str) -> String {
        interop::expect_line(&mut self.lines, prefix).await
    }

    /// Closes stdin (a clean shutdown) and waits for the exit.
    async fn stop(mut self) {
        drop(self.child.stdin.take());
        if tokio::time::timeout(DEADLINE, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// One worker's card for our relay (instance `worker` of `prod.backend.generate`).
fn write_card(cards: &std::path::Path, worker: u64) -> std::path::PathBuf {
    let record = serde_json::json!({
        "type": "Model", "namespace": "prod", "component": "backend", "endpoint": "generate",
        "instance_id": worker,
        "card_json": {
            "display_name": "model-a", "source_path": "models/model-a",
            "kv_cache_block_size": BLOCK, "model_type": "Chat | Completions",
            "worker_type": "aggregated", "needs": [],
            "runtime_config": {"total_kv_blocks": 1024, "data_parallel_start_rank": 0,
                "data_parallel_size": 1}
        }
    });
    let path = cards.join(format!("prod-backend-generate-{worker:x}.json"));
    std::fs::write(&path, record.to_string()).unwrap();
    path
}

/// The reference runtime's advert pair for `worker`'s KV event publisher on ZMQ `zmq`
/// (as its file store keeps them), so our relay attaches the engine the way a Dynamo
/// deployment advertises it, and detaches it when the records go. Returns the two files.
fn advertise(store: &std::path::Path, worker: u64, zmq: &str) -> [std::path::PathBuf; 2] {
    let scope = serde_json::json!({"kind": "endpoint", "endpoint":
        {"namespace": "prod", "component": "backend", "name": "generate"}});
    let source = serde_json::json!({
        "type": "EventSource", "scope": scope, "topic": "kv-events", "publisher_id": worker,
        "metadata": {"kv_state_endpoint": scope["endpoint"],
            "worker": {"worker_id": worker, "dp_rank": 0}, "publisher_id": worker}
    });
    let channel = serde_json::json!({
        "type": "EventChannel", "scope": scope, "topic": "kv-events", "instance_id": worker,
        "transport": {"kind": "Zmq", "config": {"endpoint": zmq}}
    });
    let record = format!(
        "namespace%2Fprod%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F{worker:x}"
    );
    [("event_channels", channel), ("event_sources", source)].map(|(bucket, value)| {
        std::fs::create_dir_all(store.join(bucket)).unwrap();
        let path = store.join(bucket).join(&record);
        std::fs::write(&path, value.to_string()).unwrap();
        path
    })
}

fn tokens_request(ids: &[u64]) -> ScoreRequest {
    ScoreRequest {
        tokens: support::tokens_of(ids),
        model: "model-a".to_owned(),
        ..ScoreRequest::default()
    }
}

/// Waits until both consumers find exactly `expected` blocks for the tokens of `ids`.
async fn both_find(ours: &Consumer, theirs: &Consumer, ids: &[u64], expected: u32) {
    let request = tokens_request(ids);
    wait_depth(ours, &request, expected).await;
    wait_depth(theirs, &request, expected).await;
}

fn fast_consumer(relay: RelayEndpoint) -> Consumer {
    let mut config = ConsumerConfig::new(vec![relay]);
    config.backoff = BackoffConfig {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(200),
        ..BackoffConfig::default()
    };
    Consumer::start(config).unwrap()
}

/// The same events through both relays: two vLLM engines (libzmq publishers) feed our
/// relay directly and Dynamo's relay through one Dynamo worker runtime each (Dynamo's
/// `KvEventPublisher` relaying the engine's stream, as in the benchmark). Our consumer
/// follows ours over our protocol and Dynamo's over the contract; every prefix is found at
/// the same, exact depth through both, through stores, evictions, and one worker leaving
/// (its card and adverts gone from our discovery, its Dynamo runtime shut down: both
/// relays drop what only it held).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fed_the_same_events_a_dynamo_relay_and_ours_give_the_same_depths() {
    let dir = tempfile::tempdir().unwrap();
    let cards = dir.path().join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    let discovery = dir.path().join("dynamo-discovery");
    std::fs::create_dir_all(&discovery).unwrap();
    let context = zmq::Context::new();
    let free = || {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
    };
    let (first_addr, second_addr) = (free(), free());
    let mut first = support::VllmEngine::bind(&context, first_addr);
    let mut second = support::VllmEngine::bind(&context, second_addr);

    // Ours: one card and one advertised source per engine.
    let store = dir.path().join("adverts/v1");
    write_card(&cards, 0x21);
    let second_card = write_card(&cards, 0x22);
    advertise(&store, 0x21, &format!("tcp://{first_addr}"));
    let second_adverts = advertise(&store, 0x22, &format!("tcp://{second_addr}"));
    let mut config = kvrelay_server::RelayConfig {
        dc_id: "dc-ours".to_owned(),
        ..kvrelay_server::RelayConfig::default()
    };
    config.wan.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.enabled = false;
    config.discovery.dir = Some(cards.clone());
    config.discovery.event_sources_dir = Some(store);
    let relay = kvrelay_server::Relay::start(config).await.unwrap();

    // Dynamo's: its relay, and one worker runtime per engine (so one can leave alone).
    let mut dynamo_relay = DynamoProcess::start(
        "dynamo_relay.py",
        &discovery,
        &[
            "--namespace",
            "prod",
            "--dc",
            "dc-dynamo",
            "--expected-unique-blocks",
            "2048",
            "--health-ms",
            "0",
        ],
    );
    let dynamo_addr = dynamo_relay.expect("bound ").await;
    // One model directory for both worker processes: their cards must agree.
    let model_dir = dir.path().join("model").display().to_string();
    let worker = |addr: std::net::SocketAddr| {
        let engine = format!("w=tcp://{addr}");
        DynamoProcess::start(
            "dynamo_workers.py",
            &discovery,
            &[
                "--endpoint",
                "prod.backend.generate",
                "--model",
                "model-a",
                "--model-dir",
                &model_dir,
                "--total-kv-blocks",
                "1024",
                "--engine",
                &engine,
            ],
        )
    };
    let mut first_worker = worker(first_addr);
    let mut second_worker = worker(second_addr);
    first_worker.expect("ready").await;
    second_worker.expect("ready").await;

    let ours = fast_consumer(RelayEndpoint::new(&relay.wan_addr().to_string(), "dc-ours"));
    let theirs = fast_consumer(
        RelayEndpoint::new(&dynamo_addr, "dc-dynamo").with_protocol(RelayProtocol::DynamoGrpc),
    );
    // Neither side replays: an engine's events reach a subscriber only once its ZMQ
    // subscription is up. Publish a fresh root block from each engine until both
    // consumers see both, then everything after reaches both.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut probe = 900_000u64;
    loop {
        probe += 2;
        first.publish(support::stored(&[probe], None));
        second.publish(support::stored(&[probe + 1], None));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let seen =
            |consumer: &Consumer, id: u64| depth(consumer, &tokens_request(&[id])) == Some(1);
        if seen(&ours, probe)
            && seen(&ours, probe + 1)
            && seen(&theirs, probe)
            && seen(&theirs, probe + 1)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the probes never reached both consumers: ours {:?}, theirs {:?} ({:?}, {:?})",
            ours.pools(),
            theirs.pools(),
            theirs.relay_errors(),
            theirs.metrics()
        );
    }

    // A chain on the first engine; the second holds its first three blocks and another
    // continuation (engine ids are per engine, so the second may reuse them).
    first.publish(support::stored(&[1, 2, 3, 4, 5, 6], None));
    second.publish(support::stored(&[1, 2, 3], None));
    second.publish(support::stored(&[7, 8], Some(3)));
    both_find(&ours, &theirs, &[1, 2, 3, 4, 5, 6], 6).await;
    both_find(&ours, &theirs, &[1, 2, 3, 7, 8], 5).await;
    both_find(&ours, &theirs, &[1, 2, 9], 2).await;
    both_find(&ours, &theirs, &[40, 41], 0).await;
    // Evictions: the first engine's tail goes; the second still holds the shared head.
    first.publish(support::removed(&[5, 6]));
    both_find(&ours, &theirs, &[1, 2, 3, 4, 5, 6], 4).await;
    first.publish(support::removed(&[1, 2, 3, 4]));
    both_find(&ours, &theirs, &[1, 2, 3, 4, 5, 6], 3).await;
    both_find(&ours, &theirs, &[1, 2, 3, 7, 8], 5).await;

    // The second worker leaves: from our discovery (its card and adverts) and from
    // Dynamo's (its runtime shuts down and its records go). What only it held is gone
    // from both, while the pool lives on with the first worker.
    std::fs::remove_file(&second_card).unwrap();
    for advert in second_adverts {
        std::fs::remove_file(advert).unwrap();
    }
    second_worker.stop().await;
    both_find(&ours, &theirs, &[1, 2, 3, 7, 8], 0).await;
    // The first worker's blocks are still there.
    first.publish(support::stored(&[11, 12], None));
    both_find(&ours, &theirs, &[11, 12], 2).await;

    ours.shutdown().await;
    theirs.shutdown().await;
    first_worker.stop().await;
    dynamo_relay.stop().await;
    relay.shutdown().await.unwrap();
}
