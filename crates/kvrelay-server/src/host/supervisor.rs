//! The host supervisor: the async shell around [`SupervisionCore`], and the one owner of
//! pool attachments.
//!
//! The core decides (see `supervisor/core.rs`); this shell feeds it (membership views,
//! configured sources, the registry's catalog, source states from the pumps, pool health
//! read in O(1) from each actor, load and health ticks, fenced generations) and executes
//! its commands. Attaches and retirements run concurrently inside this task (one slow
//! filter allocation holds up no other endpoint); sources run under the pumps' tracker.
//! After every step the shell publishes the core's readiness facts for admin.
//!
//! On shutdown it stops every source, retires every generation, waits for what is in
//! flight and shuts the registry down.

mod core;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use futures::stream::{FuturesUnordered, StreamExt};
use kvrelay_ckf::SourceId;
use kvrelay_identity::{EndpointId, PoolId};
use kvrelay_membership::MembershipView;
use kvrelay_pool::{AttachError, PoolAttachment, PoolRegistry};
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use self::core::{Command, FilterFill, HealthFact, SupervisionCore};
pub(crate) use self::core::{CoreConfig, CoverageFact, HostFacts, PoolFacts, SourceKey};
use crate::config::SourceConfig;
use crate::host::checkpoint::Checkpointer;
use crate::host::pump::{self, SourceStates};
use crate::host::scrape;
use crate::host::state::{HostState, PoolStatus, Route, Routes};
use crate::host::wire;

pub(crate) struct Supervisor {
    pub(crate) registry: PoolRegistry,
    pub(crate) state: Arc<HostState>,
    pub(crate) core: CoreConfig,
    /// Endpoints with engine sources (`[[sources]]` plus discovered adverts), current value.
    pub(crate) configured_sources: BTreeMap<EndpointId, Vec<SourceConfig>>,
    /// Updates of `configured_sources` (closed at once when nothing discovers sources).
    pub(crate) source_updates: watch::Receiver<BTreeMap<EndpointId, Vec<SourceConfig>>>,
    /// The NATS server carrying every endpoint's Dynamo KV events, if any.
    pub(crate) nats_server: Option<crate::config::NatsConfig>,
    /// Bounds of every source (`[ingest]`; NATS takes `[nats] max_payload_bytes` on top).
    pub(crate) ingest_limits: kvrelay_ingest::Limits,
    pub(crate) views: watch::Receiver<Option<MembershipView>>,
    pub(crate) cancel: CancellationToken,
    /// Pool checkpoints (`[state]`), when configured.
    pub(crate) checkpointer: Option<Checkpointer>,
}

/// An attach or retirement that finished.
enum Settled {
    Attached(EndpointId, Result<PoolAttachment, AttachError>),
    Retired(EndpointId),
    /// Departed sources' blocks dropped: how many were, and the first failure.
    SourcesCleared(EndpointId, usize, Option<kvrelay_pool::ActorError>),
}

type InFlight = FuturesUnordered<Pin<Box<dyn Future<Output = Settled> + Send>>>;

/// The shell's mutable parts.
struct Shell {
    attachments: BTreeMap<EndpointId, PoolAttachment>,
    in_flight: InFlight,
    pumps: Pumps,
}

impl Supervisor {
    pub(crate) async fn run(mut self) {
        let mut core = SupervisionCore::new(self.core.clone(), self.configured_sources.clone());
        let mut shell = Shell {
            attachments: BTreeMap::new(),
            in_flight: FuturesUnordered::new(),
            pumps: Pumps {
                tracker: TaskTracker::new(),
                running: BTreeMap::new(),
                states: SourceStates::default(),
            },
        };
        let mut catalog = self.registry.watch_catalog();
        let mut load = self.registry.watch_load();
        let window = self.state.limits.load_window();
        let mut load_ticker = tokio::time::interval_at(Instant::now() + window, window);
        load_ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let health_every = self.state.limits.pool_health_interval();
        let mut health_ticker = tokio::time::interval(health_every);
        health_ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let source_states = shell.pumps.states.clone();
        core.handle_catalog(catalog.borrow_and_update().clone());
        let mut sources_open = true;
        loop {
            self.execute(&mut core, &mut shell, &load);
            let fenced = fenced_generation(&shell.attachments);
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => break,
                changed = self.views.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let view = self.views.borrow_and_update().clone();
                    if let Some(view) = view {
                        core.handle_membership(view);
                    }
                }
                changed = self.source_updates.changed(), if sources_open => {
                    if changed.is_err() {
                        sources_open = false;
                        continue;
                    }
                    let next = self.source_updates.borrow_and_update().clone();
                    core.handle_configured_sources(next);
                }
                changed = catalog.changed() => {
                    if changed.is_ok() {
                        core.handle_catalog(catalog.borrow_and_update().clone());
                    }
                }
                changed = load.changed() => {
                    if changed.is_ok() {
                        load.borrow_and_update();
                    }
                }
                Some(settled) = shell.in_flight.next(), if !shell.in_flight.is_empty() => {
                    settle(&mut core, &mut shell, settled, &self.state);
                }
                () = source_states.changed() => {
                    for (key, state) in source_states.take() {
                        core.handle_source_state(&key, state);
                    }
                }
                _ = health_ticker.tick() => {
                    for (key, state) in source_states.observe() {
                        core.handle_source_state(&key, state);
                    }
                    let readings = self.read_health(&shell.attachments);
                    core.handle_pool_health(&readings);
                }
                _ = load_ticker.tick() => core.handle_load_tick(),
                (endpoint, generation) = fenced => {
                    warn!(endpoint = %endpoint.dotted(), generation, "pool generation fenced; rebuilding");
                    core.handle_fenced(&endpoint, generation);
                }
            }
        }
        // Shutdown: checkpoint every pool (bounded), stop the sources, retire every
        // generation, stop the registry.
        if let Some(checkpointer) = &self.checkpointer {
            let bound = checkpointer.shutdown_timeout();
            if tokio::time::timeout(bound, checkpointer.checkpoint_all(&self.state))
                .await
                .is_err()
            {
                warn!(
                    bound_ms = bound.as_millis() as u64,
                    "shutdown checkpoint did not finish in time"
                );
            }
        }
        core.handle_shutdown();
        self.execute(&mut core, &mut shell, &load);
        while core.is_settling() {
            let Some(settled) = shell.in_flight.next().await else {
                break;
            };
            settle(&mut core, &mut shell, settled, &self.state);
            self.execute(&mut core, &mut shell, &load);
        }
        shell.pumps.stop_all().await;
        self.registry.shutdown().await;
    }

    /// Runs every queued command, then publishes the core's facts.
    fn execute(
        &self,
        core: &mut SupervisionCore,
        shell: &mut Shell,
        load: &watch::Receiver<Vec<kvrelay_pool::PoolLoadSnapshot>>,
    ) {
        while let Some(command) = core.poll_command() {
            match command {
                Command::Attach { endpoint, request } => {
                    let registry = self.registry.clone();
                    shell.in_flight.push(Box::pin(async move {
                        let result = registry.attach(*request).await;
                        Settled::Attached(endpoint, result)
                    }));
                }
                Command::Retire {
                    endpoint,
                    generation,
                    mode,
                } => {
                    let Some(attachment) = shell
                        .attachments
                        .remove(&endpoint)
                        .filter(|attachment| attachment.generation == generation)
                    else {
                        core.handle_retired(&endpoint);
                        continue;
                    };
                    info!(endpoint = %endpoint.dotted(), generation, ?mode, "retiring pool");
                    let registry = self.registry.clone();
                    shell.in_flight.push(Box::pin(async move {
                        registry.retire(attachment, mode).await;
                        Settled::Retired(endpoint)
                    }));
                }
                Command::Update {
                    endpoint,
                    generation,
                    registrations,
                    roles,
                    capacity,
                } => {
                    let Some(attachment) = shell.attachments.get_mut(&endpoint) else {
                        continue;
                    };
                    if attachment.generation != generation {
                        continue;
                    }
                    if let Some(registrations) = registrations
                        && let Err(err) = self
                            .registry
                            .replace_registrations(attachment, registrations)
                    {
                        warn!(error = %err, "replacing registrations failed");
                    }
                    if let Some(roles) = roles
                        && let Err(err) = self.registry.replace_roles(attachment, roles)
                    {
                        warn!(error = %err, "replacing roles failed");
                    }
                    if let Err(err) = self.registry.replace_load_capacity(
                        attachment.pool,
                        attachment.generation,
                        &capacity,
                    ) {
                        warn!(error = %err, "replacing load capacity failed");
                    }
                }
                Command::StartSources {
                    endpoint,
                    engines,
                    nats,
                    semantics,
                } => {
                    let nats_server = nats.then_some(self.nats_server.as_ref()).flatten();
                    let target = shell
                        .attachments
                        .get(&endpoint)
                        .map(|attachment| (attachment.pool, attachment.actor.clone()));
                    shell
                        .pumps
                        .start(&endpoint, &engines, nats_server, semantics, target, self);
                }
                Command::StopSources { endpoint } => shell.pumps.stop(&endpoint),
                Command::ClearSources {
                    endpoint,
                    generation,
                    sources,
                } => {
                    let Some(attachment) = shell
                        .attachments
                        .get(&endpoint)
                        .filter(|attachment| attachment.generation == generation)
                    else {
                        continue;
                    };
                    let actor = attachment.actor.clone();
                    shell.in_flight.push(Box::pin(async move {
                        let (mut cleared, mut failure) = (0, None);
                        for source in sources {
                            match actor.clear_source(source).await {
                                Ok(()) => cleared += 1,
                                Err(err) => {
                                    failure.get_or_insert(err);
                                }
                            }
                        }
                        Settled::SourcesCleared(endpoint, cleared, failure)
                    }));
                }
                Command::PublishRoutes(plans) => {
                    let mut routes = BTreeMap::new();
                    let mut pools = BTreeMap::new();
                    for plan in plans {
                        let Some(attachment) = shell.attachments.get(&plan.endpoint) else {
                            continue;
                        };
                        for (source, capacity) in &plan.sources {
                            routes.insert(
                                *source,
                                Route {
                                    pool: plan.pool,
                                    generation: plan.generation,
                                    actor: attachment.actor.clone(),
                                    capacity: *capacity,
                                    block_size: plan.block_size,
                                },
                            );
                        }
                        pools.insert(
                            wire::pool_key(&plan.pool),
                            PoolStatus {
                                endpoint: plan.endpoint.dotted(),
                                generation: plan.generation,
                                routed_sources: plan.sources.len(),
                                actor: attachment.actor.clone(),
                            },
                        );
                    }
                    self.state.publish_routes(Routes { routes }, pools);
                }
                Command::PublishCatalog {
                    catalog,
                    withheld,
                    coverage,
                    revision,
                } => {
                    self.state.publish_catalog(wire::catalog_update(
                        &catalog, &withheld, &coverage, revision,
                    ));
                }
                Command::PublishTopology(snapshot) => {
                    self.state
                        .publish_topology(wire::topology_update(self.state.relay, &snapshot));
                }
                Command::PublishLoad { window_sequence } => {
                    let snapshots = load.borrow().clone();
                    self.state.publish_load(wire::load_window(
                        self.state.relay,
                        window_sequence,
                        self.state.limits.load_window(),
                        &snapshots,
                    ));
                }
            }
        }
        self.state.publish_facts(core.facts());
    }

    /// Reads every attached actor's health (O(1) each, never through its mailbox) and
    /// records it for metrics.
    fn read_health(
        &self,
        attachments: &BTreeMap<EndpointId, PoolAttachment>,
    ) -> Vec<(EndpointId, u64, HealthFact)> {
        let now = Instant::now();
        let mut readings = Vec::with_capacity(attachments.len());
        let mut healths = Vec::with_capacity(attachments.len());
        let mut lane_resident: BTreeMap<&'static str, u64> = BTreeMap::new();
        let mut filter_bytes = 0u64;
        let fill_of = |health: &kvrelay_pool::PoolHealth| {
            FilterFill::of(
                health.stats.filter.owned_blocks,
                health.stats.filter.resident_blocks,
            )
        };
        for (endpoint, attachment) in attachments {
            let health = attachment.actor.health(now);
            filter_bytes = filter_bytes.saturating_add(health.stats.filter.memory_bytes);
            let mut fill = fill_of(&health);
            let reading = HealthFact {
                pending_events: health.pending_events,
                stalled_for: health.stalled_for,
                events_applied: health.stats.events_applied,
                unroutable_events: health.stats.unroutable_events,
                fill,
            };
            healths.push((
                wire::pool_key(&attachment.pool),
                attachment.generation,
                health,
            ));
            // A lane's faults, omissions and backlog count like its pool's; its stall
            // shows through its pool (the pool's actor waits for the lane's permits).
            for lane in &attachment.tier_lanes {
                let health = lane.actor.health(now);
                *lane_resident.entry(lane.tier.name()).or_default() +=
                    health.stats.filter.resident_blocks;
                filter_bytes = filter_bytes.saturating_add(health.stats.filter.memory_bytes);
                fill = fill.fuller(fill_of(&health));
                healths.push((wire::pool_key(&lane.pool), lane.generation, health));
            }
            readings.push((
                endpoint.clone(),
                attachment.generation,
                HealthFact { fill, ..reading },
            ));
        }
        self.state.record_health(&healths);
        self.state
            .metrics
            .memory
            .get_or_create(&crate::metrics::MEMORY_POOL_FILTERS)
            .set(i64::try_from(filter_bytes).unwrap_or(i64::MAX));
        for tier in [kvrelay_ckf::CacheTier::Host, kvrelay_ckf::CacheTier::Disk] {
            let resident = lane_resident.get(tier.name()).copied().unwrap_or(0);
            self.state
                .metrics
                .tier_lane_resident_blocks
                .get_or_create(&crate::metrics::TierLabel { tier: tier.name() })
                .set(i64::try_from(resident).unwrap_or(i64::MAX));
        }
        readings
    }
}

fn settle(core: &mut SupervisionCore, shell: &mut Shell, settled: Settled, state: &HostState) {
    match settled {
        Settled::Attached(endpoint, Ok(attachment)) => {
            info!(endpoint = %endpoint.dotted(), generation = attachment.generation, "pool attached");
            let generation = attachment.generation;
            shell.attachments.insert(endpoint.clone(), attachment);
            core.handle_attached(&endpoint, generation);
        }
        Settled::Attached(endpoint, Err(err)) => {
            warn!(endpoint = %endpoint.dotted(), error = %err, "pool attach failed");
            state
                .metrics
                .pool_attach_failures
                .get_or_create(&crate::metrics::ReasonLabel {
                    reason: err.label(),
                })
                .inc();
            core.handle_attach_failed(&endpoint);
        }
        Settled::Retired(endpoint) => core.handle_retired(&endpoint),
        Settled::SourcesCleared(endpoint, n, failure) => {
            state.metrics.sources_cleared.inc_by(n as u64);
            if n > 0 {
                info!(endpoint = %endpoint.dotted(), sources = n, "blocks of departed sources dropped");
            }
            // A retired or stopped actor has nothing left to clear.
            if let Some(err) = failure {
                debug!(endpoint = %endpoint.dotted(), error = %err, "clearing departed sources failed");
            }
        }
    }
}

/// Resolves with the first attached generation whose token is cancelled (never when none).
async fn fenced_generation(
    attachments: &BTreeMap<EndpointId, PoolAttachment>,
) -> (EndpointId, u64) {
    let waits: Vec<_> = attachments
        .iter()
        .map(|(endpoint, attachment)| {
            let token = attachment.generation_cancel.clone();
            let fenced = (endpoint.clone(), attachment.generation);
            Box::pin(async move {
                token.cancelled().await;
                fenced
            })
        })
        .collect();
    if waits.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(waits).await.0
}

/// The running sources, per endpoint.
struct Pumps {
    tracker: TaskTracker,
    running: BTreeMap<EndpointId, CancellationToken>,
    states: SourceStates,
}

impl Pumps {
    /// Starts `endpoint`'s sources. With checkpoints on and the pool's generation in
    /// `target`, its checkpoint is restored first (off this loop) and the restored engine
    /// sources resume after their checkpointed batch; the rest start as usual.
    fn start(
        &mut self,
        endpoint: &EndpointId,
        engines: &[SourceConfig],
        nats_server: Option<&crate::config::NatsConfig>,
        semantics: kvrelay_identity::KvQuerySemantics,
        target: Option<(PoolId, kvrelay_pool::PoolActorHandle)>,
        supervisor: &Supervisor,
    ) {
        if self.running.contains_key(endpoint) {
            return;
        }
        let cancel = supervisor.cancel.child_token();
        let spawn_engines = {
            let (tracker, states, state) = (
                self.tracker.clone(),
                self.states.clone(),
                supervisor.state.clone(),
            );
            let (engines, limits, cancel) =
                (engines.to_vec(), supervisor.ingest_limits, cancel.clone());
            let lower_tiers = supervisor.core.tiers.any();
            move |resume: BTreeMap<SourceId, kvrelay_ingest::ResumePoint>| {
                for source in &engines {
                    let id = SourceId::new(source.worker_id, source.dp_rank);
                    pump::spawn_zmq(
                        &tracker,
                        pump::EngineSource {
                            config: source,
                            limits,
                            semantics,
                            resume_after: resume.get(&id).copied(),
                            lower_tiers,
                        },
                        state.clone(),
                        states.clone(),
                        cancel.clone(),
                    );
                }
            }
        };
        match (supervisor.checkpointer.clone(), target) {
            (Some(checkpointer), Some((pool, actor))) if !engines.is_empty() => {
                let ids: Vec<SourceId> = engines
                    .iter()
                    .map(|source| SourceId::new(source.worker_id, source.dp_rank))
                    .collect();
                let block_size = semantics.kv_block_size();
                let cancel = cancel.clone();
                self.tracker.spawn(async move {
                    let resume = tokio::select! {
                        biased;
                        () = cancel.cancelled() => return,
                        resume = checkpointer.restore_pool(&pool, block_size, &actor, &ids) => resume,
                    };
                    spawn_engines(resume);
                });
            }
            _ => spawn_engines(BTreeMap::new()),
        }
        for source in engines {
            if let Some(url) = &source.metrics_url {
                self.tracker.spawn(scrape::run(
                    url.clone(),
                    SourceId::new(source.worker_id, source.dp_rank),
                    supervisor.state.limits.load_window(),
                    supervisor.state.clone(),
                    supervisor.registry.clone(),
                    cancel.clone(),
                ));
            }
        }
        if let Some(server) = nats_server {
            pump::spawn_nats(
                &self.tracker,
                pump::NatsSource {
                    server,
                    limits: server.limits(supervisor.ingest_limits),
                    lower_tiers: supervisor.core.tiers.any(),
                },
                endpoint,
                supervisor.state.clone(),
                self.states.clone(),
                cancel.clone(),
            );
        }
        self.running.insert(endpoint.clone(), cancel);
    }

    fn stop(&mut self, endpoint: &EndpointId) {
        if let Some(cancel) = self.running.remove(endpoint) {
            cancel.cancel();
        }
    }

    async fn stop_all(&mut self) {
        for (_, cancel) in std::mem::take(&mut self.running) {
            cancel.cancel();
        }
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// Pool health readings over which a pool's unroutable share is judged: about 30 s.
pub(crate) fn degraded_readings(limits: &crate::limits::Limits) -> usize {
    const DEGRADED_WINDOW: std::time::Duration = std::time::Duration::from_secs(30);
    let every = limits
        .pool_health_interval()
        .max(std::time::Duration::from_millis(1));
    usize::try_from(DEGRADED_WINDOW.as_millis() / every.as_millis())
        .unwrap_or(usize::MAX)
        .max(1)
}
