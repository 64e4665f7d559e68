//! Conversions between kvrelay's v1 model (`kvrelay_codec::v1`) and the contract's messages.
//!
//! kvrelay's model was built after the reference's, so most fields map one to one. The
//! differences, each decided here and only here (docs/interop.md lists them):
//! - Readiness codes are shifted: the contract's `UNKNOWN` is 0, ours is 1.
//! - A load entry's used and total blocks are plain numbers in the contract, optional in
//!   ours (unknown until every rank reported). An unknown sum goes out as 0 with observed
//!   ranks below expected ranks, so the entry reads as incomplete, never as an idle pool.
//! - A registration's target is a `oneof`; ours is a base model plus an optional adapter.
//! - kvrelay's `capacity_ranks` and `authoritative` have no contract field and are dropped.
//!
//! Outbound (`From`) never fails: it is only ever given values the relay validated.
//! Inbound (`TryFrom`) fails with a [`ContractError`] naming the field, then runs the v1
//! type's own `validate`, so a value is judged by the same rules whichever door it came in.
//! A catalog ([`ReceivedCatalog`]) is the exception that proves it: its pools are only
//! converted, and the follower's own catalog validation judges them (quarantining and
//! counting unsupported entries), exactly as for a catalog from our own protocol.

use kvrelay_codec::v1;

use crate::contract::{CONTRACT_MARKER, PROTOCOL_VERSION};
use crate::proto;

/// A contract message kvrelay's model cannot take.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ContractError {
    /// A required message field is absent.
    #[error("{field} is missing")]
    Missing {
        /// The field.
        field: &'static str,
    },
    /// A digest is not 16 bytes.
    #[error("{field}: digest of {len} bytes (16 expected)")]
    DigestLength {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
    },
    /// An enum field holds a value this side does not know.
    #[error("{field}: value {value} is not supported")]
    UnknownValue {
        /// The field.
        field: &'static str,
        /// The value.
        value: i32,
    },
    /// The converted value breaks a v1 rule.
    #[error(transparent)]
    Invalid(#[from] v1::ValidationError),
}

impl ContractError {
    /// The reason a relay refuses a request carrying this: a value a newer schema may send
    /// is `unsupported_feature`, anything else `invalid_request`.
    pub fn reason(&self) -> v1::ErrorReason {
        match self {
            Self::UnknownValue { .. } => v1::ErrorReason::UnsupportedFeature,
            Self::Invalid(err) if err.is_unsupported() => v1::ErrorReason::UnsupportedFeature,
            _ => v1::ErrorReason::InvalidRequest,
        }
    }
}

fn code(value: u32) -> i32 {
    // Every code kvrelay sends is small; an out-of-range one reads as unspecified.
    i32::try_from(value).unwrap_or(0)
}

fn known_code(field: &'static str, value: i32) -> Result<u32, ContractError> {
    // 0 (unspecified) and codes this side does not know become v1 codes, judged by the v1
    // type's own `validate` (malformed, or unsupported and quarantined).
    u32::try_from(value).map_err(|_| ContractError::UnknownValue { field, value })
}

fn required<T>(field: &'static str, value: Option<T>) -> Result<T, ContractError> {
    value.ok_or(ContractError::Missing { field })
}

// ---- identity ----------------------------------------------------------------------------

impl From<v1::RelayIdentity> for proto::RelayIdentity {
    fn from(relay: v1::RelayIdentity) -> Self {
        Self {
            drt_instance_id: relay.drt_instance_id,
            relay_incarnation: relay.relay_incarnation,
        }
    }
}

fn relay_in(relay: Option<proto::RelayIdentity>) -> Result<v1::RelayIdentity, ContractError> {
    let relay = required("relay", relay)?;
    Ok(v1::RelayIdentity {
        drt_instance_id: relay.drt_instance_id,
        relay_incarnation: relay.relay_incarnation,
    })
}

impl From<v1::DigestId> for proto::DigestIdentity {
    fn from(id: v1::DigestId) -> Self {
        Self {
            digest: id.digest.to_vec(),
            source: code(id.source.code()),
        }
    }
}

fn digest_in(
    field: &'static str,
    id: Option<proto::DigestIdentity>,
) -> Result<v1::DigestId, ContractError> {
    let id = required(field, id)?;
    let digest: [u8; 16] =
        id.digest
            .as_slice()
            .try_into()
            .map_err(|_| ContractError::DigestLength {
                field,
                len: id.digest.len(),
            })?;
    Ok(v1::DigestId {
        digest,
        source: v1::IdentitySource::from_code(known_code(field, id.source)?),
    })
}

impl From<v1::PoolId> for proto::KvPoolId {
    fn from(pool: v1::PoolId) -> Self {
        Self {
            identity_version: pool.identity_version,
            indexer_domain: Some(proto::IndexerDomainId {
                cache_semantics: Some(pool.cache_semantics.into()),
                routing_scope: Some(pool.routing_scope.into()),
            }),
            dc_id: pool.dc_id,
        }
    }
}

/// A pool id as sent, not yet judged.
fn pool_id_in(pool: proto::KvPoolId) -> Result<v1::PoolId, ContractError> {
    let domain = required("pool_id.indexer_domain", pool.indexer_domain)?;
    Ok(v1::PoolId {
        identity_version: pool.identity_version,
        cache_semantics: digest_in(
            "pool_id.indexer_domain.cache_semantics",
            domain.cache_semantics,
        )?,
        routing_scope: digest_in("pool_id.indexer_domain.routing_scope", domain.routing_scope)?,
        dc_id: pool.dc_id,
    })
}

impl TryFrom<proto::KvPoolId> for v1::PoolId {
    type Error = ContractError;

    fn try_from(pool: proto::KvPoolId) -> Result<Self, ContractError> {
        let pool = pool_id_in(pool)?;
        pool.validate()?;
        Ok(pool)
    }
}

impl From<v1::CkfFormat> for proto::CkfFormat {
    fn from(format: v1::CkfFormat) -> Self {
        Self {
            format_version: format.format_version,
            seed: format.seed,
            bucket_count: format.bucket_count,
            fingerprint_bits: format.fingerprint_bits,
            slots_per_bucket: format.slots_per_bucket,
        }
    }
}

impl From<v1::ProducerIdentity> for proto::ProducerIdentity {
    fn from(producer: v1::ProducerIdentity) -> Self {
        Self {
            pool_id: Some(producer.pool_id.into()),
            producer_incarnation: producer.producer_incarnation,
            layout_generation: producer.layout_generation,
            ckf_format: Some(producer.ckf_format.into()),
        }
    }
}

/// A producer identity as sent, not yet judged.
fn producer_structure(
    producer: proto::ProducerIdentity,
) -> Result<v1::ProducerIdentity, ContractError> {
    let format = required("producer.ckf_format", producer.ckf_format)?;
    Ok(v1::ProducerIdentity {
        pool_id: pool_id_in(required("producer.pool_id", producer.pool_id)?)?,
        producer_incarnation: producer.producer_incarnation,
        layout_generation: producer.layout_generation,
        ckf_format: v1::CkfFormat {
            format_version: format.format_version,
            seed: format.seed,
            bucket_count: format.bucket_count,
            fingerprint_bits: format.fingerprint_bits,
            slots_per_bucket: format.slots_per_bucket,
        },
    })
}

impl TryFrom<proto::ProducerIdentity> for v1::ProducerIdentity {
    type Error = ContractError;

    fn try_from(producer: proto::ProducerIdentity) -> Result<Self, ContractError> {
        let producer = producer_structure(producer)?;
        producer.validate()?;
        Ok(producer)
    }
}

fn producer_in(
    field: &'static str,
    producer: Option<proto::ProducerIdentity>,
) -> Result<v1::ProducerIdentity, ContractError> {
    required(field, producer)?.try_into()
}

impl From<&v1::EndpointId> for proto::DynamoEndpointId {
    fn from(endpoint: &v1::EndpointId) -> Self {
        Self {
            namespace: endpoint.namespace.clone(),
            component: endpoint.component.clone(),
            endpoint: endpoint.name.clone(),
        }
    }
}

fn endpoint_in(
    field: &'static str,
    endpoint: Option<proto::DynamoEndpointId>,
) -> Result<v1::EndpointId, ContractError> {
    let endpoint = required(field, endpoint)?;
    Ok(v1::EndpointId {
        namespace: endpoint.namespace,
        component: endpoint.component,
        name: endpoint.endpoint,
    })
}

fn roles_out(roles: &[v1::WorkerRole]) -> Vec<i32> {
    roles.iter().map(|role| code(role.code())).collect()
}

fn roles_in(field: &'static str, roles: &[i32]) -> Result<Vec<v1::WorkerRole>, ContractError> {
    roles
        .iter()
        .map(|role| known_code(field, *role).map(v1::WorkerRole::from_code))
        .collect()
}

// ---- catalog -----------------------------------------------------------------------------

impl From<&v1::ModelRegistration> for proto::ModelRegistration {
    fn from(registration: &v1::ModelRegistration) -> Self {
        let target = match &registration.adapter {
            Some(adapter) => proto::model_target::Target::Lora(proto::LoraModelTarget {
                base_model: registration.base_model.clone(),
                adapter: adapter.clone(),
            }),
            None => proto::model_target::Target::Base(proto::BaseModelTarget {
                base_model: registration.base_model.clone(),
            }),
        };
        Self {
            canonical_model_id: registration.model.clone(),
            target: Some(proto::ModelTarget {
                target: Some(target),
            }),
            aliases: registration.aliases.clone(),
        }
    }
}

impl TryFrom<proto::ModelRegistration> for v1::ModelRegistration {
    type Error = ContractError;

    fn try_from(registration: proto::ModelRegistration) -> Result<Self, ContractError> {
        // An unset target may be a kind a newer schema added: never read it as a base model.
        let target =
            registration
                .target
                .and_then(|target| target.target)
                .ok_or(ContractError::Missing {
                    field: "registration.target",
                })?;
        let (base_model, adapter) = match target {
            proto::model_target::Target::Base(base) => (base.base_model, None),
            proto::model_target::Target::Lora(lora) => (lora.base_model, Some(lora.adapter)),
        };
        Ok(Self {
            model: registration.canonical_model_id,
            base_model,
            adapter,
            aliases: registration.aliases,
        })
    }
}

impl From<&v1::PoolDescriptor> for proto::KvPoolDescriptor {
    fn from(pool: &v1::PoolDescriptor) -> Self {
        Self {
            producer: Some(pool.producer.into()),
            serving_endpoint: Some((&pool.serving_endpoint).into()),
            registrations: pool.registrations.iter().map(Into::into).collect(),
            query_semantics: Some(proto::KvQuerySemantics {
                kv_block_size: pool.query_semantics.kv_block_size,
                hash_format: code(pool.query_semantics.hash_format.code()),
            }),
            pool_roles: roles_out(&pool.pool_roles),
        }
    }
}

/// A pool descriptor as sent, not yet judged (a catalog leaves judging to its reader).
fn descriptor_structure(
    pool: proto::KvPoolDescriptor,
) -> Result<v1::PoolDescriptor, ContractError> {
    let semantics = required("query_semantics", pool.query_semantics)?;
    Ok(v1::PoolDescriptor {
        producer: producer_structure(required("producer", pool.producer)?)?,
        serving_endpoint: endpoint_in("serving_endpoint", pool.serving_endpoint)?,
        registrations: pool
            .registrations
            .into_iter()
            .map(TryInto::try_into)
            .collect::<Result<_, _>>()?,
        query_semantics: v1::QuerySemantics {
            kv_block_size: semantics.kv_block_size,
            hash_format: v1::HashFormat::from_code(known_code(
                "query_semantics.hash_format",
                semantics.hash_format,
            )?),
        },
        pool_roles: roles_in("pool_roles", &pool.pool_roles)?,
    })
}

impl TryFrom<proto::KvPoolDescriptor> for v1::PoolDescriptor {
    type Error = ContractError;

    fn try_from(pool: proto::KvPoolDescriptor) -> Result<Self, ContractError> {
        let pool = descriptor_structure(pool)?;
        pool.validate()?;
        Ok(pool)
    }
}

impl From<&v1::CatalogUpdate> for proto::KvPoolCatalogUpdate {
    fn from(catalog: &v1::CatalogUpdate) -> Self {
        Self {
            protocol_version: PROTOCOL_VERSION,
            relay: Some(catalog.relay.into()),
            revision: catalog.revision,
            snapshot: Some(proto::KvPoolCatalogSnapshot {
                pools: catalog.pools.iter().map(Into::into).collect(),
            }),
            contract_marker: CONTRACT_MARKER,
        }
    }
}

/// A catalog as a follower receives it: every pool the v1 model can represent (not yet
/// judged: the follower's own catalog validation quarantines unsupported entries and counts
/// them, as it does on our protocol), and the pools that could not even be represented.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedCatalog {
    /// The relay, revision and every representable pool.
    pub catalog: v1::CatalogUpdate,
    /// Pools left out, each with why (a missing field, a digest of the wrong length, an
    /// unset model target: the pool's problem, never the whole catalog's).
    pub unsupported: Vec<ContractError>,
}

impl TryFrom<proto::KvPoolCatalogUpdate> for ReceivedCatalog {
    type Error = ContractError;

    fn try_from(update: proto::KvPoolCatalogUpdate) -> Result<Self, ContractError> {
        let relay = relay_in(update.relay)?;
        let snapshot = required("snapshot", update.snapshot)?;
        let mut pools = Vec::with_capacity(snapshot.pools.len());
        let mut unsupported = Vec::new();
        for pool in snapshot.pools {
            match descriptor_structure(pool) {
                Ok(pool) => pools.push(pool),
                Err(err) => unsupported.push(err),
            }
        }
        Ok(Self {
            catalog: v1::CatalogUpdate {
                relay,
                revision: update.revision,
                pools,
                coverage: Vec::new(),
                stalled: Vec::new(),
                tier_lanes: Vec::new(),
            },
            unsupported,
        })
    }
}

// ---- pool frames -------------------------------------------------------------------------

impl From<v1::PoolFrame> for proto::FilterUpdate {
    fn from(frame: v1::PoolFrame) -> Self {
        let header = frame.header;
        Self {
            protocol_version: PROTOCOL_VERSION,
            relay: Some(header.relay.into()),
            producer: Some(header.producer.into()),
            base_sequence: header.base_sequence,
            sequence: header.sequence,
            send_ts_us: header.sent_unix_us,
            kind: code(header.kind.code()),
            payload: frame.payload,
            contract_marker: CONTRACT_MARKER,
        }
    }
}

impl TryFrom<proto::FilterUpdate> for v1::PoolFrame {
    type Error = ContractError;

    fn try_from(update: proto::FilterUpdate) -> Result<Self, ContractError> {
        Ok(Self {
            header: v1::PoolFrameHeader {
                relay: relay_in(update.relay)?,
                producer: producer_in("producer", update.producer)?,
                base_sequence: update.base_sequence,
                sequence: update.sequence,
                kind: v1::PoolFrameKind::from_code(known_code("kind", update.kind)?),
                sent_unix_us: update.send_ts_us,
            },
            payload: update.payload,
        })
    }
}

// ---- readiness ---------------------------------------------------------------------------

fn readiness_out(state: v1::ReadinessState) -> i32 {
    let state = match state {
        v1::ReadinessState::Ready => proto::ServingReadinessState::Ready,
        v1::ReadinessState::Unavailable => proto::ServingReadinessState::Unavailable,
        // Unknown, and anything unrecognised: never claim more than "unknown".
        _ => proto::ServingReadinessState::Unknown,
    };
    state as i32
}

fn readiness_in(field: &'static str, state: i32) -> Result<v1::ReadinessState, ContractError> {
    match proto::ServingReadinessState::try_from(state) {
        Ok(proto::ServingReadinessState::Unknown) => Ok(v1::ReadinessState::Unknown),
        Ok(proto::ServingReadinessState::Unavailable) => Ok(v1::ReadinessState::Unavailable),
        Ok(proto::ServingReadinessState::Ready) => Ok(v1::ReadinessState::Ready),
        Err(_) => Err(ContractError::UnknownValue {
            field,
            value: state,
        }),
    }
}

impl From<&v1::TopologyEntry> for proto::TopologyEntry {
    fn from(entry: &v1::TopologyEntry) -> Self {
        Self {
            namespace: entry.namespace.clone(),
            canonical_model_id: entry.canonical_model.clone(),
            state: readiness_out(entry.state),
            present_roles: roles_out(&entry.present_roles),
            missing_roles: roles_out(&entry.missing_roles),
            members: entry
                .members
                .iter()
                .map(|member| proto::TopologyMember {
                    endpoint: Some((&member.endpoint).into()),
                    roles: roles_out(&member.roles),
                    pool_id: member.pool_id.map(Into::into),
                })
                .collect(),
            duplicate_role_endpoints: roles_out(&entry.duplicate_role_endpoints),
            legacy_fallback_active: entry.legacy_fallback_active,
            adapters: entry
                .adapters
                .iter()
                .map(|adapter| proto::AdapterReadiness {
                    canonical_model_id: adapter.canonical_model.clone(),
                    state: readiness_out(adapter.state),
                    missing_roles: roles_out(&adapter.missing_roles),
                })
                .collect(),
        }
    }
}

impl TryFrom<proto::TopologyEntry> for v1::TopologyEntry {
    type Error = ContractError;

    fn try_from(entry: proto::TopologyEntry) -> Result<Self, ContractError> {
        let entry = Self {
            state: readiness_in("state", entry.state)?,
            present_roles: roles_in("present_roles", &entry.present_roles)?,
            missing_roles: roles_in("missing_roles", &entry.missing_roles)?,
            members: entry
                .members
                .into_iter()
                .map(|member| {
                    Ok(v1::TopologyMember {
                        roles: roles_in("members.roles", &member.roles)?,
                        pool_id: member.pool_id.map(TryInto::try_into).transpose()?,
                        endpoint: endpoint_in("members.endpoint", member.endpoint)?,
                    })
                })
                .collect::<Result<_, ContractError>>()?,
            duplicate_role_endpoints: roles_in(
                "duplicate_role_endpoints",
                &entry.duplicate_role_endpoints,
            )?,
            legacy_fallback_active: entry.legacy_fallback_active,
            adapters: entry
                .adapters
                .into_iter()
                .map(|adapter| {
                    Ok(v1::AdapterReadiness {
                        state: readiness_in("adapters.state", adapter.state)?,
                        missing_roles: roles_in("adapters.missing_roles", &adapter.missing_roles)?,
                        canonical_model: adapter.canonical_model_id,
                    })
                })
                .collect::<Result<_, ContractError>>()?,
            namespace: entry.namespace,
            canonical_model: entry.canonical_model_id,
        };
        entry.validate()?;
        Ok(entry)
    }
}

impl From<&v1::TopologyUpdate> for proto::ServingReadinessUpdate {
    fn from(update: &v1::TopologyUpdate) -> Self {
        Self {
            protocol_version: PROTOCOL_VERSION,
            relay: Some(update.relay.into()),
            revision: update.revision,
            entries: update.entries.iter().map(Into::into).collect(),
            contract_marker: CONTRACT_MARKER,
        }
    }
}

impl TryFrom<proto::ServingReadinessUpdate> for v1::TopologyUpdate {
    type Error = ContractError;

    fn try_from(update: proto::ServingReadinessUpdate) -> Result<Self, ContractError> {
        Ok(Self {
            relay: relay_in(update.relay)?,
            revision: update.revision,
            // An entry this side cannot take is left out, never the whole update (as our
            // own consumer quarantines an unsupported entry).
            entries: update
                .entries
                .into_iter()
                .filter_map(|entry| entry.try_into().ok())
                .collect(),
        })
    }
}

// ---- load --------------------------------------------------------------------------------

impl From<&v1::PoolLoad> for proto::KvPoolLoadEntry {
    fn from(load: &v1::PoolLoad) -> Self {
        // Without a known total, a rank that reported usage but no capacity is not counted
        // as observed: the entry must read as incomplete, not as used/0. (An unknown used
        // sum already has fewer observed than expected ranks.)
        let observed = match load.total_kv_blocks {
            Some(_) => load.kv_observed_ranks,
            None => load.kv_observed_ranks.min(load.kv_capacity_ranks),
        };
        Self {
            producer: Some(load.producer.into()),
            kv_used_blocks: load.kv_used_blocks.unwrap_or(0),
            total_kv_blocks: load.total_kv_blocks.unwrap_or(0),
            kv_observed_ranks: observed,
            kv_expected_ranks: load.kv_expected_ranks,
        }
    }
}

impl From<&v1::LoadWindow> for proto::KvPoolLoadUpdate {
    fn from(window: &v1::LoadWindow) -> Self {
        Self {
            protocol_version: PROTOCOL_VERSION,
            relay: Some(window.relay.into()),
            window_sequence: window.window_sequence,
            observed_ms: window.observed_unix_ms,
            window_ms: window.window_ms,
            pools: window.pools.iter().map(Into::into).collect(),
            contract_marker: CONTRACT_MARKER,
        }
    }
}

impl TryFrom<proto::KvPoolLoadUpdate> for v1::LoadWindow {
    type Error = ContractError;

    fn try_from(update: proto::KvPoolLoadUpdate) -> Result<Self, ContractError> {
        Ok(Self {
            relay: relay_in(update.relay)?,
            window_sequence: update.window_sequence,
            observed_unix_ms: update.observed_ms,
            window_ms: update.window_ms,
            // As for readiness: an entry this side cannot take is left out.
            pools: update
                .pools
                .into_iter()
                .filter_map(|entry| entry.try_into().ok())
                .collect(),
        })
    }
}

impl TryFrom<proto::KvPoolLoadEntry> for v1::PoolLoad {
    type Error = ContractError;

    fn try_from(entry: proto::KvPoolLoadEntry) -> Result<Self, ContractError> {
        let complete =
            entry.kv_expected_ranks > 0 && entry.kv_observed_ranks == entry.kv_expected_ranks;
        let load = Self {
            producer: producer_in("producer", entry.producer)?,
            kv_used_blocks: complete.then_some(entry.kv_used_blocks),
            total_kv_blocks: complete.then_some(entry.total_kv_blocks),
            kv_observed_ranks: entry.kv_observed_ranks,
            // The contract has no separate capacity count: a complete entry has both.
            kv_capacity_ranks: if complete {
                entry.kv_expected_ranks
            } else {
                entry.kv_observed_ranks
            },
            kv_expected_ranks: entry.kv_expected_ranks,
            authoritative: complete,
        };
        load.validate()?;
        Ok(load)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use proptest::prelude::*;

    use super::*;

    fn name() -> impl Strategy<Value = String> {
        "[a-z][a-z0-9-]{0,8}"
    }

    fn roles() -> impl Strategy<Value = Vec<v1::WorkerRole>> {
        prop::sample::subsequence(v1::WorkerRole::KNOWN.to_vec(), 1..=2)
    }

    fn producer() -> impl Strategy<Value = v1::ProducerIdentity> {
        (
            any::<[u8; 16]>(),
            any::<[u8; 16]>(),
            any::<bool>(),
            any::<u64>(),
            any::<u64>(),
            1..u64::MAX,
            any::<u64>(),
            4u32..=14,
        )
            .prop_map(
                |(cache, scope, explicit, dc, incarnation, generation, seed, log2)| {
                    let source = if explicit {
                        v1::IdentitySource::Explicit
                    } else {
                        v1::IdentitySource::DefaultDerived
                    };
                    v1::ProducerIdentity {
                        pool_id: v1::PoolId {
                            identity_version: 1,
                            cache_semantics: v1::DigestId {
                                digest: cache,
                                source,
                            },
                            routing_scope: v1::DigestId {
                                digest: scope,
                                source: v1::IdentitySource::DefaultDerived,
                            },
                            dc_id: dc,
                        },
                        producer_incarnation: incarnation,
                        layout_generation: generation,
                        ckf_format: v1::CkfFormat {
                            format_version: 1,
                            seed,
                            bucket_count: 1 << log2,
                            fingerprint_bits: 16,
                            slots_per_bucket: 4,
                        },
                    }
                },
            )
    }

    fn registration() -> impl Strategy<Value = v1::ModelRegistration> {
        (name(), name(), proptest::option::of(name()), name()).prop_map(
            |(model, base, adapter, alias)| v1::ModelRegistration {
                aliases: if alias == model {
                    Vec::new()
                } else {
                    vec![format!("{alias}-alias")]
                },
                model,
                base_model: base,
                adapter,
            },
        )
    }

    fn descriptor() -> impl Strategy<Value = v1::PoolDescriptor> {
        (
            producer(),
            name(),
            registration(),
            1u32..=256,
            any::<bool>(),
            roles(),
        )
            .prop_map(
                |(producer, namespace, registration, block, eagle, pool_roles)| {
                    v1::PoolDescriptor {
                        producer,
                        serving_endpoint: v1::EndpointId {
                            namespace,
                            component: "backend".to_owned(),
                            name: "generate".to_owned(),
                        },
                        registrations: vec![registration],
                        query_semantics: v1::QuerySemantics {
                            kv_block_size: block,
                            hash_format: if eagle {
                                v1::HashFormat::DynamoEagleV1
                            } else {
                                v1::HashFormat::DynamoStandardV1
                            },
                        },
                        pool_roles,
                    }
                },
            )
    }

    fn readiness() -> impl Strategy<Value = v1::ReadinessState> {
        prop::sample::select(v1::ReadinessState::KNOWN.to_vec())
    }

    fn entry() -> impl Strategy<Value = v1::TopologyEntry> {
        (
            name(),
            name(),
            readiness(),
            roles(),
            proptest::option::of(producer()),
            any::<bool>(),
        )
            .prop_map(|(namespace, model, state, present, linked, legacy)| {
                let unknown = state == v1::ReadinessState::Unknown;
                v1::TopologyEntry {
                    namespace: namespace.clone(),
                    canonical_model: model.clone(),
                    state,
                    present_roles: if unknown { Vec::new() } else { present.clone() },
                    missing_roles: Vec::new(),
                    members: vec![v1::TopologyMember {
                        endpoint: v1::EndpointId {
                            namespace,
                            component: "backend".to_owned(),
                            name: "generate".to_owned(),
                        },
                        roles: present,
                        pool_id: linked.map(|producer| producer.pool_id),
                    }],
                    duplicate_role_endpoints: Vec::new(),
                    legacy_fallback_active: legacy,
                    adapters: vec![v1::AdapterReadiness {
                        canonical_model: format!("{model}-lora"),
                        state: if unknown {
                            v1::ReadinessState::Unavailable
                        } else {
                            state
                        },
                        missing_roles: Vec::new(),
                    }],
                }
            })
    }

    proptest! {
        #[test]
        fn descriptors_round_trip(pool in descriptor(), revision in any::<u64>()) {
            pool.validate().unwrap();
            let catalog = v1::CatalogUpdate {
                relay: v1::RelayIdentity { drt_instance_id: 1, relay_incarnation: revision },
                revision,
                pools: vec![pool],
                coverage: Vec::new(),
                stalled: Vec::new(),
                tier_lanes: Vec::new(),
            };
            let sent = proto::KvPoolCatalogUpdate::from(&catalog);
            prop_assert_eq!(sent.contract_marker, CONTRACT_MARKER);
            let received = ReceivedCatalog::try_from(sent).unwrap();
            prop_assert!(received.unsupported.is_empty());
            prop_assert_eq!(received.catalog, catalog);
        }

        #[test]
        fn topology_entries_round_trip(entry in entry()) {
            entry.validate().unwrap();
            let back = v1::TopologyEntry::try_from(proto::TopologyEntry::from(&entry)).unwrap();
            prop_assert_eq!(back, entry);
        }

        #[test]
        fn pool_frames_round_trip(
            producer in producer(),
            sequence in 1u64..u64::MAX,
            kind in prop::sample::select(v1::PoolFrameKind::KNOWN.to_vec()),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let base_sequence = if kind == v1::PoolFrameKind::Delta { sequence - 1 } else { sequence };
            let frame = v1::PoolFrame {
                header: v1::PoolFrameHeader {
                    relay: v1::RelayIdentity { drt_instance_id: 3, relay_incarnation: 4 },
                    producer,
                    base_sequence,
                    sequence,
                    kind,
                    sent_unix_us: sequence / 2,
                },
                payload: payload.into(),
            };
            let back = v1::PoolFrame::try_from(proto::FilterUpdate::from(frame.clone())).unwrap();
            prop_assert_eq!(back, frame);
        }

        /// Whatever bytes a hostile relay sends, decoding and converting them returns an
        /// answer or an error, never a panic.
        #[test]
        fn hostile_answers_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            use prost::Message as _;
            if let Ok(update) = proto::KvPoolCatalogUpdate::decode(bytes.as_slice()) {
                let _ = ReceivedCatalog::try_from(update);
            }
            if let Ok(update) = proto::FilterUpdate::decode(bytes.as_slice()) {
                let _ = v1::PoolFrame::try_from(update);
            }
            if let Ok(update) = proto::ServingReadinessUpdate::decode(bytes.as_slice()) {
                let _ = v1::TopologyUpdate::try_from(update);
            }
            if let Ok(update) = proto::KvPoolLoadUpdate::decode(bytes.as_slice()) {
                let _ = v1::LoadWindow::try_from(update);
            }
            if let Ok(request) = proto::SubscribeKvPoolRequest::decode(bytes.as_slice())
                && let Some(producer) = request.expected_producer
            {
                let _ = v1::ProducerIdentity::try_from(producer);
            }
        }

        /// A load entry never reads as more complete than kvrelay knows it is.
        #[test]
        fn load_entries_are_never_more_complete_than_known(
            producer in producer(),
            expected in 0u32..8,
            observed_cut in 0u32..8,
            capacity_cut in 0u32..8,
            used in any::<u32>(),
            total in any::<u32>(),
        ) {
            let observed = observed_cut.min(expected);
            let capacity = capacity_cut.min(expected);
            let all_observed = expected > 0 && observed == expected;
            let all_capacity = expected > 0 && capacity == expected;
            let load = v1::PoolLoad {
                producer,
                kv_used_blocks: all_observed.then_some(u64::from(used)),
                total_kv_blocks: all_capacity.then_some(u64::from(total)),
                kv_observed_ranks: observed,
                kv_capacity_ranks: capacity,
                kv_expected_ranks: expected,
                authoritative: all_observed && all_capacity,
            };
            load.validate().unwrap();
            let sent = proto::KvPoolLoadEntry::from(&load);
            let complete = sent.kv_expected_ranks > 0 && sent.kv_observed_ranks == sent.kv_expected_ranks;
            prop_assert_eq!(complete, load.authoritative);
            let back = v1::PoolLoad::try_from(sent).unwrap();
            prop_assert_eq!(back.authoritative, load.authoritative);
            if load.authoritative {
                prop_assert_eq!(back, load);
            }
        }
    }

    #[test]
    fn readiness_codes_are_shifted_not_copied() {
        let entry = |state| v1::TopologyEntry {
            namespace: "ns".to_owned(),
            canonical_model: "m".to_owned(),
            state,
            present_roles: Vec::new(),
            missing_roles: Vec::new(),
            members: Vec::new(),
            duplicate_role_endpoints: Vec::new(),
            legacy_fallback_active: false,
            adapters: Vec::new(),
        };
        let sent = |state| proto::TopologyEntry::from(&entry(state)).state();
        assert_eq!(
            sent(v1::ReadinessState::Unknown),
            proto::ServingReadinessState::Unknown
        );
        assert_eq!(
            sent(v1::ReadinessState::Unavailable),
            proto::ServingReadinessState::Unavailable
        );
        assert_eq!(
            sent(v1::ReadinessState::Ready),
            proto::ServingReadinessState::Ready
        );
        assert_eq!(
            sent(v1::ReadinessState::Unrecognized(9)),
            proto::ServingReadinessState::Unknown
        );
    }

    #[test]
    fn an_unset_model_target_is_refused_not_read_as_a_base_model() {
        let registration = proto::ModelRegistration {
            canonical_model_id: "m".to_owned(),
            target: Some(proto::ModelTarget { target: None }),
            aliases: Vec::new(),
        };
        assert_eq!(
            v1::ModelRegistration::try_from(registration),
            Err(ContractError::Missing {
                field: "registration.target"
            })
        );
    }

    #[test]
    fn a_bad_pool_is_set_aside_and_the_rest_of_the_catalog_kept() {
        let good = proto::KvPoolDescriptor::from(&v1::PoolDescriptor {
            producer: v1::ProducerIdentity {
                pool_id: v1::PoolId {
                    identity_version: 1,
                    cache_semantics: v1::DigestId {
                        digest: [1; 16],
                        source: v1::IdentitySource::Explicit,
                    },
                    routing_scope: v1::DigestId {
                        digest: [2; 16],
                        source: v1::IdentitySource::Explicit,
                    },
                    dc_id: 5,
                },
                producer_incarnation: 1,
                layout_generation: 1,
                ckf_format: v1::CkfFormat {
                    format_version: 1,
                    seed: 0,
                    bucket_count: 64,
                    fingerprint_bits: 16,
                    slots_per_bucket: 4,
                },
            },
            serving_endpoint: v1::EndpointId {
                namespace: "n".into(),
                component: "c".into(),
                name: "e".into(),
            },
            registrations: vec![v1::ModelRegistration {
                model: "m".into(),
                base_model: "m".into(),
                adapter: None,
                aliases: Vec::new(),
            }],
            query_semantics: v1::QuerySemantics {
                kv_block_size: 16,
                hash_format: v1::HashFormat::DynamoStandardV1,
            },
            pool_roles: vec![v1::WorkerRole::Aggregated],
        });
        let mut unknown_role = good.clone();
        unknown_role.pool_roles = vec![42];
        // Another pool of the same relay (catalog entries are unique by pool id).
        if let Some(id) = unknown_role
            .producer
            .as_mut()
            .and_then(|p| p.pool_id.as_mut())
        {
            id.dc_id += 1;
        }
        let mut short_digest = good.clone();
        if let Some(id) = short_digest
            .producer
            .as_mut()
            .and_then(|p| p.pool_id.as_mut())
        {
            id.indexer_domain
                .as_mut()
                .unwrap()
                .routing_scope
                .as_mut()
                .unwrap()
                .digest = vec![1, 2, 3];
        }
        let update = proto::KvPoolCatalogUpdate {
            protocol_version: 1,
            relay: Some(proto::RelayIdentity {
                drt_instance_id: 1,
                relay_incarnation: 2,
            }),
            revision: 3,
            snapshot: Some(proto::KvPoolCatalogSnapshot {
                pools: vec![unknown_role, good, short_digest],
            }),
            contract_marker: CONTRACT_MARKER,
        };
        let received = ReceivedCatalog::try_from(update).unwrap();
        // A pool the v1 model cannot even represent is set aside here...
        assert_eq!(
            received.unsupported,
            vec![ContractError::DigestLength {
                field: "pool_id.indexer_domain.routing_scope",
                len: 3
            }]
        );
        assert_eq!(
            received.unsupported[0].reason(),
            v1::ErrorReason::InvalidRequest
        );
        // ...one it can represent is kept for the reader's own validation, which
        // quarantines the unknown role (and counts it), exactly as on our protocol.
        assert_eq!(received.catalog.pools.len(), 2);
        let check = received.catalog.validate().unwrap();
        assert_eq!(check.accepted, vec![1]);
        assert_eq!(check.quarantined.len(), 1);
        assert_eq!(
            check.quarantined[0].error,
            v1::ValidationError::UnsupportedCode {
                field: "pool_roles",
                code: 42
            }
        );
    }
}
