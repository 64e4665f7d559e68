//! Complete serving topology: per (namespace, canonical model), can it serve, and why not.

use bytes::BytesMut;
use serde::{Deserialize, Serialize};

use super::body::{DecodeError, EncodeError, decode_body, encode_body};
use super::code::{ReadinessState, WorkerRole};
use super::identity::{EndpointId, PoolId, RelayIdentity};
use super::validation::{
    CollectionCheck, EntryError, ValidationError, check_collection, check_name, check_roles,
    first_duplicate,
};
use crate::frame::MessageKind;

/// Every topology entry a relay publishes, at one revision (no tombstones).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyUpdate {
    /// The relay process.
    pub relay: RelayIdentity,
    /// Increases with every change.
    pub revision: u64,
    /// One entry per (namespace, canonical model), sorted by that key.
    pub entries: Vec<TopologyEntry>,
}

/// Whether one base model can serve requests in one namespace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyEntry {
    /// The namespace.
    pub namespace: String,
    /// The base model's canonical id.
    pub canonical_model: String,
    /// Ready, unavailable or unknown.
    pub state: ReadinessState,
    /// Roles with a live worker (empty when unknown), sorted.
    pub present_roles: Vec<WorkerRole>,
    /// Roles needed but not live (empty when unknown or legacy), sorted.
    pub missing_roles: Vec<WorkerRole>,
    /// The endpoints serving the model, sorted by endpoint.
    pub members: Vec<TopologyMember>,
    /// Prefill or decode roles served by more than one live endpoint (ambiguous).
    pub duplicate_role_endpoints: Vec<WorkerRole>,
    /// True when a role-less (legacy) worker made readiness fall back to "any live worker".
    pub legacy_fallback_active: bool,
    /// LoRA adapters on this base model.
    pub adapters: Vec<AdapterReadiness>,
}

/// One endpoint under a topology entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologyMember {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Roles its workers declare.
    pub roles: Vec<WorkerRole>,
    /// The catalog pool it owns, if exactly one.
    pub pool_id: Option<PoolId>,
}

/// Readiness of one LoRA adapter on a base model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdapterReadiness {
    /// The adapter's canonical model id.
    pub canonical_model: String,
    /// Ready, unavailable or unknown.
    pub state: ReadinessState,
    /// Roles that have no live worker carrying the adapter.
    pub missing_roles: Vec<WorkerRole>,
}

impl TopologyEntry {
    /// Checks names, states, role lists and members.
    pub fn validate(&self) -> Result<(), ValidationError> {
        check_name("namespace", &self.namespace)?;
        check_name("canonical_model", &self.canonical_model)?;
        self.state.check("state")?;
        check_roles("present_roles", &self.present_roles)?;
        check_roles("missing_roles", &self.missing_roles)?;
        check_roles("duplicate_role_endpoints", &self.duplicate_role_endpoints)?;
        if let Some(role) = self
            .duplicate_role_endpoints
            .iter()
            .find(|role| !matches!(role, WorkerRole::Prefill | WorkerRole::Decode))
        {
            return Err(ValidationError::RoleNotAllowed {
                field: "duplicate_role_endpoints",
                role: *role,
            });
        }
        let unknown = self.state == ReadinessState::Unknown;
        if unknown && !(self.present_roles.is_empty() && self.missing_roles.is_empty()) {
            return Err(ValidationError::Inconsistent {
                field: "state",
                detail: "unknown state lists present or missing roles".to_owned(),
            });
        }
        if self.state == ReadinessState::Ready && !self.missing_roles.is_empty() {
            return Err(ValidationError::Inconsistent {
                field: "state",
                detail: format!(
                    "ready state with {} missing roles",
                    self.missing_roles.len()
                ),
            });
        }
        for member in &self.members {
            member.endpoint.validate("members.endpoint")?;
            check_roles("members.roles", &member.roles)?;
            if let Some(pool_id) = &member.pool_id {
                pool_id.validate()?;
            }
        }
        if let Some((_, endpoint)) = first_duplicate(self.members.iter().map(|m| &m.endpoint)) {
            return Err(ValidationError::DuplicateEntry {
                field: "members",
                key: endpoint.to_string(),
            });
        }
        for adapter in &self.adapters {
            check_name("adapters.canonical_model", &adapter.canonical_model)?;
            adapter.state.check("adapters.state")?;
            check_roles("adapters.missing_roles", &adapter.missing_roles)?;
        }
        let adapter_models = self.adapters.iter().map(|a| a.canonical_model.as_str());
        if let Some((_, model)) = first_duplicate(adapter_models) {
            return Err(ValidationError::DuplicateEntry {
                field: "adapters",
                key: model.to_owned(),
            });
        }
        Ok(())
    }
}

impl TopologyUpdate {
    /// Checks every entry and that no (namespace, model) key appears twice. Malformed data
    /// fails the whole update; unsupported entries are listed for quarantine.
    pub fn validate(&self) -> Result<CollectionCheck, EntryError> {
        let verdict = check_collection("entries", &self.entries, TopologyEntry::validate)?;
        let keys = self
            .entries
            .iter()
            .map(|entry| (entry.namespace.as_str(), entry.canonical_model.as_str()));
        if let Some((index, (namespace, model))) = first_duplicate(keys) {
            return Err(EntryError {
                collection: "entries",
                index,
                error: ValidationError::DuplicateEntry {
                    field: "entries",
                    key: format!("{namespace}/{model}"),
                },
            });
        }
        Ok(verdict)
    }

    /// Appends the body to `dst`.
    pub fn encode_body(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        encode_body(MessageKind::TopologyUpdate, self, dst)
    }

    /// Decodes a body sent with protocol minor `minor`.
    pub fn decode_body(body: &[u8], minor: u16) -> Result<Self, DecodeError> {
        decode_body(MessageKind::TopologyUpdate, body, minor)
    }
}
