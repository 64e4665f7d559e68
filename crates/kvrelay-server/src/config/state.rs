//! `[state]`: where the relay keeps pool checkpoints between runs.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// Pool checkpoints (see docs/operations.md, "Warm restart"). Absent: no checkpoints, a
/// restart rebuilds every pool from what the engines still replay.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StateConfig {
    /// The directory (created if missing) holding one checkpoint file per pool.
    pub dir: PathBuf,
    /// How often every pool is checkpointed, in milliseconds (also on graceful shutdown).
    pub checkpoint_interval_ms: u64,
    /// A checkpoint older than this at start is discarded, in milliseconds.
    pub max_age_ms: u64,
    /// A checkpoint file larger than this is neither written nor read, in bytes.
    pub max_file_bytes: u64,
    /// How long graceful shutdown waits for the final checkpoint of every pool, in
    /// milliseconds, before it stops without it.
    pub shutdown_timeout_ms: u64,
}

/// Default checkpoint period.
pub const DEFAULT_CHECKPOINT_INTERVAL_MS: u64 = 10_000;
/// Default staleness bound: older checkpoints predate any engine's replay ring.
pub const DEFAULT_CHECKPOINT_MAX_AGE_MS: u64 = 24 * 3600 * 1000;
/// Default bound on the final checkpoint at shutdown.
pub const DEFAULT_CHECKPOINT_SHUTDOWN_TIMEOUT_MS: u64 = 10_000;
/// Default file bound: 16 bytes per mapping, so about 67 M mappings.
pub const DEFAULT_CHECKPOINT_MAX_FILE_BYTES: u64 = 1 << 30;

impl Default for StateConfig {
    fn default() -> Self {
        Self {
            dir: PathBuf::from("kvrelay-state"),
            checkpoint_interval_ms: DEFAULT_CHECKPOINT_INTERVAL_MS,
            max_age_ms: DEFAULT_CHECKPOINT_MAX_AGE_MS,
            max_file_bytes: DEFAULT_CHECKPOINT_MAX_FILE_BYTES,
            shutdown_timeout_ms: DEFAULT_CHECKPOINT_SHUTDOWN_TIMEOUT_MS,
        }
    }
}

impl StateConfig {
    /// The checkpoint period.
    pub fn checkpoint_interval(&self) -> Duration {
        Duration::from_millis(self.checkpoint_interval_ms)
    }

    /// The staleness bound.
    pub fn max_age(&self) -> Duration {
        Duration::from_millis(self.max_age_ms)
    }

    /// The bound on the final checkpoint at shutdown.
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown_timeout_ms)
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let positive = [
            ("state.checkpoint_interval_ms", self.checkpoint_interval_ms),
            ("state.max_age_ms", self.max_age_ms),
            ("state.max_file_bytes", self.max_file_bytes),
            ("state.shutdown_timeout_ms", self.shutdown_timeout_ms),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(ConfigError::InvalidField {
                    field,
                    value: value.to_string(),
                    reason: "must be greater than zero",
                });
            }
        }
        if self.dir.as_os_str().is_empty() {
            return Err(ConfigError::InvalidField {
                field: "state.dir",
                value: String::new(),
                reason: "must name a directory",
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_bounds_and_an_empty_dir_are_refused() {
        assert!(StateConfig::default().validate().is_ok());
        for broken in [
            StateConfig {
                checkpoint_interval_ms: 0,
                ..StateConfig::default()
            },
            StateConfig {
                max_age_ms: 0,
                ..StateConfig::default()
            },
            StateConfig {
                max_file_bytes: 0,
                ..StateConfig::default()
            },
            StateConfig {
                dir: PathBuf::new(),
                ..StateConfig::default()
            },
        ] {
            assert!(broken.validate().is_err(), "{broken:?}");
        }
    }
}
