//! A minimal WAN client for probes, tests, the demo and benchmarks: open one stream, read
//! its messages.
//!
//! It speaks the protocol exactly like a consumer (one `StreamRequest` frame, then read
//! frames) but keeps no state beyond the receive buffer; pair it with [`crate::PoolMirror`]
//! to follow a pool. The transport is any byte stream, so callers choose plain TCP or TLS.

use std::net::SocketAddr;

use bytes::BytesMut;
use futures::StreamExt;
use kvrelay_codec::framing::{FramingError, RawFrameCodec};
use kvrelay_codec::v1::{DecodeError, EncodeError, Message, StreamRequest, encode_message};
use kvrelay_codec::{FrameError, RawFrame};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::codec::FramedRead;

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
    /// The codec's frame adapter over the transport (the receive buffer lives in it).
    frames: FramedRead<T, RawFrameCodec>,
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
            frames: FramedRead::with_capacity(io, RawFrameCodec::new(limits), 64 * 1024),
        })
    }

    /// The next raw frame, or `None` when the relay closed the stream after a whole frame
    /// (closed in the middle of one is an IO error).
    pub async fn next_frame(&mut self) -> Result<Option<RawFrame>, ProbeError> {
        match self.frames.next().await {
            None => Ok(None),
            Some(Ok(frame)) => Ok(Some(frame)),
            Some(Err(FramingError::Frame(err))) => Err(err.into()),
            Some(Err(FramingError::Decode(err))) => Err(err.into()),
            Some(Err(FramingError::Io(err))) => Err(io_error(err)),
            Some(Err(other)) => Err(ProbeError::Io {
                peer: "stream".to_owned(),
                message: other.to_string(),
            }),
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
        self.frames
            .get_mut()
            .write_all(bytes)
            .await
            .map_err(io_error)
    }
}

fn io_error(err: std::io::Error) -> ProbeError {
    ProbeError::Io {
        peer: "stream".to_owned(),
        message: err.to_string(),
    }
}
