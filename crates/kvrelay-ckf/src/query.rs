//! Multi-pool prefix queries: the [`PrefixQuery`] trait, the lossy [`QueryTable`] of pool
//! lanes and its result type.
//!
//! The table stores every lane's replica bucket-major: row `b` holds bucket `b` of every
//! lane side by side (`stride` words, lanes `0..n_lanes`), so one probe of a hash reads two
//! rows and answers "which pools hold this hash" for all pools at once. There is no lane
//! cap; adding a lane beyond the stride re-lays the table out with the next stride
//! (doubling up to 8 lanes, then a cache line more up to 64, then a quarter more).

use std::sync::atomic::{AtomicU64, Ordering, fence};

use kvrelay_identity::CkfFormat;
use parking_lot::Mutex;

use crate::addressing::Addressing;
use crate::bucket;
use crate::format::ConfigError;
use crate::huge_pages::zeroed_words;
use crate::image::{BucketImage, Delta, SnapshotChunk};
use crate::prefetch::prefetch_element;
use crate::replica::{ReplicaError, ReplicaStatus, Sequencer};
use crate::search::{Location, ProbeView, Prober, SearchScratch, search};

pub use crate::exact::ExactIndex;

/// Default number of positions verified below each depth.
pub const DEFAULT_VERIFICATION_WINDOW: u32 = 2;

/// Largest accepted verification window.
pub const MAX_VERIFICATION_WINDOW: u32 = 8;

/// Answers "how many leading blocks of this request does each pool hold".
pub trait PrefixQuery {
    /// Pools (lanes) the answer has one entry for.
    fn n_pools(&self) -> usize;

    /// Fills `out` with each pool's matched prefix depth for the request's canonical
    /// sequence hashes (`kvrelay_identity::sequence_hashes` of its block hashes).
    fn prefix_depths_into(&self, sequence_hashes: &[u64], out: &mut PrefixDepths);

    /// Allocating form of [`PrefixQuery::prefix_depths_into`].
    fn prefix_depths(&self, sequence_hashes: &[u64]) -> PrefixDepths {
        let mut out = PrefixDepths::default();
        self.prefix_depths_into(sequence_hashes, &mut out);
        out
    }
}

/// Per pool, the matched prefix depth in blocks (`None`: the pool's lane is not ready).
/// Reuse one value across queries to avoid allocating.
#[derive(Debug, Clone, Default)]
pub struct PrefixDepths {
    pub(crate) depths: Vec<Option<u32>>,
    pub(crate) scratch: SearchScratch,
}

impl PrefixDepths {
    /// Depth per pool, indexed by lane.
    pub fn depths(&self) -> &[Option<u32>] {
        &self.depths
    }

    /// Depth of one pool.
    pub fn depth(&self, pool: usize) -> Option<u32> {
        self.depths.get(pool).copied().flatten()
    }

    /// Positions probed by the last query (filter probes, or exact lookups per pool).
    pub fn n_probes(&self) -> u32 {
        self.scratch.n_probes
    }
}

/// Query table settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryConfig {
    /// Positions re-checked below each depth, `1..=MAX_VERIFICATION_WINDOW`.
    pub verification_window: u32,
    /// Ask Linux to back the rows with transparent huge pages (`madvise(MADV_HUGEPAGE)`
    /// on every rows allocation of 2 MiB or more, before it is first touched). A probe
    /// then rarely misses the TLB; the system's setting still decides (`never` turns
    /// it off for every program). No effect on other systems.
    pub huge_pages: bool,
}

impl Default for QueryConfig {
    fn default() -> Self {
        Self {
            verification_window: DEFAULT_VERIFICATION_WINDOW,
            huge_pages: true,
        }
    }
}

/// Why a query table could not be built or grown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QueryConfigError {
    /// The verification window is outside `1..=MAX_VERIFICATION_WINDOW`.
    #[error("verification window {window} is outside 1..={MAX_VERIFICATION_WINDOW}")]
    InvalidVerificationWindow {
        /// The rejected window.
        window: u32,
    },
    /// An allocation failed; the table is unchanged.
    #[error(transparent)]
    Allocation(#[from] ConfigError),
}

/// Replicas of many pools (one lane each, one shared format), laid out bucket-major.
///
/// Queries and delta applies share the table: [`QueryTable::apply_delta`] takes `&self`,
/// so a caller holding a shared lock applies while queries go on, and a query never
/// waits for an apply to finish. Each probe still reads a hash's two rows as they stood
/// before or after every delta, never between (a fingerprint a delta moves from one of
/// its rows to the other is always found): rows are guarded by striped sequence counters
/// that a delta holds odd while it writes, and a probe that overlapped such a write reads
/// its two rows again. Different probes of one query may see a concurrent delta on
/// different sides of it.
///
/// ```
/// use kvrelay_ckf::{CkfConfig, PoolFilter, PrefixQuery, QueryConfig, QueryTable};
/// let producer = PoolFilter::new(CkfConfig::new(64))?;
/// let mut table = QueryTable::new(producer.format(), QueryConfig::default())?;
/// let lane = table.add_lane()?;
/// assert_eq!(table.prefix_depths(&[11, 12]).depth(lane), None); // no snapshot yet
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct QueryTable {
    format: CkfFormat,
    addressing: Addressing,
    window: u32,
    /// [`QueryConfig::huge_pages`].
    advise_huge_pages: bool,
    /// The kernel accepted the huge-page advice for the current rows.
    rows_advised: bool,
    stride: usize,
    /// Bucket rows plus up to `ROW_ALIGN_WORDS - 1` words of padding; the rows start at
    /// `offset`, the first 64-byte boundary of the allocation, so a row of up to 8 lanes is
    /// one cache line and a row of 16 lanes two (never three). Atomic so that deltas are
    /// written while queries read (relaxed loads and stores: plain moves on x86-64).
    words: Vec<AtomicU64>,
    offset: usize,
    /// Row `r` is guarded by `stripes[r & stripe_mask]` (see [`StripeWrite`]).
    stripes: Box<[AtomicU64]>,
    stripe_mask: usize,
    /// Odd while any delta is being written (see [`StripeWrite`]).
    writing: WriteCounter,
    /// Each lane's stream state; locked by an apply only for its sequence check (never
    /// while words are written), by a status read only to copy it.
    lanes: Vec<Mutex<Lane>>,
    /// One bit per lane whose sequencer is ready (kept in step with `lanes`).
    ready: Vec<AtomicU64>,
    /// Bumped by every change to `words` (and by growth), so rows laid out from an
    /// earlier state are recognised as stale ([`GrownRows`]).
    revision: AtomicU64,
    /// Held by every shared-path writer (a delta apply, a growth's copy): the stripes
    /// protocol allows one writer at a time.
    writer: Mutex<()>,
}

/// A table's rows laid out at the next stride, built from `&QueryTable` (see
/// [`QueryTable::prepare_growth`]) so the copy can run while readers still probe the
/// table; [`QueryTable::add_lane_prepared`] then only swaps them in (and hands back the
/// old rows, to be freed outside the caller's lock).
#[derive(Debug)]
pub struct GrownRows {
    words: Vec<AtomicU64>,
    offset: usize,
    stride: usize,
    /// The kernel accepted the huge-page advice for `words`.
    advised: bool,
    /// The table's stride and revision the rows were copied at.
    from_stride: usize,
    from_revision: u64,
}

impl GrownRows {
    /// Bytes the rows hold.
    pub fn bytes(&self) -> u64 {
        self.words.len() as u64 * 8
    }
}

/// One lane's stream state, and whether a query may be reading its words.
#[derive(Debug)]
struct Lane {
    sequencer: Sequencer,
    /// The lane was ready at some point since the last change made with `&mut` (which no
    /// query overlaps): a query that saw it ready may still be reading it, so a snapshot
    /// chunk may not be written beside queries.
    readable: bool,
}

impl Lane {
    fn new(bucket_count: u64) -> Mutex<Self> {
        Mutex::new(Self {
            sequencer: Sequencer::new(bucket_count),
            readable: false,
        })
    }
}

/// Words per 64-byte cache line.
const ROW_ALIGN_WORDS: usize = 8;

/// The lanes of one cache line, as a lane mask.
const LINE_LANES: u64 = (1 << ROW_ALIGN_WORDS) - 1;

/// A sequence counter on a cache line of its own: probes read it on every call, so it
/// must not share a line with anything written more often than it is.
#[derive(Debug, Default)]
#[repr(align(64))]
struct WriteCounter(AtomicU64);

/// Most row stripes a table keeps (512 KiB of counters). With more stripes a probe
/// meets a running delta less often (a delta of `k` images holds about `k` stripes odd);
/// with fewer the counters stay in a nearer cache.
const MAX_STRIPES: usize = 1 << 16;

/// Spins a reader makes on a stripe a writer holds before it yields its thread (a
/// writer holds a stripe only while storing one delta's words).
const SPINS_BEFORE_YIELD: u32 = 64;

/// Words a table of `bucket_count` rows of `stride` lanes allocates (alignment padding
/// included).
fn table_words(bucket_count: usize, stride: usize) -> usize {
    bucket_count
        .saturating_mul(stride)
        .saturating_add(ROW_ALIGN_WORDS - 1)
}

/// One delta's hold on the table: the write counter and the stripes of every row it
/// writes are odd from [`StripeWrite::begin`] until drop. A probe that saw the write
/// counter even and unchanged around its read overlapped no write (the common case: one
/// read of a line no write shares); otherwise it checks its two rows' stripes the same
/// way and reads again while one was odd or moved. Only one `StripeWrite` exists at a
/// time (the table's writer lock), so plain loads and stores count: a stripe already odd
/// is one this write holds (two images in one stripe), and is ended once.
struct StripeWrite<'a> {
    writing: &'a AtomicU64,
    stripes: &'a [AtomicU64],
    mask: usize,
    rows: &'a [BucketImage],
}

impl<'a> StripeWrite<'a> {
    fn begin(
        writing: &'a AtomicU64,
        stripes: &'a [AtomicU64],
        mask: usize,
        rows: &'a [BucketImage],
    ) -> Self {
        let version = writing.load(Ordering::Relaxed);
        writing.store(version | 1, Ordering::Relaxed);
        for image in rows {
            if let Some(stripe) = stripes.get(image.bucket_idx as usize & mask) {
                let version = stripe.load(Ordering::Relaxed);
                if version & 1 == 0 {
                    stripe.store(version.wrapping_add(1), Ordering::Relaxed);
                }
            }
        }
        // The odd counters are visible before any word this write stores (a reader
        // that sees a new word then sees its stripe changed).
        fence(Ordering::Release);
        Self {
            writing,
            stripes,
            mask,
            rows,
        }
    }
}

impl Drop for StripeWrite<'_> {
    /// Ends the write (also on unwind, so no stripe stays odd and no reader spins on it).
    fn drop(&mut self) {
        for image in self.rows {
            if let Some(stripe) = self.stripes.get(image.bucket_idx as usize & self.mask) {
                let version = stripe.load(Ordering::Relaxed);
                if version & 1 == 1 {
                    stripe.store(version.wrapping_add(1), Ordering::Release);
                }
            }
        }
        let version = self.writing.load(Ordering::Relaxed);
        self.writing
            .store((version | 1).wrapping_add(1), Ordering::Release);
    }
}

impl QueryTable {
    /// An empty table (no lanes) for `format`.
    pub fn new(format: CkfFormat, config: QueryConfig) -> Result<Self, QueryConfigError> {
        let window = config.verification_window;
        if !(1..=MAX_VERIFICATION_WINDOW).contains(&window) {
            return Err(QueryConfigError::InvalidVerificationWindow { window });
        }
        let n_stripes = (format.bucket_count() as usize)
            .next_power_of_two()
            .min(MAX_STRIPES);
        let (stripes, _) = zeroed_words(n_stripes, "query table stripes", false)?;
        Ok(Self {
            format,
            addressing: Addressing::new(format),
            window,
            advise_huge_pages: config.huge_pages,
            rows_advised: false,
            stride: 0,
            words: Vec::new(),
            offset: 0,
            stripes: stripes.into_boxed_slice(),
            stripe_mask: n_stripes - 1,
            writing: WriteCounter::default(),
            lanes: Vec::new(),
            ready: Vec::new(),
            revision: AtomicU64::new(0),
            writer: Mutex::new(()),
        })
    }

    /// Whether the kernel accepted [`QueryConfig::huge_pages`]'s advice for the current
    /// rows (false when not asked, below 2 MiB, or not on Linux); the system's setting
    /// and its free huge pages decide what the rows get (docs/ckf.md, "Huge pages").
    pub fn huge_pages_advised(&self) -> bool {
        self.rows_advised
    }

    /// Positions re-checked below each depth ([`QueryConfig::verification_window`]).
    pub fn verification_window(&self) -> u32 {
        self.window
    }

    /// The shared format of every lane.
    pub fn format(&self) -> CkfFormat {
        self.format
    }

    /// Lanes in the table.
    pub fn n_lanes(&self) -> usize {
        self.lanes.len()
    }

    /// Bytes the next [`QueryTable::add_lane`] allocates: 0 while the stride has a spare
    /// lane, else the whole grown table (the next stride), which is held next to the old
    /// one until the re-layout is done. A caller with a memory budget checks this first.
    pub fn add_lane_bytes(&self) -> u64 {
        if self.lanes.len() < self.stride {
            return 0;
        }
        let words = table_words(self.format.bucket_count() as usize, self.next_stride());
        (words as u64).saturating_mul(8)
    }

    /// Adds an empty lane and returns its index. Grows the row stride (the next stride, fallible
    /// allocation, re-layout) when full; on `Err` the table is unchanged.
    pub fn add_lane(&mut self) -> Result<usize, QueryConfigError> {
        self.add_lane_prepared(None)
    }

    /// The rows the next [`QueryTable::add_lane`] would lay out, built without changing
    /// the table (`None` while the stride has a spare lane). Holding only `&self`, a
    /// caller can copy under a shared lock while queries go on, then pass the rows to
    /// [`QueryTable::add_lane_prepared`] under the exclusive one. Delta applies wait for
    /// the copy; one applied after it makes the rows stale.
    pub fn prepare_growth(&self) -> Result<Option<GrownRows>, QueryConfigError> {
        if self.lanes.len() < self.stride {
            return Ok(None);
        }
        let _writer = self.writer.lock();
        Ok(Some(self.grown_rows()?))
    }

    /// [`QueryTable::add_lane`] using `prepared` rows when they were built from the
    /// table as it is now (same stride, no write since): they are swapped with the
    /// table's old rows, which `prepared` then holds, so the caller frees them after
    /// releasing its lock. Stale or missing rows are left alone and the table grows
    /// itself. On `Err` the table is unchanged.
    pub fn add_lane_prepared(
        &mut self,
        prepared: Option<&mut GrownRows>,
    ) -> Result<usize, QueryConfigError> {
        if self.lanes.len() == self.stride {
            let revision = *self.revision.get_mut();
            let current = prepared
                .filter(|rows| rows.from_stride == self.stride && rows.from_revision == revision);
            // Without current rows the table lays them out itself (its old rows are then
            // freed here, with `fresh`).
            let mut fresh;
            let rows = match current {
                Some(rows) => rows,
                None => {
                    fresh = self.grown_rows()?;
                    &mut fresh
                }
            };
            std::mem::swap(&mut self.words, &mut rows.words);
            std::mem::swap(&mut self.offset, &mut rows.offset);
            std::mem::swap(&mut self.stride, &mut rows.stride);
            std::mem::swap(&mut self.rows_advised, &mut rows.advised);
            // Retired: never swapped in again.
            rows.from_stride = usize::MAX;
            self.bump_revision();
        }
        if self.ready.len() * 64 == self.lanes.len() {
            self.ready
                .try_reserve(1)
                .map_err(|_| ConfigError::AllocationFailed {
                    what: "query lane mask",
                    bytes: 8,
                })?;
            self.ready.push(AtomicU64::new(0));
        }
        self.lanes
            .push(Lane::new(u64::from(self.format.bucket_count())));
        Ok(self.lanes.len() - 1)
    }

    /// Installs one snapshot chunk into `lane`; `true` when the snapshot is complete.
    /// While assembling, the lane answers nothing.
    pub fn install_chunk(
        &mut self,
        lane: usize,
        chunk: &SnapshotChunk,
    ) -> Result<bool, ReplicaError> {
        // No query overlaps `&mut self`: none is reading the lane, so the chunk goes in
        // beside queries (`None` cannot come back once `readable` is cleared).
        if let Some(state) = self.lanes.get_mut(lane) {
            state.get_mut().readable = false;
        }
        let n_lanes = self.lanes.len();
        self.install_chunk_beside_queries(lane, chunk)
            .unwrap_or(Err(ReplicaError::UnknownLane { lane, n_lanes }))
    }

    /// [`QueryTable::install_chunk`] beside queries (`&self`), when no query can be
    /// reading `lane`: it has not been ready since it was last reset (or given a chunk)
    /// with `&mut`, so no query saw it ready. Its words are then written while queries
    /// of the other lanes go on, and it turns ready (a query sees it whole) once its last
    /// chunk is written. `None` otherwise: a chunk for a lane that answered queries (a new
    /// snapshot over an installed one) needs [`QueryTable::install_chunk`]. Runs one at a
    /// time with applies (the writer lock).
    pub fn install_chunk_beside_queries(
        &self,
        lane: usize,
        chunk: &SnapshotChunk,
    ) -> Option<Result<bool, ReplicaError>> {
        let _writer = self.writer.lock();
        let accepted = match self.lane(lane) {
            Err(err) => return Some(Err(err)),
            Ok(state) => {
                let mut state = state.lock();
                if state.readable {
                    return None;
                }
                state.sequencer.accept_chunk(chunk)
            }
        };
        let complete = match accepted {
            Ok(complete) => complete,
            Err(err) => {
                self.refresh_ready(lane);
                return Some(Err(err));
            }
        };
        self.bump_revision();
        let first = chunk.first_bucket as usize;
        let base = self.offset + lane;
        for (offset, &word) in chunk.words.iter().enumerate() {
            if let Some(slot) = self.words.get(base + (first + offset) * self.stride) {
                slot.store(word, Ordering::Relaxed);
            }
        }
        // After the words: a query that sees the lane ready sees them all.
        self.refresh_ready(lane);
        Some(Ok(complete))
    }

    /// Applies a delta to `lane` whole, strictly in sequence; any error leaves the lane
    /// invalid (it answers nothing) until a new snapshot. Runs beside queries (`&self`):
    /// their probes read each pair of rows before or after the delta, never between.
    /// Applies, and a [`QueryTable::prepare_growth`] copy, run one at a time.
    pub fn apply_delta(&self, lane: usize, delta: &Delta) -> Result<(), ReplicaError> {
        let _writer = self.writer.lock();
        let accepted = self.lane(lane)?.lock().sequencer.accept_delta(delta);
        self.refresh_ready(lane);
        accepted?;
        // The rows (and their stripes) are brought into cache first, so the stripes are
        // held odd for about one memory latency, not one miss per image.
        for image in &delta.images {
            let row = image.bucket_idx as usize;
            prefetch_element(&self.words, self.offset + row * self.stride + lane);
            prefetch_element(&self.stripes, row & self.stripe_mask);
        }
        self.bump_revision();
        let _held = StripeWrite::begin(
            &self.writing.0,
            &self.stripes,
            self.stripe_mask,
            &delta.images,
        );
        let base = self.offset + lane;
        for image in &delta.images {
            // In range: the sequencer checked every bucket index against the format.
            if let Some(slot) = self
                .words
                .get(base + image.bucket_idx as usize * self.stride)
            {
                slot.store(image.word, Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Returns `lane` to empty (for example when its pool went away). Constant time: its
    /// words are left as they are, since a lane answers nothing until a whole snapshot
    /// has rewritten every one of its buckets (zeroing a lane of a large table is a
    /// strided pass over all of it, tens of milliseconds under the caller's lock).
    pub fn reset_lane(&mut self, lane: usize) -> Result<(), ReplicaError> {
        let n_lanes = self.lanes.len();
        let state = self
            .lanes
            .get_mut(lane)
            .ok_or(ReplicaError::UnknownLane { lane, n_lanes })?
            .get_mut();
        state.sequencer.reset();
        state.readable = false;
        self.refresh_ready(lane);
        Ok(())
    }

    /// Where `lane` stands.
    pub fn lane_status(&self, lane: usize) -> Option<ReplicaStatus> {
        self.lanes
            .get(lane)
            .map(|state| state.lock().sequencer.status())
    }

    /// Whether `lane` answers queries (its snapshot is installed and no check failed);
    /// reads one word, no lock.
    pub fn lane_ready(&self, lane: usize) -> bool {
        self.ready_lanes(lane / 64) & (1 << (lane % 64)) != 0
    }

    /// Bytes of bucket words held (all lanes, including spare stride).
    pub fn table_bytes(&self) -> u64 {
        self.words.len() as u64 * 8
    }

    fn lane(&self, lane: usize) -> Result<&Mutex<Lane>, ReplicaError> {
        let n_lanes = self.lanes.len();
        self.lanes
            .get(lane)
            .ok_or(ReplicaError::UnknownLane { lane, n_lanes })
    }

    /// Marks rows prepared before now as stale (see [`GrownRows`]).
    fn bump_revision(&self) {
        self.revision.fetch_add(1, Ordering::Relaxed);
    }

    /// The bucket rows (`bucket_count * stride` words), starting on a cache line.
    fn rows(&self) -> &[AtomicU64] {
        let len = self.format.bucket_count() as usize * self.stride;
        &self.words[self.offset..self.offset + len]
    }

    /// Copies `lane`'s readiness into the lane mask (Release: a query that sees the lane
    /// ready sees the words written before), and notes a ready lane as readable.
    fn refresh_ready(&self, lane: usize) {
        let ready = self.lanes.get(lane).is_some_and(|state| {
            let mut state = state.lock();
            let ready = state.sequencer.is_ready();
            state.readable |= ready;
            ready
        });
        if let Some(word) = self.ready.get(lane / 64) {
            let bit = 1u64 << (lane % 64);
            if ready {
                word.fetch_or(bit, Ordering::Release);
            } else {
                word.fetch_and(!bit, Ordering::Release);
            }
        }
    }

    /// The stride a growth moves to: from one lane, doubling up to a cache line's
    /// worth (8 lanes: rows of 1, 2 or 4 lanes share lines), then a line more per growth
    /// up to 64 lanes (a fleet of 40 DCs holds a stride of 40, not 64), then a quarter
    /// more, rounded to lines (so a table of many lanes grows a few times, not every 8).
    /// Every stride from 8 on is whole lines, so rows start on a line boundary.
    fn next_stride(&self) -> usize {
        match self.stride {
            0 => 1,
            s if s < ROW_ALIGN_WORDS => s * 2,
            s if s < 64 => s + ROW_ALIGN_WORDS,
            s => (s + s / 4).next_multiple_of(ROW_ALIGN_WORDS),
        }
    }

    /// This table's rows copied into a new allocation at the next stride. A caller
    /// holding only `&self` holds the writer lock, so no delta lands mid-copy.
    fn grown_rows(&self) -> Result<GrownRows, ConfigError> {
        // From one lane up: a table of one pool holds exactly that pool's words (a first
        // stride of 4 made one 2^24-bucket pool take 512 MiB, four times what a
        // consumer's replica budget counts for it).
        let new_stride = self.next_stride();
        let bucket_count = self.format.bucket_count() as usize;
        let n_words = table_words(bucket_count, new_stride);
        let (words, advised) = zeroed_words(n_words, "query table", self.advise_huge_pages)?;
        // The allocation never moves after this (no pushes), so the offset stays valid.
        let misalignment = (words.as_ptr() as usize / 8) % ROW_ALIGN_WORDS;
        let offset = (ROW_ALIGN_WORDS - misalignment) % ROW_ALIGN_WORDS;
        if self.stride > 0 {
            let old_rows = self.rows();
            let new_rows = &words[offset..offset + bucket_count * new_stride];
            for (new_row, old_row) in new_rows
                .chunks_exact(new_stride)
                .zip(old_rows.chunks_exact(self.stride))
            {
                for (new, old) in new_row.iter().zip(old_row) {
                    new.store(old.load(Ordering::Relaxed), Ordering::Relaxed);
                }
            }
        }
        Ok(GrownRows {
            words,
            offset,
            stride: new_stride,
            advised,
            from_stride: self.stride,
            from_revision: self.revision.load(Ordering::Relaxed),
        })
    }
}

impl Prober for QueryTable {
    type Location = Location;
    type View<'a> = RowView<'a>;

    fn n_lanes(&self) -> usize {
        self.lanes.len()
    }

    fn ready_lanes(&self, group: usize) -> u64 {
        self.ready
            .get(group)
            .map_or(0, |word| word.load(Ordering::Acquire))
    }

    #[inline]
    fn view(&self) -> RowView<'_> {
        RowView {
            words: &self.words,
            writing: &self.writing.0,
            stripes: &self.stripes,
            stripe_mask: self.stripe_mask,
            addressing: self.addressing,
            offset: self.offset,
            stride: self.stride,
        }
    }
}

/// A [`QueryTable`]'s words with its addressing and layout (see [`Prober::view`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowView<'a> {
    words: &'a [AtomicU64],
    writing: &'a AtomicU64,
    stripes: &'a [AtomicU64],
    stripe_mask: usize,
    addressing: Addressing,
    offset: usize,
    stride: usize,
}

impl ProbeView for RowView<'_> {
    type Location = Location;

    /// The fingerprint pattern and the first words of both candidate rows.
    #[inline]
    fn locate(&self, hash: u64) -> Location {
        let address = self.addressing.address(hash);
        Location {
            key: bucket::fingerprint_pattern(address.fingerprint),
            first: self.offset + address.primary as usize * self.stride,
            second: self.offset + address.alternate as usize * self.stride,
        }
    }

    #[inline]
    fn prefetch(&self, location: &Location, group: usize, lanes: u64) {
        let first = group * 64;
        // Every cache line holding one of `lanes`, in both rows (rows start on a line
        // boundary).
        let mut lines = lanes;
        while lines != 0 {
            let line = first + (lines.trailing_zeros() as usize & !(ROW_ALIGN_WORDS - 1));
            prefetch_element(self.words, location.first + line);
            prefetch_element(self.words, location.second + line);
            lines &= !(LINE_LANES << (line - first));
        }
    }

    /// Lines holding one of `lanes` (rows start on a line boundary, as does every group).
    #[inline]
    fn lines_per_row(&self, _group: usize, lanes: u64) -> u32 {
        (0..8)
            .map(|line| u32::from((lanes >> (line * 8)) & 0xFF != 0))
            .sum()
    }

    /// Tests only the asked lanes (the search asks for the few lanes a decision needs),
    /// reading both rows again while a delta writing either of them runs.
    #[inline]
    fn probe(&self, location: &Location, group: usize, lanes: u64) -> u64 {
        let before = self.writing.load(Ordering::Acquire);
        if before & 1 == 0 {
            let bits = self.read_lanes(location, group, lanes);
            fence(Ordering::Acquire);
            if self.writing.load(Ordering::Relaxed) == before {
                return bits;
            }
        }
        self.probe_beside_a_write(location, group, lanes)
    }
}

impl RowView<'_> {
    /// [`ProbeView::probe`] when a delta was being written: only the two rows' own
    /// stripes are checked (a delta of `k` images holds about `k` of up to 2^16).
    #[cold]
    fn probe_beside_a_write(&self, location: &Location, group: usize, lanes: u64) -> u64 {
        let (first_stripe, second_stripe) = self.stripes_of(location);
        let (Some(first_guard), Some(second_guard)) = (
            self.stripes.get(first_stripe),
            self.stripes.get(second_stripe),
        ) else {
            return 0;
        };
        let mut spins = 0u32;
        loop {
            let before = (
                first_guard.load(Ordering::Acquire),
                second_guard.load(Ordering::Acquire),
            );
            if (before.0 | before.1) & 1 == 0 {
                let bits = self.read_lanes(location, group, lanes);
                // The words' loads happen before the counters are read again: a write
                // that changed a word read above shows as a changed counter.
                fence(Ordering::Acquire);
                if first_guard.load(Ordering::Relaxed) == before.0
                    && second_guard.load(Ordering::Relaxed) == before.1
                {
                    return bits;
                }
            }
            // A delta is writing one of these rows: it holds the stripe only while it
            // stores its words (no lock, allocation or I/O in between), so this ends.
            spins += 1;
            if spins < SPINS_BEFORE_YIELD {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }

    /// The stripes guarding `location`'s two rows.
    #[inline]
    fn stripes_of(&self, location: &Location) -> (usize, usize) {
        // A division, not a shift: strides are whole lines, not powers of two. Only a
        // probe beside a delta's write and the writer itself take this path.
        let row = |start: usize| start.wrapping_sub(self.offset) / self.stride.max(1);
        (
            row(location.first) & self.stripe_mask,
            row(location.second) & self.stripe_mask,
        )
    }

    /// Which of `lanes` hold `location`, from one read of each asked word.
    #[inline]
    fn read_lanes(&self, location: &Location, group: usize, lanes: u64) -> u64 {
        let first = group * 64;
        let window = |start: usize| {
            self.words
                .get(start + first..)
                .and_then(<[AtomicU64]>::first_chunk::<64>)
        };
        // `lanes` are lanes of the table, so within the stride: a 64-word window from the
        // group's first word never reaches past the row for them. Only the last rows lack
        // such a window in the allocation.
        let (Some(row_a), Some(row_b)) = (window(location.first), window(location.second)) else {
            return self.read_lanes_near_end(location, first, lanes);
        };
        let mut bits = 0u64;
        let mut rest = lanes;
        while rest != 0 {
            let lane = rest.trailing_zeros() as usize % 64;
            rest &= rest - 1;
            let holds = bucket::matches_pattern(row_a[lane].load(Ordering::Relaxed), location.key)
                | bucket::matches_pattern(row_b[lane].load(Ordering::Relaxed), location.key);
            bits |= u64::from(holds) << lane;
        }
        bits
    }

    /// [`RowView::read_lanes`] for rows within 64 words of the allocation's end.
    #[cold]
    fn read_lanes_near_end(&self, location: &Location, first: usize, lanes: u64) -> u64 {
        let width = self.stride.saturating_sub(first).min(64);
        let (Some(row_a), Some(row_b)) = (
            self.words
                .get(location.first + first..location.first + first + width),
            self.words
                .get(location.second + first..location.second + first + width),
        ) else {
            return 0;
        };
        let mut bits = 0u64;
        let mut rest = lanes;
        while rest != 0 {
            let lane = rest.trailing_zeros() as usize;
            rest &= rest - 1;
            if let (Some(a), Some(b)) = (row_a.get(lane), row_b.get(lane)) {
                let holds = bucket::matches_pattern(a.load(Ordering::Relaxed), location.key)
                    | bucket::matches_pattern(b.load(Ordering::Relaxed), location.key);
                bits |= u64::from(holds) << lane;
            }
        }
        bits
    }
}

impl PrefixQuery for QueryTable {
    fn n_pools(&self) -> usize {
        self.lanes.len()
    }

    fn prefix_depths_into(&self, sequence_hashes: &[u64], out: &mut PrefixDepths) {
        search(
            self,
            sequence_hashes,
            self.window,
            &mut out.scratch,
            &mut out.depths,
        );
    }
}
