//! Operations on one packed bucket word: four 16-bit slots, slot `i` in bits
//! `16*i..16*i+16`, 0 = empty.

/// 0x0001 in every 16-bit lane.
const LANE_ONES: u64 = 0x0001_0001_0001_0001;

/// The high bit of every 16-bit lane.
const LANE_HIGH_BITS: u64 = 0x8000_8000_8000_8000;

/// Whether any slot of `word` equals `fingerprint` (branch-free; exact).
#[inline]
pub(crate) fn contains(word: u64, fingerprint: u16) -> bool {
    has_zero_lane(word ^ (u64::from(fingerprint) * LANE_ONES))
}

/// `fingerprint` in every slot: the pattern [`matches_pattern`] compares words against,
/// computed once per probe instead of once per word.
#[inline]
pub(crate) fn fingerprint_pattern(fingerprint: u16) -> u64 {
    u64::from(fingerprint) * LANE_ONES
}

/// [`contains`] with a precomputed [`fingerprint_pattern`].
#[inline]
pub(crate) fn matches_pattern(word: u64, pattern: u64) -> bool {
    has_zero_lane(word ^ pattern)
}

/// `word` with `fingerprint` in its first empty slot, or `None` when full.
#[inline]
pub(crate) fn with_inserted(word: u64, fingerprint: u16) -> Option<u64> {
    let slot = first_slot_equal(word, 0)?;
    Some(with_slot(word, slot, fingerprint))
}

/// `word` with its first slot equal to `fingerprint` cleared, or `None` when absent.
#[inline]
pub(crate) fn with_removed(word: u64, fingerprint: u16) -> Option<u64> {
    let slot = first_slot_equal(word, fingerprint)?;
    Some(with_slot(word, slot, 0))
}

/// The fingerprint in `slot` (0..4).
#[inline]
pub(crate) fn slot_value(word: u64, slot: u32) -> u16 {
    ((word >> (16 * slot)) & 0xFFFF) as u16
}

/// `word` with `slot` (0..4) set to `fingerprint`.
#[inline]
pub(crate) fn with_slot(word: u64, slot: u32, fingerprint: u16) -> u64 {
    let shift = 16 * slot;
    (word & !(0xFFFF << shift)) | (u64::from(fingerprint) << shift)
}

/// Number of occupied slots in `word`.
#[inline]
pub(crate) fn occupied_slots(word: u64) -> u32 {
    (0..4).filter(|&slot| slot_value(word, slot) != 0).count() as u32
}

#[inline]
fn has_zero_lane(x: u64) -> bool {
    zero_lane_flags(x) != 0
}

/// The lowest slot of `word` equal to `value` (branch-free search).
#[inline]
fn first_slot_equal(word: u64, value: u16) -> Option<u32> {
    let flags = zero_lane_flags(word ^ (u64::from(value) * LANE_ONES));
    (flags != 0).then_some(flags.trailing_zeros() / 16)
}

/// The high bit of each zero lane of `x`. A borrow out of a zero lane can also flag lanes
/// above it, but never one below, so the lowest flag is always a zero lane and there is a
/// flag exactly when some lane is zero.
#[inline]
fn zero_lane_flags(x: u64) -> u64 {
    x.wrapping_sub(LANE_ONES) & !x & LANE_HIGH_BITS
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn slots(word: u64) -> [u16; 4] {
        [0, 1, 2, 3].map(|slot| slot_value(word, slot))
    }

    proptest! {
        #[test]
        fn swar_membership_matches_slot_scan(word in any::<u64>(), fingerprint in any::<u16>()) {
            let expected = slots(word).contains(&fingerprint);
            prop_assert_eq!(contains(word, fingerprint), expected);
        }

        #[test]
        fn swar_insert_and_remove_match_slot_scan(
            lanes in proptest::array::uniform4(prop_oneof![Just(0u16), Just(7), any::<u16>()]),
            fingerprint in prop_oneof![Just(7u16), 1..=u16::MAX],
        ) {
            let word = lanes.iter().rev().fold(0u64, |w, &lane| (w << 16) | u64::from(lane));
            let scan = |value: u16| (0..4).find(|&slot| slot_value(word, slot) == value);
            prop_assert_eq!(
                with_inserted(word, fingerprint),
                scan(0).map(|slot| with_slot(word, slot, fingerprint))
            );
            prop_assert_eq!(
                with_removed(word, fingerprint),
                scan(fingerprint).map(|slot| with_slot(word, slot, 0))
            );
        }
    }

    #[test]
    fn insert_fills_lowest_empty_slot_and_remove_clears_first_match() {
        let word = with_inserted(0, 7).unwrap();
        let word = with_inserted(word, 9).unwrap();
        let word = with_inserted(word, 7).unwrap();
        assert_eq!(slots(word), [7, 9, 7, 0]);
        let word = with_removed(word, 7).unwrap();
        assert_eq!(slots(word), [0, 9, 7, 0]);
        assert_eq!(with_removed(word, 5), None);
        let full = with_inserted(with_inserted(word, 1).unwrap(), 2).unwrap();
        assert_eq!(with_inserted(full, 3), None);
        assert_eq!(occupied_slots(full), 4);
    }
}
