//! The generated fleet: the trace template, tenants, each DC's cache and filter, the exact
//! index and the requests (see the binary's docs).

use std::hash::{BuildHasherDefault, Hasher};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvrelay_ckf::{
    BucketImage, EventPayload, PoolFilter, RouterEvent, SourceId, StoredBlock, StoredBlocks,
};
use kvrelay_identity::hashing::sequence_hashes;
use serde_json::Value;

/// Tenants the Zipf popularity is drawn over.
pub(crate) const TENANTS: u64 = 4096;

/// Keys are uniform 64-bit hashes: the exact map uses them as their own hash.
#[derive(Default)]
pub(crate) struct PassThrough(u64);

impl Hasher for PassThrough {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 << 8) | u64::from(byte);
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

pub(crate) type ExactMap = hashbrown::HashMap<u64, u64, BuildHasherDefault<PassThrough>>;

pub(crate) fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Deterministic xorshift.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub(crate) fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Zipf(s = 1) over `0..n` by inverse CDF on the harmonic numbers.
pub(crate) struct Zipf {
    cumulative: Vec<f64>,
}

impl Zipf {
    pub(crate) fn new(n: u64) -> Self {
        let mut total = 0.0;
        let cumulative = (1..=n)
            .map(|rank| {
                total += 1.0 / rank as f64;
                total
            })
            .collect();
        Self { cumulative }
    }
    pub(crate) fn sample(&self, rng: &mut Rng) -> u64 {
        let total = self.cumulative.last().copied().unwrap_or(1.0);
        let target = rng.unit() * total;
        self.cumulative.partition_point(|&c| c < target) as u64
    }
}

pub(crate) fn token(tenant: u64, block: u32) -> u64 {
    splitmix((tenant << 32) ^ u64::from(block) ^ 0x6b76_7265_6c61_7900)
}

/// The template: every trace request's prefix chain of block ids.
pub(crate) fn load_trace(path: &PathBuf) -> Result<Vec<Vec<u32>>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let mut chains = Vec::new();
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        let value: Value = serde_json::from_str(line).context("a trace line")?;
        let ids = value["hash_ids"]
            .as_array()
            .context("a trace line without hash_ids")?
            .iter()
            .map(|id| id.as_u64().and_then(|id| u32::try_from(id).ok()))
            .collect::<Option<Vec<u32>>>()
            .context("a hash id that is not a u32")?;
        if !ids.is_empty() {
            chains.push(ids);
        }
    }
    if chains.is_empty() {
        bail!("the trace {} has no requests", path.display());
    }
    Ok(chains)
}

/// One DC's cache: the tenants it holds and its filter's words.
pub(crate) struct BuiltDc {
    pub(crate) tenants: Vec<u64>,
    pub(crate) resident: u64,
    /// Deltas that rewrite buckets with their own words (the table stays exact), for the
    /// applying phase.
    pub(crate) rewrites: Vec<Vec<BucketImage>>,
    /// Time spent in `PoolFilter::apply` and the blocks it stored.
    pub(crate) apply_time: Duration,
    pub(crate) blocks_applied: u64,
}

/// Images per applied delta, and distinct deltas kept per DC.
pub(crate) const DELTA_IMAGES: usize = 64;
pub(crate) const DELTAS_PER_DC: usize = 64;

/// Deltas of up to `DELTA_IMAGES` distinct buckets each, sorted, carrying the words they
/// have.
pub(crate) fn rewrites(words: &[u64], rng: &mut Rng) -> Vec<Vec<BucketImage>> {
    (0..DELTAS_PER_DC)
        .map(|_| {
            let mut buckets: Vec<u32> = (0..DELTA_IMAGES)
                .map(|_| rng.below(words.len() as u64) as u32)
                .collect();
            buckets.sort_unstable();
            buckets.dedup();
            buckets
                .into_iter()
                .map(|bucket_idx| BucketImage {
                    bucket_idx,
                    word: words[bucket_idx as usize],
                })
                .collect()
        })
        .collect()
}

/// Builds DC `dc`: fills `filter` and marks its blocks in `exact`. `after_apply` runs
/// after each event the filter applied, outside the apply time (a format twin's feed).
pub(crate) fn build_dc(
    dc: usize,
    template: &[Vec<u32>],
    zipf: &Zipf,
    target: u64,
    filter: &mut PoolFilter,
    exact: &mut ExactMap,
    after_apply: &mut dyn FnMut(&mut PoolFilter, &RouterEvent) -> Result<()>,
) -> Result<BuiltDc> {
    let mut rng = Rng(splitmix(dc as u64 + 1));
    let bit = 1u64 << dc;
    // Sequence hash → the engine block id it was stored under (for parenting).
    let mut stored: std::collections::HashMap<u64, u64, BuildHasherDefault<PassThrough>> =
        Default::default();
    let mut tenants = Vec::new();
    let mut next_engine_id = 1u64;
    let mut event_id = 0u64;
    let source = SourceId::new(dc as u64 + 1, 0);
    let mut attempts = 0u32;
    let mut apply_time = Duration::ZERO;
    while (stored.len() as u64) < target {
        attempts += 1;
        if attempts > 1_000_000 {
            bail!("DC {dc}: could not reach {target} blocks from {TENANTS} tenants");
        }
        let tenant = zipf.sample(&mut rng);
        if tenants.contains(&tenant) {
            continue;
        }
        tenants.push(tenant);
        for chain in template {
            if rng.next() & 1 == 0 {
                continue;
            }
            let tokens: Vec<u64> = chain.iter().map(|&block| token(tenant, block)).collect();
            let hashes = sequence_hashes(&tokens);
            let present = hashes
                .iter()
                .take_while(|hash| stored.contains_key(*hash))
                .count();
            if present == hashes.len() {
                continue;
            }
            let parent = present
                .checked_sub(1)
                .and_then(|last| stored.get(&hashes[last]).copied());
            let mut blocks = Vec::with_capacity(hashes.len() - present);
            for (hash, token_hash) in hashes[present..].iter().zip(&tokens[present..]) {
                // What is stored is prefix-closed, so the whole suffix is new.
                stored.insert(*hash, next_engine_id);
                blocks.push(StoredBlock {
                    engine_block_id: next_engine_id,
                    token_hash: *token_hash,
                });
                next_engine_id += 1;
                *exact.entry(*hash).or_insert(0) |= bit;
            }
            event_id += 1;
            let event = RouterEvent {
                source,
                event_id,
                payload: EventPayload::Stored(StoredBlocks {
                    parent_engine_block_id: parent,
                    blocks,
                }),
            };
            let applying = Instant::now();
            filter
                .apply(&event)
                .map_err(|err| anyhow::anyhow!("DC {dc}: the filter refused a store: {err}"))?;
            apply_time += applying.elapsed();
            after_apply(filter, &event)?;
            if stored.len() as u64 >= target {
                break;
            }
        }
    }
    // The producer's canonical hashes are the query's sequence hashes.
    for hash in stored.keys().take(1000) {
        if !filter.contains(*hash) {
            bail!("DC {dc}: a stored block is not in the filter");
        }
    }
    Ok(BuiltDc {
        tenants,
        resident: filter.n_resident(),
        rewrites: rewrites(filter.words(), &mut rng),
        apply_time,
        blocks_applied: next_engine_id - 1,
    })
}

pub(crate) fn exact_depths(exact: &ExactMap, hashes: &[u64], n_dcs: usize, out: &mut [u32]) {
    let all = if n_dcs == 64 {
        u64::MAX
    } else {
        (1u64 << n_dcs) - 1
    };
    let mut alive = all;
    for (position, hash) in hashes.iter().enumerate() {
        let mask = exact.get(hash).copied().unwrap_or(0);
        let mut dying = alive & !mask;
        while dying != 0 {
            let dc = dying.trailing_zeros() as usize;
            out[dc] = position as u32;
            dying &= dying - 1;
        }
        alive &= mask;
        if alive == 0 {
            return;
        }
    }
    while alive != 0 {
        let dc = alive.trailing_zeros() as usize;
        out[dc] = hashes.len() as u32;
        alive &= alive - 1;
    }
}

pub(crate) fn requests(
    template: &[Vec<u32>],
    dcs: &[BuiltDc],
    n: usize,
    rng: &mut Rng,
) -> Vec<Vec<u64>> {
    (0..n)
        .map(|idx| {
            let mut tokens: Vec<u64> = if idx % 10 == 9 {
                let len = template[rng.below(template.len() as u64) as usize].len();
                (0..len).map(|_| rng.next()).collect()
            } else {
                let dc = &dcs[rng.below(dcs.len() as u64) as usize];
                let tenant = dc.tenants[rng.below(dc.tenants.len() as u64) as usize];
                let chain = &template[rng.below(template.len() as u64) as usize];
                chain.iter().map(|&block| token(tenant, block)).collect()
            };
            for _ in 0..rng.below(4) {
                tokens.push(rng.next());
            }
            sequence_hashes(&tokens)
        })
        .collect()
}

/// Runs every request through `exact` then `ours`, five rounds alternating (so both see the
/// same machine state), and returns the median time of each. Each closure returns one
/// depth, folded into a sink so the work is not optimised away.
pub(crate) fn paired_medians(
    requests: &[Vec<u64>],
    mut exact: impl FnMut(&[u64]) -> u32,
    mut ours: impl FnMut(&[u64]) -> u32,
) -> (Duration, Duration) {
    const ROUNDS: usize = 5;
    let (mut exact_times, mut our_times) = (Vec::new(), Vec::new());
    let mut sink = 0u64;
    for _ in 0..ROUNDS {
        let t = Instant::now();
        for hashes in requests {
            sink = sink.wrapping_add(u64::from(exact(hashes)));
        }
        exact_times.push(t.elapsed());
        let t = Instant::now();
        for hashes in requests {
            sink = sink.wrapping_add(u64::from(ours(hashes)));
        }
        our_times.push(t.elapsed());
    }
    std::hint::black_box(sink);
    exact_times.sort_unstable();
    our_times.sort_unstable();
    (exact_times[ROUNDS / 2], our_times[ROUNDS / 2])
}
