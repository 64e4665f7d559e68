//! Publication images: the plain data a producer publishes and a replica applies.
//!
//! A stream is a consistent snapshot at sequence `S` (one or more [`SnapshotChunk`]s,
//! each carrying dense absolute bucket words), then deltas `S → S+1 → …`, each a list of
//! absolute [`BucketImage`]s (bucket index and its complete new word). These types carry
//! no bytes and no checksum: the codec crate maps them to and from the CBI1 layout.

/// Buckets per snapshot chunk by default: 524,288 words (4 MiB), the CBI1 chunk size.
pub const SNAPSHOT_CHUNK_BUCKETS: u32 = 1 << 19;

/// The largest bucket count a stream may carry (2^24, bucket indices fit in `u32`).
pub const MAX_BUCKET_COUNT: u64 = 1 << 24;

/// The absolute value of one bucket: its index and its complete 64-bit word.
///
/// A word holds four 16-bit fingerprint slots, slot `i` in bits `16*i..16*i+16`,
/// 0 meaning an empty slot. A word of 0 is a valid image (the bucket became empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BucketImage {
    /// The bucket index, `< bucket_count`.
    pub bucket_idx: u32,
    /// The bucket's complete new word.
    pub word: u64,
}

/// One published batch: moves a replica from `base_sequence` to `sequence`.
///
/// A filter produces deltas with `sequence == base_sequence + 1`; a publisher may
/// coalesce consecutive ones into one delta `S → S+k` (see [`crate::stream`]). Every
/// delta has at least one image, sorted by strictly increasing `bucket_idx` (each bucket
/// once, its latest word).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Delta {
    /// The sequence the replica must be at before applying this delta.
    pub base_sequence: u64,
    /// The sequence the replica is at after applying it (`> base_sequence`).
    pub sequence: u64,
    /// Absolute images of the buckets that changed, sorted by `bucket_idx`, no repeats.
    pub images: Vec<BucketImage>,
}

/// One chunk of a consistent snapshot at `sequence`.
///
/// Chunk `chunk_index` of `chunk_count` covers buckets `first_bucket ..
/// first_bucket + words.len()`; chunks are sent in index order and together cover
/// `0..bucket_count` exactly once.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SnapshotChunk {
    /// The stream sequence this snapshot is consistent at.
    pub sequence: u64,
    /// The filter's bucket count (a power of two).
    pub bucket_count: u64,
    /// This chunk's index, `< chunk_count`.
    pub chunk_index: u32,
    /// How many chunks the snapshot has (> 0).
    pub chunk_count: u32,
    /// The bucket index of `words[0]`.
    pub first_bucket: u64,
    /// Dense absolute bucket words.
    pub words: Vec<u64>,
}
