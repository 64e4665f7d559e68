//! The router's own metrics (`kvrelay_router_*`): HTTP requests by route and status,
//! request latency by route, connections and accept errors. `/metrics` serves them
//! followed by the consumer's families (`kvrelay_consumer_*`).

use std::time::Duration;

use kvrelay_http::{AcceptErrorKind, ConnectionOutcome, ListenerEvents};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Prefix of every router family.
pub const ROUTER_METRIC_PREFIX: &str = "kvrelay_router";

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    route: &'static str,
    status: u16,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabel {
    route: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

type LatencyFamily = Family<RouteLabel, Histogram, fn() -> Histogram>;

/// The router's registry and its families.
#[derive(Debug)]
pub struct RouterMetrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    latency: LatencyFamily,
    connections: Family<OutcomeLabel, Counter>,
    accept_errors: Family<KindLabel, Counter>,
    scored: Counter,
    unauthorized: Counter,
    open_file_limit: Gauge,
    max_open_descriptors: Gauge,
}

/// Latency buckets: 10 µs doubling to ~1.3 s.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(10e-6, 2.0, 18))
}

impl RouterMetrics {
    /// Registers every family.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix(ROUTER_METRIC_PREFIX);
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "http_requests",
            "HTTP requests answered, by route and status",
            requests.clone(),
        );
        let latency: LatencyFamily = Family::new_with_constructor(latency_histogram);
        registry.register(
            "http_request_duration_seconds",
            "Time from a request's arrival to its answer, by route",
            latency.clone(),
        );
        let connections = Family::<OutcomeLabel, Counter>::default();
        registry.register(
            "http_connections",
            "HTTP connections: accepted, rejected_limit (max_connections), rejected_peer_limit (max_connections_per_peer), header_timeout, handshake_failed ([tls])",
            connections.clone(),
        );
        let accept_errors = Family::<KindLabel, Counter>::default();
        registry.register(
            "accept_errors",
            "Failed accepts of the HTTP listener (fd_limit: backing off)",
            accept_errors.clone(),
        );
        let scored = Counter::default();
        registry.register(
            "scored_requests",
            "Route requests scored (a batch counts each of its requests)",
            scored.clone(),
        );
        let unauthorized = Counter::default();
        registry.register(
            "http_unauthorized",
            "API requests refused for a missing or wrong bearer token ([auth])",
            unauthorized.clone(),
        );
        let open_file_limit = Gauge::default();
        registry.register(
            "open_file_limit",
            "The process's soft open file limit at start (0 when unlimited)",
            open_file_limit.clone(),
        );
        let max_open_descriptors = Gauge::default();
        registry.register(
            "max_open_descriptors",
            "Descriptors the router's bounds allow at once (RouterConfig::max_open_descriptors): \
             above open_file_limit, connects and accepts can fail with EMFILE",
            max_open_descriptors.clone(),
        );
        Self {
            registry,
            unauthorized,
            open_file_limit,
            max_open_descriptors,
            requests,
            latency,
            connections,
            accept_errors,
            scored,
        }
    }

    /// Counts one request refused for its bearer token.
    pub fn unauthorized(&self) {
        self.unauthorized.inc();
    }

    /// Counts one answered request on `route` with `status`, taking `elapsed`.
    pub fn observe(&self, route: &'static str, status: u16, elapsed: Duration) {
        self.requests
            .get_or_create(&RequestLabels { route, status })
            .inc();
        self.latency
            .get_or_create(&RouteLabel { route })
            .observe(elapsed.as_secs_f64());
    }

    /// Records the descriptor budget: the soft open file limit (`None`: unlimited, left
    /// at 0) and what the configured bounds allow at once.
    pub fn descriptor_budget(&self, open_file_limit: Option<u64>, max_open_descriptors: u64) {
        let gauge = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
        if let Some(limit) = open_file_limit {
            self.open_file_limit.set(gauge(limit));
        }
        self.max_open_descriptors.set(gauge(max_open_descriptors));
    }

    /// Counts `n` scored route requests.
    pub fn scored(&self, n: u64) {
        self.scored.inc_by(n);
    }

    /// The router families in the OpenMetrics text format, without the final `# EOF`
    /// (the consumer's families follow it in `/metrics`).
    pub fn encode_without_eof(&self, out: &mut String) -> Result<(), std::fmt::Error> {
        prometheus_client::encoding::text::encode_registry(out, &self.registry)
    }
}

impl Default for RouterMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ListenerEvents for RouterMetrics {
    fn accept_error(&self, kind: AcceptErrorKind) {
        self.accept_errors
            .get_or_create(&KindLabel { kind: kind.label() })
            .inc();
    }

    fn connection(&self, outcome: ConnectionOutcome) {
        self.connections
            .get_or_create(&OutcomeLabel {
                outcome: outcome.label(),
            })
            .inc();
    }
}
