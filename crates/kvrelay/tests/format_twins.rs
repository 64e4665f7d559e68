//! Format twins end to end: a `kvrelay relay` process with `[filters] format =
//! "v1_and_dense"` lists its pool in v1 and names a dense twin of it as the pool's device
//! lane. A consumer that follows twins replicates the dense twin; one that does not (as a
//! consumer older than twins behaves) replicates the v1 pool. Both score the same prefix
//! from the same vLLM engine's events.

use crate::support;

use std::time::{Duration, Instant};

use kvrelay_consumer::{Consumer, ConsumerConfig, RelayEndpoint, ScoreRequest};
use support::{
    VllmEngine, first_pool_and_lane, quick_consumer, removed, stored, vllm_relay, warm_up,
};

const DEADLINE: Duration = Duration::from_secs(30);

/// The prefix `consumer` scores for the prompt of blocks 1..=4, once it is `blocks`
/// (bounded).
async fn prefix_reaches(consumer: &Consumer, blocks: u32) {
    let request = ScoreRequest {
        tokens: support::tokens_of(&[1, 2, 3, 4]),
        model: "model-a".to_owned(),
        ..ScoreRequest::default()
    };
    let deadline = Instant::now() + DEADLINE;
    loop {
        let prefix = consumer
            .score(&request)
            .ok()
            .and_then(|ranking| ranking.candidates.first()?.legs.first()?.prefix_blocks);
        if prefix == Some(blocks) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the prefix never reached {blocks}: {prefix:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twin_following_and_older_consumers_score_the_same_pool_in_their_own_formats() {
    let setup = vllm_relay("[filters]\nformat = \"v1_and_dense\"\n").await;
    let admin = setup.relay.admin;

    // The catalog lists the pool in v1 and its twin as a device lane (tier 0) of the
    // pool's block size, in the dense format, with fewer buckets.
    let (pool, twin) = first_pool_and_lane(admin).await;
    let pool = &pool["producer"];
    assert_eq!(twin["pool_id"], pool["pool_id"]);
    assert_eq!(
        (twin["tier"].as_u64(), twin["block_size"].as_u64()),
        (Some(0), Some(16))
    );
    let format =
        |producer: &serde_json::Value, field: &str| producer["ckf_format"][field].as_u64().unwrap();
    assert_eq!(format(pool, "format_version"), 1);
    assert_eq!(format(&twin["producer"], "format_version"), 2);
    assert!(format(&twin["producer"], "bucket_count") < format(pool, "bucket_count"));

    // The engine comes up; its events reach the relay.
    let context = zmq::Context::new();
    let mut engine = VllmEngine::bind(&context, setup.engine_addr);
    warm_up(admin, &mut engine).await;

    let relays = vec![RelayEndpoint::new(&setup.relay.wan.to_string(), "dc-proc")];
    let follows_twins = quick_consumer(relays.clone());
    let mut own_format = ConsumerConfig::new(relays);
    own_format.follow_format_twins = false;
    let own_format = Consumer::start(own_format).unwrap();

    engine.publish(stored(&[1, 2, 3, 4], None));
    prefix_reaches(&follows_twins, 4).await;
    prefix_reaches(&own_format, 4).await;
    engine.publish(removed(&[3, 4]));
    prefix_reaches(&follows_twins, 2).await;
    prefix_reaches(&own_format, 2).await;

    // Each lists the one pool, replicated from the producer of its format.
    let replicated = |consumer: &Consumer| {
        let pools = consumer.pools();
        assert_eq!(pools.len(), 1, "{pools:?}");
        pools[0].producer.ckf_format.format_version
    };
    assert_eq!(replicated(&follows_twins), 2);
    assert_eq!(replicated(&own_format), 1);
    follows_twins.shutdown().await;
    own_format.shutdown().await;
}

/// A pool whose engines cache more than their cards declared: the dense twin, sized to
/// the declared capacity, cannot place every block. The relay says so: the catalog
/// advertises the pool as overfull with the omitted share, its stats name the omitted
/// blocks, `kvrelay_pools_overfull` counts it, and a twin-following consumer reports the
/// coverage on the pool and on every leg (it still scores what the filter holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_twin_that_cannot_place_every_block_is_advertised_overfull() {
    let setup = vllm_relay("[filters]\nformat = \"v1_and_dense\"\n").await;
    let admin = setup.relay.admin;
    // The pool is attached (and listed) before the engine warms up.
    first_pool_and_lane(admin).await;
    let context = zmq::Context::new();
    let mut engine = VllmEngine::bind(&context, setup.engine_addr);
    let stats_path = warm_up(admin, &mut engine).await;
    let consumer = quick_consumer(vec![RelayEndpoint::new(
        &setup.relay.wan.to_string(),
        "dc-proc",
    )]);

    // The card declares 1,024 blocks; the engine stores 4,000 (one chain, 8 events).
    let first = 10_000u64;
    for chunk in 0..8u64 {
        let ids: Vec<u64> = (first + chunk * 500..first + (chunk + 1) * 500).collect();
        let parent = (chunk > 0).then(|| ids[0] - 1);
        engine.publish(stored(&ids, parent));
    }

    let deadline = Instant::now() + DEADLINE;
    let coverage = loop {
        let pools = consumer.pools();
        if let Some(coverage) = pools.first().map(|pool| pool.coverage)
            && coverage.as_str() == "overfull"
        {
            break coverage;
        }
        assert!(
            Instant::now() < deadline,
            "the pool was never advertised overfull: {pools:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // At least 4,000 − 1,100 of 4,000 owned blocks did not fit in the twin: over 70 %.
    assert!(coverage.omitted_percent() >= 70, "{coverage:?}");
    assert_eq!(coverage.unroutable_percent(), 0);

    let stats = support::get_json(admin, &stats_path).await;
    let omitted = stats["overfull"]["omitted_blocks"].as_u64().unwrap();
    let owned = stats["overfull"]["owned_blocks"].as_u64().unwrap();
    assert_eq!(owned, 4_000, "{stats}");
    assert!(omitted * 10 >= owned * 7, "{stats}");
    let (_, metrics) = support::http_get(admin, "/metrics").await.unwrap();
    assert_eq!(support::sample(&metrics, "kvrelay_pools_overfull"), Some(1));
    let (status, _) = support::http_get(admin, "/readyz").await.unwrap();
    assert_eq!(status, 200, "an overfull pool makes progress: still ready");

    // Scoring goes on: the chain's first blocks were placed before the twin filled up.
    let request = ScoreRequest {
        tokens: support::tokens_of(&[first, first + 1]),
        model: "model-a".to_owned(),
        ..ScoreRequest::default()
    };
    let ranking = consumer.score(&request).unwrap();
    let leg = &ranking.candidates[0].legs[0];
    assert_eq!(leg.coverage, coverage);
    assert_eq!(leg.prefix_blocks, Some(2));
    consumer.shutdown().await;
}
