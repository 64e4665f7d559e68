//! Loopback end-to-end tests of a whole relay: discovery from a card directory, trace replay
//! into pool actors, and the WAN protocol to a probe client.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, reason = "test helpers fail loudly")]

mod support;

use kvrelay_codec::v1::{ErrorReason, Message, StreamRpc};
use kvrelay_server::{MirrorProgress, PoolMirror, ProbeStream, Relay};
use support::{DEADLINE, deployment, first_message, next, request};

#[tokio::test]
async fn replicas_equal_their_producers_after_a_workload() {
    let dir = tempfile::tempdir().unwrap();
    let relay = Relay::start(deployment(dir.path(), 400)).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(2)).await.expect("pools within the deadline");
    let addr = relay.wan_addr();

    let (_catalog_stream, first) = first_message(addr, &request(StreamRpc::WatchCatalog)).await;
    let Message::CatalogUpdate(catalog) = first else { panic!("expected a catalog, got {first:?}") };
    assert_eq!(catalog.pools.len(), 2);

    // Subscribe while the workload may still run, so deltas follow the snapshot.
    let mut followers = Vec::new();
    for pool in &catalog.pools {
        let stream = ProbeStream::connect(addr, &request(StreamRpc::SubscribePool { expected_producer: pool.producer }))
            .await
            .unwrap();
        followers.push((stream, PoolMirror::new(pool.producer).unwrap()));
    }
    tokio::time::timeout(DEADLINE, relay.workload_finished()).await.expect("workload within the deadline");
    relay.flush().await;
    for (stream, mirror) in &mut followers {
        let table = relay.producer_table(mirror.producer()).await.unwrap();
        assert!(table.words.iter().any(|word| *word != 0), "workload left pool empty");
        while mirror.words().is_none() || mirror.sequence() < table.sequence {
            let frame = tokio::time::timeout(DEADLINE, stream.next_frame()).await.expect("frame in time").unwrap().expect("open stream");
            let progress = mirror.handle_frame(&frame).unwrap();
            assert_ne!(progress, MirrorProgress::Heartbeat, "no heartbeat before catching up at the default interval");
        }
        assert_eq!(mirror.sequence(), table.sequence);
        assert_eq!(mirror.words().unwrap(), table.words.as_slice(), "replica differs from producer");
    }
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn relay_info_names_a_new_incarnation_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let config = deployment(dir.path(), 10);
    let first = Relay::start(config.clone()).await.unwrap();
    let (_, message) = first_message(first.wan_addr(), &request(StreamRpc::RelayInfo)).await;
    let Message::RelayInfo(info) = message else { panic!("expected relay info, got {message:?}") };
    assert_eq!(info.protocol_major, kvrelay_codec::PROTOCOL_MAJOR);
    assert_eq!(info.relay.relay_incarnation, first.incarnation());
    first.shutdown().await.unwrap();

    let second = Relay::start(config).await.unwrap();
    let (_, message) = first_message(second.wan_addr(), &request(StreamRpc::RelayInfo)).await;
    let Message::RelayInfo(again) = message else { panic!("expected relay info, got {message:?}") };
    assert_ne!(again.relay.relay_incarnation, info.relay.relay_incarnation);
    second.shutdown().await.unwrap();
}

#[tokio::test]
async fn streams_end_with_publication_unavailable_on_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let relay = Relay::start(deployment(dir.path(), 10)).await.unwrap();
    let (mut stream, _) = first_message(relay.wan_addr(), &request(StreamRpc::WatchTopology)).await;
    relay.shutdown().await.unwrap();
    let Some(Message::Error(error)) = next(&mut stream).await else { panic!("expected an error frame") };
    assert_eq!(error.reason, ErrorReason::PublicationUnavailable);
}
