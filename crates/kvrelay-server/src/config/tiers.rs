//! `[tiers]`: the lower cache tiers (host memory, disk) each pool keeps a lane of.

use kvrelay_ckf::CacheTier;
use kvrelay_pool::LaneRequest;
use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Which lower tiers every pool keeps a lane of (see docs/ingest.md, "Lower tiers").
/// Absent tables: the pool keeps device memory only and its sources filter lower-tier
/// events, as before tiers existed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TiersConfig {
    /// Host memory (vLLM `CPU` offload, SGLang `CPU_PINNED`, Dynamo KVBM `host_pinned`).
    pub host: Option<TierConfig>,
    /// Local disk or storage (vLLM `DISK`/`STORAGE`, Dynamo KVBM `disk`).
    pub disk: Option<TierConfig>,
}

/// One lower tier's lane, for every pool.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierConfig {
    /// The lane's filter holds this many times the blocks its pool's device filter is
    /// sized for (cards say nothing about lower tiers). Host memory is often 4–10× the
    /// GPU's KV cache.
    pub capacity_ratio: f64,
    /// Device blocks per block of this tier: vLLM's offloaded block size over its GPU
    /// block size (1 when they are equal, or with self-describing offload events).
    pub blocks_per_chunk: u32,
}

/// Default [`TierConfig::capacity_ratio`].
pub const DEFAULT_TIER_CAPACITY_RATIO: f64 = 4.0;
/// Largest [`TierConfig::capacity_ratio`].
pub const MAX_TIER_CAPACITY_RATIO: f64 = 1024.0;
/// Largest [`TierConfig::blocks_per_chunk`].
pub const MAX_BLOCKS_PER_CHUNK: u32 = 1024;

impl Default for TierConfig {
    fn default() -> Self {
        Self {
            capacity_ratio: DEFAULT_TIER_CAPACITY_RATIO,
            blocks_per_chunk: 1,
        }
    }
}

impl TiersConfig {
    /// Whether any lower tier is kept (sources then emit tier events).
    pub fn any(&self) -> bool {
        self.host.is_some() || self.disk.is_some()
    }

    fn tiers(&self) -> impl Iterator<Item = (CacheTier, &'static str, &TierConfig)> {
        [
            (CacheTier::Host, "tiers.host", self.host.as_ref()),
            (CacheTier::Disk, "tiers.disk", self.disk.as_ref()),
        ]
        .into_iter()
        .filter_map(|(tier, table, config)| config.map(|config| (tier, table, config)))
    }

    /// The lanes of a pool of `block_size`-token blocks whose device filter is sized for
    /// `device_blocks`.
    pub fn lanes(&self, block_size: u32, device_blocks: u64) -> Vec<LaneRequest> {
        self.tiers()
            .map(|(tier, _, config)| LaneRequest {
                tier,
                // Saturating: a ratio of a huge pool stays a number the registry refuses
                // against its memory bound, never wraps.
                expected_unique_blocks: ((device_blocks as f64) * config.capacity_ratio)
                    .clamp(1.0, u64::MAX as f64) as u64,
                block_size: block_size.saturating_mul(config.blocks_per_chunk),
                density: kvrelay_ckf::FilterDensity::V1,
            })
            .collect()
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        for (_, table, config) in self.tiers() {
            let ratio = config.capacity_ratio;
            if !(ratio.is_finite() && ratio > 0.0 && ratio <= MAX_TIER_CAPACITY_RATIO) {
                return Err(ConfigError::InvalidField {
                    field: if table == "tiers.host" {
                        "tiers.host.capacity_ratio"
                    } else {
                        "tiers.disk.capacity_ratio"
                    },
                    value: ratio.to_string(),
                    reason: "must be a number above 0 and at most 1024",
                });
            }
            if config.blocks_per_chunk == 0 || config.blocks_per_chunk > MAX_BLOCKS_PER_CHUNK {
                return Err(ConfigError::InvalidField {
                    field: if table == "tiers.host" {
                        "tiers.host.blocks_per_chunk"
                    } else {
                        "tiers.disk.blocks_per_chunk"
                    },
                    value: config.blocks_per_chunk.to_string(),
                    reason: "must be between 1 and 1024",
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test")]

    use std::path::Path;

    use super::*;
    use crate::config::RelayConfig;

    #[test]
    fn no_tiers_by_default_and_lanes_follow_the_pool() {
        let config = RelayConfig::from_toml_str("", Path::new("relay.toml")).unwrap();
        assert!(!config.tiers.any());
        let config = RelayConfig::from_toml_str(
            "[tiers.host]\nblocks_per_chunk = 2\n[tiers.disk]\ncapacity_ratio = 16.0\n",
            Path::new("relay.toml"),
        )
        .unwrap();
        assert!(config.tiers.any());
        config.tiers.validate().unwrap();
        assert_eq!(
            config.tiers.lanes(16, 1000),
            vec![
                LaneRequest {
                    tier: CacheTier::Host,
                    expected_unique_blocks: 4000,
                    block_size: 32,
                    density: kvrelay_ckf::FilterDensity::V1,
                },
                LaneRequest {
                    tier: CacheTier::Disk,
                    expected_unique_blocks: 16_000,
                    block_size: 16,
                    density: kvrelay_ckf::FilterDensity::V1,
                },
            ]
        );
    }

    #[test]
    fn bad_tier_values_are_refused_naming_the_field() {
        for (text, field) in [
            (
                "[tiers.host]\ncapacity_ratio = 0.0\n",
                "tiers.host.capacity_ratio",
            ),
            (
                "[tiers.disk]\ncapacity_ratio = -1.0\n",
                "tiers.disk.capacity_ratio",
            ),
            (
                "[tiers.host]\ncapacity_ratio = nan\n",
                "tiers.host.capacity_ratio",
            ),
            (
                "[tiers.host]\ncapacity_ratio = 2000.0\n",
                "tiers.host.capacity_ratio",
            ),
            (
                "[tiers.disk]\nblocks_per_chunk = 0\n",
                "tiers.disk.blocks_per_chunk",
            ),
            (
                "[tiers.host]\nblocks_per_chunk = 4096\n",
                "tiers.host.blocks_per_chunk",
            ),
        ] {
            let config = RelayConfig::from_toml_str(text, Path::new("relay.toml")).unwrap();
            let err = config.tiers.validate().unwrap_err();
            assert!(
                matches!(&err, ConfigError::InvalidField { field: got, .. } if *got == field),
                "{text}: {err}"
            );
        }
        let unknown = RelayConfig::from_toml_str("[tiers.gpu]\n", Path::new("relay.toml"));
        assert!(unknown.is_err(), "an unknown tier is refused");
    }
}
