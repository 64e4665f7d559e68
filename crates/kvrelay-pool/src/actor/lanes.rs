//! A pool actor's lanes: lower-tier events (host, disk, …) resolved against the device
//! filter and queued to the lane of their tier, accepted device events (and restored
//! mappings) queued to the pool's format twin (its device lane), and a source's clear
//! fanned out to every lane.

use kvrelay_ckf::tier::ResolvedChange;
use kvrelay_ckf::{CacheTier, EventPayload, RouterEvent, SourceId, TierEvent};

use crate::filter::SourceMappings;

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
        self.submit_to(&lane, event.source, event.event_id, resolved.change)
            .await;
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

    /// Queues a device event the pool's filter accepted to its format twin (the device
    /// lane, if any), which applies it to its own lineage: the twin holds exactly the
    /// blocks the pool's filter holds. Waits for the twin's permits like a tier lane.
    pub(super) async fn forward_to_twin(&mut self, event: &RouterEvent) {
        let Some(twin) = self.lane(CacheTier::Device) else {
            return;
        };
        let change = match &event.payload {
            EventPayload::Stored(stored) => ResolvedChange::Stored(stored.clone()),
            EventPayload::Removed(removed) => {
                ResolvedChange::Removed(removed.engine_block_ids.clone())
            }
            // A clear reaches every lane through `clear_lanes`.
            EventPayload::AllCleared => return,
        };
        self.submit_to(&twin, event.source, event.event_id, change)
            .await;
    }

    /// Gives the format twin what a checkpoint restored into the pool's filter: each
    /// source's mappings, whose canonical hashes are known.
    pub(super) async fn restore_twin(&mut self, sources: &[SourceMappings]) {
        let Some(twin) = self.lane(CacheTier::Device) else {
            return;
        };
        for restored in sources {
            let change = ResolvedChange::Canonical(restored.mappings.clone());
            self.submit_to(&twin, restored.source, 0, change).await;
        }
    }

    /// Queues `change` to `lane` unless the generation is fenced first; a lane that
    /// stopped (it retires with this generation) is counted, not kept.
    async fn submit_to(
        &mut self,
        lane: &PoolActorHandle,
        source: SourceId,
        event_id: u64,
        change: ResolvedChange,
    ) {
        let fence = self.fence.clone();
        let queued = tokio::select! {
            biased;
            () = fence.cancelled() => true,
            queued = lane.submit_lane(source, event_id, change) => queued.is_ok(),
        };
        if !queued {
            self.stats.tier_events_without_lane += 1;
        }
    }

    fn lane(&self, tier: CacheTier) -> Option<PoolActorHandle> {
        self.lanes
            .iter()
            .find(|(lane_tier, _)| *lane_tier == tier)
            .map(|(_, lane)| lane.clone())
    }
}
