//! Rate-limited rejection logging, pure: one line per reason and interval, carrying the
//! count since the previous line, so a flood of bad input costs a counter bump per
//! message and a few log lines, never one line per message.

use std::time::{Duration, Instant};

use crate::error::RejectionKind;

/// Per-reason log budget of one source.
#[derive(Debug)]
pub(crate) struct RejectionLog {
    interval: Duration,
    entries: [Entry; RejectionKind::ALL.len()],
}

#[derive(Debug, Default, Clone, Copy)]
struct Entry {
    last_line: Option<Instant>,
    suppressed: u64,
}

impl RejectionLog {
    pub(crate) fn new(interval: Duration) -> Self {
        Self {
            interval,
            entries: [Entry::default(); RejectionKind::ALL.len()],
        }
    }

    /// Notes one rejection of `kind` at `now`; returns the count to log (this one plus
    /// those suppressed since the previous line) when a line is due, else `None`.
    pub(crate) fn note(&mut self, kind: RejectionKind, now: Instant) -> Option<u64> {
        let entry = &mut self.entries[kind.index()];
        entry.suppressed += 1;
        let due = entry
            .last_line
            .is_none_or(|last| now.saturating_duration_since(last) >= self.interval);
        if !due {
            return None;
        }
        entry.last_line = Some(now);
        Some(std::mem::take(&mut entry.suppressed))
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
