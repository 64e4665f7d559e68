//! [`MembershipWatch`]: keeps a [`MembershipView`] current from a [`Discovery`] backend.
//!
//! The task lists and watches every query of the scope, applies the listing as a full
//! replacement and then each event, and publishes a new view only when the projection
//! changed. When a watch fails or closes it rebinds (list again, watch again) after a
//! backoff that starts at [`WatchConfig::backoff_initial`] and doubles up to
//! [`WatchConfig::backoff_max`]; a successful event or reconcile resets it. Every
//! [`WatchConfig::reconcile_interval`] it re-lists and reconciles, so a missed event heals.
//!
//! Run loop (one `biased` select): shutdown, then the next event of the merged watches,
//! then the reconcile tick. Soft errors from the projection are logged at `warn` once per
//! cause.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::SelectAll;
use kvrelay_pacing::{Backoff, BackoffConfig, NO_JITTER};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{DiscoveryScope, DiscoveryScopeError};
use crate::diagnostic::ProjectionStats;
use crate::discovery::{Discovery, DiscoveryError, DiscoveryWatch};
use crate::instance::{DiscoveryQuery, ModelCardInstance};
use crate::membership::MembershipView;
use crate::projection::MembershipProjection;

/// Default full re-list interval.
pub const DEFAULT_RECONCILE_INTERVAL: Duration = Duration::from_secs(30);
/// Default first rebind delay.
pub const DEFAULT_BACKOFF_INITIAL: Duration = Duration::from_millis(100);
/// Default longest rebind delay.
pub const DEFAULT_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Default bound on waiting for the watch task at shutdown.
pub const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Timing of the watch loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatchConfig {
    /// How often to re-list and reconcile.
    pub reconcile_interval: Duration,
    /// First delay before rebinding a failed watch.
    pub backoff_initial: Duration,
    /// Longest delay before rebinding.
    pub backoff_max: Duration,
    /// How long [`MembershipWatch::shutdown`] waits for the task.
    pub shutdown_timeout: Duration,
}

impl Default for WatchConfig {
    fn default() -> Self {
        Self {
            reconcile_interval: DEFAULT_RECONCILE_INTERVAL,
            backoff_initial: DEFAULT_BACKOFF_INITIAL,
            backoff_max: DEFAULT_BACKOFF_MAX,
            shutdown_timeout: DEFAULT_SHUTDOWN_TIMEOUT,
        }
    }
}

/// Why a membership watch could not start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MembershipWatchError {
    /// The discovery scope is invalid.
    #[error("invalid discovery scope: {0}")]
    Config(#[from] DiscoveryScopeError),
    /// The initial listing failed.
    #[error("initial discovery listing failed: {0}")]
    Discovery(#[from] DiscoveryError),
}

/// A running membership watch. Dropping it without [`MembershipWatch::shutdown`] cancels
/// the task.
#[derive(Debug)]
pub struct MembershipWatch {
    views: watch::Receiver<MembershipView>,
    stats: watch::Receiver<ProjectionStats>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    shutdown_timeout: Duration,
}

/// A subscriber to membership views.
#[derive(Debug, Clone)]
pub struct MembershipSubscription {
    views: watch::Receiver<MembershipView>,
}

impl MembershipSubscription {
    /// Waits for a view newer than the last one seen; `None` once the watch has stopped.
    pub async fn changed(&mut self) -> Option<MembershipView> {
        self.views.changed().await.ok()?;
        Some(self.views.borrow_and_update().clone())
    }

    /// The latest view (marks it seen).
    pub fn current(&mut self) -> MembershipView {
        self.views.borrow_and_update().clone()
    }
}

impl MembershipWatch {
    /// Validates the scope, lists and watches it, publishes the first view and starts the
    /// task under a child of `parent`.
    ///
    /// ```
    /// # tokio::runtime::Runtime::new().unwrap().block_on(async {
    /// use std::sync::Arc;
    /// use kvrelay_membership::{DiscoveryScope, MemoryDiscovery, MembershipWatch,
    ///     ModelCardInstance, ModelCardInstanceId, WatchConfig};
    /// use tokio_util::sync::CancellationToken;
    ///
    /// let discovery = Arc::new(MemoryDiscovery::new());
    /// let scope = DiscoveryScope { namespaces: vec!["prod".into()], ..Default::default() };
    /// let cancel = CancellationToken::new();
    /// let watch = MembershipWatch::start(discovery.clone(), &scope, WatchConfig::default(), &cancel)
    ///     .await
    ///     .unwrap();
    /// let mut subscription = watch.subscribe();
    /// discovery.put(ModelCardInstance {
    ///     id: ModelCardInstanceId::from_path("prod/backend/generate/1").unwrap(),
    ///     card_json: serde_json::json!({"display_name": "llama", "kv_cache_block_size": 16}),
    /// });
    /// let view = subscription.changed().await.unwrap();
    /// assert_eq!(view.len(), 1);
    /// watch.shutdown().await;
    /// # });
    /// ```
    pub async fn start(
        discovery: Arc<dyn Discovery>,
        scope: &DiscoveryScope,
        config: WatchConfig,
        parent: &CancellationToken,
    ) -> Result<Self, MembershipWatchError> {
        scope.validate()?;
        let queries = scope.queries();
        let mut projection = MembershipProjection::new(scope.filter());
        let (listing, watches) = open_watches(discovery.as_ref(), &queries).await?;
        projection.replace_all(listing);
        projection.project();
        log_diagnostics(&mut projection);
        let (view_sender, views) = watch::channel(projection.view());
        let (stats_sender, stats) = watch::channel(projection.stats());
        let cancel = parent.child_token();
        let tracker = TaskTracker::new();
        let task = WatchTask {
            discovery,
            queries,
            projection,
            config,
            view_sender,
            stats_sender,
            cancel: cancel.clone(),
        };
        tracker.spawn(task.run(watches));
        tracker.close();
        Ok(Self {
            views,
            stats,
            cancel,
            tracker,
            shutdown_timeout: config.shutdown_timeout,
        })
    }

    /// A subscriber starting at the current view.
    pub fn subscribe(&self) -> MembershipSubscription {
        MembershipSubscription {
            views: self.views.clone(),
        }
    }

    /// The latest view.
    pub fn view(&self) -> MembershipView {
        self.views.borrow().clone()
    }

    /// The projection's counters as of the last change.
    pub fn stats(&self) -> ProjectionStats {
        *self.stats.borrow()
    }

    /// Cancels the task and waits for it (bounded by the configured shutdown timeout).
    pub async fn shutdown(self) {
        self.cancel.cancel();
        if tokio::time::timeout(self.shutdown_timeout, self.tracker.wait())
            .await
            .is_err()
        {
            tracing::error!("membership watch did not stop within the shutdown timeout");
        }
    }
}

impl Drop for MembershipWatch {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

struct WatchTask {
    discovery: Arc<dyn Discovery>,
    queries: Vec<DiscoveryQuery>,
    projection: MembershipProjection,
    config: WatchConfig,
    view_sender: watch::Sender<MembershipView>,
    stats_sender: watch::Sender<ProjectionStats>,
    cancel: CancellationToken,
}

impl WatchTask {
    async fn run(mut self, initial: SelectAll<DiscoveryWatch>) {
        let mut backoff = Backoff::new(BackoffConfig {
            initial: self.config.backoff_initial,
            max: self.config.backoff_max,
            // Progress (an event, a clean reconcile) resets it, not time.
            healthy_reset: Duration::MAX,
        });
        let mut n_failures = 0u64;
        let mut watches = Some(initial);
        loop {
            let stream = match watches.take() {
                Some(stream) => stream,
                None => {
                    let opened = tokio::select! {
                        biased;
                        () = self.cancel.cancelled() => return,
                        opened = open_watches(self.discovery.as_ref(), &self.queries) => opened,
                    };
                    match opened {
                        Ok((listing, stream)) => {
                            tracing::info!(n_cards = listing.len(), "membership watch rebound");
                            if self.projection.replace_all(listing) {
                                self.publish();
                            } else {
                                self.publish_stats();
                            }
                            stream
                        }
                        Err(error) => {
                            n_failures = n_failures.saturating_add(1);
                            log_failure(n_failures, &error, "membership watch rebind failed");
                            if !self.wait_backoff(&mut backoff).await {
                                return;
                            }
                            continue;
                        }
                    }
                }
            };
            match self.follow(stream, &mut backoff, &mut n_failures).await {
                Followed::Cancelled => return,
                Followed::Ended => {
                    if !self.wait_backoff(&mut backoff).await {
                        return;
                    }
                }
            }
        }
    }

    /// Applies events and reconciles until the watch fails or the task is cancelled.
    async fn follow(
        &mut self,
        mut stream: SelectAll<DiscoveryWatch>,
        backoff: &mut Backoff,
        n_failures: &mut u64,
    ) -> Followed {
        let start = tokio::time::Instant::now() + self.config.reconcile_interval;
        let mut reconcile = tokio::time::interval_at(start, self.config.reconcile_interval);
        reconcile.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => return Followed::Cancelled,
                // `SelectAll::next` is cancel-safe: an unpolled event stays queued.
                event = stream.next() => match event {
                    Some(Ok(event)) => {
                        *n_failures = 0;
                        backoff.reset();
                        if self.projection.handle_event(event) {
                            self.publish();
                        } else {
                            // A malformed card changes no card, yet is logged and counted now.
                            self.publish_stats();
                        }
                    }
                    Some(Err(error)) => {
                        *n_failures = n_failures.saturating_add(1);
                        log_failure(*n_failures, &error, "membership watch failed; rebinding");
                        return Followed::Ended;
                    }
                    None => {
                        *n_failures = n_failures.saturating_add(1);
                        tracing::warn!(n_failures = *n_failures, "membership watch closed; rebinding");
                        return Followed::Ended;
                    }
                },
                _ = reconcile.tick() => {
                    let listed = tokio::select! {
                        biased;
                        () = self.cancel.cancelled() => return Followed::Cancelled,
                        listed = list_all(self.discovery.as_ref(), &self.queries) => listed,
                    };
                    match listed {
                        Ok(listing) => {
                            backoff.reset();
                            if self.projection.replace_all(listing) {
                                tracing::info!("membership reconcile found missed changes");
                                self.publish();
                            } else {
                                self.publish_stats();
                            }
                        }
                        Err(error) => {
                            tracing::warn!(%error, "membership reconcile failed");
                        }
                    }
                }
            }
        }
    }

    /// Sleeps the current backoff, then doubles it; false if cancelled meanwhile.
    async fn wait_backoff(&self, backoff: &mut Backoff) -> bool {
        let delay = backoff.on_failure(Duration::ZERO, NO_JITTER);
        tokio::select! {
            biased;
            () = self.cancel.cancelled() => false,
            () = tokio::time::sleep(delay) => true,
        }
    }

    /// Logs the projection's diagnostics and publishes its counters without projecting,
    /// for input that changed no card (a malformed card is still logged and counted at once).
    fn publish_stats(&mut self) {
        log_diagnostics(&mut self.projection);
        let stats = self.projection.stats();
        self.stats_sender.send_if_modified(|current| {
            let changed = *current != stats;
            *current = stats;
            changed
        });
    }

    fn publish(&mut self) {
        let changed = self.projection.project();
        self.publish_stats();
        if changed {
            tracing::debug!(
                n_endpoints = self.projection.view().len(),
                "membership view changed"
            );
            self.view_sender.send_replace(self.projection.view());
        }
    }
}

enum Followed {
    Cancelled,
    Ended,
}

/// Lists and watches every query; the listings are concatenated.
async fn open_watches(
    discovery: &dyn Discovery,
    queries: &[DiscoveryQuery],
) -> Result<(Vec<ModelCardInstance>, SelectAll<DiscoveryWatch>), DiscoveryError> {
    let mut listing = Vec::new();
    let mut watches = SelectAll::new();
    for query in queries {
        let (cards, watch) = discovery.list_and_watch(query).await?;
        listing.extend(cards);
        watches.push(watch);
    }
    Ok((listing, watches))
}

async fn list_all(
    discovery: &dyn Discovery,
    queries: &[DiscoveryQuery],
) -> Result<Vec<ModelCardInstance>, DiscoveryError> {
    let mut listing = Vec::new();
    for query in queries {
        listing.extend(discovery.list(query).await?);
    }
    Ok(listing)
}

fn log_failure(n_failures: u64, error: &DiscoveryError, message: &'static str) {
    if n_failures == 1 {
        tracing::warn!(%error, n_failures, "{message}");
    } else {
        tracing::debug!(%error, n_failures, "{message}");
    }
}

fn log_diagnostics(projection: &mut MembershipProjection) {
    while let Some(diagnostic) = projection.poll_diagnostic() {
        tracing::warn!(%diagnostic, "membership card skipped or degraded");
    }
}

#[cfg(test)]
mod tests;
