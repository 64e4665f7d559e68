//! Discovery for the host: the membership crate's list/watch/reconcile loop over the
//! configured backend (a card directory or etcd), forwarded as membership views.

use std::sync::Arc;
use std::time::Duration;

use kvrelay_membership::{
    DEFAULT_ETCD_TIMEOUT, Discovery, DiscoveryConfig as MembershipScope, EtcdDiscovery,
    FileDiscovery, MembershipView, MembershipWatch, WatchConfig,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::config::{DiscoveryBackend, DiscoveryConfig};

/// How often the card directory is rescanned.
pub(crate) const FILE_RESCAN_INTERVAL: Duration = Duration::from_millis(500);

/// Connects the configured backend and starts the membership watch (first listing done).
pub(crate) async fn start(
    config: &DiscoveryConfig,
    scope: &MembershipScope,
    cancel: &CancellationToken,
) -> Result<MembershipWatch, String> {
    let backend: Arc<dyn Discovery> = match config.backend {
        DiscoveryBackend::File => {
            let dir = config.dir.clone().unwrap_or_default();
            Arc::new(FileDiscovery::new(&dir, FILE_RESCAN_INTERVAL))
        }
        DiscoveryBackend::Etcd => Arc::new(
            EtcdDiscovery::connect(&config.etcd_endpoints, DEFAULT_ETCD_TIMEOUT)
                .await
                .map_err(|err| format!("connecting to etcd {:?}: {err}", config.etcd_endpoints))?,
        ),
    };
    MembershipWatch::start(backend, scope, WatchConfig::default(), cancel)
        .await
        .map_err(|err| err.to_string())
}

/// Forwards every view of `watch` to `views` until `cancel` fires, then stops the watch.
pub(crate) async fn forward(
    watch: MembershipWatch,
    views: watch::Sender<Option<MembershipView>>,
    cancel: CancellationToken,
) {
    let mut subscription = watch.subscribe();
    let first = subscription.current();
    info!(endpoints = first.len(), "discovery listed");
    views.send_replace(Some(first));
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => break,
            view = subscription.changed() => match view {
                Some(view) => {
                    views.send_replace(Some(view));
                }
                None => break,
            },
        }
    }
    watch.shutdown().await;
}
