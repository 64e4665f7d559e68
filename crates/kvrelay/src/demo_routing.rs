//! The demo's routing comparison: why kvrelay exists, in one table.
//!
//! Three relays on loopback play three DCs (`dc-a`, `dc-b`, `dc-c`, per-DC costs 0, 5 and
//! 20), each with its own slice of the example deployment ([`dc_keeps`]: `dc-a` all of
//! it, `dc-b` without mistral and the LoRA adapters, `dc-c` one llama worker), with a
//! `kvrelay router` in front following all three. The compared model is the first one
//! every DC serves. The trace's requests for one model are then served one by one, each by the pool
//! a policy picks, by simulated engines: each pool keeps an LRU prefix cache of
//! [`POOL_CACHE_BLOCKS`] blocks, answers how many leading prompt tokens it already held
//! (the ground truth measured here), stores the rest and evicts, and publishes exactly
//! those KV events to its DC's relay, so the router's replicas follow what the engines
//! hold. Each policy runs on fresh relays, on the same requests:
//! - `kvrelay`: the router's ranking (`POST /v1/route` semantics); the best candidate
//!   whose replica found a cached prefix, else (no DC holds any of it) the least-loaded;
//! - `kvrelay, GPU only`: the same, with relays that keep no host lane (what a router
//!   sees without cache tiers: only the GPU);
//! - `round robin`: the candidates in turn;
//! - `least load`: the candidate whose pool did the least prefill work lately (prompt
//!   tokens computed, decayed by [`LOAD_DECAY`] per request), what a load balancer sees.
//!
//! Each simulated engine also offloads the blocks its GPU cache evicts to host memory (an
//! LRU of [`POOL_HOST_BLOCKS`], as vLLM's offloading connector does) and restores a
//! request's prefix from there when its GPU lacks it; it publishes those offloads and host
//! evictions as tier events. The report compares the prompt tokens found in cache, on the
//! GPU and in host memory (a prefill saved either way), against round robin and against
//! routing that sees the GPU only.
//!
//! The WAN is secured as operators run it (docs/operations.md): each relay serves TLS with
//! a certificate from a CA generated into a temporary directory and requires a bearer
//! token read from a file there; the router trusts only that CA and sends the token.
//! `--plaintext` turns both off.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvrelay_ckf::{CacheTier, RouterEvent, SourceId, TierChange, TierEvent};
use kvrelay_consumer::{ReplicaState, ScoreRequest};
use kvrelay_ingest::{RequestRecord, WorkerCache};
use kvrelay_router::{RelaySection, RouterConfig, RouterService};
use kvrelay_server::{AuthConfig, ListenerTls, Relay, RelayConfig, WORKLOAD_TOKEN_SEED};
use serde::Serialize;

/// The simulated DCs: name and per-DC cost.
const DCS: [(&str, f64); 3] = [("dc-a", 0.0), ("dc-b", 5.0), ("dc-c", 20.0)];
/// GPU prefix cache of each simulated pool, in blocks (small next to the trace's working
/// set, so where a request goes decides what stays cached, and evictions reach host
/// memory).
pub(crate) const POOL_CACHE_BLOCKS: usize = 256;
/// Host memory of each simulated pool, in blocks: where its GPU's evictions go.
pub(crate) const POOL_HOST_BLOCKS: usize = 4 * POOL_CACHE_BLOCKS;
/// Per-request decay of the `least load` policy's recent-work figure.
const LOAD_DECAY: f64 = 0.9;
/// Bound on waiting for relays, replicas and the router.
const DEADLINE: Duration = Duration::from_secs(20);
/// How long the router may take to see a request's stores before the next request
/// (a router a few milliseconds behind its engines, as in production).
const PUBLISH_WAIT: Duration = Duration::from_millis(2);

/// One policy's outcome.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct PolicyLine {
    pub(crate) policy: &'static str,
    pub(crate) requests: usize,
    pub(crate) prompt_tokens: u64,
    /// Prompt tokens found cached (GPU plus host memory): prefill saved.
    pub(crate) cached_tokens: u64,
    /// Of those, found in host memory (restored instead of recomputed).
    pub(crate) host_tokens: u64,
    pub(crate) cached_fraction: f64,
    /// `cached_tokens` over round robin's.
    pub(crate) vs_round_robin: f64,
    /// Requests served per DC.
    pub(crate) requests_per_dc: BTreeMap<String, usize>,
}

/// The comparison.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RoutingReport {
    pub(crate) model: String,
    pub(crate) pool_cache_blocks: usize,
    pub(crate) pool_host_blocks: usize,
    /// Whether the relays served TLS with a bearer token.
    pub(crate) secured: bool,
    pub(crate) policies: Vec<PolicyLine>,
    pub(crate) elapsed_s: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    Kvrelay,
    KvrelayGpuOnly,
    RoundRobin,
    LeastLoad,
}

impl Policy {
    fn label(self) -> &'static str {
        match self {
            Self::Kvrelay => "kvrelay",
            Self::KvrelayGpuOnly => "kvrelay, GPU only",
            Self::RoundRobin => "round robin",
            Self::LeastLoad => "least load",
        }
    }

    /// Whether its relays keep host lanes (the router then sees host memory too).
    fn sees_host_tier(self) -> bool {
        self != Self::KvrelayGpuOnly
    }
}

/// TLS material and a bearer token generated for the demo, in a temporary directory.
struct Secured {
    _dir: tempfile::TempDir,
    ca: std::path::PathBuf,
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
    token_file: std::path::PathBuf,
}

impl Secured {
    /// A CA, a relay certificate for 127.0.0.1 signed by it, and a random token.
    fn generate() -> Result<Self> {
        use std::hash::{BuildHasher, Hasher};

        use kvrelay_tls::test_ca::{Purpose, TestAuthority};

        let dir = tempfile::tempdir().context("a temporary directory for the demo's TLS")?;
        let ca = TestAuthority::new("kvrelay demo CA")?;
        // 128 random bits from std's per-process hash keys: enough for a loopback demo.
        let random = || {
            std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish()
        };
        let token = format!("{:016x}{:016x}", random(), random());
        let path = |name: &str| dir.path().join(name);
        ca.write(dir.path(), "ca")?;
        ca.issue_to(dir.path(), "relay", &["127.0.0.1"], Purpose::Server)?;
        std::fs::write(path("token"), token)?;
        Ok(Self {
            ca: path("ca.pem"),
            cert: path("relay.pem"),
            key: path("relay.key"),
            token_file: path("token"),
            _dir: dir,
        })
    }
}

/// Runs every policy over `records` on fresh relays with the cards in `cards`, secured
/// with TLS and a token unless `plaintext`.
pub(crate) async fn compare(
    cards: &Path,
    records: &[RequestRecord],
    plaintext: bool,
) -> Result<RoutingReport> {
    let started = Instant::now();
    let secured = if plaintext {
        None
    } else {
        Some(Secured::generate().context("generating the demo's TLS material")?)
    };
    let mut lines = Vec::new();
    let mut model = String::new();
    for policy in [
        Policy::Kvrelay,
        Policy::KvrelayGpuOnly,
        Policy::RoundRobin,
        Policy::LeastLoad,
    ] {
        let (served_model, line) = run_policy(policy, cards, records, secured.as_ref())
            .await
            .with_context(|| format!("routing comparison, policy {}", policy.label()))?;
        model = served_model;
        lines.push(line);
    }
    let round_robin = lines
        .iter()
        .find(|line| line.policy == Policy::RoundRobin.label())
        .map_or(0, |line| line.cached_tokens);
    for line in &mut lines {
        line.vs_round_robin = if round_robin == 0 {
            0.0
        } else {
            line.cached_tokens as f64 / round_robin as f64
        };
    }
    Ok(RoutingReport {
        model,
        pool_cache_blocks: POOL_CACHE_BLOCKS,
        pool_host_blocks: POOL_HOST_BLOCKS,
        secured: secured.is_some(),
        policies: lines,
        elapsed_s: started.elapsed().as_secs_f64(),
    })
}

/// A simulated engine pool: the workload's LRU prefix cache
/// ([`kvrelay_ingest::WorkerCache`], the one cache model of the project) on its GPU, a
/// host-memory LRU its GPU's evictions are offloaded to, publishing its stores,
/// evictions and offloads as one source of its pool, plus the recent prefill work the
/// `least load` policy reads.
struct Engine {
    dc: usize,
    cache: WorkerCache,
    host: HostTier,
    /// Recent prefill work (tokens computed), decayed per request.
    recent_work: f64,
}

/// What serving one request found and published.
struct Served {
    /// Leading blocks found on the GPU.
    gpu: usize,
    /// Blocks past those found in host memory (restored, not recomputed).
    host: usize,
    /// Offloads of the blocks the GPU evicts (before their device eviction, so the relay
    /// resolves them while the GPU still holds them), then the host's own evictions.
    offloads: Vec<TierEvent>,
    /// The GPU cache's events.
    events: Vec<RouterEvent>,
    host_evictions: Vec<TierEvent>,
}

impl Engine {
    fn new(dc: usize, source: SourceId, block_size: u32) -> Self {
        Self::with_capacity(dc, source, block_size, POOL_CACHE_BLOCKS, POOL_HOST_BLOCKS)
    }

    fn with_capacity(
        dc: usize,
        source: SourceId,
        block_size: u32,
        gpu_blocks: usize,
        host_blocks: usize,
    ) -> Self {
        Self {
            dc,
            cache: WorkerCache::new(source, gpu_blocks, block_size, WORKLOAD_TOKEN_SEED),
            host: HostTier::new(host_blocks),
            recent_work: 0.0,
        }
    }

    /// Serves a request of trace blocks `hash_ids`: the prefix found on the GPU, its
    /// continuation in host memory, and the events the caches' changes publish.
    fn serve(&mut self, hash_ids: &[u64]) -> Served {
        let gpu = self.cache.prefix_depth(hash_ids);
        let host = self.host.continuation(&hash_ids[gpu..]);
        for &hash_id in &hash_ids[gpu..gpu + host] {
            self.host.touch(hash_id);
        }
        let (events, evicted) = self.cache.serve_evicting(hash_ids);
        let mut offloaded = Vec::with_capacity(evicted.len());
        let mut host_evicted = Vec::new();
        for hash_id in evicted {
            offloaded.push(self.cache.engine_id(hash_id));
            if let Some(dropped) = self.host.insert(hash_id) {
                host_evicted.push(self.cache.engine_id(dropped));
            }
        }
        let source = self.cache.source();
        let tier_event = |change| TierEvent {
            source,
            event_id: 0,
            tier: CacheTier::Host,
            change,
        };
        Served {
            gpu,
            host,
            offloads: (!offloaded.is_empty())
                .then(|| {
                    tier_event(TierChange::Offloaded {
                        engine_block_ids: offloaded,
                    })
                })
                .into_iter()
                .collect(),
            events,
            host_evictions: (!host_evicted.is_empty())
                .then(|| {
                    tier_event(TierChange::Removed(kvrelay_ckf::RemovedBlocks {
                        engine_block_ids: host_evicted,
                    }))
                })
                .into_iter()
                .collect(),
        }
    }
}

/// Host memory: an LRU of trace blocks the GPU evicted.
struct HostTier {
    capacity: usize,
    /// hash id → last use tick.
    blocks: HashMap<u64, u64>,
    /// last use tick → hash id.
    by_tick: BTreeMap<u64, u64>,
    tick: u64,
}

impl HostTier {
    fn new(capacity: usize) -> Self {
        Self {
            capacity: capacity.max(1),
            blocks: HashMap::new(),
            by_tick: BTreeMap::new(),
            tick: 0,
        }
    }

    /// How many leading blocks of `hash_ids` host memory holds.
    fn continuation(&self, hash_ids: &[u64]) -> usize {
        hash_ids
            .iter()
            .take_while(|id| self.blocks.contains_key(id))
            .count()
    }

    fn touch(&mut self, hash_id: u64) {
        self.tick += 1;
        if let Some(tick) = self.blocks.get_mut(&hash_id) {
            self.by_tick.remove(tick);
            *tick = self.tick;
            self.by_tick.insert(self.tick, hash_id);
        }
    }

    /// Stores `hash_id` (or refreshes it); returns the block evicted to make room.
    fn insert(&mut self, hash_id: u64) -> Option<u64> {
        if self.blocks.contains_key(&hash_id) {
            self.touch(hash_id);
            return None;
        }
        let evicted = (self.blocks.len() >= self.capacity)
            .then(|| {
                let (&oldest, &victim) = self.by_tick.iter().next()?;
                self.by_tick.remove(&oldest);
                self.blocks.remove(&victim);
                Some(victim)
            })
            .flatten();
        self.tick += 1;
        self.blocks.insert(hash_id, self.tick);
        self.by_tick.insert(self.tick, hash_id);
        evicted
    }
}

/// A one-request trace outside the compared requests' blocks: replaying it makes the
/// relay connect the cards' sources (the engines of this simulation publish through
/// them), then the relay holds only this block, which no compared request shares.
const SOURCE_TRACE: &str =
    "{\"timestamp\":0,\"input_length\":16,\"output_length\":1,\"hash_ids\":[987654321987]}\n";

/// Whether DC `dc` (an index into [`DCS`]) deploys the card file named `name`.
fn dc_keeps(dc: usize, name: &str) -> bool {
    match dc {
        0 => true,
        1 => !name.contains("mistral") && !name.contains("-sql"),
        _ => name.starts_with("demo.llama.generate.1a01") && !name.contains("-sql"),
    }
}

/// A card directory for DC `dc` under `root`: the cards of `cards` it keeps, or all of
/// them when it keeps none (a card directory other than the example's).
fn dc_card_dir(cards: &Path, dc: usize, root: &Path) -> Result<std::path::PathBuf> {
    let dir = root.join(format!("cards-{dc}"));
    std::fs::create_dir_all(&dir)?;
    let mut files = Vec::new();
    for entry in std::fs::read_dir(cards).with_context(|| format!("reading {}", cards.display()))? {
        let entry = entry?;
        if entry.file_type()?.is_file() {
            files.push(entry.file_name());
        }
    }
    let kept: Vec<_> = files
        .iter()
        .filter(|name| dc_keeps(dc, &name.to_string_lossy()))
        .collect();
    let chosen = if kept.is_empty() {
        files.iter().collect()
    } else {
        kept
    };
    for name in chosen {
        std::fs::copy(cards.join(name), dir.join(name))?;
    }
    Ok(dir)
}

/// Starts one relay per DC. The returned directory holds their card directories and setup
/// trace: keep it until the relays are shut down (they watch those directories).
async fn start_relays(
    cards: &Path,
    secured: Option<&Secured>,
    host_lanes: bool,
) -> Result<(Vec<Relay>, tempfile::TempDir)> {
    let dir = tempfile::tempdir().context("a temporary directory for the setup trace")?;
    let trace = dir.path().join("setup.jsonl");
    std::fs::write(&trace, SOURCE_TRACE).context("writing the setup trace")?;
    let mut relays = Vec::new();
    for (index, (dc, _)) in DCS.iter().enumerate() {
        let dc_cards = dc_card_dir(cards, index, dir.path())?;
        let mut config = RelayConfig {
            dc_id: (*dc).to_owned(),
            ..RelayConfig::default()
        };
        config.wan.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        config.admin.enabled = false;
        if let Some(secured) = secured {
            config.wan.tls = Some(ListenerTls {
                cert: secured.cert.clone(),
                key: secured.key.clone(),
                client_ca: None,
            });
            config.wan.auth = Some(AuthConfig {
                token: None,
                token_file: Some(secured.token_file.clone()),
            });
        }
        config.discovery.dir = Some(dc_cards);
        if host_lanes {
            // The lane is sized like the engines' host memory: 4× the GPU's.
            config.tiers.host = Some(kvrelay_server::TierConfig {
                capacity_ratio: (POOL_HOST_BLOCKS / POOL_CACHE_BLOCKS) as f64,
                blocks_per_chunk: 1,
            });
        }
        config.workload = Some(kvrelay_server::WorkloadConfig {
            trace: Some(trace.clone()),
            speed: 0.0,
            loops: 1,
        });
        let relay = Relay::start(config).await?;
        tokio::time::timeout(DEADLINE, crate::demo::wait_for_sources(&relay))
            .await
            .with_context(|| format!("{dc}: no pool materialized"))?;
        tokio::time::timeout(DEADLINE, relay.workload_finished())
            .await
            .with_context(|| format!("{dc}: the setup trace did not finish"))?;
        relays.push(relay);
    }
    Ok((relays, dir))
}

async fn run_policy(
    policy: Policy,
    cards: &Path,
    records: &[RequestRecord],
    secured: Option<&Secured>,
) -> Result<(String, PolicyLine)> {
    let (relays, relay_dir) = start_relays(cards, secured, policy.sees_host_tier()).await?;
    let mut config = RouterConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        ..RouterConfig::default()
    };
    for (relay, (dc, cost)) in relays.iter().zip(DCS) {
        let mut section = RelaySection::new(&relay.wan_addr().to_string(), dc, cost);
        if let Some(secured) = secured {
            section.tls_ca = Some(secured.ca.clone());
            section.token_file = Some(secured.token_file.clone());
        }
        config.relays.push(section);
    }
    let router = RouterService::start(&config, |_| None).await?;
    let n_pools: usize = relays.iter().map(|relay| relay.catalog().pools.len()).sum();
    let current = router
        .consumer()
        .wait_until(DEADLINE, |state, now| {
            let pools = state.pools(now);
            pools.len() == n_pools && pools.iter().all(|p| p.replica == ReplicaState::Current)
        })
        .await;
    if !current {
        bail!("the router's replicas did not become current");
    }

    let served = kvrelay_consumer::served_base_models(&relays[0].catalog());
    let model = served
        .first()
        .context("the deployment serves no model")?
        .clone();
    // One engine per pool, fed through one of the pool's sources.
    let mut engines: HashMap<(String, String), Engine> = HashMap::new();
    let sources: Vec<_> = relays.iter().map(Relay::sources_by_producer).collect();
    for pool in router.consumer().pools() {
        let dc = DCS
            .iter()
            .position(|(name, _)| *name == pool.dc)
            .context("a pool of an unknown DC")?;
        let source = sources[dc]
            .iter()
            .find(|(producer, _)| *producer == pool.producer)
            .and_then(|(_, sources)| sources.first())
            .copied()
            .with_context(|| format!("no source feeds pool {} in {}", pool.pool, pool.dc))?;
        engines.insert(
            (pool.dc.clone(), pool.pool.clone()),
            Engine::new(dc, source, model.kv_block_size),
        );
    }

    let mut line = PolicyLine {
        policy: policy.label(),
        requests: 0,
        prompt_tokens: 0,
        cached_tokens: 0,
        host_tokens: 0,
        cached_fraction: 0.0,
        vs_round_robin: 0.0,
        requests_per_dc: DCS.iter().map(|(dc, _)| ((*dc).to_owned(), 0)).collect(),
    };
    for (index, record) in records.iter().enumerate() {
        let tokens = kvrelay_ingest::request_tokens(
            &record.hash_ids,
            model.kv_block_size,
            WORKLOAD_TOKEN_SEED,
        );
        let request = ScoreRequest {
            tokens,
            model: model.model.clone(),
            ..ScoreRequest::default()
        };
        let ranking = router
            .consumer()
            .score(&request)
            .map_err(|err| anyhow::anyhow!("scoring: {err}"))?;
        // The pool each candidate's prefill (or only) leg runs on, in ranking order.
        let mut candidates: Vec<((String, String), Option<f64>)> = ranking
            .candidates
            .iter()
            .filter_map(|candidate| {
                let leg = candidate.legs.first()?;
                Some((
                    (candidate.dc.to_string(), leg.pool.to_string()),
                    candidate.prefix_fraction,
                ))
            })
            .collect();
        if candidates.is_empty() {
            bail!("no candidate serves {}", model.model);
        }
        let least_loaded = |candidates: &[((String, String), Option<f64>)]| {
            candidates
                .iter()
                .min_by(|a, b| {
                    let load = |key| {
                        engines
                            .get(key)
                            .map_or(f64::MAX, |e: &Engine| e.recent_work)
                    };
                    load(&a.0)
                        .total_cmp(&load(&b.0))
                        .then_with(|| a.0.cmp(&b.0))
                })
                .map(|(key, _)| key.clone())
        };
        let chosen = match policy {
            Policy::Kvrelay | Policy::KvrelayGpuOnly => candidates
                .iter()
                .find(|(_, prefix)| prefix.is_some_and(|fraction| fraction > 0.0))
                .map(|(key, _)| key.clone())
                .or_else(|| least_loaded(&candidates)),
            Policy::RoundRobin => {
                candidates.sort_by(|a, b| a.0.cmp(&b.0));
                Some(candidates[index % candidates.len()].0.clone())
            }
            Policy::LeastLoad => least_loaded(&candidates),
        }
        .context("no candidate chosen")?;

        for engine in engines.values_mut() {
            engine.recent_work *= LOAD_DECAY;
        }
        let engine = engines
            .get_mut(&chosen)
            .with_context(|| format!("no engine for {chosen:?}"))?;
        let served = engine.serve(&record.hash_ids);
        let block = u64::from(model.kv_block_size);
        let prompt = request.tokens.len() as u64;
        let on_gpu = (served.gpu as u64 * block).min(prompt);
        let cached = ((served.gpu + served.host) as u64 * block).min(prompt);
        engine.recent_work += (prompt - cached) as f64;
        let relay = &relays[engine.dc];
        // Offloads first: the relay resolves them while the GPU still holds the blocks.
        for event in served.offloads {
            relay.submit_tier(event).await?;
        }
        for event in served.events {
            relay.submit(event).await?;
        }
        for event in served.host_evictions {
            relay.submit_tier(event).await?;
        }
        line.host_tokens += cached - on_gpu;
        relay.flush().await;
        tokio::time::sleep(PUBLISH_WAIT).await;
        line.requests += 1;
        line.prompt_tokens += prompt;
        line.cached_tokens += cached;
        *line.requests_per_dc.entry(chosen.0).or_default() += 1;
    }
    line.cached_fraction = if line.prompt_tokens == 0 {
        0.0
    } else {
        line.cached_tokens as f64 / line.prompt_tokens as f64
    };
    router.shutdown().await;
    for relay in relays {
        relay.shutdown().await?;
    }
    drop(relay_dir);
    Ok((model.model, line))
}

/// The comparison as a table.
pub(crate) fn print_table(report: &RoutingReport) {
    println!(
        "\nrouting value: {} requests for {}, 3 DCs (costs 0/5/20, WAN {}), {} GPU and {} host blocks per pool",
        report.policies.first().map_or(0, |line| line.requests),
        report.model,
        if report.secured {
            "TLS + token"
        } else {
            "plaintext"
        },
        report.pool_cache_blocks,
        report.pool_host_blocks
    );
    println!(
        "{:<18} {:>13} {:>12} {:>12} {:>14} {:>8} {:>8}  requests per DC",
        "policy", "prompt tokens", "found GPU", "found host", "prefill saved", "saved", "vs RR"
    );
    for line in &report.policies {
        let per_dc: Vec<String> = line
            .requests_per_dc
            .iter()
            .map(|(dc, n)| format!("{dc} {n}"))
            .collect();
        println!(
            "{:<18} {:>13} {:>12} {:>12} {:>14} {:>7.1}% {:>7.2}x  {}",
            line.policy,
            line.prompt_tokens,
            line.cached_tokens - line.host_tokens,
            line.host_tokens,
            line.cached_tokens,
            line.cached_fraction * 100.0,
            line.vs_round_robin,
            per_dc.join(", ")
        );
    }
    let saved = |policy: Policy| {
        report
            .policies
            .iter()
            .find(|line| line.policy == policy.label())
            .map_or(0, |line| line.cached_tokens)
    };
    let (tiered, gpu_only) = (saved(Policy::Kvrelay), saved(Policy::KvrelayGpuOnly));
    if gpu_only > 0 {
        println!(
            "routing that sees host memory saved {} more prefill tokens than GPU-only routing ({:.2}x)",
            tiered as i64 - gpu_only as i64,
            tiered as f64 / gpu_only as f64
        );
    }
}

/// The comparison as an SVG bar chart (cached fraction per policy).
pub(crate) fn svg(report: &RoutingReport) -> String {
    let (width, bar_height, gap, left) = (560.0, 28.0, 14.0, 110.0);
    let height = 60.0 + (bar_height + gap) * report.policies.len() as f64;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         font-family=\"sans-serif\" font-size=\"13\">\n\
         <text x=\"10\" y=\"22\" font-size=\"15\">Prompt tokens found in cache ({} requests, {})</text>\n",
        report.policies.first().map_or(0, |line| line.requests),
        escape(&report.model)
    );
    let scale = width - left - 90.0;
    for (i, line) in report.policies.iter().enumerate() {
        let y = 40.0 + i as f64 * (bar_height + gap);
        let bar = (line.cached_fraction * scale).max(1.0);
        let colour = if line.policy == "kvrelay" {
            "#2b7bb9"
        } else {
            "#9aa5b1"
        };
        out.push_str(&format!(
            "<text x=\"10\" y=\"{:.1}\">{}</text>\n\
             <rect x=\"{left}\" y=\"{y:.1}\" width=\"{bar:.1}\" height=\"{bar_height}\" fill=\"{colour}\"/>\n\
             <text x=\"{:.1}\" y=\"{:.1}\">{:.1}%</text>\n",
            y + bar_height * 0.68,
            escape(line.policy),
            left + bar + 6.0,
            y + bar_height * 0.68,
            line.cached_fraction * 100.0
        ));
    }
    out.push_str("</svg>\n");
    out
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use kvrelay_ckf::EventPayload;
    use kvrelay_identity::KvQueryHashFormat;
    use kvrelay_identity::hashing::{HashSalt, block_hashes};

    use super::*;

    #[test]
    fn an_engine_publishes_the_block_hashes_the_router_computes_from_the_prompt() {
        // The router scores a request by hashing its synthesized prompt tokens; the
        // engine's stores must name exactly those blocks, or no replica would ever match.
        let block_size = 16;
        let mut engine = Engine::new(0, SourceId::new(1, 0), block_size);
        let hash_ids: Vec<u64> = (1..=4).collect();
        let tokens = kvrelay_ingest::request_tokens(&hash_ids, block_size, WORKLOAD_TOKEN_SEED);
        let expected = block_hashes(
            &tokens,
            block_size,
            KvQueryHashFormat::DynamoStandardV1,
            HashSalt::default(),
        );
        let Served { gpu, events, .. } = engine.serve(&hash_ids);
        assert_eq!(gpu, 0);
        let published: Vec<u64> = events
            .iter()
            .flat_map(|event| match &event.payload {
                EventPayload::Stored(stored) => {
                    stored.blocks.iter().map(|b| b.token_hash).collect()
                }
                _ => Vec::new(),
            })
            .collect();
        assert_eq!(published, expected);
        let Served { gpu, events, .. } = engine.serve(&hash_ids);
        assert_eq!(gpu, 4, "the second request finds the whole prefix");
        assert!(events.is_empty());
    }

    /// What the GPU evicts goes to host memory (offloaded before its device eviction is
    /// published), a later request restores its prefix from there, and host memory
    /// evicts its least recently used block when full.
    #[test]
    fn an_engine_offloads_gpu_evictions_to_host_memory_and_restores_from_there() {
        let source = SourceId::new(1, 0);
        let mut engine = Engine::with_capacity(0, source, 16, 2, 3);
        engine.serve(&[1, 2]);
        let served = engine.serve(&[3, 4]);
        let ids = |hash_ids: &[u64]| -> Vec<u64> {
            hash_ids
                .iter()
                .map(|&h| engine.cache.engine_id(h))
                .collect()
        };
        assert_eq!(
            served.offloads,
            vec![TierEvent {
                source,
                event_id: 0,
                tier: CacheTier::Host,
                change: TierChange::Offloaded {
                    engine_block_ids: ids(&[1, 2]),
                },
            }]
        );
        assert!(matches!(served.events[0].payload, EventPayload::Removed(_)));
        let served = engine.serve(&[1, 2, 5]);
        assert_eq!(
            (served.gpu, served.host),
            (0, 2),
            "restored from host memory"
        );
        // Blocks 3 and 4 left the GPU for host memory, which holds 3 blocks: the oldest
        // host blocks make room.
        assert_eq!(served.host_evictions.len(), 1);
        let TierChange::Removed(removed) = &served.host_evictions[0].change else {
            panic!("{:?}", served.host_evictions)
        };
        assert_eq!(removed.engine_block_ids.len(), 1);
    }

    #[test]
    fn each_dc_deploys_its_own_slice_of_the_example() {
        let cards = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../examples/deployment/cards");
        let root = tempfile::tempdir().unwrap();
        let counts: Vec<usize> = (0..DCS.len())
            .map(|dc| {
                std::fs::read_dir(dc_card_dir(&cards, dc, root.path()).unwrap())
                    .unwrap()
                    .count()
            })
            .collect();
        let all = std::fs::read_dir(&cards).unwrap().count();
        assert_eq!(counts[0], all);
        assert!(
            counts[0] > counts[1] && counts[1] > counts[2] && counts[2] >= 1,
            "{counts:?}"
        );
    }

    #[test]
    fn the_chart_has_one_bar_per_policy() {
        let line = |policy, fraction| PolicyLine {
            policy,
            requests: 10,
            prompt_tokens: 100,
            cached_tokens: (fraction * 100.0) as u64,
            host_tokens: 0,
            cached_fraction: fraction,
            vs_round_robin: 1.0,
            requests_per_dc: BTreeMap::new(),
        };
        let report = RoutingReport {
            model: "m<1>".into(),
            pool_cache_blocks: 8,
            pool_host_blocks: 32,
            secured: false,
            policies: vec![line("kvrelay", 0.6), line("round robin", 0.2)],
            elapsed_s: 0.0,
        };
        let svg = svg(&report);
        assert_eq!(svg.matches("<rect").count(), 2);
        assert!(svg.contains("m&lt;1&gt;") && svg.contains("60.0%"));
    }
}
