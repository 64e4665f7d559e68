//! Supervision core decisions, driven without a runtime.

#![allow(clippy::unwrap_used, clippy::panic, reason = "tests")]

use kvrelay_membership::{
    DiscoveryEvent, EndpointFilter, MembershipProjection, ModelCardInstance, ModelCardInstanceId,
};

use super::*;
use crate::config::SourceEngine;

fn card(total_kv_blocks: Option<u64>, dp_start: u32, dp_size: u32) -> serde_json::Value {
    card_with_block_size(total_kv_blocks, dp_start, dp_size, 16)
}

fn card_with_block_size(
    total_kv_blocks: Option<u64>,
    dp_start: u32,
    dp_size: u32,
    block_size: u32,
) -> serde_json::Value {
    let mut runtime =
        serde_json::json!({"data_parallel_start_rank": dp_start, "data_parallel_size": dp_size});
    if let Some(blocks) = total_kv_blocks {
        runtime["total_kv_blocks"] = blocks.into();
    }
    serde_json::json!({
        "display_name": "m", "source_path": "models/m", "kv_cache_block_size": block_size,
        "worker_type": "aggregated", "runtime_config": runtime
    })
}

/// A view of the cards `(path, card)`, paths like `prod/backend/generate/1`.
fn view(cards: &[(&str, serde_json::Value)]) -> MembershipView {
    let mut projection = MembershipProjection::new(EndpointFilter::default());
    for (path, card_json) in cards {
        let id = ModelCardInstanceId::from_path(path).unwrap();
        projection.handle_event(DiscoveryEvent::Added(ModelCardInstance {
            id,
            card_json: card_json.clone(),
        }));
    }
    projection.project();
    projection.view()
}

fn membership(cards: &[(u64, serde_json::Value)]) -> EndpointMembership {
    let cards: Vec<(String, serde_json::Value)> = cards
        .iter()
        .map(|(instance, card)| (format!("prod/backend/generate/{instance:x}"), card.clone()))
        .collect();
    let cards: Vec<(&str, serde_json::Value)> = cards
        .iter()
        .map(|(path, card)| (path.as_str(), card.clone()))
        .collect();
    view(&cards).endpoints().next().unwrap().clone()
}

fn endpoint(dotted: &str) -> EndpointId {
    dotted.parse().unwrap()
}

fn engine(endpoint: &str, worker_id: u64) -> SourceConfig {
    SourceConfig {
        endpoint: endpoint.to_owned(),
        worker_id,
        dp_rank: 0,
        engine: SourceEngine::Vllm,
        zmq: "tcp://127.0.0.1:9".to_owned(),
        replay: None,
        metrics_url: None,
        publisher_id: None,
    }
}

fn config() -> CoreConfig {
    CoreConfig {
        dc_id: DcId::from_dc_name("dc-test"),
        workload_sources: false,
        nats: false,
        stall_bound: Duration::from_secs(10),
        degraded_readings: 3,
        tiers: crate::config::TiersConfig::default(),
        filter_density: kvrelay_ckf::FilterDensity::V1,
        twin_density: None,
    }
}

/// A core with one engine source per listed endpoint (worker 1, 2, … in order).
fn core_with_engines(endpoints: &[&str]) -> SupervisionCore {
    let configured = endpoints
        .iter()
        .enumerate()
        .map(|(at, dotted)| (endpoint(dotted), vec![engine(dotted, at as u64 + 1)]))
        .collect();
    SupervisionCore::new(config(), configured)
}

fn drain(core: &mut SupervisionCore) -> Vec<Command> {
    std::iter::from_fn(|| core.poll_command()).collect()
}

fn attaches(commands: &[Command]) -> Vec<EndpointId> {
    commands
        .iter()
        .filter_map(|command| match command {
            Command::Attach { endpoint, .. } => Some(endpoint.clone()),
            _ => None,
        })
        .collect()
}

fn retires(commands: &[Command]) -> Vec<(EndpointId, u64, RetirementMode)> {
    commands
        .iter()
        .filter_map(|command| match command {
            Command::Retire {
                endpoint,
                generation,
                mode,
            } => Some((endpoint.clone(), *generation, *mode)),
            _ => None,
        })
        .collect()
}

fn started(commands: &[Command]) -> Vec<EndpointId> {
    commands
        .iter()
        .filter_map(|command| match command {
            Command::StartSources { endpoint, .. } => Some(endpoint.clone()),
            _ => None,
        })
        .collect()
}

fn last_routes(commands: &[Command]) -> Option<Vec<RoutePlan>> {
    commands.iter().rev().find_map(|command| match command {
        Command::PublishRoutes(plans) => Some(plans.clone()),
        _ => None,
    })
}

fn last_catalog(commands: &[Command]) -> Option<(BTreeSet<PoolId>, u64)> {
    last_catalog_with_coverage(commands).map(|(withheld, _, revision)| (withheld, revision))
}

fn last_catalog_with_coverage(
    commands: &[Command],
) -> Option<(BTreeSet<PoolId>, BTreeMap<PoolId, CoverageFact>, u64)> {
    commands.iter().rev().find_map(|command| match command {
        Command::PublishCatalog {
            withheld,
            coverage,
            revision,
            ..
        } => Some((withheld.clone(), coverage.clone(), *revision)),
        _ => None,
    })
}

const A: &str = "prod.backend.generate";

/// A core whose endpoint A (one worker, 64 blocks, one engine source) is attached as
/// generation 1, with its commands drained.
fn attached_a() -> SupervisionCore {
    let mut core = core_with_engines(&[A]);
    core.handle_membership(view(&[("prod/backend/generate/1", card(Some(64), 0, 1))]));
    drain(&mut core);
    core.handle_attached(&endpoint(A), 1);
    drain(&mut core);
    core
}
const B: &str = "prod.other.generate";

fn two_endpoints() -> MembershipView {
    view(&[
        ("prod/backend/generate/1", card(Some(64), 0, 1)),
        ("prod/other/generate/2", card(Some(64), 0, 1)),
    ])
}

#[test]
fn an_endpoint_without_a_source_gets_no_pool() {
    let mut core = core_with_engines(&[]);
    core.handle_membership(two_endpoints());
    let commands = drain(&mut core);
    assert!(attaches(&commands).is_empty());
    assert!(core.facts().unready.is_empty(), "{:?}", core.facts());
}

#[test]
fn readiness_waits_for_discovery() {
    let core = core_with_engines(&[A]);
    assert_eq!(
        core.facts().unready,
        vec!["discovery has not listed yet".to_owned()]
    );
}

#[test]
fn a_configured_source_is_not_connected_until_it_says_so() {
    let mut core = core_with_engines(&[A]);
    core.handle_membership(two_endpoints());
    let commands = drain(&mut core);
    assert_eq!(attaches(&commands), vec![endpoint(A)]);
    assert!(started(&commands).is_empty(), "sources start once attached");

    core.handle_attached(&endpoint(A), 7);
    let commands = drain(&mut core);
    assert_eq!(started(&commands), vec![endpoint(A)]);
    let routes = last_routes(&commands).unwrap();
    assert_eq!(routes.len(), 1);
    assert_eq!(routes[0].generation, 7);
    let facts = core.facts();
    assert_eq!(facts.unready.len(), 1, "{facts:?}");
    assert!(
        facts.unready[0].contains("has no connected source (1 connecting)"),
        "{facts:?}"
    );

    let source = SourceKey::Engine(SourceId::new(1, 0));
    core.handle_source_state(&source, SourceState::Connected);
    assert!(core.facts().unready.is_empty(), "{:?}", core.facts());
    let pool = core.facts().pools.into_values().next().unwrap();
    assert_eq!(pool.sources.get("connected"), Some(&1));

    core.handle_source_state(&source, SourceState::Failed);
    assert!(core.facts().unready[0].contains("1 failed"));
}

#[test]
fn endpoints_attach_concurrently_and_independently() {
    let mut core = core_with_engines(&[A, B]);
    core.handle_membership(two_endpoints());
    let commands = drain(&mut core);
    // Both attaches are asked for before either answers.
    assert_eq!(attaches(&commands), vec![endpoint(A), endpoint(B)]);

    // B answers first; A is still allocating and holds nothing up.
    core.handle_attached(&endpoint(B), 2);
    let commands = drain(&mut core);
    assert_eq!(started(&commands), vec![endpoint(B)]);
    let routes = last_routes(&commands).unwrap();
    assert_eq!(
        routes
            .iter()
            .map(|plan| plan.endpoint.clone())
            .collect::<Vec<_>>(),
        vec![endpoint(B)]
    );
    assert!(attaches(&commands).is_empty(), "no second attach for A");

    core.handle_attach_failed(&endpoint(A));
    drain(&mut core);
    // The next membership change tries A again.
    core.handle_membership(two_endpoints());
    assert_eq!(attaches(&drain(&mut core)), vec![endpoint(A)]);
}

#[test]
fn a_refused_attach_waits_for_a_change_that_could_admit_it() {
    let mut core = core_with_engines(&[A, B]);
    core.handle_membership(two_endpoints());
    drain(&mut core);
    // A is refused (say max_pools); B's attach finishing must not retry A: with many
    // refused endpoints that retried, logged and counted every one after every attach.
    core.handle_attach_failed(&endpoint(A));
    drain(&mut core);
    core.handle_attached(&endpoint(B), 2);
    assert!(
        attaches(&drain(&mut core)).is_empty(),
        "A retried on B's attach"
    );
    assert!(!core.is_settling(), "a refused endpoint is not in flight");
    // B's generation is fenced: A still waits while B retires...
    core.handle_fenced(&endpoint(B), 2);
    assert!(
        attaches(&drain(&mut core)).is_empty(),
        "A retried before a pool was freed"
    );
    // ...and once B's retirement frees a pool, A is tried again (with B's rebuild).
    core.handle_retired(&endpoint(B));
    assert_eq!(attaches(&drain(&mut core)), vec![endpoint(A), endpoint(B)]);
}

#[test]
fn a_changed_binding_retires_first_then_attaches_the_new_generation() {
    let mut core = attached_a();

    // A new block size is a new cache domain: a new generation.
    core.handle_membership(view(&[(
        "prod/backend/generate/1",
        card_with_block_size(Some(64), 0, 1, 32),
    )]));
    let commands = drain(&mut core);
    assert_eq!(
        retires(&commands),
        vec![(endpoint(A), 1, RetirementMode::Graceful)]
    );
    assert!(commands.iter().any(
        |command| matches!(command, Command::StopSources { endpoint: e } if *e == endpoint(A))
    ));
    assert!(attaches(&commands).is_empty(), "withdraw first");
    assert_eq!(last_routes(&commands), Some(Vec::new()));

    core.handle_retired(&endpoint(A));
    assert_eq!(attaches(&drain(&mut core)), vec![endpoint(A)]);
}

#[test]
fn a_content_change_updates_in_place() {
    let mut core = attached_a();
    core.handle_membership(view(&[("prod/backend/generate/1", card(Some(128), 0, 1))]));
    let commands = drain(&mut core);
    assert!(retires(&commands).is_empty());
    let update = commands
        .iter()
        .find_map(|command| match command {
            Command::Update {
                generation,
                capacity,
                ..
            } => Some((*generation, capacity.clone())),
            _ => None,
        })
        .unwrap();
    assert_eq!(update.0, 1);
    assert_eq!(update.1[0].total_kv_blocks, Some(128));
}

#[test]
fn an_endpoint_that_leaves_while_attaching_is_retired_once_attached() {
    let mut core = core_with_engines(&[A]);
    core.handle_membership(view(&[("prod/backend/generate/1", card(Some(64), 0, 1))]));
    drain(&mut core);
    core.handle_membership(view(&[]));
    assert!(
        retires(&drain(&mut core)).is_empty(),
        "nothing to retire yet"
    );
    core.handle_attached(&endpoint(A), 3);
    assert_eq!(
        retires(&drain(&mut core)),
        vec![(endpoint(A), 3, RetirementMode::Graceful)]
    );
}

#[test]
fn a_fenced_generation_is_retired_fenced_and_rebuilt() {
    let mut core = attached_a();
    core.handle_fenced(&endpoint(A), 0);
    assert!(
        retires(&drain(&mut core)).is_empty(),
        "a stale generation fences nothing"
    );
    core.handle_fenced(&endpoint(A), 1);
    assert_eq!(
        retires(&drain(&mut core)),
        vec![(endpoint(A), 1, RetirementMode::Fenced)]
    );
    core.handle_retired(&endpoint(A));
    assert_eq!(attaches(&drain(&mut core)), vec![endpoint(A)]);
}

/// A core with endpoint A attached at generation 1 and its one source connected.
fn one_attached_connected_pool() -> SupervisionCore {
    let mut core = core_with_engines(&[A]);
    core.handle_catalog(PoolCatalog::new(kvrelay_identity::DcRelayIdentity::new(
        1, 2,
    )));
    core.handle_membership(view(&[("prod/backend/generate/1", card(Some(64), 0, 1))]));
    drain(&mut core);
    core.handle_attached(&endpoint(A), 1);
    core.handle_source_state(
        &SourceKey::Engine(SourceId::new(1, 0)),
        SourceState::Connected,
    );
    drain(&mut core);
    core
}

#[test]
fn a_stalled_pool_is_withheld_and_named_until_it_progresses() {
    let mut core = one_attached_connected_pool();
    let pool = core.facts().pools.values().next().unwrap().pool;

    let busy = HealthFact {
        pending_events: 3,
        stalled_for: Duration::from_secs(9),
        ..HealthFact::default()
    };
    core.handle_pool_health(&[(endpoint(A), 1, busy)]);
    assert!(last_catalog(&drain(&mut core)).is_none(), "below the bound");
    assert!(core.facts().unready.is_empty());

    let stalled = HealthFact {
        stalled_for: Duration::from_secs(10),
        ..busy
    };
    core.handle_pool_health(&[(endpoint(A), 1, stalled)]);
    let (withheld, revision) = last_catalog(&drain(&mut core)).unwrap();
    assert_eq!(withheld, BTreeSet::from([pool]));
    assert_eq!(revision, 1);
    let facts = core.facts();
    assert_eq!(facts.unready.len(), 1);
    let key = wire::pool_key(&pool);
    assert!(facts.unready[0].contains(&key), "{facts:?}");
    assert!(facts.unready[0].contains("stalled"), "{facts:?}");
    // Still stalled: nothing new to publish.
    core.handle_pool_health(&[(endpoint(A), 1, stalled)]);
    assert!(last_catalog(&drain(&mut core)).is_none());
    // A reading of an old generation changes nothing.
    core.handle_pool_health(&[(
        endpoint(A),
        0,
        HealthFact {
            pending_events: 0,
            stalled_for: Duration::ZERO,
            ..HealthFact::default()
        },
    )]);
    assert!(last_catalog(&drain(&mut core)).is_none());

    core.handle_pool_health(&[(
        endpoint(A),
        1,
        HealthFact {
            pending_events: 0,
            stalled_for: Duration::ZERO,
            ..HealthFact::default()
        },
    )]);
    let (withheld, revision) = last_catalog(&drain(&mut core)).unwrap();
    assert!(withheld.is_empty());
    assert_eq!(
        revision, 2,
        "the advertised revision moves with its content"
    );
    assert!(core.facts().unready.is_empty());
}

#[test]
fn shutdown_retires_everything_including_attaches_in_flight() {
    let mut core = core_with_engines(&[A, B]);
    core.handle_membership(two_endpoints());
    drain(&mut core);
    core.handle_attached(&endpoint(A), 1);
    drain(&mut core);
    core.handle_shutdown();
    let commands = drain(&mut core);
    assert_eq!(
        retires(&commands),
        vec![(endpoint(A), 1, RetirementMode::Fenced)]
    );
    assert!(core.is_settling());
    core.handle_attached(&endpoint(B), 2);
    assert_eq!(
        retires(&drain(&mut core)),
        vec![(endpoint(B), 2, RetirementMode::Graceful)]
    );
    core.handle_retired(&endpoint(A));
    core.handle_retired(&endpoint(B));
    assert!(!core.is_settling());
    assert!(attaches(&drain(&mut core)).is_empty());
}

#[test]
fn sources_cover_every_rank_of_every_worker() {
    let endpoint = membership(&[(1, card(Some(100), 4, 2)), (2, card(None, 0, 1))]);
    let sources = sources_of(&endpoint, None);
    assert_eq!(
        sources,
        vec![
            (SourceId::new(1, 4), 100),
            (SourceId::new(1, 5), 100),
            (SourceId::new(2, 0), DEFAULT_SOURCE_CAPACITY)
        ]
    );
}

#[test]
fn filter_sizing_sums_declared_capacity_with_a_floor_and_a_default() {
    assert_eq!(
        expected_unique_blocks(&membership(&[(1, card(Some(100), 0, 2))])),
        MIN_EXPECTED_UNIQUE_BLOCKS
    );
    assert_eq!(
        expected_unique_blocks(&membership(&[
            (1, card(Some(40_000), 0, 2)),
            (2, card(Some(10_000), 0, 1))
        ])),
        90_000
    );
    assert_eq!(
        expected_unique_blocks(&membership(&[(1, card(None, 0, 1))])),
        DEFAULT_EXPECTED_UNIQUE_BLOCKS
    );
}

#[test]
fn capacities_name_each_worker_rank_range() {
    let capacity = capacities(&membership(&[(7, card(Some(64), 2, 3))]));
    assert_eq!(
        capacity,
        vec![WorkerCapacity {
            worker_id: 7,
            data_parallel_start_rank: 2,
            data_parallel_size: 3,
            total_kv_blocks: Some(64)
        }]
    );
}

/// One health reading of endpoint A's generation 1: `applied` events applied and
/// `unroutable` dropped as unroutable since it started.
fn reading(applied: u64, unroutable: u64) -> [(EndpointId, u64, HealthFact); 1] {
    [(
        endpoint(A),
        1,
        HealthFact {
            events_applied: applied,
            unroutable_events: unroutable,
            ..HealthFact::default()
        },
    )]
}

/// A pool whose events are mostly unroutable (its engine's history was lost) is named by
/// readiness as degraded with the share, and recovers once a window passes with fewer.
#[test]
fn a_pool_of_mostly_unroutable_events_is_degraded_until_a_window_passes() {
    let mut core = one_attached_connected_pool();
    // Healthy traffic: never degraded.
    core.handle_pool_health(&reading(100, 0));
    core.handle_pool_health(&reading(200, 1));
    assert!(core.facts().unready.is_empty());
    assert_eq!(
        last_catalog(&drain(&mut core)),
        None,
        "nothing to re-advertise"
    );
    assert!(
        core.facts()
            .pools
            .values()
            .all(|pool| pool.degraded.is_none())
    );
    // History lost: every new store is unroutable.
    core.handle_pool_health(&reading(205, 60));
    core.handle_pool_health(&reading(210, 120));
    let facts = core.facts();
    let pool = facts.pools.values().next().unwrap();
    // The window (3 intervals, 4 readings) spans 100/0 .. 210/120: 110 applied, 120
    // unroutable.
    assert_eq!(
        pool.degraded,
        Some(Degraded {
            unroutable_events: 120,
            events: 230
        })
    );
    assert_eq!(facts.unready.len(), 1, "{facts:?}");
    assert!(facts.unready[0].contains("degraded"), "{facts:?}");
    // Consumers see it: the catalog is re-advertised under a new revision with the pool's
    // share (120 of 230 = 52 %, advertised as 50 %).
    let (withheld, degraded, degraded_revision) =
        last_catalog_with_coverage(&drain(&mut core)).unwrap();
    assert!(withheld.is_empty());
    assert_eq!(
        degraded,
        BTreeMap::from([(
            pool.pool,
            CoverageFact::Degraded {
                unroutable_percent: 50
            }
        )])
    );
    // A share that moves within its 10 % step re-sends nothing (window 200/1 .. 310/111:
    // 110 of 220).
    core.handle_pool_health(&reading(310, 111));
    assert_eq!(
        core.facts()
            .pools
            .values()
            .next()
            .unwrap()
            .degraded
            .map(|d| d.events),
        Some(220)
    );
    assert_eq!(last_catalog(&drain(&mut core)), None);
    // One that crosses a step does (205/60 .. 400/353: 293 of 488 = 60 %).
    core.handle_pool_health(&reading(400, 353));
    let (_, degraded, revision) = last_catalog_with_coverage(&drain(&mut core)).unwrap();
    assert_eq!(
        degraded,
        BTreeMap::from([(
            pool.pool,
            CoverageFact::Degraded {
                unroutable_percent: 60
            }
        )])
    );
    assert!(revision > degraded_revision);
    // Recovered (e.g. a full replay): a window of applied events clears it.
    for n in 1..=3 {
        core.handle_pool_health(&reading(400 + 100 * n, 353));
    }
    assert!(core.facts().unready.is_empty());
    let (_, degraded, recovered_revision) = last_catalog_with_coverage(&drain(&mut core)).unwrap();
    assert!(degraded.is_empty(), "complete again: {degraded:?}");
    assert!(recovered_revision > revision);
    assert!(
        core.facts()
            .pools
            .values()
            .all(|pool| pool.degraded.is_none())
    );
}

/// A pool one of whose sources is joining (its engine's history being replayed) is
/// recovering: readiness names it and the catalog says so, until the source has joined.
/// A degraded pool is advertised as degraded even while a source joins.
#[test]
fn a_pool_with_a_joining_source_is_recovering_until_it_has_joined() {
    let mut core = one_attached_connected_pool();
    let source = SourceKey::Engine(SourceId::new(1, 0));
    core.handle_source_state(&source, SourceState::Joining);
    let facts = core.facts();
    let pool = facts.pools.values().next().unwrap().clone();
    assert_eq!(pool.joining_sources(), 1);
    assert_eq!(pool.delivering_sources(), 1, "a joining source delivers");
    assert_eq!(facts.unready.len(), 1, "{facts:?}");
    assert!(facts.unready[0].contains("recovering"), "{facts:?}");
    let (_, coverage, joining_revision) = last_catalog_with_coverage(&drain(&mut core)).unwrap();
    assert_eq!(
        coverage,
        BTreeMap::from([(pool.pool, CoverageFact::Recovering)])
    );

    // Joined: complete again, under a newer revision.
    core.handle_source_state(&source, SourceState::Connected);
    assert!(core.facts().unready.is_empty(), "{:?}", core.facts());
    let (_, coverage, joined_revision) = last_catalog_with_coverage(&drain(&mut core)).unwrap();
    assert!(coverage.is_empty());
    assert!(joined_revision > joining_revision);
    // A gap's replay is not a join: nothing to re-advertise.
    core.handle_source_state(&source, SourceState::Replaying);
    assert_eq!(last_catalog(&drain(&mut core)), None);
    assert!(core.facts().unready.is_empty());

    // Degraded wins over recovering.
    core.handle_source_state(&source, SourceState::Joining);
    core.handle_pool_health(&reading(0, 0));
    core.handle_pool_health(&reading(10, 90));
    let (_, coverage, _) = last_catalog_with_coverage(&drain(&mut core)).unwrap();
    assert_eq!(
        coverage,
        BTreeMap::from([(
            pool.pool,
            CoverageFact::Degraded {
                unroutable_percent: 90
            }
        )])
    );
}

fn cleared(commands: &[Command]) -> Vec<(EndpointId, u64, Vec<SourceId>)> {
    commands
        .iter()
        .filter_map(|command| match command {
            Command::ClearSources {
                endpoint,
                generation,
                sources,
            } => Some((endpoint.clone(), *generation, sources.clone())),
            _ => None,
        })
        .collect()
}

/// Endpoint A with the cards of workers 1 and 2 (one rank each) and worker 1's engine
/// configured, attached as generation 1.
fn attached_a_with_two_workers() -> SupervisionCore {
    let mut core = core_with_engines(&[A]);
    core.handle_membership(view(&[
        ("prod/backend/generate/1", card(Some(64), 0, 1)),
        ("prod/backend/generate/2", card(Some(64), 0, 1)),
    ]));
    drain(&mut core);
    core.handle_attached(&endpoint(A), 1);
    drain(&mut core);
    core
}

#[test]
fn a_worker_whose_card_leaves_a_living_pool_has_its_blocks_cleared() {
    let mut core = attached_a_with_two_workers();
    core.handle_membership(view(&[("prod/backend/generate/1", card(Some(64), 0, 1))]));
    let commands = drain(&mut core);
    assert!(retires(&commands).is_empty(), "the pool lives on");
    assert_eq!(
        cleared(&commands),
        vec![(endpoint(A), 1, vec![SourceId::new(2, 0)])]
    );
    // Said once: the next change of anything else clears nothing again.
    core.handle_membership(view(&[("prod/backend/generate/1", card(Some(128), 0, 1))]));
    assert!(cleared(&drain(&mut core)).is_empty());
}

#[test]
fn a_configured_source_outlives_its_card_and_a_departed_advert_is_cleared() {
    let mut core = attached_a_with_two_workers();
    // Worker 3 has no card, only an (advertised) source.
    core.handle_configured_sources(BTreeMap::from([(
        endpoint(A),
        vec![engine(A, 1), engine(A, 3)],
    )]));
    assert!(cleared(&drain(&mut core)).is_empty());
    // Worker 1's card goes, but a source entry still names it: configuration wins.
    core.handle_membership(view(&[("prod/backend/generate/2", card(Some(64), 0, 1))]));
    assert!(cleared(&drain(&mut core)).is_empty());
    // Worker 3's advert goes: it left, and the pool lives on with workers 1 and 2.
    core.handle_configured_sources(BTreeMap::from([(endpoint(A), vec![engine(A, 1)])]));
    let commands = drain(&mut core);
    assert!(retires(&commands).is_empty());
    assert_eq!(
        cleared(&commands),
        vec![(endpoint(A), 1, vec![SourceId::new(3, 0)])]
    );
}

#[test]
fn a_new_generation_starts_with_no_departures() {
    let mut core = attached_a_with_two_workers();
    // A block size change is a new binding: retire, then attach generation 2 with one
    // worker; nothing is cleared (generation 1's blocks go with it).
    core.handle_membership(view(&[(
        "prod/backend/generate/1",
        card_with_block_size(Some(64), 0, 1, 32),
    )]));
    let commands = drain(&mut core);
    assert_eq!(retires(&commands).len(), 1);
    core.handle_retired(&endpoint(A));
    drain(&mut core);
    core.handle_attached(&endpoint(A), 2);
    assert!(cleared(&drain(&mut core)).is_empty());
}

/// One health reading of endpoint A's generation 1 with steady traffic and the given
/// filter fill.
fn fill_reading(applied: u64, owned: u64, resident: u64) -> [(EndpointId, u64, HealthFact); 1] {
    [(
        endpoint(A),
        1,
        HealthFact {
            events_applied: applied,
            fill: FilterFill::of(owned, resident),
            ..HealthFact::default()
        },
    )]
}

/// A pool whose filter could not place some owned blocks is advertised as overfull with
/// the window's largest omitted share, stays ready, and is complete again once a whole
/// window passed without omissions; a degraded pool is advertised as degraded.
#[test]
fn a_pool_with_capacity_omissions_is_advertised_overfull_until_a_window_passes() {
    let mut core = one_attached_connected_pool();
    core.handle_pool_health(&fill_reading(100, 1_000, 1_000));
    assert_eq!(
        last_catalog(&drain(&mut core)),
        None,
        "complete: nothing new"
    );
    // 260 of 1,000 owned blocks did not fit: 26 %, advertised as 30 %.
    core.handle_pool_health(&fill_reading(200, 1_000, 740));
    let facts = core.facts();
    assert!(
        facts.unready.is_empty(),
        "overfull is still ready: {facts:?}"
    );
    let pool = facts.pools.values().next().unwrap().clone();
    assert_eq!(
        pool.overfull,
        Some(FilterFill {
            owned_blocks: 1_000,
            omitted_blocks: 260
        })
    );
    let (_, coverage, overfull_revision) = last_catalog_with_coverage(&drain(&mut core)).unwrap();
    assert_eq!(
        coverage,
        BTreeMap::from([(
            pool.pool,
            CoverageFact::Overfull {
                omitted_percent: 30
            }
        )])
    );
    // Fewer omissions later in the window keep the window's largest share: no re-send.
    core.handle_pool_health(&fill_reading(300, 1_000, 990));
    assert_eq!(last_catalog(&drain(&mut core)), None);
    // A single omission is still overfull (share under 5 %: advertised as 0 %) once the
    // larger one has left the window (3 intervals, 4 readings).
    for applied in [400, 500, 600] {
        core.handle_pool_health(&fill_reading(applied, 1_000, 999));
    }
    let (_, coverage, small_revision) = last_catalog_with_coverage(&drain(&mut core)).unwrap();
    assert_eq!(
        coverage.get(&pool.pool),
        Some(&CoverageFact::Overfull { omitted_percent: 0 })
    );
    assert!(small_revision > overfull_revision);
    // Degraded wins over overfull (one state per pool on the wire).
    let mut degraded = fill_reading(600, 1_000, 999);
    degraded[0].2.unroutable_events = 500;
    core.handle_pool_health(&degraded);
    let (_, coverage, _) = last_catalog_with_coverage(&drain(&mut core)).unwrap();
    assert!(
        matches!(
            coverage.get(&pool.pool),
            Some(CoverageFact::Degraded { .. })
        ),
        "{coverage:?}"
    );
    // A whole window of routable events and no omissions: complete again.
    for applied in [700, 800, 900, 1_000] {
        let mut healthy = fill_reading(applied, 1_000, 1_000);
        healthy[0].2.unroutable_events = 500;
        core.handle_pool_health(&healthy);
    }
    let (_, coverage, _) = last_catalog_with_coverage(&drain(&mut core)).unwrap();
    assert!(coverage.is_empty(), "complete again: {coverage:?}");
    assert!(
        core.facts()
            .pools
            .values()
            .all(|pool| pool.overfull.is_none())
    );
}

#[test]
fn a_pool_is_as_full_as_its_fullest_filter() {
    let pool = FilterFill::of(1_000, 1_000);
    let twin = FilterFill::of(1_000, 900);
    let small_lane = FilterFill::of(10, 5);
    assert_eq!(pool.fuller(twin), twin);
    assert_eq!(twin.fuller(pool), twin);
    assert_eq!(twin.fuller(small_lane), small_lane, "50 % beats 10 %");
    assert_eq!(small_lane.omitted_percent_rounded(), 50);
    assert_eq!(
        FilterFill::default().fuller(FilterFill::of(5, 4)),
        FilterFill::of(5, 4),
        "an empty filter omits nothing"
    );
    assert!(
        !FilterFill::of(3, 7).is_overfull(),
        "more resident than owned never underflows"
    );
    assert_eq!(FilterFill::of(u64::MAX, 0).omitted_percent_rounded(), 100);
    assert_eq!(FilterFill::of(0, 0).omitted_percent_rounded(), 0);
}
