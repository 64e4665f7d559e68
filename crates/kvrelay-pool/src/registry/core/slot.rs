//! Hub slots: one per layout generation, the lazy-hub state machine and the accounting of
//! initialized-hub capacity (see the parent module's docs for the phase diagram).

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::{EntryState, RegistryCore};
use crate::error::{HubFailure, SubscribeError, Unavailability};
use kvrelay_identity::{PoolId, ProducerIdentity};

/// What a hub handle must tell the core.
pub(crate) trait SlotHub: Clone {
    /// True when the hub has no subscriber (it may be evicted).
    fn is_idle(&self) -> bool;
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
    Fence(HubFailure),
}

/// An idle hub claimed for eviction.
pub(crate) struct Victim<H> {
    pub(crate) pool: PoolId,
    pub(crate) generation: u64,
    pub(crate) hub: H,
}

pub(super) enum HubPhase<H> {
    Vacant,
    Initializing,
    Ready(H),
    Evicting,
    Failed(HubFailure),
    Retired,
}

pub(super) struct HubSlot<H> {
    pub(super) phase: HubPhase<H>,
    pub(super) pending_admissions: usize,
    pub(super) retirement_requested: bool,
    pub(super) holds_capacity: bool,
    pub(super) changed: watch::Sender<()>,
}

impl<H> HubSlot<H> {
    pub(super) fn new() -> Self {
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

impl<A: Clone, H: SlotHub> RegistryCore<A, H> {
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
        let slot = self
            .slots
            .get_mut(&generation)
            .ok_or_else(SubscribeError::retired)?;
        if slot.retirement_requested || matches!(slot.phase, HubPhase::Retired) {
            return Err(SubscribeError::retired());
        }
        slot.pending_admissions =
            slot.pending_admissions
                .checked_add(1)
                .ok_or(SubscribeError::Unavailable {
                    reason: Unavailability::AdmissionsExhausted,
                })?;
        Ok(admission)
    }

    /// Ends a pending admission begun by [`Self::begin_admission`].
    pub(crate) fn end_admission(&mut self, generation: u64) {
        if let Some(slot) = self.slots.get_mut(&generation) {
            slot.pending_admissions = slot.pending_admissions.saturating_sub(1);
        }
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
                reason: Unavailability::GenerationChanged,
            });
        }
        let has_room = self.hubs_in_use < self.max_hubs;
        let max_hubs = self.max_hubs;
        let slot = self
            .slots
            .get_mut(&admission.generation)
            .ok_or_else(SubscribeError::retired)?;
        match &slot.phase {
            HubPhase::Ready(hub) => Ok(HubStep::Ready(hub.clone())),
            HubPhase::Failed(reason) => Err(SubscribeError::Unavailable {
                reason: Unavailability::HubFailed(reason.clone()),
            }),
            HubPhase::Retired => Err(SubscribeError::retired()),
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
        result: Result<H, HubFailure>,
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

    pub(super) fn release_slot_capacity(&mut self, generation: u64) {
        if let Some(slot) = self.slots.get_mut(&generation)
            && slot.holds_capacity
            && !matches!(slot.phase, HubPhase::Initializing | HubPhase::Ready(_))
        {
            slot.holds_capacity = false;
            self.hubs_in_use = self.hubs_in_use.saturating_sub(1);
        }
    }

    /// Forgets a settled slot whose entry is gone.
    pub(super) fn collect_slot(&mut self, generation: u64) {
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
}
