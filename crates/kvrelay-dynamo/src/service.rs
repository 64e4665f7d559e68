//! The `KvEventRelay` service over a relay's publication: a thin driver.
//!
//! Every request becomes a kvrelay [`StreamRequest`] (marker checked, then the same
//! `check` our own WAN door runs) and is opened through [`Publication::open`], the relay's
//! one path for admission, catalog checks and pool subscriptions. What each stream sends
//! and when comes from the same cores as the WAN door: [`WatchSession`] for catalog,
//! readiness and load, the pool hub's frames (snapshot chunks, contiguous deltas,
//! heartbeats) for pools, [`WriteBound`] for how long a write may wait. This module only
//! converts messages and moves them into the response.
//!
//! Each stream is a task that feeds a small queue the response drains. A write that waits
//! longer than its bound ends the stream with the bound's reason; a failure reaches the
//! client as the status after everything already queued, with the contract's reason
//! metadata, so a subscriber that stops reading sees `SUBSCRIBER_LAGGED` once it reads again.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{BoxStream, Stream, StreamExt};
pub use kvrelay_codec::session::EncodedPoolFrame;
use kvrelay_codec::session::{WatchSession, Watched, WriteBound};
use kvrelay_codec::v1::{
    CatalogUpdate, ErrorMessage, ErrorReason, LoadWindow, Message, RelayInfo, StreamRequest,
    StreamRpc, TopologyUpdate,
};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::contract::{self, CONTRACT_MARKER, PROTOCOL_VERSION};
use crate::proto;
use crate::proto::kv_event_relay_server::KvEventRelay;

/// Held for as long as a stream is open (an admission slot, a subscriber count).
pub type StreamPermit = Box<dyn Send + Sync>;

/// A pool subscription's frames; ends with an error, or `None` when the publication stops.
pub type PoolFeed = BoxStream<'static, Result<EncodedPoolFrame, ErrorMessage>>;

/// What an admitted request streams.
pub enum Feed {
    /// `GetRelayInfo`.
    Info(RelayInfo),
    /// `WatchKvPoolCatalog`.
    Catalog(watch::Receiver<Arc<CatalogUpdate>>),
    /// `SubscribeServingReadiness`.
    Readiness(watch::Receiver<Arc<TopologyUpdate>>),
    /// `SubscribeKvPoolLoad`.
    Load(watch::Receiver<Arc<LoadWindow>>),
    /// `SubscribeKvPool`.
    Pool(PoolFeed),
}

/// An admitted request: its feed and the permit that holds its slot.
pub struct Opened {
    /// What to stream.
    pub feed: Feed,
    /// Released when the stream ends.
    pub permit: StreamPermit,
}

/// Which RPC a [`DoorEvent`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Rpc {
    /// `GetRelayInfo`.
    GetRelayInfo,
    /// `WatchKvPoolCatalog`.
    WatchKvPoolCatalog,
    /// `SubscribeKvPool`.
    SubscribeKvPool,
    /// `SubscribeServingReadiness`.
    SubscribeServingReadiness,
    /// `SubscribeKvPoolLoad`.
    SubscribeKvPoolLoad,
}

impl Rpc {
    /// Every RPC the door serves, for metric initialisation.
    pub const ALL: [Rpc; 5] = [
        Self::GetRelayInfo,
        Self::WatchKvPoolCatalog,
        Self::SubscribeKvPool,
        Self::SubscribeServingReadiness,
        Self::SubscribeKvPoolLoad,
    ];

    /// The contract's method name, a metric label.
    pub fn label(self) -> &'static str {
        match self {
            Self::GetRelayInfo => "GetRelayInfo",
            Self::WatchKvPoolCatalog => "WatchKvPoolCatalog",
            Self::SubscribeKvPool => "SubscribeKvPool",
            Self::SubscribeServingReadiness => "SubscribeServingReadiness",
            Self::SubscribeKvPoolLoad => "SubscribeKvPoolLoad",
        }
    }
}

/// What the door reports for metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DoorEvent {
    /// A message was queued for the client.
    Sent {
        /// The RPC.
        rpc: Rpc,
        /// Encoded message bytes.
        bytes: usize,
        /// Whether it was a heartbeat.
        heartbeat: bool,
    },
    /// A request was refused or a stream ended with an error.
    Failed {
        /// The RPC.
        rpc: Rpc,
        /// Why.
        reason: ErrorReason,
    },
}

/// The relay as the door sees it. The relay implements it with the same code its own WAN
/// door uses, so both doors admit, check and subscribe by one set of rules.
pub trait Publication: Send + Sync + 'static {
    /// Admits and opens a checked request from `peer` (the pool's producer is still to be
    /// matched against the catalog: that is the relay's rule, not the door's).
    fn open(
        &self,
        request: StreamRequest,
        peer: IpAddr,
    ) -> BoxFuture<'static, Result<Opened, ErrorMessage>>;

    /// Counts what the door did.
    fn observe(&self, event: DoorEvent);
}

/// How the door paces its streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DoorSettings {
    /// Catalog and readiness are re-sent after this long without a change.
    pub heartbeat_interval: Duration,
    /// How long a message (other than a snapshot chunk) may wait for the client.
    pub write_timeout: Duration,
    /// How long a snapshot chunk may wait for the client.
    pub snapshot_progress_timeout: Duration,
    /// Messages queued per stream ahead of the client (at least 1).
    pub queue_messages: usize,
    /// The relay's frame bound, for re-reading its pool frames.
    pub codec_limits: kvrelay_codec::Limits,
    /// Concurrent calls one HTTP/2 connection may carry (at least the streams the relay
    /// admits in all, so one router's connection can follow every pool).
    pub max_streams_per_connection: u32,
}

/// The `KvEventRelay` service.
pub struct RelayService {
    publication: Arc<dyn Publication>,
    settings: DoorSettings,
    cancel: CancellationToken,
}

impl RelayService {
    /// The settings the service runs with.
    pub fn settings(&self) -> &DoorSettings {
        &self.settings
    }

    /// A service over `publication`; every stream ends with `PUBLICATION_UNAVAILABLE` once
    /// `cancel` fires.
    pub fn new(
        publication: Arc<dyn Publication>,
        settings: DoorSettings,
        cancel: CancellationToken,
    ) -> Self {
        Self {
            publication,
            settings,
            cancel,
        }
    }

    /// Checks and opens a request, counting a refusal.
    async fn open(
        &self,
        peer: IpAddr,
        marker: u32,
        subscriber_id: String,
        stream_rpc: Result<StreamRpc, ErrorMessage>,
        rpc: Rpc,
    ) -> Result<Opened, Status> {
        let opened = async {
            contract::check_marker(marker)?;
            let request = StreamRequest {
                subscriber_id,
                rpc: stream_rpc?,
                auth_token: None,
            };
            request.check()?;
            self.publication.open(request, peer).await
        };
        opened.await.map_err(|refusal| {
            self.publication.observe(DoorEvent::Failed {
                rpc,
                reason: refusal.reason,
            });
            contract::status_of(&refusal)
        })
    }

    /// Starts the task that feeds a response stream.
    fn spawn_stream<M, F>(&self, rpc: Rpc, permit: StreamPermit, pump: F) -> ResponseStream<M>
    where
        M: Send + 'static,
        F: FnOnce(Outbox<M>) -> BoxFuture<'static, Result<(), ErrorMessage>>,
    {
        let (tx, rx) = mpsc::channel(self.settings.queue_messages.max(1));
        let (end_tx, end_rx) = oneshot::channel();
        let closed = tx.clone();
        let outbox = Outbox {
            tx,
            rpc,
            publication: self.publication.clone(),
            settings: self.settings,
        };
        let publication = self.publication.clone();
        let cancel = self.cancel.clone();
        let pump = pump(outbox);
        tokio::spawn(async move {
            let _permit = permit;
            let result = tokio::select! {
                biased;
                () = cancel.cancelled() => Err(ErrorMessage::new(
                    ErrorReason::PublicationUnavailable,
                    "relay is shutting down",
                )),
                () = closed.closed() => Ok(()),
                result = pump => result,
            };
            if let Err(failure) = result {
                publication.observe(DoorEvent::Failed {
                    rpc,
                    reason: failure.reason,
                });
                let _ = end_tx.send(contract::status_of(&failure));
            }
        });
        let queued = tokio_stream::wrappers::ReceiverStream::new(rx).map(Ok);
        let end = futures::stream::once(end_rx).filter_map(|end| async move { end.ok().map(Err) });
        Box::pin(queued.chain(end))
    }
}

/// A response stream: queued messages, then the failure (if any) as the final status.
pub type ResponseStream<M> = Pin<Box<dyn Stream<Item = Result<M, Status>> + Send + 'static>>;

/// The sending half of one stream's queue.
pub struct Outbox<M> {
    tx: mpsc::Sender<M>,
    rpc: Rpc,
    publication: Arc<dyn Publication>,
    settings: DoorSettings,
}

impl<M: prost::Message + Send + 'static> Outbox<M> {
    /// Queues `message`, waiting at most `bound` for room. A client that has gone is not
    /// a failure (`Ok(false)`: stop quietly).
    async fn send(
        &self,
        message: M,
        bound: WriteBound,
        heartbeat: bool,
    ) -> Result<bool, ErrorMessage> {
        let limit = match bound {
            WriteBound::Frame => self.settings.write_timeout,
            WriteBound::SnapshotChunk => self.settings.snapshot_progress_timeout,
        };
        let bytes = message.encoded_len();
        match tokio::time::timeout(limit, self.tx.send(message)).await {
            Ok(Ok(())) => {
                self.publication.observe(DoorEvent::Sent {
                    rpc: self.rpc,
                    bytes,
                    heartbeat,
                });
                Ok(true)
            }
            Ok(Err(_closed)) => Ok(false),
            Err(_) => {
                let (reason, message) = bound.exceeded();
                Err(ErrorMessage::new(reason, message))
            }
        }
    }
}

/// Drives a [`WatchSession`]: writes what it emits, feeds it values and heartbeat deadlines.
async fn pump_watch<T, M>(
    outbox: Outbox<M>,
    mut rx: watch::Receiver<Arc<T>>,
    convert: fn(&T) -> M,
) -> Result<(), ErrorMessage>
where
    T: Watched + Send + Sync + 'static,
    M: prost::Message + Send + 'static,
{
    let current = rx.borrow_and_update().clone();
    let mut session =
        WatchSession::new(current, outbox.settings.heartbeat_interval, Instant::now());
    loop {
        while let Some(transmit) = session.poll_transmit() {
            if !outbox
                .send(
                    convert(&transmit.value),
                    WriteBound::Frame,
                    transmit.heartbeat,
                )
                .await?
            {
                return Ok(());
            }
        }
        let heartbeat = session.poll_timeout().map(tokio::time::Instant::from_std);
        tokio::select! {
            changed = rx.changed() => {
                if changed.is_err() {
                    return Err(ErrorMessage::new(ErrorReason::PublicationUnavailable, "publication stopped"));
                }
                let next = rx.borrow_and_update().clone();
                session.handle_value(next, Instant::now());
            }
            () = sleep_until_some(heartbeat) => session.handle_timeout(Instant::now()),
        }
    }
}

/// Re-reads each pool frame (header only, the CBI1 payload is shared, not copied) and
/// writes it as a `FilterUpdate`.
async fn pump_pool(
    outbox: Outbox<proto::FilterUpdate>,
    mut feed: PoolFeed,
) -> Result<(), ErrorMessage> {
    let limits = outbox.settings.codec_limits;
    while let Some(next) = feed.next().await {
        let frame = next?;
        let update = filter_update(&frame.frame, &limits)?;
        if !outbox
            .send(update, frame.write_bound(), frame.heartbeat)
            .await?
        {
            return Ok(());
        }
    }
    Err(ErrorMessage::new(
        ErrorReason::PublicationUnavailable,
        "pool publication ended",
    ))
}

/// A relay pool frame as the contract's `FilterUpdate`.
pub fn filter_update(
    frame: &Bytes,
    limits: &kvrelay_codec::Limits,
) -> Result<proto::FilterUpdate, ErrorMessage> {
    let internal = |detail: String| ErrorMessage::new(ErrorReason::Internal, &detail);
    let raw = kvrelay_codec::frame::decode_frame_shared(frame, limits)
        .map_err(|err| internal(format!("re-reading a pool frame: {err}")))?;
    match Message::from_frame(&raw) {
        Ok(Message::PoolFrame(frame)) => Ok(frame.into()),
        Ok(other) => Err(internal(format!(
            "pool stream carried a {} message",
            other.kind().name()
        ))),
        Err(err) => Err(internal(format!("re-reading a pool frame: {err}"))),
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// The peer address of a call: the door's connections carry it (`DoorIo`). A call
/// without one (a transport we did not build) is counted under the unspecified address,
/// so it shares one peer allowance instead of escaping it.
fn peer_of<T>(request: &Request<T>) -> IpAddr {
    request
        .extensions()
        .get::<SocketAddr>()
        .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), SocketAddr::ip)
}

fn unexpected_feed() -> Status {
    contract::status_of(&ErrorMessage::new(
        ErrorReason::Internal,
        "the relay opened a different stream than requested",
    ))
}

#[tonic::async_trait]
impl KvEventRelay for RelayService {
    async fn get_relay_info(
        &self,
        request: Request<proto::RelayInfoRequest>,
    ) -> Result<Response<proto::RelayInfo>, Status> {
        let peer = peer_of(&request);
        let marker = request.into_inner().contract_marker;
        // The contract's request has no subscriber id; ours requires one.
        let opened = self
            .open(
                peer,
                marker,
                "grpc-relay-info".to_owned(),
                Ok(StreamRpc::RelayInfo),
                Rpc::GetRelayInfo,
            )
            .await?;
        let Feed::Info(info) = opened.feed else {
            return Err(unexpected_feed());
        };
        let answer = proto::RelayInfo {
            protocol_version: PROTOCOL_VERSION,
            relay: Some(info.relay.into()),
            contract_marker: CONTRACT_MARKER,
        };
        self.publication.observe(DoorEvent::Sent {
            rpc: Rpc::GetRelayInfo,
            bytes: prost::Message::encoded_len(&answer),
            heartbeat: false,
        });
        Ok(Response::new(answer))
    }

    type WatchKvPoolCatalogStream = ResponseStream<proto::KvPoolCatalogUpdate>;

    async fn watch_kv_pool_catalog(
        &self,
        request: Request<proto::WatchKvPoolCatalogRequest>,
    ) -> Result<Response<Self::WatchKvPoolCatalogStream>, Status> {
        let peer = peer_of(&request);
        let request = request.into_inner();
        let opened = self
            .open(
                peer,
                request.contract_marker,
                request.subscriber_id,
                Ok(StreamRpc::WatchCatalog),
                Rpc::WatchKvPoolCatalog,
            )
            .await?;
        let Feed::Catalog(rx) = opened.feed else {
            return Err(unexpected_feed());
        };
        let stream = self.spawn_stream(Rpc::WatchKvPoolCatalog, opened.permit, move |outbox| {
            Box::pin(pump_watch(outbox, rx, |catalog: &CatalogUpdate| {
                catalog.into()
            }))
        });
        Ok(Response::new(stream))
    }

    type SubscribeKvPoolStream = ResponseStream<proto::FilterUpdate>;

    async fn subscribe_kv_pool(
        &self,
        request: Request<proto::SubscribeKvPoolRequest>,
    ) -> Result<Response<Self::SubscribeKvPoolStream>, Status> {
        let peer = peer_of(&request);
        let request = request.into_inner();
        let rpc = request
            .expected_producer
            .ok_or_else(|| {
                ErrorMessage::new(ErrorReason::InvalidRequest, "expected_producer is missing")
            })
            .and_then(|producer| {
                producer.try_into().map_err(|err: crate::ContractError| {
                    ErrorMessage::new(err.reason(), &format!("expected_producer: {err}"))
                })
            })
            .map(|expected_producer| StreamRpc::SubscribePool {
                expected_producer,
                // The contract has no resume: every pool stream starts with a snapshot.
                resume_from_sequence: None,
            });
        let opened = self
            .open(
                peer,
                request.contract_marker,
                request.subscriber_id,
                rpc,
                Rpc::SubscribeKvPool,
            )
            .await?;
        let Feed::Pool(feed) = opened.feed else {
            return Err(unexpected_feed());
        };
        let stream = self.spawn_stream(Rpc::SubscribeKvPool, opened.permit, move |outbox| {
            Box::pin(pump_pool(outbox, feed))
        });
        Ok(Response::new(stream))
    }

    type SubscribeServingReadinessStream = ResponseStream<proto::ServingReadinessUpdate>;

    async fn subscribe_serving_readiness(
        &self,
        request: Request<proto::SubscribeServingReadinessRequest>,
    ) -> Result<Response<Self::SubscribeServingReadinessStream>, Status> {
        let peer = peer_of(&request);
        let request = request.into_inner();
        let opened = self
            .open(
                peer,
                request.contract_marker,
                request.subscriber_id,
                Ok(StreamRpc::WatchTopology),
                Rpc::SubscribeServingReadiness,
            )
            .await?;
        let Feed::Readiness(rx) = opened.feed else {
            return Err(unexpected_feed());
        };
        let stream = self.spawn_stream(
            Rpc::SubscribeServingReadiness,
            opened.permit,
            move |outbox| {
                Box::pin(pump_watch(outbox, rx, |update: &TopologyUpdate| {
                    update.into()
                }))
            },
        );
        Ok(Response::new(stream))
    }

    type SubscribeKvPoolLoadStream = ResponseStream<proto::KvPoolLoadUpdate>;

    async fn subscribe_kv_pool_load(
        &self,
        request: Request<proto::SubscribeKvPoolLoadRequest>,
    ) -> Result<Response<Self::SubscribeKvPoolLoadStream>, Status> {
        let peer = peer_of(&request);
        let request = request.into_inner();
        let opened = self
            .open(
                peer,
                request.contract_marker,
                request.subscriber_id,
                Ok(StreamRpc::WatchLoad),
                Rpc::SubscribeKvPoolLoad,
            )
            .await?;
        let Feed::Load(rx) = opened.feed else {
            return Err(unexpected_feed());
        };
        let stream = self.spawn_stream(Rpc::SubscribeKvPoolLoad, opened.permit, move |outbox| {
            Box::pin(pump_watch(outbox, rx, |window: &LoadWindow| window.into()))
        });
        Ok(Response::new(stream))
    }

    type SubscribeServingLoadStream = ResponseStream<proto::ServingLoadUpdate>;

    /// kvrelay has no scheduler or frontend load to publish; a 1.6 relay answers the same.
    async fn subscribe_serving_load(
        &self,
        _request: Request<proto::SubscribeServingLoadRequest>,
    ) -> Result<Response<Self::SubscribeServingLoadStream>, Status> {
        Err(Status::unimplemented(
            "kvrelay does not publish serving load (SubscribeServingLoad)",
        ))
    }
}
