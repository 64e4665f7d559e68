//! The snapshot assembler: turns the chunks of one snapshot into a dense bucket table.
//!
//! Chunk 0 (re)starts an assembly. Every later chunk must carry the next index, the same
//! chunk count and epoch, and start at the next expected bucket; the last chunk must end
//! exactly at the bucket count. A rejected chunk leaves the assembler unchanged; the
//! consumer is expected to drop the stream and resubscribe.

use crate::cbi1::{CHUNK_WORDS, Cbi1Layout, ChunkView, snapshot_chunk_count};

/// A complete snapshot: one word per bucket, consistent at `sequence`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AssembledSnapshot {
    /// The filter layout.
    pub layout: Cbi1Layout,
    /// The pool's `DcId` value.
    pub dc_id: u64,
    /// The stream sequence the snapshot is consistent at.
    pub sequence: u64,
    /// One word per bucket, `layout.bucket_count()` long.
    pub words: Vec<u64>,
}

/// Collects snapshot chunks for one subscribed producer (fixed layout and `dc_id`).
#[derive(Debug)]
pub struct SnapshotAssembler {
    layout: Cbi1Layout,
    dc_id: u64,
    progress: Option<Progress>,
}

#[derive(Debug)]
struct Progress {
    sequence: u64,
    chunk_count: u32,
    next_index: u32,
    words: Vec<u64>,
    filled: usize,
}

/// A chunk that does not continue the snapshot being assembled.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AssemblyError {
    /// The chunk belongs to a filter of another layout.
    #[error("chunk layout {found:?} differs from the subscribed layout {expected:?}")]
    LayoutMismatch {
        /// Subscribed layout.
        expected: Cbi1Layout,
        /// Layout in the chunk.
        found: Cbi1Layout,
    },
    /// The chunk belongs to another DC.
    #[error("chunk dc_id {found:#018x} differs from the pool's dc_id {expected:#018x}")]
    DcMismatch {
        /// The pool's `DcId`.
        expected: u64,
        /// The chunk's.
        found: u64,
    },
    /// A chunk other than 0 arrived with no assembly in progress.
    #[error("chunk {chunk_index} arrived before chunk 0")]
    NotStarted {
        /// The chunk's index.
        chunk_index: u32,
    },
    /// The chunk count does not fit the bucket count.
    #[error("chunk count {found} does not match bucket count {bucket_count} ({expected} chunks)")]
    ChunkCount {
        /// Chunks the bucket count needs.
        expected: u32,
        /// Chunk count in the chunk.
        found: u32,
        /// Bucket count.
        bucket_count: u64,
    },
    /// Not the next chunk index.
    #[error("chunk index {found} arrived, expected {expected}")]
    OutOfOrder {
        /// The next index.
        expected: u32,
        /// The chunk's index.
        found: u32,
    },
    /// The chunk is from another snapshot sequence.
    #[error("chunk sequence {found} differs from snapshot sequence {expected}")]
    SequenceChanged {
        /// The snapshot's sequence.
        expected: u64,
        /// The chunk's.
        found: u64,
    },
    /// The chunk does not start at the next expected bucket.
    #[error("chunk starts at bucket {found}, expected {expected}")]
    Gap {
        /// The next uncovered bucket.
        expected: u64,
        /// The chunk's first bucket.
        found: u64,
    },
    /// A chunk other than the last holds fewer than a full chunk of words (chunk `k`
    /// covers the buckets from `k * CHUNK_WORDS`, so only the last may be short).
    #[error(
        "chunk {chunk_index} of {chunk_count} holds {found} words; every chunk but the last holds {expected}"
    )]
    ShortChunk {
        /// The chunk's index.
        chunk_index: u32,
        /// Chunks in the snapshot.
        chunk_count: u32,
        /// Words a non-last chunk holds.
        expected: u64,
        /// Words in the chunk.
        found: u64,
    },
    /// The table for a new assembly (`bucket_count` words) could not be allocated.
    #[error("snapshot table of {bytes} bytes could not be allocated")]
    AllocationFailed {
        /// Bytes asked for.
        bytes: u64,
    },
    /// The last chunk leaves buckets uncovered.
    #[error("snapshot covers {covered} of {bucket_count} buckets after its last chunk")]
    Incomplete {
        /// Buckets covered.
        covered: u64,
        /// Bucket count.
        bucket_count: u64,
    },
}

impl SnapshotAssembler {
    /// An idle assembler for a producer with this layout and `dc_id`.
    pub fn new(layout: Cbi1Layout, dc_id: u64) -> Self {
        Self {
            layout,
            dc_id,
            progress: None,
        }
    }

    /// True while a snapshot is partly assembled.
    pub fn is_assembling(&self) -> bool {
        self.progress.is_some()
    }

    /// The next chunk index expected, if a snapshot is in progress.
    pub fn next_chunk_index(&self) -> Option<u32> {
        self.progress.as_ref().map(|progress| progress.next_index)
    }

    /// Drops any partial snapshot.
    pub fn reset(&mut self) {
        self.progress = None;
    }

    /// Adds one chunk. Returns the snapshot when this chunk completes it.
    ///
    /// On `Err` the assembler is unchanged. Chunk 0 always starts a new assembly, dropping
    /// any partial one (memory for the table, `bucket_count` words, is taken then, fallibly:
    /// a refused allocation is [`AssemblyError::AllocationFailed`], never a panic).
    pub fn handle_chunk(
        &mut self,
        chunk: &ChunkView,
    ) -> Result<Option<AssembledSnapshot>, AssemblyError> {
        let header = chunk.header();
        if header.layout != self.layout {
            return Err(AssemblyError::LayoutMismatch {
                expected: self.layout,
                found: header.layout,
            });
        }
        if header.dc_id != self.dc_id {
            return Err(AssemblyError::DcMismatch {
                expected: self.dc_id,
                found: header.dc_id,
            });
        }
        let bucket_count = self.layout.bucket_count();
        let expected_count = snapshot_chunk_count(bucket_count);
        if chunk.chunk_count() != expected_count {
            return Err(AssemblyError::ChunkCount {
                expected: expected_count,
                found: chunk.chunk_count(),
                bucket_count,
            });
        }
        let (sequence, filled) = match (&self.progress, chunk.chunk_index()) {
            (_, 0) => (header.epoch, 0),
            (None, chunk_index) => return Err(AssemblyError::NotStarted { chunk_index }),
            (Some(progress), found) => {
                if found != progress.next_index {
                    return Err(AssemblyError::OutOfOrder {
                        expected: progress.next_index,
                        found,
                    });
                }
                if header.epoch != progress.sequence {
                    return Err(AssemblyError::SequenceChanged {
                        expected: progress.sequence,
                        found: header.epoch,
                    });
                }
                (progress.sequence, progress.filled)
            }
        };
        if chunk.bucket_offset() != filled as u64 {
            return Err(AssemblyError::Gap {
                expected: filled as u64,
                found: chunk.bucket_offset(),
            });
        }
        let covered = filled + chunk.n_words();
        let is_last = chunk.chunk_index() + 1 == chunk.chunk_count();
        if !is_last && chunk.n_words() != CHUNK_WORDS {
            return Err(AssemblyError::ShortChunk {
                chunk_index: chunk.chunk_index(),
                chunk_count: chunk.chunk_count(),
                expected: CHUNK_WORDS as u64,
                found: chunk.n_words() as u64,
            });
        }
        if is_last && covered as u64 != bucket_count {
            return Err(AssemblyError::Incomplete {
                covered: covered as u64,
                bucket_count,
            });
        }
        let fresh = if chunk.chunk_index() == 0 {
            Some(zeroed_table(bucket_count)?)
        } else {
            None
        };
        // Checked and allocated: from here on nothing fails.
        let mut progress = match fresh {
            Some(words) => {
                // Chunk 0 drops any partial assembly.
                self.progress = None;
                Progress {
                    sequence,
                    chunk_count: chunk.chunk_count(),
                    next_index: 0,
                    words,
                    filled: 0,
                }
            }
            None => self.progress.take().ok_or(AssemblyError::NotStarted {
                chunk_index: chunk.chunk_index(),
            })?,
        };
        chunk.copy_words_into(&mut progress.words[filled..covered]);
        progress.filled = covered;
        progress.next_index += 1;
        if progress.next_index < progress.chunk_count {
            self.progress = Some(progress);
            return Ok(None);
        }
        Ok(Some(AssembledSnapshot {
            layout: self.layout,
            dc_id: self.dc_id,
            sequence: progress.sequence,
            words: progress.words,
        }))
    }
}

/// A zeroed table of `bucket_count` words, allocated fallibly.
fn zeroed_table(bucket_count: u64) -> Result<Vec<u64>, AssemblyError> {
    let failed = AssemblyError::AllocationFailed {
        bytes: bucket_count.saturating_mul(8),
    };
    let n_words = usize::try_from(bucket_count).map_err(|_| failed.clone())?;
    let mut words = Vec::new();
    words.try_reserve_exact(n_words).map_err(|_| failed)?;
    words.resize(n_words, 0);
    Ok(words)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use bytes::BytesMut;

    use super::*;
    use crate::cbi1::{Cbi1Payload, decode_cbi1, encode_snapshot_chunk};

    const BUCKETS: u64 = 1 << 21; // four chunks

    fn layout() -> Cbi1Layout {
        Cbi1Layout::new(11, BUCKETS).unwrap()
    }

    fn table() -> Vec<u64> {
        (0..BUCKETS).map(|i| i.wrapping_mul(0x9e37_79b9)).collect()
    }

    fn chunk(table: &[u64], index: u32, sequence: u64) -> ChunkView {
        let mut dst = BytesMut::new();
        encode_snapshot_chunk(&layout(), 5, sequence, table, index, &mut dst).unwrap();
        match decode_cbi1(&dst.freeze(), &layout()).unwrap() {
            Cbi1Payload::Chunk(chunk) => chunk,
            Cbi1Payload::Delta(_) => unreachable!("encoded a chunk"),
        }
    }

    #[test]
    fn a_table_the_allocator_refuses_is_a_typed_error_not_a_panic() {
        // 2^60 words (2^63 bytes) is beyond any allocation: refused without trying.
        assert_eq!(
            zeroed_table(1 << 60),
            Err(AssemblyError::AllocationFailed { bytes: 1 << 63 })
        );
        assert_eq!(zeroed_table(4).unwrap(), vec![0; 4]);
    }

    #[test]
    fn chunks_in_order_assemble_the_table() {
        let table = table();
        let mut assembler = SnapshotAssembler::new(layout(), 5);
        for index in 0..3 {
            assert_eq!(assembler.handle_chunk(&chunk(&table, index, 8)), Ok(None));
        }
        let snapshot = assembler
            .handle_chunk(&chunk(&table, 3, 8))
            .unwrap()
            .unwrap();
        assert_eq!(snapshot.sequence, 8);
        assert_eq!(snapshot.words, table);
        assert!(!assembler.is_assembling());
    }

    #[test]
    fn skipped_chunk_is_rejected_and_leaves_state_unchanged() {
        let table = table();
        let mut assembler = SnapshotAssembler::new(layout(), 5);
        assembler.handle_chunk(&chunk(&table, 0, 8)).unwrap();
        assert_eq!(
            assembler.handle_chunk(&chunk(&table, 2, 8)),
            Err(AssemblyError::OutOfOrder {
                expected: 1,
                found: 2
            })
        );
        assert_eq!(assembler.next_chunk_index(), Some(1));
        assert_eq!(assembler.handle_chunk(&chunk(&table, 1, 8)), Ok(None));
    }

    #[test]
    fn chunk_from_another_sequence_is_rejected() {
        let table = table();
        let mut assembler = SnapshotAssembler::new(layout(), 5);
        assembler.handle_chunk(&chunk(&table, 0, 8)).unwrap();
        assert_eq!(
            assembler.handle_chunk(&chunk(&table, 1, 9)),
            Err(AssemblyError::SequenceChanged {
                expected: 8,
                found: 9
            })
        );
    }

    #[test]
    fn chunk_before_chunk_zero_is_rejected() {
        let mut assembler = SnapshotAssembler::new(layout(), 5);
        assert_eq!(
            assembler.handle_chunk(&chunk(&table(), 1, 8)),
            Err(AssemblyError::NotStarted { chunk_index: 1 })
        );
        assert!(!assembler.is_assembling());
    }

    #[test]
    fn chunk_zero_restarts_the_assembly() {
        let table = table();
        let mut assembler = SnapshotAssembler::new(layout(), 5);
        assembler.handle_chunk(&chunk(&table, 0, 8)).unwrap();
        assembler.handle_chunk(&chunk(&table, 1, 8)).unwrap();
        assembler.handle_chunk(&chunk(&table, 0, 12)).unwrap();
        assert_eq!(assembler.next_chunk_index(), Some(1));
        for index in 1..3 {
            assembler.handle_chunk(&chunk(&table, index, 12)).unwrap();
        }
        let snapshot = assembler
            .handle_chunk(&chunk(&table, 3, 12))
            .unwrap()
            .unwrap();
        assert_eq!(snapshot.sequence, 12);
    }

    #[test]
    fn chunk_of_another_dc_is_rejected() {
        let mut assembler = SnapshotAssembler::new(layout(), 6);
        assert_eq!(
            assembler.handle_chunk(&chunk(&table(), 0, 8)),
            Err(AssemblyError::DcMismatch {
                expected: 6,
                found: 5
            })
        );
    }

    /// Chunk `index` of `table`, then `patch` applied to its bytes and the checksum redone.
    fn patched_chunk(table: &[u64], index: u32, patch: impl Fn(&mut BytesMut)) -> ChunkView {
        let mut dst = BytesMut::new();
        encode_snapshot_chunk(&layout(), 5, 8, table, index, &mut dst).unwrap();
        patch(&mut dst);
        crate::cbi1::header::seal(&mut dst, 0);
        match decode_cbi1(&dst.freeze(), &layout()).unwrap() {
            Cbi1Payload::Chunk(chunk) => chunk,
            Cbi1Payload::Delta(_) => unreachable!("encoded a chunk"),
        }
    }

    #[test]
    fn chunk_that_leaves_a_gap_is_rejected() {
        let table = table();
        let mut assembler = SnapshotAssembler::new(layout(), 5);
        assembler.handle_chunk(&chunk(&table, 0, 8)).unwrap();
        // Chunk 1 claiming to start one bucket late.
        let late = patched_chunk(&table, 1, |bytes| {
            let offset = (CHUNK_WORDS as u64 + 1).to_le_bytes();
            bytes[56..64].copy_from_slice(&offset);
            bytes.truncate(bytes.len() - 8);
        });
        assert_eq!(
            assembler.handle_chunk(&late),
            Err(AssemblyError::Gap {
                expected: CHUNK_WORDS as u64,
                found: CHUNK_WORDS as u64 + 1
            })
        );
        assert_eq!(assembler.next_chunk_index(), Some(1));
    }

    #[test]
    fn short_chunk_before_the_last_is_rejected() {
        let table = table();
        let mut assembler = SnapshotAssembler::new(layout(), 5);
        let short = patched_chunk(&table, 0, |bytes| bytes.truncate(bytes.len() - 8));
        assert_eq!(
            assembler.handle_chunk(&short),
            Err(AssemblyError::ShortChunk {
                chunk_index: 0,
                chunk_count: 4,
                expected: CHUNK_WORDS as u64,
                found: CHUNK_WORDS as u64 - 1,
            })
        );
        assert!(
            !assembler.is_assembling(),
            "a rejected chunk 0 starts nothing"
        );
    }

    #[test]
    fn short_last_chunk_is_incomplete() {
        let table = table();
        let mut assembler = SnapshotAssembler::new(layout(), 5);
        for index in 0..3 {
            assembler.handle_chunk(&chunk(&table, index, 8)).unwrap();
        }
        let short = patched_chunk(&table, 3, |bytes| bytes.truncate(bytes.len() - 8));
        assert_eq!(
            assembler.handle_chunk(&short),
            Err(AssemblyError::Incomplete {
                covered: BUCKETS - 1,
                bucket_count: BUCKETS
            })
        );
        assert!(assembler.is_assembling());
    }

    #[test]
    fn wrong_chunk_count_is_rejected() {
        let bad = patched_chunk(&table(), 0, |bytes| {
            bytes[52..56].copy_from_slice(&5u32.to_le_bytes())
        });
        let mut assembler = SnapshotAssembler::new(layout(), 5);
        assert_eq!(
            assembler.handle_chunk(&bad),
            Err(AssemblyError::ChunkCount {
                expected: 4,
                found: 5,
                bucket_count: BUCKETS
            })
        );
    }

    #[test]
    fn single_chunk_snapshot_completes_at_once() {
        let layout = Cbi1Layout::new(11, 16).unwrap();
        let table: Vec<u64> = (0..16).collect();
        let mut dst = BytesMut::new();
        encode_snapshot_chunk(&layout, 5, 3, &table, 0, &mut dst).unwrap();
        let Cbi1Payload::Chunk(chunk) = decode_cbi1(&dst.freeze(), &layout).unwrap() else {
            unreachable!("encoded a chunk")
        };
        let mut assembler = SnapshotAssembler::new(layout, 5);
        let snapshot = assembler.handle_chunk(&chunk).unwrap().unwrap();
        assert_eq!(snapshot.words, table);
        assert!(CHUNK_WORDS as u64 > 16);
    }
}
