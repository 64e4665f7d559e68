//! Owner-count transitions and the table writes they cause: acquire, admit, re-offer and
//! release one canonical hash, recording every bucket touched in the dirty window.
//!
//! Only an owner count going 0 → 1 (with admission) inserts a fingerprint and only
//! 1 → 0 of a resident hash removes one; callers validate and reserve first, so no
//! transition fails (a broken invariant is counted, never panicked on).

use super::error::{ApplyError, alloc};
use crate::addressing::Home;
use crate::counters::{ApplyOutcome, FilterCounters};
use crate::membership::Membership;
use crate::owners::{GrowFailed, NotStored, OwnerEntry, OwnerTable};
use crate::publication::{AllocFailed, DirtyWindow};
use crate::table::Table;

/// Owner counts, the table and the window: what ownership transitions mutate.
#[derive(Debug, Clone)]
pub(super) struct Ownership {
    pub(super) owners: OwnerTable,
    pub(super) table: Table,
    pub(super) window: DirtyWindow,
    pub(super) counters: FilterCounters,
    /// Owned-set changes since the caller last took them, when recording
    /// ([`super::PoolFilter::record_memberships`]); `None` otherwise.
    pub(super) memberships: Option<Vec<Membership>>,
}

impl Ownership {
    /// No owners (placed by `placement_seed`) over `table`, with `window` recording its
    /// writes.
    pub(super) fn new(table: Table, window: DirtyWindow, placement_seed: u64) -> Self {
        Self {
            owners: OwnerTable::with_seed(placement_seed),
            table,
            window,
            counters: FilterCounters::default(),
            memberships: None,
        }
    }

    /// Makes room for `n_new_owners` owner entries, `max_touches` window entries and (when
    /// recording) `max_memberships` owned-set changes, so that the transitions after it
    /// cannot allocate.
    pub(super) fn reserve(
        &mut self,
        n_new_owners: usize,
        max_touches: usize,
        max_memberships: usize,
    ) -> Result<(), ApplyError> {
        self.owners
            .try_reserve(n_new_owners)
            .map_err(|GrowFailed { bytes }| alloc("owner table", bytes))?;
        if let Some(log) = &mut self.memberships {
            log.try_reserve(max_memberships).map_err(|_| {
                alloc(
                    "membership log",
                    (max_memberships * std::mem::size_of::<Membership>()) as u64,
                )
            })?;
        }
        self.window
            .reserve(max_touches)
            .map_err(|AllocFailed { bytes }| alloc("dirty window", bytes))
    }

    /// Adds one owner (a new mapping) to `canonical`; no table write.
    pub(super) fn acquire(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        // Overflow was ruled out by validation, and the slot was reserved.
        match self.owners.add_owner(canonical) {
            Some((_, true)) => {
                self.counters.canonicals_created += 1;
                self.record(Membership::Joined(canonical));
            }
            Some((_, false)) => {}
            None => self.counters.invariant_violations += 1,
        }
        self.counters.blocks_mapped += 1;
        outcome.blocks_mapped += 1;
    }

    /// Returns `canonical`'s fingerprint and primary bucket after prefetching its owner
    /// slot and primary table row (the alternate row is rarely needed).
    #[inline]
    pub(super) fn prefetch(&self, canonical: u64) -> Home {
        let home = self.table.addressing().home(canonical);
        self.owners.prefetch(canonical);
        self.table.prefetch(home.primary);
        home
    }

    /// [`Ownership::acquire`] then [`Ownership::admit`] with one owner-map lookup;
    /// `home` is `canonical`'s.
    #[inline]
    pub(super) fn acquire_and_admit(
        &mut self,
        canonical: u64,
        home: Home,
        outcome: &mut ApplyOutcome,
    ) {
        self.counters.blocks_mapped += 1;
        outcome.blocks_mapped += 1;
        // Overflow was ruled out by validation, and the slot was reserved.
        let Some((entry, created)) = self.owners.add_owner(canonical) else {
            self.counters.invariant_violations += 1;
            return;
        };
        if created {
            self.counters.canonicals_created += 1;
            if let Some(log) = &mut self.memberships {
                log.push(Membership::Joined(canonical));
            }
        }
        if !entry.resident {
            admit_entry(
                &mut self.table,
                &mut self.window,
                &mut self.counters,
                home,
                entry,
                outcome,
            );
        }
    }

    /// Full admission (with relocation) of an owned hash that is not resident.
    pub(super) fn admit(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        let Some(entry) = self.owners.get_mut(canonical) else {
            return;
        };
        if entry.resident {
            return;
        }
        let home = self.table.addressing().home(canonical);
        admit_entry(
            &mut self.table,
            &mut self.window,
            &mut self.counters,
            home,
            entry,
            outcome,
        );
    }

    /// A re-offered mapping: a cheap relocation-free admission if not resident.
    pub(super) fn reoffer(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        self.counters.blocks_reoffered += 1;
        outcome.blocks_reoffered += 1;
        self.record(Membership::Reoffered(canonical));
        let Some(entry) = self.owners.get_mut(canonical) else {
            return;
        };
        if entry.resident {
            return;
        }
        let home = self.table.addressing().home(canonical);
        entry.resident = readmit(
            &mut self.table,
            &mut self.window,
            &mut self.counters,
            home,
            outcome,
        );
    }

    /// Drops one owner of `canonical`; the last owner of a resident hash removes its
    /// fingerprint.
    pub(super) fn release(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        self.release_at(canonical, None, outcome);
    }

    /// [`Ownership::release`] with `canonical`'s home when already known.
    #[inline]
    pub(super) fn release_at(
        &mut self,
        canonical: u64,
        home: Option<Home>,
        outcome: &mut ApplyOutcome,
    ) {
        self.counters.mappings_removed += 1;
        outcome.mappings_removed += 1;
        let resident = match self.owners.drop_owner(canonical) {
            Err(NotStored) => {
                self.counters.invariant_violations += 1;
                return;
            }
            Ok(None) => return,
            Ok(Some(last)) => last.resident,
        };
        self.counters.canonicals_dropped += 1;
        self.record(Membership::Left(canonical));
        if !resident {
            return;
        }
        let home = home.unwrap_or_else(|| self.table.addressing().home(canonical));
        remove_fingerprint(
            &mut self.table,
            &mut self.window,
            &mut self.counters,
            home,
            outcome,
        );
    }
}

impl Ownership {
    /// Logs one owned-set change when recording (room was reserved).
    #[inline]
    fn record(&mut self, change: Membership) {
        if let Some(log) = &mut self.memberships {
            log.push(change);
        }
    }

    /// Length of the membership log (0 when not recording).
    pub(super) fn memberships_len(&self) -> usize {
        self.memberships.as_ref().map_or(0, Vec::len)
    }

    /// Moves the log's changes from `first_joined` on (the hashes a reset acquired, then
    /// from `first_left` the ones it released) so the releases come first, as the table
    /// saw them: a consumer of the log frees room before it places the new hashes.
    pub(super) fn releases_first(&mut self, first_joined: usize, first_left: usize) {
        if let Some(log) = &mut self.memberships
            && first_joined <= first_left
            && first_left <= log.len()
        {
            log[first_joined..].rotate_left(first_left - first_joined);
        }
    }
}

/// Places the fingerprint at `home` of a hash that just became owned, with relocation:
/// whether it fit. Counts the insertion or the capacity omission. Shared by both
/// producers ([`crate::PoolFilter`], [`crate::MembershipFilter`]), as are
/// [`remove_fingerprint`] and [`readmit`].
#[inline]
pub(crate) fn place(
    table: &mut Table,
    window: &mut DirtyWindow,
    counters: &mut FilterCounters,
    home: Home,
    outcome: &mut ApplyOutcome,
) -> bool {
    match table.insert(home, |b, prev| window.note(b, prev)) {
        Ok(()) => {
            counters.fingerprints_inserted += 1;
            outcome.fingerprints_inserted += 1;
            true
        }
        Err(_) => {
            counters.capacity_omissions += 1;
            outcome.capacity_omissions += 1;
            false
        }
    }
}

/// Removes the fingerprint at `home` of a resident hash that lost its last owner:
/// whether it was there. Counts the removal, or an invariant violation when it was not.
#[inline]
pub(crate) fn remove_fingerprint(
    table: &mut Table,
    window: &mut DirtyWindow,
    counters: &mut FilterCounters,
    home: Home,
    outcome: &mut ApplyOutcome,
) -> bool {
    let removed = table.remove(home, |b, prev| window.note(b, prev));
    if removed {
        counters.fingerprints_removed += 1;
        outcome.fingerprints_removed += 1;
    } else {
        counters.invariant_violations += 1;
    }
    removed
}

/// A re-offered hash that did not fit, offered again without relocation (cheap: it runs
/// on every re-store): whether it is resident now. Counts the late admission or the miss.
/// Shared by both producers ([`crate::PoolFilter`], [`crate::MembershipFilter`]).
#[inline]
pub(crate) fn readmit(
    table: &mut Table,
    window: &mut DirtyWindow,
    counters: &mut FilterCounters,
    home: Home,
    outcome: &mut ApplyOutcome,
) -> bool {
    match table.insert_without_relocation(home, |b, prev| window.note(b, prev)) {
        Ok(()) => {
            counters.fingerprints_inserted += 1;
            counters.late_admissions += 1;
            outcome.fingerprints_inserted += 1;
            true
        }
        Err(_) => {
            counters.reoffer_misses += 1;
            false
        }
    }
}

/// Inserts the fingerprint at `home` (of an owned hash that is not resident) with
/// relocation and records the outcome in its owner `entry`.
#[inline]
fn admit_entry(
    table: &mut Table,
    window: &mut DirtyWindow,
    counters: &mut FilterCounters,
    home: Home,
    entry: &mut OwnerEntry,
    outcome: &mut ApplyOutcome,
) {
    if place(table, window, counters, home, outcome) {
        entry.resident = true;
        if entry.omitted {
            counters.late_admissions += 1;
        }
    } else {
        entry.omitted = true;
    }
}
