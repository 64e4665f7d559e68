//! Message bodies: bincode 2 (serde, standard config, varints, little-endian) with a size
//! limit, and the decode and encode errors of every message.

use bytes::{BufMut, BytesMut};
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::cbi1::Cbi1Error;
use crate::frame::{self, FrameError, MessageKind};
use crate::limits::DEFAULT_MAX_FRAME_LEN;

use super::code::ErrorReason;

/// Upper bound bincode may claim for collections while decoding, in bytes: the default
/// frame limit. A body can never be longer than its frame, so a declared collection larger
/// than this is refused before bincode reserves memory for it; a few legitimate bodies
/// (a catalog, a load window) claim far less.
const BODY_LIMIT: usize = DEFAULT_MAX_FRAME_LEN as usize;

type BodyConfig = bincode::config::Configuration<
    bincode::config::LittleEndian,
    bincode::config::Varint,
    bincode::config::Limit<BODY_LIMIT>,
>;

fn config() -> BodyConfig {
    bincode::config::standard().with_limit::<BODY_LIMIT>()
}

/// A frame or body that cannot be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The frame header is not acceptable (ends the stream).
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// A message kind this version does not know (the frame was consumed; a client may
    /// skip it).
    #[error("message kind {code} is not supported")]
    UnsupportedKind {
        /// The kind code.
        code: u16,
    },
    /// The body does not decode as its kind.
    #[error("{kind} body does not decode: {detail}")]
    Body {
        /// Message kind name.
        kind: &'static str,
        /// The decoder's explanation.
        detail: String,
    },
    /// Bytes follow the body of a frame from a sender of our minor version or older.
    #[error("{kind} body has {extra} trailing bytes")]
    TrailingBytes {
        /// Message kind name.
        kind: &'static str,
        /// How many bytes.
        extra: usize,
    },
    /// A stream request names an rpc this version does not know.
    #[error("stream request rpc {code} is not supported")]
    UnsupportedRpc {
        /// The rpc code.
        code: u32,
    },
    /// A stream request whose rpc and arguments disagree.
    #[error("stream request rpc {rpc}: {detail}")]
    RpcArguments {
        /// The rpc code.
        rpc: u32,
        /// What is missing or extra.
        detail: &'static str,
    },
    /// A pool frame whose metadata checksum does not match.
    #[error("pool frame metadata checksum {declared:#010x} does not match {computed:#010x}")]
    PoolFrameChecksum {
        /// Checksum in the frame.
        declared: u32,
        /// Checksum of the received metadata.
        computed: u32,
    },
    /// A pool frame whose metadata length runs past the body.
    #[error("pool frame metadata length {meta_len} exceeds body length {body_len}")]
    PoolFrameMeta {
        /// Declared metadata length.
        meta_len: u64,
        /// Body length.
        body_len: usize,
    },
}

impl DecodeError {
    /// True when the input is well formed for a newer peer (unknown message kind or rpc).
    pub fn is_unsupported(&self) -> bool {
        matches!(
            self,
            DecodeError::UnsupportedKind { .. } | DecodeError::UnsupportedRpc { .. }
        )
    }

    /// The wire reason a relay answers with when a client's frame fails to decode.
    pub fn reason(&self) -> ErrorReason {
        match self {
            DecodeError::Frame(
                FrameError::ContractMismatch { .. } | FrameError::BadMagic { .. },
            ) => ErrorReason::ContractMismatch,
            DecodeError::Frame(FrameError::TooLong { .. }) => ErrorReason::ResourceLimit,
            DecodeError::UnsupportedKind { .. } | DecodeError::UnsupportedRpc { .. } => {
                ErrorReason::UnsupportedFeature
            }
            _ => ErrorReason::InvalidRequest,
        }
    }
}

/// A message that cannot be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The frame would exceed the frame limit.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The CBI1 payload cannot be built.
    #[error(transparent)]
    Cbi1(#[from] Cbi1Error),
    /// The body does not serialise.
    #[error("{kind} body does not encode: {detail}")]
    Body {
        /// Message kind name.
        kind: &'static str,
        /// The encoder's explanation.
        detail: String,
    },
}

/// Appends `value` as bincode to `dst`.
pub(crate) fn encode_body<T: Serialize>(
    kind: MessageKind,
    value: &T,
    dst: &mut BytesMut,
) -> Result<(), EncodeError> {
    let mut writer = dst.writer();
    bincode::serde::encode_into_std_write(value, &mut writer, config())
        .map(|_| ())
        .map_err(|err| EncodeError::Body {
            kind: kind.name(),
            detail: err.to_string(),
        })
}

/// Decodes `body` as one `T`. Trailing bytes are an error unless the sender's minor
/// version is newer than ours (newer minors may append fields).
pub(crate) fn decode_body<T: DeserializeOwned>(
    kind: MessageKind,
    body: &[u8],
    minor: u16,
) -> Result<T, DecodeError> {
    let (value, used) = decode_prefix(kind, body)?;
    if used != body.len() && !frame::is_newer_minor(minor) {
        return Err(DecodeError::TrailingBytes {
            kind: kind.name(),
            extra: body.len() - used,
        });
    }
    Ok(value)
}

/// Decodes the fields a minor version appended to a message (`T`, added in minor
/// `since`) from `rest`, the bytes after the fields of older minors. A sender older than
/// `since` wrote none (its trailing bytes are refused like any message's): `T::default()`;
/// so is an empty `rest` (a sender that wrote nothing after the older fields).
pub(crate) fn decode_appended<T: DeserializeOwned + Default>(
    kind: MessageKind,
    rest: &[u8],
    minor: u16,
    since: u16,
) -> Result<T, DecodeError> {
    if minor < since || rest.is_empty() {
        decode_body::<()>(kind, rest, minor)?;
        Ok(T::default())
    } else {
        decode_body(kind, rest, minor)
    }
}

/// [`decode_appended`] for a field that more appended fields may follow: decodes it from
/// the front of `rest` and says how many bytes it used (0 when the sender is older than
/// `since`, or wrote nothing after the older fields: `T::default()`). The caller checks
/// what is left with the next field's [`decode_appended`].
pub(crate) fn decode_appended_prefix<T: DeserializeOwned + Default>(
    kind: MessageKind,
    rest: &[u8],
    minor: u16,
    since: u16,
) -> Result<(T, usize), DecodeError> {
    if minor < since || rest.is_empty() {
        return Ok((T::default(), 0));
    }
    decode_prefix(kind, rest)
}

/// Decodes one `T` from the front of `body`, returning it and the bytes it used.
pub(crate) fn decode_prefix<T: DeserializeOwned>(
    kind: MessageKind,
    body: &[u8],
) -> Result<(T, usize), DecodeError> {
    bincode::serde::decode_from_slice(body, config()).map_err(|err| DecodeError::Body {
        kind: kind.name(),
        detail: err.to_string(),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn a_short_body_declaring_a_huge_string_is_refused_by_the_limit() {
        // 10 bytes whose varint length prefix declares a 60 MiB string: bincode must refuse
        // the claim (limit = the frame limit) instead of reserving 60 MiB and then failing
        // on the missing bytes.
        let mut body = vec![252u8];
        body.extend_from_slice(&(60u32 * 1024 * 1024).to_le_bytes());
        body.extend_from_slice(&[0; 5]);
        let err = decode_prefix::<String>(MessageKind::StreamRequest, &body).unwrap_err();
        let DecodeError::Body { detail, .. } = err else {
            panic!("unexpected error {err:?}");
        };
        assert!(detail.to_lowercase().contains("limit"), "{detail}");
    }
}
