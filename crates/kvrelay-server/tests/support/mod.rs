//! Shared fixtures of the relay's loopback tests: a card directory, a trace, a config, and
//! helpers that read one stream with a deadline.

#![allow(dead_code, reason = "each test binary uses a different subset")]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test support fails loudly"
)]

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use kvrelay_codec::v1::{Message, ProducerIdentity, StreamRequest, StreamRpc};
use kvrelay_ingest::{
    BlockStored, EngineBatch, EngineBlockHash, EngineEvent, EngineKind, EngineLayout, TokenIds,
    encode_engine_batch,
};
use kvrelay_server::{PoolMirror, ProbeStream, Relay, RelayConfig, WorkloadConfig};
use tokio::net::TcpStream;
use zeromq::{PubSocket, SocketSend, ZmqMessage};

/// Deadline of every wait in these tests.
pub(crate) const DEADLINE: Duration = Duration::from_secs(30);

/// Writes one model card record for `namespace/component/endpoint` instance `instance_id`.
pub(crate) fn write_card(
    dir: &Path,
    (namespace, component, endpoint): (&str, &str, &str),
    instance_id: u64,
    model: &str,
    worker_type: &str,
    total_kv_blocks: u64,
    dp_size: u32,
) {
    let record = serde_json::json!({
        "type": "Model",
        "namespace": namespace,
        "component": component,
        "endpoint": endpoint,
        "instance_id": instance_id,
        "card_json": {
            "display_name": model,
            "source_path": format!("models/{model}"),
            "kv_cache_block_size": 16,
            "model_type": "Chat | Completions",
            "worker_type": worker_type,
            "needs": [],
            "runtime_config": {
                "total_kv_blocks": total_kv_blocks,
                "data_parallel_start_rank": 0,
                "data_parallel_size": dp_size,
                "enable_local_indexer": true,
                "enable_eagle": false
            }
        }
    });
    let name = format!("{namespace}-{component}-{endpoint}-{instance_id:x}.json");
    std::fs::write(dir.join(name), record.to_string()).unwrap();
}

/// A deterministic trace: `n` requests over a few shared prefixes with unique tails.
pub(crate) fn write_trace(path: &Path, n: u64) {
    let mut text = String::new();
    for request in 0..n {
        let prefix = request % 7;
        let mut ids: Vec<u64> = (0..6).map(|at| prefix * 1000 + at).collect();
        ids.extend((0..(request % 5 + 1)).map(|at| 100_000 + request * 10 + at));
        text.push_str(&serde_json::json!({"timestamp": request, "input_length": 0, "output_length": 1, "hash_ids": ids}).to_string());
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

/// A two-pool deployment (one aggregated endpoint with two workers, one with one worker of
/// two data-parallel ranks) with a trace, on loopback with free ports.
pub(crate) fn deployment(dir: &Path, n_requests: u64) -> RelayConfig {
    let cards = dir.join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    write_card(
        &cards,
        ("prod", "backend", "generate"),
        0x11,
        "model-a",
        "aggregated",
        64,
        1,
    );
    write_card(
        &cards,
        ("prod", "backend", "generate"),
        0x12,
        "model-a",
        "aggregated",
        64,
        1,
    );
    write_card(
        &cards,
        ("prod", "other", "generate"),
        0x21,
        "model-b",
        "aggregated",
        48,
        2,
    );
    let trace = dir.join("trace.jsonl");
    write_trace(&trace, n_requests);
    let mut config = RelayConfig {
        dc_id: "dc-test".to_owned(),
        ..RelayConfig::default()
    };
    config.wan.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.discovery.dir = Some(cards);
    config.workload = Some(WorkloadConfig {
        trace: Some(trace),
        speed: 0.0,
        loops: 1,
    });
    config
}

pub(crate) fn request(rpc: StreamRpc) -> StreamRequest {
    StreamRequest {
        subscriber_id: "test".to_owned(),
        rpc,
        auth_token: None,
    }
}

/// Opens a stream and returns its first message.
pub(crate) async fn first_message(
    addr: std::net::SocketAddr,
    request: &StreamRequest,
) -> (ProbeStream<TcpStream>, Message) {
    let mut stream = ProbeStream::connect(addr, request).await.unwrap();
    let message = next(&mut stream)
        .await
        .expect("stream closed before its first message");
    (stream, message)
}

/// The next message under the deadline.
pub(crate) async fn next<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut ProbeStream<T>,
) -> Option<Message> {
    tokio::time::timeout(DEADLINE, stream.next_message())
        .await
        .expect("no message within the deadline")
        .unwrap()
}

/// Reads until the relay's error frame (skipping state updates) and returns it.
pub(crate) async fn until_error<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut ProbeStream<T>,
) -> kvrelay_codec::v1::ErrorMessage {
    loop {
        match next(stream).await {
            Some(Message::Error(error)) => return error,
            Some(_) => {}
            None => panic!("stream closed without an error frame"),
        }
    }
}

/// Tokens per block of the engine batches these tests publish.
pub(crate) const BLOCK_SIZE: u32 = 16;

/// A relay config on loopback (admin off) whose card directory under `dir` holds one
/// aggregated worker `0x11` of `namespace/backend/generate` with 1024 blocks.
pub(crate) fn single_worker(dir: &Path, dc_id: &str, namespace: &str) -> RelayConfig {
    let cards = dir.join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    write_card(
        &cards,
        (namespace, "backend", "generate"),
        0x11,
        "model-a",
        "aggregated",
        1024,
        1,
    );
    let mut config = RelayConfig {
        dc_id: dc_id.to_owned(),
        ..RelayConfig::default()
    };
    config.wan.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.enabled = false;
    config.discovery.dir = Some(cards);
    config
}

/// A vLLM `BlockStored` event for the blocks `ids`, chained under `parent`.
pub(crate) fn stored(ids: &[u64], parent: Option<u64>) -> EngineEvent {
    let tokens = ids
        .iter()
        .flat_map(|id| (0..BLOCK_SIZE).map(move |at| (*id as u32) * 100 + at))
        .collect();
    EngineEvent::BlockStored(BlockStored {
        medium: Some("GPU".to_owned()),
        ..BlockStored::new(
            ids.iter().copied().map(EngineBlockHash::unsigned).collect(),
            parent.map(EngineBlockHash::unsigned),
            TokenIds::Flat(tokens),
            BLOCK_SIZE,
        )
    })
}

/// The ZMQ message of batch `seq`: two fresh blocks on rank 0, as vLLM publishes it.
pub(crate) fn vllm_batch(seq: u64) -> ZmqMessage {
    vllm_message(seq, vec![stored(&[seq * 10 + 1, seq * 10 + 2], None)])
}

/// The ZMQ message of batch `seq` carrying `events` on rank 0, as vLLM publishes it.
pub(crate) fn vllm_message(seq: u64, events: Vec<EngineEvent>) -> ZmqMessage {
    let layout = EngineLayout {
        engine: EngineKind::Vllm,
        map_events: false,
        map_batch: false,
    };
    let batch = EngineBatch {
        ts: 0.0,
        events,
        dp_rank: Some(0),
    };
    let mut payload = Vec::new();
    encode_engine_batch(&batch, layout, &mut payload);
    ZmqMessage::try_from(vec![
        Bytes::from_static(b"kv-events"),
        Bytes::copy_from_slice(&seq.to_be_bytes()),
        Bytes::from(payload),
    ])
    .unwrap()
}

/// What a test publisher sends.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Feed {
    /// vLLM's own batches.
    Vllm,
    /// Dynamo's event plane: publisher `publisher` of worker `worker` (rank 0), as a
    /// Dynamo worker's `KvEventPublisher` sends on the channel it advertises.
    DynamoEventPlane { publisher: u64, worker: u64 },
}

/// Event-plane message `seq` of `publisher`: worker `worker` stores two fresh blocks
/// (Dynamo hashes them itself; any distinct hashes do here).
pub(crate) fn dynamo_message(publisher: u64, worker: u64, seq: u64) -> ZmqMessage {
    let block = |id: u64| kvrelay_ckf::StoredBlock {
        engine_block_id: id,
        token_hash: id.wrapping_mul(0x9e37_79b9_7f4a_7c15),
    };
    let event = kvrelay_ckf::RouterEvent {
        source: kvrelay_ckf::SourceId::new(worker, 0),
        event_id: seq,
        payload: kvrelay_ckf::EventPayload::Stored(kvrelay_ckf::StoredBlocks {
            parent_engine_block_id: None,
            blocks: vec![block(seq * 10 + 1), block(seq * 10 + 2)],
        }),
    };
    ZmqMessage::try_from(kvrelay_ingest::encode_event_plane(publisher, seq, &[event]).to_vec())
        .unwrap()
}

/// Flushes the relay and tells whether its first pool holds any block.
pub(crate) async fn first_pool_holds_blocks(relay: &Relay) -> bool {
    relay.flush().await;
    relay
        .pool_reports()
        .await
        .first()
        .is_some_and(|pool| pool.resident_blocks > 0)
}

/// Subscribes to `producer` at `addr` and mirrors it until it is complete at `sequence`.
pub(crate) async fn mirror_until(
    addr: std::net::SocketAddr,
    producer: ProducerIdentity,
    sequence: u64,
) -> PoolMirror {
    let mut stream = ProbeStream::connect(
        addr,
        &request(StreamRpc::SubscribePool {
            expected_producer: producer,
            resume_from_sequence: None,
        }),
    )
    .await
    .unwrap();
    let mut mirror = PoolMirror::new(producer).unwrap();
    while mirror.words().is_none() || mirror.sequence() < sequence {
        let frame = tokio::time::timeout(DEADLINE, stream.next_frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        mirror.handle_frame(&frame).unwrap();
    }
    mirror
}

/// The producer's table and a WAN mirror of it at the same sequence. Events still in
/// flight when the table is read can move the producer on, and a coalesced delta takes
/// the mirror past the table's sequence in one step: read both again until they agree.
pub(crate) async fn mirror_at_producer(
    relay: &Relay,
    producer: ProducerIdentity,
) -> (PoolMirror, kvrelay_server::ProducerTable) {
    for _ in 0..50 {
        relay.flush().await;
        let table = relay.producer_table(&producer).await.unwrap();
        let mirror = mirror_until(relay.wan_addr(), producer, table.sequence).await;
        if mirror.sequence() == table.sequence {
            return (mirror, table);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the producer of {producer:?} never held still");
}

/// Publishes a fresh vLLM batch on every tick until the relay's first pool holds blocks;
/// PUB/SUB drops whatever is sent before the relay's subscription lands. Fails with
/// `failure` at the deadline.
pub(crate) async fn publish_until_resident(
    relay: &Relay,
    publisher: &mut PubSocket,
    feed: Feed,
    failure: &str,
) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut seq = 0u64;
    loop {
        tick.tick().await;
        assert!(tokio::time::Instant::now() < deadline, "{failure}");
        let message = match feed {
            Feed::Vllm => vllm_batch(seq),
            Feed::DynamoEventPlane { publisher, worker } => dynamo_message(publisher, worker, seq),
        };
        publisher.send(message).await.unwrap();
        seq += 1;
        if first_pool_holds_blocks(relay).await {
            break;
        }
    }
}

/// This process's resident set, in bytes (`VmRSS`). The relay under test runs in-process
/// (nextest gives each test its own process), so this is what the relay holds.
pub(crate) fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .expect("VmRSS in /proc/self/status");
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|value| value.parse().ok())
        .expect("VmRSS in kB");
    kib * 1024
}

/// This process's user plus system CPU time so far (`/proc/self/stat`, USER_HZ = 100).
pub(crate) fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after.split(' ').collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

/// Mebibytes, for reports.
pub(crate) fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// The `EventSource` and `EventChannel` records the reference runtime writes for one KV
/// event publisher of `prod/backend/generate` (worker `worker`, rank 0) on ZMQ `zmq`; a
/// file store keeps them one per file, etcd one per key. The channel carries Dynamo's event
/// plane ([`Feed::DynamoEventPlane`]).
pub(crate) fn advert_records(
    worker: u64,
    publisher: u64,
    zmq: &str,
) -> (serde_json::Value, serde_json::Value) {
    let scope = serde_json::json!({"kind": "endpoint", "endpoint": {"namespace": "prod", "component": "backend", "name": "generate"}});
    let source = serde_json::json!({
        "type": "EventSource", "scope": scope, "topic": "kv-events", "publisher_id": publisher,
        "metadata": {
            "kv_state_endpoint": scope["endpoint"],
            "worker": {"worker_id": worker, "dp_rank": 0},
            "publisher_id": publisher,
            // What a worker with its local indexer advertises (the relay does not call it).
            "recovery_target": {"component": "backend", "namespace": "prod",
                "endpoint": format!("worker_kv_query_source_{publisher:x}"),
                "instance_id": worker, "transport": {"tcp": "127.0.0.1:9/query"}}
        }
    });
    let channel = serde_json::json!({
        "type": "EventChannel", "scope": scope, "topic": "kv-events", "instance_id": publisher,
        "transport": {"kind": "Zmq", "config": {"endpoint": zmq}}
    });
    (source, channel)
}

/// One stored block from worker `0x31` (the big pool's), keyed by `id`.
pub(crate) fn big_pool_store(id: u64) -> kvrelay_ckf::RouterEvent {
    kvrelay_ckf::RouterEvent {
        source: kvrelay_ckf::SourceId::new(0x31, 0),
        event_id: id,
        payload: kvrelay_ckf::EventPayload::Stored(kvrelay_ckf::StoredBlocks {
            parent_engine_block_id: None,
            blocks: vec![kvrelay_ckf::StoredBlock {
                engine_block_id: id,
                token_hash: id.wrapping_mul(0x9e37_79b9_7f4a_7c15),
            }],
        }),
    }
}

/// Adds a pool of 3,000,000 expected blocks (worker `0x31`) to `config`'s card directory:
/// a filter of 2^20+ buckets, whose 8 MiB snapshot cannot hide in socket buffers (the
/// kernel's send buffer grows to 4 MiB at most).
pub(crate) fn add_big_pool(config: &RelayConfig) {
    let cards = config.discovery.dir.clone().unwrap();
    write_card(
        &cards,
        ("prod", "big", "generate"),
        0x31,
        "model-c",
        "aggregated",
        3_000_000,
        1,
    );
}

/// Waits for the three pools of a deployment with [`add_big_pool`] and returns the big one.
pub(crate) async fn big_pool(relay: &Relay) -> kvrelay_codec::v1::ProducerIdentity {
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(3))
        .await
        .unwrap();
    relay
        .catalog()
        .pools
        .into_iter()
        .max_by_key(|pool| pool.producer.ckf_format.bucket_count)
        .unwrap()
        .producer
}
