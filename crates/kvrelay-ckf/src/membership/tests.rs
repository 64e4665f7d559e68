//! A twin fed a v1 pool's membership log against a dense `PoolFilter` fed the pool's
//! events, and against the exact owned set.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;
use crate::event::{EventPayload, RemovedBlocks, RouterEvent, SourceId, StoredBlocks};
use crate::format::FilterDensity;
use crate::replica::Replica;
use crate::{ApplyOutcome, PoolFilter};

fn dense(expected: u64) -> CkfConfig {
    CkfConfig::new(expected).with_density(FilterDensity::Dense {
        load_percent: 95,
        size_classes_per_octave: 0,
    })
}

#[derive(Debug, Clone)]
enum Op {
    Store(u8, Vec<(u64, u64)>),
    Remove(u8, Vec<u64>),
    Clear(u8),
    Restore(u8, Vec<(u64, u64)>),
    Chain(u8, Vec<u64>),
}

fn op() -> impl Strategy<Value = Op> {
    let mapping = (0u64..48, 0u64..64);
    prop_oneof![
        4 => (0u8..3, prop::collection::vec(mapping.clone(), 1..12)).prop_map(|(s, m)| Op::Store(s, m)),
        2 => (0u8..3, prop::collection::vec(0u64..48, 1..12)).prop_map(|(s, ids)| Op::Remove(s, ids)),
        1 => (0u8..3).prop_map(Op::Clear),
        1 => (0u8..3, prop::collection::vec(mapping, 0..16)).prop_map(|(s, m)| Op::Restore(s, m)),
        1 => (0u8..3, prop::collection::vec(0u64..64, 1..8)).prop_map(|(s, t)| Op::Chain(s, t)),
    ]
}

fn run(filter: &mut PoolFilter, op: &Op) -> Result<ApplyOutcome, ApplyError> {
    let source = |s: u8| SourceId::new(u64::from(s), 0);
    match op {
        Op::Store(s, mappings) => filter.store_canonical(source(*s), mappings),
        Op::Remove(s, ids) => filter.apply(&RouterEvent {
            source: source(*s),
            event_id: 0,
            payload: EventPayload::Removed(RemovedBlocks {
                engine_block_ids: ids.clone(),
            }),
        }),
        Op::Clear(s) => filter.clear_source(source(*s)),
        Op::Restore(s, mappings) => filter.restore_source(source(*s), mappings),
        Op::Chain(s, tokens) => {
            // Engine ids past the stored ones' range, so chains do not contradict them.
            filter.reset_source(
                source(*s),
                &[StoredBlocks::new_chain(1000, tokens.iter().copied())],
            )
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// After every operation the twin owns exactly what the pool owns, holds every owned
    /// hash it did not report omitted (no false negative), and, while neither it nor a
    /// dense `PoolFilter` fed the same events omitted anything, equals that filter word
    /// for word. Its deltas rebuild it in a replica.
    #[test]
    fn a_twin_fed_the_log_holds_what_the_pool_holds(
        ops in prop::collection::vec(op(), 1..40),
        expected in prop::sample::select(vec![8u64, 24, 200]),
    ) {
        let mut pool = PoolFilter::new(CkfConfig::new(expected)).unwrap();
        pool.record_memberships(true);
        let mut reference = PoolFilter::new(dense(expected)).unwrap();
        let mut twin = MembershipFilter::new(dense(expected)).unwrap();
        let mut replica = Replica::new(twin.format()).unwrap();
        for chunk in &twin.snapshot().unwrap().chunks {
            replica.install_chunk(chunk).unwrap();
        }
        for op in &ops {
            let accepted = run(&mut pool, op).is_ok();
            prop_assert_eq!(run(&mut reference, op).is_ok(), accepted);
            let log = pool.take_memberships();
            if !accepted {
                prop_assert!(log.is_empty(), "a rejected operation logged {:?}", log);
            }
            twin.apply(&log).unwrap();
            if let Some(delta) = twin.take_delta().unwrap() {
                replica.apply_delta(&delta).unwrap();
            }

            prop_assert_eq!(twin.n_owned(), pool.n_canonicals());
            let omitted: BTreeSet<u64> = twin.omitted_canonicals().collect();
            prop_assert_eq!(twin.n_resident() + omitted.len() as u64, pool.n_canonicals());
            for canonical in 0..64 {
                if pool.owner_count(canonical) > 0 && !omitted.contains(&canonical) {
                    prop_assert!(twin.contains(canonical), "{canonical:#x} lost");
                }
            }
            prop_assert_eq!(twin.occupied_slots(), twin.n_resident());
            prop_assert_eq!(twin.counters().invariant_violations, 0);
            if twin.counters().capacity_omissions == 0
                && reference.counters().capacity_omissions == 0
            {
                prop_assert_eq!(twin.words(), reference.words());
            }
            prop_assert_eq!(replica.words(), Some(twin.words()));
        }
    }
}

#[test]
fn omitted_hashes_leave_without_touching_the_table_and_reoffers_admit_them() {
    // Two buckets of four slots: the ninth hash cannot fit.
    let mut twin = MembershipFilter::new(dense(2)).unwrap();
    let joined: Vec<Membership> = (0..64).map(Membership::Joined).collect();
    let outcome = twin.apply(&joined).unwrap();
    let bucket_count = u64::from(twin.format().bucket_count());
    assert_eq!(twin.n_resident(), twin.occupied_slots());
    assert!(twin.n_resident() <= bucket_count * 4);
    assert_eq!(outcome.capacity_omissions, 64 - twin.n_resident());
    assert_eq!(twin.n_owned(), 64);

    let omitted: Vec<u64> = twin.omitted_canonicals().collect();
    let words = twin.words().to_vec();
    let left: Vec<Membership> = omitted.iter().map(|&h| Membership::Left(h)).collect();
    twin.apply(&left).unwrap();
    assert_eq!(
        twin.words(),
        words,
        "an omitted hash has no fingerprint to remove"
    );
    assert_eq!(twin.n_owned(), twin.n_resident());

    // Free one slot, then re-offer an omitted hash: it is admitted late.
    let resident = (0..64).find(|h| !omitted.contains(h)).unwrap();
    let mut twin = MembershipFilter::new(dense(2)).unwrap();
    twin.apply(&joined).unwrap();
    let late = twin.omitted_canonicals().next().unwrap();
    twin.apply(&[Membership::Left(resident)]).unwrap();
    let before = twin.counters().late_admissions;
    twin.apply(&[Membership::Reoffered(late)]).unwrap();
    if twin.counters().late_admissions == before {
        // Its buckets were not the freed one's: a miss, counted, nothing lost.
        assert_eq!(twin.counters().reoffer_misses, 1);
        assert!(twin.omitted_canonicals().any(|h| h == late));
    } else {
        assert!(twin.contains(late));
        assert!(!twin.omitted_canonicals().any(|h| h == late));
    }
    assert_eq!(twin.n_owned(), 64 - 1);
}

#[test]
fn a_left_for_a_hash_that_never_joined_is_counted() {
    let mut twin = MembershipFilter::new(dense(64)).unwrap();
    twin.apply(&[Membership::Left(7)]).unwrap();
    assert_eq!(twin.counters().invariant_violations, 1);
    assert_eq!(twin.n_owned(), 0);
}

#[test]
fn the_twin_needs_a_fraction_of_a_pool_filters_memory() {
    let mut pool = PoolFilter::new(CkfConfig::new(20_000)).unwrap();
    pool.record_memberships(true);
    let mut twin = MembershipFilter::new(dense(20_000)).unwrap();
    let mut full_twin = PoolFilter::new(dense(20_000)).unwrap();
    for chunk in 0..100u64 {
        let mappings: Vec<(u64, u64)> = (0..200)
            .map(|i| (chunk * 200 + i, 0xC0DE_0000 + chunk * 200 + i))
            .collect();
        pool.store_canonical(SourceId::new(1, 0), &mappings)
            .unwrap();
        full_twin
            .store_canonical(SourceId::new(1, 0), &mappings)
            .unwrap();
        twin.apply(&pool.take_memberships()).unwrap();
    }
    assert_eq!(twin.words(), full_twin.words());
    assert_eq!(twin.memory().lineage_bytes, 0);
    // The table and window dominate; a full twin adds lineage and owners.
    assert!(twin.memory().total_bytes() * 4 < full_twin.memory().total_bytes());
}
