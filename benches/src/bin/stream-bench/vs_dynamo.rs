//! The stream benchmark against Dynamo's relay (`--runs dynamo-paced,dynamo-flat,
//! dynamo-burst`, opt-in; `cargo xtask bench dynamo [--quick]`).
//!
//! Each run publishes the same trace, at the same rate, from the same `stream-engine`s
//! through two relays in turn, each followed by the same gRPC follower (`stream-follower`
//! with `--relay dynamo-grpc://...`: our consumer speaking Dynamo's contract). In
//! `dynamo-paced` and `dynamo-flat` the engines simulate and encode as they go, so flat
//! out they share the machine with the relays and bound the rate; in `dynamo-burst` they
//! make the whole trace before `go` (`stream-engine --precompute`) and then only hand it
//! to libzmq, so the relays get more than they can drain and the run measures each
//! relay's own sustained rate.
//!
//! - **kvrelay**: `kvrelay relay` reading the engines directly (replay sockets on), serving
//!   the follower on its `[dynamo]` door (plaintext, loopback).
//! - **dynamo**: Dynamo 1.6.1's `KvDcRelay` (`benches/dynamo/dynamo_relay.py`, file
//!   discovery) fed by one Dynamo worker runtime per engine in one process
//!   (`dynamo_workers.py`: a model card and a `KvEventPublisher` relaying the engine's ZMQ
//!   stream onto Dynamo's event plane). Dynamo reads engines in the workers, not in the
//!   relay, so its ingest CPU is the workers process's and is reported apart (on a real
//!   fleet it runs on the engine hosts).
//!
//! Neither relay exposes the same counters, so every figure is taken the same way for
//! both, from the outside: the engines' send counts and clocks, the follower's replica
//! (usable fraction, event → replica latency, deltas applied), the processes' CPU
//! (`/proc/<pid>/stat`) and the bytes the follower's connection received (the kernel's
//! `bytes_received` of the socket, read with `ss`). The relay has
//! drained when the follower's replica is current and its sequence has not moved for 5 s
//! (`settle`: longer than any pause in either relay's output, which 1 s was not for
//! Dynamo's at the start of a burst); the sustained rate is the events sent over the time
//! from `go` until the last change reached the follower.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvrelay_benches::{http_get, metric_by_label, process_cpu_seconds, process_memory};
use serde_json::{Value, json};

use crate::{
    Proc, RunSpec, Setup, free_port, run_dir, sources_toml, spawn_engines, start_relay, wait_ready,
};

/// Where the Dynamo side runs from.
#[derive(Debug, Clone)]
pub(crate) struct DynamoSide {
    /// The interop venv's Python (`cargo xtask services` makes it).
    pub(crate) python: PathBuf,
    /// `benches/dynamo/`.
    pub(crate) scripts: PathBuf,
}

/// The follower's quiet time that marks a drained relay: longer than any pause in a
/// relay's output (Dynamo's first change of a burst came more than 1 s after `go`). It is
/// not counted in any rate: the drain ends at the last change.
const SETTLE_QUIET_MS: u64 = 5_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RelayKind {
    Kvrelay,
    Dynamo,
}

impl RelayKind {
    fn label(self) -> &'static str {
        match self {
            Self::Kvrelay => "kvrelay",
            Self::Dynamo => "dynamo",
        }
    }
}

/// Runs `spec` through both relays and returns both sides and their ratios.
pub(crate) async fn run(setup: &Setup, spec: &RunSpec, dynamo: &DynamoSide) -> Result<Value> {
    if !dynamo.python.is_file() {
        bail!(
            "{} not found: run `cargo xtask services` (it makes the interop venv with Dynamo's wheel)",
            dynamo.python.display()
        );
    }
    let ours = run_side(setup, spec, dynamo, RelayKind::Kvrelay).await?;
    let theirs = run_side(setup, spec, dynamo, RelayKind::Dynamo).await?;
    let ratio = |key: &str| -> Value {
        match (ours[key].as_f64(), theirs[key].as_f64()) {
            (Some(a), Some(b)) if b > 0.0 => json!(a / b),
            _ => Value::Null,
        }
    };
    Ok(json!({
        "run": spec.name,
        "target_events_per_s": spec.rate,
        "kvrelay": ours,
        "dynamo": theirs,
        "ratio_kvrelay_to_dynamo": {
            "sustained_events_per_s": ratio("sustained_events_per_s"),
            "relay_cpu_us_per_event": ratio("relay_cpu_us_per_event"),
            "ingest_path_cpu_us_per_event": ratio("ingest_path_cpu_us_per_event"),
            "follower_cpu_us_per_event": ratio("follower_cpu_us_per_event"),
            "latency_p50_ms": ratio("latency_p50_ms"),
            "latency_p99_ms": ratio("latency_p99_ms"),
            "follower_bytes_per_s": ratio("follower_bytes_per_s"),
        },
    }))
}

/// The environment every Dynamo process needs: its own discovery directory, every host
/// on loopback, no host metadata, and quiet worker-local indexers (their warnings about
/// removals of blocks the simulator evicts head first cost the workers most of their CPU).
fn dynamo_command(side: &DynamoSide, script: &str, discovery: &Path) -> Command {
    let mut command = Command::new(&side.python);
    command.arg(side.scripts.join(script));
    command.env("DYN_FILE_KV", discovery);
    for name in [
        "DYN_EVENT_PLANE_HOST",
        "DYN_TCP_RPC_HOST",
        "DYN_TCP_RESPONSE_STREAM_HOST",
        "DYN_SYSTEM_HOST",
    ] {
        command.env(name, "127.0.0.1");
    }
    command.env("DYN_SELF_HOST_METADATA", "0");
    command.env(
        "DYN_LOG",
        "info,dynamo_kv_router::indexer::radix_tree=error",
    );
    command.env_remove("DYN_SYSTEM_PORT");
    command
}

/// Bytes received by the established loopback connections to `port` (`ss`'s
/// `bytes_received` of each: the follower's connection to the relay's gRPC door); `None`
/// when `ss` is missing or shows none.
fn bytes_received_from(port: u16) -> Option<u64> {
    let output = Command::new("ss")
        .args(["-tinH", "state", "established"])
        .arg(format!("( sport = :{port} or dport = :{port} )"))
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let lines: Vec<&str> = text.lines().collect();
    let mut total = None;
    // Each socket is a line of addresses, then a line of its TCP info; the follower's end
    // is the one whose peer (second address) is the door.
    for pair in lines.chunks(2) {
        let [addresses, info] = pair else { continue };
        let peer_is_door = addresses
            .split_whitespace()
            .nth(3)
            .is_some_and(|peer| peer.ends_with(&format!(":{port}")));
        if !peer_is_door {
            continue;
        }
        let received = info
            .split_whitespace()
            .find_map(|field| field.strip_prefix("bytes_received:"))
            .and_then(|value| value.parse::<u64>().ok())
            .unwrap_or(0);
        *total.get_or_insert(0) += received;
    }
    total
}

/// The largest value each of our relay's `kvrelay_memory_bytes` components reached,
/// sampled from its `/metrics` while the run goes on (every 100 ms).
#[derive(Debug, Default)]
struct MemoryPeaks(std::collections::BTreeMap<String, f64>);

impl MemoryPeaks {
    fn sample(&mut self, admin: &str) {
        let Ok((200, text)) = http_get(admin, "/metrics", Duration::from_secs(1)) else {
            return;
        };
        for (component, bytes) in metric_by_label(&text, "kvrelay_memory_bytes", "component") {
            let peak = self.0.entry(component).or_insert(0.0);
            *peak = peak.max(bytes);
        }
    }

    /// Each component's peak in MB.
    fn to_json(&self) -> Value {
        self.0
            .iter()
            .map(|(component, bytes)| (component.clone(), json!(bytes / (1024.0 * 1024.0))))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

/// CPU seconds of each process (0 for one that is gone).
fn cpu_of(procs: &[Proc]) -> Vec<f64> {
    procs
        .iter()
        .map(|proc| process_cpu_seconds(proc.pid()).unwrap_or(0.0))
        .collect()
}

async fn run_side(
    setup: &Setup,
    spec: &RunSpec,
    dynamo: &DynamoSide,
    kind: RelayKind,
) -> Result<Value> {
    let (dir, cards) = run_dir(setup, &format!("{}-{}", spec.name, kind.label()))?;
    eprintln!("==> {} through {}", spec.name, kind.label());
    let (mut engines, addrs, stamp_paths) = spawn_engines(
        setup,
        &dir,
        spec.rate,
        spec.max_seconds,
        10_000,
        spec.precompute,
    )
    .await?;
    // The relay's processes: ours is one; Dynamo's is the relay, then its workers.
    // Our relay's admin address, for its memory gauges (Dynamo's has no such gauges).
    let (relays, follow, admin) = match kind {
        RelayKind::Kvrelay => {
            let door = free_port()?;
            let extra = format!(
                "{}\n[dynamo]\nlisten = \"127.0.0.1:{door}\"\nplaintext = true\n",
                sources_toml(&addrs, true)
            );
            let (mut relay, admin, _wan) = start_relay(setup, &dir, &cards, &extra)?;
            wait_ready(&mut relay, &admin, &dir).await?;
            (vec![relay], ("127.0.0.1".to_owned(), door), Some(admin))
        }
        RelayKind::Dynamo => {
            let discovery = dir.join("discovery");
            std::fs::create_dir_all(&discovery)?;
            let expected_blocks = setup.workers * setup.capacity;
            let mut relay = Proc::spawn(
                "dynamo relay",
                dynamo_command(dynamo, "dynamo_relay.py", &discovery)
                    .arg("--dc")
                    .arg("dc-bench")
                    .arg("--expected-unique-blocks")
                    .arg(expected_blocks.to_string())
                    .arg("--bind")
                    .arg("127.0.0.1:0")
                    .arg("--health-ms")
                    .arg("0"),
                Stdio::from(std::fs::File::create(dir.join("dynamo-relay.log"))?),
            )?;
            let bound = relay.expect("bound ", Duration::from_secs(60)).await?;
            let (host, port) = bound
                .trim_start_matches("bound ")
                .trim()
                .rsplit_once(':')
                .context("the Dynamo relay's bound address")?;
            let addr = (host.to_owned(), port.parse::<u16>()?);
            let mut command = dynamo_command(dynamo, "dynamo_workers.py", &discovery);
            command
                .arg("--model")
                .arg(kvrelay_benches::MODEL)
                .arg("--total-kv-blocks")
                .arg(setup.capacity.to_string());
            for engine in &addrs {
                command.arg("--engine").arg(format!(
                    "{}=tcp://127.0.0.1:{}",
                    engine.worker_id, engine.publish
                ));
            }
            let mut workers = Proc::spawn(
                "dynamo workers",
                &mut command,
                Stdio::from(std::fs::File::create(dir.join("dynamo-workers.log"))?),
            )?;
            workers.expect("ready", Duration::from_secs(60)).await?;
            (vec![relay, workers], addr, None)
        }
    };
    let relay_address = format!("dynamo-grpc://{}:{}=dc-bench", follow.0, follow.1);
    let mut follower = crate::start_follower(setup, &relay_address, &stamp_paths, &[]).await?;

    let relay_cpu_before = cpu_of(&relays);
    let follower_cpu_before = process_cpu_seconds(follower.pid()).unwrap_or(0.0);
    let received_before = bytes_received_from(follow.1);
    let started = Instant::now();
    let go_ns = kvrelay_benches::stamps::unix_ns();
    for engine in &mut engines {
        engine.send("go")?;
    }
    let mut sent = vec![0u64; engines.len()];
    let mut done: Vec<Option<(u64, u64)>> = vec![None; engines.len()];
    let hard_stop = Duration::from_secs_f64(spec.max_seconds + 120.0);
    let mut next_progress = started + Duration::from_secs(1);
    let mut memory_peaks = MemoryPeaks::default();
    while done.iter().any(Option::is_none) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        if let Some(admin) = &admin {
            memory_peaks.sample(admin);
        }
        crate::poll_engines(&mut engines, &mut sent, &mut done)?;
        if Instant::now() >= next_progress {
            next_progress += Duration::from_secs(1);
            eprintln!(
                "[{} {}] {:>4.0} s: engines sent {:>9} ev",
                spec.name,
                kind.label(),
                started.elapsed().as_secs_f64(),
                sent.iter().sum::<u64>()
            );
        }
        if started.elapsed() > hard_stop {
            bail!("the engines did not finish within {hard_stop:?}");
        }
    }
    let stop_ns = done.iter().flatten().map(|(_, ns)| *ns).max().unwrap_or(0);
    let events_sent: u64 = done.iter().flatten().map(|(events, _)| *events).sum();
    let publish_seconds = stop_ns.saturating_sub(go_ns) as f64 / 1e9;
    follower.send(&format!("settle {SETTLE_QUIET_MS} {stop_ns}"))?;
    // The connection's byte count is sampled while the follower settles: it closes the
    // connection once it has reported.
    let mut received_after = None;
    let settle_deadline = Instant::now() + Duration::from_secs(180);
    let report_line = loop {
        if let Some(bytes) = bytes_received_from(follow.1) {
            received_after = Some(bytes);
        }
        if let Some(admin) = &admin {
            memory_peaks.sample(admin);
        }
        match follower.lines.try_recv() {
            Ok(line) if line.starts_with('{') => break line,
            Ok(_) => continue,
            Err(std::sync::mpsc::TryRecvError::Disconnected) => {
                bail!("the follower exited before its report")
            }
            Err(std::sync::mpsc::TryRecvError::Empty) => {}
        }
        if Instant::now() >= settle_deadline {
            bail!("the follower did not settle within 180 s");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let report: Value =
        serde_json::from_str(&report_line).context("parsing the follower's report")?;
    // The quiet second the follower waited is not work: CPU is read now, and the time
    // until the last change is what the rate is over.
    let relay_cpu = cpu_of(&relays)
        .iter()
        .zip(&relay_cpu_before)
        .map(|(after, before)| after - before)
        .collect::<Vec<_>>();
    let follower_cpu = process_cpu_seconds(follower.pid()).unwrap_or(0.0) - follower_cpu_before;
    let received = received_after
        .zip(received_before)
        .map(|(after, before)| after.saturating_sub(before));
    let memory: Vec<f64> = relays
        .iter()
        .map(|proc| {
            process_memory(proc.pid()).map_or(0.0, |m| m.peak_bytes as f64 / (1024.0 * 1024.0))
        })
        .collect();
    for engine in &mut engines {
        let _ = engine.send("quit");
    }
    follower.stop();
    drop(relays);
    drop(engines);

    let drained_after = report["time_to_current_after_stop_s"]
        .as_f64()
        .context("the follower's replica never settled")?;
    let busy = (publish_seconds + drained_after).max(1e-9);
    let per_event_us = |cpu: f64| cpu / (events_sent.max(1) as f64) * 1e6;
    let relay_cpu_s = relay_cpu.first().copied().unwrap_or(0.0);
    let ingest_path_cpu_s: f64 = relay_cpu.iter().sum();
    Ok(json!({
        "relay": kind.label(),
        "events_sent": events_sent,
        "publish_seconds": publish_seconds,
        "engine_events_per_s": events_sent as f64 / publish_seconds.max(1e-9),
        "drained_after_stop_s": drained_after,
        "sustained_events_per_s": events_sent as f64 / busy,
        "relay_cpu_s": relay_cpu_s,
        "relay_cpu_us_per_event": per_event_us(relay_cpu_s),
        // Dynamo's workers read the engines (its ingest); ours is inside the relay.
        "workers_cpu_s": relay_cpu.get(1).copied().unwrap_or(0.0),
        "ingest_path_cpu_us_per_event": per_event_us(ingest_path_cpu_s),
        "relay_rss_peak_mb": memory.first().copied().unwrap_or(0.0),
        // Ours only: the peak of each `kvrelay_memory_bytes` component, in MB.
        "relay_memory_peak_mb": memory_peaks.to_json(),
        "workers_rss_peak_mb": memory.get(1).copied().unwrap_or(0.0),
        "follower_cpu_s": follower_cpu,
        "follower_cpu_us_per_event": per_event_us(follower_cpu),
        "follower_bytes_per_s": received.map(|bytes| bytes as f64 / busy),
        "follower_frames_per_s": report["deltas_applied"].as_f64().unwrap_or(0.0) / busy,
        "usable_fraction": report["usable_fraction"],
        "replica_losses": report["replica_losses"],
        "resubscribes": report["resubscribes"],
        "latency_p50_ms": report["latency"]["p50_ms"],
        "latency_p99_ms": report["latency"]["p99_ms"],
        "unseen_probes": report["latency"]["unseen"],
        "longest_probe_gap_ms": report["longest_probe_gap_ms"],
        "final_sequence": report["final_sequence"],
        "follower": report,
    }))
}

fn cell(value: &Value, digits: usize) -> String {
    value
        .as_f64()
        .map_or_else(|| "-".to_owned(), |v| format!("{v:.digits$}"))
}

/// The Markdown table of the runs: both relays and the ratio per run.
pub(crate) fn render(results: &[Value]) -> String {
    let mut out = String::from(
        "\n| run | relay | sent ev/s | sustained ev/s | drained after stop s | relay CPU µs/ev | ingest-path CPU µs/ev | follower CPU µs/ev | follower frames/s | follower MB/s | usable % | latency p50 / p99 ms | resubscribes | relay RSS MB |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |\n",
    );
    for result in results {
        for side in ["kvrelay", "dynamo"] {
            let r = &result[side];
            let resubscribes: u64 = r["resubscribes"]
                .as_object()
                .map_or(0, |m| m.values().filter_map(Value::as_u64).sum());
            out.push_str(&format!(
                "| {} | {side} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} / {} | {resubscribes} | {} |\n",
                result["run"].as_str().unwrap_or("?"),
                cell(&r["engine_events_per_s"], 0),
                cell(&r["sustained_events_per_s"], 0),
                cell(&r["drained_after_stop_s"], 2),
                cell(&r["relay_cpu_us_per_event"], 2),
                cell(&r["ingest_path_cpu_us_per_event"], 2),
                cell(&r["follower_cpu_us_per_event"], 2),
                cell(&r["follower_frames_per_s"], 0),
                r["follower_bytes_per_s"]
                    .as_f64()
                    .map_or_else(|| "-".to_owned(), |b| format!("{:.2}", b / 1e6)),
                r["usable_fraction"]
                    .as_f64()
                    .map_or_else(|| "-".to_owned(), |f| format!("{:.2}", f * 100.0)),
                cell(&r["latency_p50_ms"], 1),
                cell(&r["latency_p99_ms"], 1),
                cell(&r["relay_rss_peak_mb"], 0),
            ));
        }
        let ratio = &result["ratio_kvrelay_to_dynamo"];
        out.push_str(&format!(
            "| {} | **kvrelay ÷ dynamo** | | **{}×** | | {}× | {}× | {}× | | {}× | | {}× / {}× | | |\n",
            result["run"].as_str().unwrap_or("?"),
            cell(&ratio["sustained_events_per_s"], 2),
            cell(&ratio["relay_cpu_us_per_event"], 2),
            cell(&ratio["ingest_path_cpu_us_per_event"], 2),
            cell(&ratio["follower_cpu_us_per_event"], 2),
            cell(&ratio["follower_bytes_per_s"], 2),
            cell(&ratio["latency_p50_ms"], 2),
            cell(&ratio["latency_p99_ms"], 2),
        ));
    }
    for result in results {
        let Some(parts) = result["kvrelay"]["relay_memory_peak_mb"].as_object() else {
            continue;
        };
        if parts.is_empty() {
            continue;
        }
        let listed: Vec<String> = parts
            .iter()
            .map(|(component, mb)| format!("{component} {}", cell(mb, 1)))
            .collect();
        out.push_str(&format!(
            "\n{}: our relay's memory by component, each at its peak (MB): {}; RSS peak {} MB\n",
            result["run"].as_str().unwrap_or("?"),
            listed.join(", "),
            cell(&result["kvrelay"]["relay_rss_peak_mb"], 0),
        ));
    }
    out
}
