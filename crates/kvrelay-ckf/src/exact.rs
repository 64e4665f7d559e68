//! The exact baseline behind [`PrefixQuery`]: one exact hash set per pool.

use crate::query::{PrefixDepths, PrefixQuery};

/// Exact per-pool membership behind the same [`PrefixQuery`] trait: the accuracy and
/// speed baseline. A pool's depth is its first absent position (a linear scan).
#[derive(Debug, Clone, Default)]
pub struct ExactIndex {
    pools: Vec<crate::keyhash::KeySet<u64>>,
}

impl ExactIndex {
    /// An index with no pools.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an empty pool and returns its index.
    pub fn add_pool(&mut self) -> usize {
        self.pools.push(Default::default());
        self.pools.len() - 1
    }

    /// Marks `hash` present in `pool` (no-op for an unknown pool).
    pub fn insert(&mut self, pool: usize, hash: u64) {
        if let Some(set) = self.pools.get_mut(pool) {
            set.insert(hash);
        }
    }

    /// Marks `hash` absent in `pool`.
    pub fn remove(&mut self, pool: usize, hash: u64) {
        if let Some(set) = self.pools.get_mut(pool) {
            set.remove(&hash);
        }
    }

    /// Whether `pool` holds `hash`.
    pub fn contains(&self, pool: usize, hash: u64) -> bool {
        self.pools.get(pool).is_some_and(|set| set.contains(&hash))
    }

    /// Hashes held by `pool`.
    pub fn len(&self, pool: usize) -> usize {
        self.pools.get(pool).map_or(0, |set| set.len())
    }

    /// Whether `pool` holds nothing.
    pub fn is_empty(&self, pool: usize) -> bool {
        self.len(pool) == 0
    }
}

impl PrefixQuery for ExactIndex {
    fn n_pools(&self) -> usize {
        self.pools.len()
    }

    fn prefix_depths_into(&self, sequence_hashes: &[u64], out: &mut PrefixDepths) {
        out.depths.clear();
        let mut n_probes = 0u32;
        for set in &self.pools {
            let depth = sequence_hashes
                .iter()
                .position(|hash| {
                    n_probes += 1;
                    !set.contains(hash)
                })
                .unwrap_or(sequence_hashes.len());
            out.depths
                .push(Some(u32::try_from(depth).unwrap_or(u32::MAX)));
        }
        out.scratch.n_probes = n_probes;
    }
}
