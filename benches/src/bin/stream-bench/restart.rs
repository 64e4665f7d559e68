//! The restart runs (opt-in, `--runs restart-checkpoint,restart-cold`): the engines
//! replay the trace with a replay ring far shorter than their history; the relay is
//! killed with SIGKILL at 40 % of the publishing time and started again 1 s later, with
//! `[state]` checkpoints (every 500 ms) or without. Once the engines are done and the
//! relay has drained, its pool is compared with the union of the engines' caches. A
//! follower follows the relay throughout (it comes back on the same ports): the longest
//! time its replica was not current, and the live recall of the 30 s after the kill (the
//! share of probes found within 1 s of their send; see the pair runs).

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvrelay_benches::{http_get, metric_sum};
use serde_json::{Value, json};

use super::{
    HTTP_TIMEOUT, Setup, engine_truth, free_port, number, poll_done, pool_stats_path, reasons,
    relay_sample, run_dir, sources_toml, spawn_engines, start_follower, start_relay_on, wait_ready,
    with_checkpoints,
};

/// The restart runs, by name.
pub(crate) const RESTART_RUNS: [&str; 3] = [
    "restart-checkpoint",
    "restart-cold",
    "restart-checkpoint-backoff",
];

/// One restart run's settings.
#[derive(Debug, Clone)]
pub(crate) struct RestartSpec {
    pub(crate) name: String,
    /// Target events/s over all engines.
    pub(crate) rate: f64,
    /// How long the engines publish.
    pub(crate) publish_s: f64,
    /// Batches each engine keeps for replay.
    pub(crate) replay_batches: usize,
    /// Whether the relay checkpoints to `[state]`.
    pub(crate) checkpoint: bool,
    /// Whether the follower rejoins the restarted relay at its rejoin interval (the
    /// default) or only on its reconnect backoff (the baseline: `rejoin_window` 0).
    pub(crate) rejoin: bool,
}

/// Downtime between the kill and the restart.
const DOWNTIME: Duration = Duration::from_secs(1);
/// The kill, as a share of the publishing time.
const KILL_AT: f64 = 0.4;

/// Runs one restart run; returns its figures.
pub(crate) async fn run(
    setup: &Setup,
    spec: &RestartSpec,
    requests: &[kvrelay_ingest::RequestRecord],
) -> Result<Value> {
    let (dir, cards) = run_dir(setup, &spec.name)?;
    let (mut engines, addrs, stamp_paths) = spawn_engines(
        setup,
        &dir,
        spec.rate,
        spec.publish_s,
        spec.replay_batches,
        false,
    )
    .await?;
    let mut sources = sources_toml(&addrs, true);
    if spec.checkpoint {
        sources = with_checkpoints(&sources, &dir);
    }
    // The restarted relay listens where the first one did, so the follower finds it.
    let (wan, admin_port) = (free_port()?, free_port()?);
    let (mut relay, admin) = start_relay_on(setup, &dir, &cards, &sources, wan, admin_port)?;
    wait_ready(&mut relay, &admin, &dir).await?;
    let mut follower_flags = vec!["--sample-ms", "1"];
    if !spec.rejoin {
        follower_flags.extend(["--rejoin-window-ms", "0"]);
    }
    let mut follower = start_follower(
        setup,
        &format!("127.0.0.1:{wan}"),
        &stamp_paths,
        &follower_flags,
    )
    .await?;
    for engine in &mut engines {
        engine.send("go")?;
    }
    let go = Instant::now();
    let mut batches: Vec<Option<(u64, u64)>> = vec![None; engines.len()];
    let kill_at = go + Duration::from_secs_f64(spec.publish_s * KILL_AT);
    while Instant::now() < kill_at {
        poll_done(&mut engines, &mut batches)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The first relay's last figures, then SIGKILL (`Child::kill`).
    let stats_path = pool_stats_path(&admin)?;
    let before_kill = relay_sample(&admin, &stats_path)?;
    let (_, metrics) = http_get(&admin, "/metrics", HTTP_TIMEOUT)?;
    let checkpoint = json!({
        "writes": metric_sum(&metrics, "kvrelay_checkpoint_writes_total", &[("outcome", "ok")]),
        "last_bytes": metric_sum(&metrics, "kvrelay_checkpoint_last_bytes", &[]),
        "last_export_s": metric_sum(&metrics, "kvrelay_checkpoint_last_export_seconds", &[]),
        "last_write_s": metric_sum(&metrics, "kvrelay_checkpoint_last_write_seconds", &[]),
    });
    follower.send(&format!("mark kill {}", kvrelay_benches::stamps::unix_ns()))?;
    relay.stop();
    let killed = Instant::now();
    std::fs::rename(dir.join("relay.log"), dir.join("relay-killed.log"))?;
    tokio::time::sleep(DOWNTIME).await;
    let (mut relay, admin) = start_relay_on(setup, &dir, &cards, &sources, wan, admin_port)?;
    wait_ready(&mut relay, &admin, &dir).await?;
    let ready_after_kill_s = killed.elapsed().as_secs_f64();
    // Until the engines are done, then until the relay applied everything they sent.
    let deadline = Instant::now() + Duration::from_secs_f64(spec.publish_s + 60.0);
    while batches.iter().any(Option::is_none) {
        if Instant::now() > deadline {
            bail!("the engines did not finish in time");
        }
        poll_done(&mut engines, &mut batches)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let stats_path = pool_stats_path(&admin)?;
    let stats = settle(&admin, &stats_path).await?;
    let sample = relay_sample(&admin, &stats_path)?;
    let (_, metrics) = http_get(&admin, "/metrics", HTTP_TIMEOUT)?;
    let final_sequence = stats["stats"]["sequence"].as_u64().unwrap_or(0);
    follower.send(&format!(
        "final {final_sequence} {}",
        kvrelay_benches::stamps::unix_ns()
    ))?;
    let report_line = follower.expect("{", Duration::from_secs(120)).await?;
    let report: Value =
        serde_json::from_str(&report_line).context("parsing the follower's report")?;
    follower.stop();
    for engine in &mut engines {
        let _ = engine.send("quit");
    }
    relay.stop();
    drop(engines);
    let batches: Vec<u64> = batches.into_iter().flatten().map(|(n, _)| n).collect();
    let truth = engine_truth(setup, requests, &batches);
    let stat = |name: &str| stats["stats"][name].as_f64().unwrap_or(0.0);
    let (resident, truth_blocks) = (stat("resident_blocks"), truth.len() as f64);
    Ok(json!({
        "run": spec.name,
        "rate": spec.rate,
        "publish_s": spec.publish_s,
        "replay_batches": spec.replay_batches,
        "checkpoint": spec.checkpoint,
        "rejoin": spec.rejoin,
        "engine_batches": batches,
        "killed_at_s": spec.publish_s * KILL_AT,
        "events_applied_before_kill": before_kill.events_applied,
        "ready_after_kill_s": ready_after_kill_s,
        "checkpoint_before_kill": checkpoint,
        "restores": kvrelay_benches::metric_by_label(&metrics, "kvrelay_checkpoint_restores_total", "outcome"),
        "restored_mappings": metric_sum(&metrics, "kvrelay_checkpoint_restored_mappings_total", &[]),
        "truth_blocks": truth_blocks,
        "resident_blocks": resident,
        "missing_blocks": (truth_blocks - resident).max(0.0),
        "routable_fraction": if truth_blocks > 0.0 { resident / truth_blocks } else { 0.0 },
        "unroutable_events": stat("unroutable_events"),
        "unroutable_blocks": stat("unroutable_blocks"),
        "ingest_replays": sample.ingest_replays,
        "ingest_resets": sample.ingest_resets,
        "follower": report,
    }))
}

/// The pool's stats once two reads 500 ms apart agree on the events applied (the relay
/// drained what the engines sent), at most 30 s.
pub(crate) async fn settle(admin: &str, stats_path: &str) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut previous: Option<f64> = None;
    loop {
        let (status, body) = http_get(admin, stats_path, HTTP_TIMEOUT)?;
        if status != 200 {
            bail!("{stats_path} answered {status}");
        }
        let stats: Value = serde_json::from_str(&body).context("parsing the pool stats")?;
        let applied = stats["stats"]["events_applied"].as_f64();
        if applied.is_some() && applied == previous || Instant::now() > deadline {
            return Ok(stats);
        }
        previous = applied;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The restart runs as a Markdown table.
pub(crate) fn render(results: &[Value]) -> String {
    let mut out = String::from(
        "\n| restart run | ring | killed at | ready after kill | checkpoint (bytes, export, write) | restored mappings | truth blocks | resident at end | missing | routable | unroutable blocks | resets | follower: longest not current | live recall 30 s after the kill (found ≤ 1 s / probes) |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for result in results {
        let checkpoint = &result["checkpoint_before_kill"];
        out.push_str(&format!(
            "| {} | {} | {} s | {} s | {} | {} | {} | {} | {} | {:.1} % | {} | {} | {} ms | {} |\n",
            result["run"].as_str().unwrap_or("?"),
            number(&result["replay_batches"], 0),
            number(&result["killed_at_s"], 1),
            number(&result["ready_after_kill_s"], 2),
            if result["checkpoint"].as_bool().unwrap_or(false) {
                format!(
                    "{:.1} MB, {:.1} ms, {:.1} ms",
                    checkpoint["last_bytes"].as_f64().unwrap_or(0.0) / 1e6,
                    checkpoint["last_export_s"].as_f64().unwrap_or(0.0) * 1e3,
                    checkpoint["last_write_s"].as_f64().unwrap_or(0.0) * 1e3,
                )
            } else {
                "off".to_owned()
            },
            number(&result["restored_mappings"], 0),
            number(&result["truth_blocks"], 0),
            number(&result["resident_blocks"], 0),
            number(&result["missing_blocks"], 0),
            result["routable_fraction"].as_f64().unwrap_or(0.0) * 100.0,
            number(&result["unroutable_blocks"], 0),
            reasons(&result["ingest_resets"]),
            number(&result["follower"]["longest_unusable_ms"], 0),
            super::pair::recall_cell(&result["follower"]),
        ));
    }
    out
}
