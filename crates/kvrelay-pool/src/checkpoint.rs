//! Pool checkpoints: one pool generation's exact ownership (every source's engine block
//! id → canonical hash mappings) and, per source, the last engine batch sequence applied,
//! as one self-checking byte string a relay writes whole and reads back after a restart.
//!
//! # Format (version 1, little-endian)
//!
//! ```text
//! magic      8 bytes  "KVRCKPT1"
//! version    u32      1
//! identity   u32 length + UTF-8 bytes (who wrote it, for what pool; compared by the reader)
//! written    u64      unix milliseconds
//! n_sources  u32
//! per source:
//!   worker_id u64, dp_rank u32, last_sequence u64, last_digest u64, n_mappings u64,
//!   n_mappings × (engine_block_id u64, canonical u64)
//! checksum   u64      XXH3-64 of every byte before it
//! ```
//!
//! Plain fixed-width fields rather than a serialisation crate: the payload is two arrays
//! of integers, and a reader that checks the checksum first and every count against the
//! bytes left can never allocate more than the file it was handed. Decoding is
//! all-or-nothing: any error rejects the whole checkpoint ([`CheckpointError`]).

use kvrelay_ckf::SourceId;

/// The first eight bytes of every checkpoint.
pub const CHECKPOINT_MAGIC: [u8; 8] = *b"KVRCKPT1";

/// The format version this build writes and reads.
pub const CHECKPOINT_VERSION: u32 = 1;

/// Longest identity string accepted (bytes).
pub const MAX_CHECKPOINT_IDENTITY_BYTES: usize = 4096;

/// Bytes of one mapping.
const MAPPING_BYTES: usize = 16;
/// Bytes of a source header.
const SOURCE_HEADER_BYTES: usize = 8 + 4 + 8 + 8 + 8;

/// One pool generation's checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolCheckpoint {
    /// What the checkpoint belongs to (relay, pool, endpoint, hashing), written by the
    /// caller and compared by it on restore: a checkpoint of anything else is foreign.
    pub identity: String,
    /// When it was written (unix milliseconds), for the reader's staleness bound.
    pub written_unix_ms: u64,
    /// Every source that can be resumed, in ascending source order.
    pub sources: Vec<SourceCheckpoint>,
}

/// One source's part of a checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SourceCheckpoint {
    /// The engine source.
    pub source: SourceId,
    /// The sequence of the last engine batch whose events are all in `mappings` (later
    /// batches may be too: applying a suffix of a source's log again leaves the same state,
    /// so a restore resumes from the next sequence).
    pub last_sequence: u64,
    /// XXH3-64 of that batch's payload, by which a resume recognises the engine that
    /// published it (`kvrelay_ingest::batch_digest`).
    pub last_digest: u64,
    /// `(engine block id, canonical hash)`, as `PoolFilter::source_mappings` lists them.
    pub mappings: Vec<(u64, u64)>,
}

impl PoolCheckpoint {
    /// Mappings over all sources.
    pub fn n_mappings(&self) -> u64 {
        self.sources.iter().map(|s| s.mappings.len() as u64).sum()
    }

    /// The encoded size in bytes.
    pub fn encoded_len(&self) -> usize {
        8 + 4
            + 4
            + self.identity.len()
            + 8
            + 4
            + self
                .sources
                .iter()
                .map(|s| SOURCE_HEADER_BYTES + s.mappings.len() * MAPPING_BYTES)
                .sum::<usize>()
            + 8
    }

    /// The checkpoint's bytes (see the module docs).
    pub fn encode(&self) -> Result<Vec<u8>, CheckpointError> {
        if self.identity.len() > MAX_CHECKPOINT_IDENTITY_BYTES {
            return Err(CheckpointError::Malformed {
                what: "identity longer than 4096 bytes",
            });
        }
        let n_sources =
            u32::try_from(self.sources.len()).map_err(|_| CheckpointError::Malformed {
                what: "more than u32::MAX sources",
            })?;
        let len = self.encoded_len();
        let mut out = Vec::new();
        out.try_reserve_exact(len)
            .map_err(|_| CheckpointError::Allocation { bytes: len as u64 })?;
        out.extend_from_slice(&CHECKPOINT_MAGIC);
        out.extend_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
        out.extend_from_slice(&(self.identity.len() as u32).to_le_bytes());
        out.extend_from_slice(self.identity.as_bytes());
        out.extend_from_slice(&self.written_unix_ms.to_le_bytes());
        out.extend_from_slice(&n_sources.to_le_bytes());
        for source in &self.sources {
            out.extend_from_slice(&source.source.worker_id.to_le_bytes());
            out.extend_from_slice(&source.source.dp_rank.to_le_bytes());
            out.extend_from_slice(&source.last_sequence.to_le_bytes());
            out.extend_from_slice(&source.last_digest.to_le_bytes());
            out.extend_from_slice(&(source.mappings.len() as u64).to_le_bytes());
            for &(engine_block_id, canonical) in &source.mappings {
                out.extend_from_slice(&engine_block_id.to_le_bytes());
                out.extend_from_slice(&canonical.to_le_bytes());
            }
        }
        let checksum = xxhash_rust::xxh3::xxh3_64(&out);
        out.extend_from_slice(&checksum.to_le_bytes());
        Ok(out)
    }

    /// Reads a checkpoint; any error rejects all of it. Never allocates more than
    /// `bytes.len()` (every count is checked against the bytes left first).
    pub fn decode(bytes: &[u8]) -> Result<Self, CheckpointError> {
        if bytes.len() < CHECKPOINT_MAGIC.len() || bytes[..8] != CHECKPOINT_MAGIC {
            return Err(CheckpointError::Foreign);
        }
        if bytes.len() < 8 + 4 + 8 {
            return Err(CheckpointError::Truncated);
        }
        let version = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
        if version != CHECKPOINT_VERSION {
            return Err(CheckpointError::UnsupportedVersion { version });
        }
        let (body, trailer) = bytes.split_at(bytes.len() - 8);
        let mut stored = [0u8; 8];
        stored.copy_from_slice(trailer);
        let stored = u64::from_le_bytes(stored);
        let computed = xxhash_rust::xxh3::xxh3_64(body);
        if stored != computed {
            return Err(CheckpointError::ChecksumMismatch { stored, computed });
        }
        let mut reader = Reader { rest: &body[12..] };
        let identity_len = reader.u32()? as usize;
        if identity_len > MAX_CHECKPOINT_IDENTITY_BYTES {
            return Err(CheckpointError::Malformed {
                what: "identity longer than 4096 bytes",
            });
        }
        let identity = std::str::from_utf8(reader.take(identity_len)?)
            .map_err(|_| CheckpointError::Malformed {
                what: "identity is not UTF-8",
            })?
            .to_owned();
        let written_unix_ms = reader.u64()?;
        let n_sources = reader.u32()? as usize;
        if n_sources > reader.rest.len() / SOURCE_HEADER_BYTES {
            return Err(CheckpointError::Truncated);
        }
        let mut sources = Vec::with_capacity(n_sources);
        for _ in 0..n_sources {
            let worker_id = reader.u64()?;
            let dp_rank = reader.u32()?;
            let last_sequence = reader.u64()?;
            let last_digest = reader.u64()?;
            let n_mappings = reader.u64()?;
            let Some(n_bytes) = usize::try_from(n_mappings)
                .ok()
                .and_then(|n| n.checked_mul(MAPPING_BYTES))
                .filter(|&n| n <= reader.rest.len())
            else {
                return Err(CheckpointError::Truncated);
            };
            let raw = reader.take(n_bytes)?;
            let mut mappings = Vec::new();
            mappings
                .try_reserve_exact(n_bytes / MAPPING_BYTES)
                .map_err(|_| CheckpointError::Allocation {
                    bytes: n_bytes as u64,
                })?;
            mappings.extend(raw.chunks_exact(MAPPING_BYTES).map(|pair| {
                let (id, canonical) = pair.split_at(8);
                (le_u64(id), le_u64(canonical))
            }));
            let source = SourceId::new(worker_id, dp_rank);
            if sources
                .last()
                .is_some_and(|prev: &SourceCheckpoint| prev.source >= source)
            {
                return Err(CheckpointError::Malformed {
                    what: "sources not in ascending order",
                });
            }
            sources.push(SourceCheckpoint {
                source,
                last_sequence,
                last_digest,
                mappings,
            });
        }
        if !reader.rest.is_empty() {
            return Err(CheckpointError::Malformed {
                what: "bytes after the last source",
            });
        }
        Ok(Self {
            identity,
            written_unix_ms,
            sources,
        })
    }
}

fn le_u64(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(bytes);
    u64::from_le_bytes(word)
}

struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CheckpointError> {
        if n > self.rest.len() {
            return Err(CheckpointError::Truncated);
        }
        let (head, rest) = self.rest.split_at(n);
        self.rest = rest;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, CheckpointError> {
        let bytes = self.take(4)?;
        Ok(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
    }

    fn u64(&mut self) -> Result<u64, CheckpointError> {
        self.take(8).map(le_u64)
    }
}

/// Why a checkpoint was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// Not a checkpoint (wrong magic).
    #[error("not a kvrelay checkpoint (bad magic)")]
    Foreign,
    /// Written by a format version this build does not read.
    #[error("checkpoint format version {version} is not supported")]
    UnsupportedVersion {
        /// The version found.
        version: u32,
    },
    /// Shorter than its own counts say.
    #[error("checkpoint is truncated")]
    Truncated,
    /// The bytes do not match their checksum.
    #[error("checkpoint checksum mismatch (stored {stored:#018x}, computed {computed:#018x})")]
    ChecksumMismatch {
        /// The checksum in the file.
        stored: u64,
        /// The checksum of the bytes read.
        computed: u64,
    },
    /// Structurally invalid despite a good checksum.
    #[error("checkpoint is malformed: {what}")]
    Malformed {
        /// What is wrong.
        what: &'static str,
    },
    /// A buffer could not be allocated.
    #[error("allocation of {bytes} bytes for a checkpoint failed")]
    Allocation {
        /// Bytes requested.
        bytes: u64,
    },
}

impl CheckpointError {
    /// A stable lowercase name (metric label).
    pub fn kind(&self) -> &'static str {
        match self {
            CheckpointError::Foreign => "foreign",
            CheckpointError::UnsupportedVersion { .. } => "version",
            CheckpointError::Truncated => "truncated",
            CheckpointError::ChecksumMismatch { .. } => "checksum",
            CheckpointError::Malformed { .. } => "malformed",
            CheckpointError::Allocation { .. } => "allocation",
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn sample() -> PoolCheckpoint {
        PoolCheckpoint {
            identity: "relay 1 pool abc endpoint ns.backend.generate".to_owned(),
            written_unix_ms: 1_700_000_000_000,
            sources: vec![
                SourceCheckpoint {
                    source: SourceId::new(1, 0),
                    last_sequence: 41,
                    last_digest: 0xD16E57,
                    mappings: vec![(10, 100), (11, 101), (u64::MAX, 7)],
                },
                SourceCheckpoint {
                    source: SourceId::new(1, 1),
                    last_sequence: 0,
                    last_digest: 0,
                    mappings: Vec::new(),
                },
            ],
        }
    }

    #[test]
    fn a_checkpoint_reads_back_exactly() {
        let checkpoint = sample();
        let bytes = checkpoint.encode().unwrap();
        assert_eq!(bytes.len(), checkpoint.encoded_len());
        assert_eq!(PoolCheckpoint::decode(&bytes).unwrap(), checkpoint);
        assert_eq!(checkpoint.n_mappings(), 3);
    }

    #[test]
    fn foreign_old_and_future_files_are_named() {
        assert_eq!(
            PoolCheckpoint::decode(b"{\"json\": true}").unwrap_err(),
            CheckpointError::Foreign
        );
        assert_eq!(
            PoolCheckpoint::decode(b"").unwrap_err(),
            CheckpointError::Foreign
        );
        let mut bytes = sample().encode().unwrap();
        bytes[8] = 2;
        assert_eq!(
            PoolCheckpoint::decode(&bytes).unwrap_err(),
            CheckpointError::UnsupportedVersion { version: 2 }
        );
    }

    #[test]
    fn every_truncation_is_rejected() {
        let bytes = sample().encode().unwrap();
        for len in 0..bytes.len() {
            let err = PoolCheckpoint::decode(&bytes[..len]).unwrap_err();
            assert!(
                matches!(
                    err,
                    CheckpointError::Foreign
                        | CheckpointError::Truncated
                        | CheckpointError::ChecksumMismatch { .. }
                ),
                "{len}: {err}"
            );
        }
    }

    #[test]
    fn unordered_sources_are_malformed_even_with_a_good_checksum() {
        let mut checkpoint = sample();
        checkpoint.sources.reverse();
        let bytes = checkpoint.encode().unwrap();
        assert!(matches!(
            PoolCheckpoint::decode(&bytes).unwrap_err(),
            CheckpointError::Malformed { .. }
        ));
    }

    proptest! {
        /// Any single corrupted byte is caught, and a hostile count never allocates
        /// beyond the input: decoding arbitrary bytes returns (it never panics).
        #[test]
        fn a_flipped_byte_is_never_accepted(position in any::<prop::sample::Index>(), flip in 1u8..=255) {
            let mut bytes = sample().encode().unwrap();
            let at = position.index(bytes.len());
            bytes[at] ^= flip;
            prop_assert!(PoolCheckpoint::decode(&bytes).is_err());
        }

        /// Arbitrary contents under a valid header and checksum (so every count is
        /// parsed): decoding returns, and whatever it accepts encodes back to the input.
        #[test]
        fn arbitrary_checksummed_bytes_decode_safely(tail in prop::collection::vec(any::<u8>(), 0..256)) {
            let mut bytes = CHECKPOINT_MAGIC.to_vec();
            bytes.extend_from_slice(&CHECKPOINT_VERSION.to_le_bytes());
            bytes.extend_from_slice(&tail);
            let checksum = xxhash_rust::xxh3::xxh3_64(&bytes);
            bytes.extend_from_slice(&checksum.to_le_bytes());
            if let Ok(decoded) = PoolCheckpoint::decode(&bytes) {
                prop_assert_eq!(decoded.encode().unwrap(), bytes);
            }
        }
    }
}
