//! [`Message`]: every message of protocol v1, and whole-frame encode and decode.

use bytes::BytesMut;

use super::body::{DecodeError, EncodeError};
use super::catalog::CatalogUpdate;
use super::info::{ErrorMessage, RelayInfo};
use super::load::LoadWindow;
use super::pool_frame::PoolFrame;
use super::request::StreamRequest;
use super::topology::TopologyUpdate;
use crate::frame::{self, MessageKind, RawFrame};
use crate::limits::Limits;

/// One message of protocol v1.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// Client → relay: open a stream.
    StreamRequest(StreamRequest),
    /// Relay → client: identity and version.
    RelayInfo(RelayInfo),
    /// Relay → client: the complete catalog.
    CatalogUpdate(CatalogUpdate),
    /// Relay → client: a complete load window.
    LoadWindow(LoadWindow),
    /// Relay → client: the complete topology.
    TopologyUpdate(TopologyUpdate),
    /// Relay → client: a snapshot chunk, delta or heartbeat.
    PoolFrame(PoolFrame),
    /// Relay → client: the stream ends with this error.
    Error(ErrorMessage),
}

impl Message {
    /// The message kind.
    pub fn kind(&self) -> MessageKind {
        match self {
            Message::StreamRequest(_) => MessageKind::StreamRequest,
            Message::RelayInfo(_) => MessageKind::RelayInfo,
            Message::CatalogUpdate(_) => MessageKind::CatalogUpdate,
            Message::LoadWindow(_) => MessageKind::LoadWindow,
            Message::TopologyUpdate(_) => MessageKind::TopologyUpdate,
            Message::PoolFrame(_) => MessageKind::PoolFrame,
            Message::Error(_) => MessageKind::Error,
        }
    }

    /// Decodes a raw frame's body. An unknown kind is [`DecodeError::UnsupportedKind`].
    pub fn from_frame(frame: &RawFrame) -> Result<Message, DecodeError> {
        let kind = frame.kind().ok_or(DecodeError::UnsupportedKind {
            code: frame.kind_code,
        })?;
        let (body, minor) = (&frame.body, frame.minor);
        Ok(match kind {
            MessageKind::StreamRequest => {
                Message::StreamRequest(StreamRequest::decode_body(body, minor)?)
            }
            MessageKind::RelayInfo => Message::RelayInfo(RelayInfo::decode_body(body, minor)?),
            MessageKind::CatalogUpdate => {
                Message::CatalogUpdate(CatalogUpdate::decode_body(body, minor)?)
            }
            MessageKind::LoadWindow => Message::LoadWindow(LoadWindow::decode_body(body, minor)?),
            MessageKind::TopologyUpdate => {
                Message::TopologyUpdate(TopologyUpdate::decode_body(body, minor)?)
            }
            MessageKind::PoolFrame => Message::PoolFrame(PoolFrame::decode_body(body, minor)?),
            MessageKind::Error => Message::Error(ErrorMessage::decode_body(body, minor)?),
        })
    }

    fn encode_body(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        match self {
            Message::StreamRequest(message) => message.encode_body(dst),
            Message::RelayInfo(message) => message.encode_body(dst),
            Message::CatalogUpdate(message) => message.encode_body(dst),
            Message::LoadWindow(message) => message.encode_body(dst),
            Message::TopologyUpdate(message) => message.encode_body(dst),
            Message::PoolFrame(message) => message.encode_body(dst),
            Message::Error(message) => message.encode_body(dst),
        }
    }
}

/// Appends `message` as one frame to `dst`. On error `dst` is unchanged.
///
/// ```
/// use bytes::BytesMut;
/// use kvrelay_codec::Limits;
/// use kvrelay_codec::v1::{self, ErrorMessage, ErrorReason, Message};
///
/// let limits = Limits::default();
/// let sent = Message::Error(ErrorMessage::new(ErrorReason::PoolNotFound, "pool 3f2a.. is gone"));
/// let mut buf = BytesMut::new();
/// v1::encode_message(&sent, &limits, &mut buf)?;
/// assert_eq!(v1::decode_message(&mut buf, &limits)?, Some(sent));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn encode_message(
    message: &Message,
    limits: &Limits,
    dst: &mut BytesMut,
) -> Result<(), EncodeError> {
    let start = dst.len();
    frame::put_header(dst, message.kind(), 0);
    let written = message
        .encode_body(dst)
        .and_then(|()| frame::finish_frame(dst, start, limits).map_err(EncodeError::Frame));
    if written.is_err() {
        dst.truncate(start);
    }
    written
}

/// Decodes one message from the front of `src`: `Ok(None)` while the frame is incomplete.
///
/// A frame error ends the stream. A body error consumes its frame, so a caller may report
/// it (or skip an unsupported kind) and keep reading.
pub fn decode_message(src: &mut BytesMut, limits: &Limits) -> Result<Option<Message>, DecodeError> {
    match frame::decode_frame(src, limits)? {
        None => Ok(None),
        Some(frame) => Message::from_frame(&frame).map(Some),
    }
}
