//! One WAN connection: TLS, the stream request, authentication, admission and the stream.
//!
//! A connection carries exactly one stream. The client completes TLS (if on) and sends one
//! `StreamRequest` frame within `request_timeout_ms` of accept, and nothing after it (the
//! pre-authentication reading lives in [`crate::wan::request`]); the server answers with the stream's
//! frames until the client leaves, the stream fails, or the relay shuts down. Every failure
//! the client can cause ends in one error frame (best effort) and a close, never in a panic,
//! and never touches another connection.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::StreamExt;
use kvrelay_codec::session::{WatchSession, Watched, WriteBound, accepts_coalesced_deltas};
use kvrelay_codec::v1::{ErrorMessage, ErrorReason, Message, encode_message};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::{Instant, timeout, timeout_at};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::admission::StreamKind;
use crate::limits::Limits;
use crate::metrics::{OutcomeLabel, ReasonLabel, RelayMetrics};
use crate::wan::open::{OpenedStream, StreamFeed, StreamOpener};
use crate::wan::request::read_stream_request;
use crate::wan::source::{PoolFrameStream, StreamFailure};
use kvrelay_pacing::SharedLogBudget;
use kvrelay_tls::BearerToken;
use kvrelay_tls::ServerTls;

/// Shared by every connection of one WAN server.
pub(crate) struct ConnectionContext {
    pub(crate) opener: StreamOpener,
    pub(crate) metrics: Arc<RelayMetrics>,
    pub(crate) limits: Limits,
    pub(crate) codec_limits: kvrelay_codec::Limits,
    pub(crate) tls: Option<ServerTls>,
    pub(crate) token: Option<BearerToken>,
    pub(crate) cancel: CancellationToken,
    /// Rate-limits the warnings for refused (unauthenticated) requests.
    pub(crate) refusal_log: SharedLogBudget,
}

trait WanIo: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> WanIo for T {}

/// Serves one accepted TCP connection to its end.
pub(crate) async fn serve(ctx: Arc<ConnectionContext>, tcp: TcpStream, peer: SocketAddr) {
    let _ = tcp.set_nodelay(true);
    // One budget from accept to a complete request: TLS handshake and request share it.
    let deadline = Instant::now() + ctx.limits.request_timeout();
    let io: Box<dyn WanIo> = match &ctx.tls {
        None => Box::new(tcp),
        Some(tls) => match timeout_at(deadline, tls.accept(tcp)).await {
            Ok(Ok(stream)) => Box::new(stream),
            Ok(Err(err)) => {
                debug!(%peer, error = ?err.to_string(), "tls handshake failed");
                ctx.outcome("tls_failed");
                return;
            }
            Err(_) => {
                debug!(%peer, "tls handshake timed out");
                ctx.outcome("tls_failed");
                return;
            }
        },
    };
    let (mut reader, writer) = tokio::io::split(io);
    let received = timeout_at(
        deadline,
        read_stream_request(&mut reader, ctx.limits.max_request_len),
    )
    .await;
    let mut conn = Conn {
        ctx: ctx.clone(),
        reader,
        writer,
        kind: None,
        peer,
        torn: false,
    };
    let received = match received {
        Ok(Ok(received)) => received,
        Ok(Err(failure)) => {
            ctx.outcome("bad_request");
            conn.fail(failure).await;
            return;
        }
        Err(_) => {
            ctx.outcome("bad_request");
            conn.fail(StreamFailure::new(
                ErrorReason::InvalidRequest,
                "no stream request within request_timeout_ms",
            ))
            .await;
            return;
        }
    };
    if !received.authenticated(ctx.token.as_ref()) {
        ctx.outcome("auth_failed");
        if let Some(suppressed) = ctx.refusal_log.admit(std::time::Instant::now()) {
            warn!(%peer, suppressed, "stream request refused: missing or wrong bearer token");
        }
        conn.fail(StreamFailure::new(
            ErrorReason::InvalidRequest,
            "authentication failed: missing or wrong bearer token",
        ))
        .await;
        return;
    }
    let minor = received.minor;
    let request = received.request;
    ctx.outcome("served");
    let kind = StreamKind::of(&request.rpc);
    let opened = ctx
        .opener
        .open(
            request,
            peer.ip(),
            accepts_coalesced_deltas(minor),
            &ctx.cancel,
        )
        .await;
    let result = match opened {
        Ok(opened) => {
            conn.kind = Some(kind);
            conn.serve_opened(opened).await
        }
        Err(failure) => Err(failure),
    };
    match result {
        Ok(End::PeerClosed) => debug!(%peer, "peer closed the stream"),
        Ok(End::Finished) => {
            let _ = conn.writer.shutdown().await;
        }
        Err(failure) => conn.fail(failure).await,
    }
}

/// How a stream ended without an error to report.
enum End {
    PeerClosed,
    Finished,
}

struct Conn {
    ctx: Arc<ConnectionContext>,
    reader: ReadHalf<Box<dyn WanIo>>,
    writer: WriteHalf<Box<dyn WanIo>>,
    kind: Option<StreamKind>,
    peer: SocketAddr,
    /// A write was abandoned mid-frame: nothing more may be written on this connection.
    torn: bool,
}

impl ConnectionContext {
    fn outcome(&self, outcome: &'static str) {
        self.metrics
            .connections
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }
}

impl Conn {
    /// Streams an admitted feed until the client leaves, the stream fails or the relay stops.
    async fn serve_opened(&mut self, opened: OpenedStream) -> Result<End, StreamFailure> {
        let _permit = opened.permit;
        match opened.feed {
            StreamFeed::Info(info) => {
                let frame = self.encode(&Message::RelayInfo(info))?;
                self.send(&frame, false).await?;
                Ok(End::Finished)
            }
            StreamFeed::Catalog(rx) => self.serve_watch(rx).await,
            StreamFeed::Topology(rx) => self.serve_watch(rx).await,
            StreamFeed::Load(rx) => self.serve_watch(rx).await,
            StreamFeed::Pool(stream) => self.serve_pool(stream).await,
        }
    }

    /// Drives a [`WatchSession`] (what to send and when lives there): writes what it
    /// emits, feeds it the publication's values and its heartbeat deadlines.
    async fn serve_watch<T: Watched>(
        &mut self,
        mut rx: watch::Receiver<Arc<T>>,
    ) -> Result<End, StreamFailure> {
        let now = || Instant::now().into_std();
        let current = rx.borrow_and_update().clone();
        let mut session = WatchSession::new(current, self.ctx.limits.heartbeat_interval(), now());
        let cancel = self.ctx.cancel.clone();
        let mut scratch = [0u8; 64];
        loop {
            while let Some(transmit) = session.poll_transmit() {
                let frame = self.encode(&transmit.value.to_message())?;
                self.send(&frame, transmit.heartbeat).await?;
            }
            let heartbeat = session.poll_timeout().map(Instant::from_std);
            tokio::select! {
                biased;
                () = cancel.cancelled() => {
                    return Err(StreamFailure::new(ErrorReason::PublicationUnavailable, "relay is shutting down"));
                }
                read = self.reader.read(&mut scratch) => return peer_read(read),
                changed = rx.changed() => {
                    if changed.is_err() {
                        return Err(StreamFailure::new(ErrorReason::PublicationUnavailable, "publication stopped"));
                    }
                    let next = rx.borrow_and_update().clone();
                    session.handle_value(next, now());
                }
                () = sleep_until_some(heartbeat) => session.handle_timeout(now()),
            }
        }
    }

    async fn serve_pool(&mut self, mut stream: PoolFrameStream) -> Result<End, StreamFailure> {
        let cancel = self.ctx.cancel.clone();
        let mut scratch = [0u8; 64];
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => {
                    return Err(StreamFailure::new(ErrorReason::PublicationUnavailable, "relay is shutting down"));
                }
                read = self.reader.read(&mut scratch) => return peer_read(read),
                next = stream.next() => {
                    let Some(next) = next else {
                        return Err(StreamFailure::new(ErrorReason::PublicationUnavailable, "pool publication ended"));
                    };
                    let frame = next?;
                    // A snapshot frame the client does not take within the progress
                    // timeout ends the stream without touching the pool; the write timeout
                    // does not apply to it (it would cut the client off first).
                    self.send_within(&frame.frame, frame.heartbeat, frame.write_bound()).await?;
                }
            }
        }
    }

    fn encode(&self, message: &Message) -> Result<Bytes, StreamFailure> {
        let mut frame = BytesMut::new();
        encode_message(message, &self.ctx.codec_limits, &mut frame)
            .map_err(|err| StreamFailure::new(ErrorReason::Internal, err.to_string()))?;
        Ok(frame.freeze())
    }

    async fn send(&mut self, frame: &Bytes, heartbeat: bool) -> Result<(), StreamFailure> {
        self.send_within(frame, heartbeat, WriteBound::Frame).await
    }

    async fn send_within(
        &mut self,
        frame: &Bytes,
        heartbeat: bool,
        bound: WriteBound,
    ) -> Result<(), StreamFailure> {
        let limit = match bound {
            WriteBound::Frame => self.ctx.limits.write_timeout(),
            WriteBound::SnapshotChunk => self.ctx.limits.snapshot_progress_timeout(),
        };
        // Until the write completes the connection counts as torn: a timeout (here or in a
        // caller's) abandons the frame midway.
        self.torn = true;
        let write = async {
            self.writer.write_all(frame).await?;
            self.writer.flush().await
        };
        match timeout(limit, write).await {
            Ok(Ok(())) => self.torn = false,
            Ok(Err(err)) => {
                return Err(StreamFailure::new(
                    ErrorReason::PublicationUnavailable,
                    format!("writing to {}: {err}", self.peer),
                ));
            }
            Err(_) => {
                let (reason, message) = bound.exceeded();
                return Err(StreamFailure::new(reason, message));
            }
        }
        if let Some(kind) = self.kind {
            let label = RelayMetrics::stream(kind);
            self.ctx.metrics.frames_sent.get_or_create(&label).inc();
            self.ctx
                .metrics
                .bytes_sent
                .get_or_create(&label)
                .inc_by(frame.len() as u64);
            if heartbeat {
                self.ctx.metrics.heartbeats.get_or_create(&label).inc();
            }
        }
        Ok(())
    }

    /// Sends one error frame (best effort, bounded by the write timeout) and closes.
    async fn fail(&mut self, failure: StreamFailure) {
        if failure.reason == ErrorReason::SubscriberLagged {
            if let Some(kind) = self.kind {
                self.ctx
                    .metrics
                    .subscriber_lagged
                    .get_or_create(&RelayMetrics::stream(kind))
                    .inc();
            }
            warn!(peer = %self.peer, "subscriber lagged; stream cut off");
        } else if failure.reason == ErrorReason::SnapshotProgressTimeout {
            warn!(peer = %self.peer, "snapshot made no progress; stream cut off");
        } else {
            // The message may quote peer-supplied text: `?` escapes control characters.
            debug!(peer = %self.peer, reason = %failure.reason, message = ?failure.message, "stream ended with an error");
        }
        self.ctx
            .metrics
            .errors_sent
            .get_or_create(&ReasonLabel {
                reason: failure.reason.name().unwrap_or("internal"),
            })
            .inc();
        if self.torn {
            // Part of a frame is on the wire; an error frame would read as garbage.
            let _ = timeout(self.ctx.limits.write_timeout(), self.writer.shutdown()).await;
            return;
        }
        let message = ErrorMessage::new(failure.reason, &failure.message);
        if let Ok(frame) = self.encode(&Message::Error(message)) {
            let write = async {
                self.writer.write_all(&frame).await?;
                self.writer.shutdown().await
            };
            let _ = timeout(self.ctx.limits.write_timeout(), write).await;
        }
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until_some(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// A read on a stream connection: EOF means the peer left; any byte is a protocol violation.
fn peer_read(read: std::io::Result<usize>) -> Result<End, StreamFailure> {
    match read {
        Ok(0) | Err(_) => Ok(End::PeerClosed),
        Ok(n) => Err(StreamFailure::new(
            ErrorReason::InvalidRequest,
            format!("{n} unexpected bytes after the stream request"),
        )),
    }
}
