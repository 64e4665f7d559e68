//! Logical engine events → canonical router events for the pool's filter.
//!
//! Each stored block gets the token hash the pool's query semantics give its tokens
//! (block size, standard or Eagle windows, salted by the event's LoRA name and cache
//! salt, with multimodal hashes from vLLM `extra_keys`). Engine block ids are kept as
//! per-source ids only; the filter derives canonical sequence hashes from token hashes.
//!
//! # Filtering rule (media and attention groups)
//!
//! The filter describes what a worker holds in device (GPU) memory for full attention:
//! - an event whose `medium` is present and is not `GPU` or `DEVICE` (any case) is
//!   filtered out (CPU offload, disk and external tiers);
//! - a stored event whose `kv_cache_spec_kind` is present and is not `full_attention` is
//!   filtered out; a `full_attention` event teaches the canonicalizer its source's
//!   full-attention `group_idx`;
//! - an event without a spec kind (every removal, and stored events of older engines) is
//!   kept when its `group_idx` is absent or equals the learned full-attention group
//!   (group 0 until one is learned).
//!
//! Filtered events are counted, never errors.
//!
//! # Lower tiers
//!
//! With [`CanonicalConfig::lower_tiers`] set, events about host memory (`CPU`,
//! `CPU_PINNED`, `HOST`) and disk (`DISK`, `STORAGE`) become [`TierEvent`]s instead of
//! being filtered, under the same attention-group rule. A lower-tier store that carries tokens
//! is hashed exactly like a device store (a chain inside the tier, the pool's block
//! size); one without tokens (vLLM's offloading connector) names device blocks and
//! becomes [`TierChange::Offloaded`], resolved by the pool against the device lineage.
//! A medium no tier is known for (`EXTERNAL`, anything else) stays filtered.

use kvrelay_ckf::{
    CacheTier, EventPayload, RemovedBlocks, RouterEvent, SourceId, StoredBlock, StoredBlocks,
    TierChange, TierEvent,
};
use kvrelay_identity::KvQueryHashFormat;
use kvrelay_identity::hashing::{HashSalt, block_hash, block_window_len, mm_hash_from_identifier};

use crate::engine::{BlockStored, EngineBatch, EngineEvent, ExtraKey, TokenIds};
use crate::error::CanonicalizeError;

/// The pool's token-hashing rules events are canonicalized with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CanonicalConfig {
    /// Tokens per block; events with another `block_size` are rejected.
    pub block_size: u32,
    /// Standard or Eagle windows.
    pub hash_format: KvQueryHashFormat,
    /// Whether events about host memory and disk become [`TierEvent`]s (the pool keeps
    /// lower-tier lanes) instead of being filtered.
    pub lower_tiers: bool,
}

impl CanonicalConfig {
    /// Device-only hashing with `block_size`-token blocks and `hash_format` windows.
    pub const fn new(block_size: u32, hash_format: KvQueryHashFormat) -> Self {
        Self {
            block_size,
            hash_format,
            lower_tiers: false,
        }
    }
}

/// One canonical event of a source, in the source's order: device and lower-tier events
/// interleave as the engine reported them (an offload resolves against the device
/// lineage as it stands at that point).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CanonicalEvent {
    /// An event about device memory, for the pool's filter.
    Device(RouterEvent),
    /// An event about a lower tier, for the pool's lane of that tier.
    Tier(TierEvent),
}

impl CanonicalEvent {
    /// The event of `change` on `tier`: a router event for device memory, a tier event
    /// otherwise. `None` for an offload to the device (offloads leave the device).
    pub fn new(
        source: SourceId,
        event_id: u64,
        tier: CacheTier,
        change: TierChange,
    ) -> Option<Self> {
        if tier != CacheTier::Device {
            return Some(CanonicalEvent::Tier(TierEvent {
                source,
                event_id,
                tier,
                change,
            }));
        }
        let payload = match change {
            TierChange::Stored(stored) => EventPayload::Stored(stored),
            TierChange::Removed(removed) => EventPayload::Removed(removed),
            TierChange::Cleared => EventPayload::AllCleared,
            TierChange::Offloaded { .. } => return None,
        };
        Some(CanonicalEvent::Device(RouterEvent {
            source,
            event_id,
            payload,
        }))
    }

    /// The source the event belongs to.
    pub fn source(&self) -> SourceId {
        match self {
            CanonicalEvent::Device(event) => event.source,
            CanonicalEvent::Tier(event) => event.source,
        }
    }

    /// The event id the canonicalizer gave it.
    pub fn event_id(&self) -> u64 {
        match self {
            CanonicalEvent::Device(event) => event.event_id,
            CanonicalEvent::Tier(event) => event.event_id,
        }
    }

    /// The router event, when this is about device memory.
    pub fn as_device(&self) -> Option<&RouterEvent> {
        match self {
            CanonicalEvent::Device(event) => Some(event),
            CanonicalEvent::Tier(_) => None,
        }
    }
}

/// What canonicalizing one batch did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchOutcome {
    /// Events produced (device and lower tiers).
    pub n_events: usize,
    /// Engine events dropped by the filtering rule.
    pub n_filtered: usize,
    /// Engine events rejected, each with its reason; the rest of the batch still applies.
    pub rejected: Vec<CanonicalizeError>,
}

/// Per-worker canonicalization state: the learned full-attention group and the next
/// event id.
#[derive(Debug, Clone)]
pub struct Canonicalizer {
    config: CanonicalConfig,
    worker_id: u64,
    default_dp_rank: u32,
    full_attention_group: Option<u32>,
    next_event_id: u64,
}

impl Canonicalizer {
    /// A canonicalizer for `worker_id`; batches without a rank use `default_dp_rank`.
    pub fn new(worker_id: u64, default_dp_rank: u32, config: CanonicalConfig) -> Self {
        Self {
            config,
            worker_id,
            default_dp_rank,
            full_attention_group: None,
            next_event_id: 0,
        }
    }

    /// The source a batch belongs to: this worker and the batch's rank.
    pub fn source_of(&self, batch: &EngineBatch) -> SourceId {
        SourceId::new(
            self.worker_id,
            batch.dp_rank.unwrap_or(self.default_dp_rank),
        )
    }

    /// The source a reset or clear applies to when no batch names a rank.
    pub fn default_source(&self) -> SourceId {
        SourceId::new(self.worker_id, self.default_dp_rank)
    }

    /// Forgets learned per-source state (on a source reset).
    pub fn reset(&mut self) {
        self.full_attention_group = None;
    }

    /// Appends the router events of `batch` to `out`, in order.
    ///
    /// ```
    /// use kvrelay_ingest::{CanonicalConfig, Canonicalizer, EngineBatch, EngineEvent};
    /// use kvrelay_identity::KvQueryHashFormat;
    /// let config = CanonicalConfig::new(16, KvQueryHashFormat::DynamoStandardV1);
    /// let mut canonicalizer = Canonicalizer::new(7, 0, config);
    /// let batch = EngineBatch { ts: 0.0, events: vec![EngineEvent::AllBlocksCleared], dp_rank: Some(2) };
    /// let mut out = Vec::new();
    /// let outcome = canonicalizer.canonicalize(&batch, &mut out);
    /// assert_eq!(outcome.n_events, 1);
    /// assert_eq!(out[0].source().dp_rank, 2);
    /// ```
    pub fn canonicalize(
        &mut self,
        batch: &EngineBatch,
        out: &mut Vec<CanonicalEvent>,
    ) -> BatchOutcome {
        let source = self.source_of(batch);
        let mut outcome = BatchOutcome::default();
        for (event_idx, event) in batch.events.iter().enumerate() {
            let (tier, change) = match event {
                EngineEvent::BlockStored(stored) => {
                    let Some(tier) = self.kept_tier(stored.medium.as_deref()) else {
                        outcome.n_filtered += 1;
                        continue;
                    };
                    if !self.keeps_stored_group(stored) {
                        outcome.n_filtered += 1;
                        continue;
                    }
                    let change = if tier != CacheTier::Device && stored.token_ids.is_empty() {
                        Ok(TierChange::Offloaded {
                            engine_block_ids: stored.block_hashes.iter().map(|h| h.value).collect(),
                        })
                    } else {
                        stored_blocks(stored, event_idx, self.config).map(TierChange::Stored)
                    };
                    match change {
                        Ok(change) => (tier, change),
                        Err(err) => {
                            outcome.rejected.push(err);
                            continue;
                        }
                    }
                }
                EngineEvent::BlockRemoved(removed) => {
                    let Some(tier) = self.kept_tier(removed.medium.as_deref()) else {
                        outcome.n_filtered += 1;
                        continue;
                    };
                    if !self.in_full_attention_group(removed.group_idx) {
                        outcome.n_filtered += 1;
                        continue;
                    }
                    let engine_block_ids = removed.block_hashes.iter().map(|h| h.value).collect();
                    (
                        tier,
                        TierChange::Removed(RemovedBlocks { engine_block_ids }),
                    )
                }
                // A clear names no medium; the pool drops every tier of the source.
                EngineEvent::AllBlocksCleared => (CacheTier::Device, TierChange::Cleared),
            };
            // A device store without tokens was rejected by the token count check, so
            // no offload reaches the device here.
            let Some(event) = CanonicalEvent::new(source, self.next_event_id, tier, change) else {
                outcome.n_filtered += 1;
                continue;
            };
            out.push(event);
            self.next_event_id += 1;
            outcome.n_events += 1;
        }
        outcome
    }

    /// A clear event for `source` (used when the source resets).
    pub fn clear_event(&mut self, source: SourceId) -> RouterEvent {
        let event = RouterEvent {
            source,
            event_id: self.next_event_id,
            payload: EventPayload::AllCleared,
        };
        self.next_event_id += 1;
        event
    }

    /// The tier an event's medium names, when this canonicalizer keeps it.
    fn kept_tier(&self, medium: Option<&str>) -> Option<CacheTier> {
        match tier_of_medium(medium)? {
            CacheTier::Device => Some(CacheTier::Device),
            lower => self.config.lower_tiers.then_some(lower),
        }
    }

    fn keeps_stored_group(&mut self, stored: &BlockStored) -> bool {
        match stored.kv_cache_spec_kind.as_deref() {
            Some(kind) if kind.eq_ignore_ascii_case("full_attention") => {
                if let Some(group) = stored.group_idx {
                    self.full_attention_group = Some(group);
                }
                true
            }
            Some(_) => false,
            None => self.in_full_attention_group(stored.group_idx),
        }
    }

    fn in_full_attention_group(&self, group_idx: Option<u32>) -> bool {
        match group_idx {
            None => true,
            Some(group) => group == self.full_attention_group.unwrap_or(0),
        }
    }
}

/// Whether a medium string names device (GPU) memory; absent means device.
pub fn is_device_medium(medium: Option<&str>) -> bool {
    tier_of_medium(medium) == Some(CacheTier::Device)
}

/// The tier an engine's medium string names (any case): absent, `GPU` or `DEVICE` is
/// device memory; `CPU`, `CPU_PINNED` or `HOST` host memory; `DISK` or `STORAGE` (vLLM's
/// local storage tier) disk. Any other medium (SGLang's `EXTERNAL` remote store, ...)
/// names no tier this relay keeps.
pub fn tier_of_medium(medium: Option<&str>) -> Option<CacheTier> {
    let Some(text) = medium else {
        return Some(CacheTier::Device);
    };
    let is = |name: &str| text.eq_ignore_ascii_case(name);
    if is("GPU") || is("DEVICE") {
        Some(CacheTier::Device)
    } else if is("CPU") || is("CPU_PINNED") || is("HOST") {
        Some(CacheTier::Host)
    } else if is("DISK") || is("STORAGE") {
        Some(CacheTier::Disk)
    } else {
        None
    }
}

/// The token hashes of a stored event's blocks under `config`.
pub fn stored_token_hashes(
    stored: &BlockStored,
    event_idx: usize,
    config: CanonicalConfig,
) -> Result<Vec<u64>, CanonicalizeError> {
    let n_blocks = stored.block_hashes.len();
    if n_blocks == 0 {
        return Err(CanonicalizeError::EmptyStored { event_idx });
    }
    if stored.block_size != config.block_size {
        return Err(CanonicalizeError::BlockSizeMismatch {
            event_idx,
            block_size: stored.block_size,
            expected: config.block_size,
        });
    }
    let bs = config.block_size as usize;
    if stored.token_ids.len() != n_blocks * bs {
        return Err(CanonicalizeError::TokenCountMismatch {
            event_idx,
            n_tokens: stored.token_ids.len(),
            n_blocks,
            block_size: config.block_size,
        });
    }
    // The window rule is identity's: Eagle windows take one token past the block.
    let eagle = block_window_len(config.block_size, config.hash_format) > bs;
    let mut window: Vec<u32> = Vec::with_capacity(bs + 1);
    let mut mm: Vec<u64> = Vec::new();
    let mut out = Vec::with_capacity(n_blocks);
    for block_idx in 0..n_blocks {
        let start = block_idx * bs;
        window.clear();
        match &stored.token_ids {
            TokenIds::Flat(tokens) => {
                window.extend_from_slice(&tokens[start..start + bs]);
                if eagle {
                    let next = tokens.get(start + bs).copied().or_else(|| {
                        stored
                            .lookahead_token_ids
                            .get(block_idx)
                            .and_then(|ahead| ahead.first().copied())
                    });
                    window.push(next.ok_or(CanonicalizeError::MissingLookahead {
                        event_idx,
                        block_idx,
                    })?);
                }
            }
            TokenIds::Bigram(pairs) => {
                let block = &pairs[start..start + bs];
                window.extend(block.iter().map(|pair| pair[0]));
                if eagle && let Some(last) = block.last() {
                    window.push(last[1]);
                }
            }
        }
        let keys = stored.extra_keys.get(block_idx).and_then(Option::as_ref);
        let salt_text = keys.and_then(|keys| block_salt(keys, stored.lora_name.as_deref()));
        let salt = HashSalt {
            lora_name: stored.lora_name.as_deref(),
            cache_namespace: stored.cache_salt.as_deref().or(salt_text),
        };
        mm.clear();
        if let Some(keys) = keys {
            mm.extend(keys.iter().filter_map(|key| match key {
                ExtraKey::Multimodal { identifier, .. } => mm_hash_from_identifier(identifier),
                ExtraKey::Text(_) => None,
            }));
        }
        out.push(block_hash(&window, &mm, salt.seed()));
    }
    Ok(out)
}

/// The cache salt among a block's extra keys: the first text key that is not the LoRA name.
fn block_salt<'a>(keys: &'a [ExtraKey], lora_name: Option<&str>) -> Option<&'a str> {
    keys.iter().find_map(|key| match key {
        ExtraKey::Text(text) if Some(text.as_str()) != lora_name => Some(text.as_str()),
        _ => None,
    })
}

fn stored_blocks(
    stored: &BlockStored,
    event_idx: usize,
    config: CanonicalConfig,
) -> Result<StoredBlocks, CanonicalizeError> {
    let token_hashes = stored_token_hashes(stored, event_idx, config)?;
    let blocks = stored
        .block_hashes
        .iter()
        .zip(token_hashes)
        .map(|(engine, token_hash)| StoredBlock {
            engine_block_id: engine.value,
            token_hash,
        })
        .collect();
    Ok(StoredBlocks {
        parent_engine_block_id: stored.parent_block_hash.map(|h| h.value),
        blocks,
    })
}
