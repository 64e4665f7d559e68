//! Software prefetch: a hint that an element will be read soon, so that many independent
//! cache misses can be in flight at once without waiting for any of them.
//!
//! A plain load would do the same but holds its place in the reorder buffer until the
//! line arrives, so a pass touching a few dozen cold slots stalls once the buffer is
//! full; a prefetch retires at once. On targets without the x86-64 hint it is a no-op.

/// 16-byte map slots per 64-byte cache line. A probe run or a backward shift that starts
/// at slot `idx` rarely reaches past `idx + SLOTS_PER_LINE`, so prefetching that slot too
/// brings in the following line whenever the run may cross into it (same page, so no
/// second translation).
pub(crate) const SLOTS_PER_LINE: usize = 4;

/// Hints that `slice[idx]` will be read soon; does nothing when `idx` is out of bounds.
#[inline(always)]
pub(crate) fn prefetch_element<T>(slice: &[T], idx: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some(element) = slice.get(idx) {
        let address = std::ptr::from_ref(element).cast::<i8>();
        #[expect(
            unsafe_code,
            reason = "a load stalls retirement until its line arrives; the hint lets the \
                      ckf_apply benchmark's misses overlap (issue #3)"
        )]
        // SAFETY: `_mm_prefetch` requires SSE, which every x86-64 target has; it is only a
        // hint, never dereferences the pointer in the memory-safety sense and cannot fault,
        // and the pointer here points into a live slice anyway.
        unsafe {
            core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(address);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (slice, idx);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetching_any_index_leaves_the_slice_alone_and_ignores_out_of_bounds() {
        let words: Vec<u64> = (0..64).collect();
        for idx in 0..words.len() + SLOTS_PER_LINE {
            prefetch_element(&words, idx);
        }
        prefetch_element(&words, usize::MAX);
        prefetch_element::<u64>(&[], 0);
        assert_eq!(words, (0..64).collect::<Vec<u64>>());
    }
}
