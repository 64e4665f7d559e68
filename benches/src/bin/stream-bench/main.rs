//! `stream-bench`: the driver of the stream benchmark (`cargo xtask bench stream [--quick]`).
//!
//! Per run it starts, as separate processes on 127.0.0.1 free ports: `--workers` (4)
//! `stream-engine`s, a real `kvrelay relay` (file card discovery of one pool, one
//! `[[sources]]` entry with a replay endpoint per engine) and a `stream-follower`; it
//! starts the engines once the follower holds a replica, prints one progress line a
//! second, waits for the relay to drain and the follower to be current at the final
//! sequence, and prints a Markdown table (stdout) and writes every figure as JSON
//! (`--out-dir`, default `target/`, file `stream-bench.json`). Runs: `paced` (48 k
//! events/s), `low` (5 k events/s) and `flat` (as fast as the engines go); see
//! docs/benchmarks.md for the columns. The opt-in `dynamo-paced`, `dynamo-flat` and
//! `dynamo-burst` runs compare kvrelay with Dynamo's relay (`vs_dynamo.rs`, `cargo xtask
//! bench dynamo`).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvrelay_benches::{Flags, MODEL, http_get, metric_by_label, metric_sum, process_memory};
use serde_json::{Value, json};

mod pair;
mod restart;
mod vs_dynamo;

/// Endpoint of the benchmark's one pool.
const NAMESPACE: &str = "bench";
const COMPONENT: &str = "backend";
const ENDPOINT: &str = "generate";
/// Engine worker ids start here.
const FIRST_WORKER_ID: u64 = 0x100;
/// Admin HTTP request timeout.
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
/// The stream runs, the opt-in runs against Dynamo's relay and the opt-in join runs, by
/// name.
const STREAM_RUNS: [&str; 3] = ["paced", "low", "flat"];
const DYNAMO_RUNS: [&str; 3] = ["dynamo-paced", "dynamo-flat", "dynamo-burst"];
const JOIN_RUNS: [&str; 5] = [
    "join-live",
    "join-live-noreplay",
    "join-live-ring8",
    "join-idle",
    "join-idle-noreplay",
];
/// Every flag the driver reads.
const FLAGS: [&str; 14] = [
    "quick",
    "python",
    "dynamo-scripts",
    "kvrelay",
    "trace",
    "out-dir",
    "workers",
    "capacity",
    "relay-limits",
    "seconds",
    "paced-rate",
    "low-rate",
    "runs",
    "engine-nice",
];
const USAGE: &str = "\
usage: stream-bench [--runs paced,low,flat] [--quick] [--seconds N]
                    [--trace FILE] [--out-dir DIR] [--kvrelay BIN]
                    [--workers N] [--capacity BLOCKS] [--paced-rate EV/S] [--low-rate EV/S]
                    [--engine-nice N] [--relay-limits key=value,...]

Runs: paced, low, flat (default all three); dynamo-paced, dynamo-flat, dynamo-burst
(opt-in: the paced and flat runs, and the whole trace made before it is sent, through
kvrelay's gRPC door and through Dynamo's relay, each to the same gRPC follower; --python, default target/interop/venv/bin/python, and
--dynamo-scripts, default benches/dynamo); join-live, join-live-noreplay,
join-live-ring8, join-idle, join-idle-noreplay, restart-checkpoint, restart-cold,
restart-checkpoint-backoff (its follower rejoins on the backoff only: the baseline of the
consumer's rejoin interval), pair-kill, pair-kill-hot (its follower keeps the standby hot),
pair-upgrade (opt-in). --engine-nice (default 19)
lowers the engine processes' CPU priority, as engines on their own hosts would not take
the relay's CPU; 0 runs them at the relay's priority. See docs/benchmarks.md.
";

/// One run's settings.
#[derive(Debug, Clone)]
struct RunSpec {
    name: String,
    /// Target events/s over all engines; 0 = flat out.
    rate: f64,
    /// Longest publishing time; the trace may end sooner.
    max_seconds: f64,
    /// Whether the engines serve and encode every batch before `go` and then only send
    /// (`stream-engine --precompute`): the offered rate is then far above what a relay
    /// drains, so the run measures the relay's sustained rate, not the engines'.
    precompute: bool,
}

/// A join run: the engines publish first and the relay starts `join_after_s` later.
#[derive(Debug, Clone)]
struct JoinSpec {
    name: String,
    /// Target events/s over all engines.
    rate: f64,
    /// How long the engines publish (from `go`).
    publish_s: f64,
    /// When the relay starts (from `go`): before `publish_s` it joins running engines,
    /// after it joins idle ones.
    join_after_s: f64,
    /// Whether the relay's `[[sources]]` name the engines' replay sockets.
    replay: bool,
    /// Batches each engine keeps for replay (vLLM's default: 10,000).
    replay_batches: usize,
}

/// How long after starting a joining relay its pool is compared with the ground truth.
const JOIN_MEASURE_AFTER: Duration = Duration::from_secs(10);

/// Everything shared by the runs.
#[derive(Debug, Clone)]
struct Setup {
    bin_dir: PathBuf,
    kvrelay: PathBuf,
    trace: PathBuf,
    out_dir: PathBuf,
    workers: usize,
    capacity: usize,
    /// Niceness the engines run at (`nice -n`; 0 = the driver's own priority).
    engine_nice: u8,
    /// Extra `[limits]` lines for the relay (`key = value`), for experiments.
    relay_limits: Vec<String>,
}

/// A child process whose stdout lines arrive on a channel.
struct Proc {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Proc {
    fn spawn(name: &str, command: &mut Command, stderr: Stdio) -> Result<Self> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {name} ({command:?})"))?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().context("child stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Ok(Self {
            name: name.to_owned(),
            child,
            stdin,
            lines,
        })
    }

    fn send(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("stdin closed")?;
        writeln!(stdin, "{line}").with_context(|| format!("writing to {}", self.name))?;
        stdin.flush()?;
        Ok(())
    }

    /// Waits for a line starting with `prefix` (other lines are skipped).
    async fn expect(&mut self, prefix: &str, timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.lines.try_recv() {
                Ok(line) if line.starts_with(prefix) => return Ok(line),
                Ok(_) => continue,
                Err(mpsc::TryRecvError::Disconnected) => {
                    bail!("{} exited before printing {prefix:?}", self.name)
                }
                Err(mpsc::TryRecvError::Empty) => {}
            }
            if Instant::now() >= deadline {
                bail!("{} did not print {prefix:?} within {timeout:?}", self.name);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGTERM, then waits up to `timeout` for the exit: how long it took (SIGKILL after).
    async fn terminate(&mut self, timeout: Duration) -> Result<Duration> {
        let started = Instant::now();
        let status = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status()
            .context("running kill -TERM")?;
        if !status.success() {
            bail!("kill -TERM {} failed", self.name);
        }
        while started.elapsed() < timeout {
            if self.child.try_wait()?.is_some() {
                return Ok(started.elapsed());
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.stop();
        bail!("{} did not exit within {timeout:?} of SIGTERM", self.name)
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> Result<u16> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(listener.local_addr()?.port())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<()> {
    let flags = Flags::from_env();
    if flags.wants_help() {
        print!("{USAGE}");
        return Ok(());
    }
    flags.ensure_known(&FLAGS)?;
    let quick = flags.switch("quick");
    let exe = std::env::current_exe()?;
    let bin_dir = exe
        .parent()
        .context("the driver's directory")?
        .to_path_buf();
    let setup = Setup {
        kvrelay: flags
            .raw("kvrelay")
            .map_or_else(|| bin_dir.join("kvrelay"), PathBuf::from),
        bin_dir,
        trace: PathBuf::from(
            flags
                .raw("trace")
                .unwrap_or("../shared/traces/mooncake-synthetic.jsonl"),
        ),
        out_dir: PathBuf::from(flags.raw("out-dir").unwrap_or("target")),
        workers: flags.get_or("workers", 4)?,
        capacity: flags.get_or("capacity", 20_000)?,
        engine_nice: flags.get_or("engine-nice", 19)?,
        relay_limits: flags
            .raw("relay-limits")
            .map(|text| {
                text.split(',')
                    .filter(|kv| !kv.is_empty())
                    .map(|kv| kv.replacen('=', " = ", 1))
                    .collect()
            })
            .unwrap_or_default(),
    };
    if !setup.kvrelay.is_file() {
        bail!(
            "{} not found: build it first (cargo build --release -p kvrelay) or pass --kvrelay",
            setup.kvrelay.display()
        );
    }
    // Full runs publish the whole trace at the paced rate (~60 s); the low rate is capped
    // (the whole trace at 5 k events/s would take ~10 minutes). `--quick`: ≤ 60 s in all.
    let max_seconds: f64 = flags.get_or("seconds", if quick { 6.0 } else { 90.0 })?;
    let paced: f64 = flags.get_or("paced-rate", 48_000.0)?;
    let low: f64 = flags.get_or("low-rate", 5_000.0)?;
    let all_runs = [
        RunSpec {
            name: "paced".into(),
            rate: paced,
            max_seconds,
            precompute: false,
        },
        RunSpec {
            name: "low".into(),
            rate: low,
            max_seconds,
            precompute: false,
        },
        RunSpec {
            name: "flat".into(),
            rate: 0.0,
            max_seconds,
            precompute: false,
        },
    ];
    let wanted: Vec<String> = flags
        .raw("runs")
        .unwrap_or("paced,low,flat")
        .split(',')
        .map(str::to_owned)
        .collect();
    if let Some(unknown) = wanted.iter().find(|name| {
        !STREAM_RUNS.contains(&name.as_str())
            && !DYNAMO_RUNS.contains(&name.as_str())
            && !JOIN_RUNS.contains(&name.as_str())
            && !restart::RESTART_RUNS.contains(&name.as_str())
            && !pair::PAIR_RUNS.contains(&name.as_str())
    }) {
        bail!(
            "unknown run {unknown:?} in --runs (known: {STREAM_RUNS:?}, {DYNAMO_RUNS:?}, {JOIN_RUNS:?}, {:?}, {:?})",
            restart::RESTART_RUNS,
            pair::PAIR_RUNS
        );
    }
    // Join runs (opt-in: `--runs join-live,join-live-noreplay,join-live-ring8,join-idle,
    // join-idle-noreplay`):
    // the engines publish at the low rate (at the paced rate their caches turn over within
    // a few seconds, so anything live soon covers everything); the relay joins at 24 s,
    // while they run (they stop at 30 s), or at 32 s, after they stopped; its pool is
    // measured 10 s after it started.
    let join_runs = [
        ("join-live", 30.0, 24.0, true, 10_000),
        ("join-live-noreplay", 30.0, 24.0, false, 10_000),
        // A long-running engine: its replay ring no longer reaches back to sequence 0.
        ("join-live-ring8", 30.0, 24.0, true, 8),
        ("join-idle", 30.0, 32.0, true, 10_000),
        ("join-idle-noreplay", 30.0, 32.0, false, 10_000),
    ]
    .map(
        |(name, publish_s, join_after_s, replay, replay_batches)| JoinSpec {
            name: name.to_owned(),
            rate: low,
            publish_s,
            join_after_s,
            replay,
            replay_batches,
        },
    );
    let mut join_results = Vec::new();
    if join_runs.iter().any(|spec| wanted.contains(&spec.name)) {
        let text = std::fs::read_to_string(&setup.trace)
            .with_context(|| format!("reading {}", setup.trace.display()))?;
        let requests = kvrelay_ingest::parse_request_trace(&text)?;
        for spec in join_runs.iter().filter(|spec| wanted.contains(&spec.name)) {
            eprintln!(
                "==> join run `{}`: engines publish {:.0} s at {:.0} events/s, relay joins at {:.0} s {} replay",
                spec.name,
                spec.publish_s,
                spec.rate,
                spec.join_after_s,
                if spec.replay { "with" } else { "without" }
            );
            let result = run_join(&setup, spec, &requests)
                .await
                .with_context(|| format!("join run {}", spec.name))?;
            join_results.push(result);
        }
    }
    // Restart runs (opt-in): the low rate for 30 s (20 s quick), a ring of 10 batches
    // (each engine publishes about 3 batches a second here: the ring covers a few seconds
    // of downtime but not the history before the kill, like vLLM's 10,000 batches on a
    // long-running engine).
    let restart_runs = restart::RESTART_RUNS.map(|name| restart::RestartSpec {
        name: name.to_owned(),
        rate: low,
        publish_s: if quick { 20.0 } else { 30.0 },
        replay_batches: 10,
        checkpoint: name != "restart-cold",
        rejoin: name != "restart-checkpoint-backoff",
    });
    let mut restart_results = Vec::new();
    if restart_runs.iter().any(|spec| wanted.contains(&spec.name)) {
        let text = std::fs::read_to_string(&setup.trace)
            .with_context(|| format!("reading {}", setup.trace.display()))?;
        let requests = kvrelay_ingest::parse_request_trace(&text)?;
        for spec in restart_runs
            .iter()
            .filter(|spec| wanted.contains(&spec.name))
        {
            eprintln!(
                "==> restart run `{}`: engines publish {:.0} s at {:.0} events/s (ring {} batches), relay killed at 40 % and restarted 1 s later, checkpoints {}, follower rejoins {}",
                spec.name,
                spec.publish_s,
                spec.rate,
                spec.replay_batches,
                if spec.checkpoint { "on" } else { "off" },
                if spec.rejoin {
                    "at its rejoin interval"
                } else {
                    "on its backoff only"
                }
            );
            let result = restart::run(&setup, spec, &requests)
                .await
                .with_context(|| format!("restart run {}", spec.name))?;
            restart_results.push(result);
        }
    }
    // Pair runs (opt-in): the low rate for 40 s (20 s quick), rings of 10,000 batches.
    let pair_runs = pair::PAIR_RUNS.map(|name| pair::PairSpec {
        name: name.to_owned(),
        rate: low,
        publish_s: if quick { 20.0 } else { 40.0 },
        upgrade: name == "pair-upgrade",
        hot: name == "pair-kill-hot",
    });
    let mut pair_results = Vec::new();
    if pair_runs.iter().any(|spec| wanted.contains(&spec.name)) {
        let text = std::fs::read_to_string(&setup.trace)
            .with_context(|| format!("reading {}", setup.trace.display()))?;
        let requests = kvrelay_ingest::parse_request_trace(&text)?;
        for spec in pair_runs.iter().filter(|spec| wanted.contains(&spec.name)) {
            eprintln!(
                "==> pair run `{}`: engines publish {:.0} s at {:.0} events/s into two relays of one DC, a follower follows them as one; {}",
                spec.name,
                spec.publish_s,
                spec.rate,
                match (spec.upgrade, spec.hot) {
                    (true, _) => "rolling upgrade (SIGTERM and restart of each in turn)",
                    (false, false) => "the followed relay SIGKILLed at 40 %",
                    (false, true) =>
                        "both relays followed (hot standby), the scored one SIGKILLed at 40 %",
                }
            );
            let result = pair::run(&setup, spec, &requests)
                .await
                .with_context(|| format!("pair run {}", spec.name))?;
            pair_results.push(result);
        }
    }
    let mut results = Vec::new();
    for spec in all_runs.iter().filter(|spec| wanted.contains(&spec.name)) {
        eprintln!(
            "==> stream run `{}`: {} events/s, ≤ {:.0} s",
            spec.name,
            if spec.rate > 0.0 {
                format!("{:.0}", spec.rate)
            } else {
                "flat-out".to_owned()
            },
            spec.max_seconds
        );
        let result = run(&setup, spec)
            .await
            .with_context(|| format!("stream run {}", spec.name))?;
        results.push(result);
    }
    let dynamo_side = vs_dynamo::DynamoSide {
        python: PathBuf::from(
            flags
                .raw("python")
                .unwrap_or("target/interop/venv/bin/python"),
        ),
        scripts: PathBuf::from(flags.raw("dynamo-scripts").unwrap_or("benches/dynamo")),
    };
    let mut dynamo_results = Vec::new();
    // The burst is the flat run with the engines' work done before `go`: the whole trace
    // (quick too: it drains in seconds).
    let burst = RunSpec {
        precompute: true,
        ..all_runs[2].clone()
    };
    for (name, spec) in DYNAMO_RUNS.iter().zip([&all_runs[0], &all_runs[2], &burst]) {
        if !wanted.iter().any(|wanted| wanted == name) {
            continue;
        }
        let spec = RunSpec {
            name: (*name).to_owned(),
            ..spec.clone()
        };
        let result = vs_dynamo::run(&setup, &spec, &dynamo_side)
            .await
            .with_context(|| format!("run {name}"))?;
        dynamo_results.push(result);
    }
    let mut table = if results.is_empty() {
        String::new()
    } else {
        render(&results)
    };
    if !dynamo_results.is_empty() {
        table.push_str(&vs_dynamo::render(&dynamo_results));
    }
    if !join_results.is_empty() {
        table.push_str(&render_join(&join_results));
    }
    if !restart_results.is_empty() {
        table.push_str(&restart::render(&restart_results));
    }
    if !pair_results.is_empty() {
        table.push_str(&pair::render(&pair_results));
    }
    print!("{table}");
    std::fs::create_dir_all(&setup.out_dir)?;
    let json_path = setup.out_dir.join("stream-bench.json");
    let document = json!({
        "benchmark": "stream",
        "trace": setup.trace.display().to_string(),
        "workers": setup.workers,
        "engine_nice": setup.engine_nice,
        "capacity_blocks": setup.capacity,
        "relay_limits": setup.relay_limits,
        "quick": quick,
        "runs": results,
        "dynamo_runs": dynamo_results,
        "join_runs": join_results,
        "restart_runs": restart_results,
        "pair_runs": pair_results,
    });
    std::fs::write(&json_path, serde_json::to_string_pretty(&document)?)
        .with_context(|| format!("writing {}", json_path.display()))?;
    std::fs::write(setup.out_dir.join("stream-bench.md"), &table)?;
    eprintln!("figures written to {}", json_path.display());
    Ok(())
}

fn write_cards(dir: &Path, setup: &Setup) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    for worker in 0..setup.workers as u64 {
        let instance_id = FIRST_WORKER_ID + worker;
        let record = json!({
            "type": "Model", "namespace": NAMESPACE, "component": COMPONENT, "endpoint": ENDPOINT,
            "instance_id": instance_id,
            "card_json": {
                "display_name": MODEL, "source_path": format!("models/{MODEL}"),
                "kv_cache_block_size": kvrelay_benches::BLOCK_SIZE,
                "model_type": "Chat", "worker_type": "aggregated", "needs": [],
                "runtime_config": {
                    "total_kv_blocks": setup.capacity,
                    "data_parallel_start_rank": 0, "data_parallel_size": 1
                }
            }
        });
        std::fs::write(dir.join(format!("w{worker}.json")), record.to_string())?;
    }
    Ok(())
}

/// The relay's figures at one moment (`/metrics` and the pool's `/v1/pools/{pool}/stats`).
#[derive(Debug, Clone, Default)]
struct RelaySample {
    /// Events the pool actor applied / rejected (pool stats).
    events_applied: f64,
    events_rejected: f64,
    /// The pool's publication sequence.
    sequence: u64,
    /// Publications the actor deferred because its hub's feed was full (pool stats;
    /// before the publication rewrite the relay reported hub overruns here).
    deferred_publications: f64,
    /// Delta frames coalesced for subscribers that fell behind
    /// (`kvrelay_stream_coalesced_frames_total`).
    coalesced_frames: f64,
    /// Deltas the pool published, and bucket images in them (pool stats `publications`,
    /// `emitted_images`): what a subscriber that keeps up receives, attached or not.
    publications: f64,
    emitted_images: f64,
    /// Events the ingest sources handed to the pool (`kvrelay_events_total{submitted}`).
    events_submitted: f64,
    pool_frames: f64,
    pool_bytes: f64,
    pool_lagged: f64,
    errors: BTreeMap<String, f64>,
    ingest_replays: BTreeMap<String, f64>,
    ingest_resets: BTreeMap<String, f64>,
}

fn relay_sample(admin: &str, stats_path: &str) -> Result<RelaySample> {
    let (status, text) = http_get(admin, "/metrics", HTTP_TIMEOUT)?;
    if status != 200 {
        bail!("/metrics answered {status}");
    }
    let (status, body) = http_get(admin, stats_path, HTTP_TIMEOUT)?;
    if status != 200 {
        bail!("{stats_path} answered {status}");
    }
    let stats: Value = serde_json::from_str(&body).context("parsing the pool stats")?;
    let stat = |name: &str| stats["stats"][name].as_f64().unwrap_or(0.0);
    Ok(RelaySample {
        events_applied: stat("events_applied"),
        events_rejected: stat("events_rejected"),
        sequence: stats["stats"]["sequence"].as_u64().unwrap_or(0),
        deferred_publications: stat("deferred_publications"),
        coalesced_frames: metric_sum(&text, "kvrelay_stream_coalesced_frames_total", &[]),
        publications: stat("publications"),
        emitted_images: stat("emitted_images"),
        events_submitted: metric_sum(
            &text,
            "kvrelay_events_total",
            &[("disposition", "submitted")],
        ),
        pool_frames: metric_sum(&text, "kvrelay_frames_sent_total", &[("stream", "pool")]),
        pool_bytes: metric_sum(&text, "kvrelay_bytes_sent_total", &[("stream", "pool")]),
        pool_lagged: metric_sum(
            &text,
            "kvrelay_subscriber_lagged_total",
            &[("stream", "pool")],
        ),
        errors: metric_by_label(&text, "kvrelay_errors_sent_total", "reason")
            .into_iter()
            .collect(),
        ingest_replays: metric_by_label(&text, "kvrelay_ingest_replays_total", "outcome")
            .into_iter()
            .collect(),
        ingest_resets: metric_by_label(&text, "kvrelay_ingest_resets_total", "cause")
            .into_iter()
            .collect(),
    })
}

/// The pool's stats path from `/v1/pools` (the benchmark has one pool).
fn pool_stats_path(admin: &str) -> Result<String> {
    let (_, body) = http_get(admin, "/v1/pools", HTTP_TIMEOUT)?;
    let pools: Value = serde_json::from_str(&body).context("parsing /v1/pools")?;
    let pool = pools["pools"][0]["pool"]
        .as_str()
        .context("no pool in /v1/pools")?;
    Ok(format!("/v1/pools/{pool}/stats"))
}

/// `after - before` per label, nonzero ones only.
fn diff(after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    after
        .iter()
        .map(|(label, n)| (label.clone(), n - before.get(label).copied().unwrap_or(0.0)))
        .filter(|(_, n)| *n > 0.0)
        .collect()
}

/// One engine's sockets.
struct EngineAddr {
    worker_id: u64,
    publish: u16,
    replay: u16,
}

/// How many times one engine is started, each time on fresh ports, before the run fails.
/// `free_port` releases a port before the engine binds it, and another process on this
/// machine (Dynamo's runtime opens ports of its own; CI runs other jobs) may take it in
/// between: the engine then exits with "Address already in use".
const ENGINE_START_ATTEMPTS: usize = 4;

/// Starts `setup.workers` engines publishing at `rate` for at most `max_seconds` once told
/// `go` (with `precompute`, every batch is made before `ready`; see [`RunSpec`]), and
/// waits until each has bound its sockets. An engine that exits before binding is
/// started again on fresh ports (see [`ENGINE_START_ATTEMPTS`]); when it keeps failing the
/// error carries the end of its log.
async fn spawn_engines(
    setup: &Setup,
    dir: &Path,
    rate: f64,
    max_seconds: f64,
    replay_batches: usize,
    precompute: bool,
) -> Result<(Vec<Proc>, Vec<EngineAddr>, Vec<String>)> {
    let mut engines = Vec::new();
    let mut addrs = Vec::new();
    let mut stamp_paths = Vec::new();
    for index in 0..setup.workers {
        let worker_id = FIRST_WORKER_ID + index as u64;
        let stamps = dir.join(format!("stamps-{index}.txt"));
        let log_path = dir.join(format!("engine-{index}.log"));
        let mut attempt = 1;
        let (engine, addr) = loop {
            // Both ports are held until both are known, so they differ.
            let (publish, replay) = {
                let first = std::net::TcpListener::bind("127.0.0.1:0")?;
                let second = std::net::TcpListener::bind("127.0.0.1:0")?;
                (first.local_addr()?.port(), second.local_addr()?.port())
            };
            let log = std::fs::File::create(&log_path)?;
            let engine = setup.bin_dir.join("stream-engine");
            // `nice` execs the engine, so the child's pid stays the engine's.
            let mut command = if setup.engine_nice > 0 {
                let mut nice = Command::new("nice");
                nice.arg("-n")
                    .arg(setup.engine_nice.to_string())
                    .arg(engine);
                nice
            } else {
                Command::new(engine)
            };
            command
                .arg("--index")
                .arg(index.to_string())
                .arg("--workers")
                .arg(setup.workers.to_string())
                .arg("--worker-id")
                .arg(worker_id.to_string())
                .arg("--trace")
                .arg(&setup.trace)
                .arg("--capacity")
                .arg(setup.capacity.to_string())
                .arg("--rate")
                .arg(rate.to_string())
                .arg("--max-seconds")
                .arg(max_seconds.to_string())
                .arg("--publish")
                .arg(format!("tcp://127.0.0.1:{publish}"))
                .arg("--replay")
                .arg(format!("tcp://127.0.0.1:{replay}"))
                .arg("--stamps")
                .arg(&stamps)
                .arg("--replay-batches")
                .arg(replay_batches.to_string());
            if precompute {
                command.arg("--precompute");
            }
            let mut engine = Proc::spawn(
                &format!("stream-engine {index}"),
                &mut command,
                Stdio::from(log),
            )?;
            match engine.expect("ready", Duration::from_secs(60)).await {
                Ok(_) => {
                    break (
                        engine,
                        EngineAddr {
                            worker_id,
                            publish,
                            replay,
                        },
                    );
                }
                Err(error) => {
                    engine.stop();
                    let log_tail = log_tail(&log_path);
                    if attempt >= ENGINE_START_ATTEMPTS {
                        bail!(
                            "{error} ({attempt} attempts on fresh ports); {}: {log_tail}",
                            log_path.display()
                        );
                    }
                    eprintln!(
                        "    stream-engine {index} did not start ({error}: {log_tail}); \
                         starting it again on fresh ports"
                    );
                    attempt += 1;
                }
            }
        };
        engines.push(engine);
        addrs.push(addr);
        stamp_paths.push(stamps.display().to_string());
    }
    Ok((engines, addrs, stamp_paths))
}

/// The last lines of a process's log, on one line, for an error message.
fn log_tail(path: &Path) -> String {
    const TAIL_LINES: usize = 5;
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text
                .lines()
                .filter(|line| !line.trim().is_empty())
                .collect();
            let tail = lines[lines.len().saturating_sub(TAIL_LINES)..].join(" | ");
            if tail.is_empty() {
                "(empty log)".to_owned()
            } else {
                tail
            }
        }
        Err(error) => format!("(log unreadable: {error})"),
    }
}

/// The relay's `[[sources]]` entries for `addrs`, with or without their replay sockets.
fn sources_toml(addrs: &[EngineAddr], with_replay: bool) -> String {
    let mut sources = String::new();
    for addr in addrs {
        sources.push_str(&format!(
            "\n[[sources]]\nendpoint = \"{NAMESPACE}.{COMPONENT}.{ENDPOINT}\"\nworker_id = {}\n\
             dp_rank = 0\nengine = \"vllm\"\nzmq = \"tcp://127.0.0.1:{}\"\n",
            addr.worker_id, addr.publish
        ));
        if with_replay {
            sources.push_str(&format!("replay = \"tcp://127.0.0.1:{}\"\n", addr.replay));
        }
    }
    sources
}

/// Starts `kvrelay relay` on free ports with file discovery of `cards` and `sources`;
/// returns the process, its admin address and its WAN port.
fn start_relay(
    setup: &Setup,
    dir: &Path,
    cards: &Path,
    sources: &str,
) -> Result<(Proc, String, u16)> {
    let (wan, admin_port) = (free_port()?, free_port()?);
    let (relay, admin) = start_relay_on(setup, dir, cards, sources, wan, admin_port)?;
    Ok((relay, admin, wan))
}

/// [`start_relay`] on the given WAN and admin ports (a relay started again where its
/// consumers know it); its config and log go to `dir`.
fn start_relay_on(
    setup: &Setup,
    dir: &Path,
    cards: &Path,
    sources: &str,
    wan: u16,
    admin_port: u16,
) -> Result<(Proc, String)> {
    let admin = format!("127.0.0.1:{admin_port}");
    let mut limits = String::new();
    if !setup.relay_limits.is_empty() {
        limits.push_str("\n[limits]\n");
        for line in &setup.relay_limits {
            limits.push_str(line);
            limits.push('\n');
        }
    }
    let config = format!(
        "dc_id = \"dc-bench\"\n\n[wan]\nlisten = \"127.0.0.1:{wan}\"\n\n[admin]\nlisten = \"{admin}\"\n\n\
         [discovery]\nbackend = \"file\"\ndir = \"{}\"\n{sources}{limits}",
        cards.display()
    );
    let config_path = dir.join("relay.toml");
    std::fs::write(&config_path, config)?;
    let relay_log = std::fs::File::create(dir.join("relay.log"))?;
    let relay = Proc::spawn(
        "kvrelay relay",
        Command::new(&setup.kvrelay)
            .arg("relay")
            .arg("--config")
            .arg(&config_path),
        Stdio::from(relay_log),
    )?;
    Ok((relay, admin))
}

/// Waits until the relay answers `/readyz` 200 (30 s at most).
async fn wait_ready(relay: &mut Proc, admin: &str, dir: &Path) -> Result<()> {
    let ready_deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok((200, _)) = http_get(admin, "/readyz", HTTP_TIMEOUT) {
            return Ok(());
        }
        if let Ok(Some(status)) = relay.child.try_wait() {
            bail!(
                "the relay exited with {status} (see {})",
                dir.join("relay.log").display()
            );
        }
        if Instant::now() >= ready_deadline {
            bail!(
                "the relay was not ready within 30 s (see {})",
                dir.join("relay.log").display()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Starts `stream-follower` on `relay` (any address it takes: `HOST:PORT` for our
/// protocol, `dynamo-grpc://HOST:PORT=DC`) and waits until it holds a replica.
async fn start_follower(
    setup: &Setup,
    relay: &str,
    stamp_paths: &[String],
    extra: &[&str],
) -> Result<Proc> {
    let mut follower = Proc::spawn(
        "stream-follower",
        Command::new(setup.bin_dir.join("stream-follower"))
            .arg("--relay")
            .arg(relay)
            .arg("--trace")
            .arg(&setup.trace)
            .arg("--stamps")
            .arg(stamp_paths.join(","))
            .args(extra),
        Stdio::inherit(),
    )?;
    follower
        .expect("installed", Duration::from_secs(60))
        .await?;
    Ok(follower)
}

/// Checkpoint period of the relays that checkpoint (restart and pair runs).
const CHECKPOINT_INTERVAL_MS: u64 = 500;

/// `sources` with `[state]` checkpoints into `dir/state` every [`CHECKPOINT_INTERVAL_MS`].
fn with_checkpoints(sources: &str, dir: &Path) -> String {
    format!(
        "{sources}\n[state]\ndir = \"{}\"\ncheckpoint_interval_ms = {CHECKPOINT_INTERVAL_MS}\n",
        dir.join("state").display()
    )
}

/// A fresh `target/stream-bench/<run>/` (absolute) with the run's cards in `cards/`.
fn run_dir(setup: &Setup, run: &str) -> Result<(PathBuf, PathBuf)> {
    let dir = setup.out_dir.join("stream-bench").join(run);
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    let dir = dir.canonicalize()?;
    let cards = dir.join("cards");
    write_cards(&cards, setup)?;
    Ok((dir, cards))
}

async fn run(setup: &Setup, spec: &RunSpec) -> Result<Value> {
    let (dir, cards) = run_dir(setup, &spec.name)?;

    // Engines first: their sockets are bound before the relay dials them.
    let (mut engines, addrs, stamp_paths) =
        spawn_engines(setup, &dir, spec.rate, spec.max_seconds, 10_000, false).await?;
    let (mut relay, admin, wan) = start_relay(setup, &dir, &cards, &sources_toml(&addrs, true))?;
    wait_ready(&mut relay, &admin, &dir).await?;

    let mut follower =
        start_follower(setup, &format!("127.0.0.1:{wan}"), &stamp_paths, &[]).await?;

    let stats_path = pool_stats_path(&admin)?;
    let before = relay_sample(&admin, &stats_path)?;
    let started = Instant::now();
    let go_ns = kvrelay_benches::stamps::unix_ns();
    for engine in &mut engines {
        engine.send("go")?;
    }
    let mut sent = vec![0u64; engines.len()];
    let mut done: Vec<Option<(u64, u64)>> = vec![None; engines.len()];
    let mut last = (Instant::now(), before.clone(), 0u64);
    let hard_stop = Duration::from_secs_f64(spec.max_seconds + 120.0);
    let mut next_progress = started + Duration::from_secs(1);
    while done.iter().any(Option::is_none) {
        // Engines are polled every 100 ms (so their end is noticed promptly), progress is
        // printed every second.
        tokio::time::sleep(Duration::from_millis(100)).await;
        poll_engines(&mut engines, &mut sent, &mut done)?;
        let now = Instant::now();
        if now < next_progress && done.iter().any(Option::is_none) {
            continue;
        }
        next_progress += Duration::from_secs(1);
        let sample = relay_sample(&admin, &stats_path)?;
        let total_sent: u64 = sent.iter().sum();
        let dt = now.duration_since(last.0).as_secs_f64().max(1e-9);
        eprintln!(
            "[{}] {:>4.0} s: engines sent {:>9} ev ({:>6.1} k/s), relay applied {:>9} ({:>6.1} k/s), pool {:>6.0} frames/s {:>7.2} MB/s, lagged cut-offs {}",
            spec.name,
            now.duration_since(started).as_secs_f64(),
            total_sent,
            (total_sent - last.2) as f64 / dt / 1e3,
            (sample.events_applied - before.events_applied) as u64,
            (sample.events_applied - last.1.events_applied) / dt / 1e3,
            (sample.pool_frames - last.1.pool_frames) / dt,
            (sample.pool_bytes - last.1.pool_bytes) / dt / 1e6,
            sample.pool_lagged - before.pool_lagged,
        );
        last = (now, sample, total_sent);
        if now.duration_since(started) > hard_stop {
            bail!("the engines did not finish within {hard_stop:?}");
        }
    }
    let stop_ns = done.iter().flatten().map(|(_, ns)| *ns).max().unwrap_or(0);
    let events_sent: u64 = done.iter().flatten().map(|(events, _)| *events).sum();
    // From the engines' own clocks: the driver notices `done` only on its next tick.
    let publish_seconds = stop_ns.saturating_sub(go_ns) as f64 / 1e9;

    // The relay has drained when its pool has applied or rejected every event sent (or
    // stopped moving for 3 s).
    let mut drained = Instant::now();
    let mut previous = -1.0;
    let drain_deadline = Instant::now() + Duration::from_secs(120);
    let mut drained_sample;
    loop {
        drained_sample = relay_sample(&admin, &stats_path)?;
        let disposed = drained_sample.events_applied + drained_sample.events_rejected
            - before.events_applied
            - before.events_rejected;
        if disposed >= events_sent as f64 {
            drained = Instant::now();
            break;
        }
        if disposed != previous {
            previous = disposed;
            drained = Instant::now();
        } else if drained.elapsed() > Duration::from_secs(3) || Instant::now() >= drain_deadline {
            eprintln!(
                "[{}] the relay's pool stopped at {disposed} of {events_sent} events",
                spec.name
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let final_sequence = drained_sample.sequence;
    let relay_memory = process_memory(relay.pid()).unwrap_or_default();
    let follower_memory = process_memory(follower.pid()).unwrap_or_default();
    follower.send(&format!("final {final_sequence} {stop_ns}"))?;
    let report_line = follower.expect("{", Duration::from_secs(120)).await?;
    let report: Value =
        serde_json::from_str(&report_line).context("parsing the follower's report")?;
    let after = relay_sample(&admin, &stats_path)?;
    for engine in &mut engines {
        let _ = engine.send("quit");
    }
    relay.stop();
    drop(engines);
    follower.stop();

    let busy_seconds = drained.duration_since(started).as_secs_f64().max(1e-9);
    let applied = after.events_applied - before.events_applied;
    let errors = diff(&after.errors, &before.errors);
    let deltas = report["deltas_applied"].as_f64().unwrap_or(0.0);
    let time_current = report["time_current_s"].as_f64().unwrap_or(0.0);
    let mb = |bytes: u64| bytes as f64 / (1024.0 * 1024.0);
    Ok(json!({
        "run": spec.name,
        "target_events_per_s": spec.rate,
        "events_sent": events_sent,
        "publish_seconds": publish_seconds,
        "engine_events_per_s": events_sent as f64 / publish_seconds.max(1e-9),
        "relay_events_applied": applied,
        "relay_events_per_s": applied / busy_seconds,
        "relay_drained_after_stop_s": (busy_seconds - publish_seconds).max(0.0),
        "relay_pool_frames": after.pool_frames - before.pool_frames,
        "relay_pool_frames_per_s": (after.pool_frames - before.pool_frames) / busy_seconds,
        "relay_pool_bytes_per_s": (after.pool_bytes - before.pool_bytes) / busy_seconds,
        "relay_pool_subscriber_lagged": after.pool_lagged - before.pool_lagged,
        "relay_error_frames": errors,
        "relay_events_submitted": after.events_submitted - before.events_submitted,
        "relay_events_rejected": after.events_rejected - before.events_rejected,
        "relay_deferred_publications": after.deferred_publications - before.deferred_publications,
        "relay_coalesced_frames": after.coalesced_frames - before.coalesced_frames,
        "relay_ingest_replays": diff(&after.ingest_replays, &before.ingest_replays),
        "relay_ingest_resets": diff(&after.ingest_resets, &before.ingest_resets),
        "consumer_delta_frames_per_s": deltas / busy_seconds,
        "consumer_delta_frames_per_current_s": if time_current > 0.0 { deltas / time_current } else { 0.0 },
        "relay_published_deltas_per_s": (after.publications - before.publications) / busy_seconds,
        "relay_emitted_images_per_s": (after.emitted_images - before.emitted_images) / busy_seconds,
        "final_sequence": final_sequence,
        "relay_rss_peak_mb": mb(relay_memory.peak_bytes),
        "relay_rss_mb": mb(relay_memory.current_bytes),
        "follower_rss_peak_mb": mb(follower_memory.peak_bytes),
        "follower_rss_mb": mb(follower_memory.current_bytes),
        "follower": report,
    }))
}

fn number(value: &Value, digits: usize) -> String {
    value
        .as_f64()
        .map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

fn reasons(value: &Value) -> String {
    match value.as_object() {
        Some(map) if !map.is_empty() => map
            .iter()
            .map(|(reason, n)| format!("{reason} {}", number(n, 0)))
            .collect::<Vec<_>>()
            .join(", "),
        _ => "0".to_owned(),
    }
}

/// `p50 / p99 (idle p50 / p99)` of the follower's score latencies, µs.
fn score_cell(score: &Value) -> String {
    let pair = |side: &Value| {
        format!(
            "{} / {}",
            number(&side["p50_us"], 1),
            number(&side["p99_us"], 1)
        )
    };
    format!(
        "{} ({})",
        pair(&score["while_applying"]),
        pair(&score["idle"])
    )
}

/// The Markdown table of every run.
fn render(results: &[Value]) -> String {
    let mut out = String::from(
        "\n| run | target ev/s | events | publish s | relay ev/s | usable | cut-offs (relay errors) | resubscribes (consumer) | published deltas/s | consumer deltas/s (per current s) | pool frames/s | pool MB/s | latency p50 / p99 ms (seen/probes) | score p50 / p99 µs applying (idle) | relay drained after stop s | current after stop s | relay RSS peak MB | follower RSS peak MB |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for run in results {
        let follower = &run["follower"];
        let latency = &follower["latency"];
        let ms = |v: &Value| {
            v.as_f64()
                .map_or_else(|| "unseen".to_owned(), |v| format!("{v:.1}"))
        };
        let target = run["target_events_per_s"].as_f64().unwrap_or(0.0);
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {}{} | {} | {} | {} ({}) | {} | {} | {} / {} ({}/{}) | {} | {} | {} | {} | {} |\n",
            run["run"].as_str().unwrap_or("?"),
            if target > 0.0 { format!("{target:.0}") } else { "flat out".to_owned() },
            number(&run["events_sent"], 0),
            number(&run["publish_seconds"], 1),
            number(&run["relay_events_per_s"], 0),
            follower["usable_fraction"]
                .as_f64()
                .map_or_else(|| "-".to_owned(), |f| format!("{:.1} %", 100.0 * f)),
            reasons(&run["relay_error_frames"]),
            match (
                run["relay_deferred_publications"].as_f64(),
                run["relay_coalesced_frames"].as_f64(),
            ) {
                (Some(d), Some(c)) if d > 0.0 || c > 0.0 => {
                    format!(" (deferred {d:.0}, coalesced {c:.0})")
                }
                _ => String::new(),
            },
            reasons(&follower["resubscribes"]),
            number(&run["relay_published_deltas_per_s"], 0),
            number(&run["consumer_delta_frames_per_s"], 0),
            number(&run["consumer_delta_frames_per_current_s"], 0),
            number(&run["relay_pool_frames_per_s"], 0),
            run["relay_pool_bytes_per_s"]
                .as_f64()
                .map_or_else(|| "-".to_owned(), |b| format!("{:.2}", b / 1e6)),
            ms(&latency["p50_ms"]),
            ms(&latency["p99_ms"]),
            number(&latency["seen"], 0),
            number(&latency["probes"], 0),
            score_cell(&follower["score"]),
            number(&run["relay_drained_after_stop_s"], 2),
            follower["time_to_current_after_stop_s"]
                .as_f64()
                .map_or_else(|| "never".to_owned(), |s| format!("{s:.2}")),
            number(&run["relay_rss_peak_mb"], 0),
            number(&run["follower_rss_peak_mb"], 0),
        ));
    }
    out
}

/// One join run: engines first, the relay `join_after_s` later; 10 s after the relay
/// started, its pool's resident blocks against the union of what the engines hold.
async fn run_join(
    setup: &Setup,
    spec: &JoinSpec,
    requests: &[kvrelay_ingest::RequestRecord],
) -> Result<Value> {
    let (dir, cards) = run_dir(setup, &spec.name)?;
    let (mut engines, addrs, _) = spawn_engines(
        setup,
        &dir,
        spec.rate,
        spec.publish_s,
        spec.replay_batches,
        false,
    )
    .await?;
    for engine in &mut engines {
        engine.send("go")?;
    }
    let go = Instant::now();
    // Published batches (and stop time) per engine, from its `done` line.
    let mut batches: Vec<Option<(u64, u64)>> = vec![None; engines.len()];
    let join_at = go + Duration::from_secs_f64(spec.join_after_s);
    while Instant::now() < join_at {
        poll_done(&mut engines, &mut batches)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (mut relay, admin, _) =
        start_relay(setup, &dir, &cards, &sources_toml(&addrs, spec.replay))?;
    let joined = Instant::now();
    wait_ready(&mut relay, &admin, &dir).await?;
    let ready_s = joined.elapsed().as_secs_f64();
    let measure_at = joined + JOIN_MEASURE_AFTER;
    while Instant::now() < measure_at {
        poll_done(&mut engines, &mut batches)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    poll_done(&mut engines, &mut batches)?;
    let stats_path = pool_stats_path(&admin)?;
    let (status, body) = http_get(&admin, &stats_path, HTTP_TIMEOUT)?;
    if status != 200 {
        bail!("{stats_path} answered {status}");
    }
    let stats: Value = serde_json::from_str(&body).context("parsing the pool stats")?;
    let sample = relay_sample(&admin, &stats_path)?;
    for engine in &mut engines {
        let _ = engine.send("quit");
    }
    relay.stop();
    drop(engines);
    let Some(batches) = batches
        .into_iter()
        .map(|done| done.map(|(n_batches, _)| n_batches))
        .collect::<Option<Vec<u64>>>()
    else {
        bail!("an engine was still publishing 10 s after the relay joined: no exact truth");
    };
    let truth = engine_truth(setup, requests, &batches);
    let stat = |name: &str| stats["stats"][name].as_f64().unwrap_or(0.0);
    let resident = stat("resident_blocks");
    let truth_blocks = truth.len() as f64;
    Ok(json!({
        "run": spec.name,
        "rate": spec.rate,
        "publish_s": spec.publish_s,
        "join_after_s": spec.join_after_s,
        "replay": spec.replay,
        "replay_batches": spec.replay_batches,
        "engine_batches": batches,
        "relay_ready_after_s": ready_s,
        "measured_after_s": JOIN_MEASURE_AFTER.as_secs_f64(),
        "truth_blocks": truth_blocks,
        "resident_blocks": resident,
        "owned_blocks": stat("owned_blocks"),
        "routable_fraction": if truth_blocks > 0.0 { resident / truth_blocks } else { 0.0 },
        "events_applied": stat("events_applied"),
        "unroutable_events": stat("unroutable_events"),
        "unroutable_blocks": stat("unroutable_blocks"),
        "unknown_removals": stats["stats"]["unknown_removals"].as_f64().unwrap_or(0.0),
        "ingest_replays": sample.ingest_replays,
        "ingest_resets": sample.ingest_resets,
    }))
}

/// The union of the engines' caches after each published `batches[i]` batches (the
/// simulation they run), by block key.
fn engine_truth(
    setup: &Setup,
    requests: &[kvrelay_ingest::RequestRecord],
    batches: &[u64],
) -> std::collections::HashSet<u64> {
    let mut truth = std::collections::HashSet::new();
    for (index, n_batches) in batches.iter().enumerate() {
        let cache = kvrelay_benches::sim::cache_after_batches(
            requests,
            setup.workers,
            index,
            FIRST_WORKER_ID + index as u64,
            setup.capacity,
            *n_batches,
        );
        truth.extend(cache.keys());
    }
    truth
}

/// Reads the engines' pending lines: events sent so far, and (events, stop time) once an
/// engine is `done`; fails if an engine exited before.
fn poll_engines(
    engines: &mut [Proc],
    sent: &mut [u64],
    done: &mut [Option<(u64, u64)>],
) -> Result<()> {
    for (at, engine) in engines.iter_mut().enumerate() {
        while let Ok(line) = engine.lines.try_recv() {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["sent", events, _] => sent[at] = events.parse().unwrap_or(sent[at]),
                ["done", events, _, unix] => {
                    let events = events.parse().unwrap_or(0);
                    sent[at] = events;
                    done[at] = Some((events, unix.parse().unwrap_or(0)));
                }
                _ => {}
            }
        }
        if done[at].is_none()
            && let Ok(Some(status)) = engine.child.try_wait()
        {
            bail!("{} exited with {status}", engine.name);
        }
    }
    Ok(())
}

/// Reads the engines' pending lines, noting each one's published batch count and stop
/// time (Unix ns) once it is `done`; fails if an engine exited.
fn poll_done(engines: &mut [Proc], done: &mut [Option<(u64, u64)>]) -> Result<()> {
    for (at, engine) in engines.iter_mut().enumerate() {
        while let Ok(line) = engine.lines.try_recv() {
            if let ["done", _, n_batches, unix] = line.split_whitespace().collect::<Vec<_>>()[..] {
                done[at] = n_batches
                    .parse()
                    .ok()
                    .map(|n| (n, unix.parse().unwrap_or(0)));
            }
        }
        if done[at].is_none()
            && let Ok(Some(status)) = engine.child.try_wait()
        {
            bail!("{} exited with {status}", engine.name);
        }
    }
    Ok(())
}

/// The join runs as a Markdown table.
fn render_join(results: &[Value]) -> String {
    let mut out = String::from(
        "\n| join run | relay joins | replay (ring) | truth blocks | resident 10 s later | routable | unroutable blocks | replays | resets |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for result in results {
        let joins = if result["join_after_s"].as_f64() < result["publish_s"].as_f64() {
            "while publishing"
        } else {
            "after they stopped"
        };
        out.push_str(&format!(
            "| {} | {} at {} s | {} | {} | {} | {:.1} % | {} | {} | {} |\n",
            result["run"].as_str().unwrap_or("?"),
            joins,
            number(&result["join_after_s"], 0),
            if result["replay"].as_bool().unwrap_or(false) {
                format!("yes ({})", number(&result["replay_batches"], 0))
            } else {
                "no".to_owned()
            },
            number(&result["truth_blocks"], 0),
            number(&result["resident_blocks"], 0),
            result["routable_fraction"].as_f64().unwrap_or(0.0) * 100.0,
            number(&result["unroutable_blocks"], 0),
            reasons(&result["ingest_replays"]),
            reasons(&result["ingest_resets"]),
        ));
    }
    out
}
