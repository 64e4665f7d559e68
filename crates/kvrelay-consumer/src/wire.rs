//! One WAN stream: a TCP (or TLS over TCP) connection carrying one stream request, then
//! server frames.

use std::time::Duration;

use bytes::BytesMut;
use kvrelay_codec::Limits as CodecLimits;
use kvrelay_codec::v1::{
    DecodeError, Message, StreamRequest, StreamRpc, decode_message, encode_message,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use kvrelay_tls::{BearerToken, RelayConnector};

/// How to reach one relay: its address, TLS connector and token, loaded once at start.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    pub(crate) addr: String,
    pub(crate) tls: Option<RelayConnector>,
    pub(crate) token: Option<BearerToken>,
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
}

/// An open stream and its receive buffer (kept across reads, so `next` is cancel safe).
pub(crate) struct WireStream {
    addr: String,
    socket: Box<dyn Socket>,
    buf: BytesMut,
    limits: CodecLimits,
}

impl std::fmt::Debug for WireStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WireStream")
            .field("addr", &self.addr)
            .field("buffered", &self.buf.len())
            .finish_non_exhaustive()
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

impl WireStream {
    /// Connects to `endpoint` and sends the stream request for `rpc` (with the
    /// endpoint's token, if any).
    pub(crate) async fn open(
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
        let mut stream = Self {
            addr: addr.to_owned(),
            socket,
            buf: BytesMut::with_capacity(64 * 1024),
            limits,
        };
        stream
            .socket
            .write_all(&out)
            .await
            .map_err(|source| stream.io(source))?;
        // TLS buffers writes; the request must reach the relay before we wait for frames.
        stream
            .socket
            .flush()
            .await
            .map_err(|source| stream.io(source))?;
        Ok(stream)
    }

    /// The next message, or `None` at a clean end of stream. Cancel safe: bytes read
    /// before a cancellation stay buffered for the next call.
    pub(crate) async fn next(&mut self) -> Result<Option<Message>, WireError> {
        loop {
            match decode_message(&mut self.buf, &self.limits) {
                Ok(Some(message)) => return Ok(Some(message)),
                Ok(None) => {}
                Err(source) => {
                    return Err(WireError::Decode {
                        addr: self.addr.clone(),
                        source,
                    });
                }
            }
            let n = self
                .socket
                .read_buf(&mut self.buf)
                .await
                .map_err(|source| self.io(source))?;
            if n == 0 {
                return Ok(None);
            }
        }
    }

    fn io(&self, source: std::io::Error) -> WireError {
        // With TLS 1.3 the client finishes its handshake before the relay has checked the
        // client certificate; a refusal arrives as an alert on the first read or write.
        let is_tls = source
            .get_ref()
            .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some());
        let addr = self.addr.clone();
        if is_tls {
            WireError::Tls { addr, source }
        } else {
            WireError::Io { addr, source }
        }
    }
}
