//! `[filters]`: which CKF format every pool's filter is built in.

use kvrelay_ckf::format::DEFAULT_DENSE_LOAD_PERCENT;
use kvrelay_ckf::{CkfConfig, FilterDensity};
use serde::{Deserialize, Serialize};

use super::ConfigError;

/// A pool filter's format, as `[filters] format` names it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FilterFormat {
    /// CKF format 1, the reference's: every consumer reads it, and the Dynamo-contract
    /// door can publish it. About 27 bits per membership at its usual 60 % load.
    #[default]
    V1,
    /// CKF format 2, kvrelay's dense format: the table sized to be `dense_load_percent`
    /// full at the pool's expected blocks (16.8 bits per membership at 95 %). Consumers
    /// older than the format quarantine such a pool as unsupported (named and counted),
    /// so upgrade routers first.
    Dense,
    /// Both, for fleets upgrading their routers: every pool is published in v1 and has
    /// a dense *format twin* (a device lane in the catalog's `tier_lanes`, fed the pool
    /// filter's membership log: the same blocks, no exact index of its own). Routers that
    /// read the dense format follow the twin; older ones never see it and keep the v1
    /// pool. The twin adds its table and dirty window to the pool's memory (docs/pool.md);
    /// the `[dynamo]` door publishes the v1 pools.
    V1AndDense,
}

/// `[filters]`: the format of every pool's filter (tier lanes stay v1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FiltersConfig {
    /// `"v1"` (the default), `"dense"` or `"v1_and_dense"`.
    pub format: FilterFormat,
    /// The dense table's design load, in percent of its slots at the pool's expected
    /// blocks (50..=97; 95 by default). Ignored for v1.
    pub dense_load_percent: u8,
    /// Dense sizes per octave the bucket count is rounded up to (0, or a power of two up
    /// to 64; 8 by default): pools of similar capacity then share a format, so a router
    /// answers them from one query table with one probe per position, at up to 1/8 more
    /// memory. 0 sizes every pool exactly (fewest bits; a router then keeps one table per
    /// distinct pool size). Ignored for v1.
    pub dense_size_classes_per_octave: u8,
}

/// Default [`FiltersConfig::dense_size_classes_per_octave`].
pub const DEFAULT_DENSE_SIZE_CLASSES_PER_OCTAVE: u8 = 8;

impl Default for FiltersConfig {
    fn default() -> Self {
        Self {
            format: FilterFormat::V1,
            dense_load_percent: DEFAULT_DENSE_LOAD_PERCENT,
            dense_size_classes_per_octave: DEFAULT_DENSE_SIZE_CLASSES_PER_OCTAVE,
        }
    }
}

impl FiltersConfig {
    /// Checks the load, and that a `[dynamo]` door (whose contract carries format 1
    /// only) is not asked to publish dense filters.
    pub fn validate(&self, dynamo_door: bool) -> Result<(), ConfigError> {
        // The rules are ckf's (one place): both values are checked through its sizing,
        // whatever the format, so a bad value is refused before anyone switches to dense.
        match CkfConfig::new(1).with_density(self.dense()).format() {
            Err(kvrelay_ckf::ConfigError::InvalidDenseLoad { load_percent }) => {
                return Err(ConfigError::InvalidField {
                    field: "filters.dense_load_percent",
                    value: load_percent.to_string(),
                    reason: "must be in 50..=97",
                });
            }
            Err(kvrelay_ckf::ConfigError::InvalidSizeClasses { classes }) => {
                return Err(ConfigError::InvalidField {
                    field: "filters.dense_size_classes_per_octave",
                    value: classes.to_string(),
                    reason: "must be 0 or a power of two up to 64",
                });
            }
            // One block always sizes: nothing else can fail here.
            Ok(_) | Err(_) => {}
        }
        if self.format == FilterFormat::Dense && dynamo_door {
            return Err(ConfigError::InvalidField {
                field: "filters.format",
                value: "dense".to_owned(),
                reason: "the [dynamo] door publishes the Dynamo contract, which carries CKF \
                         format 1 only: use \"v1\" or \"v1_and_dense\", or remove [dynamo]",
            });
        }
        Ok(())
    }

    /// The density pools are built in.
    pub fn density(&self) -> FilterDensity {
        match self.format {
            FilterFormat::V1 | FilterFormat::V1AndDense => FilterDensity::V1,
            FilterFormat::Dense => self.dense(),
        }
    }

    /// The density of every pool's format twin, if pools have one (`"v1_and_dense"`).
    pub fn twin_density(&self) -> Option<FilterDensity> {
        (self.format == FilterFormat::V1AndDense).then(|| self.dense())
    }

    fn dense(&self) -> FilterDensity {
        FilterDensity::Dense {
            load_percent: self.dense_load_percent,
            size_classes_per_octave: self.dense_size_classes_per_octave,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn parse(text: &str) -> Result<FiltersConfig, toml::de::Error> {
        toml::from_str(text)
    }

    #[test]
    fn v1_is_the_default_and_dense_is_sized_at_95_percent() {
        let config = parse("").unwrap();
        assert_eq!(config, FiltersConfig::default());
        assert_eq!(config.density(), FilterDensity::V1);
        let config = parse("format = \"dense\"").unwrap();
        assert_eq!(
            config.density(),
            FilterDensity::Dense {
                load_percent: 95,
                size_classes_per_octave: 8
            }
        );
        let config =
            parse("format = \"dense\"\ndense_load_percent = 90\ndense_size_classes_per_octave = 0")
                .unwrap();
        assert_eq!(
            config.density(),
            FilterDensity::Dense {
                load_percent: 90,
                size_classes_per_octave: 0
            }
        );
        assert_eq!(config.validate(false), Ok(()));
    }

    #[test]
    fn bad_values_are_refused_naming_the_field() {
        assert!(parse("format = \"sparse\"").is_err());
        assert!(parse("density = \"dense\"").is_err());
        for load in [0u8, 49, 98, 255] {
            let config = FiltersConfig {
                dense_load_percent: load,
                ..FiltersConfig::default()
            };
            let Err(ConfigError::InvalidField { field, .. }) = config.validate(false) else {
                panic!("load {load} accepted");
            };
            assert_eq!(field, "filters.dense_load_percent");
        }
        for classes in [3u8, 12, 128] {
            let config = FiltersConfig {
                dense_size_classes_per_octave: classes,
                ..FiltersConfig::default()
            };
            let Err(ConfigError::InvalidField { field, .. }) = config.validate(false) else {
                panic!("{classes} classes accepted");
            };
            assert_eq!(field, "filters.dense_size_classes_per_octave");
        }
    }

    #[test]
    fn the_dynamo_door_refuses_dense_filters() {
        let dense = parse("format = \"dense\"").unwrap();
        let Err(ConfigError::InvalidField { field, reason, .. }) = dense.validate(true) else {
            panic!("dense accepted with a Dynamo door");
        };
        assert_eq!(field, "filters.format");
        assert!(reason.contains("format 1 only"), "{reason}");
        assert_eq!(FiltersConfig::default().validate(true), Ok(()));
        // Publishing both keeps the door's pools v1.
        let both = parse("format = \"v1_and_dense\"").unwrap();
        assert_eq!(both.validate(true), Ok(()));
    }

    #[test]
    fn v1_and_dense_builds_v1_pools_with_dense_twins() {
        let both = parse("format = \"v1_and_dense\"\ndense_load_percent = 90").unwrap();
        assert_eq!(both.density(), FilterDensity::V1);
        assert_eq!(
            both.twin_density(),
            Some(FilterDensity::Dense {
                load_percent: 90,
                size_classes_per_octave: 8
            })
        );
        assert_eq!(FiltersConfig::default().twin_density(), None);
        assert_eq!(parse("format = \"dense\"").unwrap().twin_density(), None);
    }
}
