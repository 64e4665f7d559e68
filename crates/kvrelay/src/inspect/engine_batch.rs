//! `kvrelay inspect engine-batch`: decode one vLLM/SGLang KV-event msgpack payload.
//!
//! Prints the batch as one JSON line: `engine`, `ts`, `dp_rank` and per event its `kind`,
//! engine block hashes (u64, with their wire form), parent, token ids, LoRA name, medium,
//! group and spec kind, cache salt, and whether the ingest filtering rule keeps it. With
//! `--block-size N` each stored event also gets the canonical `token_hashes` and, when
//! its parent is in the same batch or absent, the canonical `sequence_hashes`.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use kvrelay_identity::KvQueryHashFormat;
use kvrelay_identity::hashing::{canonical_child, canonical_root};
use kvrelay_ingest::{
    CanonicalConfig, Canonicalizer, EngineBatch, EngineBlockHash, EngineEvent, EngineKind,
    HashRepr, Limits, TokenIds, decode_engine_batch, stored_token_hashes,
};
use serde::Serialize;
use serde_json::{Value, json};

use crate::usage::usage;

/// Arguments of `kvrelay inspect engine-batch`.
#[derive(Debug, clap::Args)]
pub(crate) struct EngineBatchArgs {
    /// Which engine wrote the payload: `vllm` or `sglang`.
    #[arg(long, value_name = "ENGINE")]
    engine: String,
    /// Tokens per block of the pool; adds canonical token and sequence hashes.
    #[arg(long, value_name = "N")]
    block_size: Option<u32>,
    /// Hash with Eagle windows (block_size + 1 tokens) instead of standard ones.
    #[arg(long)]
    eagle: bool,
    /// The msgpack payload file (the third frame of `[topic, seq, payload]`).
    #[arg(value_name = "FILE")]
    file: PathBuf,
}

/// The JSON printed by `kvrelay inspect engine-batch`.
#[derive(Debug, Serialize)]
struct BatchOutput {
    engine: &'static str,
    ts: f64,
    dp_rank: Option<u32>,
    n_blocks: usize,
    events: Vec<Value>,
}

pub(crate) fn run(args: &EngineBatchArgs) -> Result<()> {
    let engine: EngineKind = args.engine.parse().map_err(usage)?;
    if args.block_size == Some(0) {
        return Err(usage("--block-size must be at least 1"));
    }
    let bytes = std::fs::read(&args.file)
        .with_context(|| format!("read engine batch {}", args.file.display()))?;
    let batch = decode_engine_batch(&bytes, engine, &Limits::default())
        .map_err(|err| usage(format!("{}: {err}", args.file.display())))?;
    let config = args.block_size.map(|block_size| {
        CanonicalConfig::new(block_size, KvQueryHashFormat::from_enable_eagle(args.eagle))
    });
    let output = BatchOutput {
        engine: engine.as_str(),
        ts: batch.ts,
        dp_rank: batch.dp_rank,
        n_blocks: batch.n_blocks(),
        events: describe_events(&batch, config),
    };
    println!("{}", serde_json::to_string(&output)?);
    Ok(())
}

fn describe_events(batch: &EngineBatch, config: Option<CanonicalConfig>) -> Vec<Value> {
    // The filtering rule is stateful (it learns the full-attention group), so run the
    // real canonicalizer one event at a time to report what it keeps.
    let filter_config =
        config.unwrap_or(CanonicalConfig::new(0, KvQueryHashFormat::DynamoStandardV1));
    let mut canonicalizer = Canonicalizer::new(0, 0, filter_config);
    let mut sequence_by_engine_id: HashMap<u64, u64> = HashMap::new();
    let mut out = Vec::with_capacity(batch.events.len());
    for (event_idx, event) in batch.events.iter().enumerate() {
        let single = EngineBatch {
            ts: batch.ts,
            events: vec![event.clone()],
            dp_rank: batch.dp_rank,
        };
        let outcome = canonicalizer.canonicalize(&single, &mut Vec::new());
        let kept = outcome.n_filtered == 0;
        let mut value = match event {
            EngineEvent::BlockStored(stored) => {
                let mut value = json!({
                    "kind": "BlockStored",
                    "block_hashes": hash_values(&stored.block_hashes),
                    "hash_repr": hash_repr(stored.block_hashes.first()),
                    "parent": stored.parent_block_hash.map(|h| h.value),
                    "token_ids": token_ids(&stored.token_ids),
                    "block_size": stored.block_size,
                    "lora_id": stored.lora_id,
                    "lora_name": stored.lora_name,
                    "medium": stored.medium,
                    "group_idx": stored.group_idx,
                    "kv_cache_spec_kind": stored.kv_cache_spec_kind,
                    "cache_salt": stored.cache_salt,
                });
                if let Some(config) = config {
                    canonical_hashes(
                        &mut value,
                        stored,
                        event_idx,
                        config,
                        &mut sequence_by_engine_id,
                    );
                }
                value
            }
            EngineEvent::BlockRemoved(removed) => json!({
                "kind": "BlockRemoved",
                "block_hashes": hash_values(&removed.block_hashes),
                "hash_repr": hash_repr(removed.block_hashes.first()),
                "medium": removed.medium,
                "group_idx": removed.group_idx,
            }),
            EngineEvent::AllBlocksCleared => json!({ "kind": "AllBlocksCleared" }),
        };
        value["kept"] = Value::Bool(kept);
        out.push(value);
    }
    out
}

fn canonical_hashes(
    value: &mut Value,
    stored: &kvrelay_ingest::BlockStored,
    event_idx: usize,
    config: CanonicalConfig,
    sequence_by_engine_id: &mut HashMap<u64, u64>,
) {
    match stored_token_hashes(stored, event_idx, config) {
        Ok(token_hashes) => {
            let mut parent = match stored.parent_block_hash {
                None => Some(None),
                Some(hash) => sequence_by_engine_id.get(&hash.value).map(|seq| Some(*seq)),
            };
            let sequence: Option<Vec<u64>> = parent.as_mut().map(|parent| {
                token_hashes
                    .iter()
                    .zip(&stored.block_hashes)
                    .map(|(token_hash, engine_id)| {
                        let seq = match *parent {
                            None => canonical_root(*token_hash),
                            Some(p) => canonical_child(p, *token_hash),
                        };
                        sequence_by_engine_id.insert(engine_id.value, seq);
                        *parent = Some(seq);
                        seq
                    })
                    .collect()
            });
            value["token_hashes"] = json!(token_hashes);
            value["sequence_hashes"] = match sequence {
                Some(sequence) => json!(sequence),
                None => json!("parent not in this batch"),
            };
        }
        Err(err) => value["canonical_error"] = Value::String(err.to_string()),
    }
}

fn hash_values(hashes: &[EngineBlockHash]) -> Vec<u64> {
    hashes.iter().map(|hash| hash.value).collect()
}

fn hash_repr(hash: Option<&EngineBlockHash>) -> Option<&'static str> {
    hash.map(|hash| match hash.repr {
        HashRepr::Unsigned => "uint",
        HashRepr::Signed => "int",
        HashRepr::Bytes => "bytes",
    })
}

fn token_ids(tokens: &TokenIds) -> Value {
    match tokens {
        TokenIds::Flat(flat) => json!(flat),
        TokenIds::Bigram(pairs) => json!(pairs),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> EngineBatch {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/fixtures/engine-events")
            .join(name);
        let bytes = std::fs::read(path).unwrap();
        decode_engine_batch(&bytes, EngineKind::Sglang, &Limits::default()).unwrap()
    }

    #[test]
    fn chained_stored_event_gets_sequence_hashes_from_its_parent_in_the_batch() {
        let batch = fixture("sglang-0.5.23-basic.msgpack");
        let config = CanonicalConfig::new(16, KvQueryHashFormat::DynamoStandardV1);
        let events = describe_events(&batch, Some(config));
        let first_seq = events[0]["sequence_hashes"].as_array().unwrap();
        let second_token = events[1]["token_hashes"][0].as_u64().unwrap();
        let expected = canonical_child(first_seq[1].as_u64().unwrap(), second_token);
        assert_eq!(events[1]["sequence_hashes"][0].as_u64(), Some(expected));
        assert_eq!(events[3]["kind"], "AllBlocksCleared");
    }

    #[test]
    fn cpu_medium_events_are_reported_as_not_kept() {
        let batch = fixture("sglang-0.5.23-medium-cpu.msgpack");
        let events = describe_events(&batch, None);
        assert_eq!(events[0]["kept"], Value::Bool(false));
        assert_eq!(events[3]["kept"], Value::Bool(true));
    }
}
