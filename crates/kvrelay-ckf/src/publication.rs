//! Dirty-bucket tracking and the building of deltas and snapshot chunks.
//!
//! Every table write notes `(bucket, previous word)`; the first note of a bucket in a
//! window records its original value and sets the bucket's bit. Draining the window emits
//! one absolute image per bucket whose current word differs from its original (buckets
//! that changed and changed back are dropped), in bucket order: reverted buckets lose
//! their bit, then the set bits are read in order, skipping empty words of the bitset by
//! a summary bitset (one bit per bitset word), so no sort is needed.

use std::num::NonZeroU32;

use kvrelay_identity::CkfFormat;

use crate::counters::FilterCounters;
use crate::format::{CkfConfig, ConfigError};
use crate::image::{BucketImage, Delta, SnapshotChunk};
use crate::ownership::{BarrierSnapshot, PublishError};
use crate::table::Table;

/// Why publication data could not be built.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AllocFailed {
    pub(crate) bytes: u64,
}

/// Buckets touched since the last delta, with their values at the window's start.
#[derive(Debug, Clone)]
pub(crate) struct DirtyWindow {
    /// One bit per bucket: touched in this window.
    bits: Vec<u64>,
    /// One bit per word of `bits`: that word may have a set bit.
    summary: Vec<u64>,
    touched: Vec<(u32, u64)>,
    bucket_count: usize,
}

/// Statistics of one drained window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct DrainStats {
    pub(crate) distinct_touched: u64,
    pub(crate) net_reverted: u64,
}

impl DirtyWindow {
    pub(crate) fn new(bucket_count: usize) -> Result<Self, AllocFailed> {
        let n_words = bucket_count.div_ceil(64);
        let n_summary_words = n_words.div_ceil(64);
        let alloc_failed = AllocFailed {
            bytes: ((n_words + n_summary_words) * 8) as u64,
        };
        let mut bits = Vec::new();
        bits.try_reserve_exact(n_words).map_err(|_| alloc_failed)?;
        bits.resize(n_words, 0);
        let mut summary = Vec::new();
        summary
            .try_reserve_exact(n_summary_words)
            .map_err(|_| alloc_failed)?;
        summary.resize(n_summary_words, 0);
        Ok(Self {
            bits,
            summary,
            touched: Vec::new(),
            bucket_count,
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
            self.summary[idx / 4096] |= 1u64 << ((idx / 64) % 64);
            self.touched.push((bucket_idx, previous));
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.touched.is_empty()
    }

    /// Distinct buckets touched in this window.
    pub(crate) fn touched_len(&self) -> usize {
        self.touched.len()
    }

    /// Bytes held by the window.
    pub(crate) fn bytes(&self) -> u64 {
        ((self.bits.capacity() + self.summary.capacity()) * 8 + self.touched.capacity() * 16) as u64
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
        let mut images = Vec::new();
        images
            .try_reserve_exact(n_touched)
            .map_err(|_| AllocFailed {
                bytes: (n_touched * 16) as u64,
            })?;
        let mut stats = DrainStats {
            distinct_touched: n_touched as u64,
            net_reverted: 0,
        };
        for &(bucket_idx, original) in &self.touched {
            let idx = bucket_idx as usize;
            if words[idx] == original {
                stats.net_reverted += 1;
                self.bits[idx / 64] &= !(1u64 << (idx % 64));
            }
        }
        self.touched.clear();
        // Every set bit is a changed bucket; take them in order, clearing as we go.
        for (summary_idx, summary_word) in self.summary.iter_mut().enumerate() {
            let mut pending_words = std::mem::take(summary_word);
            while pending_words != 0 {
                let word_idx = summary_idx * 64 + pending_words.trailing_zeros() as usize;
                pending_words &= pending_words - 1;
                let mut pending_bits = std::mem::take(&mut self.bits[word_idx]);
                while pending_bits != 0 {
                    let idx = word_idx * 64 + pending_bits.trailing_zeros() as usize;
                    pending_bits &= pending_bits - 1;
                    // Bucket counts are at most 2^24, so indices fit in u32.
                    images.push(BucketImage {
                        bucket_idx: idx as u32,
                        word: words[idx],
                    });
                }
            }
        }
        if images.is_empty() {
            return Ok((None, stats));
        }
        let delta = Delta {
            base_sequence,
            sequence: base_sequence + 1,
            images,
        };
        Ok((Some(delta), stats))
    }
}

/// A fresh table in `config`'s format and the dirty window that records its writes, both
/// allocated fallibly: what either producer publishes from.
pub(crate) fn published_table(
    config: &CkfConfig,
) -> Result<(CkfFormat, Table, DirtyWindow), ConfigError> {
    let format = config.format()?;
    let table = Table::new(format, config.max_kicks)?;
    let window = DirtyWindow::new(format.bucket_count() as usize).map_err(|failed| {
        ConfigError::AllocationFailed {
            what: "dirty window",
            bytes: failed.bytes,
        }
    })?;
    Ok((format, table, window))
}

/// Publishes `window` over `words` as the delta `sequence → sequence + 1` and moves
/// `sequence`; `None` when no bucket changed net (the sequence does not move). On `Err`
/// the window is kept. Shared by both producers ([`crate::PoolFilter`],
/// [`crate::MembershipFilter`]).
pub(crate) fn publish_delta(
    window: &mut DirtyWindow,
    words: &[u64],
    sequence: &mut u64,
    counters: &mut FilterCounters,
) -> Result<Option<Delta>, PublishError> {
    if window.is_empty() {
        return Ok(None);
    }
    if *sequence == u64::MAX {
        return Err(PublishError::SequenceExhausted {
            sequence: *sequence,
        });
    }
    let (delta, stats) = window
        .drain(words, *sequence)
        .map_err(|AllocFailed { bytes }| PublishError::AllocationFailed { bytes })?;
    counters.net_reverted_buckets += stats.net_reverted;
    if let Some(delta) = &delta {
        counters.deltas_published += 1;
        counters.images_published += delta.images.len() as u64;
        *sequence = delta.sequence;
    }
    Ok(delta)
}

/// The pending changes as `tail`, then `words` at the resulting sequence in chunks of at
/// most `chunk_buckets` words; on `Err` nothing was published and the window is kept.
pub(crate) fn barrier_snapshot(
    window: &mut DirtyWindow,
    words: &[u64],
    sequence: &mut u64,
    counters: &mut FilterCounters,
    chunk_buckets: NonZeroU32,
) -> Result<BarrierSnapshot, PublishError> {
    // Copy first (the only large allocation), then drain: a failed copy keeps the tail.
    let mut chunks = snapshot_chunks(*sequence, words, chunk_buckets)
        .map_err(|AllocFailed { bytes }| PublishError::AllocationFailed { bytes })?;
    let tail = publish_delta(window, words, sequence, counters)?;
    for chunk in &mut chunks {
        chunk.sequence = *sequence;
    }
    counters.snapshots_taken += 1;
    Ok(BarrierSnapshot { tail, chunks })
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
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

        #[test]
        fn drained_images_match_a_model_window(
            bucket_count in proptest::prop_oneof![1usize..300, proptest::strategy::Just(1usize << 13)],
            windows in proptest::collection::vec(
                proptest::collection::vec((0u32..1 << 13, 0u64..4), 0..200),
                1..4,
            ),
        ) {
            let mut window = DirtyWindow::new(bucket_count).unwrap();
            let mut words = vec![0u64; bucket_count];
            for writes in windows {
                window.reserve(writes.len()).unwrap();
                let mut originals = std::collections::BTreeMap::new();
                for (bucket, value) in writes {
                    let bucket = bucket % bucket_count as u32;
                    originals.entry(bucket).or_insert(words[bucket as usize]);
                    window.note(bucket, words[bucket as usize]);
                    words[bucket as usize] = value;
                }
                let expected: Vec<BucketImage> = originals
                    .iter()
                    .filter(|&(&b, &original)| words[b as usize] != original)
                    .map(|(&bucket_idx, _)| BucketImage { bucket_idx, word: words[bucket_idx as usize] })
                    .collect();
                let (delta, stats) = window.drain(&words, 0).unwrap();
                proptest::prop_assert_eq!(stats.distinct_touched, originals.len() as u64);
                proptest::prop_assert_eq!(delta.map(|d| d.images).unwrap_or_default(), expected);
                proptest::prop_assert!(window.is_empty());
            }
        }
    }

    #[test]
    fn large_deltas_are_sorted_by_bucket() {
        // Changed buckets noted in scrambled order, across many bitset and summary words,
        // some changed back.
        let bucket_count = 1 << 14;
        let mut window = DirtyWindow::new(bucket_count).unwrap();
        let mut words = vec![0u64; bucket_count];
        window.reserve(bucket_count).unwrap();
        for i in 0..600u32 {
            let bucket = (i.wrapping_mul(2_654_435_761) >> 7) % bucket_count as u32;
            window.note(bucket, words[bucket as usize]);
            words[bucket as usize] = if i % 5 == 0 { 0 } else { u64::from(i) + 1 };
        }
        let delta = window.drain(&words, 0).unwrap().0.unwrap();
        assert!(window.is_empty());
        assert!(window.bits.iter().chain(&window.summary).all(|&w| w == 0));
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
