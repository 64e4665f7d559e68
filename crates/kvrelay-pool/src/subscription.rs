//! One subscriber's stream of a pool generation: snapshot chunks (or a resumption), then
//! deltas in order, with heartbeats in quiet periods, ending with a typed
//! [`SubscriptionEnd`].
//!
//! Every item is a [`PoolFrame`]: a complete, already-encoded codec frame (`bytes`, ready
//! to write to a socket as is) plus its kind and sequences for metrics and tests. What to
//! send is decided by the hub's sans-IO [`kvrelay_ckf::stream::Publisher`]; this type only
//! pulls it, encodes what was not encoded yet (snapshot chunks, coalesced deltas,
//! heartbeats) under the global encoding permits, and waits when there is nothing to
//! send. A delta that goes to a subscriber alone reuses the hub's one encoding.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use kvrelay_ckf::stream::{CutOff, Poll, Start, SubscriberId, Transmit};
use kvrelay_identity::ProducerIdentity;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::error::SubscriptionEnd;
use crate::frame::sent_now_us;
use crate::hub::HubShared;

/// What a [`PoolFrame`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolFrameKind {
    /// One chunk of the snapshot; `base_sequence == sequence` == the snapshot sequence.
    SnapshotChunk,
    /// Moves the replica from `base_sequence` to `sequence` (`base_sequence + 1` unless
    /// several deltas were coalesced).
    Delta,
    /// Nothing changed; `base_sequence == sequence` == the last delivered sequence.
    Heartbeat,
}

/// One encoded pool frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolFrame {
    /// What the frame carries.
    pub kind: PoolFrameKind,
    /// The sequence a replica must be at to apply the frame (chunks: the snapshot's).
    pub base_sequence: u64,
    /// The sequence a replica is at after the frame.
    pub sequence: u64,
    /// Published deltas this frame covers (deltas only: 1 unless coalesced; else 0).
    pub covers: usize,
    /// The complete codec frame (header included), ready to write.
    pub bytes: Bytes,
}

/// A pool subscription: see the module docs. Dropping it unsubscribes.
pub struct PoolSubscription {
    hub: Arc<HubShared>,
    id: SubscriberId,
    start: Start,
    wake: watch::Receiver<u64>,
    /// A transmit taken from the publisher but not yet returned (cancel safety).
    staged: Option<Transmit<Option<Bytes>>>,
    sequence: u64,
    end: Option<SubscriptionEnd>,
    _membership: SubscriberMembership,
}

impl std::fmt::Debug for PoolSubscription {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolSubscription")
            .field("identity", &self.hub.identity)
            .field("start", &self.start)
            .field("sequence", &self.sequence)
            .field("end", &self.end)
            .finish_non_exhaustive()
    }
}

/// Creates a subscription for publisher subscriber `id`; counts it until dropped.
pub(crate) fn open(
    hub: Arc<HubShared>,
    id: SubscriberId,
    start: Start,
    subscribers: Arc<AtomicUsize>,
) -> PoolSubscription {
    subscribers.fetch_add(1, Ordering::AcqRel);
    let sequence = match start {
        Start::Snapshot { sequence } => sequence,
        Start::Resume { from } => from,
    };
    PoolSubscription {
        wake: hub.wake.subscribe(),
        hub,
        id,
        start,
        staged: None,
        sequence,
        end: None,
        _membership: SubscriberMembership { subscribers },
    }
}

impl PoolSubscription {
    /// The producer generation this subscription follows.
    pub fn identity(&self) -> ProducerIdentity {
        self.hub.identity
    }

    /// How the stream started: a snapshot at a sequence, or a resumption from one.
    pub fn start(&self) -> Start {
        self.start
    }

    /// The sequence the snapshot is consistent at (the resume point when resumed).
    pub fn snapshot_sequence(&self) -> u64 {
        match self.start {
            Start::Snapshot { sequence } => sequence,
            Start::Resume { from } => from,
        }
    }

    /// The sequence of the last frame returned.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }

    /// The next frame, or why the stream ended (then every later call returns the same
    /// end). Cancel-safe: dropping the future loses no frame.
    pub async fn next_frame(&mut self) -> Result<PoolFrame, SubscriptionEnd> {
        if let Some(end) = &self.end {
            return Err(end.clone());
        }
        let result = self.advance().await;
        if let Err(end) = &result {
            self.end = Some(end.clone());
            self.staged = None;
            self.hub.publisher.lock().handle_unsubscribe(self.id);
        }
        result
    }

    async fn advance(&mut self) -> Result<PoolFrame, SubscriptionEnd> {
        loop {
            if let Some(transmit) = self.staged.clone() {
                let frame = self.encode(transmit).await?;
                self.staged = None;
                self.sequence = frame.sequence;
                return Ok(frame);
            }
            // Mark what we have seen before polling, so a wake-up in between is not lost.
            self.wake.borrow_and_update();
            let (poll, deadline) = {
                let mut publisher = self.hub.publisher.lock();
                let poll = publisher.poll_transmit(self.id, Instant::now().into_std());
                (poll, publisher.poll_timeout(self.id))
            };
            match poll {
                Poll::Transmit(transmit) => self.staged = Some(transmit),
                Poll::CutOff(cut) => return Err(cut_off_end(cut)),
                Poll::Unknown => {
                    return Err(self
                        .hub
                        .end
                        .get()
                        .cloned()
                        .unwrap_or(SubscriptionEnd::ProducerWithdrawn));
                }
                Poll::Idle => {
                    if let Some(end) = self.hub.end.get() {
                        return Err(end.clone());
                    }
                    let sleep = async {
                        match deadline {
                            Some(at) => tokio::time::sleep_until(Instant::from_std(at)).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        changed = self.wake.changed() => {
                            if changed.is_err() {
                                return Err(SubscriptionEnd::ProducerWithdrawn);
                            }
                        }
                        () = sleep => {}
                    }
                }
            }
        }
    }

    async fn encode(
        &self,
        transmit: Transmit<Option<Bytes>>,
    ) -> Result<PoolFrame, SubscriptionEnd> {
        let internal =
            |reason: kvrelay_codec::v1::EncodeError| SubscriptionEnd::Internal { reason };
        match transmit {
            Transmit::Delta {
                delta,
                encoded: Some(Some(bytes)),
                covers,
            } => Ok(PoolFrame {
                kind: PoolFrameKind::Delta,
                base_sequence: delta.base_sequence,
                sequence: delta.sequence,
                covers,
                bytes,
            }),
            Transmit::Delta { delta, covers, .. } => {
                let _permit = self.permit().await?;
                let bytes = self
                    .hub
                    .encoder
                    .delta(&delta, sent_now_us())
                    .map_err(internal)?;
                Ok(PoolFrame {
                    kind: PoolFrameKind::Delta,
                    base_sequence: delta.base_sequence,
                    sequence: delta.sequence,
                    covers,
                    bytes,
                })
            }
            Transmit::SnapshotChunk {
                words,
                sequence,
                chunk_index,
                ..
            } => {
                let _permit = self.permit().await?;
                let bytes = self
                    .hub
                    .encoder
                    .snapshot_chunk(sequence, &words, chunk_index, sent_now_us())
                    .map_err(internal)?;
                Ok(PoolFrame {
                    kind: PoolFrameKind::SnapshotChunk,
                    base_sequence: sequence,
                    sequence,
                    covers: 0,
                    bytes,
                })
            }
            Transmit::Heartbeat { sequence } => {
                let bytes = self
                    .hub
                    .encoder
                    .heartbeat(sequence, sent_now_us())
                    .map_err(internal)?;
                Ok(PoolFrame {
                    kind: PoolFrameKind::Heartbeat,
                    base_sequence: sequence,
                    sequence,
                    covers: 0,
                    bytes,
                })
            }
        }
    }

    async fn permit(&self) -> Result<tokio::sync::OwnedSemaphorePermit, SubscriptionEnd> {
        self.hub
            .encoding
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| SubscriptionEnd::ShuttingDown)
    }
}

impl Drop for PoolSubscription {
    fn drop(&mut self) {
        self.hub.publisher.lock().handle_unsubscribe(self.id);
    }
}

fn cut_off_end(cut: CutOff) -> SubscriptionEnd {
    match cut {
        CutOff::Backlog { .. } => SubscriptionEnd::SubscriberLagged,
        CutOff::SnapshotStalled { timeout } => SubscriptionEnd::SnapshotProgressTimeout {
            timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        },
    }
}

/// Counts a live subscription in its hub until dropped.
#[derive(Debug)]
struct SubscriberMembership {
    subscribers: Arc<AtomicUsize>,
}

impl Drop for SubscriberMembership {
    fn drop(&mut self) {
        self.subscribers.fetch_sub(1, Ordering::AcqRel);
    }
}
