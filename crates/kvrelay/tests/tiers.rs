//! Cache tiers end to end: a `kvrelay relay` process with `[tiers.host]`, a vLLM engine
//! publishing GPU events and its offloading connector's CPU events over ZMQ (as vLLM
//! 0.33.0's connector sends them: one key per 2-block chunk, no tokens), and a consumer
//! following the pool and its host lane over the WAN protocol.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly"
)]

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvrelay_consumer::{Consumer, RelayEndpoint, ScoreRequest, ScoredLeg};
use kvrelay_ingest::{BlockRemoved, BlockStored, EngineBlockHash, EngineEvent, TokenIds};
use support::{RelayProcess, VllmEngine, http_get, quick_consumer, removed, stored, write_card};

const DEADLINE: Duration = Duration::from_secs(30);
const ENDPOINT: &str = "prod.backend.generate";

/// vLLM's offloading connector storing the chunk whose last GPU block is `id` in host
/// memory (no tokens, no parent, block size 0, medium `CPU`, group 0).
fn offloaded(id: u64) -> EngineEvent {
    EngineEvent::BlockStored(BlockStored {
        medium: Some("CPU".to_owned()),
        group_idx: Some(0),
        ..BlockStored::new(
            vec![EngineBlockHash::unsigned(id)],
            None,
            TokenIds::Flat(Vec::new()),
            0,
        )
    })
}

/// The connector evicting that chunk from host memory.
fn evicted_from_host(id: u64) -> EngineEvent {
    EngineEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![EngineBlockHash::unsigned(id)],
        medium: Some("CPU".to_owned()),
        group_idx: Some(0),
    })
}

async fn get_json(admin: SocketAddr, path: &str) -> serde_json::Value {
    let (_, body) = http_get(admin, path)
        .await
        .unwrap_or_else(|| panic!("GET {path} got no answer"));
    serde_json::from_str(&body).unwrap_or_else(|_| panic!("GET {path}: {body}"))
}

/// The pool's only leg for the prompt of blocks 1..=4, once `accept` takes it (bounded).
async fn leg_until(consumer: &Consumer, accept: impl Fn(&ScoredLeg) -> bool) -> ScoredLeg {
    let request = ScoreRequest {
        tokens: support::tokens_of(&[1, 2, 3, 4]),
        model: "model-a".to_owned(),
        ..ScoreRequest::default()
    };
    let deadline = Instant::now() + DEADLINE;
    loop {
        let leg = consumer
            .score(&request)
            .ok()
            .and_then(|ranking| ranking.candidates.first()?.legs.first().cloned());
        if let Some(leg) = leg.filter(|leg| accept(leg)) {
            return leg;
        }
        assert!(Instant::now() < deadline, "the leg never got there");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_tier_offloads_reach_the_consumer_as_a_continuation_of_the_device_prefix() {
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
             [tiers.host]\nblocks_per_chunk = 2\n"
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

    // The catalog names the pool's host lane: 2 blocks of 16 tokens per lane block.
    let deadline = Instant::now() + DEADLINE;
    let (pool, lane) = loop {
        let catalog = get_json(admin, "/v1/catalog").await;
        if let (Some(pool), Some(lane)) = (catalog["pools"].get(0), catalog["tier_lanes"].get(0)) {
            break (pool.clone(), lane.clone());
        }
        assert!(
            Instant::now() < deadline,
            "no lane in the catalog: {catalog}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(lane["pool_id"], pool["producer"]["pool_id"]);
    assert_eq!(
        (lane["tier"].as_u64(), lane["block_size"].as_u64()),
        (Some(1), Some(32))
    );

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

    // Blocks 1-4 computed on the GPU; the connector offloads both 2-block chunks (keyed
    // by blocks 2 and 4); the GPU then evicts blocks 3 and 4.
    engine.publish(stored(&[1, 2, 3, 4], None));
    engine.publish(offloaded(2));
    engine.publish(offloaded(4));
    engine.publish(removed(&[3, 4]));

    let relays = vec![RelayEndpoint::new(&relay.wan.to_string(), "dc-proc")];
    let consumer = quick_consumer(relays.clone());
    let leg = leg_until(&consumer, |leg| leg.host_blocks == Some(2)).await;
    assert_eq!(leg.prefix_blocks, Some(2), "{leg:?}");
    assert_eq!(leg.disk_blocks, None, "no disk lane: {leg:?}");
    // A consumer that follows device memory only (as one that predates tiers) keeps
    // working against the tiered relay: the same device prefix, no lane.
    let mut device_only = kvrelay_consumer::ConsumerConfig::new(relays);
    device_only.follow_tier_lanes = false;
    let device_only = Consumer::start(device_only).unwrap();
    let leg = leg_until(&device_only, |leg| leg.prefix_blocks == Some(2)).await;
    assert_eq!((leg.host_blocks, leg.disk_blocks), (None, None), "{leg:?}");
    assert_eq!(device_only.pools().len(), 1);
    device_only.shutdown().await;

    // The host evicts the chunk of blocks 3-4: nothing continues the device prefix.
    engine.publish(evicted_from_host(4));
    let leg = leg_until(&consumer, |leg| leg.host_blocks == Some(0)).await;
    assert_eq!(leg.prefix_blocks, Some(2), "{leg:?}");

    // Offloading again after the GPU evicted the block cannot be resolved: dropped and
    // counted by the relay, never guessed.
    engine.publish(offloaded(4));
    // A clear of the engine's cache names no tier: every tier of the source goes.
    engine.publish(EngineEvent::AllBlocksCleared);
    let leg = leg_until(&consumer, |leg| leg.prefix_blocks == Some(0)).await;
    assert_eq!(leg.host_blocks, Some(0), "{leg:?}");
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
        let unmapped = support::sample(&metrics, "kvrelay_tier_offloads_unmapped_total");
        if unmapped == Some(1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "unmapped offload not counted: {unmapped:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    consumer.shutdown().await;
}
