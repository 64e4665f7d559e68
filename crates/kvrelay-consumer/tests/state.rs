//! The sans-IO consumer state driven directly with wire messages: catalog rules,
//! staleness, sequencing, and scoring accuracy against an exact index.

use crate::support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvrelay_ckf::{ExactIndex, PrefixQuery};
use kvrelay_codec::v1::{CoverageState, PoolCoverage, ProducerIdentity};
use kvrelay_consumer::{
    CatalogError, CheckedPoolFrame, ConsumerConfig, ConsumerState, Coverage, FrameOutcome, PoolKey,
    RelayEndpoint, ReplicaState, ResubscribeReason, ScoreRequest, ScoredSwitch, ServedModel,
    StandbyMode, served_base_models,
};
use kvrelay_identity::hashing::HashSalt;
use support::pair::{request, topology};
use support::{PoolSpec, Producer, catalog_of, relay_identity};

fn state(n_relays: usize) -> ConsumerState {
    let relays = (0..n_relays)
        .map(|i| RelayEndpoint::new(&format!("127.0.0.1:{}", 7400 + i), &format!("dc-{i}")))
        .collect();
    ConsumerState::new(&ConsumerConfig::new(relays)).unwrap()
}

/// Subscribes `key` and installs `producer`'s snapshot.
fn install(state: &mut ConsumerState, key: PoolKey, producer: &mut Producer, now: Instant) {
    state.begin_subscription(key).unwrap();
    let frames = producer.snapshot_frames();
    for frame in &frames {
        state.apply_pool_frame(key, frame, now).unwrap();
    }
}

#[test]
fn metadata_only_change_keeps_the_replica_and_its_key() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let mut producer = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&producer]))
        .unwrap();
    let key = change.added[0].0;
    let now = Instant::now();
    install(&mut state, key, &mut producer, now);
    producer.descriptor.registrations[0]
        .aliases
        .push("llama-latest".into());
    let change = state
        .apply_catalog(0, &catalog_of(relay, 2, &[&producer]))
        .unwrap();
    assert!(change.added.is_empty() && change.removed.is_empty());
    assert_eq!(state.pools(now)[0].replica, ReplicaState::Current);
    // The new alias resolves at once.
    let ranking = state
        .score(
            &ScoreRequest {
                model: "llama-latest".into(),
                ..request(vec![1; 8])
            },
            now,
        )
        .unwrap();
    assert_eq!(ranking.model, "llama");
}

#[test]
fn absent_pool_is_withdrawn_with_its_replica() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let mut a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let b = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", relay, 1);
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a, &b]))
        .unwrap();
    let key_a = change
        .added
        .iter()
        .find(|(_, p)| *p == a.descriptor.producer)
        .unwrap()
        .0;
    install(&mut state, key_a, &mut a, Instant::now());
    let change = state
        .apply_catalog(0, &catalog_of(relay, 2, &[&b]))
        .unwrap();
    assert_eq!(change.removed, vec![key_a]);
    assert_eq!(state.pools(Instant::now()).len(), 1);
    assert!(
        state.begin_subscription(key_a).is_err(),
        "a withdrawn key cannot resubscribe"
    );
}

#[test]
fn catalog_revision_going_backwards_is_refused() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    state
        .apply_catalog(0, &catalog_of(relay, 5, &[&a]))
        .unwrap();
    assert_eq!(
        state.apply_catalog(0, &catalog_of(relay, 4, &[&a])),
        Err(CatalogError::RevisionBackwards {
            previous: 5,
            current: 4
        })
    );
}

#[test]
fn repeated_revision_must_repeat_the_same_content() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let b = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", relay, 1);
    state
        .apply_catalog(0, &catalog_of(relay, 3, &[&a]))
        .unwrap();
    assert!(
        state.apply_catalog(0, &catalog_of(relay, 3, &[&a])).is_ok(),
        "heartbeat"
    );
    assert_eq!(
        state.apply_catalog(0, &catalog_of(relay, 3, &[&a, &b])),
        Err(CatalogError::RevisionContentChanged { revision: 3 })
    );
}

#[test]
fn catalog_from_another_relay_incarnation_is_refused() {
    let mut state = state(1);
    let a = Producer::new(
        &PoolSpec::aggregated("alpha", "llama"),
        "dc-0",
        relay_identity(1),
        1,
    );
    state
        .apply_catalog(0, &catalog_of(relay_identity(1), 1, &[&a]))
        .unwrap();
    assert!(matches!(
        state.apply_catalog(0, &catalog_of(relay_identity(2), 2, &[&a])),
        Err(CatalogError::RelayChanged { .. })
    ));
}

#[test]
fn duplicate_pool_ids_refuse_the_whole_catalog() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    assert!(matches!(
        state.apply_catalog(0, &catalog_of(relay, 1, &[&a, &a])),
        Err(CatalogError::DuplicatePool { .. })
    ));
    assert!(state.pools(Instant::now()).is_empty(), "nothing applied");
}

/// A relay names a degraded pool in its catalog's coverage: the pool keeps its key and
/// replica and still answers, and its status and every leg scored on it say degraded
/// with the share, until a later revision says it is complete again.
#[test]
fn a_degraded_pool_answers_and_says_so_until_the_relay_clears_it() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let mut producer = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let key = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&producer]))
        .unwrap()
        .added[0]
        .0;
    let now = Instant::now();
    install(&mut state, key, &mut producer, now);
    assert_eq!(state.pools(now)[0].coverage, Coverage::Complete);

    let mut degraded = catalog_of(relay, 2, &[&producer]);
    degraded.coverage = vec![PoolCoverage {
        pool_id: producer.descriptor.producer.pool_id,
        state: CoverageState::Degraded,
        unroutable_percent: 90,
    }];
    let change = state.apply_catalog(0, &degraded).unwrap();
    assert!(change.added.is_empty() && change.removed.is_empty());
    let status = &state.pools(now)[0];
    assert_eq!(
        status.replica,
        ReplicaState::Current,
        "its replica still answers"
    );
    assert_eq!(
        status.coverage,
        Coverage::Degraded {
            unroutable_percent: 90
        }
    );
    let ranking = state.score(&request(vec![1; 8]), now).unwrap();
    let leg = &ranking.candidates[0].legs[0];
    assert_eq!(leg.coverage.as_str(), "degraded");
    assert_eq!(leg.coverage.unroutable_percent(), 90);
    assert!(
        leg.prefix_blocks.is_some(),
        "a degraded pool is still scored"
    );

    // A state from a newer relay is reported, never taken for complete.
    degraded.revision = 3;
    degraded.coverage[0].state = CoverageState::from_code(7);
    state.apply_catalog(0, &degraded).unwrap();
    let coverage = state.pools(now)[0].coverage;
    assert!(!coverage.is_complete());
    assert_eq!(coverage.as_str(), "unrecognized");

    // An overfull filter's share is its omitted share, not an unroutable one.
    degraded.revision = 4;
    degraded.coverage[0].state = CoverageState::Overfull;
    degraded.coverage[0].unroutable_percent = 40;
    state.apply_catalog(0, &degraded).unwrap();
    let coverage = state.pools(now)[0].coverage;
    assert_eq!(
        coverage,
        Coverage::Overfull {
            omitted_percent: 40
        }
    );
    assert_eq!(
        (coverage.omitted_percent(), coverage.unroutable_percent()),
        (40, 0)
    );
    let ranking = state.score(&request(vec![1; 8]), now).unwrap();
    assert_eq!(ranking.candidates[0].legs[0].coverage, coverage);

    state
        .apply_catalog(0, &catalog_of(relay, 5, &[&producer]))
        .unwrap();
    assert_eq!(state.pools(now)[0].coverage, Coverage::Complete);
}

#[test]
fn malformed_coverage_refuses_the_whole_catalog() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let b = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", relay, 1);
    let mut update = catalog_of(relay, 1, &[&a]);
    // Coverage of a pool the catalog does not list.
    update.coverage = vec![PoolCoverage {
        pool_id: b.descriptor.producer.pool_id,
        state: CoverageState::Degraded,
        unroutable_percent: 50,
    }];
    assert!(matches!(
        state.apply_catalog(0, &update),
        Err(CatalogError::MalformedCoverage(_))
    ));
    assert!(state.pools(Instant::now()).is_empty(), "nothing applied");
}

/// A stalled list naming a listed pool, or one pool twice, refuses the whole catalog with
/// nothing applied; stalled pools count against `max_pools_per_relay` with the listed
/// ones; a well-formed list is reported in the relay's status.
#[test]
fn stalled_pools_are_checked_counted_and_reported() {
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let b = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", relay, 1);
    let listed = a.descriptor.producer.pool_id;
    let withheld = b.descriptor.producer.pool_id;
    for stalled in [vec![listed], vec![withheld, withheld]] {
        let mut state = state(1);
        let mut update = catalog_of(relay, 1, &[&a]);
        update.stalled = stalled;
        assert!(matches!(
            state.apply_catalog(0, &update),
            Err(CatalogError::MalformedStalled(_))
        ));
        assert!(state.pools(Instant::now()).is_empty(), "nothing applied");
    }
    let mut update = catalog_of(relay, 1, &[&a]);
    update.stalled = vec![withheld];
    let mut config = ConsumerConfig::new(vec![RelayEndpoint::new("127.0.0.1:7400", "dc-0")]);
    config.limits.max_pools_per_relay = 1;
    let mut bounded = ConsumerState::new(&config).unwrap();
    assert!(matches!(
        bounded.apply_catalog(0, &update),
        Err(CatalogError::TooManyPools { n_pools: 2, max: 1 })
    ));
    let mut state = state(1);
    state.apply_catalog(0, &update).unwrap();
    assert_eq!(state.pools(Instant::now()).len(), 1);
    assert_eq!(state.relay_statuses()[0].stalled_pools, 1);
}

#[test]
fn malformed_entry_is_quarantined_alone() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let mut bad = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", relay, 1);
    bad.descriptor.query_semantics.kv_block_size = 0;
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a, &bad]))
        .unwrap();
    assert_eq!(change.added.len(), 1);
    assert_eq!(change.newly_quarantined, 1);
    let quarantined = state.quarantined();
    assert!(
        quarantined[0].reason.starts_with("malformed"),
        "{quarantined:?}"
    );
}

#[test]
fn replica_past_the_staleness_bound_is_not_used_until_it_hears_again() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let mut a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    a.store(1, &[1, 2, 3, 4, 5, 6, 7, 8], HashSalt::default());
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a]))
        .unwrap();
    let key = change.added[0].0;
    let t0 = Instant::now();
    install(&mut state, key, &mut a, t0);
    let depth = |state: &ConsumerState, now| {
        state
            .score(&request(vec![1, 2, 3, 4, 5, 6, 7, 8]), now)
            .unwrap()
            .candidates[0]
            .legs[0]
            .prefix_blocks
    };
    assert_eq!(depth(&state, t0), Some(2));
    let later = t0 + Duration::from_secs(31);
    assert_eq!(state.pools(later)[0].replica, ReplicaState::Stale);
    assert_eq!(depth(&state, later), None, "stale replica is not used");
    let sequence = a.filter.sequence();
    assert_eq!(
        state
            .apply_pool_frame(key, &a.heartbeat(sequence), later)
            .unwrap(),
        FrameOutcome::Heartbeat(sequence)
    );
    assert_eq!(depth(&state, later), Some(2), "a heartbeat refreshes it");
}

#[test]
fn heartbeat_at_another_sequence_invalidates_the_replica() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let mut a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let key = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a]))
        .unwrap()
        .added[0]
        .0;
    let now = Instant::now();
    install(&mut state, key, &mut a, now);
    let err = state
        .apply_pool_frame(key, &a.heartbeat(9), now)
        .unwrap_err();
    assert_eq!(
        err.reason,
        ResubscribeReason::Gap,
        "a lost tail delta shows as a gap"
    );
    assert_eq!(state.pools(now)[0].replica, ReplicaState::Missing);
}

#[test]
fn delta_out_of_sequence_is_refused_and_nothing_is_half_applied() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let mut a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let key = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a]))
        .unwrap()
        .added[0]
        .0;
    let now = Instant::now();
    install(&mut state, key, &mut a, now);
    let (_, first) = a.store(1, &(0..16).collect::<Vec<_>>(), HashSalt::default());
    let (_, second) = a.store(1, &(100..116).collect::<Vec<_>>(), HashSalt::default());
    let err = state
        .apply_pool_frame(key, &second.unwrap(), now)
        .unwrap_err();
    assert_eq!(err.reason, ResubscribeReason::Gap);
    assert_eq!(state.pools(now)[0].replica, ReplicaState::Missing);
    // Even the delta that would have fit is refused until a new snapshot.
    assert!(state.apply_pool_frame(key, &first.unwrap(), now).is_err());
    assert_eq!(state.pools(now)[0].replica, ReplicaState::Missing);
    install(&mut state, key, &mut a, now);
    assert_eq!(state.pools(now)[0].sequence, Some(a.filter.sequence()));
}

#[test]
fn frame_of_another_producer_generation_is_refused() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let mut other = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 2);
    let key = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a]))
        .unwrap()
        .added[0]
        .0;
    state.begin_subscription(key).unwrap();
    let frames = other.snapshot_frames();
    let err = state
        .apply_pool_frame(key, &frames[0], Instant::now())
        .unwrap_err();
    assert_eq!(err.reason, ResubscribeReason::ProducerChanged);
}

#[test]
fn frames_checked_outside_the_state_apply_like_frames_applied_whole() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let mut a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let b = Producer::new(&PoolSpec::aggregated("beta", "mistral"), "dc-0", relay, 1);
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a, &b]))
        .unwrap();
    let (key_a, producer_a) = change.added[0];
    let (key_b, _) = change.added[1];
    let now = Instant::now();
    state.begin_subscription(key_a).unwrap();
    state.begin_subscription(key_b).unwrap();
    for frame in &a.snapshot_frames() {
        let checked = CheckedPoolFrame::check(frame, &producer_a).unwrap();
        state.apply_checked_frame(key_a, &checked, now).unwrap();
    }
    let (_, delta) = a.store(1, &(0..16).collect::<Vec<_>>(), HashSalt::default());
    let checked = CheckedPoolFrame::check(&delta.unwrap(), &producer_a).unwrap();
    assert_eq!(checked.sequence(), a.filter.sequence());
    assert_eq!(
        state.apply_checked_frame(key_a, &checked, now).unwrap(),
        FrameOutcome::DeltaApplied(a.filter.sequence())
    );
    let status = |state: &ConsumerState, key: PoolKey| {
        state
            .pools(now)
            .into_iter()
            .find(|status| status.key == key)
            .unwrap()
    };
    assert_eq!(status(&state, key_a).replica, ReplicaState::Current);
    assert_eq!(status(&state, key_a).sequence, Some(a.filter.sequence()));
    // A frame checked for one generation is refused under another's key, and that
    // replica is left unusable rather than half-written.
    let err = state.apply_checked_frame(key_b, &checked, now).unwrap_err();
    assert_eq!(err.reason, ResubscribeReason::ProducerChanged);
    assert_eq!(status(&state, key_b).replica, ReplicaState::Missing);
    assert_eq!(status(&state, key_a).replica, ReplicaState::Current);
    // A frame of another producer fails the check itself.
    let frames = a.snapshot_frames();
    let producer_b = change.added[1].1;
    let err = CheckedPoolFrame::check(&frames[0], &producer_b).unwrap_err();
    assert_eq!(err.reason, ResubscribeReason::ProducerChanged);
}

/// A state with one relay whose catalog admits one pool, `alpha`: the state, the pool's
/// producer, its key and its producer identity.
fn one_pool() -> (ConsumerState, Producer, PoolKey, ProducerIdentity) {
    let mut state = state(1);
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let (key, producer) = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a]))
        .unwrap()
        .added[0];
    (state, a, key, producer)
}

#[test]
fn frames_apply_beside_queries_and_only_a_snapshot_over_an_answering_replica_needs_the_write_lock()
{
    let (mut state, mut a, key, producer) = one_pool();
    let now = Instant::now();
    state.begin_subscription(key).unwrap();
    // A new subscription's lane answers no query until its snapshot is whole, so its
    // chunks go in beside queries.
    let frames = a.snapshot_frames();
    let checked: Vec<CheckedPoolFrame> = frames
        .iter()
        .map(|frame| CheckedPoolFrame::check(frame, &producer).unwrap())
        .collect();
    for frame in &checked {
        state
            .apply_beside_queries(key, frame, now)
            .unwrap()
            .unwrap();
    }
    assert_eq!(state.pools(now)[0].replica, ReplicaState::Current);
    // A suspended replica resumes without a reset: it answered queries, so a snapshot
    // over it needs the write lock (a query may still be reading it).
    state.suspend(key);
    assert!(
        state.begin_subscription(key).unwrap().1.is_some(),
        "resumable"
    );
    assert!(
        state.apply_beside_queries(key, &checked[0], now).is_none(),
        "a snapshot over an answering replica is not written beside queries"
    );
    for frame in &checked {
        state.apply_checked_frame(key, frame, now).unwrap();
    }
    assert_eq!(state.pools(now)[0].replica, ReplicaState::Current);

    // From here on only `&ConsumerState`, as under the consumer's shared lock.
    let shared: &ConsumerState = &state;
    let (_, delta) = a.store(1, &(0..16).collect::<Vec<_>>(), HashSalt::default());
    let delta = CheckedPoolFrame::check(&delta.unwrap(), &producer).unwrap();
    let later = now + Duration::from_secs(1);
    assert_eq!(
        shared
            .apply_beside_queries(key, &delta, later)
            .unwrap()
            .unwrap(),
        FrameOutcome::DeltaApplied(a.filter.sequence())
    );
    let pool = &shared.pools(later)[0];
    assert_eq!(pool.replica, ReplicaState::Current);
    assert_eq!(pool.sequence, Some(a.filter.sequence()));
    assert_eq!(pool.announced_sequence, Some(a.filter.sequence()));
    assert_eq!(
        pool.age,
        Some(Duration::ZERO),
        "heard when the delta applied"
    );
    let ranking = shared.score(&request((0..16).collect()), later).unwrap();
    let leg = &ranking.candidates[0].legs[0];
    assert_eq!(
        leg.prefix_blocks,
        Some(16 / leg.block_size),
        "the delta's blocks are found"
    );

    // A heartbeat at the installed sequence keeps it current; one at another sequence
    // is a gap, and the replica is unusable (invalidated with `&self` too).
    let heartbeat = CheckedPoolFrame::check(&a.heartbeat(a.filter.sequence()), &producer).unwrap();
    assert_eq!(
        shared
            .apply_beside_queries(key, &heartbeat, later)
            .unwrap()
            .unwrap(),
        FrameOutcome::Heartbeat(a.filter.sequence())
    );
    let wrong = CheckedPoolFrame::check(&a.heartbeat(a.filter.sequence() + 5), &producer).unwrap();
    let err = shared
        .apply_beside_queries(key, &wrong, later)
        .unwrap()
        .unwrap_err();
    assert_eq!(err.reason, ResubscribeReason::Gap);
    assert_eq!(shared.pools(later)[0].replica, ReplicaState::Missing);
}

/// Scoring beside applies, with the consumer's locking (scores under the read lock,
/// frames under the upgradable read): a pool's installed prefix is found at full depth and
/// the replica stays current in every score while other chains' deltas keep arriving.
#[test]
fn scores_beside_applies_keep_finding_the_installed_prefix() {
    const DELTAS: u32 = 2_000;
    let (mut state, mut a, key, producer) = one_pool();
    let now = Instant::now();
    let prefix: Vec<u32> = (0..64).collect();
    let (_, _) = a.store(1, &prefix, HashSalt::default());
    install(&mut state, key, &mut a, now);
    let deltas: Vec<CheckedPoolFrame> = (1..=DELTAS)
        .map(|chain| {
            let tokens: Vec<u32> = (0..16).map(|i| chain * 1_000 + i).collect();
            let (_, delta) = a.store(1, &tokens, HashSalt::default());
            CheckedPoolFrame::check(&delta.unwrap(), &producer).unwrap()
        })
        .collect();
    let state = parking_lot::RwLock::new(state);
    let done = std::sync::atomic::AtomicBool::new(false);
    let scoring = std::sync::atomic::AtomicBool::new(false);
    let scores = std::thread::scope(|scope| {
        let scorer = scope.spawn(|| {
            let request = request(prefix.clone());
            let mut scores = 0u32;
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                let ranking = state.read().score(&request, now).unwrap();
                let leg = &ranking.candidates[0].legs[0];
                assert_eq!(leg.replica, ReplicaState::Current);
                assert_eq!(leg.prefix_blocks, Some(64 / leg.block_size));
                scores += 1;
                scoring.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            scores
        });
        // The applies start once the scorer runs (on a loaded machine it may start after
        // 2,000 applies would have finished, and the test would show nothing).
        let deadline = Instant::now() + Duration::from_secs(30);
        while !scoring.load(std::sync::atomic::Ordering::Relaxed) {
            assert!(Instant::now() < deadline, "the scorer never started");
            std::thread::yield_now();
        }
        for delta in &deltas {
            state
                .upgradable_read()
                .apply_beside_queries(key, delta, now)
                .unwrap()
                .unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        scorer.join().unwrap()
    });
    assert!(scores > 0);
    assert_eq!(
        state.read().pools(now)[0].sequence,
        Some(a.filter.sequence())
    );
}

/// A deterministic xorshift generator (no ambient randomness in tests).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Scored prefix depths vs an exact index fed the same events: no false negatives for
/// current replicas, and the false-positive depth inflation is measured.
#[test]
fn scored_depths_never_undercount_an_exact_index_and_inflation_is_rare() {
    const N_POOLS: usize = 16;
    const N_PREFIXES: u32 = 24;
    const BLOCK: u32 = 16;
    let relay = relay_identity(1);
    let mut state = state(1);
    let mut producers: Vec<Producer> = (0..N_POOLS)
        .map(|i| {
            let name: &'static str = Box::leak(format!("pool{i}").into_boxed_str());
            let mut spec = PoolSpec::aggregated(name, "llama");
            spec.block_size = BLOCK;
            spec.expected_blocks = 4096;
            Producer::new(&spec, "dc-0", relay, 1)
        })
        .collect();
    let refs: Vec<&Producer> = producers.iter().collect();
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &refs))
        .unwrap();
    let key_of: HashMap<_, _> = change.added.iter().map(|(k, p)| (*p, *k)).collect();
    let keys: Vec<PoolKey> = producers
        .iter()
        .map(|p| key_of[&p.descriptor.producer])
        .collect();
    let now = Instant::now();
    for (producer, &key) in producers.iter_mut().zip(&keys) {
        install(&mut state, key, producer, now);
    }

    // Exact ownership per pool: canonical hash -> owning workers.
    let mut exact = ExactIndex::new();
    let mut owners: Vec<HashMap<u64, Vec<u64>>> = vec![HashMap::new(); N_POOLS];
    for _ in 0..N_POOLS {
        exact.add_pool();
    }
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let prompt = |rng: &mut Rng| -> Vec<u32> {
        // A shared prefix family, then a random tail: realistic prefix sharing.
        let family = rng.below(u64::from(N_PREFIXES)) as u32;
        let shared = 4 + rng.below(24) as u32;
        let tail = rng.below(24) as u32;
        let mut tokens: Vec<u32> = (0..shared * BLOCK)
            .map(|i| family * 1_000_000 + i)
            .collect();
        let salt = rng.next() as u32;
        tokens.extend((0..tail * BLOCK).map(|i| salt.wrapping_add(i)));
        tokens
    };

    let (mut checks, mut inflated, mut inflated_blocks, mut under) = (0u64, 0u64, 0u64, 0u64);
    for round in 0..2000 {
        // Mutate: store a prompt on a random worker of a random pool, sometimes clear one.
        let pool = rng.below(N_POOLS as u64) as usize;
        let worker = rng.below(4);
        if round % 25 == 24 {
            if let Some(frame) = producers[pool].clear(worker) {
                state.apply_pool_frame(keys[pool], &frame, now).unwrap();
            }
            owners[pool].retain(|hash, ws| {
                ws.retain(|w| *w != worker);
                if ws.is_empty() {
                    exact.remove(pool, *hash);
                }
                !ws.is_empty()
            });
        } else {
            let tokens = prompt(&mut rng);
            let (hashes, frame) = producers[pool].store(worker, &tokens, HashSalt::default());
            if let Some(frame) = frame {
                state.apply_pool_frame(keys[pool], &frame, now).unwrap();
            }
            for hash in hashes {
                exact.insert(pool, hash);
                let ws = owners[pool].entry(hash).or_default();
                if !ws.contains(&worker) {
                    ws.push(worker);
                }
            }
        }
        // Query: a fresh prompt from a known family against every pool.
        let tokens = prompt(&mut rng);
        let hashes =
            kvrelay_identity::hashing::sequence_hashes(&kvrelay_identity::hashing::block_hashes(
                &tokens,
                BLOCK,
                kvrelay_identity::KvQueryHashFormat::DynamoStandardV1,
                HashSalt::default(),
            ));
        let truth = exact.prefix_depths(&hashes);
        let ranking = state.score(&request(tokens), now).unwrap();
        for candidate in &ranking.candidates {
            let leg = &candidate.legs[0];
            let pool = producers
                .iter()
                .position(|p| {
                    *leg.endpoint
                        == *format!("prod.{}.generate", p.descriptor.serving_endpoint.component)
                })
                .unwrap();
            let scored = leg.prefix_blocks.expect("every replica is current");
            let exact_depth = truth.depth(pool).unwrap();
            checks += 1;
            if scored < exact_depth {
                under += 1;
            } else if scored > exact_depth {
                inflated += 1;
                inflated_blocks += u64::from(scored - exact_depth);
            }
        }
    }
    println!(
        "accuracy: {checks} pool checks, {under} under-counts, {inflated} inflated ({:.4}%), {inflated_blocks} extra blocks",
        100.0 * inflated as f64 / checks as f64
    );
    assert_eq!(under, 0, "no false negatives for current replicas");
    assert!(inflated * 100 <= checks, "inflation stays below 1%");
}

#[test]
fn lost_topology_makes_excluded_candidates_unknown_again() {
    use kvrelay_codec::v1::ReadinessState;
    use kvrelay_consumer::CandidateReadiness;
    let mut state = state(1);
    let relay = relay_identity(1);
    let producer = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    state
        .apply_catalog(0, &catalog_of(relay, 1, &[&producer]))
        .unwrap();
    let now = Instant::now();
    assert_eq!(
        state.apply_topology(0, &topology(relay, ReadinessState::Unavailable)),
        0
    );
    let ranking = state.score(&request(vec![1; 8]), now).unwrap();
    assert!(ranking.candidates.is_empty());
    assert_eq!(ranking.n_not_ready, 1);

    state.clear_topology(0);
    let ranking = state.score(&request(vec![1; 8]), now).unwrap();
    assert_eq!(ranking.candidates[0].readiness, CandidateReadiness::Unknown);
    assert_eq!(ranking.n_not_ready, 0);
}

#[test]
fn topology_from_another_relay_incarnation_is_ignored() {
    use kvrelay_codec::v1::ReadinessState;
    use kvrelay_consumer::CandidateReadiness;
    let mut state = state(1);
    let relay = relay_identity(1);
    let producer = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    state
        .apply_catalog(0, &catalog_of(relay, 1, &[&producer]))
        .unwrap();
    state.apply_topology(0, &topology(relay_identity(2), ReadinessState::Unavailable));
    let ranking = state.score(&request(vec![1; 8]), Instant::now()).unwrap();
    assert_eq!(ranking.candidates[0].readiness, CandidateReadiness::Unknown);
}

#[test]
fn served_base_models_lists_each_base_model_and_block_size_once_without_adapters() {
    let relay = relay_identity(1);
    let llama = Producer::new(
        &PoolSpec {
            adapter: Some("sql"),
            ..PoolSpec::aggregated("llama-a", "llama")
        },
        "dc-0",
        relay,
        1,
    );
    let llama_again = Producer::new(&PoolSpec::aggregated("llama-b", "llama"), "dc-0", relay, 1);
    let llama_wide = Producer::new(
        &PoolSpec {
            block_size: 16,
            ..PoolSpec::aggregated("llama-c", "llama")
        },
        "dc-0",
        relay,
        1,
    );
    let qwen = Producer::new(&PoolSpec::aggregated("qwen", "qwen"), "dc-0", relay, 1);
    let catalog = catalog_of(relay, 1, &[&qwen, &llama, &llama_again, &llama_wide]);
    let served = |model: &str, kv_block_size| ServedModel {
        model: model.to_owned(),
        kv_block_size,
    };
    assert_eq!(
        served_base_models(&catalog),
        vec![served("llama", 4), served("llama", 16), served("qwen", 4)]
    );
}

/// A state whose relays may each hold `budget` bytes of replicas.
fn state_with_budget(n_relays: usize, budget: u64) -> ConsumerState {
    let relays = (0..n_relays)
        .map(|i| RelayEndpoint::new(&format!("127.0.0.1:{}", 7400 + i), &format!("dc-{i}")))
        .collect();
    let mut config = ConsumerConfig::new(relays);
    config.limits.max_replica_bytes_per_relay = budget;
    ConsumerState::new(&config).unwrap()
}

/// Bytes of replica words `producer`'s filter takes.
fn replica_bytes(producer: &Producer) -> u64 {
    producer.descriptor.producer.ckf_format.bucket_count * 8
}

fn key_of(change: &kvrelay_consumer::CatalogChange, producer: &Producer) -> PoolKey {
    change
        .added
        .iter()
        .find(|(_, p)| *p == producer.descriptor.producer)
        .unwrap()
        .0
}

#[test]
fn entry_over_the_replica_budget_is_quarantined_and_the_rest_stay_usable() {
    let relay = relay_identity(1);
    let mut a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let b = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", relay, 1);
    let budget = replica_bytes(&a) + replica_bytes(&b) - 1;
    let mut state = state_with_budget(1, budget);
    a.store(1, &[1, 2, 3, 4, 5, 6, 7, 8], HashSalt::default());
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a, &b]))
        .unwrap();
    assert_eq!(change.added.len(), 1, "only alpha fits");
    assert_eq!((change.newly_quarantined, change.newly_over_budget), (1, 1));
    let quarantined = state.quarantined();
    assert_eq!(quarantined.len(), 1);
    assert_eq!(quarantined[0].entry, state_pool_label(&b));
    let reason = &quarantined[0].reason;
    assert!(reason.starts_with("over budget"), "{reason}");
    assert!(
        reason.contains(&format!("needs {} bytes", replica_bytes(&b)))
            && reason.contains(&format!("max_replica_bytes_per_relay {budget}")),
        "{reason}"
    );
    let now = Instant::now();
    install(&mut state, key_of(&change, &a), &mut a, now);
    let ranking = state
        .score(&request(vec![1, 2, 3, 4, 5, 6, 7, 8]), now)
        .unwrap();
    assert_eq!(ranking.candidates.len(), 1);
    assert_eq!(ranking.candidates[0].legs[0].prefix_blocks, Some(2));
}

/// The pool id text of `producer`, as catalogs and quarantine list it.
fn state_pool_label(producer: &Producer) -> String {
    producer.descriptor.pool_id().to_string()
}

#[test]
fn admitted_replica_keeps_its_place_when_a_new_entry_would_take_the_relay_over_budget() {
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let mut b = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", relay, 1);
    let mut state = state_with_budget(1, replica_bytes(&b));
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&b]))
        .unwrap();
    let key_b = key_of(&change, &b);
    let now = Instant::now();
    install(&mut state, key_b, &mut b, now);
    // alpha comes first in catalog order, but beta was admitted before: alpha waits.
    let change = state
        .apply_catalog(0, &catalog_of(relay, 2, &[&a, &b]))
        .unwrap();
    assert!(
        change.added.is_empty() && change.removed.is_empty(),
        "{change:?}"
    );
    assert_eq!(change.newly_over_budget, 1);
    assert_eq!(state.quarantined()[0].entry, state_pool_label(&a));
    assert_eq!(state.pools(now)[0].replica, ReplicaState::Current);
}

#[test]
fn repeated_revision_with_an_entry_over_budget_is_a_heartbeat() {
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let b = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", relay, 1);
    let c = Producer::new(&PoolSpec::aggregated("gamma", "llama"), "dc-0", relay, 1);
    let mut state = state_with_budget(1, replica_bytes(&a) * 2);
    let catalog = catalog_of(relay, 3, &[&a, &b, &c]);
    let first = state.apply_catalog(0, &catalog).unwrap();
    assert_eq!((first.added.len(), first.newly_over_budget), (2, 1));
    let again = state.apply_catalog(0, &catalog).unwrap();
    assert!(
        again.added.is_empty() && again.removed.is_empty(),
        "{again:?}"
    );
    assert_eq!((again.newly_quarantined, again.newly_over_budget), (0, 0));
}

#[test]
fn entry_over_budget_is_admitted_once_its_relay_has_room() {
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let b = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", relay, 1);
    let mut state = state_with_budget(1, replica_bytes(&a));
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a, &b]))
        .unwrap();
    assert_eq!(change.newly_over_budget, 1);
    let change = state
        .apply_catalog(0, &catalog_of(relay, 2, &[&b]))
        .unwrap();
    assert_eq!(change.added.len(), 1, "{change:?}");
    assert_eq!(change.added[0].1, b.descriptor.producer);
    assert!(state.quarantined().is_empty());
}

#[test]
fn replica_budget_is_per_relay() {
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let b = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-1", relay, 1);
    let mut state = state_with_budget(2, replica_bytes(&a));
    for (idx, producer) in [&a, &b].into_iter().enumerate() {
        let change = state
            .apply_catalog(idx, &catalog_of(relay, 1, &[producer]))
            .unwrap();
        assert_eq!(
            (change.added.len(), change.newly_over_budget),
            (1, 0),
            "relay {idx}"
        );
    }
}

/// A relay's pools must be of one DC, and no DC is followed through two relays: a relay
/// presenting another DC's pools gets them quarantined, not labelled with its own DC.
#[test]
fn pools_of_another_dc_are_quarantined_never_counted_twice() {
    let mut state = state(2);
    let relay = relay_identity(1);
    let a = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let b = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-1", relay, 1);
    let a_again = Producer::new(&PoolSpec::aggregated("gamma", "llama"), "dc-0", relay, 1);
    // Relay 0 serves dc-0 (pinned by its first catalog); a dc-1 pool in it is foreign.
    let change = state
        .apply_catalog(0, &catalog_of(relay, 1, &[&a, &b]))
        .unwrap();
    assert_eq!(change.added.len(), 1, "{change:?}");
    assert_eq!(change.added[0].1, a.descriptor.producer);
    let quarantined = state.quarantined();
    assert_eq!(quarantined.len(), 1, "{quarantined:?}");
    assert!(
        quarantined[0].reason.starts_with("foreign dc"),
        "{quarantined:?}"
    );
    // Relay 1 presents dc-0's pools (another relay already serves dc-0): quarantined.
    let change = state
        .apply_catalog(1, &catalog_of(relay, 1, &[&a_again]))
        .unwrap();
    assert!(change.added.is_empty(), "{change:?}");
    assert!(
        state
            .quarantined()
            .iter()
            .any(|entry| entry.dc == "dc-1" && entry.reason.contains("already serves")),
        "{:?}",
        state.quarantined()
    );
    // Relay 1 serving its own DC is admitted.
    let change = state
        .apply_catalog(1, &catalog_of(relay, 2, &[&b]))
        .unwrap();
    assert_eq!(change.added.len(), 1, "{change:?}");
    let ranking = state.score(&request(vec![1; 8]), Instant::now()).unwrap();
    let mut dcs: Vec<&str> = ranking.candidates.iter().map(|c| c.dc.as_ref()).collect();
    dcs.sort_unstable();
    assert_eq!(dcs, ["dc-0", "dc-1"], "each DC once");
}

/// A hot pair (`dc-0` at A and B, followed all along) and a lone relay (`dc-1`).
fn hot_pair() -> ConsumerState {
    let mut config = ConsumerConfig::new(vec![
        RelayEndpoint::new("127.0.0.1:7400", "dc-0").with_standby(vec!["127.0.0.1:7401".into()]),
        RelayEndpoint::new("127.0.0.1:7500", "dc-1"),
    ]);
    config.standby = StandbyMode::Hot;
    ConsumerState::new(&config).unwrap()
}

/// The keys of the pools scored now.
fn scored_keys(state: &ConsumerState, now: Instant) -> Vec<PoolKey> {
    state.pools(now).iter().map(|pool| pool.key).collect()
}

/// The tokens both relays of the hot pair saw stored.
fn hot_tokens() -> Vec<u32> {
    (0..64).collect()
}

/// A hot pair whose relays A and B each publish the same pool `alpha` of `dc-0`, holding
/// [`hot_tokens`] (both saw the same engine events), with both catalogs applied and no
/// replica installed: the producers and their keys.
fn hot_pair_with_one_pool() -> (ConsumerState, [Producer; 2], [PoolKey; 2]) {
    let mut state = hot_pair();
    let spec = PoolSpec::aggregated("alpha", "llama");
    let producers = [1, 2].map(|incarnation| {
        let mut producer = Producer::new(&spec, "dc-0", relay_identity(incarnation), 1);
        producer.store(1, &hot_tokens(), HashSalt::default());
        producer
    });
    let keys = [0, 1].map(|relay| {
        let catalog = catalog_of(relay_identity(relay as u64 + 1), 1, &[&producers[relay]]);
        state.apply_catalog(relay, &catalog).unwrap().added[0].0
    });
    assert!(state.quarantined().is_empty(), "one DC's two relays");
    (state, producers, keys)
}

/// The DC's depth for [`hot_tokens`], asserting the DC is ranked once.
fn hot_depth(state: &ConsumerState, now: Instant) -> Option<u32> {
    let ranking = state.score(&request(hot_tokens()), now).unwrap();
    assert_eq!(ranking.candidates.len(), 1, "the DC is counted once");
    ranking.candidates[0].legs[0].prefix_blocks
}

#[test]
fn a_hot_pair_scores_one_relay_and_switches_to_the_other_at_once_without_flapping() {
    let layout = hot_pair();
    let addrs: Vec<&str> = layout.relays().iter().map(|r| r.addr.as_str()).collect();
    assert_eq!(
        addrs,
        ["127.0.0.1:7400", "127.0.0.1:7401", "127.0.0.1:7500"]
    );
    assert_eq!(
        (0..3).map(|r| layout.relay_dc(r)).collect::<Vec<_>>(),
        [Some(0), Some(0), Some(1)]
    );
    let (mut state, [mut a, mut b], [key_a, key_b]) = hot_pair_with_one_pool();
    let (at_a, at_b) = (relay_identity(1), relay_identity(2));
    let now = Instant::now();
    install(&mut state, key_a, &mut a, now);
    install(&mut state, key_b, &mut b, now);
    let depth = |state: &ConsumerState| hot_depth(state, now);
    let full = depth(&state);
    assert!(full.is_some_and(|blocks| blocks > 0));
    assert_eq!(scored_keys(&state, now), [key_a], "A first");
    assert_eq!(state.poll_switch(), None);
    let scored: Vec<bool> = state.relay_statuses().iter().map(|r| r.scored).collect();
    assert_eq!(scored, [true, false, true]);

    // A's connection breaks: B's replica answers at once, nothing to install.
    state.suspend_relay(0);
    assert_eq!(scored_keys(&state, now), [key_b]);
    assert_eq!(state.pools(now)[0].replica, ReplicaState::Current);
    assert_eq!(depth(&state), full);
    assert_eq!(
        state.poll_switch(),
        Some(ScoredSwitch {
            dc: 0,
            from: 0,
            to: 1
        })
    );
    assert_eq!(state.poll_switch(), None, "taken once");

    // A comes back: B stays scored (two fit relays never swap).
    state.apply_catalog(0, &catalog_of(at_a, 1, &[&a])).unwrap();
    assert_eq!(scored_keys(&state, now), [key_b]);
    assert_eq!(state.poll_switch(), None);

    // B goes silent: A is scored; B heard again: A stays.
    state.set_silent(1, true);
    assert_eq!(scored_keys(&state, now), [key_a]);
    state.set_silent(1, false);
    assert_eq!(scored_keys(&state, now), [key_a]);
    assert_eq!(
        state.poll_switch(),
        Some(ScoredSwitch {
            dc: 0,
            from: 1,
            to: 0
        })
    );

    // A withholds a stalled pool and B does not: B. Both stalled: no move back.
    let other = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", at_a, 1);
    let mut stalled = catalog_of(at_a, 2, &[&a]);
    stalled.stalled = vec![other.descriptor.producer.pool_id];
    state.apply_catalog(0, &stalled).unwrap();
    assert_eq!(scored_keys(&state, now), [key_b]);
    let mut stalled_b = catalog_of(at_b, 2, &[&b]);
    stalled_b.stalled = vec![other.descriptor.producer.pool_id];
    state.apply_catalog(1, &stalled_b).unwrap();
    assert_eq!(scored_keys(&state, now), [key_b]);
    // Both relays gone: the DC is out of the ranking, never scored through a broken one.
    state.suspend_relay(1);
    state.reset_relay(0);
    assert!(scored_keys(&state, now).is_empty());
}

#[test]
fn a_hot_standby_serving_another_dc_is_quarantined_and_a_dc_is_never_served_by_two_dcs() {
    let mut state = hot_pair();
    let spec = PoolSpec::aggregated("alpha", "llama");
    let a = Producer::new(&spec, "dc-0", relay_identity(1), 1);
    state
        .apply_catalog(0, &catalog_of(relay_identity(1), 1, &[&a]))
        .unwrap();
    // B, configured as dc-0's standby, presents dc-9's pools.
    let foreign = Producer::new(&spec, "dc-9", relay_identity(2), 1);
    let change = state
        .apply_catalog(1, &catalog_of(relay_identity(2), 1, &[&foreign]))
        .unwrap();
    assert!(change.added.is_empty());
    assert_eq!(change.newly_quarantined, 1);
    // dc-1's relay presents dc-0's pools (which A and B serve).
    let copy = Producer::new(&spec, "dc-0", relay_identity(3), 1);
    let change = state
        .apply_catalog(2, &catalog_of(relay_identity(3), 1, &[&copy]))
        .unwrap();
    assert!(change.added.is_empty());
    let reasons: Vec<String> = state.quarantined().into_iter().map(|q| q.reason).collect();
    assert_eq!(reasons.len(), 2, "{reasons:?}");
    assert!(reasons[1].contains("already serves"), "{reasons:?}");
    assert_eq!(state.pools(Instant::now()).len(), 1);
}

#[test]
fn a_hot_pair_whose_standby_answers_first_starts_there_without_a_failover() {
    let mut state = hot_pair();
    let spec = PoolSpec::aggregated("alpha", "llama");
    let b = Producer::new(&spec, "dc-0", relay_identity(2), 1);
    let key_b = state
        .apply_catalog(1, &catalog_of(relay_identity(2), 1, &[&b]))
        .unwrap()
        .added[0]
        .0;
    assert_eq!(scored_keys(&state, Instant::now()), [key_b]);
    assert_eq!(state.poll_switch(), None, "the start is not a failover");
    let a = Producer::new(&spec, "dc-0", relay_identity(1), 1);
    state
        .apply_catalog(0, &catalog_of(relay_identity(1), 1, &[&a]))
        .unwrap();
    assert_eq!(scored_keys(&state, Instant::now()), [key_b], "no move back");
    // From now on a move is a failover.
    state.suspend_relay(1);
    assert_eq!(
        state.poll_switch(),
        Some(ScoredSwitch {
            dc: 0,
            from: 1,
            to: 0
        })
    );
}

#[test]
fn a_hot_standbys_replica_answers_for_a_scored_pool_that_cannot() {
    let (mut state, [mut a, mut b], [key_a, key_b]) = hot_pair_with_one_pool();
    let at_a = relay_identity(1);
    let now = Instant::now();
    install(&mut state, key_a, &mut a, now);
    let depth = |state: &ConsumerState| hot_depth(state, now);
    let full = depth(&state);
    assert!(full.is_some_and(|blocks| blocks > 0));
    assert!(!state.pools(now)[0].through_standby);

    // A's replica of the pool is dropped (a resubscription) while B's is not installed
    // yet: nothing answers.
    state.invalidate(key_a);
    assert_eq!(depth(&state), None);
    assert_ne!(state.pools(now)[0].replica, ReplicaState::Current);
    // B's replica is current: it answers for A's, the DC still scored through A.
    install(&mut state, key_b, &mut b, now);
    assert_eq!(depth(&state), full);
    let pool = &state.pools(now)[0];
    assert_eq!((pool.key, pool.replica), (key_a, ReplicaState::Current));
    assert!(pool.through_standby);
    // A's own replica is back: it answers again.
    install(&mut state, key_a, &mut a, now);
    assert_eq!(depth(&state), full);
    assert!(!state.pools(now)[0].through_standby);

    // On demand there is no second replica to answer.
    let mut config = ConsumerConfig::new(vec![
        RelayEndpoint::new("127.0.0.1:7400", "dc-0").with_standby(vec!["127.0.0.1:7401".into()]),
    ]);
    config.standby = StandbyMode::OnDemand;
    let mut on_demand = ConsumerState::new(&config).unwrap();
    assert_eq!(on_demand.relays().len(), 1);
    let key = on_demand
        .apply_catalog(0, &catalog_of(at_a, 1, &[&a]))
        .unwrap()
        .added[0]
        .0;
    install(&mut on_demand, key, &mut a, now);
    on_demand.invalidate(key);
    assert_eq!(depth(&on_demand), None);
}

/// What happens to one relay of a hot DC.
#[derive(Debug, Clone)]
enum HotStep {
    /// A catalog (listing `alpha`; naming a stalled pool or not).
    Catalog { relay: usize, stalled: bool },
    /// Its connection broke (view kept, suspended).
    Suspend { relay: usize },
    /// Its view was dropped (a restart, or held past the resume hold).
    Reset { relay: usize },
    /// Its load windows stopped or came back.
    Silent { relay: usize, silent: bool },
}

fn hot_step(relays: usize) -> impl proptest::strategy::Strategy<Value = HotStep> {
    use proptest::prelude::*;
    prop_oneof![
        3 => (0..relays, any::<bool>()).prop_map(|(relay, stalled)| HotStep::Catalog { relay, stalled }),
        2 => (0..relays).prop_map(|relay| HotStep::Suspend { relay }),
        1 => (0..relays).prop_map(|relay| HotStep::Reset { relay }),
        2 => (0..relays, any::<bool>()).prop_map(|(relay, silent)| HotStep::Silent { relay, silent }),
    ]
}

/// The model of one relay's fitness to be scored.
#[derive(Debug, Clone, Copy, Default)]
struct HotModel {
    catalog: bool,
    suspended: bool,
    silent: bool,
    stalled: bool,
}

impl HotModel {
    fn fitness(self) -> u8 {
        if !self.catalog || self.suspended {
            0
        } else if self.silent {
            1
        } else if self.stalled {
            2
        } else {
            3
        }
    }
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

    /// A DC followed through three hot relays, under random catalogs, breaks, resets,
    /// silences and stalls: exactly one relay is scored, always one of the fittest; the
    /// scored relay moves only when another is strictly fitter (never between equals);
    /// the DC's pools are that relay's, listed once, and none while it is unfit; and
    /// every move after the DC was first scored through a fit relay is reported once.
    #[test]
    fn a_hot_dc_is_scored_through_one_of_its_fittest_relays_and_never_flaps(
        steps in proptest::collection::vec(hot_step(3), 1..80),
    ) {
        let mut config = ConsumerConfig::new(vec![RelayEndpoint::new("127.0.0.1:7400", "dc-0")
            .with_standby(vec!["127.0.0.1:7401".into(), "127.0.0.1:7402".into()])]);
        config.standby = StandbyMode::Hot;
        let mut state = ConsumerState::new(&config).unwrap();
        let spec = PoolSpec::aggregated("alpha", "llama");
        let producers: Vec<Producer> = (1..=3)
            .map(|incarnation| Producer::new(&spec, "dc-0", relay_identity(incarnation), 1))
            .collect();
        let withheld = Producer::new(&PoolSpec::aggregated("beta", "llama"), "dc-0", relay_identity(1), 1)
            .descriptor
            .producer
            .pool_id;
        let mut model = [HotModel::default(); 3];
        let mut revisions = [0u64; 3];
        let mut scored = 0usize;
        let mut settled = false;
        for step in steps {
            match step {
                HotStep::Catalog { relay, stalled } => {
                    revisions[relay] += 1;
                    let mut update = catalog_of(relay_identity(relay as u64 + 1), revisions[relay], &[&producers[relay]]);
                    if stalled {
                        update.stalled = vec![withheld];
                    }
                    state.apply_catalog(relay, &update).unwrap();
                    model[relay] = HotModel { catalog: true, suspended: false, stalled, ..model[relay] };
                }
                HotStep::Suspend { relay } => {
                    state.suspend_relay(relay);
                    model[relay].suspended = true;
                    model[relay].silent = false;
                }
                HotStep::Reset { relay } => {
                    state.reset_relay(relay);
                    model[relay] = HotModel::default();
                }
                HotStep::Silent { relay, silent } => {
                    state.set_silent(relay, silent);
                    model[relay].silent = silent;
                }
            }
            let best = model.iter().map(|m| m.fitness()).max().unwrap_or(0);
            let flags: Vec<bool> = state.relay_statuses().iter().map(|r| r.scored).collect();
            proptest::prop_assert_eq!(flags.iter().filter(|f| **f).count(), 1);
            let now_scored = flags.iter().position(|f| *f).unwrap();
            proptest::prop_assert_eq!(model[now_scored].fitness(), best, "{:?}", model);
            if model[scored].fitness() == best {
                proptest::prop_assert_eq!(now_scored, scored, "moved between equals: {:?}", model);
            }
            let switch = state.poll_switch();
            if now_scored != scored && settled {
                proptest::prop_assert_eq!(switch, Some(ScoredSwitch { dc: 0, from: scored, to: now_scored }));
            } else {
                proptest::prop_assert_eq!(switch, None);
            }
            proptest::prop_assert_eq!(state.poll_switch(), None);
            scored = now_scored;
            settled |= best > 0;
            let pools = state.pools(Instant::now());
            if best > 0 {
                proptest::prop_assert_eq!(pools.len(), 1);
                proptest::prop_assert_eq!(pools[0].producer, producers[scored].descriptor.producer);
            } else {
                proptest::prop_assert!(pools.is_empty());
            }
        }
    }
}

/// A catalog naming `lane` as `pool`'s host lane (`block_size` tokens per lane block).
fn with_host_lane(
    mut catalog: kvrelay_codec::v1::CatalogUpdate,
    pool: &Producer,
    lane: &Producer,
    block_size: u32,
) -> kvrelay_codec::v1::CatalogUpdate {
    catalog.tier_lanes = vec![kvrelay_codec::v1::TierLaneDescriptor {
        pool_id: pool.descriptor.producer.pool_id,
        tier: 1,
        block_size,
        producer: lane.descriptor.producer,
    }];
    catalog
}

#[test]
fn a_pools_host_lane_is_followed_scored_and_dropped_with_the_catalog() {
    let mut state = state(1);
    let relay = relay_identity(1);
    let mut pool = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let mut host = Producer::new(
        &PoolSpec::aggregated("alpha-host", "llama"),
        "dc-0",
        relay,
        2,
    );
    let catalog = with_host_lane(catalog_of(relay, 1, &[&pool]), &pool, &host, 4);
    let change = state.apply_catalog(0, &catalog).unwrap();
    assert_eq!(
        change.added.len(),
        2,
        "the pool and its lane are subscribed"
    );
    let pool_key = key_of(&change, &pool);
    let lane_key = key_of(&change, &host);
    let now = Instant::now();
    // The device holds 2 blocks of a 4-block prompt; host memory all 4.
    let tokens: Vec<u32> = (0..16).collect();
    pool.store(1, &tokens[..8], HashSalt::default());
    host.store(1, &tokens, HashSalt::default());
    install(&mut state, pool_key, &mut pool, now);
    install(&mut state, lane_key, &mut host, now);
    let ranking = state.score(&request(tokens.clone()), now).unwrap();
    let leg = &ranking.candidates[0].legs[0];
    assert_eq!((leg.prefix_blocks, leg.host_blocks), (Some(2), Some(2)));
    // Only pools are listed; the lane rides with its pool.
    assert_eq!(state.pools(now).len(), 1);
    let lanes = &state.pools(now)[0].tier_lanes;
    assert_eq!(lanes.len(), 1);
    assert_eq!(
        (lanes[0].tier, lanes[0].key, lanes[0].replica),
        (
            kvrelay_ckf::CacheTier::Host,
            lane_key,
            ReplicaState::Current
        )
    );
    assert_eq!(state.relay_keys(0).len(), 2);

    // The same catalog again keeps both keys; without the lane, the lane is dropped.
    let change = state.apply_catalog(0, &catalog).unwrap();
    assert!(change.added.is_empty() && change.removed.is_empty());
    let change = state
        .apply_catalog(0, &catalog_of(relay, 2, &[&pool]))
        .unwrap();
    assert_eq!(change.removed, vec![lane_key]);
    let ranking = state.score(&request(tokens.clone()), now).unwrap();
    assert_eq!(ranking.candidates[0].legs[0].host_blocks, None);

    // Lanes that break the rules (a block size that is no multiple of the pool's) are
    // dropped whole and said so; the pool stays.
    let bad = with_host_lane(catalog_of(relay, 3, &[&pool]), &pool, &host, 6);
    let change = state.apply_catalog(0, &bad).unwrap();
    assert!(change.added.is_empty() && change.removed.is_empty());
    assert_eq!(change.newly_quarantined, 1);
    assert!(
        state.quarantined()[0].reason.contains("tier lane"),
        "{:?}",
        state.quarantined()
    );
}

#[test]
fn a_consumer_that_follows_device_memory_only_ignores_lanes() {
    let relays = vec![RelayEndpoint::new("127.0.0.1:7400", "dc-0")];
    let mut config = ConsumerConfig::new(relays);
    config.follow_tier_lanes = false;
    let mut state = ConsumerState::new(&config).unwrap();
    let relay = relay_identity(1);
    let pool = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let host = Producer::new(
        &PoolSpec::aggregated("alpha-host", "llama"),
        "dc-0",
        relay,
        2,
    );
    let catalog = with_host_lane(catalog_of(relay, 1, &[&pool]), &pool, &host, 4);
    let change = state.apply_catalog(0, &catalog).unwrap();
    assert_eq!(change.added.len(), 1);
    assert!(state.quarantined().is_empty());
}
