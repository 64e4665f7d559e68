//! A minimal WAN client for probes, tests, the demo and benchmarks: open one stream, read
//! its messages.
//!
//! It speaks the protocol exactly like a consumer (one `StreamRequest` frame, then read
//! frames) but keeps no state beyond the receive buffer; pair it with [`crate::PoolMirror`]
//! to follow a pool. The transport is any byte stream, so callers choose plain TCP or TLS.

use std::net::SocketAddr;

use bytes::BytesMut;
use kvrelay_codec::v1::{DecodeError, EncodeError, Message, StreamRequest, encode_message};
use kvrelay_codec::{FrameError, RawFrame, decode_frame};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// A probe stream failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProbeError {
    /// Connecting, reading or writing failed.
    #[error("probe io with {peer}: {message}")]
    Io {
        /// The relay address (or `stream`).
        peer: String,
        /// The OS error.
        message: String,
    },
    /// The request does not encode.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// A frame header is not acceptable.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A frame body does not decode.
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// One open stream.
#[derive(Debug)]
pub struct ProbeStream<T> {
    io: T,
    buf: BytesMut,
    limits: kvrelay_codec::Limits,
}

impl ProbeStream<TcpStream> {
    /// Connects over plain TCP and sends `request`.
    pub async fn connect(addr: SocketAddr, request: &StreamRequest) -> Result<Self, ProbeError> {
        let io = TcpStream::connect(addr)
            .await
            .map_err(|err| ProbeError::Io {
                peer: addr.to_string(),
                message: err.to_string(),
            })?;
        let _ = io.set_nodelay(true);
        Self::open(io, request).await
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> ProbeStream<T> {
    /// Sends `request` over an established transport.
    pub async fn open(mut io: T, request: &StreamRequest) -> Result<Self, ProbeError> {
        let limits = kvrelay_codec::Limits::default();
        let mut frame = BytesMut::new();
        encode_message(
            &Message::StreamRequest(request.clone()),
            &limits,
            &mut frame,
        )?;
        io.write_all(&frame).await.map_err(io_error)?;
        io.flush().await.map_err(io_error)?;
        Ok(Self {
            io,
            buf: BytesMut::with_capacity(64 * 1024),
            limits,
        })
    }

    /// The next raw frame, or `None` when the relay closed the stream.
    pub async fn next_frame(&mut self) -> Result<Option<RawFrame>, ProbeError> {
        loop {
            if let Some(frame) = decode_frame(&mut self.buf, &self.limits)? {
                return Ok(Some(frame));
            }
            let n = self.io.read_buf(&mut self.buf).await.map_err(io_error)?;
            if n == 0 {
                return Ok(None);
            }
        }
    }

    /// The next decoded message, or `None` when the relay closed the stream.
    pub async fn next_message(&mut self) -> Result<Option<Message>, ProbeError> {
        match self.next_frame().await? {
            None => Ok(None),
            Some(frame) => Ok(Some(Message::from_frame(&frame)?)),
        }
    }

    /// Writes raw bytes (tests of hostile clients).
    pub async fn write_raw(&mut self, bytes: &[u8]) -> Result<(), ProbeError> {
        self.io.write_all(bytes).await.map_err(io_error)
    }
}

fn io_error(err: std::io::Error) -> ProbeError {
    ProbeError::Io {
        peer: "stream".to_owned(),
        message: err.to_string(),
    }
}
