//! Explicit conversions between `kvrelay-identity` domain types and the v1 wire types.
//!
//! Domain → wire is infallible (`From`). Wire → domain (`TryFrom`) first runs the wire
//! type's `validate` (so unsupported and malformed values keep their classification), then
//! the domain constructor; a domain rule the wire check does not know becomes
//! [`ValidationError::Inconsistent`].

use kvrelay_identity as domain;

use super::code::{HashFormat, IdentitySource, WorkerRole};
use super::identity::{
    CkfFormat, DigestId, EndpointId, ModelRegistration, POOL_IDENTITY_VERSION, PoolId,
    ProducerIdentity, QuerySemantics, RelayIdentity,
};
use super::validation::ValidationError;

impl From<domain::DcRelayIdentity> for RelayIdentity {
    fn from(relay: domain::DcRelayIdentity) -> Self {
        Self {
            drt_instance_id: relay.drt_instance_id(),
            relay_incarnation: relay.relay_incarnation(),
        }
    }
}

impl From<domain::IdentitySource> for IdentitySource {
    fn from(source: domain::IdentitySource) -> Self {
        match source {
            domain::IdentitySource::DefaultDerived => IdentitySource::DefaultDerived,
            domain::IdentitySource::Explicit => IdentitySource::Explicit,
        }
    }
}

impl From<domain::PoolId> for PoolId {
    fn from(pool: domain::PoolId) -> Self {
        let domain_id = pool.indexer_domain;
        Self {
            identity_version: POOL_IDENTITY_VERSION,
            cache_semantics: DigestId {
                digest: *domain_id.cache_semantics.digest(),
                source: domain_id.cache_semantics.source().into(),
            },
            routing_scope: DigestId {
                digest: *domain_id.routing_scope.digest(),
                source: domain_id.routing_scope.source().into(),
            },
            dc_id: pool.dc_id.as_u64(),
        }
    }
}

impl From<domain::CkfFormat> for CkfFormat {
    fn from(format: domain::CkfFormat) -> Self {
        Self {
            format_version: u32::from(format.format_version()),
            seed: format.seed(),
            bucket_count: u64::from(format.bucket_count()),
            fingerprint_bits: u32::from(format.fingerprint_bits()),
            slots_per_bucket: u32::from(format.slots_per_bucket()),
        }
    }
}

impl From<domain::ProducerIdentity> for ProducerIdentity {
    fn from(producer: domain::ProducerIdentity) -> Self {
        Self {
            pool_id: (*producer.pool_id()).into(),
            producer_incarnation: producer.producer_incarnation(),
            layout_generation: producer.layout_generation(),
            ckf_format: (*producer.format()).into(),
        }
    }
}

impl From<&domain::EndpointId> for EndpointId {
    fn from(endpoint: &domain::EndpointId) -> Self {
        Self {
            namespace: endpoint.namespace().to_owned(),
            component: endpoint.component().to_owned(),
            name: endpoint.name().to_owned(),
        }
    }
}

impl From<&domain::CanonicalModelRegistration> for ModelRegistration {
    fn from(registration: &domain::CanonicalModelRegistration) -> Self {
        Self {
            model: registration.model().as_str().to_owned(),
            base_model: registration.target().base_model().as_str().to_owned(),
            adapter: registration
                .target()
                .adapter()
                .map(|adapter| adapter.as_str().to_owned()),
            aliases: registration
                .aliases()
                .iter()
                .map(|alias| alias.as_str().to_owned())
                .collect(),
        }
    }
}

impl From<domain::KvQueryHashFormat> for HashFormat {
    fn from(format: domain::KvQueryHashFormat) -> Self {
        match format {
            domain::KvQueryHashFormat::DynamoStandardV1 => HashFormat::DynamoStandardV1,
            domain::KvQueryHashFormat::DynamoEagleV1 => HashFormat::DynamoEagleV1,
        }
    }
}

impl From<domain::KvQuerySemantics> for QuerySemantics {
    fn from(semantics: domain::KvQuerySemantics) -> Self {
        Self {
            kv_block_size: semantics.kv_block_size(),
            hash_format: semantics.hash_format().into(),
        }
    }
}

impl From<domain::WorkerRole> for WorkerRole {
    fn from(role: domain::WorkerRole) -> Self {
        match role {
            domain::WorkerRole::Prefill => WorkerRole::Prefill,
            domain::WorkerRole::Decode => WorkerRole::Decode,
            domain::WorkerRole::Encode => WorkerRole::Encode,
            domain::WorkerRole::Aggregated => WorkerRole::Aggregated,
            domain::WorkerRole::Legacy => WorkerRole::Legacy,
        }
    }
}

impl TryFrom<RelayIdentity> for domain::DcRelayIdentity {
    type Error = ValidationError;

    fn try_from(relay: RelayIdentity) -> Result<Self, ValidationError> {
        domain::DcRelayIdentity::from_parts(relay.drt_instance_id, relay.relay_incarnation)
            .map_err(|err| inconsistent("relay", &err))
    }
}

impl TryFrom<IdentitySource> for domain::IdentitySource {
    type Error = ValidationError;

    fn try_from(source: IdentitySource) -> Result<Self, ValidationError> {
        match source {
            IdentitySource::DefaultDerived => Ok(domain::IdentitySource::DefaultDerived),
            IdentitySource::Explicit => Ok(domain::IdentitySource::Explicit),
            IdentitySource::Unrecognized(code) => Err(unrecognized("source", code)),
        }
    }
}

impl TryFrom<PoolId> for domain::PoolId {
    type Error = ValidationError;

    fn try_from(pool: PoolId) -> Result<Self, ValidationError> {
        pool.validate()?;
        Ok(domain::PoolId {
            indexer_domain: domain::IndexerDomainId {
                cache_semantics: domain::CacheSemanticsId::new(
                    pool.cache_semantics.digest,
                    pool.cache_semantics.source.try_into()?,
                ),
                routing_scope: domain::RoutingScopeId::new(
                    pool.routing_scope.digest,
                    pool.routing_scope.source.try_into()?,
                ),
            },
            dc_id: domain::DcId(pool.dc_id),
        })
    }
}

impl TryFrom<CkfFormat> for domain::CkfFormat {
    type Error = ValidationError;

    fn try_from(format: CkfFormat) -> Result<Self, ValidationError> {
        format.validate()?;
        let narrow = || ValidationError::InvalidBucketCount {
            bucket_count: format.bucket_count,
        };
        domain::CkfFormat::from_parts(
            u16::try_from(format.format_version).map_err(|_| narrow())?,
            format.seed,
            u32::try_from(format.bucket_count).map_err(|_| narrow())?,
            u8::try_from(format.fingerprint_bits).map_err(|_| narrow())?,
            u8::try_from(format.slots_per_bucket).map_err(|_| narrow())?,
        )
        .map_err(|err| inconsistent("ckf_format", &err))
    }
}

impl TryFrom<ProducerIdentity> for domain::ProducerIdentity {
    type Error = ValidationError;

    fn try_from(producer: ProducerIdentity) -> Result<Self, ValidationError> {
        producer.validate()?;
        domain::ProducerIdentity::new(
            producer.pool_id.try_into()?,
            producer.producer_incarnation,
            producer.layout_generation,
            producer.ckf_format.try_into()?,
        )
        .map_err(|err| inconsistent("producer", &err))
    }
}

impl TryFrom<&EndpointId> for domain::EndpointId {
    type Error = ValidationError;

    fn try_from(endpoint: &EndpointId) -> Result<Self, ValidationError> {
        endpoint.validate("endpoint")?;
        domain::EndpointId::new(&endpoint.namespace, &endpoint.component, &endpoint.name)
            .map_err(|err| inconsistent("endpoint", &err))
    }
}

impl TryFrom<&ModelRegistration> for domain::CanonicalModelRegistration {
    type Error = ValidationError;

    fn try_from(registration: &ModelRegistration) -> Result<Self, ValidationError> {
        registration.validate()?;
        let model_id = |field, text: &str| {
            domain::CanonicalModelId::new(text).map_err(|err| inconsistent(field, &err))
        };
        let base_model = model_id("registration.base_model", &registration.base_model)?;
        let target = match &registration.adapter {
            None => domain::ModelTarget::Base { base_model },
            Some(adapter) => domain::ModelTarget::Lora {
                base_model,
                adapter: model_id("registration.adapter", adapter)?,
            },
        };
        let aliases = registration
            .aliases
            .iter()
            .map(|alias| {
                domain::ModelAlias::new(alias)
                    .map_err(|err| inconsistent("registration.aliases", &err))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(domain::CanonicalModelRegistration::new(
            model_id("registration.model", &registration.model)?,
            target,
            aliases,
        ))
    }
}

impl TryFrom<QuerySemantics> for domain::KvQuerySemantics {
    type Error = ValidationError;

    fn try_from(semantics: QuerySemantics) -> Result<Self, ValidationError> {
        semantics.validate()?;
        let hash_format = match semantics.hash_format {
            HashFormat::DynamoStandardV1 => domain::KvQueryHashFormat::DynamoStandardV1,
            HashFormat::DynamoEagleV1 => domain::KvQueryHashFormat::DynamoEagleV1,
            HashFormat::Unrecognized(code) => {
                return Err(unrecognized("query_semantics.hash_format", code));
            }
        };
        domain::KvQuerySemantics::new(semantics.kv_block_size, hash_format)
            .map_err(|err| inconsistent("query_semantics", &err))
    }
}

impl TryFrom<WorkerRole> for domain::WorkerRole {
    type Error = ValidationError;

    fn try_from(role: WorkerRole) -> Result<Self, ValidationError> {
        match role {
            WorkerRole::Prefill => Ok(domain::WorkerRole::Prefill),
            WorkerRole::Decode => Ok(domain::WorkerRole::Decode),
            WorkerRole::Encode => Ok(domain::WorkerRole::Encode),
            WorkerRole::Aggregated => Ok(domain::WorkerRole::Aggregated),
            WorkerRole::Legacy => Ok(domain::WorkerRole::Legacy),
            WorkerRole::Unrecognized(code) => Err(unrecognized("role", code)),
        }
    }
}

fn inconsistent(field: &'static str, err: &dyn std::error::Error) -> ValidationError {
    ValidationError::Inconsistent {
        field,
        detail: err.to_string(),
    }
}

fn unrecognized(field: &'static str, code: u32) -> ValidationError {
    match code {
        0 => ValidationError::Unspecified { field },
        code => ValidationError::UnsupportedCode { field, code },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn domain_producer() -> domain::ProducerIdentity {
        let pool = domain::PoolId {
            indexer_domain: domain::IndexerDomainId {
                cache_semantics: domain::CacheSemanticsId::new(
                    [3; 16],
                    domain::IdentitySource::Explicit,
                ),
                routing_scope: domain::RoutingScopeId::new(
                    [4; 16],
                    domain::IdentitySource::DefaultDerived,
                ),
            },
            dc_id: domain::DcId::from_dc_name("dc-a"),
        };
        let format = domain::CkfFormat::v1(domain::DEFAULT_CKF_SEED, 1 << 16).unwrap();
        domain::ProducerIdentity::new(pool, 9, 2, format).unwrap()
    }

    #[test]
    fn producer_identity_round_trips_through_the_wire_type() {
        let producer = domain_producer();
        let wire = ProducerIdentity::from(producer);
        assert_eq!(wire.validate(), Ok(()));
        assert_eq!(domain::ProducerIdentity::try_from(wire), Ok(producer));
    }

    #[test]
    fn unsupported_wire_producer_stays_unsupported_in_conversion() {
        let mut wire = ProducerIdentity::from(domain_producer());
        wire.ckf_format.format_version = 3;
        let err = domain::ProducerIdentity::try_from(wire).unwrap_err();
        assert!(err.is_unsupported());
    }

    #[test]
    fn registration_round_trips_through_the_wire_type() {
        let registration = domain::CanonicalModelRegistration::new(
            domain::CanonicalModelId::new("llama-lora").unwrap(),
            domain::ModelTarget::Lora {
                base_model: domain::CanonicalModelId::new("llama").unwrap(),
                adapter: domain::CanonicalModelId::new("sql").unwrap(),
            },
            vec![domain::ModelAlias::new("sql-llama").unwrap()],
        );
        let wire = ModelRegistration::from(&registration);
        assert_eq!(
            domain::CanonicalModelRegistration::try_from(&wire),
            Ok(registration)
        );
    }

    #[test]
    fn every_role_converts_both_ways() {
        for role in domain::WorkerRole::ALL {
            let wire = WorkerRole::from(role);
            assert_eq!(domain::WorkerRole::try_from(wire), Ok(role));
        }
    }
}
