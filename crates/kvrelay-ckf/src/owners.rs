//! The owner table: canonical hash → owner count and residency, stored inline in one
//! open-addressing array (linear probing, backward-shift deletion).
//!
//! A general-purpose map keeps its control bytes apart from its entries, so a lookup costs
//! two cache misses on a large table, and the slot a new key lands in is unknown until
//! the insert runs. Here key and entry share one 16-byte slot and a key lands at or just
//! after its home slot, so one prefetch of the home slot (see `Ownership::prefetch`) brings in
//! the line a later lookup, increment, insert or removal touches. A slot is empty exactly
//! when its owner count is 0; every stored entry has at least one owner.

use crate::keyhash::mix;
use crate::prefetch::{SLOTS_PER_LINE, prefetch_element};
use crate::slots::{self, max_len};

/// Owner count and residency of one canonical hash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct OwnerEntry {
    /// Mappings pointing at the hash; 0 only in empty slots.
    pub(crate) owners: u32,
    /// Its fingerprint is in the table.
    pub(crate) resident: bool,
    /// A full admission failed for capacity while owned (an omission).
    pub(crate) omitted: bool,
}

pub(crate) use crate::slots::GrowFailed;

/// The table; see the module docs.
#[derive(Debug, Clone, Default)]
pub(crate) struct OwnerTable {
    /// Power-of-two length (or 0 before the first reservation).
    slots: Vec<(u64, OwnerEntry)>,
    len: usize,
    /// Keys every hash's home slot (see `PoolFilter::with_placement_seed`).
    seed: u64,
}

impl OwnerTable {
    /// An empty table (nothing allocated) whose home slots are keyed by `seed`.
    pub(crate) fn with_seed(seed: u64) -> Self {
        Self {
            slots: Vec::new(),
            len: 0,
            seed,
        }
    }

    /// Stored hashes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Allocated slots.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Makes room for `n_more` new hashes, so that inserting them cannot allocate.
    pub(crate) fn try_reserve(&mut self, n_more: usize) -> Result<(), GrowFailed> {
        let needed = self.len.saturating_add(n_more);
        let Some(slots) = slots::grown(self.slots.len(), needed, (0, OwnerEntry::default()))?
        else {
            return Ok(());
        };
        let mask = slots.len() - 1;
        let old = std::mem::replace(&mut self.slots, slots);
        for (key, entry) in old.into_iter().filter(|(_, e)| e.owners > 0) {
            let mut idx = home(key, self.seed, mask);
            while self.slots[idx].1.owners > 0 {
                idx = (idx + 1) & mask;
            }
            self.slots[idx] = (key, entry);
        }
        Ok(())
    }

    /// The entry of `key`, if stored.
    #[inline]
    pub(crate) fn get(&self, key: u64) -> Option<&OwnerEntry> {
        self.find(key).map(|idx| &self.slots[idx].1)
    }

    /// The entry of `key`, if stored.
    #[inline]
    pub(crate) fn get_mut(&mut self, key: u64) -> Option<&mut OwnerEntry> {
        self.find(key).map(|idx| &mut self.slots[idx].1)
    }

    /// Adds one owner to `key` (storing it with one owner when new) and returns its entry
    /// and whether it is new; `None` when no slot was reserved (a caller bug). The count
    /// saturates (callers rule out overflow).
    #[inline]
    pub(crate) fn add_owner(&mut self, key: u64) -> Option<(&mut OwnerEntry, bool)> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut idx = home(key, self.seed, mask);
        loop {
            let (slot_key, entry) = self.slots[idx];
            if entry.owners == 0 {
                if self.len >= max_len(self.slots.len()) {
                    return None;
                }
                self.len += 1;
                self.slots[idx] = (
                    key,
                    OwnerEntry {
                        owners: 1,
                        resident: false,
                        omitted: false,
                    },
                );
                return Some((&mut self.slots[idx].1, true));
            }
            if slot_key == key {
                let entry = &mut self.slots[idx].1;
                entry.owners = entry.owners.saturating_add(1);
                return Some((entry, false));
            }
            idx = (idx + 1) & mask;
        }
    }

    /// Drops one owner of `key`; returns the entry as it was when that was the last owner
    /// (the hash is no longer stored), `Ok(None)` when owners remain, [`NotStored`] when
    /// `key` is not stored.
    #[inline]
    pub(crate) fn drop_owner(&mut self, key: u64) -> Result<Option<OwnerEntry>, NotStored> {
        let idx = self.find(key).ok_or(NotStored)?;
        let entry = &mut self.slots[idx].1;
        entry.owners -= 1;
        if entry.owners > 0 {
            return Ok(None);
        }
        let removed = *entry;
        self.remove_at(idx);
        Ok(Some(removed))
    }

    /// Stored hashes and their entries, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &OwnerEntry)> + '_ {
        self.slots
            .iter()
            .filter(|(_, e)| e.owners > 0)
            .map(|(k, e)| (*k, e))
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
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.slots.len() - 1;
        let mut idx = home(key, self.seed, mask);
        loop {
            let (slot_key, entry) = &self.slots[idx];
            if entry.owners == 0 {
                return None;
            }
            if *slot_key == key {
                return Some(idx);
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
            let (key, entry) = self.slots[next];
            if entry.owners == 0 {
                break;
            }
            // The entry may fill the hole if the hole lies between its home and `next`.
            let from_home = next.wrapping_sub(home(key, self.seed, mask)) & mask;
            let from_hole = next.wrapping_sub(hole) & mask;
            if from_home >= from_hole {
                self.slots[hole] = (key, entry);
                hole = next;
            }
        }
        self.slots[hole] = (0, OwnerEntry::default());
        self.len -= 1;
    }
}

/// A removal named a hash the table does not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NotStored;

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

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn behaves_like_a_map_of_counts(ops in prop::collection::vec((any::<bool>(), 0u64..40), 0..400)) {
            let mut table = OwnerTable::default();
            let mut model: HashMap<u64, u32> = HashMap::new();
            for (add, key) in ops {
                if add {
                    table.try_reserve(1).unwrap();
                    let (entry, new) = table.add_owner(key).unwrap();
                    let count = model.entry(key).or_insert(0);
                    prop_assert_eq!(new, *count == 0);
                    *count += 1;
                    prop_assert_eq!(entry.owners, *count);
                } else {
                    let got = table.drop_owner(key);
                    match model.get_mut(&key) {
                        None => prop_assert_eq!(got, Err(NotStored)),
                        Some(count) => {
                            *count -= 1;
                            if *count == 0 {
                                model.remove(&key);
                                prop_assert!(matches!(got, Ok(Some(_))));
                            } else {
                                prop_assert_eq!(got, Ok(None));
                            }
                        }
                    }
                }
                prop_assert_eq!(table.len(), model.len());
                for (&key, &count) in &model {
                    prop_assert_eq!(table.get(key).map(|e| e.owners), Some(count));
                }
                prop_assert_eq!(table.iter().count(), model.len());
            }
        }
    }

    #[test]
    fn colliding_run_survives_removal_from_its_middle() {
        // Keys chosen to share a home slot in a 16-slot table.
        let mut table = OwnerTable::default();
        table.try_reserve(8).unwrap();
        let mask = table.capacity() - 1;
        let keys: Vec<u64> = (0..10_000u64)
            .filter(|&k| home(k, 0, mask) == 3)
            .take(4)
            .collect();
        for &key in &keys {
            table.add_owner(key).unwrap();
        }
        assert_eq!(
            table.drop_owner(keys[1]),
            Ok(Some(OwnerEntry {
                owners: 0,
                ..OwnerEntry::default()
            }))
        );
        for &key in [keys[0], keys[2], keys[3]].iter() {
            assert_eq!(table.get(key).unwrap().owners, 1);
        }
        assert_eq!(table.get(keys[1]), None);
    }

    #[test]
    fn the_seed_moves_keys_but_not_answers() {
        // Sequential keys (like root canonicals from crafted token hashes) under two seeds.
        let keys: Vec<u64> = (0..64u64).map(|i| i << 20).collect();
        let placed = |seed: u64| {
            let mut table = OwnerTable::with_seed(seed);
            table.try_reserve(keys.len()).unwrap();
            for &key in &keys {
                table.add_owner(key).unwrap();
            }
            for &key in keys.iter().step_by(2) {
                table.add_owner(key).unwrap();
            }
            let slots: Vec<usize> = keys.iter().map(|&key| table.find(key).unwrap()).collect();
            let counts: Vec<u32> = keys
                .iter()
                .map(|&key| table.get(key).unwrap().owners)
                .collect();
            (slots, counts)
        };
        let (first_slots, first_counts) = placed(1);
        let (second_slots, second_counts) = placed(0xDEAD_BEEF);
        assert_eq!(first_counts, second_counts);
        let n_moved = first_slots
            .iter()
            .zip(&second_slots)
            .filter(|(a, b)| a != b)
            .count();
        assert!(n_moved > keys.len() / 2, "only {n_moved} keys moved");
    }

    #[test]
    fn adding_without_a_reservation_is_refused() {
        let mut table = OwnerTable::default();
        assert!(table.add_owner(7).is_none());
        table.try_reserve(1).unwrap();
        let limit = max_len(table.capacity());
        for key in 0..limit as u64 {
            assert!(table.add_owner(key).is_some());
        }
        assert!(table.add_owner(u64::MAX).is_none());
        assert_eq!(table.len(), limit);
    }
}
