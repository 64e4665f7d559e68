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
use tokio_util::sync::CancellationToken;

mod slot;

use self::slot::HubSlot;
pub(crate) use self::slot::{HubStep, InitOutcome, SlotHub};
use crate::catalog::{PoolCatalog, PoolDescriptor, TierLaneDescriptor};
use crate::error::{AttachError, PoolError, SubscribeError};
use crate::load::{
    LoadObservation, LoadObservationOutcome, PoolLoadSnapshot, PoolLoadState, WorkerCapacity,
};

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
    /// For a lower-tier lane: the pool it belongs to (not published on its own).
    pub(crate) lane_of: Option<PoolId>,
    /// For a pool: its lanes, published in its descriptor.
    pub(crate) tier_lanes: Vec<TierLaneDescriptor>,
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
    /// Its filter table's bytes, counted against `max_filter_bytes`.
    filter_bytes: u64,
    /// For a lower-tier lane: the pool it belongs to. A lane is subscribable like a pool
    /// but never in the catalog on its own (its pool's descriptor names it) and has no
    /// endpoint of its own.
    lane_of: Option<PoolId>,
    tier_lanes: Vec<TierLaneDescriptor>,
}

impl<A> PoolEntry<A> {
    fn descriptor(&self) -> PoolDescriptor {
        PoolDescriptor {
            producer: self.identity,
            serving_endpoint: self.endpoint.clone(),
            registrations: self.registrations.to_vec(),
            query_semantics: self.query_semantics,
            pool_roles: self.roles.to_vec(),
            tier_lanes: self.tier_lanes.clone(),
        }
    }

    /// Whether the catalog and load views show this entry (a pool, not a lane).
    fn is_published(&self) -> bool {
        self.lane_of.is_none()
    }
}

struct Reservation {
    endpoint: EndpointId,
    generation: u64,
    filter_bytes: u64,
    /// A lane's reservation: it shares its pool's endpoint, so it owns no endpoint.
    lane: bool,
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
    /// Pools (entries plus reservations) held at once.
    max_pools: usize,
    /// Filter table bytes (entries plus reservations) held at once.
    max_filter_bytes: u64,
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
            max_pools: crate::limits::DEFAULT_MAX_POOLS,
            max_filter_bytes: crate::limits::DEFAULT_MAX_FILTER_BYTES_TOTAL,
        }
    }

    /// The same registry holding at most `max_filter_bytes` of filter tables.
    pub(crate) fn with_max_filter_bytes(self, max_filter_bytes: u64) -> Self {
        Self {
            max_filter_bytes,
            ..self
        }
    }

    /// Filter table bytes of every attached and attaching pool.
    pub(crate) fn filter_bytes_in_use(&self) -> u64 {
        let attached = self.pools.values().map(|entry| entry.filter_bytes);
        let attaching = self.reservations.values().map(|r| r.filter_bytes);
        attached.chain(attaching).fold(0, u64::saturating_add)
    }

    /// The same registry holding at most `max_pools` pools (entries plus reservations).
    pub(crate) fn with_max_pools(self, max_pools: usize) -> Self {
        Self { max_pools, ..self }
    }

    /// The relay identity.
    pub(crate) fn relay(&self) -> DcRelayIdentity {
        self.relay
    }

    /// The next change to publish.
    pub(crate) fn poll_publication(&mut self) -> Option<Publication> {
        self.outbox.pop_front()
    }

    /// Reserves `pool` for `endpoint`, with a filter table of `filter_bytes`, and
    /// allocates its layout generation.
    pub(crate) fn reserve(
        &mut self,
        pool: PoolId,
        endpoint: &EndpointId,
        filter_bytes: u64,
    ) -> Result<Reserved, AttachError> {
        self.reserve_entry(pool, endpoint, filter_bytes, false)
    }

    /// Reserves a lower-tier lane of the pool `endpoint` is reserving: the same bounds
    /// (pools, filter bytes), but the endpoint stays its pool's.
    pub(crate) fn reserve_lane(
        &mut self,
        lane: PoolId,
        endpoint: &EndpointId,
        filter_bytes: u64,
    ) -> Result<Reserved, AttachError> {
        self.reserve_entry(lane, endpoint, filter_bytes, true)
    }

    fn reserve_entry(
        &mut self,
        pool: PoolId,
        endpoint: &EndpointId,
        filter_bytes: u64,
        lane: bool,
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
        if let Some(assigned) = self.endpoint_pool(endpoint).filter(|_| !lane) {
            return Err(AttachError::EndpointAlreadyAssigned {
                endpoint: Box::new(endpoint.clone()),
                assigned,
                pool,
            });
        }
        if self.pools.len() + self.reservations.len() >= self.max_pools {
            return Err(AttachError::PoolLimit {
                pool,
                limit: self.max_pools,
            });
        }
        let in_use = self.filter_bytes_in_use();
        if in_use.saturating_add(filter_bytes) > self.max_filter_bytes {
            return Err(AttachError::FilterMemoryLimit {
                pool,
                bytes: filter_bytes,
                in_use,
                limit: self.max_filter_bytes,
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
                filter_bytes,
                lane,
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
        let filter_bytes = self
            .reservations
            .remove(&reserved.pool)
            .map_or(0, |reservation| reservation.filter_bytes);
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
            filter_bytes,
            lane_of: commit.lane_of,
            tier_lanes: commit.tier_lanes,
        };
        let descriptor = entry.descriptor();
        let published = entry.is_published();
        self.pools.insert(reserved.pool, entry);
        self.slots.insert(reserved.generation, HubSlot::new());
        if !published {
            return Ok(());
        }
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
        let published = entry.is_published();
        entry.state = match (entry.state, mode) {
            (EntryState::Fenced, _) | (_, RetirementMode::Fenced) => EntryState::Fenced,
            _ => EntryState::Withdrawn,
        };
        entry.cancel.cancel();
        if was_active && published {
            let revision = self.advance_revision();
            self.outbox
                .push_back(Publication::CatalogRemove { revision, pool });
            self.publish_load(pool);
        }
        Some(was_active)
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
        if was_active && entry.is_published() {
            let revision = self.advance_revision();
            self.outbox
                .push_back(Publication::CatalogRemove { revision, pool });
        }
        if entry.is_published() {
            self.outbox.push_back(Publication::LoadRemove { pool });
        }
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

    /// The generation token child of an active producer, without admitting anything.
    pub(crate) fn active_generation_token(
        &self,
        expected: &ProducerIdentity,
    ) -> Result<CancellationToken, SubscribeError> {
        Ok(self.active_producer(expected)?.cancel.child_token())
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
            .find_map(|(pool, entry)| {
                (entry.is_published() && &entry.endpoint == endpoint).then_some(*pool)
            })
            .or_else(|| {
                self.reservations.iter().find_map(|(pool, reservation)| {
                    (!reservation.lane && &reservation.endpoint == endpoint).then_some(*pool)
                })
            })
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
mod tests;
