//! The packed cuckoo table: bucket words, insertion with bounded relocation and complete
//! rollback, removal of one fingerprint copy. No ownership knowledge lives here.

use crate::addressing::{Addressing, Home};
use crate::bucket;
use crate::prefetch::prefetch_element;
use kvrelay_identity::CkfFormat;

use crate::format::ConfigError;

/// SplitMix64 increment (also mixes the relocation seed).
const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The packed table plus its deterministic relocation state.
#[derive(Debug, Clone)]
pub(crate) struct Table {
    words: Vec<u64>,
    addressing: Addressing,
    max_kicks: u32,
    rng_state: u64,
    /// Writes of the insertion in progress: (bucket, previous word), in write order.
    write_log: Vec<(u32, u64)>,
}

/// Why an insert did not place its fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InsertFailed;

impl Table {
    /// An empty table for `format`, allocated fallibly; relocation choices derive from the
    /// format's seed only, so the same operations give the same table.
    pub(crate) fn new(format: CkfFormat, max_kicks: u32) -> Result<Self, ConfigError> {
        let bucket_count = format.bucket_count() as usize;
        let mut words = Vec::new();
        words
            .try_reserve_exact(bucket_count)
            .map_err(|_| ConfigError::AllocationFailed {
                what: "bucket table",
                bytes: u64::from(format.bucket_count()) * 8,
            })?;
        words.resize(bucket_count, 0);
        let log_len = max_kicks as usize + 1;
        let mut write_log = Vec::new();
        write_log
            .try_reserve_exact(log_len)
            .map_err(|_| ConfigError::AllocationFailed {
                what: "relocation log",
                bytes: (log_len * 16) as u64,
            })?;
        Ok(Self {
            words,
            addressing: Addressing::new(format),
            max_kicks,
            rng_state: splitmix(format.seed() ^ SPLITMIX_GAMMA),
            write_log,
        })
    }

    pub(crate) fn addressing(&self) -> &Addressing {
        &self.addressing
    }

    pub(crate) fn words(&self) -> &[u64] {
        &self.words
    }

    pub(crate) fn word(&self, bucket_idx: u32) -> u64 {
        self.words[bucket_idx as usize]
    }

    /// Prefetches the word of `bucket_idx`.
    #[inline]
    pub(crate) fn prefetch(&self, bucket_idx: u32) {
        prefetch_element(&self.words, bucket_idx as usize);
    }

    /// Whether `home`'s fingerprint is in either candidate bucket.
    pub(crate) fn contains(&self, home: Home) -> bool {
        let Home {
            fingerprint,
            primary,
        } = home;
        bucket::contains(self.word(primary), fingerprint)
            || bucket::contains(
                self.word(self.addressing.alternate(primary, fingerprint)),
                fingerprint,
            )
    }

    /// Inserts one copy of `address`'s fingerprint, relocating up to the table's budget.
    /// On success `touched(bucket, previous_word)` is called for every write, in order;
    /// on failure the table is exactly as before and nothing is reported.
    pub(crate) fn insert(
        &mut self,
        home: Home,
        touched: impl FnMut(u32, u64),
    ) -> Result<(), InsertFailed> {
        self.insert_with_budget(home, self.max_kicks, touched)
    }

    /// Inserts only if a candidate bucket has a free slot (no relocation, no rollback).
    pub(crate) fn insert_without_relocation(
        &mut self,
        home: Home,
        touched: impl FnMut(u32, u64),
    ) -> Result<(), InsertFailed> {
        self.insert_with_budget(home, 0, touched)
    }

    /// Removes one copy of `home`'s fingerprint (primary bucket first). Returns `false`
    /// (and changes nothing) when neither bucket holds it.
    pub(crate) fn remove(&mut self, home: Home, mut touched: impl FnMut(u32, u64)) -> bool {
        let Home {
            fingerprint,
            primary,
        } = home;
        if self.remove_from(primary, fingerprint, &mut touched) {
            return true;
        }
        // Hashed only on a miss in the primary bucket (written out so the compiler does not
        // hoist it above the primary's check).
        let alternate = self.addressing.alternate(primary, fingerprint);
        self.remove_from(alternate, fingerprint, &mut touched)
    }

    /// Clears one slot of `bucket_idx` holding `fingerprint`, if any.
    #[inline(always)]
    fn remove_from(
        &mut self,
        bucket_idx: u32,
        fingerprint: u16,
        touched: &mut impl FnMut(u32, u64),
    ) -> bool {
        self.rewrite(bucket_idx, touched, |word| {
            bucket::with_removed(word, fingerprint)
        })
    }

    /// Replaces the word of `bucket_idx` by `change(word)` when that is `Some`, reporting
    /// the write to `touched`; `false` (nothing written) otherwise.
    #[inline(always)]
    fn rewrite(
        &mut self,
        bucket_idx: u32,
        touched: &mut impl FnMut(u32, u64),
        change: impl FnOnce(u64) -> Option<u64>,
    ) -> bool {
        let previous = self.word(bucket_idx);
        match change(previous) {
            Some(next) => {
                self.words[bucket_idx as usize] = next;
                touched(bucket_idx, previous);
                true
            }
            None => false,
        }
    }

    /// Occupied fingerprint slots (scans the table).
    pub(crate) fn occupied_slots(&self) -> u64 {
        self.words
            .iter()
            .map(|&word| u64::from(bucket::occupied_slots(word)))
            .sum()
    }

    #[inline]
    fn insert_with_budget(
        &mut self,
        home: Home,
        max_kicks: u32,
        mut touched: impl FnMut(u32, u64),
    ) -> Result<(), InsertFailed> {
        let Home {
            fingerprint,
            primary,
        } = home;
        if self.insert_into(primary, fingerprint, &mut touched) {
            return Ok(());
        }
        let alternate = self.addressing.alternate(primary, fingerprint);
        if self.insert_into(alternate, fingerprint, &mut touched) {
            return Ok(());
        }
        if max_kicks == 0 {
            return Err(InsertFailed);
        }
        self.relocate(fingerprint, primary, alternate, max_kicks, touched)
    }

    /// Both candidate buckets are full: kicks fingerprints along their alternate buckets
    /// for up to `max_kicks` steps, or undoes every write.
    #[inline(never)]
    fn relocate(
        &mut self,
        fingerprint: u16,
        primary: u32,
        alternate: u32,
        max_kicks: u32,
        mut touched: impl FnMut(u32, u64),
    ) -> Result<(), InsertFailed> {
        self.write_log.clear();
        let mut carried = fingerprint;
        let mut bucket_idx = if self.next_random() & 1 == 0 {
            primary
        } else {
            alternate
        };
        for _ in 0..max_kicks {
            let slot = (self.next_random() & 3) as u32;
            let previous = self.word(bucket_idx);
            let evicted = bucket::slot_value(previous, slot);
            self.log_write(bucket_idx, previous);
            self.words[bucket_idx as usize] = bucket::with_slot(previous, slot, carried);
            carried = evicted;
            bucket_idx = self.addressing.alternate(bucket_idx, carried);
            let previous = self.word(bucket_idx);
            if let Some(next) = bucket::with_inserted(previous, carried) {
                self.log_write(bucket_idx, previous);
                self.words[bucket_idx as usize] = next;
                for &(bucket_idx, previous) in &self.write_log {
                    touched(bucket_idx, previous);
                }
                return Ok(());
            }
        }
        for &(bucket_idx, previous) in self.write_log.iter().rev() {
            self.words[bucket_idx as usize] = previous;
        }
        Err(InsertFailed)
    }

    /// Puts `fingerprint` in a free slot of `bucket_idx` if it has one.
    #[inline(always)]
    fn insert_into(
        &mut self,
        bucket_idx: u32,
        fingerprint: u16,
        touched: &mut impl FnMut(u32, u64),
    ) -> bool {
        self.rewrite(bucket_idx, touched, |word| {
            bucket::with_inserted(word, fingerprint)
        })
    }

    fn log_write(&mut self, bucket_idx: u32, previous: u64) {
        // Capacity is max_kicks + 1 and an insertion writes at most that many times, so
        // this push never reallocates.
        self.write_log.push((bucket_idx, previous));
    }

    fn next_random(&mut self) -> u64 {
        self.rng_state = self.rng_state.wrapping_add(SPLITMIX_GAMMA);
        splitmix(self.rng_state)
    }
}

/// The SplitMix64 output function.
fn splitmix(x: u64) -> u64 {
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_identity::DEFAULT_CKF_SEED;

    fn table(bucket_count: u32, max_kicks: u32) -> Table {
        Table::new(
            CkfFormat::v1(DEFAULT_CKF_SEED, bucket_count).unwrap(),
            max_kicks,
        )
        .unwrap()
    }

    #[test]
    fn inserted_hashes_are_found_until_removed() {
        let mut table = table(64, 500);
        let addresses: Vec<_> = (0..100u64).map(|h| table.addressing().home(h)).collect();
        for &address in &addresses {
            table.insert(address, |_, _| {}).unwrap();
        }
        assert!(addresses.iter().all(|&a| table.contains(a)));
        assert_eq!(table.occupied_slots(), 100);
        for &address in &addresses {
            assert!(table.remove(address, |_, _| {}));
        }
        assert!(table.words().iter().all(|&w| w == 0));
    }

    #[test]
    fn failed_relocation_rolls_back_every_write() {
        let mut table = table(4, 50);
        let mut inserted = Vec::new();
        let mut hash = 0u64;
        // Fill until an insert fails, then check the failure left the table unchanged.
        loop {
            let address = table.addressing().home(hash);
            let before = table.words().to_vec();
            let mut n_touched = 0;
            match table.insert(address, |_, _| n_touched += 1) {
                Ok(()) => inserted.push(address),
                Err(InsertFailed) => {
                    assert_eq!(table.words(), &before[..]);
                    assert_eq!(n_touched, 0);
                    break;
                }
            }
            hash += 1;
        }
        assert!(inserted.iter().all(|&a| table.contains(a)));
    }

    #[test]
    fn touched_reports_previous_words_in_write_order() {
        let mut table = table(4, 500);
        let mut replay = [0u64; 4];
        for hash in 0..14u64 {
            let address = table.addressing().home(hash);
            let mut log = Vec::new();
            if table.insert(address, |b, prev| log.push((b, prev))).is_ok() {
                // The first report for each bucket carries the value the replay holds.
                let mut seen = Vec::new();
                for (b, prev) in log {
                    if !seen.contains(&b) {
                        assert_eq!(replay[b as usize], prev);
                        seen.push(b);
                    }
                }
                replay.copy_from_slice(table.words());
            }
        }
    }
}
