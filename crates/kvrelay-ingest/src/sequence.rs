//! Per-source batch sequence tracking: a pure state machine.
//!
//! The async source feeds it live batches ([`SequenceTracker::handle_live`]) and replay
//! replies ([`SequenceTracker::handle_replay`], [`SequenceTracker::handle_replay_end`],
//! [`SequenceTracker::handle_replay_failed`]), then drains [`SequenceTracker::poll_action`]
//! until `None`. Rules:
//!
//! - the first batch seen is applied whatever its sequence (joining a running engine);
//! - the next sequence is applied; a jump forward is a **gap**: with a replay endpoint the
//!   tracker asks for a replay from the first missing sequence and buffers live batches
//!   until the replay ends, then applies the buffer in order; without one it resets;
//! - a sequence at or below the last applied one (publisher restart or wrap) **resets**
//!   the source and applies the batch as a new start;
//! - a replay that skips sequences, fails, or overflows the live buffer cannot close the
//!   gap: the source **resets** and continues from the first batch it still has.
//!
//! A reset tells the owner to clear everything the source reported before it. Replies of
//! an abandoned replay are ignored by epoch.

use std::collections::VecDeque;

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
}

impl ResetReason {
    /// A stable lowercase name (log and metric label).
    pub fn as_str(&self) -> &'static str {
        match self {
            ResetReason::SequenceWentBack { .. } => "sequence_went_back",
            ResetReason::GapWithoutReplay { .. } => "gap_without_replay",
            ResetReason::ReplayIncomplete { .. } => "replay_incomplete",
            ResetReason::ReplayFailed => "replay_failed",
            ResetReason::ReplayBufferOverflow => "replay_buffer_overflow",
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
    /// In order; `next` is the sequence expected.
    Live { next: u64 },
    /// A replay runs; `next` is the next sequence the replay must deliver.
    Replaying {
        next: u64,
        epoch: u64,
        buffered: VecDeque<(u64, P)>,
    },
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

    /// The next action, or `None` when there is nothing to do.
    pub fn poll_action(&mut self) -> Option<SequenceAction<P>> {
        self.actions.pop_front()
    }

    /// Whether a replay is in progress.
    pub fn is_replaying(&self) -> bool {
        matches!(self.state, State::Replaying { .. })
    }

    /// The sequence expected next (`None` before the first batch).
    pub fn next_seq(&self) -> Option<u64> {
        match self.state {
            State::Fresh => None,
            State::Live { next } | State::Replaying { next, .. } => Some(next),
        }
    }

    /// A live batch arrived.
    pub fn handle_live(&mut self, seq: u64, payload: P) {
        let state = std::mem::replace(&mut self.state, State::Fresh);
        self.state = match state {
            State::Fresh => self.apply(seq, payload),
            State::Live { next } if seq == next => self.apply(seq, payload),
            State::Live { next } if seq > next => {
                self.actions.push_back(SequenceAction::Gap { expected: next, got: seq });
                if self.config.replay_available {
                    self.epoch += 1;
                    self.actions.push_back(SequenceAction::RequestReplay {
                        from_seq: next,
                        epoch: self.epoch,
                    });
                    let mut buffered = VecDeque::new();
                    buffered.push_back((seq, payload));
                    State::Replaying {
                        next,
                        epoch: self.epoch,
                        buffered,
                    }
                } else {
                    self.reset(ResetReason::GapWithoutReplay { expected: next, got: seq });
                    self.apply(seq, payload)
                }
            }
            State::Live { next } => {
                self.reset(ResetReason::SequenceWentBack { expected: next, got: seq });
                self.apply(seq, payload)
            }
            State::Replaying {
                next,
                epoch,
                mut buffered,
            } => {
                let last = buffered.back().map(|(s, _)| *s);
                if last.is_some_and(|last| seq <= last) {
                    // The publisher restarted during the replay: abandon it.
                    self.reset(ResetReason::SequenceWentBack {
                        expected: last.map_or(next, |l| l + 1),
                        got: seq,
                    });
                    self.apply(seq, payload)
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
                    State::Replaying { next, epoch, buffered }
                }
            }
        };
    }

    /// A replayed batch of replay `epoch` arrived.
    pub fn handle_replay(&mut self, epoch: u64, seq: u64, payload: P) {
        let State::Replaying { next, epoch: current, buffered } = &mut self.state else {
            return;
        };
        if epoch != *current || seq < *next {
            return;
        }
        if seq > *next {
            let reason = ResetReason::ReplayIncomplete { expected: *next, got: seq };
            self.actions.push_back(SequenceAction::Reset(reason));
        }
        // Live batches the replay has now covered are dropped from the buffer.
        while buffered.front().is_some_and(|(s, _)| *s <= seq) {
            buffered.pop_front();
        }
        *next = seq + 1;
        self.actions.push_back(SequenceAction::Apply { seq, payload });
    }

    /// Replay `epoch` sent its end marker: apply the buffered live batches.
    pub fn handle_replay_end(&mut self, epoch: u64) {
        if !matches!(&self.state, State::Replaying { epoch: current, .. } if *current == epoch) {
            return;
        }
        let state = std::mem::replace(&mut self.state, State::Fresh);
        let State::Replaying { mut next, buffered, .. } = state else {
            return;
        };
        for (seq, payload) in buffered {
            if seq < next {
                continue;
            }
            if seq > next {
                self.reset(ResetReason::ReplayIncomplete { expected: next, got: seq });
            }
            self.actions.push_back(SequenceAction::Apply { seq, payload });
            next = seq + 1;
        }
        self.state = State::Live { next };
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
            self.actions.push_back(SequenceAction::Apply { seq, payload });
            next = seq + 1;
        }
        self.state = State::Live { next };
    }

    fn apply(&mut self, seq: u64, payload: P) -> State<P> {
        self.actions.push_back(SequenceAction::Apply { seq, payload });
        State::Live { next: seq.wrapping_add(1) }
    }

    fn reset(&mut self, reason: ResetReason) {
        self.actions.push_back(SequenceAction::Reset(reason));
    }
}
