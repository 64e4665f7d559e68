//! Prometheus (OpenMetrics text) exposition of a [`ConsumerMetrics`] snapshot, through
//! `prometheus-client`.
//!
//! Every family is prefixed `kvrelay_consumer_`. Labels are low-cardinality by
//! construction: `state` (3 replica states) and `reason` (9 resubscribe reasons); no pool,
//! DC or model label appears, so the output size does not grow with the fleet.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::metrics::{ConsumerMetrics, SCORE_LATENCY_BUCKETS_US};

/// The family name prefix.
pub const METRIC_PREFIX: &str = "kvrelay_consumer";

/// Appends `metrics` to `out` in the OpenMetrics text format (ending with `# EOF`), which
/// Prometheus scrapes. Counters get the `_total` suffix; the score latency is a histogram
/// in seconds.
///
/// ```
/// use kvrelay_consumer::{ConsumerMetrics, encode_prometheus};
/// let mut text = String::new();
/// encode_prometheus(&ConsumerMetrics::default(), &mut text)?;
/// assert!(text.contains("kvrelay_consumer_replicas{state=\"current\"} 0"));
/// # Ok::<(), std::fmt::Error>(())
/// ```
pub fn encode_prometheus(
    metrics: &ConsumerMetrics,
    out: &mut String,
) -> Result<(), std::fmt::Error> {
    let mut registry = Registry::with_prefix(METRIC_PREFIX);
    registry.register_collector(Box::new(Snapshot(metrics.clone())));
    prometheus_client::encoding::text::encode(out, &registry)
}

/// One snapshot, encoded on the (single) scrape of its registry.
#[derive(Debug)]
struct Snapshot(ConsumerMetrics);

impl Collector for Snapshot {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let m = &self.0;
        {
            let mut family = encoder.encode_descriptor(
                "replicas",
                "Replicas by state (current replicas answer queries).",
                None,
                MetricType::Gauge,
            )?;
            for (state, n) in [
                ("current", m.replicas_current),
                ("assembling", m.replicas_assembling),
                ("stale", m.replicas_stale),
            ] {
                let labels = [("state", state)];
                family.encode_family(&labels)?.encode_gauge(&n)?;
            }
        }
        gauge(
            &mut encoder,
            "pools_incomplete",
            "Admitted pools whose relay says their filter is incomplete (recovering from its engines' replay, or degraded: an engine's history was lost); they answer but may miss cached prefixes.",
            m.pools_incomplete as f64,
        )?;
        gauge(
            &mut encoder,
            "replica_max_sequence_lag",
            "Largest announced minus installed sequence over current replicas.",
            m.max_replica_sequence_lag as f64,
        )?;
        gauge(
            &mut encoder,
            "query_table_bytes",
            "Bytes the replica query tables hold (spare stride included), bounded by max_query_table_bytes.",
            m.query_table_bytes as f64,
        )?;
        gauge(
            &mut encoder,
            "query_table_huge_page_advised_bytes",
            "Of query_table_bytes, those in tables the kernel took the huge-page advice for.",
            m.query_table_huge_page_advised_bytes as f64,
        )?;
        gauge(
            &mut encoder,
            "replica_max_age_seconds",
            "Largest time since a replica last heard from its relay, seconds.",
            m.max_replica_age.as_secs_f64(),
        )?;
        {
            let mut family = encoder.encode_descriptor(
                "resubscribes",
                "Replicas dropped and resubscribed, by reason.",
                None,
                MetricType::Counter,
            )?;
            for (reason, n) in &m.resubscribes {
                let labels = [("reason", reason.as_str())];
                family
                    .encode_family(&labels)?
                    .encode_counter::<NoLabelSet, u64, f64>(n, None)?;
            }
        }
        gauge(
            &mut encoder,
            "quarantined_entries",
            "Catalog entries quarantined now, over all relays.",
            m.quarantined_entries as f64,
        )?;
        gauge(
            &mut encoder,
            "standbys_unreachable",
            "Relays of pairs not followed now whose last probe failed: no working standby.",
            m.standbys_unreachable as f64,
        )?;
        gauge(
            &mut encoder,
            "standby_replicas_current",
            "Current replicas of hot standbys (followed, not scored): what a switch scores at once.",
            m.standby_replicas_current as f64,
        )?;
        let counters = [
            (
                "quarantined",
                "Catalog entries quarantined since start.",
                m.quarantined_total,
            ),
            (
                "catalog_entries_over_budget",
                "Catalog entries quarantined since start for the per-relay replica memory budget.",
                m.over_budget_total,
            ),
            (
                "contract_entries_left_out",
                "Entries of Dynamo-contract updates this consumer cannot represent, left out (each time an update carries one).",
                m.contract_entries_left_out_total,
            ),
            (
                "relay_connects",
                "Relay connections that passed the contract check.",
                m.relay_connects,
            ),
            (
                "relay_epoch_failures",
                "Relay connection epochs that ended.",
                m.relay_epoch_failures,
            ),
            (
                "relay_tls_failures",
                "Relay epochs that failed in the TLS handshake.",
                m.relay_tls_failures,
            ),
            (
                "relay_refusals",
                "Relay epochs refused at the first request (e.g. bad bearer token).",
                m.relay_refusals,
            ),
            (
                "relay_failovers",
                "Times a DC's followed relay was replaced by another of its relays.",
                m.relay_failovers,
            ),
            (
                "relay_silences",
                "Followed relays of a pair left because they sent no load window in time.",
                m.relay_silences,
            ),
            (
                "relay_stalls",
                "Followed relays of a pair left because their catalog named a stalled pool.",
                m.relay_stalls,
            ),
            (
                "standby_probe_failures",
                "Probes of a relay pair's standby that it did not answer.",
                m.standby_probe_failures,
            ),
            (
                "catalogs_applied",
                "Complete catalogs applied.",
                m.catalogs_applied,
            ),
            (
                "snapshots_installed",
                "Replica snapshots installed.",
                m.snapshots_installed,
            ),
            (
                "deltas_applied",
                "Replica deltas applied.",
                m.deltas_applied,
            ),
            ("heartbeats", "Replica heartbeats accepted.", m.heartbeats),
            ("load_windows", "Load windows applied.", m.load_windows),
            (
                "topologies_applied",
                "Topology updates applied.",
                m.topologies_applied,
            ),
        ];
        for (name, help, n) in counters {
            encoder
                .encode_descriptor(name, help, None, MetricType::Counter)?
                .encode_counter::<NoLabelSet, u64, f64>(&n, None)?;
        }
        let buckets: Vec<(f64, u64)> = SCORE_LATENCY_BUCKETS_US
            .iter()
            .map(|&us| us as f64 / 1e6)
            .chain(std::iter::once(f64::MAX))
            .zip(
                m.score_latency_counts
                    .iter()
                    .copied()
                    .chain(std::iter::repeat(0)),
            )
            .collect();
        encoder
            .encode_descriptor(
                "score_latency_seconds",
                "Latency of score calls, seconds.",
                None,
                MetricType::Histogram,
            )?
            .encode_histogram::<NoLabelSet>(
                m.score_latency_sum.as_secs_f64(),
                m.scores,
                &buckets,
                None,
            )?;
        Ok(())
    }
}

fn gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    value: f64,
) -> Result<(), std::fmt::Error> {
    encoder
        .encode_descriptor(name, help, None, MetricType::Gauge)?
        .encode_gauge(&value)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail by panicking")]

    use std::time::Duration;

    use super::*;
    use crate::metrics::ResubscribeReason;

    fn sample() -> ConsumerMetrics {
        ConsumerMetrics {
            replicas_current: 3,
            replicas_stale: 1,
            max_replica_age: Duration::from_millis(1500),
            resubscribes: ResubscribeReason::ALL
                .iter()
                .map(|&r| (r, u64::from(r == ResubscribeReason::Gap) * 2))
                .collect(),
            deltas_applied: 7,
            over_budget_total: 2,
            contract_entries_left_out_total: 3,
            score_latency_counts: {
                let mut counts = vec![0; SCORE_LATENCY_BUCKETS_US.len() + 1];
                counts[2] = 4;
                counts[SCORE_LATENCY_BUCKETS_US.len()] = 1;
                counts
            },
            score_latency_sum: Duration::from_micros(30_012),
            scores: 5,
            ..ConsumerMetrics::default()
        }
    }

    fn encoded() -> String {
        let mut text = String::new();
        encode_prometheus(&sample(), &mut text).unwrap();
        text
    }

    #[test]
    fn every_family_is_declared_once_with_its_type() {
        let text = encoded();
        for (family, kind) in [
            ("replicas", "gauge"),
            ("replica_max_sequence_lag", "gauge"),
            ("replica_max_age_seconds", "gauge"),
            ("query_table_bytes", "gauge"),
            ("query_table_huge_page_advised_bytes", "gauge"),
            ("resubscribes", "counter"),
            ("quarantined_entries", "gauge"),
            ("quarantined", "counter"),
            ("catalog_entries_over_budget", "counter"),
            ("relay_connects", "counter"),
            ("relay_epoch_failures", "counter"),
            ("relay_tls_failures", "counter"),
            ("relay_refusals", "counter"),
            ("relay_failovers", "counter"),
            ("relay_silences", "counter"),
            ("relay_stalls", "counter"),
            ("standby_probe_failures", "counter"),
            ("standbys_unreachable", "gauge"),
            ("standby_replicas_current", "gauge"),
            ("catalogs_applied", "counter"),
            ("snapshots_installed", "counter"),
            ("deltas_applied", "counter"),
            ("heartbeats", "counter"),
            ("load_windows", "counter"),
            ("topologies_applied", "counter"),
            ("score_latency_seconds", "histogram"),
        ] {
            let line = format!("# TYPE {METRIC_PREFIX}_{family} {kind}\n");
            assert_eq!(text.matches(&line).count(), 1, "{line}");
        }
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn values_carry_their_low_cardinality_labels() {
        let text = encoded();
        assert!(text.contains("kvrelay_consumer_replicas{state=\"current\"} 3\n"));
        assert!(text.contains("kvrelay_consumer_replicas{state=\"stale\"} 1\n"));
        assert!(text.contains("kvrelay_consumer_resubscribes_total{reason=\"gap\"} 2\n"));
        assert!(text.contains("kvrelay_consumer_resubscribes_total{reason=\"stale\"} 0\n"));
        assert!(text.contains("kvrelay_consumer_deltas_applied_total 7\n"));
        assert!(text.contains("kvrelay_consumer_catalog_entries_over_budget_total 2\n"));
        assert!(text.contains("kvrelay_consumer_contract_entries_left_out_total 3\n"));
        assert!(text.contains("kvrelay_consumer_resubscribes_total{reason=\"allocation\"} 0\n"));
        assert!(text.contains("kvrelay_consumer_resubscribes_total{reason=\"over_budget\"} 0\n"));
        assert!(text.contains("kvrelay_consumer_replica_max_age_seconds 1.5\n"));
    }

    #[test]
    fn latency_histogram_is_cumulative_in_seconds() {
        let text = encoded();
        assert!(text.contains("kvrelay_consumer_score_latency_seconds_count 5\n"));
        assert!(
            text.contains("kvrelay_consumer_score_latency_seconds_bucket{le=\"0.000002\"} 0\n")
        );
        assert!(
            text.contains("kvrelay_consumer_score_latency_seconds_bucket{le=\"0.000005\"} 4\n")
        );
        assert!(text.contains("kvrelay_consumer_score_latency_seconds_bucket{le=\"0.02\"} 4\n"));
        assert!(text.contains("kvrelay_consumer_score_latency_seconds_bucket{le=\"+Inf\"} 5\n"));
    }

    #[test]
    fn every_sample_line_parses_as_name_labels_and_a_number() {
        for line in encoded().lines().filter(|l| !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').unwrap();
            assert!(name.starts_with(METRIC_PREFIX), "{line}");
            assert!(value.parse::<f64>().is_ok(), "{line}");
            let metric = name.split('{').next().unwrap();
            assert!(
                metric
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_'),
                "{line}"
            );
        }
    }
}
