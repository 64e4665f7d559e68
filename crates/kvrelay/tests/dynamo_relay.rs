//! The kvrelay consumer following *Dynamo's own relay* (`ai-dynamo-runtime` 1.6.1, with a
//! Dynamo worker publishing through Dynamo's `KvEventPublisher`, a separate process on
//! loopback) over the contract: Dynamo's catalog, snapshot, deltas and readiness become
//! current replicas, and every prefix the worker stored is found at exactly its depth
//! (Dynamo's block hashing, CBI1 images and filter layout read by our code), while
//! sequences it never stored, or evicted, are not; and a restart of Dynamo's relay (a new
//! incarnation on the same address) drops the old replica and converges on the new one.

use std::time::Duration;

use kvrelay_consumer::{Consumer, RelayEndpoint, RelayProtocol, ReplicaState, ScoreRequest};

use crate::interop;
use crate::support;

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
        .filter(|leg| leg.replica == ReplicaState::Current)
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

    let consumer = support::quick_consumer(vec![
        RelayEndpoint::new(&fleet.addr, "dc-dynamo").with_protocol(RelayProtocol::DynamoGrpc),
    ]);
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
    assert_eq!(pools[0].replica, ReplicaState::Current);

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

/// One worker's card for our relay (instance `worker` of `prod.<component>.generate`,
/// serving `model`).
fn write_card(
    cards: &std::path::Path,
    component: &str,
    model: &str,
    worker: u64,
) -> std::path::PathBuf {
    let record = serde_json::json!({
        "type": "Model", "namespace": "prod", "component": component, "endpoint": "generate",
        "instance_id": worker,
        "card_json": {
            "display_name": model, "source_path": format!("models/{model}"),
            "kv_cache_block_size": BLOCK, "model_type": "Chat | Completions",
            "worker_type": "aggregated", "needs": [],
            "runtime_config": {"total_kv_blocks": 1024, "data_parallel_start_rank": 0,
                "data_parallel_size": 1}
        }
    });
    let path = cards.join(format!("prod-{component}-generate-{worker:x}.json"));
    std::fs::write(&path, record.to_string()).unwrap();
    path
}

/// The reference runtime's advert pair for `worker`'s KV event publisher on ZMQ `zmq`
/// (as its file store keeps them), naming vLLM as what publishes there (our metadata key:
/// the engine's own batches, not Dynamo's event plane), so our relay attaches the engine
/// the way a Dynamo deployment advertises a source, and detaches it when the records go.
/// Returns the two files.
fn advertise(
    store: &std::path::Path,
    component: &str,
    worker: u64,
    zmq: &str,
) -> [std::path::PathBuf; 2] {
    let scope = serde_json::json!({"kind": "endpoint", "endpoint":
        {"namespace": "prod", "component": component, "name": "generate"}});
    let source = serde_json::json!({
        "type": "EventSource", "scope": scope, "topic": "kv-events", "publisher_id": worker,
        "metadata": {"kv_state_endpoint": scope["endpoint"],
            "worker": {"worker_id": worker, "dp_rank": 0}, "publisher_id": worker,
            "engine": "vllm"}
    });
    let channel = serde_json::json!({
        "type": "EventChannel", "scope": scope, "topic": "kv-events", "instance_id": worker,
        "transport": {"kind": "Zmq", "config": {"endpoint": zmq}}
    });
    let record = format!(
        "namespace%2Fprod%2Fcomponent%2F{component}%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F{worker:x}"
    );
    [("event_channels", channel), ("event_sources", source)].map(|(bucket, value)| {
        std::fs::create_dir_all(store.join(bucket)).unwrap();
        let path = store.join(bucket).join(&record);
        std::fs::write(&path, value.to_string()).unwrap();
        path
    })
}

fn tokens_request(model: &str, ids: &[u64]) -> ScoreRequest {
    ScoreRequest {
        tokens: support::tokens_of(ids),
        model: model.to_owned(),
        ..ScoreRequest::default()
    }
}

/// Waits until both consumers find exactly `expected` blocks of `model` for the tokens
/// of `ids`.
async fn both_find_of(ours: &Consumer, theirs: &Consumer, model: &str, ids: &[u64], expected: u32) {
    let request = tokens_request(model, ids);
    wait_depth(ours, &request, expected).await;
    wait_depth(theirs, &request, expected).await;
}

/// [`both_find_of`] for `model-a`.
async fn both_find(ours: &Consumer, theirs: &Consumer, ids: &[u64], expected: u32) {
    both_find_of(ours, theirs, "model-a", ids, expected).await;
}

/// Publishes fresh root blocks from `engine` until both consumers find them for `model`:
/// neither side replays, so an engine's events reach a relay only once its ZMQ
/// subscription is up; after this, everything the engine publishes reaches both.
async fn until_both_subscribed(
    engine: &mut support::VllmEngine,
    probe: &mut u64,
    ours: &Consumer,
    theirs: &Consumer,
    model: &str,
) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        *probe += 1;
        engine.publish(support::stored(&[*probe], None));
        tokio::time::sleep(Duration::from_millis(200)).await;
        let request = tokens_request(model, &[*probe]);
        if depth(ours, &request) == Some(1) && depth(theirs, &request) == Some(1) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the probes never reached both consumers: ours {:?}, theirs {:?} ({:?})",
            ours.pools(),
            theirs.pools(),
            theirs.relay_errors(),
        );
    }
}

/// How our relay is fed in [`same_events`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OurFeed {
    /// The engines' own batches, from cards and adverts we write (naming vLLM).
    Engines,
    /// Nothing of ours: our relay reads the Dynamo deployment's own file store (the cards
    /// and event adverts Dynamo's workers register) and each worker's event plane, as
    /// Dynamo's relay does: a kvrelay relay dropped into a Dynamo deployment.
    DynamoDeployment,
}

/// The same events through both relays: two vLLM engines (libzmq publishers) feed Dynamo's
/// relay through one Dynamo worker runtime each (Dynamo's `KvEventPublisher` relaying the
/// engine's stream, as in the benchmark), and ours either directly or through the same
/// Dynamo workers' event planes. Our consumer follows ours over our protocol and Dynamo's
/// over the contract; every prefix is found at the same, exact depth through both, through
/// stores, evictions, one worker leaving (its records gone, its Dynamo runtime shut down:
/// both relays drop what only it held) and a catalog change (a worker of another model on
/// another endpoint joins: a second pool in both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fed_the_same_events_a_dynamo_relay_and_ours_give_the_same_depths() {
    same_events(OurFeed::Engines).await;
}

/// [`same_events`] with our relay reading only what the Dynamo deployment publishes: its
/// file store and its workers' event planes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_into_a_dynamo_deployment_our_relay_reads_its_workers_and_agrees_with_dynamos() {
    same_events(OurFeed::DynamoDeployment).await;
}

async fn same_events(feed: OurFeed) {
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

    // Ours, fed by the engines: one card and one advertised source per engine.
    let store = dir.path().join("adverts/v1");
    let mut second_records = Vec::new();
    if feed == OurFeed::Engines {
        write_card(&cards, "backend", "model-a", 0x21);
        second_records.push(write_card(&cards, "backend", "model-a", 0x22));
        advertise(&store, "backend", 0x21, &format!("tcp://{first_addr}"));
        second_records.extend(advertise(
            &store,
            "backend",
            0x22,
            &format!("tcp://{second_addr}"),
        ));
    }

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
    // One model directory per model for every worker process: their cards must agree.
    let worker = |component: &str, model: &str, addr: std::net::SocketAddr| {
        let engine = format!("w=tcp://{addr}");
        let endpoint = format!("prod.{component}.generate");
        let model_dir = dir.path().join(model).display().to_string();
        DynamoProcess::start(
            "dynamo_workers.py",
            &discovery,
            &[
                "--endpoint",
                &endpoint,
                "--model",
                model,
                "--model-dir",
                &model_dir,
                "--total-kv-blocks",
                "1024",
                "--engine",
                &engine,
            ],
        )
    };
    let mut first_worker = worker("backend", "model-a", first_addr);
    let mut second_worker = worker("backend", "model-a", second_addr);
    // `ready w=ID`: the worker id Dynamo gave each runtime.
    let dynamo_id = |ready: String| -> u64 {
        let id = ready.split_once('=').map(|(_, id)| id.trim());
        id.and_then(|id| id.parse().ok()).expect("ready w=ID")
    };
    let first_id = dynamo_id(first_worker.expect("ready").await);
    let second_id = dynamo_id(second_worker.expect("ready").await);

    let mut config = kvrelay_server::RelayConfig {
        dc_id: "dc-ours".to_owned(),
        ..kvrelay_server::RelayConfig::default()
    };
    config.wan.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.enabled = false;
    match feed {
        OurFeed::Engines => {
            config.discovery.dir = Some(cards.clone());
            config.discovery.event_sources_dir = Some(store.clone());
        }
        // Dynamo's file store as it is: cards under v1/mdc, adverts under v1.
        OurFeed::DynamoDeployment => {
            config.discovery.dir = Some(discovery.join("v1/mdc"));
            config.discovery.event_sources_dir = Some(discovery.join("v1"));
        }
    }
    let relay = kvrelay_server::Relay::start(config).await.unwrap();

    let ours = support::quick_consumer(vec![RelayEndpoint::new(
        &relay.wan_addr().to_string(),
        "dc-ours",
    )]);
    let theirs = support::quick_consumer(vec![
        RelayEndpoint::new(&dynamo_addr, "dc-dynamo").with_protocol(RelayProtocol::DynamoGrpc),
    ]);
    let mut probe = 900_000u64;
    until_both_subscribed(&mut first, &mut probe, &ours, &theirs, "model-a").await;
    until_both_subscribed(&mut second, &mut probe, &ours, &theirs, "model-a").await;
    // Whose events reach our relay: the engines we advertised, or Dynamo's workers.
    let mut sources: Vec<u64> = relay.sources().iter().map(|s| s.worker_id).collect();
    sources.sort_unstable();
    let mut expected = match feed {
        OurFeed::Engines => vec![0x21, 0x22],
        OurFeed::DynamoDeployment => vec![first_id, second_id],
    };
    expected.sort_unstable();
    assert_eq!(sources, expected);

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
    // Held by the first worker before the second leaves, and after.
    first.publish(support::stored(&[31, 32], None));
    both_find(&ours, &theirs, &[31, 32], 2).await;

    // The second worker leaves: from our discovery (its card and adverts) and from
    // Dynamo's (its runtime shuts down and its records go). What only it held is gone
    // from both, while the pool lives on with the first worker.
    for record in second_records {
        std::fs::remove_file(record).unwrap();
    }
    second_worker.stop().await;
    both_find(&ours, &theirs, &[1, 2, 3, 7, 8], 0).await;
    both_find(&ours, &theirs, &[1, 2, 3, 4, 5, 6], 0).await;
    // The first worker's blocks are still there, and it goes on.
    both_find(&ours, &theirs, &[31, 32], 2).await;
    first.publish(support::stored(&[11, 12], None));
    both_find(&ours, &theirs, &[11, 12], 2).await;

    // The catalog changes: a worker of another model on another endpoint joins (its card
    // and adverts for ours, a Dynamo worker runtime for Dynamo's). Both relays publish a
    // second pool; both consumers find its prefixes, and model-a's are unchanged.
    let third_addr = free();
    let mut third = support::VllmEngine::bind(&context, third_addr);
    if feed == OurFeed::Engines {
        write_card(&cards, "other", "model-b", 0x23);
        advertise(&store, "other", 0x23, &format!("tcp://{third_addr}"));
    }
    let mut third_worker = worker("other", "model-b", third_addr);
    third_worker.expect("ready").await;
    until_both_subscribed(&mut third, &mut probe, &ours, &theirs, "model-b").await;
    third.publish(support::stored(&[21, 22, 23], None));
    both_find_of(&ours, &theirs, "model-b", &[21, 22, 23, 24], 3).await;
    both_find(&ours, &theirs, &[31, 32], 2).await;
    both_find(&ours, &theirs, &[11, 12], 2).await;
    assert_eq!(ours.pools().len(), 2, "{:?}", ours.pools());
    assert_eq!(theirs.pools().len(), 2, "{:?}", theirs.pools());
    third_worker.stop().await;

    ours.shutdown().await;
    theirs.shutdown().await;
    first_worker.stop().await;
    dynamo_relay.stop().await;
    relay.shutdown().await.unwrap();
}
