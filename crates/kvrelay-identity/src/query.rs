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
