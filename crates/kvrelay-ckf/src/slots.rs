//! Sizing and fallible allocation of the open-addressing slot arrays behind the lineage
//! and owner tables: both keep at most 6/8 of a power-of-two array filled and grow by
//! doubling, allocating fallibly so a failed growth leaves the table as it was.

/// Why a table could not grow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GrowFailed {
    pub(crate) bytes: u64,
}

/// Slots are at most this many eighths full.
const MAX_LOAD_EIGHTHS: usize = 6;

/// The smallest allocated table.
const MIN_SLOTS: usize = 16;

/// The most entries `n_slots` slots may hold.
pub(crate) fn max_len(n_slots: usize) -> usize {
    n_slots / 8 * MAX_LOAD_EIGHTHS
}

/// A new slot array, every slot `empty`, large enough for `needed` entries, when the
/// current `n_slots` are not (or none are allocated yet); `None` when they suffice.
pub(crate) fn grown<T: Clone>(
    n_slots: usize,
    needed: usize,
    empty: T,
) -> Result<Option<Vec<T>>, GrowFailed> {
    if needed <= max_len(n_slots) && n_slots > 0 {
        return Ok(None);
    }
    let mut new_slots = n_slots.max(MIN_SLOTS);
    while max_len(new_slots) < needed {
        new_slots = new_slots
            .checked_mul(2)
            .ok_or(GrowFailed { bytes: u64::MAX })?;
    }
    let bytes = (new_slots * std::mem::size_of::<T>()) as u64;
    let mut slots = Vec::new();
    slots
        .try_reserve_exact(new_slots)
        .map_err(|_| GrowFailed { bytes })?;
    slots.resize(new_slots, empty);
    Ok(Some(slots))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_by_doubling_only_when_the_load_limit_would_be_passed() {
        assert_eq!(grown(0, 0, 0u64).unwrap().map(|s| s.len()), Some(MIN_SLOTS));
        assert_eq!(grown(16, 12, 0u64).unwrap(), None);
        assert_eq!(grown(16, 13, 0u64).unwrap().map(|s| s.len()), Some(32));
        assert_eq!(grown(16, 100, 7u8).unwrap(), Some(vec![7u8; 256]));
    }

    #[test]
    fn an_impossible_size_fails_instead_of_overflowing() {
        assert!(grown(16, usize::MAX, 0u64).is_err());
    }
}
