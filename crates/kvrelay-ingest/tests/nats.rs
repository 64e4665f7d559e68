//! Dynamo router events published on a real `nats-server` (Debian package) on a loopback
//! port are ingested in order.
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use kvrelay_ckf::{
    CacheTier, EventPayload, RemovedBlocks, SourceId, StoredBlock, StoredBlocks, TierChange,
    TierEvent,
};
use kvrelay_ingest::{
    Limits, NatsSourceConfig, RejectionKind, SourceOutput, SourceSignal, dynamo_kv_event_subject,
    spawn_nats_source,
};

/// A `nats-server` child on 127.0.0.1, killed on drop.
struct NatsServer {
    child: Child,
    url: String,
}

impl NatsServer {
    async fn start() -> Self {
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let binary = [
            "/usr/sbin/nats-server",
            "/usr/bin/nats-server",
            "nats-server",
        ]
        .into_iter()
        .find(|path| !path.starts_with('/') || std::path::Path::new(path).exists())
        .unwrap();
        let child = Command::new(binary)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| {
                panic!(
                    "cannot start nats-server ({err}); install it: apt-get install -y nats-server"
                )
            });
        let server = Self {
            child,
            url: format!("nats://127.0.0.1:{port}"),
        };
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                return server;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "nats-server not ready on port {port} within 10 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn router_events_published_on_nats_are_ingested_in_order() {
    let server = NatsServer::start().await;
    let subject = dynamo_kv_event_subject("dynamo", "backend", "generate");
    let mut source = spawn_nats_source(NatsSourceConfig {
        server: server.url.clone(),
        subject: subject.clone(),
        limits: Limits::nats(),
        lower_tiers: true,
        auth: Default::default(),
        tls: Default::default(),
    })
    .await
    .unwrap();
    let publisher = async_nats::connect(server.url.as_str()).await.unwrap();
    let payloads = [
        r#"[{"worker_id": 5, "event": {"event_id": 1, "dp_rank": 1, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 100, "tokens_hash": 200}, {"block_hash": 101, "tokens_hash": 201}]}}}}]"#,
        "not json",
        r#"{"worker_id": 5, "event": {"event_id": 2, "dp_rank": 1, "data": {"removed": {"block_hashes": [101]}}}}"#,
        // KVBM's host tier becomes a tier event; an external tier stays filtered.
        r#"{"worker_id": 5, "storage_tier": "host_pinned", "event": {"event_id": 3, "dp_rank": 1, "data": {"removed": {"block_hashes": [100]}}}}"#,
        r#"{"worker_id": 5, "storage_tier": "external", "event": {"event_id": 4, "dp_rank": 1, "data": "cleared"}}"#,
        r#"{"worker_id": 6, "event": {"event_id": 1, "data": "cleared"}}"#,
    ];
    for payload in payloads {
        publisher
            .publish(subject.clone(), Bytes::from_static(payload.as_bytes()))
            .await
            .unwrap();
    }
    publisher.flush().await.unwrap();

    let mut events = Vec::new();
    let mut tiers = Vec::new();
    while events.len() < 3 {
        let output = tokio::time::timeout(Duration::from_secs(10), source.next())
            .await
            .expect("no event from nats within 10 s")
            .expect("source stopped");
        match output {
            SourceOutput::Event(event) => events.push(event),
            SourceOutput::Tier(event) => tiers.push(event),
            SourceOutput::Signal(signal) => {
                assert!(matches!(signal, SourceSignal::Connected { .. }))
            }
            SourceOutput::Applied { seq, .. } => panic!("a NATS source reported batch {seq}"),
        }
    }
    assert_eq!(events[0].source, SourceId::new(5, 1));
    assert_eq!(
        events[0].payload,
        EventPayload::Stored(StoredBlocks {
            parent_engine_block_id: None,
            blocks: vec![
                StoredBlock {
                    engine_block_id: 100,
                    token_hash: 200
                },
                StoredBlock {
                    engine_block_id: 101,
                    token_hash: 201
                },
            ],
        })
    );
    assert!(matches!(events[1].payload, EventPayload::Removed(_)));
    assert_eq!(
        tiers,
        vec![TierEvent {
            source: SourceId::new(5, 1),
            event_id: 3,
            tier: CacheTier::Host,
            change: TierChange::Removed(RemovedBlocks {
                engine_block_ids: vec![100]
            }),
        }]
    );
    assert_eq!(events[2].source, SourceId::new(6, 0));
    assert_eq!(source.stats().rejected(RejectionKind::Malformed), 1);
    assert_eq!(
        source.stats().n_filtered,
        1,
        "the external tier is filtered"
    );
    assert!(source.shutdown().await);
}
