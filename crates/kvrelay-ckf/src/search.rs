//! The prefix search: per pool, how many leading positions of a request are present,
//! with probes shared across pools and issued in batches.
//!
//! Presence is assumed to be prefix-monotone (a block is only cached with its parents), so
//! each pool's depth is the first missing position. Lanes are searched in groups of 64,
//! each group as sets of lanes (`u64` bit masks) that share a bracket: a [`Bracket`] says
//! its lanes' depth lies in `lo..=hi`, where position `lo - 1` was probed present (or
//! `lo == 0`) and position `hi` was probed absent (or `hi` is the request length). Every
//! step is a handful of mask operations, whatever the number of lanes in a group, and the
//! work runs in rounds whose probes are issued as one batch (each position's address, then
//! the prefetch of its rows), so a round costs about one memory latency, not one per probe.
//! A probed lane's words are read only when a decision first needs them, and each
//! (position, lane) answer is read once and kept, so the search decides from one fixed
//! answer per probe even while deltas are applied beside it (each answer is the table's
//! before or after any one delta; lanes that left the search are never read):
//!
//! 1. gallop: probe positions 0, 1, 3, 7, …, 2^k − 1 and the last `window` positions in one
//!    batch; the lanes that miss first at a gallop position form one bracket. A group
//!    whose ready lanes span more than [`STAGED_GALLOP_LINES`] cache lines per row probes
//!    position 0 alone first and gallops only with the lanes holding it (one more round
//!    trip, far fewer lines fetched);
//! 2. refine: `FANOUT`-ary rounds; each round probes `FANOUT − 1` split points of every open
//!    bracket and splits its lanes by where they first miss. A bracket that this round
//!    resolves completely also probes the `window` positions below it, so its lanes are
//!    verified in the same pass and verification usually costs no round of its own;
//! 3. verify: the `window` positions just below each depth must be present; a miss there
//!    shows the bracket rested on a false positive (or a capacity hole), so those lanes
//!    get the bracket `[1 + last probed hit below the miss, miss]` and are refined again.
//!
//! A reported depth `d > 0` always has position `d − 1` probed as present for that lane,
//! and the `window` positions below it too. Every loop is bounded: each refine round
//! shrinks every open bracket to about `1 / FANOUT`, and each failed verification strictly
//! lowers those lanes' `hi`.

/// Scratch buffers reused across searches (`L`: where its prober locates a hash).
#[derive(Debug, Clone, Default)]
pub(crate) struct SearchScratch<L = Location> {
    /// Per position, what this search knows about it (see [`PositionState`]). The lane
    /// masks of every position outside `touched` are zero.
    positions: Vec<PositionState<L>>,
    /// Counts searches over the scratch's life, so stale locations are told apart without
    /// clearing them.
    epoch: u32,
    /// Every position queued by the current group, in queue order; those from
    /// `batch_start` on are queued for the next batch. Their lane masks are cleared when
    /// the next group starts.
    touched: Vec<u32>,
    batch_start: usize,
    open: Vec<Bracket>,
    next: Vec<Bracket>,
    /// Resolved brackets (`lo == hi`) waiting for verification.
    resolved: Vec<Bracket>,
    pub(crate) n_probes: u32,
}

/// What the search knows about one position. A probe fetches the memory of its lanes
/// (prefetch); their words are read only when a decision needs them, and kept.
#[derive(Debug, Clone, Copy, Default)]
struct PositionState<L> {
    /// Where the position's hash lives; valid when `located_epoch == epoch`.
    location: L,
    located_epoch: u32,
    /// Lanes of the current group probed here so far.
    probed: u64,
    /// Lanes queued for the next batch (never among `probed`).
    queued: u64,
    /// Lanes among `probed` whose words were read.
    read: u64,
    /// Lanes among `read` holding the position.
    present: u64,
}

/// Where a hash lives, as its prober computed it once per search: a key to compare and
/// the word offsets of its two candidate places.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Location {
    pub(crate) key: u64,
    pub(crate) first: usize,
    pub(crate) second: usize,
}

/// Lanes whose depth lies in `lo..=hi` (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Bracket {
    lo: u32,
    hi: u32,
    lanes: u64,
}

/// The per-position presence oracle, answering for 64 lanes (one group) at a time.
pub(crate) trait Prober {
    /// Where a hash lives for this prober, computed once per position and search.
    type Location: Copy + Default;
    /// What locating, prefetching and probing need, copied out once per search so that
    /// the search's loops keep it in registers instead of reloading it through a pointer.
    type View<'a>: ProbeView<Location = Self::Location>
    where
        Self: 'a;
    fn n_lanes(&self) -> usize;
    /// Ready lanes of `group` (lane `64 * group + i` is bit `i`).
    fn ready_lanes(&self, group: usize) -> u64;
    fn view(&self) -> Self::View<'_>;
}

/// Locates, prefetches and probes positions (see [`Prober::view`]).
pub(crate) trait ProbeView: Copy {
    /// Where a hash lives (see [`Prober::Location`]).
    type Location: Copy + Default;
    /// Where `hash` lives (computed once per position and search, before any memory is
    /// touched).
    fn locate(&self, hash: u64) -> Self::Location;
    /// Hints that `probe` will read the memory of `lanes` of `group` at `location` (so a
    /// batch's cache misses are all in flight before the first read waits).
    fn prefetch(&self, location: &Self::Location, group: usize, lanes: u64);
    /// Which of `lanes` (ready lanes of `group`) hold `location`; bits outside `lanes`
    /// may be set and are ignored.
    fn probe(&self, location: &Self::Location, group: usize, lanes: u64) -> u64;
    /// Cache lines a probe of `lanes` of `group` reads in each candidate row: by default
    /// lanes packed eight to a line.
    fn lines_per_row(&self, _group: usize, lanes: u64) -> u32 {
        lanes.count_ones().div_ceil(8)
    }
}

/// Runs the search over `hashes`; writes each lane's depth (`None` when not ready).
pub(crate) fn search<P: Prober>(
    prober: &P,
    hashes: &[u64],
    window: u32,
    scratch: &mut SearchScratch<P::Location>,
    depths: &mut Vec<Option<u32>>,
) {
    let n_lanes = prober.n_lanes();
    depths.clear();
    depths.resize(n_lanes, None);
    scratch.n_probes = 0;
    let n = u32::try_from(hashes.len()).unwrap_or(u32::MAX);
    let hashes = &hashes[..n as usize];
    if scratch.positions.len() < hashes.len() {
        scratch
            .positions
            .resize(hashes.len(), PositionState::default());
    }
    let n_groups = n_lanes.div_ceil(64);
    let view = prober.view();
    if scratch.epoch == u32::MAX {
        // Once in 2^32 searches: restart the epochs, forgetting every location.
        for state in &mut scratch.positions {
            state.located_epoch = 0;
        }
        scratch.epoch = 0;
    }
    scratch.epoch += 1;
    for group in 0..n_groups {
        let ready = prober.ready_lanes(group);
        if ready == 0 {
            continue;
        }
        let mut search = GroupSearch {
            view,
            group,
            hashes,
            window,
            scratch: &mut *scratch,
        };
        search.run(ready, &mut |lanes, depth| {
            let base = group * 64;
            let mut rest = lanes;
            while rest != 0 {
                let lane = base + rest.trailing_zeros() as usize;
                rest &= rest - 1;
                if let Some(slot) = depths.get_mut(lane) {
                    *slot = Some(depth);
                }
            }
        });
    }
}

/// Points probed per open bracket and round, plus one: each round cuts every bracket into
/// `FANOUT` parts. Wider rounds cost more probes but fewer dependent memory round trips.
const FANOUT: u32 = 4;

/// Cache lines per row ([`ProbeView::lines_per_row`]) of a group's ready lanes above
/// which the gallop probes position 0 alone first, and the rest of its positions only for
/// the lanes holding it. Fetching up to two lines per row at every gallop position costs
/// less than the extra round trip; past it (more than 16 lanes of one table, or lanes of
/// several tables in a joint search), one round trip saves the lines of every lane that
/// misses the first block.
const STAGED_GALLOP_LINES: u32 = 2;

/// The `FANOUT - 1` split points of `lo..hi`, which cut it into `FANOUT` parts; strictly
/// increasing and in `lo + 1..hi` when `hi - lo >= FANOUT`.
fn split_points(lo: u32, hi: u32) -> [u32; FANOUT as usize - 1] {
    let span = u64::from(hi - lo);
    // span * j / FANOUT < span, so every point stays below hi.
    std::array::from_fn(|i| lo + (span * (i as u64 + 1) / u64::from(FANOUT)) as u32)
}

struct GroupSearch<'a, V: ProbeView> {
    view: V,
    group: usize,
    hashes: &'a [u64],
    window: u32,
    scratch: &'a mut SearchScratch<V::Location>,
}

impl<V: ProbeView> GroupSearch<'_, V> {
    /// Searches the `ready` lanes; reports `(lanes, depth)` for every verified set.
    fn run(&mut self, ready: u64, report: &mut impl FnMut(u64, u32)) {
        let s = &mut *self.scratch;
        s.open.clear();
        s.next.clear();
        s.resolved.clear();
        for &position in &s.touched {
            if let Some(state) = s.positions.get_mut(position as usize) {
                state.probed = 0;
                state.queued = 0;
                state.read = 0;
                state.present = 0;
            }
        }
        s.touched.clear();
        s.batch_start = 0;
        let n = self.hashes.len() as u32;
        if n == 0 {
            report(ready, 0);
            return;
        }
        self.gallop(ready, n);
        loop {
            self.refine(report);
            if !self.verify(report) {
                return;
            }
        }
    }

    /// Queues `position` for those of `lanes` not probed there yet.
    fn queue(&mut self, position: u32, lanes: u64) {
        let s = &mut *self.scratch;
        let Some(state) = s.positions.get_mut(position as usize) else {
            return;
        };
        let needed = lanes & !state.probed;
        if needed != 0 {
            if state.queued == 0 {
                s.touched.push(position);
            }
            state.queued |= needed;
        }
    }

    /// Queues the verification window below `depth` for `lanes`.
    fn queue_window(&mut self, depth: u32, lanes: u64) {
        for position in depth.saturating_sub(self.window)..depth {
            self.queue(position, lanes);
        }
    }

    /// Probes every queued position: locates it and prefetches its queued lanes' memory
    /// (the reads wait until [`GroupSearch::present`] needs them).
    fn probe_batch(&mut self) {
        let s = &mut *self.scratch;
        let batch = s.touched.get(s.batch_start..).unwrap_or_default();
        for &p in batch {
            let Some(state) = s.positions.get_mut(p as usize) else {
                continue;
            };
            if state.located_epoch != s.epoch {
                state.located_epoch = s.epoch;
                state.location = self.view.locate(self.hashes[p as usize]);
            }
            self.view
                .prefetch(&state.location, self.group, state.queued);
            state.probed |= state.queued;
            state.queued = 0;
        }
        s.n_probes += batch.len() as u32;
        s.batch_start = s.touched.len();
    }

    /// Which of `lanes` were probed at `position` and hold it (reading the words of those
    /// not read yet).
    fn present(&mut self, position: u32, lanes: u64) -> u64 {
        let Some(state) = self.scratch.positions.get_mut(position as usize) else {
            return 0;
        };
        let unread = lanes & state.probed & !state.read;
        if unread != 0 {
            state.present |= self.view.probe(&state.location, self.group, unread) & unread;
            state.read |= unread;
        }
        state.present & lanes
    }

    fn gallop(&mut self, ready: u64, n: u32) {
        let last = n - 1;
        // A wide group first learns which lanes hold position 0: the gallop's batch
        // fetches every asked lane's lines at every gallop position, and with dozens of
        // lanes that is more lines than the core keeps in flight (its prefetches stall),
        // while in a fleet most lanes usually miss the first block already.
        let galloping = if self.view.lines_per_row(self.group, ready) > STAGED_GALLOP_LINES {
            self.queue(0, ready);
            self.probe_batch();
            self.present(0, ready)
        } else {
            ready
        };
        let mut position = 0u32;
        loop {
            self.queue(position, galloping);
            if position >= last {
                break;
            }
            position = position.saturating_mul(2).saturating_add(1).min(last);
        }
        self.queue_window(n, galloping);
        self.probe_batch();
        let mut alive = ready;
        let mut lo = 0u32;
        let mut position = 0u32;
        loop {
            let hit = self.present(position, alive);
            if alive & !hit != 0 {
                push_bracket(
                    &mut self.scratch.open,
                    &mut self.scratch.resolved,
                    lo,
                    position,
                    alive & !hit,
                );
            }
            alive = hit;
            lo = position + 1;
            if alive == 0 || position >= last {
                break;
            }
            position = position.saturating_mul(2).saturating_add(1).min(last);
        }
        if alive != 0 {
            self.scratch.resolved.push(Bracket {
                lo: n,
                hi: n,
                lanes: alive,
            });
        }
    }

    /// Splits open brackets (all with `lo < hi`) until every one is resolved (`lo == hi`).
    /// A bracket narrower than `FANOUT` has all its positions and its window probed in one
    /// round, so its lanes are verified right away; the others wait for [`Self::verify`].
    fn refine(&mut self, report: &mut impl FnMut(u64, u32)) {
        while !self.scratch.open.is_empty() {
            let open = std::mem::take(&mut self.scratch.open);
            for bracket in &open {
                if bracket.hi - bracket.lo < FANOUT {
                    // Every position of the bracket, and the window below it.
                    let start = bracket.lo.saturating_sub(self.window);
                    for position in start..bracket.hi {
                        self.queue(position, bracket.lanes);
                    }
                } else {
                    for point in split_points(bracket.lo, bracket.hi) {
                        self.queue(point, bracket.lanes);
                    }
                }
            }
            self.probe_batch();
            let mut next = std::mem::take(&mut self.scratch.next);
            for &bracket in &open {
                if bracket.hi - bracket.lo < FANOUT {
                    self.settle_small(bracket, report);
                    continue;
                }
                let mut alive = bracket.lanes;
                let mut lo = bracket.lo;
                for point in split_points(bracket.lo, bracket.hi) {
                    let hit = self.present(point, alive);
                    if alive & !hit != 0 {
                        push_bracket(
                            &mut next,
                            &mut self.scratch.resolved,
                            lo,
                            point,
                            alive & !hit,
                        );
                    }
                    alive = hit;
                    lo = point + 1;
                    if alive == 0 {
                        break;
                    }
                }
                if alive != 0 {
                    push_bracket(&mut next, &mut self.scratch.resolved, lo, bracket.hi, alive);
                }
            }
            self.scratch.open = next;
            self.scratch.next = open;
            self.scratch.next.clear();
        }
    }

    /// Resolves a bracket narrower than `FANOUT` whose positions and window were all
    /// probed: each lane's depth is its first miss. Reports the lanes whose window holds;
    /// the others go to [`Self::verify`], which reopens them exactly as if they had waited.
    fn settle_small(&mut self, bracket: Bracket, report: &mut impl FnMut(u64, u32)) {
        let mut alive = bracket.lanes;
        for depth in bracket.lo..=bracket.hi {
            let missing = if depth < bracket.hi {
                let hit = self.present(depth, alive);
                let missing = alive & !hit;
                alive = hit;
                missing
            } else {
                alive
            };
            if missing != 0 {
                let mut held = missing;
                for position in depth.saturating_sub(self.window)..depth {
                    held = self.present(position, held);
                }
                if held != 0 {
                    report(held, depth);
                }
                if missing & !held != 0 {
                    self.scratch.resolved.push(Bracket {
                        lo: depth,
                        hi: depth,
                        lanes: missing & !held,
                    });
                }
            }
            if alive == 0 {
                break;
            }
        }
    }

    /// Verifies every resolved bracket; reports the verified lanes and reopens the rest.
    /// Returns whether some bracket was reopened.
    fn verify(&mut self, report: &mut impl FnMut(u64, u32)) -> bool {
        let resolved = std::mem::take(&mut self.scratch.resolved);
        for bracket in &resolved {
            self.queue_window(bracket.lo, bracket.lanes);
        }
        if self.scratch.batch_start < self.scratch.touched.len() {
            self.probe_batch();
        }
        for bracket in &resolved {
            let depth = bracket.lo;
            let mut failed = 0u64;
            for position in depth.saturating_sub(self.window)..depth {
                let lanes = bracket.lanes & !failed;
                let first_miss = lanes & !self.present(position, lanes);
                if first_miss != 0 {
                    failed |= first_miss;
                    self.reopen(first_miss, position);
                }
            }
            if bracket.lanes & !failed != 0 {
                report(bracket.lanes & !failed, depth);
            }
        }
        self.scratch.resolved = resolved;
        self.scratch.resolved.clear();
        !self.scratch.open.is_empty()
    }

    /// Gives `lanes`, which miss at `miss`, the bracket above their last probed hit.
    fn reopen(&mut self, lanes: u64, miss: u32) {
        let mut rest = lanes;
        for position in (0..miss).rev() {
            if rest == 0 {
                break;
            }
            let hit = self.present(position, rest);
            if hit != 0 {
                self.scratch.open.push(Bracket {
                    lo: position + 1,
                    hi: miss,
                    lanes: hit,
                });
                rest &= !hit;
            }
        }
        if rest != 0 {
            self.scratch.open.push(Bracket {
                lo: 0,
                hi: miss,
                lanes: rest,
            });
        }
    }
}

/// Files a bracket as open, or as resolved when `lo == hi`.
fn push_bracket(
    open: &mut Vec<Bracket>,
    resolved: &mut Vec<Bracket>,
    lo: u32,
    hi: u32,
    lanes: u64,
) {
    let bracket = Bracket { lo, hi, lanes };
    if lo == hi {
        resolved.push(bracket);
    } else {
        open.push(bracket);
    }
}
#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Lanes with explicit present positions (hashes are positions).
    struct Fake {
        present: Vec<Vec<bool>>,
        ready: Vec<bool>,
    }

    impl Prober for Fake {
        type Location = Location;
        type View<'a> = &'a Fake;
        fn n_lanes(&self) -> usize {
            self.present.len()
        }
        fn ready_lanes(&self, group: usize) -> u64 {
            let mut bits = 0;
            for (lane, &ready) in self.ready.iter().enumerate().skip(group * 64).take(64) {
                bits |= u64::from(ready) << (lane % 64);
            }
            bits
        }
        fn view(&self) -> &Fake {
            self
        }
    }

    impl ProbeView for &Fake {
        type Location = Location;
        fn locate(&self, hash: u64) -> Location {
            Location {
                key: 1,
                first: hash as usize,
                second: 0,
            }
        }
        fn prefetch(&self, _location: &Location, _group: usize, _lanes: u64) {}
        fn probe(&self, location: &Location, group: usize, _lanes: u64) -> u64 {
            let mut bits = 0;
            for (lane, present) in self.present.iter().enumerate().skip(group * 64).take(64) {
                if present[location.first] {
                    bits |= 1 << (lane % 64);
                }
            }
            bits & self.ready_lanes(group)
        }
    }

    fn run(fake: &Fake, n: usize, window: u32) -> (Vec<Option<u32>>, u32) {
        let hashes: Vec<u64> = (0..n as u64).collect();
        let mut scratch = SearchScratch::default();
        let mut depths = Vec::new();
        search(fake, &hashes, window, &mut scratch, &mut depths);
        (depths, scratch.n_probes)
    }

    fn prefix_lane(n: usize, depth: usize) -> Vec<bool> {
        (0..n).map(|p| p < depth).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        #[test]
        fn monotone_lanes_get_their_exact_depth(
            (n, depths) in (0usize..100).prop_flat_map(|n| (Just(n), prop::collection::vec(0..=n, 1..70)))
        ) {
            let fake = Fake {
                present: depths.iter().map(|&d| prefix_lane(n, d)).collect(),
                ready: vec![true; depths.len()],
            };
            let (got, _) = run(&fake, n, 2);
            let expected: Vec<Option<u32>> = depths.iter().map(|&d| Some(d as u32)).collect();
            prop_assert_eq!(got, expected);
        }

        #[test]
        fn reported_depth_always_ends_on_a_present_block(
            present in prop::collection::vec(prop::collection::vec(any::<bool>(), 40), 1..80),
            window in 1u32..=8,
        ) {
            let fake = Fake { ready: vec![true; present.len()], present: present.clone() };
            let (got, _) = run(&fake, 40, window);
            for (lane, depth) in got.iter().enumerate() {
                let depth = depth.unwrap() as usize;
                if depth > 0 {
                    prop_assert!(present[lane][depth - 1]);
                    let start = depth.saturating_sub(window as usize);
                    prop_assert!(present[lane][start..depth].iter().all(|&p| p));
                } else {
                    prop_assert!(!present[lane][0]);
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

        #[test]
        fn reused_scratch_answers_like_a_fresh_one(
            searches in prop::collection::vec(
                (1usize..150, 0usize..80, 1u32..=8, any::<u64>()),
                1..6,
            ),
            start_epoch in prop_oneof![Just(0u32), Just(u32::MAX - 3), any::<u32>()],
        ) {
            let mut scratch = SearchScratch { epoch: start_epoch, ..SearchScratch::default() };
            for (n_lanes, n, window, seed) in searches {
                // Lane depths and ready flags from the seed; a quarter of the positions
                // beyond a lane's depth are stray hits (false positives).
                let mut bits = seed;
                let mut next = || {
                    bits = bits.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    bits >> 33
                };
                let present: Vec<Vec<bool>> = (0..n_lanes)
                    .map(|_| {
                        let depth = next() as usize % (n + 1);
                        (0..n).map(|p| p < depth || next() % 4 == 0).collect()
                    })
                    .collect();
                let ready = (0..n_lanes).map(|_| next() % 5 != 0).collect();
                let fake = Fake { present, ready };
                let hashes: Vec<u64> = (0..n as u64).collect();
                let mut reused = Vec::new();
                search(&fake, &hashes, window, &mut scratch, &mut reused);
                let reused_probes = scratch.n_probes;
                let (fresh, fresh_probes) = run(&fake, n, window);
                prop_assert_eq!(reused, fresh);
                prop_assert_eq!(reused_probes, fresh_probes);
            }
        }
    }

    #[test]
    fn not_ready_lanes_report_none() {
        let fake = Fake {
            present: vec![prefix_lane(8, 8), prefix_lane(8, 8)],
            ready: vec![true, false],
        };
        assert_eq!(run(&fake, 8, 2).0, vec![Some(8), None]);
    }

    #[test]
    fn search_probes_far_fewer_positions_than_a_scan() {
        let fake = Fake {
            present: (0..16).map(|_| prefix_lane(64, 40)).collect(),
            ready: vec![true; 16],
        };
        let (depths, probes) = run(&fake, 64, 2);
        assert!(depths.iter().all(|&d| d == Some(40)));
        assert!(probes <= 16, "{probes} probes");
    }

    /// A [`Fake`] that records every prefetch as `(position, lanes)`.
    struct Recording {
        fake: Fake,
        prefetched: std::cell::RefCell<Vec<(usize, u64)>>,
    }

    impl Prober for Recording {
        type Location = Location;
        type View<'a> = &'a Recording;
        fn n_lanes(&self) -> usize {
            self.fake.n_lanes()
        }
        fn ready_lanes(&self, group: usize) -> u64 {
            self.fake.ready_lanes(group)
        }
        fn view(&self) -> &Recording {
            self
        }
    }

    impl ProbeView for &Recording {
        type Location = Location;
        fn locate(&self, hash: u64) -> Location {
            (&self.fake).locate(hash)
        }
        fn prefetch(&self, location: &Location, _group: usize, lanes: u64) {
            self.prefetched.borrow_mut().push((location.first, lanes));
        }
        fn probe(&self, location: &Location, group: usize, lanes: u64) -> u64 {
            (&self.fake).probe(location, group, lanes)
        }
    }

    /// Depths and prefetches of a search over `n_lanes` lanes of which those in `holders`
    /// hold all `n` positions and the others none.
    fn search_recorded(
        n_lanes: usize,
        holders: u64,
        n: usize,
    ) -> (Vec<Option<u32>>, Vec<(usize, u64)>) {
        let recording = Recording {
            fake: Fake {
                present: (0..n_lanes)
                    .map(|lane| prefix_lane(n, if holders >> lane & 1 == 1 { n } else { 0 }))
                    .collect(),
                ready: vec![true; n_lanes],
            },
            prefetched: std::cell::RefCell::default(),
        };
        let hashes: Vec<u64> = (0..n as u64).collect();
        let mut depths = Vec::new();
        search(
            &recording,
            &hashes,
            2,
            &mut SearchScratch::default(),
            &mut depths,
        );
        (depths, recording.prefetched.into_inner())
    }

    #[test]
    fn a_wide_group_gallops_only_with_the_lanes_holding_the_first_block() {
        let n = 32;
        let holders: u64 = (1 << 0) | (1 << 10) | (1 << 20) | (1 << 30);
        let (depths, prefetched) = search_recorded(40, holders, n);
        for (lane, depth) in depths.iter().enumerate() {
            let expected = if holders >> lane & 1 == 1 {
                n as u32
            } else {
                0
            };
            assert_eq!(*depth, Some(expected), "lane {lane}");
        }
        assert_eq!(
            prefetched.first(),
            Some(&(0, (1 << 40) - 1)),
            "position 0 first, alone"
        );
        assert!(
            prefetched
                .iter()
                .filter(|(position, _)| *position == 0)
                .count()
                == 1
        );
        for (position, lanes) in &prefetched[1..] {
            assert_eq!(
                lanes & !holders,
                0,
                "position {position} fetched {lanes:#x}"
            );
        }
        // A group of at most STAGED_GALLOP_LINES lines (16 lanes) fetches every gallop position for
        // every lane in its first batch.
        let narrow = STAGED_GALLOP_LINES as usize * 8;
        let (depths, prefetched) = search_recorded(narrow, holders & ((1 << narrow) - 1), n);
        assert_eq!(depths[1], Some(0));
        let all = (1u64 << narrow) - 1;
        assert!(prefetched.contains(&(1, all)) && prefetched.contains(&(3, all)));
    }

    #[test]
    fn lanes_sharing_a_narrow_bracket_verify_separately() {
        // Both lanes hit every gallop position up to 15 and resolve at depth 16 in one
        // narrow bracket; only the second lies (true depth 10, stray hit at 15), so its
        // window fails and it is reopened while the first is reported.
        let mut liar = prefix_lane(64, 10);
        liar[15] = true;
        let fake = Fake {
            present: vec![prefix_lane(64, 16), liar],
            ready: vec![true, true],
        };
        assert_eq!(run(&fake, 64, 2).0, vec![Some(16), Some(10)]);
    }

    #[test]
    fn false_positive_beyond_the_end_is_caught_by_verification() {
        // True depth 10; a stray "hit" at 15 (a gallop position) with 11..15 absent.
        let mut lane = prefix_lane(64, 10);
        lane[15] = true;
        let fake = Fake {
            present: vec![lane],
            ready: vec![true],
        };
        assert_eq!(run(&fake, 64, 2).0, vec![Some(10)]);
    }
}
