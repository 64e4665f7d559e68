//! A pool actor's health, readable without its mailbox.
//!
//! The actor writes its counters here after every command; submitters stamp each event
//! as it enters the mailbox and the actor retires the stamp once the event is applied or
//! rejected. Readers copy the cell under one short lock (never held across an await), so
//! a read costs the same at any table size and still answers while the actor is stuck:
//! that is how a stall is seen at all.

use std::collections::VecDeque;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::time::Instant;

use crate::actor::{ActorFault, FaultCategory, PoolActorStats};

/// One actor's health at a given instant.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolHealth {
    /// Counters and filter statistics as of the actor's last command.
    pub stats: PoolActorStats,
    /// The latest fault of each category that had one, in category order.
    pub latest_faults: Vec<ActorFault>,
    /// Commands queued in the mailbox (events and requests).
    pub mailbox_depth: usize,
    /// The mailbox's capacity (`actor_mailbox`).
    pub mailbox_capacity: usize,
    /// Events submitted and not yet applied or rejected.
    pub pending_events: usize,
    /// How long the oldest pending event has waited; `None` when nothing is pending.
    pub oldest_pending_age: Option<Duration>,
    /// How long pending work has gone without the actor finishing a command: zero when
    /// nothing is pending, else the time since the later of the last finished command and
    /// the oldest pending event's arrival.
    pub stalled_for: Duration,
    /// Time since the last event was applied or rejected; `None` before the first.
    pub since_last_event: Option<Duration>,
    /// Whether the actor task has exited.
    pub stopped: bool,
}

impl PoolHealth {
    /// Whether pending work has made no progress for at least `bound` (a stopped actor is
    /// retired, not stalled).
    pub fn is_stalled(&self, bound: Duration) -> bool {
        !self.stopped && self.pending_events > 0 && self.stalled_for >= bound
    }

    /// The latest fault of `category`, if any.
    pub fn latest_fault(&self, category: FaultCategory) -> Option<&ActorFault> {
        self.latest_faults
            .iter()
            .find(|fault| fault.category() == category)
    }
}

/// The shared cell behind [`PoolHealth`].
#[derive(Debug)]
pub(crate) struct HealthCell {
    inner: Mutex<HealthInner>,
    mailbox_capacity: usize,
}

#[derive(Debug)]
struct HealthInner {
    stats: PoolActorStats,
    latest_faults: [Option<ActorFault>; 3],
    /// Arrival of every pending event, oldest first (at most the mailbox capacity times
    /// `MAX_EVENTS_PER_BATCH`).
    pending: VecDeque<Instant>,
    last_progress: Instant,
    last_event: Option<Instant>,
}

impl HealthCell {
    pub(crate) fn new(now: Instant, mailbox_capacity: usize) -> Self {
        Self {
            inner: Mutex::new(HealthInner {
                stats: PoolActorStats::default(),
                latest_faults: Default::default(),
                pending: VecDeque::new(),
                last_progress: now,
                last_event: None,
            }),
            mailbox_capacity,
        }
    }

    /// Stamps one event's arrival and runs `send` under the same lock, so stamps are in
    /// mailbox order.
    pub(crate) fn enqueue(&self, now: Instant, send: impl FnOnce()) {
        self.enqueue_many(now, 1, send);
    }

    /// Stamps `count` events arriving together (one batch command) and runs `send` under
    /// the same lock.
    pub(crate) fn enqueue_many(&self, now: Instant, count: usize, send: impl FnOnce()) {
        let mut inner = self.inner.lock();
        inner.pending.extend(std::iter::repeat_n(now, count));
        send();
    }

    /// The actor's update after a run of commands (or a timer publication), of which
    /// `events_done` were events (each retires its pending stamp).
    pub(crate) fn record(
        &self,
        now: Instant,
        stats: PoolActorStats,
        latest_faults: &[Option<ActorFault>; 3],
        events_done: usize,
    ) {
        let mut inner = self.inner.lock();
        inner.stats = stats;
        if inner.latest_faults != *latest_faults {
            inner.latest_faults.clone_from(latest_faults);
        }
        inner.last_progress = now;
        if events_done > 0 {
            let done = events_done.min(inner.pending.len());
            inner.pending.drain(..done);
            inner.last_event = Some(now);
        }
    }

    pub(crate) fn read(&self, now: Instant, mailbox_depth: usize, stopped: bool) -> PoolHealth {
        let inner = self.inner.lock();
        let oldest = inner.pending.front().copied();
        let stalled_for = match oldest {
            Some(oldest) => now.saturating_duration_since(oldest.max(inner.last_progress)),
            None => Duration::ZERO,
        };
        PoolHealth {
            stats: inner.stats,
            latest_faults: inner.latest_faults.iter().flatten().cloned().collect(),
            mailbox_depth,
            mailbox_capacity: self.mailbox_capacity,
            pending_events: inner.pending.len(),
            oldest_pending_age: oldest.map(|oldest| now.saturating_duration_since(oldest)),
            stalled_for,
            since_last_event: inner
                .last_event
                .map(|last| now.saturating_duration_since(last)),
            stopped,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pending_work_without_progress_is_a_stall() {
        let start = Instant::now();
        let cell = HealthCell::new(start, 8);
        let idle = cell.read(start + Duration::from_secs(60), 0, false);
        assert!(
            !idle.is_stalled(Duration::from_secs(1)),
            "idle is not stalled"
        );

        // An event arriving after a long idle spell is not stalled the moment it arrives.
        let arrival = start + Duration::from_secs(60);
        cell.enqueue(arrival, || {});
        let fresh = cell.read(arrival, 1, false);
        assert_eq!(fresh.stalled_for, Duration::ZERO);
        let later = cell.read(arrival + Duration::from_secs(2), 1, false);
        assert_eq!(later.pending_events, 1);
        assert_eq!(later.oldest_pending_age, Some(Duration::from_secs(2)));
        assert!(later.is_stalled(Duration::from_secs(2)));
        assert!(!later.is_stalled(Duration::from_secs(3)));
        assert!(
            !cell
                .read(arrival + Duration::from_secs(2), 1, true)
                .is_stalled(Duration::from_secs(1)),
            "a stopped actor is not stalled"
        );

        // Applying it clears the stall and records the last event.
        let applied = arrival + Duration::from_secs(3);
        cell.record(applied, PoolActorStats::default(), &Default::default(), 1);
        let after = cell.read(applied + Duration::from_secs(1), 0, false);
        assert_eq!(after.pending_events, 0);
        assert_eq!(after.since_last_event, Some(Duration::from_secs(1)));
        assert!(!after.is_stalled(Duration::ZERO));
    }

    #[test]
    fn progress_on_other_commands_moves_the_stall_clock() {
        let start = Instant::now();
        let cell = HealthCell::new(start, 8);
        cell.enqueue(start, || {});
        cell.enqueue(start, || {});
        cell.record(
            start + Duration::from_secs(5),
            PoolActorStats::default(),
            &Default::default(),
            1,
        );
        let health = cell.read(start + Duration::from_secs(6), 1, false);
        assert_eq!(health.pending_events, 1);
        assert_eq!(health.stalled_for, Duration::from_secs(1));
        assert_eq!(health.oldest_pending_age, Some(Duration::from_secs(6)));
    }

    #[test]
    fn a_run_of_events_retires_that_many_stamps_and_never_more() {
        let start = Instant::now();
        let cell = HealthCell::new(start, 8);
        for at in 0..5 {
            cell.enqueue(start + Duration::from_secs(at), || {});
        }
        cell.record(start, PoolActorStats::default(), &Default::default(), 3);
        let health = cell.read(start + Duration::from_secs(10), 2, false);
        assert_eq!(health.pending_events, 2);
        assert_eq!(health.oldest_pending_age, Some(Duration::from_secs(7)));
        cell.record(start, PoolActorStats::default(), &Default::default(), 9);
        assert_eq!(cell.read(start, 0, false).pending_events, 0);
    }
}
