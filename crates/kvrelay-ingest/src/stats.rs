//! Per-source counters: batches, events, filtered events, gaps, replays, resets and
//! rejections per kind.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::RejectionKind;

/// A snapshot of one source's counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceStats {
    /// Transport messages (batches) received, live or replayed.
    pub n_messages: u64,
    /// Router events emitted.
    pub n_events: u64,
    /// Engine events dropped by the filtering rule.
    pub n_filtered: u64,
    /// Sequence gaps detected.
    pub n_gaps: u64,
    /// Replays requested.
    pub n_replays: u64,
    /// Source resets (the source's state was cleared).
    pub n_resets: u64,
    /// Rejections per kind; kinds never seen are absent.
    pub rejected: BTreeMap<RejectionKind, u64>,
}

impl SourceStats {
    /// Rejections of `kind`.
    pub fn rejected(&self, kind: RejectionKind) -> u64 {
        self.rejected.get(&kind).copied().unwrap_or(0)
    }

    /// Rejections of every kind.
    pub fn n_rejected(&self) -> u64 {
        self.rejected.values().sum()
    }
}

/// Shared atomic counters a source's tasks bump and its handle reads.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    messages: AtomicU64,
    events: AtomicU64,
    filtered: AtomicU64,
    gaps: AtomicU64,
    replays: AtomicU64,
    resets: AtomicU64,
    rejected: [AtomicU64; RejectionKind::ALL.len()],
}

impl Counters {
    pub(crate) fn shared() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub(crate) fn message(&self) {
        self.messages.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn events(&self, n: usize) {
        self.events.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn filtered(&self, n: usize) {
        self.filtered.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub(crate) fn gap(&self) {
        self.gaps.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn replay(&self) {
        self.replays.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn reset(&self) {
        self.resets.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn reject(&self, kind: RejectionKind) {
        self.rejected[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> SourceStats {
        let mut rejected = BTreeMap::new();
        for kind in RejectionKind::ALL {
            let n = self.rejected[kind.index()].load(Ordering::Relaxed);
            if n > 0 {
                rejected.insert(kind, n);
            }
        }
        SourceStats {
            n_messages: self.messages.load(Ordering::Relaxed),
            n_events: self.events.load(Ordering::Relaxed),
            n_filtered: self.filtered.load(Ordering::Relaxed),
            n_gaps: self.gaps.load(Ordering::Relaxed),
            n_replays: self.replays.load(Ordering::Relaxed),
            n_resets: self.resets.load(Ordering::Relaxed),
            rejected,
        }
    }
}
