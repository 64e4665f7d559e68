//! Encoding of pool frames with `kvrelay-codec`: snapshot chunks, deltas and heartbeats of
//! one producer generation, each a complete codec frame ready to write to a socket.
//!
//! The wire identities are converted once per hub ([`FrameEncoder::new`], with the codec's
//! `kvrelay_codec::v1::convert` conversions); each frame is then encoded straight into one
//! buffer (CBI1 payload in place, no intermediate copy).

use std::time::{SystemTime, UNIX_EPOCH};

use bytes::{Bytes, BytesMut};
use kvrelay_ckf::Delta;
use kvrelay_codec::v1::{self, PoolFrameHeader, PoolFrameKind as WireKind};
use kvrelay_identity::{DcRelayIdentity, ProducerIdentity};

/// Encodes the frames of one producer generation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FrameEncoder {
    relay: v1::RelayIdentity,
    producer: v1::ProducerIdentity,
    limits: kvrelay_codec::Limits,
}

impl FrameEncoder {
    /// An encoder for `producer`, published by `relay`.
    pub(crate) fn new(
        relay: DcRelayIdentity,
        producer: &ProducerIdentity,
        limits: kvrelay_codec::Limits,
    ) -> Self {
        Self {
            relay: relay.into(),
            producer: (*producer).into(),
            limits,
        }
    }

    /// Chunk `chunk_index` of the snapshot of `table` at `sequence`.
    pub(crate) fn snapshot_chunk(
        &self,
        sequence: u64,
        table: &[u64],
        chunk_index: u32,
    ) -> Result<Bytes, v1::EncodeError> {
        let header = self.header(WireKind::SnapshotChunk, sequence, sequence);
        let mut buf = BytesMut::new();
        v1::encode_chunk_frame(&header, table, chunk_index, &self.limits, &mut buf)?;
        Ok(buf.freeze())
    }

    /// One delta.
    pub(crate) fn delta(&self, delta: &Delta) -> Result<Bytes, v1::EncodeError> {
        let header = self.header(WireKind::Delta, delta.base_sequence, delta.sequence);
        let mut buf = BytesMut::with_capacity(128 + delta.images.len() * 12);
        v1::encode_delta_frame(&header, &delta.images, &self.limits, &mut buf)?;
        Ok(buf.freeze())
    }

    /// A heartbeat at `sequence`.
    pub(crate) fn heartbeat(&self, sequence: u64) -> Result<Bytes, v1::EncodeError> {
        let header = self.header(WireKind::Heartbeat, sequence, sequence);
        let mut buf = BytesMut::with_capacity(128);
        v1::encode_heartbeat_frame(&header, &self.limits, &mut buf)?;
        Ok(buf.freeze())
    }

    fn header(&self, kind: WireKind, base_sequence: u64, sequence: u64) -> PoolFrameHeader {
        PoolFrameHeader {
            relay: self.relay,
            producer: self.producer,
            base_sequence,
            sequence,
            kind,
            sent_unix_us: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|elapsed| u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
                .unwrap_or(0),
        }
    }
}
