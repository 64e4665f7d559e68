//! The door over a scripted publication, on loopback: a subscriber that stops reading is
//! ended with the contract's lag status after what was already queued; shutdown ends every
//! stream with `PUBLICATION_UNAVAILABLE`; requests without the marker are refused.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail loudly"
)]

use std::net::{IpAddr, Ipv4Addr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::BytesMut;
use futures::StreamExt;
use futures::future::BoxFuture;
use kvrelay_codec::v1::{
    CkfFormat, DigestId, ErrorMessage, ErrorReason, IdentitySource, PoolFrameHeader, PoolFrameKind,
    PoolId, ProducerIdentity, RelayIdentity, StreamRequest, StreamRpc, encode_heartbeat_frame,
};
use kvrelay_dynamo::proto::kv_event_relay_client::KvEventRelayClient;
use kvrelay_dynamo::proto::{self};
use kvrelay_dynamo::{
    CONTRACT_MARKER, DoorEvent, DoorIo, DoorSettings, EncodedPoolFrame, Feed, Opened, Publication,
    RelayService,
};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

const DEADLINE: Duration = Duration::from_secs(20);

fn producer() -> ProducerIdentity {
    let digest = |byte| DigestId {
        digest: [byte; 16],
        source: IdentitySource::DefaultDerived,
    };
    ProducerIdentity {
        pool_id: PoolId {
            identity_version: 1,
            cache_semantics: digest(1),
            routing_scope: digest(2),
            dc_id: 7,
        },
        producer_incarnation: 9,
        layout_generation: 1,
        ckf_format: CkfFormat {
            format_version: 1,
            seed: 3,
            bucket_count: 1024,
            fingerprint_bits: 16,
            slots_per_bucket: 4,
        },
    }
}

fn heartbeat(sequence: u64) -> EncodedPoolFrame {
    let header = PoolFrameHeader {
        relay: RelayIdentity {
            drt_instance_id: 1,
            relay_incarnation: 2,
        },
        producer: producer(),
        base_sequence: sequence,
        sequence,
        kind: PoolFrameKind::Heartbeat,
        sent_unix_us: 0,
    };
    let mut frame = BytesMut::new();
    encode_heartbeat_frame(&header, &kvrelay_codec::Limits::default(), &mut frame).unwrap();
    EncodedPoolFrame {
        frame: frame.freeze(),
        snapshot: false,
        heartbeat: true,
    }
}

/// A publication whose pool streams send heartbeats as fast as they are taken.
#[derive(Default)]
struct Endless {
    events: Mutex<Vec<DoorEvent>>,
    /// The peer address of every opened call.
    peers: Mutex<Vec<IpAddr>>,
}

impl Publication for Endless {
    fn open(
        &self,
        request: StreamRequest,
        peer: IpAddr,
    ) -> BoxFuture<'static, Result<Opened, ErrorMessage>> {
        self.peers.lock().unwrap().push(peer);
        Box::pin(async move {
            match request.rpc {
                StreamRpc::SubscribePool { .. } => {
                    let frames = futures::stream::iter(0u64..).map(|at| Ok(heartbeat(at)));
                    Ok(Opened {
                        feed: Feed::Pool(frames.boxed()),
                        permit: Box::new(()),
                    })
                }
                _ => Err(ErrorMessage::new(
                    ErrorReason::UnsupportedFeature,
                    "not scripted",
                )),
            }
        })
    }

    fn observe(&self, event: DoorEvent) {
        self.events.lock().unwrap().push(event);
    }
}

async fn door(publication: Arc<Endless>, cancel: CancellationToken) -> KvEventRelayClient<Channel> {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let incoming = futures::stream::unfold(listener, |listener| async move {
        let accepted = listener
            .accept()
            .await
            .map(|(tcp, peer)| DoorIo::new(Box::new(tcp), peer, Box::new(())));
        Some((accepted, listener))
    });
    let settings = DoorSettings {
        heartbeat_interval: Duration::from_secs(10),
        write_timeout: Duration::from_millis(300),
        snapshot_progress_timeout: Duration::from_secs(5),
        queue_messages: 2,
        codec_limits: kvrelay_codec::Limits::default(),
        max_streams_per_connection: 16,
    };
    let service = RelayService::new(publication, settings, cancel.clone());
    tokio::spawn(kvrelay_dynamo::serve(incoming, service, None, cancel));
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    KvEventRelayClient::new(channel)
}

fn subscribe() -> proto::SubscribeKvPoolRequest {
    proto::SubscribeKvPoolRequest {
        subscriber_id: "slow".to_owned(),
        expected_producer: Some(producer().into()),
        contract_marker: CONTRACT_MARKER,
    }
}

#[tokio::test]
async fn a_subscriber_that_stops_reading_is_ended_as_lagged_after_what_was_queued() {
    let publication = Arc::new(Endless::default());
    let cancel = CancellationToken::new();
    let mut client = door(publication.clone(), cancel.clone()).await;
    let mut stream = client
        .subscribe_kv_pool(subscribe())
        .await
        .unwrap()
        .into_inner();
    let first = stream.message().await.unwrap().unwrap();
    assert_eq!(first.kind(), proto::FilterUpdateKind::Heartbeat);
    // The relay is told who asked (its per-peer admission counts by address).
    assert_eq!(
        *publication.peers.lock().unwrap(),
        [IpAddr::V4(Ipv4Addr::LOCALHOST)]
    );

    // Stop reading until the write bound (300 ms) has surely passed.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let mut received = 1u64;
    let status = loop {
        match tokio::time::timeout(DEADLINE, stream.message())
            .await
            .unwrap()
        {
            Ok(Some(update)) => {
                // What was queued arrives intact and in order.
                assert_eq!(update.sequence, received);
                received += 1;
            }
            Ok(None) => panic!("the stream ended without a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(
        status
            .metadata()
            .get(kvrelay_dynamo::ERROR_REASON_KEY)
            .and_then(|value| value.to_str().ok()),
        Some("RELAY_ERROR_REASON_SUBSCRIBER_LAGGED")
    );
    let failed = publication
        .events
        .lock()
        .unwrap()
        .iter()
        .filter(|event| {
            matches!(
                event,
                DoorEvent::Failed {
                    reason: ErrorReason::SubscriberLagged,
                    ..
                }
            )
        })
        .count();
    assert_eq!(failed, 1);
    cancel.cancel();
}

#[tokio::test]
async fn shutdown_ends_open_streams_as_publication_unavailable() {
    let publication = Arc::new(Endless::default());
    let cancel = CancellationToken::new();
    let mut client = door(publication, cancel.clone()).await;
    let mut stream = client
        .subscribe_kv_pool(subscribe())
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().unwrap();
    cancel.cancel();
    let status = loop {
        match tokio::time::timeout(DEADLINE, stream.message())
            .await
            .unwrap()
        {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the stream ended without a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert_eq!(
        status
            .metadata()
            .get(kvrelay_dynamo::ERROR_REASON_KEY)
            .and_then(|value| value.to_str().ok()),
        Some("RELAY_ERROR_REASON_PUBLICATION_UNAVAILABLE")
    );
}

#[tokio::test]
async fn a_request_without_the_marker_never_reaches_the_relay() {
    let publication = Arc::new(Endless::default());
    let cancel = CancellationToken::new();
    let mut client = door(publication.clone(), cancel.clone()).await;
    let status = client
        .subscribe_kv_pool(proto::SubscribeKvPoolRequest {
            contract_marker: 0,
            ..subscribe()
        })
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    // Counted as a refusal; nothing was opened.
    let events = publication.events.lock().unwrap().clone();
    assert_eq!(
        events,
        vec![DoorEvent::Failed {
            rpc: kvrelay_dynamo::Rpc::SubscribeKvPool,
            reason: ErrorReason::ContractMismatch
        }]
    );
    cancel.cancel();
}
