//! Topology and readiness over projected memberships.

use std::collections::BTreeSet;

use kvrelay_identity::{DcId, IndexerDomainId};

use super::*;
use crate::card::{LoraInfo, ModelDeploymentCard};
use crate::config::EndpointFilter;
use crate::instance::{ModelCardInstance, ModelCardInstanceId};
use crate::projection::MembershipProjection;

fn card(worker_type: Option<WorkerType>, needs: Vec<Vec<WorkerType>>) -> ModelDeploymentCard {
    let mut card = ModelDeploymentCard::with_name("llama");
    card.kv_cache_block_size = 16;
    card.worker_type = worker_type;
    card.needs = needs;
    card
}

fn instance(endpoint: &str, worker: u64, card: &ModelDeploymentCard) -> ModelCardInstance {
    instance_with_suffix(endpoint, worker, None, card)
}

fn instance_with_suffix(
    endpoint: &str,
    worker: u64,
    suffix: Option<&str>,
    card: &ModelDeploymentCard,
) -> ModelCardInstance {
    ModelCardInstance {
        id: ModelCardInstanceId {
            namespace: "prod".into(),
            component: "backend".into(),
            endpoint: endpoint.into(),
            instance_id: worker,
            model_suffix: suffix.map(str::to_owned),
        },
        card_json: serde_json::to_value(card).unwrap(),
    }
}

fn view(instances: Vec<ModelCardInstance>) -> MembershipView {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    projection.replace_all(instances);
    projection.project();
    projection.view()
}

fn endpoint(name: &str) -> EndpointId {
    EndpointId::new("prod", "backend", name).unwrap()
}

fn live(state: &mut TopologyState, name: &str, workers: &[u64]) {
    state.claim_availability(&endpoint(name), 1);
    state.replace_availability(&endpoint(name), 1, Some(workers.iter().copied().collect()));
}

fn only_entry(state: &TopologyState) -> TopologyEntry {
    let snapshot = state.snapshot();
    assert_eq!(snapshot.entries.len(), 1);
    snapshot.entries[0].clone()
}

fn disaggregated() -> MembershipView {
    view(vec![
        instance(
            "prefill",
            1,
            &card(Some(WorkerType::Prefill), vec![vec![WorkerType::Decode]]),
        ),
        instance(
            "decode",
            2,
            &card(Some(WorkerType::Decode), vec![vec![WorkerType::Prefill]]),
        ),
    ])
}

#[test]
fn entries_start_unknown_at_revision_one() {
    let state = TopologyState::new(disaggregated());
    let snapshot = state.snapshot();
    assert_eq!(snapshot.revision, 1);
    let entry = &snapshot.entries[0];
    assert_eq!(entry.namespace, "prod");
    assert_eq!(entry.model.as_str(), "llama");
    assert_eq!(entry.state, ServingState::Unknown);
    assert!(entry.present_roles.is_empty() && entry.missing_roles.is_empty());
    assert_eq!(entry.members.len(), 2);
}

#[test]
fn one_unknown_member_keeps_the_entry_unknown() {
    let mut state = TopologyState::new(disaggregated());
    live(&mut state, "prefill", &[1]);
    assert_eq!(only_entry(&state).state, ServingState::Unknown);
    live(&mut state, "decode", &[2]);
    let entry = only_entry(&state);
    assert_eq!(entry.state, ServingState::Ready);
    assert_eq!(
        entry.present_roles,
        [WorkerRole::Prefill, WorkerRole::Decode]
    );
}

#[test]
fn dead_decode_makes_the_entry_unavailable_with_decode_missing() {
    let mut state = TopologyState::new(disaggregated());
    live(&mut state, "prefill", &[1]);
    live(&mut state, "decode", &[]);
    let entry = only_entry(&state);
    assert_eq!(entry.state, ServingState::Unavailable);
    assert_eq!(entry.missing_roles, [WorkerRole::Decode]);
}

#[test]
fn revision_advances_only_when_entries_change() {
    let mut state = TopologyState::new(disaggregated());
    assert!(!state.claim_availability(&endpoint("prefill"), 1));
    assert_eq!(state.snapshot().revision, 1);
    assert!(!state.replace_availability(&endpoint("prefill"), 1, Some(BTreeSet::from([1]))));
    assert!(!state.claim_availability(&endpoint("decode"), 1));
    assert!(state.replace_availability(&endpoint("decode"), 1, Some(BTreeSet::from([2]))));
    assert_eq!(state.snapshot().revision, 2);
    assert!(!state.replace_availability(&endpoint("decode"), 1, Some(BTreeSet::from([2]))));
    assert_eq!(state.snapshot().revision, 2);
}

#[test]
fn a_retired_slot_cannot_write_liveness() {
    let mut state = TopologyState::new(disaggregated());
    live(&mut state, "prefill", &[1]);
    live(&mut state, "decode", &[2]);
    assert_eq!(only_entry(&state).state, ServingState::Ready);
    // A new slot takes over and discards the old liveness.
    assert!(state.claim_availability(&endpoint("decode"), 2));
    assert_eq!(only_entry(&state).state, ServingState::Unknown);
    assert!(!state.replace_availability(&endpoint("decode"), 1, Some(BTreeSet::new())));
    assert_eq!(only_entry(&state).state, ServingState::Unknown);
}

#[test]
fn availability_of_unknown_endpoint_is_ignored() {
    let mut state = TopologyState::new(disaggregated());
    assert!(!state.claim_availability(&endpoint("nope"), 1));
    assert!(!state.replace_availability(&endpoint("nope"), 1, Some(BTreeSet::new())));
}

#[test]
fn two_live_decode_endpoints_block_ready_as_duplicates() {
    let members = view(vec![
        instance(
            "prefill",
            1,
            &card(Some(WorkerType::Prefill), vec![vec![WorkerType::Decode]]),
        ),
        instance("decode-a", 2, &card(Some(WorkerType::Decode), vec![])),
        instance("decode-b", 3, &card(Some(WorkerType::Decode), vec![])),
    ]);
    let mut state = TopologyState::new(members);
    live(&mut state, "prefill", &[1]);
    live(&mut state, "decode-a", &[2]);
    live(&mut state, "decode-b", &[3]);
    let entry = only_entry(&state);
    assert_eq!(entry.duplicate_role_endpoints, [WorkerRole::Decode]);
    assert_eq!(entry.state, ServingState::Unavailable);
    // A dead duplicate is no duplicate.
    live(&mut state, "decode-b", &[]);
    assert_eq!(only_entry(&state).state, ServingState::Ready);
}

#[test]
fn aggregated_duplicates_are_not_reported() {
    let members = view(vec![
        instance("a", 1, &card(Some(WorkerType::Aggregated), vec![])),
        instance("b", 2, &card(Some(WorkerType::Aggregated), vec![])),
    ]);
    let mut state = TopologyState::new(members);
    live(&mut state, "a", &[1]);
    live(&mut state, "b", &[2]);
    let entry = only_entry(&state);
    assert!(entry.duplicate_role_endpoints.is_empty());
    assert_eq!(entry.state, ServingState::Ready);
}

#[test]
fn legacy_member_falls_back_to_any_live_worker() {
    let members = view(vec![
        instance("legacy", 1, &card(None, vec![])),
        instance(
            "prefill",
            2,
            &card(Some(WorkerType::Prefill), vec![vec![WorkerType::Decode]]),
        ),
    ]);
    let mut state = TopologyState::new(members);
    live(&mut state, "legacy", &[]);
    live(&mut state, "prefill", &[2]);
    let entry = only_entry(&state);
    assert!(entry.legacy_fallback);
    assert_eq!(entry.state, ServingState::Ready);
}

#[test]
fn serving_topology_conflict_removes_the_endpoint() {
    let mut other = card(Some(WorkerType::Aggregated), vec![]);
    other.display_name = "other".into();
    let members = view(vec![
        instance("a", 1, &card(Some(WorkerType::Aggregated), vec![])),
        instance("a", 2, &other),
    ]);
    let state = TopologyState::new(members);
    assert!(state.snapshot().entries.is_empty());
}

#[test]
fn zero_block_size_endpoint_stays_in_topology() {
    let mut zero = card(Some(WorkerType::Aggregated), vec![]);
    zero.kv_cache_block_size = 0;
    let state = TopologyState::new(view(vec![instance("a", 1, &zero)]));
    assert_eq!(state.snapshot().entries.len(), 1);
}

fn pool(n: u8) -> PoolId {
    let base = resolve(n);
    PoolId {
        indexer_domain: base,
        dc_id: DcId::from_dc_name("dc-a"),
    }
}

fn resolve(n: u8) -> IndexerDomainId {
    let semantics = kvrelay_identity::KvQuerySemantics::new(
        16,
        kvrelay_identity::KvQueryHashFormat::DynamoStandardV1,
    )
    .unwrap();
    kvrelay_identity::resolve_indexer_domain(
        &format!("model-{n}"),
        &kvrelay_identity::IndexerIdentitySpec::default(),
        semantics,
        &endpoint("a"),
    )
}

#[test]
fn pool_links_attach_and_ambiguous_links_fail_closed() {
    let mut state = TopologyState::new(disaggregated());
    assert!(state.replace_pool_links([(endpoint("prefill"), pool(1))]));
    let revision = state.snapshot().revision;
    let entry = only_entry(&state);
    let prefill = entry
        .members
        .iter()
        .find(|m| m.endpoint == endpoint("prefill"))
        .unwrap();
    assert_eq!(prefill.pool_id, Some(pool(1)));
    assert!(!state.replace_pool_links([(endpoint("prefill"), pool(1))]));
    assert_eq!(state.snapshot().revision, revision);
    state.replace_pool_links([
        (endpoint("prefill"), pool(1)),
        (endpoint("prefill"), pool(2)),
    ]);
    let entry = only_entry(&state);
    assert!(entry.members.iter().all(|member| member.pool_id.is_none()));
}

#[test]
fn removed_endpoint_loses_its_liveness() {
    let mut state = TopologyState::new(disaggregated());
    live(&mut state, "prefill", &[1]);
    state.replace_membership(view(vec![instance(
        "decode",
        2,
        &card(Some(WorkerType::Decode), vec![vec![WorkerType::Prefill]]),
    )]));
    state.replace_membership(disaggregated());
    // The prefill endpoint's old liveness is gone, so the entry is unknown again.
    assert_eq!(only_entry(&state).state, ServingState::Unknown);
}

fn with_adapter() -> MembershipView {
    let mut adapter = card(Some(WorkerType::Aggregated), vec![]);
    adapter.display_name = "tenant".into();
    adapter.lora = Some(LoraInfo {
        name: "tenant-lora".into(),
        max_gpu_lora_count: Some(2),
    });
    view(vec![
        instance("a", 1, &card(Some(WorkerType::Aggregated), vec![])),
        instance("a", 2, &card(Some(WorkerType::Aggregated), vec![])),
        instance_with_suffix("a", 2, Some("tenant"), &adapter),
    ])
}

#[test]
fn adapter_is_ready_only_when_a_live_worker_carries_it() {
    let mut state = TopologyState::new(with_adapter());
    let entry = only_entry(&state);
    assert_eq!(entry.adapters[0].state, ServingState::Unknown);
    live(&mut state, "a", &[1, 2]);
    let entry = only_entry(&state);
    assert_eq!(entry.adapters[0].adapter.as_str(), "tenant");
    assert_eq!(entry.adapters[0].state, ServingState::Ready);
    live(&mut state, "a", &[1]);
    let entry = only_entry(&state);
    assert_eq!(entry.state, ServingState::Ready);
    assert_eq!(entry.adapters[0].state, ServingState::Unavailable);
    assert_eq!(entry.adapters[0].missing_roles, [WorkerRole::Aggregated]);
}

#[test]
fn adapter_of_an_unavailable_base_is_unavailable() {
    let mut state = TopologyState::new(with_adapter());
    live(&mut state, "a", &[]);
    let entry = only_entry(&state);
    assert_eq!(entry.state, ServingState::Unavailable);
    assert_eq!(entry.adapters[0].state, ServingState::Unavailable);
}
