//! The ranking formula and its configurable weights.
//!
//! Every candidate (an aggregated pool, a prefill/decode pair, or a lone decode pool) gets
//! a score; higher is better:
//!
//! ```text
//! score = prefix  × prefix_fraction            (prefill leg, or the only leg)
//!       + decode_leg × decode_prefix_fraction  (decode leg of a pair; 0 otherwise)
//!       − load    × load_fraction              (kv_used / total_kv, max over legs)
//!       − dc_cost × dc_cost_value              (the relay's configured per-DC cost)
//! ```
//!
//! `prefix_fraction` is the estimated cached prefix in tokens divided by the request's
//! token count, in `[0, 1]`; an unusable replica (missing, assembling or stale) contributes
//! 0 and is reported as unknown, never as a zero match. An unknown load (incomplete rank
//! coverage or no window yet) is replaced by [`ScoreWeights::unknown_load`], so missing
//! load is never mistaken for an idle pool. Ties break by DC name, then pool order.

/// Weights of the ranking formula (see the module docs). All must be finite.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ScoreWeights {
    /// Weight of the cached-prefix fraction of the prefill (or only) leg. Default 1.0.
    pub prefix: f64,
    /// Weight of the cached-prefix fraction of the decode leg of a pair. Default 0.25.
    pub decode_leg: f64,
    /// Weight of the KV occupancy fraction in `[0, 1]`. Default 0.5.
    pub load: f64,
    /// Occupancy assumed when a pool's load is unknown, in `[0, 1]`. Default 0.5.
    pub unknown_load: f64,
    /// Weight of the per-DC cost (e.g. milliseconds of network latency). Default 0.01,
    /// so 10 ms of cost offsets 10 % of the prompt being cached.
    pub dc_cost: f64,
}

impl ScoreWeights {
    /// Default [`ScoreWeights::prefix`].
    pub const DEFAULT_PREFIX: f64 = 1.0;
    /// Default [`ScoreWeights::decode_leg`].
    pub const DEFAULT_DECODE_LEG: f64 = 0.25;
    /// Default [`ScoreWeights::load`].
    pub const DEFAULT_LOAD: f64 = 0.5;
    /// Default [`ScoreWeights::unknown_load`].
    pub const DEFAULT_UNKNOWN_LOAD: f64 = 0.5;
    /// Default [`ScoreWeights::dc_cost`].
    pub const DEFAULT_DC_COST: f64 = 0.01;

    /// Checks every weight is finite and `unknown_load` lies in `[0, 1]`.
    pub fn validate(&self) -> Result<(), WeightError> {
        let named = [
            ("prefix", self.prefix),
            ("decode_leg", self.decode_leg),
            ("load", self.load),
            ("unknown_load", self.unknown_load),
            ("dc_cost", self.dc_cost),
        ];
        for (name, value) in named {
            if !value.is_finite() {
                return Err(WeightError::NotFinite { name, value });
            }
        }
        if !(0.0..=1.0).contains(&self.unknown_load) {
            return Err(WeightError::UnknownLoadOutOfRange {
                value: self.unknown_load,
            });
        }
        Ok(())
    }

    /// The score of one candidate from its terms.
    pub(crate) fn score(&self, terms: &ScoreTerms) -> f64 {
        let load = terms.load_fraction.unwrap_or(self.unknown_load);
        self.prefix * terms.prefix_fraction.unwrap_or(0.0)
            + self.decode_leg * terms.decode_prefix_fraction.unwrap_or(0.0)
            - self.load * load
            - self.dc_cost * terms.dc_cost
    }
}

impl Default for ScoreWeights {
    fn default() -> Self {
        Self {
            prefix: Self::DEFAULT_PREFIX,
            decode_leg: Self::DEFAULT_DECODE_LEG,
            load: Self::DEFAULT_LOAD,
            unknown_load: Self::DEFAULT_UNKNOWN_LOAD,
            dc_cost: Self::DEFAULT_DC_COST,
        }
    }
}

/// The inputs of the formula for one candidate.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(crate) struct ScoreTerms {
    /// Cached prefix of the prefill (or only) leg over the request length; `None` if unusable.
    pub(crate) prefix_fraction: Option<f64>,
    /// Cached prefix of the decode leg of a pair over the request length.
    pub(crate) decode_prefix_fraction: Option<f64>,
    /// KV occupancy in `[0, 1]`, `None` when unknown.
    pub(crate) load_fraction: Option<f64>,
    /// The relay's per-DC cost.
    pub(crate) dc_cost: f64,
}

/// A weight that cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum WeightError {
    /// A weight is NaN or infinite.
    #[error("score weight {name} must be finite, got {value}")]
    NotFinite {
        /// The weight's field name.
        name: &'static str,
        /// The rejected value.
        value: f64,
    },
    /// `unknown_load` lies outside `[0, 1]`.
    #[error("score weight unknown_load must lie in [0, 1], got {value}")]
    UnknownLoadOutOfRange {
        /// The rejected value.
        value: f64,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn terms(prefix: Option<f64>, load: Option<f64>, dc_cost: f64) -> ScoreTerms {
        ScoreTerms {
            prefix_fraction: prefix,
            decode_prefix_fraction: None,
            load_fraction: load,
            dc_cost,
        }
    }

    #[test]
    fn full_prefix_beats_an_idle_cold_pool_at_default_weights() {
        let w = ScoreWeights::default();
        let warm_busy = w.score(&terms(Some(1.0), Some(0.9), 0.0));
        let cold_idle = w.score(&terms(Some(0.0), Some(0.0), 0.0));
        assert!(warm_busy > cold_idle);
    }

    #[test]
    fn unknown_load_is_not_treated_as_idle() {
        let w = ScoreWeights::default();
        let unknown = w.score(&terms(Some(0.5), None, 0.0));
        let idle = w.score(&terms(Some(0.5), Some(0.0), 0.0));
        assert!(unknown < idle);
    }

    #[test]
    fn dc_cost_lowers_the_score() {
        let w = ScoreWeights::default();
        let near = w.score(&terms(Some(0.5), Some(0.1), 1.0));
        let far = w.score(&terms(Some(0.5), Some(0.1), 80.0));
        assert!(near > far);
    }

    #[test]
    fn decode_leg_adds_its_weighted_fraction() {
        let w = ScoreWeights::default();
        let mut t = terms(Some(0.5), Some(0.0), 0.0);
        let without = w.score(&t);
        t.decode_prefix_fraction = Some(1.0);
        let with = w.score(&t);
        assert!((with - without - w.decode_leg).abs() < 1e-12);
    }

    #[test]
    fn non_finite_weight_is_rejected_with_its_name() {
        let w = ScoreWeights {
            load: f64::INFINITY,
            ..ScoreWeights::default()
        };
        assert_eq!(
            w.validate(),
            Err(WeightError::NotFinite {
                name: "load",
                value: f64::INFINITY
            })
        );
    }

    #[test]
    fn unknown_load_outside_unit_interval_is_rejected() {
        let w = ScoreWeights {
            unknown_load: 1.5,
            ..ScoreWeights::default()
        };
        assert_eq!(
            w.validate(),
            Err(WeightError::UnknownLoadOutOfRange { value: 1.5 })
        );
    }
}
