//! Encoding of pool frames (temporary stand-in until kvrelay-codec's pool frames land).

use bytes::{BufMut, Bytes, BytesMut};
use kvrelay_ckf::{Delta, SnapshotChunk};
use kvrelay_identity::ProducerIdentity;

/// A frame that could not be encoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pool frame encoding failed: {reason}")]
pub(crate) struct FrameEncodeError {
    reason: String,
}

pub(crate) fn encode_snapshot_chunk(_identity: &ProducerIdentity, chunk: &SnapshotChunk) -> Result<Bytes, FrameEncodeError> {
    let mut buf = BytesMut::with_capacity(32 + chunk.words.len() * 8);
    buf.put_u8(1);
    buf.put_u64_le(chunk.sequence);
    buf.put_u32_le(chunk.chunk_index);
    buf.put_u32_le(chunk.chunk_count);
    buf.put_u64_le(chunk.first_bucket);
    for word in &chunk.words {
        buf.put_u64_le(*word);
    }
    Ok(buf.freeze())
}

pub(crate) fn encode_delta(_identity: &ProducerIdentity, delta: &Delta) -> Result<Bytes, FrameEncodeError> {
    let mut buf = BytesMut::with_capacity(32 + delta.images.len() * 12);
    buf.put_u8(2);
    buf.put_u64_le(delta.base_sequence);
    for image in &delta.images {
        buf.put_u32_le(image.bucket_idx);
        buf.put_u64_le(image.word);
    }
    Ok(buf.freeze())
}

pub(crate) fn encode_heartbeat(_identity: &ProducerIdentity, sequence: u64) -> Result<Bytes, FrameEncodeError> {
    let mut buf = BytesMut::with_capacity(9);
    buf.put_u8(3);
    buf.put_u64_le(sequence);
    Ok(buf.freeze())
}
