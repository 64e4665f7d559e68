//! Wire messages built from pool and membership state (catalog, load, topology).
//!
//! Identity-type fields go through the codec's conversions (`kvrelay_codec::v1::convert`);
//! this module only assembles the messages the codec has no domain counterpart for.
//! Only the host builds wire states; the WAN server only encodes them.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::host::supervisor::CoverageFact;
use kvrelay_codec::v1::{
    self, CatalogUpdate, LoadWindow, PoolLoad, ReadinessState, RelayIdentity, TopologyEntry,
    TopologyMember, TopologyUpdate,
};
use kvrelay_identity::WorkerRole;
use kvrelay_membership::{ServingState, TopologySnapshot};
use kvrelay_pool::{PoolCatalog, PoolLoadSnapshot};

/// A stable, URL-safe key of a pool: `<cache semantics hex>-<routing scope hex>-<dc hex>`.
pub(crate) fn pool_key(pool: &kvrelay_identity::PoolId) -> String {
    wire_pool_key(&v1::PoolId::from(*pool))
}

/// The same key computed from a wire pool id.
pub(crate) fn wire_pool_key(pool: &v1::PoolId) -> String {
    let hex = |bytes: &[u8]| {
        bytes
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect::<String>()
    };
    format!(
        "{}-{}-{:016x}",
        hex(&pool.cache_semantics.digest),
        hex(&pool.routing_scope.digest),
        pool.dc_id
    )
}

fn roles(roles: &[WorkerRole]) -> Vec<v1::WorkerRole> {
    roles.iter().copied().map(v1::WorkerRole::from).collect()
}

/// The advertised catalog: the registry's pools (with their lower-tier lanes) except
/// `withheld` ones (stalled pools
/// consumers must not trust; named apart in `stalled`, so a consumer following a relay
/// pair can move to the other relay), those known incomplete named in its `coverage`, under
/// `revision` (the registry revision plus the times the withheld set or the coverage
/// changed, so it moves whenever the content does).
pub(crate) fn catalog_update(
    catalog: &PoolCatalog,
    withheld: &BTreeSet<kvrelay_identity::PoolId>,
    coverage: &BTreeMap<kvrelay_identity::PoolId, CoverageFact>,
    revision: u64,
) -> CatalogUpdate {
    // One pass: each registry pool is withheld (named in `stalled`; a pool that left the
    // registry while stalled is simply gone) or advertised, with its coverage if known.
    let (mut pools, mut known_incomplete, mut stalled) = (Vec::new(), Vec::new(), Vec::new());
    let mut tier_lanes = Vec::new();
    for pool in catalog.pools() {
        let pool_id = pool.pool_id();
        if withheld.contains(&pool_id) {
            stalled.push(v1::PoolId::from(pool_id));
            continue;
        }
        if let Some(fact) = coverage.get(&pool_id) {
            let (state, unroutable_percent) = match *fact {
                CoverageFact::Degraded { unroutable_percent } => {
                    (v1::CoverageState::Degraded, unroutable_percent.min(100))
                }
                CoverageFact::Recovering => (v1::CoverageState::Recovering, 0),
                CoverageFact::Overfull { omitted_percent } => {
                    (v1::CoverageState::Overfull, omitted_percent.min(100))
                }
            };
            known_incomplete.push(v1::PoolCoverage {
                pool_id: pool_id.into(),
                state,
                unroutable_percent,
            });
        }
        // A withheld pool's lanes are withheld with it (skipped above).
        tier_lanes.extend(pool.tier_lanes.iter().map(|lane| v1::TierLaneDescriptor {
            pool_id: pool_id.into(),
            tier: lane.tier.code(),
            block_size: lane.block_size,
            producer: lane.producer.into(),
        }));
        pools.push(v1::PoolDescriptor {
            producer: pool.producer.into(),
            serving_endpoint: (&pool.serving_endpoint).into(),
            registrations: pool.registrations.iter().map(Into::into).collect(),
            query_semantics: pool.query_semantics.into(),
            pool_roles: roles(&pool.pool_roles),
        });
    }
    CatalogUpdate {
        relay: catalog.relay().into(),
        revision,
        pools,
        coverage: known_incomplete,
        stalled,
        tier_lanes,
    }
}

pub(crate) fn load_window(
    relay: RelayIdentity,
    window_sequence: u64,
    window: Duration,
    snapshots: &[PoolLoadSnapshot],
) -> LoadWindow {
    let observed_unix_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0);
    LoadWindow {
        relay,
        window_sequence,
        observed_unix_ms,
        window_ms: u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
        pools: snapshots
            .iter()
            .map(|snapshot| PoolLoad {
                producer: snapshot.producer.into(),
                kv_used_blocks: snapshot.kv_used_blocks,
                total_kv_blocks: snapshot.total_kv_blocks,
                kv_observed_ranks: snapshot.kv_observed_ranks,
                kv_capacity_ranks: snapshot.kv_capacity_ranks,
                kv_expected_ranks: snapshot.kv_expected_ranks,
                authoritative: snapshot.kv_used_blocks.is_some()
                    && snapshot.total_kv_blocks.is_some()
                    && !snapshot.has_degraded_coverage(),
            })
            .collect(),
    }
}

fn serving_state(state: ServingState) -> ReadinessState {
    match state {
        ServingState::Unknown => ReadinessState::Unknown,
        ServingState::Ready => ReadinessState::Ready,
        ServingState::Unavailable => ReadinessState::Unavailable,
    }
}

/// The wire form of a topology snapshot (the membership crate derives the states).
pub(crate) fn topology_update(relay: RelayIdentity, snapshot: &TopologySnapshot) -> TopologyUpdate {
    TopologyUpdate {
        relay,
        revision: snapshot.revision,
        entries: snapshot
            .entries
            .iter()
            .map(|entry| TopologyEntry {
                namespace: entry.namespace.clone(),
                canonical_model: entry.model.as_str().to_owned(),
                state: serving_state(entry.state),
                present_roles: roles(&entry.present_roles),
                missing_roles: roles(&entry.missing_roles),
                members: entry
                    .members
                    .iter()
                    .map(|member| TopologyMember {
                        endpoint: (&member.endpoint).into(),
                        roles: roles(&member.roles),
                        pool_id: member.pool_id.map(Into::into),
                    })
                    .collect(),
                duplicate_role_endpoints: roles(&entry.duplicate_role_endpoints),
                legacy_fallback_active: entry.legacy_fallback,
                adapters: entry
                    .adapters
                    .iter()
                    .map(|adapter| v1::AdapterReadiness {
                        canonical_model: adapter.adapter.as_str().to_owned(),
                        state: serving_state(adapter.state),
                        missing_roles: roles(&adapter.missing_roles),
                    })
                    .collect(),
            })
            .collect(),
    }
}
