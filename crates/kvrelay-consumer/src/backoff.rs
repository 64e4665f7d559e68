//! Reconnect backoff: exponential with bounded equal jitter, reset after a healthy period.
//!
//! The delay before attempt `n` (0-based, counting failures since the last reset) is
//! `base = min(initial × 2^n, max)`; the sleep is `base / 2 + jitter` with `jitter` uniform
//! in `[0, base / 2]`. A failure of an attempt that had stayed healthy for at least
//! [`BackoffConfig::healthy_reset`] resets `n` to zero first, so one long-lived connection
//! that finally drops reconnects quickly. Pure: the caller passes the attempt's healthy
//! duration and a jitter sample in `[0, 1]`.

use std::time::Duration;

/// Knobs of the reconnect backoff (defaults: 0.5 s doubling to 30 s, reset after 30 s).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffConfig {
    /// First delay before jitter.
    pub initial: Duration,
    /// Upper bound of the delay before jitter.
    pub max: Duration,
    /// An attempt that stayed up this long counts as healthy and resets the delay.
    pub healthy_reset: Duration,
}

impl BackoffConfig {
    /// Default first delay: 500 ms.
    pub const DEFAULT_INITIAL: Duration = Duration::from_millis(500);
    /// Default maximum delay: 30 s.
    pub const DEFAULT_MAX: Duration = Duration::from_secs(30);
    /// Default healthy period that resets the delay: 30 s.
    pub const DEFAULT_HEALTHY_RESET: Duration = Duration::from_secs(30);
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Self {
            initial: Self::DEFAULT_INITIAL,
            max: Self::DEFAULT_MAX,
            healthy_reset: Self::DEFAULT_HEALTHY_RESET,
        }
    }
}

/// Backoff state of one reconnecting task.
#[derive(Debug, Clone)]
pub struct Backoff {
    config: BackoffConfig,
    n_failures: u32,
}

impl Backoff {
    /// A fresh backoff: the next failure waits about `initial`.
    pub fn new(config: BackoffConfig) -> Self {
        Self {
            config,
            n_failures: 0,
        }
    }

    /// Records a failed attempt that had been up for `healthy_for` and returns the delay
    /// to wait before the next one. `jitter` is a sample in `[0, 1]` (clamped).
    pub fn on_failure(&mut self, healthy_for: Duration, jitter: f64) -> Duration {
        if healthy_for >= self.config.healthy_reset {
            self.n_failures = 0;
        }
        let base = self.base_delay();
        self.n_failures = self.n_failures.saturating_add(1);
        let half = base / 2;
        let jitter = if jitter.is_finite() {
            jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        half + half.mul_f64(jitter)
    }

    /// Number of failures counted since the last reset.
    pub fn n_failures(&self) -> u32 {
        self.n_failures
    }

    /// The delay before jitter for the next failure.
    fn base_delay(&self) -> Duration {
        let factor = 1u32
            .checked_shl(self.n_failures.min(31))
            .unwrap_or(u32::MAX);
        self.config
            .initial
            .checked_mul(factor)
            .map_or(self.config.max, |delay| delay.min(self.config.max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn delay_doubles_from_half_a_second_up_to_the_cap() {
        let mut backoff = Backoff::new(BackoffConfig::default());
        let delays: Vec<Duration> = (0..10)
            .map(|_| backoff.on_failure(Duration::ZERO, 1.0))
            .collect();
        assert_eq!(
            delays,
            vec![
                ms(500),
                ms(1000),
                ms(2000),
                ms(4000),
                ms(8000),
                ms(16000),
                ms(30000),
                ms(30000),
                ms(30000),
                ms(30000)
            ]
        );
    }

    #[test]
    fn jitter_keeps_the_delay_between_half_and_full_base() {
        let mut low = Backoff::new(BackoffConfig::default());
        let mut high = Backoff::new(BackoffConfig::default());
        for _ in 0..8 {
            let lo = low.on_failure(Duration::ZERO, 0.0);
            let hi = high.on_failure(Duration::ZERO, 1.0);
            assert_eq!(lo * 2, hi);
        }
    }

    #[test]
    fn healthy_attempt_resets_the_delay() {
        let mut backoff = Backoff::new(BackoffConfig::default());
        for _ in 0..5 {
            backoff.on_failure(Duration::ZERO, 1.0);
        }
        assert_eq!(backoff.on_failure(Duration::from_secs(30), 1.0), ms(500));
        assert_eq!(backoff.n_failures(), 1);
    }

    #[test]
    fn short_lived_attempt_keeps_growing_the_delay() {
        let mut backoff = Backoff::new(BackoffConfig::default());
        backoff.on_failure(Duration::ZERO, 1.0);
        assert_eq!(backoff.on_failure(Duration::from_secs(29), 1.0), ms(1000));
    }

    #[test]
    fn non_finite_jitter_counts_as_zero() {
        let mut backoff = Backoff::new(BackoffConfig::default());
        assert_eq!(backoff.on_failure(Duration::ZERO, f64::NAN), ms(250));
    }
}
