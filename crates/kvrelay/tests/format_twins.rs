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

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvrelay_consumer::{Consumer, ConsumerConfig, RelayEndpoint, ScoreRequest};
use support::{RelayProcess, VllmEngine, http_get, quick_consumer, removed, stored, write_card};

const DEADLINE: Duration = Duration::from_secs(30);
const ENDPOINT: &str = "prod.backend.generate";

async fn get_json(admin: SocketAddr, path: &str) -> serde_json::Value {
    let (_, body) = http_get(admin, path)
        .await
        .unwrap_or_else(|| panic!("GET {path} got no answer"));
    serde_json::from_str(&body).unwrap_or_else(|_| panic!("GET {path}: {body}"))
}

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
    let reserved = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let engine_addr = reserved.local_addr().unwrap();
    drop(reserved);
    let dir = tempfile::tempdir().unwrap();
    let cards = dir.path().join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    write_card(&cards, 1024);
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[[sources]]\nendpoint = \"{ENDPOINT}\"\nworker_id = 17\ndp_rank = 0\n\
             engine = \"vllm\"\nzmq = \"tcp://{engine_addr}\"\n\n\
             [filters]\nformat = \"v1_and_dense\"\n"
        ),
    )
    .unwrap();
    let relay = RelayProcess::start_with_cards(
        cards.to_str().unwrap(),
        &[],
        &["--config", config.to_str().unwrap()],
        &[],
    )
    .await;
    let admin = relay.admin;

    // The catalog lists the pool in v1 and its twin as a device lane (tier 0) of the
    // pool's block size, in the dense format, with fewer buckets.
    let deadline = Instant::now() + DEADLINE;
    let (pool, twin) = loop {
        let catalog = get_json(admin, "/v1/catalog").await;
        if let (Some(pool), Some(twin)) = (catalog["pools"].get(0), catalog["tier_lanes"].get(0)) {
            break (pool["producer"].clone(), twin.clone());
        }
        assert!(
            Instant::now() < deadline,
            "no twin in the catalog: {catalog}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(twin["pool_id"], pool["pool_id"]);
    assert_eq!(
        (twin["tier"].as_u64(), twin["block_size"].as_u64()),
        (Some(0), Some(16))
    );
    let format =
        |producer: &serde_json::Value, field: &str| producer["ckf_format"][field].as_u64().unwrap();
    assert_eq!(format(&pool, "format_version"), 1);
    assert_eq!(format(&twin["producer"], "format_version"), 2);
    assert!(format(&twin["producer"], "bucket_count") < format(&pool, "bucket_count"));

    // The engine comes up; warm up the PUB/SUB path with no-op removals until one lands.
    let context = zmq::Context::new();
    let mut engine = VllmEngine::bind(&context, engine_addr);
    let pools = get_json(admin, "/v1/pools").await;
    let stats_path = format!(
        "/v1/pools/{}/stats",
        pools["pools"][0]["pool"].as_str().unwrap()
    );
    let deadline = Instant::now() + DEADLINE;
    loop {
        engine.publish(removed(&[1_000_000 + engine.seq]));
        let applied = get_json(admin, &stats_path).await["stats"]["events_applied"]
            .as_u64()
            .unwrap_or(0);
        if applied > 0 {
            break;
        }
        assert!(Instant::now() < deadline, "no batch arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    let relays = vec![RelayEndpoint::new(&relay.wan.to_string(), "dc-proc")];
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
