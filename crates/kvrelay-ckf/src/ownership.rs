//! The producer filter of one pool: exact ownership per source, the lossy table it
//! projects to, and the publication window.
//!
//! Each source keeps a lineage (engine block id → canonical sequence hash); each canonical
//! hash keeps an owner count (mappings pointing at it) and a residency flag (whether its
//! one fingerprint is in the table). Only 0 → 1 owners inserts a fingerprint and only
//! 1 → 0 removes one; a fingerprint is never removed for a hash that is not resident, and
//! never by fingerprint alone.

use std::num::NonZeroU32;

use kvrelay_identity::CkfFormat;
use kvrelay_identity::hashing::{canonical_child, canonical_root};

use crate::addressing::Address;
use crate::counters::{ApplyOutcome, FilterCounters, MemoryUsage};
use crate::event::{EventPayload, RouterEvent, SourceId, StoredBlocks};
use crate::format::{CkfConfig, ConfigError};
use crate::image::{Delta, SNAPSHOT_CHUNK_BUCKETS, SnapshotChunk};
use crate::keyhash::KeyMap;
use crate::lineage::LineageMap;
use crate::owners::{GrowFailed, NotStored, OwnerEntry, OwnerTable};
use crate::publication::{AllocFailed, DirtyWindow, snapshot_chunks};
use crate::table::Table;

/// Stored batches up to this length check repeated engine ids by a linear scan.
const LINEAR_SCAN_MAX: usize = 16;

/// Why an event or a source operation was rejected. The filter is unchanged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApplyError {
    /// The parent block is not in this source's lineage.
    #[error("{source_id}: parent engine block {parent_engine_block_id} not found")]
    ParentNotFound {
        /// The reporting source.
        source_id: SourceId,
        /// The unknown parent.
        parent_engine_block_id: u64,
    },
    /// An engine block id is already mapped to a different canonical hash.
    #[error(
        "{source_id}: engine block {engine_block_id} is mapped to {mapped:#018x}, event offers {offered:#018x}"
    )]
    ContradictoryBlockId {
        /// The reporting source.
        source_id: SourceId,
        /// The engine block id.
        engine_block_id: u64,
        /// The canonical hash it already maps to.
        mapped: u64,
        /// The canonical hash the event derives for it.
        offered: u64,
    },
    /// A canonical hash's owner count would exceed `u32::MAX`.
    #[error("owner count of canonical hash {canonical:#018x} would overflow u32")]
    OwnershipOverflow {
        /// The canonical hash.
        canonical: u64,
    },
    /// A fallible allocation failed before anything changed.
    #[error("allocation of {bytes} bytes for {what} failed")]
    AllocationFailed {
        /// What was being allocated.
        what: &'static str,
        /// How many bytes were requested (approximate).
        bytes: u64,
    },
}

/// Why a delta or snapshot could not be built. Pending changes are kept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PublishError {
    /// A fallible allocation failed.
    #[error("allocation of {bytes} bytes for publication failed")]
    AllocationFailed {
        /// How many bytes were requested.
        bytes: u64,
    },
    /// The stream sequence reached `u64::MAX`; a new producer generation is needed.
    #[error("publication sequence exhausted at {sequence}")]
    SequenceExhausted {
        /// The last sequence.
        sequence: u64,
    },
}

/// A snapshot taken behind a barrier: first the pending `tail` (for existing
/// subscribers), then `chunks`, consistent at the sequence after the tail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BarrierSnapshot {
    /// Pending changes published as a delta before the snapshot, if any.
    pub tail: Option<Delta>,
    /// The snapshot; the next delta has `base_sequence == chunks[0].sequence`.
    pub chunks: Vec<SnapshotChunk>,
}

/// One validated stored block.
#[derive(Debug, Clone, Copy)]
struct PlannedBlock {
    engine_block_id: u64,
    canonical: u64,
    is_new: bool,
    /// Filled by the prefetch pass just before commit.
    address: Address,
}

/// An address placeholder until the prefetch pass fills it.
const NO_ADDRESS: Address = Address {
    fingerprint: 0,
    primary: 0,
    alternate: 0,
};

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
    state: Ownership,
    plan: Vec<PlannedBlock>,
    /// Canonical hashes and addresses of the removal being applied.
    removal: Vec<(u64, Address)>,
    sequence: u64,
    pending_events: u64,
}

/// Owner counts, the table and the window: what ownership transitions mutate.
#[derive(Debug, Clone)]
struct Ownership {
    owners: OwnerTable,
    table: Table,
    window: DirtyWindow,
    counters: FilterCounters,
}

impl PoolFilter {
    /// An empty filter for `config`; the table is allocated fallibly.
    pub fn new(config: CkfConfig) -> Result<Self, ConfigError> {
        let format = config.format()?;
        let table = Table::new(format, config.max_kicks)?;
        let window = DirtyWindow::new(format.bucket_count() as usize).map_err(|failed| {
            ConfigError::AllocationFailed {
                what: "dirty window",
                bytes: failed.bytes,
            }
        })?;
        Ok(Self {
            format,
            max_kicks: config.max_kicks,
            lineage: KeyMap::default(),
            state: Ownership {
                owners: OwnerTable::default(),
                table,
                window,
                counters: FilterCounters::default(),
            },
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

    /// Applies one router event. On `Err` nothing changed except the rejection counters.
    pub fn apply(&mut self, event: &RouterEvent) -> Result<ApplyOutcome, ApplyError> {
        let counters = &mut self.state.counters;
        match &event.payload {
            EventPayload::Stored(_) => counters.stored_events += 1,
            EventPayload::Removed(_) => counters.removed_events += 1,
            EventPayload::AllCleared => counters.cleared_events += 1,
        }
        let result = match &event.payload {
            EventPayload::Stored(stored) => self.apply_stored(event.source, stored),
            EventPayload::Removed(removed) => {
                self.apply_removed(event.source, &removed.engine_block_ids)
            }
            EventPayload::AllCleared => self.clear_source_inner(event.source),
        };
        match &result {
            Ok(_) => {
                self.state.counters.events_applied += 1;
                self.pending_events += 1;
            }
            Err(err) => self.state.count_rejection(err),
        }
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

    /// Whether the table holds `canonical`'s fingerprint (what a replica would answer).
    pub fn contains(&self, canonical: u64) -> bool {
        let address = self.address(canonical);
        self.state.table.contains(address)
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

    /// Occupied fingerprint slots (scans the table).
    pub fn occupied_slots(&self) -> u64 {
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
        if self.state.window.is_empty() {
            self.pending_events = 0;
            return Ok(None);
        }
        if self.sequence == u64::MAX {
            return Err(PublishError::SequenceExhausted {
                sequence: self.sequence,
            });
        }
        let (delta, stats) = self
            .state
            .window
            .drain(self.state.table.words(), self.sequence)
            .map_err(|AllocFailed { bytes }| PublishError::AllocationFailed { bytes })?;
        let counters = &mut self.state.counters;
        counters.net_reverted_buckets += stats.net_reverted;
        self.pending_events = 0;
        if let Some(delta) = &delta {
            counters.deltas_published += 1;
            counters.images_published += delta.images.len() as u64;
            self.sequence = delta.sequence;
        }
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
        // Copy first (the only large allocation), then drain: a failed copy keeps the tail.
        let mut chunks = snapshot_chunks(self.sequence, self.state.table.words(), chunk_buckets)
            .map_err(|AllocFailed { bytes }| PublishError::AllocationFailed { bytes })?;
        let tail = self.take_delta()?;
        for chunk in &mut chunks {
            chunk.sequence = self.sequence;
        }
        self.state.counters.snapshots_taken += 1;
        Ok(BarrierSnapshot { tail, chunks })
    }

    fn finish_source_operation(&mut self, result: &Result<ApplyOutcome, ApplyError>) {
        match result {
            Ok(_) => {
                self.state.counters.source_resets += 1;
                self.pending_events += 1;
            }
            Err(err) => self.state.count_rejection(err),
        }
    }

    fn apply_stored(
        &mut self,
        source: SourceId,
        stored: &StoredBlocks,
    ) -> Result<ApplyOutcome, ApplyError> {
        let mut plan = std::mem::take(&mut self.plan);
        let result = self
            .plan_stored(source, stored, &mut plan)
            .and_then(|n_new| {
                self.reserve_for_store(source, n_new, plan.len() - n_new)?;
                self.state.prefetch_plan(&mut plan);
                Ok(self.commit_stored(source, &plan))
            });
        plan.clear();
        self.plan = plan;
        result
    }

    /// Validates a stored chain against the source's lineage; fills `plan` and returns
    /// how many blocks are new mappings.
    fn plan_stored(
        &self,
        source: SourceId,
        stored: &StoredBlocks,
        plan: &mut Vec<PlannedBlock>,
    ) -> Result<usize, ApplyError> {
        let lineage = self.lineage.get(&source);
        let mut parent = match stored.parent_engine_block_id {
            None => None,
            Some(parent_engine_block_id) => {
                Some(lineage.and_then(|m| m.get(parent_engine_block_id)).ok_or(
                    ApplyError::ParentNotFound {
                        source_id: source,
                        parent_engine_block_id,
                    },
                )?)
            }
        };
        plan.try_reserve(stored.blocks.len())
            .map_err(|_| ApplyError::AllocationFailed {
                what: "stored plan",
                bytes: (stored.blocks.len() * std::mem::size_of::<PlannedBlock>()) as u64,
            })?;
        if let Some(lineage) = lineage {
            // Issue every block's lineage miss before the (branchy) validation loop.
            let sink = stored
                .blocks
                .iter()
                .fold(0u64, |sink, b| sink ^ lineage.touch(b.engine_block_id));
            std::hint::black_box(sink);
        }
        let use_scan = stored.blocks.len() <= LINEAR_SCAN_MAX;
        let mut batch_ids: KeyMap<u64, u64> = KeyMap::default();
        let mut n_new = 0u64;
        for block in &stored.blocks {
            let canonical = match parent {
                None => canonical_root(block.token_hash),
                Some(parent) => canonical_child(parent, block.token_hash),
            };
            parent = Some(canonical);
            let id = block.engine_block_id;
            let earlier = lineage.and_then(|m| m.get(id)).or_else(|| {
                if use_scan {
                    plan.iter()
                        .find(|p| p.engine_block_id == id)
                        .map(|p| p.canonical)
                } else {
                    batch_ids.get(&id).copied()
                }
            });
            let is_new = match earlier {
                Some(mapped) if mapped != canonical => {
                    return Err(ApplyError::ContradictoryBlockId {
                        source_id: source,
                        engine_block_id: id,
                        mapped,
                        offered: canonical,
                    });
                }
                Some(_) => false,
                None => true,
            };
            if is_new {
                n_new += 1;
                // An owner count never exceeds the live mappings, so bounding those bounds
                // every count without a per-hash lookup.
                if self.live_mappings() + n_new > u64::from(u32::MAX) {
                    return Err(ApplyError::OwnershipOverflow { canonical });
                }
                if !use_scan {
                    batch_ids.insert(id, canonical);
                }
            }
            plan.push(PlannedBlock {
                engine_block_id: id,
                canonical,
                is_new,
                address: NO_ADDRESS,
            });
        }
        Ok(n_new as usize)
    }

    /// Live (source, engine block id) mappings, from the counters.
    fn live_mappings(&self) -> u64 {
        let c = &self.state.counters;
        c.blocks_mapped - c.mappings_removed
    }

    /// Reserves every map and window slot a store may need, so commit cannot fail.
    fn reserve_for_store(
        &mut self,
        source: SourceId,
        n_new: usize,
        n_reoffered: usize,
    ) -> Result<(), ApplyError> {
        let max_touches = n_new * (self.max_kicks as usize + 1) + n_reoffered;
        self.state.reserve(n_new, max_touches)?;
        if n_new == 0 {
            return Ok(());
        }
        if !self.lineage.contains_key(&source) {
            self.lineage
                .try_reserve(1)
                .map_err(|_| alloc("source map", 64))?;
            let mut map = LineageMap::default();
            map.try_reserve(n_new)
                .map_err(|GrowFailed { bytes }| alloc("lineage", bytes))?;
            self.lineage.insert(source, map);
        } else if let Some(map) = self.lineage.get_mut(&source) {
            map.try_reserve(n_new)
                .map_err(|GrowFailed { bytes }| alloc("lineage", bytes))?;
        }
        Ok(())
    }

    fn commit_stored(&mut self, source: SourceId, plan: &[PlannedBlock]) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        if let Some(lineage) = self.lineage.get_mut(&source) {
            for block in plan.iter().filter(|b| b.is_new) {
                // Room was reserved, so this cannot fail.
                if !lineage.insert(block.engine_block_id, block.canonical) {
                    self.state.counters.invariant_violations += 1;
                }
            }
        }
        for block in plan {
            if block.is_new {
                self.state
                    .acquire_and_admit(block.canonical, block.address, &mut outcome);
            } else {
                self.state.reoffer(block.canonical, &mut outcome);
            }
        }
        outcome
    }

    fn apply_removed(
        &mut self,
        source: SourceId,
        engine_block_ids: &[u64],
    ) -> Result<ApplyOutcome, ApplyError> {
        self.state.reserve(0, engine_block_ids.len())?;
        let mut removal = std::mem::take(&mut self.removal);
        removal.clear();
        if removal.try_reserve(engine_block_ids.len()).is_err() {
            self.removal = removal;
            return Err(alloc("removal scratch", engine_block_ids.len() as u64 * 24));
        }
        let mut outcome = ApplyOutcome::default();
        let Some(lineage) = self.lineage.get_mut(&source) else {
            self.removal = removal;
            self.state.counters.unknown_removals += engine_block_ids.len() as u64;
            outcome.unknown_removals = engine_block_ids.len() as u64;
            return Ok(outcome);
        };
        // Three passes, so that each pass's cache misses are independent of each other
        // and overlap: lineage reads, then owner entries and table rows, then the commit.
        let mut sink = 0u64;
        for id in engine_block_ids {
            sink ^= lineage.touch(*id);
        }
        for id in engine_block_ids {
            match lineage.remove(*id) {
                Some(canonical) => removal.push((canonical, NO_ADDRESS)),
                None => {
                    self.state.counters.unknown_removals += 1;
                    outcome.unknown_removals += 1;
                }
            }
        }
        if lineage.is_empty() {
            self.lineage.remove(&source);
        }
        for (canonical, address) in &mut removal {
            sink ^= self.state.prefetch(*canonical, address);
        }
        std::hint::black_box(sink);
        for &(canonical, address) in &removal {
            self.state
                .release_at(canonical, Some(address), &mut outcome);
        }
        self.removal = removal;
        Ok(outcome)
    }

    fn clear_source_inner(&mut self, source: SourceId) -> Result<ApplyOutcome, ApplyError> {
        let n_mappings = self.lineage.get(&source).map_or(0, |m| m.len());
        self.state.reserve(0, n_mappings)?;
        let mut outcome = ApplyOutcome::default();
        if let Some(lineage) = self.lineage.remove(&source) {
            for canonical in lineage.values() {
                self.state.release(canonical, &mut outcome);
            }
        }
        Ok(outcome)
    }

    fn remove_worker_inner(&mut self, worker_id: u64) -> Result<ApplyOutcome, ApplyError> {
        let mut sources: Vec<SourceId> = self
            .lineage
            .keys()
            .filter(|s| s.worker_id == worker_id)
            .copied()
            .collect();
        sources.sort_unstable();
        let n_mappings: usize = sources
            .iter()
            .filter_map(|s| self.lineage.get(s))
            .map(|m| m.len())
            .sum();
        self.state.reserve(0, n_mappings)?;
        let mut outcome = ApplyOutcome::default();
        for source in sources {
            if let Some(lineage) = self.lineage.remove(&source) {
                for canonical in lineage.values() {
                    self.state.release(canonical, &mut outcome);
                }
            }
        }
        Ok(outcome)
    }

    fn reset_source_inner(
        &mut self,
        source: SourceId,
        chains: &[StoredBlocks],
    ) -> Result<ApplyOutcome, ApplyError> {
        // Validate the whole dump against an empty lineage.
        let n_blocks: usize = chains.iter().map(|c| c.blocks.len()).sum();
        let mut fresh = LineageMap::default();
        fresh
            .try_reserve(n_blocks)
            .map_err(|GrowFailed { bytes }| alloc("lineage", bytes))?;
        let mut order = Vec::new();
        order
            .try_reserve_exact(n_blocks)
            .map_err(|_| alloc("reset order", n_blocks as u64 * 8))?;
        for chain in chains {
            let mut parent = match chain.parent_engine_block_id {
                None => None,
                Some(parent_engine_block_id) => Some(fresh.get(parent_engine_block_id).ok_or(
                    ApplyError::ParentNotFound {
                        source_id: source,
                        parent_engine_block_id,
                    },
                )?),
            };
            for block in &chain.blocks {
                let canonical = match parent {
                    None => canonical_root(block.token_hash),
                    Some(parent) => canonical_child(parent, block.token_hash),
                };
                parent = Some(canonical);
                match fresh.get(block.engine_block_id) {
                    Some(mapped) if mapped != canonical => {
                        return Err(ApplyError::ContradictoryBlockId {
                            source_id: source,
                            engine_block_id: block.engine_block_id,
                            mapped,
                            offered: canonical,
                        });
                    }
                    Some(_) => {}
                    None => {
                        if self.live_mappings() + fresh.len() as u64 + 1 > u64::from(u32::MAX) {
                            return Err(ApplyError::OwnershipOverflow { canonical });
                        }
                        if !fresh.insert(block.engine_block_id, canonical) {
                            return Err(alloc("lineage", n_blocks as u64 * 16));
                        }
                        order.push(canonical);
                    }
                }
            }
        }
        let n_old = self.lineage.get(&source).map_or(0, |m| m.len());
        let max_touches = n_old + order.len() * (self.max_kicks as usize + 1);
        self.state.reserve(order.len(), max_touches)?;
        self.lineage
            .try_reserve(1)
            .map_err(|_| alloc("source map", 64))?;

        // Commit: new owners first (so kept hashes never drop to zero), then release the
        // old mappings, then admit what is owned but not resident.
        let mut outcome = ApplyOutcome::default();
        for &canonical in &order {
            self.state.acquire(canonical, &mut outcome);
        }
        if let Some(old) = self.lineage.remove(&source) {
            for canonical in old.values() {
                self.state.release(canonical, &mut outcome);
            }
        }
        for &canonical in &order {
            self.state.admit(canonical, &mut outcome);
        }
        if !fresh.is_empty() {
            self.lineage.insert(source, fresh);
        }
        Ok(outcome)
    }
}

impl Ownership {
    fn reserve(&mut self, n_new_owners: usize, max_touches: usize) -> Result<(), ApplyError> {
        self.owners
            .try_reserve(n_new_owners)
            .map_err(|GrowFailed { bytes }| alloc("owner table", bytes))?;
        self.window
            .reserve(max_touches)
            .map_err(|AllocFailed { bytes }| alloc("dirty window", bytes))
    }

    fn count_rejection(&mut self, err: &ApplyError) {
        self.counters.events_rejected += 1;
        match err {
            ApplyError::ParentNotFound { .. } => self.counters.parent_not_found += 1,
            ApplyError::ContradictoryBlockId { .. } => self.counters.contradictory_block_ids += 1,
            ApplyError::OwnershipOverflow { .. } => self.counters.ownership_overflows += 1,
            ApplyError::AllocationFailed { .. } => self.counters.allocation_failures += 1,
        }
    }

    /// Adds one owner (a new mapping) to `canonical`; no table write.
    fn acquire(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        // Overflow was ruled out by validation, and the slot was reserved.
        match self.owners.add_owner(canonical) {
            Some((_, true)) => self.counters.canonicals_created += 1,
            Some((_, false)) => {}
            None => self.counters.invariant_violations += 1,
        }
        self.counters.blocks_mapped += 1;
        outcome.blocks_mapped += 1;
    }

    /// Computes every planned block's address and loads its owner entry and table rows
    /// (independent loads that overlap), so the commit finds them in cache.
    fn prefetch_plan(&self, plan: &mut [PlannedBlock]) {
        let mut sink = 0u64;
        for block in plan {
            sink ^= self.prefetch(block.canonical, &mut block.address);
        }
        std::hint::black_box(sink);
    }

    /// Sets `address` to `canonical`'s and loads its owner slot and both table rows;
    /// returns a value to fold into a sink so the loads are kept.
    #[inline]
    fn prefetch(&self, canonical: u64, address: &mut Address) -> u64 {
        *address = self.table.addressing().address(canonical);
        self.owners.touch(canonical)
            ^ self.table.word(address.primary)
            ^ self.table.word(address.alternate)
    }

    /// [`Ownership::acquire`] then [`Ownership::admit`] with one owner-map lookup;
    /// `address` is `canonical`'s.
    fn acquire_and_admit(&mut self, canonical: u64, address: Address, outcome: &mut ApplyOutcome) {
        self.counters.blocks_mapped += 1;
        outcome.blocks_mapped += 1;
        // Overflow was ruled out by validation, and the slot was reserved.
        let Some((entry, created)) = self.owners.add_owner(canonical) else {
            self.counters.invariant_violations += 1;
            return;
        };
        if created {
            self.counters.canonicals_created += 1;
        }
        if !entry.resident {
            admit_entry(
                &mut self.table,
                &mut self.window,
                &mut self.counters,
                address,
                entry,
                outcome,
            );
        }
    }

    /// Full admission (with relocation) of an owned hash that is not resident.
    fn admit(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        let Some(entry) = self.owners.get_mut(canonical) else {
            return;
        };
        if entry.resident {
            return;
        }
        let address = self.table.addressing().address(canonical);
        admit_entry(
            &mut self.table,
            &mut self.window,
            &mut self.counters,
            address,
            entry,
            outcome,
        );
    }

    /// A re-offered mapping: a cheap relocation-free admission if not resident.
    fn reoffer(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        self.counters.blocks_reoffered += 1;
        outcome.blocks_reoffered += 1;
        let Some(entry) = self.owners.get_mut(canonical) else {
            return;
        };
        if entry.resident {
            return;
        }
        let address = self.table.addressing().address(canonical);
        let window = &mut self.window;
        match self
            .table
            .insert_without_relocation(address, |b, prev| window.note(b, prev))
        {
            Ok(()) => {
                entry.resident = true;
                self.counters.fingerprints_inserted += 1;
                self.counters.late_admissions += 1;
                outcome.fingerprints_inserted += 1;
            }
            Err(_) => self.counters.reoffer_misses += 1,
        }
    }

    /// Drops one owner of `canonical`; the last owner of a resident hash removes its
    /// fingerprint.
    fn release(&mut self, canonical: u64, outcome: &mut ApplyOutcome) {
        self.release_at(canonical, None, outcome);
    }

    /// [`Ownership::release`] with `canonical`'s address when already known.
    fn release_at(&mut self, canonical: u64, address: Option<Address>, outcome: &mut ApplyOutcome) {
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
        if !resident {
            return;
        }
        let address = address.unwrap_or_else(|| self.table.addressing().address(canonical));
        let window = &mut self.window;
        if self.table.remove(address, |b, prev| window.note(b, prev)) {
            self.counters.fingerprints_removed += 1;
            outcome.fingerprints_removed += 1;
        } else {
            self.counters.invariant_violations += 1;
        }
    }
}

/// Inserts the fingerprint at `address` (of an owned hash that is not resident) with
/// relocation and records the outcome in its owner `entry`.
fn admit_entry(
    table: &mut Table,
    window: &mut DirtyWindow,
    counters: &mut FilterCounters,
    address: Address,
    entry: &mut OwnerEntry,
    outcome: &mut ApplyOutcome,
) {
    match table.insert(address, |b, prev| window.note(b, prev)) {
        Ok(()) => {
            entry.resident = true;
            counters.fingerprints_inserted += 1;
            outcome.fingerprints_inserted += 1;
            if entry.omitted {
                counters.late_admissions += 1;
            }
        }
        Err(_) => {
            entry.omitted = true;
            counters.capacity_omissions += 1;
            outcome.capacity_omissions += 1;
        }
    }
}

fn alloc(what: &'static str, bytes: u64) -> ApplyError {
    ApplyError::AllocationFailed { what, bytes }
}
