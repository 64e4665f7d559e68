//! CBI1 ("cuckoo bucket images v1"): the byte layout of a pool frame's payload.
//!
//! Every payload starts with the same 48-byte [`header`] (magic, versions, filter layout,
//! `dc_id`, epoch and an xxh3 checksum of the body), followed by a snapshot [`chunk`] body
//! (dense bucket words) or a [`delta`] body (absolute bucket images). All integers are
//! little-endian. Bucket words are copied straight between `u64`s and the byte buffer; a
//! decoded payload shares the receive buffer.

pub mod chunk;
pub mod delta;
pub mod header;

pub use chunk::{ChunkView, encode_snapshot_chunk, snapshot_chunk_count};
pub use delta::{DeltaView, encode_delta};
pub use header::{
    CBI1_HEADER_LEN, CBI1_MAGIC, CBI1_WIRE_VERSION, CHUNK_HEADER_LEN, CHUNK_WORDS,
    CKF_FORMAT_DENSE_VERSION, CKF_FORMAT_VERSION, Cbi1Error, Cbi1FrameType, Cbi1Header, Cbi1Layout,
    Cbi1Payload, DELTA_HEADER_LEN, DELTA_IMAGE_LEN, FINGERPRINT_BITS, MAX_BUCKET_COUNT,
    MAX_CBI1_LEN, MAX_DELTA_IMAGES, SLOTS_PER_BUCKET, decode_cbi1,
};
