//! Consumer metrics: atomic counters and a latency histogram, read as a plain
//! [`ConsumerMetrics`] snapshot.
//!
//! Counters only grow. Gauges (replicas by state, lag, quarantined entries) are computed
//! from the replica store and the catalog views when the snapshot is taken, so they can
//! never drift from the state they describe.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Why a pool replica was dropped and resubscribed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum ResubscribeReason {
    /// A delta did not continue the installed sequence.
    Gap,
    /// The relay cut the subscription off because it lagged.
    Lagged,
    /// The relay reported a different producer generation, or a frame named another one.
    ProducerChanged,
    /// A bucket-image payload failed its checksum.
    Checksum,
    /// A frame failed validation (header, bounds, snapshot assembly, kind).
    Validation,
    /// The connection closed, timed out or failed, or the relay sent another error.
    Disconnected,
    /// The relay restarted (its incarnation changed).
    RelayRestart,
    /// The replica aged past the staleness bound without hearing from the relay.
    Stale,
    /// The replica's table could not be allocated: the replica was dropped and the
    /// subscription is retried after backoff.
    Allocation,
    /// The replica's lane would take the query tables past
    /// [`crate::Limits::max_query_table_bytes`]: not built, retried after backoff.
    OverBudget,
}

impl ResubscribeReason {
    /// Every reason, in export order.
    pub const ALL: [Self; 10] = [
        Self::Gap,
        Self::Lagged,
        Self::ProducerChanged,
        Self::Checksum,
        Self::Validation,
        Self::Disconnected,
        Self::RelayRestart,
        Self::Stale,
        Self::Allocation,
        Self::OverBudget,
    ];

    /// The snake_case label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gap => "gap",
            Self::Lagged => "lagged",
            Self::ProducerChanged => "producer_changed",
            Self::Checksum => "checksum",
            Self::Validation => "validation",
            Self::Disconnected => "disconnected",
            Self::RelayRestart => "relay_restart",
            Self::Stale => "stale",
            Self::Allocation => "allocation",
            Self::OverBudget => "over_budget",
        }
    }

    fn index(self) -> usize {
        match self {
            Self::Gap => 0,
            Self::Lagged => 1,
            Self::ProducerChanged => 2,
            Self::Checksum => 3,
            Self::Validation => 4,
            Self::Disconnected => 5,
            Self::RelayRestart => 6,
            Self::Stale => 7,
            Self::Allocation => 8,
            Self::OverBudget => 9,
        }
    }
}

/// Upper bounds (inclusive, microseconds) of the score latency histogram buckets; a last
/// implicit bucket holds everything above.
pub const SCORE_LATENCY_BUCKETS_US: [u64; 12] =
    [1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 5_000, 20_000];

/// A point-in-time copy of every consumer metric.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ConsumerMetrics {
    /// Replicas installed, sequenced and fresh: used for scoring.
    pub replicas_current: u64,
    /// Subscriptions still assembling their first snapshot.
    pub replicas_assembling: u64,
    /// Installed replicas older than the staleness bound: not used for scoring.
    pub replicas_stale: u64,
    /// Admitted pools whose relay says their filter is incomplete (recovering, degraded,
    /// or a state this consumer does not know): they answer, but may miss cached
    /// prefixes.
    pub pools_incomplete: u64,
    /// Largest gap, over current replicas, between the newest sequence the relay
    /// announced and the installed sequence.
    pub max_replica_sequence_lag: u64,
    /// Largest time since a replica last heard from its relay (snapshot, delta or
    /// heartbeat), over installed replicas.
    pub max_replica_age: Duration,
    /// Bytes the query tables hold now (what replicas really take, spare stride
    /// included), bounded by [`crate::Limits::max_query_table_bytes`].
    pub query_table_bytes: u64,
    /// Of [`Self::query_table_bytes`], those in tables whose rows the kernel took the
    /// huge-page advice for (`kvrelay_ckf::QueryConfig::huge_pages`); what it actually
    /// backs with huge pages is `AnonHugePages` in the process's `smaps_rollup`.
    pub query_table_huge_page_advised_bytes: u64,
    /// Resubscriptions by reason, in [`ResubscribeReason::ALL`] order.
    pub resubscribes: Vec<(ResubscribeReason, u64)>,
    /// Catalog entries currently quarantined (unsupported or malformed), over all relays.
    pub quarantined_entries: u64,
    /// Catalog entries quarantined since start.
    pub quarantined_total: u64,
    /// Of those, entries quarantined because they did not fit their relay's replica
    /// memory budget ([`crate::Limits::max_replica_bytes_per_relay`]).
    pub over_budget_total: u64,
    /// Entries of updates from Dynamo-contract relays (catalog pools, readiness and load
    /// entries) this consumer cannot represent, left out of the update; counted each
    /// time an update carries one (the rest of the update is used).
    pub contract_entries_left_out_total: u64,
    /// Successful connections to relays that passed the contract check.
    pub relay_connects: u64,
    /// Relay connection epochs that ended (error, close, restart).
    pub relay_epoch_failures: u64,
    /// Epochs that failed in the TLS handshake (untrusted or mismatched relay
    /// certificate, client certificate refused, peer not speaking TLS).
    pub relay_tls_failures: u64,
    /// Epochs the relay refused at the first request (a missing or wrong bearer token,
    /// or another error answer to the relay-info request).
    pub relay_refusals: u64,
    /// Times a DC's followed relay was replaced by another of its relays (a pair).
    pub relay_failovers: u64,
    /// Followed relays of a pair left because they went silent (no load window for
    /// `relay_silence_windows` of their window lengths), each also a failover; with hot
    /// standbys, relays of a pair that went silent (kept followed, not scored meanwhile).
    pub relay_silences: u64,
    /// Followed relays of a pair left because their catalog named a stalled pool, each
    /// also a failover.
    pub relay_stalls: u64,
    /// Probes of a pair's standby that it did not answer
    /// ([`crate::Limits::standby_probe_interval`]).
    pub standby_probe_failures: u64,
    /// Relays of pairs not followed now whose last probe failed (or that were just left
    /// because they failed): the DC has no working standby until they answer again.
    pub standbys_unreachable: u64,
    /// Replicas of hot standbys ([`crate::StandbyMode::Hot`]: relays followed all along
    /// but not scored now) that are current: what a switch would score at once. Below
    /// the scored pools' count, a failover now would leave some pools out.
    pub standby_replicas_current: u64,
    /// Complete catalogs applied.
    pub catalogs_applied: u64,
    /// Snapshots installed.
    pub snapshots_installed: u64,
    /// Deltas applied.
    pub deltas_applied: u64,
    /// Heartbeats accepted.
    pub heartbeats: u64,
    /// Load windows applied.
    pub load_windows: u64,
    /// Topology updates applied.
    pub topologies_applied: u64,
    /// Score latency histogram counts, one per [`SCORE_LATENCY_BUCKETS_US`] bound plus
    /// one overflow bucket.
    pub score_latency_counts: Vec<u64>,
    /// Sum of all score latencies.
    pub score_latency_sum: Duration,
    /// Number of `score` calls.
    pub scores: u64,
}

impl ConsumerMetrics {
    /// Resubscriptions counted for `reason`.
    pub fn resubscribes_for(&self, reason: ResubscribeReason) -> u64 {
        self.resubscribes
            .iter()
            .find(|(r, _)| *r == reason)
            .map_or(0, |(_, n)| *n)
    }
}

/// The live counters, shared by the client tasks and the scoring path.
#[derive(Debug, Default)]
pub(crate) struct MetricsRecorder {
    resubscribes: [AtomicU64; ResubscribeReason::ALL.len()],
    quarantined_total: AtomicU64,
    over_budget_total: AtomicU64,
    contract_entries_left_out_total: AtomicU64,
    relay_connects: AtomicU64,
    relay_epoch_failures: AtomicU64,
    relay_tls_failures: AtomicU64,
    relay_refusals: AtomicU64,
    relay_failovers: AtomicU64,
    relay_silences: AtomicU64,
    relay_stalls: AtomicU64,
    standby_probe_failures: AtomicU64,
    catalogs_applied: AtomicU64,
    snapshots_installed: AtomicU64,
    deltas_applied: AtomicU64,
    heartbeats: AtomicU64,
    load_windows: AtomicU64,
    topologies_applied: AtomicU64,
    score_latency: [AtomicU64; 13],
    score_latency_sum_ns: AtomicU64,
    scores: AtomicU64,
}

/// A counter of [`MetricsRecorder`] without a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Counter {
    QuarantinedTotal,
    OverBudgetTotal,
    ContractEntriesLeftOut,
    RelayConnects,
    RelayEpochFailures,
    RelayTlsFailures,
    RelayRefusals,
    RelayFailovers,
    RelaySilences,
    RelayStalls,
    StandbyProbeFailures,
    CatalogsApplied,
    SnapshotsInstalled,
    DeltasApplied,
    Heartbeats,
    LoadWindows,
    TopologiesApplied,
}

impl MetricsRecorder {
    pub(crate) fn resubscribe(&self, reason: ResubscribeReason) {
        self.resubscribes[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(&self, counter: Counter, n: u64) {
        let cell = match counter {
            Counter::QuarantinedTotal => &self.quarantined_total,
            Counter::OverBudgetTotal => &self.over_budget_total,
            Counter::ContractEntriesLeftOut => &self.contract_entries_left_out_total,
            Counter::RelayConnects => &self.relay_connects,
            Counter::RelayEpochFailures => &self.relay_epoch_failures,
            Counter::RelayTlsFailures => &self.relay_tls_failures,
            Counter::RelayRefusals => &self.relay_refusals,
            Counter::RelayFailovers => &self.relay_failovers,
            Counter::RelaySilences => &self.relay_silences,
            Counter::RelayStalls => &self.relay_stalls,
            Counter::StandbyProbeFailures => &self.standby_probe_failures,
            Counter::CatalogsApplied => &self.catalogs_applied,
            Counter::SnapshotsInstalled => &self.snapshots_installed,
            Counter::DeltasApplied => &self.deltas_applied,
            Counter::Heartbeats => &self.heartbeats,
            Counter::LoadWindows => &self.load_windows,
            Counter::TopologiesApplied => &self.topologies_applied,
        };
        cell.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn incr(&self, counter: Counter) {
        self.add(counter, 1);
    }

    pub(crate) fn observe_score(&self, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        let bucket = SCORE_LATENCY_BUCKETS_US
            .iter()
            .position(|&bound| us <= bound)
            .unwrap_or(SCORE_LATENCY_BUCKETS_US.len());
        self.score_latency[bucket].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.score_latency_sum_ns.fetch_add(ns, Ordering::Relaxed);
        self.scores.fetch_add(1, Ordering::Relaxed);
    }

    /// Copies the counters into `out` (gauges are filled by the caller).
    pub(crate) fn fill(&self, out: &mut ConsumerMetrics) {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        out.resubscribes = ResubscribeReason::ALL
            .iter()
            .map(|&r| (r, load(&self.resubscribes[r.index()])))
            .collect();
        out.quarantined_total = load(&self.quarantined_total);
        out.over_budget_total = load(&self.over_budget_total);
        out.contract_entries_left_out_total = load(&self.contract_entries_left_out_total);
        out.relay_connects = load(&self.relay_connects);
        out.relay_epoch_failures = load(&self.relay_epoch_failures);
        out.relay_tls_failures = load(&self.relay_tls_failures);
        out.relay_refusals = load(&self.relay_refusals);
        out.relay_failovers = load(&self.relay_failovers);
        out.relay_silences = load(&self.relay_silences);
        out.relay_stalls = load(&self.relay_stalls);
        out.standby_probe_failures = load(&self.standby_probe_failures);
        out.catalogs_applied = load(&self.catalogs_applied);
        out.snapshots_installed = load(&self.snapshots_installed);
        out.deltas_applied = load(&self.deltas_applied);
        out.heartbeats = load(&self.heartbeats);
        out.load_windows = load(&self.load_windows);
        out.topologies_applied = load(&self.topologies_applied);
        out.score_latency_counts = self.score_latency.iter().map(load).collect();
        out.score_latency_sum = Duration::from_nanos(load(&self.score_latency_sum_ns));
        out.scores = load(&self.scores);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn score_latency_lands_in_the_first_bucket_at_or_above_it() {
        let recorder = MetricsRecorder::default();
        recorder.observe_score(Duration::from_micros(3));
        recorder.observe_score(Duration::from_secs(1));
        let mut m = ConsumerMetrics::default();
        recorder.fill(&mut m);
        assert_eq!(
            m.score_latency_counts[2], 1,
            "3 us falls in the <= 5 us bucket"
        );
        assert_eq!(m.score_latency_counts[SCORE_LATENCY_BUCKETS_US.len()], 1);
        assert_eq!(m.scores, 2);
    }

    #[test]
    fn resubscribes_are_counted_per_reason() {
        let recorder = MetricsRecorder::default();
        recorder.resubscribe(ResubscribeReason::Gap);
        recorder.resubscribe(ResubscribeReason::Gap);
        recorder.resubscribe(ResubscribeReason::Lagged);
        let mut m = ConsumerMetrics::default();
        recorder.fill(&mut m);
        assert_eq!(m.resubscribes_for(ResubscribeReason::Gap), 2);
        assert_eq!(m.resubscribes_for(ResubscribeReason::Lagged), 1);
        assert_eq!(m.resubscribes_for(ResubscribeReason::Checksum), 0);
    }
}
