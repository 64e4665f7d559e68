//! Ingest source metrics from the sources' own probes: `kvrelay_sources{state}` counts the
//! live sources by their real transport state, and the ingest counters
//! (`kvrelay_ingest_rejected_total{transport, reason}`, `kvrelay_ingest_replays_total{outcome}`,
//! `kvrelay_ingest_resets_total{cause}`, restarts, disconnects, unverified tails) sum every
//! source that ever ran: a stopped source's final counts are kept, so counters never go
//! back. Label values are closed sets from the ingest crate, never remote input.
//!
//! A source is registered for as long as its [`SourceRegistration`] lives; the exposition
//! calls [`SourceMetrics::refresh`] first, which adds what changed since the last scrape.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};

use kvrelay_ingest::{
    RejectionKind, ReplayOutcome, ResetReason, SourceProbe, SourceState, SourceStats, Transport,
};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::metrics::{OutcomeLabel, StateLabel};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct TransportReasonLabels {
    pub(crate) transport: &'static str,
    pub(crate) reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct CauseLabel {
    pub(crate) cause: &'static str,
}

/// Counter totals over a set of sources.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Totals {
    rejected: BTreeMap<(Transport, RejectionKind), u64>,
    replays: BTreeMap<ReplayOutcome, u64>,
    resets: BTreeMap<&'static str, u64>,
    restarts: u64,
    disconnects: u64,
    unverified_tails: u64,
    late_copies: u64,
}

impl Totals {
    fn add(&mut self, transport: Transport, stats: &SourceStats) {
        for (kind, n) in &stats.rejected {
            *self.rejected.entry((transport, *kind)).or_default() += n;
        }
        for (outcome, n) in &stats.replays {
            *self.replays.entry(*outcome).or_default() += n;
        }
        for (cause, n) in &stats.resets {
            *self.resets.entry(cause).or_default() += n;
        }
        self.restarts += stats.n_restarts;
        self.disconnects += stats.n_disconnects;
        self.unverified_tails += stats.n_unverified_tails;
        self.late_copies += stats.n_late_copies;
    }
}

impl Totals {
    /// The pool-stats view of these counters (`ingest` in `/v1/pools/{pool}/stats`).
    fn json(&self) -> serde_json::Value {
        // Per kind, over both transports (a pool's sources are ZMQ or NATS).
        let mut rejected: BTreeMap<&'static str, u64> = BTreeMap::new();
        for ((_, kind), n) in &self.rejected {
            *rejected.entry(kind.as_str()).or_default() += n;
        }
        let replays: serde_json::Map<String, serde_json::Value> = self
            .replays
            .iter()
            .map(|(outcome, n)| (outcome.as_str().to_owned(), (*n).into()))
            .collect();
        let resets: serde_json::Map<String, serde_json::Value> = self
            .resets
            .iter()
            .map(|(cause, n)| ((*cause).to_owned(), (*n).into()))
            .collect();
        serde_json::json!({
            "unverified_tails": self.unverified_tails,
            "late_copies": self.late_copies,
            "disconnects": self.disconnects,
            "restarts": self.restarts,
            "replays": replays,
            "resets": resets,
            "rejected": rejected,
        })
    }
}

/// One running source: its probe and the endpoint whose pool it feeds.
#[derive(Debug)]
struct LiveSource {
    probe: SourceProbe,
    endpoint: String,
}

#[derive(Debug, Default)]
struct Inner {
    next_id: u64,
    live: BTreeMap<u64, LiveSource>,
    /// Final counts of sources that stopped.
    retired: Totals,
    /// What the families already carry.
    exported: Totals,
}

/// The ingest families and the live sources they are computed from.
#[derive(Debug)]
pub(crate) struct SourceMetrics {
    inner: Mutex<Inner>,
    sources: Family<StateLabel, Gauge>,
    rejected: Family<TransportReasonLabels, Counter>,
    replays: Family<OutcomeLabel, Counter>,
    resets: Family<CauseLabel, Counter>,
    restarts: Counter,
    disconnects: Counter,
    unverified_tails: Counter,
    late_copies: Counter,
    queued_bytes: Gauge,
}

/// Keeps a source in [`SourceMetrics`]; dropping it retires the source (its final counts
/// stay in the totals).
#[derive(Debug)]
pub(crate) struct SourceRegistration {
    id: u64,
    metrics: Arc<SourceMetrics>,
}

impl Drop for SourceRegistration {
    fn drop(&mut self) {
        let mut inner = self.metrics.lock();
        if let Some(source) = inner.live.remove(&self.id) {
            inner
                .retired
                .add(source.probe.transport(), &source.probe.stats());
        }
    }
}

fn delta(counter: &Counter, now: u64, before: u64) {
    if now > before {
        counter.inc_by(now - before);
    }
}

impl SourceMetrics {
    /// Registers the families in `registry`, with `sources` as the state gauge.
    pub(crate) fn new(registry: &mut Registry, sources: Family<StateLabel, Gauge>) -> Self {
        let metrics = Self {
            inner: Mutex::default(),
            sources,
            rejected: Family::default(),
            replays: Family::default(),
            resets: Family::default(),
            restarts: Counter::default(),
            disconnects: Counter::default(),
            unverified_tails: Counter::default(),
            late_copies: Counter::default(),
            queued_bytes: Gauge::default(),
        };
        registry.register(
            "ingest_queued_bytes",
            "Bytes of received messages the running ZMQ sources hold (each bounded by [ingest] max_queued_bytes)",
            metrics.queued_bytes.clone(),
        );
        registry.register(
            "ingest_rejected",
            "Ingest input rejected, by transport and reason",
            metrics.rejected.clone(),
        );
        registry.register(
            "ingest_replays",
            "Ingest replays by outcome",
            metrics.replays.clone(),
        );
        registry.register(
            "ingest_resets",
            "Ingest source resets (state cleared) by cause",
            metrics.resets.clone(),
        );
        registry.register(
            "ingest_restarts",
            "Ingest source readers restarted after a failure or panic",
            metrics.restarts.clone(),
        );
        registry.register(
            "ingest_disconnects",
            "Ingest transport connections lost",
            metrics.disconnects.clone(),
        );
        registry.register(
            "ingest_unverified_tails",
            "Publisher disconnects after batches with no replay endpoint to check for a lost tail",
            metrics.unverified_tails.clone(),
        );
        registry.register(
            "ingest_late_copies",
            "Live copies of batches a replay had already delivered, dropped (not a publisher restart)",
            metrics.late_copies.clone(),
        );
        // Every label of the closed sets is exported from the start, at zero.
        for state in SourceState::ALL {
            let _ = metrics.sources.get_or_create(&StateLabel {
                state: state.as_str(),
            });
        }
        for outcome in ReplayOutcome::ALL {
            let _ = metrics.replays.get_or_create(&OutcomeLabel {
                outcome: outcome.as_str(),
            });
        }
        for cause in ResetReason::CAUSES {
            let _ = metrics.resets.get_or_create(&CauseLabel { cause });
        }
        metrics
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Watches `probe`, a source feeding the pool of `endpoint` (dotted), until the
    /// returned registration is dropped.
    pub(crate) fn register(
        self: &Arc<Self>,
        probe: SourceProbe,
        endpoint: String,
    ) -> SourceRegistration {
        let mut inner = self.lock();
        let id = inner.next_id;
        inner.next_id += 1;
        inner.live.insert(id, LiveSource { probe, endpoint });
        SourceRegistration {
            id,
            metrics: self.clone(),
        }
    }

    /// Live sources per state (every state present).
    pub(crate) fn state_counts(&self) -> BTreeMap<SourceState, usize> {
        let inner = self.lock();
        let mut counts: BTreeMap<SourceState, usize> =
            SourceState::ALL.iter().map(|state| (*state, 0)).collect();
        for source in inner.live.values() {
            *counts.entry(source.probe.state()).or_default() += 1;
        }
        counts
    }

    /// The counters of the running sources of `endpoint`'s pool, for its stats view: what
    /// they saw since they started (a pool's sources restart with its generation, so a
    /// retired generation's counts stay in the relay-wide metrics only).
    pub(crate) fn endpoint_json(&self, endpoint: &str) -> serde_json::Value {
        let inner = self.lock();
        let mut totals = Totals::default();
        for source in inner.live.values().filter(|s| s.endpoint == endpoint) {
            totals.add(source.probe.transport(), &source.probe.stats());
        }
        totals.json()
    }

    /// Brings the families up to date with the sources' counters and states.
    /// Re-reads every live source; returns the bytes they hold queued.
    pub(crate) fn refresh(&self) -> u64 {
        for (state, n) in self.state_counts() {
            self.sources
                .get_or_create(&StateLabel {
                    state: state.as_str(),
                })
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        let mut inner = self.lock();
        let mut totals = inner.retired.clone();
        let mut queued_bytes = 0u64;
        for source in inner.live.values() {
            let stats = source.probe.stats();
            queued_bytes = queued_bytes.saturating_add(stats.queued_bytes);
            totals.add(source.probe.transport(), &stats);
        }
        self.queued_bytes
            .set(i64::try_from(queued_bytes).unwrap_or(i64::MAX));
        let before = &inner.exported;
        for ((transport, kind), n) in &totals.rejected {
            let labels = TransportReasonLabels {
                transport: transport.as_str(),
                reason: kind.as_str(),
            };
            let was = before.rejected.get(&(*transport, *kind)).copied();
            delta(&self.rejected.get_or_create(&labels), *n, was.unwrap_or(0));
        }
        for (outcome, n) in &totals.replays {
            let labels = OutcomeLabel {
                outcome: outcome.as_str(),
            };
            let was = before.replays.get(outcome).copied().unwrap_or(0);
            delta(&self.replays.get_or_create(&labels), *n, was);
        }
        for (cause, n) in &totals.resets {
            let was = before.resets.get(cause).copied().unwrap_or(0);
            delta(&self.resets.get_or_create(&CauseLabel { cause }), *n, was);
        }
        delta(&self.restarts, totals.restarts, before.restarts);
        delta(&self.disconnects, totals.disconnects, before.disconnects);
        delta(
            &self.unverified_tails,
            totals.unverified_tails,
            before.unverified_tails,
        );
        delta(&self.late_copies, totals.late_copies, before.late_copies);
        inner.exported = totals;
        queued_bytes
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test")]
    use kvrelay_identity::KvQueryHashFormat;
    use kvrelay_ingest::{
        CanonicalConfig, EngineKind, FaultInjection, Limits, ZmqSourceConfig, ZmqWire,
        spawn_zmq_source,
    };

    use crate::metrics::RelayMetrics;

    #[tokio::test]
    async fn sources_are_counted_by_real_state_and_retired_on_drop() {
        let metrics = RelayMetrics::new();
        // Nothing listens on the discard port: the source stays connecting.
        let source = spawn_zmq_source(ZmqSourceConfig {
            worker_id: 1,
            dp_rank: 0,
            declared_ranks: 0..1,
            wire: ZmqWire::Engine(EngineKind::Vllm),
            endpoint: "tcp://127.0.0.1:9".to_owned(),
            replay_endpoint: None,
            topic: String::new(),
            canonical: CanonicalConfig::new(4, KvQueryHashFormat::DynamoStandardV1),
            limits: Limits::default(),
            fault: FaultInjection::default(),
            resume_after: None,
            queue_budget: None,
        });
        let registration = metrics
            .ingest
            .register(source.probe(), "ns.comp.ep".to_owned());
        let text = metrics.encode();
        assert!(
            text.contains("kvrelay_sources{state=\"connecting\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("kvrelay_sources{state=\"connected\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("kvrelay_ingest_replays_total{outcome=\"recovered\"} 0"),
            "{text}"
        );
        drop(registration);
        let text = metrics.encode();
        assert!(
            text.contains("kvrelay_sources{state=\"connecting\"} 0"),
            "{text}"
        );
        assert!(source.shutdown().await);
    }
}
