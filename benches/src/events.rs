//! A synthetic router-event load for the in-process benches: each source stores chains of
//! fresh random blocks and, once it holds `resident_events` of them, removes its oldest
//! chain with every new one (an LRU cache at capacity).

use std::collections::{BTreeMap, VecDeque};

use kvrelay_ckf::{EventPayload, RemovedBlocks, RouterEvent, SourceId, StoredBlock, StoredBlocks};

/// Generates stored chains (and the removals that keep each source at capacity).
#[derive(Debug)]
pub struct ChainGenerator {
    blocks_per_event: u64,
    resident_events: u64,
    next_engine_id: u64,
    per_source: BTreeMap<SourceId, VecDeque<Vec<u64>>>,
    seed: u64,
}

impl ChainGenerator {
    /// Chains of `blocks_per_event` blocks; each source keeps `resident_events` of them.
    pub fn new(blocks_per_event: u64, resident_events: u64, seed: u64) -> Self {
        Self {
            blocks_per_event,
            resident_events,
            next_engine_id: 0,
            per_source: BTreeMap::new(),
            seed,
        }
    }

    /// The events of one step of `source`: its oldest chain's removal once it is at
    /// capacity (event id `2 × event_id`), then a new chain (`2 × event_id + 1`).
    pub fn event(&mut self, source: SourceId, event_id: u64) -> Vec<RouterEvent> {
        let mut out = Vec::new();
        let queue = self.per_source.entry(source).or_default();
        if queue.len() as u64 >= self.resident_events
            && let Some(oldest) = queue.pop_front()
        {
            out.push(RouterEvent {
                source,
                event_id: event_id * 2,
                payload: EventPayload::Removed(RemovedBlocks {
                    engine_block_ids: oldest,
                }),
            });
        }
        let mut ids = Vec::new();
        let mut blocks = Vec::new();
        for _ in 0..self.blocks_per_event {
            self.next_engine_id += 1;
            self.seed = self
                .seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ids.push(self.next_engine_id);
            blocks.push(StoredBlock {
                engine_block_id: self.next_engine_id,
                token_hash: self.seed ^ (self.seed >> 29),
            });
        }
        queue.push_back(ids);
        out.push(RouterEvent {
            source,
            event_id: event_id * 2 + 1,
            payload: EventPayload::Stored(StoredBlocks {
                parent_engine_block_id: None,
                blocks,
            }),
        });
        out
    }
}
