//! Criterion benchmarks of the ckf core, each against a same-run baseline:
//!
//! - `ckf_apply`: steady-state event application (store a 64-block sequence as 8-block
//!   events, evict the oldest) into a filter sized for 1M blocks at ~50 % load, with a
//!   delta taken every 16 events, vs a bare hashbrown refcount map fed the same stream;
//! - `ckf_query`: 64-block prefix queries over 16 pools (bucket-major query table) vs the
//!   exact per-pool index behind the same trait, and the memory floor (as many independent
//!   random row-pair loads as the filter probes, no hashing, no search);
//! - `ckf_joint`: the same 16 pools split over 4 dense tables of different sizes, searched
//!   jointly (`joint_prefix_depths_into`, one search over every table) vs one table after
//!   another;
//! - `ckf_stats`: reading a 2^24-bucket filter's statistics (occupied slots, load factor,
//!   resident and owned blocks, counters) as the pool actor does after every command, vs
//!   the table scan that used to count occupied slots.
//!
//! p50/p99 latencies, a paired apply ratio (alternating turns), memory and accuracy figures come
//! from `examples/ckf_figures.rs`, which `cargo xtask bench` runs after criterion.

#![allow(clippy::unwrap_used, reason = "benchmark setup fails loudly")]
#![allow(missing_docs, reason = "criterion macros generate undocumented items")]

mod workload;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_ckf::{JointDepths, PrefixDepths, PrefixQuery, QueryTable, joint_prefix_depths_into};
use workload::{
    ApplySetup, ChainWorkload, QUERY_REQUESTS, QuerySetup, SEQUENCE_BLOCKS, STEPS_PER_BATCH,
    apply_batch, apply_refcount, block_ops, joint_setup, query_setup,
};

fn apply(c: &mut Criterion) {
    let mut group = c.benchmark_group("ckf_apply");
    let probe = ChainWorkload::new(7, 16, SEQUENCE_BLOCKS).steady(STEPS_PER_BATCH);
    group.throughput(Throughput::Elements(block_ops(&probe)));
    let ApplySetup {
        mut filter,
        mut filter_stream,
        mut refcounts,
        mut refcount_stream,
    } = ApplySetup::new();
    group.bench_function("filter", |b| {
        b.iter_batched(
            || filter_stream.steady(STEPS_PER_BATCH),
            |events| apply_batch(&mut filter, &events),
            BatchSize::SmallInput,
        )
    });
    group.bench_function("baseline-refcount-map", |b| {
        b.iter_batched(
            || refcount_stream.steady(STEPS_PER_BATCH),
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

fn joint(c: &mut Criterion) {
    let mut group = c.benchmark_group("ckf_joint");
    group.throughput(Throughput::Elements(QUERY_REQUESTS as u64));
    let (work, tables) = joint_setup(11);
    let tables: Vec<&QueryTable> = tables.iter().collect();
    let mut joint = JointDepths::default();
    group.bench_function("joint-4-tables", |b| {
        b.iter(|| {
            for request in &work.requests {
                joint_prefix_depths_into(&tables, request, &mut joint);
                std::hint::black_box(joint.n_probes());
            }
        })
    });
    let mut out = PrefixDepths::default();
    group.bench_function("baseline-one-table-after-another", |b| {
        b.iter(|| {
            for request in &work.requests {
                for table in &tables {
                    table.prefix_depths_into(request, &mut out);
                    std::hint::black_box(out.depths());
                }
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

fn stats(c: &mut Criterion) {
    use kvrelay_ckf::{CkfConfig, EventPayload, PoolFilter, RouterEvent, SourceId, StoredBlocks};
    let mut group = c.benchmark_group("ckf_stats");
    // 2^25 expected blocks size the largest v1 table: 2^24 buckets (128 MiB).
    let mut filter = PoolFilter::new(CkfConfig::new(1 << 25)).unwrap();
    assert_eq!(filter.format().bucket_count(), 1 << 24);
    let token_hashes = (1..=4096u64).map(|id| id.wrapping_mul(0x9E37_79B9_7F4A_7C15));
    filter
        .apply(&RouterEvent {
            source: SourceId::new(1, 0),
            event_id: 1,
            payload: EventPayload::Stored(StoredBlocks::new_chain(1, token_hashes)),
        })
        .unwrap();
    group.bench_function("incremental", |b| {
        b.iter(|| {
            let counters = filter.counters();
            (
                filter.occupied_slots(),
                filter.load_factor(),
                filter.n_resident(),
                filter.n_canonicals(),
                counters.capacity_omissions,
            )
        })
    });
    group.bench_function("baseline-table-scan", |b| {
        b.iter(|| filter.count_occupied_slots())
    });
    group.finish();
}

criterion_group!(benches, apply, query, joint, stats);
criterion_main!(benches);
