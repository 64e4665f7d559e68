//! Applying a stored chain: derive every block's canonical hash and prefetch the slots
//! the event touches, validate the plan against the source's lineage, reserve every slot
//! the commit may need, then commit (nothing fails after validation and reservation).

use kvrelay_identity::hashing::{canonical_child, canonical_root};

use super::PoolFilter;
use super::error::{ApplyError, alloc};
use crate::addressing::Home;
use crate::counters::ApplyOutcome;
use crate::event::{SourceId, StoredBlocks};
use crate::keyhash::KeyMap;
use crate::lineage::LineageMap;
use crate::owners::GrowFailed;

/// Stored batches up to this length check repeated engine ids by a linear scan.
const LINEAR_SCAN_MAX: usize = 16;

/// How a stored event's blocks relate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Links {
    /// A chain: each block extends the one before it (or the event's parent).
    Chain,
    /// Independent blocks whose token hash field already is their canonical hash.
    Unchained,
}

/// One validated stored block.
#[derive(Debug, Clone, Copy)]
pub(super) struct PlannedBlock {
    pub(super) engine_block_id: u64,
    pub(super) canonical: u64,
    pub(super) is_new: bool,
    /// Where the lineage would put this id (see `LineageMap::get_or_vacant`).
    pub(super) lineage_vacant: Option<usize>,
    /// The canonical hash's fingerprint and primary bucket.
    pub(super) home: Home,
}

impl PoolFilter {
    pub(super) fn apply_stored(
        &mut self,
        source: SourceId,
        stored: &StoredBlocks,
        links: Links,
    ) -> Result<ApplyOutcome, ApplyError> {
        let mut plan = std::mem::take(&mut self.plan);
        // The planned vacant lineage slots hold only while the lineage keeps this size.
        let planned_slots = self.lineage.get(&source).map_or(0, LineageMap::capacity);
        let result = self
            .plan_stored(source, stored, links, &mut plan)
            .and_then(|n_new| {
                self.reserve_for_store(source, n_new, plan.len() - n_new)?;
                Ok(self.commit_stored(source, &plan, planned_slots))
            });
        plan.clear();
        self.plan = plan;
        result
    }

    /// Validates a stored chain against the source's lineage; fills `plan` and returns
    /// how many blocks are new mappings.
    fn plan_stored(
        &self,
        source: SourceId,
        stored: &StoredBlocks,
        links: Links,
        plan: &mut Vec<PlannedBlock>,
    ) -> Result<usize, ApplyError> {
        let lineage = self.lineage.get(&source);
        let mut parent = match stored.parent_engine_block_id {
            None => None,
            Some(parent_engine_block_id) => {
                Some(lineage.and_then(|m| m.get(parent_engine_block_id)).ok_or(
                    ApplyError::ParentNotFound {
                        source_id: source,
                        parent_engine_block_id,
                    },
                )?)
            }
        };
        plan.try_reserve(stored.blocks.len())
            .map_err(|_| ApplyError::AllocationFailed {
                what: "stored plan",
                bytes: (stored.blocks.len() * std::mem::size_of::<PlannedBlock>()) as u64,
            })?;
        // Canonical hashes depend only on the parent, so every block's lineage slot, owner
        // slot and table rows can be prefetched before the first of them is read: the
        // event waits for one round of misses instead of one per pass.
        for block in &stored.blocks {
            let canonical = match (links, parent) {
                (Links::Unchained, _) | (Links::Chain, None) => canonical_root(block.token_hash),
                (Links::Chain, Some(parent)) => canonical_child(parent, block.token_hash),
            };
            parent = Some(canonical);
            if let Some(lineage) = lineage {
                lineage.prefetch(block.engine_block_id);
            }
            plan.push(PlannedBlock {
                engine_block_id: block.engine_block_id,
                canonical,
                is_new: false,
                lineage_vacant: None,
                home: self.state.prefetch(canonical),
            });
        }
        let use_scan = plan.len() <= LINEAR_SCAN_MAX;
        let mut batch_ids: KeyMap<u64, u64> = KeyMap::default();
        let mut n_new = 0u64;
        for block_idx in 0..plan.len() {
            let PlannedBlock {
                engine_block_id: id,
                canonical,
                ..
            } = plan[block_idx];
            let mapped = match lineage.map(|m| m.get_or_vacant(id)) {
                Some(Ok(canonical)) => Some(canonical),
                Some(Err(vacant)) => {
                    plan[block_idx].lineage_vacant = vacant;
                    None
                }
                None => None,
            };
            let earlier = mapped.or_else(|| {
                if use_scan {
                    plan[..block_idx]
                        .iter()
                        .find(|p| p.engine_block_id == id)
                        .map(|p| p.canonical)
                } else {
                    batch_ids.get(&id).copied()
                }
            });
            let is_new = match earlier {
                Some(mapped) if mapped != canonical => {
                    return Err(ApplyError::ContradictoryBlockId {
                        source_id: source,
                        engine_block_id: id,
                        mapped,
                        offered: canonical,
                    });
                }
                Some(_) => false,
                None => true,
            };
            plan[block_idx].is_new = is_new;
            if is_new {
                n_new += 1;
                // An owner count never exceeds the live mappings, so bounding those bounds
                // every count without a per-hash lookup.
                if self.live_mappings() + n_new > u64::from(u32::MAX) {
                    return Err(ApplyError::OwnershipOverflow { canonical });
                }
                if !use_scan {
                    batch_ids.insert(id, canonical);
                }
            }
        }
        Ok(n_new as usize)
    }

    /// Live (source, engine block id) mappings, from the counters.
    pub(super) fn live_mappings(&self) -> u64 {
        let c = &self.state.counters;
        c.blocks_mapped - c.mappings_removed
    }

    /// Reserves every map and window slot a store may need, so commit cannot fail.
    fn reserve_for_store(
        &mut self,
        source: SourceId,
        n_new: usize,
        n_reoffered: usize,
    ) -> Result<(), ApplyError> {
        let max_touches = n_new * (self.max_kicks as usize + 1) + n_reoffered;
        self.state
            .reserve(n_new, max_touches, n_new + n_reoffered)?;
        if n_new == 0 {
            return Ok(());
        }
        if !self.lineage.contains_key(&source) {
            self.lineage
                .try_reserve(1)
                .map_err(|_| alloc("source map", 64))?;
            let mut map = LineageMap::new(self.placement_seed);
            map.try_reserve(n_new)
                .map_err(|GrowFailed { bytes }| alloc("lineage", bytes))?;
            self.lineage.insert(source, map);
        } else if let Some(map) = self.lineage.get_mut(&source) {
            map.try_reserve(n_new)
                .map_err(|GrowFailed { bytes }| alloc("lineage", bytes))?;
        }
        Ok(())
    }

    fn commit_stored(
        &mut self,
        source: SourceId,
        plan: &[PlannedBlock],
        planned_slots: usize,
    ) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::default();
        if let Some(lineage) = self.lineage.get_mut(&source) {
            for block in plan.iter().filter(|b| b.is_new) {
                // Room was reserved, so this cannot fail.
                let inserted = lineage.insert_at(
                    block.engine_block_id,
                    block.canonical,
                    block.lineage_vacant,
                    planned_slots,
                );
                if !inserted {
                    self.state.counters.invariant_violations += 1;
                }
            }
        }
        for block in plan {
            if block.is_new {
                self.state
                    .acquire_and_admit(block.canonical, block.home, &mut outcome);
            } else {
                self.state.reoffer(block.canonical, &mut outcome);
            }
        }
        outcome
    }
}
