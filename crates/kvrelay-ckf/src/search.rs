//! The prefix search: per pool, how many leading positions of a request are present,
//! with probes shared across pools and issued in batches.
//!
//! Presence is assumed to be prefix-monotone (a block is only cached with its parents), so
//! each pool's depth is the first missing position. Lanes are searched in groups of 64,
//! each group as sets of lanes (`u64` bit masks) that share a bracket: a [`Bracket`] says
//! its lanes' depth lies in `lo..=hi`, where position `lo - 1` was probed present (or
//! `lo == 0`) and position `hi` was probed absent (or `hi` is the request length). Every
//! step is a handful of mask operations, whatever the number of lanes in a group, and the
//! work runs in rounds whose probes are issued as one batch (addresses first, then every
//! row prefetch, then the reads), so a round costs about one memory latency, not one per probe:
//!
//! 1. gallop: probe positions 0, 1, 3, 7, …, 2^k − 1 and the last `window` positions in one
//!    batch; the lanes that miss first at a gallop position form one bracket;
//! 2. refine: `FANOUT`-ary rounds; each round probes `FANOUT − 1` split points of every open
//!    bracket and splits its lanes by where they first miss. A bracket that this round
//!    resolves completely also probes the `window` positions below it, so verification
//!    usually costs no round of its own;
//! 3. verify: the `window` positions just below each depth must be present; a miss there
//!    shows the bracket rested on a false positive (or a capacity hole), so those lanes
//!    get the bracket `[1 + last probed hit below the miss, miss]` and are refined again.
//!
//! A reported depth `d > 0` always has position `d − 1` probed as present for that lane,
//! and the `window` positions below it too. Every loop is bounded: each refine round
//! shrinks every open bracket to about `1 / FANOUT`, and each failed verification strictly
//! lowers those lanes' `hi`.

use crate::addressing::Address;

/// Scratch buffers reused across searches.
#[derive(Debug, Clone, Default)]
pub(crate) struct SearchScratch {
    /// Per position, its address (valid where `located` is set).
    addresses: Vec<Address>,
    located: Vec<u64>,
    /// Per position, the lanes of the current group holding it, among `probed[position]`.
    masks: Vec<u64>,
    /// Per position, the lanes of the current group probed there so far.
    probed: Vec<u64>,
    /// Per position, the lanes queued for the next batch.
    queued: Vec<u64>,
    /// Positions queued for the next batch.
    batch: Vec<u32>,
    /// Positions with a non-zero `probed` entry (cleared after each group).
    visited: Vec<u32>,
    open: Vec<Bracket>,
    next: Vec<Bracket>,
    /// Resolved brackets (`lo == hi`) waiting for verification.
    resolved: Vec<Bracket>,
    pub(crate) n_probes: u32,
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
    fn n_lanes(&self) -> usize;
    /// Ready lanes of `group` (lane `64 * group + i` is bit `i`).
    fn ready_lanes(&self, group: usize) -> u64;
    /// Where `hash` lives (computed once per position, before any memory is touched).
    fn locate(&self, hash: u64) -> Address;
    /// Hints that `probe` will read the memory of `lanes` of `group` at `address` (so a
    /// batch's cache misses are all in flight before the first read waits).
    fn prefetch(&self, address: Address, group: usize, lanes: u64);
    /// Which of `lanes` (ready lanes of `group`) hold `address`; bits outside `lanes` may
    /// be set and are ignored.
    fn probe(&self, address: Address, group: usize, lanes: u64) -> u64;
}

/// Runs the search over `hashes`; writes each lane's depth (`None` when not ready).
pub(crate) fn search(
    prober: &impl Prober,
    hashes: &[u64],
    window: u32,
    scratch: &mut SearchScratch,
    depths: &mut Vec<Option<u32>>,
) {
    let n_lanes = prober.n_lanes();
    depths.clear();
    depths.resize(n_lanes, None);
    scratch.n_probes = 0;
    let n = u32::try_from(hashes.len()).unwrap_or(u32::MAX);
    let hashes = &hashes[..n as usize];
    let bit_words = hashes.len().div_ceil(64);
    scratch.located.clear();
    scratch.located.resize(bit_words, 0);
    if scratch.addresses.len() < hashes.len() {
        scratch.addresses.resize(hashes.len(), Address::default());
        scratch.masks.resize(hashes.len(), 0);
        scratch.probed.resize(hashes.len(), 0);
        scratch.queued.resize(hashes.len(), 0);
    }
    for group in 0..n_lanes.div_ceil(64) {
        let ready = prober.ready_lanes(group);
        if ready == 0 {
            continue;
        }
        let mut search = GroupSearch {
            prober,
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
        for &position in &scratch.visited {
            scratch.probed[position as usize] = 0;
        }
        scratch.visited.clear();
    }
}

/// Points probed per open bracket and round, plus one: each round cuts every bracket into
/// `FANOUT` parts. Wider rounds cost more probes but fewer dependent memory round trips.
const FANOUT: u32 = 4;

/// The `j`-th of `FANOUT - 1` split points of `lo..hi`; always in `lo..hi`.
fn split_point(lo: u32, hi: u32, j: u32) -> u32 {
    let span = u64::from(hi - lo);
    // span * j / FANOUT < span, so the point stays below hi.
    lo + (span * u64::from(j) / u64::from(FANOUT)) as u32
}

fn bit(bits: &[u64], position: u32) -> bool {
    bits[position as usize / 64] & (1 << (position % 64)) != 0
}

fn set_bit(bits: &mut [u64], position: u32) {
    bits[position as usize / 64] |= 1 << (position % 64);
}

struct GroupSearch<'a, P> {
    prober: &'a P,
    group: usize,
    hashes: &'a [u64],
    window: u32,
    scratch: &'a mut SearchScratch,
}

impl<P: Prober> GroupSearch<'_, P> {
    /// Searches the `ready` lanes; reports `(lanes, depth)` for every verified set.
    fn run(&mut self, ready: u64, report: &mut impl FnMut(u64, u32)) {
        let s = &mut *self.scratch;
        s.open.clear();
        s.next.clear();
        s.resolved.clear();
        let n = self.hashes.len() as u32;
        if n == 0 {
            report(ready, 0);
            return;
        }
        self.gallop(ready, n);
        loop {
            self.refine();
            if !self.verify(report) {
                return;
            }
        }
    }

    /// Queues `position` for those of `lanes` not probed there yet.
    fn queue(&mut self, position: u32, lanes: u64) {
        let s = &mut *self.scratch;
        let p = position as usize;
        let needed = lanes & !s.probed[p];
        if needed != 0 {
            if s.queued[p] == 0 {
                s.batch.push(position);
            }
            s.queued[p] |= needed;
        }
    }

    /// Queues the verification window below `depth` for `lanes`.
    fn queue_window(&mut self, depth: u32, lanes: u64) {
        for position in depth.saturating_sub(self.window)..depth {
            self.queue(position, lanes);
        }
    }

    /// Probes every queued position: addresses, then every prefetch, then every read.
    fn probe_batch(&mut self) {
        let s = &mut *self.scratch;
        for &p in &s.batch {
            if !bit(&s.located, p) {
                set_bit(&mut s.located, p);
                s.addresses[p as usize] = self.prober.locate(self.hashes[p as usize]);
            }
        }
        for &p in &s.batch {
            let p = p as usize;
            self.prober
                .prefetch(s.addresses[p], self.group, s.queued[p]);
        }
        for &p in &s.batch {
            let p = p as usize;
            let lanes = s.queued[p];
            let hits = self.prober.probe(s.addresses[p], self.group, lanes) & lanes;
            if s.probed[p] == 0 {
                s.visited.push(p as u32);
                s.masks[p] = 0;
            }
            s.masks[p] = (s.masks[p] & !lanes) | hits;
            s.probed[p] |= lanes;
            s.queued[p] = 0;
        }
        s.n_probes += s.batch.len() as u32;
        s.batch.clear();
    }

    fn mask(&self, position: u32) -> u64 {
        self.scratch.masks[position as usize]
    }

    fn gallop(&mut self, ready: u64, n: u32) {
        let last = n - 1;
        let mut position = 0u32;
        loop {
            self.queue(position, ready);
            if position >= last {
                break;
            }
            position = position.saturating_mul(2).saturating_add(1).min(last);
        }
        self.queue_window(n, ready);
        self.probe_batch();
        let mut alive = ready;
        let mut lo = 0u32;
        let mut position = 0u32;
        loop {
            let hit = self.mask(position) & alive;
            if alive & !hit != 0 {
                self.scratch.open.push(Bracket {
                    lo,
                    hi: position,
                    lanes: alive & !hit,
                });
            }
            alive = hit;
            lo = position + 1;
            if alive == 0 || position >= last {
                break;
            }
            position = position.saturating_mul(2).saturating_add(1).min(last);
        }
        if alive != 0 {
            self.scratch.open.push(Bracket {
                lo: n,
                hi: n,
                lanes: alive,
            });
        }
    }

    /// Splits open brackets until every one is resolved (`lo == hi`).
    fn refine(&mut self) {
        loop {
            let open = std::mem::take(&mut self.scratch.open);
            for bracket in &open {
                if bracket.lo == bracket.hi {
                    continue;
                }
                for j in 1..FANOUT {
                    self.queue(split_point(bracket.lo, bracket.hi, j), bracket.lanes);
                }
                if bracket.hi - bracket.lo < FANOUT {
                    // Every position of the bracket is probed this round: verify along.
                    self.queue_window(bracket.lo, bracket.lanes);
                }
            }
            self.probe_batch();
            let mut next = std::mem::take(&mut self.scratch.next);
            for &bracket in &open {
                if bracket.lo == bracket.hi {
                    self.scratch.resolved.push(bracket);
                    continue;
                }
                let mut alive = bracket.lanes;
                let mut lo = bracket.lo;
                for j in 1..FANOUT {
                    let point = split_point(bracket.lo, bracket.hi, j);
                    if point < lo {
                        continue; // a repeated point of a small bracket
                    }
                    let hit = self.mask(point) & alive;
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
            self.scratch.open = open;
            self.scratch.open.clear();
            std::mem::swap(&mut self.scratch.open, &mut next);
            self.scratch.next = next;
            if self.scratch.open.is_empty() {
                return;
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
        if !self.scratch.batch.is_empty() {
            self.probe_batch();
        }
        for bracket in &resolved {
            let depth = bracket.lo;
            let mut failed = 0u64;
            for position in depth.saturating_sub(self.window)..depth {
                let first_miss = bracket.lanes & !failed & !self.mask(position);
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
            let hit = rest & self.scratch.probed[position as usize] & self.mask(position);
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
        fn locate(&self, hash: u64) -> Address {
            Address {
                fingerprint: 1,
                primary: hash as u32,
                alternate: 0,
            }
        }
        fn prefetch(&self, _address: Address, _group: usize, _lanes: u64) {}
        fn probe(&self, address: Address, group: usize, _lanes: u64) -> u64 {
            let mut bits = 0;
            for (lane, present) in self.present.iter().enumerate().skip(group * 64).take(64) {
                if present[address.primary as usize] {
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
