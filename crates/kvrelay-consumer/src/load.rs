//! Load samples per pool, from the relays' load windows.
//!
//! Missing is not zero: a sample yields an occupancy fraction only when every expected
//! rank reported and the capacity is known.

/// The latest KV occupancy a relay reported for one pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LoadSample {
    /// KV blocks in use, summed over reporting ranks.
    pub kv_used_blocks: u64,
    /// KV block capacity, summed over ranks with known capacity.
    pub total_kv_blocks: u64,
    /// Ranks that reported.
    pub observed_ranks: u32,
    /// Ranks the pool declares.
    pub expected_ranks: u32,
}

impl LoadSample {
    /// Occupancy in `[0, 1]`, or `None` when coverage is incomplete or capacity unknown.
    pub fn fraction(&self) -> Option<f64> {
        let complete = self.expected_ranks > 0 && self.observed_ranks >= self.expected_ranks;
        if !complete || self.total_kv_blocks == 0 {
            return None;
        }
        Some((self.kv_used_blocks as f64 / self.total_kv_blocks as f64).clamp(0.0, 1.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incomplete_rank_coverage_has_no_fraction() {
        let sample = LoadSample {
            kv_used_blocks: 10,
            total_kv_blocks: 100,
            observed_ranks: 1,
            expected_ranks: 2,
        };
        assert_eq!(sample.fraction(), None);
    }

    #[test]
    fn unknown_capacity_has_no_fraction() {
        let sample = LoadSample {
            kv_used_blocks: 0,
            total_kv_blocks: 0,
            observed_ranks: 2,
            expected_ranks: 2,
        };
        assert_eq!(sample.fraction(), None);
    }

    #[test]
    fn complete_sample_yields_occupancy() {
        let sample = LoadSample {
            kv_used_blocks: 25,
            total_kv_blocks: 100,
            observed_ranks: 2,
            expected_ranks: 2,
        };
        assert_eq!(sample.fraction(), Some(0.25));
    }
}
