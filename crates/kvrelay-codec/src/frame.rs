//! The outer frame: a fixed 16-byte header, then a length-delimited body.
//!
//! Layout (all integers little-endian):
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic, ASCII `KVRW` |
//! | 4 | 2 | protocol major version ([`PROTOCOL_MAJOR`]) |
//! | 6 | 2 | protocol minor version ([`PROTOCOL_MINOR`] of the sender) |
//! | 8 | 2 | message kind ([`MessageKind`] code) |
//! | 10 | 2 | flags, reserved: 0 |
//! | 12 | 4 | body length in bytes |
//!
//! Magic, major version and length keep these offsets in every future major version, so
//! a peer speaking another major version is told [`FrameError::ContractMismatch`] instead
//! of reading garbage.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::limits::Limits;

/// The frame magic, ASCII `KVRW` ("kvrelay wire").
pub const FRAME_MAGIC: [u8; 4] = *b"KVRW";

/// The protocol major version this crate speaks. Another major is a contract mismatch.
pub const PROTOCOL_MAJOR: u16 = 1;

/// The protocol minor version this crate writes. Minors only add: new message kinds, new
/// enum codes and fields appended to the end of a message body. Minor 1 added coalesced
/// deltas; minor 2 the catalog's pool coverage ([`crate::v1::PoolCoverage`]); minor 3 the
/// catalog's stalled (withheld) pools ([`crate::v1::CatalogUpdate::stalled`]); minor 4 the
/// catalog's lower-tier lanes ([`crate::v1::CatalogUpdate::tier_lanes`]).
pub const PROTOCOL_MINOR: u16 = 4;

/// Frame header length, in bytes.
pub const FRAME_HEADER_LEN: usize = 16;

/// What a frame body holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MessageKind {
    /// A client's stream request (the first and only client frame of a connection).
    StreamRequest,
    /// Relay identity and protocol version.
    RelayInfo,
    /// A complete pool catalog.
    CatalogUpdate,
    /// A complete load window.
    LoadWindow,
    /// A complete serving topology.
    TopologyUpdate,
    /// One pool frame: snapshot chunk, delta or heartbeat.
    PoolFrame,
    /// A terminal error with a machine-readable reason.
    Error,
}

impl MessageKind {
    /// Every kind this crate knows, in code order.
    pub const ALL: [MessageKind; 7] = [
        MessageKind::StreamRequest,
        MessageKind::RelayInfo,
        MessageKind::CatalogUpdate,
        MessageKind::LoadWindow,
        MessageKind::TopologyUpdate,
        MessageKind::PoolFrame,
        MessageKind::Error,
    ];

    /// The kind's wire code.
    pub fn code(self) -> u16 {
        match self {
            MessageKind::StreamRequest => 1,
            MessageKind::RelayInfo => 2,
            MessageKind::CatalogUpdate => 3,
            MessageKind::LoadWindow => 4,
            MessageKind::TopologyUpdate => 5,
            MessageKind::PoolFrame => 6,
            MessageKind::Error => 7,
        }
    }

    /// The kind for a wire code, or `None` for a code this crate does not know.
    pub fn from_code(code: u16) -> Option<MessageKind> {
        MessageKind::ALL
            .into_iter()
            .find(|kind| kind.code() == code)
    }

    /// A lowercase name for logs and JSON.
    pub fn name(self) -> &'static str {
        match self {
            MessageKind::StreamRequest => "stream_request",
            MessageKind::RelayInfo => "relay_info",
            MessageKind::CatalogUpdate => "catalog_update",
            MessageKind::LoadWindow => "load_window",
            MessageKind::TopologyUpdate => "topology_update",
            MessageKind::PoolFrame => "pool_frame",
            MessageKind::Error => "error",
        }
    }
}

/// One decoded frame whose body is not interpreted yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawFrame {
    /// The sender's protocol minor version.
    pub minor: u16,
    /// The raw message kind code; see [`MessageKind::from_code`].
    pub kind_code: u16,
    /// The body (shares the receive buffer; no copy).
    pub body: Bytes,
}

impl RawFrame {
    /// The known message kind, or `None` for an unsupported code.
    pub fn kind(&self) -> Option<MessageKind> {
        MessageKind::from_code(self.kind_code)
    }
}

/// A frame header or length that cannot be accepted. Every variant ends the stream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not [`FRAME_MAGIC`].
    #[error("frame magic {found:02x?} is not KVRW")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// The peer speaks another protocol major version.
    #[error("protocol major version {major} is not {PROTOCOL_MAJOR}")]
    ContractMismatch {
        /// The peer's major version.
        major: u16,
    },
    /// Reserved flag bits are set.
    #[error("frame flags {flags:#06x} are reserved and must be 0")]
    ReservedFlags {
        /// The flags found.
        flags: u16,
    },
    /// The declared frame length exceeds the limit.
    #[error("frame length {len} exceeds max_frame_len {max}")]
    TooLong {
        /// Declared frame length, header included.
        len: u64,
        /// The configured limit.
        max: u32,
    },
}

/// Appends one frame (header and `body`) to `dst`.
///
/// Fails without touching `dst` when the frame would exceed `limits.max_frame_len`.
pub fn encode_frame(
    kind: MessageKind,
    body: &[u8],
    limits: &Limits,
    dst: &mut BytesMut,
) -> Result<(), FrameError> {
    let len = (FRAME_HEADER_LEN + body.len()) as u64;
    check_len(len, limits)?;
    dst.reserve(FRAME_HEADER_LEN + body.len());
    put_header(dst, kind, body.len() as u32);
    dst.put_slice(body);
    Ok(())
}

/// Appends a frame header for a body of `body_len` bytes that the caller writes next.
///
/// Used by encoders that write the body in place; [`patch_body_len`] fixes the length once
/// the body is known.
pub(crate) fn put_header(dst: &mut BytesMut, kind: MessageKind, body_len: u32) {
    dst.put_slice(&FRAME_MAGIC);
    dst.put_u16_le(PROTOCOL_MAJOR);
    dst.put_u16_le(PROTOCOL_MINOR);
    dst.put_u16_le(kind.code());
    dst.put_u16_le(0);
    dst.put_u32_le(body_len);
}

/// Rewrites the body length of the frame whose header starts at `header_at` in `dst`, after
/// checking the whole frame against `limits`; on error `dst` is truncated back to
/// `header_at`.
pub(crate) fn finish_frame(
    dst: &mut BytesMut,
    header_at: usize,
    limits: &Limits,
) -> Result<(), FrameError> {
    let len = (dst.len() - header_at) as u64;
    if let Err(err) = check_len(len, limits) {
        dst.truncate(header_at);
        return Err(err);
    }
    let body_len = (len as usize - FRAME_HEADER_LEN) as u32;
    dst[header_at + 12..header_at + 16].copy_from_slice(&body_len.to_le_bytes());
    Ok(())
}

/// Decodes one frame from the front of `src`.
///
/// Returns `Ok(None)` (reserving room for the rest) while the frame is incomplete, and
/// consumes exactly one frame otherwise. The header is checked, and the declared length
/// compared with `limits.max_frame_len`, before any memory is reserved for the body.
///
/// ```
/// use bytes::BytesMut;
/// use kvrelay_codec::{Limits, MessageKind, decode_frame, encode_frame};
///
/// let limits = Limits::default();
/// let mut stream = BytesMut::new();
/// encode_frame(MessageKind::RelayInfo, b"body", &limits, &mut stream)?;
/// let mut partial = BytesMut::from(&stream[..10]);
/// assert_eq!(decode_frame(&mut partial, &limits)?, None);
/// let frame = decode_frame(&mut stream, &limits)?.expect("a whole frame");
/// assert_eq!((frame.kind(), &frame.body[..]), (Some(MessageKind::RelayInfo), &b"body"[..]));
/// # Ok::<(), kvrelay_codec::FrameError>(())
/// ```
pub fn decode_frame(src: &mut BytesMut, limits: &Limits) -> Result<Option<RawFrame>, FrameError> {
    let Some(header) = peek_header(src, limits)? else {
        src.reserve(FRAME_HEADER_LEN - src.len());
        return Ok(None);
    };
    let frame_len = FRAME_HEADER_LEN + header.body_len as usize;
    if src.len() < frame_len {
        src.reserve(frame_len - src.len());
        return Ok(None);
    }
    let mut frame = src.split_to(frame_len);
    frame.advance(FRAME_HEADER_LEN);
    Ok(Some(RawFrame {
        minor: header.minor,
        kind_code: header.kind_code,
        body: frame.freeze(),
    }))
}

/// Decodes a buffer that must hold exactly one frame (a file, a datagram).
pub fn decode_frame_exact(bytes: &[u8], limits: &Limits) -> Result<RawFrame, ExactFrameError> {
    let mut src = BytesMut::from(bytes);
    match decode_frame(&mut src, limits)? {
        None => Err(ExactFrameError::Truncated { len: bytes.len() }),
        Some(_) if !src.is_empty() => Err(ExactFrameError::TrailingBytes { extra: src.len() }),
        Some(frame) => Ok(frame),
    }
}

/// Decodes a shared buffer that must hold exactly one frame, without copying it: the
/// body is a slice of `bytes` (a frame fanned out to several subscribers, re-read by a
/// second front door).
pub fn decode_frame_shared(bytes: &Bytes, limits: &Limits) -> Result<RawFrame, ExactFrameError> {
    let Some(header) = peek_header(bytes, limits)? else {
        return Err(ExactFrameError::Truncated { len: bytes.len() });
    };
    let frame_len = FRAME_HEADER_LEN + header.body_len as usize;
    match bytes.len().cmp(&frame_len) {
        std::cmp::Ordering::Less => Err(ExactFrameError::Truncated { len: bytes.len() }),
        std::cmp::Ordering::Greater => Err(ExactFrameError::TrailingBytes {
            extra: bytes.len() - frame_len,
        }),
        std::cmp::Ordering::Equal => Ok(RawFrame {
            minor: header.minor,
            kind_code: header.kind_code,
            body: bytes.slice(FRAME_HEADER_LEN..),
        }),
    }
}

/// Why a buffer is not exactly one frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExactFrameError {
    /// The header is not acceptable.
    #[error(transparent)]
    Frame(#[from] FrameError),
    /// The buffer ends inside the frame.
    #[error("buffer of {len} bytes ends inside the frame")]
    Truncated {
        /// The buffer length.
        len: usize,
    },
    /// Bytes follow the frame.
    #[error("{extra} bytes follow the frame")]
    TrailingBytes {
        /// How many.
        extra: usize,
    },
}

/// True when a peer's minor version is newer than ours: its message bodies may carry
/// appended fields we skip.
pub(crate) fn is_newer_minor(minor: u16) -> bool {
    minor > PROTOCOL_MINOR
}

struct Header {
    minor: u16,
    kind_code: u16,
    body_len: u32,
}

fn peek_header(src: &[u8], limits: &Limits) -> Result<Option<Header>, FrameError> {
    // A short prefix that is already not our magic fails early.
    let magic_len = src.len().min(FRAME_MAGIC.len());
    if src[..magic_len] != FRAME_MAGIC[..magic_len] {
        let mut found = [0u8; 4];
        found[..magic_len].copy_from_slice(&src[..magic_len]);
        return Err(FrameError::BadMagic { found });
    }
    let Some(header) = src.get(..FRAME_HEADER_LEN) else {
        return Ok(None);
    };
    let u16_at = |at: usize| u16::from_le_bytes([header[at], header[at + 1]]);
    let major = u16_at(4);
    if major != PROTOCOL_MAJOR {
        return Err(FrameError::ContractMismatch { major });
    }
    let flags = u16_at(10);
    if flags != 0 {
        return Err(FrameError::ReservedFlags { flags });
    }
    let body_len = u32::from_le_bytes([header[12], header[13], header[14], header[15]]);
    check_len(FRAME_HEADER_LEN as u64 + u64::from(body_len), limits)?;
    Ok(Some(Header {
        minor: u16_at(6),
        kind_code: u16_at(8),
        body_len,
    }))
}

fn check_len(len: u64, limits: &Limits) -> Result<(), FrameError> {
    if len > u64::from(limits.max_frame_len) {
        return Err(FrameError::TooLong {
            len,
            max: limits.max_frame_len,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn frame_bytes(kind: MessageKind, body: &[u8]) -> BytesMut {
        let mut dst = BytesMut::new();
        encode_frame(kind, body, &Limits::default(), &mut dst).unwrap();
        dst
    }

    #[test]
    fn frame_round_trips() {
        let mut src = frame_bytes(MessageKind::CatalogUpdate, b"hello");
        let frame = decode_frame(&mut src, &Limits::default()).unwrap().unwrap();
        assert_eq!(frame.kind(), Some(MessageKind::CatalogUpdate));
        assert_eq!(frame.minor, PROTOCOL_MINOR);
        assert_eq!(&frame.body[..], b"hello");
        assert!(src.is_empty());
    }

    #[test]
    fn a_shared_frame_decodes_in_place_and_must_be_whole() {
        let whole = frame_bytes(MessageKind::PoolFrame, b"payload").freeze();
        let frame = decode_frame_shared(&whole, &Limits::default()).unwrap();
        assert_eq!(frame.kind(), Some(MessageKind::PoolFrame));
        assert_eq!(&frame.body[..], b"payload");
        // The body points into the shared buffer: no copy was made.
        assert_eq!(frame.body.as_ptr(), whole[FRAME_HEADER_LEN..].as_ptr());
        for cut in 0..whole.len() {
            assert!(
                matches!(
                    decode_frame_shared(&whole.slice(..cut), &Limits::default()),
                    Err(ExactFrameError::Truncated { .. }) | Err(ExactFrameError::Frame(_))
                ),
                "cut {cut}"
            );
        }
        let mut longer = BytesMut::from(&whole[..]);
        longer.extend_from_slice(b"x");
        assert_eq!(
            decode_frame_shared(&longer.freeze(), &Limits::default()),
            Err(ExactFrameError::TrailingBytes { extra: 1 })
        );
    }

    #[test]
    fn every_prefix_asks_for_more() {
        let whole = frame_bytes(MessageKind::Error, b"0123456789");
        for cut in 0..whole.len() {
            let mut src = BytesMut::from(&whole[..cut]);
            assert_eq!(
                decode_frame(&mut src, &Limits::default()),
                Ok(None),
                "cut {cut}"
            );
            assert_eq!(src.len(), cut);
        }
    }

    #[test]
    fn decoder_consumes_exactly_one_frame() {
        let mut src = frame_bytes(MessageKind::RelayInfo, b"a");
        src.extend_from_slice(&frame_bytes(MessageKind::LoadWindow, b"bc"));
        let first = decode_frame(&mut src, &Limits::default()).unwrap().unwrap();
        let second = decode_frame(&mut src, &Limits::default()).unwrap().unwrap();
        assert_eq!(first.kind(), Some(MessageKind::RelayInfo));
        assert_eq!(&second.body[..], b"bc");
        assert!(src.is_empty());
    }

    #[test]
    fn other_major_version_is_a_contract_mismatch() {
        let mut src = frame_bytes(MessageKind::RelayInfo, b"");
        src[4] = 2;
        assert_eq!(
            decode_frame(&mut src, &Limits::default()),
            Err(FrameError::ContractMismatch { major: 2 })
        );
    }

    #[test]
    fn wrong_magic_fails_on_the_first_byte() {
        let mut src = BytesMut::from(&b"G"[..]);
        assert_eq!(
            decode_frame(&mut src, &Limits::default()),
            Err(FrameError::BadMagic {
                found: [b'G', 0, 0, 0]
            })
        );
    }

    #[test]
    fn declared_length_over_limit_is_rejected_before_reserving() {
        let mut src = BytesMut::new();
        put_header(&mut src, MessageKind::PoolFrame, u32::MAX);
        let capacity_before = src.capacity();
        assert_eq!(
            decode_frame(&mut src, &Limits::default()),
            Err(FrameError::TooLong {
                len: u64::from(u32::MAX) + 16,
                max: crate::limits::DEFAULT_MAX_FRAME_LEN
            })
        );
        assert_eq!(src.capacity(), capacity_before);
    }

    #[test]
    fn reserved_flags_are_rejected() {
        let mut src = frame_bytes(MessageKind::RelayInfo, b"");
        src[10] = 1;
        assert_eq!(
            decode_frame(&mut src, &Limits::default()),
            Err(FrameError::ReservedFlags { flags: 1 })
        );
    }

    #[test]
    fn unknown_kind_is_a_frame_with_no_known_kind() {
        let mut src = frame_bytes(MessageKind::RelayInfo, b"x");
        src[8] = 99;
        let frame = decode_frame(&mut src, &Limits::default()).unwrap().unwrap();
        assert_eq!(frame.kind(), None);
        assert_eq!(frame.kind_code, 99);
    }

    #[test]
    fn exact_decode_rejects_trailing_bytes() {
        let mut bytes = frame_bytes(MessageKind::RelayInfo, b"x");
        bytes.put_u8(0);
        assert_eq!(
            decode_frame_exact(&bytes, &Limits::default()),
            Err(ExactFrameError::TrailingBytes { extra: 1 })
        );
    }

    #[test]
    fn encoder_refuses_a_body_over_the_limit() {
        let limits = Limits {
            max_frame_len: crate::limits::MIN_MAX_FRAME_LEN,
        };
        let body = vec![0u8; limits.max_frame_len as usize];
        let mut dst = BytesMut::new();
        assert!(matches!(
            encode_frame(MessageKind::PoolFrame, &body, &limits, &mut dst),
            Err(FrameError::TooLong { .. })
        ));
        assert!(dst.is_empty());
    }
}
