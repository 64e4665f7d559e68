//! Filter sizing: the v1 [`CkfFormat`] for an expected number of unique blocks, the seed
//! and the relocation budget.

use kvrelay_identity::{CkfFormat, DEFAULT_CKF_SEED};

use crate::image::MAX_BUCKET_COUNT;

/// Default relocation budget (evictions tried before an insert gives up and rolls back).
pub const DEFAULT_MAX_KICKS: u32 = 500;

/// Largest accepted relocation budget.
pub const MAX_KICKS: u32 = 4096;

/// Smallest bucket count.
pub const MIN_BUCKET_COUNT: u64 = 2;

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

/// How to build a producer filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CkfConfig {
    /// How many distinct live blocks the pool is expected to hold (sizes the table).
    pub expected_unique_blocks: u64,
    /// The addressing seed (also seeds the deterministic relocation choices).
    pub seed: u64,
    /// Relocation budget per insert, `1..=MAX_KICKS`.
    pub max_kicks: u32,
}

impl CkfConfig {
    /// A config for `expected_unique_blocks` with the default seed and relocation budget.
    pub fn new(expected_unique_blocks: u64) -> Self {
        Self {
            expected_unique_blocks,
            seed: DEFAULT_CKF_SEED,
            max_kicks: DEFAULT_MAX_KICKS,
        }
    }

    /// Validates the config and returns its v1 format (seed and sized bucket count).
    pub fn format(&self) -> Result<CkfFormat, ConfigError> {
        if self.expected_unique_blocks == 0 {
            return Err(ConfigError::ExpectedUniqueBlocksZero);
        }
        if !(1..=MAX_KICKS).contains(&self.max_kicks) {
            return Err(ConfigError::InvalidMaxKicks {
                max_kicks: self.max_kicks,
            });
        }
        let bucket_count = bucket_count_for(self.expected_unique_blocks)?;
        // bucket_count_for bounds the count by MAX_BUCKET_COUNT (2^24), a valid v1 count.
        CkfFormat::v1(self.seed, bucket_count as u32)
            .map_err(|_| ConfigError::BucketCountTooLarge { bucket_count })
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
}
