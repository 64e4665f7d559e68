//! Seeded synthetic workloads shared by the ckf benchmark and the figures example:
//! realistic chained sequences with shared prompt prefixes, stored in 8-block events and
//! evicted oldest-first, plus multi-pool prefix-query requests with known exact depths.

#![allow(dead_code, reason = "each includer uses a different subset")]

use std::collections::VecDeque;

use kvrelay_ckf::{
    CkfConfig, EventPayload, ExactIndex, PoolFilter, QueryConfig, QueryTable, RemovedBlocks,
    RouterEvent, SourceId, StoredBlock, StoredBlocks,
};
use kvrelay_identity::hashing::sequence_hashes;

/// Filter capacity of the apply benchmark.
pub(crate) const APPLY_CAPACITY: u64 = 1 << 20;
/// Blocks per stored sequence.
pub(crate) const SEQUENCE_BLOCKS: usize = 64;
/// Live sequences (≈ 1M live blocks, ≈ 50 % load).
pub(crate) const LIVE_SEQUENCES: usize = (APPLY_CAPACITY as usize) / SEQUENCE_BLOCKS;
/// Steady-state steps per measured batch.
pub(crate) const STEPS_PER_BATCH: usize = 32;
/// Events between deltas (the relay's default cadence).
pub(crate) const EVENTS_PER_DELTA: usize = 16;

/// Blocks per stored event.
pub(crate) const BLOCKS_PER_EVENT: usize = 8;

/// Distinct shared prompt prefixes (their first blocks are shared across sources).
const N_PROMPTS: u64 = 64;

/// Leading blocks of a sequence taken from its shared prompt.
const PROMPT_BLOCKS: usize = 2;

/// SplitMix64: a tiny deterministic generator.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A steady stream of sequence stores and evictions over several sources.
#[derive(Debug, Clone)]
pub(crate) struct ChainWorkload {
    rng: Rng,
    sources: Vec<SourceId>,
    blocks_per_sequence: usize,
    next_engine_block_id: u64,
    live: VecDeque<(SourceId, Vec<u64>)>,
}

impl ChainWorkload {
    pub(crate) fn new(seed: u64, n_sources: u64, blocks_per_sequence: usize) -> Self {
        Self {
            rng: Rng::new(seed),
            sources: (0..n_sources)
                .map(|w| SourceId::new(w / 2, (w % 2) as u32))
                .collect(),
            blocks_per_sequence,
            next_engine_block_id: 1,
            live: VecDeque::new(),
        }
    }

    /// Token hashes of one new sequence: a shared prompt prefix, then unique blocks.
    pub(crate) fn token_hashes(&mut self) -> Vec<u64> {
        let prompt = self.rng.below(N_PROMPTS);
        (0..self.blocks_per_sequence)
            .map(|i| {
                if i < PROMPT_BLOCKS {
                    prompt * 1000 + i as u64
                } else {
                    self.rng.next_u64()
                }
            })
            .collect()
    }

    /// Stores one new sequence from a random source (as 8-block events), appending them.
    pub(crate) fn store_sequence(&mut self, out: &mut Vec<RouterEvent>) {
        let source = self.sources[self.rng.below(self.sources.len() as u64) as usize];
        let token_hashes = self.token_hashes();
        let mut ids = Vec::with_capacity(token_hashes.len());
        let mut parent = None;
        for chunk in token_hashes.chunks(BLOCKS_PER_EVENT) {
            let blocks: Vec<StoredBlock> = chunk
                .iter()
                .map(|&token_hash| {
                    let engine_block_id = self.next_engine_block_id;
                    self.next_engine_block_id += 1;
                    ids.push(engine_block_id);
                    StoredBlock {
                        engine_block_id,
                        token_hash,
                    }
                })
                .collect();
            let last = blocks.last().map(|b| b.engine_block_id);
            out.push(RouterEvent {
                source,
                event_id: 0,
                payload: EventPayload::Stored(StoredBlocks {
                    parent_engine_block_id: parent,
                    blocks,
                }),
            });
            parent = last;
        }
        self.live.push_back((source, ids));
    }

    /// Evicts the oldest live sequence (one removal event), if any.
    pub(crate) fn evict_oldest(&mut self, out: &mut Vec<RouterEvent>) {
        if let Some((source, ids)) = self.live.pop_front() {
            out.push(RouterEvent {
                source,
                event_id: 0,
                payload: EventPayload::Removed(RemovedBlocks {
                    engine_block_ids: ids,
                }),
            });
        }
    }

    /// `n` steady-state steps: store one sequence, evict the oldest.
    pub(crate) fn steady(&mut self, n: usize) -> Vec<RouterEvent> {
        let mut out = Vec::with_capacity(n * (self.blocks_per_sequence / BLOCKS_PER_EVENT + 2));
        for _ in 0..n {
            self.store_sequence(&mut out);
            self.evict_oldest(&mut out);
        }
        out
    }

    /// Events that fill the filter with `n` sequences.
    pub(crate) fn fill(&mut self, n: usize) -> Vec<RouterEvent> {
        let mut out = Vec::new();
        for _ in 0..n {
            self.store_sequence(&mut out);
        }
        out
    }
}

/// Block operations (stored or removed blocks) in `events`.
pub(crate) fn block_ops(events: &[RouterEvent]) -> u64 {
    events
        .iter()
        .map(|e| match &e.payload {
            EventPayload::Stored(s) => s.blocks.len() as u64,
            EventPayload::Removed(r) => r.engine_block_ids.len() as u64,
            EventPayload::AllCleared => 0,
        })
        .sum()
}

/// The bare baseline: a refcount per engine block id.
pub(crate) fn apply_refcount(map: &mut hashbrown::HashMap<u64, u32>, event: &RouterEvent) {
    match &event.payload {
        EventPayload::Stored(stored) => {
            for block in &stored.blocks {
                *map.entry(block.engine_block_id).or_insert(0) += 1;
            }
        }
        EventPayload::Removed(removed) => {
            for id in &removed.engine_block_ids {
                if let Some(count) = map.get_mut(id) {
                    *count -= 1;
                    if *count == 0 {
                        map.remove(id);
                    }
                }
            }
        }
        EventPayload::AllCleared => map.clear(),
    }
}

/// The apply benchmark's two sides in steady state: a filter and the refcount map, each
/// filled with [`LIVE_SEQUENCES`] sequences and fed its own copy of the same stream.
pub(crate) struct ApplySetup {
    pub(crate) filter: PoolFilter,
    pub(crate) filter_stream: ChainWorkload,
    pub(crate) refcounts: hashbrown::HashMap<u64, u32>,
    pub(crate) refcount_stream: ChainWorkload,
}

impl ApplySetup {
    pub(crate) fn new() -> Self {
        let mut filter_stream = ChainWorkload::new(7, 16, SEQUENCE_BLOCKS);
        let mut refcount_stream = filter_stream.clone();
        let mut filter = PoolFilter::new(CkfConfig::new(APPLY_CAPACITY)).unwrap();
        for event in filter_stream.fill(LIVE_SEQUENCES) {
            filter.apply(&event).unwrap();
        }
        filter.take_delta().unwrap();
        let mut refcounts = hashbrown::HashMap::new();
        for event in refcount_stream.fill(LIVE_SEQUENCES) {
            apply_refcount(&mut refcounts, &event);
        }
        Self {
            filter,
            filter_stream,
            refcounts,
            refcount_stream,
        }
    }
}

/// Applies one batch to the filter, taking a delta every [`EVENTS_PER_DELTA`] events.
pub(crate) fn apply_batch(filter: &mut PoolFilter, events: &[RouterEvent]) {
    for (i, event) in events.iter().enumerate() {
        filter.apply(event).unwrap();
        if i % EVENTS_PER_DELTA == EVENTS_PER_DELTA - 1 {
            std::hint::black_box(filter.take_delta().unwrap());
        }
    }
}

/// Prefix-query requests over `n_pools` pools, each with a known exact depth per pool.
pub(crate) struct QueryWorkload {
    /// Per request, its canonical sequence hashes.
    pub(crate) requests: Vec<Vec<u64>>,
    /// Per request and pool, the exact depth.
    pub(crate) depths: Vec<Vec<u32>>,
    /// Per pool, the stored chains (token hashes) including background fill.
    pub(crate) pool_chains: Vec<Vec<Vec<u64>>>,
}

impl QueryWorkload {
    /// `n_requests` requests of `request_blocks` blocks; each pool holds a random prefix of
    /// each request (none half of the time) plus `background_blocks` of unrelated chains.
    pub(crate) fn new(
        seed: u64,
        n_pools: usize,
        n_requests: usize,
        request_blocks: usize,
        background_blocks: usize,
    ) -> Self {
        let mut rng = Rng::new(seed);
        let mut pool_chains = vec![Vec::new(); n_pools];
        let mut requests = Vec::with_capacity(n_requests);
        let mut depths = Vec::with_capacity(n_requests);
        for _ in 0..n_requests {
            let tokens: Vec<u64> = (0..request_blocks).map(|_| rng.next_u64()).collect();
            let mut per_pool = Vec::with_capacity(n_pools);
            for chains in pool_chains.iter_mut() {
                let depth = if rng.below(2) == 0 {
                    0
                } else {
                    1 + rng.below(request_blocks as u64) as usize
                };
                if depth > 0 {
                    chains.push(tokens[..depth].to_vec());
                }
                per_pool.push(depth as u32);
            }
            requests.push(sequence_hashes(&tokens));
            depths.push(per_pool);
        }
        for chains in pool_chains.iter_mut() {
            let mut n = 0;
            while n < background_blocks {
                let chain: Vec<u64> = (0..32).map(|_| rng.next_u64()).collect();
                n += chain.len();
                chains.push(chain);
            }
        }
        Self {
            requests,
            depths,
            pool_chains,
        }
    }

    /// The stored events of one pool's chains (one source, fresh engine ids).
    pub(crate) fn pool_events(&self, pool: usize) -> Vec<RouterEvent> {
        let mut next_id = 1u64;
        self.pool_chains[pool]
            .iter()
            .map(|chain| RouterEvent {
                source: SourceId::new(pool as u64, 0),
                event_id: 0,
                payload: EventPayload::Stored(StoredBlocks {
                    parent_engine_block_id: None,
                    blocks: chain
                        .iter()
                        .map(|&token_hash| {
                            next_id += 1;
                            StoredBlock {
                                engine_block_id: next_id,
                                token_hash,
                            }
                        })
                        .collect(),
                }),
            })
            .collect()
    }
}

/// Pools, requests and per-pool capacity of the query benchmark.
pub(crate) const QUERY_POOLS: usize = 16;
pub(crate) const QUERY_REQUESTS: usize = 1024;
pub(crate) const QUERY_BLOCKS: usize = 64;
pub(crate) const QUERY_CAPACITY: u64 = 1 << 18;

/// The 16-pool query table and the exact index over the same workload.
pub(crate) struct QuerySetup {
    pub(crate) work: QueryWorkload,
    pub(crate) table: QueryTable,
    pub(crate) exact: ExactIndex,
    /// Mean fraction of occupied slots over the pools.
    pub(crate) mean_load: f64,
}

/// Builds the query table (through real producers and snapshots) and the exact index.
pub(crate) fn query_setup(seed: u64) -> QuerySetup {
    query_setup_with_capacity(seed, QUERY_CAPACITY)
}

/// [`query_setup`] with `capacity` expected blocks per pool.
pub(crate) fn query_setup_with_capacity(seed: u64, capacity: u64) -> QuerySetup {
    let background = (capacity as usize).saturating_sub(QUERY_REQUESTS * QUERY_BLOCKS / 4);
    let work = QueryWorkload::new(seed, QUERY_POOLS, QUERY_REQUESTS, QUERY_BLOCKS, background);
    let format = PoolFilter::new(CkfConfig::new(capacity)).unwrap().format();
    let mut table = QueryTable::new(format, QueryConfig::default()).unwrap();
    let mut exact = ExactIndex::new();
    let mut load_sum = 0.0;
    for pool in 0..QUERY_POOLS {
        let filter = install_pool(&work, pool, CkfConfig::new(capacity), &mut table);
        load_sum += filter.occupied_slots() as f64 / (4.0 * f64::from(format.bucket_count()));
        let exact_pool = exact.add_pool();
        for chain in &work.pool_chains[pool] {
            for hash in sequence_hashes(chain) {
                exact.insert(exact_pool, hash);
            }
        }
    }
    QuerySetup {
        work,
        table,
        exact,
        mean_load: load_sum / QUERY_POOLS as f64,
    }
}

/// Tables of the joint-search benchmark: pools of different sizes in dense formats.
pub(crate) const JOINT_TABLES: usize = 4;

/// The query workload's pools split over [`JOINT_TABLES`] dense tables of different
/// bucket counts (pool `p` in table `p % JOINT_TABLES`, sized 1.0, 1.07, 1.15 and 1.25 ×
/// [`QUERY_CAPACITY`]): what a router holds when its DCs' pools differ in size.
pub(crate) fn joint_setup(seed: u64) -> (QueryWorkload, Vec<QueryTable>) {
    let background = (QUERY_CAPACITY as usize).saturating_sub(QUERY_REQUESTS * QUERY_BLOCKS / 4);
    let work = QueryWorkload::new(seed, QUERY_POOLS, QUERY_REQUESTS, QUERY_BLOCKS, background);
    let configs: Vec<CkfConfig> = [100u64, 107, 115, 125]
        .iter()
        .map(|percent| {
            CkfConfig::new(QUERY_CAPACITY * percent / 100)
                .with_density(kvrelay_ckf::FilterDensity::DENSE)
        })
        .collect();
    let mut tables: Vec<QueryTable> = configs
        .iter()
        .map(|config| QueryTable::new(config.format().unwrap(), QueryConfig::default()).unwrap())
        .collect();
    for pool in 0..QUERY_POOLS {
        let table = pool % JOINT_TABLES;
        install_pool(&work, pool, configs[table], &mut tables[table]);
    }
    (work, tables)
}

/// Builds `pool`'s producer filter from the workload's events and installs its snapshot
/// into a new lane of `table`, as a router's replica; returns the filter.
fn install_pool(
    work: &QueryWorkload,
    pool: usize,
    config: CkfConfig,
    table: &mut QueryTable,
) -> PoolFilter {
    let mut filter = PoolFilter::new(config).unwrap();
    for event in work.pool_events(pool) {
        filter.apply(&event).unwrap();
    }
    let lane = table.add_lane().unwrap();
    for chunk in filter.snapshot().unwrap().chunks {
        table.install_chunk(lane, &chunk).unwrap();
    }
    filter
}
