//! Logical engine KV events: what a vLLM or SGLang batch says, independent of its
//! msgpack layout (array or map events, engine version).

/// Which engine family produced a batch; selects positional field layouts and the
/// batch's rank field name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EngineKind {
    /// vLLM (`data_parallel_rank`, unsigned int hashes or 32-byte bytes hashes).
    Vllm,
    /// SGLang (`attn_dp_rank`, signed int64 hashes, bigram pages under EAGLE).
    Sglang,
}

impl EngineKind {
    /// The lowercase engine name (`vllm`, `sglang`).
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Vllm => "vllm",
            EngineKind::Sglang => "sglang",
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "vllm" => Ok(EngineKind::Vllm),
            "sglang" => Ok(EngineKind::Sglang),
            other => Err(format!("unknown engine {other:?}, expected vllm or sglang")),
        }
    }
}

/// How a block hash was encoded on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum HashRepr {
    /// A non-negative msgpack integer.
    Unsigned,
    /// A negative msgpack integer (SGLang's signed int64); kept as its two's complement.
    Signed,
    /// Raw bytes (vLLM with int hashes off), folded to the last 8 bytes big-endian.
    Bytes,
}

/// An engine's own block id, folded to 64 bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineBlockHash {
    /// The 64-bit id (two's complement for negative ints; last 8 bytes BE for bytes).
    pub value: u64,
    /// The wire form it came in.
    pub repr: HashRepr,
}

impl EngineBlockHash {
    /// A block id published as an unsigned integer (the common wire form).
    pub fn unsigned(value: u64) -> Self {
        Self {
            value,
            repr: HashRepr::Unsigned,
        }
    }
}

/// The tokens of a stored event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenIds {
    /// One token id per position.
    Flat(Vec<u32>),
    /// SGLang EAGLE pages: `[t_j, t_j+1]` pairs, one per position.
    Bigram(Vec<[u32; 2]>),
}

impl TokenIds {
    /// Number of positions (tokens, or pairs).
    pub fn len(&self) -> usize {
        match self {
            TokenIds::Flat(tokens) => tokens.len(),
            TokenIds::Bigram(pairs) => pairs.len(),
        }
    }

    /// Whether there are no positions.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One entry of a block's vLLM `extra_keys`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExtraKey {
    /// A string key: a LoRA name or a cache salt.
    Text(String),
    /// A multimodal item: `[identifier, offset]`.
    Multimodal {
        /// The item's identifier (often a 64-hex digest).
        identifier: String,
        /// The item's token offset.
        offset: i64,
    },
}

/// `BlockStored`: a chain of blocks was stored.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockStored {
    /// The engine ids of the stored blocks, in chain order.
    pub block_hashes: Vec<EngineBlockHash>,
    /// The engine id of the block the first one extends.
    pub parent_block_hash: Option<EngineBlockHash>,
    /// The tokens of all stored blocks, concatenated.
    pub token_ids: TokenIds,
    /// Tokens per block.
    pub block_size: u32,
    /// Deprecated integer LoRA id.
    pub lora_id: Option<i64>,
    /// Storage medium string as on the wire (`GPU`, `CPU`, `CPU_PINNED`, ...).
    pub medium: Option<String>,
    /// LoRA adapter name.
    pub lora_name: Option<String>,
    /// Per-block extra keys (vLLM ≥ 0.23); empty when absent. `None` entries: no keys.
    pub extra_keys: Vec<Option<Vec<ExtraKey>>>,
    /// KV cache group index (vLLM hybrid models).
    pub group_idx: Option<u32>,
    /// KV cache spec kind (`full_attention`, `sliding_window`, ...).
    pub kv_cache_spec_kind: Option<String>,
    /// Sliding-window size, for sliding-window groups (tokens).
    pub kv_cache_spec_sliding_window: Option<u32>,
    /// Cache salt (SGLang `cache_salt`, or SGLang 0.5.19 `metadata.cache_salt`).
    pub cache_salt: Option<String>,
    /// Per-block lookahead tokens (vLLM ≥ 0.33); empty when absent.
    pub lookahead_token_ids: Vec<Vec<u32>>,
}

impl BlockStored {
    /// A store of `block_hashes` (chained under `parent_block_hash`) with `token_ids` of
    /// `block_size`-token blocks and every optional field absent: no LoRA, medium, extra
    /// keys, group, cache spec, salt or lookahead. Set those on the result
    /// (`BlockStored { medium: .., ..BlockStored::new(..) }`).
    pub fn new(
        block_hashes: Vec<EngineBlockHash>,
        parent_block_hash: Option<EngineBlockHash>,
        token_ids: TokenIds,
        block_size: u32,
    ) -> Self {
        Self {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            medium: None,
            lora_name: None,
            extra_keys: Vec::new(),
            group_idx: None,
            kv_cache_spec_kind: None,
            kv_cache_spec_sliding_window: None,
            cache_salt: None,
            lookahead_token_ids: Vec::new(),
        }
    }
}

/// `BlockRemoved`: blocks were evicted.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// The engine ids of the removed blocks.
    pub block_hashes: Vec<EngineBlockHash>,
    /// Storage medium string as on the wire.
    pub medium: Option<String>,
    /// KV cache group index.
    pub group_idx: Option<u32>,
}

/// One logical engine event.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineEvent {
    /// Blocks stored.
    BlockStored(BlockStored),
    /// Blocks removed.
    BlockRemoved(BlockRemoved),
    /// The engine dropped its whole cache.
    AllBlocksCleared,
}

impl EngineEvent {
    /// The engine's tag for this event kind.
    pub fn tag(&self) -> &'static str {
        match self {
            EngineEvent::BlockStored(_) => "BlockStored",
            EngineEvent::BlockRemoved(_) => "BlockRemoved",
            EngineEvent::AllBlocksCleared => "AllBlocksCleared",
        }
    }
}

/// One decoded `KVEventBatch`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EngineBatch {
    /// Publish time, float seconds since the epoch.
    pub ts: f64,
    /// The events, in order.
    pub events: Vec<EngineEvent>,
    /// The data-parallel rank the batch names (`None` when nil or absent).
    pub dp_rank: Option<u32>,
}

impl EngineBatch {
    /// Number of blocks named by all events (stored plus removed).
    pub fn n_blocks(&self) -> usize {
        self.events
            .iter()
            .map(|event| match event {
                EngineEvent::BlockStored(stored) => stored.block_hashes.len(),
                EngineEvent::BlockRemoved(removed) => removed.block_hashes.len(),
                EngineEvent::AllBlocksCleared => 0,
            })
            .sum()
    }
}
