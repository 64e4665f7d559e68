//! One simulated vLLM worker: the project's one cache model
//! ([`kvrelay_ingest::WorkerCache`], an LRU whose running request is never evicted) over
//! 16-token blocks fed by a request trace, emitting the KV events vLLM would publish.
//!
//! What differs from `kvrelay_ingest::TraceWorkload` is only the wire form: it emits
//! router events (no token ids, one removal event per request), while a vLLM engine
//! publishes `BlockStored` with the blocks' tokens and one `BlockRemoved` per evicted
//! block (vLLM's block pool evicts one cached block at a time as it allocates).
//!
//! The trace's `hash_ids` name 512-token blocks; each becomes 32 consecutive 16-token
//! blocks (key `hash_id * 32 + i`), and a request caches its `input_length / 16` full
//! blocks. Block tokens are synthesized per key with [`kvrelay_ingest::block_tokens`], so a
//! consumer can rebuild a request's prompt with [`request_tokens`].

use kvrelay_ckf::SourceId;
use kvrelay_ingest::{
    BlockRemoved, BlockStored, EngineBlockHash, EngineEvent, RequestRecord, TokenIds, WorkerCache,
    block_tokens,
};

use crate::{BLOCK_SIZE, TOKEN_SEED, TRACE_BLOCK_TOKENS};

/// 16-token blocks per trace block.
pub const SUB_BLOCKS: u64 = (TRACE_BLOCK_TOKENS / BLOCK_SIZE) as u64;

/// The 16-token block keys of a request, in prefix order (its full blocks only).
pub fn request_keys(request: &RequestRecord) -> Vec<u64> {
    let full_blocks = (request.input_length / u64::from(BLOCK_SIZE))
        .min(request.hash_ids.len() as u64 * SUB_BLOCKS);
    (0..full_blocks)
        .filter_map(|at| {
            let trace_block = request.hash_ids.get((at / SUB_BLOCKS) as usize)?;
            Some(trace_block * SUB_BLOCKS + at % SUB_BLOCKS)
        })
        .collect()
}

/// The prompt tokens of the first `n_blocks` blocks of `keys`, as the engines publish them.
pub fn request_tokens(keys: &[u64], n_blocks: usize) -> Vec<u32> {
    keys.iter()
        .take(n_blocks)
        .flat_map(|key| block_tokens(*key, BLOCK_SIZE, TOKEN_SEED))
        .collect()
}

/// For every request of a trace, whether its first block appears there for the first
/// time in the whole trace. Such a request's first block cannot be in any worker's cache
/// before its batch, so the moment a consumer's replica covers that one block is the
/// moment the batch's first store became visible there: these requests are the latency
/// probes (probing one block keeps the follower's work and memory per probe tiny; the
/// trace's ids name whole prefixes, so a new first block means the whole request is new).
pub fn first_block_new(requests: &[RequestRecord]) -> Vec<bool> {
    let mut seen: std::collections::HashSet<u64> = std::collections::HashSet::new();
    requests
        .iter()
        .map(|request| {
            let keys = request_keys(request);
            let fresh = keys.first().is_some_and(|first| !seen.contains(first));
            seen.extend(keys);
            fresh
        })
        .collect()
}

/// What serving one request published.
#[derive(Debug, Clone, PartialEq)]
pub struct Served {
    /// The batch's events, in order (removals first, then stores).
    pub events: Vec<EngineEvent>,
    /// Blocks of the request resident after it (the prefix a router can now find).
    pub resident_blocks: usize,
    /// Blocks stored by this request.
    pub stored_blocks: usize,
}

/// One vLLM worker's cache, publishing in vLLM's form.
#[derive(Debug)]
pub struct VllmWorker {
    cache: WorkerCache,
}

impl VllmWorker {
    /// An empty cache of `capacity` blocks for worker `worker_id` (rank 0).
    pub fn new(worker_id: u64, capacity: usize) -> Self {
        Self {
            cache: WorkerCache::new(
                SourceId::new(worker_id, 0),
                capacity,
                BLOCK_SIZE,
                TOKEN_SEED,
            ),
        }
    }

    /// Blocks cached now.
    pub fn len(&self) -> usize {
        self.cache.resident()
    }

    /// The keys cached now, in no particular order.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.cache.keys()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Serves a request whose prefix blocks are `keys`.
    pub fn serve(&mut self, keys: &[u64]) -> Served {
        let change = self.cache.apply(keys);
        let stored_blocks = change.stored_blocks();
        let mut events: Vec<EngineEvent> =
            change.evicted.iter().copied().map(removed_event).collect();
        events.extend(change.stored.into_iter().map(|run| {
            let (keys, engine_ids): (Vec<u64>, Vec<u64>) = run.blocks.into_iter().unzip();
            stored_event(engine_ids, keys, run.parent_engine_id)
        }));
        Served {
            events,
            resident_blocks: change.resident,
            stored_blocks,
        }
    }
}

/// The cache of engine `index` of `workers` (requests dealt round robin, as
/// `stream-engine` does) once it has published `batches` batches: a full hit publishes
/// nothing, so it is served but not counted. This is the ground truth a relay should hold
/// for that engine after those batches.
pub fn cache_after_batches(
    requests: &[RequestRecord],
    workers: usize,
    index: usize,
    worker_id: u64,
    capacity: usize,
    batches: u64,
) -> VllmWorker {
    let mut cache = VllmWorker::new(worker_id, capacity);
    let mut published = 0u64;
    for (at, request) in requests.iter().enumerate() {
        if published >= batches {
            break;
        }
        if at % workers.max(1) != index {
            continue;
        }
        if !cache.serve(&request_keys(request)).events.is_empty() {
            published += 1;
        }
    }
    cache
}

fn removed_event(engine_hash: u64) -> EngineEvent {
    EngineEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![EngineBlockHash::unsigned(engine_hash)],
        medium: Some("GPU".to_owned()),
        group_idx: None,
    })
}

fn stored_event(engine_hashes: Vec<u64>, keys: Vec<u64>, parent: Option<u64>) -> EngineEvent {
    let tokens = keys
        .iter()
        .flat_map(|key| block_tokens(*key, BLOCK_SIZE, TOKEN_SEED))
        .collect();
    EngineEvent::BlockStored(BlockStored {
        medium: Some("GPU".to_owned()),
        ..BlockStored::new(
            engine_hashes
                .into_iter()
                .map(EngineBlockHash::unsigned)
                .collect(),
            parent.map(EngineBlockHash::unsigned),
            TokenIds::Flat(tokens),
            BLOCK_SIZE,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(input_length: u64, hash_ids: Vec<u64>) -> RequestRecord {
        RequestRecord {
            timestamp: 0,
            input_length,
            output_length: 1,
            hash_ids,
        }
    }

    #[test]
    fn trace_blocks_split_into_full_sixteen_token_blocks() {
        let keys = request_keys(&request(512 + 40, vec![7, 9]));
        assert_eq!(keys.len(), 34);
        assert_eq!(keys[0], 7 * SUB_BLOCKS);
        assert_eq!(keys[32], 9 * SUB_BLOCKS);
        assert_eq!(keys[33], 9 * SUB_BLOCKS + 1);
    }

    #[test]
    fn a_full_cache_evicts_one_block_per_event_and_keeps_the_running_request() {
        let mut cache = VllmWorker::new(1, 4);
        let first = cache.serve(&[1, 2, 3]);
        assert_eq!(first.events.len(), 1);
        assert_eq!(first.stored_blocks, 3);
        // Reuses 1 and 2, stores 10 and 11: one slot free, then one eviction (block 3).
        let second = cache.serve(&[1, 2, 10, 11]);
        assert_eq!(second.stored_blocks, 2);
        let removals = second
            .events
            .iter()
            .filter(|e| matches!(e, EngineEvent::BlockRemoved(r) if r.block_hashes.len() == 1))
            .count();
        assert_eq!(removals, 1);
        assert_eq!(cache.len(), 4);
        // A request longer than the cache is cut to it.
        let long = cache.serve(&[20, 21, 22, 23, 24, 25]);
        assert_eq!(long.resident_blocks, 4);
        assert_eq!(long.stored_blocks, 4);
    }

    #[test]
    fn the_cache_after_n_batches_counts_only_published_batches_of_its_own_share() {
        // Engine 1 of 2 takes requests 1, 3 and 5; request 3 repeats request 1 (a full hit,
        // nothing published), so its second batch is request 5's.
        let requests = vec![
            request(512, vec![1]),
            request(512, vec![2]),
            request(512, vec![3]),
            request(512, vec![2]),
            request(512, vec![4]),
            request(512, vec![5]),
        ];
        let keys = |cache: &VllmWorker| {
            let mut keys: Vec<u64> = cache.keys().map(|key| key / SUB_BLOCKS).collect();
            keys.dedup();
            keys
        };
        let one = cache_after_batches(&requests, 2, 1, 9, 1_000, 1);
        assert_eq!(keys(&one), vec![2]);
        let two = cache_after_batches(&requests, 2, 1, 9, 1_000, 2);
        let mut two_keys = keys(&two);
        two_keys.sort_unstable();
        two_keys.dedup();
        assert_eq!(two_keys, vec![2, 5]);
        assert_eq!(two.len(), 2 * SUB_BLOCKS as usize);
    }

    #[test]
    fn stores_are_parented_on_the_cached_prefix() {
        let mut cache = VllmWorker::new(1, 16);
        let first = cache.serve(&[1, 2]);
        let EngineEvent::BlockStored(root) = &first.events[0] else {
            panic!("expected a store");
        };
        assert_eq!(root.parent_block_hash, None);
        let served = cache.serve(&[1, 2, 3]);
        let EngineEvent::BlockStored(stored) = &served.events[0] else {
            panic!("expected a store");
        };
        assert_eq!(stored.parent_block_hash, Some(root.block_hashes[1]));
        assert!(
            stored.block_hashes[0].value < 1 << 63,
            "vLLM's integer hashes are non-negative"
        );
        assert_eq!(stored.token_ids.len(), BLOCK_SIZE as usize);
    }

    #[test]
    fn probes_are_requests_whose_first_block_is_new() {
        let requests = vec![
            request(1024, vec![1, 2]),
            request(512, vec![1]),
            request(1024, vec![1, 3]),
            request(1024, vec![4, 3]),
        ];
        assert_eq!(first_block_new(&requests), vec![true, false, false, true]);
    }
}
