//! The publication hub of one pool generation: a thin async driver of the sans-IO
//! [`kvrelay_ckf::stream::Publisher`], which owns the mirror, sequencing, per-subscriber
//! cursors, coalescing backlogs, the resume window and the deadlines.
//!
//! The hub task moves the actor's deltas into the publisher (encoding each once, under the
//! global encoding permits, when someone is subscribed) and ticks its timeouts; each
//! [`PoolSubscription`] pulls its own frames from the publisher. Both go through one short
//! lock, never held across an await, so a subscriber opened at sequence `N` gets exactly
//! the deltas after `N`, however the two interleave.
//!
//! Run loop (`biased`): cancellation (retire, evict, shutdown) first, then the actor's
//! deltas, then the timeout tick. A delta that does not follow the mirror or cannot be
//! encoded is a terminal failure: subscribers end with `InvalidPublication` and the
//! generation is fenced through the failure callback. The actor never overruns the hub: a
//! full feed makes it accumulate its changes into a later delta.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use kvrelay_ckf::Delta;
use kvrelay_ckf::stream::{Publisher, StreamLimits, StreamStats, SubscribeRefused};
use kvrelay_identity::ProducerIdentity;
use parking_lot::Mutex;
use tokio::sync::{Semaphore, mpsc, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::actor::{FeedItem, PoolActorHandle, PublicationFeed};
use crate::error::{HubFailure, SubscribeError, SubscriptionEnd, Unavailability};
use crate::frame::{encoder, sent_now_us};
use crate::limits::Limits;
use crate::registry::core::SlotHub;
use crate::subscription::{self, PoolSubscription};
use kvrelay_codec::session::PoolFrameEncoder;

/// Called once with a reason when the hub fails terminally; fences the generation.
pub(crate) type FailureCallback = Arc<dyn Fn(HubFailure) + Send + Sync>;

/// How often the hub checks the publisher's deadlines without new deltas.
const TIMEOUT_TICK: Duration = Duration::from_secs(1);

/// What a hub needs from its registry.
#[derive(Clone)]
pub(crate) struct HubContext {
    pub(crate) identity: ProducerIdentity,
    pub(crate) relay: kvrelay_identity::DcRelayIdentity,
    pub(crate) limits: Arc<Limits>,
    pub(crate) encoding: Arc<Semaphore>,
    pub(crate) tracker: TaskTracker,
    /// Cancelled on registry shutdown: subscribers then end with `ShuttingDown`.
    pub(crate) shutdown: CancellationToken,
    pub(crate) on_failure: FailureCallback,
    /// The registry's stream counters, summed over every hub it ever ran.
    pub(crate) totals: Arc<Mutex<StreamStats>>,
}

/// How a subscriber wants its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SubscribeOptions {
    /// The last sequence the subscriber applied of this generation, if it kept a replica:
    /// the stream then resumes from it when the relay still holds what it missed.
    pub resume_from: Option<u64>,
    /// Whether the subscriber accepts deltas spanning several sequences (protocol minor
    /// 1); without it a subscriber that falls behind is cut off at the backlog bound.
    pub coalesce: bool,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        Self {
            resume_from: None,
            coalesce: true,
        }
    }
}

/// A cloneable handle to a running hub.
#[derive(Clone)]
pub(crate) struct HubHandle {
    shared: Arc<HubShared>,
}

/// What the hub task and its subscriptions share.
pub(crate) struct HubShared {
    pub(crate) publisher: Mutex<Publisher<Option<Bytes>>>,
    /// Bumped whenever a subscription may have something new (a delta, a timeout, the end).
    pub(crate) wake: watch::Sender<u64>,
    /// Why the hub ended, once it has.
    pub(crate) end: OnceLock<SubscriptionEnd>,
    pub(crate) identity: ProducerIdentity,
    pub(crate) encoder: PoolFrameEncoder,
    pub(crate) encoding: Arc<Semaphore>,
    subscribers: Arc<AtomicUsize>,
    cancel: CancellationToken,
    stopped: CancellationToken,
}

impl HubShared {
    pub(crate) fn wake_all(&self) {
        self.wake.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn finish(&self, end: SubscriptionEnd) {
        let _ = self.end.set(end);
        self.wake_all();
    }
}

impl SlotHub for HubHandle {
    fn is_idle(&self) -> bool {
        self.shared.subscribers.load(Ordering::Acquire) == 0 && !self.shared.stopped.is_cancelled()
    }
}

impl HubHandle {
    /// Spawns the hub task over an attached feed (a snapshot and its deltas).
    pub(crate) fn spawn(
        actor: &PoolActorHandle,
        feed: PublicationFeed,
        context: HubContext,
    ) -> Result<Self, HubFailure> {
        if feed.identity != context.identity {
            actor.detach_publication(feed.lease);
            return Err(HubFailure::IdentityMismatch);
        }
        let stream_limits = stream_limits(&context.limits);
        let publisher = match Publisher::new(feed.sequence, feed.words, stream_limits) {
            Ok(publisher) => publisher,
            Err(error) => {
                actor.detach_publication(feed.lease);
                return Err(error.into());
            }
        };
        let shared = Arc::new(HubShared {
            publisher: Mutex::new(publisher),
            wake: watch::Sender::new(0),
            end: OnceLock::new(),
            identity: context.identity,
            encoder: encoder(context.relay, &context.identity, context.limits.codec),
            encoding: context.encoding.clone(),
            subscribers: Arc::new(AtomicUsize::new(0)),
            cancel: context.shutdown.child_token(),
            stopped: CancellationToken::new(),
        });
        let task = HubTask {
            reported: StreamStats::default(),
            lease: feed.lease,
            deltas: feed.deltas,
            shared: shared.clone(),
            actor: actor.clone(),
            context: context.clone(),
        };
        let span = tracing::info_span!(
            "publication_hub",
            pool = %context.identity.pool_id().indexer_domain,
            generation = context.identity.layout_generation()
        );
        context.tracker.spawn(task.run().instrument(span));
        Ok(Self { shared })
    }

    /// Opens a subscription: a snapshot of the mirror (or a resumption), then every later
    /// delta.
    pub(crate) fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<PoolSubscription, SubscribeError> {
        if let Some(end) = self.shared.end.get() {
            return Err(SubscribeError::Unavailable {
                reason: Unavailability::HubStopped(end.clone()),
            });
        }
        let started = self.shared.publisher.lock().handle_subscribe(
            options.resume_from,
            options.coalesce,
            Instant::now().into_std(),
        );
        match started {
            Ok((id, start)) => Ok(subscription::open(
                self.shared.clone(),
                id,
                start,
                self.shared.subscribers.clone(),
            )),
            Err(SubscribeRefused::SubscriberLimit { limit }) => {
                Err(SubscribeError::SubscriberLimit {
                    pool: *self.shared.identity.pool_id(),
                    limit,
                })
            }
            Err(SubscribeRefused::SnapshotLimit { limit }) => Err(SubscribeError::SnapshotLimit {
                pool: *self.shared.identity.pool_id(),
                limit,
            }),
        }
    }

    /// Stops the hub (subscribers end with `ProducerWithdrawn`) and waits for its task.
    pub(crate) async fn shutdown(&self) {
        self.shared.cancel.cancel();
        self.shared.stopped.cancelled().await;
    }

    /// Stops the hub without waiting (subscribers end with `ProducerWithdrawn`).
    pub(crate) fn retire(&self) {
        self.shared.cancel.cancel();
    }
}

/// The publisher's limits: the configured stream limits, with every delta handed out (a
/// lagging subscriber's backlog is coalesced in runs) small enough for one frame: within
/// the CBI1 payload's capacity and `max_frame_len`.
fn stream_limits(limits: &Limits) -> StreamLimits {
    let frame_images = u64::from(limits.codec.max_frame_len)
        .saturating_sub(kvrelay_ckf::stream::DELTA_FRAME_OVERHEAD)
        / kvrelay_ckf::stream::IMAGE_WIRE_BYTES;
    let frame_images = usize::try_from(frame_images).unwrap_or(usize::MAX);
    StreamLimits {
        max_delta_images: limits
            .stream
            .max_delta_images
            .min(kvrelay_codec::cbi1::MAX_DELTA_IMAGES)
            .min(frame_images)
            .max(1),
        ..limits.stream.clone()
    }
}

struct HubTask {
    /// The counters already added to the registry's totals.
    reported: StreamStats,
    lease: u64,
    deltas: mpsc::Receiver<FeedItem>,
    shared: Arc<HubShared>,
    actor: PoolActorHandle,
    context: HubContext,
}

/// Cancels `stopped` however the task exits.
impl HubTask {
    async fn run(mut self) {
        // Stopped (cancelled) however the task ends.
        let _stopped = self.shared.stopped.clone().drop_guard();
        let cancel = self.shared.cancel.clone();
        let mut tick = tokio::time::interval(TIMEOUT_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let end = loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => break self.cancel_reason(),
                item = self.deltas.recv() => match item {
                    Some(FeedItem::Barrier(reply)) => {
                        let _ = reply.send(());
                    }
                    Some(FeedItem::Delta(delta)) => {
                        match self.on_delta(delta, &cancel).await {
                            Ok(true) => {}
                            Ok(false) => break self.cancel_reason(),
                            Err(_) if cancel.is_cancelled() => break self.cancel_reason(),
                            Err(reason) => {
                                tracing::error!(%reason, "publication hub failed, fencing the generation");
                                self.shared.finish(SubscriptionEnd::InvalidPublication { reason: reason.clone() });
                                (self.context.on_failure)(reason);
                                self.answer_barriers();
                                self.retire_gauges();
                                return;
                            }
                        }
                    }
                    None => break SubscriptionEnd::ProducerWithdrawn,
                },
                _ = tick.tick() => {
                    self.shared.publisher.lock().handle_timeout(Instant::now().into_std());
                    self.shared.wake_all();
                    self.report_stats();
                }
            }
        };
        self.shared.finish(end);
        self.report_stats();
        self.retire_gauges();
        self.answer_barriers();
        // Retire the actor's lease while our feed is still open, so it stops publishing.
        self.actor.detach_publication(self.lease);
    }

    /// Answers the settle barriers still queued behind the hub's end, so a settle racing a
    /// retirement returns instead of failing.
    fn answer_barriers(&mut self) {
        self.deltas.close();
        while let Ok(item) = self.deltas.try_recv() {
            if let FeedItem::Barrier(reply) = item {
                let _ = reply.send(());
            }
        }
    }

    /// Adds what this hub's counters gained and its gauges now read to the registry's totals.
    fn report_stats(&mut self) {
        let current = self.shared.publisher.lock().stats();
        let before = self.reported;
        self.context.totals.lock().advance(&before, &current);
        self.reported = current;
    }

    /// Takes this hub's gauges (mirror, resume window, pinned copies, backlogs) out of the
    /// registry's totals: it holds none of that once it has ended.
    fn retire_gauges(&mut self) {
        let retired = kvrelay_ckf::stream::StreamStats {
            pinned_copies: 0,
            pinned_copy_bytes: 0,
            retained_deltas: 0,
            retained_bytes: 0,
            pending_bytes: 0,
            mirror_bytes: 0,
            ..self.reported
        };
        self.context.totals.lock().advance(&self.reported, &retired);
        self.reported = retired;
    }

    fn cancel_reason(&self) -> SubscriptionEnd {
        if self.context.shutdown.is_cancelled() {
            SubscriptionEnd::ShuttingDown
        } else {
            SubscriptionEnd::ProducerWithdrawn
        }
    }

    /// Hands one delta to the publisher; `Ok(false)` when cancelled meanwhile.
    async fn on_delta(
        &mut self,
        delta: Delta,
        cancel: &CancellationToken,
    ) -> Result<bool, HubFailure> {
        let live = self.shared.publisher.lock().live_subscriber_count() > 0;
        // Encoded once, outside the lock, for every subscriber it goes to alone.
        let encoded = if live {
            let permit = tokio::select! {
                biased;
                () = cancel.cancelled() => return Ok(false),
                permit = self.shared.encoding.clone().acquire_owned() => {
                    permit.map_err(|_| HubFailure::PermitsClosed)?
                }
            };
            let bytes = self.shared.encoder.delta(&delta, sent_now_us())?;
            drop(permit);
            Some(bytes)
        } else {
            None
        };
        self.shared
            .publisher
            .lock()
            .handle_delta(delta, Instant::now().into_std(), |_| encoded)?;
        self.shared.wake_all();
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every delta a hub's publisher hands out fits one frame: by default as many images
    /// as a CBI1 payload carries, fewer when `max_frame_len` is smaller.
    #[test]
    fn deltas_handed_out_fit_one_frame() {
        let defaults = Limits::default();
        assert_eq!(
            stream_limits(&defaults).max_delta_images,
            kvrelay_codec::cbi1::MAX_DELTA_IMAGES
        );
        let mut small = Limits::default();
        small.codec.max_frame_len = 1 << 20;
        assert_eq!(
            stream_limits(&small).max_delta_images,
            ((1 << 20) - 256) / 12
        );
        assert_eq!(
            stream_limits(&small).max_backlog_bytes,
            small.stream.max_backlog_bytes,
            "the backlog bound is the configured one"
        );
    }
}
