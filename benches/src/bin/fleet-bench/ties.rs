//! Best-DC picks against the exact depths, and how many of them a false positive could turn
//! wrong: what "0 wrong best-DC picks" asks of the filter's false-positive rate.
//!
//! A router that picks the deepest DC, first of equals, picks wrong when a DC one block
//! short of the best, ahead of every truly best DC in that order, has a false positive at
//! its boundary: its estimate then ties the best (the search verifies positions below a
//! depth, never the depth's own last position, which a DC one block short really lacks).
//! Each such (request, DC) pair is one *exposed boundary*; the expected wrong picks are
//! the exposed boundaries times the false-positive rate at a boundary (picks that need two
//! or more false positives in a row are left out: a rate squared).
//!
//! **The rate at a boundary** is measured, not assumed: of every DC one block short of the
//! best (in any order), the share whose estimate is above its exact depth. It matches the
//! probe rate of never-stored hashes within the noise of a run (64 DCs × 2.5 M blocks:
//! 1.19e-4 against 1.08e-4 dense, 4.9e-5 against 7.1e-5 v1).
//!
//! Requests recur (popular tenants' prompts), and one boundary hash meets one DC's filter
//! with the same answer each time: a false positive there is a wrong pick each time the
//! request comes. So a run's wrong picks vary more than a Poisson count would (the same
//! run: 16 against 39 expected dense, 13 against 16 v1), and whether a run sees 0 depends
//! on the *distinct* exposed (hash, DC) pairs, each a false positive or not. The figures
//! say what rate, and so how many fingerprint bits, would make 0 wrong picks over the
//! run's requests happen nine runs in ten.

use std::collections::HashSet;

use serde_json::{Value, json};

use crate::rounded;

/// `-ln(0.9)`: a Poisson count with this mean is 0 nine times in ten.
const ZERO_NINE_TIMES_IN_TEN: f64 = 0.105_360_515_657_826_3;

/// The fingerprint width of both formats the fleet builds (v1 and dense).
const FINGERPRINT_BITS: f64 = 16.0;

#[derive(Debug, Default)]
pub(crate) struct BestPicks {
    /// Requests whose pick holds less than the best DC does.
    wrong: u64,
    /// Wrong picks whose estimate equals a truly best DC's (the pick came first of equals).
    wrong_ties: u64,
    /// (request, DC) pairs one block short of the best and ahead of every best DC.
    exposed: u64,
    /// The distinct (boundary hash, DC) pairs among them.
    exposed_distinct: HashSet<(u64, usize)>,
    /// (request, DC) pairs one block short of the best, in any order, and how many of them
    /// the filter put above their exact depth: the false-positive rate at a boundary.
    short_by_one: u64,
    short_by_one_inflated: u64,
}

impl BestPicks {
    /// Scores one request (its sequence hashes): `truth` holds each DC's exact depth,
    /// `estimate` gives the filter's for a DC.
    pub(crate) fn record(
        &mut self,
        hashes: &[u64],
        truth: &[u32],
        estimate: impl Fn(usize) -> u32,
    ) {
        let best = truth.iter().copied().max().unwrap_or(0);
        if best == 0 {
            return;
        }
        let mut pick = (0usize, 0u32);
        for dc in 0..truth.len() {
            let depth = estimate(dc);
            if depth > pick.1 {
                pick = (dc, depth);
            }
        }
        if truth[pick.0] < best {
            self.wrong += 1;
            let tied = truth
                .iter()
                .enumerate()
                .any(|(dc, &depth)| depth == best && estimate(dc) == pick.1);
            self.wrong_ties += u64::from(tied);
        }
        let first_best = truth.iter().position(|&depth| depth == best).unwrap_or(0);
        let boundary = hashes.get(best as usize - 1).copied();
        for (dc, &depth) in truth.iter().enumerate() {
            if depth + 1 != best {
                continue;
            }
            self.short_by_one += 1;
            self.short_by_one_inflated += u64::from(estimate(dc) > depth);
            if let (true, Some(boundary)) = (dc < first_best, boundary) {
                self.exposed += 1;
                self.exposed_distinct.insert((boundary, dc));
            }
        }
    }

    /// The JSON figures, given the filter's bits per membership.
    pub(crate) fn figures(&self, bits_per_membership: f64) -> Value {
        let fp_rate = self.short_by_one_inflated as f64 / self.short_by_one.max(1) as f64;
        let expected = self.exposed as f64 * fp_rate;
        let mut figures = json!({
            "wrong_best_dc": self.wrong,
            "wrong_best_dc_ties": self.wrong_ties,
            "best_dc_exposed_boundaries": self.exposed,
            "best_dc_exposed_boundaries_distinct": self.exposed_distinct.len(),
            "boundary_false_positives": format!("{} of {}", self.short_by_one_inflated, self.short_by_one),
            "boundary_false_positives_per_probe": fp_rate,
            "wrong_best_dc_expected": rounded(expected, 1),
        });
        if !self.exposed_distinct.is_empty() && fp_rate > 0.0 {
            // The rate at which no distinct exposed pair is a false positive nine runs in
            // ten, and the fingerprint (each bit halves the rate) and bits per membership
            // (at the same load) it takes.
            let needed = ZERO_NINE_TIMES_IN_TEN / self.exposed_distinct.len() as f64;
            let extra_bits = (fp_rate / needed).log2().ceil().max(0.0);
            let fingerprint_bits = FINGERPRINT_BITS + extra_bits;
            figures["zero_wrong_best_dc_needs"] = json!({
                "false_positives_per_probe": needed,
                "fingerprint_bits": fingerprint_bits,
                "bits_per_membership": rounded(
                    bits_per_membership * fingerprint_bits / FINGERPRINT_BITS,
                    2
                ),
            });
        }
        figures
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_false_tie_ahead_of_the_best_is_a_wrong_pick_and_an_exposed_boundary() {
        let mut picks = BestPicks::default();
        // DC 0 is one block short of DC 2 and ahead of it: exposed. DC 1 is two short.
        let hashes = [10, 11, 12, 13, 14, 15];
        let truth = [4, 3, 5];
        picks.record(&hashes, &truth, |dc| truth[dc]);
        assert_eq!((picks.wrong, picks.exposed), (0, 1));
        // A false positive at DC 0's boundary ties DC 2, and DC 0 comes first. The same
        // request again meets the same boundary of the same DC: one distinct pair.
        picks.record(&hashes, &truth, |dc| if dc == 0 { 5 } else { truth[dc] });
        assert_eq!((picks.wrong, picks.wrong_ties, picks.exposed), (1, 1, 2));
        assert_eq!(picks.exposed_distinct.len(), 1);
        // DC 0 was one short twice, inflated once.
        assert_eq!((picks.short_by_one, picks.short_by_one_inflated), (2, 1));
        assert!(picks.exposed_distinct.contains(&(14, 0)));
        // Behind the best DC, a DC one short is not exposed: it would lose the tie.
        let truth = [5, 4];
        picks.record(&hashes, &truth, |dc| if dc == 1 { 5 } else { truth[dc] });
        assert_eq!((picks.wrong, picks.exposed), (1, 2));
        // Behind it, but one short all the same: it counts toward the boundary's rate.
        assert_eq!((picks.short_by_one, picks.short_by_one_inflated), (3, 2));
        // A request cached nowhere picks nothing.
        picks.record(&hashes, &[0, 0], |_| 1);
        assert_eq!((picks.wrong, picks.exposed), (1, 2));
    }

    #[test]
    fn passing_the_best_is_wrong_but_not_a_tie() {
        let mut picks = BestPicks::default();
        let truth = [2, 3];
        picks.record(&[1, 2, 3], &truth, |dc| if dc == 0 { 4 } else { truth[dc] });
        assert_eq!((picks.wrong, picks.wrong_ties), (1, 0));
    }

    #[test]
    fn the_needed_rate_and_bits_follow_from_the_exposure() {
        let picks = BestPicks {
            wrong: 16,
            wrong_ties: 16,
            exposed: 300_000,
            exposed_distinct: (0..150_000).map(|hash| (hash, 0)).collect(),
            short_by_one: 1_000_000,
            short_by_one_inflated: 108,
        };
        let figures = picks.figures(16.84);
        assert_eq!(figures["wrong_best_dc_expected"], json!(32.4));
        let needs = &figures["zero_wrong_best_dc_needs"];
        let rate = needs["false_positives_per_probe"].as_f64().unwrap_or(0.0);
        assert!((rate - 7.02e-7).abs() < 1e-9, "{rate}");
        // 1.08e-4 / 7.02e-7 = 154: eight more fingerprint bits.
        assert_eq!(needs["fingerprint_bits"], json!(24.0));
        assert_eq!(needs["bits_per_membership"], json!(25.26));
    }
}
