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

    /// The pool id of this pool's lane for the cache tier with wire code `tier_code`
    /// (a lower tier: host memory, disk): the same cache semantics and DC, and a routing
    /// scope digest derived from this pool's and the tier, so a lane never collides with a
    /// pool and is the same across relay restarts.
    ///
    /// ```
    /// # use kvrelay_identity::*;
    /// # let semantics = KvQuerySemantics::new(16, KvQueryHashFormat::DynamoStandardV1).unwrap();
    /// # let endpoint: EndpointId = "prod.backend.generate".parse().unwrap();
    /// let pool = PoolId {
    ///     indexer_domain: resolve_indexer_domain("m", &IndexerIdentitySpec::default(), semantics, &endpoint),
    ///     dc_id: DcId::from_dc_name("dc-a"),
    /// };
    /// let host = pool.tier_lane(1);
    /// assert_ne!(host, pool);
    /// assert_eq!(host, pool.tier_lane(1));
    /// assert_ne!(host, pool.tier_lane(2));
    /// assert_eq!(host.indexer_domain.cache_semantics, pool.indexer_domain.cache_semantics);
    /// ```
    pub fn tier_lane(&self, tier_code: u8) -> PoolId {
        let scope = self.indexer_domain.routing_scope;
        let mut hasher = blake3::Hasher::new();
        hasher.update(b"kvrelay tier lane v1\0");
        hasher.update(scope.digest());
        hasher.update(&[tier_code]);
        let mut digest = [0u8; crate::digest::DIGEST_LEN];
        digest.copy_from_slice(&hasher.finalize().as_bytes()[..crate::digest::DIGEST_LEN]);
        PoolId {
            indexer_domain: IndexerDomainId {
                cache_semantics: self.indexer_domain.cache_semantics,
                routing_scope: crate::digest::RoutingScopeId::new(digest, scope.source()),
            },
            dc_id: self.dc_id,
        }
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
