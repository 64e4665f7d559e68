//! Transparent huge pages for a query table's rows.
//!
//! A fleet's query table is hundreds of MiB probed at random: with 4 KiB pages nearly
//! every probe also misses the TLB and walks the page tables, one more dependent memory
//! access per row. Backed by 2 MiB pages the same table needs 512 times fewer
//! translations (fleet benchmark, 64 DCs: the median query took 15–33 % less time, and so
//! did the exact map's, docs/benchmarks.md). Linux gives an anonymous mapping huge pages
//! by default only when `/sys/kernel/mm/transparent_hugepage/enabled` is `always`; under
//! the common `madvise` setting a program has to ask for them with
//! `madvise(MADV_HUGEPAGE)`, which is what [`advise_huge_pages`] does for an allocation
//! before its first touch. Under `never`
//! (or on other systems) the request does nothing and the table keeps small pages.

use std::mem::MaybeUninit;
use std::sync::atomic::AtomicU64;

use crate::format::ConfigError;

/// The smallest allocation worth advising: below one 2 MiB page no aligned huge page
/// fits inside it.
pub const MIN_ADVISED_BYTES: usize = 2 << 20;

/// The part of `start..start + len` (bytes) that starts and ends on a `page` boundary,
/// as `(start, len)`; `None` when no whole page fits. `page` is a power of two.
pub fn page_aligned_interior(start: usize, len: usize, page: usize) -> Option<(usize, usize)> {
    let end = start.checked_add(len)?;
    let first = start.checked_next_multiple_of(page)?;
    let last = end - end % page;
    (last > first).then(|| (first, last - first))
}

/// Asks the kernel to back `memory` (an allocation's untouched spare capacity) with
/// transparent huge pages; returns whether it accepted. Advises only the part of
/// `memory` that covers whole pages, and nothing below [`MIN_ADVISED_BYTES`].
pub fn advise_huge_pages<T>(memory: &mut [MaybeUninit<T>]) -> bool {
    let len = std::mem::size_of_val(memory);
    if len < MIN_ADVISED_BYTES {
        return false;
    }
    advise(memory.as_mut_ptr().cast::<u8>(), len)
}

/// `n` zeroed atomic words, or the allocator's refusal; with `huge_pages`, advised onto
/// transparent huge pages before they are zeroed (first touched). Also returns whether
/// the kernel accepted that advice.
pub(crate) fn zeroed_words(
    n: usize,
    what: &'static str,
    huge_pages: bool,
) -> Result<(Vec<AtomicU64>, bool), ConfigError> {
    let mut words = Vec::new();
    words
        .try_reserve_exact(n)
        .map_err(|_| ConfigError::AllocationFailed {
            what,
            bytes: n as u64 * 8,
        })?;
    let advised = huge_pages && advise_huge_pages(words.spare_capacity_mut());
    words.resize_with(n, || AtomicU64::new(0));
    Ok((words, advised))
}

#[cfg(target_os = "linux")]
fn advise(start: *mut u8, len: usize) -> bool {
    let page = rustix::param::page_size();
    let Some((first, aligned_len)) = page_aligned_interior(start as usize, len, page) else {
        return false;
    };
    let offset = first - start as usize;
    // `offset < page <= len`, so the pointer stays inside `memory`.
    let first = start.wrapping_add(offset);
    #[expect(
        unsafe_code,
        reason = "rustix's madvise takes a raw range; the fleet benchmark measures what the \
                  advice buys (`fleet-bench --small-pages` is the same run without it)"
    )]
    // SAFETY: `first..first + aligned_len` lies inside `memory`, a live allocation this
    // caller holds by `&mut` (page_aligned_interior only shrinks the range). MADV_HUGEPAGE
    // neither reads nor writes the memory and never unmaps it: it only marks the mapping
    // so that later page faults (and khugepaged) may use huge pages, which preserves
    // contents. An allocator sharing the mapping with other allocations sees them keep
    // their contents too.
    let advised = unsafe {
        rustix::mm::madvise(first.cast(), aligned_len, rustix::mm::Advice::LinuxHugepage)
    };
    advised.is_ok()
}

#[cfg(not(target_os = "linux"))]
fn advise(_start: *mut u8, _len: usize) -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advised_range_is_the_whole_pages_inside_the_allocation() {
        let page = 4096;
        assert_eq!(page_aligned_interior(4096, 8192, page), Some((4096, 8192)));
        assert_eq!(page_aligned_interior(4112, 8192, page), Some((8192, 4096)));
        assert_eq!(page_aligned_interior(4112, 8176, page), Some((8192, 4096)));
        assert_eq!(page_aligned_interior(4112, 8175, page), None);
        assert_eq!(page_aligned_interior(4112, 100, page), None);
        assert_eq!(page_aligned_interior(usize::MAX - 10, 5, page), None);
        assert_eq!(page_aligned_interior(usize::MAX - 10, 20, page), None);
        for start in [0usize, 1, 16, 4095, 4096, 4097, 1 << 20, (1 << 21) + 24] {
            for len in [0usize, 1, 4095, 4096, 8191, 8192, 3 << 20] {
                if let Some((first, aligned)) = page_aligned_interior(start, len, page) {
                    assert!(first >= start && first + aligned <= start + len);
                    assert_eq!(first % page, 0);
                    assert_eq!(aligned % page, 0);
                    assert!(aligned > 0);
                    assert!(first - start < page && start + len - (first + aligned) < page);
                }
            }
        }
    }

    #[test]
    fn small_allocations_are_not_advised() {
        let mut words: Vec<u64> = Vec::with_capacity(1024);
        assert!(!advise_huge_pages(words.spare_capacity_mut()));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_large_allocation_is_advised_and_keeps_its_contents() {
        let n = (MIN_ADVISED_BYTES / 8) * 2;
        let mut words: Vec<u64> = Vec::with_capacity(n);
        // The advice is accepted whatever the system's setting (under `never` it is
        // recorded and unused); only kernels built without transparent huge pages refuse.
        let thp_built = std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
        assert_eq!(advise_huge_pages(words.spare_capacity_mut()), thp_built);
        words.extend((0..n as u64).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        for (i, word) in words.iter().enumerate() {
            assert_eq!(*word, (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        }
    }
}
