//! The registry's synchronous decision core: reservations, generations, entry states,
//! the catalog and load views, and the per-generation hub slot state machine.
//!
//! No runtime is needed to drive it: the async shell (`PoolRegistry`) holds it under one
//! short-lived lock, feeds it with method calls and drains what to publish with
//! [`RegistryCore::poll_publication`] until `None`. It is generic over the actor handle
//! `A` and the hub handle `H` so tests drive it with plain values.
//!
//! Hub slot phases, one slot per layout generation:
//!
//! ```text
//! Vacant --first subscription--> Initializing --started--> Ready(hub)
//! Initializing --start failed--> Failed(reason)        (the generation is fenced)
//! Initializing --no capacity, no idle victim--> Vacant  (the waiter gets InitializedHubLimit)
//! Ready --claimed idle by another pool's initialisation--> Evicting --done--> Vacant
//! any --retirement--> Retired (an Initializing or Evicting slot retires when its task ends)
//! ```
//!
//! Hub capacity (`max_initialized_hubs`) is counted here, not in a semaphore: a unit is
//! held by an Initializing or Ready slot (`holds_capacity`) or by an eviction in flight,
//! and `hubs_in_use` always equals the number of units held.

use std::collections::BTreeMap;
use std::sync::Arc;

use kvrelay_identity::{
    CanonicalModelRegistration, DcRelayIdentity, EndpointId, KvQuerySemantics, PoolId,
    ProducerIdentity, WorkerRole,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::catalog::{PoolCatalog, PoolDescriptor};
use crate::error::{AttachError, PoolError, SubscribeError};
use crate::load::{
    LoadObservation, LoadObservationOutcome, PoolLoadSnapshot, PoolLoadState, WorkerCapacity,
};

/// What a hub handle must tell the core.
pub(crate) trait SlotHub: Clone {
    /// True when the hub has no subscriber (it may be evicted).
    fn is_idle(&self) -> bool;
}

/// Whether a generation leaves gracefully or is fenced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetirementMode {
    /// Withdrawn from the catalog; the actor may drain and publish its tail.
    Graceful,
    /// Withdrawn because it can no longer be trusted; the tail is discarded.
    Fenced,
}

/// The lifecycle state of a pool generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EntryState {
    Active,
    Withdrawn,
    Fenced,
}

/// A change the shell must publish, in order.
#[derive(Debug)]
pub(crate) enum Publication {
    CatalogUpsert {
        revision: u64,
        descriptor: PoolDescriptor,
    },
    CatalogRemove {
        revision: u64,
        pool: PoolId,
    },
    CatalogClear {
        revision: u64,
    },
    LoadSet {
        snapshot: PoolLoadSnapshot,
    },
    LoadRemove {
        pool: PoolId,
    },
    LoadClear,
}

/// The validated, reserved part of an attach request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reserved {
    pub(crate) pool: PoolId,
    pub(crate) generation: u64,
}

/// What the core keeps of an attach while the filter is built.
pub(crate) struct Commit<A> {
    pub(crate) reserved: Reserved,
    pub(crate) endpoint: EndpointId,
    pub(crate) actor: A,
    pub(crate) identity: ProducerIdentity,
    pub(crate) registrations: Arc<[CanonicalModelRegistration]>,
    pub(crate) query_semantics: KvQuerySemantics,
    pub(crate) roles: Arc<[WorkerRole]>,
    pub(crate) load: Option<PoolLoadState>,
    pub(crate) cancel: CancellationToken,
}

/// What an admitted subscriber needs to reach its hub.
pub(crate) struct Admission<A> {
    pub(crate) pool: PoolId,
    pub(crate) generation: u64,
    pub(crate) actor: A,
    pub(crate) identity: ProducerIdentity,
    /// A child of the generation token: observes retirement, cannot cause it.
    pub(crate) generation_cancel: CancellationToken,
}

/// The next thing an admitted subscriber must do.
pub(crate) enum HubStep<H> {
    /// Subscribe to this hub.
    Ready(H),
    /// Wait for the slot to change, then step again.
    Wait(watch::Receiver<()>),
    /// Start the hub; `with_capacity` says whether a capacity unit was taken, otherwise
    /// the initialiser must reclaim one from an idle hub.
    Initialize { with_capacity: bool },
}

/// What to do with a hub whose initialisation finished.
pub(crate) enum InitOutcome<H> {
    /// Installed as Ready.
    Installed,
    /// The generation retired meanwhile: shut this hub down.
    Discard(Option<H>),
    /// Start failed and the generation is active: fence it with this reason.
    Fence(String),
}

/// An idle hub claimed for eviction.
pub(crate) struct Victim<H> {
    pub(crate) pool: PoolId,
    pub(crate) generation: u64,
    pub(crate) hub: H,
}

enum HubPhase<H> {
    Vacant,
    Initializing,
    Ready(H),
    Evicting,
    Failed(String),
    Retired,
}

struct HubSlot<H> {
    phase: HubPhase<H>,
    pending_admissions: usize,
    retirement_requested: bool,
    holds_capacity: bool,
    changed: watch::Sender<()>,
}

impl<H> HubSlot<H> {
    fn new() -> Self {
        Self {
            phase: HubPhase::Vacant,
            pending_admissions: 0,
            retirement_requested: false,
            holds_capacity: false,
            changed: watch::Sender::new(()),
        }
    }

    fn set_phase(&mut self, phase: HubPhase<H>) -> HubPhase<H> {
        let previous = std::mem::replace(&mut self.phase, phase);
        self.changed.send_replace(());
        previous
    }

    fn is_settled(&self) -> bool {
        matches!(self.phase, HubPhase::Retired | HubPhase::Failed(_))
    }
}

struct PoolEntry<A> {
    endpoint: EndpointId,
    actor: A,
    identity: ProducerIdentity,
    generation: u64,
    registrations: Arc<[CanonicalModelRegistration]>,
    query_semantics: KvQuerySemantics,
    roles: Arc<[WorkerRole]>,
    cancel: CancellationToken,
    state: EntryState,
    load: Option<PoolLoadState>,
}

impl<A> PoolEntry<A> {
    fn descriptor(&self) -> PoolDescriptor {
        PoolDescriptor {
            producer: self.identity,
            serving_endpoint: self.endpoint.clone(),
            registrations: self.registrations.to_vec(),
            query_semantics: self.query_semantics,
            pool_roles: self.roles.to_vec(),
        }
    }
}

struct Reservation {
    endpoint: EndpointId,
    generation: u64,
}

/// The registry's state; see the module docs.
pub(crate) struct RegistryCore<A, H> {
    relay: DcRelayIdentity,
    pools: BTreeMap<PoolId, PoolEntry<A>>,
    reservations: BTreeMap<PoolId, Reservation>,
    slots: BTreeMap<u64, HubSlot<H>>,
    next_generation: u64,
    catalog_revision: u64,
    accepting: bool,
    max_hubs: usize,
    hubs_in_use: usize,
    evictions: u64,
    outbox: std::collections::VecDeque<Publication>,
}

impl<A: Clone, H: SlotHub> RegistryCore<A, H> {
    /// An empty registry; layout generations start at 1.
    pub(crate) fn new(relay: DcRelayIdentity, max_hubs: usize) -> Self {
        Self {
            relay,
            pools: BTreeMap::new(),
            reservations: BTreeMap::new(),
            slots: BTreeMap::new(),
            next_generation: 1,
            catalog_revision: 0,
            accepting: true,
            max_hubs,
            hubs_in_use: 0,
            evictions: 0,
            outbox: std::collections::VecDeque::new(),
        }
    }

    /// The relay identity.
    pub(crate) fn relay(&self) -> DcRelayIdentity {
        self.relay
    }

    /// The next change to publish.
    pub(crate) fn poll_publication(&mut self) -> Option<Publication> {
        self.outbox.pop_front()
    }

    /// Reserves `pool` for `endpoint` and allocates its layout generation.
    pub(crate) fn reserve(
        &mut self,
        pool: PoolId,
        endpoint: &EndpointId,
    ) -> Result<Reserved, AttachError> {
        if !self.accepting {
            return Err(AttachError::ShuttingDown);
        }
        if let Some(owner) = self.pool_owner(pool) {
            return Err(AttachError::PoolAlreadyOwned {
                pool,
                owner: Box::new(owner.clone()),
                endpoint: Box::new(endpoint.clone()),
            });
        }
        if let Some(assigned) = self.endpoint_pool(endpoint) {
            return Err(AttachError::EndpointAlreadyAssigned {
                endpoint: Box::new(endpoint.clone()),
                assigned,
                pool,
            });
        }
        let generation = self.next_generation;
        self.next_generation = generation
            .checked_add(1)
            .ok_or(AttachError::GenerationsExhausted)?;
        self.reservations.insert(
            pool,
            Reservation {
                endpoint: endpoint.clone(),
                generation,
            },
        );
        Ok(Reserved { pool, generation })
    }

    /// Drops a reservation if it is still this generation's.
    pub(crate) fn rollback(&mut self, reserved: Reserved) {
        if self
            .reservations
            .get(&reserved.pool)
            .is_some_and(|reservation| reservation.generation == reserved.generation)
        {
            self.reservations.remove(&reserved.pool);
        }
    }

    /// True while the reservation is still live (not rolled back or retired by shutdown).
    pub(crate) fn is_reserved(&self, reserved: Reserved) -> bool {
        self.accepting
            && self
                .reservations
                .get(&reserved.pool)
                .is_some_and(|reservation| reservation.generation == reserved.generation)
    }

    /// Turns a live reservation into an Active entry and publishes it.
    pub(crate) fn commit(&mut self, commit: Commit<A>) -> Result<(), AttachError> {
        let reserved = commit.reserved;
        if !self.is_reserved(reserved) {
            return Err(AttachError::RetiredBeforeCommit {
                pool: reserved.pool,
                generation: reserved.generation,
            });
        }
        self.reservations.remove(&reserved.pool);
        let entry = PoolEntry {
            endpoint: commit.endpoint,
            actor: commit.actor,
            identity: commit.identity,
            generation: reserved.generation,
            registrations: commit.registrations,
            query_semantics: commit.query_semantics,
            roles: commit.roles,
            cancel: commit.cancel,
            state: EntryState::Active,
            load: commit.load,
        };
        let descriptor = entry.descriptor();
        self.pools.insert(reserved.pool, entry);
        self.slots.insert(reserved.generation, HubSlot::new());
        let revision = self.advance_revision();
        self.outbox.push_back(Publication::CatalogUpsert {
            revision,
            descriptor,
        });
        self.publish_load(reserved.pool);
        Ok(())
    }

    /// Replaces an active generation's registrations (already validated).
    pub(crate) fn replace_registrations(
        &mut self,
        pool: PoolId,
        generation: u64,
        registrations: Arc<[CanonicalModelRegistration]>,
    ) -> Result<(), PoolError> {
        let entry = self.active_entry_mut(pool, generation)?;
        if entry.registrations == registrations {
            return Ok(());
        }
        entry.registrations = registrations;
        let descriptor = entry.descriptor();
        let revision = self.advance_revision();
        self.outbox.push_back(Publication::CatalogUpsert {
            revision,
            descriptor,
        });
        Ok(())
    }

    /// Replaces an active generation's roles (already validated).
    pub(crate) fn replace_roles(
        &mut self,
        pool: PoolId,
        generation: u64,
        roles: Arc<[WorkerRole]>,
    ) -> Result<(), PoolError> {
        let entry = self.active_entry_mut(pool, generation)?;
        if entry.roles == roles {
            return Ok(());
        }
        entry.roles = roles;
        let descriptor = entry.descriptor();
        let revision = self.advance_revision();
        self.outbox.push_back(Publication::CatalogUpsert {
            revision,
            descriptor,
        });
        Ok(())
    }

    /// Replaces an active generation's load capacity.
    ///
    /// `Ok(false)` when the generation is not active or publishes no load; `Ok(true)` when
    /// the capacity was accepted (changed or not). Invalid capacity degrades and
    /// republishes the load snapshot, then returns the error.
    pub(crate) fn replace_load_capacity(
        &mut self,
        pool: PoolId,
        generation: u64,
        workers: &[WorkerCapacity],
    ) -> Result<bool, PoolError> {
        let Ok(entry) = self.active_entry_mut(pool, generation) else {
            return Ok(false);
        };
        let Some(load) = entry.load.as_mut() else {
            return Ok(false);
        };
        let result = load.replace_capacity(workers);
        self.publish_load(pool);
        result.map(|_| true).map_err(PoolError::from)
    }

    /// Records a load report for an active generation; false if not accepted.
    pub(crate) fn observe_load(
        &mut self,
        pool: PoolId,
        generation: u64,
        observation: LoadObservation,
    ) -> bool {
        let Ok(entry) = self.active_entry_mut(pool, generation) else {
            return false;
        };
        let Some(load) = entry.load.as_mut() else {
            return false;
        };
        match load.observe(observation) {
            LoadObservationOutcome::UnknownRank => false,
            LoadObservationOutcome::IgnoredAdvisory => true,
            LoadObservationOutcome::Updated => {
                self.publish_load(pool);
                true
            }
        }
    }

    /// Drops an active generation's load observations; false if not active or no load.
    pub(crate) fn clear_load_observations(&mut self, pool: PoolId, generation: u64) -> bool {
        let Ok(entry) = self.active_entry_mut(pool, generation) else {
            return false;
        };
        let Some(load) = entry.load.as_mut() else {
            return false;
        };
        if load.clear_observations() {
            self.publish_load(pool);
        }
        true
    }

    /// Withdraws a generation from catalog and load (once) and cancels its token.
    ///
    /// Returns `None` if `generation` is not the pool's current one; otherwise whether it
    /// was active. Fenced is sticky: a fenced generation stays fenced.
    pub(crate) fn withdraw(
        &mut self,
        pool: PoolId,
        generation: u64,
        mode: RetirementMode,
    ) -> Option<bool> {
        let entry = self
            .pools
            .get_mut(&pool)
            .filter(|entry| entry.generation == generation)?;
        let was_active = entry.state == EntryState::Active;
        entry.state = match (entry.state, mode) {
            (EntryState::Fenced, _) | (_, RetirementMode::Fenced) => EntryState::Fenced,
            _ => EntryState::Withdrawn,
        };
        entry.cancel.cancel();
        if was_active {
            let revision = self.advance_revision();
            self.outbox
                .push_back(Publication::CatalogRemove { revision, pool });
            self.publish_load(pool);
        }
        Some(was_active)
    }

    /// Marks a generation's hub slot for retirement; returns a Ready hub to shut down.
    pub(crate) fn retire_slot(&mut self, generation: u64) -> Option<H> {
        let slot = self.slots.get_mut(&generation)?;
        slot.retirement_requested = true;
        let hub = match slot.phase {
            HubPhase::Ready(_) => match slot.set_phase(HubPhase::Retired) {
                HubPhase::Ready(hub) => Some(hub),
                _ => None,
            },
            HubPhase::Vacant | HubPhase::Failed(_) => {
                slot.set_phase(HubPhase::Retired);
                None
            }
            HubPhase::Initializing | HubPhase::Evicting | HubPhase::Retired => None,
        };
        self.release_slot_capacity(generation);
        self.collect_slot(generation);
        hub
    }

    /// A receiver that changes whenever the slot does, or `None` once it has settled
    /// (Retired or Failed) or is gone.
    pub(crate) fn unsettled_slot(&self, generation: u64) -> Option<watch::Receiver<()>> {
        let slot = self.slots.get(&generation)?;
        (!slot.is_settled()).then(|| slot.changed.subscribe())
    }

    /// Removes a generation's entry (withdrawing it first if still active).
    /// Returns the entry's actor if removed.
    pub(crate) fn remove(&mut self, pool: PoolId, generation: u64) -> Option<A> {
        let entry = self
            .pools
            .get(&pool)
            .filter(|entry| entry.generation == generation)?;
        let was_active = entry.state == EntryState::Active;
        let entry = self.pools.remove(&pool)?;
        entry.cancel.cancel();
        if was_active {
            let revision = self.advance_revision();
            self.outbox
                .push_back(Publication::CatalogRemove { revision, pool });
        }
        self.outbox.push_back(Publication::LoadRemove { pool });
        self.collect_slot(generation);
        Some(entry.actor)
    }

    /// Stops accepting, drops reservations, clears catalog and load and returns every
    /// entry's generation, token and actor for the shell to fence.
    pub(crate) fn shutdown(&mut self) -> Vec<(PoolId, u64, CancellationToken, A)> {
        self.accepting = false;
        self.reservations.clear();
        let entries = std::mem::take(&mut self.pools);
        let revision = self.advance_revision();
        self.outbox
            .push_back(Publication::CatalogClear { revision });
        self.outbox.push_back(Publication::LoadClear);
        entries
            .into_iter()
            .map(|(pool, entry)| (pool, entry.generation, entry.cancel, entry.actor))
            .collect()
    }

    /// Admits a subscriber of `expected`: the generation must be active and equal, its
    /// slot not retired. Counts a pending admission that protects the hub from eviction
    /// until [`Self::end_admission`].
    pub(crate) fn begin_admission(
        &mut self,
        expected: &ProducerIdentity,
    ) -> Result<Admission<A>, SubscribeError> {
        let pool = *expected.pool_id();
        let entry = self.active_producer(expected)?;
        let generation = entry.generation;
        let admission = Admission {
            pool,
            generation,
            actor: entry.actor.clone(),
            identity: entry.identity,
            generation_cancel: entry.cancel.child_token(),
        };
        let slot = self.slots.get_mut(&generation).ok_or_else(retired)?;
        if slot.retirement_requested || matches!(slot.phase, HubPhase::Retired) {
            return Err(retired());
        }
        slot.pending_admissions =
            slot.pending_admissions
                .checked_add(1)
                .ok_or_else(|| SubscribeError::Unavailable {
                    reason: "pool publication admission counter exhausted".to_owned(),
                })?;
        Ok(admission)
    }

    /// Ends a pending admission begun by [`Self::begin_admission`].
    pub(crate) fn end_admission(&mut self, generation: u64) {
        if let Some(slot) = self.slots.get_mut(&generation) {
            slot.pending_admissions = slot.pending_admissions.saturating_sub(1);
        }
    }

    /// The generation token child of an active producer, without admitting anything.
    pub(crate) fn active_generation_token(
        &self,
        expected: &ProducerIdentity,
    ) -> Result<CancellationToken, SubscribeError> {
        Ok(self.active_producer(expected)?.cancel.child_token())
    }

    /// Advances an admitted subscriber; see [`HubStep`]. `attempted` says whether this
    /// subscriber already started an initialisation that fell back to Vacant.
    pub(crate) fn hub_step(
        &mut self,
        admission: &Admission<A>,
        attempted: bool,
    ) -> Result<HubStep<H>, SubscribeError> {
        let current = self
            .pools
            .get(&admission.pool)
            .filter(|entry| entry.state == EntryState::Active)
            .ok_or(SubscribeError::UnknownPool {
                pool: admission.pool,
            })?;
        if current.generation != admission.generation {
            return Err(SubscribeError::Unavailable {
                reason: "pool publication generation changed".to_owned(),
            });
        }
        let has_room = self.hubs_in_use < self.max_hubs;
        let max_hubs = self.max_hubs;
        let slot = self
            .slots
            .get_mut(&admission.generation)
            .ok_or_else(retired)?;
        match &slot.phase {
            HubPhase::Ready(hub) => Ok(HubStep::Ready(hub.clone())),
            HubPhase::Failed(reason) => Err(SubscribeError::Unavailable {
                reason: reason.clone(),
            }),
            HubPhase::Retired => Err(retired()),
            HubPhase::Initializing | HubPhase::Evicting => {
                Ok(HubStep::Wait(slot.changed.subscribe()))
            }
            HubPhase::Vacant if attempted => {
                Err(SubscribeError::InitializedHubLimit { limit: max_hubs })
            }
            HubPhase::Vacant => {
                slot.set_phase(HubPhase::Initializing);
                if has_room {
                    slot.holds_capacity = true;
                    self.hubs_in_use += 1;
                }
                Ok(HubStep::Initialize {
                    with_capacity: has_room,
                })
            }
        }
    }

    /// Takes a free capacity unit for an initialising slot; false if none is free or the
    /// slot is no longer initialising.
    pub(crate) fn try_take_capacity(&mut self, generation: u64) -> bool {
        if self.hubs_in_use >= self.max_hubs {
            return false;
        }
        let Some(slot) = self.slots.get_mut(&generation) else {
            return false;
        };
        if !matches!(slot.phase, HubPhase::Initializing)
            || slot.retirement_requested
            || slot.holds_capacity
        {
            return false;
        }
        slot.holds_capacity = true;
        self.hubs_in_use += 1;
        true
    }

    /// Claims one idle Ready hub of another active generation for eviction: no
    /// subscriber, no pending admission, no retirement requested. Its capacity unit moves
    /// to the eviction until [`Self::finish_eviction`].
    pub(crate) fn claim_idle_victim(&mut self, requester: u64) -> Option<Victim<H>> {
        let candidates: Vec<(PoolId, u64)> = self
            .pools
            .iter()
            .filter(|(_, entry)| entry.state == EntryState::Active && entry.generation != requester)
            .map(|(pool, entry)| (*pool, entry.generation))
            .collect();
        for (pool, generation) in candidates {
            let Some(slot) = self.slots.get_mut(&generation) else {
                continue;
            };
            if slot.retirement_requested || slot.pending_admissions != 0 {
                continue;
            }
            let HubPhase::Ready(hub) = &slot.phase else {
                continue;
            };
            if !hub.is_idle() {
                continue;
            }
            let HubPhase::Ready(hub) = slot.set_phase(HubPhase::Evicting) else {
                continue;
            };
            slot.holds_capacity = false;
            return Some(Victim {
                pool,
                generation,
                hub,
            });
        }
        None
    }

    /// Ends an eviction: the victim becomes Vacant (or Retired if its generation retired
    /// meanwhile); its capacity unit goes to the requester if it is still initialising
    /// without one (returns true), otherwise it is released.
    pub(crate) fn finish_eviction(&mut self, victim: u64, requester: u64) -> bool {
        self.evictions = self.evictions.saturating_add(1);
        let victim_active = self.generation_is_active(victim);
        if let Some(slot) = self.slots.get_mut(&victim)
            && matches!(slot.phase, HubPhase::Evicting)
        {
            let next = if slot.retirement_requested || !victim_active {
                HubPhase::Retired
            } else {
                HubPhase::Vacant
            };
            slot.set_phase(next);
        }
        self.collect_slot(victim);
        let granted = match self.slots.get_mut(&requester) {
            Some(slot)
                if matches!(slot.phase, HubPhase::Initializing)
                    && !slot.retirement_requested
                    && !slot.holds_capacity =>
            {
                slot.holds_capacity = true;
                true
            }
            _ => false,
        };
        if !granted {
            self.hubs_in_use = self.hubs_in_use.saturating_sub(1);
        }
        granted
    }

    /// Ends an initialisation that could not get capacity or was cancelled: Vacant again
    /// (Retired if `retired` or retirement was requested); releases any capacity held.
    pub(crate) fn abort_initialization(&mut self, generation: u64, retired: bool) {
        if let Some(slot) = self.slots.get_mut(&generation)
            && matches!(slot.phase, HubPhase::Initializing)
        {
            let next = if retired || slot.retirement_requested {
                HubPhase::Retired
            } else {
                HubPhase::Vacant
            };
            slot.set_phase(next);
        }
        self.release_slot_capacity(generation);
        self.collect_slot(generation);
    }

    /// Ends an initialisation that produced a hub or failed.
    pub(crate) fn finish_initialization(
        &mut self,
        generation: u64,
        result: Result<H, String>,
    ) -> InitOutcome<H> {
        let active = self.generation_is_active(generation);
        let Some(slot) = self.slots.get_mut(&generation) else {
            return InitOutcome::Discard(result.ok());
        };
        if !matches!(slot.phase, HubPhase::Initializing) || slot.retirement_requested || !active {
            if matches!(slot.phase, HubPhase::Initializing) {
                slot.set_phase(HubPhase::Retired);
            }
            self.release_slot_capacity(generation);
            self.collect_slot(generation);
            return InitOutcome::Discard(result.ok());
        }
        match result {
            Ok(hub) => {
                slot.set_phase(HubPhase::Ready(hub));
                InitOutcome::Installed
            }
            Err(reason) => {
                slot.set_phase(HubPhase::Failed(reason.clone()));
                self.release_slot_capacity(generation);
                InitOutcome::Fence(reason)
            }
        }
    }

    /// Idle hubs evicted so far.
    pub(crate) fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Capacity units in use (tests and stats).
    pub(crate) fn hubs_in_use(&self) -> usize {
        self.hubs_in_use
    }

    #[cfg(test)]
    /// The phase name of a generation's slot: "vacant", "initializing", "ready",
    /// "evicting", "failed" or "retired" (also when the slot is gone).
    pub(crate) fn slot_phase(&self, generation: u64) -> &'static str {
        match self.slots.get(&generation).map(|slot| &slot.phase) {
            Some(HubPhase::Vacant) => "vacant",
            Some(HubPhase::Initializing) => "initializing",
            Some(HubPhase::Ready(_)) => "ready",
            Some(HubPhase::Evicting) => "evicting",
            Some(HubPhase::Failed(_)) => "failed",
            Some(HubPhase::Retired) | None => "retired",
        }
    }

    /// Number of attached entries (any state).
    pub(crate) fn pool_count(&self) -> usize {
        self.pools.len()
    }

    /// Number of live reservations.
    pub(crate) fn reservation_count(&self) -> usize {
        self.reservations.len()
    }

    /// The current generation of a pool and its state.
    pub(crate) fn generation_of(&self, pool: PoolId) -> Option<(u64, EntryState)> {
        self.pools
            .get(&pool)
            .map(|entry| (entry.generation, entry.state))
    }

    fn active_producer(
        &self,
        expected: &ProducerIdentity,
    ) -> Result<&PoolEntry<A>, SubscribeError> {
        let pool = *expected.pool_id();
        let entry = self
            .pools
            .get(&pool)
            .filter(|entry| entry.state == EntryState::Active)
            .ok_or(SubscribeError::UnknownPool { pool })?;
        if entry.identity != *expected {
            return Err(SubscribeError::ProducerMismatch {
                pool,
                expected_generation: expected.layout_generation(),
                current_generation: entry.generation,
            });
        }
        Ok(entry)
    }

    fn generation_is_active(&self, generation: u64) -> bool {
        self.pools
            .values()
            .any(|entry| entry.generation == generation && entry.state == EntryState::Active)
    }

    fn release_slot_capacity(&mut self, generation: u64) {
        if let Some(slot) = self.slots.get_mut(&generation)
            && slot.holds_capacity
            && !matches!(slot.phase, HubPhase::Initializing | HubPhase::Ready(_))
        {
            slot.holds_capacity = false;
            self.hubs_in_use = self.hubs_in_use.saturating_sub(1);
        }
    }

    /// Forgets a settled slot whose entry is gone.
    fn collect_slot(&mut self, generation: u64) {
        let entry_exists = self
            .pools
            .values()
            .any(|entry| entry.generation == generation);
        if entry_exists {
            return;
        }
        if self.slots.get(&generation).is_some_and(HubSlot::is_settled) {
            self.slots.remove(&generation);
        }
    }

    fn active_entry_mut(
        &mut self,
        pool: PoolId,
        generation: u64,
    ) -> Result<&mut PoolEntry<A>, PoolError> {
        let entry = self
            .pools
            .get_mut(&pool)
            .ok_or(PoolError::NotAttached { pool })?;
        if entry.generation != generation || entry.state != EntryState::Active {
            return Err(PoolError::GenerationInactive { pool, generation });
        }
        Ok(entry)
    }

    fn advance_revision(&mut self) -> u64 {
        self.catalog_revision = self.catalog_revision.saturating_add(1);
        self.catalog_revision
    }

    fn publish_load(&mut self, pool: PoolId) {
        let snapshot = self
            .pools
            .get(&pool)
            .filter(|entry| entry.state == EntryState::Active)
            .and_then(|entry| {
                entry
                    .load
                    .as_ref()
                    .map(|load| load.snapshot(entry.identity))
            });
        self.outbox.push_back(match snapshot {
            Some(snapshot) => Publication::LoadSet { snapshot },
            None => Publication::LoadRemove { pool },
        });
    }

    fn pool_owner(&self, pool: PoolId) -> Option<&EndpointId> {
        self.pools
            .get(&pool)
            .map(|entry| &entry.endpoint)
            .or_else(|| {
                self.reservations
                    .get(&pool)
                    .map(|reservation| &reservation.endpoint)
            })
    }

    fn endpoint_pool(&self, endpoint: &EndpointId) -> Option<PoolId> {
        self.pools
            .iter()
            .find_map(|(pool, entry)| (&entry.endpoint == endpoint).then_some(*pool))
            .or_else(|| {
                self.reservations.iter().find_map(|(pool, reservation)| {
                    (&reservation.endpoint == endpoint).then_some(*pool)
                })
            })
    }
}

fn retired() -> SubscribeError {
    SubscribeError::Unavailable {
        reason: "pool generation retired".to_owned(),
    }
}

/// Applies one publication to the watched catalog; true if it changed.
pub(crate) fn apply_to_catalog(catalog: &mut PoolCatalog, publication: &Publication) -> bool {
    match publication {
        Publication::CatalogUpsert {
            revision,
            descriptor,
        } => catalog.upsert(*revision, descriptor.clone()),
        Publication::CatalogRemove { revision, pool } => catalog.remove(*revision, *pool),
        Publication::CatalogClear { revision } => catalog.clear(*revision),
        _ => return false,
    }
    true
}

/// Applies one publication to the watched load view (sorted by pool); true if it changed.
pub(crate) fn apply_to_load(load: &mut Vec<PoolLoadSnapshot>, publication: &Publication) -> bool {
    match publication {
        Publication::LoadSet { snapshot } => {
            let pool = *snapshot.producer.pool_id();
            match load.binary_search_by_key(&pool, |item| *item.producer.pool_id()) {
                Ok(index) if load[index] == *snapshot => false,
                Ok(index) => {
                    load[index] = *snapshot;
                    true
                }
                Err(index) => {
                    load.insert(index, *snapshot);
                    true
                }
            }
        }
        Publication::LoadRemove { pool } => {
            match load.binary_search_by_key(pool, |item| *item.producer.pool_id()) {
                Ok(index) => {
                    load.remove(index);
                    true
                }
                Err(_) => false,
            }
        }
        Publication::LoadClear => {
            let changed = !load.is_empty();
            load.clear();
            changed
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    //! The decision core driven without a runtime.

    use kvrelay_identity::{
        CacheSemanticsId, CkfFormat, DcId, IdentitySource, IndexerDomainId, KvQueryHashFormat,
        RoutingScopeId,
    };

    use super::*;

    #[derive(Clone)]
    struct TestHub {
        idle: bool,
    }

    impl SlotHub for TestHub {
        fn is_idle(&self) -> bool {
            self.idle
        }
    }

    type Core = RegistryCore<(), TestHub>;

    fn pool(seed: u8) -> PoolId {
        PoolId {
            indexer_domain: IndexerDomainId {
                cache_semantics: CacheSemanticsId::new([seed; 16], IdentitySource::Explicit),
                routing_scope: RoutingScopeId::new([seed; 16], IdentitySource::DefaultDerived),
            },
            dc_id: DcId(1),
        }
    }

    fn endpoint(name: &str) -> EndpointId {
        format!("ns.{name}.generate").parse().unwrap()
    }

    fn attach(core: &mut Core, seed: u8) -> ProducerIdentity {
        let reserved = core
            .reserve(pool(seed), &endpoint(&seed.to_string()))
            .unwrap();
        let identity = ProducerIdentity::new(
            pool(seed),
            7,
            reserved.generation,
            CkfFormat::v1(1, 16).unwrap(),
        )
        .unwrap();
        core.commit(Commit {
            reserved,
            endpoint: endpoint(&seed.to_string()),
            actor: (),
            identity,
            registrations: Arc::from(Vec::new()),
            query_semantics: KvQuerySemantics::new(16, KvQueryHashFormat::DynamoStandardV1)
                .unwrap(),
            roles: Arc::from(vec![WorkerRole::Aggregated]),
            load: None,
            cancel: CancellationToken::new(),
        })
        .unwrap();
        while core.poll_publication().is_some() {}
        identity
    }

    fn step(core: &mut Core, admission: &Admission<()>, attempted: bool) -> &'static str {
        match core.hub_step(admission, attempted) {
            Ok(HubStep::Ready(_)) => "ready",
            Ok(HubStep::Wait(_)) => "wait",
            Ok(HubStep::Initialize {
                with_capacity: true,
            }) => "initialize",
            Ok(HubStep::Initialize {
                with_capacity: false,
            }) => "reclaim",
            Err(SubscribeError::InitializedHubLimit { .. }) => "limit",
            Err(_) => "error",
        }
    }

    #[test]
    fn layout_generations_start_at_one_and_never_repeat() {
        let mut core = Core::new(DcRelayIdentity::new(1, 2), 4);
        let first = core.reserve(pool(1), &endpoint("a")).unwrap();
        core.rollback(first);
        let second = core.reserve(pool(1), &endpoint("a")).unwrap();
        assert_eq!((first.generation, second.generation), (1, 2));
    }

    #[test]
    fn a_reservation_blocks_its_pool_and_its_endpoint() {
        let mut core = Core::new(DcRelayIdentity::new(1, 2), 4);
        core.reserve(pool(1), &endpoint("a")).unwrap();
        assert!(matches!(
            core.reserve(pool(1), &endpoint("b")),
            Err(AttachError::PoolAlreadyOwned { .. })
        ));
        assert!(matches!(
            core.reserve(pool(2), &endpoint("a")),
            Err(AttachError::EndpointAlreadyAssigned { .. })
        ));
    }

    #[test]
    fn catalog_revision_advances_once_per_change() {
        let mut core = Core::new(DcRelayIdentity::new(1, 2), 4);
        let identity = attach(&mut core, 1);
        assert_eq!(
            core.withdraw(
                *identity.pool_id(),
                identity.layout_generation(),
                RetirementMode::Graceful
            ),
            Some(true)
        );
        let revisions: Vec<u64> = std::iter::from_fn(|| core.poll_publication())
            .filter_map(|publication| match publication {
                Publication::CatalogRemove { revision, .. } => Some(revision),
                _ => None,
            })
            .collect();
        assert_eq!(revisions, [2]);
        assert_eq!(
            core.withdraw(
                *identity.pool_id(),
                identity.layout_generation(),
                RetirementMode::Fenced
            ),
            Some(false)
        );
        assert!(
            std::iter::from_fn(|| core.poll_publication())
                .all(|p| !matches!(p, Publication::CatalogRemove { .. }))
        );
        assert_eq!(
            core.generation_of(*identity.pool_id())
                .map(|(_, state)| state),
            Some(EntryState::Fenced)
        );
    }

    #[test]
    fn capacity_units_follow_hub_slots_through_eviction() {
        let mut core = Core::new(DcRelayIdentity::new(1, 2), 1);
        let first = attach(&mut core, 1);
        let second = attach(&mut core, 2);
        let a = core.begin_admission(&first).unwrap();
        assert_eq!(step(&mut core, &a, false), "initialize");
        assert!(matches!(
            core.finish_initialization(a.generation, Ok(TestHub { idle: true })),
            InitOutcome::Installed
        ));
        assert_eq!(step(&mut core, &a, false), "ready");
        core.end_admission(a.generation);

        let b = core.begin_admission(&second).unwrap();
        assert_eq!(step(&mut core, &b, false), "reclaim");
        assert!(!core.try_take_capacity(b.generation));
        let victim = core.claim_idle_victim(b.generation).unwrap();
        assert_eq!(victim.generation, a.generation);
        assert_eq!(core.slot_phase(a.generation), "evicting");
        assert!(
            core.claim_idle_victim(b.generation).is_none(),
            "one victim per unit"
        );
        assert!(core.finish_eviction(victim.generation, b.generation));
        assert_eq!(core.slot_phase(a.generation), "vacant");
        assert_eq!(core.hubs_in_use(), 1);
        assert!(matches!(
            core.finish_initialization(b.generation, Ok(TestHub { idle: false })),
            InitOutcome::Installed
        ));
        core.end_admission(b.generation);

        // A busy hub is never a victim: the next pool hits the limit.
        let again = core.begin_admission(&first).unwrap();
        assert_eq!(step(&mut core, &again, false), "reclaim");
        assert!(core.claim_idle_victim(again.generation).is_none());
        core.abort_initialization(again.generation, false);
        assert_eq!(step(&mut core, &again, true), "limit");
        assert_eq!(core.hubs_in_use(), 1);
    }

    #[test]
    fn retirement_releases_capacity_and_discards_a_late_hub() {
        let mut core = Core::new(DcRelayIdentity::new(1, 2), 2);
        let first = attach(&mut core, 1);
        let a = core.begin_admission(&first).unwrap();
        assert_eq!(step(&mut core, &a, false), "initialize");
        assert_eq!(core.hubs_in_use(), 1);
        core.withdraw(
            *first.pool_id(),
            first.layout_generation(),
            RetirementMode::Fenced,
        );
        assert!(
            core.retire_slot(a.generation).is_none(),
            "still initializing"
        );
        assert!(matches!(
            core.finish_initialization(a.generation, Ok(TestHub { idle: true })),
            InitOutcome::Discard(Some(_))
        ));
        assert_eq!(core.slot_phase(a.generation), "retired");
        assert_eq!(core.hubs_in_use(), 0);
    }

    #[test]
    fn a_failed_start_fences_only_an_active_generation() {
        let mut core = Core::new(DcRelayIdentity::new(1, 2), 2);
        let first = attach(&mut core, 1);
        let a = core.begin_admission(&first).unwrap();
        step(&mut core, &a, false);
        assert!(matches!(
            core.finish_initialization(a.generation, Err("boom".to_owned())),
            InitOutcome::Fence(_)
        ));
        assert_eq!(core.slot_phase(a.generation), "failed");
        assert_eq!(core.hubs_in_use(), 0);
        assert!(matches!(step(&mut core, &a, false), "error"));
    }
}
