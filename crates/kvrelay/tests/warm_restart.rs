//! A `kvrelay relay` process killed with SIGKILL and restarted next to an engine whose
//! replay ring is shorter than its history (the conversation's root block is no longer
//! in it): with `[state]` checkpoints the restarted relay restores the pool and replays
//! only the batches it missed, and its resident blocks equal the engine's cache exactly;
//! with the checkpoint corrupted (discarded and counted) the same restart loses the pool,
//! as it did before checkpoints existed. A SIGTERM writes a final checkpoint.

use crate::support;

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::{RelayProcess, http_get, sample, stored, write_card};

const DEADLINE: Duration = Duration::from_secs(30);
const ENDPOINT: &str = "prod.backend.generate";
/// Batches the engine keeps for replay.
const RING: usize = 8;
/// Blocks per batch: batch `k` stores blocks `k*4+1 ..= k*4+4`, chained to batch `k-1`.
const BLOCKS_PER_BATCH: u64 = 4;

/// The replay ring: `(sequence, payload)` of the last [`RING`] batches.
type Ring = VecDeque<(u64, Vec<u8>)>;

/// A vLLM engine: PUB socket plus a ROUTER replay socket answering from a ring of the
/// last [`RING`] batches (vLLM's replay protocol).
struct ReplayingEngine {
    publisher: zmq::Socket,
    ring: Arc<Mutex<Ring>>,
    stop: Arc<AtomicBool>,
    server: Option<std::thread::JoinHandle<()>>,
    seq: u64,
}

impl ReplayingEngine {
    fn bind(context: &zmq::Context, publish: SocketAddr, replay: SocketAddr) -> Self {
        let publisher = context.socket(zmq::PUB).unwrap();
        publisher.set_linger(0).unwrap();
        publisher.bind(&format!("tcp://{publish}")).unwrap();
        let router = context.socket(zmq::ROUTER).unwrap();
        router.set_linger(0).unwrap();
        router.bind(&format!("tcp://{replay}")).unwrap();
        let ring: Arc<Mutex<Ring>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let server = {
            let (ring, stop) = (ring.clone(), stop.clone());
            std::thread::spawn(move || serve_replays(&router, &ring, &stop))
        };
        Self {
            publisher,
            ring,
            stop,
            server: Some(server),
            seq: 0,
        }
    }

    /// Publishes batch `self.seq`: blocks chained to the previous batch's last block.
    fn publish_next(&mut self) {
        use kvrelay_ingest::{EngineBatch, EngineKind, EngineLayout, encode_engine_batch};
        let first = self.seq * BLOCKS_PER_BATCH + 1;
        let ids: Vec<u64> = (first..first + BLOCKS_PER_BATCH).collect();
        let parent = self.seq.checked_sub(1).map(|_| first - 1);
        let batch = EngineBatch {
            ts: 0.0,
            events: vec![stored(&ids, parent)],
            dp_rank: Some(0),
        };
        let layout = EngineLayout {
            engine: EngineKind::Vllm,
            map_events: false,
            map_batch: false,
        };
        let mut payload = Vec::new();
        encode_engine_batch(&batch, layout, &mut payload);
        {
            let mut ring = self.ring.lock().unwrap();
            ring.push_back((self.seq, payload.clone()));
            while ring.len() > RING {
                ring.pop_front();
            }
        }
        let seq = self.seq.to_be_bytes();
        self.publisher
            .send_multipart([&b"kv-events"[..], &seq[..], &payload[..]], 0)
            .unwrap();
        self.seq += 1;
    }

    fn blocks(&self) -> u64 {
        self.seq * BLOCKS_PER_BATCH
    }
}

impl Drop for ReplayingEngine {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(server) = self.server.take() {
            let _ = server.join();
        }
    }
}

fn serve_replays(router: &zmq::Socket, ring: &Mutex<Ring>, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        if router.poll(zmq::POLLIN, 20).unwrap_or(0) == 0 {
            continue;
        }
        let Ok(frames) = router.recv_multipart(0) else {
            continue;
        };
        let identity = frames[0].clone();
        let start = u64::from_be_bytes(frames.last().unwrap()[..8].try_into().unwrap());
        let batches: Vec<(u64, Vec<u8>)> = ring
            .lock()
            .unwrap()
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .cloned()
            .collect();
        for (seq, payload) in batches {
            let seq = seq.to_be_bytes();
            let reply: Vec<&[u8]> = vec![&identity, b"", b"kv-events", &seq, &payload];
            if router.send_multipart(reply, 0).is_err() {
                break;
            }
        }
        let end: Vec<&[u8]> = vec![&identity, b"", b"", &[0xff; 8], b""];
        let _ = router.send_multipart(end, 0);
    }
}

fn free_addr() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// A relay's files (one worker's card, `relay.toml`) and its engine's two addresses.
struct Setup {
    dir: tempfile::TempDir,
    cards: std::path::PathBuf,
    config: std::path::PathBuf,
    publish: SocketAddr,
    replay: SocketAddr,
}

impl Setup {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let cards = dir.path().join("cards");
        std::fs::create_dir_all(&cards).unwrap();
        write_card(&cards, 4096);
        let config = dir.path().join("relay.toml");
        Self {
            dir,
            cards,
            config,
            publish: free_addr(),
            replay: free_addr(),
        }
    }

    /// Writes `relay.toml`: the engine's `[[sources]]` entry (its replay socket named),
    /// then `extra`.
    fn write_config(&self, extra: &str) {
        let (publish, replay) = (self.publish, self.replay);
        std::fs::write(
            &self.config,
            format!(
                "[[sources]]\nendpoint = \"{ENDPOINT}\"\nworker_id = 17\ndp_rank = 0\n\
                 engine = \"vllm\"\nzmq = \"tcp://{publish}\"\nreplay = \"tcp://{replay}\"\n\n\
                 {extra}"
            ),
        )
        .unwrap();
    }
}

async fn get(admin: SocketAddr, path: &str) -> (u16, String) {
    http_get(admin, path)
        .await
        .unwrap_or_else(|| panic!("GET {path} got no answer"))
}

/// Polls `path` every 20 ms until `accept` takes its body (bounded).
async fn poll_until<T>(
    relay: &RelayProcess,
    path: &str,
    mut accept: impl FnMut(&str) -> Option<T>,
) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (_, body) = get(relay.admin, path).await;
        if let Some(value) = accept(&body) {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "GET {path} never got there: {body}\nrelay log:\n{}",
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn start(cards: &Path, config: &Path) -> RelayProcess {
    RelayProcess::start_with_cards(
        cards.to_str().unwrap(),
        &[],
        &["--config", config.to_str().unwrap()],
        &[],
    )
    .await
}

/// The pool's stats once `accept` takes them.
async fn stats_until(
    relay: &RelayProcess,
    accept: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let pool = poll_until(relay, "/v1/pools", |body| {
        let listing: serde_json::Value = serde_json::from_str(body).ok()?;
        Some(listing["pools"].get(0)?["pool"].as_str()?.to_owned())
    })
    .await;
    poll_until(relay, &format!("/v1/pools/{pool}/stats"), |body| {
        let stats: serde_json::Value = serde_json::from_str(body).ok()?;
        accept(&stats).then_some(stats)
    })
    .await
}

async fn checkpoint_writes(relay: &RelayProcess) -> u64 {
    let (_, metrics) = get(relay.admin, "/metrics").await;
    sample(&metrics, "kvrelay_checkpoint_writes_total{outcome=\"ok\"}").unwrap_or(0)
}

/// Waits until two more checkpoints than now were written (so one began after now).
async fn wait_for_a_fresh_checkpoint(relay: &RelayProcess) {
    let before = checkpoint_writes(relay).await;
    poll_until(relay, "/metrics", |metrics| {
        let writes = sample(metrics, "kvrelay_checkpoint_writes_total{outcome=\"ok\"}")?;
        (writes >= before + 2).then_some(())
    })
    .await;
}

async fn kill(mut relay: RelayProcess) {
    relay.child.start_kill().unwrap();
    tokio::time::timeout(DEADLINE, relay.child.wait())
        .await
        .expect("the killed relay exits")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_relay_restarts_exact_from_its_checkpoint_past_a_short_replay_ring() {
    let setup = Setup::new();
    let state = setup.dir.path().join("state");
    setup.write_config(&format!(
        "[state]\ndir = \"{}\"\ncheckpoint_interval_ms = 100\n",
        state.display()
    ));
    let (cards, config) = (setup.cards.clone(), setup.config.clone());
    let context = zmq::Context::new();
    let mut engine = ReplayingEngine::bind(&context, setup.publish, setup.replay);

    // The first relay follows 12 batches (the ring keeps 8: from here on the root block
    // is only in the relay's state).
    let relay = start(&cards, &config).await;
    // The first batch lands live or through the join probe's replay; once it is resident
    // the subscription is in place and the rest arrive live.
    engine.publish_next();
    stats_until(&relay, |stats| {
        stats["stats"]["resident_blocks"] == BLOCKS_PER_BATCH
    })
    .await;
    for _ in 1..12 {
        engine.publish_next();
    }
    let total = engine.blocks();
    stats_until(&relay, |stats| stats["stats"]["resident_blocks"] == total).await;
    wait_for_a_fresh_checkpoint(&relay).await;
    kill(relay).await;

    // While it is down the engine stores 3 more batches.
    for _ in 0..3 {
        engine.publish_next();
    }
    let total = engine.blocks();
    let relay = start(&cards, &config).await;
    let restored = stats_until(&relay, |stats| stats["stats"]["resident_blocks"] == total).await;
    assert_eq!(restored["stats"]["unroutable_blocks"], 0, "{restored}");
    // Live batches after the restart land on the restored chain too.
    engine.publish_next();
    let total = engine.blocks();
    let live = stats_until(&relay, |stats| stats["stats"]["resident_blocks"] == total).await;
    assert_eq!(live["stats"]["unroutable_blocks"], 0, "{live}");
    let (_, metrics) = get(relay.admin, "/metrics").await;
    assert_eq!(
        sample(
            &metrics,
            "kvrelay_checkpoint_restores_total{outcome=\"restored\"}"
        ),
        Some(1),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "kvrelay_checkpoint_restored_mappings_total"),
        Some(12 * BLOCKS_PER_BATCH),
        "{metrics}"
    );
    assert!(relay.log().contains("pool restored from its checkpoint"));

    // SIGTERM writes a final checkpoint: with periodic checkpoints an hour apart, the
    // file written on the way out holds the batch published just before.
    wait_for_a_fresh_checkpoint(&relay).await;
    kill(relay).await;
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace(
            "checkpoint_interval_ms = 100",
            "checkpoint_interval_ms = 3600000",
        ),
    )
    .unwrap();
    let mut relay = start(&cards, &config).await;
    engine.publish_next();
    let total = engine.blocks();
    stats_until(&relay, |stats| stats["stats"]["resident_blocks"] == total).await;
    let pid = relay.child.id().unwrap();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    tokio::time::timeout(DEADLINE, relay.child.wait())
        .await
        .expect("the relay stops on SIGTERM")
        .unwrap();
    let file = std::fs::read_dir(&state)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.extension().is_some_and(|ext| ext == "ckpt"))
        .expect("a checkpoint file");
    let written = kvrelay_pool::PoolCheckpoint::decode(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(written.n_mappings(), total);
    assert_eq!(written.sources.len(), 1);
    assert_eq!(written.sources[0].last_sequence, engine.seq - 1);
    // With the digest of that batch's payload, by which a resume recognises the engine.
    let last = engine
        .ring
        .lock()
        .unwrap()
        .back()
        .map(|(_, payload)| kvrelay_ingest::batch_digest(payload));
    assert_eq!(Some(written.sources[0].last_digest), last);

    // A corrupt checkpoint is discarded and counted; without it the restart cannot
    // recover what the ring no longer holds (the pre-checkpoint behaviour).
    let mut bytes = std::fs::read(&file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&file, &bytes).unwrap();
    let relay = start(&cards, &config).await;
    poll_until(&relay, "/metrics", |metrics| {
        sample(
            metrics,
            "kvrelay_checkpoint_restores_total{outcome=\"checksum\"}",
        )
        .filter(|&n| n == 1)
    })
    .await;
    engine.publish_next();
    let lost = stats_until(&relay, |stats| {
        stats["stats"]["unroutable_blocks"].as_u64() > Some(0)
    })
    .await;
    assert!(
        lost["stats"]["resident_blocks"].as_u64().unwrap() < engine.blocks(),
        "{lost}"
    );
    assert!(relay.log().contains("checkpoint discarded"));

    // Every store from here on chains to blocks the relay lost, so the pool turns
    // degraded: readiness and the stats say so, and so does the catalog, which a consumer
    // following the relay shows on the pool (still answering: its replica is current).
    let consumer = support::quick_consumer(vec![kvrelay_consumer::RelayEndpoint::new(
        &relay.wan.to_string(),
        "dc-test",
    )]);
    let deadline = Instant::now() + DEADLINE;
    let pool = loop {
        engine.publish_next();
        if let Some(pool) = consumer
            .pools()
            .into_iter()
            .find(|pool| !pool.coverage.is_complete())
        {
            break pool;
        }
        assert!(
            Instant::now() < deadline,
            "the consumer never saw the pool degraded: {:?}\nrelay log:\n{}",
            consumer.pools(),
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(pool.coverage.as_str(), "degraded");
    assert!(pool.coverage.unroutable_percent() >= 50, "{pool:?}");
    let (status, body) = get(relay.admin, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("degraded"), "{body}");
    let degraded = stats_until(&relay, |stats| !stats["degraded"].is_null()).await;
    assert!(
        degraded["degraded"]["unroutable_events"].as_u64() > Some(0),
        "{degraded}"
    );
}

/// A relay started next to an idle engine that published before it came up: until the
/// quiet join's replay has recovered the engine's history, the pool is recovering (the
/// relay's readiness names it, a consumer following it sees it), then complete with every
/// block the engine holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_is_recovering_until_its_engines_history_is_replayed() {
    let setup = Setup::new();
    // The quiet join waits 2 s, so the recovering window is wide enough to watch.
    setup.write_config("[ingest]\ntail_probe_idle_ms = 2000\n");
    let (cards, config) = (setup.cards.clone(), setup.config.clone());
    let context = zmq::Context::new();
    let mut engine = ReplayingEngine::bind(&context, setup.publish, setup.replay);
    for _ in 0..5 {
        engine.publish_next();
    }
    let relay = start(&cards, &config).await;
    let consumer = support::quick_consumer(vec![kvrelay_consumer::RelayEndpoint::new(
        &relay.wan.to_string(),
        "dc-test",
    )]);
    let coverage =
        |consumer: &kvrelay_consumer::Consumer| consumer.pools().first().map(|pool| pool.coverage);
    let deadline = Instant::now() + DEADLINE;
    while coverage(&consumer) != Some(kvrelay_consumer::Coverage::Recovering) {
        assert!(
            Instant::now() < deadline,
            "the consumer never saw the pool recovering: {:?}\nrelay log:\n{}",
            consumer.pools(),
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, body) = get(relay.admin, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("recovering"), "{body}");

    // The quiet join's replay recovers the five batches: complete, every block resident.
    while coverage(&consumer) != Some(kvrelay_consumer::Coverage::Complete) {
        assert!(
            Instant::now() < deadline,
            "the pool never became complete: {:?}\nrelay log:\n{}",
            consumer.pools(),
            relay.log()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let total = engine.blocks();
    let stats = stats_until(&relay, |stats| stats["stats"]["resident_blocks"] == total).await;
    assert_eq!(stats["joining_sources"], 0, "{stats}");
    assert_eq!(stats["stats"]["unroutable_blocks"], 0, "{stats}");
    poll_until(&relay, "/readyz", |body| {
        body.contains("\"ready\":true").then_some(())
    })
    .await;
}
