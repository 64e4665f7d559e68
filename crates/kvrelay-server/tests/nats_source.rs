//! A relay fed by Dynamo router events on a real `nats-server` (Debian package) on a
//! loopback port: the endpoint's KV-event subject becomes filter content a WAN replica sees.

use crate::support;

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use kvrelay_server::{NatsConfig, Relay};
use support::{DEADLINE, first_pool_holds_blocks, mirror_at_producer, single_worker};

/// A `nats-server` child on 127.0.0.1, killed on drop.
struct NatsServer {
    child: Child,
    url: String,
}

impl NatsServer {
    async fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let binary = ["/usr/sbin/nats-server", "/usr/bin/nats-server"]
            .into_iter()
            .find(|path| std::path::Path::new(path).exists())
            .unwrap_or("nats-server");
        let child = Command::new(binary)
            .args(["-a", "127.0.0.1", "-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|err| {
                panic!("cannot start nats-server ({err}); apt-get install -y nats-server")
            });
        let server = Self {
            child,
            url: format!("nats://127.0.0.1:{port}"),
        };
        let mut probe = tokio::time::interval(Duration::from_millis(20));
        let ready = tokio::time::timeout(DEADLINE, async {
            loop {
                probe.tick().await;
                if tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
                {
                    return;
                }
            }
        });
        ready.await.expect("nats-server ready within the deadline");
        server
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamo_events_on_nats_reach_a_wan_replica() {
    let server = NatsServer::start().await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = single_worker(dir.path(), "dc-nats", "dynamo");
    config.nats = Some(NatsConfig::plain(server.url.clone()));
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .unwrap();

    // The relay subscribes after the pool attaches; publish on every tick until it lands.
    let publisher = async_nats::connect(server.url.as_str()).await.unwrap();
    let subject = kvrelay_ingest::dynamo_kv_event_subject("dynamo", "backend", "generate");
    let deadline = tokio::time::Instant::now() + DEADLINE;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let mut event_id = 0u64;
    loop {
        tick.tick().await;
        assert!(
            tokio::time::Instant::now() < deadline,
            "no NATS event reached the pool"
        );
        event_id += 1;
        let payload = format!(
            r#"{{"worker_id": 17, "event": {{"event_id": {event_id}, "data": {{"stored": {{"parent_hash": null, "blocks": [{{"block_hash": {block}, "tokens_hash": {hash}}}]}}}}}}}}"#,
            block = 1000 + event_id,
            hash = 77_000 + event_id,
        );
        publisher
            .publish(subject.clone(), Bytes::from(payload))
            .await
            .unwrap();
        publisher.flush().await.unwrap();
        if first_pool_holds_blocks(&relay).await {
            break;
        }
    }

    let producer = relay.catalog().pools[0].producer;
    let (mirror, table) = mirror_at_producer(&relay, producer).await;
    assert_eq!(mirror.words().unwrap(), table.words.as_slice());
    relay.shutdown().await.unwrap();
}
