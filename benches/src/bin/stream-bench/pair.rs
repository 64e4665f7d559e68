//! The relay-pair runs (opt-in, `--runs pair-kill,pair-upgrade`): two relays of one DC
//! (the same cards and engines: each subscribes to every engine's PUB socket and asks its
//! replay socket on its own, each with its own `[state]` checkpoints) and a follower that
//! follows them as one DC (`A+B=dc-bench`), while the engines replay the trace.
//!
//! - `pair-kill`: the followed relay (A) is SIGKILLed at 40 % of the publishing time and
//!   stays down; the follower moves to B.
//! - `pair-kill-hot`: the same with the follower's standby hot (`--standby-mode hot`): it
//!   follows both relays all along, scores A, and switches its scoring to B's replicas.
//! - `pair-upgrade`: a rolling upgrade. A is stopped with SIGTERM at 30 % and started
//!   again on its ports 1 s later (restoring its checkpoint); B, followed by then, is
//!   stopped at 65 % and started again the same way.
//!
//! The follower reports the longest time its replica was not current, the most pools it
//! listed at once (1: the DC is never counted twice) and the live recall of the 30 s after
//! each step (the share of probes found within 1 s of their send). At the end the followed
//! relay's pool is compared with the union of the engines' caches, and the follower must
//! be current at that relay's final sequence. Bytes: what the standby sent when it was
//! taken over on demand (its pool stream: a snapshot, then deltas) against the followed
//! relay's pool stream rate, which a hot standby would cost a second time all along.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvrelay_benches::stamps::unix_ns;
use serde_json::{Value, json};

use super::{
    Proc, Setup, engine_truth, free_port, number, poll_done, pool_stats_path, relay_sample,
    run_dir, sources_toml, spawn_engines, start_follower, start_relay_on, wait_ready,
    with_checkpoints,
};

/// The pair runs, by name.
pub(crate) const PAIR_RUNS: [&str; 3] = ["pair-kill", "pair-kill-hot", "pair-upgrade"];

/// One pair run's settings.
#[derive(Debug, Clone)]
pub(crate) struct PairSpec {
    pub(crate) name: String,
    /// Target events/s over all engines.
    pub(crate) rate: f64,
    /// How long the engines publish.
    pub(crate) publish_s: f64,
    /// A rolling upgrade (both relays stopped gracefully and started again in turn)
    /// rather than one SIGKILL.
    pub(crate) upgrade: bool,
    /// The follower keeps its standby hot (follows both relays all along).
    pub(crate) hot: bool,
}

/// How long a stopped relay stays down in the upgrade run.
const DOWNTIME: Duration = Duration::from_secs(1);
/// How long a relay may take to exit after SIGTERM.
const EXIT_BOUND: Duration = Duration::from_secs(15);

/// One relay of the pair: its process, ports and directory.
struct PairRelay {
    name: &'static str,
    proc: Proc,
    wan: u16,
    admin_port: u16,
    dir: std::path::PathBuf,
    starts: usize,
}

impl PairRelay {
    async fn start(
        setup: &Setup,
        name: &'static str,
        dir: &Path,
        cards: &Path,
        sources: &str,
    ) -> Result<Self> {
        let dir = dir.join(name);
        std::fs::create_dir_all(&dir)?;
        let (wan, admin_port) = (free_port()?, free_port()?);
        let proc = launch(setup, &dir, cards, sources, wan, admin_port).await?;
        Ok(Self {
            name,
            proc,
            wan,
            admin_port,
            dir,
            starts: 1,
        })
    }

    fn admin(&self) -> String {
        format!("127.0.0.1:{}", self.admin_port)
    }

    /// Started again on its ports, its log of the previous run kept beside.
    async fn restart(&mut self, setup: &Setup, cards: &Path, sources: &str) -> Result<Duration> {
        std::fs::rename(
            self.dir.join("relay.log"),
            self.dir.join(format!("relay-{}.log", self.starts)),
        )?;
        let started = Instant::now();
        self.proc = launch(setup, &self.dir, cards, sources, self.wan, self.admin_port).await?;
        self.starts += 1;
        Ok(started.elapsed())
    }

    fn pool_bytes(&self) -> Result<f64> {
        let admin = self.admin();
        Ok(relay_sample(&admin, &pool_stats_path(&admin)?)?.pool_bytes)
    }
}

/// Starts a relay of the pair in `dir` on its ports, checkpointing to `dir/state`, and
/// waits until it is ready.
async fn launch(
    setup: &Setup,
    dir: &Path,
    cards: &Path,
    sources: &str,
    wan: u16,
    admin_port: u16,
) -> Result<Proc> {
    let sources = with_checkpoints(sources, dir);
    let (mut proc, admin) = start_relay_on(setup, dir, cards, &sources, wan, admin_port)?;
    wait_ready(&mut proc, &admin, dir).await?;
    Ok(proc)
}

/// Waits until `at` (from the run's start), reading the engines meanwhile.
async fn until(
    go: Instant,
    at_s: f64,
    engines: &mut [Proc],
    done: &mut [Option<(u64, u64)>],
) -> Result<()> {
    let at = go + Duration::from_secs_f64(at_s);
    while Instant::now() < at {
        poll_done(engines, done)?;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Runs one pair run; returns its figures.
pub(crate) async fn run(
    setup: &Setup,
    spec: &PairSpec,
    requests: &[kvrelay_ingest::RequestRecord],
) -> Result<Value> {
    let (dir, cards) = run_dir(setup, &spec.name)?;
    let (mut engines, addrs, stamp_paths) =
        spawn_engines(setup, &dir, spec.rate, spec.publish_s, 10_000, false).await?;
    let sources = sources_toml(&addrs, true);
    let mut first = PairRelay::start(setup, "a", &dir, &cards, &sources).await?;
    let mut second = PairRelay::start(setup, "b", &dir, &cards, &sources).await?;
    let pair = format!("127.0.0.1:{}+127.0.0.1:{}=dc-bench", first.wan, second.wan);
    // Sampled every probe tick (2 ms) rather than every 10 ms: a failover takes a few ms.
    let mut follower_args = vec!["--sample-ms", "1"];
    if spec.hot {
        follower_args.extend(["--standby-mode", "hot"]);
    }
    let mut follower = start_follower(setup, &pair, &stamp_paths, &follower_args).await?;

    for engine in &mut engines {
        engine.send("go")?;
    }
    let go = Instant::now();
    let mut done: Vec<Option<(u64, u64)>> = vec![None; engines.len()];
    let mut steps = Vec::new();
    let mut bytes = json!(null);
    let followed_at_end = if spec.upgrade {
        // A (followed) stopped gracefully, started again; then B (followed by then).
        for (relay, at) in [(&mut first, 0.30), (&mut second, 0.65)] {
            until(go, spec.publish_s * at, &mut engines, &mut done).await?;
            follower.send(&format!("mark stop-{} {}", relay.name, unix_ns()))?;
            let exit = relay.proc.terminate(EXIT_BOUND).await?;
            tokio::time::sleep(DOWNTIME).await;
            let ready = relay.restart(setup, &cards, &sources).await?;
            eprintln!(
                "    [{}] relay {} stopped (SIGTERM, exited in {:.0} ms) and ready again {:.2} s after its start",
                spec.name,
                relay.name,
                exit.as_secs_f64() * 1e3,
                ready.as_secs_f64()
            );
            steps.push(json!({
                "relay": relay.name,
                "at_s": spec.publish_s * at,
                "exit_after_sigterm_ms": exit.as_secs_f64() * 1e3,
                "ready_after_restart_s": ready.as_secs_f64(),
            }));
        }
        (first.name, first.admin())
    } else {
        until(go, spec.publish_s * 0.40, &mut engines, &mut done).await?;
        let followed_bytes = first.pool_bytes()?;
        let followed_for = go.elapsed().as_secs_f64();
        let standby_before = second.pool_bytes()?;
        follower.send(&format!("mark kill-a {}", unix_ns()))?;
        first.proc.stop();
        steps.push(json!({ "relay": "a", "at_s": followed_for, "signal": "SIGKILL" }));
        until(go, followed_for + 2.0, &mut engines, &mut done).await?;
        let standby_takeover = second.pool_bytes()? - standby_before;
        bytes = json!({
            "followed_pool_bytes_per_s": followed_bytes / followed_for.max(1e-9),
            "standby_bytes_before_takeover": standby_before,
            "standby_bytes_per_s_before_takeover": standby_before / followed_for.max(1e-9),
            "standby_bytes_first_2s": standby_takeover,
        });
        (second.name, second.admin())
    };
    let deadline = go + Duration::from_secs_f64(spec.publish_s + 60.0);
    while done.iter().any(Option::is_none) {
        if Instant::now() > deadline {
            bail!("the engines did not finish in time");
        }
        poll_done(&mut engines, &mut done)?;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let admin = &followed_at_end.1;
    let stats_path = pool_stats_path(admin)?;
    let stats = super::restart::settle(admin, &stats_path).await?;
    let final_sequence = stats["stats"]["sequence"].as_u64().unwrap_or(0);
    let stop_ns = done.iter().flatten().map(|(_, ns)| *ns).max().unwrap_or(0);
    follower.send(&format!("final {final_sequence} {stop_ns}"))?;
    let report_line = follower.expect("{", Duration::from_secs(120)).await?;
    let report: Value =
        serde_json::from_str(&report_line).context("parsing the follower's report")?;
    if let Some(object) = bytes.as_object_mut() {
        let standby_total = second.pool_bytes()?;
        object.insert("standby_bytes_total".to_owned(), json!(standby_total));
    }
    for engine in &mut engines {
        let _ = engine.send("quit");
    }
    first.proc.stop();
    second.proc.stop();
    follower.stop();
    drop(engines);
    let batches: Vec<u64> = done.into_iter().flatten().map(|(n, _)| n).collect();
    let truth = engine_truth(setup, requests, &batches);
    let resident = stats["stats"]["resident_blocks"].as_f64().unwrap_or(0.0);
    let truth_blocks = truth.len() as f64;
    Ok(json!({
        "run": spec.name,
        "rate": spec.rate,
        "publish_s": spec.publish_s,
        "steps": steps,
        "followed_at_end": followed_at_end.0,
        "truth_blocks": truth_blocks,
        "resident_blocks": resident,
        "missing_blocks": (truth_blocks - resident).max(0.0),
        "unroutable_blocks": stats["stats"]["unroutable_blocks"].as_f64().unwrap_or(0.0),
        "bytes": bytes,
        "follower": report,
    }))
}

/// The pair runs as a Markdown table.
pub(crate) fn render(results: &[Value]) -> String {
    let mut out = String::from(
        "\n| pair run | steps | longest not current | live recall 30 s after each step (found ≤ 1 s / probes) | pools listed at most | failovers | current after stop s | truth blocks | missing at end | standby bytes at takeover (first 2 s) | followed pool stream B/s | standby pool stream B/s before the kill |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for result in results {
        let follower = &result["follower"];
        let steps = result["steps"]
            .as_array()
            .map(|steps| {
                steps
                    .iter()
                    .map(|step| {
                        format!(
                            "{} at {} s{}",
                            step["relay"].as_str().unwrap_or("?"),
                            number(&step["at_s"], 1),
                            step["exit_after_sigterm_ms"].as_f64().map_or_else(
                                || " (SIGKILL)".to_owned(),
                                |ms| format!(" (SIGTERM, exit {ms:.0} ms)")
                            )
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default();
        let recall = recall_cell(follower);
        out.push_str(&format!(
            "| {} | {} | {} ms | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            result["run"].as_str().unwrap_or("?"),
            steps,
            number(&follower["longest_unusable_ms"], 0),
            recall,
            number(&follower["max_pools_listed"], 0),
            number(&follower["relay_failovers"], 0),
            follower["time_to_current_after_stop_s"]
                .as_f64()
                .map_or_else(|| "never".to_owned(), |s| format!("{s:.2}")),
            number(&result["truth_blocks"], 0),
            number(&result["missing_blocks"], 0),
            number(&result["bytes"]["standby_bytes_first_2s"], 0),
            number(&result["bytes"]["followed_pool_bytes_per_s"], 0),
            number(&result["bytes"]["standby_bytes_per_s_before_takeover"], 0),
        ));
    }
    out
}

/// `mark: recall (live/probes)` of each of a follower report's windows.
pub(crate) fn recall_cell(follower: &Value) -> String {
    follower["windows"]
        .as_array()
        .map(|windows| {
            windows
                .iter()
                .map(|window| {
                    format!(
                        "{}: {} ({}/{})",
                        window["mark"].as_str().unwrap_or("?"),
                        window["live_recall"]
                            .as_f64()
                            .map_or_else(|| "-".to_owned(), |r| format!("{r:.3}")),
                        number(&window["live"], 0),
                        number(&window["probes"], 0)
                    )
                })
                .collect::<Vec<_>>()
                .join("; ")
        })
        .unwrap_or_default()
}
