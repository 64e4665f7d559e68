//! `kvrelay demo`: the whole system on loopback in one command, no external services.
//!
//! Starts a relay with file discovery from the example deployment in this repository,
//! replays the built-in request trace into its pools, connects the consumer library over the
//! real WAN protocol, and shows live progress. At the end every pool is checked twice: the
//! consumer's replica must be current at the producer's sequence, and an independent
//! replica (a [`PoolMirror`] over its own TCP stream) must equal the producer's table bit
//! for bit. Prints a report table (or JSON with `--json`); exits non-zero on any mismatch.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvrelay_codec::v1::{Message, ProducerIdentity, StreamRequest, StreamRpc};
use kvrelay_consumer::{Consumer, ConsumerConfig, ReplicaState, ScoreRequest};
use kvrelay_server::{
    PoolMirror, ProbeStream, Relay, RelayConfig, RelayProgress, WORKLOAD_TOKEN_SEED, WorkloadConfig,
};
use serde::Serialize;
use tokio::sync::watch;

/// Bound on every wait of the demo.
const DEMO_DEADLINE: Duration = Duration::from_secs(45);
/// Progress line interval.
const PROGRESS_EVERY: Duration = Duration::from_millis(500);
/// Trace requests scored through the consumer at the end.
const SCORED_REQUESTS: usize = 100;

/// Arguments of `kvrelay demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Print the final report as JSON on stdout (progress still goes to stderr).
    #[arg(long)]
    json: bool,
    /// Card directory (default: examples/deployment/cards of this repository).
    #[arg(long)]
    cards: Option<PathBuf>,
    /// Request trace, JSONL (default: the trace built into the binary).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Replay speed multiplier over the trace's timestamps (0 = as fast as possible).
    #[arg(long, default_value_t = 16.0)]
    speed: f64,
    /// Log filter (tracing env-filter syntax).
    #[arg(long, env = "KVRELAY_LOG", default_value = "warn")]
    log: String,
    /// Trace requests served in the routing comparison (three DCs, three policies).
    #[arg(long, default_value_t = 600)]
    routing_requests: usize,
    /// Where the routing comparison's chart (SVG) is written.
    #[arg(long)]
    routing_chart: Option<PathBuf>,
    /// Run the routing comparison's WAN without TLS and token (on by default).
    #[arg(long)]
    plaintext: bool,
}

/// Runs the demo on its own runtime.
pub(crate) fn run(args: DemoArgs) -> Result<()> {
    if !(args.speed.is_finite() && args.speed >= 0.0) {
        return Err(crate::usage::usage(format!(
            "--speed {} must be a finite number >= 0",
            args.speed
        )));
    }
    let cards = match &args.cards {
        Some(dir) => dir.clone(),
        None => default_cards()?,
    };
    if !cards.is_dir() {
        return Err(crate::usage::usage(format!(
            "card directory {} does not exist",
            cards.display()
        )));
    }
    crate::relay::init_logging(&args.log, crate::relay::LogFormat::Text);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    let report = runtime.block_on(demo(&args, cards))?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&report).context("encoding the report")?
        );
    } else {
        print_report(&report);
    }
    if !report.ok {
        bail!(
            "{} of {} pools: replicas do not match their producers",
            report.mismatched,
            report.pools.len()
        );
    }
    Ok(())
}

/// The final report.
#[derive(Debug, Serialize)]
struct DemoReport {
    ok: bool,
    mismatched: usize,
    elapsed_s: f64,
    relay_incarnation: u64,
    wan_addr: String,
    admin_addr: Option<String>,
    requests: u64,
    events: u64,
    events_per_s: f64,
    blocks_stored: u64,
    blocks_removed: u64,
    bytes_published: u64,
    frames_published: u64,
    scored_requests: usize,
    scored_with_cached_prefix: usize,
    pools: Vec<PoolLine>,
    /// The routing comparison across three DCs (`demo_routing.rs`).
    routing: crate::demo_routing::RoutingReport,
    /// Where its chart was written.
    routing_chart: Option<String>,
}

/// One pool of the report.
#[derive(Debug, Serialize)]
struct PoolLine {
    endpoint: String,
    models: Vec<String>,
    generation: u64,
    sequence: u64,
    resident_blocks: u64,
    bucket_count: u64,
    consumer_replica: String,
    consumer_sequence: Option<u64>,
    mirror_identical: bool,
    ok: bool,
}

async fn demo(args: &DemoArgs, cards: PathBuf) -> Result<DemoReport> {
    let started = Instant::now();
    let mut config = RelayConfig {
        dc_id: "dc-demo".to_owned(),
        ..RelayConfig::default()
    };
    config.wan.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.admin.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.discovery.dir = Some(cards.clone());
    config.workload = Some(WorkloadConfig {
        trace: args.trace.clone(),
        speed: args.speed,
        loops: 1,
    });
    let relay = Relay::start(config).await?;
    let addr = relay.wan_addr();
    eprintln!(
        "relay up: WAN {addr}, admin http://{}",
        relay
            .admin_addr()
            .map_or_else(|| "off".to_owned(), |addr| addr.to_string())
    );

    let consumer = Consumer::start(ConsumerConfig::new(vec![
        kvrelay_consumer::RelayEndpoint::new(&addr.to_string(), "dc-demo"),
    ]))
    .context("starting the consumer")?;

    tokio::time::timeout(DEMO_DEADLINE, wait_for_sources(&relay))
        .await
        .context("no pool materialized within the deadline")?;
    let catalog = relay.catalog();
    let mut followers = BTreeMap::new();
    for pool in &catalog.pools {
        followers.insert(
            pool.serving_endpoint_dotted(),
            Follower::spawn(addr, pool.producer),
        );
    }

    // Live progress until the workload is replayed.
    let mut last = (Instant::now(), 0u64);
    loop {
        let finished = tokio::time::timeout(PROGRESS_EVERY, relay.workload_finished())
            .await
            .is_ok();
        let progress = relay.progress();
        let current = consumer
            .pools()
            .iter()
            .filter(|pool| pool.replica == ReplicaState::Current)
            .count();
        let now = Instant::now();
        let rate =
            (progress.events - last.1) as f64 / now.duration_since(last.0).as_secs_f64().max(1e-3);
        last = (now, progress.events);
        progress_line(started, &progress, rate, current);
        if finished {
            break;
        }
        if started.elapsed() > DEMO_DEADLINE {
            bail!(
                "the workload did not finish within {}s",
                DEMO_DEADLINE.as_secs()
            );
        }
    }
    eprintln!();
    relay.flush().await;
    let replay_elapsed = started.elapsed();

    // Verify every pool: producer table vs consumer replica vs independent mirror.
    let mut pools = Vec::new();
    let reports = relay.pool_reports().await;
    for pool in &catalog.pools {
        let endpoint = pool.serving_endpoint_dotted();
        let table = relay.producer_table(&pool.producer).await?;
        let consumer_current = consumer
            .wait_until(DEMO_DEADLINE, |state, now| {
                state.pools(now).iter().any(|status| {
                    status.producer == pool.producer
                        && status.replica == ReplicaState::Current
                        && status.sequence == Some(table.sequence)
                })
            })
            .await;
        let status = consumer
            .pools()
            .into_iter()
            .find(|status| status.producer == pool.producer);
        let mirror_identical = match followers.remove(&endpoint) {
            Some(follower) => match follower.finish(table.sequence).await {
                Ok(mirror) => {
                    mirror.sequence() == table.sequence
                        && mirror.words() == Some(table.words.as_slice())
                }
                Err(err) => {
                    eprintln!("pool {endpoint}: independent replica failed: {err:#}");
                    false
                }
            },
            None => false,
        };
        let report = reports.iter().find(|report| report.endpoint == endpoint);
        pools.push(PoolLine {
            endpoint,
            models: pool
                .registrations
                .iter()
                .map(|registration| registration.model.clone())
                .collect(),
            generation: pool.producer.layout_generation,
            sequence: table.sequence,
            resident_blocks: report.map_or(0, |report| report.resident_blocks),
            bucket_count: pool.producer.ckf_format.bucket_count,
            consumer_replica: status
                .as_ref()
                .map_or("missing", |status| status.replica.as_str())
                .to_owned(),
            consumer_sequence: status.and_then(|status| status.sequence),
            mirror_identical,
            ok: consumer_current && mirror_identical,
        });
    }

    let (scored_requests, scored_with_cached_prefix) = score_sample(args, &consumer, &catalog)?;
    let progress = relay.progress();
    consumer.shutdown().await;
    let incarnation = relay.incarnation();
    let admin_addr = relay.admin_addr().map(|addr| addr.to_string());
    relay.shutdown().await?;
    let mismatched = pools.iter().filter(|pool| !pool.ok).count();

    eprintln!("routing comparison: 3 DCs, a router in front, 3 policies ...");
    let trace_text = match &args.trace {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading trace {}", path.display()))?,
        None => kvrelay_ingest::BUILTIN_REQUEST_TRACE.to_owned(),
    };
    let mut records = kvrelay_ingest::parse_request_trace(&trace_text)
        .map_err(|err| anyhow::anyhow!("parsing the trace: {err}"))?;
    records.truncate(args.routing_requests);
    let routing = crate::demo_routing::compare(&cards, &records, args.plaintext).await?;
    let chart_path = args
        .routing_chart
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("kvrelay-demo-routing.svg"));
    let routing_chart = match std::fs::write(&chart_path, crate::demo_routing::svg(&routing)) {
        Ok(()) => Some(chart_path.display().to_string()),
        Err(err) => {
            eprintln!(
                "routing chart not written to {}: {err}",
                chart_path.display()
            );
            None
        }
    };
    Ok(DemoReport {
        ok: mismatched == 0 && !pools.is_empty(),
        mismatched,
        elapsed_s: started.elapsed().as_secs_f64(),
        relay_incarnation: incarnation,
        wan_addr: addr.to_string(),
        admin_addr,
        requests: progress.requests,
        events: progress.events,
        events_per_s: progress.events as f64 / replay_elapsed.as_secs_f64().max(1e-3),
        blocks_stored: progress.blocks_stored,
        blocks_removed: progress.blocks_removed,
        bytes_published: progress.bytes_published,
        frames_published: progress.frames_published,
        scored_requests,
        scored_with_cached_prefix,
        pools,
        routing,
        routing_chart,
    })
}

pub(crate) async fn wait_for_sources(relay: &Relay) {
    relay.wait_for_pools(1).await;
    // Attaches finish one by one: follow the catalog once every discovered endpoint has
    // settled (the caller bounds this by the demo deadline).
    while relay.is_settling() || relay.progress().sources == 0 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Scores the first requests of the trace for every base model through the consumer;
/// returns (scored, scored with a cached prefix on some pool).
fn score_sample(
    args: &DemoArgs,
    consumer: &Consumer,
    catalog: &kvrelay_codec::v1::CatalogUpdate,
) -> Result<(usize, usize)> {
    let text = match &args.trace {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("reading trace {}", path.display()))?,
        None => kvrelay_ingest::BUILTIN_REQUEST_TRACE.to_owned(),
    };
    let models = kvrelay_consumer::served_base_models(catalog);
    let mut scored = 0;
    let mut hits = 0;
    for line in text
        .lines()
        .filter(|line| !line.trim().is_empty())
        .take(SCORED_REQUESTS)
    {
        let Ok(record) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let hash_ids: Vec<u64> = record
            .get("hash_ids")
            .and_then(serde_json::Value::as_array)
            .map(|ids| ids.iter().filter_map(serde_json::Value::as_u64).collect())
            .unwrap_or_default();
        for kvrelay_consumer::ServedModel {
            model,
            kv_block_size,
        } in &models
        {
            let request = ScoreRequest {
                tokens: kvrelay_ingest::request_tokens(
                    &hash_ids,
                    *kv_block_size,
                    WORKLOAD_TOKEN_SEED,
                ),
                model: model.clone(),
                lora: None,
                cache_namespace: None,
            };
            let Ok(ranking) = consumer.score(&request) else {
                continue;
            };
            scored += 1;
            let cached = ranking
                .candidates
                .iter()
                .flat_map(|candidate| &candidate.legs)
                .any(|leg| leg.prefix_blocks.is_some_and(|blocks| blocks > 0));
            if cached {
                hits += 1;
            }
        }
    }
    Ok((scored, hits))
}

fn progress_line(started: Instant, progress: &RelayProgress, rate: f64, current: usize) {
    // Redraw one line on a terminal; print one line per update otherwise (logs, CI).
    let (start, end) = if std::io::stderr().is_terminal() {
        ("\r", "")
    } else {
        ("", "\n")
    };
    eprint!(
        "{start}[{:5.1}s] requests {:5}  events {:6} ({:7.0}/s)  pools {}  filter load {:5.2}%  published {:8}  replicas current {}/{}   ",
        started.elapsed().as_secs_f64(),
        progress.requests,
        progress.events,
        rate,
        progress.pools,
        progress.filter_load_max * 100.0,
        human_bytes(progress.bytes_published),
        current,
        progress.pools,
    );
    eprint!("{end}");
    let _ = std::io::stderr().flush();
}

fn print_report(report: &DemoReport) {
    println!();
    println!(
        "kvrelay demo: {} requests, {} events ({:.0}/s), {} blocks stored, {} removed, {} published in {} frames, {:.1}s",
        report.requests,
        report.events,
        report.events_per_s,
        report.blocks_stored,
        report.blocks_removed,
        human_bytes(report.bytes_published),
        report.frames_published,
        report.elapsed_s
    );
    println!();
    println!(
        "{:<26} {:<32} {:>4} {:>8} {:>9} {:>9} {:>10} {:>9} {:>9} {:>4}",
        "endpoint",
        "models",
        "gen",
        "sequence",
        "resident",
        "buckets",
        "consumer",
        "cons.seq",
        "identical",
        "ok"
    );
    for pool in &report.pools {
        println!(
            "{:<26} {:<32} {:>4} {:>8} {:>9} {:>9} {:>10} {:>9} {:>9} {:>4}",
            pool.endpoint,
            truncate(&pool.models.join(","), 32),
            pool.generation,
            pool.sequence,
            pool.resident_blocks,
            pool.bucket_count,
            pool.consumer_replica,
            pool.consumer_sequence
                .map_or_else(|| "-".to_owned(), |sequence| sequence.to_string()),
            if pool.mirror_identical { "yes" } else { "NO" },
            if pool.ok { "ok" } else { "FAIL" },
        );
    }
    println!();
    println!(
        "consumer scoring: {} of {} (request, model) pairs found a cached prefix",
        report.scored_with_cached_prefix, report.scored_requests
    );
    println!(
        "result: {}",
        if report.ok {
            "every replica matches its producer".to_owned()
        } else {
            format!("{} pools mismatched", report.mismatched)
        }
    );
    crate::demo_routing::print_table(&report.routing);
    if let Some(path) = &report.routing_chart {
        println!("chart: {path}");
    }
}

fn truncate(text: &str, width: usize) -> String {
    if text.chars().count() <= width {
        text.to_owned()
    } else {
        let mut out: String = text.chars().take(width.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// The example deployment: next to the working directory, or in the source tree.
fn default_cards() -> Result<PathBuf> {
    let relative = Path::new("examples/deployment/cards");
    if relative.is_dir() {
        return Ok(relative.to_path_buf());
    }
    let in_tree = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/deployment/cards");
    if in_tree.is_dir() {
        return Ok(in_tree);
    }
    Err(crate::usage::usage(
        "example deployment not found (examples/deployment/cards); run from the repository root or pass --cards DIR",
    ))
}

trait DottedEndpoint {
    fn serving_endpoint_dotted(&self) -> String;
}

impl DottedEndpoint for kvrelay_codec::v1::PoolDescriptor {
    fn serving_endpoint_dotted(&self) -> String {
        let endpoint = &self.serving_endpoint;
        format!(
            "{}.{}.{}",
            endpoint.namespace, endpoint.component, endpoint.name
        )
    }
}

/// An independent replica over its own TCP stream, built on the codec.
struct Follower {
    target: watch::Sender<Option<u64>>,
    task: tokio::task::JoinHandle<Result<PoolMirror>>,
}

impl Follower {
    fn spawn(addr: SocketAddr, producer: ProducerIdentity) -> Self {
        let (target, mut target_rx) = watch::channel(None::<u64>);
        let task = tokio::spawn(async move {
            let request = StreamRequest {
                subscriber_id: "kvrelay-demo-mirror".to_owned(),
                rpc: StreamRpc::SubscribePool {
                    expected_producer: producer,
                    resume_from_sequence: None,
                },
                auth_token: None,
            };
            let mut stream = ProbeStream::connect(addr, &request).await?;
            let mut mirror = PoolMirror::new(producer)?;
            loop {
                let reached = |target: Option<u64>, mirror: &PoolMirror| {
                    target.is_some_and(|target| {
                        mirror.words().is_some() && mirror.sequence() >= target
                    })
                };
                if reached(*target_rx.borrow(), &mirror) {
                    return Ok(mirror);
                }
                tokio::select! {
                    changed = target_rx.changed() => {
                        if changed.is_err() {
                            bail!("demo stopped before the replica caught up");
                        }
                    }
                    frame = stream.next_frame() => {
                        let Some(frame) = frame? else { bail!("relay closed the pool stream") };
                        if frame.kind() == Some(kvrelay_codec::MessageKind::Error) {
                            if let Ok(Message::Error(error)) = Message::from_frame(&frame) {
                                bail!("relay ended the pool stream: {} ({})", error.reason, error.message);
                            }
                            bail!("relay ended the pool stream with an error");
                        }
                        mirror.handle_frame(&frame)?;
                    }
                }
            }
        });
        Self { target, task }
    }

    async fn finish(self, sequence: u64) -> Result<PoolMirror> {
        self.target.send_replace(Some(sequence));
        tokio::time::timeout(DEMO_DEADLINE, self.task)
            .await
            .context("independent replica did not catch up within the deadline")?
            .context("independent replica task failed")?
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn demo_replicas_match_their_producers() {
        let chart = tempfile::tempdir().unwrap();
        let args = DemoArgs {
            json: true,
            cards: None,
            trace: None,
            speed: 0.0,
            log: "warn".to_owned(),
            routing_requests: 50,
            routing_chart: Some(chart.path().join("routing.svg")),
            plaintext: true,
        };
        let report = demo(&args, default_cards().unwrap()).await.unwrap();
        assert!(report.ok, "{report:#?}");
        assert_eq!(
            report.pools.len(),
            4,
            "the example deployment has four pools"
        );
        assert!(
            report
                .pools
                .iter()
                .all(|pool| pool.mirror_identical && pool.consumer_replica == "current")
        );
        assert!(
            report.scored_with_cached_prefix > 0,
            "scoring finds the replayed prefixes"
        );
    }
}
