//! A pool mirror: the bucket table of one producer generation, rebuilt from its wire frames.
//!
//! Sans-IO and thin: each frame is checked against the producer by the codec
//! ([`PoolFrame::check`]) and its payload goes to a [`kvrelay_ckf::Replica`], the one
//! subscriber-side state machine (snapshot assembly, then deltas strictly in sequence)
//! that the consumer's replica lanes run too. Any identity change, gap or malformed frame
//! is an error after which the mirror must be discarded. The host uses it to read a
//! producer's table for verification, and tests and the demo use it as a minimal replica.

use bytes::Bytes;
use kvrelay_ckf::{ConfigError, Replica, ReplicaError, ReplicaStatus};
use kvrelay_codec::frame::ExactFrameError;
use kvrelay_codec::v1::{
    DecodeError, PoolFrame, PoolFrameError, PoolPayload, ProducerIdentity, ValidationError,
};
use kvrelay_codec::{MessageKind, RawFrame};

/// Why a frame could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MirrorError {
    /// The producer's filter format is not one this build can mirror.
    #[error("producer format: {0}")]
    Format(#[from] ValidationError),
    /// The mirror's table could not be allocated.
    #[error("mirror table: {0}")]
    Table(#[from] ConfigError),
    /// The bytes are not exactly one frame.
    #[error(transparent)]
    Framing(#[from] ExactFrameError),
    /// The frame is not a pool frame.
    #[error("expected a pool frame, got message kind {code}")]
    NotAPoolFrame {
        /// The message kind code.
        code: u16,
    },
    /// The frame body does not decode.
    #[error(transparent)]
    Decode(#[from] DecodeError),
    /// The frame fails validation against the expected producer.
    #[error(transparent)]
    Frame(#[from] PoolFrameError),
    /// The replica refused the chunk or delta (out of order, a gap, a delta before the
    /// snapshot, a bucket out of range).
    #[error(transparent)]
    Replica(#[from] ReplicaError),
}

/// What a frame did to the mirror.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MirrorProgress {
    /// A snapshot chunk was taken; more chunks follow.
    Assembling,
    /// The snapshot completed; the mirror is at its sequence.
    SnapshotComplete,
    /// A delta moved the mirror to the next sequence.
    Delta,
    /// A heartbeat; nothing changed.
    Heartbeat,
}

/// The mirror of one producer generation.
#[derive(Debug)]
pub struct PoolMirror {
    expected: ProducerIdentity,
    replica: Replica,
}

impl PoolMirror {
    /// An empty mirror following `expected` (its table allocated fallibly).
    pub fn new(expected: ProducerIdentity) -> Result<Self, MirrorError> {
        let replica = Replica::new(expected.ckf_format.domain()?)?;
        Ok(Self { expected, replica })
    }

    /// The producer this mirror follows.
    pub fn producer(&self) -> &ProducerIdentity {
        &self.expected
    }

    /// The bucket words once the snapshot is complete.
    pub fn words(&self) -> Option<&[u64]> {
        self.replica.words()
    }

    /// The sequence the mirror is at (meaningful once the snapshot is complete).
    pub fn sequence(&self) -> u64 {
        match self.replica.status() {
            ReplicaStatus::Ready { sequence } => sequence,
            _ => 0,
        }
    }

    /// Applies one decoded frame; on `Err` the mirror should be discarded.
    pub fn handle_frame(&mut self, frame: &RawFrame) -> Result<MirrorProgress, MirrorError> {
        if frame.kind() != Some(MessageKind::PoolFrame) {
            return Err(MirrorError::NotAPoolFrame {
                code: frame.kind_code,
            });
        }
        let decoded = PoolFrame::decode_body(&frame.body, frame.minor)?;
        self.handle_pool_frame(&decoded)
    }

    /// Applies one complete encoded frame (header included), decoded under the codec's
    /// default limits.
    pub fn handle_bytes(&mut self, bytes: &Bytes) -> Result<MirrorProgress, MirrorError> {
        let limits = kvrelay_codec::Limits::default();
        let raw = kvrelay_codec::frame::decode_frame_shared(bytes, &limits)?;
        self.handle_frame(&raw)
    }

    /// Applies one pool frame already decoded (from any transport).
    pub fn handle_pool_frame(&mut self, frame: &PoolFrame) -> Result<MirrorProgress, MirrorError> {
        match frame.check(&self.expected)? {
            PoolPayload::SnapshotChunk(chunk) => {
                if self.replica.install_chunk(&chunk.to_snapshot_chunk())? {
                    Ok(MirrorProgress::SnapshotComplete)
                } else {
                    Ok(MirrorProgress::Assembling)
                }
            }
            PoolPayload::Delta(delta) => {
                self.replica.apply_delta(&delta.to_delta())?;
                Ok(MirrorProgress::Delta)
            }
            PoolPayload::Heartbeat => Ok(MirrorProgress::Heartbeat),
        }
    }
}
