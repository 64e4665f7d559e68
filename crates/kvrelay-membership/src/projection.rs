//! [`MembershipProjection`]: cards in, endpoint memberships out, incrementally.
//!
//! Feed it with [`MembershipProjection::handle_event`] or
//! [`MembershipProjection::replace_all`] (each returns whether any card changed), then call
//! [`MembershipProjection::project`], which re-projects only the endpoints whose cards
//! changed, plus the endpoints whose request-facing names changed ambiguity, and returns
//! whether the view changed. Drain soft errors with
//! [`MembershipProjection::poll_diagnostic`].
//!
//! Fail-closed federation: a request-facing name (model or alias) claimed by more than one
//! distinct (model, target) binding anywhere in the watch scope is omitted from every
//! endpoint; a model name so claimed also records a serving-binding conflict.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use kvrelay_identity::{CanonicalModelRegistration, EndpointId, ModelAlias};

use crate::card::ModelDeploymentCard;
use crate::config::EndpointFilter;
use crate::diagnostic::{Diagnostic, ProjectionStats};
use crate::endpoint::{Binding, EndpointProjection, project_endpoint};
use crate::instance::{DiscoveryEvent, ModelCardInstance, ModelCardInstanceId};
use crate::limits::MembershipLimits;
use crate::membership::{
    ConflictReason, ConflictScope, ConflictSubject, EndpointMembership, MembershipConflict,
    MembershipView,
};

/// The incremental projection of model cards into endpoint memberships. Sans-IO.
///
/// ```
/// use kvrelay_membership::{DiscoveryEvent, MembershipProjection, ModelCardInstance,
///     ModelCardInstanceId, EndpointFilter};
/// let mut projection = MembershipProjection::new(EndpointFilter::default());
/// let card = serde_json::json!({"display_name": "llama", "kv_cache_block_size": 16,
///     "worker_type": "aggregated"});
/// let id = ModelCardInstanceId::from_path("prod/backend/generate/1").unwrap();
/// assert!(projection.handle_event(DiscoveryEvent::Added(ModelCardInstance { id, card_json: card })));
/// assert!(projection.project());
/// let view = projection.view();
/// let membership = view.endpoints().next().unwrap();
/// assert!(membership.is_materializable());
/// assert_eq!(membership.generation, 1);
/// ```
#[derive(Debug)]
pub struct MembershipProjection {
    filter: EndpointFilter,
    limits: MembershipLimits,
    cards: HashMap<ModelCardInstanceId, StoredCard>,
    /// Ids whose latest JSON did not decode, with that JSON (to report each cause once).
    malformed: HashMap<ModelCardInstanceId, serde_json::Value>,
    by_endpoint: HashMap<EndpointId, BTreeSet<ModelCardInstanceId>>,
    dirty: BTreeSet<EndpointId>,
    local: HashMap<EndpointId, EndpointProjection>,
    names: HashMap<String, NameClaims>,
    ambiguous: HashSet<String>,
    view: MembershipView,
    next_generation: u64,
    diagnostics: VecDeque<Diagnostic>,
    stats: ProjectionStats,
}

#[derive(Debug)]
struct StoredCard {
    endpoint: EndpointId,
    card: ModelDeploymentCard,
    json: serde_json::Value,
}

/// Who claims one request-facing name: endpoint count per binding, and the endpoints.
#[derive(Debug, Default)]
struct NameClaims {
    bindings: HashMap<Binding, usize>,
    endpoints: HashSet<EndpointId>,
}

impl MembershipProjection {
    /// An empty projection keeping only cards whose endpoint passes `filter`, with the
    /// default limits.
    pub fn new(filter: EndpointFilter) -> Self {
        Self::with_limits(filter, MembershipLimits::default())
    }

    /// An empty projection with explicit limits.
    pub fn with_limits(filter: EndpointFilter, limits: MembershipLimits) -> Self {
        Self {
            filter,
            limits,
            cards: HashMap::new(),
            malformed: HashMap::new(),
            by_endpoint: HashMap::new(),
            dirty: BTreeSet::new(),
            local: HashMap::new(),
            names: HashMap::new(),
            ambiguous: HashSet::new(),
            view: MembershipView::default(),
            next_generation: 1,
            diagnostics: VecDeque::new(),
            stats: ProjectionStats::default(),
        }
    }

    /// Applies one discovery event; returns whether any stored card changed.
    ///
    /// A malformed `Added` card is reported and ignored (the previous card, if any, stays).
    pub fn handle_event(&mut self, event: DiscoveryEvent) -> bool {
        match event {
            DiscoveryEvent::Added(instance) => {
                if !self.in_scope(&instance.id) {
                    return false;
                }
                if self
                    .cards
                    .get(&instance.id)
                    .is_some_and(|stored| stored.json == instance.card_json)
                {
                    return false;
                }
                match self.decode(instance) {
                    (id, Some(stored)) => {
                        self.malformed.remove(&id);
                        self.insert_card(id, stored);
                        true
                    }
                    (_, None) => false,
                }
            }
            DiscoveryEvent::Removed(id) => {
                self.malformed.remove(&id);
                self.remove_card(&id)
            }
            DiscoveryEvent::TaintsUpdated { id, taints } => {
                if !self.in_scope(&id) {
                    return false;
                }
                let Some(stored) = self.cards.get_mut(&id) else {
                    self.report(Diagnostic::UnknownTaintTarget { card: id });
                    return false;
                };
                let taints: BTreeSet<String> = taints.into_iter().collect();
                if stored.card.runtime_config.taints == taints {
                    return false;
                }
                set_json_taints(&mut stored.json, &taints);
                stored.card.runtime_config.taints = taints;
                self.dirty.insert(stored.endpoint.clone());
                true
            }
        }
    }

    /// Replaces every card with a full listing (a reconcile); returns whether any stored
    /// card changed. Malformed cards in the listing are reported and left out.
    pub fn replace_all(&mut self, instances: Vec<ModelCardInstance>) -> bool {
        let mut next: HashMap<ModelCardInstanceId, serde_json::Value> = HashMap::new();
        for instance in instances {
            if self.in_scope(&instance.id) {
                next.insert(instance.id, instance.card_json);
            }
        }
        let stale: Vec<ModelCardInstanceId> = self
            .cards
            .keys()
            .filter(|id| !next.contains_key(*id))
            .cloned()
            .collect();
        let mut changed = false;
        for id in stale {
            changed |= self.remove_card(&id);
        }
        self.malformed.retain(|id, _| next.contains_key(id));
        for (id, card_json) in next {
            if self
                .cards
                .get(&id)
                .is_some_and(|stored| stored.json == card_json)
            {
                continue;
            }
            match self.decode(ModelCardInstance { id, card_json }) {
                (id, Some(stored)) => {
                    self.malformed.remove(&id);
                    self.insert_card(id, stored);
                    changed = true;
                }
                (id, None) => changed |= self.remove_card(&id),
            }
        }
        changed
    }

    /// Re-projects what changed since the last call; returns whether the view changed.
    pub fn project(&mut self) -> bool {
        if self.dirty.is_empty() {
            return false;
        }
        self.stats.projections = self.stats.projections.saturating_add(1);
        let dirty = std::mem::take(&mut self.dirty);
        let mut touched_names = BTreeSet::new();
        for endpoint in &dirty {
            self.stats.endpoint_projections = self.stats.endpoint_projections.saturating_add(1);
            let previous = self.local.remove(endpoint);
            if let Some(previous) = &previous {
                self.unindex_names(endpoint, previous, &mut touched_names);
            }
            let Some(ids) = self.by_endpoint.get(endpoint) else {
                continue;
            };
            let cards = ids
                .iter()
                .filter_map(|id| self.cards.get(id).map(|stored| (id, &stored.card)));
            let next = project_endpoint(endpoint, cards);
            for soft_error in &next.soft_errors {
                let known = previous
                    .as_ref()
                    .is_some_and(|previous| previous.soft_errors.contains(soft_error));
                if !known {
                    self.report(soft_error.clone());
                }
            }
            self.index_names(endpoint, &next, &mut touched_names);
            self.local.insert(endpoint.clone(), next);
        }

        let mut finalize: BTreeSet<EndpointId> = dirty;
        for name in touched_names {
            let now_ambiguous = self
                .names
                .get(&name)
                .is_some_and(|claims| claims.bindings.len() > 1);
            if now_ambiguous == self.ambiguous.contains(&name) {
                continue;
            }
            if let Some(claims) = self.names.get(&name) {
                finalize.extend(claims.endpoints.iter().cloned());
            }
            if now_ambiguous {
                self.ambiguous.insert(name.clone());
                self.report(Diagnostic::AmbiguousName { name });
            } else {
                self.ambiguous.remove(&name);
            }
        }

        let mut endpoints = None;
        for endpoint in finalize {
            let previous = self.view.endpoints.get(&endpoint).cloned();
            let Some(local) = self.local.get(&endpoint) else {
                if previous.is_some() {
                    endpoints
                        .get_or_insert_with(|| (*self.view.endpoints).clone())
                        .remove(&endpoint);
                }
                continue;
            };
            let mut candidate = finalize_membership(&endpoint, local, &self.ambiguous);
            if let Some(previous) = &previous
                && previous.same_content(&candidate)
            {
                continue;
            }
            candidate.generation = self.next_generation;
            self.next_generation = self.next_generation.saturating_add(1);
            endpoints
                .get_or_insert_with(|| (*self.view.endpoints).clone())
                .insert(endpoint, Arc::new(candidate));
        }
        match endpoints {
            Some(endpoints) => {
                self.view = MembershipView {
                    endpoints: Arc::new(endpoints),
                };
                true
            }
            None => false,
        }
    }

    /// The current view (as of the last [`MembershipProjection::project`]); cheap to clone.
    pub fn view(&self) -> MembershipView {
        self.view.clone()
    }

    /// The next undrained soft error, oldest first.
    pub fn poll_diagnostic(&mut self) -> Option<Diagnostic> {
        self.diagnostics.pop_front()
    }

    /// Work and soft-error counters.
    pub fn stats(&self) -> ProjectionStats {
        self.stats
    }

    /// Number of cards held (in scope and decodable).
    pub fn n_cards(&self) -> usize {
        self.cards.len()
    }

    fn in_scope(&self, id: &ModelCardInstanceId) -> bool {
        id.endpoint_id()
            .map_or(true, |endpoint| self.filter.matches(&endpoint))
    }

    fn decode(&mut self, instance: ModelCardInstance) -> (ModelCardInstanceId, Option<StoredCard>) {
        let ModelCardInstance { id, card_json } = instance;
        let endpoint = match id.endpoint_id() {
            Ok(endpoint) => endpoint,
            Err(_) => {
                let diagnostic = Diagnostic::InvalidEndpoint { card: id.clone() };
                self.report_malformed(&id, card_json, diagnostic);
                return (id, None);
            }
        };
        match serde_json::from_value::<ModelDeploymentCard>(card_json.clone()) {
            Ok(mut card) => {
                card.normalize_legacy_prefill();
                let stored = StoredCard {
                    endpoint,
                    card,
                    json: card_json,
                };
                (id, Some(stored))
            }
            Err(error) => {
                let diagnostic = Diagnostic::MalformedCard {
                    card: id.clone(),
                    reason: error.to_string(),
                };
                self.report_malformed(&id, card_json, diagnostic);
                (id, None)
            }
        }
    }

    fn report_malformed(
        &mut self,
        id: &ModelCardInstanceId,
        card_json: serde_json::Value,
        diagnostic: Diagnostic,
    ) {
        if self.malformed.get(id) != Some(&card_json) {
            self.malformed.insert(id.clone(), card_json);
            self.report(diagnostic);
        }
    }

    fn insert_card(&mut self, id: ModelCardInstanceId, stored: StoredCard) {
        self.dirty.insert(stored.endpoint.clone());
        self.by_endpoint
            .entry(stored.endpoint.clone())
            .or_default()
            .insert(id.clone());
        self.cards.insert(id, stored);
    }

    fn remove_card(&mut self, id: &ModelCardInstanceId) -> bool {
        let Some(stored) = self.cards.remove(id) else {
            return false;
        };
        if let Some(ids) = self.by_endpoint.get_mut(&stored.endpoint) {
            ids.remove(id);
            if ids.is_empty() {
                self.by_endpoint.remove(&stored.endpoint);
            }
        }
        self.dirty.insert(stored.endpoint);
        true
    }

    fn index_names(
        &mut self,
        endpoint: &EndpointId,
        local: &EndpointProjection,
        touched: &mut BTreeSet<String>,
    ) {
        for (name, bindings) in local.claimed_names() {
            let claims = self.names.entry(name.to_owned()).or_default();
            claims.endpoints.insert(endpoint.clone());
            for binding in bindings {
                *claims.bindings.entry(binding.clone()).or_default() += 1;
            }
            touched.insert(name.to_owned());
        }
    }

    fn unindex_names(
        &mut self,
        endpoint: &EndpointId,
        local: &EndpointProjection,
        touched: &mut BTreeSet<String>,
    ) {
        for (name, bindings) in local.claimed_names() {
            let Some(claims) = self.names.get_mut(name) else {
                continue;
            };
            claims.endpoints.remove(endpoint);
            for binding in bindings {
                if let Some(count) = claims.bindings.get_mut(binding) {
                    *count = count.saturating_sub(1);
                    if *count == 0 {
                        claims.bindings.remove(binding);
                    }
                }
            }
            if claims.endpoints.is_empty() {
                self.names.remove(name);
            }
            touched.insert(name.to_owned());
        }
    }

    fn report(&mut self, diagnostic: Diagnostic) {
        tracing::debug!(%diagnostic, "membership soft error");
        self.stats.count(&diagnostic);
        if self.diagnostics.len() >= self.limits.max_pending_diagnostics.max(1) {
            self.diagnostics.pop_front();
            self.stats.diagnostics_dropped = self.stats.diagnostics_dropped.saturating_add(1);
        }
        self.diagnostics.push_back(diagnostic);
    }
}

/// Builds the membership from an endpoint's local projection and the ambiguous names.
/// The generation is left 0 for the caller to assign.
fn finalize_membership(
    endpoint: &EndpointId,
    local: &EndpointProjection,
    ambiguous: &HashSet<String>,
) -> EndpointMembership {
    let mut conflicts = local.conflicts.clone();
    let mut grouped: BTreeMap<&Binding, BTreeSet<&ModelAlias>> = BTreeMap::new();
    for claim in &local.claims {
        if ambiguous.contains(claim.binding.model.as_str()) {
            conflicts.push(MembershipConflict::new(
                ConflictScope::ServingBinding,
                ConflictSubject::Binding(claim.binding.model.clone()),
                ConflictReason::AmbiguousName,
            ));
            continue;
        }
        grouped.entry(&claim.binding).or_default().extend(
            claim
                .aliases
                .iter()
                .filter(|alias| !ambiguous.contains(alias.as_str())),
        );
    }
    let registrations: Vec<CanonicalModelRegistration> = grouped
        .into_iter()
        .map(|(binding, aliases)| {
            CanonicalModelRegistration::new(
                binding.model.clone(),
                binding.target.clone(),
                aliases.into_iter().cloned().collect(),
            )
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let mut adapters = local.adapters.clone();
    adapters.retain(|served, adapter| {
        registrations.iter().any(|registration| {
            registration.model() == served
                && registration.target().adapter() == Some(&adapter.adapter)
                && registration.target().base_model() == &adapter.base_model
        })
    });
    let models = registrations
        .iter()
        .map(|registration| registration.model().clone())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let aliases = registrations
        .iter()
        .flat_map(|registration| registration.aliases().iter().cloned())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let roles = local
        .worker_topology
        .values()
        .map(|topology| topology.role())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    conflicts.sort();
    conflicts.dedup();
    EndpointMembership {
        endpoint: endpoint.clone(),
        generation: 0,
        domain: local.domain,
        registrations,
        models,
        aliases,
        roles,
        runtime_configs: local.runtime_configs.clone(),
        worker_topology: local.worker_topology.clone(),
        adapters,
        conflicts,
    }
}

/// Writes `taints` into the stored card JSON's `runtime_config`, creating it if absent.
fn set_json_taints(json: &mut serde_json::Value, taints: &BTreeSet<String>) {
    let taints = serde_json::Value::Array(
        taints
            .iter()
            .cloned()
            .map(serde_json::Value::String)
            .collect(),
    );
    if let Some(object) = json.as_object_mut() {
        let runtime_config = object
            .entry("runtime_config")
            .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
        if let Some(runtime_config) = runtime_config.as_object_mut() {
            runtime_config.insert("taints".to_owned(), taints);
        }
    }
}

#[cfg(test)]
mod tests;
