//! One WAN stream: a TCP connection carrying one stream request, then server frames.

use std::time::Duration;

use bytes::BytesMut;
use kvrelay_codec::Limits as CodecLimits;
use kvrelay_codec::v1::{
    DecodeError, Message, StreamRequest, StreamRpc, decode_message, encode_message,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Why a stream could not be opened or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum WireError {
    /// Connecting timed out.
    #[error("connecting to relay {addr} timed out after {timeout:?}")]
    ConnectTimeout { addr: String, timeout: Duration },
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
#[derive(Debug)]
pub(crate) struct WireStream {
    addr: String,
    socket: TcpStream,
    buf: BytesMut,
    limits: CodecLimits,
}

impl WireStream {
    /// Connects to `addr` and sends the stream request for `rpc`.
    pub(crate) async fn open(
        addr: &str,
        subscriber_id: &str,
        rpc: StreamRpc,
        max_frame_len: u32,
        connect_timeout: Duration,
    ) -> Result<Self, WireError> {
        let limits = CodecLimits { max_frame_len };
        let socket = tokio::time::timeout(connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| WireError::ConnectTimeout {
                addr: addr.to_owned(),
                timeout: connect_timeout,
            })?
            .map_err(|source| WireError::Io {
                addr: addr.to_owned(),
                source,
            })?;
        let _ = socket.set_nodelay(true);
        let request = Message::StreamRequest(StreamRequest {
            subscriber_id: subscriber_id.to_owned(),
            rpc,
            auth_token: None,
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
        WireError::Io {
            addr: self.addr.clone(),
            source,
        }
    }
}
