//! Per-source batch sequence tracking: a pure state machine.
//!
//! The async source feeds it live batches ([`SequenceTracker::handle_live`]) and replay
//! replies ([`SequenceTracker::handle_replay`], [`SequenceTracker::handle_replay_end`],
//! [`SequenceTracker::handle_replay_failed`]), then drains [`SequenceTracker::poll_action`]
//! until `None`. Rules:
//!
//! - the first batch seen is applied when it is sequence 0 or there is no replay
//!   endpoint; otherwise (joining a running engine, or a slow subscription) the tracker
//!   first replays from 0 to recover what the engine still buffers, as for a gap;
//! - a source connected with a replay endpoint that sees no batch for a while (joining an
//!   idle engine that published before the relay came up) asks for a replay from 0 when the
//!   owner reports the quiet ([`SequenceTracker::handle_quiet_join`]), so what the engine
//!   still buffers is recovered even if it never publishes again;
//! - the next sequence is applied; a jump forward is a **gap**: with a replay endpoint the
//!   tracker asks for a replay from the first missing sequence and buffers live batches
//!   until the replay ends, then applies the buffer in order; without one it resets;
//! - a sequence at or below the last applied one (publisher restart) **resets** the
//!   source and starts over as for a first batch (replaying the new incarnation from 0
//!   when the batch is not sequence 0);
//! - a replay that skips sequences, fails, or overflows the live buffer cannot close the
//!   gap: the source **resets** and continues from the first batch it still has;
//! - after a replay, the replay socket may have been ahead of the live one: live copies of
//!   batches the replay already delivered can still arrive. Until the live stream reaches
//!   the next new sequence, such a **late copy** (a sequence the replay delivered, above 0,
//!   each later than the previous late copy, at most `max_buffered` behind) is dropped and
//!   reported, not taken for a publisher restart (which would clear the source and replay
//!   its whole history again). A restarted publisher starts again at 0, which is never a
//!   late copy.
//!
//! A reset tells the owner to clear everything the source reported before it. Replies of
//! an abandoned replay are ignored by epoch.

use std::collections::VecDeque;

/// Where a restored source continues: the last batch its state holds, and the XXH3-64 of
/// that batch's payload (as [`crate::SourceOutput::Applied`] reported it), by which the engine
/// that answers the replay is recognised as the one that published it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResumePoint {
    /// The batch's sequence.
    pub last_applied: u64,
    /// XXH3-64 of its payload.
    pub digest: u64,
}

impl ResumePoint {
    /// Whether `seq` (payload `payload`), the first batch the resume replay returned,
    /// shows another engine: at or below the checkpointed batch, but not that batch with
    /// its digest.
    pub fn contradicted_by(&self, seq: u64, payload: &[u8]) -> bool {
        seq <= self.last_applied
            && !(seq == self.last_applied && batch_digest(payload) == self.digest)
    }
}

/// The digest [`crate::SourceOutput::Applied`] reports for a batch payload.
pub fn batch_digest(payload: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(payload)
}

/// Why a source was reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ResetReason {
    /// The sequence went backwards or repeated: the engine restarted.
    SequenceWentBack {
        /// The sequence expected next.
        expected: u64,
        /// The sequence received.
        got: u64,
    },
    /// A gap and no replay endpoint to close it.
    GapWithoutReplay {
        /// The first missing sequence.
        expected: u64,
        /// The sequence received.
        got: u64,
    },
    /// The replay did not cover the gap (the engine's buffer had moved on).
    ReplayIncomplete {
        /// The first sequence still missing.
        expected: u64,
        /// The next sequence available.
        got: u64,
    },
    /// The replay request failed or timed out.
    ReplayFailed,
    /// Live batches buffered during a replay overflowed the bound.
    ReplayBufferOverflow,
    /// The publisher reconnected and there is no replay endpoint to check that it is the
    /// same engine: what the previous connection reported is not trusted (an engine that
    /// restarted and stays idle would otherwise keep its predecessor's blocks counted).
    ReconnectedUnverified,
    /// A source resumed after a checkpoint, but the engine's replay of the checkpointed
    /// batch differs from it (or the engine no longer has anything from it on): another
    /// incarnation publishes there, and what was restored is not its state.
    ResumeMismatch {
        /// The checkpointed batch.
        seq: u64,
    },
}

impl ResetReason {
    /// Every cause name, in [`ResetReason::cause_index`] order (the metric's label set).
    pub const CAUSES: [&'static str; 7] = [
        "sequence_went_back",
        "gap_without_replay",
        "replay_incomplete",
        "replay_failed",
        "replay_buffer_overflow",
        "reconnected_unverified",
        "resume_mismatch",
    ];

    /// This reason's position in [`ResetReason::CAUSES`].
    pub fn cause_index(&self) -> usize {
        match self {
            ResetReason::SequenceWentBack { .. } => 0,
            ResetReason::GapWithoutReplay { .. } => 1,
            ResetReason::ReplayIncomplete { .. } => 2,
            ResetReason::ReplayFailed => 3,
            ResetReason::ReplayBufferOverflow => 4,
            ResetReason::ReconnectedUnverified => 5,
            ResetReason::ResumeMismatch { .. } => 6,
        }
    }

    /// A stable lowercase name (log and metric label).
    pub fn as_str(&self) -> &'static str {
        match self {
            ResetReason::SequenceWentBack { .. } => "sequence_went_back",
            ResetReason::GapWithoutReplay { .. } => "gap_without_replay",
            ResetReason::ReplayIncomplete { .. } => "replay_incomplete",
            ResetReason::ReplayFailed => "replay_failed",
            ResetReason::ReplayBufferOverflow => "replay_buffer_overflow",
            ResetReason::ReconnectedUnverified => "reconnected_unverified",
            ResetReason::ResumeMismatch { .. } => "resume_mismatch",
        }
    }
}

/// What the owner must do next, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SequenceAction<P> {
    /// Decode and apply this batch.
    Apply {
        /// The batch's sequence.
        seq: u64,
        /// The batch payload.
        payload: P,
    },
    /// Ask the replay endpoint for every batch from `from_seq`; tag replies with `epoch`.
    RequestReplay {
        /// First sequence wanted.
        from_seq: u64,
        /// The replay's epoch.
        epoch: u64,
    },
    /// A gap was detected (informational; a replay or reset follows).
    Gap {
        /// The first missing sequence.
        expected: u64,
        /// The sequence received.
        got: u64,
    },
    /// Clear everything this source reported; then apply what follows.
    Reset(ResetReason),
    /// A live copy of a batch a replay already delivered arrived late and was dropped.
    LateCopy {
        /// Its sequence.
        seq: u64,
    },
}

/// Bounds of the tracker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceConfig {
    /// Whether a replay endpoint exists.
    pub replay_available: bool,
    /// Live batches buffered while a replay runs before the source resets.
    pub max_buffered: usize,
}

#[derive(Debug)]
enum State<P> {
    /// Nothing seen yet.
    Fresh,
    /// In order; `next` is the sequence expected; `late` while live copies of what a
    /// replay delivered may still arrive.
    Live { next: u64, late: Option<LateCopies> },
    /// A replay runs; `next` is the next sequence the replay must deliver; `delivered`
    /// the first sequence it delivered, once it has; `joining` when it recovers the
    /// engine's history from its start (a join, a resume, a restarted engine) rather than
    /// filling a gap or probing a tail.
    Replaying {
        next: u64,
        epoch: u64,
        buffered: VecDeque<(u64, P)>,
        delivered: Option<u64>,
        joining: bool,
    },
}

/// The sequences a late live copy may carry after a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LateCopies {
    /// The lowest one (at least 1: a publisher restart starts at 0).
    floor: u64,
    /// The last late copy seen: they arrive in order.
    last: Option<u64>,
}

impl LateCopies {
    /// The window after a replay that delivered `delivered..next`, `max_behind` deep.
    fn after_replay(delivered: Option<u64>, next: u64, max_behind: usize) -> Option<Self> {
        let delivered = delivered?;
        let behind = u64::try_from(max_behind).unwrap_or(u64::MAX);
        let floor = delivered.max(next.saturating_sub(behind)).max(1);
        (floor < next).then_some(Self { floor, last: None })
    }

    fn admits(&self, seq: u64, next: u64) -> bool {
        seq >= self.floor && seq < next && self.last.is_none_or(|last| seq > last)
    }
}

/// The sequence state machine of one ZMQ publisher; `P` is the payload type.
#[derive(Debug)]
pub struct SequenceTracker<P> {
    config: SequenceConfig,
    state: State<P>,
    epoch: u64,
    actions: VecDeque<SequenceAction<P>>,
}

impl<P> SequenceTracker<P> {
    /// A tracker that has seen nothing.
    pub fn new(config: SequenceConfig) -> Self {
        Self {
            config,
            state: State::Fresh,
            epoch: 0,
            actions: VecDeque::new(),
        }
    }

    /// A tracker resuming a source whose batches up to `last_applied` are already applied
    /// (restored from a checkpoint). With a replay endpoint it asks at once for everything
    /// from `last_applied` on: the replayed `last_applied` itself is not applied again
    /// (the owner compares it with the checkpoint's copy to tell that the same engine
    /// answers), the batches after it catch the source up exactly; a replay that skips
    /// sequences or fails resets the source (clearing what was restored), as does a live
    /// batch at or below `last_applied` (the engine restarted). Without one, the next live
    /// batch must be `last_applied + 1` or the source resets.
    pub fn resumed(config: SequenceConfig, last_applied: u64) -> Self {
        let next = last_applied.saturating_add(1);
        let mut tracker = Self::new(config);
        if !config.replay_available {
            tracker.state = State::Live { next, late: None };
            return tracker;
        }
        tracker.state = tracker.request_replay(last_applied, next, VecDeque::new(), true);
        tracker
    }

    /// The epoch of the replay in flight, if any.
    pub fn replay_epoch(&self) -> Option<u64> {
        match self.state {
            State::Replaying { epoch, .. } => Some(epoch),
            _ => None,
        }
    }

    /// Forgets everything (the owner reset the source): the next batch is a first batch.
    pub fn forget(&mut self) {
        self.state = State::Fresh;
    }

    /// The next action, or `None` when there is nothing to do.
    pub fn poll_action(&mut self) -> Option<SequenceAction<P>> {
        self.actions.pop_front()
    }

    /// Whether a replay is in progress.
    pub fn is_replaying(&self) -> bool {
        matches!(self.state, State::Replaying { .. })
    }

    /// Whether the engine's history is still being recovered: with a replay endpoint,
    /// nothing has been applied yet (no batch, or an idle engine not probed yet), or the
    /// replay in progress recovers the engine from its start (joining a running engine,
    /// resuming a checkpoint, following a restarted engine). Filling a gap or probing a
    /// tail is not joining: what was applied before stays applied. Without a replay
    /// endpoint there is nothing to wait for: the first batch is applied as it comes.
    pub fn is_joining(&self) -> bool {
        match self.state {
            State::Fresh => self.config.replay_available,
            State::Replaying { joining, .. } => joining,
            State::Live { .. } => false,
        }
    }

    /// The sequence expected next (`None` before the first batch).
    pub fn next_seq(&self) -> Option<u64> {
        match self.state {
            State::Fresh => None,
            State::Live { next, .. } | State::Replaying { next, .. } => Some(next),
        }
    }

    /// A live batch arrived.
    pub fn handle_live(&mut self, seq: u64, payload: P) {
        let state = std::mem::replace(&mut self.state, State::Fresh);
        self.state = match state {
            State::Fresh if seq == 0 || !self.config.replay_available => self.apply(seq, payload),
            State::Fresh => self.start_replay(0, seq, payload, true),
            State::Live { next, .. } if seq == next => self.apply(seq, payload),
            State::Live { next, .. } if seq > next => {
                self.actions.push_back(SequenceAction::Gap {
                    expected: next,
                    got: seq,
                });
                if self.config.replay_available {
                    self.start_replay(next, seq, payload, false)
                } else {
                    self.reset(ResetReason::GapWithoutReplay {
                        expected: next,
                        got: seq,
                    });
                    self.apply(seq, payload)
                }
            }
            State::Live {
                next,
                late: Some(mut late),
            } if late.admits(seq, next) => {
                late.last = Some(seq);
                self.actions.push_back(SequenceAction::LateCopy { seq });
                State::Live {
                    next,
                    late: Some(late),
                }
            }
            State::Live { next, .. } => {
                self.reset(ResetReason::SequenceWentBack {
                    expected: next,
                    got: seq,
                });
                self.restart(seq, payload)
            }
            State::Replaying {
                next,
                epoch,
                mut buffered,
                delivered,
                joining,
            } => {
                let last = buffered.back().map(|(s, _)| *s);
                if last.is_some_and(|last| seq <= last) {
                    // The publisher restarted during the replay: abandon it.
                    self.reset(ResetReason::SequenceWentBack {
                        expected: last.map_or(next, |l| l + 1),
                        got: seq,
                    });
                    self.restart(seq, payload)
                } else if buffered.len() >= self.config.max_buffered {
                    self.reset(ResetReason::ReplayBufferOverflow);
                    for (buffered_seq, buffered_payload) in buffered {
                        self.actions.push_back(SequenceAction::Apply {
                            seq: buffered_seq,
                            payload: buffered_payload,
                        });
                    }
                    self.apply(seq, payload)
                } else {
                    buffered.push_back((seq, payload));
                    State::Replaying {
                        next,
                        epoch,
                        buffered,
                        delivered,
                        joining,
                    }
                }
            }
        };
    }

    /// A replayed batch of replay `epoch` arrived.
    pub fn handle_replay(&mut self, epoch: u64, seq: u64, payload: P) {
        let State::Replaying {
            next,
            epoch: current,
            buffered,
            delivered,
            ..
        } = &mut self.state
        else {
            return;
        };
        if epoch != *current || seq < *next {
            return;
        }
        if seq > *next {
            let reason = ResetReason::ReplayIncomplete {
                expected: *next,
                got: seq,
            };
            self.actions.push_back(SequenceAction::Reset(reason));
        }
        // Live batches the replay has now covered are dropped from the buffer.
        while buffered.front().is_some_and(|(s, _)| *s <= seq) {
            buffered.pop_front();
        }
        *next = seq + 1;
        delivered.get_or_insert(seq);
        self.actions
            .push_back(SequenceAction::Apply { seq, payload });
    }

    /// The source went quiet after live batches, or its publisher disconnected: with a
    /// replay endpoint, ask for everything after the last applied batch, so a tail the
    /// publisher still held when it stopped is recovered (vLLM's replay socket answers from
    /// a given sequence to its newest). Returns whether a probe replay was started.
    pub fn handle_idle(&mut self) -> bool {
        if !self.config.replay_available {
            return false;
        }
        let State::Live { next, .. } = self.state else {
            return false;
        };
        self.state = self.request_replay(next, next, VecDeque::new(), false);
        true
    }

    /// The publisher reconnected after a disconnect. Without a replay endpoint nothing can
    /// tell a network blip from an engine that restarted (and may stay idle, publishing
    /// nothing that would reveal it): the source is reset and starts fresh, so a restarted
    /// engine never keeps its predecessor's blocks. With a replay endpoint the disconnect
    /// already probed the tail, and a restarted engine's first batch (at or below the last
    /// applied sequence) resets the source. Returns whether a reset was queued.
    pub fn handle_reconnected(&mut self) -> bool {
        if self.config.replay_available || !matches!(self.state, State::Live { .. }) {
            return false;
        }
        self.reset(ResetReason::ReconnectedUnverified);
        self.state = State::Fresh;
        true
    }

    /// The source connected and no batch has arrived since (the owner's timer): with a
    /// replay endpoint and nothing seen yet, ask for everything the engine still buffers,
    /// from 0, as a first batch past 0 would. An engine that published only before the
    /// relay subscribed (a relay restarted next to an idle engine) is otherwise never
    /// recovered. Returns whether a replay was started.
    pub fn handle_quiet_join(&mut self) -> bool {
        if !self.config.replay_available || !matches!(self.state, State::Fresh) {
            return false;
        }
        self.state = self.request_replay(0, 0, VecDeque::new(), true);
        true
    }

    /// Replay `epoch` sent its end marker: apply the buffered live batches.
    pub fn handle_replay_end(&mut self, epoch: u64) {
        if !matches!(&self.state, State::Replaying { epoch: current, .. } if *current == epoch) {
            return;
        }
        let state = std::mem::replace(&mut self.state, State::Fresh);
        let State::Replaying {
            mut next,
            buffered,
            delivered,
            ..
        } = state
        else {
            return;
        };
        let mut delivered = delivered;
        for (seq, payload) in buffered {
            if seq < next {
                continue;
            }
            if seq > next {
                self.reset(ResetReason::ReplayIncomplete {
                    expected: next,
                    got: seq,
                });
            }
            self.actions
                .push_back(SequenceAction::Apply { seq, payload });
            delivered.get_or_insert(seq);
            next = seq + 1;
        }
        let late = LateCopies::after_replay(delivered, next, self.config.max_buffered);
        self.state = State::Live { next, late };
    }

    /// Replay `epoch` failed or timed out: reset and continue from the buffered batches.
    pub fn handle_replay_failed(&mut self, epoch: u64) {
        if !matches!(&self.state, State::Replaying { epoch: current, .. } if *current == epoch) {
            return;
        }
        let state = std::mem::replace(&mut self.state, State::Fresh);
        let State::Replaying { next, buffered, .. } = state else {
            return;
        };
        self.reset(ResetReason::ReplayFailed);
        let mut next = next;
        for (seq, payload) in buffered {
            self.actions
                .push_back(SequenceAction::Apply { seq, payload });
            next = seq + 1;
        }
        self.state = State::Live { next, late: None };
    }

    /// After a restart: recover the new incarnation from its start when possible.
    fn restart(&mut self, seq: u64, payload: P) -> State<P> {
        if seq == 0 || !self.config.replay_available {
            self.apply(seq, payload)
        } else {
            self.start_replay(0, seq, payload, true)
        }
    }

    fn start_replay(&mut self, from_seq: u64, seq: u64, payload: P, joining: bool) -> State<P> {
        self.request_replay(
            from_seq,
            from_seq,
            VecDeque::from([(seq, payload)]),
            joining,
        )
    }

    /// Asks for every batch from `from_seq` under a new epoch; the replay state expects
    /// `next` first (the batches before it are already applied) and holds `buffered`;
    /// `joining` when it recovers the engine's history from its start.
    fn request_replay(
        &mut self,
        from_seq: u64,
        next: u64,
        buffered: VecDeque<(u64, P)>,
        joining: bool,
    ) -> State<P> {
        self.epoch += 1;
        self.actions.push_back(SequenceAction::RequestReplay {
            from_seq,
            epoch: self.epoch,
        });
        State::Replaying {
            next,
            epoch: self.epoch,
            buffered,
            delivered: None,
            joining,
        }
    }

    fn apply(&mut self, seq: u64, payload: P) -> State<P> {
        self.actions
            .push_back(SequenceAction::Apply { seq, payload });
        State::Live {
            next: seq.wrapping_add(1),
            late: None,
        }
    }

    fn reset(&mut self, reason: ResetReason) {
        self.actions.push_back(SequenceAction::Reset(reason));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reconnect_without_replay_resets_and_starts_fresh() {
        let mut tracker = tracker(false);
        tracker.handle_live(0, "a");
        tracker.handle_live(1, "b");
        while tracker.poll_action().is_some() {}
        assert!(tracker.handle_reconnected());
        assert_eq!(
            tracker.poll_action(),
            Some(SequenceAction::Reset(ResetReason::ReconnectedUnverified))
        );
        assert_eq!(tracker.next_seq(), None);
        // The restarted engine's first batch applies as a fresh start: no second reset.
        tracker.handle_live(0, "c");
        assert_eq!(
            tracker.poll_action(),
            Some(SequenceAction::Apply {
                seq: 0,
                payload: "c"
            })
        );
        assert_eq!(tracker.poll_action(), None);
        // Before any batch there is nothing to distrust.
        let mut fresh = tracker_without_batches(false);
        assert!(!fresh.handle_reconnected());
        assert_eq!(fresh.poll_action(), None);
    }

    #[test]
    fn a_reconnect_with_replay_is_left_to_the_replay() {
        let mut tracker = tracker(true);
        tracker.handle_live(0, "a");
        while tracker.poll_action().is_some() {}
        assert!(!tracker.handle_reconnected());
        assert_eq!(tracker.poll_action(), None);
        assert_eq!(tracker.next_seq(), Some(1));
    }

    fn tracker_without_batches(replay_available: bool) -> SequenceTracker<&'static str> {
        tracker(replay_available)
    }

    /// Joining lasts until the engine's history is recovered from its start (a join, a
    /// quiet join, a resume, a restarted engine), never through a gap or a tail probe, and
    /// never without a replay endpoint.
    #[test]
    fn joining_lasts_until_the_history_from_the_engine_start_is_recovered() {
        // A join: fresh, then the replay from 0 the first batch past 0 asks for.
        let mut t = tracker(true);
        assert!(t.is_joining(), "nothing applied yet");
        t.handle_live(5, "f");
        assert!(t.is_joining());
        drain(&mut t);
        for seq in 0..5 {
            t.handle_replay(1, seq, "r");
        }
        assert!(t.is_joining(), "the replay has not ended");
        t.handle_replay_end(1);
        assert!(!t.is_joining());
        // A gap and a tail probe are not joins.
        t.handle_live(8, "h");
        assert!(t.is_replaying() && !t.is_joining());
        t.handle_replay_failed(2);
        assert!(t.handle_idle());
        assert!(t.is_replaying() && !t.is_joining());
        t.handle_replay_end(3);
        // A restarted engine is joined again from its start.
        t.handle_live(2, "new incarnation");
        assert!(t.is_joining());
        t.handle_replay_end(4);
        assert!(!t.is_joining());

        // An idle engine: joining until the quiet join's replay ends.
        let mut idle = tracker(true);
        assert!(idle.handle_quiet_join());
        assert!(idle.is_joining());
        idle.handle_replay_end(1);
        assert!(!idle.is_joining());

        // A resume replays from the checkpointed batch: joining until it ends.
        let mut resumed = SequenceTracker::<&'static str>::resumed(
            SequenceConfig {
                replay_available: true,
                max_buffered: 3,
            },
            9,
        );
        assert!(resumed.is_joining());
        resumed.handle_replay_end(1);
        assert!(!resumed.is_joining());

        // Without a replay endpoint nothing is waited for.
        let mut plain = tracker(false);
        assert!(!plain.is_joining());
        plain.handle_live(5, "f");
        assert!(!plain.is_joining());
    }

    fn tracker(replay_available: bool) -> SequenceTracker<&'static str> {
        SequenceTracker::new(SequenceConfig {
            replay_available,
            max_buffered: 3,
        })
    }

    fn drain(tracker: &mut SequenceTracker<&'static str>) -> Vec<SequenceAction<&'static str>> {
        std::iter::from_fn(|| tracker.poll_action()).collect()
    }

    fn apply(seq: u64, payload: &'static str) -> SequenceAction<&'static str> {
        SequenceAction::Apply { seq, payload }
    }

    fn resumed(replay_available: bool, last_applied: u64) -> SequenceTracker<&'static str> {
        SequenceTracker::resumed(
            SequenceConfig {
                replay_available,
                max_buffered: 3,
            },
            last_applied,
        )
    }

    /// A source restored from a checkpoint at batch 5 asks for 5 onwards at once and
    /// applies the replay after 5, then the live batches buffered meanwhile.
    #[test]
    fn a_resumed_source_catches_up_from_the_batch_after_its_checkpoint() {
        let mut t = resumed(true, 5);
        assert_eq!(t.next_seq(), Some(6));
        assert_eq!(t.replay_epoch(), Some(1));
        assert_eq!(
            drain(&mut t),
            vec![SequenceAction::RequestReplay {
                from_seq: 5,
                epoch: 1
            }]
        );
        t.handle_live(8, "i");
        // The checkpointed batch comes back first; it is the owner's to compare, not
        // applied again.
        t.handle_replay(1, 5, "f");
        t.handle_replay(1, 6, "g");
        t.handle_replay(1, 7, "h");
        t.handle_replay(1, 8, "i");
        t.handle_replay_end(1);
        t.handle_live(9, "j");
        assert_eq!(
            drain(&mut t),
            vec![apply(6, "g"), apply(7, "h"), apply(8, "i"), apply(9, "j")]
        );
    }

    /// Each way a checkpoint cannot be completed resets the source (the owner clears what
    /// was restored): the engine's ring moved past it, the replay failed, or the engine
    /// restarted (a live batch at or below the checkpoint).
    #[test]
    fn a_resumed_source_that_cannot_be_completed_resets() {
        let mut moved_on = resumed(true, 5);
        drain(&mut moved_on);
        moved_on.handle_replay(1, 9, "j");
        assert_eq!(
            drain(&mut moved_on),
            vec![
                SequenceAction::Reset(ResetReason::ReplayIncomplete {
                    expected: 6,
                    got: 9
                }),
                apply(9, "j"),
            ]
        );

        let mut failed = resumed(true, 5);
        drain(&mut failed);
        failed.handle_replay_failed(1);
        assert_eq!(
            drain(&mut failed),
            vec![SequenceAction::Reset(ResetReason::ReplayFailed)]
        );

        let mut restarted = resumed(true, 5);
        drain(&mut restarted);
        restarted.handle_replay_end(1);
        restarted.handle_live(2, "c");
        let actions = drain(&mut restarted);
        assert_eq!(
            actions.first(),
            Some(&SequenceAction::Reset(ResetReason::SequenceWentBack {
                expected: 6,
                got: 2
            }))
        );
    }

    /// Without a replay endpoint the next live batch must continue the checkpoint.
    #[test]
    fn a_resumed_source_without_replay_continues_only_in_sequence() {
        let mut continues = resumed(false, 5);
        assert_eq!(drain(&mut continues), vec![]);
        continues.handle_live(6, "g");
        assert_eq!(drain(&mut continues), vec![apply(6, "g")]);

        let mut gapped = resumed(false, 5);
        gapped.handle_live(8, "i");
        assert_eq!(
            drain(&mut gapped),
            vec![
                SequenceAction::Gap {
                    expected: 6,
                    got: 8
                },
                SequenceAction::Reset(ResetReason::GapWithoutReplay {
                    expected: 6,
                    got: 8
                }),
                apply(8, "i"),
            ]
        );
    }

    #[test]
    fn in_order_batches_apply_in_order() {
        let mut t = tracker(true);
        t.handle_live(0, "a");
        t.handle_live(1, "b");
        assert_eq!(drain(&mut t), vec![apply(0, "a"), apply(1, "b")]);
    }

    #[test]
    fn gap_requests_replay_and_buffers_live_batches_until_it_ends() {
        let mut t = tracker(true);
        t.handle_live(0, "a");
        t.handle_live(3, "d");
        t.handle_live(4, "e");
        assert_eq!(
            drain(&mut t),
            vec![
                apply(0, "a"),
                SequenceAction::Gap {
                    expected: 1,
                    got: 3
                },
                SequenceAction::RequestReplay {
                    from_seq: 1,
                    epoch: 1
                },
            ]
        );
        t.handle_replay(1, 1, "b");
        t.handle_replay(1, 2, "c");
        t.handle_replay(1, 3, "d");
        t.handle_replay_end(1);
        t.handle_live(5, "f");
        assert_eq!(
            drain(&mut t),
            vec![
                apply(1, "b"),
                apply(2, "c"),
                apply(3, "d"),
                apply(4, "e"),
                apply(5, "f")
            ]
        );
    }

    #[test]
    fn sequence_going_back_resets_and_applies_as_new_start() {
        let mut t = tracker(true);
        t.handle_live(0, "a");
        t.handle_live(1, "b");
        t.handle_live(0, "new");
        let actions = drain(&mut t);
        assert_eq!(
            actions[2..],
            [
                SequenceAction::Reset(ResetReason::SequenceWentBack {
                    expected: 2,
                    got: 0
                }),
                apply(0, "new"),
            ]
        );
    }

    #[test]
    fn restart_seen_mid_stream_replays_the_new_incarnation_from_zero() {
        let mut t = tracker(true);
        t.handle_live(0, "a");
        t.handle_live(1, "b");
        t.handle_live(2, "c");
        drain(&mut t);
        t.handle_live(1, "new-1");
        assert_eq!(
            drain(&mut t),
            vec![
                SequenceAction::Reset(ResetReason::SequenceWentBack {
                    expected: 3,
                    got: 1
                }),
                SequenceAction::RequestReplay {
                    from_seq: 0,
                    epoch: 1
                },
            ]
        );
        t.handle_replay(1, 0, "new-0");
        t.handle_replay(1, 1, "new-1");
        t.handle_replay_end(1);
        assert_eq!(drain(&mut t), vec![apply(0, "new-0"), apply(1, "new-1")]);
    }

    #[test]
    fn gap_without_replay_endpoint_resets() {
        let mut t = tracker(false);
        t.handle_live(0, "a");
        t.handle_live(2, "c");
        assert_eq!(
            drain(&mut t)[1..],
            [
                SequenceAction::Gap {
                    expected: 1,
                    got: 2
                },
                SequenceAction::Reset(ResetReason::GapWithoutReplay {
                    expected: 1,
                    got: 2
                }),
                apply(2, "c"),
            ]
        );
    }

    #[test]
    fn replay_that_skips_sequences_resets_then_continues() {
        let mut t = tracker(true);
        t.handle_live(0, "a");
        t.handle_live(5, "f");
        drain(&mut t);
        t.handle_replay(1, 3, "d");
        t.handle_replay(1, 4, "e");
        t.handle_replay_end(1);
        assert_eq!(
            drain(&mut t),
            vec![
                SequenceAction::Reset(ResetReason::ReplayIncomplete {
                    expected: 1,
                    got: 3
                }),
                apply(3, "d"),
                apply(4, "e"),
                apply(5, "f"),
            ]
        );
    }

    #[test]
    fn failed_replay_resets_and_applies_the_buffer() {
        let mut t = tracker(true);
        t.handle_live(0, "a");
        t.handle_live(2, "c");
        drain(&mut t);
        t.handle_replay_failed(1);
        t.handle_live(3, "d");
        assert_eq!(
            drain(&mut t),
            vec![
                SequenceAction::Reset(ResetReason::ReplayFailed),
                apply(2, "c"),
                apply(3, "d")
            ]
        );
    }

    #[test]
    fn replies_of_an_abandoned_replay_are_ignored() {
        let mut t = tracker(true);
        t.handle_live(0, "a");
        t.handle_live(2, "c");
        t.handle_replay_failed(1);
        drain(&mut t);
        t.handle_replay(1, 1, "late");
        t.handle_replay_end(1);
        assert!(drain(&mut t).is_empty());
    }

    #[test]
    fn buffer_overflow_during_replay_resets() {
        let mut t = tracker(true);
        t.handle_live(0, "a");
        for (seq, payload) in [(2, "c"), (3, "d"), (4, "e"), (5, "f")] {
            t.handle_live(seq, payload);
        }
        let actions = drain(&mut t);
        assert!(actions.contains(&SequenceAction::Reset(ResetReason::ReplayBufferOverflow)));
        assert_eq!(actions.last(), Some(&apply(5, "f")));
        assert!(!t.is_replaying());
    }

    #[test]
    fn late_joiner_replays_from_zero_first() {
        let mut t = tracker(true);
        t.handle_live(7, "h");
        assert_eq!(
            drain(&mut t),
            vec![SequenceAction::RequestReplay {
                from_seq: 0,
                epoch: 1
            }]
        );
        for seq in 0..7 {
            t.handle_replay(1, seq, "old");
        }
        t.handle_replay_end(1);
        assert_eq!(drain(&mut t).last(), Some(&apply(7, "h")));
        assert_eq!(t.next_seq(), Some(8));
    }

    #[test]
    fn restart_during_replay_abandons_it() {
        let mut t = tracker(true);
        t.handle_live(0, "a");
        t.handle_live(3, "d");
        t.handle_live(0, "restart");
        // Sequence 0 needs no replay: the new incarnation starts here.
        let actions = drain(&mut t);
        assert_eq!(
            actions[3..],
            [
                SequenceAction::Reset(ResetReason::SequenceWentBack {
                    expected: 4,
                    got: 0
                }),
                apply(0, "restart"),
            ]
        );
        assert!(!t.is_replaying());
    }

    #[test]
    fn a_quiet_join_replays_from_zero_and_then_follows_live_batches() {
        let mut t = tracker(true);
        assert!(t.handle_quiet_join());
        assert_eq!(
            drain(&mut t),
            vec![SequenceAction::RequestReplay {
                from_seq: 0,
                epoch: 1
            }]
        );
        assert!(t.is_replaying());
        t.handle_replay(1, 0, "a");
        t.handle_replay(1, 1, "b");
        t.handle_live(3, "d");
        t.handle_replay(1, 2, "c");
        t.handle_replay_end(1);
        t.handle_live(4, "e");
        assert_eq!(
            drain(&mut t),
            vec![
                apply(0, "a"),
                apply(1, "b"),
                apply(2, "c"),
                apply(3, "d"),
                apply(4, "e")
            ]
        );
    }

    #[test]
    fn a_quiet_join_that_finds_nothing_leaves_the_first_live_batch_to_decide() {
        let mut t = tracker(true);
        assert!(t.handle_quiet_join());
        drain(&mut t);
        t.handle_replay_end(1);
        t.handle_live(0, "a");
        t.handle_live(1, "b");
        assert_eq!(drain(&mut t), vec![apply(0, "a"), apply(1, "b")]);
    }

    #[test]
    fn a_quiet_join_probe_needs_a_replay_endpoint_and_a_fresh_source() {
        let mut without = tracker(false);
        assert!(!without.handle_quiet_join());
        assert_eq!(drain(&mut without), vec![]);
        let mut live = tracker(true);
        live.handle_live(0, "a");
        drain(&mut live);
        assert!(
            !live.handle_quiet_join(),
            "a source with batches probes its tail instead"
        );
        assert_eq!(drain(&mut live), vec![]);
    }

    /// Answers the replay `t` just requested with `batches`, ends it and drops the
    /// actions so far (the setup of the late-copy tests).
    fn answer_replay(t: &mut SequenceTracker<&'static str>, batches: &[(u64, &'static str)]) {
        let epoch = drain(t)
            .into_iter()
            .find_map(|action| match action {
                SequenceAction::RequestReplay { epoch, .. } => Some(epoch),
                _ => None,
            })
            .unwrap();
        for &(seq, payload) in batches {
            t.handle_replay(epoch, seq, payload);
        }
        t.handle_replay_end(epoch);
        drain(t);
    }

    /// The race seen in a relay restart: the replay socket delivered the newest batch
    /// before the live socket did; the late live copies are dropped, not taken for a
    /// publisher restart, and the stream goes on.
    #[test]
    fn late_live_copies_after_a_replay_are_dropped_not_a_restart() {
        let mut t = tracker(true);
        // Joining a running engine: the first live batch is 5, so replay from 0.
        t.handle_live(5, "f");
        let batches = [
            (0, "a"),
            (1, "b"),
            (2, "c"),
            (3, "d"),
            (4, "e"),
            (5, "f"),
            (6, "g"),
        ];
        answer_replay(&mut t, &batches);
        // Live copies of 5 and 6 arrive after the replay delivered them.
        t.handle_live(5, "f");
        t.handle_live(6, "g");
        t.handle_live(7, "h");
        assert_eq!(
            drain(&mut t),
            vec![
                SequenceAction::LateCopy { seq: 5 },
                SequenceAction::LateCopy { seq: 6 },
                apply(7, "h")
            ]
        );
        // Once the live stream has caught up, going back is a restart again.
        t.handle_live(6, "g");
        assert!(matches!(
            drain(&mut t).first(),
            Some(SequenceAction::Reset(ResetReason::SequenceWentBack { .. }))
        ));
    }

    #[test]
    fn a_restart_at_zero_right_after_a_replay_is_still_a_restart() {
        let mut t = tracker(true);
        t.handle_live(3, "d");
        answer_replay(&mut t, &[(0, "a"), (1, "b"), (2, "c"), (3, "d")]);
        t.handle_live(0, "new");
        assert_eq!(
            drain(&mut t),
            vec![
                SequenceAction::Reset(ResetReason::SequenceWentBack {
                    expected: 4,
                    got: 0
                }),
                apply(0, "new")
            ]
        );
    }

    #[test]
    fn late_copies_must_increase_and_stay_within_what_the_replay_delivered() {
        let mut t = tracker(true);
        t.handle_live(0, "a");
        t.handle_live(1, "b");
        t.handle_live(4, "e");
        answer_replay(&mut t, &[(2, "c"), (3, "d")]);
        // 1 was applied live, not by the replay: a batch going back there is a restart.
        t.handle_live(1, "b");
        assert!(matches!(
            drain(&mut t).first(),
            Some(SequenceAction::Reset(ResetReason::SequenceWentBack { .. }))
        ));
        let mut t = tracker(true);
        t.handle_live(2, "c");
        answer_replay(&mut t, &[(0, "a"), (1, "b"), (2, "c"), (3, "d")]);
        t.handle_live(3, "d");
        // A copy that goes back relative to the last late copy is not one.
        t.handle_live(2, "c");
        let actions = drain(&mut t);
        assert_eq!(actions[0], SequenceAction::LateCopy { seq: 3 });
        assert!(matches!(
            actions[1],
            SequenceAction::Reset(ResetReason::SequenceWentBack { .. })
        ));
    }
}
