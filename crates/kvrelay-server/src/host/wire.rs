//! Explicit conversions from domain types (identity, pool, membership) to v1 wire messages.
//!
//! Only the host builds wire states; the WAN server only encodes them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use kvrelay_codec::v1::{
    self, CatalogUpdate, LoadWindow, PoolLoad, ReadinessState, RelayIdentity, TopologyEntry,
    TopologyMember, TopologyUpdate,
};
use kvrelay_identity::{
    DcRelayIdentity, IdentitySource, KvQueryHashFormat, ModelTarget, WorkerRole,
};
use kvrelay_membership::{ServingState, TopologySnapshot};
use kvrelay_pool::{PoolCatalog, PoolLoadSnapshot};

pub(crate) fn relay_identity(relay: DcRelayIdentity) -> RelayIdentity {
    RelayIdentity {
        drt_instance_id: relay.drt_instance_id(),
        relay_incarnation: relay.relay_incarnation(),
    }
}

fn source(source: IdentitySource) -> v1::IdentitySource {
    match source {
        IdentitySource::DefaultDerived => v1::IdentitySource::DefaultDerived,
        IdentitySource::Explicit => v1::IdentitySource::Explicit,
    }
}

pub(crate) fn pool_id(pool: &kvrelay_identity::PoolId) -> v1::PoolId {
    let domain = &pool.indexer_domain;
    v1::PoolId {
        identity_version: v1::POOL_IDENTITY_VERSION,
        cache_semantics: v1::DigestId {
            digest: *domain.cache_semantics.digest(),
            source: source(domain.cache_semantics.source()),
        },
        routing_scope: v1::DigestId {
            digest: *domain.routing_scope.digest(),
            source: source(domain.routing_scope.source()),
        },
        dc_id: pool.dc_id.as_u64(),
    }
}

pub(crate) fn producer(identity: &kvrelay_identity::ProducerIdentity) -> v1::ProducerIdentity {
    let format = identity.format();
    v1::ProducerIdentity {
        pool_id: pool_id(identity.pool_id()),
        producer_incarnation: identity.producer_incarnation(),
        layout_generation: identity.layout_generation(),
        ckf_format: v1::CkfFormat {
            format_version: u32::from(format.format_version()),
            seed: format.seed(),
            bucket_count: u64::from(format.bucket_count()),
            fingerprint_bits: u32::from(format.fingerprint_bits()),
            slots_per_bucket: u32::from(format.slots_per_bucket()),
        },
    }
}

pub(crate) fn role(role: WorkerRole) -> v1::WorkerRole {
    match role {
        WorkerRole::Prefill => v1::WorkerRole::Prefill,
        WorkerRole::Decode => v1::WorkerRole::Decode,
        WorkerRole::Encode => v1::WorkerRole::Encode,
        WorkerRole::Aggregated => v1::WorkerRole::Aggregated,
        WorkerRole::Legacy => v1::WorkerRole::Legacy,
    }
}

fn endpoint(endpoint: &kvrelay_identity::EndpointId) -> v1::EndpointId {
    v1::EndpointId {
        namespace: endpoint.namespace().to_owned(),
        component: endpoint.component().to_owned(),
        name: endpoint.name().to_owned(),
    }
}

/// A stable, URL-safe key of a pool: `<cache semantics hex>-<routing scope hex>-<dc hex>`.
pub(crate) fn pool_key(pool: &kvrelay_identity::PoolId) -> String {
    let hex = |bytes: &[u8]| {
        bytes
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect::<String>()
    };
    format!(
        "{}-{}-{:016x}",
        hex(pool.indexer_domain.cache_semantics.digest()),
        hex(pool.indexer_domain.routing_scope.digest()),
        pool.dc_id.as_u64()
    )
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

pub(crate) fn catalog_update(catalog: &PoolCatalog) -> CatalogUpdate {
    let pools = catalog
        .pools()
        .map(|pool| v1::PoolDescriptor {
            producer: producer(&pool.producer),
            serving_endpoint: endpoint(&pool.serving_endpoint),
            registrations: pool
                .registrations
                .iter()
                .map(|registration| v1::ModelRegistration {
                    model: registration.model().as_str().to_owned(),
                    base_model: registration.target().base_model().as_str().to_owned(),
                    adapter: match registration.target() {
                        ModelTarget::Base { .. } => None,
                        ModelTarget::Lora { adapter, .. } => Some(adapter.as_str().to_owned()),
                    },
                    aliases: registration
                        .aliases()
                        .iter()
                        .map(|alias| alias.as_str().to_owned())
                        .collect(),
                })
                .collect(),
            query_semantics: v1::QuerySemantics {
                kv_block_size: pool.query_semantics.kv_block_size(),
                hash_format: match pool.query_semantics.hash_format() {
                    KvQueryHashFormat::DynamoStandardV1 => v1::HashFormat::DynamoStandardV1,
                    KvQueryHashFormat::DynamoEagleV1 => v1::HashFormat::DynamoEagleV1,
                },
            },
            pool_roles: pool.pool_roles.iter().copied().map(role).collect(),
        })
        .collect();
    CatalogUpdate {
        relay: relay_identity(catalog.relay()),
        revision: catalog.revision(),
        pools,
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
                producer: producer(&snapshot.producer),
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
    let roles = |roles: &[WorkerRole]| roles.iter().copied().map(role).collect::<Vec<_>>();
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
                        endpoint: endpoint(&member.endpoint),
                        roles: roles(&member.roles),
                        pool_id: member.pool_id.as_ref().map(pool_id),
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
