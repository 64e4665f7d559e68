//! [`EngineBatch`] → msgpack in the engines' layouts: for test publishers, generated
//! traffic and property tests of the decoder.
//!
//! Array events write the engine's positional fields in declaration order (vLLM 0.23
//! layout: 11 fields; SGLang 0.5.19 layout: 6 fields, plus the `metadata` map when a
//! cache salt is set). Map events write `type` first and omit absent optional fields.
//! Bytes hashes are written as 8-byte `bin` values.

use rmp::encode;

use crate::engine::{
    BlockRemoved, BlockStored, EngineBatch, EngineBlockHash, EngineEvent, EngineKind, ExtraKey,
    HashRepr, TokenIds,
};

/// How a batch and its events are laid out on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EngineLayout {
    /// Whose positional layout and rank field name to use.
    pub engine: EngineKind,
    /// Events as tagged maps (`true`) or tagged arrays (`false`).
    pub map_events: bool,
    /// The batch as a map (`true`) or the usual 3-element array (`false`).
    pub map_batch: bool,
}

/// Appends the msgpack encoding of `batch` in `layout` to `out`.
pub fn encode_engine_batch(batch: &EngineBatch, layout: EngineLayout, out: &mut Vec<u8>) {
    let rank_key = match layout.engine {
        EngineKind::Vllm => "data_parallel_rank",
        EngineKind::Sglang => "attn_dp_rank",
    };
    if layout.map_batch {
        map_len(out, 3);
        string(out, "ts");
        float(out, batch.ts);
        string(out, "events");
    } else {
        array_len(out, 3);
        float(out, batch.ts);
    }
    array_len(out, batch.events.len());
    for event in &batch.events {
        if layout.map_events {
            encode_map_event(event, out);
        } else {
            encode_array_event(event, layout.engine, out);
        }
    }
    if layout.map_batch {
        string(out, rank_key);
    }
    opt_uint(out, batch.dp_rank.map(u64::from));
}

fn encode_array_event(event: &EngineEvent, engine: EngineKind, out: &mut Vec<u8>) {
    match (event, engine) {
        (EngineEvent::BlockStored(stored), EngineKind::Vllm) => {
            array_len(out, 12);
            string(out, "BlockStored");
            stored_core(stored, out);
            opt_string(out, stored.lora_name.as_deref());
            extra_keys(out, &stored.extra_keys);
            opt_uint(out, stored.group_idx.map(u64::from));
            opt_string(out, stored.kv_cache_spec_kind.as_deref());
            opt_uint(out, stored.kv_cache_spec_sliding_window.map(u64::from));
        }
        (EngineEvent::BlockStored(stored), EngineKind::Sglang) => {
            let with_metadata = stored.cache_salt.is_some();
            array_len(out, if with_metadata { 8 } else { 7 });
            string(out, "BlockStored");
            stored_core(stored, out);
            if let Some(salt) = &stored.cache_salt {
                map_len(out, 1);
                string(out, "cache_salt");
                string(out, salt);
            }
        }
        (EngineEvent::BlockRemoved(removed), EngineKind::Vllm) => {
            array_len(out, 4);
            string(out, "BlockRemoved");
            hashes(out, &removed.block_hashes);
            opt_string(out, removed.medium.as_deref());
            opt_uint(out, removed.group_idx.map(u64::from));
        }
        (EngineEvent::BlockRemoved(removed), EngineKind::Sglang) => {
            array_len(out, 3);
            string(out, "BlockRemoved");
            hashes(out, &removed.block_hashes);
            opt_string(out, removed.medium.as_deref());
        }
        (EngineEvent::AllBlocksCleared, _) => {
            array_len(out, 1);
            string(out, "AllBlocksCleared");
        }
    }
}

/// The six fields every positional `BlockStored` starts with.
fn stored_core(stored: &BlockStored, out: &mut Vec<u8>) {
    hashes(out, &stored.block_hashes);
    opt_hash(out, stored.parent_block_hash);
    tokens(out, &stored.token_ids);
    uint(out, u64::from(stored.block_size));
    opt_int(out, stored.lora_id);
    opt_string(out, stored.medium.as_deref());
}

fn encode_map_event(event: &EngineEvent, out: &mut Vec<u8>) {
    match event {
        EngineEvent::BlockStored(stored) => {
            let optional = [
                stored.lora_name.is_some(),
                !stored.extra_keys.is_empty(),
                stored.group_idx.is_some(),
                stored.kv_cache_spec_kind.is_some(),
                stored.kv_cache_spec_sliding_window.is_some(),
                stored.cache_salt.is_some(),
                !stored.lookahead_token_ids.is_empty(),
            ];
            let n = 7 + optional.iter().filter(|set| **set).count();
            map_len(out, n);
            string(out, "type");
            string(out, "BlockStored");
            string(out, "block_hashes");
            hashes(out, &stored.block_hashes);
            string(out, "parent_block_hash");
            opt_hash(out, stored.parent_block_hash);
            string(out, "token_ids");
            tokens(out, &stored.token_ids);
            string(out, "block_size");
            uint(out, u64::from(stored.block_size));
            string(out, "lora_id");
            opt_int(out, stored.lora_id);
            string(out, "medium");
            opt_string(out, stored.medium.as_deref());
            if let Some(name) = &stored.lora_name {
                string(out, "lora_name");
                string(out, name);
            }
            if !stored.extra_keys.is_empty() {
                string(out, "extra_keys");
                extra_keys(out, &stored.extra_keys);
            }
            if let Some(group) = stored.group_idx {
                string(out, "group_idx");
                uint(out, u64::from(group));
            }
            if let Some(kind) = &stored.kv_cache_spec_kind {
                string(out, "kv_cache_spec_kind");
                string(out, kind);
            }
            if let Some(window) = stored.kv_cache_spec_sliding_window {
                string(out, "kv_cache_spec_sliding_window");
                uint(out, u64::from(window));
            }
            if let Some(salt) = &stored.cache_salt {
                string(out, "cache_salt");
                string(out, salt);
            }
            if !stored.lookahead_token_ids.is_empty() {
                string(out, "lookahead_token_ids");
                array_len(out, stored.lookahead_token_ids.len());
                for block in &stored.lookahead_token_ids {
                    array_len(out, block.len());
                    for token in block {
                        uint(out, u64::from(*token));
                    }
                }
            }
        }
        EngineEvent::BlockRemoved(BlockRemoved {
            block_hashes,
            medium,
            group_idx,
        }) => {
            map_len(out, 3 + usize::from(group_idx.is_some()));
            string(out, "type");
            string(out, "BlockRemoved");
            string(out, "block_hashes");
            hashes(out, block_hashes);
            string(out, "medium");
            opt_string(out, medium.as_deref());
            if let Some(group) = group_idx {
                string(out, "group_idx");
                uint(out, u64::from(*group));
            }
        }
        EngineEvent::AllBlocksCleared => {
            map_len(out, 1);
            string(out, "type");
            string(out, "AllBlocksCleared");
        }
    }
}

fn hashes(out: &mut Vec<u8>, hashes: &[EngineBlockHash]) {
    array_len(out, hashes.len());
    for hash in hashes {
        block_hash(out, *hash);
    }
}

fn opt_hash(out: &mut Vec<u8>, hash: Option<EngineBlockHash>) {
    match hash {
        None => nil(out),
        Some(hash) => block_hash(out, hash),
    }
}

fn block_hash(out: &mut Vec<u8>, hash: EngineBlockHash) {
    match hash.repr {
        HashRepr::Unsigned => uint(out, hash.value),
        HashRepr::Signed => {
            let _ = encode::write_sint(out, hash.value as i64);
        }
        HashRepr::Bytes => {
            let _ = encode::write_bin(out, &hash.value.to_be_bytes());
        }
    }
}

fn tokens(out: &mut Vec<u8>, tokens: &TokenIds) {
    match tokens {
        TokenIds::Flat(flat) => {
            array_len(out, flat.len());
            for token in flat {
                uint(out, u64::from(*token));
            }
        }
        TokenIds::Bigram(pairs) => {
            array_len(out, pairs.len());
            for [first, second] in pairs {
                array_len(out, 2);
                uint(out, u64::from(*first));
                uint(out, u64::from(*second));
            }
        }
    }
}

fn extra_keys(out: &mut Vec<u8>, blocks: &[Option<Vec<ExtraKey>>]) {
    if blocks.is_empty() {
        nil(out);
        return;
    }
    array_len(out, blocks.len());
    for block in blocks {
        match block {
            None => nil(out),
            Some(keys) => {
                array_len(out, keys.len());
                for key in keys {
                    match key {
                        ExtraKey::Text(text) => string(out, text),
                        ExtraKey::Multimodal { identifier, offset } => {
                            array_len(out, 2);
                            string(out, identifier);
                            let _ = encode::write_sint(out, *offset);
                        }
                    }
                }
            }
        }
    }
}

// Writes into a Vec<u8> cannot fail; rmp's Result only reflects the io::Write contract.
fn array_len(out: &mut Vec<u8>, n: usize) {
    let _ = encode::write_array_len(out, u32::try_from(n).unwrap_or(u32::MAX));
}

fn map_len(out: &mut Vec<u8>, n: usize) {
    let _ = encode::write_map_len(out, u32::try_from(n).unwrap_or(u32::MAX));
}

fn string(out: &mut Vec<u8>, text: &str) {
    let _ = encode::write_str(out, text);
}

fn float(out: &mut Vec<u8>, value: f64) {
    let _ = encode::write_f64(out, value);
}

fn uint(out: &mut Vec<u8>, value: u64) {
    let _ = encode::write_uint(out, value);
}

fn nil(out: &mut Vec<u8>) {
    let _ = encode::write_nil(out);
}

fn opt_uint(out: &mut Vec<u8>, value: Option<u64>) {
    match value {
        None => nil(out),
        Some(value) => uint(out, value),
    }
}

fn opt_int(out: &mut Vec<u8>, value: Option<i64>) {
    match value {
        None => nil(out),
        Some(value) => {
            let _ = encode::write_sint(out, value);
        }
    }
}

fn opt_string(out: &mut Vec<u8>, value: Option<&str>) {
    match value {
        None => nil(out),
        Some(text) => string(out, text),
    }
}
