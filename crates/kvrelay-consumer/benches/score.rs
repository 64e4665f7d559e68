//! `score` latency for a 64-block request over 16, 64 and 256 pools, against an exact
//! index (hash the request, then an exact per-pool prefix scan) fed the same blocks and
//! the bare ckf `QueryTable`. `consumer` allocates a fresh ranking per call;
//! `consumer-score-into` refills one; `consumer-top-8` keeps the best 8.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "benchmark setup"
)]
#![allow(missing_docs, reason = "criterion macros generate undocumented items")]

#[path = "../tests/support/mod.rs"]
mod support;

use std::hint::black_box;
use std::time::Instant;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_ckf::{ExactIndex, PrefixDepths, PrefixQuery, QueryConfig, QueryTable};
use kvrelay_consumer::{ConsumerConfig, ConsumerState, RelayEndpoint, ScoreRequest};
use kvrelay_identity::KvQueryHashFormat;
use kvrelay_identity::hashing::{HashSalt, block_hashes, sequence_hashes};
use support::{PoolSpec, Producer, catalog_of, relay_identity};

const BLOCK: u32 = 16;
const REQUEST_BLOCKS: u32 = 64;

/// Deterministic xorshift.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

fn family_tokens(family: u32, n_blocks: u32) -> Vec<u32> {
    (0..n_blocks * BLOCK)
        .map(|i| family * 1_000_000 + i)
        .collect()
}

struct Setup {
    state: ConsumerState,
    exact: ExactIndex,
    table: QueryTable,
    request: ScoreRequest,
}

fn setup(n_pools: usize) -> Setup {
    let relay = relay_identity(1);
    let config = ConsumerConfig::new(vec![RelayEndpoint::new("127.0.0.1:7400", "dc-a")]);
    let mut state = ConsumerState::new(&config).unwrap();
    let mut producers: Vec<Producer> = (0..n_pools)
        .map(|i| {
            let name: &'static str = Box::leak(format!("pool{i}").into_boxed_str());
            let mut spec = PoolSpec::aggregated(name, "llama");
            spec.block_size = BLOCK;
            spec.expected_blocks = 4096;
            Producer::new(&spec, "dc-a", relay, 1)
        })
        .collect();
    let mut exact = ExactIndex::new();
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    // ~1,500 resident blocks per pool (~40% filter load): the request's family at a depth
    // that varies by pool, plus unrelated chains.
    for (idx, producer) in producers.iter_mut().enumerate() {
        let pool = exact.add_pool();
        let depth = (idx as u32 * 7) % (REQUEST_BLOCKS + 1);
        let mut chains = vec![family_tokens(1, depth)];
        for _ in 0..24 {
            let family = 2 + (rng.next() % 10_000) as u32;
            chains.push(family_tokens(family, 64));
        }
        for (worker, tokens) in chains.iter().enumerate() {
            let (hashes, _) = producer.store(worker as u64 % 4, tokens, HashSalt::default());
            for hash in hashes {
                exact.insert(pool, hash);
            }
        }
    }
    let mut table = QueryTable::new(producers[0].filter.format(), QueryConfig::default()).unwrap();
    for producer in &mut producers {
        let lane = table.add_lane().unwrap();
        let chunk = kvrelay_ckf::SnapshotChunk {
            sequence: producer.filter.sequence(),
            bucket_count: producer.filter.words().len() as u64,
            chunk_index: 0,
            chunk_count: 1,
            first_bucket: 0,
            words: producer.filter.words().to_vec(),
        };
        table.install_chunk(lane, &chunk).unwrap();
    }
    let refs: Vec<&Producer> = producers.iter().collect();
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &refs))
        .unwrap();
    let now = Instant::now();
    for (key, producer_id) in change.added {
        let producer = producers
            .iter_mut()
            .find(|p| p.descriptor.producer == producer_id)
            .unwrap();
        state.begin_subscription(key).unwrap();
        for frame in producer.snapshot_frames() {
            state.apply_pool_frame(key, &frame, now).unwrap();
        }
    }
    Setup {
        state,
        exact,
        table,
        request: ScoreRequest {
            tokens: family_tokens(1, REQUEST_BLOCKS),
            model: "llama".into(),
            ..ScoreRequest::default()
        },
    }
}

fn bench_score(c: &mut Criterion) {
    for n_pools in [16usize, 64, 256] {
        let setup = setup(n_pools);
        let mut group = c.benchmark_group(format!("score-{n_pools}-pools"));
        group.throughput(Throughput::Elements(n_pools as u64));
        let now = Instant::now();
        let ranking = setup.state.score(&setup.request, now).unwrap();
        assert_eq!(ranking.candidates.len(), n_pools);
        assert!(
            ranking
                .candidates
                .iter()
                .all(|c| c.legs[0].prefix_blocks.is_some())
        );
        group.bench_function("consumer", |b| {
            b.iter(|| black_box(setup.state.score(black_box(&setup.request), now).unwrap()));
        });
        let mut reused = kvrelay_consumer::Ranking::default();
        group.bench_function("consumer-score-into", |b| {
            b.iter(|| {
                setup
                    .state
                    .score_into(black_box(&setup.request), now, &mut reused)
                    .unwrap();
                black_box(reused.candidates.len())
            });
        });
        group.bench_function("consumer-top-8", |b| {
            b.iter(|| {
                setup
                    .state
                    .score_top_into(black_box(&setup.request), now, 8, &mut reused)
                    .unwrap();
                black_box(reused.candidates.len())
            });
        });
        let mut depths = PrefixDepths::default();
        group.bench_function("ckf-query-table-only", |b| {
            b.iter(|| {
                let hashes = sequence_hashes(&block_hashes(
                    black_box(&setup.request.tokens),
                    BLOCK,
                    KvQueryHashFormat::DynamoStandardV1,
                    HashSalt::default(),
                ));
                setup.table.prefix_depths_into(&hashes, &mut depths);
                black_box(depths.depths().len())
            });
        });
        group.bench_function("baseline-exact-index", |b| {
            b.iter(|| {
                let hashes = sequence_hashes(&block_hashes(
                    black_box(&setup.request.tokens),
                    BLOCK,
                    KvQueryHashFormat::DynamoStandardV1,
                    HashSalt::default(),
                ));
                setup.exact.prefix_depths_into(&hashes, &mut depths);
                black_box(depths.depths().len())
            });
        });
        group.finish();
    }
}

criterion_group!(
    name = benches;
    config = Criterion::default();
    targets = bench_score
);
criterion_main!(benches);
