//! Lower-tier lanes: what a pool's workers hold in host memory or on disk.
//!
//! A pool's device filter ([`PoolFilter`]) is unchanged by tiers: device events go there
//! exactly as before. Each lower tier a pool keeps gets its own [`TierLane`], a second
//! producer filter with the same ownership rules, fed [`TierEvent`]s:
//!
//! - a **stored chain** carries token hashes and chains inside the tier (its parent is a
//!   block the source reported on the same tier), so its canonical hashes are derived as
//!   on device;
//! - an **offload** names device blocks by engine id (vLLM's offloading connector sends
//!   no tokens, and keys an offloaded block of `k` device blocks by the last one). Each
//!   id takes the canonical hash the source's *device* lineage holds for it at that
//!   moment; an id the device lineage does not hold (evicted before the offload was
//!   reported, or never reported) is dropped and counted, never guessed;
//! - removals and clears act on the tier's own lineage, so a block evicted from device
//!   memory stays in the lane until the tier evicts it too.
//!
//! The lane's canonical hashes are those of the device block each offloaded block ends
//! with, so a lane of `k`-block offloads holds every `k`-th prefix position: consumers
//! probe it at that stride (the catalog names each lane's block size).

use crate::counters::ApplyOutcome;
use crate::event::{CacheTier, SourceId, StoredBlocks, TierChange, TierEvent};
use crate::format::{CkfConfig, ConfigError};
use crate::ownership::{ApplyError, PoolFilter};

/// Counters a lane keeps beside its filter's own.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierCounters {
    /// Offloaded blocks whose device block was found (mapped or re-offered).
    pub offloads_resolved: u64,
    /// Offloaded blocks whose engine id named no block of the source's device lineage:
    /// dropped (the lane never guesses a block's prefix).
    pub offloads_unmapped: u64,
}

/// What applying one tier event did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierOutcome {
    /// The lane filter's outcome (zero when nothing reached it).
    pub applied: ApplyOutcome,
    /// Offloaded blocks of this event that were dropped as unmapped.
    pub unmapped: u64,
}

/// Why a tier event was rejected. The lane is unchanged (but for counters).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TierApplyError {
    /// The event is about another tier than the lane's (a routing bug of the caller).
    #[error("event for the {event} tier handed to the {lane} lane")]
    WrongTier {
        /// The lane's tier.
        lane: CacheTier,
        /// The event's tier.
        event: CacheTier,
    },
    /// The lane's filter rejected the event.
    #[error(transparent)]
    Filter(#[from] ApplyError),
}

/// One lower tier of one pool: its producer filter and counters.
///
/// ```
/// use kvrelay_ckf::tier::TierLane;
/// use kvrelay_ckf::{CacheTier, CkfConfig, EventPayload, PoolFilter, RouterEvent, SourceId};
/// use kvrelay_ckf::{StoredBlock, StoredBlocks, TierChange, TierEvent};
/// let source = SourceId::new(7, 0);
/// let mut device = PoolFilter::new(CkfConfig::new(1024))?;
/// device.apply(&RouterEvent {
///     source,
///     event_id: 1,
///     payload: EventPayload::Stored(StoredBlocks {
///         parent_engine_block_id: None,
///         blocks: vec![StoredBlock { engine_block_id: 100, token_hash: 11 }],
///     }),
/// })?;
/// let mut host = TierLane::new(CacheTier::Host, CkfConfig::new(1024))?;
/// let offload = TierEvent {
///     source,
///     event_id: 2,
///     tier: CacheTier::Host,
///     change: TierChange::Offloaded { engine_block_ids: vec![100, 555] },
/// };
/// let outcome = host.apply(&device, &offload)?;
/// assert_eq!(outcome.unmapped, 1); // 555 was never on the device
/// assert!(host.filter().contains(11));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct TierLane {
    tier: CacheTier,
    filter: PoolFilter,
    counters: TierCounters,
}

impl TierLane {
    /// An empty lane for `tier` with a filter of `config`.
    pub fn new(tier: CacheTier, config: CkfConfig) -> Result<Self, ConfigError> {
        Ok(Self::with_filter(tier, PoolFilter::new(config)?))
    }

    /// A lane for `tier` around `filter` (e.g. one built with a placement seed).
    pub fn with_filter(tier: CacheTier, filter: PoolFilter) -> Self {
        Self {
            tier,
            filter,
            counters: TierCounters::default(),
        }
    }

    /// The lane's tier.
    pub fn tier(&self) -> CacheTier {
        self.tier
    }

    /// The lane's filter (read-only views).
    pub fn filter(&self) -> &PoolFilter {
        &self.filter
    }

    /// The lane's filter, for publication (`take_delta`, `snapshot`) and source
    /// operations (`clear_source`, `remove_worker`).
    pub fn filter_mut(&mut self) -> &mut PoolFilter {
        &mut self.filter
    }

    /// The lane's own counters.
    pub fn counters(&self) -> &TierCounters {
        &self.counters
    }

    /// Applies one event about this lane's tier; offloads resolve through `device`, the
    /// pool's device filter as it stands when the event arrives ([`resolve`] then
    /// [`apply_resolved`], the two halves a relay runs in two actors). On `Err` nothing
    /// changed except counters.
    pub fn apply(
        &mut self,
        device: &PoolFilter,
        event: &TierEvent,
    ) -> Result<TierOutcome, TierApplyError> {
        if event.tier != self.tier {
            return Err(TierApplyError::WrongTier {
                lane: self.tier,
                event: event.tier,
            });
        }
        let resolved = resolve(device, event)?;
        self.counters.offloads_unmapped += resolved.unmapped;
        let applied = apply_resolved(&mut self.filter, event.source, &resolved.change)?;
        if let ResolvedChange::Canonical(pairs) = &resolved.change {
            self.counters.offloads_resolved += pairs.len() as u64;
        }
        Ok(TierOutcome {
            applied,
            unmapped: resolved.unmapped,
        })
    }
}

/// A tier event with its offload resolved: what a lane's filter applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolvedChange {
    /// A chain inside the tier (token hashes, parent on the same tier).
    Stored(StoredBlocks),
    /// Independent blocks whose canonical hashes are known: `(engine id, canonical)`.
    Canonical(Vec<(u64, u64)>),
    /// Blocks evicted from the tier.
    Removed(Vec<u64>),
    /// Everything the source held on the tier.
    Cleared,
}

impl ResolvedChange {
    /// Blocks the change names (1 for a clear): what it weighs in a lane's permits.
    pub fn n_blocks(&self) -> usize {
        match self {
            ResolvedChange::Stored(stored) => stored.blocks.len(),
            ResolvedChange::Canonical(pairs) => pairs.len(),
            ResolvedChange::Removed(ids) => ids.len(),
            ResolvedChange::Cleared => 1,
        }
    }
}

/// [`resolve`]'s answer: the change and how many offloaded ids were dropped as unmapped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    /// What the lane applies.
    pub change: ResolvedChange,
    /// Offloaded ids the device lineage did not hold (dropped, never guessed).
    pub unmapped: u64,
}

/// Resolves `event` against `device` as it stands now: an offload's ids take the
/// canonical hashes the source's device lineage holds for them; other changes pass
/// through. Reads `device` only.
pub fn resolve(device: &PoolFilter, event: &TierEvent) -> Result<Resolved, ApplyError> {
    let change = match &event.change {
        TierChange::Stored(stored) => ResolvedChange::Stored(stored.clone()),
        TierChange::Removed(removed) => ResolvedChange::Removed(removed.engine_block_ids.clone()),
        TierChange::Cleared => ResolvedChange::Cleared,
        TierChange::Offloaded { engine_block_ids } => {
            let mut pairs = Vec::new();
            pairs.try_reserve(engine_block_ids.len()).map_err(|_| {
                ApplyError::AllocationFailed {
                    what: "offload plan",
                    bytes: (engine_block_ids.len() * std::mem::size_of::<(u64, u64)>()) as u64,
                }
            })?;
            pairs.extend(
                engine_block_ids
                    .iter()
                    .filter_map(|&id| device.canonical_of(event.source, id).map(|c| (id, c))),
            );
            let unmapped = (engine_block_ids.len() - pairs.len()) as u64;
            return Ok(Resolved {
                change: ResolvedChange::Canonical(pairs),
                unmapped,
            });
        }
    };
    Ok(Resolved {
        change,
        unmapped: 0,
    })
}

/// Applies a resolved change of `source` to a lane's `filter` as one event. An empty
/// offload (every id unmapped) changes nothing and counts no event.
pub fn apply_resolved(
    filter: &mut PoolFilter,
    source: SourceId,
    change: &ResolvedChange,
) -> Result<ApplyOutcome, ApplyError> {
    match change {
        ResolvedChange::Stored(stored) => filter.apply_stored_event(source, stored),
        ResolvedChange::Canonical(pairs) if pairs.is_empty() => Ok(ApplyOutcome::default()),
        ResolvedChange::Canonical(pairs) => filter.store_canonical(source, pairs),
        ResolvedChange::Removed(ids) => filter.apply_removed_event(source, ids),
        ResolvedChange::Cleared => filter.apply_cleared_event(source),
    }
}
