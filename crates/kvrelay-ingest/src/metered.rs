//! A byte budget for what one source holds: every received message is admitted against it
//! before it is queued, and gives its bytes back when the last holder drops it, wherever
//! that is (the reader-to-driver queue, the sequence tracker's replay buffer, the batch being
//! applied). So a source's memory for messages is bounded in bytes, not only in counts. The
//! held bytes live in the source's counters, so its stats show them and their peak.
//!
//! Sources may also share a [`QueueBudget`]: what all of them hold together, so a relay's
//! memory for queued messages is bounded whatever the number of engines it reads.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;

use crate::stats::Counters;

/// The bytes several sources may hold together (`Limits::max_queued_bytes_total`); cheap
/// to clone, every clone is the same budget.
#[derive(Debug, Clone)]
pub struct QueueBudget {
    inner: Arc<SharedBytes>,
}

/// Two handles are equal when they are the same budget.
impl PartialEq for QueueBudget {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Eq for QueueBudget {}

#[derive(Debug)]
struct SharedBytes {
    held: AtomicUsize,
    max: usize,
}

impl QueueBudget {
    /// A budget of `max` bytes, none held.
    pub fn new(max: usize) -> Self {
        Self {
            inner: Arc::new(SharedBytes {
                held: AtomicUsize::new(0),
                max,
            }),
        }
    }

    /// Bytes held now by every source sharing it.
    pub fn held(&self) -> usize {
        self.inner.held.load(Ordering::Acquire)
    }

    /// Its bound.
    pub fn max(&self) -> usize {
        self.inner.max
    }

    fn reserve(&self, len: usize) -> bool {
        self.inner
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(len)
                    .filter(|total| *total <= self.inner.max)
            })
            .is_ok()
    }

    fn release(&self, len: usize) {
        self.inner.held.fetch_sub(len, Ordering::AcqRel);
    }
}

/// The bytes one source may hold; cheap to clone (shared).
#[derive(Debug, Clone)]
pub(crate) struct ByteBudget {
    counters: Arc<Counters>,
    max: usize,
    /// What this source shares with others, if anything.
    shared: Option<QueueBudget>,
}

impl ByteBudget {
    pub(crate) fn new(max: usize, counters: Arc<Counters>, shared: Option<QueueBudget>) -> Self {
        Self {
            counters,
            max,
            shared,
        }
    }

    /// Admits `bytes` if they fit what is left of this source's budget and of the shared
    /// one; `None` (nothing taken from either) if not.
    pub(crate) fn admit(&self, bytes: Bytes) -> Option<Metered> {
        let len = bytes.len();
        let held = self
            .counters
            .queued_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(len).filter(|total| *total <= self.max)
            })
            .ok()?;
        if let Some(shared) = &self.shared
            && !shared.reserve(len)
        {
            self.counters.queued_bytes.fetch_sub(len, Ordering::AcqRel);
            return None;
        }
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

    /// What is held against which bound, for the message that explains a refusal.
    pub(crate) fn describe(&self) -> String {
        let own = format!(
            "the source holds {} bytes (max_queued_bytes {})",
            self.held(),
            self.max
        );
        match &self.shared {
            Some(shared) => format!(
                "{own}, all sources {} bytes (max_queued_bytes_total {})",
                shared.held(),
                shared.max()
            ),
            None => own,
        }
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
        if let Some(shared) = &self.budget.shared {
            shared.release(self.bytes.len());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_until_full_and_returns_bytes_on_drop() {
        let counters = Counters::shared();
        let budget = ByteBudget::new(10, counters.clone(), None);
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

    #[test]
    fn sources_sharing_a_budget_hold_at_most_it_together() {
        let shared = QueueBudget::new(10);
        let (a_counters, b_counters) = (Counters::shared(), Counters::shared());
        let a = ByteBudget::new(8, a_counters.clone(), Some(shared.clone()));
        let b = ByteBudget::new(8, b_counters.clone(), Some(shared.clone()));
        let held_by_a = a.admit(Bytes::from(vec![0; 6])).unwrap();
        // Within b's own 8 bytes, but 6 + 5 is over the shared 10: refused, nothing taken.
        assert!(b.admit(Bytes::from(vec![0; 5])).is_none());
        assert_eq!((b.held(), shared.held()), (0, 6));
        assert!(
            b.describe().contains("max_queued_bytes_total 10"),
            "{}",
            b.describe()
        );
        let held_by_b = b.admit(Bytes::from(vec![0; 4])).unwrap();
        assert_eq!(shared.held(), 10);
        // Over a's own bound comes first: the shared budget is not touched.
        assert!(a.admit(Bytes::from(vec![0; 3])).is_none());
        assert_eq!(shared.held(), 10);
        drop(held_by_a);
        assert_eq!((a.held(), shared.held()), (0, 4));
        assert!(
            b.admit(Bytes::from(vec![0; 4])).is_some(),
            "dropped at once"
        );
        drop(held_by_b);
        assert_eq!(shared.held(), 0);
        assert_eq!(a_counters.snapshot().peak_queued_bytes, 6);
    }
}
