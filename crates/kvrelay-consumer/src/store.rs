//! The replica store: one replica per subscribed producer generation, with freshness.
//!
//! Each slot is a lane of a `kvrelay-ckf` query table (chunked snapshot install, then
//! deltas strictly in sequence) plus the time it last heard from its relay. A slot answers prefix queries only while it is *current*: ready, and heard
//! from within the staleness bound. Any refused chunk, delta or heartbeat leaves the slot
//! invalid (it answers nothing) until a new snapshot restarts it; callers then drop the
//! subscription and resubscribe.
//!
//! Deltas and heartbeats are applied with `&self`, beside queries (the consumer applies
//! them under its shared lock, so scoring never waits for them): the table guards each
//! probe's rows (see `QueryTable`), and a slot's freshness is atomics. Everything else
//! (snapshot chunks, new and dropped lanes, invalidation) takes `&mut self`.

use hashbrown::HashMap;
use hashbrown::hash_map::Entry;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvrelay_ckf::{
    Delta, GrownRows, JointDepths, PrefixDepths, PrefixQuery, QueryConfig, QueryTable,
    ReplicaError, ReplicaStatus as CkfStatus, SnapshotChunk, joint_prefix_depths_into,
};
use kvrelay_identity::CkfFormat;

use crate::catalog::PoolKey;
use crate::scoring::{DepthProbe, ReplicaDepth, ReplicaState};

/// Why the store refused an operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// No slot for the key (the pool left the catalog).
    #[error("pool key {key} has no replica slot")]
    UnknownKey {
        /// The key.
        key: u64,
    },
    /// The replica table could not be allocated or grown; the key has no slot now (its
    /// replica is dropped) and the table is as it was.
    #[error("replica for pool key {key} could not be allocated: {reason}")]
    Allocation {
        /// The key.
        key: u64,
        /// The allocator's complaint.
        reason: String,
    },
    /// A new lane would take the query tables past
    /// [`crate::Limits::max_query_table_bytes`]; the key has no slot (its replica is
    /// dropped) and no table grew.
    #[error(
        "replica for pool key {key} needs {needed} more bytes of query table; {held} are \
         held and max_query_table_bytes is {budget}"
    )]
    OverTableBudget {
        /// The key.
        key: u64,
        /// Bytes the lane's table would allocate (a grown table is held next to the old
        /// one while it is laid out).
        needed: u64,
        /// Bytes every query table holds now.
        held: u64,
        /// The budget.
        budget: u64,
    },
    /// The replica refused a chunk or delta; it is now invalid.
    #[error("replica for pool key {key} refused a frame: {source}")]
    Replica {
        /// The key.
        key: u64,
        /// What the replica refused.
        source: ReplicaError,
    },
    /// A heartbeat named a sequence other than the installed one, or came before a
    /// snapshot was installed.
    #[error(
        "heartbeat at sequence {sequence} for pool key {key} does not match installed {installed:?}"
    )]
    HeartbeatMismatch {
        /// The key.
        key: u64,
        /// The heartbeat's sequence.
        sequence: u64,
        /// The installed sequence, if any.
        installed: Option<u64>,
    },
}

/// The allocator refused `key`'s table.
fn allocation_error(key: PoolKey, err: &dyn std::fmt::Display) -> StoreError {
    StoreError::Allocation {
        key: key.0,
        reason: err.to_string(),
    }
}

/// Whether a lane that allocates `needed` bytes of table fits `budget` beside the `held`
/// bytes (a growth's new table is allocated while the old one is still held).
fn within_table_budget(
    key: PoolKey,
    held: u64,
    needed: u64,
    budget: u64,
) -> Result<(), StoreError> {
    if held.saturating_add(needed) > budget {
        return Err(StoreError::OverTableBudget {
            key: key.0,
            needed,
            held,
            budget,
        });
    }
    Ok(())
}

/// Where one pool's replica lives, and its freshness.
#[derive(Debug)]
struct Slot {
    format: CkfFormat,
    lane: usize,
    fresh: Freshness,
}

impl Slot {
    fn new(format: CkfFormat, lane: usize) -> Self {
        Self {
            format,
            lane,
            fresh: Freshness::default(),
        }
    }
}

/// A slot's `invalid` flag: a heartbeat or frame was refused (or the stream broke), so the
/// lane answers nothing until reset.
const INVALID: u8 = 1;
/// A slot's `suspended` flag (always with `INVALID`): the stream broke but the lane is
/// intact at its sequence; a resumed stream brings it up to date.
const SUSPENDED: u8 = 2;

/// What applies beside queries change in a slot, as atomics (applies to one slot come
/// from its one subscription, one at a time; relaxed is enough: a query reading a flag a
/// moment early or late answers as it would have a moment earlier or later).
#[derive(Debug, Default)]
struct Freshness {
    /// When the slot last heard from its relay, as [`Clock`] ticks (0: never).
    last_heard: AtomicU64,
    /// `INVALID` and `SUSPENDED` bits.
    flags: AtomicU8,
    /// The newest frame sequence announced for the pool, plus one (0: none), for lag.
    announced: AtomicU64,
}

impl Freshness {
    fn flags(&self) -> u8 {
        self.flags.load(Ordering::Relaxed)
    }

    fn invalid(&self) -> bool {
        self.flags() & INVALID != 0
    }

    fn suspended(&self) -> bool {
        self.flags() & SUSPENDED != 0
    }

    fn set_flags(&self, flags: u8) {
        self.flags.store(flags, Ordering::Relaxed);
    }

    /// The slot heard from its relay at `now`.
    fn heard(&self, clock: Clock, now: Instant) {
        self.last_heard.store(clock.ticks(now), Ordering::Relaxed);
    }

    /// A frame brought the replica up to date: heard now, and a suspended replica (its
    /// stream resumed) answers again.
    fn caught_up(&self, clock: Clock, now: Instant) {
        self.heard(clock, now);
        if self.suspended() {
            self.set_flags(0);
        }
    }
}

/// `Instant`s as atomically storable ticks: nanoseconds after a base a little before the
/// store was made, plus one (0 stands for "never").
#[derive(Debug, Clone, Copy)]
struct Clock {
    base: Instant,
}

impl Clock {
    fn new() -> Self {
        let now = Instant::now();
        // A base before any `now` a caller may still pass (one taken just before the
        // store was made); a monotonic clock may not reach back that far after boot.
        let base = [3600, 60, 1]
            .into_iter()
            .find_map(|secs| now.checked_sub(Duration::from_secs(secs)))
            .unwrap_or(now);
        Self { base }
    }

    fn ticks(self, at: Instant) -> u64 {
        let nanos = at.saturating_duration_since(self.base).as_nanos();
        u64::try_from(nanos).unwrap_or(u64::MAX - 1) + 1
    }

    fn instant(self, ticks: u64) -> Option<Instant> {
        let nanos = ticks.checked_sub(1)?;
        self.base.checked_add(Duration::from_nanos(nanos))
    }
}

/// One multi-pool table per filter format, with its free lanes.
#[derive(Debug)]
struct FormatTable {
    table: QueryTable,
    free_lanes: Vec<usize>,
}

/// Replicas by pool key, laid out in one `kvrelay-ckf` [`QueryTable`] per filter format
/// (pools of one format share bucket rows, so one probe answers all of them).
#[derive(Debug)]
pub(crate) struct ReplicaStore {
    slots: HashMap<PoolKey, Slot>,
    tables: HashMap<CkfFormat, FormatTable>,
    clock: Clock,
    staleness_bound: Duration,
    /// Bytes all tables may hold, a growth's old and new table counted together.
    max_table_bytes: u64,
    /// Test hook: the next lane allocation fails as if the allocator had refused it.
    #[cfg(test)]
    fail_next_allocation: bool,
}

impl ReplicaStore {
    pub(crate) fn new(staleness_bound: Duration, max_table_bytes: u64) -> Self {
        Self {
            slots: HashMap::new(),
            tables: HashMap::new(),
            clock: Clock::new(),
            staleness_bound,
            max_table_bytes,
            #[cfg(test)]
            fail_next_allocation: false,
        }
    }

    /// The table growth [`ReplicaStore::reset`] of `key` would make, built from `&self`
    /// (allocation and copy) so it can run under a shared lock while queries go on;
    /// `None` when the reset needs no new rows. Refuses what the budget would refuse.
    pub(crate) fn prepare_lane(
        &self,
        key: PoolKey,
        format: CkfFormat,
    ) -> Result<Option<GrownRows>, StoreError> {
        let alloc = |err: &dyn std::fmt::Display| allocation_error(key, err);
        if self
            .slots
            .get(&key)
            .is_some_and(|slot| slot.format == format)
        {
            return Ok(None);
        }
        let fresh;
        let table = match self.tables.get(&format) {
            Some(entry) if !entry.free_lanes.is_empty() => return Ok(None),
            Some(entry) => &entry.table,
            None => {
                fresh = QueryTable::new(format, QueryConfig::default()).map_err(|e| alloc(&e))?;
                &fresh
            }
        };
        within_table_budget(
            key,
            self.table_bytes(),
            table.add_lane_bytes(),
            self.max_table_bytes,
        )?;
        table.prepare_growth().map_err(|e| alloc(&e))
    }

    /// Gives `key` an empty lane of its format's table (an existing lane is reset). On
    /// `Err` (the allocation of a new lane failed) `key` has no slot: its replica, if any,
    /// is dropped.
    #[cfg(test)]
    pub(crate) fn reset(&mut self, key: PoolKey, format: CkfFormat) -> Result<(), StoreError> {
        self.reset_prepared(key, format, None)
    }

    /// [`ReplicaStore::reset`] with rows from [`ReplicaStore::prepare_lane`]: a growth
    /// swaps them in when nothing changed since (else the table grows itself), leaving
    /// the old rows in `prepared` for the caller to free outside its lock.
    pub(crate) fn reset_prepared(
        &mut self,
        key: PoolKey,
        format: CkfFormat,
        prepared: Option<&mut GrownRows>,
    ) -> Result<(), StoreError> {
        let alloc = |err: &dyn std::fmt::Display| allocation_error(key, err);
        if let Some(&Slot {
            format: slot_format,
            lane,
            ..
        }) = self.slots.get(&key)
        {
            if slot_format == format {
                let table = self.table_mut(key, format)?;
                table
                    .reset_lane(lane)
                    .map_err(|source| StoreError::Replica { key: key.0, source })?;
                self.slots.insert(key, Slot::new(format, lane));
                return Ok(());
            }
            self.remove(key);
        }
        let held = self.table_bytes();
        let budget = self.max_table_bytes;
        let entry = match self.tables.entry(format) {
            Entry::Occupied(entry) => entry.into_mut(),
            Entry::Vacant(entry) => entry.insert(FormatTable {
                table: QueryTable::new(format, QueryConfig::default()).map_err(|e| alloc(&e))?,
                free_lanes: Vec::new(),
            }),
        };
        #[cfg(test)]
        let injected = std::mem::take(&mut self.fail_next_allocation);
        #[cfg(not(test))]
        let injected = false;
        let lane = match entry.free_lanes.pop() {
            Some(lane) => Ok(lane),
            None if injected => Err(alloc(&"injected allocation failure")),
            None => within_table_budget(key, held, entry.table.add_lane_bytes(), budget).and_then(
                |()| {
                    entry
                        .table
                        .add_lane_prepared(prepared)
                        .map_err(|e| alloc(&e))
                },
            ),
        };
        let lane = match lane {
            Ok(lane) => lane,
            Err(err) => {
                if entry.table.n_lanes() == 0 {
                    self.tables.remove(&format);
                }
                return Err(err);
            }
        };
        self.slots.insert(key, Slot::new(format, lane));
        Ok(())
    }

    /// Bytes every query table holds (lanes in use, spare stride and padding).
    pub(crate) fn table_bytes(&self) -> u64 {
        self.tables
            .values()
            .map(|entry| entry.table.table_bytes())
            .sum()
    }

    /// Of [`Self::table_bytes`], those in tables whose rows the kernel took the
    /// huge-page advice for.
    pub(crate) fn huge_page_advised_bytes(&self) -> u64 {
        self.tables
            .values()
            .filter(|entry| entry.table.huge_pages_advised())
            .map(|entry| entry.table.table_bytes())
            .sum()
    }

    /// Drops `key`'s slot and frees its lane; returns whether it existed.
    pub(crate) fn remove(&mut self, key: PoolKey) -> bool {
        let Some(slot) = self.slots.remove(&key) else {
            return false;
        };
        if let Some(entry) = self.tables.get_mut(&slot.format) {
            // The lane was valid when handed out, so resetting it cannot fail; a failure
            // would only leak the lane, never expose its words.
            if entry.table.reset_lane(slot.lane).is_ok() {
                entry.free_lanes.push(slot.lane);
            }
            if entry.free_lanes.len() == entry.table.n_lanes() {
                self.tables.remove(&slot.format);
            }
        }
        true
    }

    /// Marks `key`'s replica unusable until a new snapshot.
    pub(crate) fn invalidate(&self, key: PoolKey) {
        if let Some(slot) = self.slots.get(&key) {
            slot.fresh.set_flags(INVALID);
        }
    }

    /// Marks `key`'s replica unusable until its stream resumes (or a new snapshot), keeping
    /// its lane for the resumption. A replica already invalidated stays invalid.
    pub(crate) fn suspend(&mut self, key: PoolKey) {
        if let Some(slot) = self.slots.get(&key)
            && (!slot.fresh.invalid() || slot.fresh.suspended())
        {
            slot.fresh.set_flags(INVALID | SUSPENDED);
        }
    }

    /// The sequence a suspended replica of `format` can resume from.
    pub(crate) fn resume_point(&self, key: PoolKey, format: CkfFormat) -> Option<u64> {
        let slot = self.slots.get(&key)?;
        if !slot.fresh.suspended() || slot.format != format {
            return None;
        }
        match self
            .tables
            .get(&slot.format)?
            .table
            .lane_status(slot.lane)?
        {
            CkfStatus::Ready { sequence } => Some(sequence),
            _ => None,
        }
    }

    /// The lane's own sequence, suspended or not (never for a refused replica).
    fn resumable_sequence(&self, key: PoolKey) -> Option<u64> {
        let slot = self.slots.get(&key)?;
        if slot.fresh.invalid() && !slot.fresh.suspended() {
            return None;
        }
        match self
            .tables
            .get(&slot.format)?
            .table
            .lane_status(slot.lane)?
        {
            CkfStatus::Ready { sequence } => Some(sequence),
            _ => None,
        }
    }

    /// Installs one snapshot chunk; `Ok(true)` when the snapshot is complete.
    pub(crate) fn install_chunk(
        &mut self,
        key: PoolKey,
        chunk: &SnapshotChunk,
        now: Instant,
    ) -> Result<bool, StoreError> {
        let (format, lane) = self.place(key)?;
        let complete = self
            .table_mut(key, format)?
            .install_chunk(lane, chunk)
            .map_err(|source| StoreError::Replica { key: key.0, source })?;
        self.chunk_installed(self.slot(key)?, chunk, complete, now);
        Ok(complete)
    }

    /// [`ReplicaStore::install_chunk`] beside queries, when no query can be reading the
    /// lane (see `QueryTable::install_chunk_beside_queries`: a lane reset since it last
    /// answered, as every new subscription's is); `None` when one may be (use
    /// [`ReplicaStore::install_chunk`]).
    pub(crate) fn install_chunk_beside_queries(
        &self,
        key: PoolKey,
        chunk: &SnapshotChunk,
        now: Instant,
    ) -> Option<Result<bool, StoreError>> {
        let (slot, table) = match self
            .slot(key)
            .and_then(|slot| Ok((slot, self.table(key, slot)?)))
        {
            Ok(found) => found,
            Err(err) => return Some(Err(err)),
        };
        let installed = table.install_chunk_beside_queries(slot.lane, chunk)?;
        Some(
            installed
                .inspect(|&complete| self.chunk_installed(slot, chunk, complete, now))
                .map_err(|source| StoreError::Replica { key: key.0, source }),
        )
    }

    /// A chunk went in: the first one starts a new replica (valid, not suspended), the
    /// last one is news from the relay.
    fn chunk_installed(&self, slot: &Slot, chunk: &SnapshotChunk, complete: bool, now: Instant) {
        if chunk.chunk_index == 0 {
            slot.fresh.set_flags(0);
        }
        if complete {
            slot.fresh.heard(self.clock, now);
        }
    }

    /// Applies one delta whole, strictly in sequence, beside queries (see the module
    /// docs). A refused delta leaves the lane invalid.
    pub(crate) fn apply_delta(
        &self,
        key: PoolKey,
        delta: &Delta,
        now: Instant,
    ) -> Result<(), StoreError> {
        let slot = self.slot(key)?;
        self.table(key, slot)?
            .apply_delta(slot.lane, delta)
            .map_err(|source| StoreError::Replica { key: key.0, source })?;
        // A resumed stream caught the replica up: it answers again.
        slot.fresh.caught_up(self.clock, now);
        Ok(())
    }

    /// Accepts a heartbeat at `sequence` (beside queries): it must equal the installed
    /// sequence, else the replica is invalid.
    pub(crate) fn heartbeat(
        &self,
        key: PoolKey,
        sequence: u64,
        now: Instant,
    ) -> Result<(), StoreError> {
        let installed = self.resumable_sequence(key);
        let slot = self.slot(key)?;
        if installed == Some(sequence) {
            // Resumed already current, or still current.
            slot.fresh.caught_up(self.clock, now);
            return Ok(());
        }
        slot.fresh.set_flags(INVALID);
        Err(StoreError::HeartbeatMismatch {
            key: key.0,
            sequence,
            installed,
        })
    }

    /// The installed sequence of `key`, when ready and valid.
    pub(crate) fn sequence(&self, key: PoolKey) -> Option<u64> {
        match self.lane_status(key)? {
            CkfStatus::Ready { sequence } => Some(sequence),
            _ => None,
        }
    }

    /// How usable `key`'s replica is at `now`.
    pub(crate) fn status(&self, key: PoolKey, now: Instant) -> ReplicaState {
        match self.slots.get(&key) {
            Some(slot) => self.slot_status(slot, now),
            None => ReplicaState::Missing,
        }
    }

    fn slot_status(&self, slot: &Slot, now: Instant) -> ReplicaState {
        self.slot_status_in(slot, self.tables.get(&slot.format), now)
    }

    /// [`ReplicaStore::slot_status`] with the slot's format table already looked up.
    fn slot_status_in(
        &self,
        slot: &Slot,
        table: Option<&FormatTable>,
        now: Instant,
    ) -> ReplicaState {
        let Some(entry) = table.filter(|_| !slot.fresh.invalid()) else {
            return ReplicaState::Missing;
        };
        // The ready bit is one word and no lock (every query checks every candidate);
        // only a lane that is not ready has its stream state read.
        let ready = entry.table.lane_ready(slot.lane)
            || match entry.table.lane_status(slot.lane) {
                Some(CkfStatus::Assembling { .. }) => return ReplicaState::Assembling,
                Some(CkfStatus::Ready { .. }) => true,
                None | Some(CkfStatus::Empty | CkfStatus::Invalid) => false,
            };
        if !ready {
            return ReplicaState::Missing;
        }
        let fresh = self
            .last_heard(slot)
            .is_some_and(|heard| now.saturating_duration_since(heard) <= self.staleness_bound);
        if fresh {
            ReplicaState::Current
        } else {
            ReplicaState::Stale
        }
    }

    /// Time since `key` last heard from its relay, for installed replicas.
    pub(crate) fn age(&self, key: PoolKey, now: Instant) -> Option<Duration> {
        let slot = self.slots.get(&key)?;
        self.last_heard(slot)
            .map(|heard| now.saturating_duration_since(heard))
    }

    /// The newest frame sequence announced for `key` since its replica was (re)made.
    pub(crate) fn announced(&self, key: PoolKey) -> Option<u64> {
        let ticks = self
            .slots
            .get(&key)?
            .fresh
            .announced
            .load(Ordering::Relaxed);
        ticks.checked_sub(1)
    }

    /// Records that a frame at `sequence` arrived for `key` (beside queries).
    pub(crate) fn announce(&self, key: PoolKey, sequence: u64) {
        if let Some(slot) = self.slots.get(&key) {
            slot.fresh
                .announced
                .fetch_max(sequence.saturating_add(1), Ordering::Relaxed);
        }
    }

    fn last_heard(&self, slot: &Slot) -> Option<Instant> {
        self.clock
            .instant(slot.fresh.last_heard.load(Ordering::Relaxed))
    }

    fn lane_status(&self, key: PoolKey) -> Option<CkfStatus> {
        let slot = self.slots.get(&key)?;
        if slot.fresh.invalid() {
            return Some(CkfStatus::Invalid);
        }
        self.tables.get(&slot.format)?.table.lane_status(slot.lane)
    }

    fn slot(&self, key: PoolKey) -> Result<&Slot, StoreError> {
        self.slots
            .get(&key)
            .ok_or(StoreError::UnknownKey { key: key.0 })
    }

    /// `key`'s format and lane.
    fn place(&self, key: PoolKey) -> Result<(CkfFormat, usize), StoreError> {
        self.slot(key).map(|slot| (slot.format, slot.lane))
    }

    /// The table `slot` (of `key`) has its lane in.
    fn table(&self, key: PoolKey, slot: &Slot) -> Result<&QueryTable, StoreError> {
        self.tables
            .get(&slot.format)
            .map(|entry| &entry.table)
            .ok_or(StoreError::UnknownKey { key: key.0 })
    }

    fn table_mut(
        &mut self,
        key: PoolKey,
        format: CkfFormat,
    ) -> Result<&mut QueryTable, StoreError> {
        self.tables
            .get_mut(&format)
            .map(|entry| &mut entry.table)
            .ok_or(StoreError::UnknownKey { key: key.0 })
    }
}

/// Probe buffers kept across calls, so a warm scoring pass allocates nothing here when
/// its pools share one format.
#[derive(Debug, Default)]
pub(crate) struct ProbeScratch {
    /// The formats of this call's usable pools, in first-seen order.
    formats: Vec<CkfFormat>,
    /// Per key of this call: its format's index in `formats` and its lane, if usable.
    key_lanes: Vec<Option<(usize, usize)>>,
    /// The answer when every usable pool shares one format.
    single: PrefixDepths,
    /// The answers of a few formats searched one by one, by index in `formats`.
    per_table: Vec<PrefixDepths>,
    /// The answer over many formats, by index in `formats`.
    joint: JointDepths,
}

/// Fewest tables a request's pools must span for one joint search; fewer are searched one
/// by one. Measured (docs/ckf.md, "Where the joint search loses"): against one by one the
/// joint search gave 0.82–0.98× at 2 tables and 0.79–1.03× at 4, and 1.07–1.9× from 6 or
/// 7 tables in the fleet's workload.
const JOINT_MIN_TABLES: usize = 5;

/// How one probe's depths were found.
enum Searched {
    OneTable,
    OneByOne,
    Jointly,
}

impl DepthProbe for ReplicaStore {
    /// Pools of one format are answered by one search of their table; pools of a few
    /// formats (pools of different sizes) by their tables' searches one after another;
    /// pools of [`JOINT_MIN_TABLES`] formats or more by one joint search over their
    /// tables ([`kvrelay_ckf::joint_prefix_depths_into`]), so the tables' memory round
    /// trips overlap instead of adding up.
    fn probe(
        &self,
        keys: &[PoolKey],
        sequence_hashes: &[u64],
        now: Instant,
        out: &mut [ReplicaDepth],
        scratch: &mut ProbeScratch,
    ) {
        scratch.formats.clear();
        scratch.key_lanes.clear();
        // The tables of the formats in `scratch.formats`, in the same order, taken as each
        // format is first seen: the first apart, so one format (the usual case) allocates
        // nothing.
        let mut first_table: Option<&QueryTable> = None;
        let mut more_tables: Vec<&QueryTable> = Vec::new();
        // Pools of one request nearly always share one format: remember its table.
        let mut last_table: Option<(CkfFormat, Option<&FormatTable>)> = None;
        for (key, slot_out) in keys.iter().zip(out.iter_mut()) {
            let Some(slot) = self.slots.get(key) else {
                *slot_out = ReplicaDepth::Unusable(ReplicaState::Missing);
                scratch.key_lanes.push(None);
                continue;
            };
            let table = match last_table {
                Some((format, table)) if format == slot.format => table,
                _ => {
                    let table = self.tables.get(&slot.format);
                    last_table = Some((slot.format, table));
                    table
                }
            };
            let status = self.slot_status_in(slot, table, now);
            let Some(entry) = table.filter(|_| status == ReplicaState::Current) else {
                // A slot whose format has no table cannot be read, whatever its status.
                let status = match status {
                    ReplicaState::Current => ReplicaState::Missing,
                    status => status,
                };
                *slot_out = ReplicaDepth::Unusable(status);
                scratch.key_lanes.push(None);
                continue;
            };
            let index = match scratch.formats.iter().position(|f| *f == slot.format) {
                Some(index) => index,
                None => {
                    scratch.formats.push(slot.format);
                    if first_table.is_none() {
                        first_table = Some(&entry.table);
                    } else {
                        more_tables.push(&entry.table);
                    }
                    scratch.formats.len() - 1
                }
            };
            scratch.key_lanes.push(Some((index, slot.lane)));
        }
        let Some(first_table) = first_table else {
            return;
        };
        let searched = if more_tables.is_empty() {
            first_table.prefix_depths_into(sequence_hashes, &mut scratch.single);
            Searched::OneTable
        } else {
            let mut tables = more_tables;
            tables.insert(0, first_table);
            if tables.len() < JOINT_MIN_TABLES {
                let per_table = &mut scratch.per_table;
                per_table.resize_with(tables.len(), PrefixDepths::default);
                for (table, answer) in tables.iter().zip(per_table) {
                    table.prefix_depths_into(sequence_hashes, answer);
                }
                Searched::OneByOne
            } else {
                joint_prefix_depths_into(&tables, sequence_hashes, &mut scratch.joint);
                Searched::Jointly
            }
        };
        for (slot_out, key_lane) in out.iter_mut().zip(&scratch.key_lanes) {
            if let Some((index, lane)) = *key_lane {
                let depth = match searched {
                    Searched::OneTable => scratch.single.depth(lane),
                    Searched::OneByOne => scratch.per_table.get(index).and_then(|a| a.depth(lane)),
                    Searched::Jointly => scratch.joint.depth(index, lane),
                };
                *slot_out = match depth {
                    Some(depth) => ReplicaDepth::Current(depth),
                    None => ReplicaDepth::Unusable(ReplicaState::Missing),
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail by panicking")]

    use super::*;

    fn format() -> CkfFormat {
        CkfFormat::v1(7, 1024).unwrap()
    }

    /// A pool of `capacity` blocks holding `tokens[..depth]` as one chain, installed
    /// in `store` under `key` from its snapshot.
    fn install_pool(
        store: &mut ReplicaStore,
        key: PoolKey,
        capacity: u64,
        tokens: &[u64],
        depth: usize,
    ) {
        use kvrelay_ckf::{
            CkfConfig, EventPayload, PoolFilter, RouterEvent, SourceId, StoredBlocks,
        };
        let mut filter = PoolFilter::new(CkfConfig::new(capacity)).unwrap();
        let chain = StoredBlocks::new_chain(0, tokens[..depth].iter().copied());
        filter
            .apply(&RouterEvent {
                source: SourceId::new(1, 0),
                event_id: 1,
                payload: EventPayload::Stored(chain),
            })
            .unwrap();
        store.reset(key, filter.format()).unwrap();
        for chunk in filter.snapshot().unwrap().chunks {
            store.install_chunk(key, &chunk, Instant::now()).unwrap();
        }
    }

    /// Pools `(key, capacity, depth)` installed, probed together with the missing pool 9
    /// after the first two, answer their depths and as each alone does.
    fn probed_together_answer_as_alone(pools: &[(u64, u64, usize)], n_formats: usize) {
        let mut store = ReplicaStore::new(Duration::from_secs(30), u64::MAX);
        let tokens: Vec<u64> = (1..=12).collect();
        for &(key, capacity, depth) in pools {
            install_pool(&mut store, PoolKey(key), capacity, &tokens, depth);
        }
        assert_eq!(store.tables.len(), n_formats);
        let hashes = kvrelay_identity::hashing::sequence_hashes(&tokens);
        let now = Instant::now();
        let mut keys: Vec<PoolKey> = pools.iter().map(|&(key, ..)| PoolKey(key)).collect();
        keys.insert(2, PoolKey(9));
        let mut out = vec![ReplicaDepth::Current(0); keys.len()];
        let mut scratch = ProbeScratch::default();
        store.probe(&keys, &hashes, now, &mut out, &mut scratch);
        let mut expected: Vec<ReplicaDepth> = pools
            .iter()
            .map(|&(.., depth)| ReplicaDepth::Current(depth as u32))
            .collect();
        expected.insert(2, ReplicaDepth::Unusable(ReplicaState::Missing));
        assert_eq!(out, expected);
        // Each alone (one format: its table's own search) answers the same.
        for (i, key) in keys.iter().enumerate() {
            let mut alone = [ReplicaDepth::Current(0)];
            store.probe(&[*key], &hashes, now, &mut alone, &mut scratch);
            assert_eq!(alone[0], out[i], "pool {key:?}");
        }
    }

    #[test]
    fn pools_of_a_few_formats_are_searched_one_by_one_and_answer_as_alone() {
        // Three formats (capacities round to different bucket counts), two pools in one.
        let pools = [(1, 1_000, 12), (2, 5_000, 3), (3, 20_000, 7), (4, 1_000, 5)];
        probed_together_answer_as_alone(&pools, 3);
    }

    #[test]
    fn pools_of_many_formats_are_searched_jointly_and_answer_as_alone() {
        let pools = [
            (1, 1_000, 12),
            (2, 5_000, 3),
            (3, 20_000, 7),
            (4, 1_000, 5),
            (5, 80_000, 0),
            (6, 300_000, 9),
        ];
        const { assert!(JOINT_MIN_TABLES <= 5) };
        probed_together_answer_as_alone(&pools, 5);
    }

    #[test]
    fn failed_lane_allocation_is_a_typed_error_and_leaves_no_slot() {
        let mut store = ReplicaStore::new(Duration::from_secs(30), u64::MAX);
        store.fail_next_allocation = true;
        let err = store.reset(PoolKey(1), format()).unwrap_err();
        assert!(
            matches!(err, StoreError::Allocation { key: 1, .. }),
            "{err:?}"
        );
        assert_eq!(
            store.status(PoolKey(1), Instant::now()),
            ReplicaState::Missing
        );
        assert!(store.tables.is_empty(), "no empty table is left behind");
        // The allocator recovered: the next attempt gets a lane.
        store.reset(PoolKey(1), format()).unwrap();
        assert_eq!(store.tables[&format()].table.n_lanes(), 1);
    }

    #[test]
    fn tables_of_2_mib_or_more_count_as_advised_onto_huge_pages() {
        let mut store = ReplicaStore::new(Duration::from_secs(30), u64::MAX);
        store.reset(PoolKey(1), format()).unwrap();
        assert_eq!(
            store.huge_page_advised_bytes(),
            0,
            "an 8 KiB table is not advised"
        );
        let large = CkfFormat::v1(7, 1 << 19).unwrap();
        store.reset(PoolKey(2), large).unwrap();
        let large_bytes = store.tables[&large].table.table_bytes();
        assert!(large_bytes >= 4 << 20);
        // Linux takes the advice whenever it was built with transparent huge pages.
        let can_advise = cfg!(target_os = "linux")
            && std::path::Path::new("/sys/kernel/mm/transparent_hugepage").exists();
        let expected = if can_advise { large_bytes } else { 0 };
        assert_eq!(store.huge_page_advised_bytes(), expected);
    }

    #[test]
    fn lanes_past_the_table_budget_are_refused_before_anything_is_allocated() {
        // A table of 1,024 rows: one lane is 1,024 words, two lanes 2,048 (plus 7 words
        // of alignment padding each time).
        let one_lane = (1024 + 7) * 8;
        let two_lanes = (2048 + 7) * 8;
        // Growing to two lanes holds both tables at once.
        let budget = one_lane + two_lanes;
        let mut store = ReplicaStore::new(Duration::from_secs(30), budget);
        store.reset(PoolKey(1), format()).unwrap();
        assert_eq!(store.table_bytes(), one_lane);
        store.reset(PoolKey(2), format()).unwrap();
        assert_eq!(store.table_bytes(), two_lanes);

        // A third lane needs a four-lane table next to the two-lane one.
        let err = store.reset(PoolKey(3), format()).unwrap_err();
        assert_eq!(
            err,
            StoreError::OverTableBudget {
                key: 3,
                needed: (4096 + 7) * 8,
                held: two_lanes,
                budget,
            }
        );
        assert_eq!(
            store.status(PoolKey(3), Instant::now()),
            ReplicaState::Missing
        );
        assert_eq!(store.table_bytes(), two_lanes, "nothing grew");

        // Another format's first table does not fit beside it either, and leaves no
        // empty table behind.
        let other = CkfFormat::v1(8, 4096).unwrap();
        assert!(matches!(
            store.reset(PoolKey(4), other),
            Err(StoreError::OverTableBudget { key: 4, .. })
        ));
        assert_eq!(store.tables.len(), 1);

        // A freed lane is reused without growing.
        assert!(store.remove(PoolKey(1)));
        store.reset(PoolKey(3), format()).unwrap();
        assert_eq!(store.table_bytes(), two_lanes);
        // Preparing refuses what resetting would.
        assert!(matches!(
            store.prepare_lane(PoolKey(5), format()),
            Err(StoreError::OverTableBudget { key: 5, .. })
        ));
    }

    #[test]
    fn a_prepared_growth_is_swapped_in_by_the_reset_it_was_made_for() {
        let mut store = ReplicaStore::new(Duration::from_secs(30), u64::MAX);
        // A new format's first table is prepared too.
        let mut first = store.prepare_lane(PoolKey(1), format()).unwrap().unwrap();
        assert_eq!(first.bytes(), (1024 + 7) * 8);
        store
            .reset_prepared(PoolKey(1), format(), Some(&mut first))
            .unwrap();
        assert_eq!(store.table_bytes(), (1024 + 7) * 8);
        // The key's own lane needs nothing new.
        assert!(store.prepare_lane(PoolKey(1), format()).unwrap().is_none());

        let mut grown = store.prepare_lane(PoolKey(2), format()).unwrap().unwrap();
        assert_eq!(grown.bytes(), (2048 + 7) * 8);
        assert_eq!(
            store.table_bytes(),
            (1024 + 7) * 8,
            "preparing changes nothing"
        );
        store
            .reset_prepared(PoolKey(2), format(), Some(&mut grown))
            .unwrap();
        assert_eq!(
            grown.bytes(),
            (1024 + 7) * 8,
            "the old rows, to free outside the lock"
        );
        assert_eq!(store.table_bytes(), (2048 + 7) * 8);
        assert_eq!(store.slots[&PoolKey(2)].lane, 1);
        assert_eq!(
            store.slots[&PoolKey(1)].lane,
            0,
            "the first lane kept its place"
        );
    }
}
