//! One source's lineage: engine block id → canonical sequence hash, stored inline in one
//! open-addressing array (linear probing, backward-shift deletion).
//!
//! Like the owner table (`owners.rs`), key and value share one 16-byte slot and a key
//! lands at or just after its home slot, so one read of the home slot brings in the line
//! a later insert or removal touches. The empty-slot marker is the key `u64::MAX`; a
//! mapping of that engine id lives in a side field instead.
//!
//! Engines choose their block ids, so the home slot is keyed by a per-filter lineage seed
//! (see `PoolFilter::with_placement_seed`): ids that collide under one seed spread under
//! another. The keyed mix resists precomputed collision sets, not a cryptographic attack.

use crate::keyhash::mix;
use crate::prefetch::{SLOTS_PER_LINE, prefetch_element};
use crate::slots::{self, GrowFailed, max_len};

/// The key marking an empty slot.
const EMPTY: u64 = u64::MAX;

/// The map; see the module docs.
#[derive(Debug, Clone)]
pub(crate) struct LineageMap {
    /// `(engine block id, canonical)`; power-of-two length (or 0 before the first
    /// reservation).
    slots: Vec<(u64, u64)>,
    /// Mappings in `slots` (not counting `max_id`).
    n_slotted: usize,
    /// The canonical of engine id `u64::MAX`, if mapped.
    max_id: Option<u64>,
    /// Keys the home slot of every engine id.
    seed: u64,
}

impl LineageMap {
    /// An empty map (nothing allocated) whose slots are placed by `seed`.
    pub(crate) fn new(seed: u64) -> Self {
        Self {
            slots: Vec::new(),
            n_slotted: 0,
            max_id: None,
            seed,
        }
    }

    /// Mappings held.
    pub(crate) fn len(&self) -> usize {
        self.n_slotted + usize::from(self.max_id.is_some())
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Allocated slots.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Makes room for `n_more` new mappings, so that inserting them cannot allocate.
    pub(crate) fn try_reserve(&mut self, n_more: usize) -> Result<(), GrowFailed> {
        let needed = self.n_slotted.saturating_add(n_more);
        let Some(slots) = slots::grown(self.slots.len(), needed, (EMPTY, 0))? else {
            return Ok(());
        };
        let mask = slots.len() - 1;
        let old = std::mem::replace(&mut self.slots, slots);
        for (key, value) in old.into_iter().filter(|&(k, _)| k != EMPTY) {
            let mut idx = home(key, self.seed, mask);
            while self.slots[idx].0 != EMPTY {
                idx = (idx + 1) & mask;
            }
            self.slots[idx] = (key, value);
        }
        Ok(())
    }

    /// The canonical `engine_block_id` maps to.
    #[inline]
    pub(crate) fn get(&self, engine_block_id: u64) -> Option<u64> {
        if engine_block_id == EMPTY {
            return self.max_id;
        }
        self.find(engine_block_id).map(|idx| self.slots[idx].1)
    }

    /// Maps `engine_block_id` to `canonical` (replacing any mapping); `false` when no slot
    /// was reserved (a caller bug) and nothing changed.
    #[inline]
    pub(crate) fn insert(&mut self, engine_block_id: u64, canonical: u64) -> bool {
        if engine_block_id == EMPTY {
            self.max_id = Some(canonical);
            return true;
        }
        match self.probe(engine_block_id) {
            Some(Ok(idx)) => {
                self.slots[idx].1 = canonical;
                true
            }
            Some(Err(vacant)) => self.place(vacant, engine_block_id, canonical),
            None => false,
        }
    }

    /// The canonical `engine_block_id` maps to, or (`Err`) the slot inserting it would
    /// take right now (`None` when that is not a plain slot): a store looks each new id
    /// up once and hands the slot to [`LineageMap::insert_at`].
    #[inline]
    pub(crate) fn get_or_vacant(&self, engine_block_id: u64) -> Result<u64, Option<usize>> {
        if engine_block_id == EMPTY {
            return self.max_id.ok_or(None);
        }
        match self.probe(engine_block_id) {
            Some(Ok(idx)) => Ok(self.slots[idx].1),
            Some(Err(vacant)) => Err(Some(vacant)),
            None => Err(None),
        }
    }

    /// [`LineageMap::insert`] of an id that is not mapped, into `vacant` from
    /// [`LineageMap::get_or_vacant`] when that slot is still empty and the table has
    /// `n_slots` slots as it had then. Other inserts since can only have filled slots, so
    /// an empty `vacant` is still the first empty slot of the id's run.
    #[inline]
    pub(crate) fn insert_at(
        &mut self,
        engine_block_id: u64,
        canonical: u64,
        vacant: Option<usize>,
        n_slots: usize,
    ) -> bool {
        match vacant {
            Some(idx)
                if n_slots == self.slots.len()
                    && self.slots.get(idx).is_some_and(|&(key, _)| key == EMPTY) =>
            {
                self.place(idx, engine_block_id, canonical)
            }
            _ => self.insert(engine_block_id, canonical),
        }
    }

    /// Stores a new mapping in the empty slot `idx`, the first of its key's run; `false`
    /// (nothing changed) when the load limit is reached (no slot was reserved).
    #[inline]
    fn place(&mut self, idx: usize, engine_block_id: u64, canonical: u64) -> bool {
        if self.n_slotted >= max_len(self.slots.len()) {
            return false;
        }
        self.n_slotted += 1;
        self.slots[idx] = (engine_block_id, canonical);
        true
    }

    /// Removes and returns the mapping of `engine_block_id`.
    #[inline]
    pub(crate) fn remove(&mut self, engine_block_id: u64) -> Option<u64> {
        if engine_block_id == EMPTY {
            return self.max_id.take();
        }
        let idx = self.find(engine_block_id)?;
        let canonical = self.slots[idx].1;
        self.remove_at(idx);
        Some(canonical)
    }

    /// Every mapped canonical (with repeats), in slot order.
    pub(crate) fn values(&self) -> impl Iterator<Item = u64> + '_ {
        self.slots
            .iter()
            .filter(|&&(k, _)| k != EMPTY)
            .map(|&(_, v)| v)
            .chain(self.max_id)
    }

    /// Every `(engine block id, canonical)` mapping, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.slots
            .iter()
            .copied()
            .filter(|&(k, _)| k != EMPTY)
            .chain(self.max_id.map(|canonical| (EMPTY, canonical)))
    }

    /// Prefetches the home slot of `key`, so that the misses of many keys overlap.
    #[inline]
    pub(crate) fn prefetch(&self, key: u64) {
        if !self.slots.is_empty() {
            let idx = home(key, self.seed, self.slots.len() - 1);
            prefetch_element(&self.slots, idx);
            prefetch_element(&self.slots, idx + SLOTS_PER_LINE);
        }
    }

    fn find(&self, key: u64) -> Option<usize> {
        self.probe(key)?.ok()
    }

    /// Walks `key`'s probe run: `Ok` with its slot, or `Err` with the first empty slot
    /// (where it would go); `None` before the first reservation.
    #[inline]
    fn probe(&self, key: u64) -> Option<Result<usize, usize>> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut idx = home(key, self.seed, mask);
        loop {
            let slot_key = self.slots[idx].0;
            if slot_key == key {
                return Some(Ok(idx));
            }
            if slot_key == EMPTY {
                return Some(Err(idx));
            }
            idx = (idx + 1) & mask;
        }
    }

    /// Empties slot `idx`, shifting later entries of its probe run back so every stored
    /// key stays reachable from its home slot without gaps.
    fn remove_at(&mut self, idx: usize) {
        let mask = self.slots.len() - 1;
        let mut hole = idx;
        let mut next = idx;
        loop {
            next = (next + 1) & mask;
            let (key, value) = self.slots[next];
            if key == EMPTY {
                break;
            }
            // The entry may fill the hole if the hole lies between its home and `next`.
            let from_home = next.wrapping_sub(home(key, self.seed, mask)) & mask;
            let from_hole = next.wrapping_sub(hole) & mask;
            if from_home >= from_hole {
                self.slots[hole] = (key, value);
                hole = next;
            }
        }
        self.slots[hole] = (EMPTY, 0);
        self.n_slotted -= 1;
    }
}

/// The home slot of `key` under `seed` in a table of `mask + 1` slots.
#[inline]
fn home(key: u64, seed: u64, mask: usize) -> usize {
    (mix(key ^ seed) as usize) & mask
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test assertions")]

    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn key() -> impl Strategy<Value = u64> {
        prop_oneof![0u64..40, Just(u64::MAX), Just(u64::MAX - 1)]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn behaves_like_a_hash_map(
            seed in any::<u64>(),
            ops in prop::collection::vec((any::<bool>(), key(), any::<u64>()), 0..400),
        ) {
            let mut map = LineageMap::new(seed);
            let mut model: HashMap<u64, u64> = HashMap::new();
            for (insert, id, canonical) in ops {
                if insert {
                    map.try_reserve(1).unwrap();
                    prop_assert!(map.insert(id, canonical));
                    model.insert(id, canonical);
                } else {
                    prop_assert_eq!(map.remove(id), model.remove(&id));
                }
                prop_assert_eq!(map.len(), model.len());
                for (&id, &canonical) in &model {
                    prop_assert_eq!(map.get(id), Some(canonical));
                }
                let mut values: Vec<u64> = map.values().collect();
                let mut expected: Vec<u64> = model.values().copied().collect();
                values.sort_unstable();
                expected.sort_unstable();
                prop_assert_eq!(values, expected);
            }
        }
    }

    /// Mean distance of stored keys from their home slot.
    fn mean_displacement(map: &LineageMap) -> f64 {
        let mask = map.slots.len() - 1;
        let (sum, n) = map
            .slots
            .iter()
            .enumerate()
            .filter(|(_, (k, _))| *k != EMPTY)
            .fold((0usize, 0usize), |(sum, n), (idx, (k, _))| {
                (
                    sum + (idx.wrapping_sub(home(*k, map.seed, mask)) & mask),
                    n + 1,
                )
            });
        sum as f64 / n as f64
    }

    #[test]
    fn structured_engine_ids_do_not_cluster() {
        // Sequential, page-like, and high-bit engine ids spread like random keys (linear
        // probing at <= 75 % load expects a mean displacement around 1.5).
        for seed in [0, 0x5EED, u64::MAX - 1] {
            for shift in [0u32, 6, 12, 20, 32, 44] {
                let mut map = LineageMap::new(seed);
                map.try_reserve(1 << 15).unwrap();
                for i in 0..(1u64 << 15) {
                    assert!(map.insert(i << shift, i));
                }
                let displacement = mean_displacement(&map);
                assert!(
                    displacement < 3.0,
                    "seed {seed:#x} shift {shift}: mean displacement {displacement}"
                );
            }
        }
    }

    #[test]
    fn two_seeds_place_the_same_ids_differently() {
        let ids: Vec<u64> = (0..64u64).map(|i| i << 12).collect();
        let homes = |seed: u64| -> Vec<usize> {
            let mut map = LineageMap::new(seed);
            map.try_reserve(ids.len()).unwrap();
            for &id in &ids {
                assert!(map.insert(id, id + 1));
            }
            ids.iter().map(|&id| map.find(id).unwrap()).collect()
        };
        let (first, second) = (homes(1), homes(2));
        let n_moved = first.iter().zip(&second).filter(|(a, b)| a != b).count();
        assert!(
            n_moved > ids.len() / 2,
            "only {n_moved} of {} ids changed slot",
            ids.len()
        );
    }

    #[test]
    fn a_lineage_answers_the_same_under_any_seed() {
        let ids: Vec<u64> = (0..200u64).map(|i| i.wrapping_mul(0x1_0000_0001)).collect();
        for seed in [0, 1, 0xDEAD_BEEF, u64::MAX] {
            let mut map = LineageMap::new(seed);
            map.try_reserve(ids.len()).unwrap();
            for &id in &ids {
                assert!(map.insert(id, !id));
            }
            for &id in ids.iter().step_by(3) {
                assert_eq!(map.remove(id), Some(!id));
            }
            for (idx, &id) in ids.iter().enumerate() {
                let expected = (idx % 3 != 0).then_some(!id);
                assert_eq!(map.get(id), expected, "seed {seed:#x} id {id}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        /// Vacant slots handed out before a batch of inserts (and a possible growth) still
        /// place every id where a lookup finds it.
        #[test]
        fn inserting_at_stale_vacant_slots_stays_consistent(
            seed in any::<u64>(),
            batches in prop::collection::vec(prop::collection::vec(0u64..64, 1..12), 1..20),
        ) {
            let mut map = LineageMap::new(seed);
            let mut model: HashMap<u64, u64> = HashMap::new();
            for (round, ids) in batches.iter().enumerate() {
                let n_slots = map.capacity();
                let probes: Vec<_> = ids.iter().map(|&id| map.get_or_vacant(id)).collect();
                map.try_reserve(ids.len()).unwrap();
                for (&id, probe) in ids.iter().zip(probes) {
                    if model.contains_key(&id) {
                        continue;
                    }
                    let vacant = probe.expect_err("unmapped ids have no canonical");
                    prop_assert!(map.insert_at(id, round as u64, vacant, n_slots));
                    model.insert(id, round as u64);
                }
                prop_assert_eq!(map.len(), model.len());
                for (&id, &canonical) in &model {
                    prop_assert_eq!(map.get_or_vacant(id), Ok(canonical));
                }
                if round % 3 == 2 {
                    let victim = ids[0];
                    prop_assert_eq!(map.remove(victim), model.remove(&victim));
                }
            }
        }
    }

    #[test]
    fn inserting_without_a_reservation_is_refused() {
        let mut map = LineageMap::new(0);
        assert!(!map.insert(7, 1));
        assert!(map.is_empty());
        assert!(
            map.insert(u64::MAX, 1),
            "the side slot needs no reservation"
        );
        assert_eq!(map.get(u64::MAX), Some(1));
    }
}
