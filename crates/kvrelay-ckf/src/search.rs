//! The prefix search: per pool, how many leading positions of a request are present,
//! with probes shared across pools and issued in batches.
//!
//! Presence is assumed to be prefix-monotone (a block is only cached with its parents), so
//! each pool's depth is the first missing position. The search brackets it per pool with
//! `lo` (a probed hit at `lo - 1`, or 0) and `hi` (a probed miss at `hi`, or the request
//! length), in rounds; each round's positions are probed as one batch whose memory loads
//! are issued together, so a round costs about one memory latency, not one per probe:
//!
//! 1. gallop: probe positions 0, 1, 3, 7, …, 2^k − 1 and the last position in one batch;
//!    per pool, the hits before its first miss set `lo`, the first miss sets `hi`;
//! 2. refine: 4-ary search rounds; each round probes three split points of every
//!    unresolved bracket (pools with the same bracket share probes) and keeps, per pool,
//!    the part between its last hit and its first miss;
//! 3. verify: probe the `window` positions just below each depth; a miss there shows the
//!    bracket rested on a false positive (or a capacity hole), so that pool's bracket is
//!    reset to `[1 + last probed hit below the miss, miss)` and refined again.
//!
//! A reported depth `d > 0` always has position `d − 1` probed as present for that pool,
//! and the `window` positions below it too. Every loop is bounded: each refine round
//! shrinks every open bracket to about a quarter, and each failed verification strictly
//! lowers that pool's `hi`.

use crate::addressing::Address;

/// Scratch buffers reused across searches.
#[derive(Debug, Clone, Default)]
pub(crate) struct SearchScratch {
    /// Per position, `mask_words` presence words (valid where `probed`).
    masks: Vec<u64>,
    probed: Vec<bool>,
    lo: Vec<u32>,
    hi: Vec<u32>,
    batch: Vec<u32>,
    addresses: Vec<Address>,
    pub(crate) n_probes: u32,
}

/// The per-position presence oracle.
pub(crate) trait Prober {
    fn n_lanes(&self) -> usize;
    fn is_ready(&self, lane: usize) -> bool;
    /// Where `hash` lives (computed once per probe, before any memory is touched).
    fn locate(&self, hash: u64) -> Address;
    /// Loads the memory `probe` will read and folds it into the result (so a batch of
    /// touches issues its cache misses together).
    fn touch(&self, address: Address) -> u64;
    /// Writes one bit per ready lane holding `address` into `mask` (already zeroed).
    fn probe(&self, address: Address, mask: &mut [u64]);
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
    if n_lanes == 0 {
        return;
    }
    let n = u32::try_from(hashes.len()).unwrap_or(u32::MAX);
    let mut search = Search {
        prober,
        hashes: &hashes[..n as usize],
        mask_words: n_lanes.div_ceil(64),
        scratch,
    };
    search.reset(n);
    if n > 0 {
        search.gallop(n);
        loop {
            search.refine();
            if !search.verify(window) {
                break;
            }
        }
    }
    for (lane, depth) in depths.iter_mut().enumerate() {
        if prober.is_ready(lane) {
            *depth = Some(search.scratch.lo[lane]);
        }
    }
}

/// Points probed per open bracket and round, plus one: each round cuts every bracket into
/// `FANOUT` parts. Wider rounds cost more probes but fewer dependent memory round trips.
const FANOUT: u32 = 4;

/// The `j`-th of `FANOUT - 1` split points of `[lo, hi)`; always in `lo..hi`.
fn split_point(lo: u32, hi: u32, j: u32) -> u32 {
    let span = u64::from(hi - lo);
    // span * j / FANOUT < span, so the point stays below hi.
    lo + (span * u64::from(j) / u64::from(FANOUT)) as u32
}

struct Search<'a, P> {
    prober: &'a P,
    hashes: &'a [u64],
    mask_words: usize,
    scratch: &'a mut SearchScratch,
}

impl<P: Prober> Search<'_, P> {
    fn reset(&mut self, n: u32) {
        let n_lanes = self.prober.n_lanes();
        let s = &mut *self.scratch;
        s.masks.clear();
        s.masks.resize(n as usize * self.mask_words, 0);
        s.probed.clear();
        s.probed.resize(n as usize, false);
        s.lo.clear();
        s.lo.resize(n_lanes, 0);
        s.hi.clear();
        for lane in 0..n_lanes {
            s.hi.push(if self.prober.is_ready(lane) { n } else { 0 });
        }
    }

    /// Probes every not-yet-probed position in `scratch.batch`: touches first, then reads.
    fn probe_batch(&mut self) {
        let s = &mut *self.scratch;
        s.batch.sort_unstable();
        s.batch.dedup();
        s.batch.retain(|&p| !s.probed[p as usize]);
        s.addresses.clear();
        for &p in &s.batch {
            s.addresses
                .push(self.prober.locate(self.hashes[p as usize]));
        }
        let mut sink = 0u64;
        for &address in &s.addresses {
            sink ^= self.prober.touch(address);
        }
        std::hint::black_box(sink);
        let words = self.mask_words;
        for (&p, &address) in s.batch.iter().zip(&s.addresses) {
            let p = p as usize;
            s.probed[p] = true;
            s.n_probes += 1;
            self.prober
                .probe(address, &mut s.masks[p * words..(p + 1) * words]);
        }
        s.batch.clear();
    }

    /// Whether `lane` holds `position` (which must be probed).
    fn hit(&self, position: u32, lane: usize) -> bool {
        let p = position as usize;
        self.scratch.masks[p * self.mask_words + lane / 64] & (1 << (lane % 64)) != 0
    }

    fn gallop(&mut self, n: u32) {
        let last = n - 1;
        let mut position = 0u32;
        loop {
            self.scratch.batch.push(position);
            if position >= last {
                break;
            }
            position = position.saturating_mul(2).saturating_add(1).min(last);
        }
        let positions = self.scratch.batch.clone();
        self.probe_batch();
        for lane in 0..self.scratch.lo.len() {
            if self.scratch.hi[lane] == 0 {
                continue;
            }
            for &p in &positions {
                if self.hit(p, lane) {
                    self.scratch.lo[lane] = p + 1;
                } else {
                    self.scratch.hi[lane] = p;
                    break;
                }
            }
        }
    }

    fn refine(&mut self) {
        loop {
            for lane in 0..self.scratch.lo.len() {
                let (lo, hi) = (self.scratch.lo[lane], self.scratch.hi[lane]);
                for j in 1..FANOUT {
                    if lo < hi {
                        self.scratch.batch.push(split_point(lo, hi, j));
                    }
                }
            }
            if self.scratch.batch.is_empty() {
                return;
            }
            self.probe_batch();
            for lane in 0..self.scratch.lo.len() {
                let (lo, hi) = (self.scratch.lo[lane], self.scratch.hi[lane]);
                if lo >= hi {
                    continue;
                }
                for j in 1..FANOUT {
                    let point = split_point(lo, hi, j);
                    if point < self.scratch.lo[lane] {
                        continue; // a repeated point on a small bracket
                    }
                    if self.hit(point, lane) {
                        self.scratch.lo[lane] = point + 1;
                    } else {
                        self.scratch.hi[lane] = point;
                        break;
                    }
                }
            }
        }
    }

    /// Verifies every depth; returns whether some bracket was reopened.
    fn verify(&mut self, window: u32) -> bool {
        for lane in 0..self.scratch.lo.len() {
            let depth = self.scratch.lo[lane];
            for position in depth.saturating_sub(window)..depth {
                self.scratch.batch.push(position);
            }
        }
        self.probe_batch();
        let mut reopened = false;
        for lane in 0..self.scratch.lo.len() {
            let depth = self.scratch.lo[lane];
            let start = depth.saturating_sub(window);
            if let Some(miss) = (start..depth).find(|&p| !self.hit(p, lane)) {
                reopened = true;
                let last_hit = (0..miss)
                    .rev()
                    .find(|&p| self.scratch.probed[p as usize] && self.hit(p, lane));
                self.scratch.lo[lane] = last_hit.map_or(0, |p| p + 1);
                self.scratch.hi[lane] = miss;
            }
        }
        reopened
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
        fn is_ready(&self, lane: usize) -> bool {
            self.ready[lane]
        }
        fn locate(&self, hash: u64) -> Address {
            Address {
                fingerprint: 1,
                primary: hash as u32,
                alternate: 0,
            }
        }
        fn touch(&self, address: Address) -> u64 {
            u64::from(address.primary)
        }
        fn probe(&self, address: Address, mask: &mut [u64]) {
            for (lane, present) in self.present.iter().enumerate() {
                if self.ready[lane] && present[address.primary as usize] {
                    mask[lane / 64] |= 1 << (lane % 64);
                }
            }
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
            present in prop::collection::vec(prop::collection::vec(any::<bool>(), 40), 1..20),
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
