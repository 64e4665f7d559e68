//! A flood of malformed messages is counted exactly and logged a few times, not once per
//! message. (Alone in its binary: it installs the process's global log subscriber.)
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kvrelay_identity::KvQueryHashFormat;
use kvrelay_ingest::{
    CanonicalConfig, EngineKind, FaultInjection, Limits, RejectionKind, SourceState,
    ZmqSourceConfig, ZmqWire, spawn_zmq_source,
};

/// Log output captured in memory.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_malformed_messages_count_ten_thousand_and_log_a_few_lines() {
    const N: u64 = 10_000;
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .init();

    let socket = zmq::Context::new().socket(zmq::PUB).unwrap();
    socket.set_linger(0).unwrap();
    socket.set_sndhwm(1_000_000).unwrap();
    socket.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = socket.get_last_endpoint().unwrap().unwrap();
    let source = spawn_zmq_source(ZmqSourceConfig {
        worker_id: 1,
        dp_rank: 0,
        declared_ranks: 0..1,
        wire: ZmqWire::Engine(EngineKind::Vllm),
        endpoint,
        replay_endpoint: None,
        topic: String::new(),
        canonical: CanonicalConfig::new(4, KvQueryHashFormat::DynamoStandardV1),
        limits: Limits::default(),
        fault: FaultInjection::default(),
        resume_after: None,
        queue_budget: None,
    });
    for _ in 0..400 {
        if source.state() == SourceState::Connected {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    // Let the publisher register the subscription before counting on every message.
    tokio::time::sleep(Duration::from_millis(300)).await;
    for seq in 0..N {
        // 0xc1 is never valid msgpack.
        socket
            .send_multipart([&b"kv"[..], &seq.to_be_bytes()[..], &[0xc1][..]], 0)
            .unwrap();
        if seq % 1_000 == 999 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for _ in 0..400 {
        if source.stats().rejected(RejectionKind::Malformed) >= N {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!(source.stats().rejected(RejectionKind::Malformed), N);
    assert!(source.shutdown().await);
    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let rejection_lines = text.lines().filter(|l| l.contains("rejected")).count();
    assert!(
        (1..=36).contains(&rejection_lines),
        "{rejection_lines} rejection lines:\n{text}"
    );
}
