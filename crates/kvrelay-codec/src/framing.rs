//! `tokio_util::codec` adapters (feature `framing`): they only delegate to
//! [`crate::frame`] and [`crate::v1`].

use std::io;

use bytes::BytesMut;
use tokio_util::codec::{Decoder, Encoder};

use crate::frame::{self, FrameError, RawFrame};
use crate::limits::Limits;
use crate::v1::{self, DecodeError, EncodeError, Message};

/// Frames whose bodies are left undecoded.
#[derive(Debug, Clone, Default)]
pub struct RawFrameCodec {
    limits: Limits,
}

/// Whole v1 messages.
#[derive(Debug, Clone, Default)]
pub struct MessageCodec {
    limits: Limits,
}

/// A framing failure: transport IO or a codec error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FramingError {
    /// The transport failed.
    #[error("transport: {0}")]
    Io(#[from] io::Error),
    /// The frame header is not acceptable.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A message does not decode.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// A message does not encode.
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

impl RawFrameCodec {
    /// A codec with these limits.
    pub fn new(limits: Limits) -> Self {
        Self { limits }
    }
}

impl MessageCodec {
    /// A codec with these limits.
    pub fn new(limits: Limits) -> Self {
        Self { limits }
    }
}

impl Decoder for RawFrameCodec {
    type Item = RawFrame;
    type Error = FramingError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<RawFrame>, FramingError> {
        Ok(frame::decode_frame(src, &self.limits)?)
    }
}

impl Decoder for MessageCodec {
    type Item = Message;
    type Error = FramingError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Message>, FramingError> {
        Ok(v1::decode_message(src, &self.limits)?)
    }
}

impl Encoder<&Message> for MessageCodec {
    type Error = FramingError;

    fn encode(&mut self, item: &Message, dst: &mut BytesMut) -> Result<(), FramingError> {
        Ok(v1::encode_message(item, &self.limits, dst)?)
    }
}

impl Encoder<Message> for MessageCodec {
    type Error = FramingError;

    fn encode(&mut self, item: Message, dst: &mut BytesMut) -> Result<(), FramingError> {
        Ok(v1::encode_message(&item, &self.limits, dst)?)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use crate::v1::{ErrorMessage, ErrorReason};

    #[test]
    fn message_codec_delegates_both_ways() {
        let mut codec = MessageCodec::new(Limits::default());
        let sent = Message::Error(ErrorMessage::new(
            ErrorReason::SubscriberLagged,
            "queue full",
        ));
        let mut buf = BytesMut::new();
        codec.encode(&sent, &mut buf).unwrap();
        let whole = buf.clone();
        let mut partial = BytesMut::from(&whole[..whole.len() - 1]);
        assert!(codec.decode(&mut partial).unwrap().is_none());
        assert_eq!(codec.decode(&mut buf).unwrap(), Some(sent));
    }

    #[test]
    fn raw_frame_codec_reports_contract_mismatch() {
        let mut codec = RawFrameCodec::new(Limits::default());
        let mut buf = BytesMut::from(&b"KVRW\x02\x00\x00\x00\x01\x00\x00\x00\x00\x00\x00\x00"[..]);
        assert!(matches!(
            codec.decode(&mut buf),
            Err(FramingError::Frame(FrameError::ContractMismatch {
                major: 2
            }))
        ));
    }
}
