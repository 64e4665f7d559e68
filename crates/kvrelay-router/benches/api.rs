//! Parsing a route request's body: the common-shape fast parser (`api::parse`) against
//! `serde_json` alone (`api::parse_with_serde`, the baseline), for the 1,024-token request
//! of `benches/route.rs` (64 blocks of 16, token ids of seven digits) and for a batch of 16
//! such requests; and encoding a 16- and a 256-candidate answer: `serde_json` on
//! `RouteResponse` and the direct writer (`api::write_ranking`) against copying the
//! answer's bytes (the floor of any encoder).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "benchmark setup"
)]
#![allow(missing_docs, reason = "criterion macros generate undocumented items")]

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use std::sync::Arc;

use kvrelay_consumer::{
    CandidateReadiness, CandidateShape, Coverage, Ranking, ReplicaState, ScoredCandidate, ScoredLeg,
};
use kvrelay_router::api::{self, BatchRequest, RouteRequest, RouteResponse};
use kvrelay_router::config::HttpSection;

fn route_body(family: u32) -> serde_json::Value {
    let tokens: Vec<u32> = (0..1024).map(|i| family * 1_000_000 + i).collect();
    serde_json::json!({ "tokens": tokens, "model": "llama", "top_k": 8 })
}

/// One parse group over `body`: serde_json alone (the baseline) against [`api::parse`],
/// after checking that both give the same request.
fn bench_parse_of<T: api::RequestBody + PartialEq + std::fmt::Debug>(
    c: &mut Criterion,
    group_name: &str,
    body: &[u8],
) {
    let limits = HttpSection::default();
    let fast: T = api::parse(body, &limits).unwrap();
    assert_eq!(Some(fast), api::parse_with_serde(body).ok());
    let mut group = c.benchmark_group(group_name);
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("baseline-serde-json", |b| {
        b.iter(|| api::parse_with_serde::<T>(black_box(body)).unwrap());
    });
    group.bench_function("common-shape", |b| {
        b.iter(|| api::parse::<T>(black_box(body), &limits).unwrap());
    });
    group.finish();
}

fn bench_parse(c: &mut Criterion) {
    let single = route_body(1).to_string().into_bytes();
    let batch = serde_json::json!({ "requests": (1..=16).map(route_body).collect::<Vec<_>>() })
        .to_string()
        .into_bytes();
    bench_parse_of::<RouteRequest>(c, "parse-route-1024-tokens", &single);
    bench_parse_of::<BatchRequest>(c, "parse-batch-16x1024-tokens", &batch);
}

/// A ranking of `n` aggregated candidates shaped like the route benchmark's.
fn ranking(n: usize) -> Ranking {
    let dc: Arc<str> = Arc::from("dc-a");
    let endpoint: Arc<str> = Arc::from("dynamo.backend.generate");
    Ranking {
        model: "llama".into(),
        lora: None,
        candidates: (0..n)
            .map(|i| ScoredCandidate {
                dc: dc.clone(),
                shape: CandidateShape::Aggregated,
                legs: vec![ScoredLeg {
                    role: "aggregated",
                    pool: Arc::from(format!("pool{i}")),
                    endpoint: endpoint.clone(),
                    block_size: 16,
                    replica: ReplicaState::Current,
                    coverage: Coverage::Complete,
                    prefix_blocks: Some(i as u32 % 65),
                    prefix_tokens: Some(i as u32 % 65 * 16),
                    host_blocks: None,
                    disk_blocks: None,
                    load: Some(0.1 + i as f64 / 1_000.0),
                }],
                prefix_fraction: Some(f64::from(i as u32 % 65) / 64.0),
                load_fraction: Some(0.1 + i as f64 / 1_000.0),
                dc_cost: 0.0,
                readiness: CandidateReadiness::Ready,
                score: 1.0 - i as f64 / 300.0,
            })
            .collect(),
        n_not_ready: 0,
    }
}

fn bench_encode(c: &mut Criterion) {
    for n in [16usize, 256] {
        let ranking = ranking(n);
        let encoded = serde_json::to_vec(&RouteResponse::from(&ranking)).unwrap();
        let mut direct = Vec::new();
        api::write_ranking(&mut direct, &ranking);
        assert_eq!(direct, encoded);
        let mut group = c.benchmark_group(format!("encode-answer-{n}-candidates"));
        group.throughput(Throughput::Bytes(encoded.len() as u64));
        group.bench_function("baseline-copy-bytes", |b| {
            b.iter(|| black_box(&encoded).clone())
        });
        group.bench_function("serde-json", |b| {
            b.iter(|| serde_json::to_vec(&RouteResponse::from(black_box(&ranking))).unwrap());
        });
        group.bench_function("direct", |b| {
            b.iter(|| {
                let mut out = Vec::new();
                api::write_ranking(&mut out, black_box(&ranking));
                out
            });
        });
        group.finish();
    }
}

criterion_group!(benches, bench_parse, bench_encode);
criterion_main!(benches);
