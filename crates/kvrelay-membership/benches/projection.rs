//! Membership projection cost: a full projection of 10,000 cards over 1,000 endpoints
//! (`projection/baseline-full`) against one card changing on top of it
//! (`projection/one-card-update`). The update should cost at most 10% of the full run.

#![allow(missing_docs, reason = "criterion macros generate undocumented items")]

use std::hint::black_box;

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use kvrelay_membership::{
    DiscoveryEvent, EndpointFilter, MembershipProjection, ModelCardInstance, ModelCardInstanceId,
};

const N_ENDPOINTS: u64 = 1_000;
const N_CARDS: u64 = 10_000;

fn card(endpoint: u64, worker: u64, n_kv_blocks: u64) -> ModelCardInstance {
    ModelCardInstance {
        id: ModelCardInstanceId {
            namespace: format!("ns{}", endpoint % 10),
            component: "backend".into(),
            endpoint: format!("e{endpoint}"),
            instance_id: worker,
            model_suffix: None,
        },
        card_json: serde_json::json!({
            "display_name": format!("model-{}", endpoint % 50),
            "source_path": format!("org/model-{}", endpoint % 50),
            "kv_cache_block_size": 16,
            "model_type": "Chat | Completions",
            "worker_type": "aggregated",
            "aliases": [format!("alias-{}", endpoint % 50)],
            "runtime_config": {"total_kv_blocks": n_kv_blocks, "data_parallel_size": 1}
        }),
    }
}

fn cards() -> Vec<ModelCardInstance> {
    (0..N_CARDS)
        .map(|worker| card(worker % N_ENDPOINTS, worker, 4096))
        .collect()
}

fn projected(cards: &[ModelCardInstance]) -> MembershipProjection {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.replace_all(cards.to_vec());
    projection.project();
    projection
}

fn bench_projection(c: &mut Criterion) {
    let cards = cards();
    let mut group = c.benchmark_group("projection");
    group.sample_size(10);
    group.throughput(Throughput::Elements(N_CARDS));
    group.bench_function("baseline-full", |b| {
        b.iter_batched(
            || cards.clone(),
            |cards| {
                let mut projection = MembershipProjection::new(EndpointFilter::default());
                projection.replace_all(cards);
                projection.project();
                black_box(projection.view())
            },
            BatchSize::LargeInput,
        );
    });
    group.throughput(Throughput::Elements(1));
    let mut projection = projected(&cards);
    let mut n_kv_blocks = 4096;
    group.bench_function("one-card-update", |b| {
        b.iter_batched(
            || {
                n_kv_blocks += 1;
                DiscoveryEvent::Added(card(7, 7, n_kv_blocks))
            },
            |event| {
                projection.handle_event(event);
                projection.project();
                black_box(projection.view())
            },
            BatchSize::SmallInput,
        );
    });
    group.finish();
}

criterion_group!(benches, bench_projection);
criterion_main!(benches);
