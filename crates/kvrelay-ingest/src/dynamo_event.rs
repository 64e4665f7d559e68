//! Dynamo router events → canonical router events. Pure.
//!
//! Two encodings of one schema, decoded through the same serde types and converted by one
//! rule: JSON (as the reference runtime publishes them on NATS, [`decode_dynamo_events`])
//! and msgpack (inside its event-plane envelopes on ZMQ, [`decode_dynamo_events_msgpack`],
//! see [`crate::event_plane`]).
//!
//! Accepted payloads: one `RouterEvent` object or an array of them:
//! `{"worker_id": 7, "storage_tier": "device", "event": {"event_id": 3, "dp_rank": 0,
//! "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 11, "tokens_hash": 22}]}}}}`,
//! with `data` one of `{"stored": {..}}`, `{"removed": {"block_hashes": [..]}}` or
//! `"cleared"`; fields added by newer runtimes (`residency_domain`, `start_position`,
//! `mm_extra_info`) are ignored. Dynamo's `tokens_hash` is the same block hash this crate
//! computes (XXH3, seed 1337), so it is passed through. Events whose `storage_tier` is
//! present and not `device` are filtered (the same media rule as engine events), unless
//! the caller keeps lower tiers: then `host_pinned` (KVBM's host memory) and `disk`
//! events become tier events (`external` and unknown tiers stay filtered). A payload
//! with more than `max_events_per_batch` events, or an event with more than
//! `max_blocks_per_event` blocks, is rejected whole, as an engine batch would be.
//!
//! The decoders stream: each event is deserialized straight into its compact form as the
//! parser reaches it (no untagged buffering of the document into a generic value tree),
//! so memory stays proportional to the events, and so bounded by the payload size the
//! transport already checked.

use kvrelay_ckf::{CacheTier, RemovedBlocks, SourceId, StoredBlock, StoredBlocks, TierChange};
use serde::Deserialize;
use serde::de::{self, IgnoredAny, MapAccess, SeqAccess, Visitor};

use crate::canonical::CanonicalEvent;
use crate::error::RejectionKind;
use crate::limits::Limits;

/// A Dynamo payload that is not a router event (or array of them) within the limits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DynamoEventError {
    /// Invalid JSON or msgpack, or the wrong shape.
    #[error("dynamo router event: {reason}")]
    Malformed {
        /// The parser's message.
        reason: String,
    },
    /// More events in the payload, or blocks in one event, than the limits allow.
    #[error("dynamo router event: {field}: {n} elements exceed the limit {max}")]
    TooMany {
        /// `events` or `blocks`.
        field: &'static str,
        /// Elements found.
        n: usize,
        /// The limit.
        max: u32,
    },
}

impl DynamoEventError {
    /// The rejection kind this error is counted under.
    pub fn rejection_kind(&self) -> RejectionKind {
        match self {
            DynamoEventError::Malformed { .. } => RejectionKind::Malformed,
            DynamoEventError::TooMany { .. } => RejectionKind::Schema,
        }
    }
}

/// What decoding one payload produced.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DynamoDecoded {
    /// Canonical events, in payload order.
    pub events: Vec<CanonicalEvent>,
    /// Events dropped by the storage-tier rule.
    pub n_filtered: usize,
}

/// Decodes a JSON payload of Dynamo router events (NATS); `lower_tiers` keeps host and
/// disk events as tier events instead of filtering them.
pub fn decode_dynamo_events(
    payload: &[u8],
    limits: &Limits,
    lower_tiers: bool,
) -> Result<DynamoDecoded, DynamoEventError> {
    convert(serde_json::from_slice(payload), limits, lower_tiers)
}

/// Decodes a msgpack payload of Dynamo router events (the payload of an event-plane
/// envelope on ZMQ).
pub fn decode_dynamo_events_msgpack(
    payload: &[u8],
    limits: &Limits,
    lower_tiers: bool,
) -> Result<DynamoDecoded, DynamoEventError> {
    convert(rmp_serde::from_slice(payload), limits, lower_tiers)
}

/// The one rule from wire events to canonical ones, whatever the encoding (a parse error
/// is `Malformed` with the parser's message).
fn convert<E: std::fmt::Display>(
    parsed: Result<OneOrMany, E>,
    limits: &Limits,
    lower_tiers: bool,
) -> Result<DynamoDecoded, DynamoEventError> {
    let parsed = parsed.map_err(|err| DynamoEventError::Malformed {
        reason: err.to_string(),
    })?;
    let wire = match parsed {
        OneOrMany::One(event) => vec![event],
        OneOrMany::Many(events) => events,
    };
    check_count("events", wire.len(), limits.max_events_per_batch)?;
    for event in &wire {
        let n_blocks = match &event.event.data {
            WireData::Stored(stored) => stored.blocks.len(),
            WireData::Removed(removed) => removed.block_hashes.len(),
            WireData::Cleared => 0,
        };
        check_count("blocks", n_blocks, limits.max_blocks_per_event)?;
    }
    let mut decoded = DynamoDecoded::default();
    for event in wire {
        let tier = match event
            .storage_tier
            .as_deref()
            .map_or(Some(CacheTier::Device), tier_of_storage_tier)
        {
            Some(CacheTier::Device) => CacheTier::Device,
            Some(lower) if lower_tiers => lower,
            _ => {
                decoded.n_filtered += 1;
                continue;
            }
        };
        let change = match event.event.data {
            WireData::Stored(stored) => TierChange::Stored(StoredBlocks {
                parent_engine_block_id: stored.parent_hash,
                blocks: stored
                    .blocks
                    .into_iter()
                    .map(|block| StoredBlock {
                        engine_block_id: block.block_hash,
                        token_hash: block.tokens_hash,
                    })
                    .collect(),
            }),
            WireData::Removed(removed) => TierChange::Removed(RemovedBlocks {
                engine_block_ids: removed.block_hashes,
            }),
            WireData::Cleared => TierChange::Cleared,
        };
        let source = SourceId::new(event.worker_id, event.event.dp_rank);
        let event_id = event.event.event_id;
        // Dynamo events always carry token hashes: no offload is built here.
        decoded
            .events
            .extend(CanonicalEvent::new(source, event_id, tier, change));
    }
    Ok(decoded)
}

/// The tier a Dynamo `storage_tier` names (any case): `device`, `host_pinned` (KVBM's
/// host memory) or `disk`; `external` and unknown names keep no tier.
pub fn tier_of_storage_tier(name: &str) -> Option<CacheTier> {
    let is = |tier: &str| name.eq_ignore_ascii_case(tier);
    if is("device") {
        Some(CacheTier::Device)
    } else if is("host_pinned") || is("host") {
        Some(CacheTier::Host)
    } else if is("disk") {
        Some(CacheTier::Disk)
    } else {
        None
    }
}

fn check_count(field: &'static str, n: usize, max: u32) -> Result<(), DynamoEventError> {
    if n > usize::try_from(max).unwrap_or(usize::MAX) {
        return Err(DynamoEventError::TooMany { field, n, max });
    }
    Ok(())
}

/// The event-plane subject of an endpoint's KV events:
/// `namespace.<ns>.component.<c>.endpoint.<e>.kv-events`, each name percent-encoded
/// except ASCII alphanumerics, `-` and `_`.
pub fn dynamo_kv_event_subject(namespace: &str, component: &str, endpoint: &str) -> String {
    format!(
        "namespace.{}.component.{}.endpoint.{}.kv-events",
        percent_encode(namespace),
        percent_encode(component),
        percent_encode(endpoint)
    )
}

fn percent_encode(segment: &str) -> String {
    let mut out = String::with_capacity(segment.len());
    for byte in segment.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'-' || byte == b'_' {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// One router event or an array of them, decided by the first token.
#[derive(Debug)]
enum OneOrMany {
    Many(Vec<WireRouterEvent>),
    One(WireRouterEvent),
}

impl<'de> Deserialize<'de> for OneOrMany {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct OneOrManyVisitor;
        impl<'de> Visitor<'de> for OneOrManyVisitor {
            type Value = OneOrMany;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a router event or an array of router events")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<OneOrMany, A::Error> {
                let mut events = Vec::new();
                while let Some(event) = seq.next_element::<WireRouterEvent>()? {
                    events.push(event);
                }
                Ok(OneOrMany::Many(events))
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<OneOrMany, A::Error> {
                WireRouterEvent::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(OneOrMany::One)
            }
        }
        deserializer.deserialize_any(OneOrManyVisitor)
    }
}

#[derive(Debug, Deserialize)]
struct WireRouterEvent {
    worker_id: u64,
    #[serde(default)]
    storage_tier: Option<String>,
    event: WireKvCacheEvent,
}

#[derive(Debug, Deserialize)]
struct WireKvCacheEvent {
    event_id: u64,
    data: WireData,
    #[serde(default)]
    dp_rank: u32,
}

/// `"cleared"`, or a map with exactly one key: `stored`, `removed` or `cleared`.
#[derive(Debug)]
enum WireData {
    Stored(WireStored),
    Removed(WireRemoved),
    Cleared,
}

impl<'de> Deserialize<'de> for WireData {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DataVisitor;
        impl<'de> Visitor<'de> for DataVisitor {
            type Value = WireData;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(r#""cleared" or {"stored"|"removed"|"cleared": ..}"#)
            }
            fn visit_str<E: de::Error>(self, value: &str) -> Result<WireData, E> {
                match value {
                    "cleared" => Ok(WireData::Cleared),
                    other => Err(E::unknown_variant(other, &["cleared"])),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<WireData, A::Error> {
                let Some(tag) = map.next_key::<std::borrow::Cow<'de, str>>()? else {
                    return Err(de::Error::invalid_length(0, &"one key"));
                };
                let data = match tag.as_ref() {
                    "stored" => WireData::Stored(map.next_value()?),
                    "removed" => WireData::Removed(map.next_value()?),
                    "cleared" => {
                        map.next_value::<IgnoredAny>()?;
                        WireData::Cleared
                    }
                    other => {
                        return Err(de::Error::unknown_variant(
                            other,
                            &["stored", "removed", "cleared"],
                        ));
                    }
                };
                if map.next_key::<IgnoredAny>()?.is_some() {
                    return Err(de::Error::invalid_length(2, &"one key"));
                }
                Ok(data)
            }
        }
        deserializer.deserialize_any(DataVisitor)
    }
}

#[derive(Debug, Deserialize)]
struct WireStored {
    #[serde(default)]
    parent_hash: Option<u64>,
    blocks: Vec<WireBlock>,
}

#[derive(Debug, Deserialize)]
struct WireBlock {
    block_hash: u64,
    tokens_hash: u64,
}

#[derive(Debug, Deserialize)]
struct WireRemoved {
    block_hashes: Vec<u64>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test")]
    use super::*;
    use kvrelay_ckf::EventPayload;

    /// The device events of a decoded payload (every test payload is device-only).
    fn device(decoded: &DynamoDecoded) -> Vec<kvrelay_ckf::RouterEvent> {
        decoded
            .events
            .iter()
            .map(|event| match event {
                CanonicalEvent::Device(event) => event.clone(),
                CanonicalEvent::Tier(event) => panic!("unexpected tier event {event:?}"),
            })
            .collect()
    }

    #[test]
    fn stored_removed_and_cleared_decode_in_order() {
        let payload = br#"[
            {"worker_id": 7, "event": {"event_id": 1, "dp_rank": 2, "data": {"stored": {"parent_hash": null, "blocks": [{"block_hash": 11, "tokens_hash": 22}]}}}},
            {"worker_id": 7, "event": {"event_id": 2, "data": {"removed": {"block_hashes": [11]}}}},
            {"worker_id": 7, "event": {"event_id": 3, "data": "cleared"}}
        ]"#;
        let decoded = decode_dynamo_events(payload, &Limits::default(), false).unwrap();
        assert_eq!(decoded.events.len(), 3);
        assert_eq!(device(&decoded)[0].source, SourceId::new(7, 2));
        assert_eq!(device(&decoded)[1].source, SourceId::new(7, 0));
        assert_eq!(
            device(&decoded)[0].payload,
            EventPayload::Stored(StoredBlocks {
                parent_engine_block_id: None,
                blocks: vec![StoredBlock {
                    engine_block_id: 11,
                    token_hash: 22
                }],
            })
        );
        assert_eq!(device(&decoded)[2].payload, EventPayload::AllCleared);
    }

    #[test]
    fn host_tier_events_are_filtered() {
        let payload = br#"{"worker_id": 1, "storage_tier": "host_pinned", "event": {"event_id": 1, "data": "cleared"}}"#;
        let decoded = decode_dynamo_events(payload, &Limits::default(), false).unwrap();
        assert!(decoded.events.is_empty());
        assert_eq!(decoded.n_filtered, 1);
    }

    #[test]
    fn malformed_payload_is_a_typed_error() {
        assert!(matches!(
            decode_dynamo_events(b"{\"worker_id\": -1}", &Limits::default(), false),
            Err(DynamoEventError::Malformed { .. })
        ));
    }

    #[test]
    fn tagged_cleared_and_single_object_decode() {
        let payload = br#"{"worker_id": 3, "event": {"event_id": 9, "data": {"cleared": null}}}"#;
        let decoded = decode_dynamo_events(payload, &Limits::default(), false).unwrap();
        assert_eq!(decoded.events.len(), 1);
        assert_eq!(device(&decoded)[0].payload, EventPayload::AllCleared);
    }

    #[test]
    fn data_with_two_tags_or_an_unknown_tag_is_rejected() {
        let two = br#"{"worker_id": 3, "event": {"event_id": 9, "data": {"cleared": null, "removed": {"block_hashes": []}}}}"#;
        let unknown = br#"{"worker_id": 3, "event": {"event_id": 9, "data": {"moved": {}}}}"#;
        for payload in [&two[..], &unknown[..]] {
            assert!(matches!(
                decode_dynamo_events(payload, &Limits::default(), false),
                Err(DynamoEventError::Malformed { .. })
            ));
        }
    }

    #[test]
    fn subject_percent_encodes_names() {
        assert_eq!(
            dynamo_kv_event_subject("dynamo", "vllm.worker", "generate"),
            "namespace.dynamo.component.vllm%2Eworker.endpoint.generate.kv-events"
        );
    }
}
