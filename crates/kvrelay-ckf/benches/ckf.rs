//! Criterion benchmarks of the ckf core, each against a same-run baseline:
//!
//! - `ckf_apply`: steady-state event application (store a 64-block sequence as 8-block
//!   events, evict the oldest) into a filter sized for 1M blocks at ~50 % load, with a
//!   delta taken every 16 events, vs a bare hashbrown refcount map fed the same stream;
//! - `ckf_query`: 64-block prefix queries over 16 pools (bucket-major query table) vs the
//!   exact per-pool index behind the same trait, and the memory floor (as many independent
//!   random row-pair loads as the filter probes, no hashing, no search).
//!
//! p50/p99 latencies, memory and accuracy figures come from `examples/ckf_figures.rs`.

#![allow(clippy::unwrap_used, reason = "benchmark setup fails loudly")]
#![allow(missing_docs, reason = "criterion macros generate undocumented items")]

mod workload;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_ckf::{CkfConfig, EventPayload, PoolFilter, PrefixDepths, PrefixQuery, RouterEvent};
use workload::{ChainWorkload, QUERY_REQUESTS, QuerySetup, block_ops, query_setup};

/// Filter capacity of the apply benchmark.
const APPLY_CAPACITY: u64 = 1 << 20;
/// Blocks per stored sequence.
const SEQUENCE_BLOCKS: usize = 64;
/// Live sequences (≈ 1M live blocks, ≈ 50 % load).
const LIVE_SEQUENCES: usize = (APPLY_CAPACITY as usize) / SEQUENCE_BLOCKS;
/// Steady-state steps per measured batch.
const STEPS_PER_BATCH: usize = 32;
/// Events between deltas (the relay's default cadence).
const EVENTS_PER_DELTA: usize = 16;

fn apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("ckf_apply");
    let probe = ChainWorkload::new(7, 16, SEQUENCE_BLOCKS).steady(STEPS_PER_BATCH);
    group.throughput(Throughput::Elements(block_ops(&probe)));

    let mut stream = ChainWorkload::new(7, 16, SEQUENCE_BLOCKS);
    let mut filter = PoolFilter::new(CkfConfig::new(APPLY_CAPACITY)).unwrap();
    for event in stream.fill(LIVE_SEQUENCES) {
        filter.apply(&event).unwrap();
    }
    filter.take_delta().unwrap();
    group.bench_function("filter", |b| {
        b.iter_batched(
            || stream.steady(STEPS_PER_BATCH),
            |events| {
                for (i, event) in events.iter().enumerate() {
                    filter.apply(event).unwrap();
                    if i % EVENTS_PER_DELTA == EVENTS_PER_DELTA - 1 {
                        std::hint::black_box(filter.take_delta().unwrap());
                    }
                }
            },
            BatchSize::SmallInput,
        )
    });

    let mut stream = ChainWorkload::new(7, 16, SEQUENCE_BLOCKS);
    let mut refcounts: hashbrown::HashMap<u64, u32> = hashbrown::HashMap::new();
    for event in stream.fill(LIVE_SEQUENCES) {
        apply_refcount(&mut refcounts, &event);
    }
    group.bench_function("baseline-refcount-map", |b| {
        b.iter_batched(
            || stream.steady(STEPS_PER_BATCH),
            |events| {
                for event in &events {
                    apply_refcount(&mut refcounts, event);
                }
            },
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

/// The bare baseline: a refcount per engine block id.
fn apply_refcount(map: &mut hashbrown::HashMap<u64, u32>, event: &RouterEvent) {
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

fn query(c: &mut Criterion) {
    let mut group = c.benchmark_group("ckf_query");
    group.throughput(Throughput::Elements(QUERY_REQUESTS as u64));
    let QuerySetup {
        work, table, exact, ..
    } = query_setup(11);
    let mut out = PrefixDepths::default();
    group.bench_function("filter-16-pools", |b| {
        b.iter(|| {
            for request in &work.requests {
                table.prefix_depths_into(request, &mut out);
                std::hint::black_box(out.depths());
            }
        })
    });
    group.bench_function("baseline-exact-index", |b| {
        b.iter(|| {
            for request in &work.requests {
                exact.prefix_depths_into(request, &mut out);
                std::hint::black_box(out.depths());
            }
        })
    });
    // The memory floor: per request, as many independent random row-pair loads (two
    // 16-lane rows of 128 bytes, line-aligned) as the filter probes, from a table of the
    // same size; no hashing and no search logic.
    let n_probes: u64 = work
        .requests
        .iter()
        .map(|request| {
            table.prefix_depths_into(request, &mut out);
            u64::from(out.n_probes())
        })
        .sum();
    let probes_per_query = n_probes.div_ceil(QUERY_REQUESTS as u64) as usize;
    let floor = RowLoads::new(table.table_bytes() as usize / 8, 16);
    let mut rng = workload::Rng::new(5);
    let rows: Vec<Vec<(usize, usize)>> = work
        .requests
        .iter()
        .map(|_| {
            (0..probes_per_query)
                .map(|_| (floor.random_row(&mut rng), floor.random_row(&mut rng)))
                .collect()
        })
        .collect();
    group.bench_function("baseline-row-loads", |b| {
        b.iter(|| {
            for request_rows in &rows {
                std::hint::black_box(floor.load(request_rows));
            }
        })
    });
    group.finish();
}

/// A line-aligned table of rows for the memory-floor baseline.
struct RowLoads {
    words: Vec<u64>,
    offset: usize,
    stride: usize,
    n_rows: usize,
}

impl RowLoads {
    fn new(n_words: usize, stride: usize) -> Self {
        let words: Vec<u64> = (0..n_words as u64 + 7).collect();
        let offset = (8 - (words.as_ptr() as usize / 8) % 8) % 8;
        Self {
            n_rows: n_words / stride,
            words,
            offset,
            stride,
        }
    }

    fn random_row(&self, rng: &mut workload::Rng) -> usize {
        self.offset + rng.below(self.n_rows as u64) as usize * self.stride
    }

    /// Reads every word of each row pair (all loads independent).
    fn load(&self, rows: &[(usize, usize)]) -> u64 {
        let mut sink = 0u64;
        for &(a, b) in rows {
            for lane in 0..self.stride {
                sink = sink.wrapping_add(self.words[a + lane] ^ self.words[b + lane]);
            }
        }
        sink
    }
}

criterion_group!(benches, apply, query);
criterion_main!(benches);
