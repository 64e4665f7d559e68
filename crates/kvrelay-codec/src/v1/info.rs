//! `RelayInfo` and the error frame.

use bytes::BytesMut;
use serde::{Deserialize, Serialize};

use super::body::{DecodeError, EncodeError, decode_body, encode_body};
use super::code::ErrorReason;
use super::identity::RelayIdentity;
use super::validation::ValidationError;
use crate::frame::MessageKind;
use crate::limits::MAX_ERROR_MESSAGE_LEN;

/// The relay's identity, protocol version and frame limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayInfo {
    /// Protocol major version ([`crate::PROTOCOL_MAJOR`]).
    pub protocol_major: u16,
    /// Protocol minor version the relay speaks.
    pub protocol_minor: u16,
    /// The relay process.
    pub relay: RelayIdentity,
    /// The largest frame the relay sends or accepts, in bytes.
    pub max_frame_len: u32,
}

/// A terminal error: the stream ends after it. Clients act on `reason`; `message` is for
/// people and not an API.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorMessage {
    /// The machine-readable reason.
    pub reason: ErrorReason,
    /// A lowercase diagnostic phrase (at most 4096 bytes).
    pub message: String,
}

impl RelayInfo {
    /// Appends the body to `dst`.
    pub fn encode_body(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        encode_body(MessageKind::RelayInfo, self, dst)
    }

    /// Decodes a body sent with protocol minor `minor`.
    pub fn decode_body(body: &[u8], minor: u16) -> Result<Self, DecodeError> {
        decode_body(MessageKind::RelayInfo, body, minor)
    }
}

impl ErrorMessage {
    /// An error, its message cut at a char boundary to at most 4096 bytes.
    pub fn new(reason: ErrorReason, message: &str) -> Self {
        let mut end = message.len().min(MAX_ERROR_MESSAGE_LEN);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        Self {
            reason,
            message: message[..end].to_owned(),
        }
    }

    /// Checks the reason (an unrecognized reason is unsupported: treat it as internal).
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.reason.check("reason")
    }

    /// The reason a client acts on: unrecognized reasons count as `Internal`.
    pub fn effective_reason(&self) -> ErrorReason {
        match self.reason {
            ErrorReason::Unrecognized(_) => ErrorReason::Internal,
            known => known,
        }
    }

    /// Appends the body to `dst`.
    pub fn encode_body(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        encode_body(MessageKind::Error, self, dst)
    }

    /// Decodes a body sent with protocol minor `minor`.
    pub fn decode_body(body: &[u8], minor: u16) -> Result<Self, DecodeError> {
        decode_body(MessageKind::Error, body, minor)
    }
}
