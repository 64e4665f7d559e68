//! A pool mirror: the bucket table of one producer generation, rebuilt from its wire frames.
//!
//! Sans-IO: feed it every pool frame of one subscription in order with
//! [`PoolMirror::handle_frame`]. It assembles the snapshot, then applies deltas strictly in
//! sequence; any identity change, gap or malformed frame is an error after which the mirror
//! must be discarded. The host uses it to read a producer's table for verification, and
//! tests and the demo use it as a minimal replica.

use bytes::Bytes;
use kvrelay_codec::v1::{DecodeError, PoolFrame, PoolFrameError, PoolPayload, ProducerIdentity};
use kvrelay_codec::{AssemblyError, MessageKind, RawFrame, SnapshotAssembler};

/// Why a frame could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MirrorError {
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
    /// The snapshot chunks do not assemble.
    #[error(transparent)]
    Assembly(#[from] AssemblyError),
    /// The producer's filter format is not supported.
    #[error("producer format: {message}")]
    Format {
        /// The validation message.
        message: String,
    },
    /// A delta does not continue the mirror's sequence.
    #[error("delta {base}->{next} does not follow sequence {current}")]
    Gap {
        /// The mirror's sequence.
        current: u64,
        /// The delta's base.
        base: u64,
        /// The delta's target.
        next: u64,
    },
    /// A delta arrived before the snapshot completed.
    #[error("delta before the snapshot completed")]
    DeltaBeforeSnapshot,
    /// A delta names a bucket outside the table.
    #[error("bucket index {bucket_idx} outside {bucket_count} buckets")]
    BucketOutOfRange {
        /// The bucket index.
        bucket_idx: u32,
        /// The table size.
        bucket_count: usize,
    },
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
    assembler: SnapshotAssembler,
    words: Option<Vec<u64>>,
    sequence: u64,
}

impl PoolMirror {
    /// An empty mirror following `expected`.
    pub fn new(expected: ProducerIdentity) -> Result<Self, MirrorError> {
        let layout = expected
            .ckf_format
            .layout()
            .map_err(|err| MirrorError::Format {
                message: err.to_string(),
            })?;
        Ok(Self {
            expected,
            assembler: SnapshotAssembler::new(layout, expected.pool_id.dc_id),
            words: None,
            sequence: 0,
        })
    }

    /// The producer this mirror follows.
    pub fn producer(&self) -> &ProducerIdentity {
        &self.expected
    }

    /// The bucket words once the snapshot is complete.
    pub fn words(&self) -> Option<&[u64]> {
        self.words.as_deref()
    }

    /// The sequence the mirror is at (meaningful once the snapshot is complete).
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Applies one decoded frame; on `Err` the mirror is unchanged and should be discarded.
    pub fn handle_frame(&mut self, frame: &RawFrame) -> Result<MirrorProgress, MirrorError> {
        if frame.kind() != Some(MessageKind::PoolFrame) {
            return Err(MirrorError::NotAPoolFrame {
                code: frame.kind_code,
            });
        }
        let decoded = PoolFrame::decode_body(&frame.body, frame.minor)?;
        self.handle_pool_frame(&decoded)
    }

    /// Applies one complete encoded frame (header included).
    pub fn handle_bytes(&mut self, bytes: &Bytes) -> Result<MirrorProgress, MirrorError> {
        let limits = kvrelay_codec::Limits::default();
        let raw = kvrelay_codec::frame::decode_frame_exact(bytes, &limits).map_err(|err| {
            MirrorError::Format {
                message: err.to_string(),
            }
        })?;
        self.handle_frame(&raw)
    }

    fn handle_pool_frame(&mut self, frame: &PoolFrame) -> Result<MirrorProgress, MirrorError> {
        match frame.check(&self.expected)? {
            PoolPayload::SnapshotChunk(chunk) => match self.assembler.handle_chunk(&chunk)? {
                None => Ok(MirrorProgress::Assembling),
                Some(snapshot) => {
                    self.sequence = snapshot.sequence;
                    self.words = Some(snapshot.words);
                    Ok(MirrorProgress::SnapshotComplete)
                }
            },
            PoolPayload::Delta(delta) => {
                let Some(words) = self.words.as_mut() else {
                    return Err(MirrorError::DeltaBeforeSnapshot);
                };
                let base = frame.header.base_sequence;
                let next = frame.header.sequence;
                if base != self.sequence {
                    return Err(MirrorError::Gap {
                        current: self.sequence,
                        base,
                        next,
                    });
                }
                let bucket_count = words.len();
                if let Some(image) = delta
                    .images()
                    .find(|image| image.bucket_idx as usize >= bucket_count)
                {
                    return Err(MirrorError::BucketOutOfRange {
                        bucket_idx: image.bucket_idx,
                        bucket_count,
                    });
                }
                for image in delta.images() {
                    words[image.bucket_idx as usize] = image.word;
                }
                self.sequence = next;
                Ok(MirrorProgress::Delta)
            }
            PoolPayload::Heartbeat => Ok(MirrorProgress::Heartbeat),
        }
    }
}
