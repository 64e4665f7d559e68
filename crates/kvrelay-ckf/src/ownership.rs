//! The producer filter of one pool: exact ownership per source, the lossy table it
//! projects to, and the publication window.
//!
//! Each source keeps a lineage (engine block id → canonical sequence hash); each canonical
//! hash keeps an owner count (mappings pointing at it) and a residency flag (whether its
//! one fingerprint is in the table). Only 0 → 1 owners inserts a fingerprint and only
//! 1 → 0 removes one; a fingerprint is never removed for a hash that is not resident, and
//! never by fingerprint alone.
//!
//! This module is the producer-facing facade ([`PoolFilter`]): construction, the event
//! and source operations, read-only views and publication. The passes behind them live
//! in submodules: `chain` (stored events), `removal` (removed events), `reset` (whole
//! sources), `transition` (owner counts and table writes) and `error`.

mod chain;
pub(crate) mod error;
mod removal;
mod reset;
mod transition;

use std::num::NonZeroU32;

use kvrelay_identity::CkfFormat;

use crate::addressing::{Address, Home};
use crate::counters::{ApplyOutcome, FilterCounters, MemoryUsage};
use crate::event::{EventPayload, RouterEvent, SourceId, StoredBlocks};
use crate::format::{CkfConfig, ConfigError};
use crate::image::{Delta, SNAPSHOT_CHUNK_BUCKETS, SnapshotChunk};
use crate::keyhash::KeyMap;
use crate::lineage::LineageMap;
use crate::membership::Membership;
use crate::owners::OwnerEntry;
use crate::publication::{barrier_snapshot, publish_delta, published_table};

use chain::PlannedBlock;
use transition::Ownership;
pub(crate) use transition::{place, readmit, remove_fingerprint};

pub use error::{ApplyError, PublishError};

/// A snapshot taken behind a barrier: first the pending `tail` (for existing
/// subscribers), then `chunks`, consistent at the sequence after the tail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BarrierSnapshot {
    /// Pending changes published as a delta before the snapshot, if any.
    pub tail: Option<Delta>,
    /// The snapshot; the next delta has `base_sequence == chunks[0].sequence`.
    pub chunks: Vec<SnapshotChunk>,
}

/// The producer filter of one pool. Single-threaded; one actor owns it.
///
/// ```
/// use kvrelay_ckf::{CkfConfig, EventPayload, PoolFilter, RouterEvent, SourceId, StoredBlock, StoredBlocks};
/// let mut filter = PoolFilter::new(CkfConfig::new(1024))?;
/// let event = RouterEvent {
///     source: SourceId::new(7, 0),
///     event_id: 1,
///     payload: EventPayload::Stored(StoredBlocks {
///         parent_engine_block_id: None,
///         blocks: vec![StoredBlock { engine_block_id: 100, token_hash: 11 }],
///     }),
/// };
/// filter.apply(&event)?;
/// assert!(filter.contains(11)); // root canonical hash = its token hash
/// let delta = filter.take_delta()?.expect("one bucket changed");
/// assert_eq!((delta.base_sequence, delta.sequence), (0, 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct PoolFilter {
    format: CkfFormat,
    max_kicks: u32,
    lineage: KeyMap<SourceId, LineageMap>,
    /// Keys where each lineage places engine block ids and the owner table places
    /// canonical hashes.
    placement_seed: u64,
    state: Ownership,
    plan: Vec<PlannedBlock>,
    /// Canonical hashes and addresses of the removal being applied.
    removal: Vec<(u64, Home)>,
    sequence: u64,
    pending_events: u64,
}

impl PoolFilter {
    /// An empty filter for `config`; the table is allocated fallibly. Lineages are keyed
    /// by the format seed (see [`PoolFilter::with_placement_seed`]).
    pub fn new(config: CkfConfig) -> Result<Self, ConfigError> {
        let placement_seed = config.format()?.seed();
        Self::with_placement_seed(config, placement_seed)
    }

    /// An empty filter for `config` whose per-source lineages (engine block id →
    /// canonical hash) and owner table (canonical hash → owners) place their keys by
    /// `placement_seed` instead of the published format seed.
    ///
    /// Engines choose their block ids and token hashes (a root block's canonical hash is
    /// its token hash), so keys crafted to collide under a known seed could lengthen probe
    /// runs; a seed the engines cannot see (chosen by the caller, e.g. per pool
    /// generation) removes that lever. The seed changes only where keys sit in memory:
    /// every result, counter, word and delta is the same as with [`PoolFilter::new`].
    ///
    /// ```
    /// use kvrelay_ckf::{CkfConfig, PoolFilter};
    /// let filter = PoolFilter::with_placement_seed(CkfConfig::new(1024), 0x5EED_1234)?;
    /// assert_eq!(filter.format(), PoolFilter::new(CkfConfig::new(1024))?.format());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn with_placement_seed(
        config: CkfConfig,
        placement_seed: u64,
    ) -> Result<Self, ConfigError> {
        let (format, table, window) = published_table(&config)?;
        Ok(Self {
            format,
            max_kicks: config.max_kicks,
            lineage: KeyMap::default(),
            placement_seed,
            state: Ownership::new(table, window, placement_seed),
            plan: Vec::new(),
            removal: Vec::new(),
            sequence: 0,
            pending_events: 0,
        })
    }

    /// The filter format (seed and bucket count).
    pub fn format(&self) -> CkfFormat {
        self.format
    }

    /// Starts (`true`) or stops recording the changes of the owned set: each hash that
    /// gains its first owner ([`Membership::Joined`]), loses its last
    /// ([`Membership::Left`]) or is stored again by a source that holds it
    /// ([`Membership::Reoffered`]), in the order the table saw them. A
    /// [`MembershipFilter`](crate::MembershipFilter) fed the log holds the same blocks in
    /// its own format without an exact index of its own. Stopping drops the unread log.
    ///
    /// The log grows until [`PoolFilter::take_memberships`]: by at most the blocks of one
    /// event, or a source's mappings for a clear or reset (16 bytes each), reserved
    /// before anything changes (an allocation failure rejects the operation).
    ///
    /// ```
    /// use kvrelay_ckf::{CkfConfig, Membership, PoolFilter, SourceId};
    /// let mut filter = PoolFilter::new(CkfConfig::new(1024))?;
    /// filter.record_memberships(true);
    /// filter.store_canonical(SourceId::new(1, 0), &[(100, 11)])?;
    /// filter.clear_source(SourceId::new(1, 0))?;
    /// assert_eq!(
    ///     filter.take_memberships(),
    ///     [Membership::Joined(11), Membership::Left(11)]
    /// );
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn record_memberships(&mut self, on: bool) {
        match (on, self.state.memberships.is_some()) {
            (true, false) => self.state.memberships = Some(Vec::new()),
            (false, true) => self.state.memberships = None,
            _ => {}
        }
    }

    /// The owned-set changes recorded since the last call (empty when not recording).
    pub fn take_memberships(&mut self) -> Vec<Membership> {
        self.state
            .memberships
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Applies one router event. On `Err` nothing changed except the rejection counters.
    pub fn apply(&mut self, event: &RouterEvent) -> Result<ApplyOutcome, ApplyError> {
        match &event.payload {
            EventPayload::Stored(stored) => self.apply_stored_event(event.source, stored),
            EventPayload::Removed(removed) => {
                self.apply_removed_event(event.source, &removed.engine_block_ids)
            }
            EventPayload::AllCleared => self.apply_cleared_event(event.source),
        }
    }

    /// [`PoolFilter::apply`] of a stored chain, without building a [`RouterEvent`].
    pub(crate) fn apply_stored_event(
        &mut self,
        source: SourceId,
        stored: &StoredBlocks,
    ) -> Result<ApplyOutcome, ApplyError> {
        self.state.counters.stored_events += 1;
        let result = self.apply_stored(source, stored, chain::Links::Chain);
        self.finish_event(&result);
        result
    }

    /// [`PoolFilter::apply`] of a removal, without building a [`RouterEvent`].
    pub(crate) fn apply_removed_event(
        &mut self,
        source: SourceId,
        engine_block_ids: &[u64],
    ) -> Result<ApplyOutcome, ApplyError> {
        self.state.counters.removed_events += 1;
        let result = self.apply_removed(source, engine_block_ids);
        self.finish_event(&result);
        result
    }

    /// [`PoolFilter::apply`] of an all-cleared event, without building a [`RouterEvent`].
    pub(crate) fn apply_cleared_event(
        &mut self,
        source: SourceId,
    ) -> Result<ApplyOutcome, ApplyError> {
        self.state.counters.cleared_events += 1;
        let result = self.clear_source_inner(source);
        self.finish_event(&result);
        result
    }

    /// Counts an event's disposition; an applied event joins the pending delta.
    fn finish_event(&mut self, result: &Result<ApplyOutcome, ApplyError>) {
        match result {
            Ok(_) => {
                self.state.counters.events_applied += 1;
                self.pending_events += 1;
            }
            Err(err) => self.state.counters.count_rejection(err),
        }
    }

    /// Maps each `(engine block id, canonical hash)` of `blocks` for `source` as one
    /// stored event whose blocks are independent (no chain, no parent): for blocks whose
    /// canonical hash is already known, such as a lower tier's copies of device blocks.
    /// Validated like a stored event (an id mapped to another hash is rejected); on `Err`
    /// nothing changed except the rejection counters.
    ///
    /// ```
    /// use kvrelay_ckf::{CkfConfig, PoolFilter, SourceId};
    /// let mut filter = PoolFilter::new(CkfConfig::new(1024))?;
    /// filter.store_canonical(SourceId::new(7, 0), &[(100, 0xAB), (101, 0xCD)])?;
    /// assert!(filter.contains(0xAB) && filter.contains(0xCD));
    /// assert_eq!(filter.canonical_of(SourceId::new(7, 0), 101), Some(0xCD));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn store_canonical(
        &mut self,
        source: SourceId,
        blocks: &[(u64, u64)],
    ) -> Result<ApplyOutcome, ApplyError> {
        let stored = StoredBlocks {
            parent_engine_block_id: None,
            blocks: blocks
                .iter()
                .map(|&(engine_block_id, canonical)| crate::event::StoredBlock {
                    engine_block_id,
                    token_hash: canonical,
                })
                .collect(),
        };
        self.state.counters.stored_events += 1;
        let result = self.apply_stored(source, &stored, chain::Links::Unchained);
        self.finish_event(&result);
        result
    }

    /// Drops every mapping of `source` (as an all-cleared event would). Other sources,
    /// including sibling ranks of the same worker, are untouched.
    pub fn clear_source(&mut self, source: SourceId) -> Result<ApplyOutcome, ApplyError> {
        let result = self.clear_source_inner(source);
        self.finish_source_operation(&result);
        result
    }

    /// Drops every mapping of every rank of `worker_id`.
    pub fn remove_worker(&mut self, worker_id: u64) -> Result<ApplyOutcome, ApplyError> {
        let result = self.remove_worker_inner(worker_id);
        self.finish_source_operation(&result);
        result
    }

    /// Replaces everything `source` holds with `chains` (e.g. from a recovery dump):
    /// the chains are validated as if the source started empty (each parent must appear
    /// in an earlier chain), then ownership moves in one step; hashes the source keeps
    /// cause no table writes. On `Err` nothing changed.
    pub fn reset_source(
        &mut self,
        source: SourceId,
        chains: &[StoredBlocks],
    ) -> Result<ApplyOutcome, ApplyError> {
        let result = self.reset_source_inner(source, chains);
        self.finish_source_operation(&result);
        result
    }

    /// Replaces everything `source` holds with `mappings` (`(engine block id, canonical
    /// hash)`, as [`PoolFilter::source_mappings`] lists them, e.g. from a checkpoint):
    /// the same one-step ownership move as [`PoolFilter::reset_source`], without
    /// re-deriving canonical hashes. A repeated engine id with another canonical is
    /// rejected. On `Err` nothing changed.
    ///
    /// ```
    /// use kvrelay_ckf::{CkfConfig, PoolFilter, SourceId};
    /// let mut filter = PoolFilter::new(CkfConfig::new(1024))?;
    /// filter.restore_source(SourceId::new(7, 0), &[(100, 11), (101, 12)])?;
    /// assert!(filter.contains(11) && filter.contains(12));
    /// assert_eq!(filter.canonical_of(SourceId::new(7, 0), 101), Some(12));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn restore_source(
        &mut self,
        source: SourceId,
        mappings: &[(u64, u64)],
    ) -> Result<ApplyOutcome, ApplyError> {
        let result = self.restore_source_inner(source, mappings);
        self.finish_source_operation(&result);
        result
    }

    /// Every `(engine block id, canonical hash)` mapping `source` holds, in no particular
    /// order: with [`PoolFilter::restore_source`], the whole exact state of a source.
    pub fn source_mappings(&self, source: SourceId) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.lineage
            .get(&source)
            .into_iter()
            .flat_map(LineageMap::iter)
    }

    /// Whether the table holds `canonical`'s fingerprint (what a replica would answer).
    pub fn contains(&self, canonical: u64) -> bool {
        let home = self.state.table.addressing().home(canonical);
        self.state.table.contains(home)
    }

    /// The address of a canonical hash in this filter's format.
    pub fn address(&self, canonical: u64) -> Address {
        self.state.table.addressing().address(canonical)
    }

    /// How many mappings point at `canonical` (0 when unowned).
    pub fn owner_count(&self, canonical: u64) -> u32 {
        self.state.owners.get(canonical).map_or(0, |e| e.owners)
    }

    /// Whether `canonical` currently has its fingerprint in the table.
    pub fn is_resident(&self, canonical: u64) -> bool {
        self.state.owners.get(canonical).is_some_and(|e| e.resident)
    }

    /// The canonical hash `source` maps `engine_block_id` to, if any.
    pub fn canonical_of(&self, source: SourceId, engine_block_id: u64) -> Option<u64> {
        self.lineage.get(&source)?.get(engine_block_id)
    }

    /// Sources with at least one mapping.
    pub fn sources(&self) -> impl Iterator<Item = SourceId> + '_ {
        self.lineage.keys().copied()
    }

    /// Live (source, engine block id) mappings.
    pub fn n_mappings(&self) -> u64 {
        self.lineage.values().map(|m| m.len() as u64).sum()
    }

    /// Distinct owned canonical hashes.
    pub fn n_canonicals(&self) -> u64 {
        self.state.owners.len() as u64
    }

    /// Owned canonical hashes whose fingerprint is in the table.
    pub fn n_resident(&self) -> u64 {
        let c = &self.state.counters;
        c.fingerprints_inserted - c.fingerprints_removed
    }

    /// Owned canonical hashes that are not resident (capacity omissions still owned).
    pub fn omitted_canonicals(&self) -> impl Iterator<Item = u64> + '_ {
        self.state
            .owners
            .iter()
            .filter(|(_, e)| !e.resident)
            .map(|(c, _)| c)
    }

    /// Occupied fingerprint slots, O(1): maintained incrementally as fingerprints are
    /// inserted and removed (every resident canonical hash holds exactly one slot).
    pub fn occupied_slots(&self) -> u64 {
        self.n_resident()
    }

    /// Occupied slots over all slots (4 per bucket), O(1); 0 for an empty table.
    pub fn load_factor(&self) -> f64 {
        let slots = u64::from(self.format.bucket_count()) * 4;
        if slots == 0 {
            0.0
        } else {
            self.occupied_slots() as f64 / slots as f64
        }
    }

    /// Occupied fingerprint slots counted by scanning every bucket, O(buckets): an audit
    /// of [`PoolFilter::occupied_slots`] for tests and tools, not for polling.
    pub fn count_occupied_slots(&self) -> u64 {
        self.state.table.occupied_slots()
    }

    /// Cumulative counters.
    pub fn counters(&self) -> &FilterCounters {
        &self.state.counters
    }

    /// The sequence of the last published delta or snapshot (0 before any).
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// Events applied since the last delta.
    pub fn pending_events(&self) -> u64 {
        self.pending_events
    }

    /// Distinct buckets touched since the last delta (an upper bound on its images).
    pub fn pending_buckets(&self) -> usize {
        self.state.window.touched_len()
    }

    /// Whether buckets were touched since the last delta.
    pub fn has_pending_changes(&self) -> bool {
        !self.state.window.is_empty()
    }

    /// The current bucket words.
    pub fn words(&self) -> &[u64] {
        self.state.table.words()
    }

    /// Bytes held, by part.
    pub fn memory(&self) -> MemoryUsage {
        let lineage_entry = std::mem::size_of::<(u64, u64)>() as u64;
        let source_entry = (std::mem::size_of::<(SourceId, LineageMap)>() + 1) as u64;
        let owner_entry = std::mem::size_of::<(u64, OwnerEntry)>() as u64;
        MemoryUsage {
            table_bytes: u64::from(self.format.bucket_count()) * 8,
            dirty_window_bytes: self.state.window.bytes(),
            lineage_bytes: self.lineage.capacity() as u64 * source_entry
                + self
                    .lineage
                    .values()
                    .map(|m| m.capacity() as u64 * lineage_entry)
                    .sum::<u64>(),
            owner_bytes: self.state.owners.capacity() as u64 * owner_entry,
        }
    }

    /// Publishes the pending window as a delta `sequence → sequence + 1`; `None` when no
    /// bucket changed net (the sequence does not move). On `Err` the window is kept.
    pub fn take_delta(&mut self) -> Result<Option<Delta>, PublishError> {
        let delta = publish_delta(
            &mut self.state.window,
            self.state.table.words(),
            &mut self.sequence,
            &mut self.state.counters,
        )?;
        self.pending_events = 0;
        Ok(delta)
    }

    /// A consistent snapshot behind a barrier, in CBI1-sized chunks: see
    /// [`PoolFilter::snapshot_with_chunk_buckets`].
    pub fn snapshot(&mut self) -> Result<BarrierSnapshot, PublishError> {
        self.snapshot_with_chunk_buckets(NonZeroU32::MIN.saturating_add(SNAPSHOT_CHUNK_BUCKETS - 1))
    }

    /// Publishes the pending changes as `tail` (for existing subscribers), then returns
    /// the table at the resulting sequence in chunks of at most `chunk_buckets` words.
    /// A new subscriber installs the chunks and applies every later delta. On `Err`
    /// nothing was published and pending changes are kept.
    pub fn snapshot_with_chunk_buckets(
        &mut self,
        chunk_buckets: NonZeroU32,
    ) -> Result<BarrierSnapshot, PublishError> {
        let snapshot = barrier_snapshot(
            &mut self.state.window,
            self.state.table.words(),
            &mut self.sequence,
            &mut self.state.counters,
            chunk_buckets,
        )?;
        self.pending_events = 0;
        Ok(snapshot)
    }

    fn finish_source_operation(&mut self, result: &Result<ApplyOutcome, ApplyError>) {
        match result {
            Ok(_) => {
                self.state.counters.source_resets += 1;
                self.pending_events += 1;
            }
            Err(err) => self.state.counters.count_rejection(err),
        }
    }
}
