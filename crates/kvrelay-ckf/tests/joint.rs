//! The joint search over query tables of different formats answers every lane exactly as
//! its own table's search and the exact index do (no false negative, ever), whatever the
//! tables' sizes, lane counts (table groups packed into shared virtual groups, tables of
//! more than 64 lanes), readiness, and the number of tables (more than
//! `MAX_JOINT_TABLES` are searched in chunks).

use kvrelay_ckf::{
    CkfConfig, EventPayload, ExactIndex, FilterDensity, JointDepths, MAX_JOINT_TABLES, PoolFilter,
    PrefixQuery, QueryConfig, QueryTable, RouterEvent, SourceId, StoredBlocks,
    joint_prefix_depths_into,
};
use kvrelay_identity::hashing::sequence_hashes;
use proptest::prelude::*;

/// Capacities giving distinct dense bucket counts, all roomy for these tests (a false
/// positive is a ~1e-6 event per probe).
const CAPACITIES: [u64; 5] = [4_096, 4_500, 5_000, 6_000, 7_000];

fn config(capacity: u64) -> CkfConfig {
    CkfConfig::new(capacity).with_density(FilterDensity::DENSE)
}

/// A filter holding `tokens[..depth]` as one chain.
fn filter_with_prefix(capacity: u64, tokens: &[u64], depth: usize) -> PoolFilter {
    let mut filter = PoolFilter::new(config(capacity)).unwrap();
    if depth > 0 {
        let event = RouterEvent {
            source: SourceId::new(1, 0),
            event_id: 1,
            payload: EventPayload::Stored(StoredBlocks::new_chain(
                0,
                tokens[..depth].iter().copied(),
            )),
        };
        filter.apply(&event).unwrap();
    }
    filter
}

/// One table per `(capacity, lane depths)`: lane `i` holds `tokens[..depths[i]]`, `None`
/// lanes get no snapshot. Returns the tables and one exact index per table.
fn build(tokens: &[u64], specs: &[(u64, Vec<Option<usize>>)]) -> Vec<(QueryTable, ExactIndex)> {
    let hashes = sequence_hashes(tokens);
    specs
        .iter()
        .map(|(capacity, depths)| {
            let format = PoolFilter::new(config(*capacity)).unwrap().format();
            let mut table = QueryTable::new(format, QueryConfig::default()).unwrap();
            let mut exact = ExactIndex::new();
            for depth in depths {
                let lane = table.add_lane().unwrap();
                let pool = exact.add_pool();
                let Some(depth) = *depth else { continue };
                let mut filter = filter_with_prefix(*capacity, tokens, depth);
                for chunk in filter.snapshot().unwrap().chunks {
                    table.install_chunk(lane, &chunk).unwrap();
                }
                for &hash in &hashes[..depth] {
                    exact.insert(pool, hash);
                }
            }
            (table, exact)
        })
        .collect()
}

fn check(tokens: &[u64], specs: &[(u64, Vec<Option<usize>>)], out: &mut JointDepths) {
    let built = build(tokens, specs);
    let tables: Vec<&QueryTable> = built.iter().map(|(table, _)| table).collect();
    let hashes = sequence_hashes(tokens);
    joint_prefix_depths_into(&tables, &hashes, out);
    for (t, ((table, exact), (_, depths))) in built.iter().zip(specs).enumerate() {
        let own = table.prefix_depths(&hashes);
        let expected = exact.prefix_depths(&hashes);
        for (lane, depth) in depths.iter().enumerate() {
            let got = out.depth(t, lane);
            assert_eq!(
                got,
                own.depth(lane),
                "table {t} lane {lane}: as its own search"
            );
            match depth {
                Some(_) => assert_eq!(got, expected.depth(lane), "table {t} lane {lane}"),
                None => assert_eq!(got, None, "table {t} lane {lane} has no snapshot"),
            }
        }
        assert_eq!(out.depth(t, depths.len()), None, "past the table's lanes");
    }
    assert_eq!(out.depth(specs.len(), 0), None, "past the tables");
}

fn lanes(n: usize) -> impl Strategy<Value = Vec<Option<usize>>> {
    prop::collection::vec(prop::option::weighted(0.9, 0..=n), 1..40)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn joint_depths_match_each_tables_own_search_and_the_exact_index(
        (tokens, specs) in (1usize..60).prop_flat_map(|n| (
            prop::collection::vec(any::<u64>(), n),
            prop::collection::vec((prop::sample::select(CAPACITIES.to_vec()), lanes(n)), 1..12),
        ))
    ) {
        let mut out = JointDepths::default();
        check(&tokens, &specs, &mut out);
        // The same value reused for another request and other tables (scratch kept).
        let shorter = &tokens[..tokens.len().div_ceil(2)];
        let clamped: Vec<(u64, Vec<Option<usize>>)> = specs
            .iter()
            .map(|(capacity, depths)| {
                let depths = depths.iter().map(|d| d.map(|d| d.min(shorter.len()))).collect();
                (*capacity, depths)
            })
            .collect();
        check(shorter, &clamped, &mut out);
    }
}

#[test]
fn tables_of_more_than_64_lanes_and_more_tables_than_one_chunk_answer_exactly() {
    let tokens: Vec<u64> = (1..=40).collect();
    let wide: Vec<Option<usize>> = (0..150).map(|i| Some(i % 41)).collect();
    let mut specs = vec![
        (CAPACITIES[0], wide),
        (CAPACITIES[1], vec![Some(40), None, Some(3)]),
    ];
    for i in 0..MAX_JOINT_TABLES {
        specs.push((CAPACITIES[i % CAPACITIES.len()], vec![Some(i * 5); 9]));
    }
    let mut out = JointDepths::default();
    check(&tokens, &specs, &mut out);
    assert!(out.n_probes() > 0);
}

#[test]
fn no_tables_and_an_empty_request_answer_nothing_and_zero() {
    let mut out = JointDepths::default();
    joint_prefix_depths_into(&[], &sequence_hashes(&[1, 2]), &mut out);
    assert_eq!(out.depth(0, 0), None);
    let built = build(
        &[1, 2, 3],
        &[
            (CAPACITIES[0], vec![Some(3)]),
            (CAPACITIES[2], vec![Some(1)]),
        ],
    );
    let tables: Vec<&QueryTable> = built.iter().map(|(table, _)| table).collect();
    joint_prefix_depths_into(&tables, &[], &mut out);
    assert_eq!((out.depth(0, 0), out.depth(1, 0)), (Some(0), Some(0)));
}
