//! Scoring beside a writer: score latency while every lane takes deltas, and the longest
//! score call while one lane takes a whole snapshot again.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvrelay_benches::percentile;
use kvrelay_ckf::{
    BucketImage, Delta, PrefixDepths, PrefixQuery, QueryTable, ReplicaStatus, SnapshotChunk,
};
use parking_lot::RwLock;

use crate::fleet::{BuiltDc, DELTAS_PER_DC};

/// The `q`-quantile of sorted latencies, in µs (0 when there are none).
pub(crate) fn quantile_us(sorted: &[Duration], q: f64) -> f64 {
    let micros: Vec<f64> = sorted.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    percentile(&micros, q).unwrap_or(0.0)
}

/// How often each lane receives a delta in the applying phase.
const DELTA_PERIOD: Duration = Duration::from_millis(1);

/// Score latency under the consumer's lock with no writer, then while one thread applies
/// a delta to every lane each `DELTA_PERIOD` (flat out when it cannot keep up): first
/// each delta under the write lock (the consumer before applies ran beside queries, the
/// baseline), then under the upgradable read lock, which queries share (as the consumer
/// applies deltas now).
pub(crate) struct Applying {
    pub(crate) idle_p99_us: f64,
    pub(crate) write_locked_p99_us: f64,
    pub(crate) beside_p99_us: f64,
    pub(crate) deltas_per_s: f64,
    pub(crate) snapshot: [SnapshotStall; 2],
}

/// The longest score call while lane 0 takes a whole snapshot again (after a reset, as a
/// resubscribed replica does), and how long the install took.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SnapshotStall {
    pub(crate) longest_score_us: f64,
    pub(crate) install_ms: f64,
}

/// Lane 0's snapshot installed again while scoring: `[under the write lock (the
/// baseline), beside queries (under the upgradable read, as the consumer installs a new
/// replica's chunks)]`.
fn scoring_while_installing(
    table: &RwLock<QueryTable>,
    requests: &[Vec<u64>],
    chunks: &[SnapshotChunk],
) -> Result<[SnapshotStall; 2]> {
    let mut stalls = [SnapshotStall::default(); 2];
    for (phase, beside_queries) in [false, true].into_iter().enumerate() {
        table
            .write()
            .reset_lane(0)
            .map_err(|err| anyhow::anyhow!("resetting lane 0: {err}"))?;
        let done = AtomicBool::new(false);
        let (longest, install) = std::thread::scope(|scope| {
            let installer = scope.spawn(|| -> Result<Duration> {
                let started = Instant::now();
                let result = chunks.iter().try_for_each(|chunk| {
                    let installed = if beside_queries {
                        table
                            .upgradable_read()
                            .install_chunk_beside_queries(0, chunk)
                            .context("lane 0 answered queries since its reset")?
                    } else {
                        table.write().install_chunk(0, chunk)
                    };
                    installed
                        .map(|_| ())
                        .map_err(|err| anyhow::anyhow!("installing lane 0: {err}"))
                });
                done.store(true, Ordering::Relaxed);
                result.map(|()| started.elapsed())
            });
            let mut out = PrefixDepths::default();
            let mut longest = Duration::ZERO;
            for hashes in requests.iter().cycle() {
                if done.load(Ordering::Relaxed) {
                    break;
                }
                let t = Instant::now();
                table.read().prefix_depths_into(hashes, &mut out);
                longest = longest.max(t.elapsed());
            }
            let install = installer
                .join()
                .map_err(|_| anyhow::anyhow!("the installer panicked"))?;
            install.map(|install| (longest, install))
        })?;
        stalls[phase] = SnapshotStall {
            longest_score_us: longest.as_secs_f64() * 1e6,
            install_ms: install.as_secs_f64() * 1e3,
        };
    }
    Ok(stalls)
}

pub(crate) fn scoring_while_applying(
    table: QueryTable,
    requests: &[Vec<u64>],
    dcs: &[BuiltDc],
    n_dcs: usize,
    first_snapshot: &[SnapshotChunk],
) -> Result<Applying> {
    const PHASE: Duration = Duration::from_millis(1500);
    let mut sequences: Vec<u64> = Vec::with_capacity(n_dcs);
    for lane in 0..n_dcs {
        match table.lane_status(lane) {
            Some(ReplicaStatus::Ready { sequence }) => sequences.push(sequence),
            other => bail!("lane {lane} is not ready: {other:?}"),
        }
    }
    let table = Arc::new(RwLock::new(table));
    // Scores for `PHASE` as the consumer does (read lock per call), timing each call.
    let score_phase = |table: &RwLock<QueryTable>| {
        let mut out = PrefixDepths::default();
        let mut latencies = Vec::with_capacity(1 << 20);
        let started = Instant::now();
        for hashes in requests.iter().cycle() {
            let t = Instant::now();
            table.read().prefix_depths_into(hashes, &mut out);
            latencies.push(t.elapsed());
            if started.elapsed() > PHASE {
                break;
            }
        }
        latencies.sort_unstable();
        quantile_us(&latencies, 0.99)
    };
    let idle_p99_us = score_phase(&table);
    let rewrites = Arc::new(
        dcs.iter()
            .map(|dc| dc.rewrites.clone())
            .collect::<Vec<Vec<Vec<BucketImage>>>>(),
    );
    // Under the write lock first, then beside queries; the sequences carry over.
    let mut applying = [(0.0, 0.0); 2];
    for (phase, beside_queries) in [false, true].into_iter().enumerate() {
        // The applier waits for its next round on the stop signal, with the round's
        // deadline as the timeout.
        let (stop, stopped) = mpsc::channel::<()>();
        let applier = std::thread::spawn({
            let table = Arc::clone(&table);
            let rewrites = Arc::clone(&rewrites);
            let mut sequences = std::mem::take(&mut sequences);
            move || -> Result<(Vec<u64>, f64)> {
                let started = Instant::now();
                let mut applied = 0u64;
                let mut round = 0usize;
                loop {
                    let due = started + DELTA_PERIOD * round as u32;
                    let wait = due.saturating_duration_since(Instant::now());
                    match stopped.recv_timeout(wait) {
                        Err(mpsc::RecvTimeoutError::Timeout) => {}
                        Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => break,
                    }
                    for (lane, sequence) in sequences.iter_mut().enumerate() {
                        let delta = Delta {
                            base_sequence: *sequence,
                            sequence: *sequence + 1,
                            images: rewrites[lane][round % DELTAS_PER_DC].clone(),
                        };
                        let applied_delta = if beside_queries {
                            table.upgradable_read().apply_delta(lane, &delta)
                        } else {
                            table.write().apply_delta(lane, &delta)
                        };
                        applied_delta
                            .map_err(|err| anyhow::anyhow!("applying to lane {lane}: {err}"))?;
                        *sequence += 1;
                        applied += 1;
                    }
                    round += 1;
                }
                Ok((sequences, applied as f64 / started.elapsed().as_secs_f64()))
            }
        });
        let p99 = score_phase(&table);
        drop(stop);
        let (returned, rate) = applier
            .join()
            .map_err(|_| anyhow::anyhow!("the applier panicked"))??;
        sequences = returned;
        applying[phase] = (p99, rate);
    }
    let snapshot = scoring_while_installing(&table, requests, first_snapshot)?;
    Ok(Applying {
        idle_p99_us,
        write_locked_p99_us: applying[0].0,
        beside_p99_us: applying[1].0,
        deltas_per_s: applying[0].1.min(applying[1].1),
        snapshot,
    })
}
