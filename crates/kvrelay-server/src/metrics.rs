//! Prometheus metrics of the relay: a fixed, low-cardinality set registered once.
//!
//! Label values come from closed sets (stream kinds, error reasons, outcomes, dispositions,
//! source states, fault categories), never from remote input or pool identities, so the
//! series count is fixed. Pool-level figures are exported as relay-wide sums or maxima for
//! the same reason (a pool key per series would grow with every discovered endpoint and
//! every generation); per-pool detail lives in `/v1/pools/{pool}/stats`.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

mod labels;

pub(crate) use self::labels::{
    AcceptErrorLabels, CategoryLabel, CauseLabel, ComponentLabel, DispositionLabel,
    MEMORY_INGEST_QUEUES, MEMORY_PINNED_SNAPSHOTS, MEMORY_POOL_FILTERS, MEMORY_PUBLICATION_MIRRORS,
    MEMORY_RESUME_WINDOWS, MEMORY_SUBSCRIBER_BACKLOGS, OutcomeLabel, ReasonLabel, RejectionLabels,
    RpcLabel, RpcReasonLabels, StartLabel, StateLabel, StreamLabel, TierLabel,
};

use crate::admission::StreamKind;
use crate::source_metrics::SourceMetrics;

/// Every metric the relay exports, registered in one registry.
#[derive(Debug)]
pub(crate) struct RelayMetrics {
    registry: Registry,
    /// Accepted connections by outcome (served, tls_failed, auth_failed, bad_request, ...).
    pub(crate) connections: Family<OutcomeLabel, Counter>,
    /// Open streams by kind.
    pub(crate) streams: Family<StreamLabel, Gauge>,
    /// Admission rejections by stream kind and limit scope.
    pub(crate) admission_rejected: Family<RejectionLabels, Counter>,
    /// Error frames sent, by wire reason.
    pub(crate) errors_sent: Family<ReasonLabel, Counter>,
    /// Streams cut off because the subscriber lagged.
    pub(crate) subscriber_lagged: Family<StreamLabel, Counter>,
    /// Frames written, by stream kind.
    pub(crate) frames_sent: Family<StreamLabel, Counter>,
    /// Bytes written, by stream kind.
    pub(crate) bytes_sent: Family<StreamLabel, Counter>,
    /// Heartbeats written, by stream kind.
    pub(crate) heartbeats: Family<StreamLabel, Counter>,
    /// Pools in the catalog.
    pub(crate) pools: Gauge,
    /// The ingest sources' states and counters, refreshed on every exposition.
    pub(crate) ingest: Arc<SourceMetrics>,
    /// Pool actor faults by category (resource, source_protocol, producer_invariant).
    pub(crate) pool_faults: Family<CategoryLabel, Counter>,
    /// Stored blocks dropped because their parent was unknown to their source.
    pub(crate) pool_unroutable_blocks: Counter,
    /// Sources cleared because they contradicted their own block ids.
    pub(crate) pool_contradiction_resets: Counter,
    /// Lower-tier events for a tier the pool keeps no lane of, or whose lane had stopped.
    pub(crate) tier_events_without_lane: Counter,
    /// Offloaded blocks whose device block the pool did not hold (dropped, never guessed).
    pub(crate) tier_offloads_unmapped: Counter,
    /// Blocks resident in each tier's lanes, summed over pools.
    pub(crate) tier_lane_resident_blocks: Family<TierLabel, Gauge>,
    /// Bytes the relay holds, by component (see [`ComponentLabel`]).
    pub(crate) memory: Family<ComponentLabel, Gauge>,
    /// Pools withheld from the catalog as stalled.
    pub(crate) pools_stalled: Gauge,
    /// Pools whose recent events were mostly unroutable (history lost).
    pub(crate) pools_degraded: Gauge,
    /// Pools whose filter (or a lane's) could not place some owned blocks lately.
    pub(crate) pools_overfull: Gauge,
    /// Pool checkpoint writes by outcome (ok, failed, too_large).
    pub(crate) checkpoint_writes: Family<OutcomeLabel, Counter>,
    /// Checkpoint restores at pool start by outcome (restored, none, stale, other_pool,
    /// foreign, version, truncated, checksum, malformed, too_large, unreadable, refused).
    pub(crate) checkpoint_restores: Family<OutcomeLabel, Counter>,
    /// Mappings (source, block) restored from checkpoints.
    pub(crate) checkpoint_restored_mappings: Counter,
    /// Size of the last checkpoint written, in bytes.
    pub(crate) checkpoint_last_bytes: Gauge,
    /// Actor time of the last checkpoint (copying its mappings), in seconds.
    pub(crate) checkpoint_last_export_seconds: Gauge<f64, AtomicU64>,
    /// Encode + write + sync time of the last checkpoint, in seconds (off the executor).
    pub(crate) checkpoint_last_write_seconds: Gauge<f64, AtomicU64>,
    /// Deepest actor mailbox across pools, in commands.
    pub(crate) pool_mailbox_depth_max: Gauge,
    /// Age of the oldest pending event across pools, in seconds.
    pub(crate) pool_oldest_pending_seconds_max: Gauge<f64, AtomicU64>,
    /// Engine events by disposition (applied, rejected, ...).
    pub(crate) events: Family<DispositionLabel, Counter>,
    /// Blocks the filters could not place (capacity omissions), summed over pools.
    pub(crate) filter_omissions: Gauge,
    /// Highest filter load factor across pools (0..1).
    pub(crate) filter_load_max: Gauge<f64, AtomicU64>,
    /// Catalog revision currently published.
    pub(crate) catalog_revision: Gauge,
    /// Failed `accept` calls by listener and kind.
    pub(crate) accept_errors: Family<AcceptErrorLabels, Counter>,
    /// Admin HTTP connections by outcome (accepted, rejected_limit, rejected_peer_limit,
    /// header_timeout).
    pub(crate) admin_connections: Family<OutcomeLabel, Counter>,
    /// Dynamo-contract door connections by outcome (served, tls_failed, rejected_limit,
    /// rejected_peer_limit).
    pub(crate) dynamo_connections: Family<OutcomeLabel, Counter>,
    /// Dynamo-contract calls refused for a missing or wrong bearer token.
    pub(crate) dynamo_unauthorized: Counter,
    /// Messages the Dynamo-contract door queued for clients, by RPC.
    pub(crate) dynamo_messages_sent: Family<RpcLabel, Counter>,
    /// Encoded bytes of those messages, by RPC.
    pub(crate) dynamo_bytes_sent: Family<RpcLabel, Counter>,
    /// Dynamo-contract heartbeats (pool heartbeats, catalog and readiness re-sends), by RPC.
    pub(crate) dynamo_heartbeats: Family<RpcLabel, Counter>,
    /// Dynamo-contract refusals and stream failures, by RPC and reason.
    pub(crate) dynamo_errors: Family<RpcReasonLabels, Counter>,
    /// Admin HTTP requests refused for a missing or wrong bearer token.
    pub(crate) admin_unauthorized: Counter,
    /// Discovery inputs skipped, by reason (`kvrelay_discovery_skipped_total`).
    pub(crate) discovery_skipped: Family<ReasonLabel, Counter>,
    /// Sources whose blocks were dropped because they left a pool that lives on
    /// (`kvrelay_sources_cleared_total`).
    pub(crate) sources_cleared: Counter,
    /// Listings of event adverts in etcd that failed (the last sources were kept)
    /// (`kvrelay_discovery_advert_listing_failures_total`).
    pub(crate) discovery_advert_listing_failures: Counter,
    /// Advertised sources whose recovery target (a request-plane query of the worker's own
    /// index) the relay does not call, once per advert
    /// (`kvrelay_discovery_recovery_targets_unused_total`).
    pub(crate) discovery_recovery_targets_unused: Counter,
    /// Card files opened and parsed by the file backend (`kvrelay_discovery_card_reads_total`):
    /// new and changed files only, so it stays flat while the directory does not change.
    pub(crate) discovery_card_reads: Counter,
    /// The pool publication streams' counters, refreshed on every exposition.
    pub(crate) stream: StreamMetrics,
    /// Pool attaches that failed, by reason (`pool_limit` when `max_pools` is reached).
    pub(crate) pool_attach_failures: Family<ReasonLabel, Counter>,
}

/// `kvrelay_stream_*`: what the pools' publishers decided, summed over pools.
#[derive(Debug, Default)]
pub(crate) struct StreamMetrics {
    /// Reads the registry's totals (set once the registry exists).
    source: std::sync::OnceLock<kvrelay_pool::StreamStatsReader>,
    seen: std::sync::Mutex<kvrelay_pool::StreamStats>,
    cut_offs: Family<CauseLabel, Counter>,
    subscriptions: Family<StartLabel, Counter>,
    deltas: Counter,
    delta_frames: Counter,
    coalesced_frames: Counter,
    coalesced_deltas: Counter,
    snapshots_shared: Counter,
    snapshot_refusals: Counter,
}

impl StreamMetrics {
    fn register(&self, registry: &mut Registry) {
        registry.register(
            "stream_cut_offs",
            "Pool subscribers cut off by their publisher, by cause (backlog, snapshot_stalled)",
            self.cut_offs.clone(),
        );
        registry.register(
            "stream_subscriptions",
            "Pool subscriptions started, by start (snapshot, resume, resume_miss: asked to resume, got a snapshot)",
            self.subscriptions.clone(),
        );
        registry.register(
            "stream_deltas",
            "Deltas the pool actors handed to their publishers",
            self.deltas.clone(),
        );
        registry.register(
            "stream_delta_frames",
            "Delta frames handed to subscribers (coalesced ones included)",
            self.delta_frames.clone(),
        );
        registry.register(
            "stream_coalesced_frames",
            "Delta frames that merged two or more deltas for a subscriber that fell behind",
            self.coalesced_frames.clone(),
        );
        registry.register(
            "stream_snapshots_shared",
            "Snapshots started on an older pinned table version because max_pinned_snapshots_per_pool was reached (the deltas since follow)",
            self.snapshots_shared.clone(),
        );
        registry.register(
            "stream_snapshot_refusals",
            "Pool subscriptions refused (resource_limit) because max_pinned_snapshots_per_pool was reached and the resume window no longer reached the newest pinned version",
            self.snapshot_refusals.clone(),
        );
        registry.register(
            "stream_coalesced_deltas",
            "Deltas merged into coalesced frames",
            self.coalesced_deltas.clone(),
        );
        for cause in ["backlog", "snapshot_stalled"] {
            let _ = self.cut_offs.get_or_create(&CauseLabel { cause });
        }
        for start in ["snapshot", "resume", "resume_miss"] {
            let _ = self.subscriptions.get_or_create(&StartLabel { start });
        }
    }

    /// Follows `registry`'s stream totals from now on.
    pub(crate) fn follow(&self, reader: kvrelay_pool::StreamStatsReader) {
        let _ = self.source.set(reader);
    }

    /// Adds what the totals gained since the last refresh and returns them (`None`
    /// before the registry exists).
    fn refresh(&self) -> Option<kvrelay_pool::StreamStats> {
        let reader = self.source.get()?;
        let now = reader.get();
        let mut seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let gained = |now: u64, then: u64| now.saturating_sub(then);
        let cut = |cause| self.cut_offs.get_or_create(&CauseLabel { cause });
        cut("backlog").inc_by(gained(now.cut_offs_backlog, seen.cut_offs_backlog));
        cut("snapshot_stalled").inc_by(gained(
            now.cut_offs_snapshot_stalled,
            seen.cut_offs_snapshot_stalled,
        ));
        let start = |start| self.subscriptions.get_or_create(&StartLabel { start });
        start("snapshot").inc_by(gained(
            now.snapshots.saturating_sub(now.resume_misses),
            seen.snapshots.saturating_sub(seen.resume_misses),
        ));
        start("resume").inc_by(gained(now.resumes, seen.resumes));
        start("resume_miss").inc_by(gained(now.resume_misses, seen.resume_misses));
        self.deltas.inc_by(gained(now.deltas, seen.deltas));
        self.delta_frames
            .inc_by(gained(now.delta_frames, seen.delta_frames));
        self.coalesced_frames
            .inc_by(gained(now.coalesced_frames, seen.coalesced_frames));
        self.coalesced_deltas
            .inc_by(gained(now.coalesced_deltas, seen.coalesced_deltas));
        self.snapshots_shared
            .inc_by(gained(now.snapshots_shared, seen.snapshots_shared));
        self.snapshot_refusals
            .inc_by(gained(now.snapshot_refusals, seen.snapshot_refusals));
        *seen = now;
        Some(now)
    }
}

impl RelayMetrics {
    pub(crate) fn new() -> Self {
        let mut registry = Registry::with_prefix("kvrelay");
        let connections = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "connections",
            "WAN connections by outcome",
            connections.clone(),
        );
        let streams = Family::<StreamLabel, Gauge>::default();
        registry.register("streams", "Open WAN streams by kind", streams.clone());
        let admission_rejected = Family::<RejectionLabels, Counter>::default();
        registry.register(
            "admission_rejected",
            "Streams refused by an admission limit",
            admission_rejected.clone(),
        );
        let errors_sent = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "errors_sent",
            "Error frames sent by reason",
            errors_sent.clone(),
        );
        let subscriber_lagged = Family::<StreamLabel, Counter>::default();
        registry.register(
            "subscriber_lagged",
            "Streams cut off because the subscriber lagged",
            subscriber_lagged.clone(),
        );
        let frames_sent = Family::<StreamLabel, Counter>::default();
        registry.register(
            "frames_sent",
            "Frames written by stream kind",
            frames_sent.clone(),
        );
        let bytes_sent = Family::<StreamLabel, Counter>::default();
        registry.register(
            "bytes_sent",
            "Bytes written by stream kind",
            bytes_sent.clone(),
        );
        let heartbeats = Family::<StreamLabel, Counter>::default();
        registry.register(
            "heartbeats",
            "Heartbeats written by stream kind",
            heartbeats.clone(),
        );
        let pools = Gauge::default();
        registry.register("pools", "Pools in the catalog", pools.clone());
        let sources = Family::<StateLabel, Gauge>::default();
        registry.register("sources", "Event sources by state", sources.clone());
        let ingest = Arc::new(SourceMetrics::new(&mut registry, sources.clone()));
        let pool_faults = Family::<CategoryLabel, Counter>::default();
        registry.register(
            "pool_faults",
            "Pool actor faults by category",
            pool_faults.clone(),
        );
        for category in kvrelay_pool::FaultCategory::ALL {
            let _ = pool_faults.get_or_create(&CategoryLabel {
                category: category.label(),
            });
        }
        let pool_unroutable_blocks = Counter::default();
        registry.register(
            "pool_unroutable_blocks",
            "Stored blocks dropped because their parent was unknown to their source",
            pool_unroutable_blocks.clone(),
        );
        let pool_contradiction_resets = Counter::default();
        registry.register(
            "pool_contradiction_resets",
            "Sources cleared because they contradicted their own block ids",
            pool_contradiction_resets.clone(),
        );
        let tier_events_without_lane = Counter::default();
        registry.register(
            "tier_events_without_lane",
            "Lower-tier (host, disk) events for a tier the pool keeps no lane of (add the tier under [tiers] to keep them), or whose lane had stopped with its retiring pool: dropped",
            tier_events_without_lane.clone(),
        );
        let tier_offloads_unmapped = Counter::default();
        registry.register(
            "tier_offloads_unmapped",
            "Offloaded blocks whose device block the pool did not hold when the offload arrived: dropped, never guessed",
            tier_offloads_unmapped.clone(),
        );
        let tier_lane_resident_blocks = Family::<TierLabel, Gauge>::default();
        registry.register(
            "tier_lane_resident_blocks",
            "Blocks resident in the lower-tier lanes of every pool, by tier",
            tier_lane_resident_blocks.clone(),
        );
        let memory = Family::<ComponentLabel, Gauge>::default();
        registry.register(
            "memory_bytes",
            "Bytes the relay holds, by component: pool_filters (tables, exact ownership index and lineage of every pool and lane), publication_mirrors, pinned_snapshots, resume_windows, subscriber_backlogs (an upper bound: shared deltas count once per subscriber), ingest_queues. Allocator slack, libzmq's own queues and the runtime are not counted",
            memory.clone(),
        );
        for component in [
            MEMORY_POOL_FILTERS,
            MEMORY_PUBLICATION_MIRRORS,
            MEMORY_PINNED_SNAPSHOTS,
            MEMORY_RESUME_WINDOWS,
            MEMORY_SUBSCRIBER_BACKLOGS,
            MEMORY_INGEST_QUEUES,
        ] {
            let _ = memory.get_or_create(&component);
        }
        let pools_stalled = Gauge::default();
        registry.register(
            "pools_stalled",
            "Pools withheld from the catalog because their actor made no progress",
            pools_stalled.clone(),
        );
        let pools_degraded = Gauge::default();
        registry.register(
            "pools_degraded",
            "Pools whose events over the last 30 s were mostly unroutable (the engine's history is lost; the filter misses what it caches)",
            pools_degraded.clone(),
        );
        let pools_overfull = Gauge::default();
        registry.register(
            "pools_overfull",
            "Pools whose filter, or one of its lanes, could not place some owned blocks over the last 30 s (capacity omissions: the cards declared too little capacity)",
            pools_overfull.clone(),
        );
        let checkpoint_writes = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "checkpoint_writes",
            "Pool checkpoint writes by outcome",
            checkpoint_writes.clone(),
        );
        let checkpoint_restores = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "checkpoint_restores",
            "Checkpoint restores at pool start by outcome (restored, none, or why it was discarded)",
            checkpoint_restores.clone(),
        );
        let checkpoint_restored_mappings = Counter::default();
        registry.register(
            "checkpoint_restored_mappings",
            "Source block mappings restored from checkpoints",
            checkpoint_restored_mappings.clone(),
        );
        let checkpoint_last_bytes = Gauge::default();
        registry.register(
            "checkpoint_last_bytes",
            "Size of the last pool checkpoint written",
            checkpoint_last_bytes.clone(),
        );
        let checkpoint_last_export_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "checkpoint_last_export_seconds",
            "Pool actor time of the last checkpoint (copying its mappings)",
            checkpoint_last_export_seconds.clone(),
        );
        let checkpoint_last_write_seconds = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "checkpoint_last_write_seconds",
            "Encode, write and sync time of the last checkpoint (off the executor)",
            checkpoint_last_write_seconds.clone(),
        );
        let pool_mailbox_depth_max = Gauge::default();
        registry.register(
            "pool_mailbox_depth_max",
            "Deepest pool actor mailbox, in commands",
            pool_mailbox_depth_max.clone(),
        );
        let pool_oldest_pending_seconds_max = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "pool_oldest_pending_seconds_max",
            "Age of the oldest event waiting in any pool actor, in seconds",
            pool_oldest_pending_seconds_max.clone(),
        );
        let events = Family::<DispositionLabel, Counter>::default();
        registry.register("events", "Engine events by disposition", events.clone());
        let filter_omissions = Gauge::default();
        registry.register(
            "filter_omissions",
            "Blocks the filters could not place, summed over pools",
            filter_omissions.clone(),
        );
        let filter_load_max = Gauge::<f64, AtomicU64>::default();
        registry.register(
            "filter_load_max",
            "Highest filter load factor across pools",
            filter_load_max.clone(),
        );
        let catalog_revision = Gauge::default();
        registry.register(
            "catalog_revision",
            "Catalog revision published",
            catalog_revision.clone(),
        );
        let accept_errors = Family::<AcceptErrorLabels, Counter>::default();
        registry.register(
            "accept_errors",
            "Failed accept calls by listener and kind",
            accept_errors.clone(),
        );
        let admin_connections = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "admin_connections",
            "Admin HTTP connections by outcome",
            admin_connections.clone(),
        );
        let dynamo_connections = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "dynamo_connections",
            "Dynamo-contract door connections by outcome",
            dynamo_connections.clone(),
        );
        let dynamo_unauthorized = Counter::default();
        registry.register(
            "dynamo_unauthorized",
            "Dynamo-contract calls refused for a missing or wrong bearer token",
            dynamo_unauthorized.clone(),
        );
        let dynamo_messages_sent = Family::<RpcLabel, Counter>::default();
        registry.register(
            "dynamo_messages_sent",
            "Messages the Dynamo-contract door sent, by RPC",
            dynamo_messages_sent.clone(),
        );
        let dynamo_bytes_sent = Family::<RpcLabel, Counter>::default();
        registry.register(
            "dynamo_bytes_sent",
            "Encoded bytes the Dynamo-contract door sent, by RPC",
            dynamo_bytes_sent.clone(),
        );
        let dynamo_heartbeats = Family::<RpcLabel, Counter>::default();
        registry.register(
            "dynamo_heartbeats",
            "Heartbeats the Dynamo-contract door sent, by RPC",
            dynamo_heartbeats.clone(),
        );
        let dynamo_errors = Family::<RpcReasonLabels, Counter>::default();
        registry.register(
            "dynamo_errors",
            "Dynamo-contract refusals and stream failures, by RPC and reason",
            dynamo_errors.clone(),
        );
        let admin_unauthorized = Counter::default();
        registry.register(
            "admin_unauthorized",
            "Admin HTTP requests refused for a missing or wrong bearer token",
            admin_unauthorized.clone(),
        );
        let discovery_skipped = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "discovery_skipped",
            "Discovery inputs (card files, cards) skipped, by reason",
            discovery_skipped.clone(),
        );
        let sources_cleared = Counter::default();
        registry.register(
            "sources_cleared",
            "Sources whose blocks were dropped because they left a pool that lives on (card or advert gone)",
            sources_cleared.clone(),
        );
        let discovery_advert_listing_failures = Counter::default();
        registry.register(
            "discovery_advert_listing_failures",
            "Listings of event adverts in etcd that failed; the last sources were kept",
            discovery_advert_listing_failures.clone(),
        );
        let discovery_recovery_targets_unused = Counter::default();
        registry.register(
            "discovery_recovery_targets_unused",
            "Advertised event sources whose recovery target (a request-plane query) is not called, once per advert; such a source resets instead of recovering",
            discovery_recovery_targets_unused.clone(),
        );
        let discovery_card_reads = Counter::default();
        registry.register(
            "discovery_card_reads",
            "Card files opened and parsed (new or changed files; unchanged ones are only stat'ed)",
            discovery_card_reads.clone(),
        );
        let stream = StreamMetrics::default();
        stream.register(&mut registry);
        let pool_attach_failures = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "pool_attach_failures",
            "Pool attaches that failed, by reason (pool_limit: max_pools reached)",
            pool_attach_failures.clone(),
        );
        for kind in StreamKind::ALL {
            let _ = streams.get_or_create(&StreamLabel {
                stream: kind.label(),
            });
        }
        Self {
            registry,
            connections,
            streams,
            admission_rejected,
            errors_sent,
            subscriber_lagged,
            frames_sent,
            bytes_sent,
            heartbeats,
            pools,
            ingest,
            pool_faults,
            pool_unroutable_blocks,
            pool_contradiction_resets,
            tier_events_without_lane,
            tier_offloads_unmapped,
            tier_lane_resident_blocks,
            memory,
            pools_stalled,
            pools_degraded,
            pools_overfull,
            checkpoint_writes,
            checkpoint_restores,
            checkpoint_restored_mappings,
            checkpoint_last_bytes,
            checkpoint_last_export_seconds,
            checkpoint_last_write_seconds,
            pool_mailbox_depth_max,
            pool_oldest_pending_seconds_max,
            events,
            filter_omissions,
            filter_load_max,
            catalog_revision,
            accept_errors,
            admin_connections,
            dynamo_connections,
            dynamo_unauthorized,
            dynamo_messages_sent,
            dynamo_bytes_sent,
            dynamo_heartbeats,
            dynamo_errors,
            admin_unauthorized,
            discovery_skipped,
            discovery_advert_listing_failures,
            discovery_recovery_targets_unused,
            sources_cleared,
            discovery_card_reads,
            stream,
            pool_attach_failures,
        }
    }

    /// The OpenMetrics text exposition of every metric.
    pub(crate) fn encode(&self) -> String {
        let queued_bytes = self.ingest.refresh();
        let set = |component: &ComponentLabel, bytes: u64| {
            self.memory
                .get_or_create(component)
                .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        };
        set(&MEMORY_INGEST_QUEUES, queued_bytes);
        if let Some(stream) = self.stream.refresh() {
            set(&MEMORY_PUBLICATION_MIRRORS, stream.mirror_bytes);
            set(&MEMORY_PINNED_SNAPSHOTS, stream.pinned_copy_bytes);
            set(&MEMORY_RESUME_WINDOWS, stream.retained_bytes);
            set(&MEMORY_SUBSCRIBER_BACKLOGS, stream.pending_bytes);
        }
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }

    pub(crate) fn stream(kind: StreamKind) -> StreamLabel {
        StreamLabel {
            stream: kind.label(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_names_every_stream_kind() {
        let metrics = RelayMetrics::new();
        metrics
            .frames_sent
            .get_or_create(&RelayMetrics::stream(StreamKind::Pool))
            .inc_by(3);
        let text = metrics.encode();
        assert!(
            text.contains("kvrelay_frames_sent_total{stream=\"pool\"} 3"),
            "{text}"
        );
        assert!(
            text.contains("kvrelay_streams{stream=\"topology\"} 0"),
            "{text}"
        );
    }
}
