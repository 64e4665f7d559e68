//! A pool actor's tier lanes (host, disk, …): lower-tier events resolved against the
//! device filter and queued to the lane of their tier, and a source's clear fanned out
//! to every lane.

use kvrelay_ckf::tier::ResolvedChange;
use kvrelay_ckf::{CacheTier, SourceId, TierEvent};

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
                    source: event.source,
                    event_id: event.event_id,
                    fault,
                });
                return;
            }
        };
        self.stats.offloads_unmapped += resolved.unmapped;
        let fence = self.fence.clone();
        let queued = tokio::select! {
            biased;
            () = fence.cancelled() => true,
            queued = lane.submit_lane(event.source, event.event_id, resolved.change) => queued.is_ok(),
        };
        if !queued {
            // The lane stopped (it retires with this generation): counted, not kept.
            self.stats.tier_events_without_lane += 1;
        }
    }

    /// Queues a clear of `source` to every lane.
    pub(super) async fn clear_lanes(&mut self, source: SourceId, event_id: u64) {
        let fence = self.fence.clone();
        for (_, lane) in &self.lanes {
            tokio::select! {
                biased;
                () = fence.cancelled() => return,
                _ = lane.submit_lane(source, event_id, ResolvedChange::Cleared) => {}
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
