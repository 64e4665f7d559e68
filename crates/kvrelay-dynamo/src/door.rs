//! The gRPC server of the door: the `KvEventRelay` service with gRPC health and reflection
//! (v1), the contract's message and keepalive bounds, and an optional bearer-token check.
//!
//! Sockets come from the caller already accepted, admitted and (if configured) past TLS,
//! as [`DoorIo`]: the relay's one accept loop owns connection caps and handshakes for every
//! listener it runs.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::Stream;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_util::sync::CancellationToken;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::server::Connected;
use tonic::{Request, Status};
use tonic_health::ServingStatus;

use crate::contract::{ERROR_REASON_KEY, MAX_MESSAGE_BYTES, SERVICE_NAME};
use crate::proto::kv_event_relay_server::KvEventRelayServer;
use crate::service::RelayService;

/// HTTP/2 keepalive ping interval (the contract's default).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// How long a keepalive ping may go unanswered before the connection is closed.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Any byte stream the door can serve (plain TCP or TLS).
pub trait DoorStream: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> DoorStream for T {}

/// One accepted connection, with whatever must live as long as it (its admission permit).
pub struct DoorIo {
    stream: Box<dyn DoorStream>,
    peer: SocketAddr,
    _held: Box<dyn Send + Sync>,
}

impl DoorIo {
    /// Wraps an accepted stream from `peer`; `held` is dropped when the connection closes.
    pub fn new(stream: Box<dyn DoorStream>, peer: SocketAddr, held: Box<dyn Send + Sync>) -> Self {
        Self {
            stream,
            peer,
            _held: held,
        }
    }
}

impl Connected for DoorIo {
    type ConnectInfo = SocketAddr;

    fn connect_info(&self) -> SocketAddr {
        self.peer
    }
}

impl AsyncRead for DoorIo {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_read(cx, buf)
    }
}

impl AsyncWrite for DoorIo {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().stream).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

/// Decides whether a call's metadata is authorised (the relay's bearer-token rule).
pub type Authorize = Arc<dyn Fn(&MetadataMap) -> bool + Send + Sync>;

/// Why the door stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DoorError {
    /// The reflection service could not read the embedded schema.
    #[error("gRPC reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The gRPC server failed.
    #[error("gRPC server: {0}")]
    Server(#[from] tonic::transport::Error),
}

/// Serves `service` (and health, and reflection) on `incoming` until `shutdown` fires.
///
/// Health: the overall status and `dynamo.kvrelay.v1.KvEventRelay` are `SERVING` while
/// the door runs and `NOT_SERVING` from shutdown on. Health and reflection need no token;
/// every `KvEventRelay` call does when `authorize` is set (`UNAUTHENTICATED` otherwise).
pub async fn serve<I>(
    incoming: I,
    service: RelayService,
    authorize: Option<Authorize>,
    shutdown: CancellationToken,
) -> Result<(), DoorError>
where
    I: Stream<Item = Result<DoorIo, io::Error>> + Send + 'static,
{
    let max_streams = service.settings().max_streams_per_connection.max(1);
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_service_status(SERVICE_NAME, ServingStatus::Serving)
        .await;
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(crate::proto::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let relay = KvEventRelayServer::new(service)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let check = move |request: Request<()>| match &authorize {
        Some(authorize) if !authorize(request.metadata()) => Err(unauthenticated()),
        _ => Ok(request),
    };
    let relay = InterceptedService::new(relay, check);
    let stopped = async move {
        shutdown.cancelled().await;
        reporter
            .set_service_status(SERVICE_NAME, ServingStatus::NotServing)
            .await;
        reporter
            .set_service_status("", ServingStatus::NotServing)
            .await;
    };
    tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .max_concurrent_streams(max_streams)
        .add_service(health)
        .add_service(reflection)
        .add_service(relay)
        .serve_with_incoming_shutdown(incoming, stopped)
        .await?;
    Ok(())
}

fn unauthenticated() -> Status {
    let mut status = Status::unauthenticated("missing or wrong bearer token");
    status.metadata_mut().insert(
        ERROR_REASON_KEY,
        MetadataValue::from_static("RELAY_ERROR_REASON_INVALID_REQUEST"),
    );
    status
}
