//! The counting cuckoo filter core: exact ownership, event application, publication
//! images, replicas and multi-pool prefix queries.
//!
//! # API for other crates
//!
//! - **Events in** ([`event`]): [`RouterEvent`] = [`SourceId`] `{worker_id, dp_rank}` +
//!   `event_id` + [`EventPayload`] (`Stored` chain with optional parent engine block id and
//!   per-block `engine_block_id` + `token_hash`; `Removed` engine block ids; `AllCleared`).
//! - **Images out** ([`image`]): [`BucketImage`] `{bucket_idx, word}` (absolute word),
//!   [`Delta`] `{base_sequence, sequence, images}` (coalesced, sorted, never empty) and
//!   [`SnapshotChunk`] `{sequence, bucket_count, chunk_index, chunk_count, first_bucket,
//!   words}`. Plain data; the codec crate owns their CBI1 bytes and checksum.
//!
//! # Invariants
//!
//! Pure and single-threaded: no tokio, no clock, no IO, no ambient randomness (relocation
//! is driven by a seed passed in). Every fallible mutation validates first: on `Err` the
//! state is unchanged.

pub mod event;
pub mod image;

pub use event::{EventPayload, RemovedBlocks, RouterEvent, SourceId, StoredBlock, StoredBlocks};
pub use image::{BucketImage, Delta, MAX_BUCKET_COUNT, SNAPSHOT_CHUNK_BUCKETS, SnapshotChunk};
