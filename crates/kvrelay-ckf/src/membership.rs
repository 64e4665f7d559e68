//! A producer fed by another producer's owned-set changes instead of engine events: the
//! same blocks in another format, without an exact index of its own.
//!
//! A pool published in two formats (v1 for older consumers and a dense *format twin*)
//! needs two tables, but only one exact index: which canonical hashes the pool owns is
//! decided once, by the pool's [`PoolFilter`](crate::PoolFilter), whose
//! [`record_memberships`](crate::PoolFilter::record_memberships) log says when a hash
//! joins or leaves the owned set. A [`MembershipFilter`] places those hashes in its own
//! table and keeps only the few it could not place (its capacity omissions), so a
//! removal never takes out a fingerprint that is not the hash's own. Per block it holds
//! its table's share (about 2 bytes in the dense format) where a second `PoolFilter`
//! held its own lineage and owner counts (about 54 bytes at 10 M blocks).
//!
//! The log comes from this process's own filter, never from a peer: a `Left` for a hash
//! that never joined could remove another hash's matching fingerprint. What can be
//! detected (a `Left` whose fingerprint is absent) is counted as an invariant violation.

use std::num::NonZeroU32;

use kvrelay_identity::CkfFormat;

use crate::counters::{ApplyOutcome, FilterCounters, MemoryUsage};
use crate::format::{CkfConfig, ConfigError};
use crate::image::{Delta, SNAPSHOT_CHUNK_BUCKETS};
use crate::keyhash::KeySet;
use crate::ownership::error::alloc;
use crate::ownership::{
    ApplyError, BarrierSnapshot, PublishError, place, readmit, remove_fingerprint,
};
use crate::publication::{DirtyWindow, barrier_snapshot, publish_delta, published_table};
use crate::table::Table;

/// One change of a pool's owned set, in the order its producer's table saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Membership {
    /// The canonical hash gained its first owner.
    Joined(u64),
    /// The canonical hash lost its last owner.
    Left(u64),
    /// A source stored again a mapping it already held: a hash that did not fit may now.
    Reoffered(u64),
}

/// A producer table fed [`Membership`] changes (see the module docs). Single-threaded.
///
/// ```
/// use kvrelay_ckf::{CkfConfig, FilterDensity, MembershipFilter, PoolFilter, SourceId};
/// let mut pool = PoolFilter::new(CkfConfig::new(1024))?;
/// let mut twin = MembershipFilter::new(
///     CkfConfig::new(1024).with_density(FilterDensity::Dense {
///         load_percent: 95,
///         size_classes_per_octave: 0,
///     }),
/// )?;
/// pool.record_memberships(true);
/// pool.store_canonical(SourceId::new(1, 0), &[(100, 0xAB), (101, 0xCD)])?;
/// twin.apply(&pool.take_memberships())?;
/// assert!(twin.contains(0xAB) && twin.contains(0xCD));
/// assert_eq!(twin.format().format_version(), 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct MembershipFilter {
    format: CkfFormat,
    max_kicks: u32,
    table: Table,
    window: DirtyWindow,
    /// Owned hashes whose fingerprint did not fit (capacity omissions).
    omitted: KeySet<u64>,
    resident: u64,
    sequence: u64,
    pending_events: u64,
    counters: FilterCounters,
}

impl MembershipFilter {
    /// An empty filter for `config`; the table is allocated fallibly.
    pub fn new(config: CkfConfig) -> Result<Self, ConfigError> {
        let (format, table, window) = published_table(&config)?;
        Ok(Self {
            format,
            max_kicks: config.max_kicks,
            table,
            window,
            omitted: KeySet::default(),
            resident: 0,
            sequence: 0,
            pending_events: 0,
            counters: FilterCounters::default(),
        })
    }

    /// The filter format (seed and bucket count).
    pub fn format(&self) -> CkfFormat {
        self.format
    }

    /// Applies `changes` in order as one event. Room for every write is reserved first,
    /// so on `Err` (an allocation failure) nothing changed.
    pub fn apply(&mut self, changes: &[Membership]) -> Result<ApplyOutcome, ApplyError> {
        if let Err(err) = self.reserve(changes) {
            self.counters.count_rejection(&err);
            return Err(err);
        }
        let mut outcome = ApplyOutcome::default();
        for &change in changes {
            match change {
                Membership::Joined(canonical) => self.join(canonical, &mut outcome),
                Membership::Left(canonical) => self.leave(canonical, &mut outcome),
                Membership::Reoffered(canonical) => self.reoffer(canonical, &mut outcome),
            }
        }
        self.counters.events_applied += 1;
        self.pending_events += 1;
        Ok(outcome)
    }

    fn reserve(&mut self, changes: &[Membership]) -> Result<(), ApplyError> {
        let joined = changes
            .iter()
            .filter(|change| matches!(change, Membership::Joined(_)))
            .count();
        let max_touches = joined * (self.max_kicks as usize + 1) + (changes.len() - joined);
        self.window
            .reserve(max_touches)
            .map_err(|failed| alloc("dirty window", failed.bytes))?;
        self.omitted
            .try_reserve(joined)
            .map_err(|_| alloc("omitted set", joined as u64 * 8))
    }

    fn join(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        self.counters.canonicals_created += 1;
        outcome.blocks_mapped += 1;
        if self.omitted.contains(&canonical) {
            // Joined twice without leaving: the log is not a producer's.
            self.counters.invariant_violations += 1;
            return;
        }
        let home = self.table.addressing().home(canonical);
        if place(
            &mut self.table,
            &mut self.window,
            &mut self.counters,
            home,
            outcome,
        ) {
            self.resident += 1;
        } else {
            self.omitted.insert(canonical);
        }
    }

    fn leave(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        self.counters.canonicals_dropped += 1;
        outcome.mappings_removed += 1;
        if self.omitted.remove(&canonical) {
            return;
        }
        let home = self.table.addressing().home(canonical);
        if remove_fingerprint(
            &mut self.table,
            &mut self.window,
            &mut self.counters,
            home,
            outcome,
        ) {
            self.resident -= 1;
        }
    }

    fn reoffer(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        self.counters.blocks_reoffered += 1;
        outcome.blocks_reoffered += 1;
        if !self.omitted.contains(&canonical) {
            return;
        }
        let home = self.table.addressing().home(canonical);
        if readmit(
            &mut self.table,
            &mut self.window,
            &mut self.counters,
            home,
            outcome,
        ) {
            self.omitted.remove(&canonical);
            self.resident += 1;
        }
    }

    /// Whether `canonical`'s fingerprint is in the table (false positives possible).
    pub fn contains(&self, canonical: u64) -> bool {
        self.table.contains(self.table.addressing().home(canonical))
    }

    /// Owned hashes whose fingerprint is in the table.
    pub fn n_resident(&self) -> u64 {
        self.resident
    }

    /// Owned hashes, resident or omitted.
    pub fn n_owned(&self) -> u64 {
        self.resident + self.omitted.len() as u64
    }

    /// Owned hashes whose fingerprint did not fit.
    pub fn omitted_canonicals(&self) -> impl Iterator<Item = u64> + '_ {
        self.omitted.iter().copied()
    }

    /// Occupied fingerprint slots (maintained incrementally).
    pub fn occupied_slots(&self) -> u64 {
        self.table.occupied_slots()
    }

    /// Cumulative counters.
    pub fn counters(&self) -> &FilterCounters {
        &self.counters
    }

    /// The sequence of the last delta.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Applied calls since the last delta.
    pub fn pending_events(&self) -> u64 {
        self.pending_events
    }

    /// Distinct buckets touched since the last delta.
    pub fn pending_buckets(&self) -> usize {
        self.window.touched_len()
    }

    /// The current bucket words.
    pub fn words(&self) -> &[u64] {
        self.table.words()
    }

    /// Bytes held, by part: no lineage; the omitted set is counted as owner bytes.
    pub fn memory(&self) -> MemoryUsage {
        MemoryUsage {
            table_bytes: u64::from(self.format.bucket_count()) * 8,
            dirty_window_bytes: self.window.bytes(),
            lineage_bytes: 0,
            owner_bytes: self.omitted.capacity() as u64 * 8,
        }
    }

    /// Publishes the pending window as a delta `sequence → sequence + 1`, as
    /// [`PoolFilter::take_delta`](crate::PoolFilter::take_delta) does.
    pub fn take_delta(&mut self) -> Result<Option<Delta>, PublishError> {
        let delta = publish_delta(
            &mut self.window,
            self.table.words(),
            &mut self.sequence,
            &mut self.counters,
        )?;
        self.pending_events = 0;
        Ok(delta)
    }

    /// A consistent snapshot behind a barrier in CBI1-sized chunks, as
    /// [`PoolFilter::snapshot`](crate::PoolFilter::snapshot) does.
    pub fn snapshot(&mut self) -> Result<BarrierSnapshot, PublishError> {
        let chunk_buckets = NonZeroU32::MIN.saturating_add(SNAPSHOT_CHUNK_BUCKETS - 1);
        let snapshot = barrier_snapshot(
            &mut self.window,
            self.table.words(),
            &mut self.sequence,
            &mut self.counters,
            chunk_buckets,
        )?;
        self.pending_events = 0;
        Ok(snapshot)
    }
}

#[cfg(test)]
mod tests;
