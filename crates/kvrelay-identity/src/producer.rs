//! [`ProducerIdentity`]: the subscription key of one published filter generation.

use serde::{Deserialize, Serialize};

use crate::format::CkfFormat;
use crate::pool::PoolId;

/// Why a producer identity was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProducerIdentityError {
    /// The layout generation is zero (generations start at 1).
    #[error("producer layout generation must be nonzero, got 0")]
    ZeroLayoutGeneration,
}

/// Who produces a pool's filter, and in which layout.
///
/// Equality of every field (pool, incarnation, generation, format) is the subscription
/// key; descriptive metadata never participates. Invariant: `layout_generation >= 1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawProducerIdentity")]
pub struct ProducerIdentity {
    pool_id: PoolId,
    producer_incarnation: u64,
    layout_generation: u64,
    format: CkfFormat,
}

impl ProducerIdentity {
    /// Validates the layout generation (non-zero).
    pub const fn new(
        pool_id: PoolId,
        producer_incarnation: u64,
        layout_generation: u64,
        format: CkfFormat,
    ) -> Result<Self, ProducerIdentityError> {
        if layout_generation == 0 {
            return Err(ProducerIdentityError::ZeroLayoutGeneration);
        }
        Ok(Self {
            pool_id,
            producer_incarnation,
            layout_generation,
            format,
        })
    }

    /// The pool produced.
    pub const fn pool_id(&self) -> &PoolId {
        &self.pool_id
    }

    /// The producing relay's incarnation.
    pub const fn producer_incarnation(&self) -> u64 {
        self.producer_incarnation
    }

    /// The layout generation (starts at 1, +1 per attach).
    pub const fn layout_generation(&self) -> u64 {
        self.layout_generation
    }

    /// The filter layout.
    pub const fn format(&self) -> &CkfFormat {
        &self.format
    }
}

/// The unvalidated serde shape of [`ProducerIdentity`].
#[derive(Deserialize)]
struct RawProducerIdentity {
    pool_id: PoolId,
    producer_incarnation: u64,
    layout_generation: u64,
    format: CkfFormat,
}

impl TryFrom<RawProducerIdentity> for ProducerIdentity {
    type Error = ProducerIdentityError;

    fn try_from(raw: RawProducerIdentity) -> Result<Self, Self::Error> {
        Self::new(
            raw.pool_id,
            raw.producer_incarnation,
            raw.layout_generation,
            raw.format,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dc::DcId;
    use crate::digest::{CacheSemanticsId, IdentitySource, RoutingScopeId};
    use crate::domain::IndexerDomainId;
    use crate::format::DEFAULT_CKF_SEED;

    fn pool() -> PoolId {
        PoolId {
            indexer_domain: IndexerDomainId {
                cache_semantics: CacheSemanticsId::new([1; 16], IdentitySource::DefaultDerived),
                routing_scope: RoutingScopeId::new([2; 16], IdentitySource::Explicit),
            },
            dc_id: DcId(7),
        }
    }

    #[test]
    fn zero_layout_generation_is_rejected() {
        let format = CkfFormat::v1(DEFAULT_CKF_SEED, 16).unwrap();
        assert_eq!(
            ProducerIdentity::new(pool(), 9, 0, format),
            Err(ProducerIdentityError::ZeroLayoutGeneration)
        );
    }

    #[test]
    fn serde_uses_field_names_and_revalidates() {
        let format = CkfFormat::v1(DEFAULT_CKF_SEED, 16).unwrap();
        let producer = ProducerIdentity::new(pool(), 9, 1, format).unwrap();
        let json = serde_json::to_string(&producer).unwrap();
        for field in [
            "pool_id",
            "producer_incarnation",
            "layout_generation",
            "format",
        ] {
            assert!(json.contains(&format!("\"{field}\"")), "{json}");
        }
        assert_eq!(
            serde_json::from_str::<ProducerIdentity>(&json).unwrap(),
            producer
        );
        let zero = json.replace("\"layout_generation\":1", "\"layout_generation\":0");
        assert!(serde_json::from_str::<ProducerIdentity>(&zero).is_err());
    }
}
