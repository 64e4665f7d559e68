//! A pool actor's lanes: lower-tier events (host, disk, …) resolved against the device
//! filter and queued to the lane of their tier, the device filter's membership log
//! queued to the pool's format twin (its device lane), and a source's clear fanned out
//! to every lower-tier lane.

use kvrelay_ckf::tier::ResolvedChange;
use kvrelay_ckf::{ApplyOutcome, CacheTier, SourceId, TierEvent};
use tokio::time::Instant;

use crate::error::{ActorError, PoolFault};

/// Most membership changes in one command to a format twin: a clear of a large source
/// is queued in pieces, so the twin's permits and mailbox pace it like events.
pub(crate) const MAX_MEMBERSHIPS_PER_COMMAND: usize = 4096;

use super::{Actor, ActorFault, PoolActorHandle};

impl Actor {
    /// Resolves a lower-tier event against the device filter now and queues it to the
    /// lane of its tier (waiting for the lane's permits: a slow lane slows its pool, it
    /// never loses an event). A fence ends the wait.
    pub(super) async fn forward_tier_event(&mut self, event: TierEvent) {
        self.stats.tier_events += 1;
        let Some(lane) = self.lane(event.tier) else {
            self.stats.tier_events_without_lane += 1;
            return;
        };
        let resolved = match self.state.resolve_tier(&event) {
            Ok(resolved) => resolved,
            Err(fault) => {
                self.report(ActorFault {
                    source: Some(event.source),
                    event_id: event.event_id,
                    fault,
                });
                return;
            }
        };
        self.stats.offloads_unmapped += resolved.unmapped;
        self.queue_to_lane(lane.submit_lane(event.source, event.event_id, resolved.change))
            .await;
    }

    /// Queues a clear of `source` to every lower-tier lane (the format twin learns what
    /// the clear dropped from the pool's membership log).
    pub(super) async fn clear_lanes(&mut self, source: SourceId, event_id: u64) {
        let fence = self.fence.clone();
        for (_, lane) in self
            .lanes
            .iter()
            .filter(|(tier, _)| *tier != CacheTier::Device)
        {
            tokio::select! {
                biased;
                () = fence.cancelled() => return,
                _ = lane.submit_lane(source, event_id, ResolvedChange::Cleared) => {}
            }
        }
    }

    /// Queues what the pool's filter recorded of its owned set since the last call to its
    /// format twin (the device lane, if any), in chunks of at most
    /// [`MAX_MEMBERSHIPS_PER_COMMAND`], waiting for the twin's permits like a tier lane:
    /// the twin applies them in order and holds exactly the pool's blocks.
    pub(super) async fn forward_memberships(&mut self) {
        let changes = self.state.take_memberships();
        if changes.is_empty() {
            return;
        }
        let Some(twin) = self.lane(CacheTier::Device) else {
            return;
        };
        if changes.len() <= MAX_MEMBERSHIPS_PER_COMMAND {
            self.queue_to_lane(twin.submit_memberships(changes)).await;
            return;
        }
        for chunk in changes.chunks(MAX_MEMBERSHIPS_PER_COMMAND) {
            if !self
                .queue_to_lane(twin.submit_memberships(chunk.to_vec()))
                .await
            {
                return;
            }
        }
    }

    /// After a format twin applied part of its pool's membership log. A log it could not
    /// apply leaves it no longer mirroring the pool: a `ProducerInvariant` fault, so the
    /// generation (pool and lanes) is rebuilt.
    pub(super) async fn after_memberships(&mut self, result: Result<ApplyOutcome, PoolFault>) {
        match result {
            Ok(outcome) => self.count_applied(&outcome, None),
            Err(fault) => {
                self.stats.events_rejected += 1;
                self.report(ActorFault {
                    source: None,
                    event_id: 0,
                    fault,
                });
            }
        }
        self.schedule_publication(Instant::now()).await;
    }

    /// Queues one command to a lane (`submit`, a lower tier's change or a twin's log)
    /// unless the generation is fenced first; a lane that stopped (it retires with this
    /// generation) is counted, not kept. Returns whether the command was queued.
    async fn queue_to_lane(
        &mut self,
        submit: impl Future<Output = Result<(), ActorError>>,
    ) -> bool {
        let fence = self.fence.clone();
        tokio::select! {
            biased;
            () = fence.cancelled() => false,
            queued = submit => {
                if queued.is_err() {
                    self.stats.tier_events_without_lane += 1;
                }
                queued.is_ok()
            }
        }
    }

    fn lane(&self, tier: CacheTier) -> Option<PoolActorHandle> {
        self.lanes
            .iter()
            .find(|(lane_tier, _)| *lane_tier == tier)
            .map(|(_, lane)| lane.clone())
    }
}
