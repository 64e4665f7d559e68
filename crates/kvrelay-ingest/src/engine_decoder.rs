//! msgpack `KVEventBatch` → [`EngineBatch`]: every vLLM and SGLang layout in the wild.
//!
//! Accepted: the batch as an array `[ts, events, rank]` or a map (`ts`, `events`,
//! `data_parallel_rank` / `attn_dp_rank`); events as tagged arrays (`["BlockStored", ..]`,
//! fields in the engine's declaration order, missing trailing fields defaulted) or tagged
//! maps (`{"type": "BlockStored", ..}`, unknown keys ignored, the tag anywhere); block
//! hashes as uint64, int64 or bytes (folded to the last 8 bytes, big-endian); SGLang
//! bigram token pairs; SGLang 0.5.19's trailing `metadata` map; non-minimal headers.

use crate::engine::{
    BlockRemoved, BlockStored, EngineBatch, EngineBlockHash, EngineEvent, EngineKind, ExtraKey,
    HashRepr, TokenIds,
};
use crate::error::DecodeError;
use crate::limits::Limits;
use crate::msgpack::{Item, Reader};

/// Decodes one msgpack batch payload from `engine`, within `limits`.
///
/// ```
/// use kvrelay_ingest::{decode_engine_batch, EngineEvent, EngineKind, Limits};
/// // [ts, [["AllBlocksCleared"]], 0] as msgpack:
/// let bytes = [0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xb0,
///     b'A', b'l', b'l', b'B', b'l', b'o', b'c', b'k', b's',
///     b'C', b'l', b'e', b'a', b'r', b'e', b'd', 0x00];
/// let batch = decode_engine_batch(&bytes, EngineKind::Vllm, &Limits::default()).unwrap();
/// assert_eq!(batch.events, vec![EngineEvent::AllBlocksCleared]);
/// assert_eq!(batch.dp_rank, Some(0));
/// ```
pub fn decode_engine_batch(
    payload: &[u8],
    engine: EngineKind,
    limits: &Limits,
) -> Result<EngineBatch, DecodeError> {
    let mut reader = Reader::new(payload);
    let batch = match reader.next()? {
        Item::Array(n) => decode_array_batch(&mut reader, n, engine, limits)?,
        Item::Map(n) => decode_map_batch(&mut reader, n, engine, limits)?,
        other => return Err(unexpected("batch", "array or map", &other)),
    };
    if reader.remaining() > 0 {
        return Err(DecodeError::TrailingBytes {
            n_bytes: reader.remaining(),
        });
    }
    Ok(batch)
}

fn decode_array_batch(
    reader: &mut Reader<'_>,
    n_fields: u32,
    engine: EngineKind,
    limits: &Limits,
) -> Result<EngineBatch, DecodeError> {
    if n_fields < 2 {
        return Err(DecodeError::BatchTooShort { n_fields });
    }
    let ts = read_float(reader, "ts")?;
    let events = read_events(reader, engine, limits)?;
    let dp_rank = if n_fields >= 3 {
        read_opt_u32(reader, "dp_rank")?
    } else {
        None
    };
    for _ in 3..n_fields {
        reader.skip()?;
    }
    Ok(EngineBatch {
        ts,
        events,
        dp_rank,
    })
}

fn decode_map_batch(
    reader: &mut Reader<'_>,
    n_entries: u32,
    engine: EngineKind,
    limits: &Limits,
) -> Result<EngineBatch, DecodeError> {
    let mut ts = None;
    let mut events = None;
    let mut dp_rank = None;
    for _ in 0..n_entries {
        let key = read_str_bytes(reader, "batch key")?;
        match key {
            b"ts" => ts = Some(read_float(reader, "ts")?),
            b"events" => events = Some(read_events(reader, engine, limits)?),
            b"data_parallel_rank" | b"attn_dp_rank" | b"dp_rank" => {
                dp_rank = read_opt_u32(reader, "dp_rank")?;
            }
            _ => reader.skip()?,
        }
    }
    Ok(EngineBatch {
        ts: ts.ok_or(DecodeError::MissingBatchKey { key: "ts" })?,
        events: events.ok_or(DecodeError::MissingBatchKey { key: "events" })?,
        dp_rank,
    })
}

fn read_events(
    reader: &mut Reader<'_>,
    engine: EngineKind,
    limits: &Limits,
) -> Result<Vec<EngineEvent>, DecodeError> {
    let n = read_array_len(reader, "events")?;
    check_count("events", n, limits.max_events_per_batch)?;
    let mut events = Vec::with_capacity((n as usize).min(reader.remaining()));
    for event_idx in 0..n as usize {
        let event = match reader.next()? {
            Item::Array(n_fields) => {
                decode_array_event(reader, n_fields, event_idx, engine, limits)?
            }
            Item::Map(n_entries) => decode_map_event(reader, n_entries, event_idx, limits)?,
            other => return Err(unexpected("event", "array or map", &other)),
        };
        events.push(event);
    }
    Ok(events)
}

/// The kinds of event the decoder knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tag {
    Stored,
    Removed,
    Cleared,
}

impl Tag {
    fn parse(bytes: &[u8], event_idx: usize) -> Result<Tag, DecodeError> {
        match bytes {
            b"BlockStored" | b"BlockStoredWithMetadata" => Ok(Tag::Stored),
            b"BlockRemoved" => Ok(Tag::Removed),
            b"AllBlocksCleared" => Ok(Tag::Cleared),
            other => Err(DecodeError::UnknownTag {
                event_idx,
                tag: String::from_utf8_lossy(other).into_owned(),
            }),
        }
    }

    fn name(self) -> &'static str {
        match self {
            Tag::Stored => "BlockStored",
            Tag::Removed => "BlockRemoved",
            Tag::Cleared => "AllBlocksCleared",
        }
    }
}

/// One field of an event, whatever its position or key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Field {
    BlockHashes,
    Parent,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    /// SGLang position 7: `lora_name` (str) in newer positional events, `metadata` (map)
    /// in 0.5.19's `BlockStoredWithMetadata`.
    LoraNameOrMetadata,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SlidingWindow,
    CacheSalt,
    Metadata,
    Lookahead,
    Ignored,
}

const VLLM_STORED: &[Field] = &[
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraName,
    Field::ExtraKeys,
    Field::GroupIdx,
    Field::SpecKind,
    Field::SlidingWindow,
    Field::Ignored, // locality
    Field::Ignored, // ownership
    Field::Ignored, // session_id
    Field::Lookahead,
];
const SGLANG_STORED: &[Field] = &[
    Field::BlockHashes,
    Field::Parent,
    Field::TokenIds,
    Field::BlockSize,
    Field::LoraId,
    Field::Medium,
    Field::LoraNameOrMetadata,
    Field::ExtraKeys,
];
const VLLM_REMOVED: &[Field] = &[Field::BlockHashes, Field::Medium, Field::GroupIdx];
const SGLANG_REMOVED: &[Field] = &[Field::BlockHashes, Field::Medium];

fn positional_fields(engine: EngineKind, tag: Tag) -> &'static [Field] {
    match (engine, tag) {
        (EngineKind::Vllm, Tag::Stored) => VLLM_STORED,
        (EngineKind::Sglang, Tag::Stored) => SGLANG_STORED,
        (EngineKind::Vllm, Tag::Removed) => VLLM_REMOVED,
        (EngineKind::Sglang, Tag::Removed) => SGLANG_REMOVED,
        (_, Tag::Cleared) => &[],
    }
}

fn field_for_key(key: &[u8]) -> Field {
    match key {
        b"block_hashes" => Field::BlockHashes,
        b"parent_block_hash" => Field::Parent,
        b"token_ids" => Field::TokenIds,
        b"block_size" => Field::BlockSize,
        b"lora_id" => Field::LoraId,
        b"medium" => Field::Medium,
        b"lora_name" => Field::LoraName,
        b"extra_keys" => Field::ExtraKeys,
        b"group_idx" => Field::GroupIdx,
        b"kv_cache_spec_kind" => Field::SpecKind,
        b"kv_cache_spec_sliding_window" => Field::SlidingWindow,
        b"cache_salt" => Field::CacheSalt,
        b"metadata" => Field::Metadata,
        b"lookahead_token_ids" => Field::Lookahead,
        _ => Field::Ignored,
    }
}

/// Every field any event kind may carry, filled as they are read.
#[derive(Debug, Default)]
struct EventFields {
    block_hashes: Option<Vec<EngineBlockHash>>,
    parent: Option<EngineBlockHash>,
    token_ids: Option<TokenIds>,
    block_size: Option<u32>,
    lora_id: Option<i64>,
    medium: Option<String>,
    lora_name: Option<String>,
    extra_keys: Vec<Option<Vec<ExtraKey>>>,
    group_idx: Option<u32>,
    spec_kind: Option<String>,
    sliding_window: Option<u32>,
    cache_salt: Option<String>,
    lookahead: Vec<Vec<u32>>,
}

fn decode_array_event(
    reader: &mut Reader<'_>,
    n_fields: u32,
    event_idx: usize,
    engine: EngineKind,
    limits: &Limits,
) -> Result<EngineEvent, DecodeError> {
    if n_fields == 0 {
        return Err(DecodeError::MissingTag { event_idx });
    }
    let tag = Tag::parse(read_str_bytes(reader, "event tag")?, event_idx)?;
    let layout = positional_fields(engine, tag);
    let mut fields = EventFields::default();
    for position in 0..(n_fields - 1) as usize {
        let field = layout.get(position).copied().unwrap_or(Field::Ignored);
        read_field(reader, field, &mut fields, limits)?;
    }
    build_event(tag, fields, event_idx)
}

fn decode_map_event(
    reader: &mut Reader<'_>,
    n_entries: u32,
    event_idx: usize,
    limits: &Limits,
) -> Result<EngineEvent, DecodeError> {
    let mut tag = None;
    let mut fields = EventFields::default();
    for _ in 0..n_entries {
        let key = read_str_bytes(reader, "event key")?;
        if key == b"type" {
            tag = Some(Tag::parse(read_str_bytes(reader, "type")?, event_idx)?);
            continue;
        }
        read_field(reader, field_for_key(key), &mut fields, limits)?;
    }
    let tag = tag.ok_or(DecodeError::MissingTag { event_idx })?;
    build_event(tag, fields, event_idx)
}

fn build_event(
    tag: Tag,
    fields: EventFields,
    event_idx: usize,
) -> Result<EngineEvent, DecodeError> {
    let missing = |field| DecodeError::MissingField {
        event_idx,
        tag: tag.name(),
        field,
    };
    match tag {
        Tag::Stored => Ok(EngineEvent::BlockStored(BlockStored {
            block_hashes: fields.block_hashes.ok_or_else(|| missing("block_hashes"))?,
            parent_block_hash: fields.parent,
            token_ids: fields.token_ids.ok_or_else(|| missing("token_ids"))?,
            block_size: fields.block_size.ok_or_else(|| missing("block_size"))?,
            lora_id: fields.lora_id,
            medium: fields.medium,
            lora_name: fields.lora_name,
            extra_keys: fields.extra_keys,
            group_idx: fields.group_idx,
            kv_cache_spec_kind: fields.spec_kind,
            kv_cache_spec_sliding_window: fields.sliding_window,
            cache_salt: fields.cache_salt,
            lookahead_token_ids: fields.lookahead,
        })),
        Tag::Removed => Ok(EngineEvent::BlockRemoved(BlockRemoved {
            block_hashes: fields.block_hashes.ok_or_else(|| missing("block_hashes"))?,
            medium: fields.medium,
            group_idx: fields.group_idx,
        })),
        Tag::Cleared => Ok(EngineEvent::AllBlocksCleared),
    }
}

fn read_field(
    reader: &mut Reader<'_>,
    field: Field,
    fields: &mut EventFields,
    limits: &Limits,
) -> Result<(), DecodeError> {
    match field {
        Field::BlockHashes => {
            let n = read_array_len(reader, "block_hashes")?;
            check_count("block_hashes", n, limits.max_blocks_per_event)?;
            let mut hashes = Vec::with_capacity((n as usize).min(reader.remaining()));
            for _ in 0..n {
                let item = reader.next()?;
                hashes.push(block_hash_from(&item, "block_hashes")?);
            }
            fields.block_hashes = Some(hashes);
        }
        Field::Parent => {
            fields.parent = match reader.next()? {
                Item::Nil => None,
                item => Some(block_hash_from(&item, "parent_block_hash")?),
            };
        }
        Field::TokenIds => fields.token_ids = Some(read_token_ids(reader, limits)?),
        Field::BlockSize => {
            fields.block_size = Some(read_opt_u32(reader, "block_size")?.unwrap_or(0));
        }
        Field::LoraId => fields.lora_id = read_opt_i64(reader, "lora_id")?,
        Field::Medium => fields.medium = read_opt_string(reader, "medium")?,
        Field::LoraName => fields.lora_name = read_opt_string(reader, "lora_name")?,
        Field::LoraNameOrMetadata => match reader.next()? {
            Item::Nil => {}
            Item::Str(bytes) => fields.lora_name = Some(utf8(bytes, "lora_name")?),
            Item::Map(n) => read_metadata(reader, n, fields)?,
            other => return Err(unexpected("metadata", "str or map", &other)),
        },
        Field::ExtraKeys => fields.extra_keys = read_extra_keys(reader, limits)?,
        Field::GroupIdx => fields.group_idx = read_opt_u32(reader, "group_idx")?,
        Field::SpecKind => fields.spec_kind = read_opt_string(reader, "kv_cache_spec_kind")?,
        Field::SlidingWindow => {
            fields.sliding_window = read_opt_u32(reader, "kv_cache_spec_sliding_window")?;
        }
        Field::CacheSalt => fields.cache_salt = read_opt_string(reader, "cache_salt")?,
        Field::Metadata => match reader.next()? {
            Item::Nil => {}
            Item::Map(n) => read_metadata(reader, n, fields)?,
            other => return Err(unexpected("metadata", "map", &other)),
        },
        Field::Lookahead => fields.lookahead = read_lookahead(reader, limits)?,
        Field::Ignored => reader.skip()?,
    }
    Ok(())
}

fn read_metadata(
    reader: &mut Reader<'_>,
    n: u32,
    fields: &mut EventFields,
) -> Result<(), DecodeError> {
    for _ in 0..n {
        let key = read_str_bytes(reader, "metadata key")?;
        match key {
            b"cache_salt" => fields.cache_salt = read_opt_string(reader, "cache_salt")?,
            b"lora_name" => fields.lora_name = read_opt_string(reader, "lora_name")?,
            _ => reader.skip()?,
        }
    }
    Ok(())
}

fn read_token_ids(reader: &mut Reader<'_>, limits: &Limits) -> Result<TokenIds, DecodeError> {
    let n = read_array_len(reader, "token_ids")?;
    check_count("token_ids", n, limits.max_tokens_per_event)?;
    let cap = (n as usize).min(reader.remaining());
    let mut flat: Vec<u32> = Vec::new();
    let mut pairs: Vec<[u32; 2]> = Vec::new();
    for idx in 0..n {
        match reader.next()? {
            Item::Array(len) => {
                if !flat.is_empty() {
                    return Err(DecodeError::MixedTokenShapes);
                }
                if len != 2 {
                    return Err(DecodeError::BadBigram { len });
                }
                if idx == 0 {
                    pairs.reserve(cap);
                }
                let first = token_from(&reader.next()?)?;
                let second = token_from(&reader.next()?)?;
                pairs.push([first, second]);
            }
            item => {
                if !pairs.is_empty() {
                    return Err(DecodeError::MixedTokenShapes);
                }
                if idx == 0 {
                    flat.reserve(cap);
                }
                flat.push(token_from(&item)?);
            }
        }
    }
    if pairs.is_empty() {
        Ok(TokenIds::Flat(flat))
    } else {
        Ok(TokenIds::Bigram(pairs))
    }
}

fn read_extra_keys(
    reader: &mut Reader<'_>,
    limits: &Limits,
) -> Result<Vec<Option<Vec<ExtraKey>>>, DecodeError> {
    let n = match reader.next()? {
        Item::Nil => return Ok(Vec::new()),
        Item::Array(n) => n,
        other => return Err(unexpected("extra_keys", "array or nil", &other)),
    };
    check_count("extra_keys", n, limits.max_blocks_per_event)?;
    let mut out = Vec::with_capacity((n as usize).min(reader.remaining()));
    for _ in 0..n {
        let n_keys = match reader.next()? {
            Item::Nil => {
                out.push(None);
                continue;
            }
            Item::Array(n_keys) => n_keys,
            other => return Err(unexpected("extra_keys entry", "array or nil", &other)),
        };
        let mut keys = Vec::new();
        for _ in 0..n_keys {
            match reader.next()? {
                Item::Str(bytes) => keys.push(ExtraKey::Text(utf8(bytes, "extra_keys")?)),
                Item::Array(len) => keys.extend(read_mm_key(reader, len)?),
                Item::Map(n_entries) => skip_entries(reader, 2 * u64::from(n_entries))?,
                // Other scalar keys carry no hashing input; ignore them.
                _ => {}
            }
        }
        out.push(Some(keys));
    }
    Ok(out)
}

/// Reads a `[identifier, offset, ..]` multimodal key (array header already read).
fn read_mm_key(reader: &mut Reader<'_>, len: u32) -> Result<Option<ExtraKey>, DecodeError> {
    if len == 0 {
        return Ok(None);
    }
    let identifier = match reader.next()? {
        Item::Str(bytes) => utf8(bytes, "extra_keys")?,
        Item::Bin(bytes) => bytes.iter().map(|b| format!("{b:02x}")).collect(),
        Item::Array(n) => {
            skip_entries(reader, u64::from(n))?;
            skip_entries(reader, u64::from(len - 1))?;
            return Ok(None);
        }
        Item::Map(n) => {
            skip_entries(reader, 2 * u64::from(n))?;
            skip_entries(reader, u64::from(len - 1))?;
            return Ok(None);
        }
        _ => {
            skip_entries(reader, u64::from(len - 1))?;
            return Ok(None);
        }
    };
    let mut offset = 0;
    if len >= 2 {
        offset = match reader.next()? {
            Item::Unsigned(v) => i64::try_from(v).unwrap_or(i64::MAX),
            Item::Negative(v) => v,
            Item::Array(n) => {
                skip_entries(reader, u64::from(n))?;
                0
            }
            Item::Map(n) => {
                skip_entries(reader, 2 * u64::from(n))?;
                0
            }
            _ => 0,
        };
        skip_entries(reader, u64::from(len - 2))?;
    }
    Ok(Some(ExtraKey::Multimodal { identifier, offset }))
}

fn read_lookahead(reader: &mut Reader<'_>, limits: &Limits) -> Result<Vec<Vec<u32>>, DecodeError> {
    let n = match reader.next()? {
        Item::Nil => return Ok(Vec::new()),
        Item::Array(n) => n,
        other => return Err(unexpected("lookahead_token_ids", "array or nil", &other)),
    };
    check_count("lookahead_token_ids", n, limits.max_blocks_per_event)?;
    let mut out = Vec::with_capacity((n as usize).min(reader.remaining()));
    for _ in 0..n {
        match reader.next()? {
            Item::Nil => out.push(Vec::new()),
            Item::Array(len) => {
                check_count("lookahead_token_ids", len, limits.max_tokens_per_event)?;
                let mut tokens = Vec::with_capacity((len as usize).min(reader.remaining()));
                for _ in 0..len {
                    tokens.push(token_from(&reader.next()?)?);
                }
                out.push(tokens);
            }
            other => return Err(unexpected("lookahead_token_ids entry", "array", &other)),
        }
    }
    Ok(out)
}

fn skip_entries(reader: &mut Reader<'_>, n: u64) -> Result<(), DecodeError> {
    for _ in 0..n {
        reader.skip()?;
    }
    Ok(())
}

/// Folds a wire block hash to 64 bits.
fn block_hash_from(item: &Item<'_>, field: &'static str) -> Result<EngineBlockHash, DecodeError> {
    match *item {
        Item::Unsigned(value) => Ok(EngineBlockHash {
            value,
            repr: HashRepr::Unsigned,
        }),
        Item::Negative(value) => Ok(EngineBlockHash {
            value: value as u64,
            repr: HashRepr::Signed,
        }),
        Item::Bin(bytes) => {
            if bytes.is_empty() {
                return Err(DecodeError::EmptyHashBytes { field });
            }
            let tail = &bytes[bytes.len().saturating_sub(8)..];
            let value = tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
            Ok(EngineBlockHash {
                value,
                repr: HashRepr::Bytes,
            })
        }
        ref other => Err(unexpected(field, "int or bin", other)),
    }
}

fn token_from(item: &Item<'_>) -> Result<u32, DecodeError> {
    match *item {
        Item::Unsigned(value) => u32::try_from(value).map_err(|_| DecodeError::OutOfRange {
            field: "token_ids",
            value: i128::from(value),
        }),
        Item::Negative(value) => Err(DecodeError::OutOfRange {
            field: "token_ids",
            value: i128::from(value),
        }),
        ref other => Err(unexpected("token_ids", "int", other)),
    }
}

fn read_float(reader: &mut Reader<'_>, field: &'static str) -> Result<f64, DecodeError> {
    match reader.next()? {
        Item::Float(value) => Ok(value),
        Item::Unsigned(value) => Ok(value as f64),
        Item::Negative(value) => Ok(value as f64),
        other => Err(unexpected(field, "float", &other)),
    }
}

fn read_opt_u32(reader: &mut Reader<'_>, field: &'static str) -> Result<Option<u32>, DecodeError> {
    match reader.next()? {
        Item::Nil => Ok(None),
        Item::Unsigned(value) => {
            u32::try_from(value)
                .map(Some)
                .map_err(|_| DecodeError::OutOfRange {
                    field,
                    value: i128::from(value),
                })
        }
        Item::Negative(value) => Err(DecodeError::OutOfRange {
            field,
            value: i128::from(value),
        }),
        other => Err(unexpected(field, "int or nil", &other)),
    }
}

fn read_opt_i64(reader: &mut Reader<'_>, field: &'static str) -> Result<Option<i64>, DecodeError> {
    match reader.next()? {
        Item::Nil => Ok(None),
        Item::Unsigned(value) => {
            i64::try_from(value)
                .map(Some)
                .map_err(|_| DecodeError::OutOfRange {
                    field,
                    value: i128::from(value),
                })
        }
        Item::Negative(value) => Ok(Some(value)),
        other => Err(unexpected(field, "int or nil", &other)),
    }
}

fn read_opt_string(
    reader: &mut Reader<'_>,
    field: &'static str,
) -> Result<Option<String>, DecodeError> {
    match reader.next()? {
        Item::Nil => Ok(None),
        Item::Str(bytes) => Ok(Some(utf8(bytes, field)?)),
        other => Err(unexpected(field, "str or nil", &other)),
    }
}

fn read_str_bytes<'a>(
    reader: &mut Reader<'a>,
    field: &'static str,
) -> Result<&'a [u8], DecodeError> {
    match reader.next()? {
        Item::Str(bytes) => Ok(bytes),
        other => Err(unexpected(field, "str", &other)),
    }
}

fn read_array_len(reader: &mut Reader<'_>, field: &'static str) -> Result<u32, DecodeError> {
    match reader.next()? {
        Item::Array(n) => Ok(n),
        other => Err(unexpected(field, "array", &other)),
    }
}

fn utf8(bytes: &[u8], field: &'static str) -> Result<String, DecodeError> {
    std::str::from_utf8(bytes)
        .map(str::to_owned)
        .map_err(|_| DecodeError::InvalidUtf8 { field })
}

fn check_count(field: &'static str, n: u32, max: u32) -> Result<(), DecodeError> {
    if n > max {
        return Err(DecodeError::TooMany {
            field,
            n: u64::from(n),
            max: u64::from(max),
        });
    }
    Ok(())
}

fn unexpected(field: &'static str, expected: &'static str, got: &Item<'_>) -> DecodeError {
    DecodeError::UnexpectedType {
        field,
        expected,
        got: got.kind(),
    }
}
