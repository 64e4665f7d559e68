//! The multi-pool query table against the exact index: per-pool depths across lane groups
//! (more than 64 lanes), sparse and dense probes, lanes that are not ready, deltas.

use kvrelay_ckf::{
    Addressing, BucketImage, CkfConfig, Delta, EventPayload, ExactIndex, PoolFilter, PrefixDepths,
    PrefixQuery, QueryConfig, QueryTable, RouterEvent, SnapshotChunk, SourceId, StoredBlock,
    StoredBlocks,
};
use kvrelay_identity::hashing::sequence_hashes;
use proptest::prelude::*;

/// Roomy enough that a false positive in these small tests is a ~1e-6 event per probe.
const CAPACITY: u64 = 4096;

/// A store of `tokens[..depth]` as one chain from `source`.
fn store_prefix(filter: &mut PoolFilter, tokens: &[u64], depth: usize, event_id: u64) {
    if depth == 0 {
        return;
    }
    let blocks = tokens[..depth]
        .iter()
        .enumerate()
        .map(|(i, &token_hash)| StoredBlock {
            engine_block_id: event_id * 1_000 + i as u64,
            token_hash,
        })
        .collect();
    let event = RouterEvent {
        source: SourceId::new(1, 0),
        event_id,
        payload: EventPayload::Stored(StoredBlocks {
            parent_engine_block_id: None,
            blocks,
        }),
    };
    filter.apply(&event).unwrap();
}

/// Lane `i` holds the first `depths[i]` blocks of `tokens`; `None` lanes get no snapshot.
fn build(tokens: &[u64], depths: &[Option<usize>]) -> (QueryTable, ExactIndex) {
    let format = PoolFilter::new(CkfConfig::new(CAPACITY)).unwrap().format();
    let mut table = QueryTable::new(format, QueryConfig::default()).unwrap();
    let mut exact = ExactIndex::new();
    let hashes = sequence_hashes(tokens);
    for (i, depth) in depths.iter().enumerate() {
        let lane = table.add_lane().unwrap();
        let pool = exact.add_pool();
        let Some(depth) = *depth else { continue };
        let mut filter = PoolFilter::new(CkfConfig::new(CAPACITY)).unwrap();
        store_prefix(&mut filter, tokens, depth, i as u64 + 1);
        for chunk in filter.snapshot().unwrap().chunks {
            table.install_chunk(lane, &chunk).unwrap();
        }
        for &hash in &hashes[..depth] {
            exact.insert(pool, hash);
        }
    }
    (table, exact)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn depths_match_the_exact_index_across_lane_groups(
        (tokens, depths) in (1usize..80).prop_flat_map(|n| (
            prop::collection::vec(any::<u64>(), n),
            prop::collection::vec(prop::option::weighted(0.9, 0..=n), 1..140),
        ))
    ) {
        let (table, exact) = build(&tokens, &depths);
        let hashes = sequence_hashes(&tokens);
        let got = table.prefix_depths(&hashes);
        let expected = exact.prefix_depths(&hashes);
        for (lane, depth) in depths.iter().enumerate() {
            match depth {
                Some(_) => prop_assert_eq!(got.depth(lane), expected.depth(lane), "lane {}", lane),
                None => prop_assert_eq!(got.depth(lane), None, "lane {} has no snapshot", lane),
            }
        }
    }
}

#[test]
fn a_few_lanes_deep_among_many_shallow_ones_get_their_own_depth() {
    // 100 lanes over two groups; 3 lanes deep (sparse probes), the rest at depth 5.
    let tokens: Vec<u64> = (1..=64).collect();
    let depths: Vec<Option<usize>> = (0..100)
        .map(|lane| Some(if lane % 37 == 1 { 60 + lane % 4 } else { 5 }))
        .collect();
    let (table, _) = build(&tokens, &depths);
    let got = table.prefix_depths(&sequence_hashes(&tokens));
    for (lane, depth) in depths.iter().enumerate() {
        assert_eq!(got.depth(lane), depth.map(|d| d as u32), "lane {lane}");
    }
    assert!(got.n_probes() < 64, "{} probes", got.n_probes());
}

#[test]
fn an_empty_request_has_depth_zero_in_every_ready_lane() {
    let (table, _) = build(&[1, 2, 3], &[Some(3), None, Some(0)]);
    assert_eq!(table.prefix_depths(&[]).depths(), &[Some(0), None, Some(0)]);
}

#[test]
fn a_delta_extends_the_depth_a_query_sees() {
    let tokens: Vec<u64> = (100..132).collect();
    let format = PoolFilter::new(CkfConfig::new(CAPACITY)).unwrap().format();
    let mut table = QueryTable::new(format, QueryConfig::default()).unwrap();
    let lane = table.add_lane().unwrap();
    let mut filter = PoolFilter::new(CkfConfig::new(CAPACITY)).unwrap();
    store_prefix(&mut filter, &tokens, 10, 1);
    for chunk in filter.snapshot().unwrap().chunks {
        table.install_chunk(lane, &chunk).unwrap();
    }
    let hashes = sequence_hashes(&tokens);
    assert_eq!(table.prefix_depths(&hashes).depth(lane), Some(10));
    store_prefix(&mut filter, &tokens, 25, 2);
    let delta = filter.take_delta().unwrap().unwrap();
    table.apply_delta(lane, &delta).unwrap();
    assert_eq!(table.prefix_depths(&hashes).depth(lane), Some(25));
}

#[test]
fn add_lane_bytes_is_what_the_next_lane_allocates() {
    let producer = PoolFilter::new(CkfConfig::new(4096)).unwrap();
    let mut table = QueryTable::new(producer.format(), QueryConfig::default()).unwrap();
    let row_bytes = u64::from(producer.format().bucket_count()) * 8;
    let mut held = 0;
    let mut growths = 0;
    for lanes in 1..=200u64 {
        let announced = table.add_lane_bytes();
        table.add_lane().unwrap();
        if announced > 0 {
            // A growth: the new table replaces the old, and was announced exactly.
            assert_eq!(table.table_bytes(), announced, "lane {lanes}");
            assert!(announced > held);
            held = announced;
            growths += 1;
        } else {
            assert_eq!(table.table_bytes(), held, "lane {lanes} needed no growth");
        }
        // Spare lanes: below 8 lanes the stride doubles (rows share cache lines); up to
        // 64 it is the lanes rounded up to whole lines; past 64, at most a quarter more
        // (and whole lines). Plus alignment padding.
        let spare_bound = match lanes {
            0..8 => 2 * lanes,
            8..=64 => lanes.next_multiple_of(8),
            _ => (lanes + lanes / 4).next_multiple_of(8) + 8,
        };
        assert!(
            table.table_bytes() <= spare_bound * row_bytes + 64,
            "{lanes} lanes hold {} bytes",
            table.table_bytes()
        );
        if lanes == 40 || lanes == 64 {
            assert_eq!(
                table.table_bytes(),
                lanes * row_bytes + 56,
                "{lanes} lanes, no spare"
            );
        }
    }
    // 1, 2, 4, 8, then 16..=64 by lines (7), then 80, 104, 136, 176, 224: few growths.
    assert_eq!(growths, 4 + 7 + 5);
}

#[test]
fn rows_prepared_from_a_shared_table_are_swapped_in_unless_the_table_changed_since() {
    let tokens: Vec<u64> = (200..240).collect();
    let hashes = sequence_hashes(&tokens);
    // Two lanes: the stride is full, so the next lane needs a growth.
    let (mut table, _) = build(&tokens, &[Some(12), Some(30)]);
    let before = table.prefix_depths(&hashes);

    let old_bytes = table.table_bytes();
    let mut prepared = table.prepare_growth().unwrap().unwrap();
    assert_eq!(prepared.bytes(), table.add_lane_bytes());
    // Queries still run on the table while the rows exist (shared borrow only).
    assert_eq!(table.prefix_depths(&hashes).depths(), before.depths());
    let lane = table.add_lane_prepared(Some(&mut prepared)).unwrap();
    assert_eq!(lane, 2);
    // The old rows come back to be freed by the caller, and are never swapped in again.
    assert_eq!(prepared.bytes(), old_bytes);
    assert_eq!(&table.prefix_depths(&hashes).depths()[..2], before.depths());
    assert_eq!(
        table.prefix_depths(&hashes).depth(2),
        None,
        "new lane is empty"
    );
    // The fourth lane fits the doubled stride: nothing to prepare.
    assert!(table.prepare_growth().unwrap().is_none());
    table.add_lane().unwrap();

    // Rows prepared before a delta are stale: dropped, and the table grows from its
    // current words, so the delta is kept.
    let mut stale = table.prepare_growth().unwrap().unwrap();
    let mut filter = PoolFilter::new(CkfConfig::new(CAPACITY)).unwrap();
    store_prefix(&mut filter, &tokens, 20, 9);
    for chunk in filter.snapshot().unwrap().chunks {
        table.install_chunk(3, &chunk).unwrap();
    }
    table.add_lane_prepared(Some(&mut stale)).unwrap();
    let after = table.prefix_depths(&hashes);
    assert_eq!(
        after.depth(3),
        Some(20),
        "the chunk written after preparing is kept"
    );
    assert_eq!(&after.depths()[..2], before.depths());
}

/// The table's words for the fingerprint of each hash in its primary bucket (`true`) or in
/// its alternate one, as sorted delta images (the other bucket emptied).
fn placed(addressing: &Addressing, hashes: &[u64], primary: bool) -> Vec<BucketImage> {
    let mut images: Vec<BucketImage> = hashes
        .iter()
        .flat_map(|&hash| {
            let address = addressing.address(hash);
            let (holder, emptied) = if primary {
                (address.primary, address.alternate)
            } else {
                (address.alternate, address.primary)
            };
            [
                BucketImage {
                    bucket_idx: holder,
                    word: u64::from(address.fingerprint),
                },
                BucketImage {
                    bucket_idx: emptied,
                    word: 0,
                },
            ]
        })
        .collect();
    images.sort_unstable();
    images
}

/// Every hash of a request stays resident while deltas move each one's fingerprint
/// between its two buckets (the cuckoo kick a producer's delta carries), and queries run
/// beside the applies: no query may miss a position. Delta images are written in bucket
/// order, so without the stripes a probe reading one bucket before and the other after a
/// move would miss (this test fails within a few thousand queries then).
#[test]
fn queries_beside_applies_never_miss_a_fingerprint_a_delta_moves() {
    const MOVES: u64 = 20_000;
    let format = PoolFilter::new(CkfConfig::new(1 << 16)).unwrap().format();
    let addressing = Addressing::new(format);
    // Positions whose four buckets are all distinct from every other position's, so
    // each bucket word holds exactly one fingerprint.
    let mut used = std::collections::HashSet::new();
    let hashes: Vec<u64> = (1..)
        .map(|i: u64| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .filter(|&hash| {
            let address = addressing.address(hash);
            address.primary != address.alternate
                && !used.contains(&address.primary)
                && !used.contains(&address.alternate)
                && used.insert(address.primary)
                && used.insert(address.alternate)
        })
        .take(48)
        .collect();
    let mut table = QueryTable::new(format, QueryConfig::default()).unwrap();
    let lane = table.add_lane().unwrap();
    let bucket_count = u64::from(format.bucket_count());
    table
        .install_chunk(
            lane,
            &SnapshotChunk {
                sequence: 0,
                bucket_count,
                chunk_index: 0,
                chunk_count: 1,
                first_bucket: 0,
                words: vec![0; bucket_count as usize],
            },
        )
        .unwrap();
    let at_primary = placed(&addressing, &hashes, true);
    let at_alternate = placed(&addressing, &hashes, false);
    let delta = |sequence: u64| Delta {
        base_sequence: sequence - 1,
        sequence,
        images: if sequence % 2 == 1 {
            at_primary.clone()
        } else {
            at_alternate.clone()
        },
    };
    table.apply_delta(lane, &delta(1)).unwrap();
    let full = Some(hashes.len() as u32);
    assert_eq!(table.prefix_depths(&hashes).depth(lane), full);

    let done = std::sync::atomic::AtomicBool::new(false);
    let (queries, short) = std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut out = PrefixDepths::default();
            let (mut queries, mut short) = (0u64, 0u64);
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                table.prefix_depths_into(&hashes, &mut out);
                queries += 1;
                if out.depth(lane) != full {
                    short += 1;
                }
            }
            (queries, short)
        });
        for sequence in 2..2 + MOVES {
            table.apply_delta(lane, &delta(sequence)).unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        reader.join().unwrap()
    });
    assert!(queries > 0);
    assert_eq!(
        short, 0,
        "{short} of {queries} queries missed a resident position"
    );
    assert_eq!(table.prefix_depths(&hashes).depth(lane), full);
}

/// A new lane's snapshot is written chunk by chunk beside queries of the other lanes: they
/// keep their answers, the new lane answers nothing until its last chunk and then its
/// whole depth; a lane that answered queries takes a snapshot only through `&mut`.
#[test]
fn a_new_lanes_chunks_go_in_beside_queries_and_an_answering_lane_refuses_them() {
    let tokens: Vec<u64> = (400..440).collect();
    let hashes = sequence_hashes(&tokens);
    let (mut table, _) = build(&tokens, &[Some(20)]);
    let lane = table.add_lane().unwrap();
    let mut filter = PoolFilter::new(CkfConfig::new(CAPACITY)).unwrap();
    store_prefix(&mut filter, &tokens, 30, 7);
    let snapshot = filter.snapshot().unwrap();
    let words: Vec<u64> = snapshot
        .chunks
        .iter()
        .flat_map(|chunk| chunk.words.iter().copied())
        .collect();
    let small: Vec<SnapshotChunk> = words
        .chunks(64)
        .enumerate()
        .map(|(index, part)| SnapshotChunk {
            sequence: snapshot.chunks[0].sequence,
            bucket_count: words.len() as u64,
            chunk_index: index as u32,
            chunk_count: words.len().div_ceil(64) as u32,
            first_bucket: index as u64 * 64,
            words: part.to_vec(),
        })
        .collect();
    assert!(small.len() > 8, "{} chunks", small.len());

    let done = std::sync::atomic::AtomicBool::new(false);
    let seen = std::thread::scope(|scope| {
        let reader = scope.spawn(|| {
            let mut out = PrefixDepths::default();
            let mut seen = std::collections::BTreeSet::new();
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                table.prefix_depths_into(&hashes, &mut out);
                assert_eq!(
                    out.depth(0),
                    Some(20),
                    "the installed lane keeps its answer"
                );
                seen.insert(out.depth(lane));
            }
            seen
        });
        for chunk in &small {
            table
                .install_chunk_beside_queries(lane, chunk)
                .expect("a new lane takes chunks beside queries")
                .unwrap();
        }
        done.store(true, std::sync::atomic::Ordering::Relaxed);
        reader.join().unwrap()
    });
    // Before its last chunk the lane answered nothing; after it, its whole depth.
    assert!(
        seen.iter().all(|depth| matches!(depth, None | Some(30))),
        "{seen:?}"
    );
    assert_eq!(table.prefix_depths(&hashes).depth(lane), Some(30));
    assert!(
        table
            .install_chunk_beside_queries(lane, &small[0])
            .is_none(),
        "the lane answered queries: a new snapshot needs &mut"
    );
    // Through `&mut` it goes in (and the lane assembles again).
    assert!(!table.install_chunk(lane, &small[0]).unwrap());
    assert_eq!(table.prefix_depths(&hashes).depth(lane), None);
}

#[test]
fn large_rows_are_advised_onto_huge_pages_and_answer_the_same() {
    let tokens: Vec<u64> = (0..24u64).map(|i| i * 7 + 1).collect();
    let hashes = sequence_hashes(&tokens);
    let capacity = 1 << 20;
    let format = PoolFilter::new(CkfConfig::new(capacity)).unwrap().format();
    // Linux accepts the advice whenever it was built with transparent huge pages, whatever
    // the system's setting; a table of small rows is never advised.
    let can_advise = cfg!(target_os = "linux")
        && std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
    let mut answers = Vec::new();
    for huge_pages in [true, false] {
        let config = QueryConfig {
            huge_pages,
            ..QueryConfig::default()
        };
        let mut table = QueryTable::new(format, config).unwrap();
        assert!(!table.huge_pages_advised(), "no rows yet");
        for (i, depth) in [24, 10, 0].into_iter().enumerate() {
            let lane = table.add_lane().unwrap();
            assert!(table.table_bytes() >= 4 << 20);
            assert_eq!(table.huge_pages_advised(), huge_pages && can_advise);
            let mut filter = PoolFilter::new(CkfConfig::new(capacity)).unwrap();
            store_prefix(&mut filter, &tokens, depth, i as u64 + 1);
            for chunk in filter.snapshot().unwrap().chunks {
                table.install_chunk(lane, &chunk).unwrap();
            }
        }
        answers.push(table.prefix_depths(&hashes).depths().to_vec());
    }
    assert_eq!(answers[0], vec![Some(24), Some(10), Some(0)]);
    assert_eq!(answers[0], answers[1]);
    let (small, _) = build(&tokens, &[Some(3)]);
    assert!(small.table_bytes() < 2 << 20 && !small.huge_pages_advised());
}
