//! The dense format (CKF format 2) at its design load: how full it really gets, what a
//! probe's false-positive rate is there, and that a query table of dense lanes answers
//! like the exact index (never below it).

use kvrelay_ckf::{
    CkfConfig, EventPayload, ExactIndex, FilterDensity, PoolFilter, PrefixQuery, QueryConfig,
    QueryTable, RouterEvent, SourceId, StoredBlocks,
};
use kvrelay_identity::hashing::sequence_hashes;

/// Stores `n` distinct blocks as chains of 64 from one source.
fn fill(filter: &mut PoolFilter, n: u64, salt: u64) {
    for chain in 0..n.div_ceil(64) {
        let ids = chain * 64..((chain + 1) * 64).min(n);
        let event = RouterEvent {
            source: SourceId::new(1, 0),
            event_id: chain + 1,
            payload: EventPayload::Stored(StoredBlocks::new_chain(
                ids.start,
                ids.map(|i| i ^ salt),
            )),
        };
        filter.apply(&event).unwrap();
    }
}

fn dense(expected_unique_blocks: u64) -> CkfConfig {
    CkfConfig::new(expected_unique_blocks).with_density(FilterDensity::DENSE)
}

#[test]
fn a_dense_filter_takes_its_expected_count_at_95_percent_without_omissions() {
    for n in [10_000u64, 200_000] {
        let mut filter = PoolFilter::new(dense(n)).unwrap();
        let format = filter.format();
        assert!(format.is_dense());
        fill(&mut filter, n, 0x5EED);
        let counters = filter.counters();
        assert_eq!(counters.capacity_omissions, 0, "{n} blocks");
        assert_eq!(filter.n_resident(), n);
        let slots = u64::from(format.bucket_count()) * 4;
        let load = n as f64 / slots as f64;
        assert!(load > 0.949, "load {load}");
        let bits_per_membership = (slots * 16) as f64 / n as f64;
        assert!(bits_per_membership < 17.0, "{bits_per_membership} bits");
    }
}

#[test]
fn a_full_dense_filter_keeps_false_positives_near_8_load_over_2_to_16() {
    let n = 200_000u64;
    let mut filter = PoolFilter::new(dense(n)).unwrap();
    fill(&mut filter, n, 0x5EED);
    // Probe hashes never stored: every hit is a false positive.
    let probes = 2_000_000u64;
    let hits = (0..probes)
        .filter(|i| filter.contains(i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1 << 63))
        .count() as f64;
    let rate = hits / probes as f64;
    // Expected 8 · 0.95 / 65,535 ≈ 1.16e-4 (232 hits); allow for sampling noise.
    assert!(
        (0.7e-4..1.6e-4).contains(&rate),
        "false-positive rate {rate}"
    );
}

#[test]
fn dense_lanes_of_different_pools_answer_like_the_exact_index() {
    // Three pools of one dense format, each holding a different prefix of one request.
    let tokens: Vec<u64> = (0..48).map(|i| i * 7 + 3).collect();
    let hashes = sequence_hashes(&tokens);
    let format = PoolFilter::new(dense(4096)).unwrap().format();
    let mut table = QueryTable::new(format, QueryConfig::default()).unwrap();
    let mut exact = ExactIndex::new();
    for (pool, depth) in [0usize, 17, 48].into_iter().enumerate() {
        let lane = table.add_lane().unwrap();
        let exact_pool = exact.add_pool();
        let mut filter = PoolFilter::new(dense(4096)).unwrap();
        // Background blocks fill the table toward its design load.
        fill(&mut filter, 3_800, (pool as u64 + 1) << 40);
        if depth > 0 {
            let chain = StoredBlocks::new_chain(1 << 32, tokens[..depth].iter().copied());
            let event = RouterEvent {
                source: SourceId::new(2, 0),
                event_id: 1,
                payload: EventPayload::Stored(chain),
            };
            filter.apply(&event).unwrap();
        }
        assert_eq!(filter.counters().capacity_omissions, 0);
        for chunk in filter.snapshot().unwrap().chunks {
            table.install_chunk(lane, &chunk).unwrap();
        }
        for &hash in &hashes[..depth] {
            exact.insert(exact_pool, hash);
        }
    }
    let got = table.prefix_depths(&hashes);
    let expected = exact.prefix_depths(&hashes);
    for lane in 0..3 {
        let (got, expected) = (got.depth(lane).unwrap(), expected.depth(lane).unwrap());
        // Never below the exact depth; above it only by a false positive chain, which at
        // 1e-4 per probe and a verified window of two does not happen here.
        assert_eq!(got, expected, "lane {lane}");
    }
}
