//! Model tests of lower-tier lanes: random stores, removals and clears on the device and
//! on two lower tiers from several sources, offloads (resolved through the device lineage
//! of the moment), device evictions after an offload, reloads and source resets, against
//! an exact model of residency per (source, tier). The device filter must stay
//! bit-identical to a filter fed only the device events, as before tiers existed.

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_ckf::{
    CacheTier, CkfConfig, EventPayload, PoolFilter, RemovedBlocks, RouterEvent, SourceId,
    StoredBlock, StoredBlocks, TierApplyError, TierChange, TierEvent, TierLane,
};
use kvrelay_identity::hashing::{canonical_child, canonical_root};
use proptest::prelude::*;

/// Exact residency of one tier: per source, engine id → canonical hash.
type Lineages = BTreeMap<SourceId, BTreeMap<u64, u64>>;

#[derive(Debug, Default, Clone)]
struct Model {
    tiers: BTreeMap<CacheTier, Lineages>,
}

impl Model {
    fn lineage(&self, tier: CacheTier, source: SourceId) -> BTreeMap<u64, u64> {
        self.tiers
            .get(&tier)
            .and_then(|l| l.get(&source))
            .cloned()
            .unwrap_or_default()
    }

    fn set(&mut self, tier: CacheTier, source: SourceId, map: BTreeMap<u64, u64>) {
        let lineages = self.tiers.entry(tier).or_default();
        if map.is_empty() {
            lineages.remove(&source);
        } else {
            lineages.insert(source, map);
        }
    }

    /// New `(id, canonical)` pairs on top of `map`; `Err` when an id would change hash.
    fn admit(map: &BTreeMap<u64, u64>, pairs: &[(u64, u64)]) -> Result<BTreeMap<u64, u64>, ()> {
        let mut next = map.clone();
        for &(id, canonical) in pairs {
            match next.get(&id) {
                Some(&c) if c != canonical => return Err(()),
                Some(_) => {}
                None => {
                    next.insert(id, canonical);
                }
            }
        }
        Ok(next)
    }

    fn store(
        &mut self,
        tier: CacheTier,
        source: SourceId,
        stored: &StoredBlocks,
    ) -> Result<(), ()> {
        let map = self.lineage(tier, source);
        let mut parent = match stored.parent_engine_block_id {
            None => None,
            Some(p) => Some(*map.get(&p).ok_or(())?),
        };
        let mut pairs = Vec::new();
        for block in &stored.blocks {
            let canonical = match parent {
                None => canonical_root(block.token_hash),
                Some(p) => canonical_child(p, block.token_hash),
            };
            parent = Some(canonical);
            pairs.push((block.engine_block_id, canonical));
        }
        let next = Self::admit(&map, &pairs)?;
        self.set(tier, source, next);
        Ok(())
    }

    /// Resolves through the device lineage; returns how many ids were unmapped.
    fn offload(&mut self, tier: CacheTier, source: SourceId, ids: &[u64]) -> Result<u64, ()> {
        let device = self.lineage(CacheTier::Device, source);
        let pairs: Vec<(u64, u64)> = ids
            .iter()
            .filter_map(|id| device.get(id).map(|&c| (*id, c)))
            .collect();
        let unmapped = (ids.len() - pairs.len()) as u64;
        let next = Self::admit(&self.lineage(tier, source), &pairs)?;
        self.set(tier, source, next);
        Ok(unmapped)
    }

    fn remove(&mut self, tier: CacheTier, source: SourceId, ids: &[u64]) {
        let mut map = self.lineage(tier, source);
        for id in ids {
            map.remove(id);
        }
        self.set(tier, source, map);
    }

    fn clear(&mut self, tier: CacheTier, source: SourceId) {
        self.set(tier, source, BTreeMap::new());
    }
}

#[derive(Debug, Clone)]
enum Op {
    Store(CacheTier, SourceId, StoredBlocks),
    Offload(CacheTier, SourceId, Vec<u64>),
    Remove(CacheTier, SourceId, Vec<u64>),
    Clear(CacheTier, SourceId),
    /// A source reset: every tier of the source is dropped (as the pool does).
    Reset(SourceId),
}

const LOWER: [CacheTier; 2] = [CacheTier::Host, CacheTier::Disk];

fn tier() -> impl Strategy<Value = CacheTier> {
    prop_oneof![
        2 => Just(CacheTier::Device),
        1 => Just(CacheTier::Host),
        1 => Just(CacheTier::Disk),
    ]
}

fn lower_tier() -> impl Strategy<Value = CacheTier> {
    prop::sample::select(LOWER.to_vec())
}

fn source() -> impl Strategy<Value = SourceId> {
    (0u64..2, 0u32..2).prop_map(|(worker_id, dp_rank)| SourceId { worker_id, dp_rank })
}

fn chain() -> impl Strategy<Value = StoredBlocks> {
    (
        prop::option::weighted(0.5, 0u64..20),
        prop::collection::vec((0u64..20, 0u64..5), 0..6),
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

fn ids() -> impl Strategy<Value = Vec<u64>> {
    prop::collection::vec(0u64..22, 0..5)
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (tier(), source(), chain()).prop_map(|(t, s, c)| Op::Store(t, s, c)),
        5 => (lower_tier(), source(), ids()).prop_map(|(t, s, i)| Op::Offload(t, s, i)),
        4 => (tier(), source(), ids()).prop_map(|(t, s, i)| Op::Remove(t, s, i)),
        1 => (tier(), source()).prop_map(|(t, s)| Op::Clear(t, s)),
        1 => source().prop_map(Op::Reset),
    ]
}

fn device_event(source: SourceId, payload: EventPayload) -> RouterEvent {
    RouterEvent {
        source,
        event_id: 0,
        payload,
    }
}

fn tier_event(tier: CacheTier, source: SourceId, change: TierChange) -> TierEvent {
    TierEvent {
        source,
        event_id: 0,
        tier,
        change,
    }
}

/// A filter large enough never to omit a hash, so residency is exact.
fn config() -> CkfConfig {
    CkfConfig::new(4096)
}

/// The filter holds exactly the model's lineages, owner counts and residency.
fn check(filter: &PoolFilter, lineages: Option<&Lineages>) -> Result<(), TestCaseError> {
    let empty = Lineages::new();
    let lineages = lineages.unwrap_or(&empty);
    let mut owners: BTreeMap<u64, u32> = BTreeMap::new();
    let mut n_mappings = 0;
    for (&source, map) in lineages {
        let mut held: Vec<(u64, u64)> = filter.source_mappings(source).collect();
        held.sort_unstable();
        prop_assert_eq!(held, map.iter().map(|(&i, &c)| (i, c)).collect::<Vec<_>>());
        for &canonical in map.values() {
            *owners.entry(canonical).or_default() += 1;
            n_mappings += 1;
        }
    }
    prop_assert_eq!(filter.n_mappings(), n_mappings);
    let sources: BTreeSet<SourceId> = filter.sources().collect();
    prop_assert_eq!(sources, lineages.keys().copied().collect::<BTreeSet<_>>());
    prop_assert_eq!(filter.n_canonicals(), owners.len() as u64);
    for (&canonical, &count) in &owners {
        prop_assert_eq!(filter.owner_count(canonical), count);
        prop_assert!(filter.contains(canonical), "{canonical:#x} missing");
    }
    prop_assert_eq!(filter.count_occupied_slots(), owners.len() as u64);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn lanes_hold_exactly_each_tiers_blocks_and_the_device_filter_is_unchanged(
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let mut device = PoolFilter::new(config()).unwrap();
        // Today's code path: the same device events alone, no tiers anywhere.
        let mut device_only = PoolFilter::new(config()).unwrap();
        let mut lanes: BTreeMap<CacheTier, TierLane> = LOWER
            .iter()
            .map(|&t| (t, TierLane::new(t, config()).unwrap()))
            .collect();
        let mut model = Model::default();
        let mut unmapped: BTreeMap<CacheTier, u64> = BTreeMap::new();
        for op in &ops {
            match op {
                Op::Store(CacheTier::Device, source, stored) => {
                    let event = device_event(*source, EventPayload::Stored(stored.clone()));
                    let expected = model.store(CacheTier::Device, *source, stored);
                    prop_assert_eq!(device.apply(&event).is_ok(), expected.is_ok());
                    prop_assert_eq!(device_only.apply(&event).is_ok(), expected.is_ok());
                }
                Op::Store(tier, source, stored) => {
                    let event = tier_event(*tier, *source, TierChange::Stored(stored.clone()));
                    let expected = model.store(*tier, *source, stored);
                    let lane = lanes.get_mut(tier).unwrap();
                    prop_assert_eq!(lane.apply(&device, &event).is_ok(), expected.is_ok());
                }
                Op::Offload(tier, source, ids) => {
                    let event = tier_event(
                        *tier,
                        *source,
                        TierChange::Offloaded { engine_block_ids: ids.clone() },
                    );
                    let expected = model.offload(*tier, *source, ids);
                    let lane = lanes.get_mut(tier).unwrap();
                    match (lane.apply(&device, &event), expected) {
                        (Ok(outcome), Ok(n)) => {
                            prop_assert_eq!(outcome.unmapped, n);
                            *unmapped.entry(*tier).or_default() += n;
                        }
                        (Err(TierApplyError::Filter(_)), Err(())) => {
                            // Rejected whole, but its unmapped ids were still counted.
                            let device_map = model.lineage(CacheTier::Device, *source);
                            let n = ids.iter().filter(|i| !device_map.contains_key(i)).count();
                            *unmapped.entry(*tier).or_default() += n as u64;
                        }
                        (got, want) => prop_assert!(false, "{got:?} vs {want:?}"),
                    }
                }
                Op::Remove(CacheTier::Device, source, ids) => {
                    let event = device_event(
                        *source,
                        EventPayload::Removed(RemovedBlocks { engine_block_ids: ids.clone() }),
                    );
                    model.remove(CacheTier::Device, *source, ids);
                    prop_assert!(device.apply(&event).is_ok());
                    prop_assert!(device_only.apply(&event).is_ok());
                }
                Op::Remove(tier, source, ids) => {
                    let change = TierChange::Removed(RemovedBlocks { engine_block_ids: ids.clone() });
                    model.remove(*tier, *source, ids);
                    let lane = lanes.get_mut(tier).unwrap();
                    prop_assert!(lane.apply(&device, &tier_event(*tier, *source, change)).is_ok());
                }
                Op::Clear(CacheTier::Device, source) => {
                    let event = device_event(*source, EventPayload::AllCleared);
                    model.clear(CacheTier::Device, *source);
                    prop_assert!(device.apply(&event).is_ok());
                    prop_assert!(device_only.apply(&event).is_ok());
                }
                Op::Clear(tier, source) => {
                    model.clear(*tier, *source);
                    let lane = lanes.get_mut(tier).unwrap();
                    let event = tier_event(*tier, *source, TierChange::Cleared);
                    prop_assert!(lane.apply(&device, &event).is_ok());
                }
                Op::Reset(source) => {
                    for tier in [CacheTier::Device, CacheTier::Host, CacheTier::Disk] {
                        model.clear(tier, *source);
                    }
                    prop_assert!(device.clear_source(*source).is_ok());
                    prop_assert!(device_only.clear_source(*source).is_ok());
                    for lane in lanes.values_mut() {
                        prop_assert!(lane.filter_mut().clear_source(*source).is_ok());
                    }
                }
            }
            prop_assert_eq!(device.words(), device_only.words());
            prop_assert_eq!(device.counters(), device_only.counters());
            check(&device, model.tiers.get(&CacheTier::Device))?;
            for (tier, lane) in &lanes {
                check(lane.filter(), model.tiers.get(tier))?;
                prop_assert_eq!(lane.counters().offloads_unmapped, unmapped.get(tier).copied().unwrap_or(0));
            }
        }
        // The published stream of the device filter is the same too.
        prop_assert_eq!(device.take_delta().unwrap(), device_only.take_delta().unwrap());
    }
}

/// Offload, then the device evicts the block: the host lane keeps it until the host
/// evicts it; a reload to the device is a device store again.
#[test]
fn an_offloaded_block_outlives_its_device_copy_until_the_tier_evicts_it() {
    let source = SourceId::new(1, 0);
    let mut device = PoolFilter::new(config()).unwrap();
    let mut host = TierLane::new(CacheTier::Host, config()).unwrap();
    let store = device_event(
        source,
        EventPayload::Stored(StoredBlocks {
            parent_engine_block_id: None,
            blocks: vec![
                StoredBlock {
                    engine_block_id: 10,
                    token_hash: 1,
                },
                StoredBlock {
                    engine_block_id: 11,
                    token_hash: 2,
                },
            ],
        }),
    );
    device.apply(&store).unwrap();
    let second = canonical_child(canonical_root(1), 2);
    // A 2-block offload is keyed by its last device block.
    let offload = tier_event(
        CacheTier::Host,
        source,
        TierChange::Offloaded {
            engine_block_ids: vec![11],
        },
    );
    assert_eq!(host.apply(&device, &offload).unwrap().unmapped, 0);
    device
        .apply(&device_event(
            source,
            EventPayload::Removed(RemovedBlocks {
                engine_block_ids: vec![10, 11],
            }),
        ))
        .unwrap();
    assert!(!device.contains(second));
    assert!(
        host.filter().contains(second),
        "host keeps the offloaded block"
    );
    // Offloading again after the device eviction cannot be resolved: dropped, counted.
    assert_eq!(host.apply(&device, &offload).unwrap().unmapped, 1);
    assert_eq!(host.counters().offloads_unmapped, 1);
    // Reload: the device stores it again; the host copy is unaffected.
    device.apply(&store).unwrap();
    assert!(device.contains(second) && host.filter().contains(second));
    host.apply(
        &device,
        &tier_event(
            CacheTier::Host,
            source,
            TierChange::Removed(RemovedBlocks {
                engine_block_ids: vec![11],
            }),
        ),
    )
    .unwrap();
    assert!(!host.filter().contains(second) && device.contains(second));
    // An event for another tier is refused, nothing changes.
    let disk = tier_event(CacheTier::Disk, source, TierChange::Cleared);
    assert!(matches!(
        host.apply(&device, &disk),
        Err(TierApplyError::WrongTier {
            lane: CacheTier::Host,
            event: CacheTier::Disk
        })
    ));
}
