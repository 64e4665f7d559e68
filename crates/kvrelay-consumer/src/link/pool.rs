//! One pool stream's consumer side, sans-IO: what a message from the relay means for the
//! subscription, when the stream is stale or its snapshot overdue, what becomes of the
//! replica when the stream ends, and when to subscribe again.
//!
//! [`PoolStream`] is one attempt (one open stream); [`PoolFollow`] spans the attempts of
//! one producer generation. The tokio client (`client.rs`) opens streams, moves messages
//! and applies checked frames to the state under its lock; every decision is here, fed the
//! caller's `now` and a jitter sample, and tested as a pair with the relay's publisher on
//! a simulated clock (`pair_tests.rs`).

use std::time::{Duration, Instant};

use kvrelay_codec::v1::{ErrorMessage, ErrorReason, Message, ProducerIdentity, RelayIdentity};
use kvrelay_pacing::{Backoff, BackoffConfig};

use crate::metrics::ResubscribeReason;
use crate::state::{CheckedPoolFrame, FrameOutcome, PoolFrameRefused};
use crate::store::StoreError;

/// What becomes of a replica when its pool stream ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaAfterStream {
    /// Kept intact and not scored; the next subscription names its sequence to resume.
    Suspend,
    /// Dropped: the next subscription starts from a snapshot.
    Invalidate,
}

/// A pool stream ended with `reason` (`None`: stopped without a fault), its relay's epoch
/// being over (`epoch_ended`) or not.
pub(crate) fn replica_after_stream(
    reason: Option<ResubscribeReason>,
    epoch_ended: bool,
) -> ReplicaAfterStream {
    match reason {
        // Broken in transit: the replica is intact.
        Some(
            ResubscribeReason::Disconnected | ResubscribeReason::Lagged | ResubscribeReason::Stale,
        ) => ReplicaAfterStream::Suspend,
        // The relay's epoch ended: its next epoch may resume this pool.
        None if epoch_ended => ReplicaAfterStream::Suspend,
        _ => ReplicaAfterStream::Invalidate,
    }
}

/// The resubscribe reason of an error frame that ended a pool stream: the one map from
/// the relay's reasons to the consumer's.
pub(crate) fn resubscribe_reason(reason: ErrorReason) -> ResubscribeReason {
    match reason {
        ErrorReason::SubscriberLagged => ResubscribeReason::Lagged,
        ErrorReason::ProducerChanged | ErrorReason::PoolNotFound => {
            ResubscribeReason::ProducerChanged
        }
        ErrorReason::InvalidPublication => ResubscribeReason::Validation,
        _ => ResubscribeReason::Disconnected,
    }
}

/// When a snapshot being assembled got its first chunk, to bound its assembly.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SnapshotAssembly {
    timeout: Duration,
    since: Option<Instant>,
}

impl SnapshotAssembly {
    pub(crate) fn new(timeout: Duration) -> Self {
        Self {
            timeout,
            since: None,
        }
    }

    /// How long a snapshot may take to assemble.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// A frame was applied at `now`; `chunk_stored` when it was a snapshot chunk that did
    /// not complete the snapshot. True when the snapshot has been assembling for longer
    /// than the timeout: the stream must be renewed (`Stale`).
    pub(crate) fn handle_frame(&mut self, now: Instant, chunk_stored: bool) -> bool {
        if !chunk_stored {
            self.since = None;
            return false;
        }
        let since = *self.since.get_or_insert(now);
        now.saturating_duration_since(since) > self.timeout
    }
}

/// Why one pool stream ended; each carries what the driver logs.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEnd {
    /// The relay ended the stream with an error frame.
    Refused {
        /// What the consumer makes of the relay's reason.
        reason: ResubscribeReason,
        /// The relay's error.
        error: ErrorMessage,
    },
    /// A frame failed its checks or the replica refused it.
    FrameRefused(PoolFrameRefused),
    /// The relay sent a message a pool stream never carries.
    Unexpected {
        /// The message's kind.
        kind: &'static str,
    },
    /// A frame of another relay incarnation: the relay restarted.
    RelayRestarted,
    /// Nothing arrived within the staleness bound.
    Stale {
        /// The bound.
        bound: Duration,
    },
    /// Frames flowed but the snapshot did not complete within the assembly timeout.
    SnapshotOverdue {
        /// The timeout.
        timeout: Duration,
    },
    /// The connection closed or failed (the driver logs its error).
    Disconnected,
}

impl StreamEnd {
    /// The reason the subscription is renewed for.
    pub fn reason(&self) -> ResubscribeReason {
        match self {
            StreamEnd::Refused { reason, .. } => *reason,
            StreamEnd::FrameRefused(refused) => refused.reason,
            StreamEnd::Unexpected { .. } => ResubscribeReason::Validation,
            StreamEnd::RelayRestarted => ResubscribeReason::RelayRestart,
            StreamEnd::Stale { .. } | StreamEnd::SnapshotOverdue { .. } => ResubscribeReason::Stale,
            StreamEnd::Disconnected => ResubscribeReason::Disconnected,
        }
    }
}

/// One open pool stream of `producer` at relay incarnation `relay`.
#[derive(Debug, Clone)]
pub struct PoolStream {
    relay: RelayIdentity,
    producer: ProducerIdentity,
    staleness: Duration,
    stale_at: Instant,
    assembly: SnapshotAssembly,
}

impl PoolStream {
    /// A stream opened at `now`: it must hear from the relay within `staleness`, and a
    /// snapshot must complete within `assembly_timeout` of its first chunk.
    pub fn new(
        relay: RelayIdentity,
        producer: ProducerIdentity,
        staleness: Duration,
        assembly_timeout: Duration,
        now: Instant,
    ) -> Self {
        Self {
            relay,
            producer,
            staleness,
            stale_at: now + staleness,
            assembly: SnapshotAssembly::new(assembly_timeout),
        }
    }

    /// A message arrived at `now`: the frame to apply, checked against the subscribed
    /// producer with its payload copied out (no lock needed), or why the stream ends.
    pub fn handle_message(
        &mut self,
        now: Instant,
        message: &Message,
    ) -> Result<CheckedPoolFrame, StreamEnd> {
        self.stale_at = now + self.staleness;
        let frame = match message {
            Message::PoolFrame(frame) => frame,
            Message::Error(error) => {
                return Err(StreamEnd::Refused {
                    reason: resubscribe_reason(error.effective_reason()),
                    error: error.clone(),
                });
            }
            other => {
                return Err(StreamEnd::Unexpected {
                    kind: other.kind().name(),
                });
            }
        };
        if frame.header.relay != self.relay {
            return Err(StreamEnd::RelayRestarted);
        }
        CheckedPoolFrame::check(frame, &self.producer).map_err(StreamEnd::FrameRefused)
    }

    /// The state applied a frame at `now` with `outcome`: what it did, or why the stream
    /// ends (the replica refused it, or the snapshot is overdue).
    pub fn handle_applied(
        &mut self,
        now: Instant,
        outcome: Result<FrameOutcome, PoolFrameRefused>,
    ) -> Result<FrameOutcome, StreamEnd> {
        let outcome = outcome.map_err(StreamEnd::FrameRefused)?;
        let chunk_stored = matches!(outcome, FrameOutcome::ChunkStored);
        if self.assembly.handle_frame(now, chunk_stored) {
            return Err(StreamEnd::SnapshotOverdue {
                timeout: self.assembly.timeout(),
            });
        }
        Ok(outcome)
    }

    /// When the stream is stale unless a message arrives first.
    pub fn poll_timeout(&self) -> Instant {
        self.stale_at
    }

    /// The clock reached `now`: the stream's end when it is stale.
    pub fn handle_timeout(&self, now: Instant) -> Option<StreamEnd> {
        (now >= self.stale_at).then_some(StreamEnd::Stale {
            bound: self.staleness,
        })
    }
}

/// Why a subscription could not begin: the reason to retry for, or `None` when the
/// generation left the catalog (stop for good).
pub fn begin_refused(err: &StoreError) -> Option<ResubscribeReason> {
    match err {
        // The replica is dropped (no slot); memory may come back.
        StoreError::Allocation { .. } => Some(ResubscribeReason::Allocation),
        // Pools may leave and free lanes.
        StoreError::OverTableBudget { .. } => Some(ResubscribeReason::OverBudget),
        _ => None,
    }
}

/// What follows the end of one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AfterAttempt {
    /// What becomes of the replica.
    pub replica: ReplicaAfterStream,
    /// When to subscribe again; `None`: never (stopped, or the relay's epoch ended).
    pub retry_at: Option<Instant>,
}

/// The attempts of one producer generation's subscription.
#[derive(Debug, Clone)]
pub struct PoolFollow {
    backoff: Backoff,
    started: Instant,
}

impl PoolFollow {
    /// A subscription whose first attempt starts at `now`.
    pub fn new(backoff: BackoffConfig, now: Instant) -> Self {
        Self {
            backoff: Backoff::new(backoff),
            started: now,
        }
    }

    /// An attempt starts at `now`.
    pub fn handle_attempt(&mut self, now: Instant) {
        self.started = now;
    }

    /// The attempt ended at `now` for `reason` (`None`: stopped without a fault, or the
    /// generation left the catalog), the relay's epoch being over (`epoch_ended`) or not.
    ///
    /// No reset for reaching current: a relay that breaks every stream right after its
    /// snapshot must not get a snapshot download per base delay. The backoff resets itself
    /// once an attempt stayed up for its healthy period.
    pub fn handle_ended(
        &mut self,
        now: Instant,
        reason: Option<ResubscribeReason>,
        epoch_ended: bool,
        jitter: f64,
    ) -> AfterAttempt {
        let replica = replica_after_stream(reason, epoch_ended);
        let retry_at = match reason {
            Some(_) if !epoch_ended => {
                let healthy_for = now.saturating_duration_since(self.started);
                Some(now + self.backoff.on_failure(healthy_for, jitter))
            }
            _ => None,
        };
        AfterAttempt { replica, retry_at }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_pacing::NO_JITTER;

    #[test]
    fn a_subscription_that_cannot_begin_retries_only_for_memory() {
        assert_eq!(
            begin_refused(&StoreError::UnknownKey { key: 1 }),
            None,
            "a generation that left the catalog is not retried"
        );
    }

    #[test]
    fn attempts_back_off_and_an_ended_epoch_or_a_stop_never_retries() {
        let t0 = Instant::now();
        let config = BackoffConfig::doubling(Duration::from_millis(100), Duration::from_secs(5));
        let mut follow = PoolFollow::new(config, t0);
        let first = follow.handle_ended(t0, Some(ResubscribeReason::Lagged), false, NO_JITTER);
        assert_eq!(first.replica, ReplicaAfterStream::Suspend);
        let first_at = first.retry_at.expect("retried");
        follow.handle_attempt(first_at);
        let second = follow.handle_ended(
            first_at,
            Some(ResubscribeReason::Checksum),
            false,
            NO_JITTER,
        );
        assert_eq!(second.replica, ReplicaAfterStream::Invalidate);
        let second_delay = second.retry_at.expect("retried") - first_at;
        assert!(
            second_delay > first_at - t0,
            "the delay grows: {second_delay:?}"
        );
        let stopped = follow.handle_ended(first_at, None, false, 0.5);
        assert_eq!(
            stopped,
            AfterAttempt {
                replica: ReplicaAfterStream::Invalidate,
                retry_at: None
            }
        );
        let epoch = follow.handle_ended(first_at, Some(ResubscribeReason::Disconnected), true, 0.5);
        assert_eq!(
            epoch,
            AfterAttempt {
                replica: ReplicaAfterStream::Suspend,
                retry_at: None
            }
        );
    }

    #[test]
    fn streams_broken_in_transit_keep_their_replica() {
        for reason in [
            ResubscribeReason::Disconnected,
            ResubscribeReason::Lagged,
            ResubscribeReason::Stale,
        ] {
            assert_eq!(
                replica_after_stream(Some(reason), false),
                ReplicaAfterStream::Suspend
            );
        }
        for reason in [
            ResubscribeReason::Gap,
            ResubscribeReason::ProducerChanged,
            ResubscribeReason::Checksum,
            ResubscribeReason::Validation,
            ResubscribeReason::RelayRestart,
            ResubscribeReason::Allocation,
            ResubscribeReason::OverBudget,
        ] {
            assert_eq!(
                replica_after_stream(Some(reason), true),
                ReplicaAfterStream::Invalidate,
                "{reason:?}"
            );
        }
        assert_eq!(
            replica_after_stream(None, true),
            ReplicaAfterStream::Suspend
        );
        assert_eq!(
            replica_after_stream(None, false),
            ReplicaAfterStream::Invalidate,
            "the generation left the catalog"
        );
    }

    #[test]
    fn relay_reasons_map_to_resubscribe_reasons() {
        assert_eq!(
            resubscribe_reason(ErrorReason::SubscriberLagged),
            ResubscribeReason::Lagged
        );
        assert_eq!(
            resubscribe_reason(ErrorReason::PoolNotFound),
            ResubscribeReason::ProducerChanged
        );
        assert_eq!(
            resubscribe_reason(ErrorReason::ProducerChanged),
            ResubscribeReason::ProducerChanged
        );
        assert_eq!(
            resubscribe_reason(ErrorReason::InvalidPublication),
            ResubscribeReason::Validation
        );
        assert_eq!(
            resubscribe_reason(ErrorReason::SnapshotProgressTimeout),
            ResubscribeReason::Disconnected
        );
    }

    #[test]
    fn a_snapshot_assembling_too_long_is_renewed() {
        let start = Instant::now();
        let mut assembly = SnapshotAssembly::new(Duration::from_secs(120));
        assert!(!assembly.handle_frame(start, true));
        assert!(!assembly.handle_frame(start + Duration::from_secs(120), true));
        assert!(assembly.handle_frame(start + Duration::from_secs(121), true));
        // A completed snapshot (or any other frame) restarts the clock.
        assert!(!assembly.handle_frame(start + Duration::from_secs(122), false));
        assert!(!assembly.handle_frame(start + Duration::from_secs(300), true));
    }
}
