//! The pool registry: which pool generations exist, their catalog and load views, and
//! lazy, bounded publication hubs.
//!
//! [`PoolRegistry`] is a cloneable handle over one [`core::RegistryCore`] (the sync
//! decision core) behind a short lock that is never held across an `.await`. Every spawn
//! (actors, hub tasks, hub initialisations, evictions, filter allocations) joins the
//! registry's `TaskTracker`; [`PoolRegistry::shutdown`] fences everything and waits.
//!
//! The handles the owner holds share one [`OwnerGuard`]: when the last of them is dropped
//! without `shutdown`, the guard cancels the registry's token (actors fence, hubs end their
//! subscribers with `ShuttingDown`, pending initialisations give up) and closes the
//! tracker, so no task outlives its owner. Tasks the registry spawns hold internal
//! handles without the guard, so they never keep it alive.

mod admission;
pub(crate) mod core;
#[cfg(test)]
mod lane_tests;
mod lanes;
#[cfg(test)]
mod publication_tests;
pub(crate) mod registration;
#[cfg(test)]
mod stress_tests;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use kvrelay_ckf::{CkfConfig, ConfigError, FilterDensity};
use kvrelay_identity::{
    CanonicalModelRegistration, DcRelayIdentity, EndpointId, KvQuerySemantics, PoolId,
    ProducerIdentity, WorkerRole,
};
use parking_lot::Mutex;
use tokio::sync::{Semaphore, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use self::core::RetirementMode;
use self::core::{Commit, RegistryCore, Reserved};
use self::lanes::validate_lanes;
pub use self::lanes::{LaneAttachment, LaneRequest};
use crate::actor::PoolActorHandle;
use crate::catalog::{PoolCatalog, TierLaneDescriptor};
use crate::error::{AttachError, LimitsError, PoolError, SubscribeError};
use crate::filter::FilterState;
use crate::hub::HubHandle;
use crate::limits::Limits;
use crate::load::{LoadObservation, PoolLoadSnapshot, PoolLoadState, WorkerCapacity};

/// What the registry needs to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegistryConfig {
    /// This relay's identity; its incarnation fences producers across relay lifetimes.
    pub relay: DcRelayIdentity,
    /// Every bound (see [`Limits`]).
    pub limits: Limits,
}

/// One pool generation to attach.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttachRequest {
    /// The pool (indexer domain + DC).
    pub pool: PoolId,
    /// The serving endpoint that owns the pool; one pool per endpoint and vice versa.
    pub endpoint: EndpointId,
    /// The models served (at least one; validated).
    pub registrations: Vec<CanonicalModelRegistration>,
    /// How consumers hash requests for this pool.
    pub query_semantics: KvQuerySemantics,
    /// The declared worker roles (at least one, no repeats).
    pub roles: Vec<WorkerRole>,
    /// Filter sizing: expected unique resident blocks (> 0).
    pub expected_unique_blocks: u64,
    /// The filter's format: v1 (the reference's, what every consumer reads) or the dense
    /// format (16.8 bits per membership at 95 %; consumers before it quarantine the pool
    /// as unsupported). Tier lanes stay v1.
    pub filter_density: FilterDensity,
    /// Load capacity of the pool's workers; `None` publishes no load for this pool.
    /// Invalid capacity does not block the attach: the load snapshot is degraded.
    pub load_capacity: Option<Vec<WorkerCapacity>>,
    /// Lower-tier lanes (host memory, disk) attached and retired with the pool; empty
    /// for a device-only pool.
    pub tier_lanes: Vec<LaneRequest>,
}

/// An attached pool generation, owned by whoever attached it.
///
/// Its `generation_cancel` token is cancelled when the generation is withdrawn, fenced
/// (for example by a terminal hub failure) or removed: the owner should then call
/// [`PoolRegistry::retire`] (or [`PoolRegistry::detach`]).
#[derive(Debug)]
pub struct PoolAttachment {
    /// The pool.
    pub pool: PoolId,
    /// Its layout generation (unique in this registry, never reused).
    pub generation: u64,
    /// The pool actor: submit events here.
    pub actor: PoolActorHandle,
    /// Cancelled when the generation stops being publishable.
    pub generation_cancel: CancellationToken,
    /// The pool's lower-tier lanes, in tier order (shared token: a lane that fails takes
    /// its pool's generation down, and the pool's retirement retires them).
    pub tier_lanes: Vec<LaneAttachment>,
    registrations: Arc<[CanonicalModelRegistration]>,
    roles: Arc<[WorkerRole]>,
}

impl PoolAttachment {
    /// The producer identity consumers subscribe with.
    pub fn identity(&self) -> ProducerIdentity {
        self.actor.identity()
    }
}

/// Registry-wide counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegistryStats {
    /// Attached generations (any state).
    pub pools: usize,
    /// Attaches in flight.
    pub reservations: usize,
    /// Hub capacity units in use (≤ `max_initialized_hubs`).
    pub initialized_hubs: usize,
    /// Idle hubs evicted to make room for another pool's hub.
    pub hub_evictions: u64,
    /// Tasks alive in the registry's tracker.
    pub tasks: usize,
    /// Publication stream counters summed over every hub (refreshed by each hub about
    /// once a second and when it stops; the gauge fields are not filled).
    pub stream: kvrelay_ckf::stream::StreamStats,
}

/// Reads a registry's stream counters ([`RegistryStats::stream`]) without holding it.
#[derive(Debug, Clone)]
pub struct StreamStatsReader(Arc<Mutex<kvrelay_ckf::stream::StreamStats>>);

impl StreamStatsReader {
    /// The counters now.
    pub fn get(&self) -> kvrelay_ckf::stream::StreamStats {
        *self.0.lock()
    }
}

/// The cloneable registry handle.
///
/// Dropping the last clone without [`PoolRegistry::shutdown`] still stops every task the
/// registry spawned (actors fenced, subscriptions ended with `ShuttingDown`), without
/// waiting for them.
#[derive(Clone)]
pub struct PoolRegistry {
    inner: Arc<RegistryInner>,
    /// Shared by the owner's clones; `None` in handles held by the registry's own tasks.
    _owner: Option<Arc<OwnerGuard>>,
}

/// Cancels the registry's token and closes its tracker when the owner's last handle drops.
struct OwnerGuard {
    shutdown: CancellationToken,
    tracker: TaskTracker,
}

impl Drop for OwnerGuard {
    fn drop(&mut self) {
        if !self.shutdown.is_cancelled() {
            tracing::debug!(
                "last pool registry handle dropped without shutdown, cancelling its tasks"
            );
        }
        self.shutdown.cancel();
        self.tracker.close();
    }
}

type Core = RegistryCore<PoolActorHandle, HubHandle>;

struct RegistryInner {
    limits: Arc<Limits>,
    core: Mutex<Core>,
    catalog: watch::Sender<PoolCatalog>,
    load: watch::Sender<Vec<PoolLoadSnapshot>>,
    allocation: Arc<Semaphore>,
    encoding: Arc<Semaphore>,
    eviction_coordinator: Arc<Semaphore>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    /// Stream counters summed over every hub.
    stream_totals: Arc<Mutex<kvrelay_ckf::stream::StreamStats>>,
    #[cfg(test)]
    gates: tests::Gates,
}

impl std::fmt::Debug for PoolRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolRegistry")
            .field("stats", &self.stats())
            .finish()
    }
}

impl PoolRegistry {
    /// A registry with no pools; fails on invalid limits.
    pub fn new(config: RegistryConfig) -> Result<Self, LimitsError> {
        config.limits.validate()?;
        Ok(Self::build(
            config,
            #[cfg(test)]
            tests::Gates::default(),
        ))
    }

    fn build(config: RegistryConfig, #[cfg(test)] gates: tests::Gates) -> Self {
        let limits = Arc::new(config.limits);
        let inner = Arc::new(RegistryInner {
            core: Mutex::new(
                RegistryCore::new(config.relay, limits.max_initialized_hubs)
                    .with_max_pools(limits.max_pools)
                    .with_max_filter_bytes(limits.max_filter_bytes_total),
            ),
            catalog: watch::Sender::new(PoolCatalog::new(config.relay)),
            load: watch::Sender::new(Vec::new()),
            allocation: Arc::new(Semaphore::new(limits.allocation_concurrency)),
            encoding: Arc::new(Semaphore::new(limits.encoding_permits)),
            eviction_coordinator: Arc::new(Semaphore::new(1)),
            tracker: TaskTracker::new(),
            shutdown: CancellationToken::new(),
            stream_totals: Arc::new(Mutex::new(kvrelay_ckf::stream::StreamStats::default())),
            limits,
            #[cfg(test)]
            gates,
        });
        let owner = Arc::new(OwnerGuard {
            shutdown: inner.shutdown.clone(),
            tracker: inner.tracker.clone(),
        });
        Self {
            inner,
            _owner: Some(owner),
        }
    }

    /// A handle for the registry's own tasks: it does not hold the owner's guard, so a
    /// task never keeps its registry alive.
    fn internal(&self) -> Self {
        Self::from_inner(self.inner.clone())
    }

    fn from_inner(inner: Arc<RegistryInner>) -> Self {
        Self {
            inner,
            _owner: None,
        }
    }

    /// The relay identity.
    pub fn relay(&self) -> DcRelayIdentity {
        self.inner.core.lock().relay()
    }

    /// The limits in force.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Attaches a new pool generation: validates, reserves the pool and endpoint, builds
    /// the filter on a blocking thread (at most `allocation_concurrency` at once), spawns
    /// the actor and publishes the descriptor (and load, if any).
    ///
    /// Cancel-safe: dropping the future, or a shutdown meanwhile, rolls the reservation
    /// back and publishes nothing.
    pub async fn attach(&self, request: AttachRequest) -> Result<PoolAttachment, AttachError> {
        self.attach_with_builder(request, FilterState::build).await
    }

    async fn attach_with_builder<B>(
        &self,
        request: AttachRequest,
        builder: B,
    ) -> Result<PoolAttachment, AttachError>
    where
        B: FnOnce(CkfConfig) -> Result<FilterState, ConfigError> + Send + 'static,
    {
        registration::validate_registrations(request.pool, &request.registrations)?;
        registration::validate_roles(&request.roles)?;
        let load = request.load_capacity.as_ref().map(|workers| {
            PoolLoadState::from_capacities(workers).unwrap_or_else(|error| {
                tracing::warn!(%error, "ignoring invalid pool load capacity during attach");
                PoolLoadState::default()
            })
        });
        // The table's size is known before anything is allocated: refuse a pool that would
        // pass the memory budget here, not after building it.
        let filter_config =
            CkfConfig::new(request.expected_unique_blocks).with_density(request.filter_density);
        let filter_bytes = filter_config
            .format()
            .map_err(|error| AttachError::Filter {
                pool: request.pool,
                error,
            })
            .map(|format| u64::from(format.bucket_count()).saturating_mul(8))?;
        let lanes = validate_lanes(&request)?;
        let reserved =
            self.inner
                .core
                .lock()
                .reserve(request.pool, &request.endpoint, filter_bytes)?;
        let mut guard = ReservationGuard {
            inner: &self.inner,
            reserved,
            armed: true,
        };
        let mut lane_guards = Vec::with_capacity(lanes.len());
        for (lane, lane_bytes) in &lanes {
            let reserved = self.inner.core.lock().reserve_lane(
                request.pool.tier_lane(lane.tier.code()),
                &request.endpoint,
                *lane_bytes,
            )?;
            lane_guards.push(ReservationGuard {
                inner: &self.inner,
                reserved,
                armed: true,
            });
        }

        let pool = request.pool;
        let state = self.build_filter(pool, filter_config, builder).await?;
        let identity = self.producer_identity(reserved, &state)?;
        let reserved_lanes: Vec<Reserved> =
            lane_guards.iter().map(|guard| guard.reserved).collect();
        let lane_states = self.build_lanes(&lanes, &reserved_lanes).await?;
        let registrations: Arc<[CanonicalModelRegistration]> = request.registrations.into();
        let roles: Arc<[WorkerRole]> = request.roles.into();
        // A child of the registry token: dropping the owner's last handle retires it too.
        let generation_cancel = self.inner.shutdown.child_token();
        let (actor, tier_lanes) = {
            let mut core = self.inner.core.lock();
            let unreserved = std::iter::once(reserved)
                .chain(lane_states.iter().map(|(_, _, _, reserved)| *reserved))
                .find(|reserved| !core.is_reserved(*reserved));
            if let Some(reserved) = unreserved {
                return Err(AttachError::RetiredBeforeCommit {
                    pool: reserved.pool,
                    generation: reserved.generation,
                });
            }
            // Lanes first: the pool's actor forwards to them from its first event, and
            // its descriptor names them.
            let mut tier_lanes = Vec::with_capacity(lane_states.len());
            let mut descriptors = Vec::with_capacity(lane_states.len());
            for (lane, lane_state, lane_identity, lane_reserved) in lane_states {
                let lane_actor = PoolActorHandle::spawn(
                    lane_state,
                    lane_identity,
                    &self.inner.limits,
                    &self.inner.tracker,
                    &self.inner.shutdown,
                    generation_cancel.clone(),
                    Vec::new(),
                );
                core.commit(Commit {
                    reserved: lane_reserved,
                    endpoint: request.endpoint.clone(),
                    actor: lane_actor.clone(),
                    identity: lane_identity,
                    registrations: registrations.clone(),
                    query_semantics: request.query_semantics,
                    roles: roles.clone(),
                    load: None,
                    cancel: generation_cancel.clone(),
                    lane_of: Some(pool),
                    tier_lanes: Vec::new(),
                })?;
                descriptors.push(TierLaneDescriptor {
                    tier: lane.tier,
                    producer: lane_identity,
                    block_size: lane.block_size,
                });
                tier_lanes.push(LaneAttachment {
                    tier: lane.tier,
                    pool: lane_reserved.pool,
                    generation: lane_reserved.generation,
                    actor: lane_actor,
                });
            }
            let actor = PoolActorHandle::spawn(
                state,
                identity,
                &self.inner.limits,
                &self.inner.tracker,
                &self.inner.shutdown,
                generation_cancel.clone(),
                tier_lanes
                    .iter()
                    .map(|lane| (lane.tier, lane.actor.clone()))
                    .collect(),
            );
            core.commit(Commit {
                reserved,
                endpoint: request.endpoint,
                actor: actor.clone(),
                identity,
                registrations: registrations.clone(),
                query_semantics: request.query_semantics,
                roles: roles.clone(),
                load,
                cancel: generation_cancel.clone(),
                lane_of: None,
                tier_lanes: descriptors,
            })?;
            self.publish(&mut core);
            (actor, tier_lanes)
        };
        guard.armed = false;
        for lane_guard in &mut lane_guards {
            lane_guard.armed = false;
        }
        tracing::info!(pool = %pool.indexer_domain, generation = reserved.generation, "pool attached");
        Ok(PoolAttachment {
            pool,
            generation: reserved.generation,
            actor,
            generation_cancel,
            tier_lanes,
            registrations,
            roles,
        })
    }

    /// Graceful retirement: withdraw (catalog first), drain the actor and remove.
    pub async fn detach(&self, attachment: PoolAttachment) {
        self.retire(attachment, RetirementMode::Graceful).await;
    }

    /// Retires a generation: withdraws it from catalog and load, stops its hub, then shuts
    /// the actor down (`Graceful`: tail published) or fences it (`Fenced`: tail
    /// discarded), and removes the entry. Faults are data on the actor (its health), so
    /// there is nothing to drain.
    pub async fn retire(&self, attachment: PoolAttachment, mode: RetirementMode) {
        let PoolAttachment {
            pool,
            generation,
            actor,
            tier_lanes,
            ..
        } = attachment;
        // The pool leaves the catalog first (its descriptor names its lanes), then the
        // lanes; its actor stops before theirs, since it forwards to them while draining.
        self.withdraw(pool, generation, mode).await;
        for lane in &tier_lanes {
            self.withdraw(lane.pool, lane.generation, mode).await;
        }
        for actor in std::iter::once(&actor).chain(tier_lanes.iter().map(|lane| &lane.actor)) {
            match mode {
                RetirementMode::Graceful => {
                    if actor.shutdown().await.is_err() {
                        actor.fence().await;
                    }
                }
                RetirementMode::Fenced => actor.fence().await,
            }
        }
        self.remove(pool, generation).await;
        for lane in &tier_lanes {
            self.remove(lane.pool, lane.generation).await;
        }
    }

    /// Withdraws a generation from catalog and load and stops its hub (subscribers end
    /// with `ProducerWithdrawn`). The actor keeps running. False if `generation` is not
    /// the pool's current one.
    pub async fn withdraw(&self, pool: PoolId, generation: u64, mode: RetirementMode) -> bool {
        let hub = {
            let mut core = self.inner.core.lock();
            if core.withdraw(pool, generation, mode).is_none() {
                return false;
            }
            let hub = core.retire_slot(generation);
            self.publish(&mut core);
            hub
        };
        if let Some(hub) = hub {
            hub.shutdown().await;
        }
        self.wait_slot_settled(generation).await;
        true
    }

    /// Fences a generation after a terminal failure: withdrawn from catalog and load,
    /// token cancelled, hub retired. A stale generation fences nothing. True if the
    /// generation was active.
    pub fn fence_generation(&self, pool: PoolId, generation: u64, reason: &str) -> bool {
        let (was_active, hub) = {
            let mut core = self.inner.core.lock();
            let Some(was_active) = core.withdraw(pool, generation, RetirementMode::Fenced) else {
                return false;
            };
            let hub = core.retire_slot(generation);
            self.publish(&mut core);
            (was_active, hub)
        };
        if let Some(hub) = hub {
            hub.retire();
        }
        if was_active {
            tracing::error!(pool = %pool.indexer_domain, generation, %reason, "pool generation fenced");
        }
        was_active
    }

    /// Removes a generation's entry (withdrawing it first if needed) and waits for its hub
    /// to stop. False if `generation` is not the pool's current one.
    pub async fn remove(&self, pool: PoolId, generation: u64) -> bool {
        let hub = {
            let mut core = self.inner.core.lock();
            if core.generation_of(pool).map(|(current, _)| current) != Some(generation) {
                return false;
            }
            let hub = core.retire_slot(generation);
            core.remove(pool, generation);
            self.publish(&mut core);
            hub
        };
        if let Some(hub) = hub {
            hub.shutdown().await;
        }
        self.wait_slot_settled(generation).await;
        true
    }

    /// Replaces an active generation's registrations without a new generation.
    pub fn replace_registrations(
        &self,
        attachment: &mut PoolAttachment,
        registrations: Vec<CanonicalModelRegistration>,
    ) -> Result<(), PoolError> {
        registration::validate_registrations(attachment.pool, &registrations)?;
        if attachment.registrations.as_ref() == registrations.as_slice() {
            return Ok(());
        }
        let registrations: Arc<[CanonicalModelRegistration]> = registrations.into();
        let mut core = self.inner.core.lock();
        core.replace_registrations(
            attachment.pool,
            attachment.generation,
            registrations.clone(),
        )?;
        self.publish(&mut core);
        attachment.registrations = registrations;
        Ok(())
    }

    /// Replaces an active generation's declared roles without a new generation.
    pub fn replace_roles(
        &self,
        attachment: &mut PoolAttachment,
        roles: Vec<WorkerRole>,
    ) -> Result<(), PoolError> {
        registration::validate_roles(&roles)?;
        if attachment.roles.as_ref() == roles.as_slice() {
            return Ok(());
        }
        let roles: Arc<[WorkerRole]> = roles.into();
        let mut core = self.inner.core.lock();
        core.replace_roles(attachment.pool, attachment.generation, roles.clone())?;
        self.publish(&mut core);
        attachment.roles = roles;
        Ok(())
    }

    /// Replaces an active generation's load capacity. `Ok(false)`: not active or no load
    /// published; `Ok(true)`: accepted. On `Err` the load snapshot was degraded and
    /// republished.
    pub fn replace_load_capacity(
        &self,
        pool: PoolId,
        generation: u64,
        workers: &[WorkerCapacity],
    ) -> Result<bool, PoolError> {
        let mut core = self.inner.core.lock();
        let result = core.replace_load_capacity(pool, generation, workers);
        self.publish(&mut core);
        result
    }

    /// Records one rank's load for an active generation; false if not accepted (stale
    /// generation, no load, unknown rank).
    pub fn observe_load(
        &self,
        pool: PoolId,
        generation: u64,
        observation: LoadObservation,
    ) -> bool {
        let mut core = self.inner.core.lock();
        let accepted = core.observe_load(pool, generation, observation);
        self.publish(&mut core);
        accepted
    }

    /// Drops an active generation's load observations; false if not active or no load.
    pub fn clear_load_observations(&self, pool: PoolId, generation: u64) -> bool {
        let mut core = self.inner.core.lock();
        let cleared = core.clear_load_observations(pool, generation);
        self.publish(&mut core);
        cleared
    }

    /// Checks that `expected` is the active producer of its pool; returns a token that is
    /// cancelled when that generation retires (observe-only).
    pub fn validate_active_producer(
        &self,
        expected: &ProducerIdentity,
    ) -> Result<CancellationToken, SubscribeError> {
        self.inner.core.lock().active_generation_token(expected)
    }

    /// The current catalog.
    pub fn catalog(&self) -> PoolCatalog {
        self.inner.catalog.borrow().clone()
    }

    /// A watch of complete catalog snapshots.
    pub fn watch_catalog(&self) -> watch::Receiver<PoolCatalog> {
        self.inner.catalog.subscribe()
    }

    /// The current load snapshots, sorted by pool.
    pub fn load(&self) -> Vec<PoolLoadSnapshot> {
        self.inner.load.borrow().clone()
    }

    /// A watch of complete load views (sorted by pool).
    pub fn watch_load(&self) -> watch::Receiver<Vec<PoolLoadSnapshot>> {
        self.inner.load.subscribe()
    }

    /// Registry-wide counters.
    pub fn stats(&self) -> RegistryStats {
        let core = self.inner.core.lock();
        RegistryStats {
            pools: core.pool_count(),
            reservations: core.reservation_count(),
            initialized_hubs: core.hubs_in_use(),
            hub_evictions: core.evictions(),
            tasks: self.inner.tracker.len(),
            stream: *self.inner.stream_totals.lock(),
        }
    }

    /// A reader of the stream counters that does not keep the registry alive (for
    /// metrics expositions that may outlive it).
    pub fn stream_stats_reader(&self) -> StreamStatsReader {
        StreamStatsReader(self.inner.stream_totals.clone())
    }

    /// A token cancelled when the registry shuts down.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.inner.shutdown.child_token()
    }

    /// Stops the registry: refuses new attaches, clears catalog and load, ends every
    /// subscription with `ShuttingDown`, fences every actor (tails discarded) and waits for
    /// every task it spawned.
    pub async fn shutdown(&self) {
        let (entries, hubs) = {
            let mut core = self.inner.core.lock();
            let entries = core.shutdown();
            let hubs: Vec<HubHandle> = entries
                .iter()
                .filter_map(|(_, generation, _, _)| core.retire_slot(*generation))
                .collect();
            self.publish(&mut core);
            (entries, hubs)
        };
        self.inner.shutdown.cancel();
        self.inner.allocation.close();
        for hub in &hubs {
            hub.shutdown().await;
        }
        for (_, generation, cancel, actor) in entries {
            cancel.cancel();
            actor.fence().await;
            self.wait_slot_settled(generation).await;
        }
        self.inner.tracker.close();
        self.inner.tracker.wait().await;
        tracing::info!("pool registry stopped");
    }

    fn publish(&self, core: &mut Core) {
        while let Some(publication) = core.poll_publication() {
            self.inner
                .catalog
                .send_if_modified(|catalog| core::apply_to_catalog(catalog, &publication));
            self.inner
                .load
                .send_if_modified(|load| core::apply_to_load(load, &publication));
        }
    }

    async fn wait_slot_settled(&self, generation: u64) {
        loop {
            let Some(mut changed) = self.inner.core.lock().unsettled_slot(generation) else {
                return;
            };
            if changed.changed().await.is_err() {
                return;
            }
        }
    }
}

/// Rolls an attach's reservation back unless disarmed (cancelled or failed attach).
struct ReservationGuard<'a> {
    inner: &'a RegistryInner,
    reserved: Reserved,
    armed: bool,
}

impl Drop for ReservationGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.inner.core.lock().rollback(self.reserved);
        }
    }
}
