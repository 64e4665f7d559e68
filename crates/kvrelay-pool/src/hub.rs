//! The publication hub of one pool generation: a task that mirrors the actor's filter and
//! fans each delta, encoded once, out to bounded per-subscriber queues.
//!
//! The hub task owns the mirror, the sequence and the subscriber list; subscriptions and
//! deltas go through it in one order, so a new subscriber gets the mirror at sequence `N`
//! and then exactly the deltas `N → N+1 → …` — including those published while its
//! snapshot is being encoded and sent. The mirror is an `Arc<Vec<u64>>`: a snapshot is a
//! pointer copy, and a delta copies the table only while a subscriber still holds the
//! previous image (copy on write).
//!
//! Run loop (`biased`): cancellation (retire, evict, shutdown) first, then subscribe
//! commands, then the actor's deltas. With no subscriber a delta is applied without
//! encoding and without an encoding permit, so idle hubs are cheap. A delta that does not
//! follow the mirror (identity, sequence or bucket out of range) or cannot be encoded is a
//! terminal failure: subscribers end with `InvalidPublication` and the generation is
//! fenced through the failure callback. If the hub falls so far behind that the actor
//! overran its feed, the hub takes a fresh snapshot and ends every current subscriber with
//! `SubscriberLagged`: nobody ever gets a gapped stream.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use kvrelay_ckf::Delta;
use kvrelay_identity::ProducerIdentity;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::actor::{PoolActorHandle, PublicationFeed};
use crate::error::{SubscribeError, SubscriptionEnd};
use crate::frame::FrameEncoder;
use crate::limits::Limits;
use crate::registry::core::SlotHub;
use crate::subscription::{
    self, Offer, PoolFrame, PoolFrameKind, PoolSubscription, SubscriberSender,
};

/// Called once with a reason when the hub fails terminally; fences the generation.
pub(crate) type FailureCallback = Arc<dyn Fn(String) + Send + Sync>;

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
}

/// A cloneable handle to a running hub.
#[derive(Clone)]
pub(crate) struct HubHandle {
    shared: Arc<HubShared>,
}

struct HubShared {
    commands: mpsc::Sender<HubCommand>,
    subscribers: Arc<AtomicUsize>,
    cancel: CancellationToken,
    stopped: CancellationToken,
}

enum HubCommand {
    Subscribe {
        reply: oneshot::Sender<Result<PoolSubscription, SubscribeError>>,
    },
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
    ) -> Result<Self, String> {
        if feed.identity != context.identity {
            actor.detach_publication(feed.lease);
            return Err("pool actor identity differs from the hub's producer".to_owned());
        }
        let (commands, command_rx) = mpsc::channel(context.limits.max_subscribers_per_pool);
        let shared = Arc::new(HubShared {
            commands,
            subscribers: Arc::new(AtomicUsize::new(0)),
            cancel: context.shutdown.child_token(),
            stopped: CancellationToken::new(),
        });
        let task = HubTask {
            mirror: Arc::new(feed.words),
            sequence: feed.sequence,
            lease: feed.lease,
            deltas: feed.deltas,
            overrun: feed.overrun,
            subscribers: Vec::new(),
            commands: command_rx,
            shared: shared.clone(),
            actor: actor.clone(),
            encoder: FrameEncoder::new(context.relay, &context.identity),
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

    /// Opens a subscription: a snapshot of the mirror, then every later delta.
    pub(crate) async fn subscribe(&self) -> Result<PoolSubscription, SubscribeError> {
        let (reply, answer) = oneshot::channel();
        self.shared
            .commands
            .send(HubCommand::Subscribe { reply })
            .await
            .map_err(|_| hub_stopped())?;
        answer.await.map_err(|_| hub_stopped())?
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

fn hub_stopped() -> SubscribeError {
    SubscribeError::Unavailable {
        reason: "publication hub stopped".to_owned(),
    }
}

struct HubTask {
    mirror: Arc<Vec<u64>>,
    sequence: u64,
    lease: u64,
    deltas: mpsc::Receiver<Arc<Delta>>,
    overrun: Arc<std::sync::atomic::AtomicBool>,
    subscribers: Vec<SubscriberSender>,
    commands: mpsc::Receiver<HubCommand>,
    shared: Arc<HubShared>,
    actor: PoolActorHandle,
    encoder: FrameEncoder,
    context: HubContext,
}

/// Cancels `stopped` however the task exits.
struct StoppedGuard(CancellationToken);

impl Drop for StoppedGuard {
    fn drop(&mut self) {
        self.0.cancel();
    }
}

impl HubTask {
    async fn run(mut self) {
        let _stopped = StoppedGuard(self.shared.stopped.clone());
        let cancel = self.shared.cancel.clone();
        let end = loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => break self.cancel_reason(),
                Some(command) = self.commands.recv() => self.handle(command),
                delta = self.deltas.recv() => match delta {
                    Some(delta) => {
                        if let Err(reason) = self.on_delta(&delta, &cancel).await {
                            if cancel.is_cancelled() {
                                break self.cancel_reason();
                            }
                            tracing::error!(%reason, "publication hub failed, fencing the generation");
                            self.end_all(SubscriptionEnd::InvalidPublication { reason: reason.clone() });
                            (self.context.on_failure)(reason);
                            return;
                        }
                    }
                    None => {
                        if self.overrun.load(Ordering::Acquire) {
                            if let Err(reason) = self.resynchronise().await {
                                tracing::warn!(%reason, "publication hub could not resynchronise");
                                break SubscriptionEnd::ProducerWithdrawn;
                            }
                        } else {
                            break SubscriptionEnd::ProducerWithdrawn;
                        }
                    }
                },
            }
        };
        self.end_all(end);
        // Retire the actor's lease while our feed is still open, so it stops publishing.
        self.actor.detach_publication(self.lease);
    }

    fn cancel_reason(&self) -> SubscriptionEnd {
        if self.context.shutdown.is_cancelled() {
            SubscriptionEnd::ShuttingDown
        } else {
            SubscriptionEnd::ProducerWithdrawn
        }
    }

    fn handle(&mut self, command: HubCommand) {
        match command {
            HubCommand::Subscribe { reply } => {
                let limits = &self.context.limits;
                self.subscribers.retain(|subscriber| subscriber.is_live());
                let live = self.shared.subscribers.load(Ordering::Acquire);
                if live >= limits.max_subscribers_per_pool {
                    let _ = reply.send(Err(SubscribeError::SubscriberLimit {
                        pool: *self.context.identity.pool_id(),
                        limit: limits.max_subscribers_per_pool,
                    }));
                    return;
                }
                let (subscription, sender) = subscription::open(subscription::SubscriptionParts {
                    identity: self.context.identity,
                    sequence: self.sequence,
                    words: self.mirror.clone(),
                    encoder: self.encoder,
                    queue_frames: limits.subscriber_queue_frames,
                    queue_bytes: limits.subscriber_queue_bytes,
                    encoding: self.context.encoding.clone(),
                    heartbeat_interval: limits.heartbeat_interval,
                    snapshot_progress_timeout: limits.snapshot_progress_timeout,
                    subscribers: self.shared.subscribers.clone(),
                });
                // A requester that went away drops the subscription, which unsubscribes.
                if reply.send(Ok(subscription)).is_ok() {
                    self.subscribers.push(sender);
                }
            }
        }
    }

    async fn on_delta(&mut self, delta: &Delta, cancel: &CancellationToken) -> Result<(), String> {
        let next = self.sequence.checked_add(1);
        if delta.base_sequence != self.sequence || Some(delta.sequence) != next {
            return Err(format!(
                "sequence gap: hub at {}, delta {} -> {}",
                self.sequence, delta.base_sequence, delta.sequence
            ));
        }
        let bucket_count = self.mirror.len();
        if let Some(image) = delta
            .images
            .iter()
            .find(|image| image.bucket_idx as usize >= bucket_count)
        {
            return Err(format!(
                "delta bucket {} out of range for bucket count {bucket_count}",
                image.bucket_idx
            ));
        }
        self.subscribers.retain(SubscriberSender::is_live);
        let frame = if self.subscribers.is_empty() {
            None
        } else {
            let permit = tokio::select! {
                biased;
                () = cancel.cancelled() => return Err("publication hub cancelled".to_owned()),
                permit = self.context.encoding.clone().acquire_owned() => {
                    permit.map_err(|_| "encoding permits closed".to_owned())?
                }
            };
            let bytes = self
                .encoder
                .delta(delta)
                .map_err(|error| format!("delta encoding failed: {error}"))?;
            drop(permit);
            Some(PoolFrame {
                kind: PoolFrameKind::Delta,
                base_sequence: delta.base_sequence,
                sequence: delta.sequence,
                bytes,
            })
        };
        let mirror = Arc::make_mut(&mut self.mirror);
        for image in &delta.images {
            if let Some(word) = mirror.get_mut(image.bucket_idx as usize) {
                *word = image.word;
            }
        }
        self.sequence = delta.sequence;
        if let Some(frame) = frame {
            self.subscribers
                .retain(|subscriber| match subscriber.offer(&frame) {
                    Offer::Queued => true,
                    Offer::Lagged => {
                        tracing::warn!(seq = frame.sequence, "subscriber lagged, cutting it off");
                        false
                    }
                    Offer::Gone => false,
                });
        }
        Ok(())
    }

    async fn resynchronise(&mut self) -> Result<(), String> {
        tracing::warn!(
            seq = self.sequence,
            "publication hub overran by its actor, taking a new snapshot"
        );
        self.end_all(SubscriptionEnd::SubscriberLagged);
        let feed: PublicationFeed = self
            .actor
            .attach_publication()
            .await
            .map_err(|error| error.to_string())?;
        if feed.identity != self.context.identity {
            return Err("pool actor identity changed".to_owned());
        }
        self.mirror = Arc::new(feed.words);
        self.sequence = feed.sequence;
        self.lease = feed.lease;
        self.deltas = feed.deltas;
        self.overrun = feed.overrun;
        Ok(())
    }

    fn end_all(&mut self, end: SubscriptionEnd) {
        for subscriber in self.subscribers.drain(..) {
            subscriber.end(end.clone());
        }
    }
}
