//! Page sizes for the whole process, so that the query table and the exact baseline run
//! on the same kind of memory.
//!
//! The query table asks Linux for transparent huge pages for its rows
//! (`QueryConfig::huge_pages`, on by default). A fair baseline gets them too: this
//! binary's allocator advises every allocation of 2 MiB or more the same way (the exact
//! map's table, the builders), through the same `kvrelay_ckf::huge_pages` call. With
//! `--small-pages` neither is advised: the difference between the two runs is what huge
//! pages buy each index (docs/benchmarks.md).

use std::alloc::{GlobalAlloc, Layout, System};
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, Ordering};

use kvrelay_ckf::QueryConfig;
use kvrelay_ckf::huge_pages::{MIN_ADVISED_BYTES, advise_huge_pages};

/// Whether large allocations are advised onto huge pages (cleared by `--small-pages`).
static HUGE_PAGES: AtomicBool = AtomicBool::new(true);

/// Sets the process's page mode before anything large is allocated.
pub(crate) fn use_huge_pages(on: bool) {
    HUGE_PAGES.store(on, Ordering::Relaxed);
}

/// Whether this process advises huge pages.
pub(crate) fn huge_pages() -> bool {
    HUGE_PAGES.load(Ordering::Relaxed)
}

/// The query tables' configuration in this process's page mode.
pub(crate) fn query_config() -> QueryConfig {
    QueryConfig {
        huge_pages: huge_pages(),
        ..QueryConfig::default()
    }
}

/// The system allocator, advising every allocation of [`MIN_ADVISED_BYTES`] or more
/// onto huge pages while [`huge_pages`] holds.
pub(crate) struct AdvisingAllocator;

impl AdvisingAllocator {
    fn advise(ptr: *mut u8, size: usize) {
        if ptr.is_null() || size < MIN_ADVISED_BYTES || !huge_pages() {
            return;
        }
        #[expect(
            unsafe_code,
            reason = "the baseline's allocations get the same advice as the query table's"
        )]
        // SAFETY: `ptr` was just returned by the system allocator for `size` bytes, and
        // nothing else refers to that memory until this allocation is returned; viewing
        // it as uninitialised bytes reads nothing.
        let memory = unsafe { std::slice::from_raw_parts_mut(ptr.cast::<MaybeUninit<u8>>(), size) };
        advise_huge_pages(memory);
    }
}

#[expect(unsafe_code, reason = "a global allocator is an unsafe trait")]
// SAFETY: every method forwards to `System` with the caller's arguments unchanged and
// returns its result; the advice only changes how the kernel backs the pages.
unsafe impl GlobalAlloc for AdvisingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc`, passed on.
        let ptr = unsafe { System.alloc(layout) };
        Self::advise(ptr, layout.size());
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        Self::advise(ptr, layout.size());
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for `realloc`, passed on.
        let grown = unsafe { System.realloc(ptr, layout, new_size) };
        Self::advise(grown, new_size);
        grown
    }
}

/// Bytes of this process's anonymous memory on transparent huge pages now
/// (`AnonHugePages` in `/proc/self/smaps_rollup`): what the advice actually got, since
/// the kernel gives huge pages only while it has free ones (0 where not reported).
pub(crate) fn anon_huge_page_bytes() -> u64 {
    let Ok(rollup) = std::fs::read_to_string("/proc/self/smaps_rollup") else {
        return 0;
    };
    rollup
        .lines()
        .find_map(|line| line.strip_prefix("AnonHugePages:"))
        .and_then(|rest| {
            rest.trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kib| kib * 1024)
}
