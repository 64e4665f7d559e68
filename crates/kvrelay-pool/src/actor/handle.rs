//! The cloneable handle of a pool actor: what others may ask of it (events through
//! block-weighted permits, flushes, barriers, publication leases, health) and how.

use std::sync::Arc;

use kvrelay_ckf::tier::ResolvedChange;
use kvrelay_ckf::{CacheTier, Membership, RouterEvent, SourceId, TierEvent};
use kvrelay_identity::ProducerIdentity;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::{
    Actor, ActorShared, Command, EventChunk, MAX_EVENTS_PER_BATCH, PoolActorHandle, PoolActorStats,
    PublicationFeed,
};
use crate::error::{ActorError, BatchSubmitError, FeedError, TransferError};
use crate::filter::{FilterState, SourceMappings};
use crate::health::{HealthCell, PoolHealth};
use crate::limits::Limits;

impl PoolActorHandle {
    /// Spawns the actor on `tracker`. Cancelling `registry` (registry shutdown or drop)
    /// fences the actor; the actor cancels `generation` itself when a fault means the
    /// generation must be rebuilt.
    pub(crate) fn spawn(
        state: FilterState,
        identity: ProducerIdentity,
        limits: &Limits,
        tracker: &TaskTracker,
        registry: &CancellationToken,
        generation: CancellationToken,
        lanes: Vec<(CacheTier, PoolActorHandle)>,
    ) -> Self {
        let mut state = state;
        if lanes.iter().any(|(tier, _)| *tier == CacheTier::Device) {
            // Its format twin is fed the owned-set changes this filter records.
            state.record_memberships();
        }
        let (mailbox, commands) = mpsc::channel(limits.actor_mailbox);
        let shared = Arc::new(ActorShared {
            mailbox,
            permits: Arc::new(Semaphore::new(limits.actor_pending_blocks as usize)),
            max_weight: limits.actor_pending_blocks,
            identity,
            fence: registry.child_token(),
            stopped: CancellationToken::new(),
            health: HealthCell::new(Instant::now(), limits.actor_mailbox),
        });
        let actor = Actor {
            identity,
            state,
            commands,
            shared: shared.clone(),
            generation,
            latest_faults: Default::default(),
            fence: shared.fence.clone(),
            window: limits.publication_window,
            max_delta_buckets: limits.max_delta_buckets as usize,
            hub_queue: limits.hub_delta_queue,
            last_publication: None,
            deadline: None,
            lease: None,
            next_lease: 1,
            shutdown_replies: Vec::new(),
            stats: PoolActorStats::default(),
            lanes,
        };
        let span = tracing::info_span!(
            "pool_actor",
            pool = %identity.pool_id().indexer_domain,
            generation = identity.layout_generation()
        );
        let stopped = shared.stopped.clone();
        tracker.spawn(
            async move {
                let _stopped = stopped.drop_guard();
                actor.run().await;
            }
            .instrument(span),
        );
        Self { shared }
    }

    /// The producer generation this actor publishes.
    pub fn identity(&self) -> ProducerIdentity {
        self.shared.identity
    }

    /// Queues one event; returns once queued, not once applied.
    ///
    /// Waits for block permits (the event's block count, at least 1, at most
    /// `actor_pending_blocks`) and then for mailbox room. Cancel-safe: dropping the future
    /// before it returns queues nothing.
    pub async fn submit(&self, event: RouterEvent) -> Result<(), ActorError> {
        let weight = event_weight(&event, self.shared.max_weight);
        self.enqueue_one(weight, |permit| Command::Apply {
            event,
            _permit: permit,
        })
        .await
    }

    /// Admits `weight` permits and queues the one-event command `command` makes of them,
    /// stamped and sent in one step, so stamps leave in mailbox order.
    async fn enqueue_one(
        &self,
        weight: u32,
        command: impl FnOnce(OwnedSemaphorePermit) -> Command,
    ) -> Result<(), ActorError> {
        let (permit, slot) = self.admit(weight).await?;
        self.shared
            .health
            .enqueue(Instant::now(), || slot.send(command(permit)));
        Ok(())
    }

    /// Queues one lower-tier event (in order with the source's device events); returns
    /// once queued. The actor resolves it against its filter (an offload takes the
    /// canonical hashes its device blocks have at that point) and forwards it to the
    /// pool's lane of that tier; a tier the pool keeps no lane of is counted and dropped.
    /// Weighs its block count in permits, like [`PoolActorHandle::submit`].
    pub async fn submit_tier(&self, event: TierEvent) -> Result<(), ActorError> {
        let weight = clamp_weight(event.change.n_blocks(), self.shared.max_weight);
        self.enqueue_one(weight, |permit| Command::ApplyTier {
            event,
            _permit: permit,
        })
        .await
    }

    /// Queues a resolved change for this lane's actor (from its pool's actor).
    pub(super) async fn submit_lane(
        &self,
        source: SourceId,
        event_id: u64,
        change: ResolvedChange,
    ) -> Result<(), ActorError> {
        let weight = clamp_weight(change.n_blocks(), self.shared.max_weight);
        self.enqueue_one(weight, |permit| Command::ApplyLane {
            source,
            event_id,
            change,
            _permit: permit,
        })
        .await
    }

    /// Queues part of its pool's membership log for this format twin's actor (from the
    /// pool's actor), weighted by its length.
    pub(super) async fn submit_memberships(
        &self,
        changes: Vec<Membership>,
    ) -> Result<(), ActorError> {
        let weight = clamp_weight(changes.len(), self.shared.max_weight);
        self.enqueue_one(weight, |permit| Command::ApplyMemberships {
            changes,
            _permit: permit,
        })
        .await
    }

    /// Splits `events` into the chunks [`PoolActorHandle::submit_chunk`] queues, in order.
    ///
    /// A chunk holds at most [`MAX_EVENTS_PER_BATCH`] events and at most
    /// `actor_pending_blocks` of weight (an event weighs its block count, at least 1), so
    /// the same permits bound the queued blocks as with [`PoolActorHandle::submit`] and a
    /// chunk never waits for more permits than exist. An empty `events` gives no chunk.
    pub fn chunk_events(&self, events: Vec<RouterEvent>) -> Vec<EventChunk> {
        let max_weight = self.shared.max_weight.max(1);
        let mut chunks = Vec::new();
        let mut chunk = EventChunk::default();
        for event in events {
            let weight = event_weight(&event, max_weight);
            let full = chunk.events.len() >= MAX_EVENTS_PER_BATCH
                || chunk.weight.saturating_add(weight) > max_weight;
            if full && !chunk.events.is_empty() {
                chunks.push(std::mem::take(&mut chunk));
            }
            chunk.weight += weight;
            chunk.events.push(event);
        }
        if !chunk.events.is_empty() {
            chunks.push(chunk);
        }
        chunks
    }

    /// Queues one chunk from [`PoolActorHandle::chunk_events`]: all its events or none;
    /// returns once queued, not once applied.
    ///
    /// One permit acquisition, one mailbox slot and one health stamp for the whole chunk
    /// instead of per event: a source that delivers a burst (an engine's batch is
    /// hundreds of events) costs the actor one wake per chunk. Cancel-safe: dropping the
    /// future before it returns queues nothing.
    pub async fn submit_chunk(&self, chunk: EventChunk) -> Result<(), ActorError> {
        let (permit, slot) = self.admit(chunk.weight).await?;
        let count = chunk.events.len();
        self.shared.health.enqueue_many(Instant::now(), count, || {
            slot.send(Command::ApplyBatch {
                events: chunk.events,
                _permit: permit,
            });
        });
        Ok(())
    }

    /// Queues `events` in order, chunk by chunk ([`PoolActorHandle::chunk_events`]),
    /// until all are queued, the actor refuses a chunk or `cancel` fires; returns once all
    /// are queued, not once applied.
    ///
    /// On error, the returned [`BatchSubmitError`] says how many events were queued before
    /// it (whole chunks from the front; the rest are not) and why the rest was refused
    /// ([`ActorError::Cancelled`] when `cancel` fired), so a caller counts every event
    /// exactly once. Dropping the future instead queues the chunks already sent and
    /// nothing of the rest, uncounted: cancel through `cancel`.
    pub async fn submit_batch(
        &self,
        events: Vec<RouterEvent>,
        cancel: &CancellationToken,
    ) -> Result<(), BatchSubmitError> {
        let mut queued = 0;
        for chunk in self.chunk_events(events) {
            let len = chunk.len();
            let submitted = tokio::select! {
                biased;
                () = cancel.cancelled() => Err(ActorError::Cancelled),
                submitted = self.submit_chunk(chunk) => submitted,
            };
            submitted.map_err(|cause| BatchSubmitError { queued, cause })?;
            queued += len;
        }
        Ok(())
    }

    /// Waits for `weight` block permits, then for a mailbox slot: the order every
    /// submission admits itself in (permits first, so a full budget holds no slot).
    async fn admit(
        &self,
        weight: u32,
    ) -> Result<(OwnedSemaphorePermit, mpsc::Permit<'_, Command>), ActorError> {
        let permit = self
            .shared
            .permits
            .clone()
            .acquire_many_owned(weight)
            .await
            .map_err(|_| ActorError::ShuttingDown)?;
        let slot = self
            .shared
            .mailbox
            .reserve()
            .await
            .map_err(|_| ActorError::ShuttingDown)?;
        Ok((permit, slot))
    }

    /// The actor's health at `now`, O(1) and without the mailbox: counters as of its last
    /// command, mailbox depth, pending events and their age, time since the last applied
    /// event, the latest fault of each category. Fresh even when the actor is stalled.
    pub fn health(&self, now: Instant) -> PoolHealth {
        let mailbox = &self.shared.mailbox;
        let depth = mailbox.max_capacity() - mailbox.capacity();
        self.shared.health.read(now, depth, self.is_stopped())
    }

    /// Test hook: the actor takes no command until the returned sender fires or drops.
    /// Waits until the actor has stopped. Not for production use.
    #[cfg(any(test, feature = "test-hooks"))]
    pub async fn stall(&self) -> Result<oneshot::Sender<()>, ActorError> {
        let (release, stalled) = oneshot::channel();
        self.shared
            .mailbox
            .send(Command::Stall { release: stalled })
            .await
            .map_err(|_| ActorError::ShuttingDown)?;
        Ok(release)
    }

    /// Removes every block of `source` (its cache was cleared or the source went away)
    /// and waits until it is applied.
    pub async fn clear_source(&self, source: SourceId) -> Result<(), ActorError> {
        self.request(|reply| Command::ClearSource { source, reply })
            .await
    }

    /// Every source's exact ownership after every queued command (a checkpoint's
    /// content). Copies `16 bytes × mappings` on the actor; nothing changes.
    pub async fn export_mappings(&self) -> Result<Vec<SourceMappings>, TransferError> {
        Ok(self
            .request(|reply| Command::ExportMappings { reply })
            .await??)
    }

    /// Makes each listed source hold exactly its mappings (from a checkpoint), all or
    /// nothing, and publishes the change as one window. Returns the mappings restored.
    /// Meant for a fresh generation before its sources start.
    pub async fn restore(&self, sources: Vec<SourceMappings>) -> Result<u64, TransferError> {
        Ok(self
            .request(|reply| Command::Restore { sources, reply })
            .await??)
    }

    /// Publishes the pending batch now and waits until it is handed to the hub's feed (the
    /// hub may not have taken it yet; see [`PoolActorHandle::settle`]).
    pub async fn flush(&self) -> Result<(), ActorError> {
        self.request(|reply| Command::Flush {
            reply,
            through_hub: false,
        })
        .await
    }

    /// Publishes the pending batch now and waits until the hub, if any, has taken it into
    /// its publisher: a subscription opened after this returns starts at or after every
    /// change applied before it. Waits for the hub's progress (a stalled hub holds it up;
    /// a hub that ends answers it), so use it at the end of a workload or in tests, not on
    /// a hot path.
    pub async fn settle(&self) -> Result<(), ActorError> {
        self.request(|reply| Command::Flush {
            reply,
            through_hub: true,
        })
        .await
    }

    /// The exact number of blocks each source holds, sorted by source, after every queued
    /// command. Cheap (no table scan): poll it for load accounting.
    pub async fn source_blocks(&self) -> Result<Vec<(SourceId, u64)>, ActorError> {
        self.request(|reply| Command::SourceBlocks { reply }).await
    }

    /// The actor's counters and filter statistics, after every queued command (O(1) for
    /// the actor; [`PoolActorHandle::health`] reads the same without waiting).
    pub async fn stats(&self) -> Result<PoolActorStats, ActorError> {
        self.request(|reply| Command::Stats { reply }).await
    }

    /// Graceful stop: queued commands still run, the pending batch is published, then the
    /// task exits. A second or later call gets `ShuttingDown`.
    pub async fn shutdown(&self) -> Result<(), ActorError> {
        self.request(|reply| Command::Shutdown { reply }).await?;
        self.shared.stopped.cancelled().await;
        Ok(())
    }

    /// Hard stop: the pending batch is discarded and the hub's feed closes. Waits for the
    /// task to exit. Always succeeds.
    pub async fn fence(&self) {
        self.shared.fence.cancel();
        self.shared.stopped.cancelled().await;
    }

    /// True once the actor task has exited.
    pub fn is_stopped(&self) -> bool {
        self.shared.stopped.is_cancelled()
    }

    /// Block permits currently free (tests and stats).
    pub fn available_block_permits(&self) -> usize {
        self.shared.permits.available_permits()
    }

    /// The filter's sequence and table, after every queued command (tests).
    #[cfg(test)]
    pub(crate) async fn words(&self) -> Result<(u64, Vec<u64>), ActorError> {
        self.request(|reply| Command::Words { reply }).await
    }

    pub(crate) async fn attach_publication(&self) -> Result<PublicationFeed, FeedError> {
        Ok(self.request(|reply| Command::Attach { reply }).await??)
    }

    /// Retires `lease` if it is still the current one. Never waits.
    pub(crate) fn detach_publication(&self, lease: u64) {
        let _ = self.shared.mailbox.try_send(Command::Detach { lease });
    }

    async fn request<T>(
        &self,
        command: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, ActorError> {
        let (reply, answer) = oneshot::channel();
        self.shared
            .mailbox
            .send(command(reply))
            .await
            .map_err(|_| ActorError::ShuttingDown)?;
        answer.await.map_err(|_| ActorError::Stopped)
    }
}

/// An event's permit weight: its block count, at least 1, at most `max`.
fn event_weight(event: &RouterEvent, max: u32) -> u32 {
    let blocks = match &event.payload {
        kvrelay_ckf::EventPayload::Stored(stored) => stored.blocks.len(),
        kvrelay_ckf::EventPayload::Removed(removed) => removed.engine_block_ids.len(),
        kvrelay_ckf::EventPayload::AllCleared => 1,
    };
    clamp_weight(blocks, max)
}

/// A block count as a permit weight: at least 1, at most `max`.
fn clamp_weight(blocks: usize, max: u32) -> u32 {
    u32::try_from(blocks)
        .unwrap_or(u32::MAX)
        .clamp(1, max.max(1))
}
