//! A blocking, one-request entry point for command-line tools: connect to the relays,
//! let replicas settle, score once, shut down.

use std::time::Duration;

use crate::catalog::QuarantinedEntry;
use crate::client::Consumer;
use crate::config::{ConfigError, ConsumerConfig};
use crate::metrics::ConsumerMetrics;
use crate::scoring::{Ranking, ReplicaState, ScoreError, ScoreRequest};
use crate::state::PoolStatus;

/// Everything one blocking route produced.
#[derive(Debug, Clone)]
pub struct RouteReport {
    /// The ranking, or why the request could not be scored.
    pub ranking: Result<Ranking, ScoreError>,
    /// Whether every relay delivered a catalog and every replica was current before the
    /// settle time ran out (otherwise unusable replicas are reported as unknown).
    pub settled: bool,
    /// Every admitted pool and its replica state when scored.
    pub pools: Vec<PoolStatus>,
    /// Quarantined catalog entries.
    pub quarantined: Vec<QuarantinedEntry>,
    /// Metrics when scored.
    pub metrics: ConsumerMetrics,
    /// Per relay: its DC and why its last connection epoch ended, if one did (see
    /// [`Consumer::relay_errors`]).
    pub relay_errors: Vec<(String, Option<String>)>,
}

/// Why a blocking route could not run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouteError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The runtime could not be built.
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
}

/// Builds a single-threaded runtime, starts a [`Consumer`], waits up to `settle` for
/// every relay's catalog and every replica to be current, scores `request` and shuts
/// down. Must not be called from inside a tokio runtime.
pub fn route_once(
    config: ConsumerConfig,
    request: &ScoreRequest,
    settle: Duration,
) -> Result<RouteReport, RouteError> {
    config.validate()?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(RouteError::Runtime)?;
    runtime.block_on(async move {
        let consumer = Consumer::start(config)?;
        let settled = consumer
            .wait_until(settle, |state, now| {
                let all_catalogs =
                    (0..state.relays().len()).all(|relay| state.catalog_revision(relay).is_some());
                all_catalogs
                    && state
                        .pools(now)
                        .iter()
                        .all(|pool| pool.replica == ReplicaState::Current)
            })
            .await;
        let report = RouteReport {
            ranking: consumer.score(request),
            settled,
            pools: consumer.pools(),
            quarantined: consumer.quarantined(),
            metrics: consumer.metrics(),
            relay_errors: consumer.relay_errors(),
        };
        consumer.shutdown().await;
        Ok(report)
    })
}
