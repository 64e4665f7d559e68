//! The publication wire codec and the WAN protocol messages.
//!
//! Owns the bytes between a relay and its consumers: the outer [`frame`] (magic, protocol
//! version, message kind, length), the [`cbi1`] bucket-image payload of pool frames (whose
//! views convert into ckf's `SnapshotChunk` and `Delta` for a `Replica`, the one owner of
//! the snapshot and sequence rules), and the [`v1`] messages.
//!
//! # Invariants
//!
//! - Pure and sans-IO: no tokio, no sockets, no clock. Plain functions encode into the
//!   caller's `BytesMut` and decode from `BytesMut`/`Bytes`. The `tokio_util::codec`
//!   Encoder/Decoder pair in `framing` (feature `framing`, off by default) only delegates.
//! - Decoders never panic on any input, return `Ok(None)` while a frame is incomplete and
//!   check every declared length against [`Limits`] before reserving memory.
//! - Validation never mutates state, and tells *malformed* data (a broken peer) from
//!   *unsupported* data (a newer peer: unknown enum code, format or version), so a consumer
//!   can quarantine one catalog entry and keep the rest.
//!
//! Start reading at [`frame::decode_frame`], [`v1::Message`] and [`cbi1::decode_cbi1`].

pub mod cbi1;
pub mod frame;
pub mod limits;
pub mod session;

pub use frame::{
    FrameError, MessageKind, PROTOCOL_MAJOR, PROTOCOL_MINOR, RawFrame, decode_frame, encode_frame,
};
pub use limits::{Limits, LimitsError};
pub mod v1;

#[cfg(feature = "framing")]
pub mod framing;
