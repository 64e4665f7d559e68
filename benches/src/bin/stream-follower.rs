//! `stream-follower`: the consumer process of the stream benchmark.
//!
//! Follows one relay with [`kvrelay_consumer::Consumer`] (default configuration, as a
//! router would run it) and measures, from the outside of the consumer's API:
//!
//! - **usable fraction**: every `--sample-ms` (10 ms) the pool's replica status is
//!   sampled; each interval counts as usable when the replica was `current` at its start.
//!   Fraction = usable time / time since the first install.
//! - **event → replica latency**: engines stamp the wall-clock send time of the batch of
//!   every request whose first block is new to the trace (no worker can hold it before;
//!   `sim::first_block_new`); every `--probe-ms` (2 ms), while the replica is current, the
//!   follower scores each pending probe's first block and takes the first time the pool's
//!   estimated prefix covers it. Latency = that time − send time (both wall clock, same
//!   host). It includes
//!   relay ingest, batching, the WAN hop and the consumer's apply, plus up to one probe
//!   interval; a request not seen within `--probe-timeout-s` (or before the end) is
//!   *unseen* and counts as infinitely late in the percentiles.
//! - **time to current after the publishers stop**: the driver sends
//!   `final SEQUENCE STOP_UNIX_NS` on stdin (the relay's final pool sequence and when the
//!   last engine finished); the follower reports when its replica is current at or past
//!   that sequence.
//!   Against a relay whose final sequence the driver cannot read (Dynamo's), the driver
//!   sends `settle QUIET_MS STOP_UNIX_NS` instead: the follower reports once its replica is
//!   current and its sequence has not moved for `QUIET_MS`; the time to current is then
//!   that of the last sequence change (0 if it came before the stop).
//! - **score latency while applying**: every `score_into` call of the probe loop is timed
//!   while the publishers run (frames apply at the full rate meanwhile; the consumer's
//!   state is one lock shared by apply and score); once current after the stop, the same
//!   number of recent requests (up to `--idle-scores`, 5,000) is scored again with nothing
//!   applying, in bursts of the same mean size one probe tick apart, as the baseline of
//!   the same run.
//!
//! - **failover figures** (relay pairs, `--relay A+B`): the longest time the replica was
//!   not current (`longest_unusable_ms`), the most pools listed at once (a DC counted
//!   twice would list its pool twice) and, for each `mark NAME UNIX_NS` the driver sends
//!   (a kill, an upgrade step), the *live recall* of the `--window-s` (30 s) after it: of
//!   the probes sent in the window, the share found within `--live-ms` (1 s) of their send.
//!
//! Prints `installed` once the first replica is current, one progress line a second on
//! stderr, and the JSON report on stdout when done (or on `stop`).

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, Seek};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvrelay_benches::sim::{request_keys, request_tokens};
use kvrelay_benches::stamps::{Stamp, unix_ns};
use kvrelay_benches::{Flags, MODEL, percentile};
use kvrelay_consumer::{
    Consumer, ConsumerConfig, Ranking, RelayEndpoint, ReplicaState, ResubscribeReason, ScoreRequest,
};
use tokio::io::AsyncBufReadExt;

/// A request waiting to become visible.
struct Pending {
    stamp: Stamp,
    request: ScoreRequest,
    /// Into the probe times.
    index: usize,
}

/// Tails one stamp file.
struct Tail {
    path: String,
    offset: u64,
}

impl Tail {
    fn read_new(&mut self, out: &mut Vec<Stamp>) -> Result<()> {
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return Ok(());
        };
        file.seek(std::io::SeekFrom::Start(self.offset))?;
        let mut reader = std::io::BufReader::new(file);
        let mut line = String::new();
        loop {
            line.clear();
            let n = reader.read_line(&mut line)?;
            // Only complete lines: a partial last line is read again next time.
            if n == 0 || !line.ends_with('\n') {
                return Ok(());
            }
            self.offset += n as u64;
            if let Some(stamp) = Stamp::parse(line.trim_end()) {
                out.push(stamp);
            }
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<()> {
    let flags = Flags::from_env();
    flags.ensure_known(&[
        "relay",
        "trace",
        "stamps",
        "sample-ms",
        "probe-ms",
        "probe-timeout-s",
        "install-timeout-s",
        "final-timeout-s",
        "idle-scores",
        "live-ms",
        "window-s",
        "rejoin-window-ms",
        "standby-mode",
    ])?;
    let relay: String = flags.get("relay")?;
    let trace: String = flags.get("trace")?;
    let stamp_paths: String = flags.get("stamps")?;
    let sample_every = Duration::from_millis(flags.get_or("sample-ms", 10)?);
    let probe_every = Duration::from_millis(flags.get_or("probe-ms", 2)?);
    let probe_timeout = Duration::from_secs_f64(flags.get_or("probe-timeout-s", 30.0)?);
    let install_timeout = Duration::from_secs_f64(flags.get_or("install-timeout-s", 60.0)?);
    let final_timeout = Duration::from_secs_f64(flags.get_or("final-timeout-s", 60.0)?);
    let idle_scores: usize = flags.get_or("idle-scores", 5_000)?;
    let live_bound_ns: u64 = flags.get_or::<u64>("live-ms", 1_000)? * 1_000_000;
    let window_ns = (flags.get_or::<f64>("window-s", 30.0)? * 1e9) as u64;

    let text = std::fs::read_to_string(&trace).with_context(|| format!("reading {trace}"))?;
    let requests = kvrelay_ingest::parse_request_trace(&text)?;
    let mut tails: Vec<Tail> = stamp_paths
        .split(',')
        .map(|path| Tail {
            path: path.to_owned(),
            offset: 0,
        })
        .collect();

    // `ADDR` follows our WAN protocol; `dynamo-grpc://ADDR=DC` or a pair `A+B=DC` (any
    // relay address the consumer parses) names the protocol or the standby too.
    let endpoint = if relay.contains("://") || relay.contains('=') {
        relay
            .parse::<RelayEndpoint>()
            .with_context(|| format!("--relay {relay}"))?
    } else {
        RelayEndpoint::new(&relay, "dc-bench")
    };
    let mut config = ConsumerConfig::new(vec![endpoint]);
    config.subscriber_id = "stream-follower".to_owned();
    if let Some(window_ms) = flags.raw("rejoin-window-ms") {
        let window_ms: u64 = window_ms.parse().context("--rejoin-window-ms")?;
        config.limits.rejoin_window = Duration::from_millis(window_ms);
    }
    if let Some(mode) = flags.raw("standby-mode") {
        config.standby = mode.parse().context("--standby-mode")?;
    }
    let consumer = Arc::new(Consumer::start(config)?);
    let installed = consumer
        .wait_until(install_timeout, |state, now| {
            state
                .pools(now)
                .iter()
                .any(|pool| pool.replica == ReplicaState::Current)
        })
        .await;
    if !installed {
        anyhow::bail!("no replica became current within {install_timeout:?}");
    }
    println!("installed");

    let (command_tx, mut commands) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
        while let Ok(Some(line)) = lines.next_line().await {
            if command_tx.send(line.trim().to_owned()).is_err() {
                return;
            }
        }
    });

    let first_install = Instant::now();
    let mut last_sample = first_install;
    let mut was_current = true;
    let mut current_time = Duration::ZERO;
    let mut losses = 0u64;
    let mut sequence: Option<u64> = None;
    let mut pending: Vec<Pending> = Vec::new();
    let mut latencies_ms: Vec<f64> = Vec::new();
    let mut unseen = 0u64;
    let mut probes = 0u64;
    let mut new_stamps = Vec::new();
    let mut ranking = Ranking::default();
    let mut final_target: Option<(u64, u64, Instant)> = None;
    // `settle`: (quiet time, stop time); and when the sequence last changed (wall clock).
    let mut settle: Option<(Duration, u64)> = None;
    let mut sequence_changed: (Option<u64>, u64, Instant) = (None, unix_ns(), Instant::now());
    let mut time_to_current: Option<f64> = None;
    let mut next_progress = first_install + Duration::from_secs(1);
    // Score call durations while the publishers run, and the recent requests to score
    // again at rest.
    let mut score_us_loaded: Vec<f64> = Vec::new();
    let mut loaded_bursts = 0usize;
    let mut recent: VecDeque<ScoreRequest> = VecDeque::with_capacity(idle_scores);
    // Failover figures: the longest stretch not current, the most pools listed at once,
    // and every probe's send time and when it was found (for the recall after a mark).
    let mut unusable_since: Option<Instant> = None;
    let mut longest_unusable = Duration::ZERO;
    let mut max_pools_listed = 0usize;
    let mut probe_times: Vec<(u64, Option<u64>)> = Vec::new();
    let mut marks: Vec<(String, u64)> = Vec::new();
    let mut ticker = tokio::time::interval(probe_every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // The longest time between two probe rounds while the publishers run: a block that
    // lives in the replica for less than that can be missed (an unseen probe).
    let mut longest_probe_gap = Duration::ZERO;
    let mut last_round: Option<Instant> = None;

    loop {
        ticker.tick().await;
        let now = Instant::now();
        if final_target.is_none()
            && let Some(last) = last_round
        {
            longest_probe_gap = longest_probe_gap.max(now.duration_since(last));
        }
        last_round = Some(now);
        if now.duration_since(last_sample) >= sample_every {
            let pools = consumer.pools();
            let status = pools.first().map(|pool| (pool.replica, pool.sequence));
            let current = matches!(status, Some((ReplicaState::Current, _)));
            max_pools_listed = max_pools_listed.max(pools.len());
            match (current, unusable_since) {
                (false, None) => unusable_since = Some(last_sample),
                (true, Some(since)) => {
                    longest_unusable = longest_unusable.max(now.duration_since(since));
                    unusable_since = None;
                }
                _ => {}
            }
            if was_current {
                current_time += now.duration_since(last_sample);
            }
            if was_current && !current {
                losses += 1;
            }
            was_current = current;
            sequence = status.and_then(|(_, sequence)| sequence);
            if sequence != sequence_changed.0 {
                sequence_changed = (sequence, unix_ns(), now);
            }
            last_sample = now;
        }
        for tail in &mut tails {
            tail.read_new(&mut new_stamps)?;
        }
        for stamp in new_stamps.drain(..) {
            let Some(record) = requests.get(stamp.request) else {
                continue;
            };
            let keys = request_keys(record);
            probes += 1;
            probe_times.push((stamp.sent_unix_ns, None));
            let request = ScoreRequest {
                tokens: request_tokens(&keys, stamp.blocks),
                model: MODEL.to_owned(),
                ..ScoreRequest::default()
            };
            if idle_scores > 0 {
                if recent.len() == idle_scores {
                    recent.pop_front();
                }
                recent.push_back(request.clone());
            }
            pending.push(Pending {
                stamp,
                request,
                index: probe_times.len() - 1,
            });
        }
        // Nothing can become visible while the replica is not current.
        if was_current {
            let wall = unix_ns();
            let publishing = final_target.is_none();
            if publishing && !pending.is_empty() {
                loaded_bursts += 1;
            }
            pending.retain(|probe| {
                let started = Instant::now();
                let scored = consumer.score_into(&probe.request, &mut ranking);
                if publishing {
                    score_us_loaded.push(started.elapsed().as_secs_f64() * 1e6);
                }
                if scored.is_err() {
                    return true;
                }
                let covered = ranking.candidates.iter().any(|candidate| {
                    candidate.legs.iter().any(|leg| {
                        leg.prefix_blocks
                            .is_some_and(|blocks| blocks as usize >= probe.stamp.blocks)
                    })
                });
                if covered {
                    latencies_ms.push(wall.saturating_sub(probe.stamp.sent_unix_ns) as f64 / 1e6);
                    probe_times[probe.index].1 = Some(wall);
                }
                !covered
            });
        }
        let wall = unix_ns();
        let before = pending.len();
        pending.retain(|probe| {
            Duration::from_nanos(wall.saturating_sub(probe.stamp.sent_unix_ns)) < probe_timeout
        });
        unseen += (before - pending.len()) as u64;

        while let Ok(command) = commands.try_recv() {
            let mut words = command.split_whitespace();
            match words.next() {
                Some("final") => {
                    let target = words.next().and_then(|w| w.parse().ok()).unwrap_or(0);
                    let stop_ns = words.next().and_then(|w| w.parse().ok()).unwrap_or(wall);
                    final_target = Some((target, stop_ns, now));
                }
                Some("settle") => {
                    let quiet = words.next().and_then(|w| w.parse().ok()).unwrap_or(1_000);
                    let stop_ns = words.next().and_then(|w| w.parse().ok()).unwrap_or(wall);
                    settle = Some((Duration::from_millis(quiet), stop_ns));
                    // Bounded like `final`: the target is whatever sequence it settles at.
                    final_target = Some((u64::MAX, stop_ns, now));
                }
                Some("stop") => final_target = Some((u64::MAX, wall, now - final_timeout)),
                Some("mark") => {
                    let name = words.next().unwrap_or("mark").to_owned();
                    let at = words.next().and_then(|w| w.parse().ok()).unwrap_or(wall);
                    marks.push((name, at));
                }
                _ => {}
            }
        }
        if let Some((quiet, stop_ns)) = settle
            && was_current
            && now.duration_since(sequence_changed.2) >= quiet
        {
            time_to_current = Some(sequence_changed.1.saturating_sub(stop_ns) as f64 / 1e9);
            final_target = sequence.map(|sequence| (sequence, stop_ns, now));
            break;
        }
        if let Some((target, stop_ns, asked)) = final_target {
            if was_current && sequence.is_some_and(|sequence| sequence >= target) {
                time_to_current = Some(unix_ns().saturating_sub(stop_ns) as f64 / 1e9);
                break;
            }
            if now.duration_since(asked) >= final_timeout {
                break;
            }
        }
        if now >= next_progress {
            next_progress += Duration::from_secs(1);
            let since = now.duration_since(first_install).as_secs_f64();
            eprintln!(
                "    follower: {} seq {} usable {:.1}% of {:.0} s, {} losses, {} seen / {} pending / {} unseen probes",
                if was_current {
                    "current"
                } else {
                    "NOT current"
                },
                sequence.map_or_else(|| "-".to_owned(), |s| s.to_string()),
                100.0 * current_time.as_secs_f64() / since.max(1e-9),
                since,
                losses,
                latencies_ms.len(),
                pending.len(),
                unseen
            );
        }
    }

    // The span the samples cover: `current_time` accrues at each sample, so time after the
    // last one (up to a sample interval, plus the exit) is in neither total.
    let elapsed = last_sample.duration_since(first_install).as_secs_f64();
    // The baseline: as many scores as were timed under load (at most the recent
    // requests), now that nothing applies; only once current, so both score replicas.
    let mut score_us_idle: Vec<f64> = Vec::new();
    if time_to_current.is_some() && !recent.is_empty() {
        // The same pattern as under load: bursts of the mean loaded burst size, one per
        // probe tick (a tight loop would be warmer in cache than the loaded samples).
        let wanted = score_us_loaded.len().clamp(1, idle_scores.max(1));
        let burst = score_us_loaded.len().div_ceil(loaded_bursts.max(1)).max(1);
        let mut requests = recent.iter().cycle();
        let until = Instant::now() + Duration::from_secs(20);
        while score_us_idle.len() < wanted && Instant::now() < until {
            ticker.tick().await;
            for request in requests
                .by_ref()
                .take(burst.min(wanted - score_us_idle.len()))
            {
                let started = Instant::now();
                let _ = consumer.score_into(request, &mut ranking);
                score_us_idle.push(started.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    score_us_loaded.sort_by(f64::total_cmp);
    score_us_idle.sort_by(f64::total_cmp);
    let score_summary = |sorted: &[f64]| {
        serde_json::json!({
            "n": sorted.len(),
            "p50_us": percentile(sorted, 0.50),
            "p99_us": percentile(sorted, 0.99),
            "max_us": sorted.last(),
        })
    };
    unseen += pending.len() as u64;
    latencies_ms.sort_by(f64::total_cmp);
    // Unseen probes are infinitely late: a percentile falling on them is reported as null.
    let total = latencies_ms.len() + unseen as usize;
    let quantile = |p: f64| -> serde_json::Value {
        if total == 0 {
            return serde_json::Value::Null;
        }
        let rank = ((total as f64 - 1.0) * p).round() as usize;
        latencies_ms
            .get(rank)
            .map_or(serde_json::Value::Null, |ms| serde_json::json!(ms))
    };
    if let Some(since) = unusable_since {
        longest_unusable = longest_unusable.max(last_sample.duration_since(since));
    }
    let windows: Vec<serde_json::Value> = marks
        .iter()
        .map(|(name, at)| {
            let sent: Vec<&(u64, Option<u64>)> = probe_times
                .iter()
                .filter(|(sent, _)| *sent >= *at && *sent < at.saturating_add(window_ns))
                .collect();
            let live = sent
                .iter()
                .filter(|(sent, seen)| seen.is_some_and(|seen| seen.saturating_sub(*sent) <= live_bound_ns))
                .count();
            let seen = sent.iter().filter(|(_, seen)| seen.is_some()).count();
            serde_json::json!({
                "mark": name,
                "probes": sent.len(),
                "live": live,
                "seen": seen,
                "live_recall": if sent.is_empty() { serde_json::Value::Null } else { serde_json::json!(live as f64 / sent.len() as f64) },
            })
        })
        .collect();
    let metrics = consumer.metrics();
    let resubscribes: BTreeMap<&str, u64> = ResubscribeReason::ALL
        .iter()
        .map(|reason| (reason.as_str(), metrics.resubscribes_for(*reason)))
        .filter(|(_, n)| *n > 0)
        .collect();
    let report = serde_json::json!({
        "usable_fraction": current_time.as_secs_f64() / elapsed.max(1e-9),
        "time_current_s": current_time.as_secs_f64(),
        "time_since_first_install_s": elapsed,
        "replica_losses": losses,
        "resubscribes": resubscribes,
        "resubscribes_total": resubscribes.values().sum::<u64>(),
        "snapshots_installed": metrics.snapshots_installed,
        "deltas_applied": metrics.deltas_applied,
        "heartbeats": metrics.heartbeats,
        "latency": {
            "probes": probes,
            "seen": latencies_ms.len(),
            "unseen": unseen,
            "p50_ms": quantile(0.50),
            "p99_ms": quantile(0.99),
            "seen_p50_ms": percentile(&latencies_ms, 0.50),
            "seen_p99_ms": percentile(&latencies_ms, 0.99),
        },
        "score": {
            "while_applying": score_summary(&score_us_loaded),
            "idle": score_summary(&score_us_idle),
        },
        "time_to_current_after_stop_s": time_to_current,
        "longest_unusable_ms": longest_unusable.as_secs_f64() * 1e3,
        "longest_probe_gap_ms": longest_probe_gap.as_secs_f64() * 1e3,
        "max_pools_listed": max_pools_listed,
        "relay_failovers": metrics.relay_failovers,
        "relay_silences": metrics.relay_silences,
        "live_bound_ms": live_bound_ns / 1_000_000,
        "windows": windows,
        "final_sequence": final_target.map(|(target, _, _)| target),
        "last_sequence": sequence,
    });
    println!("{report}");
    if let Ok(consumer) = Arc::try_unwrap(consumer) {
        consumer.shutdown().await;
    }
    Ok(())
}
