//! [`LogThrottle`]: at most one log line per interval for a repeated event, with the count
//! of the lines it held back.
//!
//! Remote peers can cause the same refusal thousands of times a second; logging each one
//! would let them flood the log (and the disk). Every occurrence is still counted in a
//! metric by the caller; the throttle only decides which ones are also logged.

use std::sync::Mutex;
use std::sync::PoisonError;
use std::time::{Duration, Instant};

/// Default interval between two log lines of one throttled event.
pub const DEFAULT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Lets one occurrence per interval through.
#[derive(Debug)]
pub struct LogThrottle {
    interval: Duration,
    state: Mutex<ThrottleState>,
}

#[derive(Debug, Default)]
struct ThrottleState {
    last: Option<Instant>,
    suppressed: u64,
}

impl LogThrottle {
    /// A throttle letting one occurrence per `interval` through.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new(ThrottleState::default()),
        }
    }

    /// Records one occurrence at `now`: `Some(held back since the last line)` when this one
    /// should be logged, `None` when it is held back.
    pub fn admit(&self, now: Instant) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let due = state
            .last
            .is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if due {
            state.last = Some(now);
            Some(std::mem::take(&mut state.suppressed))
        } else {
            state.suppressed += 1;
            None
        }
    }
}

impl Default for LogThrottle {
    fn default() -> Self {
        Self::new(DEFAULT_LOG_INTERVAL)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_reports_what_it_held_back() {
        let throttle = LogThrottle::new(Duration::from_secs(10));
        let start = Instant::now();
        assert_eq!(throttle.admit(start), Some(0));
        assert_eq!(throttle.admit(start + Duration::from_secs(1)), None);
        assert_eq!(throttle.admit(start + Duration::from_secs(9)), None);
        assert_eq!(throttle.admit(start + Duration::from_secs(10)), Some(2));
        assert_eq!(throttle.admit(start + Duration::from_secs(11)), None);
    }
}
