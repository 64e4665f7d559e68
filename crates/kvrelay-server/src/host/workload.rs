//! Trace replay: turns a Mooncake-style request trace into per-source router events.
//!
//! Each request (`{"timestamp","input_length","output_length","hash_ids"}` per line) is
//! routed to one source by its first prefix block, so requests sharing a prefix land on
//! the same worker. Every source simulates an LRU block cache of its capacity: the blocks of
//! the request's prefix it already holds are touched, the missing suffix is stored as one
//! `Stored` event chained to the last held block, and the least recently used blocks not in
//! the request are evicted first with one `Removed` event. The pure part ([`SourceCache`],
//! [`parse_trace`]) has no IO; the async shell in the host feeds actors.

use std::collections::{BTreeMap, HashMap};

use kvrelay_ckf::{EventPayload, RemovedBlocks, RouterEvent, SourceId, StoredBlock, StoredBlocks};
use kvrelay_ingest::block_token_hash;
use serde::Deserialize;

/// One request of the trace.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub(crate) struct TraceRequest {
    /// Arrival, in ms from the trace start.
    #[serde(default)]
    pub(crate) timestamp: u64,
    /// The request's prefix block ids (equal ids mean the same prefix block).
    pub(crate) hash_ids: Vec<u64>,
}

/// Why a trace could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// A line is not a trace request.
    #[error("trace line {line}: {message}")]
    Line {
        /// 1-based line number.
        line: usize,
        /// The parser's message.
        message: String,
    },
}

/// Parses a JSONL trace; blank lines are skipped.
pub(crate) fn parse_trace(text: &str) -> Result<Vec<TraceRequest>, TraceError> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(at, line)| {
            serde_json::from_str(line).map_err(|err| TraceError::Line {
                line: at + 1,
                message: err.to_string(),
            })
        })
        .collect()
}

/// Seed of the synthesized block tokens: the ingest workload generator's default, so a
/// consumer scoring `kvrelay_ingest::request_tokens(hash_ids, block_size, WORKLOAD_TOKEN_SEED)`
/// finds the blocks this workload stored.
pub const WORKLOAD_TOKEN_SEED: u64 = 0x6b76_7265_6c61_7931;

/// A fixed 64-bit mix of a trace block id, used to spread requests over sources.
fn mix(hash_id: u64) -> u64 {
    let mut z = hash_id.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The simulated block cache of one source.
#[derive(Debug)]
pub(crate) struct SourceCache {
    source: SourceId,
    capacity: usize,
    block_size: u32,
    /// Trace block id → (engine block id, last use tick).
    resident: HashMap<u64, (u64, u64)>,
    /// Last use tick → trace block id (the LRU order).
    by_use: BTreeMap<u64, u64>,
    tick: u64,
    next_engine_block: u64,
    next_event_id: u64,
}

impl SourceCache {
    pub(crate) fn new(source: SourceId, capacity: usize, block_size: u32) -> Self {
        Self {
            source,
            capacity: capacity.max(1),
            block_size,
            resident: HashMap::new(),
            by_use: BTreeMap::new(),
            tick: 0,
            // Engine ids are per source; start away from 0 so they never look unset.
            next_engine_block: 1,
            next_event_id: 0,
        }
    }

    /// Resident blocks (the source's exact KV usage).
    pub(crate) fn resident(&self) -> usize {
        self.resident.len()
    }

    /// Serves one request: returns the events (eviction first, then the stored suffix).
    pub(crate) fn serve(&mut self, hash_ids: &[u64]) -> Vec<RouterEvent> {
        // A request longer than the cache keeps only the prefix that fits.
        let hash_ids = &hash_ids[..hash_ids.len().min(self.capacity)];
        let held = hash_ids
            .iter()
            .take_while(|id| self.resident.contains_key(id))
            .count();
        for id in &hash_ids[..held] {
            self.touch(*id);
        }
        let missing = &hash_ids[held..];
        let mut events = Vec::new();
        if missing.is_empty() {
            return events;
        }
        // Blocks after a gap in the held prefix are re-stored under their new parent, so a
        // stale copy is removed first.
        let mut removed = Vec::new();
        for id in missing {
            if let Some((engine_id, last_use)) = self.resident.remove(id) {
                self.by_use.remove(&last_use);
                removed.push(engine_id);
            }
        }
        // The held prefix was just touched, so LRU eviction never takes the parent.
        let overflow = (self.resident.len() + missing.len()).saturating_sub(self.capacity);
        for _ in 0..overflow {
            let Some((_, victim)) = self.by_use.pop_first() else {
                break;
            };
            if let Some((engine_id, _)) = self.resident.remove(&victim) {
                removed.push(engine_id);
            }
        }
        if !removed.is_empty() {
            events.push(self.event(EventPayload::Removed(RemovedBlocks {
                engine_block_ids: removed,
            })));
        }
        let parent = held
            .checked_sub(1)
            .and_then(|at| self.resident.get(&hash_ids[at]))
            .map(|entry| entry.0);
        let mut blocks = Vec::with_capacity(missing.len());
        for id in missing {
            let engine_block_id = self.next_engine_block;
            self.next_engine_block += 1;
            self.tick += 1;
            self.resident.insert(*id, (engine_block_id, self.tick));
            self.by_use.insert(self.tick, *id);
            blocks.push(StoredBlock {
                engine_block_id,
                token_hash: block_token_hash(*id, self.block_size, WORKLOAD_TOKEN_SEED),
            });
        }
        events.push(self.event(EventPayload::Stored(StoredBlocks {
            parent_engine_block_id: parent,
            blocks,
        })));
        events
    }

    fn touch(&mut self, id: u64) {
        self.tick += 1;
        if let Some(entry) = self.resident.get_mut(&id) {
            self.by_use.remove(&entry.1);
            entry.1 = self.tick;
            self.by_use.insert(self.tick, id);
        }
    }

    fn event(&mut self, payload: EventPayload) -> RouterEvent {
        self.next_event_id += 1;
        RouterEvent {
            source: self.source,
            event_id: self.next_event_id,
            payload,
        }
    }
}

/// Which source (index into a sorted source list of length `n_sources`) serves a request.
pub(crate) fn route(hash_ids: &[u64], n_sources: usize) -> Option<usize> {
    let first = *hash_ids.first()?;
    let n = u64::try_from(n_sources).ok().filter(|n| *n > 0)?;
    usize::try_from(mix(first) % n).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(event: &RouterEvent) -> &StoredBlocks {
        match &event.payload {
            EventPayload::Stored(stored) => stored,
            other => panic!("expected stored, got {other:?}"),
        }
    }

    #[test]
    fn shared_prefix_is_stored_once_and_chained() {
        let mut cache = SourceCache::new(SourceId::new(1, 0), 100, 16);
        let first = cache.serve(&[1, 2, 3]);
        assert_eq!(first.len(), 1);
        assert_eq!(stored(&first[0]).parent_engine_block_id, None);
        let second = cache.serve(&[1, 2, 4]);
        let blocks = stored(&second[0]);
        assert_eq!(blocks.parent_engine_block_id, Some(2));
        assert_eq!(
            blocks.blocks,
            vec![StoredBlock {
                engine_block_id: 4,
                token_hash: block_token_hash(4, 16, WORKLOAD_TOKEN_SEED)
            }]
        );
        assert_eq!(cache.resident(), 4);
    }

    #[test]
    fn full_cache_evicts_least_recently_used_first() {
        let mut cache = SourceCache::new(SourceId::new(1, 0), 3, 16);
        cache.serve(&[1, 2]);
        cache.serve(&[7]);
        cache.serve(&[1, 2]);
        let events = cache.serve(&[9]);
        assert_eq!(
            events[0].payload,
            EventPayload::Removed(RemovedBlocks {
                engine_block_ids: vec![3]
            })
        );
        assert_eq!(cache.resident(), 3);
    }

    #[test]
    fn event_ids_increase_per_source() {
        let mut cache = SourceCache::new(SourceId::new(1, 0), 2, 16);
        let ids: Vec<u64> = [[1u64, 2], [3, 4], [5, 6]]
            .iter()
            .flat_map(|request| cache.serve(request))
            .map(|event| event.event_id)
            .collect();
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "{ids:?}");
    }

    #[test]
    fn blocks_after_a_gap_are_restored_under_their_new_parent() {
        let mut cache = SourceCache::new(SourceId::new(1, 0), 3, 16);
        cache.serve(&[1, 2, 3]);
        // [9] evicts block 1 (least recently used); 2 and 3 stay resident behind the gap.
        cache.serve(&[9]);
        let events = cache.serve(&[1, 2, 3]);
        let removed: Vec<u64> = events
            .iter()
            .filter_map(|event| match &event.payload {
                EventPayload::Removed(removed) => Some(removed.engine_block_ids.clone()),
                _ => None,
            })
            .flatten()
            .collect();
        assert!(
            removed.contains(&2) && removed.contains(&3),
            "stale copies removed: {removed:?}"
        );
        let stored = stored(events.last().unwrap());
        assert_eq!(stored.parent_engine_block_id, None);
        assert_eq!(stored.blocks.len(), 3);
        assert_eq!(cache.resident(), 3);
    }

    #[test]
    fn malformed_trace_line_names_its_number() {
        let err = parse_trace("{\"hash_ids\":[1]}\n\n{\"hash_ids\":\"x\"}\n").unwrap_err();
        assert!(matches!(err, TraceError::Line { line: 3, .. }), "{err}");
    }
}
