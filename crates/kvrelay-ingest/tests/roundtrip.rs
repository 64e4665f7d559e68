//! Property tests: random batches encoded in every layout decode to the same events, and
//! random bytes never panic the decoder.

use kvrelay_ingest::{
    BlockRemoved, BlockStored, DecodeError, EngineBatch, EngineBlockHash, EngineEvent, EngineKind,
    EngineLayout, ExtraKey, HashRepr, Limits, TokenIds, decode_engine_batch, encode_engine_batch,
};
use proptest::prelude::*;

fn hash_strategy(engine: EngineKind) -> impl Strategy<Value = EngineBlockHash> {
    let reprs = match engine {
        EngineKind::Vllm => vec![HashRepr::Unsigned, HashRepr::Bytes],
        EngineKind::Sglang => vec![HashRepr::Unsigned, HashRepr::Signed],
    };
    (any::<u64>(), proptest::sample::select(reprs)).prop_map(|(value, repr)| {
        // The wire form decides the repr: a signed value must be negative, an unsigned
        // one must fit its form.
        let value = match repr {
            HashRepr::Signed => value | (1 << 63),
            HashRepr::Unsigned | HashRepr::Bytes => value,
        };
        EngineBlockHash { value, repr }
    })
}

fn opt_text() -> impl Strategy<Value = Option<String>> {
    proptest::option::of("[a-z0-9-]{1,12}")
}

fn stored_strategy(engine: EngineKind) -> impl Strategy<Value = EngineEvent> {
    (
        proptest::collection::vec(hash_strategy(engine), 1..4),
        proptest::option::of(hash_strategy(engine)),
        any::<bool>(),
        proptest::option::of(-3i64..100),
        proptest::option::of(proptest::sample::select(vec!["GPU", "CPU", "CPU_PINNED"])),
        opt_text(),
        opt_text(),
        proptest::option::of(0u32..4),
        proptest::option::of(1u32..8192),
        any::<bool>(),
    )
        .prop_map(
            move |(hashes, parent, bigram, lora_id, medium, lora_name, salt, group, window, mm)| {
                let block_size = 4u32;
                let n_tokens = hashes.len() * block_size as usize;
                let token_ids = if bigram && engine == EngineKind::Sglang {
                    TokenIds::Bigram((0..n_tokens as u32).map(|t| [t, t + 1]).collect())
                } else {
                    TokenIds::Flat((0..n_tokens as u32).map(|t| t * 7 + 3).collect())
                };
                let mut stored = BlockStored {
                    lora_id,
                    medium: medium.map(str::to_owned),
                    ..BlockStored::new(hashes.clone(), parent, token_ids, block_size)
                };
                match engine {
                    EngineKind::Vllm => {
                        stored.lora_name = lora_name.clone();
                        stored.group_idx = group;
                        stored.kv_cache_spec_sliding_window = window;
                        stored.kv_cache_spec_kind = window.map(|_| "sliding_window".to_owned());
                        if mm || salt.is_some() {
                            stored.extra_keys = hashes
                                .iter()
                                .enumerate()
                                .map(|(idx, _)| {
                                    (idx % 2 == 0).then(|| {
                                        let mut keys = Vec::new();
                                        keys.extend(salt.clone().map(ExtraKey::Text));
                                        if mm {
                                            keys.push(ExtraKey::Multimodal {
                                                identifier: format!("mm-{idx}"),
                                                offset: idx as i64,
                                            });
                                        }
                                        keys
                                    })
                                })
                                .collect();
                        }
                    }
                    EngineKind::Sglang => stored.cache_salt = salt,
                }
                EngineEvent::BlockStored(stored)
            },
        )
}

fn event_strategy(engine: EngineKind) -> impl Strategy<Value = EngineEvent> {
    prop_oneof![
        3 => stored_strategy(engine),
        2 => (
            proptest::collection::vec(hash_strategy(engine), 0..4),
            proptest::option::of(proptest::sample::select(vec!["GPU", "DISK"])),
            proptest::option::of(0u32..3),
        )
            .prop_map(move |(block_hashes, medium, group)| {
                EngineEvent::BlockRemoved(BlockRemoved {
                    block_hashes,
                    medium: medium.map(str::to_owned),
                    group_idx: if engine == EngineKind::Vllm { group } else { None },
                })
            }),
        1 => Just(EngineEvent::AllBlocksCleared),
    ]
}

fn batch_strategy(engine: EngineKind) -> impl Strategy<Value = EngineBatch> {
    (
        proptest::collection::vec(event_strategy(engine), 0..6),
        proptest::option::of(0u32..8),
        0u32..1_000_000,
    )
        .prop_map(|(events, dp_rank, ts)| EngineBatch {
            ts: f64::from(ts) / 8.0,
            events,
            dp_rank,
        })
}

fn roundtrip(batch: &EngineBatch, layout: EngineLayout) -> Result<EngineBatch, DecodeError> {
    let mut bytes = Vec::new();
    encode_engine_batch(batch, layout, &mut bytes);
    decode_engine_batch(&bytes, layout.engine, &Limits::default())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn vllm_batches_roundtrip_in_every_layout(batch in batch_strategy(EngineKind::Vllm)) {
        for map_events in [false, true] {
            for map_batch in [false, true] {
                let layout = EngineLayout { engine: EngineKind::Vllm, map_events, map_batch };
                prop_assert_eq!(&roundtrip(&batch, layout).unwrap(), &batch, "{:?}", layout);
            }
        }
    }

    #[test]
    fn sglang_batches_roundtrip_in_every_layout(batch in batch_strategy(EngineKind::Sglang)) {
        for map_events in [false, true] {
            for map_batch in [false, true] {
                let layout = EngineLayout { engine: EngineKind::Sglang, map_events, map_batch };
                prop_assert_eq!(&roundtrip(&batch, layout).unwrap(), &batch, "{:?}", layout);
            }
        }
    }

    #[test]
    fn random_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_engine_batch(&bytes, EngineKind::Vllm, &Limits::default());
        let _ = decode_engine_batch(&bytes, EngineKind::Sglang, &Limits::default());
    }

    #[test]
    fn every_truncation_of_a_valid_batch_is_a_typed_error(batch in batch_strategy(EngineKind::Vllm)) {
        let mut bytes = Vec::new();
        let layout = EngineLayout { engine: EngineKind::Vllm, map_events: true, map_batch: false };
        encode_engine_batch(&batch, layout, &mut bytes);
        for len in 0..bytes.len() {
            prop_assert!(decode_engine_batch(&bytes[..len], EngineKind::Vllm, &Limits::default()).is_err());
        }
    }
}

#[test]
fn unknown_event_tag_is_a_typed_error() {
    // [0.0, [["BlockMoved"]], 0]
    let mut bytes = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x91, 0xaa];
    bytes.extend_from_slice(b"BlockMoved");
    bytes.push(0x00);
    let err = decode_engine_batch(&bytes, EngineKind::Vllm, &Limits::default()).unwrap_err();
    assert_eq!(
        err,
        DecodeError::UnknownTag {
            event_idx: 0,
            tag: "BlockMoved".to_owned()
        }
    );
}

#[test]
fn declared_event_count_above_the_limit_is_rejected_before_decoding() {
    // [0.0, array32 of 2^32-1 events] with no event bytes.
    let bytes = [
        0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
    ];
    let err = decode_engine_batch(&bytes, EngineKind::Vllm, &Limits::default()).unwrap_err();
    assert!(
        matches!(
            err,
            DecodeError::TooMany {
                field: "events",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn map_event_with_unknown_keys_and_late_tag_decodes() {
    let batch = EngineBatch {
        ts: 1.5,
        events: vec![EngineEvent::AllBlocksCleared],
        dp_rank: Some(1),
    };
    // Hand-build: [1.5, [{"future": [1, {"x": nil}], "type": "AllBlocksCleared"}], 1]
    let mut bytes = vec![0x93, 0xcb];
    bytes.extend_from_slice(&1.5f64.to_be_bytes());
    bytes.extend_from_slice(&[0x91, 0x82, 0xa6]);
    bytes.extend_from_slice(b"future");
    bytes.extend_from_slice(&[0x92, 0x01, 0x81, 0xa1, b'x', 0xc0, 0xa4]);
    bytes.extend_from_slice(b"type");
    bytes.push(0xb0);
    bytes.extend_from_slice(b"AllBlocksCleared");
    bytes.push(0x01);
    assert_eq!(
        decode_engine_batch(&bytes, EngineKind::Vllm, &Limits::default()).unwrap(),
        batch
    );
}
