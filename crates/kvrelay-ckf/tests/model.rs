//! Model tests: the producer filter against an exact ownership model over random
//! interleavings of stores, removals, clears, worker removals and resets from several
//! sources, with a tiny filter that saturates; replicas and query lanes follow the stream.

use std::collections::BTreeMap;

use kvrelay_ckf::{
    CkfConfig, Delta, EventPayload, FilterDensity, PoolFilter, PrefixQuery, QueryConfig,
    QueryTable, RemovedBlocks, Replica, ReplicaStatus, RouterEvent, SourceId, StoredBlock,
    StoredBlocks,
};
use kvrelay_identity::hashing::{canonical_child, canonical_root};
use proptest::prelude::*;

/// Exact model: per source, engine id → canonical.
#[derive(Debug, Default, Clone)]
struct Model {
    lineage: BTreeMap<SourceId, BTreeMap<u64, u64>>,
}

impl Model {
    /// Mirrors the filter's validation; `Err(())` when the event must be rejected.
    fn store(&mut self, source: SourceId, stored: &StoredBlocks) -> Result<(), ()> {
        let map = self.lineage.get(&source).cloned().unwrap_or_default();
        let mut next = map.clone();
        let mut parent = match stored.parent_engine_block_id {
            None => None,
            Some(p) => Some(*map.get(&p).ok_or(())?),
        };
        for block in &stored.blocks {
            let canonical = match parent {
                None => canonical_root(block.token_hash),
                Some(p) => canonical_child(p, block.token_hash),
            };
            parent = Some(canonical);
            match next.get(&block.engine_block_id) {
                Some(&c) if c != canonical => return Err(()),
                Some(_) => {}
                None => {
                    next.insert(block.engine_block_id, canonical);
                }
            }
        }
        if !next.is_empty() {
            self.lineage.insert(source, next);
        }
        Ok(())
    }

    fn remove(&mut self, source: SourceId, ids: &[u64]) {
        if let Some(map) = self.lineage.get_mut(&source) {
            for id in ids {
                map.remove(id);
            }
            if map.is_empty() {
                self.lineage.remove(&source);
            }
        }
    }

    fn reset(&mut self, source: SourceId, chains: &[StoredBlocks]) -> Result<(), ()> {
        let mut fresh = Model::default();
        for chain in chains {
            fresh.store(source, chain)?;
        }
        self.lineage.remove(&source);
        if let Some(map) = fresh.lineage.remove(&source) {
            self.lineage.insert(source, map);
        }
        Ok(())
    }

    fn owners(&self) -> BTreeMap<u64, u32> {
        let mut owners = BTreeMap::new();
        for map in self.lineage.values() {
            for &canonical in map.values() {
                *owners.entry(canonical).or_insert(0) += 1;
            }
        }
        owners
    }
}

#[derive(Debug, Clone)]
enum Op {
    Store(SourceId, StoredBlocks),
    Remove(SourceId, Vec<u64>),
    Clear(SourceId),
    RemoveWorker(u64),
    Reset(SourceId, Vec<StoredBlocks>),
    Publish,
    Subscribe,
}

fn source() -> impl Strategy<Value = SourceId> {
    (0u64..3, 0u32..2).prop_map(|(worker_id, dp_rank)| SourceId { worker_id, dp_rank })
}

fn chain() -> impl Strategy<Value = StoredBlocks> {
    (
        prop::option::weighted(0.5, 0u64..24),
        prop::collection::vec((0u64..24, 0u64..6), 0..6),
    )
        .prop_map(|(parent, blocks)| StoredBlocks {
            parent_engine_block_id: parent,
            blocks: blocks
                .into_iter()
                .map(|(engine_block_id, token_hash)| StoredBlock {
                    engine_block_id,
                    token_hash,
                })
                .collect(),
        })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => (source(), chain()).prop_map(|(s, c)| Op::Store(s, c)),
        4 => (source(), prop::collection::vec(0u64..26, 0..5)).prop_map(|(s, ids)| Op::Remove(s, ids)),
        1 => source().prop_map(Op::Clear),
        1 => (0u64..3).prop_map(Op::RemoveWorker),
        1 => (source(), prop::collection::vec(chain(), 0..3)).prop_map(|(s, c)| Op::Reset(s, c)),
        3 => Just(Op::Publish),
        1 => Just(Op::Subscribe),
    ]
}

fn event(source: SourceId, payload: EventPayload) -> RouterEvent {
    RouterEvent {
        source,
        event_id: 0,
        payload,
    }
}

/// Checks ownership, residency, the table and the counters against the model.
fn check_state(filter: &PoolFilter, model: &Model) -> Result<(), TestCaseError> {
    // Exact lineage.
    let mut n_mappings = 0;
    for (&source, map) in &model.lineage {
        for (&id, &canonical) in map {
            prop_assert_eq!(filter.canonical_of(source, id), Some(canonical));
            n_mappings += 1;
        }
    }
    prop_assert_eq!(filter.n_mappings(), n_mappings);
    let mut sources: Vec<_> = filter.sources().collect();
    sources.sort();
    prop_assert_eq!(sources, model.lineage.keys().copied().collect::<Vec<_>>());
    // Exact owner counts; (a) every resident hash is found.
    let owners = model.owners();
    prop_assert_eq!(filter.n_canonicals(), owners.len() as u64);
    let mut n_resident = 0;
    for (&canonical, &count) in &owners {
        prop_assert_eq!(filter.owner_count(canonical), count);
        if filter.is_resident(canonical) {
            n_resident += 1;
            prop_assert!(
                filter.contains(canonical),
                "resident {canonical:#x} not found"
            );
        }
    }
    // (b) one physical copy per resident hash, none left behind by removals.
    prop_assert_eq!(filter.count_occupied_slots(), n_resident);
    // The O(1) figures agree with the scan.
    prop_assert_eq!(filter.occupied_slots(), n_resident);
    prop_assert_eq!(filter.n_resident(), n_resident);
    let omitted = filter.omitted_canonicals().count() as u64;
    prop_assert_eq!(omitted + n_resident, owners.len() as u64);
    // (d) counters add up.
    let c = filter.counters();
    prop_assert_eq!(c.blocks_mapped - c.mappings_removed, n_mappings);
    prop_assert_eq!(
        c.canonicals_created - c.canonicals_dropped,
        owners.len() as u64
    );
    prop_assert_eq!(c.fingerprints_inserted - c.fingerprints_removed, n_resident);
    prop_assert_eq!(c.invariant_violations, 0);
    prop_assert!(c.fingerprints_inserted >= c.late_admissions);
    Ok(())
}

/// Subscribers following the stream: a replica and a query-table lane each.
struct Subscribers {
    replicas: Vec<Replica>,
    table: QueryTable,
}

impl Subscribers {
    fn apply(&mut self, delta: &Delta) -> Result<(), TestCaseError> {
        for replica in &mut self.replicas {
            prop_assert!(replica.apply_delta(delta).is_ok());
        }
        for lane in 0..self.table.n_lanes() {
            prop_assert!(self.table.apply_delta(lane, delta).is_ok());
        }
        Ok(())
    }

    /// (c) every replica is bit-identical to the producer, every lane answers alike.
    fn check(&self, filter: &PoolFilter, model: &Model) -> Result<(), TestCaseError> {
        for replica in &self.replicas {
            prop_assert_eq!(
                replica.status(),
                ReplicaStatus::Ready {
                    sequence: filter.sequence()
                }
            );
            prop_assert_eq!(replica.words(), Some(filter.words()));
        }
        let hashes: Vec<u64> = model.owners().keys().copied().collect();
        for &hash in &hashes {
            let depths = self.table.prefix_depths(&[hash]);
            for lane in 0..self.table.n_lanes() {
                let expected = u32::from(filter.contains(hash));
                prop_assert_eq!(depths.depth(lane), Some(expected));
            }
        }
        Ok(())
    }
}

fn run(ops: Vec<Op>, expected_unique_blocks: u64) -> Result<(), TestCaseError> {
    run_in(ops, expected_unique_blocks, FilterDensity::V1)
}

fn run_in(
    ops: Vec<Op>,
    expected_unique_blocks: u64,
    density: FilterDensity,
) -> Result<(), TestCaseError> {
    let config = CkfConfig {
        max_kicks: 16,
        ..CkfConfig::new(expected_unique_blocks).with_density(density)
    };
    let mut filter = PoolFilter::new(config).unwrap();
    let mut model = Model::default();
    let mut subs = Subscribers {
        replicas: Vec::new(),
        table: QueryTable::new(filter.format(), QueryConfig::default()).unwrap(),
    };
    let mut rejected_resets = 0u64;
    for op in ops {
        let before = filter.words().to_vec();
        match op {
            Op::Store(source, stored) => {
                let expected = model.store(source, &stored);
                let got = filter.apply(&event(source, EventPayload::Stored(stored)));
                prop_assert_eq!(got.is_ok(), expected.is_ok(), "{:?}", got);
                if got.is_err() {
                    prop_assert_eq!(filter.words(), &before[..]);
                }
            }
            Op::Remove(source, ids) => {
                model.remove(source, &ids);
                let payload = EventPayload::Removed(RemovedBlocks {
                    engine_block_ids: ids,
                });
                prop_assert!(filter.apply(&event(source, payload)).is_ok());
            }
            Op::Clear(source) => {
                model.lineage.remove(&source);
                if source.worker_id == 0 {
                    prop_assert!(
                        filter
                            .apply(&event(source, EventPayload::AllCleared))
                            .is_ok()
                    );
                } else {
                    prop_assert!(filter.clear_source(source).is_ok());
                }
            }
            Op::RemoveWorker(worker_id) => {
                model.lineage.retain(|s, _| s.worker_id != worker_id);
                prop_assert!(filter.remove_worker(worker_id).is_ok());
            }
            Op::Reset(source, chains) => {
                let expected = model.reset(source, &chains);
                let got = filter.reset_source(source, &chains);
                prop_assert_eq!(got.is_ok(), expected.is_ok(), "{:?}", got);
                if got.is_err() {
                    rejected_resets += 1;
                    prop_assert_eq!(filter.words(), &before[..]);
                }
            }
            Op::Publish => {
                if let Some(delta) = filter.take_delta().unwrap() {
                    subs.apply(&delta)?;
                }
                subs.check(&filter, &model)?;
            }
            Op::Subscribe => {
                let barrier = filter
                    .snapshot_with_chunk_buckets(std::num::NonZeroU32::new(3).unwrap())
                    .unwrap();
                if let Some(tail) = &barrier.tail {
                    subs.apply(tail)?;
                }
                let mut replica = Replica::new(filter.format()).unwrap();
                let lane = subs.table.add_lane().unwrap();
                for chunk in &barrier.chunks {
                    replica.install_chunk(chunk).unwrap();
                    subs.table.install_chunk(lane, chunk).unwrap();
                }
                subs.replicas.push(replica);
                subs.check(&filter, &model)?;
            }
        }
        let c = filter.counters();
        prop_assert_eq!(
            c.events_applied + c.events_rejected,
            c.stored_events + c.removed_events + c.cleared_events + rejected_resets
        );
        check_state(&filter, &model)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn tiny_saturating_filter_matches_the_exact_model(ops in prop::collection::vec(op(), 1..120)) {
        // 8 expected blocks → 4 buckets, 16 slots: well below the live hash count.
        run(ops, 8)?;
    }

    #[test]
    fn roomy_filter_matches_the_exact_model(ops in prop::collection::vec(op(), 1..120)) {
        run(ops, 256)?;
    }

    #[test]
    fn tiny_dense_filter_matches_the_exact_model(ops in prop::collection::vec(op(), 1..120)) {
        // 8 expected blocks at 95 % → 3 buckets: an odd count, so some hashes have one
        // candidate bucket (primary = alternate), and the table saturates.
        run_in(ops, 8, FilterDensity::DENSE)?;
    }

    #[test]
    fn roomy_dense_filter_matches_the_exact_model(ops in prop::collection::vec(op(), 1..120)) {
        // 256 at 95 % → 68 buckets, not a power of two.
        run_in(ops, 256, FilterDensity::DENSE)?;
    }
}

#[test]
fn tiny_filter_really_saturates_and_still_matches_the_model() {
    let chain = StoredBlocks {
        parent_engine_block_id: None,
        blocks: (0..40)
            .map(|i| StoredBlock {
                engine_block_id: i,
                token_hash: i,
            })
            .collect(),
    };
    let ops = vec![
        Op::Subscribe,
        Op::Store(SourceId::new(0, 0), chain.clone()),
        Op::Store(SourceId::new(1, 0), chain),
        Op::Publish,
        Op::Remove(SourceId::new(0, 0), (0..20).collect()),
        Op::Remove(SourceId::new(1, 0), (0..30).collect()),
        Op::Publish,
        Op::Subscribe,
    ];
    run(ops, 8).unwrap();
    let mut filter = PoolFilter::new(CkfConfig::new(8)).unwrap();
    let stored = StoredBlocks {
        parent_engine_block_id: None,
        blocks: (0..40)
            .map(|i| StoredBlock {
                engine_block_id: i,
                token_hash: i,
            })
            .collect(),
    };
    let outcome = filter
        .apply(&event(SourceId::new(0, 0), EventPayload::Stored(stored)))
        .unwrap();
    assert!(outcome.capacity_omissions >= 24, "{outcome:?}");
}

/// Applies `op` to `filter`; returns what an observer could see of the call.
fn observe(filter: &mut PoolFilter, op: &Op) -> String {
    match op {
        Op::Store(source, stored) => {
            let event = event(*source, EventPayload::Stored(stored.clone()));
            format!("{:?}", filter.apply(&event))
        }
        Op::Remove(source, ids) => {
            let payload = EventPayload::Removed(RemovedBlocks {
                engine_block_ids: ids.clone(),
            });
            format!("{:?}", filter.apply(&event(*source, payload)))
        }
        Op::Clear(source) => format!("{:?}", filter.clear_source(*source)),
        Op::RemoveWorker(worker_id) => format!("{:?}", filter.remove_worker(*worker_id)),
        Op::Reset(source, chains) => format!("{:?}", filter.reset_source(*source, chains)),
        Op::Publish => format!("{:?}", filter.take_delta()),
        Op::Subscribe => format!("{:?}", filter.snapshot()),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn placement_seed_changes_no_observable_result(
        seed in any::<u64>(),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        // A tiny table, so equal fingerprints share buckets and release order would show.
        let config = CkfConfig { max_kicks: 16, ..CkfConfig::new(8) };
        let mut default_seeded = PoolFilter::new(config).unwrap();
        let mut seeded = PoolFilter::with_placement_seed(config, seed).unwrap();
        for op in &ops {
            let expected = observe(&mut default_seeded, op);
            prop_assert_eq!(observe(&mut seeded, op), expected, "{:?}", op);
            prop_assert_eq!(seeded.words(), default_seeded.words());
            prop_assert_eq!(seeded.counters(), default_seeded.counters());
        }
    }
}

/// Applies the ownership ops of `ops` to `filter` and `model` (publication ops are
/// skipped; rejected events change neither).
fn apply_ownership_ops(filter: &mut PoolFilter, model: &mut Model, ops: &[Op]) {
    for op in ops {
        match op {
            Op::Store(source, stored) => {
                let expected = model.store(*source, stored);
                let got = filter.apply(&event(*source, EventPayload::Stored(stored.clone())));
                assert_eq!(got.is_ok(), expected.is_ok(), "{got:?}");
            }
            Op::Remove(source, ids) => {
                model.remove(*source, ids);
                let payload = EventPayload::Removed(RemovedBlocks {
                    engine_block_ids: ids.clone(),
                });
                filter.apply(&event(*source, payload)).unwrap();
            }
            Op::Clear(source) => {
                model.lineage.remove(source);
                filter.clear_source(*source).unwrap();
            }
            Op::RemoveWorker(worker_id) => {
                model.lineage.retain(|s, _| s.worker_id != *worker_id);
                filter.remove_worker(*worker_id).unwrap();
            }
            Op::Reset(source, chains) => {
                let expected = model.reset(*source, chains);
                assert_eq!(
                    filter.reset_source(*source, chains).is_ok(),
                    expected.is_ok()
                );
            }
            Op::Publish | Op::Subscribe => {}
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    /// A checkpoint is every source's mappings: restored into a fresh filter (another
    /// placement seed, tiny or roomy), ownership, residency and counters match the model
    /// exactly; restoring one source over a live filter replaces only that source.
    #[test]
    fn restored_mappings_rebuild_the_exact_state(
        ops in prop::collection::vec(op(), 1..120),
        later in prop::collection::vec(op(), 0..40),
        expected_blocks in prop::sample::select(vec![8u64, 256]),
        seed in any::<u64>(),
    ) {
        let mut filter = PoolFilter::new(CkfConfig::new(expected_blocks)).unwrap();
        let mut model = Model::default();
        apply_ownership_ops(&mut filter, &mut model, &ops);
        let exported: Vec<(SourceId, Vec<(u64, u64)>)> = filter
            .sources()
            .map(|source| (source, filter.source_mappings(source).collect()))
            .collect();

        let mut restored =
            PoolFilter::with_placement_seed(CkfConfig::new(expected_blocks), seed).unwrap();
        for (source, mappings) in &exported {
            restored.restore_source(*source, mappings).unwrap();
        }
        check_state(&restored, &model)?;

        // Later events diverge the live filter; restoring a source brings back exactly
        // its exported mappings and leaves every other source as it is.
        let mut later_model = model.clone();
        apply_ownership_ops(&mut filter, &mut later_model, &later);
        if let Some((source, mappings)) = exported.first() {
            filter.restore_source(*source, mappings).unwrap();
            later_model.lineage.insert(*source, model.lineage[source].clone());
            check_state(&filter, &later_model)?;
        }
    }
}

#[test]
fn a_restore_that_contradicts_itself_changes_nothing() {
    let mut filter = PoolFilter::new(CkfConfig::new(64)).unwrap();
    let source = SourceId::new(1, 0);
    filter.restore_source(source, &[(1, 10), (2, 20)]).unwrap();
    let words = filter.words().to_vec();
    let err = filter
        .restore_source(source, &[(3, 30), (3, 31)])
        .unwrap_err();
    assert!(format!("{err}").contains("3"), "{err}");
    assert_eq!(filter.words(), &words[..]);
    assert_eq!(filter.canonical_of(source, 2), Some(20));
    assert_eq!(filter.canonical_of(source, 3), None);
    // The same mapping twice is one mapping.
    filter.restore_source(source, &[(4, 40), (4, 40)]).unwrap();
    assert_eq!(filter.n_mappings(), 1);
    assert_eq!(filter.owner_count(40), 1);
}
