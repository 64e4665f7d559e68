//! How long `score` waits while a new replica grows its format's query table (issue #32:
//! "growing never blocks scoring"). Eight pools of one large format hold snapshots; a
//! ninth subscription doubles the table (allocation and copy of every row). One thread
//! scores in a loop while the main thread begins that subscription, either the old way
//! (everything under the write lock) or as the consumer does now (prepared under the
//! upgradable lock, which queries share; the write lock only swaps the rows in).
//!
//! Prints one JSON object: per mode, the growth's duration, the idle score p99 and the
//! longest score call overlapping the growth, with ratios against idle (same run).
//! `--quick` runs one trial per mode instead of five.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "benchmark setup"
)]

#[path = "../tests/support/mod.rs"]
mod support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kvrelay_consumer::{ConsumerConfig, ConsumerState, PoolKey, RelayEndpoint, ScoreRequest};
use kvrelay_identity::hashing::HashSalt;
use parking_lot::{RwLock, RwLockUpgradableReadGuard};
use support::{PoolSpec, Producer, catalog_of, relay_identity};

const BLOCK: u32 = 16;
/// Expected blocks per pool: a 2^21-bucket filter (16 MiB per lane).
const EXPECTED_BLOCKS: u64 = 4_000_000;
const LANES_BEFORE: usize = 8;

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    WriteLock,
    Prepared,
}

fn tokens(family: u32, n_blocks: u32) -> Vec<u32> {
    (0..n_blocks * BLOCK)
        .map(|i| family * 1_000_000 + i)
        .collect()
}

/// Eight current replicas and the key of a ninth, not yet subscribed.
fn setup() -> (ConsumerState, PoolKey, u64) {
    let relay = relay_identity(1);
    let config = ConsumerConfig::new(vec![RelayEndpoint::new("127.0.0.1:7400", "dc-a")]);
    let mut state = ConsumerState::new(&config).unwrap();
    let mut producers: Vec<Producer> = (0..=LANES_BEFORE)
        .map(|i| {
            let name: &'static str = Box::leak(format!("pool{i}").into_boxed_str());
            let mut spec = PoolSpec::aggregated(name, "llama");
            spec.block_size = BLOCK;
            spec.expected_blocks = EXPECTED_BLOCKS;
            let mut producer = Producer::new(&spec, "dc-a", relay, 1);
            for family in 0..32 {
                producer.store(0, &tokens(family + i as u32 * 100, 64), HashSalt::default());
            }
            producer
        })
        .collect();
    let bucket_count = producers[0].filter.words().len() as u64;
    let refs: Vec<&Producer> = producers.iter().collect();
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &refs))
        .unwrap();
    let now = Instant::now();
    let mut last = None;
    for (key, producer_id) in change.added {
        let producer = producers
            .iter_mut()
            .find(|p| p.descriptor.producer == producer_id)
            .unwrap();
        if producer.descriptor.serving_endpoint.component == format!("pool{LANES_BEFORE}") {
            last = Some(key);
            continue;
        }
        state.begin_subscription(key).unwrap();
        for frame in producer.snapshot_frames() {
            state.apply_pool_frame(key, &frame, now).unwrap();
        }
    }
    (state, last.unwrap(), bucket_count)
}

struct Trial {
    growth: Duration,
    idle_p99: Duration,
    max_during_growth: Duration,
}

fn trial(mode: Mode) -> Trial {
    let (state, key, _) = setup();
    let state = Arc::new(RwLock::new(state));
    let request = ScoreRequest {
        tokens: tokens(3, 64),
        model: "llama".into(),
        ..ScoreRequest::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let scorer = std::thread::spawn({
        let state = Arc::clone(&state);
        let stop = Arc::clone(&stop);
        move || {
            let mut calls = Vec::with_capacity(1 << 20);
            while !stop.load(Ordering::Relaxed) {
                let started = Instant::now();
                let ranking = state.read().score(&request, Instant::now());
                assert!(ranking.is_ok());
                calls.push((started, started.elapsed()));
            }
            calls
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    let growth_started = Instant::now();
    match mode {
        Mode::WriteLock => {
            state.write().begin_subscription(key).unwrap();
        }
        Mode::Prepared => {
            let guard = state.upgradable_read();
            let mut prepared = guard.prepare_subscription(key).unwrap();
            assert!(prepared.is_some(), "the ninth lane grows the table");
            RwLockUpgradableReadGuard::upgrade(guard)
                .begin_subscription_prepared(key, prepared.as_mut())
                .unwrap();
            // The old rows, freed outside the lock.
            drop(prepared);
        }
    }
    let growth_ended = Instant::now();
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::Relaxed);
    let calls = scorer.join().unwrap();
    let mut idle: Vec<Duration> = calls
        .iter()
        .filter(|(started, took)| *started + *took < growth_started)
        .map(|(_, took)| *took)
        .collect();
    idle.sort_unstable();
    let max_during_growth = calls
        .iter()
        .filter(|(started, took)| *started < growth_ended && *started + *took > growth_started)
        .map(|(_, took)| *took)
        .max()
        .unwrap_or_default();
    Trial {
        growth: growth_ended - growth_started,
        idle_p99: idle[idle.len() * 99 / 100],
        max_during_growth,
    }
}

fn micros(duration: Duration) -> f64 {
    (duration.as_secs_f64() * 1e7).round() / 10.0
}

fn main() {
    let quick = std::env::args().any(|arg| arg == "--quick");
    let trials = if quick { 1 } else { 5 };
    let (_, _, bucket_count) = setup();
    let mut out = serde_json::Map::new();
    out.insert(
        "table".into(),
        format!(
            "{bucket_count} buckets, {LANES_BEFORE} -> {} lanes ({} MiB -> {} MiB)",
            2 * LANES_BEFORE,
            (bucket_count * 8 * LANES_BEFORE as u64) >> 20,
            (bucket_count * 16 * LANES_BEFORE as u64) >> 20
        )
        .into(),
    );
    let mut worst = [Duration::ZERO; 2];
    for (idx, (mode, name)) in [
        (Mode::WriteLock, "write_lock"),
        (Mode::Prepared, "prepared"),
    ]
    .into_iter()
    .enumerate()
    {
        let results: Vec<Trial> = (0..trials).map(|_| trial(mode)).collect();
        let growth = results.iter().map(|t| t.growth).max().unwrap();
        let idle = results.iter().map(|t| t.idle_p99).max().unwrap();
        let during = results.iter().map(|t| t.max_during_growth).max().unwrap();
        worst[idx] = during;
        eprintln!(
            "{name}: growth {growth:?}, idle score p99 {idle:?}, longest score during growth {during:?}"
        );
        out.insert(
            name.into(),
            serde_json::json!({
                "growth_ms": micros(growth) / 1000.0,
                "idle_score_p99_us": micros(idle),
                "longest_score_during_growth_us": micros(during),
                "longest_vs_idle_p99": (during.as_secs_f64() / idle.as_secs_f64() * 100.0).round() / 100.0,
            }),
        );
    }
    out.insert(
        "prepared_vs_write_lock_longest_score".into(),
        ((worst[1].as_secs_f64() / worst[0].as_secs_f64() * 1000.0).round() / 1000.0).into(),
    );
    println!("{}", serde_json::Value::Object(out));
}
