//! Engine-like events from a request trace: each worker's prefix cache is simulated as an
//! LRU of blocks, requests are routed to workers, and every store and eviction becomes a
//! router event. This is the embedded default workload of the demo and the benchmarks.
//!
//! Model: a request's `hash_ids` are its prefix blocks. The request goes to a worker
//! ([`Routing`]); blocks the worker already caches are touched, missing ones are stored
//! (one `stored` event per run of missing blocks, parented on the block before the run),
//! and when the worker is full its least recently used blocks of *other* requests are
//! evicted first (one `removed` event). A request longer than the capacity is cut to it.
//! Each block's tokens are synthesized from its id ([`block_tokens`]), so a router can
//! rebuild a request's tokens with [`request_tokens`] and probe the filter. Engine block
//! ids differ per worker, like vLLM's randomly seeded hashes.

use std::collections::{BTreeMap, HashMap};

use kvrelay_ckf::{EventPayload, RemovedBlocks, RouterEvent, SourceId, StoredBlock, StoredBlocks};
use kvrelay_identity::KvQueryHashFormat;
use kvrelay_identity::hashing::{HashSalt, block_hash};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::event_trace::{
    EventTraceHeader, RequestRecord, TimedEvent, TraceError, parse_request_trace,
};

/// The small request trace shipped with the repository (`traces/requests-small.jsonl`).
pub const BUILTIN_REQUEST_TRACE: &str = include_str!("../../../traces/requests-small.jsonl");

/// How requests are assigned to workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Routing {
    /// The worker caching the longest prefix of the request; ties go to the worker with
    /// the fewest cached blocks, then the lowest index (a KV-aware router).
    KvAware,
    /// Workers in turn.
    RoundRobin,
    /// By a fixed hash of the request's first block ([`route_by_first_block`]): requests
    /// sharing a first block land on the same worker, without looking at any cache (what
    /// the relay's embedded workload does over the sources it finds attached).
    FirstBlock,
}

/// The default [`TraceWorkloadConfig::seed`]: the relay's embedded workload synthesizes block
/// tokens with it, so a consumer scoring
/// `request_tokens(hash_ids, block_size, DEFAULT_WORKLOAD_SEED)` finds what it stored.
pub const DEFAULT_WORKLOAD_SEED: u64 = 0x6b76_7265_6c61_7931;

/// Which of `n_workers` workers serves a request under [`Routing::FirstBlock`]: a fixed
/// 64-bit mix (splitmix64) of its first block id, modulo the count. `None` for an empty
/// request or no workers.
pub fn route_by_first_block(hash_ids: &[u64], n_workers: usize) -> Option<usize> {
    let first = *hash_ids.first()?;
    let n = u64::try_from(n_workers).ok().filter(|n| *n > 0)?;
    let mut z = first.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    usize::try_from((z ^ (z >> 31)) % n).ok()
}

/// Generator settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceWorkloadConfig {
    /// Workers (sources), each with `dp_rank` 0.
    pub n_workers: u32,
    /// The first worker's id; the others follow consecutively.
    pub first_worker_id: u64,
    /// Blocks each worker's cache holds.
    pub capacity_blocks: usize,
    /// Tokens per block of the synthesized tokens.
    pub block_size: u32,
    /// Request routing.
    pub routing: Routing,
    /// Seeds the per-worker engine block ids and the synthesized tokens.
    pub seed: u64,
}

impl Default for TraceWorkloadConfig {
    fn default() -> Self {
        Self {
            n_workers: 4,
            first_worker_id: 1,
            capacity_blocks: 512,
            block_size: 16,
            routing: Routing::KvAware,
            seed: DEFAULT_WORKLOAD_SEED,
        }
    }
}

/// A generated workload: router events in time order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceWorkload {
    config: TraceWorkloadConfig,
    events: Vec<TimedEvent>,
    n_requests: usize,
}

impl TraceWorkload {
    /// Simulates `requests` under `config`.
    ///
    /// ```
    /// use kvrelay_ingest::{RequestRecord, TraceWorkload, TraceWorkloadConfig};
    /// let requests = vec![
    ///     RequestRecord { timestamp: 0, input_length: 32, output_length: 1, hash_ids: vec![1, 2] },
    ///     RequestRecord { timestamp: 5, input_length: 48, output_length: 1, hash_ids: vec![1, 2, 3] },
    /// ];
    /// let workload = TraceWorkload::generate(&requests, TraceWorkloadConfig::default());
    /// // The second request reuses blocks 1 and 2 on the same worker and stores block 3.
    /// assert_eq!(workload.events().len(), 2);
    /// ```
    pub fn generate(requests: &[RequestRecord], config: TraceWorkloadConfig) -> Self {
        let n_workers = config.n_workers.max(1) as usize;
        let mut workers: Vec<WorkerCache> = (0..n_workers)
            .map(|idx| {
                WorkerCache::new(
                    SourceId::new(config.first_worker_id + idx as u64, 0),
                    config.capacity_blocks,
                    config.block_size,
                    config.seed,
                )
            })
            .collect();
        let mut events = Vec::new();
        let mut next_round_robin = 0usize;
        for request in requests {
            let worker_idx = match config.routing {
                Routing::RoundRobin => {
                    let idx = next_round_robin % n_workers;
                    next_round_robin += 1;
                    idx
                }
                Routing::KvAware => pick_kv_aware(&workers, &request.hash_ids),
                Routing::FirstBlock => {
                    route_by_first_block(&request.hash_ids, n_workers).unwrap_or(0)
                }
            };
            let Some(worker) = workers.get_mut(worker_idx) else {
                continue;
            };
            events.extend(
                worker
                    .serve(&request.hash_ids)
                    .into_iter()
                    .map(|event| TimedEvent {
                        t_ms: request.timestamp,
                        event,
                    }),
            );
        }
        Self {
            config,
            events,
            n_requests: requests.len(),
        }
    }

    /// The workload of the shipped request trace.
    pub fn builtin(config: TraceWorkloadConfig) -> Result<Self, TraceError> {
        let requests = parse_request_trace(BUILTIN_REQUEST_TRACE)?;
        Ok(Self::generate(&requests, config))
    }

    /// The events, in time order.
    pub fn events(&self) -> &[TimedEvent] {
        &self.events
    }

    /// Consumes the workload, returning its events.
    pub fn into_events(self) -> Vec<TimedEvent> {
        self.events
    }

    /// The settings it was generated with.
    pub fn config(&self) -> &TraceWorkloadConfig {
        &self.config
    }

    /// Requests simulated.
    pub fn n_requests(&self) -> usize {
        self.n_requests
    }

    /// The event-trace header describing these events.
    pub fn header(&self) -> EventTraceHeader {
        EventTraceHeader::new(self.config.block_size, KvQueryHashFormat::DynamoStandardV1)
    }
}

/// The synthesized tokens of block `hash_id` (`block_size` tokens below 32,000).
pub fn block_tokens(hash_id: u64, block_size: u32, seed: u64) -> Vec<u32> {
    (0..u64::from(block_size))
        .map(|pos| {
            (xxh3_64_with_seed(&[hash_id.to_le_bytes(), pos.to_le_bytes()].concat(), seed) % 32_000)
                as u32
        })
        .collect()
}

/// The synthesized prompt tokens of a request: its blocks' tokens, concatenated.
pub fn request_tokens(hash_ids: &[u64], block_size: u32, seed: u64) -> Vec<u32> {
    hash_ids
        .iter()
        .flat_map(|id| block_tokens(*id, block_size, seed))
        .collect()
}

/// The token hash of block `hash_id` (standard format, no salt).
pub fn block_token_hash(hash_id: u64, block_size: u32, seed: u64) -> u64 {
    block_hash(
        &block_tokens(hash_id, block_size, seed),
        &[],
        HashSalt::default().seed(),
    )
}

fn pick_kv_aware(workers: &[WorkerCache], hash_ids: &[u64]) -> usize {
    let mut best = 0usize;
    let mut best_key = (0usize, usize::MAX);
    for (idx, worker) in workers.iter().enumerate() {
        let key = (worker.prefix_depth(hash_ids), worker.resident());
        if idx == 0 || key.0 > best_key.0 || (key.0 == best_key.0 && key.1 < best_key.1) {
            best = idx;
            best_key = key;
        }
    }
    best
}

/// What serving one request changed in a [`WorkerCache`], in the order an engine
/// publishes it: the evictions, then the stored runs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheChange {
    /// Engine ids of the blocks evicted to make room, least recently used first.
    pub evicted: Vec<u64>,
    /// The trace blocks (hash ids) of `evicted`, in the same order.
    pub evicted_hash_ids: Vec<u64>,
    /// Runs of newly stored blocks, in request order.
    pub stored: Vec<StoredRun>,
    /// Leading blocks of the request cached after it (hits plus stores; less than the
    /// request when it was cut to the capacity or found nothing to evict).
    pub resident: usize,
}

impl CacheChange {
    /// Blocks stored by the request.
    pub fn stored_blocks(&self) -> usize {
        self.stored.iter().map(|run| run.blocks.len()).sum()
    }
}

/// A run of consecutive blocks a request stored, chained under the block before it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRun {
    /// Engine id of the cached block the run extends (`None`: the request's root).
    pub parent_engine_id: Option<u64>,
    /// `(trace block id, engine block id)` of each stored block, in chain order.
    pub blocks: Vec<(u64, u64)>,
}

/// One worker's simulated prefix cache: an LRU of trace blocks that turns each request into
/// the router events the worker would publish. The project's one cache model: behind
/// [`TraceWorkload`], the relay's embedded trace replay, the demo's simulated engines and
/// the benchmarks' vLLM engine publishers (which publish [`WorkerCache::apply`]'s change
/// in vLLM's wire form).
///
/// A request's blocks the cache holds are touched; each run of missing blocks is stored
/// (one `stored` event, parented on the block before the run); when the cache is full, the
/// least recently used blocks of *earlier* requests are evicted first (one `removed` event,
/// before the stores); a request longer than the capacity is cut to it, and one that finds
/// nothing to evict stops there. Engine block ids are a per-worker hash of the block id
/// (vLLM's hashes differ per worker); event ids count from 0 per worker.
#[derive(Debug, Clone)]
pub struct WorkerCache {
    source: SourceId,
    capacity: usize,
    block_size: u32,
    seed: u64,
    /// hash id → (engine block id, last use tick).
    blocks: HashMap<u64, (u64, u64)>,
    /// last use tick → hash id (LRU order).
    by_tick: BTreeMap<u64, u64>,
    tick: u64,
    next_event_id: u64,
}

impl WorkerCache {
    /// An empty cache of `capacity_blocks` blocks (at least 1) for `source`, synthesizing
    /// `block_size`-token blocks with `seed`.
    pub fn new(source: SourceId, capacity_blocks: usize, block_size: u32, seed: u64) -> Self {
        Self {
            source,
            capacity: capacity_blocks.max(1),
            block_size,
            seed,
            blocks: HashMap::new(),
            by_tick: BTreeMap::new(),
            tick: 0,
            next_event_id: 0,
        }
    }

    /// The source whose events this cache emits.
    pub fn source(&self) -> SourceId {
        self.source
    }

    /// Blocks cached now (the worker's exact KV usage).
    pub fn resident(&self) -> usize {
        self.blocks.len()
    }

    /// How many leading blocks of `hash_ids` the cache holds.
    pub fn prefix_depth(&self, hash_ids: &[u64]) -> usize {
        hash_ids
            .iter()
            .take_while(|id| self.blocks.contains_key(id))
            .count()
    }

    /// The trace blocks cached now, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.blocks.keys().copied()
    }

    /// Serves one request whose prefix blocks are `hash_ids` and returns what changed
    /// (the cache model itself; [`WorkerCache::serve`] turns it into router events, an
    /// engine simulator into its own wire events).
    pub fn apply(&mut self, hash_ids: &[u64]) -> CacheChange {
        let request_start = self.tick;
        let chain = &hash_ids[..hash_ids.len().min(self.capacity)];
        let mut change = CacheChange::default();
        let mut run: Vec<(u64, u64)> = Vec::new();
        let mut run_parent: Option<u64> = None;
        let mut previous_engine_id: Option<u64> = None;
        for &hash_id in chain {
            if let Some(engine_id) = self.touch(hash_id) {
                if !run.is_empty() {
                    change.stored.push(StoredRun {
                        parent_engine_id: run_parent,
                        blocks: std::mem::take(&mut run),
                    });
                }
                previous_engine_id = Some(engine_id);
                change.resident += 1;
                continue;
            }
            if self.blocks.len() >= self.capacity {
                match self.evict_before(request_start) {
                    Some((evicted, engine_id)) => {
                        change.evicted.push(engine_id);
                        change.evicted_hash_ids.push(evicted);
                    }
                    None => break,
                }
            }
            let engine_id = engine_block_id(self.source, hash_id, self.seed);
            self.insert(hash_id, engine_id);
            if run.is_empty() {
                run_parent = previous_engine_id;
            }
            run.push((hash_id, engine_id));
            previous_engine_id = Some(engine_id);
            change.resident += 1;
        }
        if !run.is_empty() {
            change.stored.push(StoredRun {
                parent_engine_id: run_parent,
                blocks: run,
            });
        }
        change
    }

    /// Serves one request whose prefix blocks are `hash_ids`; returns its events in order
    /// (the eviction first, then the stored runs). A full hit returns none.
    pub fn serve(&mut self, hash_ids: &[u64]) -> Vec<RouterEvent> {
        self.serve_evicting(hash_ids).0
    }

    /// [`WorkerCache::serve`], also returning the trace blocks (hash ids) it evicted, for
    /// an engine that offloads them to a lower tier.
    pub fn serve_evicting(&mut self, hash_ids: &[u64]) -> (Vec<RouterEvent>, Vec<u64>) {
        let mut change = self.apply(hash_ids);
        let evicted_hash_ids = std::mem::take(&mut change.evicted_hash_ids);
        let mut events = Vec::with_capacity(change.stored.len() + 1);
        if !change.evicted.is_empty() {
            events.push(self.event(EventPayload::Removed(RemovedBlocks {
                engine_block_ids: change.evicted,
            })));
        }
        for run in change.stored {
            let blocks = run
                .blocks
                .iter()
                .map(|&(hash_id, engine_id)| StoredBlock {
                    engine_block_id: engine_id,
                    token_hash: block_token_hash(hash_id, self.block_size, self.seed),
                })
                .collect();
            events.push(self.event(EventPayload::Stored(StoredBlocks {
                parent_engine_block_id: run.parent_engine_id,
                blocks,
            })));
        }
        (events, evicted_hash_ids)
    }

    fn event(&mut self, payload: EventPayload) -> RouterEvent {
        let event = RouterEvent {
            source: self.source,
            event_id: self.next_event_id,
            payload,
        };
        self.next_event_id += 1;
        event
    }

    /// Marks `hash_id` used; returns its engine id when cached.
    fn touch(&mut self, hash_id: u64) -> Option<u64> {
        let tick = self.next_tick();
        let entry = self.blocks.get_mut(&hash_id)?;
        self.by_tick.remove(&entry.1);
        entry.1 = tick;
        self.by_tick.insert(tick, hash_id);
        Some(entry.0)
    }

    fn insert(&mut self, hash_id: u64, engine_id: u64) {
        let tick = self.next_tick();
        self.blocks.insert(hash_id, (engine_id, tick));
        self.by_tick.insert(tick, hash_id);
    }

    /// Evicts the least recently used block last used before `tick`: its hash id and
    /// engine id.
    fn evict_before(&mut self, tick: u64) -> Option<(u64, u64)> {
        let (&oldest, &hash_id) = self.by_tick.iter().next()?;
        if oldest > tick {
            return None;
        }
        self.by_tick.remove(&oldest);
        self.blocks
            .remove(&hash_id)
            .map(|(engine_id, _)| (hash_id, engine_id))
    }

    /// The engine id this cache gives trace block `hash_id` (whether cached or not).
    pub fn engine_id(&self, hash_id: u64) -> u64 {
        engine_block_id(self.source, hash_id, self.seed)
    }

    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }
}

/// A worker's engine block id for trace block `hash_id` (vLLM's ids differ per worker),
/// below 2^63 like vLLM's non-negative integer hashes.
fn engine_block_id(source: SourceId, hash_id: u64, seed: u64) -> u64 {
    let material = [source.worker_id.to_le_bytes(), hash_id.to_le_bytes()].concat();
    xxh3_64_with_seed(&material, seed ^ 0x656e_6769_6e65) >> 1
}
