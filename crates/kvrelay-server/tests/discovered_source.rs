//! A relay fed by a ZMQ publisher advertised only through the reference runtime's discovery
//! records (`event_sources/` + `event_channels/`): its events reach a WAN replica, and
//! removing the records detaches the source and withdraws the pool.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly"
)]

mod support;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use kvrelay_codec::v1::StreamRpc;
use kvrelay_ingest::{
    BlockStored, EngineBatch, EngineBlockHash, EngineEvent, EngineKind, EngineLayout, HashRepr,
    TokenIds, encode_engine_batch,
};
use kvrelay_server::{PoolMirror, ProbeStream, Relay, RelayConfig};
use support::{DEADLINE, request, write_card};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BLOCK_SIZE: u32 = 16;
const WORKER: u64 = 0x11;
const PUBLISHER: u64 = 4_242;
const RECORD: &str =
    "namespace%2Fprod%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F1092";

/// Writes the advert pair the reference runtime registers for one publisher.
fn advertise(store: &Path, zmq: &str) {
    let scope = serde_json::json!({"kind": "endpoint", "endpoint": {"namespace": "prod", "component": "backend", "name": "generate"}});
    let source = serde_json::json!({
        "type": "EventSource", "scope": scope, "topic": "kv-events", "publisher_id": PUBLISHER,
        "metadata": {
            "kv_state_endpoint": scope["endpoint"],
            "worker": {"worker_id": WORKER, "dp_rank": 0},
            "publisher_id": PUBLISHER
        }
    });
    let channel = serde_json::json!({
        "type": "EventChannel", "scope": scope, "topic": "kv-events", "instance_id": PUBLISHER,
        "transport": {"kind": "Zmq", "config": {"endpoint": zmq}}
    });
    for (bucket, record) in [("event_channels", channel), ("event_sources", source)] {
        std::fs::create_dir_all(store.join(bucket)).unwrap();
        std::fs::write(store.join(bucket).join(RECORD), record.to_string()).unwrap();
    }
}

fn batch(seq: u64) -> ZmqMessage {
    let hash = |value: u64| EngineBlockHash {
        value,
        repr: HashRepr::Unsigned,
    };
    let ids = [seq * 10 + 1, seq * 10 + 2];
    let event = EngineEvent::BlockStored(BlockStored {
        block_hashes: ids.iter().map(|id| hash(*id)).collect(),
        parent_block_hash: None,
        token_ids: TokenIds::Flat(
            ids.iter()
                .flat_map(|id| (0..BLOCK_SIZE).map(move |at| (*id as u32) * 100 + at))
                .collect(),
        ),
        block_size: BLOCK_SIZE,
        lora_id: None,
        medium: Some("GPU".to_owned()),
        lora_name: None,
        extra_keys: Vec::new(),
        group_idx: None,
        kv_cache_spec_kind: None,
        kv_cache_spec_sliding_window: None,
        cache_salt: None,
        lookahead_token_ids: Vec::new(),
    });
    let layout = EngineLayout {
        engine: EngineKind::Vllm,
        map_events: false,
        map_batch: false,
    };
    let mut payload = Vec::new();
    encode_engine_batch(
        &EngineBatch {
            ts: 0.0,
            events: vec![event],
            dp_rank: Some(0),
        },
        layout,
        &mut payload,
    );
    ZmqMessage::try_from(vec![
        Bytes::from_static(b"kv-events"),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ])
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advertised_zmq_source_feeds_a_wan_replica_and_detaches_when_withdrawn() {
    let mut publisher = PubSocket::new();
    let zmq = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let dir = tempfile::tempdir().unwrap();
    let cards = dir.path().join("cards");
    let store = dir.path().join("store/v1");
    std::fs::create_dir_all(&cards).unwrap();
    write_card(
        &cards,
        ("prod", "backend", "generate"),
        WORKER,
        "model-a",
        "aggregated",
        1024,
        1,
    );
    let mut config = RelayConfig {
        dc_id: "dc-adverts".to_owned(),
        ..RelayConfig::default()
    };
    config.wan.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.enabled = false;
    config.discovery.dir = Some(cards);
    config.discovery.event_sources_dir = Some(store.clone());
    let relay = Relay::start(config).await.unwrap();
    assert!(relay.catalog().pools.is_empty(), "no source yet, no pool");

    advertise(&store, &zmq);
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .unwrap();

    // PUB/SUB drops what is sent before the subscription lands: publish on every tick until
    // the pool holds blocks.
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut seq = 0u64;
    loop {
        tick.tick().await;
        assert!(
            tokio::time::Instant::now() < deadline,
            "no advertised engine event reached the pool"
        );
        publisher.send(batch(seq)).await.unwrap();
        seq += 1;
        relay.flush().await;
        if relay
            .pool_reports()
            .await
            .first()
            .is_some_and(|pool| pool.resident_blocks > 0)
        {
            break;
        }
    }

    let producer = relay.catalog().pools[0].producer;
    let table = relay.producer_table(&producer).await.unwrap();
    assert!(table.words.iter().any(|word| *word != 0));
    let mut stream = ProbeStream::connect(
        relay.wan_addr(),
        &request(StreamRpc::SubscribePool {
            expected_producer: producer,
        }),
    )
    .await
    .unwrap();
    let mut mirror = PoolMirror::new(producer).unwrap();
    while mirror.words().is_none() || mirror.sequence() < table.sequence {
        let frame = tokio::time::timeout(DEADLINE, stream.next_frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        mirror.handle_frame(&frame).unwrap();
    }
    assert_eq!(mirror.words().unwrap(), table.words.as_slice());

    // Withdrawing the advert detaches the source: the pool has no source left and retires.
    std::fs::remove_file(store.join("event_sources").join(RECORD)).unwrap();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !relay.catalog().pools.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "pool not withdrawn after its advert was removed"
        );
        tick.tick().await;
    }
    assert!(relay.sources().is_empty());
    relay.shutdown().await.unwrap();
}
