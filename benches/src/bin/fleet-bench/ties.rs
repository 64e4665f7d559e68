//! Best-DC picks against the exact depths, and how many of them a false positive could turn
//! wrong: what "0 wrong best-DC picks" asks of the filter's false-positive rate.
//!
//! A router that picks the deepest DC, first of equals, picks wrong when a DC one block
//! short of the best, ahead of every truly best DC in that order, has a false positive at
//! its boundary: its estimate then ties the best (the search verifies positions below a
//! depth, never the depth's own last position, which a DC one block short really lacks).
//! Each such (request, DC) pair is one *exposed boundary*; the expected wrong picks are
//! the exposed boundaries times the probe's false-positive rate (picks that need two or
//! more false positives in a row are left out: a rate squared). The figures say what rate,
//! and so how many fingerprint bits, would make 0 wrong picks over the run likely.

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
}

impl BestPicks {
    /// Scores one request: `truth` holds each DC's exact depth, `estimate` gives the
    /// filter's for a DC.
    pub(crate) fn record(&mut self, truth: &[u32], estimate: impl Fn(usize) -> u32) {
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
        self.exposed += truth[..first_best]
            .iter()
            .filter(|&&depth| depth + 1 == best)
            .count() as u64;
    }

    /// The JSON figures, given the probe's measured false-positive rate and the filter's
    /// bits per membership.
    pub(crate) fn figures(&self, fp_rate: f64, bits_per_membership: f64) -> Value {
        let expected = self.exposed as f64 * fp_rate;
        let mut figures = json!({
            "wrong_best_dc": self.wrong,
            "wrong_best_dc_ties": self.wrong_ties,
            "best_dc_exposed_boundaries": self.exposed,
            "wrong_best_dc_expected": rounded(expected, 1),
        });
        if self.exposed > 0 && fp_rate > 0.0 {
            // The rate at which 0 wrong picks happens nine runs in ten, and the fingerprint
            // (each bit halves the rate) and bits per membership (at the same load) it takes.
            let needed = ZERO_NINE_TIMES_IN_TEN / self.exposed as f64;
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
        let truth = [4, 3, 5];
        picks.record(&truth, |dc| truth[dc]);
        assert_eq!((picks.wrong, picks.exposed), (0, 1));
        // A false positive at DC 0's boundary ties DC 2, and DC 0 comes first.
        picks.record(&truth, |dc| if dc == 0 { 5 } else { truth[dc] });
        assert_eq!((picks.wrong, picks.wrong_ties, picks.exposed), (1, 1, 2));
        // Behind the best DC, a DC one short is not exposed: it would lose the tie.
        let truth = [5, 4];
        picks.record(&truth, |dc| if dc == 1 { 5 } else { truth[dc] });
        assert_eq!((picks.wrong, picks.exposed), (1, 2));
        // A request cached nowhere picks nothing.
        picks.record(&[0, 0], |_| 1);
        assert_eq!((picks.wrong, picks.exposed), (1, 2));
    }

    #[test]
    fn passing_the_best_is_wrong_but_not_a_tie() {
        let mut picks = BestPicks::default();
        let truth = [2, 3];
        picks.record(&truth, |dc| if dc == 0 { 4 } else { truth[dc] });
        assert_eq!((picks.wrong, picks.wrong_ties), (1, 0));
    }

    #[test]
    fn the_needed_rate_and_bits_follow_from_the_exposure() {
        let picks = BestPicks {
            wrong: 16,
            wrong_ties: 16,
            exposed: 150_000,
        };
        let figures = picks.figures(1.08e-4, 16.84);
        assert_eq!(figures["wrong_best_dc_expected"], json!(16.2));
        let needs = &figures["zero_wrong_best_dc_needs"];
        let rate = needs["false_positives_per_probe"].as_f64().unwrap_or(0.0);
        assert!((rate - 7.02e-7).abs() < 1e-9, "{rate}");
        // 1.08e-4 / 7.02e-7 = 154: eight more fingerprint bits.
        assert_eq!(needs["fingerprint_bits"], json!(24.0));
        assert_eq!(needs["bits_per_membership"], json!(25.26));
    }
}
