//! Discovery for the host: the membership crate's list/watch/reconcile loop over the
//! configured backend (a card directory or etcd), forwarded as membership views. Skipped
//! card files, skipped etcd records (`malformed`, `too_large`) and skipped cards are
//! counted in `kvrelay_discovery_skipped_total{reason}`.

use std::sync::Arc;
use std::time::Duration;

use kvrelay_membership::{
    DEFAULT_ETCD_TIMEOUT, Discovery, DiscoveryScope, EtcdClientLimits, EtcdDiscovery,
    FileDiscovery, MembershipLimits, MembershipView, MembershipWatch, ProjectionStats, WatchConfig,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::{DiscoveryBackend, DiscoveryConfig};
use crate::host::DiscoveryStartError;
use crate::metrics::{ReasonLabel, RelayMetrics};

/// A started membership watch and the backend whose skip counters feed the metrics.
pub(crate) struct Discovering {
    watch: MembershipWatch,
    files: Option<FileDiscovery>,
    etcd: Option<EtcdDiscovery>,
}

impl Discovering {
    /// The etcd client of the etcd backend (shared by the event-advert scan).
    pub(crate) fn etcd_client(&self) -> Option<kvrelay_membership::EtcdClient> {
        self.etcd.as_ref().map(|etcd| etcd.client().clone())
    }
}

/// How often the card directory is rescanned.
pub(crate) const FILE_RESCAN_INTERVAL: Duration = Duration::from_millis(500);

/// Connects the configured backend and starts the membership watch (first listing done).
pub(crate) async fn start(
    config: &DiscoveryConfig,
    scope: &DiscoveryScope,
    cancel: &CancellationToken,
) -> Result<Discovering, DiscoveryStartError> {
    let mut files = None;
    let mut etcd = None;
    let backend: Arc<dyn Discovery> = match config.backend {
        DiscoveryBackend::File => {
            let dir = config.dir.clone().unwrap_or_default();
            let limits = MembershipLimits {
                max_card_file_bytes: config.max_card_file_bytes,
                max_card_files: usize::try_from(config.max_card_files).unwrap_or(usize::MAX),
                ..MembershipLimits::default()
            };
            let discovery = FileDiscovery::new(&dir, FILE_RESCAN_INTERVAL).with_limits(limits);
            files = Some(discovery.clone());
            Arc::new(discovery)
        }
        DiscoveryBackend::Etcd => {
            // A record is bounded like a card file; listings are paged under it.
            let limits = EtcdClientLimits {
                max_record_bytes: config.max_card_file_bytes,
                timeout: DEFAULT_ETCD_TIMEOUT,
                ..EtcdClientLimits::default()
            };
            let discovery = EtcdDiscovery::connect_with_limits(&config.etcd_endpoints, limits)
                .await
                .map_err(|source| DiscoveryStartError::Etcd {
                    endpoints: config.etcd_endpoints.clone(),
                    source,
                })?;
            etcd = Some(discovery.clone());
            Arc::new(discovery)
        }
    };
    let watch = MembershipWatch::start(backend, scope, WatchConfig::default(), cancel).await?;
    Ok(Discovering { watch, files, etcd })
}

/// Forwards every view of `watch` to `views` until `cancel` fires, then stops the watch.
pub(crate) async fn forward(
    discovering: Discovering,
    views: watch::Sender<Option<MembershipView>>,
    metrics: Arc<RelayMetrics>,
    cancel: CancellationToken,
) {
    let Discovering { watch, files, etcd } = discovering;
    let mut subscription = watch.subscribe();
    let first = subscription.current();
    info!(endpoints = first.len(), "discovery listed");
    views.send_replace(Some(first));
    let mut skips = SkipCounts::default();
    skips.sync(&metrics, files.as_ref(), etcd.as_ref(), watch.stats());
    let mut tick = tokio::time::interval(FILE_RESCAN_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            view = subscription.changed() => match view {
                Some(view) => {
                    views.send_replace(Some(view));
                    skips.sync(&metrics, files.as_ref(), etcd.as_ref(), watch.stats());
                }
                None => break,
            },
            _ = tick.tick() => skips.sync(&metrics, files.as_ref(), etcd.as_ref(), watch.stats()),
        }
    }
    watch.shutdown().await;
}

/// The skip totals already added to the metric, so each sync adds only what is new.
#[derive(Debug, Default)]
struct SkipCounts {
    seen: std::collections::BTreeMap<&'static str, u64>,
    reads: u64,
}

impl SkipCounts {
    fn sync(
        &mut self,
        metrics: &RelayMetrics,
        files: Option<&FileDiscovery>,
        etcd: Option<&EtcdDiscovery>,
        stats: ProjectionStats,
    ) {
        let file_skips = files
            .map(FileDiscovery::skips)
            .or_else(|| etcd.map(EtcdDiscovery::skips))
            .unwrap_or_default();
        let reads = files.map_or(0, FileDiscovery::reads);
        if reads > self.reads {
            metrics.discovery_card_reads.inc_by(reads - self.reads);
            self.reads = reads;
        }
        let card_skips = [
            ("malformed_card", stats.malformed_cards),
            ("invalid_endpoint", stats.invalid_endpoints),
            ("invalid_model", stats.invalid_models),
            ("invalid_alias", stats.invalid_aliases),
        ];
        for (reason, total) in file_skips.by_reason().into_iter().chain(card_skips) {
            let seen = self.seen.entry(reason).or_insert(0);
            if total > *seen {
                metrics
                    .discovery_skipped
                    .get_or_create(&ReasonLabel { reason })
                    .inc_by(total - *seen);
                *seen = total;
            }
        }
    }
}
