//! The host's answers to admin HTTP: readiness facts and JSON views of the published state.
//!
//! Readiness is the supervision core's facts (discovery listed, per pool: a connected
//! source, not stalled) plus liveness. Pool views read each actor's health when asked
//! (O(1), without its mailbox), so they are fresh and still answer for a stalled actor.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvrelay_pool::{FaultCategory, PoolHealth};
use serde_json::json;
use tokio::time::Instant;

use crate::admin::{AdminView, Readiness};
use crate::admission::{Admission, StreamKind};
use crate::host::state::{HostState, filter_load};
use crate::host::supervisor::PoolFacts;
use crate::metrics::RelayMetrics;

pub(crate) struct HostAdminView {
    pub(crate) state: Arc<HostState>,
    pub(crate) admission: Admission,
}

impl AdminView for HostAdminView {
    fn live(&self) -> bool {
        self.state.live.load(Ordering::SeqCst)
    }

    fn readiness(&self) -> Readiness {
        let mut reasons = Vec::new();
        if !self.live() {
            reasons.push("relay is shutting down".to_owned());
        }
        reasons.extend(self.state.facts().unready);
        Readiness {
            ready: reasons.is_empty(),
            reasons,
        }
    }

    fn catalog(&self) -> serde_json::Value {
        serde_json::to_value(&*self.state.catalog_snapshot()).unwrap_or_default()
    }

    fn load(&self) -> serde_json::Value {
        serde_json::to_value(&**self.state.load.borrow()).unwrap_or_default()
    }

    fn topology(&self) -> serde_json::Value {
        serde_json::to_value(&**self.state.topology.borrow()).unwrap_or_default()
    }

    fn pools(&self) -> serde_json::Value {
        let facts = self.state.facts();
        let pools: Vec<serde_json::Value> = self
            .state
            .pools()
            .into_iter()
            .map(|(key, status)| {
                let pool_facts = facts.pools.get(&key);
                json!({
                    "pool": key,
                    "endpoint": status.endpoint,
                    "generation": status.generation,
                    "stalled": pool_facts.is_some_and(|facts| facts.stalled),
                    "degraded": pool_facts.is_some_and(|facts| facts.degraded.is_some()),
                    "overfull": pool_facts.is_some_and(|facts| facts.overfull.is_some()),
                    "recovering": pool_facts.is_some_and(|facts| facts.joining_sources() > 0),
                    "advertised": pool_facts.is_none_or(|facts| !facts.stalled),
                    "links": {"stats": format!("/v1/pools/{key}/stats")},
                })
            })
            .collect();
        json!({ "pools": pools })
    }

    fn pool_stats(&self, pool: &str) -> Option<serde_json::Value> {
        let pools = self.state.pools();
        let status = pools.get(pool)?;
        let facts = self.state.facts();
        let pool_facts = facts.pools.get(pool);
        let health = status.actor.health(Instant::now());
        Some(json!({
            "pool": pool,
            "endpoint": status.endpoint,
            "generation": status.generation,
            "routed_sources": status.routed_sources,
            "sources": pool_facts.map(|facts| facts.sources.clone()).unwrap_or_default(),
            "stalled": pool_facts.is_some_and(|facts| facts.stalled),
            "degraded": pool_facts.and_then(|facts| facts.degraded).map(|degraded| json!({
                "unroutable_events": degraded.unroutable_events,
                "events": degraded.events,
            })),
            "overfull": pool_facts.and_then(|facts| facts.overfull).map(|fill| json!({
                "omitted_blocks": fill.omitted_blocks,
                "owned_blocks": fill.owned_blocks,
            })),
            "joining_sources": pool_facts.map_or(0, PoolFacts::joining_sources),
            "stall_timeout_ms": self.state.limits.pool_stall_timeout_ms,
            "health": health_json(&health),
            "stats": stats_json(&health),
            "ingest": self.state.metrics.ingest.endpoint_json(&status.endpoint),
        }))
    }

    fn refresh_metrics(&self) {
        for kind in StreamKind::ALL {
            self.state
                .metrics
                .streams
                .get_or_create(&RelayMetrics::stream(kind))
                .set(i64::from(self.admission.active(kind)));
        }
    }
}

fn millis(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn health_json(health: &PoolHealth) -> serde_json::Value {
    json!({
        "mailbox_depth": health.mailbox_depth,
        "mailbox_capacity": health.mailbox_capacity,
        "pending_events": health.pending_events,
        "oldest_pending_ms": health.oldest_pending_age.map(millis),
        "stalled_for_ms": millis(health.stalled_for),
        "since_last_event_ms": health.since_last_event.map(millis),
        "actor_stopped": health.stopped,
    })
}

fn stats_json(health: &PoolHealth) -> serde_json::Value {
    let stats = &health.stats;
    let faults: serde_json::Map<String, serde_json::Value> = FaultCategory::ALL
        .into_iter()
        .map(|category| {
            (
                category.label().to_owned(),
                stats.faults.get(category).into(),
            )
        })
        .collect();
    let latest_faults: Vec<serde_json::Value> = health
        .latest_faults
        .iter()
        .map(|fault| {
            json!({
                "category": fault.category().label(),
                // `null` for a fault of the pool as a whole (a publication, a twin's log).
                "worker_id": fault.source.map(|source| source.worker_id),
                "dp_rank": fault.source.map(|source| source.dp_rank),
                "event_id": fault.event_id,
                "error": fault.fault.to_string(),
            })
        })
        .collect();
    json!({
        "sequence": stats.sequence,
        "publishing": stats.publishing,
        "events_applied": stats.events_applied,
        "events_rejected": stats.events_rejected,
        "unroutable_events": stats.unroutable_events,
        "unroutable_blocks": stats.unroutable_blocks,
        "faults": faults,
        "latest_faults": latest_faults,
        "contradiction_resets": stats.contradiction_resets,
        "publications": stats.publications,
        "emitted_images": stats.emitted_images,
        "deferred_publications": stats.deferred_publications,
        "bucket_count": stats.filter.bucket_count,
        "occupied_slots": stats.filter.occupied_slots,
        "resident_blocks": stats.filter.resident_blocks,
        "owned_blocks": stats.filter.owned_blocks,
        "sources_with_blocks": stats.filter.sources,
        "memory_bytes": stats.filter.memory_bytes,
        "capacity_omissions": stats.filter.counters.capacity_omissions,
        "unknown_removals": stats.filter.counters.unknown_removals,
        "load_factor": filter_load(health),
    })
}
