//! KV query semantics: the block size and hash format a pool's filter keys are built with.

use serde::{Deserialize, Serialize};

/// The whole token → sequence-hash pipeline, named atomically.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvQueryHashFormat {
    /// Standard windows of `block_size` tokens.
    DynamoStandardV1,
    /// Eagle windows of `block_size + 1` tokens with stride `block_size`.
    DynamoEagleV1,
}

impl KvQueryHashFormat {
    /// Maps a card's `runtime_config.enable_eagle` flag.
    pub fn from_enable_eagle(enable_eagle: bool) -> Self {
        if enable_eagle {
            Self::DynamoEagleV1
        } else {
            Self::DynamoStandardV1
        }
    }

    /// The short name used on the command line: `standard` or `eagle`.
    pub const fn short_name(self) -> &'static str {
        match self {
            Self::DynamoStandardV1 => "standard",
            Self::DynamoEagleV1 => "eagle",
        }
    }

    /// Whether this format uses Eagle windows.
    pub fn is_eagle(self) -> bool {
        matches!(self, Self::DynamoEagleV1)
    }

    /// The version mixed into cache-semantics digests: 1 for standard, 2 for Eagle.
    pub fn identity_version(self) -> u16 {
        match self {
            Self::DynamoStandardV1 => 1,
            Self::DynamoEagleV1 => 2,
        }
    }
}

/// Why KV query semantics were rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KvQuerySemanticsError {
    /// The KV block size is zero.
    #[error("kv query block size must be nonzero, got 0")]
    ZeroBlockSize,
}

/// How a pool's filter keys are built: the KV block size (tokens) and the hash format.
///
/// Invariant: `kv_block_size > 0`. JSON: `{"kv_block_size":N,"hash_format":"..."}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawKvQuerySemantics")]
pub struct KvQuerySemantics {
    kv_block_size: u32,
    hash_format: KvQueryHashFormat,
}

impl KvQuerySemantics {
    /// Validates the block size (tokens per block, non-zero).
    ///
    /// ```
    /// use kvrelay_identity::{KvQueryHashFormat, KvQuerySemantics, KvQuerySemanticsError};
    /// assert!(KvQuerySemantics::new(16, KvQueryHashFormat::DynamoStandardV1).is_ok());
    /// assert_eq!(
    ///     KvQuerySemantics::new(0, KvQueryHashFormat::DynamoStandardV1),
    ///     Err(KvQuerySemanticsError::ZeroBlockSize)
    /// );
    /// ```
    pub const fn new(
        kv_block_size: u32,
        hash_format: KvQueryHashFormat,
    ) -> Result<Self, KvQuerySemanticsError> {
        if kv_block_size == 0 {
            return Err(KvQuerySemanticsError::ZeroBlockSize);
        }
        Ok(Self {
            kv_block_size,
            hash_format,
        })
    }

    /// Tokens per KV block (at least 1).
    pub const fn kv_block_size(&self) -> u32 {
        self.kv_block_size
    }

    /// The token → sequence-hash pipeline.
    pub const fn hash_format(&self) -> KvQueryHashFormat {
        self.hash_format
    }
}

/// The unvalidated serde shape of [`KvQuerySemantics`].
#[derive(Deserialize)]
struct RawKvQuerySemantics {
    kv_block_size: u32,
    hash_format: KvQueryHashFormat,
}

impl TryFrom<RawKvQuerySemantics> for KvQuerySemantics {
    type Error = KvQuerySemanticsError;

    fn try_from(raw: RawKvQuerySemantics) -> Result<Self, Self::Error> {
        Self::new(raw.kv_block_size, raw.hash_format)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_serialise_snake_case() {
        assert_eq!(
            serde_json::to_string(&KvQueryHashFormat::DynamoStandardV1).unwrap(),
            "\"dynamo_standard_v1\""
        );
        assert_eq!(
            serde_json::to_string(&KvQueryHashFormat::DynamoEagleV1).unwrap(),
            "\"dynamo_eagle_v1\""
        );
    }

    #[test]
    fn identity_version_is_1_for_standard_and_2_for_eagle() {
        assert_eq!(KvQueryHashFormat::DynamoStandardV1.identity_version(), 1);
        assert_eq!(KvQueryHashFormat::DynamoEagleV1.identity_version(), 2);
    }

    #[test]
    fn enable_eagle_selects_the_eagle_format() {
        assert!(KvQueryHashFormat::from_enable_eagle(true).is_eagle());
        assert!(!KvQueryHashFormat::from_enable_eagle(false).is_eagle());
    }

    #[test]
    fn zero_block_size_is_rejected() {
        assert_eq!(
            KvQuerySemantics::new(0, KvQueryHashFormat::DynamoEagleV1),
            Err(KvQuerySemanticsError::ZeroBlockSize)
        );
    }

    #[test]
    fn semantics_serde_uses_field_names_and_revalidates() {
        let semantics = KvQuerySemantics::new(16, KvQueryHashFormat::DynamoStandardV1).unwrap();
        let json = serde_json::to_string(&semantics).unwrap();
        assert_eq!(
            json,
            r#"{"kv_block_size":16,"hash_format":"dynamo_standard_v1"}"#
        );
        assert_eq!(
            serde_json::from_str::<KvQuerySemantics>(&json).unwrap(),
            semantics
        );
        let zero = r#"{"kv_block_size":0,"hash_format":"dynamo_standard_v1"}"#;
        let err = serde_json::from_str::<KvQuerySemantics>(zero).unwrap_err();
        assert!(err.to_string().contains("must be nonzero"), "{err}");
    }

    #[test]
    fn unknown_format_is_rejected() {
        assert!(serde_json::from_str::<KvQueryHashFormat>("\"unspecified\"").is_err());
    }
}
