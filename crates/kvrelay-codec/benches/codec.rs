//! Codec throughput: CBI1 snapshot chunk encode/decode against a memcpy (and a bare xxh3,
//! the checksum every payload needs, computed like the codec does) of the same bytes,
//! and delta encode/decode for 1, 16 and 1,024 images.

#![allow(
    clippy::expect_used,
    clippy::panic,
    missing_docs,
    reason = "benchmark setup fails loudly"
)]

use std::hint::black_box;

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_ckf::BucketImage;
use kvrelay_codec::cbi1::{self, CHUNK_WORDS, Cbi1Layout, Cbi1Payload};
use twox_hash::XxHash3_64;

/// One full chunk: 512 Ki buckets (4 MiB of words).
const BUCKETS: u64 = CHUNK_WORDS as u64;

fn table(seed: u64) -> Vec<u64> {
    let mut state = seed;
    (0..BUCKETS)
        .map(|_| {
            // splitmix64: seeded, deterministic filler.
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        })
        .collect()
}

fn snapshot_chunk(c: &mut Criterion) {
    let layout = Cbi1Layout::new(7, BUCKETS).expect("valid layout");
    let table = table(1);
    let mut encoded = BytesMut::new();
    cbi1::encode_snapshot_chunk(&layout, 1, 9, &table, 0, &mut encoded).expect("encodes");
    let encoded = encoded.freeze();
    let word_bytes: Vec<u8> = table.iter().flat_map(|w| w.to_le_bytes()).collect();

    let mut group = c.benchmark_group("snapshot_chunk");
    group.throughput(Throughput::Bytes(BUCKETS * 8));
    group.bench_function("encode", |b| {
        let mut dst = BytesMut::with_capacity(encoded.len());
        b.iter(|| {
            dst.clear();
            cbi1::encode_snapshot_chunk(&layout, 1, 9, black_box(&table), 0, &mut dst)
                .expect("encodes");
            black_box(dst.len())
        });
    });
    group.bench_function("decode", |b| {
        let mut words = vec![0u64; BUCKETS as usize];
        b.iter(|| {
            let Ok(Cbi1Payload::Chunk(chunk)) = cbi1::decode_cbi1(black_box(&encoded), &layout)
            else {
                unreachable!("a valid chunk")
            };
            black_box(chunk.copy_words_into(&mut words))
        });
    });
    group.bench_function("baseline-memcpy", |b| {
        let mut dst = vec![0u8; word_bytes.len()];
        b.iter(|| {
            dst.copy_from_slice(black_box(&word_bytes));
            black_box(dst.len())
        });
    });
    group.bench_function("baseline-xxh3", |b| {
        b.iter(|| black_box(XxHash3_64::oneshot(black_box(&word_bytes))));
    });
    group.finish();
}

fn delta(c: &mut Criterion) {
    let layout = Cbi1Layout::new(7, 1 << 20).expect("valid layout");
    let words = table(2);
    let mut group = c.benchmark_group("delta");
    for n in [1usize, 16, 1024] {
        let images: Vec<BucketImage> = (0..n)
            .map(|i| BucketImage {
                bucket_idx: (words[i] % (1 << 20)) as u32,
                word: words[i + n],
            })
            .collect();
        let mut encoded = BytesMut::new();
        cbi1::encode_delta(&layout, 1, 4, 5, &images, &mut encoded).expect("encodes");
        let encoded: Bytes = encoded.freeze();
        let raw = encoded.to_vec();
        group.throughput(Throughput::Elements(n as u64));
        group.bench_with_input(BenchmarkId::new("encode", n), &images, |b, images| {
            let mut dst = BytesMut::with_capacity(encoded.len());
            b.iter(|| {
                dst.clear();
                cbi1::encode_delta(&layout, 1, 4, 5, black_box(images), &mut dst).expect("encodes");
                black_box(dst.len())
            });
        });
        group.bench_with_input(BenchmarkId::new("decode", n), &encoded, |b, encoded| {
            let mut out = Vec::with_capacity(n);
            b.iter(|| {
                let Ok(Cbi1Payload::Delta(delta)) = cbi1::decode_cbi1(black_box(encoded), &layout)
                else {
                    unreachable!("a valid delta")
                };
                out.clear();
                out.extend(delta.images());
                black_box(out.len())
            });
        });
        group.bench_with_input(BenchmarkId::new("baseline-memcpy", n), &raw, |b, raw| {
            let mut dst = vec![0u8; raw.len()];
            b.iter(|| {
                dst.copy_from_slice(black_box(raw));
                black_box(dst.len())
            });
        });
    }
    group.finish();
}

criterion_group!(benches, snapshot_chunk, delta);
criterion_main!(benches);
