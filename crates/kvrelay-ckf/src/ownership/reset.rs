//! Whole-source operations: clearing one source, removing every rank of a worker, and
//! resetting a source to a validated dump (new owners first, so kept hashes never drop
//! to zero owners and cause no table writes).

use kvrelay_identity::hashing::{canonical_child, canonical_root};

use super::PoolFilter;
use super::error::{ApplyError, alloc};
use crate::counters::ApplyOutcome;
use crate::event::{SourceId, StoredBlocks};
use crate::lineage::LineageMap;
use crate::owners::GrowFailed;

impl PoolFilter {
    pub(super) fn clear_source_inner(
        &mut self,
        source: SourceId,
    ) -> Result<ApplyOutcome, ApplyError> {
        let n_mappings = self.lineage.get(&source).map_or(0, |m| m.len());
        self.state.reserve(0, n_mappings, n_mappings)?;
        let mut outcome = ApplyOutcome::default();
        if let Some(lineage) = self.lineage.remove(&source) {
            for canonical in lineage.values() {
                self.state.release(canonical, &mut outcome);
            }
        }
        Ok(outcome)
    }

    pub(super) fn remove_worker_inner(
        &mut self,
        worker_id: u64,
    ) -> Result<ApplyOutcome, ApplyError> {
        let mut sources: Vec<SourceId> = self
            .lineage
            .keys()
            .filter(|s| s.worker_id == worker_id)
            .copied()
            .collect();
        sources.sort_unstable();
        let n_mappings: usize = sources
            .iter()
            .filter_map(|s| self.lineage.get(s))
            .map(|m| m.len())
            .sum();
        self.state.reserve(0, n_mappings, n_mappings)?;
        let mut outcome = ApplyOutcome::default();
        for source in sources {
            if let Some(lineage) = self.lineage.remove(&source) {
                for canonical in lineage.values() {
                    self.state.release(canonical, &mut outcome);
                }
            }
        }
        Ok(outcome)
    }

    pub(super) fn reset_source_inner(
        &mut self,
        source: SourceId,
        chains: &[StoredBlocks],
    ) -> Result<ApplyOutcome, ApplyError> {
        // Validate the whole dump against an empty lineage.
        let n_blocks: usize = chains.iter().map(|c| c.blocks.len()).sum();
        let mut fresh = LineageMap::new(self.placement_seed);
        fresh
            .try_reserve(n_blocks)
            .map_err(|GrowFailed { bytes }| alloc("lineage", bytes))?;
        let mut order = Vec::new();
        order
            .try_reserve_exact(n_blocks)
            .map_err(|_| alloc("reset order", n_blocks as u64 * 8))?;
        for chain in chains {
            let mut parent = match chain.parent_engine_block_id {
                None => None,
                Some(parent_engine_block_id) => Some(fresh.get(parent_engine_block_id).ok_or(
                    ApplyError::ParentNotFound {
                        source_id: source,
                        parent_engine_block_id,
                    },
                )?),
            };
            for block in &chain.blocks {
                let canonical = match parent {
                    None => canonical_root(block.token_hash),
                    Some(parent) => canonical_child(parent, block.token_hash),
                };
                parent = Some(canonical);
                self.map_fresh(
                    source,
                    &mut fresh,
                    &mut order,
                    block.engine_block_id,
                    canonical,
                )?;
            }
        }
        self.commit_reset(source, fresh, &order)
    }

    /// [`PoolFilter::restore_source`]: like a reset, from mappings instead of chains.
    pub(super) fn restore_source_inner(
        &mut self,
        source: SourceId,
        mappings: &[(u64, u64)],
    ) -> Result<ApplyOutcome, ApplyError> {
        let mut fresh = LineageMap::new(self.placement_seed);
        fresh
            .try_reserve(mappings.len())
            .map_err(|GrowFailed { bytes }| alloc("lineage", bytes))?;
        let mut order = Vec::new();
        order
            .try_reserve_exact(mappings.len())
            .map_err(|_| alloc("restore order", mappings.len() as u64 * 8))?;
        for &(engine_block_id, canonical) in mappings {
            self.map_fresh(source, &mut fresh, &mut order, engine_block_id, canonical)?;
        }
        self.commit_reset(source, fresh, &order)
    }

    /// Maps `engine_block_id` to `canonical` in the lineage `fresh` being built for
    /// `source` (room reserved beforehand), noting a new canonical in `order`; a repeated
    /// id must map to the same canonical.
    fn map_fresh(
        &self,
        source: SourceId,
        fresh: &mut LineageMap,
        order: &mut Vec<u64>,
        engine_block_id: u64,
        canonical: u64,
    ) -> Result<(), ApplyError> {
        match fresh.get(engine_block_id) {
            Some(mapped) if mapped != canonical => Err(ApplyError::ContradictoryBlockId {
                source_id: source,
                engine_block_id,
                mapped,
                offered: canonical,
            }),
            Some(_) => Ok(()),
            None => {
                if self.live_mappings() + fresh.len() as u64 + 1 > u64::from(u32::MAX) {
                    return Err(ApplyError::OwnershipOverflow { canonical });
                }
                if !fresh.insert(engine_block_id, canonical) {
                    return Err(alloc("lineage", (fresh.len() as u64 + 1) * 16));
                }
                order.push(canonical);
                Ok(())
            }
        }
    }

    /// Makes `fresh` (whose new canonicals are `order`) `source`'s whole lineage: reserves
    /// everything first (on `Err` nothing changed), then moves ownership in one step.
    fn commit_reset(
        &mut self,
        source: SourceId,
        fresh: LineageMap,
        order: &[u64],
    ) -> Result<ApplyOutcome, ApplyError> {
        let n_old = self.lineage.get(&source).map_or(0, |m| m.len());
        let max_touches = n_old + order.len() * (self.max_kicks as usize + 1);
        self.state
            .reserve(order.len(), max_touches, n_old + order.len())?;
        self.lineage
            .try_reserve(1)
            .map_err(|_| alloc("source map", 64))?;

        // Commit: new owners first (so kept hashes never drop to zero), then release the
        // old mappings, then admit what is owned but not resident.
        let mut outcome = ApplyOutcome::default();
        let first_joined = self.state.memberships_len();
        for &canonical in order {
            self.state.acquire(canonical, &mut outcome);
        }
        let first_left = self.state.memberships_len();
        if let Some(old) = self.lineage.remove(&source) {
            for canonical in old.values() {
                self.state.release(canonical, &mut outcome);
            }
        }
        // The table admits after the releases; the log says so.
        self.state.releases_first(first_joined, first_left);
        for &canonical in order {
            self.state.admit(canonical, &mut outcome);
        }
        if !fresh.is_empty() {
            self.lineage.insert(source, fresh);
        }
        Ok(outcome)
    }
}
