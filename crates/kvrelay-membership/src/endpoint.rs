//! The projection of one endpoint's cards, before the watch-scope-wide name check.
//!
//! A pure function of the endpoint's cards: [`project_endpoint`]. The result carries the
//! claims (request-facing names with their targets) that the federation step in
//! [`crate::projection`] checks for ambiguity across endpoints.

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_identity::{
    CanonicalModelId, EndpointId, IndexerIdentitySpec, KvQueryHashFormat, KvQuerySemantics,
    ModelAlias, ModelTarget, resolve_indexer_domain,
};

use crate::card::{ModelDeploymentCard, RuntimeConfig};
use crate::diagnostic::Diagnostic;
use crate::instance::ModelCardInstanceId;
use crate::membership::{
    AdapterMembership, ConflictReason, ConflictScope, ConflictSubject, MembershipConflict,
    ResolvedDomain, WorkerId, WorkerTopology,
};

/// A request-facing name's target: what must be unique per name across the watch scope.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Binding {
    pub(crate) model: CanonicalModelId,
    pub(crate) target: ModelTarget,
}

/// One card's claim of a binding and its aliases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Claim {
    pub(crate) binding: Binding,
    pub(crate) aliases: Vec<ModelAlias>,
}

/// Everything about one endpoint that depends only on its own cards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EndpointProjection {
    pub(crate) domain: Option<ResolvedDomain>,
    pub(crate) claims: Vec<Claim>,
    pub(crate) runtime_configs: BTreeMap<WorkerId, RuntimeConfig>,
    pub(crate) worker_topology: BTreeMap<WorkerId, WorkerTopology>,
    pub(crate) adapters: BTreeMap<CanonicalModelId, AdapterMembership>,
    pub(crate) conflicts: Vec<MembershipConflict>,
    /// Soft errors (logged once while they persist, never conflicts).
    pub(crate) soft_errors: BTreeSet<Diagnostic>,
}

impl EndpointProjection {
    /// Every request-facing name this endpoint claims, with the bindings claiming it.
    pub(crate) fn claimed_names(&self) -> BTreeMap<&str, BTreeSet<&Binding>> {
        let mut names: BTreeMap<&str, BTreeSet<&Binding>> = BTreeMap::new();
        for claim in &self.claims {
            names
                .entry(claim.binding.model.as_str())
                .or_default()
                .insert(&claim.binding);
            for alias in &claim.aliases {
                names
                    .entry(alias.as_str())
                    .or_default()
                    .insert(&claim.binding);
            }
        }
        names
    }
}

struct BaseCard<'a> {
    id: &'a ModelCardInstanceId,
    card: &'a ModelDeploymentCard,
    domain: Option<ResolvedDomain>,
    model: Option<CanonicalModelId>,
    aliases: Vec<ModelAlias>,
}

/// Projects one endpoint's cards (all already inside the scope filter).
pub(crate) fn project_endpoint<'a>(
    endpoint: &EndpointId,
    cards: impl Iterator<Item = (&'a ModelCardInstanceId, &'a ModelDeploymentCard)>,
) -> EndpointProjection {
    let mut conflicts = Vec::new();
    let mut soft_errors = BTreeSet::new();
    let mut base_cards = Vec::new();
    let mut adapter_cards = Vec::new();
    for (id, card) in cards {
        match (id.model_suffix.is_some(), card.lora.is_some()) {
            (true, true) => {
                adapter_cards.push((id, card));
                continue;
            }
            (false, false) => {}
            _ => {
                soft_errors.insert(Diagnostic::InvalidModel {
                    card: id.clone(),
                    name: card.display_name.clone(),
                });
                conflicts.push(MembershipConflict::new(
                    ConflictScope::ServingBinding,
                    ConflictSubject::Card(id.clone()),
                    ConflictReason::LoraShapeMismatch,
                ));
                continue;
            }
        }
        let domain = resolve_domain(card, endpoint);
        if domain.is_none() {
            soft_errors.insert(Diagnostic::InvalidQuerySemantics {
                card: id.clone(),
                kv_block_size: card.kv_cache_block_size,
            });
            conflicts.push(MembershipConflict::new(
                ConflictScope::PoolMaterialization,
                ConflictSubject::Card(id.clone()),
                ConflictReason::ZeroBlockSize,
            ));
        }
        let model = CanonicalModelId::new(&card.display_name).ok();
        if model.is_none() {
            soft_errors.insert(Diagnostic::InvalidModel {
                card: id.clone(),
                name: card.display_name.clone(),
            });
        }
        let aliases = model
            .as_ref()
            .map(|model| valid_aliases(id, card, model, &mut soft_errors))
            .unwrap_or_default();
        base_cards.push(BaseCard {
            id,
            card,
            domain,
            model,
            aliases,
        });
    }

    let distinct_domains: BTreeSet<ResolvedDomain> =
        base_cards.iter().filter_map(|base| base.domain).collect();
    let all_resolved = base_cards.iter().all(|base| base.domain.is_some());
    let domain = match (all_resolved, distinct_domains.len()) {
        (true, 1) => distinct_domains.first().copied(),
        _ => None,
    };
    if distinct_domains.len() > 1 {
        conflicts.push(MembershipConflict::new(
            ConflictScope::PoolMaterialization,
            ConflictSubject::Endpoint(endpoint.clone()),
            ConflictReason::MultipleIndexerDomains,
        ));
    }
    let distinct_models: BTreeSet<&CanonicalModelId> = base_cards
        .iter()
        .filter_map(|base| base.model.as_ref())
        .collect();
    if distinct_models.len() > 1 {
        conflicts.push(MembershipConflict::new(
            ConflictScope::ServingTopology,
            ConflictSubject::Endpoint(endpoint.clone()),
            ConflictReason::MultipleBaseModels,
        ));
    }

    let mut per_worker: BTreeMap<WorkerId, Vec<&BaseCard<'_>>> = BTreeMap::new();
    for base in &base_cards {
        per_worker
            .entry(base.id.instance_id)
            .or_default()
            .push(base);
    }
    let mut claims = Vec::new();
    let mut runtime_configs = BTreeMap::new();
    let mut worker_topology = BTreeMap::new();
    let mut base_of_worker: BTreeMap<WorkerId, &BaseCard<'_>> = BTreeMap::new();
    for (worker_id, bases) in per_worker {
        let [base] = bases.as_slice() else {
            conflicts.push(MembershipConflict::new(
                ConflictScope::ServingTopology,
                ConflictSubject::Worker(worker_id),
                ConflictReason::MultipleBaseCards,
            ));
            continue;
        };
        base_of_worker.insert(worker_id, base);
        let Some(model) = base.model.clone() else {
            conflicts.push(MembershipConflict::new(
                ConflictScope::ServingBinding,
                ConflictSubject::Card(base.id.clone()),
                ConflictReason::InvalidBaseModel,
            ));
            continue;
        };
        runtime_configs.insert(worker_id, base.card.runtime_config.clone());
        worker_topology.insert(
            worker_id,
            WorkerTopology {
                worker_type: base.card.worker_type,
                model_type: base.card.model_type.clone(),
                needs: base.card.needs.clone(),
            },
        );
        claims.push(Claim {
            binding: Binding {
                target: ModelTarget::Base {
                    base_model: model.clone(),
                },
                model,
            },
            aliases: base.aliases.clone(),
        });
    }

    let mut adapters: BTreeMap<CanonicalModelId, AdapterMembership> = BTreeMap::new();
    for (id, card) in adapter_cards {
        let worker_id = id.instance_id;
        let Some(base) = base_of_worker.get(&worker_id) else {
            soft_errors.insert(Diagnostic::OrphanAdapter { card: id.clone() });
            continue;
        };
        let card_conflict = |reason| {
            MembershipConflict::new(
                ConflictScope::ServingBinding,
                ConflictSubject::Card(id.clone()),
                reason,
            )
        };
        let Some(base_model) = base.model.clone() else {
            conflicts.push(card_conflict(ConflictReason::InvalidAdapterBase));
            continue;
        };
        let Some(lora) = card.lora.as_ref() else {
            // Classification put only cards with LoRA metadata here.
            continue;
        };
        let Ok(served) = CanonicalModelId::new(&card.display_name) else {
            soft_errors.insert(Diagnostic::InvalidModel {
                card: id.clone(),
                name: card.display_name.clone(),
            });
            conflicts.push(card_conflict(ConflictReason::InvalidServedAdapter));
            continue;
        };
        let Ok(runtime_adapter) = CanonicalModelId::new(&lora.name) else {
            soft_errors.insert(Diagnostic::InvalidModel {
                card: id.clone(),
                name: lora.name.clone(),
            });
            conflicts.push(card_conflict(ConflictReason::InvalidRuntimeAdapter));
            continue;
        };
        let aliases = valid_aliases(id, card, &served, &mut soft_errors);
        claims.push(Claim {
            binding: Binding {
                model: served.clone(),
                target: ModelTarget::Lora {
                    base_model: base_model.clone(),
                    adapter: runtime_adapter.clone(),
                },
            },
            aliases,
        });
        let capacity = lora.max_gpu_lora_count;
        match adapters.get_mut(&served) {
            None => {
                adapters.insert(
                    served,
                    AdapterMembership {
                        base_model,
                        adapter: runtime_adapter,
                        workers: BTreeMap::from([(worker_id, capacity)]),
                    },
                );
            }
            Some(existing) => {
                if existing.base_model != base_model || existing.adapter != runtime_adapter {
                    conflicts.push(card_conflict(ConflictReason::ConflictingAdapterTargets));
                    continue;
                }
                if existing
                    .workers
                    .insert(worker_id, capacity)
                    .is_some_and(|previous| previous != capacity)
                {
                    existing.workers.remove(&worker_id);
                    conflicts.push(MembershipConflict::new(
                        ConflictScope::PoolMaterialization,
                        ConflictSubject::Worker(worker_id),
                        ConflictReason::ConflictingAdapterCapacity,
                    ));
                }
            }
        }
    }

    EndpointProjection {
        domain,
        claims,
        runtime_configs,
        worker_topology,
        adapters,
        conflicts,
        soft_errors,
    }
}

/// The card's domain, or `None` when its query semantics are invalid (block size 0).
fn resolve_domain(card: &ModelDeploymentCard, endpoint: &EndpointId) -> Option<ResolvedDomain> {
    let format = KvQueryHashFormat::from_enable_eagle(card.runtime_config.enable_eagle);
    let query_semantics = KvQuerySemantics::new(card.kv_cache_block_size, format).ok()?;
    let default_spec = IndexerIdentitySpec::default();
    let spec = card.indexer_identity.as_ref().unwrap_or(&default_spec);
    let id = resolve_indexer_domain(card.source_path(), spec, query_semantics, endpoint);
    Some(ResolvedDomain {
        id,
        query_semantics,
    })
}

/// The card's valid aliases other than the model name, sorted and unique; invalid ones
/// become soft errors.
fn valid_aliases(
    id: &ModelCardInstanceId,
    card: &ModelDeploymentCard,
    model: &CanonicalModelId,
    soft_errors: &mut BTreeSet<Diagnostic>,
) -> Vec<ModelAlias> {
    let mut aliases = BTreeSet::new();
    for alias in &card.aliases {
        match ModelAlias::new(alias) {
            Ok(alias) if alias.as_str() != model.as_str() => {
                aliases.insert(alias);
            }
            Ok(_) => {}
            Err(_) => {
                soft_errors.insert(Diagnostic::InvalidAlias {
                    card: id.clone(),
                    alias: alias.clone(),
                });
            }
        }
    }
    aliases.into_iter().collect()
}
