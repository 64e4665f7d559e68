//! The kvrelay consumer following *Dynamo's own relay* (`ai-dynamo-runtime` 1.6.1, with a
//! Dynamo worker publishing through Dynamo's `KvEventPublisher`, a separate process on
//! loopback) over the contract: Dynamo's catalog, snapshot, deltas and readiness become
//! current replicas, and every prefix the worker stored is found at exactly its depth
//! (Dynamo's block hashing, CBI1 images and filter layout read by our code), while
//! sequences it never stored, or evicted, are not; and a restart of Dynamo's relay (a new
//! incarnation on the same address) drops the old replica and converges on the new one.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly"
)]

use std::time::Duration;

use kvrelay_consumer::{
    BackoffConfig, Consumer, ConsumerConfig, RelayEndpoint, RelayProtocol, ReplicaStatus,
    ScoreRequest,
};

#[path = "../../kvrelay-dynamo/tests/interop/mod.rs"]
mod interop;

const DEADLINE: Duration = Duration::from_secs(30);
const BLOCK: u32 = 16;

fn request(first: u32, blocks: u32) -> ScoreRequest {
    ScoreRequest {
        tokens: (first..first + BLOCK * blocks).collect(),
        model: "model-a".to_owned(),
        ..ScoreRequest::default()
    }
}

/// The deepest cached prefix any candidate of `consumer` finds for `request`, once every
/// replica is current; `None` while the model is unknown or no replica is current.
fn depth(consumer: &Consumer, request: &ScoreRequest) -> Option<u32> {
    let ranking = consumer.score(request).ok()?;
    ranking
        .candidates
        .iter()
        .flat_map(|candidate| &candidate.legs)
        .filter(|leg| leg.replica == ReplicaStatus::Current)
        .filter_map(|leg| leg.prefix_blocks)
        .max()
}

/// Waits until `consumer` finds exactly `expected` blocks for `request`.
async fn wait_depth(consumer: &Consumer, request: &ScoreRequest, expected: u32) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let found = depth(consumer, request);
        if found == Some(expected) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "expected depth {expected}, found {found:?}; pools {:?}; errors {:?}",
            consumer.pools(),
            consumer.relay_errors()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumer_follows_dynamos_relay_and_finds_what_its_worker_cached() {
    let mut fleet = interop::DynamoFleet::start().await;
    // Stored before the consumer subscribes: it arrives in the snapshot.
    fleet.store(10_000, 6).await;

    let mut config = ConsumerConfig::new(vec![
        RelayEndpoint::new(&fleet.addr, "dc-dynamo").with_protocol(RelayProtocol::DynamoGrpc),
    ]);
    config.backoff = BackoffConfig {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(200),
        ..BackoffConfig::default()
    };
    let consumer = Consumer::start(config).unwrap();
    wait_depth(&consumer, &request(10_000, 6), 6).await;
    // A prefix of it, and the sequence continued past what was stored.
    assert_eq!(depth(&consumer, &request(10_000, 2)), Some(2));
    assert_eq!(depth(&consumer, &request(10_000, 9)), Some(6));
    // Tokens nobody stored.
    assert_eq!(depth(&consumer, &request(50_000, 4)), Some(0));

    // Stored while the consumer follows: it arrives as deltas.
    fleet.store(20_000, 3).await;
    wait_depth(&consumer, &request(20_000, 3), 3).await;
    // Evicted: gone from the replica too.
    fleet.remove(10_000, 6).await;
    wait_depth(&consumer, &request(10_000, 6), 0).await;
    assert_eq!(depth(&consumer, &request(20_000, 3)), Some(3));

    let pools = consumer.pools();
    assert_eq!(pools.len(), 1, "{pools:?}");
    assert_eq!(pools[0].replica, ReplicaStatus::Current);

    // Dynamo's relay restarts on the same address, with a worker that cached something
    // else: the old replica is dropped (never scored), the new incarnation's is used.
    let port = fleet
        .addr
        .rsplit_once(':')
        .and_then(|(_, port)| port.parse::<u16>().ok())
        .expect("host:port");
    let old_producer = pools[0].producer;
    fleet.stop().await;
    let mut restarted = interop::DynamoFleet::start_on(port).await;
    restarted.store(30_000, 4).await;
    wait_depth(&consumer, &request(30_000, 4), 4).await;
    assert_eq!(depth(&consumer, &request(20_000, 3)), Some(0));
    let pools = consumer.pools();
    assert_eq!(pools.len(), 1, "{pools:?}");
    assert_ne!(
        pools[0].producer, old_producer,
        "a new incarnation is a new producer"
    );
    consumer.shutdown().await;
}
