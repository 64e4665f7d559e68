//! Reconnect after a network outage, resume vs snapshot, on loopback: a relay with one
//! pool of ~1 M resident blocks under a steady event load, a `kvrelay_consumer::Consumer`
//! behind a byte-counting TCP proxy. The proxy cuts every connection for `OUTAGE` and then
//! lets the consumer back in; we measure the bytes the relay sent through the proxy and
//! the time until the consumer's replica is current again at (or past) the relay's
//! sequence at the moment the network came back.
//!
//! Run twice in one process: with the default resume window (the consumer resumes with
//! one coalesced delta) and with `resume_window_bytes = 0` (every pool starts over from a
//! snapshot). Prints one JSON object. `cargo run --release -p kvrelay-benches --example
//! outage`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a benchmark binary fails loudly"
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvrelay_benches::events::ChainGenerator;
use kvrelay_consumer::{BackoffConfig, Consumer, ConsumerConfig, ReplicaState};
use kvrelay_server::{Relay, RelayConfig, WorkloadConfig};

/// How long the network is down.
const OUTAGE: Duration = Duration::from_secs(2);
/// Workers of the pool, each with this many KV blocks (4 × 262,144 ≈ 1 M blocks).
const WORKERS: u64 = 4;
const BLOCKS_PER_WORKER: u64 = 262_144;
/// Blocks per stored event.
const BLOCKS_PER_EVENT: u64 = 16;
/// Stored events kept resident per source before its oldest is removed (fills the pool).
const RESIDENT_EVENTS: u64 = BLOCKS_PER_WORKER / BLOCKS_PER_EVENT;
/// The steady load while the consumer follows: stored events per second (each also
/// removes one once a source is full).
const LOAD_EVENTS_PER_S: u64 = 2_000;
/// Bound on every wait.
const DEADLINE: Duration = Duration::from_secs(60);

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let resume = runtime.block_on(run(None));
    let snapshot = runtime.block_on(run(Some(0)));
    let figures = serde_json::json!({
        "outage_ms": OUTAGE.as_millis() as u64,
        "resident_blocks": resume.resident_blocks,
        "bucket_count": resume.bucket_count,
        "resume": resume.json(),
        "snapshot": snapshot.json(),
        "bytes_ratio_snapshot_over_resume": snapshot.bytes as f64 / resume.bytes.max(1) as f64,
    });
    println!("{}", serde_json::to_string_pretty(&figures).unwrap());
}

struct Outcome {
    resident_blocks: u64,
    bucket_count: u64,
    bytes: u64,
    time_to_current: Duration,
    snapshots_installed: u64,
}

impl Outcome {
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "bytes_after_reconnect": self.bytes,
            "time_to_current_ms": self.time_to_current.as_secs_f64() * 1e3,
            "snapshots_installed_after_reconnect": self.snapshots_installed,
        })
    }
}

/// A loopback proxy that counts the bytes sent towards the client and can be taken down
/// (every connection cut, new ones refused) and brought back.
struct Proxy {
    addr: SocketAddr,
    up: Arc<tokio::sync::watch::Sender<bool>>,
    downstream_bytes: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(relay: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(tokio::sync::watch::Sender::new(true));
        let downstream_bytes = Arc::new(AtomicU64::new(0));
        let (link, counter) = (up.clone(), downstream_bytes.clone());
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let mut state = link.subscribe();
                if !*state.borrow_and_update() {
                    continue;
                }
                let counter = counter.clone();
                connections.spawn(async move {
                    let Ok(upstream) = tokio::net::TcpStream::connect(relay).await else {
                        return;
                    };
                    let (mut client_read, mut client_write) = client.into_split();
                    let (mut relay_read, mut relay_write) = upstream.into_split();
                    let upward = tokio::io::copy(&mut client_read, &mut relay_write);
                    let downward = async {
                        use tokio::io::{AsyncReadExt, AsyncWriteExt};
                        let mut buffer = vec![0u8; 64 * 1024];
                        loop {
                            let n = relay_read.read(&mut buffer).await?;
                            if n == 0 {
                                return Ok::<(), std::io::Error>(());
                            }
                            client_write.write_all(&buffer[..n]).await?;
                            counter.fetch_add(n as u64, Ordering::Relaxed);
                        }
                    };
                    tokio::select! {
                        _ = upward => {}
                        _ = downward => {}
                        _ = state.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        Self {
            addr,
            up,
            downstream_bytes,
            task,
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(resume_window_bytes: Option<u64>) -> Outcome {
    let dir = tempfile::tempdir().unwrap();
    let cards = dir.path().join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    for worker in 0..WORKERS {
        let record = serde_json::json!({
            "type": "Model", "namespace": "bench", "component": "backend", "endpoint": "generate",
            "instance_id": 0x100 + worker,
            "card_json": {
                "display_name": "bench-model", "source_path": "models/bench", "kv_cache_block_size": 16,
                "model_type": "Chat", "worker_type": "aggregated", "needs": [],
                "runtime_config": { "total_kv_blocks": BLOCKS_PER_WORKER, "data_parallel_start_rank": 0, "data_parallel_size": 1 }
            }
        });
        std::fs::write(cards.join(format!("w{worker}.json")), record.to_string()).unwrap();
    }
    let trace = dir.path().join("empty.jsonl");
    std::fs::write(&trace, "").unwrap();
    let mut config = RelayConfig {
        dc_id: "dc-bench".to_owned(),
        ..RelayConfig::default()
    };
    config.wan.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.enabled = false;
    config.discovery.dir = Some(cards);
    config.workload = Some(WorkloadConfig {
        trace: Some(trace),
        speed: 0.0,
        loops: 1,
    });
    if let Some(bytes) = resume_window_bytes {
        config.limits.resume_window_bytes = bytes;
    }
    let relay = Arc::new(Relay::start(config).await.unwrap());
    relay.wait_for_pools(1).await;
    relay.workload_finished().await;
    let sources = relay.sources();

    // Fill every source to its capacity.
    let mut generator = ChainGenerator::new(BLOCKS_PER_EVENT, RESIDENT_EVENTS, 42);
    let mut event_id = 0u64;
    for _ in 0..RESIDENT_EVENTS {
        for source in &sources {
            for event in generator.event(*source, event_id) {
                relay.submit(event).await.unwrap();
            }
            event_id += 1;
        }
    }
    relay.flush().await;
    let resident_blocks = relay.pool_reports().await[0].resident_blocks;

    // A steady load from here on.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (relay, stop, sources) = (relay.clone(), stop.clone(), sources.clone());
        tokio::spawn(async move {
            let mut ticker = tokio::time::interval(Duration::from_millis(10));
            let per_tick = LOAD_EVENTS_PER_S / 100;
            while !stop.load(Ordering::Relaxed) {
                ticker.tick().await;
                for _ in 0..per_tick {
                    let source = sources[(event_id % sources.len() as u64) as usize];
                    for event in generator.event(source, event_id) {
                        relay.submit(event).await.unwrap();
                    }
                    event_id += 1;
                }
            }
        })
    };

    let proxy = Proxy::start(relay.wan_addr()).await;
    let mut consumer_config = ConsumerConfig::new(vec![kvrelay_consumer::RelayEndpoint::new(
        &proxy.addr.to_string(),
        "dc-bench",
    )]);
    consumer_config.backoff = BackoffConfig {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(200),
        ..BackoffConfig::default()
    };
    let consumer = Consumer::start(consumer_config).unwrap();
    let current_at = |target: u64| {
        move |state: &kvrelay_consumer::ConsumerState, now: Instant| {
            state.pools(now).iter().any(|status| {
                status.replica == ReplicaState::Current
                    && status.sequence.is_some_and(|sequence| sequence >= target)
            })
        }
    };
    assert!(
        consumer.wait_until(DEADLINE, current_at(0)).await,
        "first install"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;

    proxy.up.send_replace(false);
    tokio::time::sleep(OUTAGE).await;
    let snapshots_before = consumer.metrics().snapshots_installed;
    let bytes_before = proxy.downstream_bytes.load(Ordering::Relaxed);
    let target = relay.pool_reports().await[0].sequence;
    let back = Instant::now();
    proxy.up.send_replace(true);
    assert!(
        consumer.wait_until(DEADLINE, current_at(target)).await,
        "current again"
    );
    let time_to_current = back.elapsed();
    let bytes = proxy.downstream_bytes.load(Ordering::Relaxed) - bytes_before;
    let snapshots_installed = consumer.metrics().snapshots_installed - snapshots_before;

    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    consumer.shutdown().await;
    drop(proxy);
    Outcome {
        resident_blocks,
        bucket_count: relay.pool_reports().await[0].bucket_count,
        bytes,
        time_to_current,
        snapshots_installed,
    }
}
