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

mod standby;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrelay_codec::PROTOCOL_MAJOR;
use kvrelay_codec::v1::{ErrorReason, Message, RelayIdentity, StreamRpc};
use parking_lot::{Mutex, RwLock, RwLockUpgradableReadGuard};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::catalog::{PoolKey, QuarantinedEntry};
use crate::config::{ConfigError, ConsumerConfig, RelayEndpoint, StandbyMode};
use crate::metrics::{ConsumerMetrics, Counter, MetricsRecorder, ResubscribeReason};
use crate::scoring::{Ranking, ScoreError, ScoreRequest};
use crate::state::{ConsumerState, FrameOutcome, PoolStatus, RelayStatus, StandbyStatus};
use crate::wire::{Endpoint, WireError, WireStream};
use standby::{StandbyRecord, run_standby_probe};

use crate::link::epoch::{EpochFault, EpochSession, SilenceStep};
use crate::link::pool::{PoolFollow, PoolStream, ReplicaAfterStream, StreamEnd, begin_refused};
use crate::link::{EpochEnd, Reach, RelayLink, ViewAfterEpoch};

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

/// Why a relay epoch ended.
#[derive(Debug, thiserror::Error)]
enum EpochError {
    #[error(transparent)]
    Wire(#[from] WireError),
    #[error("relay {addr} speaks protocol major {major}, we speak {PROTOCOL_MAJOR}")]
    ContractMismatch { addr: String, major: u16 },
    /// What the relay sent (or did not send) ended the epoch ([`EpochSession`] decides).
    #[error("relay {addr} {fault}")]
    Session { addr: String, fault: EpochFault },
    #[error("relay {addr} refused the connection ({reason}): {message}")]
    Refused {
        addr: String,
        reason: ErrorReason,
        message: String,
    },
    #[error("relay {addr} sent error {reason}: {message}")]
    Relay {
        addr: String,
        reason: ErrorReason,
        message: String,
    },
    #[error("relay {addr} sent an unexpected {kind} message on the {stream} stream")]
    Unexpected {
        addr: String,
        kind: &'static str,
        stream: &'static str,
    },
    #[error("relay {addr} closed the {stream} stream")]
    Closed { addr: String, stream: &'static str },
}

async fn run_relay(shared: Arc<Shared>, relay: usize, cancel: CancellationToken) {
    let mut link = RelayLink::new(
        shared.config.backoff,
        shared.config.limits.resume_hold,
        shared.config.limits.failover_hold,
        shared.endpoints[relay].len(),
    )
    .with_rejoin(
        shared.config.limits.rejoin_interval,
        shared.config.limits.rejoin_window,
    );
    let dc = shared.dc(relay).to_owned();
    loop {
        if link.handle_epoch_start(Instant::now()) == Some(ViewAfterEpoch::StartOver) {
            // Held too long to be worth resuming: start this relay over.
            shared.update(|state| state.reset_relay(relay));
        }
        let addr = shared.endpoint(relay).addr.clone();
        let started = Instant::now();
        let mut connected = false;
        let result = relay_epoch(&shared, relay, &cancel, &mut connected, &mut link).await;
        let end = match &result {
            Err(err) if err.invalidates_view() => EpochEnd::Invalidated,
            _ => EpochEnd::Broken,
        };
        let reach = match &result {
            _ if connected => Reach::Answered,
            Err(err) if err.unreachable() => Reach::Unreachable,
            _ => Reach::Declined,
        };
        let (view, delay) = link.handle_epoch_end(
            Instant::now(),
            end,
            started.elapsed(),
            reach,
            rand::random::<f64>(),
        );
        let why = match &result {
            Ok(()) => "relay epoch ended".to_owned(),
            Err(err) => err.to_string(),
        };
        let previous =
            shared.active[relay].swap(link.active(), std::sync::atomic::Ordering::Relaxed);
        if previous != link.active() && !cancel.is_cancelled() {
            // Left for a failure: no working standby until a probe hears from it.
            shared.record_standby(relay, previous, Instant::now(), Err(why.clone()));
            shared.metrics.incr(Counter::RelayFailovers);
            info!(dc = %dc, from = %addr, to = %shared.endpoint(relay).addr, delay_ms = delay.as_millis() as u64, "following the DC's other relay");
        }
        let dropped = match view {
            ViewAfterEpoch::StartOver => shared.update(|state| state.reset_relay(relay)),
            ViewAfterEpoch::Suspend => {
                shared.update(|state| state.suspend_relay(relay));
                Vec::new()
            }
        };
        shared.bump();
        if cancel.is_cancelled() {
            return;
        }
        shared.metrics.incr(Counter::RelayEpochFailures);
        match &result {
            Err(EpochError::Wire(WireError::Tls { .. })) => {
                shared.metrics.incr(Counter::RelayTlsFailures);
            }
            Err(EpochError::Refused { .. }) => shared.metrics.incr(Counter::RelayRefusals),
            Err(EpochError::Session {
                fault: EpochFault::Silent { .. },
                ..
            }) => shared.metrics.incr(Counter::RelaySilences),
            Err(EpochError::Session {
                fault: EpochFault::Stalled { .. },
                ..
            }) => shared.metrics.incr(Counter::RelayStalls),
            _ => {}
        }
        shared.last_errors.lock()[relay] = Some(why);
        if let Err(EpochError::Session {
            fault: EpochFault::RelayRestart { .. },
            ..
        }) = &result
        {
            for _ in &dropped {
                shared.metrics.resubscribe(ResubscribeReason::RelayRestart);
            }
        }
        match &result {
            Ok(()) => warn!(dc = %dc, peer = %addr, "relay epoch ended"),
            Err(err) => warn!(dc = %dc, peer = %addr, error = %err, "relay epoch failed"),
        }
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

impl EpochError {
    /// Whether the attempt reached no relay: refused, timed out or broken at the transport
    /// before any answer, on either protocol (retrying costs the relay nothing; a TLS
    /// failure or a refusal would cost it a handshake each time).
    fn unreachable(&self) -> bool {
        matches!(
            self,
            Self::Wire(
                WireError::ConnectTimeout { .. }
                    | WireError::Io { .. }
                    | WireError::Contract {
                        source: kvrelay_dynamo::ClientError::Transport(_),
                        ..
                    }
            )
        )
    }

    /// A relay that restarted, whose catalog broke the rules or that speaks another major
    /// version starts over; one whose connection merely broke keeps its catalog and
    /// suspended replicas for resuming.
    fn invalidates_view(&self) -> bool {
        matches!(
            self,
            Self::Session {
                fault: EpochFault::RelayRestart { .. } | EpochFault::Catalog(_),
                ..
            } | Self::ContractMismatch { .. }
        )
    }
}

async fn open(
    shared: &Shared,
    relay: usize,
    suffix: &str,
    rpc: StreamRpc,
) -> Result<WireStream, WireError> {
    open_at(shared, shared.endpoint(relay), suffix, rpc).await
}

/// Opens a stream to one given address of a DC (the followed one: [`open`]).
async fn open_at(
    shared: &Shared,
    endpoint: &Endpoint,
    suffix: &str,
    rpc: StreamRpc,
) -> Result<WireStream, WireError> {
    let config = &shared.config;
    WireStream::open(
        endpoint,
        &format!("{}/{suffix}", config.subscriber_id),
        rpc,
        config.limits.max_frame_len,
        config.limits.connect_timeout,
        &shared.metrics,
    )
    .await
}

/// One connection epoch: relay info, catalog and load streams, subscriptions. Returns
/// `Ok` only when cancelled.
/// One connection epoch to the relay `relay`'s DC is followed through; `connected` is set
/// once the relay answered.
async fn relay_epoch(
    shared: &Arc<Shared>,
    relay: usize,
    cancel: &CancellationToken,
    connected: &mut bool,
    link: &mut RelayLink,
) -> Result<(), EpochError> {
    let addr = shared.endpoint(relay).addr.clone();
    let identity = relay_info(shared, relay).await?;
    *connected = true;
    let mut session = EpochSession::new(
        relay,
        identity,
        &shared.config.limits,
        shared.config.backoff,
        Instant::now(),
    );
    // Restarted while we were away: what we kept is of another incarnation.
    let dropped = shared.update(|state| session.begin(state));
    for _ in 0..dropped {
        shared.metrics.resubscribe(ResubscribeReason::RelayRestart);
    }
    shared.metrics.incr(Counter::RelayConnects);
    info!(dc = %shared.dc(relay), peer = %addr, incarnation = identity.relay_incarnation, "relay connected");
    let fault = |fault: EpochFault| EpochError::Session {
        addr: addr.clone(),
        fault,
    };

    let mut catalog = open(shared, relay, "catalog", StreamRpc::WatchCatalog).await?;
    // The load stream is independent: losing it clears this relay's load samples and
    // reopens it after backoff, without touching catalogs or replicas.
    let mut load = Some(open(shared, relay, "load", StreamRpc::WatchLoad).await?);
    // The topology stream likewise: losing it (or never getting it) only makes
    // readiness unknown; it opens on the first loop turn and reopens with backoff.
    let mut topology: Option<WireStream> = None;
    let epoch_cancel = cancel.child_token();
    let subscriptions = TaskTracker::new();
    let mut tokens: HashMap<PoolKey, CancellationToken> = HashMap::new();

    let result = loop {
        let catalog_deadline = tokio::time::Instant::from_std(session.catalog_deadline());
        tokio::select! {
            biased;
            () = cancel.cancelled() => break Ok(()),
            () = tokio::time::sleep_until(catalog_deadline) => {
                if let Some(stale) = session.handle_catalog_timeout(Instant::now()) {
                    break Err(fault(stale));
                }
            }
            // `WireStream::next` is cancel safe (its buffer lives in the stream).
            message = catalog.next() => {
                let message = match message {
                    Err(err) => break Err(err.into()),
                    Ok(None) => break Err(EpochError::Closed { addr: addr.clone(), stream: "catalog" }),
                    Ok(Some(message)) => message,
                };
                let step = shared.update(|state| session.handle_catalog(Instant::now(), &message, state, link));
                let step = match step {
                    Ok(step) => step,
                    Err(err) => break Err(fault(err)),
                };
                shared.metrics.incr(Counter::CatalogsApplied);
                if step.newly_quarantined > 0 {
                    shared.metrics.add(Counter::QuarantinedTotal, step.newly_quarantined as u64);
                    shared.metrics.add(Counter::OverBudgetTotal, step.newly_over_budget as u64);
                    for entry in shared.state.read().quarantined() {
                        warn!(dc = %entry.dc, pool = %entry.entry, reason = %entry.reason, "catalog entry quarantined");
                    }
                }
                for key in &step.unsubscribe {
                    if let Some(token) = tokens.remove(key) {
                        token.cancel();
                    }
                }
                for key in step.subscribe {
                    let token = epoch_cancel.child_token();
                    tokens.insert(key, token.clone());
                    subscriptions.spawn(run_subscription(Arc::clone(shared), relay, key, identity, token));
                }
                shared.bump();
            }
            message = next_or_pending(&mut load) => {
                let now = Instant::now();
                let jitter = rand::random::<f64>();
                // A message the session refuses loses the stream there; a closed or
                // failed stream is reported lost here.
                let lost = match message {
                    Ok(Some(message)) => shared
                        .update(|state| session.handle_load(now, &message, state, jitter))
                        .err()
                        .map(|loss| loss.to_string()),
                    Ok(None) => {
                        shared.update(|state| session.handle_load_lost(now, state, jitter));
                        Some("load stream closed".to_owned())
                    }
                    Err(err) => {
                        shared.update(|state| session.handle_load_lost(now, state, jitter));
                        Some(err.to_string())
                    }
                };
                match lost {
                    None => shared.metrics.incr(Counter::LoadWindows),
                    Some(failure) => {
                        warn!(dc = %shared.dc(relay), peer = %addr, error = %failure, "load stream lost; loads unknown until it reopens");
                        load = None;
                    }
                }
                shared.bump();
            }
            message = next_or_pending(&mut topology) => {
                let now = Instant::now();
                let jitter = rand::random::<f64>();
                let lost = match message {
                    Ok(Some(message)) => {
                        match shared.update(|state| session.handle_topology(now, &message, state, jitter)) {
                            Ok(n_invalid) => {
                                if n_invalid > 0 {
                                    warn!(dc = %shared.dc(relay), peer = %addr, n_invalid, "topology entries failed validation; their readiness is unknown");
                                }
                                shared.metrics.incr(Counter::TopologiesApplied);
                                None
                            }
                            Err(loss) => Some(loss.to_string()),
                        }
                    }
                    Ok(None) => {
                        shared.update(|state| session.handle_topology_lost(now, state, jitter));
                        Some("topology stream closed".to_owned())
                    }
                    Err(err) => {
                        shared.update(|state| session.handle_topology_lost(now, state, jitter));
                        Some(err.to_string())
                    }
                };
                if let Some(failure) = lost {
                    warn!(dc = %shared.dc(relay), peer = %addr, error = %failure, "topology stream lost; readiness unknown until it reopens");
                    topology = None;
                }
                shared.bump();
            }
            () = sleep_until_std(session.poll_silence()) => {
                let step = shared.update(|state| session.handle_silence_timeout(Instant::now(), state, link));
                match step {
                    Err(silent) => break Err(fault(silent)),
                    Ok(SilenceStep::Marked) => {
                        let dc = &shared.config.relays[shared.relays[relay].0];
                        if shared.config.standby == StandbyMode::Hot && !dc.standby.is_empty() {
                            // A hot pair's relay: counted like a pair's relay left for
                            // silence (its DC is scored through another meanwhile).
                            shared.metrics.incr(Counter::RelaySilences);
                        }
                        shared.bump();
                    }
                    Ok(SilenceStep::Nothing) => {}
                }
            }
            () = sleep_until_std(session.poll_topology_open()), if topology.is_none() => {
                match open(shared, relay, "topology", StreamRpc::WatchTopology).await {
                    Ok(stream) => {
                        topology = Some(stream);
                        session.handle_topology_opened(Instant::now());
                    }
                    Err(err) => {
                        debug!(peer = %addr, error = %err, "topology stream open failed");
                        session.handle_topology_open_failed(Instant::now(), rand::random::<f64>());
                    }
                }
            }
            () = sleep_until_std(session.poll_load_reopen()), if load.is_none() => {
                match open(shared, relay, "load", StreamRpc::WatchLoad).await {
                    Ok(stream) => {
                        load = Some(stream);
                        session.handle_load_opened(Instant::now());
                    }
                    Err(err) => {
                        debug!(peer = %addr, error = %err, "load stream reopen failed");
                        session.handle_load_open_failed(Instant::now(), rand::random::<f64>());
                    }
                }
            }
        }
    };
    epoch_cancel.cancel();
    subscriptions.close();
    subscriptions.wait().await;
    result
}

/// Sleeps until `deadline` (a std instant of the same clock), or forever without one.
async fn sleep_until_std(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(tokio::time::Instant::from_std(deadline)).await,
        None => std::future::pending().await,
    }
}

/// The next message of `stream`, or pending forever when there is no stream.
async fn next_or_pending(stream: &mut Option<WireStream>) -> Result<Option<Message>, WireError> {
    match stream {
        Some(stream) => stream.next().await,
        None => std::future::pending().await,
    }
}

async fn relay_info(shared: &Shared, relay: usize) -> Result<RelayIdentity, EpochError> {
    relay_info_at(shared, shared.endpoint(relay)).await
}

/// The relay info of one given address (a followed relay's, or a standby's when probed).
async fn relay_info_at(shared: &Shared, endpoint: &Endpoint) -> Result<RelayIdentity, EpochError> {
    let addr = &endpoint.addr;
    let mut stream = open_at(shared, endpoint, "info", StreamRpc::RelayInfo).await?;
    let message = tokio::time::timeout(shared.config.limits.connect_timeout, stream.next())
        .await
        .map_err(|_| {
            EpochError::Wire(WireError::ConnectTimeout {
                addr: addr.clone(),
                timeout: shared.config.limits.connect_timeout,
            })
        })??;
    match message {
        Some(Message::RelayInfo(info)) if info.protocol_major == PROTOCOL_MAJOR => Ok(info.relay),
        Some(Message::RelayInfo(info)) => Err(EpochError::ContractMismatch {
            addr: addr.clone(),
            major: info.protocol_major,
        }),
        // The first answer of an epoch: an error here is the relay refusing us (a missing
        // or wrong token, typically), counted apart from errors on established streams.
        Some(Message::Error(err)) => Err(EpochError::Refused {
            addr: addr.clone(),
            reason: err.effective_reason(),
            message: err.message,
        }),
        Some(other) => Err(unexpected(addr, &other, "relay info")),
        None => Err(EpochError::Closed {
            addr: addr.clone(),
            stream: "relay info",
        }),
    }
}

fn unexpected(addr: &str, message: &Message, stream: &'static str) -> EpochError {
    match message {
        Message::Error(err) => EpochError::Relay {
            addr: addr.to_owned(),
            reason: err.effective_reason(),
            message: err.message.clone(),
        },
        other => EpochError::Unexpected {
            addr: addr.to_owned(),
            kind: other.kind().name(),
            stream,
        },
    }
}

async fn run_subscription(
    shared: Arc<Shared>,
    relay: usize,
    key: PoolKey,
    identity: RelayIdentity,
    cancel: CancellationToken,
) {
    let mut follow = PoolFollow::new(shared.config.backoff, Instant::now());
    loop {
        follow.handle_attempt(Instant::now());
        let reason = subscription_frames(&shared, relay, key, identity, &cancel).await;
        let after = follow.handle_ended(
            Instant::now(),
            reason,
            cancel.is_cancelled(),
            rand::random::<f64>(),
        );
        {
            let mut state = shared.state.write();
            match after.replica {
                ReplicaAfterStream::Suspend => state.suspend(key),
                ReplicaAfterStream::Invalidate => state.invalidate(key),
            }
        }
        shared.bump();
        let Some(retry_at) = after.retry_at else {
            return;
        };
        if let Some(reason) = reason {
            shared.metrics.resubscribe(reason);
        }
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            () = tokio::time::sleep_until(retry_at.into()) => {}
        }
    }
}

/// One subscription attempt: a `None` reason means stop for good (cancelled, or the
/// generation left the catalog), `Some(reason)` means resubscribe after backoff.
async fn subscription_frames(
    shared: &Shared,
    relay: usize,
    key: PoolKey,
    identity: RelayIdentity,
    cancel: &CancellationToken,
) -> Option<ResubscribeReason> {
    let dc = &shared.dc(relay);
    let begun = {
        // A new lane may grow its format's table (allocate and copy every row): that
        // runs under the upgradable lock, which queries share, so scoring goes on while
        // frame writers wait; the write lock is then held only to swap the rows in.
        let state = shared.state.upgradable_read();
        match state.prepare_subscription(key) {
            Ok(mut prepared) => {
                let begun = RwLockUpgradableReadGuard::upgrade(state)
                    .begin_subscription_prepared(key, prepared.as_mut());
                // The old rows are freed here, after the write lock (a large table takes
                // milliseconds to unmap).
                drop(prepared);
                begun
            }
            Err(err) => Err(err),
        }
    };
    let (producer, resume_from_sequence) = match begun {
        Ok(begun) => begun,
        Err(err) => {
            let reason = begin_refused(&err);
            match reason {
                Some(ResubscribeReason::OverBudget) => {
                    // Pools may leave and free lanes; warn once, then only the
                    // `over_budget` resubscribe count says it goes on.
                    let first = !shared
                        .table_budget_warned
                        .swap(true, std::sync::atomic::Ordering::Relaxed);
                    if first {
                        warn!(dc = %dc, pool = key.as_u64(), error = %err, "replica not built: over max_query_table_bytes; retried after backoff (logged once, counted as resubscribes{{reason=over_budget}})");
                    } else {
                        debug!(dc = %dc, pool = key.as_u64(), error = %err, "replica not built: over max_query_table_bytes");
                    }
                }
                Some(_) => {
                    warn!(dc = %dc, pool = key.as_u64(), error = %err, "replica allocation failed; dropped, resubscribing");
                }
                None => {}
            }
            if reason.is_some() {
                shared.bump();
            }
            return reason;
        }
    };
    shared.bump();
    let rpc = StreamRpc::SubscribePool {
        expected_producer: producer,
        resume_from_sequence,
    };
    // One slot of the relay's pool streams, held while the stream is open.
    let slots = Arc::clone(&shared.pool_streams[relay]);
    let _slot = match slots.clone().try_acquire_owned() {
        Ok(slot) => slot,
        Err(_) => {
            if !shared.pool_streams_warned[relay].swap(true, std::sync::atomic::Ordering::Relaxed) {
                warn!(dc = %dc, limit = shared.config.limits.max_pool_streams_per_relay, "relay advertises more pools than max_pool_streams_per_relay; the rest wait for a free stream (logged once)");
            }
            tokio::select! {
                biased;
                () = cancel.cancelled() => return None,
                slot = slots.acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => return None,
                },
            }
        }
    };
    let stream = tokio::select! {
        biased;
        () = cancel.cancelled() => return None,
        stream = open(shared, relay, "pool", rpc) => stream,
    };
    let mut stream = match stream {
        Ok(stream) => stream,
        Err(err) => {
            debug!(dc = %dc, pool = key.as_u64(), error = %err, "pool subscription failed to open");
            return Some(ResubscribeReason::Disconnected);
        }
    };
    let limits = &shared.config.limits;
    let mut session = PoolStream::new(
        identity,
        producer,
        limits.staleness_bound,
        limits.snapshot_assembly_timeout,
        Instant::now(),
    );
    let end = loop {
        let stale_at = tokio::time::Instant::from_std(session.poll_timeout());
        let message = tokio::select! {
            biased;
            () = cancel.cancelled() => return None,
            () = tokio::time::sleep_until(stale_at) => match session.handle_timeout(Instant::now()) {
                Some(end) => break end,
                None => continue,
            },
            message = stream.next() => message,
        };
        let message = match message {
            Ok(Some(message)) => message,
            Ok(None) => break StreamEnd::Disconnected,
            Err(err) => {
                warn!(dc = %dc, pool = key.as_u64(), error = %err, "pool stream failed");
                break StreamEnd::Disconnected;
            }
        };
        // Checksum and copy happen here, outside the lock. The frame is then applied
        // under the upgradable read, which `score` shares (it never waits for an apply)
        // and which keeps applies and a table's growth one at a time; only a snapshot
        // chunk over a replica that answered queries takes the write lock.
        let checked = match session.handle_message(Instant::now(), &message) {
            Ok(checked) => checked,
            Err(end) => break end,
        };
        let now = Instant::now();
        let beside = shared
            .state
            .upgradable_read()
            .apply_beside_queries(key, &checked, now);
        let outcome = match beside {
            Some(outcome) => outcome,
            None => shared.state.write().apply_checked_frame(key, &checked, now),
        };
        match session.handle_applied(Instant::now(), outcome) {
            Ok(outcome) => {
                let counter = match outcome {
                    FrameOutcome::ChunkStored => None,
                    FrameOutcome::SnapshotInstalled(_) => Some(Counter::SnapshotsInstalled),
                    FrameOutcome::DeltaApplied(_) => Some(Counter::DeltasApplied),
                    FrameOutcome::Heartbeat(_) => Some(Counter::Heartbeats),
                };
                if let Some(counter) = counter {
                    shared.metrics.incr(counter);
                }
                shared.bump();
            }
            Err(end) => break end,
        }
    };
    log_stream_end(dc, key, &end);
    Some(end.reason())
}

/// One line per pool stream that ended with something to say.
fn log_stream_end(dc: &str, key: PoolKey, end: &StreamEnd) {
    let pool = key.as_u64();
    match end {
        StreamEnd::Refused { error, .. } => {
            warn!(dc = %dc, pool, reason = %error.effective_reason(), message = ?error.message, "relay ended pool stream");
        }
        StreamEnd::FrameRefused(refused) => {
            warn!(dc = %dc, pool, error = %refused, "pool frame refused; resubscribing");
        }
        StreamEnd::SnapshotOverdue { timeout } => {
            warn!(dc = %dc, pool, timeout = ?timeout, "snapshot did not complete in time; resubscribing");
        }
        StreamEnd::Unexpected { kind } => {
            warn!(dc = %dc, pool, kind, "pool stream carried a message of another kind; resubscribing");
        }
        StreamEnd::RelayRestarted | StreamEnd::Stale { .. } | StreamEnd::Disconnected => {
            debug!(dc = %dc, pool, end = ?end, "pool stream ended");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only an attempt that reached no relay (on either protocol) may be retried at the
    /// rejoin interval: a TLS failure, a refusal or a closed stream cost the relay work.
    #[test]
    fn only_attempts_that_reached_no_relay_are_unreachable() {
        let addr = || "127.0.0.1:9".to_owned();
        let io = |kind| std::io::Error::from(kind);
        let unreachable = [
            EpochError::Wire(WireError::ConnectTimeout {
                addr: addr(),
                timeout: Duration::from_secs(5),
            }),
            EpochError::Wire(WireError::Io {
                addr: addr(),
                source: io(std::io::ErrorKind::ConnectionRefused),
            }),
            EpochError::Wire(WireError::Contract {
                addr: addr(),
                source: kvrelay_dynamo::ClientError::Transport(Box::new(
                    tonic::Status::unavailable("tcp connect error"),
                )),
            }),
        ];
        for error in &unreachable {
            assert!(error.unreachable(), "{error}");
        }
        let declined = [
            EpochError::Wire(WireError::Tls {
                addr: addr(),
                source: io(std::io::ErrorKind::InvalidData),
            }),
            EpochError::Refused {
                addr: addr(),
                reason: ErrorReason::ResourceLimit,
                message: "max_connections".to_owned(),
            },
            EpochError::Closed {
                addr: addr(),
                stream: "relay info",
            },
            EpochError::Wire(WireError::Contract {
                addr: addr(),
                source: kvrelay_dynamo::ClientError::Token,
            }),
        ];
        for error in &declined {
            assert!(!error.unreachable(), "{error}");
        }
    }
}
