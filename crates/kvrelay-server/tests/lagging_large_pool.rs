//! A subscriber far behind on a large pool, through the real relay's hub and sockets: its
//! backlog holds more bucket images than one delta frame may carry (349,525), so the relay
//! hands it out as several coalesced deltas, each within a frame, and the replica ends
//! equal to the producer (before ckf's `StreamLimits::max_delta_images`, such a stream
//! ended with `internal`).

use crate::support;

use kvrelay_codec::v1::{Message, PoolPayload, StreamRpc};
use kvrelay_server::{PoolMirror, ProbeStream, Relay};
use support::{DEADLINE, deployment, request};

/// Blocks stored while the subscriber reads nothing: about 1 M bucket images, of which
/// socket buffers hold at most ~4 MiB (~350 k); the rest waits in the relay.
const BLOCKS_WHILE_STALLED: u64 = 1_000_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backlog_larger_than_one_frame_arrives_as_several_coalesced_deltas() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = deployment(dir.path(), 5);
    support::add_big_pool(&config);
    // Room for the whole backlog: the subscriber must lag, not be cut off.
    config.limits.subscriber_backlog_bytes = Some(64 << 20);
    let relay = Relay::start(config).await.unwrap();
    let large = support::big_pool(&relay).await;
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .unwrap();
    assert_eq!(large.ckf_format.bucket_count, 1 << 20);

    // A subscriber with a small receive buffer reads its snapshot, then stops reading.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let io = socket.connect(relay.wan_addr()).await.unwrap();
    let subscribe = request(StreamRpc::SubscribePool {
        expected_producer: large,
        resume_from_sequence: None,
    });
    let mut stream = ProbeStream::open(io, &subscribe).await.unwrap();
    let mut mirror = PoolMirror::new(large).unwrap();
    while mirror.words().is_none() {
        let frame = next_pool_frame(&mut stream).await;
        mirror.handle_pool_frame(&frame).unwrap();
    }

    // Stored while it reads nothing, then published.
    for id in 1..=BLOCKS_WHILE_STALLED {
        relay.submit(support::big_pool_store(id)).await.unwrap();
    }
    relay.flush().await;
    let table = relay.producer_table(&large).await.unwrap();

    // It reads again: every delta fits a frame, several were coalesced runs, and the
    // replica ends where the producer is.
    let (mut coalesced, mut coalesced_images, mut largest) = (0usize, 0usize, 0usize);
    while mirror.sequence() < table.sequence {
        let frame = next_pool_frame(&mut stream).await;
        if let PoolPayload::Delta(delta) = frame.check(&large).unwrap() {
            let images = delta.to_delta().images.len();
            largest = largest.max(images);
            let header = &frame.header;
            if header.sequence > header.base_sequence + 1 {
                coalesced += 1;
                coalesced_images += images;
            }
        }
        mirror.handle_pool_frame(&frame).unwrap();
    }
    eprintln!(
        "caught up through {coalesced} coalesced deltas of {coalesced_images} images, the \
         largest {largest}"
    );
    assert_eq!(mirror.sequence(), table.sequence);
    assert_eq!(mirror.words().unwrap(), table.words.as_slice());
    assert!(
        largest <= kvrelay_codec::cbi1::MAX_DELTA_IMAGES,
        "a delta of {largest} images"
    );
    // More than one frame's worth came coalesced, so it took several runs.
    assert!(
        coalesced_images > kvrelay_codec::cbi1::MAX_DELTA_IMAGES,
        "only {coalesced_images} images came coalesced ({coalesced} deltas)"
    );
    relay.shutdown().await.unwrap();
}

/// The next pool frame of `stream` (heartbeats included), within the deadline.
async fn next_pool_frame(
    stream: &mut ProbeStream<tokio::net::TcpStream>,
) -> kvrelay_codec::v1::PoolFrame {
    match tokio::time::timeout(DEADLINE, stream.next_message()).await {
        Ok(Ok(Some(Message::PoolFrame(frame)))) => frame,
        other => panic!("expected a pool frame: {other:?}"),
    }
}
