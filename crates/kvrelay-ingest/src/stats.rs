//! Per-source counters: batches, events, filtered events, gaps, replays (requested and by
//! outcome), resets (by cause), reader restarts, transport connects and disconnects, and
//! rejections per kind.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::RejectionKind;
use crate::sequence::ResetReason;

/// How one replay ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReplayOutcome {
    /// It ended and delivered at least one missing batch.
    Recovered,
    /// It ended with nothing missing (a tail probe that found no lost batches).
    Empty,
    /// The engine's buffer had moved on: batches stayed missing and the source reset.
    Incomplete,
    /// The request failed or timed out; the source reset.
    Failed,
}

impl ReplayOutcome {
    /// Every outcome, in counter order.
    pub const ALL: [ReplayOutcome; 4] = [
        ReplayOutcome::Recovered,
        ReplayOutcome::Empty,
        ReplayOutcome::Incomplete,
        ReplayOutcome::Failed,
    ];

    /// A stable lowercase name (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            ReplayOutcome::Recovered => "recovered",
            ReplayOutcome::Empty => "empty",
            ReplayOutcome::Incomplete => "incomplete",
            ReplayOutcome::Failed => "failed",
        }
    }

    fn index(self) -> usize {
        match self {
            ReplayOutcome::Recovered => 0,
            ReplayOutcome::Empty => 1,
            ReplayOutcome::Incomplete => 2,
            ReplayOutcome::Failed => 3,
        }
    }
}

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
    /// Live copies of batches a replay had already delivered, dropped (the replay socket
    /// was ahead of the live one; not a publisher restart).
    pub n_late_copies: u64,
    /// Replays requested (gap, late join and tail probes).
    pub n_replays: u64,
    /// Source resets (the source's state was cleared).
    pub n_resets: u64,
    /// Reader restarts after the reader failed or panicked.
    pub n_restarts: u64,
    /// Transport connections established (handshake completed).
    pub n_connects: u64,
    /// Transport connections lost (publisher gone, heartbeat timeout, oversized frame).
    pub n_disconnects: u64,
    /// Disconnects after batches without a replay endpoint: a tail the publisher still
    /// held may be lost and cannot be checked.
    pub n_unverified_tails: u64,
    /// Replays per outcome; outcomes never seen are absent.
    pub replays: BTreeMap<ReplayOutcome, u64>,
    /// Resets per cause ([`ResetReason::CAUSES`]); causes never seen are absent.
    pub resets: BTreeMap<&'static str, u64>,
    /// Rejections per kind; kinds never seen are absent.
    pub rejected: BTreeMap<RejectionKind, u64>,
    /// Bytes of received messages the source holds now (ZMQ; bounded by
    /// `Limits::max_queued_bytes`).
    pub queued_bytes: u64,
    /// The most it has held at once.
    pub peak_queued_bytes: u64,
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

    /// Replays that ended with `outcome`.
    pub fn replays(&self, outcome: ReplayOutcome) -> u64 {
        self.replays.get(&outcome).copied().unwrap_or(0)
    }

    /// Resets of cause `cause` (a [`ResetReason::CAUSES`] name).
    pub fn resets(&self, cause: &str) -> u64 {
        self.resets.get(cause).copied().unwrap_or(0)
    }
}

/// Shared atomic counters a source's tasks bump and its handle reads.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    messages: AtomicU64,
    events: AtomicU64,
    filtered: AtomicU64,
    gaps: AtomicU64,
    late_copies: AtomicU64,
    replays: AtomicU64,
    resets: AtomicU64,
    restarts: AtomicU64,
    connects: AtomicU64,
    disconnects: AtomicU64,
    unverified_tails: AtomicU64,
    replay_outcomes: [AtomicU64; ReplayOutcome::ALL.len()],
    reset_causes: [AtomicU64; ResetReason::CAUSES.len()],
    rejected: [AtomicU64; RejectionKind::ALL.len()],
    /// What the source's byte budget holds (`crate::metered`), and its peak.
    pub(crate) queued_bytes: std::sync::atomic::AtomicUsize,
    peak_queued_bytes: AtomicU64,
}

fn bump(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

fn load(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

impl Counters {
    pub(crate) fn shared() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Notes that the byte budget now holds `held` bytes.
    pub(crate) fn queued_peak(&self, held: usize) {
        self.peak_queued_bytes
            .fetch_max(u64::try_from(held).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    pub(crate) fn message(&self) {
        bump(&self.messages, 1);
    }

    pub(crate) fn events(&self, n: usize) {
        bump(&self.events, n as u64);
    }

    pub(crate) fn filtered(&self, n: usize) {
        bump(&self.filtered, n as u64);
    }

    pub(crate) fn gap(&self) {
        bump(&self.gaps, 1);
    }

    pub(crate) fn late_copy(&self) {
        bump(&self.late_copies, 1);
    }

    pub(crate) fn replay(&self) {
        bump(&self.replays, 1);
    }

    pub(crate) fn replay_outcome(&self, outcome: ReplayOutcome) {
        bump(&self.replay_outcomes[outcome.index()], 1);
    }

    pub(crate) fn reset(&self, reason: &ResetReason) {
        bump(&self.resets, 1);
        bump(&self.reset_causes[reason.cause_index()], 1);
    }

    pub(crate) fn restart(&self) {
        bump(&self.restarts, 1);
    }

    pub(crate) fn connect(&self) {
        bump(&self.connects, 1);
    }

    pub(crate) fn disconnect(&self) {
        bump(&self.disconnects, 1);
    }

    pub(crate) fn unverified_tail(&self) {
        bump(&self.unverified_tails, 1);
    }

    pub(crate) fn reject(&self, kind: RejectionKind) {
        bump(&self.rejected[kind.index()], 1);
    }

    pub(crate) fn snapshot(&self) -> SourceStats {
        let mut rejected = BTreeMap::new();
        for kind in RejectionKind::ALL {
            let n = load(&self.rejected[kind.index()]);
            if n > 0 {
                rejected.insert(kind, n);
            }
        }
        let mut replays = BTreeMap::new();
        for outcome in ReplayOutcome::ALL {
            let n = load(&self.replay_outcomes[outcome.index()]);
            if n > 0 {
                replays.insert(outcome, n);
            }
        }
        let mut resets = BTreeMap::new();
        for (cause, counter) in ResetReason::CAUSES.iter().zip(&self.reset_causes) {
            let n = load(counter);
            if n > 0 {
                resets.insert(*cause, n);
            }
        }
        SourceStats {
            n_messages: load(&self.messages),
            n_events: load(&self.events),
            n_filtered: load(&self.filtered),
            n_gaps: load(&self.gaps),
            n_late_copies: load(&self.late_copies),
            n_replays: load(&self.replays),
            n_resets: load(&self.resets),
            n_restarts: load(&self.restarts),
            n_connects: load(&self.connects),
            n_disconnects: load(&self.disconnects),
            n_unverified_tails: load(&self.unverified_tails),
            replays,
            resets,
            rejected,
            queued_bytes: u64::try_from(self.queued_bytes.load(Ordering::Acquire))
                .unwrap_or(u64::MAX),
            peak_queued_bytes: load(&self.peak_queued_bytes),
        }
    }
}
