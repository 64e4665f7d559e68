//! Retry backoff: exponential with bounded equal jitter, reset after a healthy period.
//!
//! The delay before attempt `n` (0-based, counting failures since the last reset) is
//! `base = min(initial × 2^n, max)`; the sleep is `base / 2 + jitter` with `jitter` uniform
//! in `[0, base / 2]`. A failure of an attempt that had stayed healthy for at least
//! [`BackoffConfig::healthy_reset`] resets `n` to zero first, so one long-lived connection
//! that finally drops reconnects quickly. A caller without a random source (or one that
//! wants exact delays, as an accept loop does) passes [`NO_JITTER`] and sleeps `base`.

use std::time::Duration;

/// The jitter sample that makes the sleep exactly the base delay.
pub const NO_JITTER: f64 = 1.0;

/// Knobs of one backoff (defaults: 0.5 s doubling to 30 s, reset after 30 s healthy).
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

    /// A backoff doubling from `initial` to `max` whose healthy period is `max`: an attempt
    /// that outlived the longest sleep starts over (the engine-source and watch loops).
    pub const fn doubling(initial: Duration, max: Duration) -> Self {
        Self {
            initial,
            max,
            healthy_reset: max,
        }
    }

    /// Checks the knobs: a first delay of at least 1 ms (a zero delay retries in a busy
    /// loop) and a ceiling no lower than the first delay.
    pub fn validate(&self) -> Result<(), BackoffConfigError> {
        if self.initial < Duration::from_millis(1) {
            return Err(BackoffConfigError::ZeroInitial);
        }
        if self.max < self.initial {
            return Err(BackoffConfigError::MaxBelowInitial {
                initial: self.initial,
                max: self.max,
            });
        }
        Ok(())
    }
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

/// Backoff knobs that cannot work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BackoffConfigError {
    /// The first delay is under a millisecond: retries would spin.
    #[error("the first backoff delay must be at least 1 ms")]
    ZeroInitial,
    /// The ceiling is below the first delay.
    #[error("the backoff ceiling {max:?} is below its first delay {initial:?}")]
    MaxBelowInitial {
        /// The first delay.
        initial: Duration,
        /// The ceiling.
        max: Duration,
    },
}

/// `base / 2` plus `jitter` (a sample in `[0, 1]`, clamped; a non-finite sample counts as
/// 0) times the other half: the sleep of a backoff step of `base`, and of any fixed retry
/// interval that should not have every client retry in step.
pub fn equal_jitter(base: Duration, jitter: f64) -> Duration {
    let half = base / 2;
    let jitter = if jitter.is_finite() {
        jitter.clamp(0.0, 1.0)
    } else {
        0.0
    };
    // `base - half` rather than `half` twice: an odd number of nanoseconds keeps its last
    // one, so `NO_JITTER` sleeps exactly `base`.
    half + (base - half).mul_f64(jitter)
}

/// Backoff state of one retrying loop.
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
    /// to wait before the next one. `jitter` is a sample in `[0, 1]` (clamped; a
    /// non-finite sample counts as 0).
    pub fn on_failure(&mut self, healthy_for: Duration, jitter: f64) -> Duration {
        if healthy_for >= self.config.healthy_reset {
            self.n_failures = 0;
        }
        let base = self.base_delay();
        self.n_failures = self.n_failures.saturating_add(1);
        equal_jitter(base, jitter)
    }

    /// The loop made progress (a socket accepted, an event applied): the next failure
    /// waits about `initial` again.
    pub fn reset(&mut self) {
        self.n_failures = 0;
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
    use proptest::prelude::*;

    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn delay_doubles_from_half_a_second_up_to_the_cap() {
        let mut backoff = Backoff::new(BackoffConfig::default());
        let delays: Vec<Duration> = (0..10)
            .map(|_| backoff.on_failure(Duration::ZERO, NO_JITTER))
            .collect();
        assert_eq!(
            delays,
            [
                500, 1000, 2000, 4000, 8000, 16000, 30000, 30000, 30000, 30000
            ]
            .map(ms)
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
            backoff.on_failure(Duration::ZERO, NO_JITTER);
        }
        assert_eq!(
            backoff.on_failure(Duration::from_secs(30), NO_JITTER),
            ms(500)
        );
        assert_eq!(backoff.n_failures(), 1);
    }

    #[test]
    fn short_lived_attempt_keeps_growing_the_delay() {
        let mut backoff = Backoff::new(BackoffConfig::default());
        backoff.on_failure(Duration::ZERO, NO_JITTER);
        assert_eq!(
            backoff.on_failure(Duration::from_secs(29), NO_JITTER),
            ms(1000)
        );
    }

    #[test]
    fn reset_starts_over_from_the_first_delay() {
        let mut backoff = Backoff::new(BackoffConfig::doubling(ms(100), ms(5000)));
        for _ in 0..4 {
            backoff.on_failure(Duration::ZERO, NO_JITTER);
        }
        backoff.reset();
        assert_eq!(backoff.on_failure(Duration::ZERO, NO_JITTER), ms(100));
    }

    #[test]
    fn non_finite_jitter_counts_as_zero() {
        let mut backoff = Backoff::new(BackoffConfig::default());
        assert_eq!(backoff.on_failure(Duration::ZERO, f64::NAN), ms(250));
    }

    #[test]
    fn unusable_knobs_are_refused() {
        assert_eq!(
            BackoffConfig::doubling(Duration::ZERO, ms(10)).validate(),
            Err(BackoffConfigError::ZeroInitial)
        );
        assert!(matches!(
            BackoffConfig::doubling(ms(20), ms(10)).validate(),
            Err(BackoffConfigError::MaxBelowInitial { .. })
        ));
        assert_eq!(BackoffConfig::default().validate(), Ok(()));
    }

    proptest! {
        /// Against the closed form: every sleep lies in `[base/2, base]` for
        /// `base = min(initial·2^n, max)`, whatever the jitter and the healthy periods.
        #[test]
        fn sleeps_follow_the_closed_form(
            initial_ms in 1u64..10_000,
            extra_ms in 0u64..100_000,
            attempts in proptest::collection::vec((0u64..60_000, any::<f64>()), 1..64),
        ) {
            let config = BackoffConfig {
                initial: ms(initial_ms),
                max: ms(initial_ms + extra_ms),
                healthy_reset: ms(30_000),
            };
            let mut backoff = Backoff::new(config);
            let mut n: u32 = 0;
            for (healthy_ms, jitter) in attempts {
                if ms(healthy_ms) >= config.healthy_reset {
                    n = 0;
                }
                let base = config
                    .initial
                    .checked_mul(1u32.checked_shl(n.min(31)).unwrap_or(u32::MAX))
                    .map_or(config.max, |d| d.min(config.max));
                let sleep = backoff.on_failure(ms(healthy_ms), jitter);
                prop_assert!(sleep >= base / 2 && sleep <= base, "{sleep:?} vs {base:?}");
                n = n.saturating_add(1);
                prop_assert_eq!(backoff.n_failures(), n);
            }
        }
    }
}
