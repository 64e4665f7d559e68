//! Applying a removed event: the source's mappings of the listed engine ids are dropped
//! in three passes whose cache misses overlap (lineage, owner entries and table rows,
//! commit); unknown ids are counted no-ops.

use super::PoolFilter;
use super::error::{ApplyError, alloc};
use crate::counters::ApplyOutcome;
use crate::event::SourceId;

impl PoolFilter {
    pub(super) fn apply_removed(
        &mut self,
        source: SourceId,
        engine_block_ids: &[u64],
    ) -> Result<ApplyOutcome, ApplyError> {
        self.state
            .reserve(0, engine_block_ids.len(), engine_block_ids.len())?;
        let mut removal = std::mem::take(&mut self.removal);
        removal.clear();
        if removal.try_reserve(engine_block_ids.len()).is_err() {
            self.removal = removal;
            return Err(alloc("removal scratch", engine_block_ids.len() as u64 * 24));
        }
        let mut outcome = ApplyOutcome::default();
        let Some(lineage) = self.lineage.get_mut(&source) else {
            self.removal = removal;
            self.state.counters.unknown_removals += engine_block_ids.len() as u64;
            outcome.unknown_removals = engine_block_ids.len() as u64;
            return Ok(outcome);
        };
        // Three passes, so that each pass's cache misses are independent of each other
        // and overlap: lineage reads, then owner entries and table rows, then the commit.
        for id in engine_block_ids {
            lineage.prefetch(*id);
        }
        for id in engine_block_ids {
            match lineage.remove(*id) {
                Some(canonical) => removal.push((canonical, self.state.prefetch(canonical))),
                None => {
                    self.state.counters.unknown_removals += 1;
                    outcome.unknown_removals += 1;
                }
            }
        }
        if lineage.is_empty() {
            self.lineage.remove(&source);
        }
        for &(canonical, home) in &removal {
            self.state.release_at(canonical, Some(home), &mut outcome);
        }
        self.removal = removal;
        Ok(outcome)
    }
}
