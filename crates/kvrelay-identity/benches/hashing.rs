//! Block hashing throughput (tokens/s) against bare XXH3-64 over the same pre-encoded
//! token bytes, one hash call per block in both cases.
//!
//! Groups: `block_hashing_bs<N>/standard` (and `/eagle` for N = 16) versus
//! `block_hashing_bs<N>/baseline-xxh3`; the ratio baseline time / our time is the
//! efficiency (target ≥ 0.8).

#![allow(
    missing_docs,
    reason = "criterion_group! generates an undocumented function"
)]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_identity::KvQueryHashFormat;
use kvrelay_identity::hashing::{HashSalt, block_hashes};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Tokens per measured sequence.
const N_TOKENS: usize = 8192;

/// Deterministic token ids from a fixed-seed LCG, below a 200k vocabulary.
fn seeded_tokens(n_tokens: usize) -> Vec<u32> {
    let mut state: u64 = 0x0123_4567_89ab_cdef;
    (0..n_tokens)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 33) % 200_000) as u32
        })
        .collect()
}

fn encode(tokens: &[u32]) -> Vec<u8> {
    tokens
        .iter()
        .flat_map(|token| token.to_le_bytes())
        .collect()
}

fn bench_block_size(c: &mut Criterion, block_size: u32, with_eagle: bool) {
    let tokens = seeded_tokens(N_TOKENS);
    let bytes = encode(&tokens);
    let salt = HashSalt {
        lora_name: Some("adapter-a"),
        cache_namespace: Some("tenant-ns"),
    };
    let seed = salt.seed();
    let block_bytes = block_size as usize * 4;

    let mut group = c.benchmark_group(format!("block_hashing_bs{block_size}"));
    group.throughput(Throughput::Elements(N_TOKENS as u64));
    group.bench_function("standard", |b| {
        b.iter(|| {
            block_hashes(
                black_box(&tokens),
                block_size,
                KvQueryHashFormat::DynamoStandardV1,
                salt,
            )
        });
    });
    if with_eagle {
        group.bench_function("eagle", |b| {
            b.iter(|| {
                block_hashes(
                    black_box(&tokens),
                    block_size,
                    KvQueryHashFormat::DynamoEagleV1,
                    salt,
                )
            });
        });
    }
    group.bench_function("baseline-xxh3", |b| {
        b.iter(|| {
            black_box(&bytes)
                .chunks_exact(block_bytes)
                .map(|chunk| xxh3_64_with_seed(chunk, seed))
                .collect::<Vec<u64>>()
        });
    });
    group.finish();
}

fn block_hashing(c: &mut Criterion) {
    bench_block_size(c, 16, true);
    bench_block_size(c, 64, false);
}

criterion_group!(benches, block_hashing);
criterion_main!(benches);
