//! A real ZMQ publisher and replay ROUTER on loopback (the test plays the engine): dropped
//! messages create gaps, the publisher restarts with a reset sequence, and the ingested
//! state must equal the publisher's ground truth afterwards.
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kvrelay_ckf::{EventPayload, RouterEvent, SourceId};
use kvrelay_identity::KvQueryHashFormat;
use kvrelay_ingest::{
    BlockRemoved, BlockStored, CanonicalConfig, Canonicalizer, EngineBatch, EngineBlockHash,
    EngineEvent, EngineKind, EngineLayout, Limits, RejectionKind, ResetReason, SourceHandle,
    SourceOutput, SourceSignal, SourceState, TokenIds, ZmqSourceConfig, ZmqWire,
    encode_engine_batch, encode_event_plane, spawn_zmq_source,
};

const BLOCK_SIZE: u32 = 4;
const TOPIC: &str = "kv-events";
const LAYOUT: EngineLayout = EngineLayout {
    engine: EngineKind::Vllm,
    map_events: true,
    map_batch: false,
};

fn canonical() -> CanonicalConfig {
    CanonicalConfig::new(BLOCK_SIZE, KvQueryHashFormat::DynamoStandardV1)
}

/// Exact per-source state: engine block id → token hash.
type State = BTreeMap<SourceId, BTreeMap<u64, u64>>;

fn apply(state: &mut State, event: &RouterEvent) {
    let blocks = state.entry(event.source).or_default();
    match &event.payload {
        EventPayload::Stored(stored) => {
            for block in &stored.blocks {
                blocks.insert(block.engine_block_id, block.token_hash);
            }
        }
        EventPayload::Removed(removed) => {
            for id in &removed.engine_block_ids {
                blocks.remove(id);
            }
        }
        EventPayload::AllCleared => blocks.clear(),
    }
    state.retain(|_, blocks| !blocks.is_empty());
}

/// The test's engine, on libzmq like the real engines (pyzmq): a PUB socket, a ROUTER
/// replay server on its own thread, and the replay history.
struct FakeEngine {
    publisher: zmq::Socket,
    history: Arc<Mutex<Vec<(u64, Bytes)>>>,
    replay_server: Option<std::thread::JoinHandle<()>>,
    stop_replays: Arc<AtomicBool>,
    next_seq: u64,
    /// Ground truth of this incarnation.
    truth: State,
    canonicalizer: Canonicalizer,
}

impl FakeEngine {
    /// Binds the PUB and ROUTER sockets (`tcp://127.0.0.1:*` picks free ports).
    async fn start(pub_endpoint: &str, replay_endpoint: &str) -> (Self, String, String) {
        let ctx = zmq::Context::new();
        let publisher = ctx.socket(zmq::PUB).expect("pub socket");
        publisher.set_linger(0).unwrap();
        publisher.set_sndhwm(100_000).unwrap();
        bind_retrying(&publisher, pub_endpoint).await;
        let bound_pub = publisher.get_last_endpoint().unwrap().unwrap();
        let router = ctx.socket(zmq::ROUTER).expect("router socket");
        router.set_linger(0).unwrap();
        bind_retrying(&router, replay_endpoint).await;
        let bound_replay = router.get_last_endpoint().unwrap().unwrap();
        let history: Arc<Mutex<Vec<(u64, Bytes)>>> = Arc::default();
        let stop_replays = Arc::new(AtomicBool::new(false));
        let replay_server = {
            let (history, stop) = (history.clone(), stop_replays.clone());
            std::thread::spawn(move || serve_replays(router, history, stop))
        };
        let engine = Self {
            publisher,
            history,
            replay_server: Some(replay_server),
            stop_replays,
            next_seq: 0,
            truth: State::new(),
            canonicalizer: Canonicalizer::new(1, 0, canonical()),
        };
        (engine, bound_pub, bound_replay)
    }

    /// Publishes (or, with `drop`, only records for replay) the next batch.
    async fn publish(&mut self, events: Vec<EngineEvent>, drop: bool) {
        let batch = EngineBatch {
            ts: 0.0,
            events,
            dp_rank: Some(0),
        };
        let mut out = Vec::new();
        self.canonicalizer.canonicalize(&batch, &mut out);
        for event in &out {
            apply(
                &mut self.truth,
                event.as_device().expect("device events only"),
            );
        }
        let mut payload = Vec::new();
        encode_engine_batch(&batch, LAYOUT, &mut payload);
        let payload = Bytes::from(payload);
        let seq = self.next_seq;
        self.next_seq += 1;
        self.history.lock().unwrap().push((seq, payload.clone()));
        if !drop {
            self.send_raw(vec![
                Bytes::from_static(TOPIC.as_bytes()),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ])
            .await;
        }
    }

    /// Sends raw frames on the PUB socket (for malformed input).
    async fn send_raw(&mut self, frames: Vec<Bytes>) {
        let parts: Vec<&[u8]> = frames.iter().map(|f| &f[..]).collect();
        self.publisher.send_multipart(parts, 0).unwrap();
    }

    /// Stops the engine and releases its ports.
    async fn stop(mut self) {
        self.stop_replays.store(true, Ordering::Relaxed);
        if let Some(server) = self.replay_server.take() {
            server.join().unwrap();
        }
    }
}

/// Binds `endpoint`, retrying briefly while a previous incarnation's port is released.
async fn bind_retrying(socket: &zmq::Socket, endpoint: &str) {
    for _ in 0..100 {
        if socket.bind(endpoint).is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("could not bind {endpoint}");
}

fn serve_replays(
    router: zmq::Socket,
    history: Arc<Mutex<Vec<(u64, Bytes)>>>,
    stop: Arc<AtomicBool>,
) {
    while !stop.load(Ordering::Relaxed) {
        if router.poll(zmq::POLLIN, 20).unwrap() == 0 {
            continue;
        }
        let frames = router.recv_multipart(0).unwrap();
        let identity = frames[0].clone();
        let start = u64::from_be_bytes(frames.last().unwrap()[..8].try_into().unwrap());
        let batches: Vec<(u64, Bytes)> = history
            .lock()
            .unwrap()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let seq = seq.to_be_bytes();
            let reply: Vec<&[u8]> = vec![&identity, b"", TOPIC.as_bytes(), &seq, &payload];
            if router.send_multipart(reply, 0).is_err() {
                break;
            }
        }
        let end: Vec<&[u8]> = vec![&identity, b"", b"", &[0xff; 8], b""];
        let _ = router.send_multipart(end, 0);
    }
}

fn stored(ids: &[u64], parent: Option<u64>, salt: u32) -> EngineEvent {
    let tokens = (0..ids.len() as u32 * BLOCK_SIZE)
        .map(|t| t + salt * 1000)
        .collect();
    EngineEvent::BlockStored(BlockStored {
        medium: Some("GPU".to_owned()),
        ..BlockStored::new(
            ids.iter().copied().map(EngineBlockHash::unsigned).collect(),
            parent.map(EngineBlockHash::unsigned),
            TokenIds::Flat(tokens),
            BLOCK_SIZE,
        )
    })
}

fn removed(ids: &[u64]) -> EngineEvent {
    EngineEvent::BlockRemoved(BlockRemoved {
        block_hashes: ids.iter().copied().map(EngineBlockHash::unsigned).collect(),
        medium: Some("GPU".to_owned()),
        group_idx: None,
    })
}

/// Drives the source until the ingested state equals the engine's truth, publishing an
/// empty batch on every tick as an idle engine would; fails after a deadline.
async fn converge(
    source: &mut SourceHandle,
    engine: &mut FakeEngine,
    state: &mut State,
    signals: &mut Vec<SourceSignal>,
    what: &str,
) {
    drive_until_truth(source, engine, state, signals, what, true).await;
}

/// Drives the source until the ingested state equals the engine's truth; with
/// `idle_batches` the engine publishes an empty batch every 100 ms, without it nothing
/// (so no live batch can reveal a gap and only a probe can recover it). Fails after a
/// deadline, naming `what`.
async fn drive_until_truth(
    source: &mut SourceHandle,
    engine: &mut FakeEngine,
    state: &mut State,
    signals: &mut Vec<SourceSignal>,
    what: &str,
    idle_batches: bool,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    while *state != engine.truth {
        tokio::select! {
            () = tokio::time::sleep_until(deadline) => {
                panic!("{what}: ingested state never matched the engine\n ingested {state:?}\n truth {:?}\n signals {signals:?}\n stats {:?}", engine.truth, source.stats());
            }
            output = source.next() => match output.expect("source stopped") {
                SourceOutput::Event(event) => apply(state, &event),
                SourceOutput::Signal(signal) => signals.push(signal),
                SourceOutput::Applied { .. } => {}
                SourceOutput::Tier(event) => panic!("{what}: lower tiers are off: {event:?}"),
            },
            _ = tick.tick(), if idle_batches => engine.publish(Vec::new(), false).await,
        }
    }
}

/// A source with a replay endpoint that probes after 200 ms of silence.
/// Takes every output `source` has ready, keeping its signals in `signals`.
fn collect_signals(source: &mut SourceHandle, signals: &mut Vec<SourceSignal>) {
    while let Some(output) = source.try_next() {
        if let SourceOutput::Signal(signal) = output {
            signals.push(signal);
        }
    }
}

/// A vLLM source of worker 1 on `pub_endpoint` with no replay endpoint.
fn source_without_replay(pub_endpoint: String) -> SourceHandle {
    spawn_zmq_source(ZmqSourceConfig {
        worker_id: 1,
        dp_rank: 0,
        wire: ZmqWire::Engine(EngineKind::Vllm),
        endpoint: pub_endpoint,
        replay_endpoint: None,
        topic: TOPIC.to_owned(),
        canonical: canonical(),
        limits: Limits::default(),
        declared_ranks: 0..1,
        fault: Default::default(),
        resume_after: None,
        queue_budget: None,
    })
}

fn probing_source(pub_endpoint: String, replay_endpoint: String) -> SourceHandle {
    spawn_zmq_source(probing_config(pub_endpoint, replay_endpoint))
}

/// [`probing_source`]'s configuration.
fn probing_config(pub_endpoint: String, replay_endpoint: String) -> ZmqSourceConfig {
    ZmqSourceConfig {
        worker_id: 1,
        dp_rank: 0,
        wire: ZmqWire::Engine(EngineKind::Vllm),
        endpoint: pub_endpoint,
        replay_endpoint: Some(replay_endpoint),
        topic: TOPIC.to_owned(),
        canonical: canonical(),
        limits: Limits {
            tail_probe_idle_ms: 200,
            ..Limits::default()
        },
        declared_ranks: 0..1,
        fault: Default::default(),
        resume_after: None,
        queue_budget: None,
    }
}

/// Drains the source until its stats satisfy `done` (bounded); returns them.
async fn stats_until(
    source: &mut SourceHandle,
    done: impl Fn(&kvrelay_ingest::SourceStats) -> bool,
) -> kvrelay_ingest::SourceStats {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let stats = source.stats();
        if done(&stats) {
            return stats;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "stats never got there: {stats:?}"
        );
        while source.try_next().is_some() {}
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gaps_are_replayed_and_a_restart_resets_to_the_new_truth() {
    let (mut engine, pub_endpoint, replay_endpoint) =
        FakeEngine::start("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").await;
    let limits = Limits {
        replay_timeout_ms: 5_000,
        ..Limits::default()
    };
    let mut source = spawn_zmq_source(ZmqSourceConfig {
        worker_id: 1,
        dp_rank: 0,
        wire: ZmqWire::Engine(EngineKind::Vllm),
        endpoint: pub_endpoint.clone(),
        replay_endpoint: Some(replay_endpoint.clone()),
        topic: TOPIC.to_owned(),
        canonical: canonical(),
        limits,
        declared_ranks: 0..1,
        fault: Default::default(),
        resume_after: None,
        queue_budget: None,
    });
    let mut state = State::new();
    let mut signals = Vec::new();

    // Phase 1: twenty batches, some dropped on the live path (only the replay has them).
    let mut ids_by_batch: HashMap<u64, Vec<u64>> = HashMap::new();
    for batch_idx in 0..20u64 {
        let ids = [batch_idx * 10 + 1, batch_idx * 10 + 2];
        ids_by_batch.insert(batch_idx, ids.to_vec());
        let mut events = vec![stored(&ids, None, batch_idx as u32)];
        if batch_idx >= 2 && batch_idx % 3 == 0 {
            events.push(removed(&ids_by_batch[&(batch_idx - 2)][..1]));
        }
        let drop = matches!(batch_idx, 3 | 4 | 9 | 15);
        engine.publish(events, drop).await;
    }
    converge(
        &mut source,
        &mut engine,
        &mut state,
        &mut signals,
        "after gaps",
    )
    .await;
    let stats = source.stats();
    assert!(stats.n_replays >= 1, "{stats:?}");

    // Phase 2: the engine restarts on the same ports with a fresh sequence and new content.
    engine.stop().await;
    let (mut engine, _, _) = FakeEngine::start(&pub_endpoint, &replay_endpoint).await;
    engine
        .publish(vec![stored(&[9001, 9002], None, 77)], false)
        .await;
    engine
        .publish(vec![stored(&[9003], Some(9002), 78)], false)
        .await;
    engine.publish(vec![removed(&[9001])], false).await;
    converge(
        &mut source,
        &mut engine,
        &mut state,
        &mut signals,
        "after restart",
    )
    .await;
    let stats = source.stats();
    assert!(stats.n_resets >= 1, "{stats:?}");
    assert!(
        signals
            .iter()
            .any(|s| matches!(s, SourceSignal::Reset { .. })),
        "{signals:?}"
    );
    assert_eq!(stats.n_rejected(), 0, "{stats:?}");
    assert!(source.shutdown().await, "source tasks did not stop");
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_counted_per_kind_and_the_source_continues() {
    let (mut engine, pub_endpoint, replay_endpoint) =
        FakeEngine::start("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").await;
    // The replay endpoint lets a slow subscription recover the first batch.
    let mut source = spawn_zmq_source(ZmqSourceConfig {
        worker_id: 1,
        dp_rank: 0,
        wire: ZmqWire::Engine(EngineKind::Vllm),
        endpoint: pub_endpoint,
        replay_endpoint: Some(replay_endpoint),
        topic: TOPIC.to_owned(),
        canonical: canonical(),
        limits: Limits::default(),
        declared_ranks: 0..1,
        fault: Default::default(),
        resume_after: None,
        queue_budget: None,
    });
    let mut state = State::new();
    let mut signals = Vec::new();
    engine.publish(vec![stored(&[1, 2], None, 0)], false).await;
    converge(
        &mut source,
        &mut engine,
        &mut state,
        &mut signals,
        "first batch",
    )
    .await;

    let topic = Bytes::from_static(TOPIC.as_bytes());
    let seq = |n: u64| Bytes::copy_from_slice(&n.to_be_bytes());
    // A 4-byte sequence frame, a payload that is not msgpack, a batch of the wrong shape,
    // and a stored event whose block size is not the pool's.
    engine
        .send_raw(vec![
            topic.clone(),
            Bytes::from_static(&[0, 0, 0, 1]),
            Bytes::new(),
        ])
        .await;
    engine.next_seq += 1;
    engine
        .send_raw(vec![
            topic.clone(),
            seq(engine.next_seq - 1),
            Bytes::from_static(&[0xc1]),
        ])
        .await;
    engine.next_seq += 1;
    engine
        .send_raw(vec![
            topic.clone(),
            seq(engine.next_seq - 1),
            Bytes::from_static(&[0x07]),
        ])
        .await;
    let mut wrong_size = stored(&[3], Some(2), 1);
    if let EngineEvent::BlockStored(event) = &mut wrong_size {
        event.block_size = 8;
        event.token_ids = TokenIds::Flat((0..8).collect());
    }
    let batch = EngineBatch {
        ts: 0.0,
        events: vec![wrong_size],
        dp_rank: Some(0),
    };
    let mut payload = Vec::new();
    encode_engine_batch(&batch, LAYOUT, &mut payload);
    engine
        .send_raw(vec![topic, seq(engine.next_seq), Bytes::from(payload)])
        .await;
    engine.next_seq += 1;
    // A good batch after all of them still applies.
    engine.publish(vec![removed(&[1])], false).await;
    converge(
        &mut source,
        &mut engine,
        &mut state,
        &mut signals,
        "after malformed",
    )
    .await;
    let stats = source.stats();
    assert_eq!(stats.rejected(RejectionKind::Framing), 1, "{stats:?}");
    assert_eq!(stats.rejected(RejectionKind::Malformed), 1, "{stats:?}");
    assert_eq!(stats.rejected(RejectionKind::Schema), 1, "{stats:?}");
    assert_eq!(stats.rejected(RejectionKind::Canonicalize), 1, "{stats:?}");
    assert!(source.shutdown().await);
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_replay_endpoint_a_publisher_gone_after_batches_counts_an_unverified_tail() {
    let (mut engine, pub_endpoint, _replay_endpoint) =
        FakeEngine::start("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").await;
    let mut source = source_without_replay(pub_endpoint);
    // Publish until the source has applied something (a slow subscription misses the
    // first batches, which nothing can recover without a replay endpoint).
    for batch_idx in 0..200u64 {
        engine
            .publish(vec![stored(&[batch_idx + 1], None, 0)], false)
            .await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        if source.stats().n_events > 0 {
            break;
        }
    }
    assert!(source.stats().n_events > 0);
    engine.stop().await;
    for _ in 0..400 {
        if source.stats().n_unverified_tails > 0 {
            break;
        }
        while source.try_next().is_some() {}
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let stats = source.stats();
    assert_eq!(stats.n_unverified_tails, 1, "{stats:?}");
    assert!(stats.n_disconnects >= 1, "{stats:?}");
    assert!(source.shutdown().await);
}

/// An engine that restarts on the same port and stays idle publishes nothing that would
/// reveal the restart: without a replay endpoint the reconnect itself resets the source,
/// so the new engine is never credited with its predecessor's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_restarted_engine_without_replay_is_not_credited_with_old_blocks() {
    let (mut engine, pub_endpoint, _replay_endpoint) =
        FakeEngine::start("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").await;
    let mut source = source_without_replay(pub_endpoint.clone());
    let mut signals = Vec::new();
    for batch_idx in 0..200u64 {
        engine
            .publish(vec![stored(&[batch_idx + 1], None, 0)], false)
            .await;
        tokio::time::sleep(Duration::from_millis(10)).await;
        collect_signals(&mut source, &mut signals);
        if source.stats().n_events > 0 {
            break;
        }
    }
    assert!(source.stats().n_events > 0);
    assert_eq!(source.stats().resets("reconnected_unverified"), 0);

    // The engine restarts on the same port and publishes nothing.
    engine.stop().await;
    let (restarted, _, _) = FakeEngine::start(&pub_endpoint, "tcp://127.0.0.1:*").await;
    for _ in 0..400 {
        collect_signals(&mut source, &mut signals);
        if source.stats().resets("reconnected_unverified") > 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let stats = source.stats();
    assert_eq!(stats.resets("reconnected_unverified"), 1, "{stats:?}");
    collect_signals(&mut source, &mut signals);
    assert!(
        signals.iter().any(|signal| matches!(
            signal,
            SourceSignal::Reset { sources, reason: ResetReason::ReconnectedUnverified }
                if !sources.is_empty()
        )),
        "{signals:?}"
    );
    assert!(source.shutdown().await);
    restarted.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_joining_an_idle_engine_recovers_what_it_published_before() {
    let (mut engine, pub_endpoint, replay_endpoint) =
        FakeEngine::start("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").await;
    // Everything is published before the relay subscribes (nobody receives it live), and
    // the engine stays quiet afterwards: no live batch will ever show a gap.
    for batch_idx in 0..12u64 {
        let ids = [batch_idx * 10 + 1, batch_idx * 10 + 2];
        let parent = batch_idx.checked_sub(1).map(|prev| prev * 10 + 2);
        engine
            .publish(vec![stored(&ids, parent, batch_idx as u32)], true)
            .await;
    }
    engine.publish(vec![removed(&[1])], true).await;
    let mut source = probing_source(pub_endpoint, replay_endpoint);
    // Connected to an engine that has published nothing since: joining (what the source
    // holds is not the engine's history yet) until the quiet join's replay has ended.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while source.state() != SourceState::Joining {
        assert!(
            std::time::Instant::now() < deadline,
            "never joining: {:?}",
            source.state()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut state = State::new();
    let mut signals = Vec::new();
    drive_until_truth(
        &mut source,
        &mut engine,
        &mut state,
        &mut signals,
        "the join probe",
        false,
    )
    .await;
    // The replay's outcome is counted when its end marker arrives, just after its last
    // batch.
    let stats = stats_until(&mut source, |stats| {
        stats.replays(kvrelay_ingest::ReplayOutcome::Recovered) == 1
    })
    .await;
    assert_eq!(stats.n_messages, 13, "{stats:?}");
    assert_eq!(stats.n_gaps, 0, "{stats:?}");
    assert_eq!(stats.n_resets, 0, "{stats:?}");
    assert_eq!(stats.n_replays, 1, "{stats:?}");
    assert_eq!(source.state(), SourceState::Connected, "joined");
    assert!(source.shutdown().await, "source tasks did not stop");
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tail_the_publisher_never_sent_is_fetched_by_the_idle_probe() {
    let (mut engine, pub_endpoint, replay_endpoint) =
        FakeEngine::start("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").await;
    let mut source = probing_source(pub_endpoint, replay_endpoint);
    let mut state = State::new();
    let mut signals = Vec::new();
    engine.publish(vec![stored(&[1, 2], None, 1)], false).await;
    converge(&mut source, &mut engine, &mut state, &mut signals, "live").await;
    let before = source.stats();

    // The engine's last batches stay queued on its side (it stopped before sending them)
    // while its replay socket stays up; no later batch will reveal a gap.
    engine.publish(vec![stored(&[3], Some(2), 2)], true).await;
    engine.publish(vec![removed(&[1])], true).await;
    engine.publish(vec![stored(&[4, 5], None, 3)], true).await;
    drive_until_truth(
        &mut source,
        &mut engine,
        &mut state,
        &mut signals,
        "the tail probe",
        false,
    )
    .await;
    let recovered_before = before.replays(kvrelay_ingest::ReplayOutcome::Recovered);
    let after = stats_until(&mut source, |stats| {
        stats.replays(kvrelay_ingest::ReplayOutcome::Recovered) > recovered_before
    })
    .await;
    assert_eq!(
        after.n_gaps, before.n_gaps,
        "no live batch showed a gap: {after:?}"
    );
    assert_eq!(after.n_resets, before.n_resets, "{after:?}");
    assert!(source.shutdown().await, "source tasks did not stop");
    engine.stop().await;
}

/// A Dynamo worker's event plane on a real libzmq PUB socket: the advertised publisher's
/// events arrive as Dynamo hashed them; another publisher's messages, events of another
/// worker and a broken frame are rejected and counted, each whole, and the source goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dynamo_event_plane_publisher_feeds_the_source_and_strangers_are_refused() {
    const PUBLISHER: u64 = 0x001a_a34c_1462_3e6e;
    const WORKER: u64 = 7;
    let context = zmq::Context::new();
    let publisher = context.socket(zmq::PUB).unwrap();
    publisher.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = publisher.get_last_endpoint().unwrap().unwrap();
    let mut source = spawn_zmq_source(ZmqSourceConfig {
        worker_id: WORKER,
        dp_rank: 0,
        wire: ZmqWire::DynamoEventPlane {
            publisher_id: PUBLISHER,
        },
        endpoint,
        replay_endpoint: None,
        topic: String::new(),
        canonical: canonical(),
        limits: Limits::default(),
        declared_ranks: 0..1,
        fault: Default::default(),
        resume_after: None,
        queue_budget: None,
    });
    let stored = |worker: u64, event_id: u64, ids: &[u64]| RouterEvent {
        source: SourceId::new(worker, 0),
        event_id,
        payload: EventPayload::Stored(kvrelay_ckf::StoredBlocks {
            parent_engine_block_id: None,
            blocks: ids
                .iter()
                .map(|id| kvrelay_ckf::StoredBlock {
                    engine_block_id: *id,
                    token_hash: id * 1_000,
                })
                .collect(),
        }),
    };
    let send = |frames: [Bytes; 4]| {
        let frames: Vec<Vec<u8>> = frames.iter().map(|frame| frame.to_vec()).collect();
        publisher.send_multipart(frames, 0).unwrap();
    };
    // Until the subscription is up: fresh blocks of the advertised publisher.
    let mut seq = 0u64;
    let mut state = State::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while state.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "nothing arrived");
        send(encode_event_plane(
            PUBLISHER,
            seq,
            &[stored(WORKER, seq, &[1, 2])],
        ));
        seq += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
        while let Some(output) = source.try_next() {
            if let SourceOutput::Event(event) = output {
                apply(&mut state, &event);
            }
        }
    }
    assert_eq!(
        state[&SourceId::new(WORKER, 0)],
        BTreeMap::from([(1, 1_000), (2, 2_000)]),
        "Dynamo's block hashes pass through"
    );
    // A stranger on the socket, another worker's events, a frame of an unknown version.
    send(encode_event_plane(
        PUBLISHER + 1,
        seq,
        &[stored(WORKER, 90, &[9])],
    ));
    send(encode_event_plane(
        PUBLISHER,
        seq,
        &[stored(WORKER, 91, &[3]), stored(WORKER + 1, 92, &[4])],
    ));
    seq += 1;
    let mut bad = encode_event_plane(PUBLISHER, seq, &[stored(WORKER, 93, &[5])]);
    let mut frame = bad[3].to_vec();
    frame[0] = 9;
    bad[3] = Bytes::from(frame);
    send(bad);
    seq += 1;
    send(encode_event_plane(
        PUBLISHER,
        seq,
        &[stored(WORKER, 94, &[6])],
    ));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !state[&SourceId::new(WORKER, 0)].contains_key(&6) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the good message after the bad never arrived"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
        while let Some(output) = source.try_next() {
            if let SourceOutput::Event(event) = output {
                apply(&mut state, &event);
            }
        }
    }
    let blocks: Vec<u64> = state[&SourceId::new(WORKER, 0)].keys().copied().collect();
    assert_eq!(
        blocks,
        [1, 2, 6],
        "nothing of a refused message was applied"
    );
    assert_eq!(state.len(), 1, "no other worker's blocks");
    let stats = source.stats();
    assert_eq!(stats.rejected(RejectionKind::Framing), 2, "{stats:?}");
    assert_eq!(
        stats.rejected(RejectionKind::UndeclaredWorker),
        1,
        "{stats:?}"
    );
    assert!(source.shutdown().await);
}

fn resuming_source(
    pub_endpoint: String,
    replay_endpoint: String,
    after: kvrelay_ingest::ResumePoint,
) -> SourceHandle {
    spawn_zmq_source(ZmqSourceConfig {
        resume_after: Some(after),
        ..probing_config(pub_endpoint, replay_endpoint)
    })
}

/// A relay that checkpointed its state and the last applied batch, then went away while
/// the engine kept publishing and its replay ring moved past the conversation's root,
/// resumes after the checkpoint: it replays only the batches it missed and reaches the
/// engine's truth exactly without a reset. A checkpoint older than the ring resets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_resumed_after_a_checkpoint_catches_up_past_a_short_ring() {
    let (mut engine, pub_endpoint, replay_endpoint) =
        FakeEngine::start("tcp://127.0.0.1:*", "tcp://127.0.0.1:*").await;
    let chained = |batch_idx: u64| {
        let ids = [batch_idx * 10 + 1, batch_idx * 10 + 2];
        let parent = batch_idx.checked_sub(1).map(|prev| prev * 10 + 2);
        vec![stored(&ids, parent, batch_idx as u32)]
    };
    // The first relay follows batches 0..12 live and sees each one's `Applied`.
    let mut first = probing_source(pub_endpoint.clone(), replay_endpoint.clone());
    let mut checkpoint = State::new();
    let mut last_applied = None;
    let mut last_digest = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let mut published = 0u64;
    while last_applied != Some(11) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "never applied batch 11"
        );
        if published < 12 {
            engine.publish(chained(published), false).await;
            published += 1;
        }
        match tokio::time::timeout(Duration::from_millis(100), first.next()).await {
            Ok(Some(SourceOutput::Event(event))) => apply(&mut checkpoint, &event),
            Ok(Some(SourceOutput::Applied { seq, digest })) => {
                assert!(last_applied < Some(seq), "{seq} after {last_applied:?}");
                let (_, payload) = engine.history.lock().unwrap()[seq as usize].clone();
                assert_eq!(digest, kvrelay_ingest::batch_digest(&payload));
                last_applied = Some(seq);
                last_digest = digest;
            }
            Ok(Some(SourceOutput::Signal(_))) | Err(_) => {}
            Ok(Some(SourceOutput::Tier(event))) => panic!("lower tiers are off: {event:?}"),
            Ok(None) => panic!("source stopped"),
        }
    }
    assert_eq!(
        checkpoint, engine.truth,
        "every event precedes its batch's Applied"
    );
    assert!(first.shutdown().await);

    // While no relay listens the engine publishes on, and its ring forgets batches 0..14.
    for batch_idx in 12..17 {
        engine.publish(chained(batch_idx), false).await;
    }
    engine.history.lock().unwrap().retain(|(seq, _)| *seq >= 10);

    let point = |last_applied, digest| kvrelay_ingest::ResumePoint {
        last_applied,
        digest,
    };
    let mut resumed = resuming_source(
        pub_endpoint.clone(),
        replay_endpoint.clone(),
        point(11, last_digest),
    );
    let mut state = checkpoint.clone();
    let mut signals = Vec::new();
    converge(
        &mut resumed,
        &mut engine,
        &mut state,
        &mut signals,
        "the resume",
    )
    .await;
    let stats = resumed.stats();
    assert_eq!(stats.n_resets, 0, "{stats:?} {signals:?}");
    assert!(resumed.shutdown().await);

    // A checkpoint from before the ring's first batch cannot be completed, and one whose
    // batch the engine replays differently is another engine's: each resets the source.
    let cases = [
        (
            point(5, 0),
            kvrelay_ingest::ResetReason::ReplayIncomplete {
                expected: 6,
                got: 10,
            },
        ),
        (
            point(11, last_digest ^ 1),
            kvrelay_ingest::ResetReason::ResumeMismatch { seq: 11 },
        ),
    ];
    for (point, expected) in cases {
        let mut stale = resuming_source(pub_endpoint.clone(), replay_endpoint.clone(), point);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no reset for {point:?}"
            );
            match tokio::time::timeout(Duration::from_millis(100), stale.next()).await {
                Ok(Some(SourceOutput::Signal(SourceSignal::Reset { reason, sources }))) => {
                    assert_eq!(reason, expected);
                    assert_eq!(sources, vec![SourceId::new(1, 0)]);
                    break;
                }
                Ok(None) => panic!("source stopped"),
                _ => {}
            }
        }
        assert!(stale.shutdown().await);
    }
    engine.stop().await;
}
