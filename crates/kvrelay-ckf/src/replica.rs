//! Replicas: install a chunked snapshot, then apply deltas strictly in sequence.
//!
//! A replica is either empty, assembling a snapshot, ready at a sequence, or invalid. Every
//! chunk and delta is checked completely before any word is written; any failed check
//! marks the replica invalid (it answers nothing) until chunk 0 of a new snapshot
//! restarts it. Nothing is ever half applied: a delta is applied whole or not at all.

use std::num::NonZeroU32;

use kvrelay_identity::CkfFormat;

use crate::addressing::Addressing;
use crate::bucket;
use crate::format::ConfigError;
use crate::image::{Delta, SnapshotChunk};
use crate::ownership::PublishError;
use crate::publication::{AllocFailed, snapshot_chunks};

/// Where a replica stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaStatus {
    /// No snapshot yet.
    Empty,
    /// Chunks of a snapshot at `sequence` are arriving; not queryable.
    Assembling {
        /// The snapshot's sequence.
        sequence: u64,
    },
    /// Complete and current at `sequence`.
    Ready {
        /// The last applied sequence.
        sequence: u64,
    },
    /// A check failed; only a new snapshot (chunk 0) recovers.
    Invalid,
}

/// Why a chunk or delta was refused. The replica is now [`ReplicaStatus::Invalid`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ReplicaError {
    /// The chunk's bucket count differs from the replica's format.
    #[error("snapshot bucket count {got} differs from the format's {expected}")]
    BucketCountMismatch {
        /// The replica's bucket count.
        expected: u64,
        /// The chunk's bucket count.
        got: u64,
    },
    /// `chunk_count` is 0, exceeds the bucket count, or `chunk_index >= chunk_count`.
    #[error("snapshot chunk index {chunk_index} is invalid for chunk count {chunk_count}")]
    InvalidChunkIndex {
        /// The chunk's index.
        chunk_index: u32,
        /// The chunk's count.
        chunk_count: u32,
    },
    /// A chunk carries no words.
    #[error("snapshot chunk {chunk_index} carries no words")]
    EmptyChunk {
        /// The chunk's index.
        chunk_index: u32,
    },
    /// The chunk extends past the last bucket.
    #[error(
        "snapshot chunk covers buckets {first_bucket}..{end}, beyond bucket count {bucket_count}"
    )]
    ChunkOutOfRange {
        /// The chunk's first bucket.
        first_bucket: u64,
        /// One past its last bucket.
        end: u64,
        /// The bucket count.
        bucket_count: u64,
    },
    /// A chunk does not continue the snapshot being assembled.
    #[error(
        "snapshot chunk {chunk_index}/{chunk_count} at sequence {sequence} starting at bucket \
         {first_bucket} does not continue the assembly (expected chunk {expected_index}/{expected_count} \
         at sequence {expected_sequence} starting at bucket {expected_first_bucket})"
    )]
    ChunkOutOfOrder {
        /// The chunk's index.
        chunk_index: u32,
        /// The chunk's count.
        chunk_count: u32,
        /// The chunk's sequence.
        sequence: u64,
        /// The chunk's first bucket.
        first_bucket: u64,
        /// The expected index.
        expected_index: u32,
        /// The expected count.
        expected_count: u32,
        /// The expected sequence.
        expected_sequence: u64,
        /// The expected first bucket.
        expected_first_bucket: u64,
    },
    /// The last chunk arrived but the chunks do not cover every bucket.
    #[error("snapshot chunks cover {covered} buckets, expected {bucket_count}")]
    IncompleteSnapshot {
        /// Buckets covered.
        covered: u64,
        /// The bucket count.
        bucket_count: u64,
    },
    /// A delta arrived while no snapshot is installed.
    #[error("delta {base_sequence}->{sequence} arrived with no snapshot installed")]
    NotReady {
        /// The delta's base.
        base_sequence: u64,
        /// The delta's sequence.
        sequence: u64,
    },
    /// The delta does not start at the installed sequence (gap, duplicate or stale).
    #[error("delta base sequence {base_sequence} differs from installed sequence {installed}")]
    SequenceGap {
        /// The installed sequence.
        installed: u64,
        /// The delta's base.
        base_sequence: u64,
    },
    /// The delta's sequence is not after its base.
    #[error("delta sequence {sequence} is not after base sequence {base_sequence}")]
    SequenceNotNext {
        /// The delta's base.
        base_sequence: u64,
        /// The delta's sequence.
        sequence: u64,
    },
    /// The delta has no images.
    #[error("delta {base_sequence}->{sequence} has no images")]
    EmptyDelta {
        /// The delta's base.
        base_sequence: u64,
        /// The delta's sequence.
        sequence: u64,
    },
    /// An image names a bucket past the last one.
    #[error("delta image bucket {bucket_idx} is not below bucket count {bucket_count}")]
    ImageOutOfRange {
        /// The image's bucket.
        bucket_idx: u32,
        /// The bucket count.
        bucket_count: u64,
    },
    /// Two images name the same bucket.
    #[error("delta has two images for bucket {bucket_idx}")]
    DuplicateImage {
        /// The repeated bucket.
        bucket_idx: u32,
    },
    /// The lane index is not in the table.
    #[error("lane {lane} does not exist, the table has {n_lanes} lanes")]
    UnknownLane {
        /// The lane asked for.
        lane: usize,
        /// Lanes in the table.
        n_lanes: usize,
    },
}

/// A complete mirror of one producer's table.
///
/// ```
/// use kvrelay_ckf::{CkfConfig, PoolFilter, Replica, ReplicaStatus};
/// let mut producer = PoolFilter::new(CkfConfig::new(64))?;
/// let mut replica = Replica::new(producer.format())?;
/// for chunk in producer.snapshot()?.chunks {
///     replica.install_chunk(&chunk)?;
/// }
/// assert_eq!(replica.status(), ReplicaStatus::Ready { sequence: 0 });
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct Replica {
    addressing: Addressing,
    words: Vec<u64>,
    sequencer: Sequencer,
}

impl Replica {
    /// An empty replica for `format`, allocated fallibly.
    pub fn new(format: CkfFormat) -> Result<Self, ConfigError> {
        let bucket_count = format.bucket_count() as usize;
        let mut words = Vec::new();
        words
            .try_reserve_exact(bucket_count)
            .map_err(|_| ConfigError::AllocationFailed {
                what: "replica table",
                bytes: bucket_count as u64 * 8,
            })?;
        words.resize(bucket_count, 0);
        Ok(Self {
            addressing: Addressing::new(format),
            words,
            sequencer: Sequencer::new(u64::from(format.bucket_count())),
        })
    }

    /// Installs one snapshot chunk; returns `true` when it completed the snapshot.
    /// Chunk 0 always (re)starts an assembly.
    pub fn install_chunk(&mut self, chunk: &SnapshotChunk) -> Result<bool, ReplicaError> {
        let complete = self.sequencer.accept_chunk(chunk)?;
        let first = chunk.first_bucket as usize;
        self.words[first..first + chunk.words.len()].copy_from_slice(&chunk.words);
        Ok(complete)
    }

    /// Applies a delta whole; it must start at the installed sequence.
    pub fn apply_delta(&mut self, delta: &Delta) -> Result<(), ReplicaError> {
        self.sequencer.accept_delta(delta)?;
        for image in &delta.images {
            self.words[image.bucket_idx as usize] = image.word;
        }
        Ok(())
    }

    /// Marks the replica invalid (for example when its stream broke).
    pub fn invalidate(&mut self) {
        self.sequencer.status = ReplicaStatus::Invalid;
    }

    /// Where the replica stands.
    pub fn status(&self) -> ReplicaStatus {
        self.sequencer.status
    }

    /// The bucket words when ready.
    pub fn words(&self) -> Option<&[u64]> {
        match self.sequencer.status {
            ReplicaStatus::Ready { .. } => Some(&self.words),
            _ => None,
        }
    }

    /// Whether `hash`'s fingerprint is present, when ready.
    pub fn contains(&self, hash: u64) -> Option<bool> {
        let words = self.words()?;
        let address = self.addressing.address(hash);
        Some(
            bucket::contains(words[address.primary as usize], address.fingerprint)
                || bucket::contains(words[address.alternate as usize], address.fingerprint),
        )
    }

    /// A snapshot of this replica at its sequence (to serve a new subscriber from a
    /// mirror), in chunks of at most `chunk_buckets` words; `None` when not ready.
    pub fn snapshot(
        &self,
        chunk_buckets: NonZeroU32,
    ) -> Result<Option<Vec<SnapshotChunk>>, PublishError> {
        let ReplicaStatus::Ready { sequence } = self.sequencer.status else {
            return Ok(None);
        };
        snapshot_chunks(sequence, &self.words, chunk_buckets)
            .map(Some)
            .map_err(|AllocFailed { bytes }| PublishError::AllocationFailed { bytes })
    }
}

/// The stream state machine shared by [`Replica`] and the query table's lanes: validates
/// chunks and deltas and advances the status; the caller writes words after `Ok`.
#[derive(Debug, Clone)]
pub(crate) struct Sequencer {
    bucket_count: u64,
    status: ReplicaStatus,
    assembly: Assembly,
}

/// Progress of the snapshot being assembled.
#[derive(Debug, Clone, Copy, Default)]
struct Assembly {
    chunk_count: u32,
    next_index: u32,
    next_bucket: u64,
}

impl Sequencer {
    pub(crate) fn new(bucket_count: u64) -> Self {
        Self {
            bucket_count,
            status: ReplicaStatus::Empty,
            assembly: Assembly::default(),
        }
    }

    pub(crate) fn status(&self) -> ReplicaStatus {
        self.status
    }

    pub(crate) fn is_ready(&self) -> bool {
        matches!(self.status, ReplicaStatus::Ready { .. })
    }

    pub(crate) fn reset(&mut self) {
        self.status = ReplicaStatus::Empty;
    }

    /// Checks `chunk` against the assembly; on `Ok` the caller must write its words.
    pub(crate) fn accept_chunk(&mut self, chunk: &SnapshotChunk) -> Result<bool, ReplicaError> {
        let result = self.check_chunk(chunk);
        match result {
            Ok(complete) => {
                self.assembly = Assembly {
                    chunk_count: chunk.chunk_count,
                    next_index: chunk.chunk_index + 1,
                    next_bucket: chunk.first_bucket + chunk.words.len() as u64,
                };
                self.status = if complete {
                    ReplicaStatus::Ready {
                        sequence: chunk.sequence,
                    }
                } else {
                    ReplicaStatus::Assembling {
                        sequence: chunk.sequence,
                    }
                };
            }
            Err(_) => self.status = ReplicaStatus::Invalid,
        }
        result
    }

    /// Checks `delta` against the installed sequence; on `Ok` the caller must write it.
    pub(crate) fn accept_delta(&mut self, delta: &Delta) -> Result<(), ReplicaError> {
        let result = self.check_delta(delta);
        match result {
            Ok(()) => {
                self.status = ReplicaStatus::Ready {
                    sequence: delta.sequence,
                }
            }
            Err(_) => self.status = ReplicaStatus::Invalid,
        }
        result
    }

    fn check_chunk(&self, chunk: &SnapshotChunk) -> Result<bool, ReplicaError> {
        if chunk.bucket_count != self.bucket_count {
            return Err(ReplicaError::BucketCountMismatch {
                expected: self.bucket_count,
                got: chunk.bucket_count,
            });
        }
        // Every chunk carries at least one bucket, so a snapshot of more chunks than
        // buckets can never complete: refuse it at its first chunk instead of assembling
        // forever.
        if chunk.chunk_count == 0
            || chunk.chunk_index >= chunk.chunk_count
            || u64::from(chunk.chunk_count) > self.bucket_count
        {
            return Err(ReplicaError::InvalidChunkIndex {
                chunk_index: chunk.chunk_index,
                chunk_count: chunk.chunk_count,
            });
        }
        if chunk.words.is_empty() {
            return Err(ReplicaError::EmptyChunk {
                chunk_index: chunk.chunk_index,
            });
        }
        let end = chunk.first_bucket.saturating_add(chunk.words.len() as u64);
        if end > self.bucket_count {
            return Err(ReplicaError::ChunkOutOfRange {
                first_bucket: chunk.first_bucket,
                end,
                bucket_count: self.bucket_count,
            });
        }
        let (expected_index, expected_count, expected_sequence, expected_first_bucket) =
            match (chunk.chunk_index, self.status) {
                (0, _) => (0, chunk.chunk_count, chunk.sequence, 0),
                (_, ReplicaStatus::Assembling { sequence }) => (
                    self.assembly.next_index,
                    self.assembly.chunk_count,
                    sequence,
                    self.assembly.next_bucket,
                ),
                // A later chunk with no assembly in progress can never be right.
                _ => (0, chunk.chunk_count, chunk.sequence, 0),
            };
        if chunk.chunk_index != expected_index
            || chunk.chunk_count != expected_count
            || chunk.sequence != expected_sequence
            || chunk.first_bucket != expected_first_bucket
        {
            return Err(ReplicaError::ChunkOutOfOrder {
                chunk_index: chunk.chunk_index,
                chunk_count: chunk.chunk_count,
                sequence: chunk.sequence,
                first_bucket: chunk.first_bucket,
                expected_index,
                expected_count,
                expected_sequence,
                expected_first_bucket,
            });
        }
        let complete = chunk.chunk_index + 1 == chunk.chunk_count;
        if complete && end != self.bucket_count {
            return Err(ReplicaError::IncompleteSnapshot {
                covered: end,
                bucket_count: self.bucket_count,
            });
        }
        Ok(complete)
    }

    fn check_delta(&self, delta: &Delta) -> Result<(), ReplicaError> {
        let ReplicaStatus::Ready {
            sequence: installed,
        } = self.status
        else {
            return Err(ReplicaError::NotReady {
                base_sequence: delta.base_sequence,
                sequence: delta.sequence,
            });
        };
        if delta.base_sequence != installed {
            return Err(ReplicaError::SequenceGap {
                installed,
                base_sequence: delta.base_sequence,
            });
        }
        // A coalesced delta spans several sequences; it never goes backwards or stands still.
        if delta.sequence <= delta.base_sequence {
            return Err(ReplicaError::SequenceNotNext {
                base_sequence: delta.base_sequence,
                sequence: delta.sequence,
            });
        }
        if delta.images.is_empty() {
            return Err(ReplicaError::EmptyDelta {
                base_sequence: delta.base_sequence,
                sequence: delta.sequence,
            });
        }
        for image in &delta.images {
            if u64::from(image.bucket_idx) >= self.bucket_count {
                return Err(ReplicaError::ImageOutOfRange {
                    bucket_idx: image.bucket_idx,
                    bucket_count: self.bucket_count,
                });
            }
        }
        let sorted = delta
            .images
            .windows(2)
            .all(|pair| pair[0].bucket_idx < pair[1].bucket_idx);
        if !sorted {
            // Foreign producers may list images in touch order: check repeats by sorting.
            let mut indices: Vec<u32> = delta.images.iter().map(|i| i.bucket_idx).collect();
            indices.sort_unstable();
            if let Some(pair) = indices.windows(2).find(|pair| pair[0] == pair[1]) {
                return Err(ReplicaError::DuplicateImage {
                    bucket_idx: pair[0],
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
