//! The host's answers to admin HTTP: readiness facts and JSON views of the published state.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde_json::json;

use crate::admin::{AdminView, Readiness};
use crate::admission::{Admission, StreamKind};
use crate::host::state::{HostState, filter_load};
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
        if !self.state.discovery_listed() {
            reasons.push("discovery has not listed yet".to_owned());
        }
        for (key, pool) in self.state.pools() {
            if pool.sources == 0 {
                reasons.push(format!(
                    "pool {key} ({}) has no connected source",
                    pool.endpoint
                ));
            }
        }
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

    fn pool_stats(&self, pool: &str) -> Option<serde_json::Value> {
        let pools = self.state.pools();
        let status = pools.get(pool)?;
        let stats = status.stats.as_ref().map(|stats| {
            json!({
                "sequence": stats.sequence,
                "events_applied": stats.events_applied,
                "events_rejected": stats.events_rejected,
                "publications": stats.publications,
                "emitted_images": stats.emitted_images,
                "faults": stats.faults.total(),
                "bucket_count": stats.filter.bucket_count,
                "resident_blocks": stats.filter.resident_blocks,
                "capacity_omissions": stats.filter.counters.capacity_omissions,
                "unknown_removals": stats.filter.counters.unknown_removals,
                "load_factor": filter_load(stats),
            })
        });
        Some(json!({
            "pool": pool,
            "endpoint": status.endpoint,
            "generation": status.generation,
            "sources": status.sources,
            "stats": stats,
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
