//! Dirty-bucket tracking and the building of deltas and snapshot chunks.
//!
//! Every table write notes `(bucket, previous word)`; the first note of a bucket in a
//! window records its original value. Draining the window emits one absolute image per
//! bucket whose current word differs from its original (buckets that changed and changed
//! back are dropped), sorted by bucket index (a radix sort of the changed indices).

use std::num::NonZeroU32;

use crate::image::{BucketImage, Delta, SnapshotChunk};

/// Why publication data could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AllocFailed {
    pub(crate) bytes: u64,
}

/// Buckets touched since the last delta, with their values at the window's start.
#[derive(Debug, Clone)]
pub(crate) struct DirtyWindow {
    bits: Vec<u64>,
    touched: Vec<(u32, u64)>,
    bucket_count: usize,
    /// Bits in the largest bucket index (the radix sort's key width).
    index_bits: u32,
    /// Indices of the buckets that changed net, while draining.
    changed: Vec<u32>,
    /// The radix sort's second buffer.
    sort_scratch: Vec<u32>,
}

/// Changed-bucket lists up to this length are sorted by comparison, longer ones by radix.
const COMPARISON_SORT_MAX: usize = 64;

/// Statistics of one drained window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DrainStats {
    pub(crate) distinct_touched: u64,
    pub(crate) net_reverted: u64,
}

impl DirtyWindow {
    pub(crate) fn new(bucket_count: usize) -> Result<Self, AllocFailed> {
        let n_words = bucket_count.div_ceil(64);
        let mut bits = Vec::new();
        bits.try_reserve_exact(n_words).map_err(|_| AllocFailed {
            bytes: (n_words * 8) as u64,
        })?;
        bits.resize(n_words, 0);
        Ok(Self {
            bits,
            touched: Vec::new(),
            bucket_count,
            index_bits: usize::BITS - bucket_count.saturating_sub(1).leading_zeros(),
            changed: Vec::new(),
            sort_scratch: Vec::new(),
        })
    }

    /// Makes room for `n_more` newly touched buckets so noting them cannot allocate.
    pub(crate) fn reserve(&mut self, n_more: usize) -> Result<(), AllocFailed> {
        let room = self.bucket_count - self.touched.len();
        let n_more = n_more.min(room);
        self.touched.try_reserve(n_more).map_err(|_| AllocFailed {
            bytes: (n_more * 16) as u64,
        })
    }

    /// Notes a write to `bucket_idx` whose word was `previous`.
    #[inline]
    pub(crate) fn note(&mut self, bucket_idx: u32, previous: u64) {
        let idx = bucket_idx as usize;
        let bit = 1u64 << (idx % 64);
        let word = &mut self.bits[idx / 64];
        if *word & bit == 0 {
            *word |= bit;
            self.touched.push((bucket_idx, previous));
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.touched.is_empty()
    }

    /// Bytes held by the window.
    pub(crate) fn bytes(&self) -> u64 {
        (self.bits.capacity() * 8
            + self.touched.capacity() * 16
            + (self.changed.capacity() + self.sort_scratch.capacity()) * 4) as u64
    }

    /// Drains the window into a delta `base_sequence → base_sequence + 1` against the
    /// current `words`; `None` (and an empty window) when nothing changed net. On
    /// allocation failure the window is kept.
    pub(crate) fn drain(
        &mut self,
        words: &[u64],
        base_sequence: u64,
    ) -> Result<(Option<Delta>, DrainStats), AllocFailed> {
        let n_touched = self.touched.len();
        let alloc_failed = AllocFailed {
            bytes: (n_touched * 24) as u64,
        };
        let mut images = Vec::new();
        images
            .try_reserve_exact(n_touched)
            .map_err(|_| alloc_failed)?;
        self.changed.clear();
        self.changed
            .try_reserve(n_touched)
            .map_err(|_| alloc_failed)?;
        self.sort_scratch
            .try_reserve(n_touched)
            .map_err(|_| alloc_failed)?;
        let mut stats = DrainStats {
            distinct_touched: n_touched as u64,
            net_reverted: 0,
        };
        for &(bucket_idx, original) in &self.touched {
            if words[bucket_idx as usize] == original {
                stats.net_reverted += 1;
            } else {
                self.changed.push(bucket_idx);
            }
            self.bits[bucket_idx as usize / 64] = 0;
        }
        self.touched.clear();
        if self.changed.is_empty() {
            return Ok((None, stats));
        }
        if self.changed.len() <= COMPARISON_SORT_MAX {
            self.changed.sort_unstable();
        } else {
            radix_sort(&mut self.changed, &mut self.sort_scratch, self.index_bits);
        }
        images.extend(self.changed.iter().map(|&bucket_idx| BucketImage {
            bucket_idx,
            word: words[bucket_idx as usize],
        }));
        let delta = Delta {
            base_sequence,
            sequence: base_sequence + 1,
            images,
        };
        Ok((Some(delta), stats))
    }
}

/// Sorts `keys` (each below `1 << key_bits`) ascending: least-significant-digit radix
/// sort with 8-bit digits, skipping digits all keys share; `scratch` is the second buffer
/// (reserved by the caller, so nothing allocates).
fn radix_sort(keys: &mut Vec<u32>, scratch: &mut Vec<u32>, key_bits: u32) {
    let n_keys = keys.len();
    let mut shift = 0;
    while shift < key_bits {
        let mut starts = [0usize; 256];
        for &key in keys.iter() {
            starts[((key >> shift) & 0xFF) as usize] += 1;
        }
        if starts.contains(&n_keys) {
            shift += 8;
            continue;
        }
        let mut total = 0;
        for start in &mut starts {
            let count = *start;
            *start = total;
            total += count;
        }
        scratch.clear();
        scratch.resize(n_keys, 0);
        for &key in keys.iter() {
            let digit = ((key >> shift) & 0xFF) as usize;
            scratch[starts[digit]] = key;
            starts[digit] += 1;
        }
        std::mem::swap(keys, scratch);
        shift += 8;
    }
}

/// Splits `words` into snapshot chunks of at most `chunk_buckets` words at `sequence`.
pub(crate) fn snapshot_chunks(
    sequence: u64,
    words: &[u64],
    chunk_buckets: NonZeroU32,
) -> Result<Vec<SnapshotChunk>, AllocFailed> {
    let chunk_len = chunk_buckets.get() as usize;
    let chunk_count = words.len().div_ceil(chunk_len);
    let alloc_failed = AllocFailed {
        bytes: (words.len() * 8) as u64,
    };
    let mut chunks = Vec::new();
    chunks
        .try_reserve_exact(chunk_count)
        .map_err(|_| alloc_failed)?;
    for (chunk_index, part) in words.chunks(chunk_len).enumerate() {
        let mut chunk_words = Vec::new();
        chunk_words
            .try_reserve_exact(part.len())
            .map_err(|_| alloc_failed)?;
        chunk_words.extend_from_slice(part);
        chunks.push(SnapshotChunk {
            sequence,
            bucket_count: words.len() as u64,
            // Bucket counts are at most 2^24, so chunk indices and counts fit in u32.
            chunk_index: chunk_index as u32,
            chunk_count: chunk_count as u32,
            first_bucket: (chunk_index * chunk_len) as u64,
            words: chunk_words,
        });
    }
    Ok(chunks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delta_is_coalesced_sorted_and_drops_net_reverted_buckets() {
        let mut window = DirtyWindow::new(8).unwrap();
        let mut words = vec![0u64; 8];
        window.reserve(8).unwrap();
        // Bucket 5 changes twice, bucket 2 changes, bucket 3 changes and reverts.
        for (bucket, value) in [(5u32, 1u64), (2, 7), (5, 9), (3, 4), (3, 0)] {
            window.note(bucket, words[bucket as usize]);
            words[bucket as usize] = value;
        }
        let (delta, stats) = window.drain(&words, 4).unwrap();
        let delta = delta.unwrap();
        assert_eq!((delta.base_sequence, delta.sequence), (4, 5));
        assert_eq!(
            delta.images,
            vec![
                BucketImage {
                    bucket_idx: 2,
                    word: 7
                },
                BucketImage {
                    bucket_idx: 5,
                    word: 9
                }
            ]
        );
        assert_eq!(
            stats,
            DrainStats {
                distinct_touched: 3,
                net_reverted: 1
            }
        );
        assert!(window.is_empty());
        assert_eq!(window.drain(&words, 5).unwrap().0, None);
    }

    proptest::proptest! {
        #[test]
        fn radix_sort_orders_like_a_comparison_sort(
            key_bits in 1u32..=24,
            raw in proptest::collection::vec(proptest::prelude::any::<u32>(), 0..400),
        ) {
            let mut keys: Vec<u32> = raw.iter().map(|k| k & ((1u32 << key_bits) - 1)).collect();
            let mut expected = keys.clone();
            expected.sort_unstable();
            let mut scratch = Vec::with_capacity(keys.len());
            radix_sort(&mut keys, &mut scratch, key_bits);
            proptest::prop_assert_eq!(keys, expected);
        }
    }

    #[test]
    fn large_deltas_are_sorted_by_bucket() {
        // More changed buckets than the comparison-sort cutoff, noted in scrambled order.
        let bucket_count = 1 << 12;
        let mut window = DirtyWindow::new(bucket_count).unwrap();
        let mut words = vec![0u64; bucket_count];
        window.reserve(bucket_count).unwrap();
        for i in 0..300u32 {
            let bucket = (i.wrapping_mul(2_654_435_761) >> 7) % bucket_count as u32;
            window.note(bucket, words[bucket as usize]);
            words[bucket as usize] = u64::from(i) + 1;
        }
        let delta = window.drain(&words, 0).unwrap().0.unwrap();
        assert!(delta.images.len() > COMPARISON_SORT_MAX);
        assert!(
            delta
                .images
                .windows(2)
                .all(|w| w[0].bucket_idx < w[1].bucket_idx)
        );
        for image in &delta.images {
            assert_eq!(image.word, words[image.bucket_idx as usize]);
        }
        let n_changed = words.iter().filter(|&&w| w != 0).count();
        assert_eq!(delta.images.len(), n_changed);
    }

    #[test]
    fn snapshot_chunks_cover_the_table_in_order() {
        let words: Vec<u64> = (0..10).collect();
        let chunks = snapshot_chunks(3, &words, NonZeroU32::new(4).unwrap()).unwrap();
        assert_eq!(chunks.len(), 3);
        for (i, chunk) in chunks.iter().enumerate() {
            assert_eq!(chunk.chunk_index as usize, i);
            assert_eq!(chunk.chunk_count, 3);
            assert_eq!(chunk.sequence, 3);
            assert_eq!(chunk.bucket_count, 10);
            assert_eq!(chunk.first_bucket as usize, i * 4);
        }
        let joined: Vec<u64> = chunks.iter().flat_map(|c| c.words.clone()).collect();
        assert_eq!(joined, words);
    }
}
