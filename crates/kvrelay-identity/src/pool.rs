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
