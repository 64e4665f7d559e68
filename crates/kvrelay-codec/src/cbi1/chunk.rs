//! Snapshot chunks: dense bucket words of one slice of the table.
//!
//! Body: chunk index u32, chunk count u32, bucket offset u64, then `n` bucket words (u64
//! each). Chunk `k` of a snapshot covers buckets `k * CHUNK_WORDS ..` up to the bucket
//! count; `chunk_count = ceil(bucket_count / CHUNK_WORDS)`.

use bytes::{BufMut, Bytes, BytesMut};
use kvrelay_ckf::SnapshotChunk;
use zerocopy::IntoBytes;

use super::header::{
    self, CBI1_HEADER_LEN, CHUNK_HEADER_LEN, CHUNK_WORDS, Cbi1Error, Cbi1FrameType, Cbi1Header,
    Cbi1Layout, u64_at,
};

/// How many chunks a snapshot of `bucket_count` buckets has (at least 1).
pub fn snapshot_chunk_count(bucket_count: u64) -> u32 {
    bucket_count.div_ceil(CHUNK_WORDS as u64).max(1) as u32
}

/// Appends chunk `chunk_index` of the snapshot of `table` (the whole filter, one word per
/// bucket) at sequence `epoch` to `dst`.
///
/// Fails without touching `dst` if `table.len()` is not the layout's bucket count or the
/// index is not below [`snapshot_chunk_count`].
pub fn encode_snapshot_chunk(
    layout: &Cbi1Layout,
    dc_id: u64,
    epoch: u64,
    table: &[u64],
    chunk_index: u32,
    dst: &mut BytesMut,
) -> Result<(), Cbi1Error> {
    let bucket_count = layout.bucket_count();
    if table.len() as u64 != bucket_count {
        return Err(Cbi1Error::TableLength {
            n_words: table.len(),
            bucket_count,
        });
    }
    let chunk_count = snapshot_chunk_count(bucket_count);
    if chunk_index >= chunk_count {
        return Err(Cbi1Error::ChunkIndex {
            chunk_index,
            chunk_count,
        });
    }
    let first = chunk_index as usize * CHUNK_WORDS;
    let words = &table[first..table.len().min(first + CHUNK_WORDS)];
    let start = dst.len();
    dst.reserve(CBI1_HEADER_LEN + CHUNK_HEADER_LEN + words.len() * 8);
    header::put_header(dst, Cbi1FrameType::SnapshotChunk, layout, dc_id, epoch);
    dst.put_u32_le(chunk_index);
    dst.put_u32_le(chunk_count);
    dst.put_u64_le(first as u64);
    // A copy then a one-shot xxh3 (AVX2 when the CPU has it): with the hash at ~50 GB/s,
    // copying and hashing 64 KiB pieces while they are in L2 measured no faster.
    put_words(dst, words);
    header::seal(dst, start);
    Ok(())
}

/// A decoded snapshot chunk; its words share the receive buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkView {
    header: Cbi1Header,
    chunk_index: u32,
    chunk_count: u32,
    bucket_offset: u64,
    words: Bytes,
}

impl ChunkView {
    /// The payload header.
    pub fn header(&self) -> &Cbi1Header {
        &self.header
    }

    /// This chunk's index, `< chunk_count`.
    pub fn chunk_index(&self) -> u32 {
        self.chunk_index
    }

    /// The snapshot's chunk count (> 0).
    pub fn chunk_count(&self) -> u32 {
        self.chunk_count
    }

    /// The bucket index of the first word.
    pub fn bucket_offset(&self) -> u64 {
        self.bucket_offset
    }

    /// The number of words (`<= CHUNK_WORDS`).
    pub fn n_words(&self) -> usize {
        self.words.len() / 8
    }

    /// The words, in bucket order.
    pub fn words(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.words.chunks_exact(8).map(|bytes| u64_at(bytes, 0))
    }

    /// Copies the words into `dst[..n_words()]`; returns how many were copied
    /// (`min(dst.len(), n_words())`). One `memcpy` on little-endian targets.
    pub fn copy_words_into(&self, dst: &mut [u64]) -> usize {
        let n = dst.len().min(self.n_words());
        let out = &mut dst[..n];
        out.as_mut_bytes().copy_from_slice(&self.words[..n * 8]);
        for word in out.iter_mut() {
            // A no-op on little-endian targets.
            *word = u64::from_le(*word);
        }
        n
    }

    /// The raw little-endian word bytes.
    pub fn word_bytes(&self) -> &Bytes {
        &self.words
    }

    /// This chunk as a `kvrelay-ckf` snapshot chunk, at the payload's epoch: what a
    /// [`kvrelay_ckf::Replica`] (or a query-table lane) installs. The words are copied out
    /// of the receive buffer (at most [`CHUNK_WORDS`], bounded by the decoder).
    pub fn to_snapshot_chunk(&self) -> SnapshotChunk {
        SnapshotChunk {
            sequence: self.header.epoch,
            bucket_count: self.header.layout.bucket_count(),
            chunk_index: self.chunk_index,
            chunk_count: self.chunk_count,
            first_bucket: self.bucket_offset,
            words: self.words().collect(),
        }
    }
}

pub(super) fn decode_chunk_body(header: Cbi1Header, body: Bytes) -> Result<ChunkView, Cbi1Error> {
    if body.len() < CHUNK_HEADER_LEN {
        return Err(Cbi1Error::ChunkBodyTooShort { len: body.len() });
    }
    let chunk_index = u32::from_le_bytes(header::array4(&body, 0));
    let chunk_count = u32::from_le_bytes(header::array4(&body, 4));
    let bucket_offset = u64_at(&body, 8);
    if chunk_index >= chunk_count {
        return Err(Cbi1Error::ChunkIndex {
            chunk_index,
            chunk_count,
        });
    }
    let word_len = body.len() - CHUNK_HEADER_LEN;
    if !word_len.is_multiple_of(8) {
        return Err(Cbi1Error::ChunkWordBytes { len: word_len });
    }
    let n_words = word_len / 8;
    let bucket_count = header.layout.bucket_count();
    let fits = bucket_offset
        .checked_add(n_words as u64)
        .is_some_and(|end| end <= bucket_count);
    if n_words > CHUNK_WORDS || !fits {
        return Err(Cbi1Error::ChunkRange {
            bucket_offset,
            n_words,
            bucket_count,
        });
    }
    Ok(ChunkView {
        header,
        chunk_index,
        chunk_count,
        bucket_offset,
        words: body.slice(CHUNK_HEADER_LEN..),
    })
}

/// Appends `words` little-endian: one `memcpy` on little-endian targets.
#[cfg(target_endian = "little")]
pub(super) fn put_words(dst: &mut BytesMut, words: &[u64]) {
    dst.put_slice(words.as_bytes());
}

/// Appends `words` little-endian through a small stack buffer (one bounds check per block,
/// not per word).
#[cfg(not(target_endian = "little"))]
pub(super) fn put_words(dst: &mut BytesMut, words: &[u64]) {
    const BLOCK: usize = 512;
    let mut buf = [0u8; BLOCK * 8];
    for block in words.chunks(BLOCK) {
        let out = &mut buf[..block.len() * 8];
        for (bytes, word) in out.chunks_exact_mut(8).zip(block) {
            bytes.copy_from_slice(&word.to_le_bytes());
        }
        dst.put_slice(out);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use crate::cbi1::{Cbi1Payload, decode_cbi1};

    fn layout(bucket_count: u64) -> Cbi1Layout {
        Cbi1Layout::new(0x5eed, bucket_count).unwrap()
    }

    fn decode_chunk(bytes: BytesMut, layout: &Cbi1Layout) -> Result<ChunkView, Cbi1Error> {
        match decode_cbi1(&bytes.freeze(), layout)? {
            Cbi1Payload::Chunk(chunk) => Ok(chunk),
            Cbi1Payload::Delta(_) => Err(Cbi1Error::UnsupportedFrameType { code: 2 }),
        }
    }

    #[test]
    fn chunk_round_trips_words_and_header() {
        let layout = layout(8);
        let table: Vec<u64> = (0..8).map(|i| i * 0x0101_0101_0101).collect();
        let mut dst = BytesMut::new();
        encode_snapshot_chunk(&layout, 42, 17, &table, 0, &mut dst).unwrap();
        let chunk = decode_chunk(dst, &layout).unwrap();
        assert_eq!(chunk.header().dc_id, 42);
        assert_eq!(chunk.header().epoch, 17);
        assert_eq!((chunk.chunk_index(), chunk.chunk_count()), (0, 1));
        assert_eq!(chunk.words().collect::<Vec<_>>(), table);
        let mut copy = vec![0u64; 8];
        assert_eq!(chunk.copy_words_into(&mut copy), 8);
        assert_eq!(copy, table);
    }

    #[test]
    fn a_dense_layout_round_trips_and_is_told_apart_from_format_1() {
        use crate::cbi1::CKF_FORMAT_DENSE_VERSION;
        let dense = Cbi1Layout::for_format(CKF_FORMAT_DENSE_VERSION, 0x5eed, 7).unwrap();
        let table: Vec<u64> = (0..7).map(|i| i * 3 + 1).collect();
        let mut dst = BytesMut::new();
        encode_snapshot_chunk(&dense, 1, 9, &table, 0, &mut dst).unwrap();
        assert_eq!(
            u16::from_le_bytes([dst[10], dst[11]]),
            CKF_FORMAT_DENSE_VERSION
        );
        let chunk = decode_chunk(dst.clone(), &dense).unwrap();
        assert_eq!(chunk.words().collect::<Vec<_>>(), table);
        assert_eq!(chunk.header().layout, dense);
        // The same bytes against a format 1 subscription (of any count) are refused by
        // format before the count is compared.
        let v1 = layout(8);
        assert_eq!(
            decode_chunk(dst, &v1).unwrap_err(),
            Cbi1Error::FormatMismatch {
                expected: 1,
                found: CKF_FORMAT_DENSE_VERSION
            }
        );
        // Format 1 still needs a power of two; format 3 is unsupported.
        assert_eq!(
            Cbi1Layout::for_format(1, 0, 7),
            Err(Cbi1Error::InvalidBucketCount { bucket_count: 7 })
        );
        assert!(matches!(
            Cbi1Layout::for_format(3, 0, 8),
            Err(Cbi1Error::UnsupportedFormat {
                format_version: 3,
                ..
            })
        ));
        assert_eq!(
            Cbi1Layout::for_format(CKF_FORMAT_DENSE_VERSION, 0, 1),
            Err(Cbi1Error::InvalidBucketCount { bucket_count: 1 })
        );
    }

    #[test]
    fn large_table_splits_into_fixed_size_chunks() {
        let bucket_count = 1u64 << 20;
        let layout = layout(bucket_count);
        let table: Vec<u64> = (0..bucket_count).collect();
        assert_eq!(snapshot_chunk_count(bucket_count), 2);
        let mut dst = BytesMut::new();
        encode_snapshot_chunk(&layout, 1, 1, &table, 1, &mut dst).unwrap();
        let chunk = decode_chunk(dst, &layout).unwrap();
        assert_eq!(chunk.bucket_offset(), CHUNK_WORDS as u64);
        assert_eq!(chunk.n_words(), CHUNK_WORDS);
        assert_eq!(chunk.words().next(), Some(CHUNK_WORDS as u64));
    }

    #[test]
    fn table_of_wrong_length_is_refused_before_writing() {
        let mut dst = BytesMut::new();
        assert_eq!(
            encode_snapshot_chunk(&layout(8), 1, 1, &[0; 4], 0, &mut dst),
            Err(Cbi1Error::TableLength {
                n_words: 4,
                bucket_count: 8
            })
        );
        assert!(dst.is_empty());
    }

    #[test]
    fn chunk_index_past_count_is_refused() {
        let mut dst = BytesMut::new();
        assert_eq!(
            encode_snapshot_chunk(&layout(8), 1, 1, &[0; 8], 1, &mut dst),
            Err(Cbi1Error::ChunkIndex {
                chunk_index: 1,
                chunk_count: 1
            })
        );
    }

    #[test]
    fn chunk_reaching_past_bucket_count_is_rejected() {
        let small = layout(4);
        let mut dst = BytesMut::new();
        encode_snapshot_chunk(&layout(8), 1, 1, &[0; 8], 0, &mut dst).unwrap();
        // Re-stamp the header with the smaller layout so only the range check fails.
        dst[20..28].copy_from_slice(&4u64.to_le_bytes());
        header::seal(&mut dst, 0);
        assert_eq!(
            decode_chunk(dst, &small),
            Err(Cbi1Error::ChunkRange {
                bucket_offset: 0,
                n_words: 8,
                bucket_count: 4
            })
        );
    }
}
