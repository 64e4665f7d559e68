//! The model deployment card: the fields of a worker's card the relay reads.
//!
//! This is a format type (STYLE rule 9): it mirrors the JSON the reference runtime publishes
//! in discovery, field names included, and ignores every field it does not use.
//!
//! Numeric fields that size memory are bounded here, at the card boundary: a card whose
//! `data_parallel_size`, `data_parallel_start_rank` or `total_kv_blocks` is out of range
//! does not decode (the projection reports it as malformed and skips it), so no later layer
//! ever allocates per rank or per block for it.

use std::collections::BTreeSet;

use kvrelay_identity::{EndpointId, IndexerIdentitySpec};
use serde::{Deserialize, Deserializer, Serialize};

use crate::limits::{MAX_CARD_DATA_PARALLEL_SIZE, MAX_CARD_START_RANK, MAX_CARD_TOTAL_KV_BLOCKS};

/// One worker's model deployment card, as published in discovery (`card_json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelDeploymentCard {
    /// The request-facing model name; the canonical model id of a base card.
    pub display_name: String,
    /// Where the weights come from; the cache-semantics default input. Falls back to
    /// `display_name` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source_path: Option<String>,
    /// Tokens per KV block (0 is invalid and fences the endpoint's pool).
    #[serde(default)]
    pub kv_cache_block_size: u32,
    /// The request surfaces the worker serves (`"Chat | Completions"` in JSON).
    #[serde(default)]
    pub model_type: ModelType,
    /// The worker's role; absent means a legacy card.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker_type: Option<WorkerType>,
    /// Roles this worker needs live somewhere, in disjunctive normal form.
    #[serde(default)]
    pub needs: Vec<Vec<WorkerType>>,
    /// Extra request-facing names of the model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// Present on LoRA adapter cards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraInfo>,
    /// Operator-supplied identity material replacing the default digest inputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub indexer_identity: Option<IndexerIdentitySpec>,
    /// Engine runtime facts: capacity, data parallelism, Eagle, taints.
    #[serde(default)]
    pub runtime_config: RuntimeConfig,
}

impl ModelDeploymentCard {
    /// A card with only a name; every other field takes its default (legacy worker, block
    /// size 0).
    pub fn with_name(display_name: &str) -> Self {
        Self {
            display_name: display_name.to_owned(),
            source_path: None,
            kv_cache_block_size: 0,
            model_type: ModelType::default(),
            worker_type: None,
            needs: Vec::new(),
            aliases: Vec::new(),
            lora: None,
            indexer_identity: None,
            runtime_config: RuntimeConfig::default(),
        }
    }

    /// The source path, falling back to the display name.
    pub fn source_path(&self) -> &str {
        self.source_path.as_deref().unwrap_or(&self.display_name)
    }

    /// Rewrites a legacy prefill card (no worker type, prefill surface) as a typed prefill
    /// worker that needs a decode worker, as the reference runtime does.
    pub fn normalize_legacy_prefill(&mut self) {
        if self.worker_type.is_none() && self.model_type.supports_prefill() {
            self.worker_type = Some(WorkerType::Prefill);
            if self.needs.is_empty() {
                self.needs = vec![vec![WorkerType::Decode]];
            }
        }
    }
}

/// A worker's role as cards spell it (`"prefill"`, `"decode"`, `"encode"`, `"aggregated"`).
///
/// The reference writes role flags joined by `|`; `"prefill|decode"` reads as aggregated,
/// other combinations are rejected (the card is then malformed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum WorkerType {
    /// Computes prompt KV and hands it to a decode worker.
    Prefill,
    /// Generates tokens from transferred KV.
    Decode,
    /// Encodes multimodal inputs.
    Encode,
    /// Prefill and decode in one worker.
    Aggregated,
}

impl<'de> Deserialize<'de> for WorkerType {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        let mut flags = BTreeSet::new();
        for flag in text.split('|').map(str::trim) {
            match flag {
                "prefill" => flags.insert(Self::Prefill),
                "decode" => flags.insert(Self::Decode),
                "encode" => flags.insert(Self::Encode),
                "aggregated" => flags.insert(Self::Aggregated),
                _ => {
                    return Err(serde::de::Error::custom(format!(
                        "unknown worker type {flag:?} in {text:?}"
                    )));
                }
            };
        }
        let worker_type = match flags.into_iter().collect::<Vec<_>>().as_slice() {
            [single] => *single,
            [Self::Prefill, Self::Decode] => Self::Aggregated,
            _ => {
                return Err(serde::de::Error::custom(format!(
                    "unsupported worker type combination {text:?}"
                )));
            }
        };
        Ok(worker_type)
    }
}

/// The request surfaces of a worker: a set of flag names, normalised (trimmed, sorted,
/// deduplicated). JSON form: the names joined by `" | "`.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModelType {
    flags: BTreeSet<String>,
}

impl ModelType {
    /// Parses `"Chat | Completions"`; empty parts are skipped.
    pub fn parse(text: &str) -> Self {
        let flags = text
            .split('|')
            .map(str::trim)
            .filter(|flag| !flag.is_empty())
            .map(str::to_owned)
            .collect();
        Self { flags }
    }

    /// The flag names, sorted.
    pub fn flags(&self) -> impl Iterator<Item = &str> {
        self.flags.iter().map(String::as_str)
    }

    /// Whether the `Prefill` surface flag is set.
    pub fn supports_prefill(&self) -> bool {
        self.flags.contains("Prefill")
    }
}

impl Serialize for ModelType {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let joined = self.flags().collect::<Vec<_>>().join(" | ");
        serializer.serialize_str(&joined)
    }
}

impl<'de> Deserialize<'de> for ModelType {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        Ok(Self::parse(&text))
    }
}

/// LoRA adapter metadata of an adapter card.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoraInfo {
    /// The runtime LoRA name (salts block hashes); distinct from the served model name.
    pub name: String,
    /// How many adapters the worker keeps on GPU, if published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_gpu_lora_count: Option<u32>,
}

/// The engine runtime facts of a card.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuntimeConfig {
    /// KV capacity of one data-parallel rank, in blocks (at most
    /// [`MAX_CARD_TOTAL_KV_BLOCKS`]).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "bounded_total_kv_blocks"
    )]
    pub total_kv_blocks: Option<u64>,
    /// Maximum concurrent sequences.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_num_seqs: Option<u64>,
    /// Maximum tokens per scheduler batch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_num_batched_tokens: Option<u64>,
    /// First data-parallel rank this worker hosts (at most [`MAX_CARD_START_RANK`]).
    #[serde(default, deserialize_with = "bounded_start_rank")]
    pub data_parallel_start_rank: u32,
    /// Number of data-parallel ranks this worker hosts (1..=[`MAX_CARD_DATA_PARALLEL_SIZE`]).
    #[serde(
        default = "default_data_parallel_size",
        deserialize_with = "bounded_data_parallel_size"
    )]
    pub data_parallel_size: u32,
    /// Whether the worker runs a local indexer (the recovery target of its KV events).
    #[serde(default = "default_true")]
    pub enable_local_indexer: bool,
    /// Eagle speculative decoding (changes the hash format).
    #[serde(default)]
    pub enable_eagle: bool,
    /// Where this worker's KV events are published, when not on the serving endpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_state_endpoint: Option<EndpointId>,
    /// Per-worker LoRA capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_gpu_lora_count: Option<u32>,
    /// Scheduling taints; a set.
    #[serde(default, skip_serializing_if = "BTreeSet::is_empty")]
    pub taints: BTreeSet<String>,
}

impl Default for RuntimeConfig {
    fn default() -> Self {
        Self {
            total_kv_blocks: None,
            max_num_seqs: None,
            max_num_batched_tokens: None,
            data_parallel_start_rank: 0,
            data_parallel_size: default_data_parallel_size(),
            enable_local_indexer: true,
            enable_eagle: false,
            kv_state_endpoint: None,
            max_gpu_lora_count: None,
            taints: BTreeSet::new(),
        }
    }
}

fn default_data_parallel_size() -> u32 {
    1
}

fn default_true() -> bool {
    true
}

fn bounded_data_parallel_size<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    let size = u32::deserialize(deserializer)?;
    if size == 0 || size > MAX_CARD_DATA_PARALLEL_SIZE {
        return Err(serde::de::Error::custom(format!(
            "data_parallel_size {size} outside 1..={MAX_CARD_DATA_PARALLEL_SIZE}"
        )));
    }
    Ok(size)
}

fn bounded_start_rank<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u32, D::Error> {
    let rank = u32::deserialize(deserializer)?;
    if rank > MAX_CARD_START_RANK {
        return Err(serde::de::Error::custom(format!(
            "data_parallel_start_rank {rank} exceeds {MAX_CARD_START_RANK}"
        )));
    }
    Ok(rank)
}

fn bounded_total_kv_blocks<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<u64>, D::Error> {
    let blocks = Option::<u64>::deserialize(deserializer)?;
    if let Some(blocks) = blocks
        && blocks > MAX_CARD_TOTAL_KV_BLOCKS
    {
        return Err(serde::de::Error::custom(format!(
            "total_kv_blocks {blocks} exceeds {MAX_CARD_TOTAL_KV_BLOCKS}"
        )));
    }
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_card_with_unknown_fields_decodes() {
        let json = r#"{"display_name":"fake-model","slug":"fake-model","source_path":"models/fake-model",
            "kv_cache_block_size":16,"model_type":"Chat | Completions","model_input":"Tokens",
            "worker_type":"aggregated","needs":[],
            "runtime_config":{"total_kv_blocks":4194304,"max_num_seqs":null,"data_parallel_start_rank":0,
              "data_parallel_size":1,"enable_local_indexer":true,"enable_eagle":false,"tool_call_parser":null}}"#;
        let card: ModelDeploymentCard = serde_json::from_str(json).unwrap();
        assert_eq!(card.display_name, "fake-model");
        assert_eq!(card.source_path(), "models/fake-model");
        assert_eq!(card.kv_cache_block_size, 16);
        assert_eq!(card.worker_type, Some(WorkerType::Aggregated));
        assert_eq!(
            card.model_type.flags().collect::<Vec<_>>(),
            ["Chat", "Completions"]
        );
        assert_eq!(card.runtime_config.total_kv_blocks, Some(4_194_304));
        assert_eq!(card.runtime_config.max_num_seqs, None);
    }

    #[test]
    fn missing_runtime_fields_take_reference_defaults() {
        let card: ModelDeploymentCard = serde_json::from_str(r#"{"display_name":"m"}"#).unwrap();
        assert_eq!(card.runtime_config.data_parallel_size, 1);
        assert!(card.runtime_config.enable_local_indexer);
        assert!(!card.runtime_config.enable_eagle);
        assert_eq!(card.worker_type, None);
        assert_eq!(card.source_path(), "m");
    }

    #[test]
    fn model_type_round_trips_through_its_text_form() {
        let parsed = ModelType::parse("Completions|Chat | ");
        let json = serde_json::to_string(&parsed).unwrap();
        assert_eq!(json, r#""Chat | Completions""#);
        let back: ModelType = serde_json::from_str(&json).unwrap();
        assert_eq!(back, parsed);
    }

    #[test]
    fn worker_type_flags_read_like_the_reference() {
        let parse = |text: &str| serde_json::from_value::<WorkerType>(serde_json::json!(text));
        assert_eq!(parse("decode").unwrap(), WorkerType::Decode);
        assert_eq!(parse("prefill|decode").unwrap(), WorkerType::Aggregated);
        assert_eq!(parse("aggregated").unwrap(), WorkerType::Aggregated);
        assert!(parse("prefill|encode").is_err());
        assert!(parse("router").is_err());
        assert_eq!(
            serde_json::to_value(WorkerType::Aggregated).unwrap(),
            "aggregated"
        );
    }

    #[test]
    fn legacy_prefill_card_becomes_prefill_needing_decode() {
        let mut card = ModelDeploymentCard::with_name("m");
        card.model_type = ModelType::parse("Prefill");
        card.normalize_legacy_prefill();
        assert_eq!(card.worker_type, Some(WorkerType::Prefill));
        assert_eq!(card.needs, vec![vec![WorkerType::Decode]]);

        let mut chat = ModelDeploymentCard::with_name("m");
        chat.model_type = ModelType::parse("Chat");
        chat.normalize_legacy_prefill();
        assert_eq!(chat.worker_type, None);
    }

    #[test]
    fn out_of_range_rank_and_block_counts_do_not_decode() {
        let check = |runtime: serde_json::Value, needle: &str| {
            let json = serde_json::json!({"display_name": "m", "runtime_config": runtime});
            let err = serde_json::from_value::<ModelDeploymentCard>(json).unwrap_err();
            assert!(err.to_string().contains(needle), "{err}");
        };
        check(
            serde_json::json!({"data_parallel_size": 4_294_967_295u64}),
            "data_parallel_size 4294967295 outside 1..=4096",
        );
        check(
            serde_json::json!({"data_parallel_size": 0}),
            "data_parallel_size 0",
        );
        check(
            serde_json::json!({"data_parallel_start_rank": 4_294_967_000u64}),
            "data_parallel_start_rank",
        );
        check(
            serde_json::json!({"total_kv_blocks": 1u64 << 40}),
            "total_kv_blocks 1099511627776 exceeds",
        );
    }

    #[test]
    fn the_largest_allowed_values_decode() {
        let json = serde_json::json!({"display_name": "m", "runtime_config": {
            "data_parallel_size": MAX_CARD_DATA_PARALLEL_SIZE,
            "data_parallel_start_rank": MAX_CARD_START_RANK,
            "total_kv_blocks": MAX_CARD_TOTAL_KV_BLOCKS,
            "max_num_seqs": null,
        }});
        let card = serde_json::from_value::<ModelDeploymentCard>(json).unwrap();
        assert_eq!(card.runtime_config.data_parallel_size, 4096);
        let null_blocks =
            serde_json::json!({"display_name": "m", "runtime_config": {"total_kv_blocks": null}});
        let card = serde_json::from_value::<ModelDeploymentCard>(null_blocks).unwrap();
        assert_eq!(card.runtime_config.total_kv_blocks, None);
    }
}
