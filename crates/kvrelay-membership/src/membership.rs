//! The projection's output: one [`EndpointMembership`] per endpoint, with its conflicts, and
//! the [`MembershipView`] of all of them.
//!
//! Plain data: public fields, no invariants beyond "sorted and deduplicated", so other crates
//! (pool, codec, server) can read and convert them freely.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use kvrelay_identity::{
    CanonicalModelId, CanonicalModelRegistration, EndpointId, IndexerDomainId, KvQuerySemantics,
    ModelAlias, WorkerRole,
};

use crate::card::{ModelType, RuntimeConfig, WorkerType};
use crate::instance::ModelCardInstanceId;

/// A worker id: the discovery instance id of the worker that published a card.
pub type WorkerId = u64;

/// The indexer domain an endpoint's cards resolve to, with the query semantics its filter
/// keys are built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResolvedDomain {
    /// Cache semantics and routing scope digests.
    pub id: IndexerDomainId,
    /// Block size and hash format.
    pub query_semantics: KvQuerySemantics,
}

/// One endpoint as projected from its cards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointMembership {
    /// The serving endpoint.
    pub endpoint: EndpointId,
    /// Advances (from a global counter starting at 1) whenever any other field changes, and
    /// when the endpoint reappears after removal; kept otherwise.
    pub generation: u64,
    /// The unique domain of all base cards; `None` if any base card failed to resolve or
    /// they disagree.
    pub domain: Option<ResolvedDomain>,
    /// Request-facing bindings, sorted.
    pub registrations: Vec<CanonicalModelRegistration>,
    /// Registration model names, sorted and unique.
    pub models: Vec<CanonicalModelId>,
    /// Registration aliases, sorted and unique.
    pub aliases: Vec<ModelAlias>,
    /// Distinct roles of the endpoint's workers, sorted.
    pub roles: Vec<WorkerRole>,
    /// Runtime facts per worker (from its one base card).
    pub runtime_configs: BTreeMap<WorkerId, RuntimeConfig>,
    /// Readiness facts per worker (from its one base card).
    pub worker_topology: BTreeMap<WorkerId, WorkerTopology>,
    /// Adapter overlays keyed by request-facing (served) adapter name.
    pub adapters: BTreeMap<CanonicalModelId, AdapterMembership>,
    /// Structural inconsistencies, sorted and unique.
    pub conflicts: Vec<MembershipConflict>,
}

impl EndpointMembership {
    /// The endpoint's namespace (the topology key's first half).
    pub fn namespace(&self) -> &str {
        self.endpoint.namespace()
    }

    /// Whether a conflict fences the pool (pool-materialization or serving-topology scope).
    pub fn has_pool_materialization_conflict(&self) -> bool {
        self.conflicts.iter().any(|conflict| {
            matches!(
                conflict.scope,
                ConflictScope::PoolMaterialization | ConflictScope::ServingTopology
            )
        })
    }

    /// Whether a conflict fences the serving topology too.
    pub fn has_serving_topology_conflict(&self) -> bool {
        self.conflicts
            .iter()
            .any(|conflict| conflict.scope == ConflictScope::ServingTopology)
    }

    /// A pool may exist: domain known, at least one registration, no fencing conflict.
    pub fn is_materializable(&self) -> bool {
        self.domain.is_some()
            && !self.registrations.is_empty()
            && !self.has_pool_materialization_conflict()
    }

    /// Where the endpoint's workers publish KV events: each worker's
    /// `runtime_config.kv_state_endpoint`, defaulting to the serving endpoint. Workers that
    /// disagree make it ambiguous (KV handling fails closed; serving continues).
    pub fn kv_state_endpoint(&self) -> KvStateEndpoint {
        let mut endpoints = self
            .runtime_configs
            .values()
            .map(|config| config.kv_state_endpoint.as_ref().unwrap_or(&self.endpoint));
        let first = endpoints.next().unwrap_or(&self.endpoint);
        if endpoints.all(|endpoint| endpoint == first) {
            KvStateEndpoint::Resolved(first.clone())
        } else {
            KvStateEndpoint::Ambiguous
        }
    }

    /// Equality of every field except the generation.
    pub fn same_content(&self, other: &Self) -> bool {
        self.endpoint == other.endpoint
            && self.domain == other.domain
            && self.registrations == other.registrations
            && self.models == other.models
            && self.aliases == other.aliases
            && self.roles == other.roles
            && self.runtime_configs == other.runtime_configs
            && self.worker_topology == other.worker_topology
            && self.adapters == other.adapters
            && self.conflicts == other.conflicts
    }
}

/// Where an endpoint's KV events are published.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvStateEndpoint {
    /// All workers agree on this endpoint.
    Resolved(EndpointId),
    /// Workers name different KV-state endpoints.
    Ambiguous,
}

/// The readiness facts of one worker.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct WorkerTopology {
    /// The worker's role; `None` for a legacy card.
    pub worker_type: Option<WorkerType>,
    /// Request surfaces: same-role workers with different surfaces are distinct units.
    pub model_type: ModelType,
    /// Roles the worker needs live, in disjunctive normal form.
    pub needs: Vec<Vec<WorkerType>>,
}

impl WorkerTopology {
    /// The worker's role (`Legacy` when the card named none).
    pub fn role(&self) -> WorkerRole {
        role_of(self.worker_type)
    }
}

/// Maps a card's worker type to a role; `None` is `Legacy`.
pub fn role_of(worker_type: Option<WorkerType>) -> WorkerRole {
    match worker_type {
        Some(WorkerType::Prefill) => WorkerRole::Prefill,
        Some(WorkerType::Decode) => WorkerRole::Decode,
        Some(WorkerType::Encode) => WorkerRole::Encode,
        Some(WorkerType::Aggregated) => WorkerRole::Aggregated,
        None => WorkerRole::Legacy,
    }
}

/// A LoRA adapter loaded on an endpoint's base model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterMembership {
    /// The base model the adapter runs on.
    pub base_model: CanonicalModelId,
    /// The runtime LoRA name (salts hashes); distinct from the served name keying the map.
    pub adapter: CanonicalModelId,
    /// Workers carrying the adapter, with their published GPU adapter capacity.
    pub workers: BTreeMap<WorkerId, Option<u32>>,
}

/// Which projection a conflict invalidates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ConflictScope {
    /// Fences the pool (filter publication) only; serving bindings stay valid.
    PoolMaterialization,
    /// Suppresses one binding; the endpoint's other bindings stay usable.
    ServingBinding,
    /// Fences the pool and the serving topology: workers cannot be assigned safely.
    ServingTopology,
}

impl ConflictScope {
    /// The snake_case name (`pool_materialization`, `serving_binding`, `serving_topology`).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::PoolMaterialization => "pool_materialization",
            Self::ServingBinding => "serving_binding",
            Self::ServingTopology => "serving_topology",
        }
    }
}

/// What a conflict is about.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ConflictSubject {
    /// The whole endpoint.
    Endpoint(EndpointId),
    /// One card.
    Card(ModelCardInstanceId),
    /// One worker.
    Worker(WorkerId),
    /// One request-facing binding, by model name.
    Binding(CanonicalModelId),
}

impl fmt::Display for ConflictSubject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Endpoint(endpoint) => write!(f, "endpoint {}", endpoint.dotted()),
            Self::Card(card) => write!(f, "card {card}"),
            Self::Worker(worker) => write!(f, "worker {worker:x}"),
            Self::Binding(model) => write!(f, "binding {model}"),
        }
    }
}

/// Why a conflict was recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum ConflictReason {
    /// The card has a model suffix without LoRA metadata, or LoRA metadata without a suffix.
    LoraShapeMismatch,
    /// The card's KV block size is 0.
    ZeroBlockSize,
    /// Base cards resolve to more than one indexer domain.
    MultipleIndexerDomains,
    /// Base cards name more than one canonical base model.
    MultipleBaseModels,
    /// One worker publishes more than one base card.
    MultipleBaseCards,
    /// A base card's name is not a valid canonical model id.
    InvalidBaseModel,
    /// An adapter's backing base card has an invalid model name.
    InvalidAdapterBase,
    /// An adapter card's served name is not a valid canonical model id.
    InvalidServedAdapter,
    /// An adapter card's runtime LoRA name is not a valid canonical model id.
    InvalidRuntimeAdapter,
    /// One served adapter name maps to different (base, runtime adapter) targets.
    ConflictingAdapterTargets,
    /// A worker publishes one adapter with different capacities.
    ConflictingAdapterCapacity,
    /// The request-facing name is claimed by different targets in the watch scope.
    AmbiguousName,
}

impl fmt::Display for ConflictReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::LoraShapeMismatch => "lora discovery identity and card metadata disagree",
            Self::ZeroBlockSize => "kv query block size must be nonzero",
            Self::MultipleIndexerDomains => "endpoint resolves to multiple indexer domains",
            Self::MultipleBaseModels => "endpoint resolves to multiple canonical base models",
            Self::MultipleBaseCards => "worker publishes multiple base model cards",
            Self::InvalidBaseModel => "invalid canonical model identity",
            Self::InvalidAdapterBase => "adapter's backing base model identity is invalid",
            Self::InvalidServedAdapter => "invalid adapter request-facing model identity",
            Self::InvalidRuntimeAdapter => "invalid runtime lora identity",
            Self::ConflictingAdapterTargets => {
                "adapter request-facing model resolves to conflicting runtime targets"
            }
            Self::ConflictingAdapterCapacity => "worker publishes conflicting adapter capacity",
            Self::AmbiguousName => "request-facing model name resolves to conflicting targets",
        })
    }
}

/// A structural inconsistency found while projecting one endpoint.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct MembershipConflict {
    /// What it invalidates.
    pub scope: ConflictScope,
    /// What it is about.
    pub subject: ConflictSubject,
    /// Why.
    pub reason: ConflictReason,
}

impl MembershipConflict {
    pub(crate) fn new(
        scope: ConflictScope,
        subject: ConflictSubject,
        reason: ConflictReason,
    ) -> Self {
        Self {
            scope,
            subject,
            reason,
        }
    }
}

/// All endpoint memberships at one point; cheap to clone (shared, immutable).
#[derive(Debug, Clone, Default)]
pub struct MembershipView {
    pub(crate) endpoints: Arc<BTreeMap<EndpointId, Arc<EndpointMembership>>>,
}

impl MembershipView {
    /// Memberships in endpoint order.
    pub fn endpoints(&self) -> impl ExactSizeIterator<Item = &EndpointMembership> {
        self.endpoints.values().map(Arc::as_ref)
    }

    /// The membership of one endpoint.
    pub fn endpoint(&self, endpoint: &EndpointId) -> Option<&EndpointMembership> {
        self.endpoints.get(endpoint).map(Arc::as_ref)
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    /// Whether no endpoint is present.
    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }
}

impl PartialEq for MembershipView {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.endpoints, &other.endpoints)
            || (self.endpoints.len() == other.endpoints.len()
                && self.endpoints.iter().zip(other.endpoints.iter()).all(
                    |((left_id, left), (right_id, right))| {
                        left_id == right_id && (Arc::ptr_eq(left, right) || left == right)
                    },
                ))
    }
}

impl Eq for MembershipView {}
