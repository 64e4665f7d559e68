//! Log budgets: at most one log line per interval for a repeated event, carrying the
//! count of the occurrences it held back.
//!
//! Remote peers can cause the same refusal thousands of times a second; logging each one
//! would let them flood the log (and the disk). Every occurrence is still counted in a
//! metric by the caller; the budget only decides which ones are also logged.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Default interval between two log lines of one budgeted event: 10 s.
pub const DEFAULT_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Lets one occurrence per interval through; owned by one task.
#[derive(Debug, Clone, Copy)]
pub struct LogBudget {
    interval: Duration,
    last_line: Option<Instant>,
    held_back: u64,
}

impl LogBudget {
    /// A budget letting one occurrence per `interval` through.
    pub const fn new(interval: Duration) -> Self {
        Self {
            interval,
            last_line: None,
            held_back: 0,
        }
    }

    /// Records one occurrence at `now`: `Some(held back since the last line)` when this
    /// one should be logged, `None` when it is held back.
    pub fn admit(&mut self, now: Instant) -> Option<u64> {
        let due = self
            .last_line
            .is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if due {
            self.last_line = Some(now);
            Some(std::mem::take(&mut self.held_back))
        } else {
            self.held_back = self.held_back.saturating_add(1);
            None
        }
    }
}

impl Default for LogBudget {
    fn default() -> Self {
        Self::new(DEFAULT_LOG_INTERVAL)
    }
}

/// A [`LogBudget`] shared by the tasks of one listener or stream server.
#[derive(Debug, Default)]
pub struct SharedLogBudget(Mutex<LogBudget>);

impl SharedLogBudget {
    /// A shared budget letting one occurrence per `interval` through.
    pub const fn new(interval: Duration) -> Self {
        Self(Mutex::new(LogBudget::new(interval)))
    }

    /// [`LogBudget::admit`] under the lock (a poisoned lock is taken over: the budget
    /// holds no invariant a panic could break).
    pub fn admit(&self, now: Instant) -> Option<u64> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .admit(now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_interval_reports_what_it_held_back() {
        let mut budget = LogBudget::new(Duration::from_secs(10));
        let start = Instant::now();
        assert_eq!(budget.admit(start), Some(0));
        assert_eq!(budget.admit(start + Duration::from_secs(1)), None);
        assert_eq!(budget.admit(start + Duration::from_secs(9)), None);
        assert_eq!(budget.admit(start + Duration::from_secs(10)), Some(2));
        assert_eq!(budget.admit(start + Duration::from_secs(11)), None);
    }

    #[test]
    fn a_flood_costs_one_line_per_interval() {
        let budget = SharedLogBudget::new(Duration::from_secs(10));
        let start = Instant::now();
        let logged = (0..20_000u64)
            .filter(|i| budget.admit(start + Duration::from_millis(*i)).is_some())
            .count();
        // 20 s of occurrences, one per millisecond: lines at 0 s and 10 s only.
        assert_eq!(logged, 2);
    }
}
