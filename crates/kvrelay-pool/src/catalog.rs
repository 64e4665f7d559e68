//! The pool catalog: a revisioned, complete view of every publishable pool generation.
//!
//! [`PoolCatalog`] is what `PoolRegistry::watch_catalog` publishes: always a complete
//! snapshot (no tombstones), pools sorted by [`PoolId`], revision bumped by one
//! (saturating) on every upsert, removal or clear. It serialises to JSON as
//! `{"drt_instance_id", "relay_incarnation", "revision", "pools": [...]}`.

use std::collections::BTreeMap;

use kvrelay_identity::{
    CanonicalModelRegistration, DcRelayIdentity, EndpointId, KvQuerySemantics, PoolId,
    ProducerIdentity, WorkerRole,
};
use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};

/// What a consumer needs to know about one pool generation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PoolDescriptor {
    /// The producer generation; the exact subscription key.
    pub producer: ProducerIdentity,
    /// The worker endpoint that owns the pool.
    pub serving_endpoint: EndpointId,
    /// The models the pool serves.
    pub registrations: Vec<CanonicalModelRegistration>,
    /// How to hash a request for this pool.
    pub query_semantics: KvQuerySemantics,
    /// The declared worker roles, sorted and unique.
    pub pool_roles: Vec<WorkerRole>,
    /// The pool's lower-tier lanes (host memory, disk), by tier; empty when the pool
    /// keeps only device memory. Each is subscribed to like a pool, by its producer.
    pub tier_lanes: Vec<TierLaneDescriptor>,
}

/// One lower-tier lane of a pool: a filter of what its workers hold on that tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TierLaneDescriptor {
    /// The tier (never device).
    #[serde(serialize_with = "serialize_tier")]
    pub tier: kvrelay_ckf::CacheTier,
    /// The lane's producer generation: its subscription key.
    pub producer: ProducerIdentity,
    /// Tokens per lane block: a multiple of the pool's block size (an offloaded block of
    /// `k` device blocks holds every `k`-th prefix position).
    pub block_size: u32,
}

fn serialize_tier<S: Serializer>(
    tier: &kvrelay_ckf::CacheTier,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    serializer.serialize_str(tier.name())
}

impl PoolDescriptor {
    /// The pool this descriptor describes.
    pub fn pool_id(&self) -> PoolId {
        *self.producer.pool_id()
    }
}

/// A complete, revisioned catalog of one relay's pools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolCatalog {
    relay: DcRelayIdentity,
    revision: u64,
    pools: BTreeMap<PoolId, PoolDescriptor>,
}

impl PoolCatalog {
    /// An empty catalog at revision 0.
    pub fn new(relay: DcRelayIdentity) -> Self {
        Self {
            relay,
            revision: 0,
            pools: BTreeMap::new(),
        }
    }

    /// The relay that publishes this catalog.
    pub fn relay(&self) -> DcRelayIdentity {
        self.relay
    }

    /// The revision: 0 when empty and new, +1 per change.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The pools, sorted by [`PoolId`].
    pub fn pools(&self) -> impl ExactSizeIterator<Item = &PoolDescriptor> {
        self.pools.values()
    }

    /// Number of pools.
    pub fn len(&self) -> usize {
        self.pools.len()
    }

    /// True when no pool is publishable.
    pub fn is_empty(&self) -> bool {
        self.pools.is_empty()
    }

    /// The descriptor of one pool.
    pub fn pool(&self, pool: PoolId) -> Option<&PoolDescriptor> {
        self.pools.get(&pool)
    }

    pub(crate) fn upsert(&mut self, revision: u64, descriptor: PoolDescriptor) {
        self.revision = revision;
        self.pools.insert(descriptor.pool_id(), descriptor);
    }

    pub(crate) fn remove(&mut self, revision: u64, pool: PoolId) {
        self.revision = revision;
        self.pools.remove(&pool);
    }

    pub(crate) fn clear(&mut self, revision: u64) {
        self.revision = revision;
        self.pools.clear();
    }
}

impl Serialize for PoolCatalog {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        struct Pools<'a>(&'a BTreeMap<PoolId, PoolDescriptor>);
        impl Serialize for Pools<'_> {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.collect_seq(self.0.values())
            }
        }
        let mut catalog = serializer.serialize_struct("PoolCatalog", 4)?;
        catalog.serialize_field("drt_instance_id", &self.relay.drt_instance_id())?;
        catalog.serialize_field("relay_incarnation", &self.relay.relay_incarnation())?;
        catalog.serialize_field("revision", &self.revision)?;
        catalog.serialize_field("pools", &Pools(&self.pools))?;
        catalog.end()
    }
}
