//! Hostile and mistaken clients: each gets the right error frame and a close, and nobody
//! else notices.

use crate::support;

use bytes::BytesMut;
use kvrelay_codec::v1::{ErrorReason, Message, StreamRpc, decode_message};
use kvrelay_server::{ProbeStream, Relay, RelayConfig};
use support::{DEADLINE, deployment, first_message, next, request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Writes `bytes` as a client and returns every message the relay sent before closing.
async fn send_raw(addr: std::net::SocketAddr, bytes: &[u8]) -> Vec<Message> {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    let mut received = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut received))
        .await
        .expect("relay closes in time")
        .unwrap();
    let mut buf = BytesMut::from(received.as_slice());
    let limits = kvrelay_codec::Limits::default();
    let mut messages = Vec::new();
    while let Some(message) = decode_message(&mut buf, &limits).unwrap() {
        messages.push(message);
    }
    messages
}

fn reason(messages: &[Message]) -> ErrorReason {
    match messages {
        [Message::Error(error)] => error.reason,
        other => panic!("expected exactly one error frame, got {other:?}"),
    }
}

fn header(magic: &[u8; 4], major: u16, kind: u16, body_len: u32) -> Vec<u8> {
    let mut bytes = magic.to_vec();
    bytes.extend_from_slice(&major.to_le_bytes());
    bytes.extend_from_slice(&0u16.to_le_bytes());
    bytes.extend_from_slice(&kind.to_le_bytes());
    bytes.extend_from_slice(&0u16.to_le_bytes());
    bytes.extend_from_slice(&body_len.to_le_bytes());
    bytes
}

async fn relay_with(config: impl FnOnce(&mut RelayConfig)) -> (tempfile::TempDir, Relay) {
    let dir = tempfile::tempdir().unwrap();
    let mut relay_config = deployment(dir.path(), 20);
    config(&mut relay_config);
    let relay = Relay::start(relay_config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(2))
        .await
        .unwrap();
    (dir, relay)
}

#[tokio::test]
async fn garbage_bytes_get_a_contract_mismatch() {
    let (_dir, relay) = relay_with(|_| {}).await;
    let messages = send_raw(relay.wan_addr(), b"GET / HTTP/1.1\r\nHost: relay\r\n\r\n").await;
    assert_eq!(reason(&messages), ErrorReason::ContractMismatch);
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn another_major_version_gets_a_contract_mismatch() {
    let (_dir, relay) = relay_with(|_| {}).await;
    let messages = send_raw(relay.wan_addr(), &header(b"KVRW", 2, 1, 0)).await;
    assert_eq!(reason(&messages), ErrorReason::ContractMismatch);
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn oversized_frame_is_refused_before_its_body_arrives() {
    let (_dir, relay) = relay_with(|_| {}).await;
    let messages = send_raw(relay.wan_addr(), &header(b"KVRW", 1, 1, 512 * 1024 * 1024)).await;
    assert_eq!(reason(&messages), ErrorReason::ResourceLimit);
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_first_frame_that_is_not_a_request_is_invalid() {
    let (_dir, relay) = relay_with(|_| {}).await;
    let messages = send_raw(relay.wan_addr(), &header(b"KVRW", 1, 6, 0)).await;
    assert_eq!(reason(&messages), ErrorReason::InvalidRequest);
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_silent_client_is_closed_after_the_request_timeout() {
    let (_dir, relay) = relay_with(|config| config.limits.request_timeout_ms = 200).await;
    let messages = send_raw(relay.wan_addr(), &[]).await;
    assert_eq!(reason(&messages), ErrorReason::InvalidRequest);
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn stale_and_unknown_producers_get_their_reasons() {
    let (_dir, relay) = relay_with(|_| {}).await;
    let producer = relay.catalog().pools[0].producer;

    let mut stale = producer;
    stale.layout_generation += 100;
    let (_, message) = first_message(
        relay.wan_addr(),
        &request(StreamRpc::SubscribePool {
            expected_producer: stale,
            resume_from_sequence: None,
        }),
    )
    .await;
    let Message::Error(error) = message else {
        panic!("expected an error, got {message:?}")
    };
    assert_eq!(error.reason, ErrorReason::ProducerChanged);

    let mut unknown = producer;
    unknown.pool_id.routing_scope.digest = [7; 16];
    let (_, message) = first_message(
        relay.wan_addr(),
        &request(StreamRpc::SubscribePool {
            expected_producer: unknown,
            resume_from_sequence: None,
        }),
    )
    .await;
    let Message::Error(error) = message else {
        panic!("expected an error, got {message:?}")
    };
    assert_eq!(error.reason, ErrorReason::PoolNotFound);
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn stream_limit_rejects_the_extra_stream_only() {
    let (_dir, relay) = relay_with(|config| config.limits.max_catalog_streams = 1).await;
    let addr = relay.wan_addr();
    let (mut kept, first) = first_message(addr, &request(StreamRpc::WatchCatalog)).await;
    assert!(matches!(first, Message::CatalogUpdate(_)));
    let (_, refused) = first_message(addr, &request(StreamRpc::WatchCatalog)).await;
    let Message::Error(error) = refused else {
        panic!("expected an error, got {refused:?}")
    };
    assert_eq!(error.reason, ErrorReason::ResourceLimit);
    // Other stream types are unaffected, and the admitted stream is still served.
    let (_, load) = first_message(addr, &request(StreamRpc::WatchLoad)).await;
    assert!(matches!(load, Message::LoadWindow(_)), "{load:?}");
    relay.shutdown().await.unwrap();
    let end = support::until_error(&mut kept).await;
    assert_eq!(end.reason, ErrorReason::PublicationUnavailable);
}

#[tokio::test]
async fn hostile_clients_do_not_disturb_an_open_stream() {
    let (_dir, relay) = relay_with(|_| {}).await;
    let addr = relay.wan_addr();
    let (mut watcher, first) = first_message(addr, &request(StreamRpc::WatchTopology)).await;
    assert!(matches!(first, Message::TopologyUpdate(_)));
    for garbage in [
        &b"\x00\x01\x02\x03garbage-garbage-garbage"[..],
        &header(b"KVRW", 9, 1, 0),
    ] {
        let _ = send_raw(addr, garbage).await;
    }
    // Bytes after the request are a protocol violation for that connection only.
    let mut chatty = ProbeStream::connect(addr, &request(StreamRpc::WatchCatalog))
        .await
        .unwrap();
    assert!(matches!(
        next(&mut chatty).await,
        Some(Message::CatalogUpdate(_))
    ));
    chatty.write_raw(b"more").await.unwrap();
    let error = support::until_error(&mut chatty).await;
    assert_eq!(error.reason, ErrorReason::InvalidRequest);
    // The watcher is still open and served: shutdown reaches it with its reason.
    relay.shutdown().await.unwrap();
    let end = support::until_error(&mut watcher).await;
    assert_eq!(end.reason, ErrorReason::PublicationUnavailable);
}
