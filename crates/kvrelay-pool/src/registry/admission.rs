//! Subscription admission: check the producer, get or lazily start the generation's hub
//! (reclaiming an idle hub's capacity under pressure), then subscribe.

use std::sync::{Arc, Weak};

use kvrelay_identity::{PoolId, ProducerIdentity};
use tokio_util::sync::CancellationToken;

use super::core::{HubStep, InitOutcome};
use super::{PoolRegistry, RegistryInner};
use crate::actor::PoolActorHandle;
use crate::error::{HubFailure, SubscribeError, Unavailability};
use crate::hub::{HubContext, HubHandle, SubscribeOptions};
use crate::subscription::PoolSubscription;

impl PoolRegistry {
    /// Opens a subscription to the exact producer `expected`.
    ///
    /// Checks the producer first (no waiting for a stale request), then gets or lazily
    /// starts the pool's hub (reclaiming an idle hub's capacity when all
    /// `max_initialized_hubs` are taken), then subscribes. Fails with
    /// `InitializedHubLimit` when every hub has subscribers.
    pub async fn subscribe(
        &self,
        expected: ProducerIdentity,
    ) -> Result<PoolSubscription, SubscribeError> {
        self.subscribe_with(expected, SubscribeOptions::default())
            .await
    }

    /// [`PoolRegistry::subscribe`] with a resume point and the subscriber's abilities.
    pub async fn subscribe_with(
        &self,
        expected: ProducerIdentity,
        options: SubscribeOptions,
    ) -> Result<PoolSubscription, SubscribeError> {
        if self.inner.shutdown.is_cancelled() {
            return Err(SubscribeError::Unavailable {
                reason: Unavailability::ShuttingDown,
            });
        }
        let admission = self.inner.core.lock().begin_admission(&expected)?;
        let _pending = AdmissionGuard {
            inner: &self.inner,
            generation: admission.generation,
        };
        let mut attempted = false;
        loop {
            let step = self.inner.core.lock().hub_step(&admission, attempted)?;
            match step {
                HubStep::Ready(hub) => {
                    let subscription = hub.subscribe(options)?;
                    self.inner.core.lock().active_generation_token(&expected)?;
                    return Ok(subscription);
                }
                HubStep::Wait(mut changed) => {
                    tokio::select! {
                        _ = changed.changed() => {}
                        () = admission.generation_cancel.cancelled() => {
                            return Err(SubscribeError::retired());
                        }
                    }
                }
                HubStep::Initialize { with_capacity } => {
                    attempted = true;
                    let registry = self.internal();
                    let initialization = Initialization {
                        pool: admission.pool,
                        generation: admission.generation,
                        actor: admission.actor.clone(),
                        identity: admission.identity,
                        cancel: admission.generation_cancel.clone(),
                    };
                    self.inner.tracker.spawn(async move {
                        registry.initialize(initialization, with_capacity).await
                    });
                }
            }
        }
    }

    async fn initialize(self, init: Initialization, with_capacity: bool) {
        if !with_capacity && let Err(error) = self.reclaim_capacity(&init).await {
            tracing::debug!(%error, "publication hub initialisation found no capacity");
            let mut core = self.inner.core.lock();
            core.abort_initialization(init.generation, init.cancel.is_cancelled());
            return;
        }
        let result = self.start_hub(&init).await;
        let outcome = self
            .inner
            .core
            .lock()
            .finish_initialization(init.generation, result);
        match outcome {
            InitOutcome::Installed => {}
            InitOutcome::Discard(Some(hub)) => hub.shutdown().await,
            InitOutcome::Discard(None) => {}
            InitOutcome::Fence(reason) => {
                self.fence_generation(
                    init.pool,
                    init.generation,
                    &format!("publication hub: {reason}"),
                );
            }
        }
    }

    async fn start_hub(&self, init: &Initialization) -> Result<HubHandle, HubFailure> {
        #[cfg(test)]
        self.inner.gates.initialization.pass(&init.cancel).await?;
        let feed = tokio::select! {
            biased;
            () = init.cancel.cancelled() => return Err(HubFailure::Retired),
            feed = init.actor.attach_publication() => feed.map_err(HubFailure::Attach)?,
        };
        let lease = feed.lease;
        #[cfg(test)]
        if let Err(reason) = self.inner.gates.post_snapshot.pass(&init.cancel).await {
            init.actor.detach_publication(lease);
            return Err(reason);
        }
        if init.cancel.is_cancelled() {
            init.actor.detach_publication(lease);
            return Err(HubFailure::Retired);
        }
        HubHandle::spawn(&init.actor, feed, self.hub_context(init))
    }

    fn hub_context(&self, init: &Initialization) -> HubContext {
        let registry: Weak<RegistryInner> = Arc::downgrade(&self.inner);
        let pool = init.pool;
        let generation = init.generation;
        HubContext {
            identity: init.identity,
            relay: self.relay(),
            limits: self.inner.limits.clone(),
            encoding: self.inner.encoding.clone(),
            tracker: self.inner.tracker.clone(),
            shutdown: self.inner.shutdown.clone(),
            totals: self.inner.stream_totals.clone(),
            on_failure: Arc::new(move |reason| {
                if let Some(inner) = registry.upgrade() {
                    PoolRegistry::from_inner(inner).fence_generation(
                        pool,
                        generation,
                        &format!("publication hub: {reason}"),
                    );
                }
            }),
        }
    }

    /// Takes the eviction coordinator, retries free capacity, then evicts one idle hub of
    /// another pool and takes over its capacity. The eviction runs in its own tracked task
    /// so a requester that retires meanwhile cannot strand the victim or leak its unit.
    async fn reclaim_capacity(&self, init: &Initialization) -> Result<(), SubscribeError> {
        let coordinator = tokio::select! {
            biased;
            () = init.cancel.cancelled() => return Err(SubscribeError::retired()),
            permit = self.inner.eviction_coordinator.clone().acquire_owned() => {
                permit.map_err(|_| SubscribeError::retired())?
            }
        };
        let limit = SubscribeError::InitializedHubLimit {
            limit: self.inner.limits.max_initialized_hubs,
        };
        let victim = {
            let mut core = self.inner.core.lock();
            if core.try_take_capacity(init.generation) {
                return Ok(());
            }
            core.claim_idle_victim(init.generation)
                .ok_or(limit.clone())?
        };
        let (granted_tx, granted_rx) = tokio::sync::oneshot::channel();
        let registry = self.internal();
        let requester = init.generation;
        self.inner.tracker.spawn(async move {
            let _coordinator = coordinator;
            #[cfg(test)]
            registry.inner.gates.eviction.pass_uncancellable().await;
            victim.hub.shutdown().await;
            let granted = registry.inner.core.lock().finish_eviction(victim.generation, requester);
            tracing::debug!(pool = %victim.pool.indexer_domain, generation = victim.generation, "idle publication hub evicted");
            let _ = granted_tx.send(granted);
        });
        tokio::select! {
            biased;
            () = init.cancel.cancelled() => Err(SubscribeError::retired()),
            granted = granted_rx => match granted {
                Ok(true) => Ok(()),
                _ => Err(limit),
            },
        }
    }
}

struct Initialization {
    pool: PoolId,
    generation: u64,
    actor: PoolActorHandle,
    identity: ProducerIdentity,
    cancel: CancellationToken,
}

/// Ends a pending admission when the subscribe call returns or is dropped.
struct AdmissionGuard<'a> {
    inner: &'a RegistryInner,
    generation: u64,
}

impl Drop for AdmissionGuard<'_> {
    fn drop(&mut self) {
        self.inner.core.lock().end_admission(self.generation);
    }
}
