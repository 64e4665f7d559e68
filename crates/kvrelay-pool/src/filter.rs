//! The pool actor's view of its filter state (temporary stand-in until kvrelay-ckf's
//! producer state lands).

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_ckf::{BucketImage, EventPayload, RouterEvent, SourceId};
use kvrelay_identity::CkfFormat;

use crate::actor::FaultCategory;

/// Filter statistics reported by a pool actor.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FilterStats {
    /// Buckets in the filter.
    pub bucket_count: u64,
    /// Canonical blocks resident in the filter.
    pub resident_blocks: u64,
    /// Blocks whose fingerprint could not be placed (capacity omissions).
    pub capacity_omissions: u64,
    /// Removals of blocks the source never reported.
    pub unknown_removals: u64,
    /// Blocks held per source, sorted by source (for load accounting).
    pub blocks_per_source: Vec<(SourceId, u64)>,
}

/// What applying one event did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Applied {
    pub(crate) fault: Option<(FaultCategory, String)>,
}

/// The filter state one actor owns.
pub(crate) struct FilterState {
    words: Vec<u64>,
    format: CkfFormat,
    dirty: BTreeSet<u32>,
    sources: BTreeMap<SourceId, BTreeSet<u64>>,
    unknown_removals: u64,
}

impl FilterState {
    /// Builds a filter sized for `expected_unique_blocks`.
    pub(crate) fn build(expected_unique_blocks: u64) -> Result<Self, String> {
        if expected_unique_blocks == 0 {
            return Err("expected unique blocks must be greater than zero".to_owned());
        }
        let bucket_count = expected_unique_blocks.div_ceil(2).next_power_of_two().max(2);
        let bucket_count = u32::try_from(bucket_count).map_err(|error| error.to_string())?;
        let format = CkfFormat::v1(kvrelay_identity::DEFAULT_CKF_SEED, bucket_count).map_err(|error| error.to_string())?;
        Ok(Self {
            words: vec![0; bucket_count as usize],
            format,
            dirty: BTreeSet::new(),
            sources: BTreeMap::new(),
            unknown_removals: 0,
        })
    }

    pub(crate) fn format(&self) -> CkfFormat {
        self.format
    }

    pub(crate) fn apply(&mut self, event: &RouterEvent) -> Applied {
        match &event.payload {
            EventPayload::Stored(stored) => {
                for block in &stored.blocks {
                    if self.sources.entry(event.source).or_default().insert(block.engine_block_id) {
                        self.bump(block.engine_block_id, 1);
                    }
                }
            }
            EventPayload::Removed(removed) => {
                for id in &removed.engine_block_ids {
                    if self.sources.entry(event.source).or_default().remove(id) {
                        self.bump(*id, u64::MAX);
                    } else {
                        self.unknown_removals += 1;
                    }
                }
            }
            EventPayload::AllCleared => self.clear_source(event.source),
        }
        Applied::default()
    }

    pub(crate) fn clear_source(&mut self, source: SourceId) {
        for id in self.sources.remove(&source).unwrap_or_default() {
            self.bump(id, u64::MAX);
        }
    }

    fn bump(&mut self, id: u64, by: u64) {
        let idx = (id % self.words.len() as u64) as u32;
        if let Some(word) = self.words.get_mut(idx as usize) {
            *word = word.wrapping_add(by);
            self.dirty.insert(idx);
        }
    }

    pub(crate) fn take_images(&mut self) -> Option<Vec<BucketImage>> {
        let images: Vec<BucketImage> = std::mem::take(&mut self.dirty)
            .into_iter()
            .map(|bucket_idx| BucketImage {
                bucket_idx,
                word: self.words.get(bucket_idx as usize).copied().unwrap_or(0),
            })
            .collect();
        (!images.is_empty()).then_some(images)
    }

    pub(crate) fn copy_words(&self) -> Vec<u64> {
        self.words.clone()
    }

    pub(crate) fn stats(&self) -> FilterStats {
        FilterStats {
            bucket_count: self.words.len() as u64,
            resident_blocks: self.sources.values().map(|set| set.len() as u64).sum(),
            capacity_omissions: 0,
            unknown_removals: self.unknown_removals,
            blocks_per_source: self.sources.iter().map(|(source, set)| (*source, set.len() as u64)).collect(),
        }
    }
}
