//! Rate-limited rejection logging: one [`LogBudget`] per reason, so a flood of bad input
//! costs a counter bump per message and a few log lines, never one line per message, and
//! one noisy reason never hides another.

use std::time::{Duration, Instant};

use kvrelay_pacing::LogBudget;

use crate::error::RejectionKind;

/// Per-reason log budget of one source.
#[derive(Debug)]
pub(crate) struct RejectionLog {
    budgets: [LogBudget; RejectionKind::ALL.len()],
}

impl RejectionLog {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            budgets: [LogBudget::new(interval); RejectionKind::ALL.len()],
        }
    }

    /// Notes one rejection of `kind` at `now`; returns the count to log (this one plus
    /// those held back since the previous line) when a line is due, else `None`.
    pub(crate) fn note(&mut self, kind: RejectionKind, now: Instant) -> Option<u64> {
        self.budgets[kind.index()]
            .admit(now)
            .map(|held_back| held_back + 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_reason_and_interval_with_the_count() {
        let start = Instant::now();
        let mut log = RejectionLog::new(Duration::from_secs(10));
        assert_eq!(log.note(RejectionKind::Malformed, start), Some(1));
        for i in 1..10_000u64 {
            let now = start + Duration::from_millis(i / 2);
            assert_eq!(log.note(RejectionKind::Malformed, now), None);
        }
        // Another reason has its own budget.
        assert_eq!(log.note(RejectionKind::Framing, start), Some(1));
        let later = start + Duration::from_secs(10);
        assert_eq!(log.note(RejectionKind::Malformed, later), Some(10_000));
        assert_eq!(log.note(RejectionKind::Malformed, later), None);
    }
}
