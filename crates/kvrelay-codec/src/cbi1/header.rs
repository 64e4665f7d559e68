//! The 48-byte CBI1 header, the filter layout it pins, limits and errors.
//!
//! | offset | size | field |
//! | --- | --- | --- |
//! | 0 | 4 | magic, ASCII `CBI1` |
//! | 4 | 2 | wire version, 1 |
//! | 6 | 2 | frame type: 1 snapshot chunk, 2 delta |
//! | 8 | 1 | fingerprint bits, 16 |
//! | 9 | 1 | slots per bucket, 4 |
//! | 10 | 2 | CKF format version: 1, or 2 (kvrelay's dense format) |
//! | 12 | 8 | seed |
//! | 20 | 8 | bucket count |
//! | 28 | 8 | `dc_id` of the pool |
//! | 36 | 8 | epoch: the stream sequence of this payload |
//! | 44 | 4 | low 32 bits of unseeded `xxh3_64(body)`, body = bytes 48.. |

use bytes::{BufMut, Bytes, BytesMut};
use twox_hash::XxHash3_64;

use super::chunk::{ChunkView, decode_chunk_body};
use super::delta::{DeltaView, decode_delta_body};

/// The payload magic, ASCII `CBI1`.
pub const CBI1_MAGIC: [u8; 4] = *b"CBI1";
/// The only CBI1 wire version.
pub const CBI1_WIRE_VERSION: u16 = 1;
/// Header length, in bytes.
pub const CBI1_HEADER_LEN: usize = 48;
/// CKF format 1, the reference's (power-of-two bucket count).
pub const CKF_FORMAT_VERSION: u16 = 1;
/// CKF format 2, kvrelay's dense format (any bucket count in range); only kvrelay's own
/// protocol carries it.
pub const CKF_FORMAT_DENSE_VERSION: u16 = 2;
/// Fingerprint width of CKF format 1, in bits.
pub const FINGERPRINT_BITS: u8 = 16;
/// Slots per bucket of CKF format 1.
pub const SLOTS_PER_BUCKET: u8 = 4;
/// The largest bucket count (2^24, so every bucket index fits a `u32`).
pub const MAX_BUCKET_COUNT: u64 = 1 << 24;
/// Bucket words per snapshot chunk (512 Ki words, 4 MiB); chunk `k` starts at bucket
/// `k * CHUNK_WORDS`.
pub const CHUNK_WORDS: usize = 1 << 19;
/// Chunk body header (index u32, count u32, bucket offset u64), in bytes.
pub const CHUNK_HEADER_LEN: usize = 16;
/// Delta body header (base epoch u64, image count u32), in bytes.
pub const DELTA_HEADER_LEN: usize = 12;
/// One delta image (bucket u32, word u64), in bytes.
pub const DELTA_IMAGE_LEN: usize = 12;
/// The largest payload: a full snapshot chunk, 4,194,368 bytes.
pub const MAX_CBI1_LEN: usize = CBI1_HEADER_LEN + CHUNK_HEADER_LEN + CHUNK_WORDS * 8;
/// The most images one delta can carry within [`MAX_CBI1_LEN`]: 349,525.
pub const MAX_DELTA_IMAGES: usize =
    (MAX_CBI1_LEN - CBI1_HEADER_LEN - DELTA_HEADER_LEN) / DELTA_IMAGE_LEN;

/// The filter layout a payload must match: the format version, seed and bucket count
/// (fingerprint bits and slots are fixed by CBI1).
///
/// Invariant: `bucket_count` is in `2..=MAX_BUCKET_COUNT`, a power of two in format 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cbi1Layout {
    format_version: u16,
    seed: u64,
    bucket_count: u64,
}

impl Cbi1Layout {
    /// A format 1 layout, if `bucket_count` is a power of two in `2..=MAX_BUCKET_COUNT`.
    pub fn new(seed: u64, bucket_count: u64) -> Result<Self, Cbi1Error> {
        Self::for_format(CKF_FORMAT_VERSION, seed, bucket_count)
    }

    /// A layout of CKF format `format_version` (1 or 2): the bucket count must be in
    /// `2..=MAX_BUCKET_COUNT`, and a power of two in format 1.
    pub fn for_format(
        format_version: u16,
        seed: u64,
        bucket_count: u64,
    ) -> Result<Self, Cbi1Error> {
        // The per-version rules live with the format's identity (kvrelay-identity).
        let invalid = Cbi1Error::InvalidBucketCount { bucket_count };
        let count = u32::try_from(bucket_count).map_err(|_| invalid.clone())?;
        match kvrelay_identity::CkfFormat::from_parts(
            format_version,
            seed,
            count,
            FINGERPRINT_BITS,
            SLOTS_PER_BUCKET,
        ) {
            Ok(_) => {}
            Err(kvrelay_identity::CkfFormatError::UnsupportedVersion { .. }) => {
                return Err(Cbi1Error::UnsupportedFormat {
                    format_version,
                    fingerprint_bits: FINGERPRINT_BITS,
                    slots_per_bucket: SLOTS_PER_BUCKET,
                });
            }
            Err(_) => return Err(invalid),
        }
        Ok(Self {
            format_version,
            seed,
            bucket_count,
        })
    }

    /// The CKF format version (1, or 2 for the dense format).
    pub fn format_version(&self) -> u16 {
        self.format_version
    }

    /// The filter seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The number of buckets (a power of two in format 1).
    pub fn bucket_count(&self) -> u64 {
        self.bucket_count
    }
}

/// The two CBI1 payload types.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cbi1FrameType {
    /// Dense bucket words of one snapshot chunk.
    SnapshotChunk,
    /// Absolute images of changed buckets.
    Delta,
}

impl Cbi1FrameType {
    /// The wire code.
    pub fn code(self) -> u16 {
        match self {
            Cbi1FrameType::SnapshotChunk => 1,
            Cbi1FrameType::Delta => 2,
        }
    }
}

/// A decoded, checked CBI1 header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Cbi1Header {
    /// Snapshot chunk or delta.
    pub frame_type: Cbi1FrameType,
    /// The filter layout (equal to the expected one once decoded).
    pub layout: Cbi1Layout,
    /// The pool's `DcId` value.
    pub dc_id: u64,
    /// The stream sequence of this payload (the snapshot sequence for chunks).
    pub epoch: u64,
}

/// A decoded CBI1 payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cbi1Payload {
    /// One snapshot chunk.
    Chunk(ChunkView),
    /// One delta.
    Delta(DeltaView),
}

impl Cbi1Payload {
    /// The header common to both types.
    pub fn header(&self) -> &Cbi1Header {
        match self {
            Cbi1Payload::Chunk(chunk) => chunk.header(),
            Cbi1Payload::Delta(delta) => delta.header(),
        }
    }
}

/// A CBI1 payload that cannot be encoded or accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Cbi1Error {
    /// Shorter than the header.
    #[error("cbi1 payload of {len} bytes is shorter than the 48-byte header")]
    TooShort {
        /// Payload length.
        len: usize,
    },
    /// Longer than [`MAX_CBI1_LEN`].
    #[error("cbi1 payload of {len} bytes exceeds {MAX_CBI1_LEN}")]
    TooLong {
        /// Payload length.
        len: usize,
    },
    /// Not the `CBI1` magic.
    #[error("cbi1 magic {found:02x?} is not CBI1")]
    BadMagic {
        /// The bytes found.
        found: [u8; 4],
    },
    /// Another wire version (unsupported, not malformed).
    #[error("cbi1 wire version {version} is not supported")]
    UnsupportedWireVersion {
        /// The version found.
        version: u16,
    },
    /// The body checksum does not match.
    #[error("cbi1 checksum {declared:#010x} does not match body checksum {computed:#010x}")]
    ChecksumMismatch {
        /// Checksum in the header.
        declared: u32,
        /// Checksum of the received body.
        computed: u32,
    },
    /// A frame type other than snapshot chunk or delta (unsupported).
    #[error("cbi1 frame type {code} is not supported")]
    UnsupportedFrameType {
        /// The type code found.
        code: u16,
    },
    /// A CKF format other than version 1 or 2 with 16-bit fingerprints and 4 slots
    /// (unsupported).
    #[error(
        "ckf format version {format_version} with {fingerprint_bits}-bit fingerprints and {slots_per_bucket} slots is not supported"
    )]
    UnsupportedFormat {
        /// CKF format version.
        format_version: u16,
        /// Fingerprint bits.
        fingerprint_bits: u8,
        /// Slots per bucket.
        slots_per_bucket: u8,
    },
    /// The bucket count is outside `2..=MAX_BUCKET_COUNT`, or not a power of two in
    /// format 1.
    #[error("bucket count {bucket_count} is outside 2..=16777216 or (format 1) not a power of two")]
    InvalidBucketCount {
        /// The bucket count.
        bucket_count: u64,
    },
    /// Seed or bucket count differs from the subscribed producer's format.
    #[error(
        "cbi1 layout seed {found_seed:#x} bucket count {found_bucket_count} differs from expected seed {expected_seed:#x} bucket count {expected_bucket_count}"
    )]
    LayoutMismatch {
        /// Expected seed.
        expected_seed: u64,
        /// Expected bucket count.
        expected_bucket_count: u64,
        /// Seed in the payload.
        found_seed: u64,
        /// Bucket count in the payload.
        found_bucket_count: u64,
    },
    /// A supported CKF format other than the subscribed producer's.
    #[error("cbi1 ckf format {found} differs from the expected format {expected}")]
    FormatMismatch {
        /// Expected format version.
        expected: u16,
        /// Format version in the payload.
        found: u16,
    },
    /// A delta body shorter than its 12-byte header.
    #[error("delta body of {len} bytes is shorter than its 12-byte header")]
    DeltaBodyTooShort {
        /// Body length.
        len: usize,
    },
    /// More delta images than [`MAX_DELTA_IMAGES`].
    #[error("delta image count {count} exceeds {MAX_DELTA_IMAGES}")]
    TooManyImages {
        /// Declared or requested image count.
        count: usize,
    },
    /// The delta body length disagrees with its image count.
    #[error("delta body of {len} bytes does not hold {count} images ({expected} bytes)")]
    DeltaBodyLength {
        /// Body length.
        len: usize,
        /// Declared image count.
        count: u32,
        /// Expected body length.
        expected: usize,
    },
    /// A bucket index at or past the bucket count.
    #[error("bucket index {bucket_idx} is out of range for bucket count {bucket_count}")]
    BucketOutOfRange {
        /// The bucket index.
        bucket_idx: u64,
        /// The bucket count.
        bucket_count: u64,
    },
    /// A chunk body shorter than its 16-byte header.
    #[error("chunk body of {len} bytes is shorter than its 16-byte header")]
    ChunkBodyTooShort {
        /// Body length.
        len: usize,
    },
    /// Chunk index not below a non-zero chunk count.
    #[error("chunk index {chunk_index} is not below chunk count {chunk_count}")]
    ChunkIndex {
        /// Chunk index.
        chunk_index: u32,
        /// Chunk count.
        chunk_count: u32,
    },
    /// Chunk word bytes not a multiple of 8.
    #[error("chunk word bytes {len} are not a multiple of 8")]
    ChunkWordBytes {
        /// Length of the word area.
        len: usize,
    },
    /// A chunk that reaches past the bucket count, or holds more than [`CHUNK_WORDS`].
    #[error(
        "chunk at bucket offset {bucket_offset} with {n_words} words exceeds bucket count {bucket_count}"
    )]
    ChunkRange {
        /// First bucket of the chunk.
        bucket_offset: u64,
        /// Words in the chunk.
        n_words: usize,
        /// Bucket count.
        bucket_count: u64,
    },
    /// A snapshot table whose length is not the layout's bucket count (encoder).
    #[error("snapshot table of {n_words} words does not match bucket count {bucket_count}")]
    TableLength {
        /// Table length.
        n_words: usize,
        /// Bucket count.
        bucket_count: u64,
    },
}

impl Cbi1Error {
    /// True when the payload is well formed but uses a version, type or format this codec
    /// does not speak: the consumer should quarantine the pool, not blame the relay.
    pub fn is_unsupported(&self) -> bool {
        matches!(
            self,
            Cbi1Error::UnsupportedWireVersion { .. }
                | Cbi1Error::UnsupportedFrameType { .. }
                | Cbi1Error::UnsupportedFormat { .. }
        )
    }
}

/// Decodes and checks a CBI1 payload against the subscribed filter layout.
///
/// Checks, in order: length, magic, wire version, checksum, format and layout, frame type,
/// then the body. The result shares `payload`'s buffer. Never panics.
///
/// ```
/// use bytes::BytesMut;
/// use kvrelay_codec::cbi1::{self, Cbi1Layout, Cbi1Payload};
///
/// let layout = Cbi1Layout::new(7, 4)?;
/// let mut dst = BytesMut::new();
/// cbi1::encode_snapshot_chunk(&layout, 1, 9, &[1, 0, 0, 5], 0, &mut dst)?;
/// let Cbi1Payload::Chunk(chunk) = cbi1::decode_cbi1(&dst.freeze(), &layout)? else {
///     unreachable!()
/// };
/// assert_eq!(chunk.words().collect::<Vec<_>>(), vec![1, 0, 0, 5]);
/// # Ok::<(), cbi1::Cbi1Error>(())
/// ```
pub fn decode_cbi1(payload: &Bytes, expected: &Cbi1Layout) -> Result<Cbi1Payload, Cbi1Error> {
    let len = payload.len();
    if len < CBI1_HEADER_LEN {
        return Err(Cbi1Error::TooShort { len });
    }
    if len > MAX_CBI1_LEN {
        return Err(Cbi1Error::TooLong { len });
    }
    let raw = &payload[..CBI1_HEADER_LEN];
    let found = array4(raw, 0);
    if found != CBI1_MAGIC {
        return Err(Cbi1Error::BadMagic { found });
    }
    let version = u16_at(raw, 4);
    if version != CBI1_WIRE_VERSION {
        return Err(Cbi1Error::UnsupportedWireVersion { version });
    }
    let declared = u32::from_le_bytes(array4(raw, 44));
    let computed = checksum(&payload[CBI1_HEADER_LEN..]);
    if declared != computed {
        return Err(Cbi1Error::ChecksumMismatch { declared, computed });
    }
    let (fingerprint_bits, slots_per_bucket, format_version) = (raw[8], raw[9], u16_at(raw, 10));
    if !matches!(
        format_version,
        CKF_FORMAT_VERSION | CKF_FORMAT_DENSE_VERSION
    ) || fingerprint_bits != FINGERPRINT_BITS
        || slots_per_bucket != SLOTS_PER_BUCKET
    {
        return Err(Cbi1Error::UnsupportedFormat {
            format_version,
            fingerprint_bits,
            slots_per_bucket,
        });
    }
    if format_version != expected.format_version {
        return Err(Cbi1Error::FormatMismatch {
            expected: expected.format_version,
            found: format_version,
        });
    }
    let (found_seed, found_bucket_count) = (u64_at(raw, 12), u64_at(raw, 20));
    if found_seed != expected.seed || found_bucket_count != expected.bucket_count {
        return Err(Cbi1Error::LayoutMismatch {
            expected_seed: expected.seed,
            expected_bucket_count: expected.bucket_count,
            found_seed,
            found_bucket_count,
        });
    }
    let frame_type = match u16_at(raw, 6) {
        1 => Cbi1FrameType::SnapshotChunk,
        2 => Cbi1FrameType::Delta,
        code => return Err(Cbi1Error::UnsupportedFrameType { code }),
    };
    let header = Cbi1Header {
        frame_type,
        layout: *expected,
        dc_id: u64_at(raw, 28),
        epoch: u64_at(raw, 36),
    };
    let body = payload.slice(CBI1_HEADER_LEN..);
    match frame_type {
        Cbi1FrameType::SnapshotChunk => decode_chunk_body(header, body).map(Cbi1Payload::Chunk),
        Cbi1FrameType::Delta => decode_delta_body(header, body).map(Cbi1Payload::Delta),
    }
}

/// Appends a header with a zero checksum; [`seal`] fills it once the body is written.
pub(super) fn put_header(
    dst: &mut BytesMut,
    frame_type: Cbi1FrameType,
    layout: &Cbi1Layout,
    dc_id: u64,
    epoch: u64,
) {
    dst.put_slice(&CBI1_MAGIC);
    dst.put_u16_le(CBI1_WIRE_VERSION);
    dst.put_u16_le(frame_type.code());
    dst.put_u8(FINGERPRINT_BITS);
    dst.put_u8(SLOTS_PER_BUCKET);
    dst.put_u16_le(layout.format_version);
    dst.put_u64_le(layout.seed);
    dst.put_u64_le(layout.bucket_count);
    dst.put_u64_le(dc_id);
    dst.put_u64_le(epoch);
    dst.put_u32_le(0);
}

/// Writes the checksum of the payload that starts at `start` in `dst`.
pub(crate) fn seal(dst: &mut BytesMut, start: usize) {
    let sum = checksum(&dst[start + CBI1_HEADER_LEN..]);
    dst[start + 44..start + 48].copy_from_slice(&sum.to_le_bytes());
}

/// The CBI1 body checksum: the low 32 bits of unseeded xxh3-64.
///
/// `twox-hash` picks AVX2 or SSE2 at run time (xxhash-rust fixes SSE2 at compile time for
/// default build flags), which roughly doubles the speed on bodies past 240 bytes.
pub(crate) fn checksum(body: &[u8]) -> u32 {
    XxHash3_64::oneshot(body) as u32
}

pub(super) fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

pub(super) fn array4(bytes: &[u8], at: usize) -> [u8; 4] {
    let mut out = [0u8; 4];
    out.copy_from_slice(&bytes[at..at + 4]);
    out
}

pub(super) fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut out = [0u8; 8];
    out.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(out)
}

#[cfg(test)]
mod tests {
    use xxhash_rust::xxh3::xxh3_64;

    use super::*;

    /// Seeded filler so every length sees different bytes.
    fn bytes(len: usize) -> Vec<u8> {
        let mut state = len as u64 ^ 0x9e37_79b9_7f4a_7c15;
        (0..len)
            .map(|_| {
                state = state
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                (state >> 56) as u8
            })
            .collect()
    }

    fn check(len: usize) {
        let body = bytes(len);
        assert_eq!(
            XxHash3_64::oneshot(&body),
            xxh3_64(&body),
            "xxh3-64 of {len} bytes differs between twox-hash and xxhash-rust"
        );
        assert_eq!(
            checksum(&body),
            xxh3_64(&body) as u32,
            "checksum of {len} bytes"
        );
    }

    #[test]
    fn checksum_matches_xxhash_rust_on_every_short_length() {
        // Covers each xxh3 size class: 0, 1..=3, 4..=8, 9..=16, 17..=128, 129..=240, 241+.
        for len in 0..=300 {
            check(len);
        }
    }

    #[test]
    fn checksum_matches_xxhash_rust_on_long_lengths() {
        // Around the 1 KiB stripe block and the largest body a payload can carry.
        for len in [
            1023,
            1024,
            1025,
            4096,
            65_537,
            1 << 20,
            MAX_CBI1_LEN - CBI1_HEADER_LEN,
        ] {
            check(len);
        }
    }

    #[test]
    fn checksum_of_empty_body_is_the_xxh3_reference_value() {
        // The published unseeded XXH3_64bits of the empty input.
        assert_eq!(XxHash3_64::oneshot(&[]), 0x2d06_8005_38d3_94c2);
        assert_eq!(checksum(&[]), 0x38d3_94c2);
    }
}
