//! The complete pool catalog: a revision and every pool descriptor.

use std::collections::BTreeSet;

use bytes::BytesMut;
use serde::{Deserialize, Serialize};

use super::body::{
    DecodeError, EncodeError, decode_appended, decode_appended_prefix, decode_prefix, encode_body,
};
use super::code::{CoverageState, WorkerRole};
use super::identity::{
    EndpointId, ModelRegistration, PoolId, ProducerIdentity, QuerySemantics, RelayIdentity,
};
use super::validation::{
    CollectionCheck, EntryError, ValidationError, check_collection, check_roles, first_duplicate,
};
use crate::frame::MessageKind;

/// Every pool a relay publishes, at one revision (no tombstones: a pool missing from an
/// update is gone).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CatalogUpdate {
    /// The relay process.
    pub relay: RelayIdentity,
    /// Increases with every change.
    pub revision: u64,
    /// Every pool, in pool id order.
    pub pools: Vec<PoolDescriptor>,
    /// Pools whose filter is known to be incomplete, each named once and listed in
    /// `pools`; a pool not named here is complete. Protocol minor 2 appends it to the
    /// body: an older sender's catalog decodes with none, an older receiver skips it.
    #[serde(default)]
    pub coverage: Vec<PoolCoverage>,
    /// Pools the relay serves but withholds from `pools` because they are stalled (events
    /// pending, no progress): each named once and none listed in `pools`. A consumer
    /// following the relay through a pair may move to the other relay, which may not be
    /// stalled. Protocol minor 3 appends it after `coverage`.
    #[serde(default)]
    pub stalled: Vec<PoolId>,
    /// Lower-tier lanes (host memory, disk) of listed pools, each subscribed to like a
    /// pool by its producer. Protocol minor 4 appends it after `stalled`: an older
    /// sender's catalog decodes with none, an older receiver skips it and keeps scoring
    /// device memory only.
    #[serde(default)]
    pub tier_lanes: Vec<TierLaneDescriptor>,
}

/// Most lanes one pool may list (one per tier; a newer relay's tiers included).
pub const MAX_TIER_LANES_PER_POOL: usize = 4;

/// One lower-tier lane of a listed pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierLaneDescriptor {
    /// The pool the lane belongs to (listed in `pools`).
    pub pool_id: PoolId,
    /// The tier's code: 1 host memory, 2 disk. An unknown code is a newer relay's tier;
    /// a consumer skips that lane.
    pub tier: u8,
    /// Tokens per lane block: a positive multiple of the pool's block size. A lane of
    /// `k`-block chunks holds every `k`-th prefix position.
    pub block_size: u32,
    /// The lane's producer generation (its subscription key).
    pub producer: ProducerIdentity,
}

/// A pool whose filter is known to be incomplete, and by how much.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolCoverage {
    /// The pool (one of the catalog's).
    pub pool_id: PoolId,
    /// What is wrong with its filter. An unrecognized code is a newer relay's state: a
    /// consumer reports it, never takes it for complete.
    pub state: CoverageState,
    /// The share of the pool's recent events its filter could not take, in percent
    /// (0 to 100; the relay rounds it to a multiple of 10, so a share that drifts does not
    /// re-send the catalog on every reading).
    pub unroutable_percent: u8,
}

/// One pool: its producer generation and what it serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolDescriptor {
    /// The current producer generation (the subscription key).
    pub producer: ProducerIdentity,
    /// The endpoint whose workers own the pool.
    pub serving_endpoint: EndpointId,
    /// The models the pool serves (non-empty).
    pub registrations: Vec<ModelRegistration>,
    /// How to hash requests for this pool.
    pub query_semantics: QuerySemantics,
    /// The roles of the pool's workers (non-empty, unique).
    pub pool_roles: Vec<WorkerRole>,
}

impl PoolDescriptor {
    /// The pool id.
    pub fn pool_id(&self) -> &PoolId {
        &self.producer.pool_id
    }

    /// Checks the descriptor alone.
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.producer.validate()?;
        self.query_semantics.validate()?;
        if self.pool_roles.is_empty() {
            return Err(ValidationError::EmptyRoles {
                field: "pool_roles",
            });
        }
        check_roles("pool_roles", &self.pool_roles)?;
        self.serving_endpoint.validate("serving_endpoint")?;
        if self.registrations.is_empty() {
            return Err(ValidationError::NoRegistrations);
        }
        for registration in &self.registrations {
            registration.validate()?;
        }
        let models = self.registrations.iter().map(|r| r.model.as_str());
        if let Some((_, model)) = first_duplicate(models) {
            return Err(ValidationError::DuplicateModel {
                model: model.to_owned(),
            });
        }
        // Every model and alias names one model in the pool: a repeat is a collision.
        let models: BTreeSet<&str> = self
            .registrations
            .iter()
            .map(|r| r.model.as_str())
            .collect();
        let aliases = self
            .registrations
            .iter()
            .flat_map(|r| r.aliases.iter().map(String::as_str));
        if let Some(alias) = aliases.clone().find(|alias| models.contains(alias)) {
            return Err(ValidationError::AliasCollision {
                alias: alias.to_owned(),
            });
        }
        if let Some((_, alias)) = first_duplicate(aliases) {
            return Err(ValidationError::AliasCollision {
                alias: alias.to_owned(),
            });
        }
        Ok(())
    }
}

impl CatalogUpdate {
    /// Checks every descriptor and that no pool id appears twice. Malformed data fails the
    /// whole update; unsupported descriptors are listed for quarantine.
    pub fn validate(&self) -> Result<CollectionCheck, EntryError> {
        let verdict = check_collection("pools", &self.pools, PoolDescriptor::validate)?;
        if let Some((index, pool_id)) =
            first_duplicate(self.pools.iter().map(PoolDescriptor::pool_id))
        {
            return Err(EntryError {
                collection: "pools",
                index,
                error: ValidationError::DuplicateEntry {
                    field: "pools",
                    key: pool_id.to_string(),
                },
            });
        }
        self.validate_coverage()?;
        self.validate_stalled()?;
        self.validate_tier_lanes()?;
        Ok(verdict)
    }

    /// Checks `tier_lanes` alone: each names a listed pool, at most once per tier and at
    /// most [`MAX_TIER_LANES_PER_POOL`] per pool, with a block size that is a positive
    /// multiple of the pool's and a producer of its own (not a listed pool's). The work is
    /// `O(lanes log pools)`, whatever a peer sends.
    pub fn validate_tier_lanes(&self) -> Result<(), EntryError> {
        let entry_error = |index: usize, pool: &PoolId, detail| EntryError {
            collection: "tier_lanes",
            index,
            error: ValidationError::InvalidTierLane {
                pool: pool.to_string(),
                detail,
            },
        };
        if self.tier_lanes.len() > self.pools.len().saturating_mul(MAX_TIER_LANES_PER_POOL) {
            let index = self.pools.len().saturating_mul(MAX_TIER_LANES_PER_POOL);
            return Err(entry_error(
                index,
                &self.tier_lanes[index].pool_id,
                "more lanes than the pools may have",
            ));
        }
        let block_sizes: std::collections::BTreeMap<&PoolId, u32> = self
            .pools
            .iter()
            .map(|pool| (pool.pool_id(), pool.query_semantics.kv_block_size))
            .collect();
        for (index, lane) in self.tier_lanes.iter().enumerate() {
            lane.producer.validate().map_err(|error| EntryError {
                collection: "tier_lanes",
                index,
                error,
            })?;
            let Some(&pool_block_size) = block_sizes.get(&lane.pool_id) else {
                return Err(entry_error(index, &lane.pool_id, "the pool is not listed"));
            };
            if lane.block_size == 0 || lane.block_size % pool_block_size.max(1) != 0 {
                return Err(entry_error(
                    index,
                    &lane.pool_id,
                    "block size is not a positive multiple of the pool's",
                ));
            }
            if block_sizes.contains_key(&lane.producer.pool_id) {
                return Err(entry_error(
                    index,
                    &lane.pool_id,
                    "the lane's producer is a listed pool",
                ));
            }
        }
        let keys = self
            .tier_lanes
            .iter()
            .map(|lane| (&lane.pool_id, lane.tier));
        if let Some((index, (pool_id, _))) = first_duplicate(keys) {
            return Err(entry_error(index, pool_id, "tier listed twice"));
        }
        Ok(())
    }

    /// Checks `stalled` alone: each pool named once, none of them listed in `pools`. The
    /// work is `O((pools + stalled) log pools)`, whatever a peer sends.
    pub fn validate_stalled(&self) -> Result<(), EntryError> {
        let listed: BTreeSet<&PoolId> = self.pools.iter().map(PoolDescriptor::pool_id).collect();
        if let Some(index) = self.stalled.iter().position(|id| listed.contains(id)) {
            return Err(EntryError {
                collection: "stalled",
                index,
                error: ValidationError::StalledPoolListed {
                    pool: self.stalled[index].to_string(),
                },
            });
        }
        if let Some((index, pool_id)) = first_duplicate(self.stalled.iter()) {
            return Err(EntryError {
                collection: "stalled",
                index,
                error: ValidationError::DuplicateEntry {
                    field: "stalled",
                    key: pool_id.to_string(),
                },
            });
        }
        Ok(())
    }

    /// Checks `coverage` alone: each entry names a listed pool, once, with a share of at
    /// most 100 percent (an unrecognized state is a newer relay's, not malformed). A list
    /// longer than `pools` is refused before any entry is looked at, so the work a peer can
    /// cause is bounded by the pool list (which the receiver bounds first).
    pub fn validate_coverage(&self) -> Result<(), EntryError> {
        if self.coverage.len() > self.pools.len() {
            return Err(EntryError {
                collection: "coverage",
                index: self.pools.len(),
                error: ValidationError::CoverageLongerThanPools {
                    coverage: self.coverage.len(),
                    pools: self.pools.len(),
                },
            });
        }
        for (index, coverage) in self.coverage.iter().enumerate() {
            let error = if coverage.unroutable_percent > 100 {
                Some(ValidationError::CoverageShare {
                    percent: coverage.unroutable_percent,
                })
            } else if !self
                .pools
                .iter()
                .any(|pool| pool.pool_id() == &coverage.pool_id)
            {
                Some(ValidationError::CoverageOfUnlistedPool {
                    pool: coverage.pool_id.to_string(),
                })
            } else {
                None
            };
            if let Some(error) = error {
                return Err(EntryError {
                    collection: "coverage",
                    index,
                    error,
                });
            }
        }
        if let Some((index, pool_id)) = first_duplicate(self.coverage.iter().map(|c| &c.pool_id)) {
            return Err(EntryError {
                collection: "coverage",
                index,
                error: ValidationError::DuplicateEntry {
                    field: "coverage",
                    key: pool_id.to_string(),
                },
            });
        }
        Ok(())
    }

    /// Appends the body to `dst`: the fields of minor 0, then `coverage` (minor 2),
    /// `stalled` (minor 3) and `tier_lanes` (minor 4).
    pub fn encode_body(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        let kind = MessageKind::CatalogUpdate;
        encode_body(kind, &(&self.relay, self.revision, &self.pools), dst)?;
        encode_body(kind, &self.coverage, dst)?;
        encode_body(kind, &self.stalled, dst)?;
        encode_body(kind, &self.tier_lanes, dst)
    }

    /// Decodes a body sent with protocol minor `minor`. A body of minor 0 or 1 ends after
    /// `pools` (no coverage: every pool complete); from minor 2 on `coverage` follows, from
    /// minor 3 on `stalled` (none before: nothing withheld is named).
    pub fn decode_body(body: &[u8], minor: u16) -> Result<Self, DecodeError> {
        let kind = MessageKind::CatalogUpdate;
        let ((relay, revision, pools), used) =
            decode_prefix::<(RelayIdentity, u64, Vec<PoolDescriptor>)>(kind, body)?;
        let rest = &body[used..];
        let (coverage, used) = decode_appended_prefix(kind, rest, minor, COVERAGE_MINOR)?;
        let rest = &rest[used..];
        let (stalled, used) = decode_appended_prefix(kind, rest, minor, STALLED_MINOR)?;
        let tier_lanes = decode_appended(kind, &rest[used..], minor, TIER_LANES_MINOR)?;
        Ok(Self {
            relay,
            revision,
            pools,
            coverage,
            stalled,
            tier_lanes,
        })
    }
}

/// The protocol minor that appended `tier_lanes` to the catalog body.
const TIER_LANES_MINOR: u16 = 4;

/// The protocol minor that appended `stalled` to the catalog body.
const STALLED_MINOR: u16 = 3;

/// The protocol minor that appended `coverage` to the catalog body.
const COVERAGE_MINOR: u16 = 2;
