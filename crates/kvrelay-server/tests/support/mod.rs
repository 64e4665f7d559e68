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

use kvrelay_codec::v1::{Message, StreamRequest, StreamRpc};
use kvrelay_server::{ProbeStream, RelayConfig, WorkloadConfig};
use tokio::net::TcpStream;

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
