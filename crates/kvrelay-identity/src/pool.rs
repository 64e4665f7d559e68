//! [`PoolId`]: one pool per (indexer domain, data center).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::dc::DcId;
use crate::domain::IndexerDomainId;

/// The pool identity version carried on the WAN wire next to a [`PoolId`]; any other
/// non-zero value is unsupported and quarantines the pool rather than being reinterpreted.
pub const POOL_IDENTITY_VERSION: u32 = 1;

/// A pool: the KV state of one indexer domain in one data center.
///
/// Ordered by domain, then DC. `Display` is `<cache hex>:<routing hex>/<dc hex>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PoolId {
    /// The indexer domain the pool's keys belong to.
    pub indexer_domain: IndexerDomainId,
    /// The data center holding the pool.
    pub dc_id: DcId,
}

impl PoolId {
    /// Whether either digest of the domain came from default inputs.
    pub const fn relies_on_defaults(&self) -> bool {
        self.indexer_domain.relies_on_defaults()
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.indexer_domain, self.dc_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::{CacheSemanticsId, IdentitySource, RoutingScopeId};

    fn domain(source: IdentitySource) -> IndexerDomainId {
        IndexerDomainId {
            cache_semantics: CacheSemanticsId::new([0xaa; 16], IdentitySource::Explicit),
            routing_scope: RoutingScopeId::new([0xbb; 16], source),
        }
    }

    #[test]
    fn display_joins_domain_and_dc() {
        let pool = PoolId {
            indexer_domain: domain(IdentitySource::Explicit),
            dc_id: DcId(1),
        };
        assert_eq!(
            pool.to_string(),
            format!("{}:{}/0000000000000001", "aa".repeat(16), "bb".repeat(16))
        );
    }

    #[test]
    fn relies_on_defaults_when_either_axis_is_default_derived() {
        let explicit = PoolId {
            indexer_domain: domain(IdentitySource::Explicit),
            dc_id: DcId(1),
        };
        let derived = PoolId {
            indexer_domain: domain(IdentitySource::DefaultDerived),
            dc_id: DcId(1),
        };
        assert!(!explicit.relies_on_defaults());
        assert!(derived.relies_on_defaults());
    }

    #[test]
    fn pools_order_by_domain_before_dc() {
        let low = PoolId {
            indexer_domain: domain(IdentitySource::DefaultDerived),
            dc_id: DcId(9),
        };
        let high = PoolId {
            indexer_domain: domain(IdentitySource::Explicit),
            dc_id: DcId(1),
        };
        assert!(low < high);
    }
}
