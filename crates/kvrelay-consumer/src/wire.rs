//! One WAN stream: a stream request, then the relay's messages. On kvrelay's protocol a
//! stream is a TCP (or TLS over TCP) connection carrying one request, then frames; on
//! Dynamo's relay contract it is one gRPC call on the relay's shared HTTP/2 connection,
//! opened and read back as the same v1 messages by `kvrelay_dynamo::client`. Everything
//! above this module is the same for both.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::BytesMut;
use futures::StreamExt;
use kvrelay_codec::Limits as CodecLimits;
use kvrelay_codec::framing::{FramingError, MessageCodec};
use kvrelay_codec::v1::{DecodeError, Message, StreamRequest, StreamRpc, encode_message};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::FramedRead;

use kvrelay_tls::{BearerToken, RelayConnector};
use tonic::transport::Channel;

use crate::config::RelayProtocol;
use crate::metrics::{Counter, MetricsRecorder};

/// How to reach one relay: its address, TLS connector, token and protocol, loaded once at
/// start.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    pub(crate) addr: String,
    pub(crate) tls: Option<RelayConnector>,
    pub(crate) token: Option<BearerToken>,
    pub(crate) protocol: RelayProtocol,
    /// The relay's one HTTP/2 connection (Dynamo's contract), made on first use and shared
    /// by every stream to the relay.
    pub(crate) channel: Arc<OnceLock<Channel>>,
}

impl Endpoint {
    /// The relay's gRPC channel (connected lazily; reconnects by itself).
    fn channel(&self, connect_timeout: Duration) -> Result<Channel, WireError> {
        if let Some(channel) = self.channel.get() {
            return Ok(channel.clone());
        }
        let addr = self.addr.clone();
        let uri = format!("http://{addr}");
        let builder = tonic::transport::Endpoint::from_shared(uri)
            .map_err(|err| WireError::Encode {
                addr: addr.clone(),
                detail: err.to_string(),
            })?
            .connect_timeout(connect_timeout);
        let channel = match &self.tls {
            None => builder.connect_lazy(),
            Some(tls) => {
                let tls = tls.clone();
                builder.connect_with_connector_lazy(tower::service_fn(
                    move |_: tonic::transport::Uri| {
                        let (tls, addr) = (tls.clone(), addr.clone());
                        async move {
                            let socket = TcpStream::connect(&addr).await?;
                            let _ = socket.set_nodelay(true);
                            let stream = tls.connect(socket).await?;
                            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
                        }
                    },
                ))
            }
        };
        Ok(self.channel.get_or_init(|| channel).clone())
    }
}

/// A plaintext or TLS socket.
trait Socket: AsyncRead + AsyncWrite + Unpin + Send + Sync {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send + Sync> Socket for T {}

/// Why a stream could not be opened or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum WireError {
    /// Connecting timed out.
    #[error("connecting to relay {addr} timed out after {timeout:?}")]
    ConnectTimeout { addr: String, timeout: Duration },
    /// The TLS handshake failed (untrusted or mismatched certificate, refused client
    /// certificate, or a peer that does not speak TLS).
    #[error("relay {addr}: TLS handshake failed: {source}")]
    Tls {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// The socket failed.
    #[error("relay {addr}: {source}")]
    Io {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    /// The request could not be encoded.
    #[error("relay {addr}: cannot encode request: {detail}")]
    Encode { addr: String, detail: String },
    /// A frame could not be decoded.
    #[error("relay {addr}: {source}")]
    Decode {
        addr: String,
        #[source]
        source: DecodeError,
    },
    /// A Dynamo-contract call failed in transport, or answered what kvrelay cannot take.
    #[error("relay {addr}: {source}")]
    Contract {
        addr: String,
        #[source]
        source: kvrelay_dynamo::ClientError,
    },
}

/// An open stream, on either protocol.
#[derive(Debug)]
pub(crate) enum WireStream {
    /// kvrelay's framed protocol.
    Framed(FramedStream),
    /// Dynamo's relay contract.
    Contract {
        addr: String,
        stream: kvrelay_dynamo::ContractStream,
        /// Counts the entries the contract stream leaves out.
        metrics: Arc<MetricsRecorder>,
    },
}

/// A contract call's failure as a wire error: a TLS failure inside the gRPC transport is a
/// [`WireError::Tls`], as on our own protocol (counted as a TLS failure, named so).
fn contract_error(addr: String, source: kvrelay_dynamo::ClientError) -> WireError {
    match &source {
        kvrelay_dynamo::ClientError::Transport(status) if is_tls_failure(&**status) => {
            WireError::Tls {
                addr,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    status.message().to_owned(),
                ),
            }
        }
        _ => WireError::Contract { addr, source },
    }
}

/// Whether a rustls error is anywhere in `error`'s source chain (directly, or inside an
/// I/O error, as the TLS connector reports it).
fn is_tls_failure(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        let inside_io = error
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::get_ref)
            .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some());
        if inside_io || error.downcast_ref::<rustls::Error>().is_some() {
            return true;
        }
        next = error.source();
    }
    false
}

/// An open framed stream and its receive buffer (kept across reads, so `next` is cancel
/// safe).
pub(crate) struct FramedStream {
    addr: String,
    /// The codec's `MessageCodec` over the socket: every frame is checked against the
    /// limits before its body is buffered, and the buffer survives a cancelled read.
    frames: FramedRead<Box<dyn Socket>, MessageCodec>,
}

impl std::fmt::Debug for FramedStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FramedStream")
            .field("addr", &self.addr)
            .field("buffered", &self.frames.read_buffer().len())
            .finish_non_exhaustive()
    }
}

impl WireStream {
    /// Opens a stream for `rpc` on the relay's protocol (with the endpoint's token, if any).
    pub(crate) async fn open(
        endpoint: &Endpoint,
        subscriber_id: &str,
        rpc: StreamRpc,
        max_frame_len: u32,
        connect_timeout: Duration,
        metrics: &Arc<MetricsRecorder>,
    ) -> Result<Self, WireError> {
        match endpoint.protocol {
            RelayProtocol::Kvrelay => Ok(Self::Framed(
                FramedStream::open(endpoint, subscriber_id, rpc, max_frame_len, connect_timeout)
                    .await?,
            )),
            RelayProtocol::DynamoGrpc => {
                let addr = endpoint.addr.clone();
                let channel = endpoint.channel(connect_timeout)?;
                let request = StreamRequest {
                    subscriber_id: subscriber_id.to_owned(),
                    rpc,
                    auth_token: None,
                };
                let token = endpoint.token.as_ref().map(BearerToken::secret);
                // The connect timeout bounds the call's opening (connection included).
                let opened = tokio::time::timeout(
                    connect_timeout,
                    kvrelay_dynamo::client::open(channel, token, request),
                )
                .await
                .map_err(|_| WireError::ConnectTimeout {
                    addr: addr.clone(),
                    timeout: connect_timeout,
                })?;
                match opened {
                    Ok(stream) => Ok(Self::Contract {
                        addr,
                        stream,
                        metrics: metrics.clone(),
                    }),
                    Err(source) => Err(contract_error(addr, source)),
                }
            }
        }
    }

    /// The next message, or `None` at a clean end of stream. Cancel safe.
    pub(crate) async fn next(&mut self) -> Result<Option<Message>, WireError> {
        match self {
            Self::Framed(stream) => stream.next().await,
            Self::Contract {
                addr,
                stream,
                metrics,
            } => {
                let next = stream
                    .next()
                    .await
                    .map_err(|source| contract_error(addr.clone(), source));
                let left_out = stream.take_left_out();
                if left_out > 0 {
                    metrics.add(Counter::ContractEntriesLeftOut, left_out);
                }
                next
            }
        }
    }
}

/// Connects (and, with TLS, completes the handshake); `connect_timeout` bounds both.
async fn connect(endpoint: &Endpoint) -> Result<Box<dyn Socket>, WireError> {
    let addr = &endpoint.addr;
    let socket = TcpStream::connect(addr)
        .await
        .map_err(|source| WireError::Io {
            addr: addr.clone(),
            source,
        })?;
    let _ = socket.set_nodelay(true);
    match &endpoint.tls {
        None => Ok(Box::new(socket)),
        Some(tls) => {
            let stream = tls.connect(socket).await.map_err(|source| WireError::Tls {
                addr: addr.clone(),
                source,
            })?;
            Ok(Box::new(stream))
        }
    }
}

impl FramedStream {
    /// Connects to `endpoint` and sends the stream request for `rpc` (with the
    /// endpoint's token, if any).
    async fn open(
        endpoint: &Endpoint,
        subscriber_id: &str,
        rpc: StreamRpc,
        max_frame_len: u32,
        connect_timeout: Duration,
    ) -> Result<Self, WireError> {
        let addr = endpoint.addr.as_str();
        let limits = CodecLimits { max_frame_len };
        let socket = tokio::time::timeout(connect_timeout, connect(endpoint))
            .await
            .map_err(|_| WireError::ConnectTimeout {
                addr: addr.to_owned(),
                timeout: connect_timeout,
            })??;
        let request = Message::StreamRequest(StreamRequest {
            subscriber_id: subscriber_id.to_owned(),
            rpc,
            auth_token: endpoint
                .token
                .as_ref()
                .map(|token| token.secret().to_owned()),
        });
        let mut out = BytesMut::new();
        encode_message(&request, &limits, &mut out).map_err(|err| WireError::Encode {
            addr: addr.to_owned(),
            detail: err.to_string(),
        })?;
        let mut socket = socket;
        let sent = async {
            socket.write_all(&out).await?;
            // TLS buffers writes; the request must reach the relay before we wait for
            // frames.
            socket.flush().await
        };
        sent.await.map_err(|source| io_error(addr, source))?;
        Ok(Self {
            addr: addr.to_owned(),
            frames: FramedRead::with_capacity(socket, MessageCodec::new(limits), 64 * 1024),
        })
    }

    /// The next message, or `None` at a clean end of stream. Cancel safe: bytes read
    /// before a cancellation stay buffered for the next call.
    /// A connection closed in the middle of a frame is an IO error, not a clean end.
    async fn next(&mut self) -> Result<Option<Message>, WireError> {
        let addr = &self.addr;
        match self.frames.next().await {
            None => Ok(None),
            Some(Ok(message)) => Ok(Some(message)),
            Some(Err(FramingError::Io(source))) => Err(io_error(addr, source)),
            Some(Err(FramingError::Decode(source))) => Err(WireError::Decode {
                addr: addr.clone(),
                source,
            }),
            Some(Err(FramingError::Frame(frame))) => Err(WireError::Decode {
                addr: addr.clone(),
                source: DecodeError::from(frame),
            }),
            // The message codec only decodes; any other framing failure is the
            // transport's.
            Some(Err(other)) => Err(io_error(addr, std::io::Error::other(other.to_string()))),
        }
    }
}

/// An IO failure on the connection to `addr`. With TLS 1.3 the client finishes its
/// handshake before the relay has checked the client certificate; a refusal arrives as an
/// alert on the first read or write, and is reported as a TLS failure.
fn io_error(addr: &str, source: std::io::Error) -> WireError {
    let is_tls = source
        .get_ref()
        .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some());
    let addr = addr.to_owned();
    if is_tls {
        WireError::Tls { addr, source }
    } else {
        WireError::Io { addr, source }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic, reason = "tests fail by panicking")]

    use kvrelay_codec::v1::{ErrorMessage, ErrorReason};
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    use super::*;

    fn endpoint(addr: String) -> Endpoint {
        Endpoint {
            addr,
            tls: None,
            token: None,
            protocol: RelayProtocol::Kvrelay,
            channel: Arc::new(OnceLock::new()),
        }
    }

    /// A relay on 127.0.0.1 that reads the stream request and writes `bytes`, then closes.
    async fn relay_writing(bytes: Vec<u8>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 256];
            let _ = socket.read(&mut request).await.unwrap();
            socket.write_all(&bytes).await.unwrap();
        });
        addr
    }

    fn error_frame() -> Vec<u8> {
        let mut frame = BytesMut::new();
        let message = Message::Error(ErrorMessage::new(ErrorReason::Internal, "bye"));
        encode_message(&message, &CodecLimits::default(), &mut frame).unwrap();
        frame.to_vec()
    }

    async fn open(addr: String) -> FramedStream {
        FramedStream::open(
            &endpoint(addr),
            "test",
            StreamRpc::WatchCatalog,
            1 << 20,
            Duration::from_secs(5),
        )
        .await
        .unwrap()
    }

    #[tokio::test]
    async fn a_connection_closed_mid_frame_is_an_error_not_a_clean_end() {
        let mut bytes = error_frame();
        let whole = bytes.clone();
        bytes.extend_from_slice(&whole[..whole.len() / 2]);
        let mut stream = open(relay_writing(bytes).await).await;
        assert!(matches!(stream.next().await, Ok(Some(Message::Error(_)))));
        let end = stream.next().await;
        assert!(matches!(end, Err(WireError::Io { .. })), "{end:?}");
    }

    #[tokio::test]
    async fn a_clean_close_after_whole_frames_ends_the_stream() {
        let mut stream = open(relay_writing(error_frame()).await).await;
        assert!(matches!(stream.next().await, Ok(Some(Message::Error(_)))));
        assert!(matches!(stream.next().await, Ok(None)));
    }

    #[tokio::test]
    async fn a_frame_declared_over_the_limit_is_refused_from_its_header() {
        // Only a header declaring 8 MiB: refused without waiting for (or buffering) a body.
        let mut header = error_frame()[..16].to_vec();
        header[12..16].copy_from_slice(&(8u32 << 20).to_le_bytes());
        let mut stream = open(relay_writing(header).await).await;
        let refused = stream.next().await;
        assert!(
            matches!(refused, Err(WireError::Decode { .. })),
            "{refused:?}"
        );
    }
}
