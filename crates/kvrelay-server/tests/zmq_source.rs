//! A relay fed by a real vLLM-style ZMQ publisher configured in `[[sources]]`: engine
//! batches on the wire become filter content a WAN replica sees.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly"
)]

mod support;

use std::time::Duration;

use bytes::Bytes;
use kvrelay_codec::v1::StreamRpc;
use kvrelay_ingest::{
    BlockStored, EngineBatch, EngineBlockHash, EngineEvent, EngineKind, EngineLayout, HashRepr,
    TokenIds, encode_engine_batch,
};
use kvrelay_server::{
    EngineKind as ConfigEngine, PoolMirror, ProbeStream, Relay, RelayConfig, SourceConfig,
};
use support::{DEADLINE, request, write_card};
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

const BLOCK_SIZE: u32 = 16;

fn stored(ids: &[u64], parent: Option<u64>) -> EngineEvent {
    let hash = |value: u64| EngineBlockHash {
        value,
        repr: HashRepr::Unsigned,
    };
    let tokens = ids
        .iter()
        .flat_map(|id| (0..BLOCK_SIZE).map(move |at| (*id as u32) * 100 + at))
        .collect();
    EngineEvent::BlockStored(BlockStored {
        block_hashes: ids.iter().map(|id| hash(*id)).collect(),
        parent_block_hash: parent.map(hash),
        token_ids: TokenIds::Flat(tokens),
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
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_engine_events_reach_a_wan_replica() {
    let mut publisher = PubSocket::new();
    let endpoint = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();

    let dir = tempfile::tempdir().unwrap();
    let cards = dir.path().join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    write_card(
        &cards,
        ("prod", "backend", "generate"),
        0x11,
        "model-a",
        "aggregated",
        1024,
        1,
    );
    let mut config = RelayConfig {
        dc_id: "dc-zmq".to_owned(),
        ..RelayConfig::default()
    };
    config.wan.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.enabled = false;
    config.discovery.dir = Some(cards);
    config.sources = vec![SourceConfig {
        endpoint: "prod.backend.generate".to_owned(),
        worker_id: 0x11,
        dp_rank: 0,
        engine: ConfigEngine::Vllm,
        zmq: endpoint,
        replay: None,
        metrics_url: None,
    }];
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .unwrap();

    // PUB/SUB drops what is sent before the subscription lands, so publish a new batch on
    // every tick until the pool holds blocks.
    let layout = EngineLayout {
        engine: EngineKind::Vllm,
        map_events: false,
        map_batch: false,
    };
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut seq = 0u64;
    loop {
        tick.tick().await;
        assert!(
            tokio::time::Instant::now() < deadline,
            "no engine event reached the pool"
        );
        let batch = EngineBatch {
            ts: 0.0,
            events: vec![stored(&[seq * 10 + 1, seq * 10 + 2], None)],
            dp_rank: Some(0),
        };
        let mut payload = Vec::new();
        encode_engine_batch(&batch, layout, &mut payload);
        let frames = vec![
            Bytes::from_static(b"kv-events"),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ];
        publisher
            .send(ZmqMessage::try_from(frames).unwrap())
            .await
            .unwrap();
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
    relay.shutdown().await.unwrap();
}

/// Serves one fixed metrics page to every connection.
async fn serve_metrics(page: &'static str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.windows(4).any(|window| window == b"\r\n\r\n") {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                page.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        }
    });
    format!("http://{addr}/metrics")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_kv_usage_becomes_the_pool_load() {
    let url = serve_metrics("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.5\n").await;
    let dir = tempfile::tempdir().unwrap();
    let cards = dir.path().join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    write_card(
        &cards,
        ("prod", "backend", "generate"),
        0x11,
        "model-a",
        "aggregated",
        1024,
        1,
    );
    let mut config = RelayConfig {
        dc_id: "dc-load".to_owned(),
        ..RelayConfig::default()
    };
    config.wan.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.enabled = false;
    config.discovery.dir = Some(cards);
    config.limits.load_window_ms = 50;
    config.sources = vec![SourceConfig {
        endpoint: "prod.backend.generate".to_owned(),
        worker_id: 0x11,
        dp_rank: 0,
        engine: ConfigEngine::Vllm,
        // No engine publishes here; only the metrics endpoint matters in this test.
        zmq: "tcp://127.0.0.1:9".to_owned(),
        replay: None,
        metrics_url: Some(url),
    }];
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .unwrap();
    let mut stream = ProbeStream::connect(relay.wan_addr(), &request(StreamRpc::WatchLoad))
        .await
        .unwrap();
    loop {
        let message = support::next(&mut stream).await.expect("load stream open");
        let kvrelay_codec::v1::Message::LoadWindow(window) = message else {
            panic!("expected a load window, got {message:?}")
        };
        if let Some(pool) = window.pools.first()
            && pool.kv_used_blocks == Some(512)
        {
            assert_eq!(pool.total_kv_blocks, Some(1024));
            assert!(pool.authoritative, "{pool:?}");
            break;
        }
    }
    relay.shutdown().await.unwrap();
}
