//! The async relay client: one task per relay running connection epochs, one task per
//! subscribed producer generation, all feeding one [`ConsumerState`].
//!
//! Concurrency: the state sits behind one `RwLock`; `score` takes the read lock. The
//! relay and subscription tasks take it only to apply one validated message (never
//! across an `.await`). A pool frame is checked (checksum, bounds) and copied out before
//! any lock is taken. Deltas, heartbeats and a new replica's snapshot chunks are applied
//! under the upgradable read lock, which queries share: scoring never waits for them, and
//! each probe still sees a delta whole (`kvrelay_ckf::QueryTable` guards its rows; a
//! replica being assembled is read by no query). The upgradable lock keeps those applies
//! one at a time and away from a table's growth (prepared under it too). Catalogs, load
//! windows, lane changes and a snapshot over a replica that answered queries take the
//! write lock, each whole.
//!
//! Task tree: `Consumer` owns a `TaskTracker` and a `CancellationToken`; each relay task
//! owns a child token and a tracker for its subscriptions, cancelled and awaited when its
//! epoch ends. Nothing outlives [`Consumer::shutdown`]. With a relay pair, one more task
//! per DC probes the addresses it does not follow (`standby.rs`).

mod epoch;
mod standby;
mod subscription;

use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::catalog::QuarantinedEntry;
use crate::config::{ConfigError, ConsumerConfig, RelayEndpoint};
use crate::metrics::{ConsumerMetrics, Counter, MetricsRecorder};
use crate::scoring::{Ranking, ScoreError, ScoreRequest};
use crate::state::{ConsumerState, PoolStatus, RelayStatus, StandbyStatus};
use crate::wire::Endpoint;
use epoch::run_relay;
use standby::{StandbyRecord, run_standby_probe};

/// How long [`Consumer::shutdown`] waits for its tasks.
const SHUTDOWN_DEADLINE: Duration = Duration::from_secs(5);

/// A running consumer: relay connections, replicas and scoring.
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use kvrelay_consumer::{Consumer, ConsumerConfig, ScoreRequest};
/// let config = ConsumerConfig::new(vec!["127.0.0.1:7400=dc-a:5".parse()?]);
/// let consumer = Consumer::start(config)?;
/// let ranking = consumer.score(&ScoreRequest {
///     tokens: (0..256).collect(),
///     model: "llama".into(),
///     ..ScoreRequest::default()
/// });
/// consumer.shutdown().await;
/// # let _ = ranking; Ok(()) }
/// ```
#[derive(Debug)]
pub struct Consumer {
    shared: Arc<Shared>,
    cancel: CancellationToken,
    tracker: TaskTracker,
}

#[derive(Debug)]
struct Shared {
    config: ConsumerConfig,
    /// The followed relays (`ConsumerConfig::followed_relays`: one per DC, or one per
    /// address with hot standbys), each with its DC's index; every `relay` index below
    /// is into this.
    relays: Vec<(usize, RelayEndpoint)>,
    /// How to reach each followed relay (per relay its addresses, the primary first; one
    /// with hot standbys), TLS material loaded.
    endpoints: Vec<Vec<Endpoint>>,
    /// Per relay: which of its addresses is followed now (its `RelayLink` decides).
    active: Vec<std::sync::atomic::AtomicUsize>,
    state: RwLock<ConsumerState>,
    /// Shared with the Dynamo-contract streams, which count what they leave out.
    metrics: Arc<MetricsRecorder>,
    /// Why each relay's last epoch ended (`None` until one ends), same order as
    /// `relays`; kept after a reconnect, so a flapping relay still explains itself.
    last_errors: Mutex<Vec<Option<String>>>,
    /// Per DC, per address: the last check of it as a standby (`standby.rs`).
    standbys: Mutex<Vec<Vec<Option<StandbyRecord>>>>,
    /// Bumped after every state change, so waiters re-check their condition.
    changed: watch::Sender<u64>,
    /// Per relay: open pool streams allowed ([`crate::Limits::max_pool_streams_per_relay`]);
    /// each pool stream is a connection, so a relay advertising thousands of pools cannot
    /// take every descriptor of the process.
    pool_streams: Vec<Arc<tokio::sync::Semaphore>>,
    /// Per relay: whether waiting for a pool stream slot was logged this process.
    pool_streams_warned: Vec<std::sync::atomic::AtomicBool>,
    /// Whether a replica refused for the query-table budget was logged at warn.
    table_budget_warned: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// The endpoint `relay`'s DC is followed through now.
    fn endpoint(&self, relay: usize) -> &Endpoint {
        let addresses = &self.endpoints[relay];
        let active = self.active[relay].load(std::sync::atomic::Ordering::Relaxed);
        &addresses[active.min(addresses.len() - 1)]
    }

    fn bump(&self) {
        self.changed
            .send_modify(|version| *version = version.wrapping_add(1));
    }

    /// The DC name of followed relay `relay`.
    fn dc(&self, relay: usize) -> &str {
        &self.relays[relay].1.dc
    }

    /// Runs `change` on the state, then logs and counts each DC whose scored relay it
    /// moved (hot standbys: a failover that costs no connection and no snapshot).
    fn update<R>(&self, change: impl FnOnce(&mut ConsumerState) -> R) -> R {
        let mut state = self.state.write();
        let result = change(&mut state);
        while let Some(switch) = state.poll_switch() {
            self.metrics.incr(Counter::RelayFailovers);
            info!(
                dc = %self.config.relays[switch.dc].dc,
                from = %self.relays[switch.from].1.addr,
                to = %self.relays[switch.to].1.addr,
                "scoring the DC through its hot standby"
            );
        }
        result
    }
}

impl Consumer {
    /// Validates `config` (loading every relay's TLS material) and starts one task per
    /// relay on the current tokio runtime.
    pub fn start(config: ConsumerConfig) -> Result<Self, ConfigError> {
        let state = ConsumerState::new(&config)?;
        let relays = config.followed_relays();
        let endpoints = relays
            .iter()
            .map(|(_, relay)| {
                relay
                    .addresses()
                    .map(|addr| {
                        Ok(Endpoint {
                            addr: addr.to_owned(),
                            tls: relay.connector_for(addr)?,
                            token: relay.token.clone(),
                            protocol: relay.protocol,
                            channel: Default::default(),
                        })
                    })
                    .collect::<Result<Vec<_>, ConfigError>>()
            })
            .collect::<Result<Vec<_>, ConfigError>>()?;
        let active = endpoints
            .iter()
            .map(|_| std::sync::atomic::AtomicUsize::new(0))
            .collect();
        let (changed, _) = watch::channel(0);
        let n_relays = relays.len();
        let pool_streams = (0..n_relays)
            .map(|_| {
                Arc::new(tokio::sync::Semaphore::new(
                    config
                        .limits
                        .max_pool_streams_per_relay
                        .min(tokio::sync::Semaphore::MAX_PERMITS),
                ))
            })
            .collect();
        let pool_streams_warned = (0..n_relays)
            .map(|_| std::sync::atomic::AtomicBool::new(false))
            .collect();
        let shared = Arc::new(Shared {
            pool_streams,
            pool_streams_warned,
            table_budget_warned: std::sync::atomic::AtomicBool::new(false),
            config,
            relays,
            last_errors: Mutex::new(vec![None; endpoints.len()]),
            standbys: Mutex::new(
                endpoints
                    .iter()
                    .map(|addresses| vec![None; addresses.len()])
                    .collect(),
            ),
            endpoints,
            active,
            state: RwLock::new(state),
            metrics: Arc::new(MetricsRecorder::default()),
            changed,
        });
        let cancel = CancellationToken::new();
        let tracker = TaskTracker::new();
        for relay in 0..shared.relays.len() {
            let shared = Arc::clone(&shared);
            let cancel = cancel.child_token();
            tracker.spawn(run_relay(Arc::clone(&shared), relay, cancel.clone()));
            tracker.spawn(run_standby_probe(shared, relay, cancel));
        }
        Ok(Self {
            shared,
            cancel,
            tracker,
        })
    }

    /// Ranks the deployments that can serve `request`, now.
    pub fn score(&self, request: &ScoreRequest) -> Result<Ranking, ScoreError> {
        let started = Instant::now();
        let result = self.shared.state.read().score(request, started);
        self.shared.metrics.observe_score(started.elapsed());
        result
    }

    /// Ranks the deployments that can serve `request` into `out`, reusing its buffers
    /// (see [`ConsumerState::score_into`]). On `Err`, `out` is unchanged.
    pub fn score_into(&self, request: &ScoreRequest, out: &mut Ranking) -> Result<(), ScoreError> {
        self.score_top_into(request, usize::MAX, out)
    }

    /// Like [`Consumer::score_into`], keeping only the best `limit` candidates.
    pub fn score_top_into(
        &self,
        request: &ScoreRequest,
        limit: usize,
        out: &mut Ranking,
    ) -> Result<(), ScoreError> {
        let started = Instant::now();
        let result = self
            .shared
            .state
            .read()
            .score_top_into(request, started, limit, out);
        self.shared.metrics.observe_score(started.elapsed());
        result
    }

    /// A snapshot of every metric.
    pub fn metrics(&self) -> ConsumerMetrics {
        let mut out = ConsumerMetrics::default();
        self.shared.metrics.fill(&mut out);
        out.standbys_unreachable = self
            .relays()
            .iter()
            .flat_map(|relay| &relay.standbys)
            .filter(|standby| standby.reachable == Some(false))
            .count() as u64;
        self.shared
            .state
            .read()
            .fill_gauges(&mut out, Instant::now());
        out
    }

    /// Every admitted pool with its replica state.
    pub fn pools(&self) -> Vec<PoolStatus> {
        self.shared.state.read().pools(Instant::now())
    }

    /// Per DC (in configuration order): its name and why the last connection epoch of
    /// the relay it is scored through ended, e.g. a TLS handshake or token refusal;
    /// `None` if none has ended yet.
    pub fn relay_errors(&self) -> Vec<(String, Option<String>)> {
        self.relays()
            .into_iter()
            .map(|relay| (relay.dc, relay.last_error))
            .collect()
    }

    /// Every configured DC's catalog state and last connection error, in configuration
    /// order: the status of the relay it is scored through (its `addr` the address
    /// followed now), with its other relays in
    /// [`RelayStatus::standbys`] (probed ones as last probed; hot standbys as followed
    /// now).
    pub fn relays(&self) -> Vec<RelayStatus> {
        let now = Instant::now();
        let (mut followed, scored) = {
            let state = self.shared.state.read();
            let scored: Vec<usize> = (0..self.shared.config.relays.len())
                .map(|dc| state.scored_relay(dc).unwrap_or(dc))
                .collect();
            (state.relay_statuses(), scored)
        };
        let errors = self.shared.last_errors.lock().clone();
        for (idx, (relay, error)) in followed.iter_mut().zip(errors).enumerate() {
            relay.last_error = error;
            // The address followed now (a pair on demand may have moved to its standby).
            relay.addr.clone_from(&self.shared.endpoint(idx).addr);
            relay.standbys = self.shared.standby_statuses(idx, now);
        }
        scored
            .iter()
            .enumerate()
            .map(|(dc, &scored)| {
                let mut status = followed[scored].clone();
                let hot = followed
                    .iter()
                    .enumerate()
                    .filter(|(relay, _)| *relay != scored && self.shared.relays[*relay].0 == dc);
                for (_, other) in hot {
                    let reachable = other.in_view();
                    status.standbys.push(StandbyStatus {
                        addr: other.addr.clone(),
                        reachable: Some(reachable),
                        checked_ago: None,
                        incarnation: other.incarnation.filter(|_| reachable),
                        error: other.last_error.clone().filter(|_| !reachable),
                        followed: true,
                    });
                }
                status
            })
            .collect()
    }

    /// Every quarantined catalog entry.
    pub fn quarantined(&self) -> Vec<QuarantinedEntry> {
        self.shared.state.read().quarantined()
    }

    /// Waits until `condition` holds on the state (checked after every change, under the
    /// read lock: `condition` must not call back into this consumer), or `timeout`
    /// passes; returns whether it held.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        condition: impl Fn(&ConsumerState, Instant) -> bool,
    ) -> bool {
        let mut changes = self.shared.changed.subscribe();
        let wait = async {
            loop {
                if condition(&self.shared.state.read(), Instant::now()) {
                    return true;
                }
                if changes.changed().await.is_err() {
                    return false;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.unwrap_or(false)
    }

    /// Waits until `condition` holds on the metrics (checked after every change), or
    /// `timeout` passes; returns whether it held. The state lock is not held while
    /// `condition` runs.
    pub async fn wait_for_metrics(
        &self,
        timeout: Duration,
        condition: impl Fn(&ConsumerMetrics) -> bool,
    ) -> bool {
        let mut changes = self.shared.changed.subscribe();
        let wait = async {
            loop {
                if condition(&self.metrics()) {
                    return true;
                }
                if changes.changed().await.is_err() {
                    return false;
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.unwrap_or(false)
    }

    /// Cancels every task and waits (bounded) for them to finish.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        self.tracker.close();
        if tokio::time::timeout(SHUTDOWN_DEADLINE, self.tracker.wait())
            .await
            .is_err()
        {
            warn!("consumer tasks did not stop within the shutdown deadline");
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
