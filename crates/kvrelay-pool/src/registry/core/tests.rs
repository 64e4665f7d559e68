//! The decision core driven without a runtime.

use kvrelay_identity::{
    CacheSemanticsId, CkfFormat, DcId, IdentitySource, IndexerDomainId, KvQueryHashFormat,
    RoutingScopeId,
};

use super::slot::Admission;
use super::*;
use crate::error::HubFailure;

#[derive(Clone)]
struct TestHub {
    idle: bool,
}

impl SlotHub for TestHub {
    fn is_idle(&self) -> bool {
        self.idle
    }
}

type Core = RegistryCore<(), TestHub>;

fn pool(seed: u8) -> PoolId {
    PoolId {
        indexer_domain: IndexerDomainId {
            cache_semantics: CacheSemanticsId::new([seed; 16], IdentitySource::Explicit),
            routing_scope: RoutingScopeId::new([seed; 16], IdentitySource::DefaultDerived),
        },
        dc_id: DcId(1),
    }
}

fn endpoint(name: &str) -> EndpointId {
    format!("ns.{name}.generate").parse().unwrap()
}

fn attach(core: &mut Core, seed: u8) -> ProducerIdentity {
    let reserved = core
        .reserve(pool(seed), &endpoint(&seed.to_string()), 0)
        .unwrap();
    let identity = ProducerIdentity::new(
        pool(seed),
        7,
        reserved.generation,
        CkfFormat::v1(1, 16).unwrap(),
    )
    .unwrap();
    core.commit(Commit {
        reserved,
        endpoint: endpoint(&seed.to_string()),
        actor: (),
        identity,
        registrations: Arc::from(Vec::new()),
        query_semantics: KvQuerySemantics::new(16, KvQueryHashFormat::DynamoStandardV1).unwrap(),
        roles: Arc::from(vec![WorkerRole::Aggregated]),
        load: None,
        cancel: CancellationToken::new(),
        lane_of: None,
        tier_lanes: Vec::new(),
    })
    .unwrap();
    while core.poll_publication().is_some() {}
    identity
}

fn step(core: &mut Core, admission: &Admission<()>, attempted: bool) -> &'static str {
    match core.hub_step(admission, attempted) {
        Ok(HubStep::Ready(_)) => "ready",
        Ok(HubStep::Wait(_)) => "wait",
        Ok(HubStep::Initialize {
            with_capacity: true,
        }) => "initialize",
        Ok(HubStep::Initialize {
            with_capacity: false,
        }) => "reclaim",
        Err(SubscribeError::InitializedHubLimit { .. }) => "limit",
        Err(_) => "error",
    }
}

#[test]
fn layout_generations_start_at_one_and_never_repeat() {
    let mut core = Core::new(DcRelayIdentity::new(1, 2), 4);
    let first = core.reserve(pool(1), &endpoint("a"), 0).unwrap();
    core.rollback(first);
    let second = core.reserve(pool(1), &endpoint("a"), 0).unwrap();
    assert_eq!((first.generation, second.generation), (1, 2));
}

#[test]
fn a_reservation_blocks_its_pool_and_its_endpoint() {
    let mut core = Core::new(DcRelayIdentity::new(1, 2), 4);
    core.reserve(pool(1), &endpoint("a"), 0).unwrap();
    assert!(matches!(
        core.reserve(pool(1), &endpoint("b"), 0),
        Err(AttachError::PoolAlreadyOwned { .. })
    ));
    assert!(matches!(
        core.reserve(pool(2), &endpoint("a"), 0),
        Err(AttachError::EndpointAlreadyAssigned { .. })
    ));
}

#[test]
fn catalog_revision_advances_once_per_change() {
    let mut core = Core::new(DcRelayIdentity::new(1, 2), 4);
    let identity = attach(&mut core, 1);
    assert_eq!(
        core.withdraw(
            *identity.pool_id(),
            identity.layout_generation(),
            RetirementMode::Graceful
        ),
        Some(true)
    );
    let revisions: Vec<u64> = std::iter::from_fn(|| core.poll_publication())
        .filter_map(|publication| match publication {
            Publication::CatalogRemove { revision, .. } => Some(revision),
            _ => None,
        })
        .collect();
    assert_eq!(revisions, [2]);
    assert_eq!(
        core.withdraw(
            *identity.pool_id(),
            identity.layout_generation(),
            RetirementMode::Fenced
        ),
        Some(false)
    );
    assert!(
        std::iter::from_fn(|| core.poll_publication())
            .all(|p| !matches!(p, Publication::CatalogRemove { .. }))
    );
    assert_eq!(
        core.generation_of(*identity.pool_id())
            .map(|(_, state)| state),
        Some(EntryState::Fenced)
    );
}

#[test]
fn capacity_units_follow_hub_slots_through_eviction() {
    let mut core = Core::new(DcRelayIdentity::new(1, 2), 1);
    let first = attach(&mut core, 1);
    let second = attach(&mut core, 2);
    let a = core.begin_admission(&first).unwrap();
    assert_eq!(step(&mut core, &a, false), "initialize");
    assert!(matches!(
        core.finish_initialization(a.generation, Ok(TestHub { idle: true })),
        InitOutcome::Installed
    ));
    assert_eq!(step(&mut core, &a, false), "ready");
    core.end_admission(a.generation);

    let b = core.begin_admission(&second).unwrap();
    assert_eq!(step(&mut core, &b, false), "reclaim");
    assert!(!core.try_take_capacity(b.generation));
    let victim = core.claim_idle_victim(b.generation).unwrap();
    assert_eq!(victim.generation, a.generation);
    assert_eq!(core.slot_phase(a.generation), "evicting");
    assert!(
        core.claim_idle_victim(b.generation).is_none(),
        "one victim per unit"
    );
    assert!(core.finish_eviction(victim.generation, b.generation));
    assert_eq!(core.slot_phase(a.generation), "vacant");
    assert_eq!(core.hubs_in_use(), 1);
    assert!(matches!(
        core.finish_initialization(b.generation, Ok(TestHub { idle: false })),
        InitOutcome::Installed
    ));
    core.end_admission(b.generation);

    // A busy hub is never a victim: the next pool hits the limit.
    let again = core.begin_admission(&first).unwrap();
    assert_eq!(step(&mut core, &again, false), "reclaim");
    assert!(core.claim_idle_victim(again.generation).is_none());
    core.abort_initialization(again.generation, false);
    assert_eq!(step(&mut core, &again, true), "limit");
    assert_eq!(core.hubs_in_use(), 1);
}

#[test]
fn retirement_releases_capacity_and_discards_a_late_hub() {
    let mut core = Core::new(DcRelayIdentity::new(1, 2), 2);
    let first = attach(&mut core, 1);
    let a = core.begin_admission(&first).unwrap();
    assert_eq!(step(&mut core, &a, false), "initialize");
    assert_eq!(core.hubs_in_use(), 1);
    core.withdraw(
        *first.pool_id(),
        first.layout_generation(),
        RetirementMode::Fenced,
    );
    assert!(
        core.retire_slot(a.generation).is_none(),
        "still initializing"
    );
    assert!(matches!(
        core.finish_initialization(a.generation, Ok(TestHub { idle: true })),
        InitOutcome::Discard(Some(_))
    ));
    assert_eq!(core.slot_phase(a.generation), "retired");
    assert_eq!(core.hubs_in_use(), 0);
}

#[test]
fn a_failed_start_fences_only_an_active_generation() {
    let mut core = Core::new(DcRelayIdentity::new(1, 2), 2);
    let first = attach(&mut core, 1);
    let a = core.begin_admission(&first).unwrap();
    step(&mut core, &a, false);
    assert!(matches!(
        core.finish_initialization(a.generation, Err(HubFailure::IdentityMismatch)),
        InitOutcome::Fence(HubFailure::IdentityMismatch)
    ));
    assert_eq!(core.slot_phase(a.generation), "failed");
    assert_eq!(core.hubs_in_use(), 0);
    assert!(matches!(step(&mut core, &a, false), "error"));
}

#[test]
fn attaches_past_the_pool_limit_are_refused_until_one_is_removed() {
    let mut core = Core::new(DcRelayIdentity::new(1, 2), 4).with_max_pools(2);
    let first = core.reserve(pool(1), &endpoint("a"), 0).unwrap();
    core.reserve(pool(2), &endpoint("b"), 0).unwrap();
    assert!(matches!(
        core.reserve(pool(3), &endpoint("c"), 0),
        Err(AttachError::PoolLimit { limit: 2, .. })
    ));
    core.rollback(first);
    assert!(core.reserve(pool(3), &endpoint("c"), 0).is_ok());
}

#[test]
fn filter_memory_is_budgeted_across_attached_and_attaching_pools() {
    let mut core = Core::new(DcRelayIdentity::new(1, 2), 4).with_max_filter_bytes(1000);
    let first = core.reserve(pool(1), &endpoint("a"), 600).unwrap();
    assert_eq!(core.filter_bytes_in_use(), 600);
    // A reservation counts before its filter exists.
    assert!(matches!(
        core.reserve(pool(2), &endpoint("b"), 500),
        Err(AttachError::FilterMemoryLimit {
            bytes: 500,
            in_use: 600,
            limit: 1000,
            ..
        })
    ));
    assert_eq!(core.reservation_count(), 1, "a refusal reserves nothing");
    core.reserve(pool(3), &endpoint("c"), 400).unwrap();
    assert_eq!(core.filter_bytes_in_use(), 1000);
    // Releasing a reservation returns its bytes.
    core.rollback(first);
    assert_eq!(core.filter_bytes_in_use(), 400);
    core.reserve(pool(2), &endpoint("b"), 500).unwrap();
    assert_eq!(core.filter_bytes_in_use(), 900);
}
