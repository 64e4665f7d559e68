//! The complete pool catalog: a revision and every pool descriptor.

use std::collections::BTreeSet;

use bytes::BytesMut;
use serde::{Deserialize, Serialize};

use super::body::{DecodeError, EncodeError, decode_body, encode_body};
use super::code::WorkerRole;
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
        Ok(verdict)
    }

    /// Appends the body to `dst`.
    pub fn encode_body(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        encode_body(MessageKind::CatalogUpdate, self, dst)
    }

    /// Decodes a body sent with protocol minor `minor`.
    pub fn decode_body(body: &[u8], minor: u16) -> Result<Self, DecodeError> {
        decode_body(MessageKind::CatalogUpdate, body, minor)
    }
}
