//! Cache tiers end to end: a `kvrelay relay` process with `[tiers.host]`, a vLLM engine
//! publishing GPU events and its offloading connector's CPU events over ZMQ (as vLLM
//! 0.33.0's connector sends them: one key per 2-block chunk, no tokens), and a consumer
//! following the pool and its host lane over the WAN protocol.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvrelay_consumer::{Consumer, RelayEndpoint, ScoreRequest, ScoredLeg};
use kvrelay_ingest::{BlockRemoved, BlockStored, EngineBlockHash, EngineEvent, TokenIds};
use support::{
    VllmEngine, first_pool_and_lane, http_get, quick_consumer, removed, stored, vllm_relay,
    warm_up, write_card,
};

const DEADLINE: Duration = Duration::from_secs(30);

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
    let setup = vllm_relay("[tiers.host]\nblocks_per_chunk = 2\n").await;
    let admin = setup.relay.admin;

    // The catalog names the pool's host lane: 2 blocks of 16 tokens per lane block.
    let (pool, lane) = first_pool_and_lane(admin).await;
    assert_eq!(lane["pool_id"], pool["producer"]["pool_id"]);
    assert_eq!(
        (lane["tier"].as_u64(), lane["block_size"].as_u64()),
        (Some(1), Some(32))
    );

    // The engine comes up; its events reach the relay.
    let context = zmq::Context::new();
    let mut engine = VllmEngine::bind(&context, setup.engine_addr);
    warm_up(admin, &mut engine).await;

    // Blocks 1-4 computed on the GPU; the connector offloads both 2-block chunks (keyed
    // by blocks 2 and 4); the GPU then evicts blocks 3 and 4.
    engine.publish(stored(&[1, 2, 3, 4], None));
    engine.publish(offloaded(2));
    engine.publish(offloaded(4));
    engine.publish(removed(&[3, 4]));

    let relays = vec![RelayEndpoint::new(&setup.relay.wan.to_string(), "dc-proc")];
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
    // Where the relay's memory goes: the pool's and the lane's producer state, the
    // mirrors of the two hubs the consumer follows, the deltas kept for resuming.
    let memory = |metrics: &str, component: &str| {
        support::sample(
            metrics,
            &format!("kvrelay_memory_bytes{{component=\"{component}\"}}"),
        )
        .unwrap_or(0)
    };
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (_, metrics) = http_get(admin, "/metrics").await.unwrap();
        let parts = ["pool_filters", "publication_mirrors", "resume_windows"]
            .map(|component| memory(&metrics, component));
        // Two tables of 1,024 buckets at least (the pool's and its lane's).
        if parts.iter().all(|&bytes| bytes > 0) && parts[1] >= 2 * 1024 * 8 {
            assert!(parts[0] >= parts[1], "{parts:?}");
            break;
        }
        assert!(Instant::now() < deadline, "memory gauges: {parts:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    consumer.shutdown().await;
}

/// An embedded relay with a host lane fed device and tier events: an independent replica
/// of the lane over its own TCP stream equals the relay's lane table bit for bit, and both
/// equal an exact model (a device filter and a `TierLane` fed the same events).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lane_replica_is_bit_identical_to_the_relays_lane_and_to_an_exact_model() {
    use kvrelay_ckf::{
        CacheTier, CkfConfig, EventPayload, PoolFilter, RemovedBlocks, RouterEvent, StoredBlock,
        StoredBlocks, TierChange, TierEvent, TierLane,
    };
    use kvrelay_codec::v1::{StreamRequest, StreamRpc};
    use kvrelay_server::{PoolMirror, ProbeStream, Relay, RelayConfig, TierConfig};

    let dir = tempfile::tempdir().unwrap();
    let cards = dir.path().join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    write_card(&cards, 1024);
    // A one-block trace: replaying it connects the card's source, whose events follow.
    let trace = dir.path().join("setup.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\":0,\"input_length\":16,\"output_length\":1,\"hash_ids\":[987654321]}\n",
    )
    .unwrap();
    let mut config = RelayConfig::default();
    config.wan.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.admin.enabled = false;
    config.discovery.dir = Some(cards);
    config.workload = Some(kvrelay_server::WorkloadConfig {
        trace: Some(trace),
        speed: 0.0,
        loops: 1,
    });
    config.tiers.host = Some(TierConfig {
        capacity_ratio: 4.0,
        blocks_per_chunk: 1,
    });
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .expect("the setup trace replays");
    let source = relay.sources()[0];

    let stored = RouterEvent {
        source,
        event_id: 1,
        payload: EventPayload::Stored(StoredBlocks {
            parent_engine_block_id: None,
            blocks: (1..=8)
                .map(|id| StoredBlock {
                    engine_block_id: id,
                    token_hash: 0x5eed_0000 + id,
                })
                .collect(),
        }),
    };
    let tier = |change| TierEvent {
        source,
        event_id: 2,
        tier: CacheTier::Host,
        change,
    };
    let offload = tier(TierChange::Offloaded {
        engine_block_ids: vec![2, 4, 6, 99],
    });
    let device_eviction = RouterEvent {
        source,
        event_id: 3,
        payload: EventPayload::Removed(RemovedBlocks {
            engine_block_ids: (5..=8).collect(),
        }),
    };
    let reoffload = tier(TierChange::Offloaded {
        engine_block_ids: vec![8],
    });
    let host_eviction = tier(TierChange::Removed(RemovedBlocks {
        engine_block_ids: vec![4],
    }));
    relay.submit(stored.clone()).await.unwrap();
    relay.submit_tier(offload.clone()).await.unwrap();
    relay.submit(device_eviction.clone()).await.unwrap();
    relay.submit_tier(reoffload.clone()).await.unwrap();
    relay.submit_tier(host_eviction.clone()).await.unwrap();
    relay.flush().await;

    // The exact model: the same events through a device filter and a host lane.
    let lane_producer = relay.catalog().tier_lanes[0].producer;
    let mut device = PoolFilter::new(CkfConfig::new(1024)).unwrap();
    let mut host = TierLane::new(CacheTier::Host, CkfConfig::new(4096)).unwrap();
    assert_eq!(
        kvrelay_codec::v1::CkfFormat::from(host.filter().format()),
        lane_producer.ckf_format,
        "the model is sized like the relay's lane"
    );
    device.apply(&stored).unwrap();
    host.apply(&device, &offload).unwrap();
    device.apply(&device_eviction).unwrap();
    assert_eq!(host.apply(&device, &reoffload).unwrap().unmapped, 1);
    host.apply(&device, &host_eviction).unwrap();
    assert_eq!(
        host.filter().n_canonicals(),
        2,
        "blocks 2 and 6 stay in host memory"
    );

    // The relay's lane, through its own publication, and an independent replica.
    let table = relay.producer_table(&lane_producer).await.unwrap();
    assert_eq!(
        table.words,
        host.filter().words(),
        "the relay's lane is the model's"
    );
    let request = StreamRequest {
        subscriber_id: "tiers-test".to_owned(),
        rpc: StreamRpc::SubscribePool {
            expected_producer: lane_producer,
            resume_from_sequence: None,
        },
        auth_token: None,
    };
    let mut stream = ProbeStream::connect(relay.wan_addr(), &request)
        .await
        .unwrap();
    let mut mirror = PoolMirror::new(lane_producer).unwrap();
    let deadline = Instant::now() + DEADLINE;
    while !(mirror.words().is_some() && mirror.sequence() >= table.sequence) {
        assert!(
            Instant::now() < deadline,
            "the lane replica never caught up"
        );
        let frame = tokio::time::timeout(DEADLINE, stream.next_frame())
            .await
            .unwrap()
            .unwrap()
            .expect("the relay keeps the lane stream open");
        mirror.handle_frame(&frame).unwrap();
    }
    assert_eq!(mirror.words().unwrap(), &table.words[..]);
    relay.shutdown().await.unwrap();
}
