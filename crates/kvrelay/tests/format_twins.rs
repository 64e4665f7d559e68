//! Format twins end to end: a `kvrelay relay` process with `[filters] format =
//! "v1_and_dense"` lists its pool in v1 and names a dense twin of it as the pool's device
//! lane. A consumer that follows twins replicates the dense twin; one that does not (as a
//! consumer older than twins behaves) replicates the v1 pool. Both score the same prefix
//! from the same vLLM engine's events.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly"
)]

mod support;

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
