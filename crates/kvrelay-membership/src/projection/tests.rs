//! Behaviour of the membership projection, ported from the reference discovery tests plus
//! the incremental and federation rules.

use std::collections::BTreeSet;

use kvrelay_identity::{CanonicalModelId, EndpointId, ModelTarget, WorkerRole};
use proptest::prelude::*;

use super::*;
use crate::card::{LoraInfo, ModelType, WorkerType};

fn card(name: &str, source: &str, block_size: u32) -> ModelDeploymentCard {
    let mut card = ModelDeploymentCard::with_name(name);
    card.source_path = Some(source.to_owned());
    card.kv_cache_block_size = block_size;
    card.worker_type = Some(WorkerType::Aggregated);
    card
}

fn adapter_card(served: &str, runtime: &str, capacity: Option<u32>) -> ModelDeploymentCard {
    let mut adapter = card(served, "meta/llama", 64);
    adapter.lora = Some(LoraInfo {
        name: runtime.to_owned(),
        max_gpu_lora_count: capacity,
    });
    adapter
}

fn id(endpoint: &str, instance_id: u64, suffix: Option<&str>) -> ModelCardInstanceId {
    ModelCardInstanceId {
        namespace: "prod".into(),
        component: "backend".into(),
        endpoint: endpoint.into(),
        instance_id,
        model_suffix: suffix.map(str::to_owned),
    }
}

fn instance(
    endpoint: &str,
    instance_id: u64,
    suffix: Option<&str>,
    card: &ModelDeploymentCard,
) -> ModelCardInstance {
    ModelCardInstance {
        id: id(endpoint, instance_id, suffix),
        card_json: serde_json::to_value(card).unwrap(),
    }
}

fn added(
    endpoint: &str,
    instance_id: u64,
    suffix: Option<&str>,
    card: &ModelDeploymentCard,
) -> DiscoveryEvent {
    DiscoveryEvent::Added(instance(endpoint, instance_id, suffix, card))
}

fn endpoint(name: &str) -> EndpointId {
    EndpointId::new("prod", "backend", name).unwrap()
}

fn model(name: &str) -> CanonicalModelId {
    CanonicalModelId::new(name).unwrap()
}

fn projected(instances: Vec<ModelCardInstance>) -> MembershipProjection {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.replace_all(instances);
    projection.project();
    projection
}

fn membership<'a>(view: &'a MembershipView, name: &str) -> &'a EndpointMembership {
    view.endpoint(&endpoint(name)).unwrap()
}

fn model_names(membership: &EndpointMembership) -> Vec<&str> {
    membership
        .models
        .iter()
        .map(CanonicalModelId::as_str)
        .collect()
}

fn has_conflict(
    membership: &EndpointMembership,
    scope: ConflictScope,
    subject: &ConflictSubject,
    reason: ConflictReason,
) -> bool {
    membership.conflicts.contains(&MembershipConflict {
        scope,
        subject: subject.clone(),
        reason,
    })
}

// spec: unchanged_membership_does_not_advance_the_watch_version
#[test]
fn unchanged_cards_neither_reproject_nor_change_the_view() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    let llama = card("llama", "meta/llama", 64);
    assert!(projection.handle_event(added("generate", 1, None, &llama)));
    assert!(projection.project());
    let initial = projection.view();
    let work = projection.stats().endpoint_projections;

    assert!(!projection.handle_event(added("generate", 1, None, &llama)));
    assert!(!projection.project());
    assert!(!projection.replace_all(vec![instance("generate", 1, None, &llama)]));
    assert!(!projection.project());
    assert!(!projection.handle_event(DiscoveryEvent::Removed(id("generate", 999, None))));
    assert!(!projection.project());
    assert_eq!(projection.stats().endpoint_projections, work);
    assert_eq!(projection.view(), initial);

    assert!(projection.handle_event(added("generate", 2, None, &llama)));
    assert!(projection.project());
    assert_eq!(projection.stats().endpoint_projections, work + 1);
    assert_ne!(projection.view(), initial);
}

// spec: reappearing_endpoint_advances_its_generation
#[test]
fn reappearing_endpoint_advances_its_generation() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    let llama = card("llama", "meta/llama", 64);
    projection.handle_event(added("generate", 1, None, &llama));
    projection.project();
    assert_eq!(membership(&projection.view(), "generate").generation, 1);

    projection.handle_event(DiscoveryEvent::Removed(id("generate", 1, None)));
    assert!(projection.project());
    assert!(projection.view().is_empty());

    projection.handle_event(added("generate", 1, None, &llama));
    projection.project();
    assert_eq!(membership(&projection.view(), "generate").generation, 2);
}

#[test]
fn unchanged_endpoint_keeps_its_generation_when_another_changes() {
    let mut projection = projected(vec![
        instance("a", 1, None, &card("llama", "meta/llama", 64)),
        instance("b", 2, None, &card("llama", "meta/llama", 64)),
    ]);
    let before = membership(&projection.view(), "a").generation;
    projection.handle_event(added("b", 3, None, &card("llama", "meta/llama", 64)));
    projection.project();
    let view = projection.view();
    assert_eq!(membership(&view, "a").generation, before);
    assert!(membership(&view, "b").generation > before);
}

// spec: zero_block_size_is_not_materialized
#[test]
fn zero_block_size_fences_the_pool_but_keeps_the_binding() {
    let projection = projected(vec![instance(
        "generate",
        1,
        None,
        &card("llama", "meta/llama", 0),
    )]);
    let view = projection.view();
    let membership = membership(&view, "generate");
    assert!(!membership.is_materializable());
    assert!(membership.domain.is_none());
    assert!(has_conflict(
        membership,
        ConflictScope::PoolMaterialization,
        &ConflictSubject::Card(id("generate", 1, None)),
        ConflictReason::ZeroBlockSize
    ));
    assert_eq!(model_names(membership), ["llama"]);
    assert_eq!(membership.registrations.len(), 1);
    assert!(membership.worker_topology.contains_key(&1));
}

// spec: encode_role_is_preserved_for_surface_less_and_front_door_cards
#[test]
fn encode_role_is_kept_with_or_without_a_request_surface() {
    let mut surface_less = card("vision-language", "vision-language", 16);
    surface_less.worker_type = Some(WorkerType::Encode);
    surface_less.model_type = ModelType::default();
    let mut front_door = surface_less.clone();
    front_door.model_type = ModelType::parse("Chat");
    let projection = projected(vec![
        instance("encoder-internal", 1, None, &surface_less),
        instance("encoder-frontdoor", 2, None, &front_door),
    ]);
    let view = projection.view();
    for name in ["encoder-internal", "encoder-frontdoor"] {
        let membership = membership(&view, name);
        assert_eq!(membership.roles, [WorkerRole::Encode]);
        let topology = membership.worker_topology.values().next().unwrap();
        assert_eq!(topology.worker_type, Some(WorkerType::Encode));
    }
}

// spec: standard_and_eagle_workers_under_one_endpoint_are_fenced_together
#[test]
fn standard_and_eagle_workers_on_one_endpoint_fence_the_pool() {
    let standard = card("llama", "meta/llama", 64);
    let mut eagle = standard.clone();
    eagle.runtime_config.enable_eagle = true;
    let projection = projected(vec![
        instance("generate", 1, None, &standard),
        instance("generate", 2, None, &eagle),
    ]);
    let view = projection.view();
    assert_eq!(view.len(), 1);
    let membership = membership(&view, "generate");
    assert!(membership.domain.is_none());
    assert!(!membership.is_materializable());
    assert!(has_conflict(
        membership,
        ConflictScope::PoolMaterialization,
        &ConflictSubject::Endpoint(endpoint("generate")),
        ConflictReason::MultipleIndexerDomains
    ));
}

// spec: prefill_and_decode_on_distinct_endpoints_materialize_independently
#[test]
fn prefill_and_decode_endpoints_materialize_with_distinct_domains() {
    let mut prefill = card("llama", "meta/llama", 64);
    prefill.worker_type = Some(WorkerType::Prefill);
    let mut decode = prefill.clone();
    decode.worker_type = Some(WorkerType::Decode);
    let projection = projected(vec![
        instance("prefill", 1, None, &prefill),
        instance("generate", 2, None, &decode),
    ]);
    let view = projection.view();
    assert_eq!(view.len(), 2);
    let prefill = membership(&view, "prefill");
    let decode = membership(&view, "generate");
    assert!(prefill.is_materializable());
    assert!(decode.is_materializable());
    assert_eq!(prefill.roles, [WorkerRole::Prefill]);
    assert_eq!(decode.roles, [WorkerRole::Decode]);
    assert_ne!(prefill.domain.unwrap().id, decode.domain.unwrap().id);
}

// spec: scoped_taint_update_reprojects_known_card_without_synthesizing_unknown_worker
#[test]
fn taint_update_reprojects_a_known_card_and_ignores_unknown_ones() {
    let mut base = card("llama", "meta/llama", 64);
    base.runtime_config.taints = BTreeSet::from(["old".to_owned()]);
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    assert!(projection.handle_event(added("generate", 1, None, &base)));
    let update = |instance_id| DiscoveryEvent::TaintsUpdated {
        id: id("generate", instance_id, None),
        taints: vec!["gpu".to_owned(), "blue".to_owned()],
    };
    assert!(projection.handle_event(update(1)));
    projection.project();
    let view = projection.view();
    assert_eq!(
        membership(&view, "generate").runtime_configs[&1].taints,
        BTreeSet::from(["blue".to_owned(), "gpu".to_owned()])
    );
    assert!(!projection.handle_event(update(1)));
    assert!(!projection.handle_event(update(99)));
    assert_eq!(projection.n_cards(), 1);
    assert_eq!(projection.stats().unknown_taint_targets, 1);
}

#[test]
fn taint_update_changes_the_stored_json_so_a_relisting_is_unchanged() {
    let base = card("llama", "meta/llama", 64);
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.handle_event(added("generate", 1, None, &base));
    projection.handle_event(DiscoveryEvent::TaintsUpdated {
        id: id("generate", 1, None),
        taints: vec!["gpu".to_owned()],
    });
    let mut tainted = base.clone();
    tainted.runtime_config.taints = BTreeSet::from(["gpu".to_owned()]);
    assert!(!projection.replace_all(vec![instance("generate", 1, None, &tainted)]));
}

// spec: incompatible_domains_under_one_endpoint_are_fenced_together
#[test]
fn incompatible_domains_fence_until_the_odd_card_leaves() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.handle_event(added("generate", 1, None, &card("llama", "meta/llama", 64)));
    projection.handle_event(added(
        "generate",
        2,
        None,
        &card("embed", "nvidia/embed", 32),
    ));
    projection.project();
    let view = projection.view();
    assert_eq!(view.len(), 1);
    let conflicted = membership(&view, "generate");
    assert!(conflicted.domain.is_none());
    assert!(!conflicted.is_materializable());
    assert_eq!(model_names(conflicted), ["embed", "llama"]);
    assert!(has_conflict(
        conflicted,
        ConflictScope::PoolMaterialization,
        &ConflictSubject::Endpoint(endpoint("generate")),
        ConflictReason::MultipleIndexerDomains
    ));

    projection.handle_event(DiscoveryEvent::Removed(id("generate", 2, None)));
    projection.project();
    let view = projection.view();
    let healed = membership(&view, "generate");
    assert_eq!(model_names(healed), ["llama"]);
    assert!(healed.domain.is_some());
    assert!(healed.conflicts.is_empty());
    assert!(healed.is_materializable());
    assert!(healed.generation > conflicted.generation);
}

// spec: different_base_models_under_one_endpoint_are_a_hard_conflict
#[test]
fn different_base_models_on_one_endpoint_are_a_serving_topology_conflict() {
    let projection = projected(vec![
        instance("generate", 1, None, &card("llama", "meta/llama", 64)),
        instance("generate", 2, None, &card("chat", "meta/llama", 64)),
    ]);
    let view = projection.view();
    let membership = membership(&view, "generate");
    assert!(membership.domain.is_some());
    assert!(!membership.is_materializable());
    assert!(membership.has_serving_topology_conflict());
    assert!(has_conflict(
        membership,
        ConflictScope::ServingTopology,
        &ConflictSubject::Endpoint(endpoint("generate")),
        ConflictReason::MultipleBaseModels
    ));
}

#[test]
fn suffixed_card_without_lora_metadata_is_a_shape_conflict() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.handle_event(added("generate", 1, None, &card("llama", "meta/llama", 64)));
    let mut second = instance("generate", 1, None, &card("llama", "meta/llama", 64));
    second.id.model_suffix = Some("extra".into());
    projection.handle_event(DiscoveryEvent::Added(second));
    projection.project();
    let view = projection.view();
    let membership = membership(&view, "generate");
    assert!(has_conflict(
        membership,
        ConflictScope::ServingBinding,
        &ConflictSubject::Card(id("generate", 1, Some("extra"))),
        ConflictReason::LoraShapeMismatch
    ));
    assert!(membership.is_materializable());
}

// spec: adapter_is_a_loaded_overlay_on_the_backing_base_domain
#[test]
fn adapter_is_an_overlay_on_its_workers_base_domain() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.handle_event(added("generate", 1, None, &card("llama", "meta/llama", 64)));
    let adapter = adapter_card("tenant-a", "tenant-a", Some(4));
    projection.handle_event(added("generate", 1, Some("tenant-a"), &adapter));
    projection.project();
    let view = projection.view();
    let membership = membership(&view, "generate");
    assert!(membership.is_materializable());
    assert_eq!(membership.runtime_configs.len(), 1);
    assert_eq!(model_names(membership), ["llama", "tenant-a"]);
    let overlay = &membership.adapters[&model("tenant-a")];
    assert_eq!(overlay.base_model, model("llama"));
    assert_eq!(overlay.workers[&1], Some(4));
    let registration = membership
        .registrations
        .iter()
        .find(|registration| registration.model() == &model("tenant-a"))
        .unwrap();
    assert_eq!(
        registration.target(),
        &ModelTarget::Lora {
            base_model: model("llama"),
            adapter: model("tenant-a"),
        }
    );
}

// spec: adapter_served_model_is_distinct_from_runtime_lora_identity
#[test]
fn adapter_served_name_is_distinct_from_its_runtime_lora_name() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.handle_event(added("generate", 1, None, &card("llama", "meta/llama", 64)));
    let adapter = adapter_card("tenant-chat", "org/runtime-adapter-v2", Some(4));
    projection.handle_event(added("generate", 1, Some("adapter-v2"), &adapter));
    projection.project();
    let view = projection.view();
    let membership = membership(&view, "generate");
    let overlay = &membership.adapters[&model("tenant-chat")];
    assert_eq!(overlay.adapter, model("org/runtime-adapter-v2"));
    let registration = membership
        .registrations
        .iter()
        .find(|registration| registration.model() == &model("tenant-chat"))
        .unwrap();
    assert_eq!(
        registration.target(),
        &ModelTarget::Lora {
            base_model: model("llama"),
            adapter: model("org/runtime-adapter-v2"),
        }
    );
}

// spec: malformed_adapter_shape_suppresses_only_that_binding
#[test]
fn lora_card_without_suffix_suppresses_only_its_binding() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.handle_event(added("generate", 1, None, &card("llama", "meta/llama", 64)));
    let malformed = adapter_card("tenant-chat", "org/runtime-adapter-v2", Some(4));
    projection.handle_event(added("generate", 2, None, &malformed));
    projection.project();
    let view = projection.view();
    let membership = membership(&view, "generate");
    assert!(membership.is_materializable());
    assert_eq!(model_names(membership), ["llama"]);
    assert!(membership.adapters.is_empty());
    assert!(has_conflict(
        membership,
        ConflictScope::ServingBinding,
        &ConflictSubject::Card(id("generate", 2, None)),
        ConflictReason::LoraShapeMismatch
    ));
}

#[test]
fn orphan_adapter_is_ignored_softly_and_reported_once() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.handle_event(added("generate", 1, None, &card("llama", "meta/llama", 64)));
    let adapter = adapter_card("tenant-a", "tenant-a", None);
    projection.handle_event(added("generate", 7, Some("tenant-a"), &adapter));
    projection.project();
    let view = projection.view();
    let membership = membership(&view, "generate");
    assert!(membership.conflicts.is_empty());
    assert_eq!(model_names(membership), ["llama"]);
    assert_eq!(
        projection.poll_diagnostic(),
        Some(Diagnostic::OrphanAdapter {
            card: id("generate", 7, Some("tenant-a"))
        })
    );
    // Another change on the endpoint re-projects it; the persisting cause is not repeated.
    projection.handle_event(added("generate", 2, None, &card("llama", "meta/llama", 64)));
    projection.project();
    assert_eq!(projection.poll_diagnostic(), None);
    assert_eq!(projection.stats().orphan_adapters, 1);
}

#[test]
fn one_served_adapter_with_two_runtime_targets_is_a_binding_conflict() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.handle_event(added("generate", 1, None, &card("llama", "meta/llama", 64)));
    projection.handle_event(added("generate", 2, None, &card("llama", "meta/llama", 64)));
    projection.handle_event(added(
        "generate",
        1,
        Some("t"),
        &adapter_card("tenant", "lora-a", None),
    ));
    projection.handle_event(added(
        "generate",
        2,
        Some("t"),
        &adapter_card("tenant", "lora-b", None),
    ));
    projection.project();
    let view = projection.view();
    let membership = membership(&view, "generate");
    assert!(has_conflict(
        membership,
        ConflictScope::ServingBinding,
        &ConflictSubject::Card(id("generate", 2, Some("t"))),
        ConflictReason::ConflictingAdapterTargets
    ));
}

#[test]
fn worker_with_conflicting_adapter_capacity_fences_the_pool() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.handle_event(added("generate", 1, None, &card("llama", "meta/llama", 64)));
    projection.handle_event(added(
        "generate",
        1,
        Some("a"),
        &adapter_card("tenant", "lora", Some(2)),
    ));
    projection.handle_event(added(
        "generate",
        1,
        Some("b"),
        &adapter_card("tenant", "lora", Some(8)),
    ));
    projection.project();
    let view = projection.view();
    let membership = membership(&view, "generate");
    assert!(has_conflict(
        membership,
        ConflictScope::PoolMaterialization,
        &ConflictSubject::Worker(1),
        ConflictReason::ConflictingAdapterCapacity
    ));
    assert!(!membership.is_materializable());
    assert!(membership.adapters[&model("tenant")].workers.is_empty());
}

// spec: base_model_aliases_remain_attached_to_their_canonical_registration
#[test]
fn base_model_aliases_stay_on_their_registration() {
    let mut llama = card("llama", "meta/llama", 64);
    llama.aliases = vec![
        "instruct".into(),
        "chat".into(),
        "llama".into(),
        " bad".into(),
    ];
    let mut projection = projected(vec![instance("generate", 1, None, &llama)]);
    let view = projection.view();
    let membership = membership(&view, "generate");
    assert_eq!(membership.registrations.len(), 1);
    let registration = &membership.registrations[0];
    assert_eq!(registration.model(), &model("llama"));
    let aliases: Vec<&str> = registration.aliases().iter().map(|a| a.as_str()).collect();
    assert_eq!(aliases, ["chat", "instruct"]);
    assert_eq!(
        projection.poll_diagnostic(),
        Some(Diagnostic::InvalidAlias {
            card: id("generate", 1, None),
            alias: " bad".into()
        })
    );
}

// spec: federated_alias_collision_is_omitted_from_every_endpoint
#[test]
fn alias_claimed_by_two_models_is_omitted_from_every_endpoint() {
    let mut llama = card("llama", "meta/llama", 64);
    llama.aliases = vec!["shared-chat".into()];
    let mut mistral = card("mistral", "mistral/model", 64);
    mistral.aliases = vec!["shared-chat".into()];
    let projection = projected(vec![
        instance("llama", 1, None, &llama),
        instance("mistral", 2, None, &mistral),
    ]);
    let view = projection.view();
    for membership in view.endpoints() {
        assert!(membership.is_materializable());
        assert!(membership.aliases.is_empty());
        assert_eq!(membership.registrations.len(), 1);
        assert!(membership.registrations[0].aliases().is_empty());
    }
}

#[test]
fn model_name_claimed_by_two_targets_is_omitted_with_a_binding_conflict() {
    let mut projection = projected(vec![
        instance("a", 1, None, &card("llama", "meta/llama", 64)),
        instance("b", 2, Some("x"), &adapter_card("llama", "lora", None)),
        instance("b", 2, None, &card("base-b", "meta/llama", 64)),
    ]);
    let view = projection.view();
    for name in ["a", "b"] {
        let membership = membership(&view, name);
        assert!(!membership.models.contains(&model("llama")));
        assert!(has_conflict(
            membership,
            ConflictScope::ServingBinding,
            &ConflictSubject::Binding(model("llama")),
            ConflictReason::AmbiguousName
        ));
    }
    // When the adapter leaves, the name is unambiguous again on the other endpoint.
    projection.handle_event(DiscoveryEvent::Removed(id("b", 2, Some("x"))));
    projection.project();
    let view = projection.view();
    assert_eq!(model_names(membership(&view, "a")), ["llama"]);
    assert!(membership(&view, "a").conflicts.is_empty());
}

#[test]
fn same_binding_on_two_endpoints_is_not_ambiguous() {
    let projection = projected(vec![
        instance("a", 1, None, &card("llama", "meta/llama", 64)),
        instance("b", 2, None, &card("llama", "meta/llama", 64)),
    ]);
    for membership in projection.view().endpoints() {
        assert_eq!(model_names(membership), ["llama"]);
        assert!(membership.conflicts.is_empty());
    }
}

#[test]
fn malformed_card_is_skipped_and_reported_once() {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    let bad = ModelCardInstance {
        id: id("generate", 1, None),
        card_json: serde_json::json!({"display_name": 5}),
    };
    assert!(!projection.handle_event(DiscoveryEvent::Added(bad.clone())));
    assert!(!projection.handle_event(DiscoveryEvent::Added(bad.clone())));
    assert!(!projection.replace_all(vec![bad]));
    assert!(matches!(
        projection.poll_diagnostic(),
        Some(Diagnostic::MalformedCard { .. })
    ));
    assert_eq!(projection.poll_diagnostic(), None);
    assert_eq!(projection.stats().malformed_cards, 1);
    assert_eq!(projection.n_cards(), 0);
}

#[test]
fn undrained_diagnostics_are_bounded_and_drops_counted() {
    let limits = MembershipLimits {
        max_pending_diagnostics: 2,
        ..MembershipLimits::default()
    };
    let mut projection = MembershipProjection::with_limits(EndpointFilter::default(), limits);
    for worker in 0..3 {
        projection.handle_event(DiscoveryEvent::Added(ModelCardInstance {
            id: id("generate", worker, None),
            card_json: serde_json::json!([]),
        }));
    }
    assert_eq!(projection.stats().malformed_cards, 3);
    assert_eq!(projection.stats().diagnostics_dropped, 1);
    let mut n_pending = 0;
    while projection.poll_diagnostic().is_some() {
        n_pending += 1;
    }
    assert_eq!(n_pending, 2);
}

#[test]
fn cards_outside_the_filter_are_ignored() {
    let config = crate::DiscoveryScope {
        namespaces: vec!["prod".into()],
        endpoint_prefixes: vec!["prod.backend.generate".into()],
        watch_all: false,
    };
    let mut projection = MembershipProjection::new(config.filter());
    assert!(!projection.handle_event(added("other", 1, None, &card("llama", "meta/llama", 64))));
    assert!(projection.handle_event(added("generate", 1, None, &card("llama", "meta/llama", 64))));
    projection.project();
    assert_eq!(projection.view().len(), 1);
}

#[test]
fn replace_all_drops_cards_missing_from_the_listing() {
    let mut projection = projected(vec![
        instance("a", 1, None, &card("llama", "meta/llama", 64)),
        instance("b", 2, None, &card("llama", "meta/llama", 64)),
    ]);
    assert!(projection.replace_all(vec![instance(
        "a",
        1,
        None,
        &card("llama", "meta/llama", 64)
    )]));
    assert!(projection.project());
    assert!(projection.view().endpoint(&endpoint("b")).is_none());
}

#[test]
fn one_card_change_reprojects_only_its_endpoint() {
    let instances = (0..50)
        .map(|n| instance(&format!("e{n}"), n, None, &card("llama", "meta/llama", 64)))
        .collect();
    let mut projection = projected(instances);
    let before = projection.stats().endpoint_projections;
    assert_eq!(before, 50);
    projection.handle_event(added("e7", 99, None, &card("llama", "meta/llama", 64)));
    projection.project();
    assert_eq!(projection.stats().endpoint_projections, before + 1);
}

#[test]
fn kv_state_endpoint_defaults_to_serving_and_disagreement_is_ambiguous() {
    let plain = card("llama", "meta/llama", 64);
    let mut elsewhere = plain.clone();
    elsewhere.runtime_config.kv_state_endpoint = Some(endpoint("kv"));
    let projection = projected(vec![instance("generate", 1, None, &plain)]);
    assert_eq!(
        membership(&projection.view(), "generate").kv_state_endpoint(),
        crate::KvStateEndpoint::Resolved(endpoint("generate"))
    );
    let projection = projected(vec![instance("generate", 1, None, &elsewhere)]);
    assert_eq!(
        membership(&projection.view(), "generate").kv_state_endpoint(),
        crate::KvStateEndpoint::Resolved(endpoint("kv"))
    );
    let projection = projected(vec![
        instance("generate", 1, None, &plain),
        instance("generate", 2, None, &elsewhere),
    ]);
    assert_eq!(
        membership(&projection.view(), "generate").kv_state_endpoint(),
        crate::KvStateEndpoint::Ambiguous
    );
}

#[test]
fn legacy_card_projects_a_legacy_role() {
    let mut legacy = card("llama", "meta/llama", 64);
    legacy.worker_type = None;
    let projection = projected(vec![instance("generate", 1, None, &legacy)]);
    assert_eq!(
        membership(&projection.view(), "generate").roles,
        [WorkerRole::Legacy]
    );
}

// Model test: any sequence of events projected incrementally equals a fresh projection of
// the final card set (generations aside).
fn arbitrary_event() -> impl Strategy<Value = DiscoveryEvent> {
    let endpoint = prop::sample::select(vec!["a", "b", "c"]);
    let worker = 1u64..4;
    let name = prop::sample::select(vec!["llama", "mistral"]);
    let alias = prop::sample::select(vec![None, Some("chat"), Some("code")]);
    let block = prop::sample::select(vec![0u32, 16, 64]);
    let adapter = prop::sample::select(vec![
        None,
        Some(("tenant", "lora-a")),
        Some(("tenant", "lora-b")),
    ]);
    (endpoint, worker, name, alias, block, adapter, 0u8..10).prop_map(
        |(endpoint, worker, name, alias, block, adapter, op)| {
            if op < 3 {
                let suffix = (op == 1).then_some("t");
                return DiscoveryEvent::Removed(id(endpoint, worker, suffix));
            }
            if op == 3 {
                return DiscoveryEvent::TaintsUpdated {
                    id: id(endpoint, worker, None),
                    taints: vec![name.to_owned()],
                };
            }
            match adapter {
                Some((served, runtime)) if op > 7 => added(
                    endpoint,
                    worker,
                    Some("t"),
                    &adapter_card(served, runtime, None),
                ),
                _ => {
                    let mut base = card(name, name, block);
                    base.aliases = alias.into_iter().map(str::to_owned).collect();
                    added(endpoint, worker, None, &base)
                }
            }
        },
    )
}

fn without_generation(view: &MembershipView) -> Vec<EndpointMembership> {
    view.endpoints()
        .map(|membership| EndpointMembership {
            generation: 0,
            ..membership.clone()
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn incremental_projection_equals_projection_from_scratch(
        batches in prop::collection::vec(prop::collection::vec(arbitrary_event(), 1..6), 1..8)
    ) {
        let mut incremental = MembershipProjection::new(EndpointFilter::default());
        let mut cards: std::collections::BTreeMap<ModelCardInstanceId, serde_json::Value> =
            std::collections::BTreeMap::new();
        for batch in batches {
            for event in batch {
                match &event {
                    DiscoveryEvent::Added(instance) => {
                        cards.insert(instance.id.clone(), instance.card_json.clone());
                    }
                    DiscoveryEvent::Removed(id) => {
                        cards.remove(id);
                    }
                    DiscoveryEvent::TaintsUpdated { id, taints } => {
                        if let Some(json) = cards.get_mut(id) {
                            let set: BTreeSet<String> = taints.iter().cloned().collect();
                            super::set_json_taints(json, &set);
                        }
                    }
                }
                incremental.handle_event(event);
            }
            incremental.project();
            let fresh = projected(
                cards
                    .iter()
                    .map(|(id, card_json)| ModelCardInstance { id: id.clone(), card_json: card_json.clone() })
                    .collect(),
            );
            prop_assert_eq!(without_generation(&incremental.view()), without_generation(&fresh.view()));
        }
    }
}
