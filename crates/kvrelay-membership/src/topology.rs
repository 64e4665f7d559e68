//! Serving topology: per `(namespace, base model)`, can the DC serve a request, and with
//! which endpoints and pools. Sans-IO: [`TopologyState`] is fed memberships, liveness and
//! pool links, and bumps its revision only when the derived entries change.
//!
//! States: `Unknown` while any member endpoint has no authoritative live set; `Ready` when
//! the readiness evaluator says so and (unless in legacy fallback) no prefill or decode role
//! is served by more than one live endpoint; `Unavailable` otherwise. Endpoints with a
//! serving-topology conflict are left out (their workers cannot be assigned to a model);
//! pool-materialization and binding conflicts do not remove an endpoint.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use kvrelay_identity::{CanonicalModelId, EndpointId, ModelTarget, PoolId, WorkerRole};

use crate::card::WorkerType;
use crate::membership::{EndpointMembership, MembershipView, WorkerId, WorkerTopology};
use crate::readiness::{ReadinessUnit, evaluate_readiness};

/// Whether a topology entry (or adapter) can serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ServingState {
    /// Some member endpoint has no authoritative live set yet.
    Unknown,
    /// Live workers cover every declared and needed role.
    Ready,
    /// Authoritatively not ready.
    Unavailable,
}

/// One member endpoint of a topology entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyMember {
    /// The endpoint.
    pub endpoint: EndpointId,
    /// Its workers' roles, sorted.
    pub roles: Vec<WorkerRole>,
    /// The pool serving it, when exactly one catalog pool claims it.
    pub pool_id: Option<PoolId>,
}

/// Readiness of one adapter served on a topology entry's base model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdapterReadiness {
    /// The served (request-facing) adapter name.
    pub adapter: CanonicalModelId,
    /// Its state.
    pub state: ServingState,
    /// Roles without a live worker carrying the adapter, plus the base entry's missing
    /// roles; sorted.
    pub missing_roles: Vec<WorkerRole>,
}

/// Readiness of one `(namespace, base model)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologyEntry {
    /// The namespace.
    pub namespace: String,
    /// The canonical base model.
    pub model: CanonicalModelId,
    /// Its state.
    pub state: ServingState,
    /// Roles with a live worker, sorted (empty when `Unknown`).
    pub present_roles: Vec<WorkerRole>,
    /// Roles missing a live worker, sorted (empty when `Unknown`).
    pub missing_roles: Vec<WorkerRole>,
    /// A legacy worker switched evaluation to "ready iff anything is live".
    pub legacy_fallback: bool,
    /// Prefill/decode roles served by more than one live endpoint, sorted; they block
    /// `Ready` outside legacy fallback.
    pub duplicate_role_endpoints: Vec<WorkerRole>,
    /// Member endpoints, sorted by endpoint.
    pub members: Vec<TopologyMember>,
    /// Adapters on this base model, sorted by name.
    pub adapters: Vec<AdapterReadiness>,
}

/// A revisioned set of entries, sorted by `(namespace, model)`. Cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopologySnapshot {
    /// Starts at 1, +1 (saturating) whenever the entries change.
    pub revision: u64,
    /// The entries.
    pub entries: Arc<Vec<TopologyEntry>>,
}

/// The topology publisher's state: membership, liveness per endpoint (fenced by an owning
/// slot), and pool links.
///
/// ```
/// use std::collections::BTreeSet;
/// use kvrelay_membership::{DiscoveryEvent, EndpointFilter, MembershipProjection,
///     ModelCardInstance, ModelCardInstanceId, ServingState, TopologyState};
///
/// let mut projection = MembershipProjection::new(EndpointFilter::default());
/// let id = ModelCardInstanceId::from_path("prod/backend/generate/1").unwrap();
/// let card_json = serde_json::json!({"display_name": "llama", "kv_cache_block_size": 16,
///     "worker_type": "aggregated"});
/// projection.handle_event(DiscoveryEvent::Added(ModelCardInstance { id, card_json }));
/// projection.project();
///
/// let mut topology = TopologyState::new(projection.view());
/// let endpoint = "prod/backend/generate".parse().unwrap();
/// topology.claim_availability(&endpoint, 1);
/// topology.replace_availability(&endpoint, 1, Some(BTreeSet::from([1])));
/// assert_eq!(topology.snapshot().entries[0].state, ServingState::Ready);
/// ```
#[derive(Debug)]
pub struct TopologyState {
    membership: MembershipView,
    availability: BTreeMap<EndpointId, Option<BTreeSet<WorkerId>>>,
    owners: BTreeMap<EndpointId, u64>,
    pool_links: BTreeMap<EndpointId, Option<PoolId>>,
    snapshot: TopologySnapshot,
}

impl TopologyState {
    /// Derives entries for `membership` with no liveness known (so `Unknown`), revision 1.
    pub fn new(membership: MembershipView) -> Self {
        let mut state = Self {
            membership,
            availability: BTreeMap::new(),
            owners: BTreeMap::new(),
            pool_links: BTreeMap::new(),
            snapshot: TopologySnapshot {
                revision: 1,
                entries: Arc::new(Vec::new()),
            },
        };
        state.snapshot.entries = Arc::new(state.derive());
        state
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> TopologySnapshot {
        self.snapshot.clone()
    }

    /// Replaces the membership; liveness and owners of endpoints no longer present are
    /// dropped. Returns whether the snapshot changed.
    pub fn replace_membership(&mut self, membership: MembershipView) -> bool {
        if membership == self.membership {
            return false;
        }
        self.availability
            .retain(|endpoint, _| membership.endpoint(endpoint).is_some());
        self.owners
            .retain(|endpoint, _| membership.endpoint(endpoint).is_some());
        self.membership = membership;
        self.publish_if_changed()
    }

    /// Makes `slot` the only writer of `endpoint`'s liveness (a new slot discards the old
    /// slot's liveness). Ignored for endpoints not in the membership. Returns whether the
    /// snapshot changed.
    pub fn claim_availability(&mut self, endpoint: &EndpointId, slot: u64) -> bool {
        if self.membership.endpoint(endpoint).is_none() || self.owners.get(endpoint) == Some(&slot)
        {
            return false;
        }
        self.owners.insert(endpoint.clone(), slot);
        self.availability.remove(endpoint);
        self.publish_if_changed()
    }

    /// Records `endpoint`'s live workers as seen by `slot`: `None` = not authoritative yet,
    /// `Some(empty)` = authoritatively nobody. Ignored unless `slot` owns the endpoint.
    /// Returns whether the snapshot changed.
    pub fn replace_availability(
        &mut self,
        endpoint: &EndpointId,
        slot: u64,
        live: Option<BTreeSet<WorkerId>>,
    ) -> bool {
        if self.owners.get(endpoint) != Some(&slot) {
            return false;
        }
        if self.availability.get(endpoint) == Some(&live) {
            return false;
        }
        self.availability.insert(endpoint.clone(), live);
        self.publish_if_changed()
    }

    /// Replaces the endpoint → pool links from the catalog's `(serving endpoint, pool)`
    /// pairs; an endpoint claimed by two pools gets no link (fail closed). Returns whether
    /// the snapshot changed.
    pub fn replace_pool_links(
        &mut self,
        links: impl IntoIterator<Item = (EndpointId, PoolId)>,
    ) -> bool {
        let mut next: BTreeMap<EndpointId, Option<PoolId>> = BTreeMap::new();
        for (endpoint, pool_id) in links {
            next.entry(endpoint)
                .and_modify(|link| {
                    if *link != Some(pool_id) {
                        *link = None;
                    }
                })
                .or_insert(Some(pool_id));
        }
        if next == self.pool_links {
            return false;
        }
        self.pool_links = next;
        self.publish_if_changed()
    }

    fn publish_if_changed(&mut self) -> bool {
        let entries = self.derive();
        if *self.snapshot.entries == entries {
            return false;
        }
        self.snapshot = TopologySnapshot {
            revision: self.snapshot.revision.saturating_add(1),
            entries: Arc::new(entries),
        };
        true
    }

    fn derive(&self) -> Vec<TopologyEntry> {
        let mut keys: BTreeMap<(String, CanonicalModelId), Vec<&EndpointMembership>> =
            BTreeMap::new();
        for membership in self.membership.endpoints() {
            if membership.has_serving_topology_conflict() {
                continue;
            }
            for registration in &membership.registrations {
                if let ModelTarget::Base { base_model } = registration.target() {
                    keys.entry((membership.namespace().to_owned(), base_model.clone()))
                        .or_default()
                        .push(membership);
                }
            }
        }
        keys.into_iter()
            .map(|((namespace, model), members)| self.entry(namespace, model, &members))
            .collect()
    }

    fn entry(
        &self,
        namespace: String,
        model: CanonicalModelId,
        members: &[&EndpointMembership],
    ) -> TopologyEntry {
        let topology_members = members
            .iter()
            .map(|membership| TopologyMember {
                endpoint: membership.endpoint.clone(),
                roles: membership.roles.clone(),
                pool_id: self.pool_links.get(&membership.endpoint).copied().flatten(),
            })
            .collect();
        let adapter_names: BTreeSet<&CanonicalModelId> = members
            .iter()
            .flat_map(|membership| membership.adapters.iter())
            .filter(|(_, adapter)| adapter.base_model == model)
            .map(|(served, _)| served)
            .collect();
        let live_sets: Option<Vec<&BTreeSet<WorkerId>>> = members
            .iter()
            .map(|membership| self.availability.get(&membership.endpoint)?.as_ref())
            .collect();
        let Some(live_sets) = live_sets else {
            return TopologyEntry {
                namespace,
                model,
                state: ServingState::Unknown,
                present_roles: Vec::new(),
                missing_roles: Vec::new(),
                legacy_fallback: false,
                duplicate_role_endpoints: Vec::new(),
                members: topology_members,
                adapters: adapter_names
                    .into_iter()
                    .map(|adapter| AdapterReadiness {
                        adapter: adapter.clone(),
                        state: ServingState::Unknown,
                        missing_roles: Vec::new(),
                    })
                    .collect(),
            };
        };

        let mut units: BTreeMap<&WorkerTopology, usize> = BTreeMap::new();
        let mut endpoints_per_type: BTreeMap<WorkerType, usize> = BTreeMap::new();
        for (membership, live) in members.iter().zip(&live_sets) {
            let mut live_types = BTreeSet::new();
            for (worker_id, topology) in &membership.worker_topology {
                let is_live = live.contains(worker_id);
                let n_live = units.entry(topology).or_default();
                if is_live {
                    *n_live += 1;
                    live_types.extend(topology.worker_type);
                }
            }
            for worker_type in live_types {
                *endpoints_per_type.entry(worker_type).or_default() += 1;
            }
        }
        let units: Vec<ReadinessUnit> = units
            .into_iter()
            .map(|(topology, n_live)| ReadinessUnit {
                worker_type: topology.worker_type,
                n_live,
                needs: topology.needs.clone(),
            })
            .collect();
        let readiness = evaluate_readiness(&units);
        let duplicate_role_endpoints: Vec<WorkerRole> = endpoints_per_type
            .into_iter()
            .filter(|(worker_type, n_endpoints)| {
                *worker_type != WorkerType::Aggregated && *n_endpoints > 1
            })
            .map(|(worker_type, _)| crate::membership::role_of(Some(worker_type)))
            .collect();
        let ready =
            readiness.ready && (readiness.legacy_fallback || duplicate_role_endpoints.is_empty());
        let state = if ready {
            ServingState::Ready
        } else {
            ServingState::Unavailable
        };

        let required: BTreeSet<WorkerRole> = members
            .iter()
            .flat_map(|membership| membership.roles.iter().copied())
            .filter(|role| {
                matches!(
                    role,
                    WorkerRole::Prefill | WorkerRole::Decode | WorkerRole::Aggregated
                )
            })
            .collect();
        let adapters = adapter_names
            .into_iter()
            .map(|served| {
                let mut live_roles = BTreeSet::new();
                for (membership, live) in members.iter().zip(&live_sets) {
                    let Some(adapter) = membership.adapters.get(served) else {
                        continue;
                    };
                    for worker_id in adapter.workers.keys() {
                        if !live.contains(worker_id) {
                            continue;
                        }
                        if let Some(topology) = membership.worker_topology.get(worker_id) {
                            live_roles.insert(topology.role());
                        }
                    }
                }
                live_roles.remove(&WorkerRole::Encode);
                let carried = !live_roles.is_empty();
                let missing: BTreeSet<WorkerRole> = required
                    .difference(&live_roles)
                    .copied()
                    .chain(readiness.missing.iter().copied())
                    .collect();
                let adapter_state = match state {
                    ServingState::Unavailable | ServingState::Unknown => state,
                    ServingState::Ready if readiness.legacy_fallback || missing.is_empty() => {
                        if carried {
                            ServingState::Ready
                        } else {
                            ServingState::Unavailable
                        }
                    }
                    ServingState::Ready => ServingState::Unavailable,
                };
                AdapterReadiness {
                    adapter: served.clone(),
                    state: adapter_state,
                    missing_roles: missing.into_iter().collect(),
                }
            })
            .collect();

        TopologyEntry {
            namespace,
            model,
            state,
            present_roles: readiness.present,
            missing_roles: readiness.missing,
            legacy_fallback: readiness.legacy_fallback,
            duplicate_role_endpoints,
            members: topology_members,
            adapters,
        }
    }
}

#[cfg(test)]
mod tests;
