//! One subscriber's stream of a pool generation: snapshot chunks, then deltas in order,
//! with heartbeats in quiet periods, ending with a typed [`SubscriptionEnd`].
//!
//! Every item is a [`PoolFrame`]: a complete, already-encoded codec frame (`bytes`, ready
//! to write to a socket as is) plus its kind and sequences for metrics and tests. Delta
//! frames are encoded once by the hub and shared by every subscriber (`Bytes` clones).
//! Snapshot chunks are encoded lazily, one per [`PoolSubscription::next_frame`] call,
//! under the global encoding permits, so a slow subscriber never buffers a whole table.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use kvrelay_identity::ProducerIdentity;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;

use crate::error::SubscriptionEnd;
use crate::frame::FrameEncoder;
use crate::limits::FRAME_ACCOUNTING_OVERHEAD;

/// What a [`PoolFrame`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PoolFrameKind {
    /// One chunk of the snapshot; `base_sequence == sequence` == the snapshot sequence.
    SnapshotChunk,
    /// Moves the replica from `base_sequence` to `sequence = base_sequence + 1`.
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
    /// The complete codec frame (header included), ready to write.
    pub bytes: Bytes,
}

impl PoolFrame {
    /// Bytes charged against a subscriber's queue budget for this frame.
    pub fn queued_bytes(&self) -> usize {
        self.bytes.len().saturating_add(FRAME_ACCOUNTING_OVERHEAD)
    }
}

/// A pool subscription: see the module docs. Dropping it unsubscribes.
#[derive(Debug)]
pub struct PoolSubscription {
    identity: ProducerIdentity,
    snapshot: Option<SnapshotCursor>,
    snapshot_sequence: u64,
    queue: mpsc::Receiver<PoolFrame>,
    shared: Arc<SubscriberShared>,
    encoding: Arc<Semaphore>,
    encoder: FrameEncoder,
    heartbeat_interval: Duration,
    snapshot_progress_timeout: Duration,
    last_progress: Instant,
    sequence: u64,
    end: Option<SubscriptionEnd>,
    _membership: SubscriberMembership,
}

impl PoolSubscription {
    /// The producer generation this subscription follows.
    pub fn identity(&self) -> ProducerIdentity {
        self.identity
    }

    /// The sequence the snapshot is consistent at.
    pub fn snapshot_sequence(&self) -> u64 {
        self.snapshot_sequence
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
            self.snapshot = None;
            self.queue.close();
        }
        result
    }

    async fn advance(&mut self) -> Result<PoolFrame, SubscriptionEnd> {
        if let Some(end) = self.shared.end_reason_if_cut_off() {
            return Err(end);
        }
        if let Some(cursor) = &self.snapshot {
            let elapsed = self.last_progress.elapsed();
            if elapsed > self.snapshot_progress_timeout {
                return Err(SubscriptionEnd::SnapshotProgressTimeout {
                    timeout_ms: duration_ms(self.snapshot_progress_timeout),
                });
            }
            let permit = self
                .encoding
                .clone()
                .acquire_owned()
                .await
                .map_err(|_| SubscriptionEnd::ShuttingDown)?;
            let sequence = cursor.sequence;
            let bytes = self
                .encoder
                .snapshot_chunk(sequence, &cursor.words, cursor.next_chunk)
                .map_err(|error| SubscriptionEnd::Internal {
                    reason: error.to_string(),
                })?;
            drop(permit);
            if let Some(cursor) = self.snapshot.as_mut() {
                cursor.next_chunk += 1;
                if cursor.next_chunk >= cursor.chunk_count {
                    self.snapshot = None;
                }
            }
            self.last_progress = Instant::now();
            self.sequence = sequence;
            return Ok(PoolFrame {
                kind: PoolFrameKind::SnapshotChunk,
                base_sequence: sequence,
                sequence,
                bytes,
            });
        }
        match tokio::time::timeout(self.heartbeat_interval, self.queue.recv()).await {
            Ok(Some(frame)) => {
                self.shared.release(frame.queued_bytes());
                if let Some(end) = self.shared.end_reason_if_cut_off() {
                    return Err(end);
                }
                self.sequence = frame.sequence;
                Ok(frame)
            }
            Ok(None) => Err(self.shared.end_reason()),
            Err(_elapsed) => {
                let bytes = self.encoder.heartbeat(self.sequence).map_err(|error| {
                    SubscriptionEnd::Internal {
                        reason: error.to_string(),
                    }
                })?;
                Ok(PoolFrame {
                    kind: PoolFrameKind::Heartbeat,
                    base_sequence: self.sequence,
                    sequence: self.sequence,
                    bytes,
                })
            }
        }
    }
}

/// The hub's side of one subscriber.
#[derive(Debug)]
pub(crate) struct SubscriberSender {
    queue: mpsc::Sender<PoolFrame>,
    shared: Arc<SubscriberShared>,
    max_bytes: usize,
}

/// What [`SubscriberSender::offer`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Offer {
    /// Queued.
    Queued,
    /// The subscriber was too slow and is now cut off with `SubscriberLagged`.
    Lagged,
    /// The subscription was dropped.
    Gone,
}

impl SubscriberSender {
    /// Queues a frame, or cuts the subscriber off when its queue is full by frames or
    /// bytes.
    pub(crate) fn offer(&self, frame: &PoolFrame) -> Offer {
        if self.queue.is_closed() {
            return Offer::Gone;
        }
        let charge = frame.queued_bytes();
        if !self.shared.charge(charge, self.max_bytes) {
            self.shared.end(SubscriptionEnd::SubscriberLagged);
            return Offer::Lagged;
        }
        match self.queue.try_send(frame.clone()) {
            Ok(()) => Offer::Queued,
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.shared.release(charge);
                self.shared.end(SubscriptionEnd::SubscriberLagged);
                Offer::Lagged
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.shared.release(charge);
                Offer::Gone
            }
        }
    }

    /// False once the subscription was dropped.
    pub(crate) fn is_live(&self) -> bool {
        !self.queue.is_closed()
    }

    /// Ends the subscription with `end` (the first recorded end wins).
    pub(crate) fn end(&self, end: SubscriptionEnd) {
        self.shared.end(end);
    }
}

/// Everything needed to open one subscription.
pub(crate) struct SubscriptionParts {
    pub(crate) identity: ProducerIdentity,
    pub(crate) sequence: u64,
    pub(crate) words: Arc<Vec<u64>>,
    pub(crate) encoder: FrameEncoder,
    pub(crate) queue_frames: usize,
    pub(crate) queue_bytes: usize,
    pub(crate) encoding: Arc<Semaphore>,
    pub(crate) heartbeat_interval: Duration,
    pub(crate) snapshot_progress_timeout: Duration,
    pub(crate) subscribers: Arc<AtomicUsize>,
}

/// Creates the subscriber's two ends; counts it in `subscribers` until dropped.
pub(crate) fn open(parts: SubscriptionParts) -> (PoolSubscription, SubscriberSender) {
    let (tx, rx) = mpsc::channel(parts.queue_frames);
    let shared = Arc::new(SubscriberShared::default());
    parts.subscribers.fetch_add(1, Ordering::AcqRel);
    let chunk_count = FrameEncoder::chunk_count(parts.words.len());
    let subscription = PoolSubscription {
        identity: parts.identity,
        snapshot: Some(SnapshotCursor {
            words: parts.words,
            sequence: parts.sequence,
            next_chunk: 0,
            chunk_count,
        }),
        snapshot_sequence: parts.sequence,
        queue: rx,
        shared: shared.clone(),
        encoding: parts.encoding,
        encoder: parts.encoder,
        heartbeat_interval: parts.heartbeat_interval,
        snapshot_progress_timeout: parts.snapshot_progress_timeout,
        last_progress: Instant::now(),
        sequence: parts.sequence,
        end: None,
        _membership: SubscriberMembership {
            subscribers: parts.subscribers,
        },
    };
    let sender = SubscriberSender {
        queue: tx,
        shared,
        max_bytes: parts.queue_bytes,
    };
    (subscription, sender)
}

#[derive(Debug)]
struct SnapshotCursor {
    words: Arc<Vec<u64>>,
    sequence: u64,
    next_chunk: u32,
    chunk_count: u32,
}

#[derive(Debug, Default)]
struct SubscriberShared {
    queued_bytes: AtomicUsize,
    end: OnceLock<SubscriptionEnd>,
}

impl SubscriberShared {
    fn charge(&self, bytes: usize, max: usize) -> bool {
        self.queued_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                queued.checked_add(bytes).filter(|total| *total <= max)
            })
            .is_ok()
    }

    fn release(&self, bytes: usize) {
        let _ = self
            .queued_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |queued| {
                Some(queued.saturating_sub(bytes))
            });
    }

    fn end(&self, end: SubscriptionEnd) {
        let _ = self.end.set(end);
    }

    /// The end reason when the subscriber must stop before draining its queue (lag).
    fn end_reason_if_cut_off(&self) -> Option<SubscriptionEnd> {
        self.end
            .get()
            .filter(|end| matches!(end, SubscriptionEnd::SubscriberLagged))
            .cloned()
    }

    fn end_reason(&self) -> SubscriptionEnd {
        self.end
            .get()
            .cloned()
            .unwrap_or(SubscriptionEnd::ProducerWithdrawn)
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

fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
