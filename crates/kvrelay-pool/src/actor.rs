//! The pool actor: one serialized task per pool generation, the only owner of that
//! generation's filter state (exact ownership + counting cuckoo filter).
//!
//! Others hold a cloneable [`PoolActorHandle`]. Events enter through a bounded mailbox
//! after taking block-weighted permits (an event weighs its block count, at least 1), so
//! queued work is bounded both in commands and in blocks. Applied events are batched by
//! time and size, not by count: a change after a quiet `publication_window` is published
//! at once; later changes wait until a window has passed since the previous delta, or
//! until `max_delta_buckets` buckets changed. Latency stays low at low rates while the
//! frame rate stays bounded (1 / window) under load. [`PoolActorHandle::flush`] publishes
//! now.
//!
//! Deltas are handed to a publication hub only while one is attached (a lease); without
//! one the actor still drains its dirty buckets (the filter's sequence advances) but
//! delivers nothing. Attaching drains the pending tail, copies the table and hands the hub
//! a snapshot at sequence `S` and a bounded feed of deltas `S → S+1 → …`.
//! If the hub does not keep up and its feed is full, the actor does not drain its dirty
//! window: the changes keep accumulating (deltas are absolute images, so the next one
//! carries them all) and it retries a window later. Nothing is lost, nobody is cut off,
//! and the actor never waits for a hub.
//!
//! Run loop (`biased`): fence first, then the mailbox, then the publication timer.
//! [`PoolActorHandle::shutdown`] is graceful (queued commands run, the tail is published);
//! [`PoolActorHandle::fence`] is not (the tail is discarded).
//!
//! Faults are data: the actor never waits to report one. Each is counted by
//! [`FaultCategory`], the latest of each category is kept with its typed [`PoolFault`],
//! and a fault with a remedy gets it here (contradictory block ids → that source is
//! cleared; an exhausted sequence → the generation token is cancelled so its owner
//! rebuilds it). Stored events whose parent the source never reported are not faults but
//! *unroutable* blocks, counted and dropped. After every command the actor publishes its
//! counters into a shared cell that [`PoolActorHandle::health`] reads in O(1) without the
//! mailbox, so a stalled actor is still observable (see `health.rs`).

use std::sync::Arc;

use kvrelay_ckf::tier::ResolvedChange;
use kvrelay_ckf::{
    ApplyError, ApplyOutcome, CacheTier, Delta, EventPayload, Membership, RouterEvent, SourceId,
    TierEvent,
};
use kvrelay_identity::ProducerIdentity;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::error::PoolFault;
use crate::filter::{FilterState, FilterStats, SourceMappings};
use crate::health::HealthCell;

mod fault;
mod handle;
mod lanes;

pub use fault::{ActorFault, FaultCategory, FaultCounts};
#[cfg(test)]
pub(crate) use lanes::MAX_MEMBERSHIPS_PER_COMMAND;

/// A snapshot of one actor's counters and filter statistics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolActorStats {
    /// The last published sequence.
    pub sequence: u64,
    /// Whether a hub is attached (deltas are being sequenced).
    pub publishing: bool,
    /// Events applied (accepted, possibly with omissions).
    pub events_applied: u64,
    /// Events the filter rejected (faults and unroutable events together).
    pub events_rejected: u64,
    /// Stored events rejected because their parent block is unknown to their source (a
    /// relay restarted next to a running engine, or a lost event): not faults.
    pub unroutable_events: u64,
    /// Blocks of those events.
    pub unroutable_blocks: u64,
    /// Deltas published to a hub.
    pub publications: u64,
    /// Publication boundaries that found no changed bucket.
    pub unchanged_publications: u64,
    /// Bucket images drained from the filter (published or not).
    pub emitted_images: u64,
    /// Publications deferred because the hub's feed was full (the changes accumulated
    /// into a later delta).
    pub deferred_publications: u64,
    /// Faults, by category.
    pub faults: FaultCounts,
    /// Sources cleared as the remedy of a contradictory block id.
    pub contradiction_resets: u64,
    /// Blocks owned but not resident because the filter was full (lossy, not a fault).
    pub capacity_omissions: u64,
    /// Lower-tier events received (a pool's actor): resolved and forwarded to their lane.
    pub tier_events: u64,
    /// Lower-tier events for a tier the pool keeps no lane of, or whose lane had stopped
    /// (retiring with the pool): dropped.
    pub tier_events_without_lane: u64,
    /// Offloaded blocks whose device block this filter did not hold when the offload
    /// arrived (dropped, never guessed).
    pub offloads_unmapped: u64,
    /// The filter's own statistics (load, omissions, unknown removals, resident blocks),
    /// all O(1) to read.
    pub filter: FilterStats,
}

/// One item of a hub's feed, in the order the actor produced it.
pub(crate) enum FeedItem {
    /// The next delta after the hub's mirror.
    Delta(Delta),
    /// A settle barrier: the hub answers it once every delta before it is in the publisher,
    /// so a subscription opened after [`PoolActorHandle::settle`] sees every change.
    Barrier(oneshot::Sender<()>),
}

/// What a hub receives when it attaches: a snapshot and the feed of later deltas.
pub(crate) struct PublicationFeed {
    pub(crate) identity: ProducerIdentity,
    pub(crate) lease: u64,
    pub(crate) sequence: u64,
    pub(crate) words: Vec<u64>,
    pub(crate) deltas: mpsc::Receiver<FeedItem>,
}

/// A cloneable handle to one pool actor.
#[derive(Debug, Clone)]
pub struct PoolActorHandle {
    shared: Arc<ActorShared>,
}

/// Events queued to an actor as one mailbox command, from
/// [`PoolActorHandle::chunk_events`]. Its weight (blocks) fits the actor's permits.
#[derive(Debug, Default)]
pub struct EventChunk {
    events: Vec<RouterEvent>,
    weight: u32,
}

impl EventChunk {
    /// The events in the chunk.
    pub fn len(&self) -> usize {
        self.events.len()
    }

    /// Whether the chunk holds no event (never, when from `chunk_events`).
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}

#[derive(Debug)]
struct ActorShared {
    mailbox: mpsc::Sender<Command>,
    permits: Arc<Semaphore>,
    max_weight: u32,
    identity: ProducerIdentity,
    fence: CancellationToken,
    stopped: CancellationToken,
    health: HealthCell,
}

#[derive(Debug)]
enum Command {
    Apply {
        event: RouterEvent,
        _permit: OwnedSemaphorePermit,
    },
    /// Events applied in order as one command (see [`PoolActorHandle::submit_chunk`]).
    ApplyBatch {
        events: Vec<RouterEvent>,
        _permit: OwnedSemaphorePermit,
    },
    /// A lower-tier event for a pool's actor: resolved against its filter, forwarded.
    ApplyTier {
        event: TierEvent,
        _permit: OwnedSemaphorePermit,
    },
    /// Part of its pool's membership log, for a format twin's actor.
    ApplyMemberships {
        changes: Vec<Membership>,
        _permit: OwnedSemaphorePermit,
    },
    /// A resolved lower-tier change for a lane's actor.
    ApplyLane {
        source: SourceId,
        event_id: u64,
        change: ResolvedChange,
        _permit: OwnedSemaphorePermit,
    },
    ClearSource {
        source: SourceId,
        reply: oneshot::Sender<()>,
    },
    Flush {
        reply: oneshot::Sender<()>,
        /// Whether the reply waits for the hub to take the flushed changes.
        through_hub: bool,
    },
    Stats {
        reply: oneshot::Sender<PoolActorStats>,
    },
    SourceBlocks {
        reply: oneshot::Sender<Vec<(SourceId, u64)>>,
    },
    ExportMappings {
        reply: oneshot::Sender<Result<Vec<SourceMappings>, PoolFault>>,
    },
    Restore {
        sources: Vec<SourceMappings>,
        reply: oneshot::Sender<Result<u64, PoolFault>>,
    },
    Attach {
        reply: oneshot::Sender<Result<PublicationFeed, PoolFault>>,
    },
    Detach {
        lease: u64,
    },
    Shutdown {
        reply: oneshot::Sender<()>,
    },
    #[cfg(test)]
    Words {
        reply: oneshot::Sender<(u64, Vec<u64>)>,
    },
    /// Test hook: the actor stops taking commands until `release` fires or is dropped.
    #[cfg(any(test, feature = "test-hooks"))]
    Stall {
        release: oneshot::Receiver<()>,
    },
}

impl std::fmt::Debug for PublicationFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublicationFeed")
            .field("lease", &self.lease)
            .field("sequence", &self.sequence)
            .finish_non_exhaustive()
    }
}

struct Lease {
    id: u64,
    deltas: mpsc::Sender<FeedItem>,
}

struct Actor {
    identity: ProducerIdentity,
    state: FilterState,
    commands: mpsc::Receiver<Command>,
    /// Where the actor publishes its health.
    shared: Arc<ActorShared>,
    /// Cancelled by the actor when a fault means this generation must be rebuilt.
    generation: CancellationToken,
    latest_faults: [Option<ActorFault>; 3],
    fence: CancellationToken,
    window: std::time::Duration,
    max_delta_buckets: usize,
    hub_queue: usize,
    /// When the last delta left (or was drained without a hub).
    last_publication: Option<Instant>,
    /// When the pending changes are due, if any.
    deadline: Option<Instant>,
    lease: Option<Lease>,
    next_lease: u64,
    shutdown_replies: Vec<oneshot::Sender<()>>,
    stats: PoolActorStats,
    /// A pool's lower-tier lanes (empty for a lane, or a device-only pool).
    lanes: Vec<(CacheTier, PoolActorHandle)>,
}

/// Most commands one wake of the actor runs before it records health and looks at its
/// timer again.
const MAX_COMMANDS_PER_WAKE: usize = 64;

/// Most events in one mailbox command from [`PoolActorHandle::submit_chunk`]. One wake of
/// the actor runs at most 64 commands, so it applies at most 4096 events before it sees
/// its publication timer and fence again.
pub const MAX_EVENTS_PER_BATCH: usize = 64;

impl Actor {
    async fn run(mut self) {
        let fence = self.fence.clone();
        let discard_tail = loop {
            let deadline = self.deadline;
            tokio::select! {
                biased;
                () = fence.cancelled() => break true,
                command = self.commands.recv() => match command {
                    Some(command) => self.run_queued(command).await,
                    None => break false,
                },
                () = sleep_until_armed(deadline), if deadline.is_some() => {
                    self.deadline = None;
                    self.publish().await;
                    self.publish_health(0);
                }
            }
            if self.fence.is_cancelled() {
                break true;
            }
        };
        if !discard_tail {
            self.publish_tail().await;
        }
        self.publish_health(0);
        self.lease = None;
        for reply in self.shutdown_replies.drain(..) {
            let _ = reply.send(());
        }
    }

    /// Runs `first` and the events already queued behind it in one wake, recording health
    /// once for them: per-command bookkeeping (the health lock, the clock, a task poll)
    /// costs more than applying an event. Bounded by [`MAX_COMMANDS_PER_WAKE`], so the
    /// publication timer and the fence are seen within a few dozen commands. Any other
    /// command may wait (a flush, an attach), so the events before it are on record first
    /// and the run ends with it.
    async fn run_queued(&mut self, first: Command) {
        let mut applied = 0usize;
        let mut command = first;
        for handled in 1..=MAX_COMMANDS_PER_WAKE {
            let events = match &command {
                Command::Apply { .. }
                | Command::ApplyTier { .. }
                | Command::ApplyLane { .. }
                | Command::ApplyMemberships { .. } => Some(1),
                Command::ApplyBatch { events, .. } => Some(events.len()),
                _ => None,
            };
            let is_event = events.is_some();
            if !is_event && applied > 0 {
                self.publish_health(applied);
                applied = 0;
            }
            self.handle(command).await;
            applied += events.unwrap_or(0);
            if !is_event || handled == MAX_COMMANDS_PER_WAKE || self.fence.is_cancelled() {
                break;
            }
            let Ok(next) = self.commands.try_recv() else {
                break;
            };
            command = next;
        }
        self.publish_health(applied);
    }

    async fn handle(&mut self, command: Command) {
        match command {
            Command::Apply { event, _permit } => {
                let result = self.state.apply(&event);
                drop(_permit);
                self.after_device_event(&event, result).await;
            }
            Command::ApplyBatch { events, _permit } => {
                for event in &events {
                    let result = self.state.apply(event);
                    self.after_device_event(event, result).await;
                }
                drop(_permit);
            }
            Command::ApplyTier { event, _permit } => {
                drop(_permit);
                self.forward_tier_event(event).await;
            }
            Command::ApplyMemberships { changes, _permit } => {
                let result = self.state.apply_memberships(&changes);
                drop(_permit);
                self.after_memberships(result).await;
            }
            Command::ApplyLane {
                source,
                event_id,
                change,
                _permit,
            } => {
                let result = self.state.apply_resolved(source, &change);
                drop(_permit);
                let stored_blocks = match &change {
                    ResolvedChange::Stored(stored) => stored.blocks.len() as u64,
                    _ => 0,
                };
                self.after_apply(source, event_id, stored_blocks, result)
                    .await;
            }
            Command::ClearSource { source, reply } => {
                if let Err(fault) = self.state.clear_source(source) {
                    self.report(ActorFault {
                        source: Some(source),
                        event_id: 0,
                        fault,
                    });
                }
                self.forward_memberships().await;
                self.clear_lanes(source, 0).await;
                self.publish().await;
                let _ = reply.send(());
            }
            Command::Flush { reply, through_hub } => {
                self.publish_tail().await;
                if through_hub {
                    self.pass_barrier(reply).await;
                } else {
                    let _ = reply.send(());
                }
            }
            Command::Stats { reply } => {
                let _ = reply.send(self.current_stats());
            }
            Command::SourceBlocks { reply } => {
                let _ = reply.send(self.state.source_blocks());
            }
            Command::ExportMappings { reply } => {
                let _ = reply.send(self.state.export_mappings());
            }
            Command::Restore { sources, reply } => {
                let result = self.state.restore(&sources);
                // What the restore (or its undoing) changed in the owned set.
                self.forward_memberships().await;
                // Published as one window: subscribers see all of it or none of it.
                self.publish().await;
                let _ = reply.send(result);
            }
            Command::Attach { reply } => self.attach(reply).await,
            Command::Detach { lease } => {
                if self
                    .lease
                    .as_ref()
                    .is_some_and(|current| current.id == lease)
                {
                    self.lease = None;
                }
            }
            Command::Shutdown { reply } => {
                self.commands.close();
                self.shutdown_replies.push(reply);
            }
            #[cfg(test)]
            Command::Words { reply } => {
                let _ = reply.send((self.state.sequence(), self.state.words().to_vec()));
            }
            #[cfg(any(test, feature = "test-hooks"))]
            Command::Stall { release } => {
                tokio::select! {
                    biased;
                    () = self.fence.cancelled() => {}
                    _ = release => {}
                }
            }
        }
    }

    /// The counters as of now (O(1)).
    fn current_stats(&self) -> PoolActorStats {
        let mut stats = self.stats;
        stats.sequence = self.state.sequence();
        stats.publishing = self.lease.is_some();
        stats.filter = self.state.stats();
        stats
    }

    /// Publishes the counters into the shared health cell; `applied` counts the applied
    /// (or rejected) events since the last call, which also retires their pending stamps.
    fn publish_health(&self, applied: usize) {
        self.shared.health.record(
            Instant::now(),
            self.current_stats(),
            &self.latest_faults,
            applied,
        );
    }

    /// After a device event: its lanes lose whatever a clear of the source drops (a clear
    /// names no tier; every tier of the source is dropped with it).
    async fn after_device_event(
        &mut self,
        event: &RouterEvent,
        result: Result<ApplyOutcome, PoolFault>,
    ) {
        let stored_blocks = match &event.payload {
            EventPayload::Stored(stored) => stored.blocks.len() as u64,
            EventPayload::Removed(_) | EventPayload::AllCleared => 0,
        };
        let cleared = result.is_ok() && matches!(event.payload, EventPayload::AllCleared);
        self.after_apply(event.source, event.event_id, stored_blocks, result)
            .await;
        if cleared {
            self.clear_lanes(event.source, event.event_id).await;
        }
    }

    async fn after_apply(
        &mut self,
        source: SourceId,
        event_id: u64,
        stored_blocks: u64,
        result: Result<ApplyOutcome, PoolFault>,
    ) {
        match result {
            Ok(outcome) => self.count_applied(&outcome, Some(source)),
            Err(PoolFault::Apply(ApplyError::ParentNotFound { .. })) => {
                self.stats.events_rejected += 1;
                self.count_unroutable(source, stored_blocks);
            }
            Err(fault) => {
                self.stats.events_rejected += 1;
                let contradiction = matches!(
                    fault,
                    PoolFault::Apply(ApplyError::ContradictoryBlockId { .. })
                );
                self.report(ActorFault {
                    source: Some(source),
                    event_id,
                    fault,
                });
                if contradiction {
                    self.reset_contradicting_source(source);
                    self.clear_lanes(source, event_id).await;
                }
            }
        }
        self.forward_memberships().await;
        self.schedule_publication(Instant::now()).await;
    }

    /// Counts an applied event (or log) and its capacity omissions; `source` is the
    /// engine's, `None` for a twin's log.
    pub(super) fn count_applied(&mut self, outcome: &ApplyOutcome, source: Option<SourceId>) {
        self.stats.events_applied += 1;
        if outcome.capacity_omissions == 0 {
            return;
        }
        self.stats.capacity_omissions += outcome.capacity_omissions;
        let total = self.stats.capacity_omissions;
        // Logged on the first omission, then at powers of two.
        if total.is_power_of_two() || total == outcome.capacity_omissions {
            tracing::warn!(
                worker_id = source.map(|s| s.worker_id),
                dp_rank = source.map(|s| s.dp_rank),
                omissions = total,
                "filter full: blocks owned but not resident"
            );
        }
    }

    /// Publishes now when the size bound or the due time is reached, else arms the timer:
    /// at once after a quiet window, otherwise a window after the previous delta. Checked
    /// after every event, so a mailbox that never empties cannot starve the timer.
    async fn schedule_publication(&mut self, now: Instant) {
        if self.state.pending_buckets() >= self.max_delta_buckets {
            self.publish().await;
            return;
        }
        match self.deadline {
            Some(deadline) if now >= deadline => self.publish().await,
            Some(_) => {}
            None => {
                let due = self
                    .last_publication
                    .map_or(now, |last| (last + self.window).max(now));
                if due <= now {
                    self.publish().await;
                } else {
                    self.deadline = Some(due);
                }
            }
        }
    }

    /// Counts a stored event whose parent its source never reported. Its blocks cannot be
    /// keyed (a canonical hash needs the parent's), so they are dropped; later events are
    /// unaffected.
    fn count_unroutable(&mut self, source: SourceId, blocks: u64) {
        self.stats.unroutable_events += 1;
        self.stats.unroutable_blocks = self.stats.unroutable_blocks.saturating_add(blocks);
        let total = self.stats.unroutable_events;
        // Logged on the first, then at powers of two.
        if total.is_power_of_two() {
            tracing::warn!(
                worker_id = source.worker_id,
                dp_rank = source.dp_rank,
                unroutable_events = total,
                "stored blocks with an unknown parent dropped as unroutable"
            );
        }
    }

    /// The remedy of a contradictory block id: the source's history here no longer
    /// matches the engine's, so everything it holds is dropped and it starts over.
    fn reset_contradicting_source(&mut self, source: SourceId) {
        match self.state.clear_source(source) {
            Ok(_) => self.stats.contradiction_resets += 1,
            Err(fault) => self.report(ActorFault {
                source: Some(source),
                event_id: 0,
                fault,
            }),
        }
    }

    /// Counts a fault, keeps it as the latest of its category and applies the remedy of a
    /// broken generation. Never waits.
    fn report(&mut self, fault: ActorFault) {
        let category = fault.category();
        let count = self.stats.faults.count(category);
        // Logged on the first of each category, then at powers of two.
        if count.is_power_of_two() {
            tracing::warn!(
                worker_id = fault.source.map(|source| source.worker_id),
                dp_rank = fault.source.map(|source| source.dp_rank),
                category = category.label(),
                count,
                error = %fault.fault,
                "pool actor fault"
            );
        }
        if category == FaultCategory::ProducerInvariant {
            // The owner rebuilds a generation whose token is cancelled.
            self.generation.cancel();
        }
        self.latest_faults[category.index()] = Some(fault);
    }

    /// Drains the filter's pending window into one delta and hands it to the hub, if any.
    /// Without a hub the delta is dropped: a hub that attaches later starts from a
    /// snapshot at the filter's sequence. With a hub whose feed is full nothing is
    /// drained: the changes stay pending and are retried a window later.
    async fn publish(&mut self) {
        self.deadline = None;
        let now = Instant::now();
        let mut permit = None;
        let mut closed = false;
        if let Some(lease) = &self.lease {
            // An owned permit: it does not borrow the lease, which may be dropped below.
            match lease.deltas.clone().try_reserve_owned() {
                Ok(reserved) => permit = Some(reserved),
                Err(mpsc::error::TrySendError::Full(_)) => {
                    self.stats.deferred_publications += 1;
                    self.deadline = Some(now + self.window);
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => closed = true,
            }
        }
        let taken = self.state.take_delta();
        let delivered = match taken {
            Ok(Some(delta)) => {
                self.last_publication = Some(now);
                self.stats.emitted_images += delta.images.len() as u64;
                match permit {
                    Some(permit) => {
                        permit.send(FeedItem::Delta(delta));
                        true
                    }
                    None => false,
                }
            }
            Ok(None) => {
                drop(permit);
                self.stats.unchanged_publications += 1;
                return;
            }
            Err(fault) => {
                drop(permit);
                // The window is kept; a later publication retries.
                self.report(ActorFault {
                    source: None,
                    event_id: 0,
                    fault,
                });
                return;
            }
        };
        if delivered {
            self.stats.publications += 1;
        }
        if closed {
            self.lease = None;
        }
    }

    /// Publishes what is pending even if the hub's feed is full, waiting for room (a
    /// graceful stop's tail); gives up when the hub went away.
    async fn publish_tail(&mut self) {
        if let Some(lease) = &self.lease
            && self.state.pending_buckets() > 0
        {
            // Room appears as the hub drains; a closed feed ends the wait.
            let _ = lease.deltas.reserve().await.map(drop);
        }
        self.publish().await;
    }

    /// Answers a settle through the hub's feed (after the deltas ahead of it), or at once
    /// without a hub; a hub that went away answers nothing, so the reply is sent here.
    async fn pass_barrier(&mut self, reply: oneshot::Sender<()>) {
        let reply = match &self.lease {
            Some(lease) => match lease.deltas.reserve().await {
                Ok(permit) => {
                    permit.send(FeedItem::Barrier(reply));
                    return;
                }
                Err(_) => reply,
            },
            None => reply,
        };
        let _ = reply.send(());
    }

    async fn attach(&mut self, reply: oneshot::Sender<Result<PublicationFeed, PoolFault>>) {
        // The pending tail goes to the current hub, if any; the snapshot includes it.
        self.publish().await;
        self.lease = None;
        let words = match self.state.copy_words() {
            Ok(words) => words,
            Err(fault) => {
                self.report(ActorFault {
                    source: None,
                    event_id: 0,
                    fault: fault.clone(),
                });
                let _ = reply.send(Err(fault));
                return;
            }
        };
        let (deltas_tx, deltas) = mpsc::channel(self.hub_queue);
        let id = self.next_lease;
        self.next_lease = self.next_lease.wrapping_add(1);
        let feed = PublicationFeed {
            identity: self.identity,
            lease: id,
            sequence: self.state.sequence(),
            words,
            deltas,
        };
        // A requester that went away leaves no lease behind.
        if reply.send(Ok(feed)).is_ok() {
            self.lease = Some(Lease {
                id,
                deltas: deltas_tx,
            });
        }
    }
}

async fn sleep_until_armed(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
