//! A byte budget for what one source holds: every received message is admitted against it
//! before it is queued, and gives its bytes back when the last holder drops it, wherever
//! that is (the reader-to-driver queue, the sequence tracker's replay buffer, the batch being
//! applied). So a source's memory for messages is bounded in bytes, not only in counts. The
//! held bytes live in the source's counters, so its stats show them and their peak.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;

use crate::stats::Counters;

/// The bytes one source may hold; cheap to clone (shared).
#[derive(Debug, Clone)]
pub(crate) struct ByteBudget {
    counters: Arc<Counters>,
    max: usize,
}

impl ByteBudget {
    pub(crate) fn new(max: usize, counters: Arc<Counters>) -> Self {
        Self { counters, max }
    }

    /// Admits `bytes` if they fit what is left; `None` (nothing taken) if not.
    pub(crate) fn admit(&self, bytes: Bytes) -> Option<Metered> {
        let len = bytes.len();
        let held = self
            .counters
            .queued_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(len).filter(|total| *total <= self.max)
            })
            .ok()?;
        self.counters.queued_peak(held + len);
        Some(Metered {
            bytes,
            budget: self.clone(),
        })
    }

    /// Bytes held now.
    pub(crate) fn held(&self) -> usize {
        self.counters.queued_bytes.load(Ordering::Acquire)
    }
}

/// A message admitted against a [`ByteBudget`]; its bytes return to the budget on drop.
#[derive(Debug)]
pub(crate) struct Metered {
    bytes: Bytes,
    budget: ByteBudget,
}

impl Metered {
    /// The message.
    pub(crate) fn bytes(&self) -> &Bytes {
        &self.bytes
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        self.budget
            .counters
            .queued_bytes
            .fetch_sub(self.bytes.len(), Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_until_full_and_returns_bytes_on_drop() {
        let counters = Counters::shared();
        let budget = ByteBudget::new(10, counters.clone());
        let first = budget.admit(Bytes::from(vec![0; 6]));
        assert!(first.is_some());
        assert_eq!(budget.held(), 6);
        assert!(
            budget.admit(Bytes::from(vec![0; 5])).is_none(),
            "6 + 5 > 10"
        );
        assert_eq!(budget.held(), 6, "a refusal takes nothing");
        let second = budget.admit(Bytes::from(vec![0; 4]));
        assert_eq!(budget.held(), 10);
        drop(first);
        assert_eq!(budget.held(), 4);
        drop(second);
        assert_eq!(budget.held(), 0);
        assert!(budget.admit(Bytes::from(vec![0; 11])).is_none());
        assert!(
            budget.admit(Bytes::new()).is_some(),
            "an empty message always fits"
        );
        let stats = counters.snapshot();
        assert_eq!((stats.queued_bytes, stats.peak_queued_bytes), (0, 10));
    }
}
