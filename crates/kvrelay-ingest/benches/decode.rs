//! Decode + canonicalize throughput of vLLM KV-event batches (blocks/s), against a bare
//! generic msgpack decode (`rmpv`) of the same bytes in the same run.

#![allow(clippy::unwrap_used, reason = "benchmark setup fails loudly")]
#![allow(missing_docs, reason = "criterion macros generate undocumented items")]

use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use kvrelay_identity::KvQueryHashFormat;
use kvrelay_ingest::{
    BlockRemoved, BlockStored, CanonicalConfig, Canonicalizer, EngineBatch, EngineBlockHash,
    EngineEvent, EngineKind, EngineLayout, Limits, TokenIds, decode_engine_batch,
    encode_engine_batch,
};

const BLOCK_SIZE: u32 = 16;
const EVENTS_PER_BATCH: usize = 32;
const BLOCKS_PER_EVENT: usize = 4;

/// A seeded batch shaped like steady vLLM traffic: mostly stored chains, some removals.
fn batch(seed: u64) -> EngineBatch {
    let mut state = seed;
    let mut next = move || {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        state
    };
    let events = (0..EVENTS_PER_BATCH)
        .map(|event_idx| {
            let hashes: Vec<EngineBlockHash> = (0..BLOCKS_PER_EVENT)
                .map(|_| EngineBlockHash::unsigned(next()))
                .collect();
            if event_idx % 4 == 3 {
                return EngineEvent::BlockRemoved(BlockRemoved {
                    block_hashes: hashes,
                    medium: Some("GPU".to_owned()),
                    group_idx: None,
                });
            }
            let tokens = (0..BLOCKS_PER_EVENT * BLOCK_SIZE as usize)
                .map(|_| (next() % 128_000) as u32)
                .collect();
            EngineEvent::BlockStored(BlockStored {
                medium: Some("GPU".to_owned()),
                ..BlockStored::new(
                    hashes,
                    Some(EngineBlockHash::unsigned(next())),
                    TokenIds::Flat(tokens),
                    BLOCK_SIZE,
                )
            })
        })
        .collect();
    EngineBatch {
        ts: 1.0,
        events,
        dp_rank: Some(0),
    }
}

fn decode_benches(c: &mut Criterion) {
    let config = CanonicalConfig::new(BLOCK_SIZE, KvQueryHashFormat::DynamoStandardV1);
    let limits = Limits::default();
    for (name, map_events) in [("vllm-map", true), ("vllm-array", false)] {
        let layout = EngineLayout {
            engine: EngineKind::Vllm,
            map_events,
            map_batch: false,
        };
        let source = batch(42);
        let mut bytes = Vec::new();
        encode_engine_batch(&source, layout, &mut bytes);
        let n_blocks = source.n_blocks() as u64;
        let mut group = c.benchmark_group(format!("decode-{name}"));
        group.throughput(Throughput::Elements(n_blocks));
        group.bench_function(BenchmarkId::from_parameter("decode+canonicalize"), |b| {
            let mut canonicalizer = Canonicalizer::new(1, 0, config);
            let mut out = Vec::with_capacity(EVENTS_PER_BATCH);
            b.iter(|| {
                out.clear();
                let decoded =
                    decode_engine_batch(black_box(&bytes), EngineKind::Vllm, &limits).unwrap();
                canonicalizer.canonicalize(&decoded, &mut out);
                black_box(out.len())
            });
        });
        group.bench_function(BenchmarkId::from_parameter("decode"), |b| {
            b.iter(|| decode_engine_batch(black_box(&bytes), EngineKind::Vllm, &limits).unwrap());
        });
        group.bench_function(BenchmarkId::from_parameter("baseline-msgpack"), |b| {
            b.iter(|| rmpv::decode::read_value(&mut black_box(bytes.as_slice())).unwrap());
        });
        group.finish();
    }
}

criterion_group!(benches, decode_benches);
criterion_main!(benches);
