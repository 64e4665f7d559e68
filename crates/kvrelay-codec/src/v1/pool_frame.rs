//! Pool frames: snapshot chunks, deltas and heartbeats of one producer generation.
//!
//! Body: metadata length u32 LE, the bincode [`PoolFrameHeader`], a u32 LE metadata
//! checksum (low 32 bits of unseeded xxh3-64 over the frame's minor version, u16 LE, then
//! the metadata bytes), then the raw CBI1 payload to the end of the frame (empty for
//! heartbeats). With the CBI1 body checksum, every byte of a pool frame is covered. The payload is never copied by
//! the decoder, and the in-place encoders write CBI1 straight into the frame buffer.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use kvrelay_ckf::BucketImage;
use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use super::body::{DecodeError, EncodeError, decode_prefix, encode_body};
use super::code::PoolFrameKind;
use super::identity::{ProducerIdentity, RelayIdentity};
use super::validation::ValidationError;
use crate::cbi1::{self, Cbi1Error, Cbi1FrameType, Cbi1Payload, ChunkView, DeltaView};
use crate::frame::{self, MessageKind, PROTOCOL_MINOR};
use crate::limits::Limits;

/// Everything in a pool frame except the payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolFrameHeader {
    /// The relay process (must not change within a stream).
    pub relay: RelayIdentity,
    /// The producer generation (must equal the subscribed one).
    pub producer: ProducerIdentity,
    /// Chunks and heartbeats: equal to `sequence`; deltas: before `sequence` (`sequence - 1`
    /// unless the relay coalesced several deltas, protocol minor 1).
    pub base_sequence: u64,
    /// The stream sequence after this frame.
    pub sequence: u64,
    /// Snapshot chunk, delta or heartbeat.
    pub kind: PoolFrameKind,
    /// When the relay sent the frame, Unix time in µs (0 if unknown); for staleness only.
    pub sent_unix_us: u64,
}

/// A pool frame as received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolFrame {
    /// Identity, sequences and kind.
    pub header: PoolFrameHeader,
    /// The CBI1 payload (empty for heartbeats).
    pub payload: Bytes,
}

/// A pool frame that passed [`PoolFrame::check`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolPayload {
    /// One snapshot chunk at `sequence`.
    SnapshotChunk(ChunkView),
    /// One delta from `base_sequence` to `sequence`.
    Delta(DeltaView),
    /// No change; the stream is at `sequence`.
    Heartbeat,
}

/// A pool frame that breaks the stream's rules.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolFrameError {
    /// The frame's producer is not the subscribed one.
    #[error(
        "pool {}: expected producer generation {}, got {}",
        expected.pool_id,
        expected.layout_generation,
        found.layout_generation
    )]
    ProducerChanged {
        /// The subscribed producer.
        expected: Box<ProducerIdentity>,
        /// The frame's producer.
        found: Box<ProducerIdentity>,
    },
    /// The producer identity itself is not acceptable.
    #[error("pool frame producer: {0}")]
    Producer(ValidationError),
    /// A frame kind this version does not know (unsupported).
    #[error("pool frame kind {code} is not supported")]
    UnsupportedKind {
        /// The kind code.
        code: u32,
    },
    /// Sequences that do not fit the kind.
    #[error("{kind} frame with base sequence {base_sequence} and sequence {sequence}")]
    Sequence {
        /// The frame kind.
        kind: PoolFrameKind,
        /// Base sequence.
        base_sequence: u64,
        /// Sequence.
        sequence: u64,
    },
    /// A heartbeat with a payload.
    #[error("heartbeat carries a {len}-byte payload")]
    HeartbeatPayload {
        /// Payload length.
        len: usize,
    },
    /// The CBI1 payload is not acceptable.
    #[error(transparent)]
    Cbi1(#[from] Cbi1Error),
    /// The payload type disagrees with the frame kind.
    #[error("{kind} frame carries a cbi1 {payload:?} payload")]
    PayloadType {
        /// The frame kind.
        kind: PoolFrameKind,
        /// The payload type.
        payload: Cbi1FrameType,
    },
    /// The payload epoch is not the frame's sequence.
    #[error("cbi1 epoch {epoch} differs from frame sequence {sequence}")]
    Epoch {
        /// Frame sequence.
        sequence: u64,
        /// Payload epoch.
        epoch: u64,
    },
    /// The delta's base epoch is not the frame's base sequence.
    #[error("cbi1 base epoch {base_epoch} differs from frame base sequence {base_sequence}")]
    BaseEpoch {
        /// Frame base sequence.
        base_sequence: u64,
        /// Payload base epoch.
        base_epoch: u64,
    },
    /// The payload's `dc_id` is not the pool's.
    #[error("cbi1 dc_id {found:#018x} differs from the pool's dc_id {expected:#018x}")]
    DcId {
        /// The pool's.
        expected: u64,
        /// The payload's.
        found: u64,
    },
}

impl PoolFrameError {
    /// True for frames a newer producer may send (unknown kind, version or format).
    pub fn is_unsupported(&self) -> bool {
        match self {
            PoolFrameError::UnsupportedKind { .. } => true,
            PoolFrameError::Producer(err) => err.is_unsupported(),
            PoolFrameError::Cbi1(err) => err.is_unsupported(),
            _ => false,
        }
    }
}

impl PoolFrameHeader {
    /// Checks that the sequences fit the kind (no payload needed).
    pub fn check_sequences(&self) -> Result<(), PoolFrameError> {
        let fits = match self.kind {
            PoolFrameKind::SnapshotChunk | PoolFrameKind::Heartbeat => {
                self.base_sequence == self.sequence
            }
            PoolFrameKind::Delta => self.base_sequence < self.sequence,
            PoolFrameKind::Unrecognized(code) => {
                return Err(PoolFrameError::UnsupportedKind { code });
            }
        };
        if !fits {
            return Err(PoolFrameError::Sequence {
                kind: self.kind,
                base_sequence: self.base_sequence,
                sequence: self.sequence,
            });
        }
        Ok(())
    }
}

impl PoolFrame {
    /// Checks the frame against the subscribed producer and decodes its payload: producer
    /// equality, kind, sequences, CBI1 (checksum, layout, bounds), epoch, base epoch and
    /// `dc_id`. Reads only; the caller applies the result.
    pub fn check(&self, expected: &ProducerIdentity) -> Result<PoolPayload, PoolFrameError> {
        let header = &self.header;
        if header.producer != *expected {
            return Err(PoolFrameError::ProducerChanged {
                expected: Box::new(*expected),
                found: Box::new(header.producer),
            });
        }
        header
            .producer
            .validate()
            .map_err(PoolFrameError::Producer)?;
        header.check_sequences()?;
        if header.kind == PoolFrameKind::Heartbeat {
            if !self.payload.is_empty() {
                return Err(PoolFrameError::HeartbeatPayload {
                    len: self.payload.len(),
                });
            }
            return Ok(PoolPayload::Heartbeat);
        }
        let layout = header
            .producer
            .ckf_format
            .layout()
            .map_err(PoolFrameError::Producer)?;
        let payload = cbi1::decode_cbi1(&self.payload, &layout)?;
        let cbi1_header = payload.header();
        if cbi1_header.epoch != header.sequence {
            return Err(PoolFrameError::Epoch {
                sequence: header.sequence,
                epoch: cbi1_header.epoch,
            });
        }
        let dc_id = header.producer.pool_id.dc_id;
        if cbi1_header.dc_id != dc_id {
            return Err(PoolFrameError::DcId {
                expected: dc_id,
                found: cbi1_header.dc_id,
            });
        }
        match (header.kind, payload) {
            (PoolFrameKind::SnapshotChunk, Cbi1Payload::Chunk(chunk)) => {
                Ok(PoolPayload::SnapshotChunk(chunk))
            }
            (PoolFrameKind::Delta, Cbi1Payload::Delta(delta)) => {
                if delta.base_epoch() != header.base_sequence {
                    return Err(PoolFrameError::BaseEpoch {
                        base_sequence: header.base_sequence,
                        base_epoch: delta.base_epoch(),
                    });
                }
                Ok(PoolPayload::Delta(delta))
            }
            (kind, payload) => Err(PoolFrameError::PayloadType {
                kind,
                payload: payload.header().frame_type,
            }),
        }
    }

    /// Appends the body (metadata length, metadata, payload) to `dst`.
    pub fn encode_body(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        put_meta(&self.header, dst)?;
        dst.put_slice(&self.payload);
        Ok(())
    }

    /// Decodes a body; the payload shares `body`'s buffer.
    pub fn decode_body(body: &Bytes, minor: u16) -> Result<Self, DecodeError> {
        let mut rest = &body[..];
        if rest.len() < 4 {
            return Err(DecodeError::PoolFrameMeta {
                meta_len: 4,
                body_len: body.len(),
            });
        }
        let meta_len = rest.get_u32_le() as usize;
        if meta_len > rest.len() {
            return Err(DecodeError::PoolFrameMeta {
                meta_len: meta_len as u64,
                body_len: body.len(),
            });
        }
        let meta = &rest[..meta_len];
        let Some(declared) = rest.get(meta_len..meta_len + 4) else {
            return Err(DecodeError::PoolFrameMeta {
                meta_len: meta_len as u64 + 4,
                body_len: body.len(),
            });
        };
        let declared = u32::from_le_bytes([declared[0], declared[1], declared[2], declared[3]]);
        let computed = meta_checksum(minor, meta);
        if declared != computed {
            return Err(DecodeError::PoolFrameChecksum { declared, computed });
        }
        let (header, used) = decode_prefix::<PoolFrameHeader>(MessageKind::PoolFrame, meta)?;
        if used != meta_len && !frame::is_newer_minor(minor) {
            return Err(DecodeError::TrailingBytes {
                kind: MessageKind::PoolFrame.name(),
                extra: meta_len - used,
            });
        }
        Ok(Self {
            header,
            payload: body.slice(4 + meta_len + 4..),
        })
    }
}

/// Appends a whole snapshot-chunk frame, writing CBI1 chunk `chunk_index` of `table` (one
/// word per bucket) straight into `dst`. Layout, `dc_id` and epoch come from `header`.
/// On error `dst` is unchanged.
pub fn encode_chunk_frame(
    header: &PoolFrameHeader,
    table: &[u64],
    chunk_index: u32,
    limits: &Limits,
    dst: &mut BytesMut,
) -> Result<(), EncodeError> {
    let layout = precheck(header, PoolFrameKind::SnapshotChunk)?;
    in_frame(header, limits, dst, |dst| {
        cbi1::encode_snapshot_chunk(
            &layout,
            header.producer.pool_id.dc_id,
            header.sequence,
            table,
            chunk_index,
            dst,
        )
    })
}

/// Appends a whole delta frame, writing the CBI1 delta of `images` straight into `dst`.
/// On error `dst` is unchanged.
pub fn encode_delta_frame(
    header: &PoolFrameHeader,
    images: &[BucketImage],
    limits: &Limits,
    dst: &mut BytesMut,
) -> Result<(), EncodeError> {
    let layout = precheck(header, PoolFrameKind::Delta)?;
    in_frame(header, limits, dst, |dst| {
        cbi1::encode_delta(
            &layout,
            header.producer.pool_id.dc_id,
            header.base_sequence,
            header.sequence,
            images,
            dst,
        )
    })
}

/// Appends a whole heartbeat frame. On error `dst` is unchanged.
pub fn encode_heartbeat_frame(
    header: &PoolFrameHeader,
    limits: &Limits,
    dst: &mut BytesMut,
) -> Result<(), EncodeError> {
    precheck_kind(header, PoolFrameKind::Heartbeat)?;
    in_frame(header, limits, dst, |_| Ok(()))
}

fn precheck_kind(header: &PoolFrameHeader, kind: PoolFrameKind) -> Result<(), EncodeError> {
    if header.kind != kind {
        return Err(EncodeError::Body {
            kind: MessageKind::PoolFrame.name(),
            detail: format!("header kind {} used to encode a {kind}", header.kind),
        });
    }
    header.check_sequences().map_err(|err| EncodeError::Body {
        kind: MessageKind::PoolFrame.name(),
        detail: err.to_string(),
    })
}

fn precheck(
    header: &PoolFrameHeader,
    kind: PoolFrameKind,
) -> Result<cbi1::Cbi1Layout, EncodeError> {
    precheck_kind(header, kind)?;
    let format = &header.producer.ckf_format;
    let version = u16::try_from(format.format_version).unwrap_or(u16::MAX);
    cbi1::Cbi1Layout::for_format(version, format.seed, format.bucket_count)
        .map_err(EncodeError::Cbi1)
}

fn in_frame(
    header: &PoolFrameHeader,
    limits: &Limits,
    dst: &mut BytesMut,
    payload: impl FnOnce(&mut BytesMut) -> Result<(), Cbi1Error>,
) -> Result<(), EncodeError> {
    let start = dst.len();
    frame::put_header(dst, MessageKind::PoolFrame, 0);
    let written = put_meta(header, dst)
        .and_then(|()| payload(dst).map_err(EncodeError::Cbi1))
        .and_then(|()| frame::finish_frame(dst, start, limits).map_err(EncodeError::Frame));
    if written.is_err() {
        dst.truncate(start);
    }
    written
}

fn put_meta(header: &PoolFrameHeader, dst: &mut BytesMut) -> Result<(), EncodeError> {
    let at = dst.len();
    dst.put_u32_le(0);
    if let Err(err) = encode_body(MessageKind::PoolFrame, header, dst) {
        dst.truncate(at);
        return Err(err);
    }
    let meta_len = (dst.len() - at - 4) as u32;
    dst[at..at + 4].copy_from_slice(&meta_len.to_le_bytes());
    let sum = meta_checksum(PROTOCOL_MINOR, &dst[at + 4..]);
    dst.put_u32_le(sum);
    Ok(())
}

fn meta_checksum(minor: u16, meta: &[u8]) -> u32 {
    let mut hasher = Xxh3::new();
    hasher.update(&minor.to_le_bytes());
    hasher.update(meta);
    hasher.digest() as u32
}
