//! The prefix search: per pool, how many leading positions of a request are present,
//! with probes shared across pools.
//!
//! Presence is assumed to be prefix-monotone (a block is only cached with its parents), so
//! each pool's depth is the first missing position. The search brackets it per pool with
//! `lo` (every pool-known hit ends at `lo - 1`) and `hi` (a known miss at `hi`, or the
//! request length):
//!
//! 1. gallop: probe positions 0, 1, 3, 7, …, 2^k − 1 (capped at the last position) while
//!    some pool has hit every probe so far;
//! 2. refine: binary search inside each unresolved `[lo, hi)`; one probe updates every pool
//!    whose bracket contains the position, so pools holding the same prefix share probes;
//! 3. verify: re-check the `window` positions just below each depth; a miss there shows the
//!    bracket rested on a false positive (or a capacity hole), so the pool's bracket is
//!    reset to `[1 + last verified hit below the miss, miss)` and refined again.
//!
//! A reported depth `d > 0` always has position `d − 1` probed as present for that pool,
//! and the `window` positions below it too. Every loop is bounded: each refine probe
//! shrinks a bracket, and each failed verification strictly lowers that pool's `hi`.

/// Scratch buffers reused across searches.
#[derive(Debug, Clone, Default)]
pub(crate) struct SearchScratch {
    /// Per position, `mask_words` presence words (valid where `probed`).
    masks: Vec<u64>,
    probed: Vec<bool>,
    lo: Vec<u32>,
    hi: Vec<u32>,
    pub(crate) n_probes: u32,
}

/// The per-position presence oracle: writes one bit per lane into `mask` (already zeroed).
pub(crate) trait Prober {
    fn n_lanes(&self) -> usize;
    fn is_ready(&self, lane: usize) -> bool;
    fn probe(&self, hash: u64, mask: &mut [u64]);
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
    let mask_words = n_lanes.div_ceil(64);
    let mut search = Search {
        prober,
        hashes,
        mask_words,
        scratch,
    };
    search.reset(n);
    if n > 0 {
        search.gallop(n);
        search.refine();
        search.verify(window);
    }
    for (lane, depth) in depths.iter_mut().enumerate() {
        if prober.is_ready(lane) {
            *depth = Some(search.scratch.lo[lane]);
        }
    }
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

    fn hit(&mut self, position: u32, lane: usize) -> bool {
        let p = position as usize;
        let words = self.mask_words;
        if !self.scratch.probed[p] {
            self.scratch.probed[p] = true;
            self.scratch.n_probes += 1;
            let mask = &mut self.scratch.masks[p * words..(p + 1) * words];
            self.prober.probe(self.hashes[p], mask);
        }
        self.scratch.masks[p * words + lane / 64] & (1 << (lane % 64)) != 0
    }

    /// Probes `position` and narrows every bracket that contains it.
    fn observe(&mut self, position: u32) {
        for lane in 0..self.scratch.lo.len() {
            let (lo, hi) = (self.scratch.lo[lane], self.scratch.hi[lane]);
            if lo <= position && position < hi {
                if self.hit(position, lane) {
                    self.scratch.lo[lane] = position + 1;
                } else {
                    self.scratch.hi[lane] = position;
                }
            }
        }
    }

    fn gallop(&mut self, n: u32) {
        let mut position = 0u32;
        loop {
            self.observe(position);
            let last = n - 1;
            let any_galloping = (0..self.scratch.lo.len())
                .any(|lane| self.scratch.lo[lane] == position + 1 && self.scratch.hi[lane] == n);
            if !any_galloping || position == last {
                return;
            }
            position = position.saturating_mul(2).saturating_add(1).min(last);
        }
    }

    fn refine(&mut self) {
        while let Some(lane) =
            (0..self.scratch.lo.len()).find(|&l| self.scratch.lo[l] < self.scratch.hi[l])
        {
            let (lo, hi) = (self.scratch.lo[lane], self.scratch.hi[lane]);
            self.observe(lo + (hi - lo) / 2);
        }
    }

    fn verify(&mut self, window: u32) {
        loop {
            let mut contradicted = false;
            for lane in 0..self.scratch.lo.len() {
                let depth = self.scratch.lo[lane];
                if depth == 0 {
                    continue;
                }
                let start = depth.saturating_sub(window);
                let miss = (start..depth).find(|&position| !self.hit(position, lane));
                if let Some(miss) = miss {
                    contradicted = true;
                    let last_hit = (0..miss)
                        .rev()
                        .find(|&p| self.scratch.probed[p as usize] && self.hit(p, lane));
                    self.scratch.lo[lane] = last_hit.map_or(0, |p| p + 1);
                    self.scratch.hi[lane] = miss;
                }
            }
            if !contradicted {
                return;
            }
            self.refine();
        }
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
        fn probe(&self, hash: u64, mask: &mut [u64]) {
            for (lane, present) in self.present.iter().enumerate() {
                if self.ready[lane] && present[hash as usize] {
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
        assert!(probes <= 14, "{probes} probes");
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
