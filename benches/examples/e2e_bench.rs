//! End-to-end figures on loopback: events submitted to a relay's pool actor → published →
//! sent over TCP → applied to a replica ([`PoolMirror`] over a real WAN stream).
//!
//! Prints one JSON object: sustained stored blocks/s (submit to replica caught up), and
//! event-to-replica latency p50/p99 (one event at a time, including the actor's batching
//! delay). Run with `cargo run --release -p kvrelay-benches --example e2e_bench [-- EVENTS]`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a benchmark binary fails loudly"
)]

use std::time::{Duration, Instant};

use kvrelay_benches::events::ChainGenerator;
use kvrelay_codec::v1::{StreamRequest, StreamRpc};
use kvrelay_server::{PoolMirror, ProbeStream, Relay, RelayConfig, WorkloadConfig};
use tokio::sync::watch;

/// Blocks per stored event.
const BLOCKS_PER_EVENT: u64 = 16;
/// Events a source keeps resident before its oldest is removed.
const RESIDENT_EVENTS: u64 = 256;
/// Latency samples.
const LATENCY_SAMPLES: usize = 2_000;

fn main() {
    let events: u64 = std::env::args()
        .nth(1)
        .and_then(|arg| arg.parse().ok())
        .unwrap_or(50_000);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let figures = runtime.block_on(run(events));
    println!("{}", serde_json::to_string_pretty(&figures).unwrap());
}

async fn run(events: u64) -> serde_json::Value {
    let dir = tempfile::tempdir().unwrap();
    let cards = dir.path().join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    for worker in 0..4u64 {
        let record = serde_json::json!({
            "type": "Model", "namespace": "bench", "component": "backend", "endpoint": "generate",
            "instance_id": 0x100 + worker,
            "card_json": {
                "display_name": "bench-model", "source_path": "models/bench", "kv_cache_block_size": 16,
                "model_type": "Chat", "worker_type": "aggregated", "needs": [],
                "runtime_config": { "total_kv_blocks": 8192, "data_parallel_start_rank": 0, "data_parallel_size": 1 }
            }
        });
        std::fs::write(cards.join(format!("w{worker}.json")), record.to_string()).unwrap();
    }
    // An empty trace connects every discovered worker as a source without replaying anything.
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
    let relay = Relay::start(config).await.unwrap();
    relay.wait_for_pools(1).await;
    relay.workload_finished().await;
    let pool = relay.catalog().pools[0].clone();
    let sources = relay.sources();

    // The replica: its own TCP stream; publishes its sequence after every applied frame.
    let (sequence_tx, mut sequence_rx) = watch::channel(0u64);
    let request = StreamRequest {
        subscriber_id: "e2e-bench".to_owned(),
        rpc: StreamRpc::SubscribePool {
            expected_producer: pool.producer,
            resume_from_sequence: None,
        },
        auth_token: None,
    };
    let addr = relay.wan_addr();
    let (resubscribes_tx, resubscribes_rx) = watch::channel(0u64);
    let replica = tokio::spawn(async move {
        // A cut-off subscriber (lag) resubscribes and starts over from a snapshot, like a
        // consumer does; the count is reported.
        loop {
            let Ok(mut stream) = ProbeStream::connect(addr, &request).await else {
                return;
            };
            let mut mirror = PoolMirror::new(pool.producer).unwrap();
            while let Ok(Some(frame)) = stream.next_frame().await {
                if mirror.handle_frame(&frame).is_err() {
                    break;
                }
                if mirror.words().is_some() {
                    sequence_tx.send_replace(mirror.sequence());
                }
            }
            if sequence_tx.is_closed() {
                return;
            }
            resubscribes_tx.send_modify(|count| *count += 1);
        }
    });
    sequence_rx.wait_for(|_| true).await.unwrap();

    // Throughput: submit everything, then wait for the replica to reach the final sequence.
    let mut generator = ChainGenerator::new(BLOCKS_PER_EVENT, RESIDENT_EVENTS, 42);
    let started = Instant::now();
    for at in 0..events {
        let source = sources[(at % sources.len() as u64) as usize];
        for event in generator.event(source, at) {
            relay.submit(event).await.unwrap();
        }
    }
    relay.flush().await;
    let final_sequence = relay.pool_reports().await[0].sequence;
    sequence_rx
        .wait_for(|sequence| *sequence >= final_sequence)
        .await
        .unwrap();
    let elapsed = started.elapsed();
    let blocks = events * BLOCKS_PER_EVENT;

    // Latency: one stored event at a time, until the replica applied its delta; first with
    // the actor's own batching delay, then flushing right after the submit.
    let mut batched = Vec::with_capacity(LATENCY_SAMPLES);
    let mut flushed = Vec::with_capacity(LATENCY_SAMPLES);
    for sample in 0..(2 * LATENCY_SAMPLES) as u64 {
        let flush = sample >= LATENCY_SAMPLES as u64;
        let before = *sequence_rx.borrow_and_update();
        let source = sources[(sample % sources.len() as u64) as usize];
        let batch = generator.event(source, events + sample);
        let sent = Instant::now();
        for event in batch {
            relay.submit(event).await.unwrap();
        }
        if flush {
            relay.flush().await;
        }
        tokio::time::timeout(
            Duration::from_secs(10),
            sequence_rx.wait_for(|sequence| *sequence > before),
        )
        .await
        .expect("replica advances")
        .unwrap();
        if flush { &mut flushed } else { &mut batched }.push(sent.elapsed());
    }
    let percentile = |samples: &mut Vec<Duration>, p: f64| {
        samples.sort();
        samples[((samples.len() as f64 * p) as usize).min(samples.len() - 1)].as_micros()
    };
    let table = relay.producer_table(&pool.producer).await.unwrap();
    let caught_up = *sequence_rx.borrow() == table.sequence;
    drop(sequence_rx);
    relay.shutdown().await.unwrap();
    let _ = replica.await;
    serde_json::json!({
        "benchmark": "e2e/loopback",
        "events": events,
        "blocks_stored": blocks,
        "seconds": elapsed.as_secs_f64(),
        "blocks_per_s": blocks as f64 / elapsed.as_secs_f64(),
        "events_per_s": events as f64 / elapsed.as_secs_f64(),
        "latency_samples": LATENCY_SAMPLES,
        "event_to_replica_p50_us": percentile(&mut batched, 0.50),
        "event_to_replica_p99_us": percentile(&mut batched, 0.99),
        "event_to_replica_flushed_p50_us": percentile(&mut flushed, 0.50),
        "event_to_replica_flushed_p99_us": percentile(&mut flushed, 0.99),
        "replica_caught_up": caught_up,
        "replica_resubscribes": *resubscribes_rx.borrow(),
        "bucket_count": pool.producer.ckf_format.bucket_count,
    })
}
