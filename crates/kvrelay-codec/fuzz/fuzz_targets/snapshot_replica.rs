//! A `kvrelay-ckf` replica fed a sequence of sealed CBI1 chunk payloads, decoded and
//! converted the way every subscriber does (`decode_cbi1`, then
//! `ChunkView::to_snapshot_chunk`): it never panics, a rejected chunk leaves it invalid
//! (answering nothing) until a chunk 0 restarts it, and a completed snapshot holds exactly
//! the words of the accepted chunks, one per bucket.
//!
//! Each run stays cheap: the first byte picks a small single-chunk layout (2..=4096
//! buckets) or a two- or four-chunk layout (2^20 or 2^21 buckets: chunk order, duplicates
//! and epochs across chunks need more than one chunk). Steps ask for short chunks, or for
//! exactly the words that reach the end of a chunk; at most two full 4 MiB chunks are built
//! per run, enough to complete one two-chunk snapshot.
#![no_main]

use bytes::Bytes;
use kvrelay_ckf::{Replica, ReplicaStatus};
use kvrelay_codec::v1::CkfFormat;
use kvrelay_codec::cbi1::{self, CHUNK_WORDS, Cbi1Layout, Cbi1Payload, snapshot_chunk_count};
use libfuzzer_sys::fuzz_target;

mod support;

const DC_ID: u64 = 7;
/// Bucket words a run may build in total (two full chunks).
const WORD_BUDGET: usize = 2 * CHUNK_WORDS;
/// Chunks up to this many words are always cheap enough to build in full.
const SMALL_REST: usize = 4096;

fuzz_target!(|data: &[u8]| {
    let (flags, steps) = support::flag(data);
    let Ok(layout) = Cbi1Layout::new(0, bucket_count(flags)) else {
        return;
    };
    let Some(mut run) = Run::new(layout) else {
        return;
    };
    for (step_no, step) in steps.chunks_exact(6).enumerate() {
        run.step(step_no as u64, step);
    }
});

/// 2..=4096 buckets (one chunk) unless the top bit is set: then 2^20 or 2^21 (2 or 4 chunks).
fn bucket_count(flags: u8) -> u64 {
    match flags >> 6 {
        2 => 1 << 20,
        3 => 1 << 21,
        _ => 1 << (1 + u32::from(flags) % 12),
    }
}

/// Word `i` of a chunk of `n` words built with `seed`: its first and last words are unique
/// to the step (so a misplaced chunk shows), the others repeat the seed's low byte (a
/// memset, cheap even for a 4 MiB chunk).
fn word(seed: u64, i: u64, n: u64) -> u64 {
    if i == 0 || i + 1 == n {
        edge_word(seed, i)
    } else {
        u64::from_le_bytes([seed as u8; 8])
    }
}

fn edge_word(seed: u64, i: u64) -> u64 {
    seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ i
}

/// What the target expects the replica to hold: the accepted chunks since chunk 0.
struct Run {
    layout: Cbi1Layout,
    replica: Replica,
    words_left: usize,
    sequence: u64,
    filled: u64,
    /// `(bucket_offset, n_words, seed)` of each accepted chunk of the current assembly.
    segments: Vec<(u64, u64, u64)>,
}

impl Run {
    fn new(layout: Cbi1Layout) -> Option<Self> {
        let format = CkfFormat {
            format_version: 1,
            seed: 0,
            bucket_count: layout.bucket_count(),
            fingerprint_bits: 16,
            slots_per_bucket: 4,
        }
        .domain()
        .ok()?;
        Some(Self {
            layout,
            replica: Replica::new(format).ok()?,
            words_left: WORD_BUDGET,
            sequence: 0,
            filled: 0,
            segments: Vec::new(),
        })
    }

    /// One step: u8 chunk index, u8 chunk count, u8 epoch (top bit: another `dc_id`),
    /// u8 word count, u8 offset, u8 filler seed and body shape.
    fn step(&mut self, step_no: u64, step: &[u8]) {
        let bucket_count = self.layout.bucket_count();
        let count = snapshot_chunk_count(bucket_count);
        let chunk_index = u32::from(step[0] % 5);
        let chunk_count = match step[1] % 4 {
            0 => count,
            1 => count + 1,
            2 => count - 1,
            _ => u32::from(step[1] >> 2),
        };
        let epoch = u64::from(step[2] % 4);
        let dc_id = if step[2] & 0x80 == 0 {
            DC_ID
        } else {
            DC_ID + 1
        };
        let nominal = u64::from(chunk_index) * CHUNK_WORDS as u64;
        let offset = match step[4] % 5 {
            0 => nominal,
            1 => self.filled,
            2 => self.filled + 1,
            3 => self.filled.saturating_sub(1),
            _ => u64::from(step[4] >> 3),
        };
        let rest = bucket_count.saturating_sub(offset).min(CHUNK_WORDS as u64) as usize;
        let small = usize::from(step[3] >> 3);
        // Chunk-sized word counts are cheap below 4096 words; above, only the selector
        // values 0xfd..=0xff ask for them, so most runs of a large layout stay small.
        let mut n_words = match (step[3] % 5, rest <= SMALL_REST || step[3] >= 0xfd) {
            (0, _) => 0,
            (1, true) => rest,
            (2, true) => rest.saturating_sub(1),
            (3, true) => rest + 1,
            _ => small,
        };
        if n_words > self.words_left {
            n_words = small;
        }
        self.words_left = self.words_left.saturating_sub(n_words);
        let seed = u64::from(step[5]) | step_no << 8;
        let shape = step[5] % 16;

        let mut payload = Vec::with_capacity(64 + n_words * 8 + 8);
        payload.extend_from_slice(b"CBI1");
        payload.extend_from_slice(&1u16.to_le_bytes());
        payload.extend_from_slice(&1u16.to_le_bytes());
        payload.extend_from_slice(&[16, 4]);
        payload.extend_from_slice(&1u16.to_le_bytes());
        payload.extend_from_slice(&0u64.to_le_bytes());
        payload.extend_from_slice(&bucket_count.to_le_bytes());
        payload.extend_from_slice(&dc_id.to_le_bytes());
        payload.extend_from_slice(&epoch.to_le_bytes());
        payload.extend_from_slice(&0u32.to_le_bytes());
        payload.extend_from_slice(&chunk_index.to_le_bytes());
        payload.extend_from_slice(&chunk_count.to_le_bytes());
        payload.extend_from_slice(&offset.to_le_bytes());
        let words_at = payload.len();
        payload.resize(words_at + n_words * 8, step[5]);
        for i in [0, n_words.saturating_sub(1)].into_iter().take(n_words) {
            let at = words_at + i * 8;
            payload[at..at + 8].copy_from_slice(&edge_word(seed, i as u64).to_le_bytes());
        }
        match shape {
            // Word bytes that are not a multiple of 8.
            15 => payload.extend(std::iter::repeat_n(0, usize::from(step[5] >> 4) % 7 + 1)),
            // A body shorter than the 16-byte chunk header.
            14 => payload.truncate(48 + usize::from(step[5] >> 4)),
            _ => {}
        }
        support::reseal(&mut payload);
        let Ok(Cbi1Payload::Chunk(chunk)) = cbi1::decode_cbi1(&Bytes::from(payload), &self.layout)
        else {
            return;
        };

        match self.replica.install_chunk(&chunk.to_snapshot_chunk()) {
            Err(_) => {
                assert_eq!(self.replica.status(), ReplicaStatus::Invalid);
                assert!(self.replica.words().is_none(), "an invalid replica answered");
                self.segments.clear();
                self.filled = 0;
            }
            Ok(done) => {
                if chunk.chunk_index() == 0 {
                    self.segments.clear();
                    self.sequence = epoch;
                }
                assert_eq!(chunk.bucket_offset(), self.filled_for(chunk.chunk_index()));
                self.filled = offset + n_words as u64;
                self.segments.push((offset, n_words as u64, seed));
                if !done {
                    assert_eq!(
                        self.replica.status(),
                        ReplicaStatus::Assembling {
                            sequence: self.sequence
                        }
                    );
                    assert!(self.replica.words().is_none(), "a partial snapshot answered");
                    return;
                }
                assert_eq!(
                    self.replica.status(),
                    ReplicaStatus::Ready {
                        sequence: self.sequence
                    }
                );
                assert_eq!(chunk.chunk_index() + 1, chunk.chunk_count());
                assert_eq!(self.filled, bucket_count);
                let Some(words) = self.replica.words() else {
                    panic!("a complete snapshot answers");
                };
                assert_eq!(words.len() as u64, bucket_count);
                for &(at, n, seed) in &self.segments {
                    let got = &words[at as usize..(at + n) as usize];
                    let expected: Vec<u64> = (0..n).map(|i| word(seed, i, n)).collect();
                    assert!(got == expected, "snapshot words differ from the chunks");
                }
                self.segments.clear();
                self.filled = 0;
            }
        }
    }

    /// Where an accepted chunk `chunk_index` must have started: bucket 0 for chunk 0, else
    /// where the previous accepted chunk ended.
    fn filled_for(&self, chunk_index: u32) -> u64 {
        if chunk_index == 0 { 0 } else { self.filled }
    }
}
