//! Filter sizing: the v1 or dense [`CkfFormat`] for an expected number of unique blocks,
//! the seed and the relocation budget.

use kvrelay_identity::{CkfFormat, DEFAULT_CKF_SEED};

use crate::image::MAX_BUCKET_COUNT;

/// Default relocation budget (evictions tried before an insert gives up and rolls back).
pub const DEFAULT_MAX_KICKS: u32 = 500;

/// Largest accepted relocation budget.
pub const MAX_KICKS: u32 = 4096;

/// Smallest bucket count.
pub const MIN_BUCKET_COUNT: u64 = 2;

/// Default design load of the dense format, in percent: the table is full to this share
/// of its slots when the pool holds its expected number of unique blocks. At 95 % a
/// 16-bit fingerprint costs 16.8 bits per membership and a probe's false-positive rate is
/// about `8 · 0.95 / 65,535 ≈ 1.16e-4`.
pub const DEFAULT_DENSE_LOAD_PERCENT: u8 = 95;

/// Most size classes per octave of the dense format ([`FilterDensity::Dense`]).
pub const MAX_DENSE_SIZE_CLASSES_PER_OCTAVE: u8 = 64;

/// Accepted dense design loads, in percent. Above 97 % inserts start to fail well before
/// the expected count (a 4-slot cuckoo table's threshold is about 97–98 %).
pub const DENSE_LOAD_PERCENT_RANGE: std::ops::RangeInclusive<u8> = 50..=97;

/// Errors building a filter layout or a producer filter.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The expected number of unique blocks was zero.
    #[error("expected unique blocks must be greater than zero")]
    ExpectedUniqueBlocksZero,
    /// The relocation budget is outside `1..=MAX_KICKS`.
    #[error("max kicks {max_kicks} is outside 1..={MAX_KICKS}")]
    InvalidMaxKicks {
        /// The rejected budget.
        max_kicks: u32,
    },
    /// Sizing arithmetic overflowed.
    #[error("expected unique blocks {expected_unique_blocks} overflows the bucket count")]
    CapacityOverflow {
        /// The rejected capacity.
        expected_unique_blocks: u64,
    },
    /// The dense design load is outside [`DENSE_LOAD_PERCENT_RANGE`].
    #[error("dense design load {load_percent} % is outside 50..=97 %")]
    InvalidDenseLoad {
        /// The rejected load, in percent.
        load_percent: u8,
    },
    /// More dense size classes per octave than [`MAX_DENSE_SIZE_CLASSES_PER_OCTAVE`].
    #[error("dense size classes per octave {classes} must be 0 or a power of two up to 64")]
    InvalidSizeClasses {
        /// The rejected number of classes.
        classes: u8,
    },
    /// The bucket count exceeds `MAX_BUCKET_COUNT`.
    #[error("bucket count {bucket_count} exceeds the largest table {MAX_BUCKET_COUNT}")]
    BucketCountTooLarge {
        /// The rejected bucket count.
        bucket_count: u64,
    },
    /// A fallible allocation failed.
    #[error("allocation of {bytes} bytes for {what} failed")]
    AllocationFailed {
        /// What was being allocated.
        what: &'static str,
        /// How many bytes were requested.
        bytes: u64,
    },
}

/// The bucket count for `expected_unique_blocks`: `max(2, ceil(5n / 16))` rounded up to a
/// power of two, so the design load at `n` live blocks is between 40 % and 80 %.
///
/// ```
/// use kvrelay_ckf::format::bucket_count_for;
/// assert_eq!(bucket_count_for(1), Ok(2));
/// assert_eq!(bucket_count_for(16), Ok(8));
/// assert_eq!(bucket_count_for(1 << 20), Ok(524_288));
/// ```
pub fn bucket_count_for(expected_unique_blocks: u64) -> Result<u64, ConfigError> {
    if expected_unique_blocks == 0 {
        return Err(ConfigError::ExpectedUniqueBlocksZero);
    }
    let overflow = ConfigError::CapacityOverflow {
        expected_unique_blocks,
    };
    let required = expected_unique_blocks
        .checked_mul(5)
        .and_then(|x| x.checked_add(15))
        .ok_or_else(|| overflow.clone())?
        / 16;
    let bucket_count = required
        .max(MIN_BUCKET_COUNT)
        .checked_next_power_of_two()
        .ok_or(overflow)?;
    if bucket_count > MAX_BUCKET_COUNT {
        return Err(ConfigError::BucketCountTooLarge { bucket_count });
    }
    Ok(bucket_count)
}

/// The dense-format bucket count for `expected_unique_blocks` at `load_percent`:
/// `max(2, ceil(100 n / (4 · load)))`, any count (not rounded to a power of two), so the
/// table is `load_percent` full at `n` live blocks.
///
/// ```
/// use kvrelay_ckf::format::dense_bucket_count_for;
/// assert_eq!(dense_bucket_count_for(1, 95), Ok(2));
/// assert_eq!(dense_bucket_count_for(1_000_000, 95), Ok(263_158));
/// ```
pub fn dense_bucket_count_for(
    expected_unique_blocks: u64,
    load_percent: u8,
) -> Result<u64, ConfigError> {
    if expected_unique_blocks == 0 {
        return Err(ConfigError::ExpectedUniqueBlocksZero);
    }
    if !DENSE_LOAD_PERCENT_RANGE.contains(&load_percent) {
        return Err(ConfigError::InvalidDenseLoad { load_percent });
    }
    let slots_per_load = 4 * u64::from(load_percent);
    let bucket_count = expected_unique_blocks
        .checked_mul(100)
        .and_then(|x| x.checked_add(slots_per_load - 1))
        .ok_or(ConfigError::CapacityOverflow {
            expected_unique_blocks,
        })?
        / slots_per_load;
    let bucket_count = bucket_count.max(MIN_BUCKET_COUNT);
    if bucket_count > MAX_BUCKET_COUNT {
        return Err(ConfigError::BucketCountTooLarge { bucket_count });
    }
    Ok(bucket_count)
}

/// Which format a producer filter is built in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum FilterDensity {
    /// CKF format 1 (the reference's): a power-of-two table 40–80 % full at the expected
    /// count (about 27 bits per membership at 60 %).
    #[default]
    V1,
    /// The dense format 2: a table sized to be `load_percent` full at the expected count
    /// ([`DENSE_LOAD_PERCENT_RANGE`]; 95 % is 16.8 bits per membership).
    Dense {
        /// The design load, in percent.
        load_percent: u8,
        /// 0: the bucket count is exactly what the load asks for. `c` (a power of two up
        /// to 64): it is rounded up to one of `c` sizes per octave (`2^k + j · 2^k / c`), so pools of
        /// similar capacity share a format, and a router one query table (one probe per
        /// position) for them, at up to `1/c` more memory.
        size_classes_per_octave: u8,
    },
}

impl FilterDensity {
    /// The dense format at [`DEFAULT_DENSE_LOAD_PERCENT`].
    pub const DENSE: Self = Self::Dense {
        load_percent: DEFAULT_DENSE_LOAD_PERCENT,
        size_classes_per_octave: 0,
    };
}

/// `bucket_count` rounded up to one of `classes` sizes per octave (`2^k + j · 2^k /
/// classes`, `j < classes`; unchanged for 0 or below `2 · classes`, where every count is
/// a class). `classes` is 0 or a power of two up to [`MAX_DENSE_SIZE_CLASSES_PER_OCTAVE`].
///
/// ```
/// use kvrelay_ckf::format::size_class_of;
/// assert_eq!(size_class_of(657_895, 0), Ok(657_895));
/// assert_eq!(size_class_of(657_895, 8), Ok(720_896)); // 2^19 + 3 · 2^16
/// assert_eq!(size_class_of(655_360, 8), Ok(655_360));
/// assert_eq!(size_class_of(5, 4), Ok(5));
/// ```
pub fn size_class_of(bucket_count: u64, classes: u8) -> Result<u64, ConfigError> {
    if classes > MAX_DENSE_SIZE_CLASSES_PER_OCTAVE || !(classes == 0 || classes.is_power_of_two()) {
        return Err(ConfigError::InvalidSizeClasses { classes });
    }
    let classes = u64::from(classes);
    if classes == 0 || bucket_count < 2 * classes {
        return Ok(bucket_count);
    }
    // The octave [2^k, 2^(k+1)) holding the count, cut into `classes` equal steps (both
    // powers of two, the octave at least twice the classes: the step is at least 2).
    let octave = 1u64 << (63 - bucket_count.leading_zeros());
    let step = octave / classes;
    let rounded = bucket_count.div_ceil(step) * step;
    if rounded > MAX_BUCKET_COUNT {
        return Err(ConfigError::BucketCountTooLarge {
            bucket_count: rounded,
        });
    }
    Ok(rounded)
}

/// How to build a producer filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CkfConfig {
    /// How many distinct live blocks the pool is expected to hold (sizes the table).
    pub expected_unique_blocks: u64,
    /// The addressing seed (also seeds the deterministic relocation choices).
    pub seed: u64,
    /// Relocation budget per insert, `1..=MAX_KICKS`.
    pub max_kicks: u32,
    /// The format: v1 (the default) or dense.
    pub density: FilterDensity,
}

impl CkfConfig {
    /// A config for `expected_unique_blocks` with the default seed and relocation budget.
    pub fn new(expected_unique_blocks: u64) -> Self {
        Self {
            expected_unique_blocks,
            seed: DEFAULT_CKF_SEED,
            max_kicks: DEFAULT_MAX_KICKS,
            density: FilterDensity::V1,
        }
    }

    /// The same config in `density`.
    pub fn with_density(self, density: FilterDensity) -> Self {
        Self { density, ..self }
    }

    /// Validates the config and returns its format (version, seed and sized bucket count).
    pub fn format(&self) -> Result<CkfFormat, ConfigError> {
        self.check_budget()?;
        if let FilterDensity::Dense {
            load_percent,
            size_classes_per_octave,
        } = self.density
        {
            return self.dense_format(load_percent, size_classes_per_octave);
        }
        let bucket_count = bucket_count_for(self.expected_unique_blocks)?;
        // bucket_count_for bounds the count by MAX_BUCKET_COUNT (2^24), a valid v1 count.
        CkfFormat::v1(self.seed, bucket_count as u32)
            .map_err(|_| ConfigError::BucketCountTooLarge { bucket_count })
    }

    /// The dense format (format 2), sized so the table is `load_percent` full at the
    /// expected number of unique blocks.
    fn dense_format(&self, load_percent: u8, classes: u8) -> Result<CkfFormat, ConfigError> {
        let bucket_count = dense_bucket_count_for(self.expected_unique_blocks, load_percent)?;
        let bucket_count = size_class_of(bucket_count, classes)?;
        // Bounded by MAX_BUCKET_COUNT (2^24) and at least 2: a valid dense count.
        CkfFormat::dense(self.seed, bucket_count as u32)
            .map_err(|_| ConfigError::BucketCountTooLarge { bucket_count })
    }

    /// The checks both formats share: a nonzero expected count, a budget in range.
    fn check_budget(&self) -> Result<(), ConfigError> {
        if self.expected_unique_blocks == 0 {
            return Err(ConfigError::ExpectedUniqueBlocksZero);
        }
        if !(1..=MAX_KICKS).contains(&self.max_kicks) {
            return Err(ConfigError::InvalidMaxKicks {
                max_kicks: self.max_kicks,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_count_matches_reference_sizing() {
        for (n, expected) in [
            (1, 2),
            (16, 8),
            (32, 16),
            (64, 32),
            (1000, 512),
            (65_536, 32_768),
            (1 << 20, 524_288),
        ] {
            assert_eq!(bucket_count_for(n), Ok(expected), "n = {n}");
        }
    }

    #[test]
    fn zero_capacity_is_rejected_with_its_message() {
        let err = CkfConfig::new(0).format().unwrap_err();
        assert_eq!(err, ConfigError::ExpectedUniqueBlocksZero);
        assert_eq!(
            err.to_string(),
            "expected unique blocks must be greater than zero"
        );
    }

    #[test]
    fn max_kicks_outside_range_is_rejected() {
        for max_kicks in [0, MAX_KICKS + 1] {
            let config = CkfConfig {
                max_kicks,
                ..CkfConfig::new(10)
            };
            assert_eq!(
                config.format(),
                Err(ConfigError::InvalidMaxKicks { max_kicks })
            );
        }
    }

    #[test]
    fn capacity_beyond_largest_table_is_rejected() {
        assert!(matches!(
            bucket_count_for(u64::MAX),
            Err(ConfigError::CapacityOverflow { .. })
        ));
        assert!(matches!(
            bucket_count_for(60_000_000),
            Err(ConfigError::BucketCountTooLarge { .. })
        ));
    }

    #[test]
    fn dense_sizing_fills_to_the_design_load() {
        for (n, load, expected) in [
            (1, 95, 2),
            (8, 95, 3),
            (1_000_000, 95, 263_158),
            (10_000_000, 95, 2_631_579),
            (1_000_000, 50, 500_000),
        ] {
            assert_eq!(dense_bucket_count_for(n, load), Ok(expected), "n = {n}");
            // The table holds n at no more than the design load, and one bucket fewer
            // would be above it.
            assert!(n * 100 <= expected * 4 * u64::from(load));
            if expected > 2 {
                assert!(n * 100 > (expected - 1) * 4 * u64::from(load));
            }
        }
        let dense = |n| CkfConfig::new(n).with_density(FilterDensity::DENSE);
        let format = dense(10_000_000).format().unwrap();
        assert!(format.is_dense());
        assert_eq!(format.bucket_count(), 2_631_579);
        // Larger than v1 can size (2^24 buckets hold 63.7 M at 95 %).
        assert!(CkfConfig::new(60_000_000).format().is_err());
        assert!(dense(60_000_000).format().is_ok());
    }

    #[test]
    fn size_classes_round_up_within_an_octave_and_share_formats() {
        // 8 classes per octave: 2^19 + j · 2^16.
        for (count, expected) in [
            (524_288, 524_288),
            (524_289, 589_824),
            (657_895, 720_896),
            (1_048_575, 1_048_576),
        ] {
            assert_eq!(size_class_of(count, 8), Ok(expected), "{count}");
        }
        // Never more than one step (1/8 of the octave) above, never below.
        for count in (2u64..200_000).step_by(997) {
            let rounded = size_class_of(count, 8).unwrap();
            let octave = 1u64 << (63 - count.leading_zeros());
            assert!(
                rounded >= count && rounded - count < (octave / 8).max(1),
                "{count}"
            );
        }
        // Pools within a step of each other get one format.
        let classed = |n| {
            CkfConfig::new(n)
                .with_density(FilterDensity::Dense {
                    load_percent: 95,
                    size_classes_per_octave: 8,
                })
                .format()
                .unwrap()
        };
        assert_eq!(classed(2_400_000), classed(2_450_000));
        assert_eq!(classed(2_450_000).bucket_count(), 655_360);
        assert_ne!(classed(2_450_000), classed(2_500_000));
        for classes in [3u8, 65, 128] {
            assert_eq!(
                size_class_of(100, classes),
                Err(ConfigError::InvalidSizeClasses { classes })
            );
        }
    }

    #[test]
    fn dense_sizing_rejects_bad_loads_and_counts() {
        for load_percent in [0, 49, 98, 255] {
            assert_eq!(
                dense_bucket_count_for(100, load_percent),
                Err(ConfigError::InvalidDenseLoad { load_percent })
            );
        }
        assert_eq!(
            dense_bucket_count_for(0, 95),
            Err(ConfigError::ExpectedUniqueBlocksZero)
        );
        assert!(matches!(
            dense_bucket_count_for(u64::MAX, 95),
            Err(ConfigError::CapacityOverflow { .. })
        ));
        assert!(matches!(
            dense_bucket_count_for(64_000_000, 95),
            Err(ConfigError::BucketCountTooLarge { .. })
        ));
        let config = CkfConfig {
            max_kicks: 0,
            ..CkfConfig::new(10)
        };
        assert_eq!(
            config.with_density(FilterDensity::DENSE).format(),
            Err(ConfigError::InvalidMaxKicks { max_kicks: 0 })
        );
        let config = CkfConfig::new(10).with_density(FilterDensity::Dense {
            load_percent: 99,
            size_classes_per_octave: 0,
        });
        assert_eq!(
            config.format(),
            Err(ConfigError::InvalidDenseLoad { load_percent: 99 })
        );
    }
}
