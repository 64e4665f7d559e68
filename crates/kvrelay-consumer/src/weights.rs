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
//! token count, in `[0, 1]`: the prefix found in device memory, then its continuation in
//! the pool's lower tiers (host memory, then disk; relays with `[tiers]`) weighted by
//! [`ScoreWeights::host_tier`] and [`ScoreWeights::disk_tier`], the share of a prefill a
//! hit there saves; an unusable replica (missing, assembling or stale) contributes
//! 0 and is reported as unknown, never as a zero match. An unknown load (incomplete rank
//! coverage or no window yet) is replaced by [`ScoreWeights::unknown_load`], so missing
//! load is never mistaken for an idle pool. Ties break by DC name, then pool order.

/// Weights of the ranking formula (see the module docs). All must be finite.
///
/// Deserializes from a table of these fields (the router's `[weights]`), each optional
/// (its default), unknown keys refused; [`ScoreWeights::validate`] checks the values.
#[derive(Debug, Clone, Copy, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields, default)]
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
    /// What a cached token in host memory is worth against one in device memory, in
    /// `[0, 1]`: the share of its prefill a host hit saves. Default 0.9: restoring over
    /// PCIe 4 x16 (about 25 GB/s) moves an 8B model's 128 KiB of KV per token at about
    /// 190 k tokens/s, against an H100's prefill of about 10–20 k tokens/s, so a restore
    /// costs 5–10 % of recomputing.
    pub host_tier: f64,
    /// The same for local disk or storage, in `[0, 1]`. Default 0.6: an NVMe drive
    /// (about 5 GB/s) restores about 38 k tokens/s, a quarter to a half of a prefill.
    pub disk_tier: f64,
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
    /// Default [`ScoreWeights::host_tier`].
    pub const DEFAULT_HOST_TIER: f64 = 0.9;
    /// Default [`ScoreWeights::disk_tier`].
    pub const DEFAULT_DISK_TIER: f64 = 0.6;

    /// Checks every weight is finite and `unknown_load` lies in `[0, 1]`.
    pub fn validate(&self) -> Result<(), WeightError> {
        let named = [
            ("prefix", self.prefix),
            ("decode_leg", self.decode_leg),
            ("load", self.load),
            ("unknown_load", self.unknown_load),
            ("dc_cost", self.dc_cost),
            ("host_tier", self.host_tier),
            ("disk_tier", self.disk_tier),
        ];
        for (name, value) in named {
            if !value.is_finite() {
                return Err(WeightError::NotFinite { name, value });
            }
        }
        for (name, value) in [("host_tier", self.host_tier), ("disk_tier", self.disk_tier)] {
            if !(0.0..=1.0).contains(&value) {
                return Err(WeightError::TierWeightOutOfRange { name, value });
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
            host_tier: Self::DEFAULT_HOST_TIER,
            disk_tier: Self::DEFAULT_DISK_TIER,
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
    /// A tier weight lies outside `[0, 1]` (a lower tier is never worth more than device
    /// memory, nor less than nothing).
    #[error("score weight {name} must lie in [0, 1], got {value}")]
    TierWeightOutOfRange {
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

    #[test]
    fn tier_weights_outside_the_unit_interval_are_rejected_by_name() {
        for (w, name, value) in [
            (
                ScoreWeights {
                    host_tier: 1.5,
                    ..ScoreWeights::default()
                },
                "host_tier",
                1.5,
            ),
            (
                ScoreWeights {
                    disk_tier: -0.1,
                    ..ScoreWeights::default()
                },
                "disk_tier",
                -0.1,
            ),
        ] {
            assert_eq!(
                w.validate(),
                Err(WeightError::TierWeightOutOfRange { name, value })
            );
        }
        assert!(ScoreWeights::default().validate().is_ok());
    }
}
