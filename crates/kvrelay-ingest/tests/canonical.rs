//! Canonicalization: token hashes per pool semantics, salts, Eagle windows, SGLang bigram
//! pages, the media / attention-group filtering rule and lower tiers.
use std::path::PathBuf;

use kvrelay_ckf::{
    CacheTier, EventPayload, RemovedBlocks, RouterEvent, SourceId, TierChange, TierEvent,
};
use kvrelay_identity::KvQueryHashFormat;
use kvrelay_identity::hashing::{HashSalt, block_hashes, block_hashes_with_mm};
use kvrelay_ingest::{
    BlockRemoved, BlockStored, CanonicalConfig, CanonicalEvent, CanonicalizeError, Canonicalizer,
    EngineBatch, EngineBlockHash, EngineEvent, EngineKind, ExtraKey, Limits, TokenIds,
    decode_engine_batch,
};

const STANDARD: KvQueryHashFormat = KvQueryHashFormat::DynamoStandardV1;
const EAGLE: KvQueryHashFormat = KvQueryHashFormat::DynamoEagleV1;

fn config(block_size: u32, hash_format: KvQueryHashFormat) -> CanonicalConfig {
    CanonicalConfig::new(block_size, hash_format)
}

fn fixture(name: &str, engine: EngineKind) -> EngineBatch {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../../shared/fixtures/engine-events")
        .join(name);
    decode_engine_batch(&std::fs::read(path).unwrap(), engine, &Limits::default()).unwrap()
}

fn canonicalize(batch: &EngineBatch, config: CanonicalConfig) -> Vec<RouterEvent> {
    let mut out = Vec::new();
    let outcome = Canonicalizer::new(9, 0, config).canonicalize(batch, &mut out);
    assert!(outcome.rejected.is_empty(), "{:?}", outcome.rejected);
    device(&out)
}

/// The device events of `out` (the test fails on a tier event).
fn device(out: &[CanonicalEvent]) -> Vec<RouterEvent> {
    out.iter()
        .map(|event| event.as_device().cloned().unwrap())
        .collect()
}

fn token_hashes(event: &RouterEvent) -> Vec<u64> {
    match &event.payload {
        EventPayload::Stored(stored) => stored.blocks.iter().map(|b| b.token_hash).collect(),
        other => panic!("not stored: {other:?}"),
    }
}

fn stored(n_blocks: usize, block_size: u32) -> BlockStored {
    BlockStored::new(
        (0..n_blocks as u64)
            .map(EngineBlockHash::unsigned)
            .collect(),
        None,
        TokenIds::Flat((0..n_blocks as u32 * block_size).collect()),
        block_size,
    )
}

fn one(event: EngineEvent) -> EngineBatch {
    EngineBatch {
        ts: 0.0,
        events: vec![event],
        dp_rank: None,
    }
}

#[test]
fn vllm_fixture_token_hashes_equal_identity_block_hashes_of_its_tokens() {
    let batch = fixture("vllm-0.23.0-basic.msgpack", EngineKind::Vllm);
    let events = canonicalize(&batch, config(16, STANDARD));
    let tokens: Vec<u32> = (0..48).collect();
    let expected = block_hashes(&tokens, 16, STANDARD, HashSalt::default());
    assert_eq!(token_hashes(&events[0]), expected[..2]);
    assert_eq!(token_hashes(&events[1]), expected[2..]);
    let EventPayload::Stored(second) = &events[1].payload else {
        panic!()
    };
    assert_eq!(second.parent_engine_block_id, Some(0xFEDC_BA98_7654_3210));
}

#[test]
fn same_block_from_vllm_and_sglang_gets_the_same_token_hash() {
    let vllm = canonicalize(
        &fixture("vllm-0.33.0-basic.msgpack", EngineKind::Vllm),
        config(16, STANDARD),
    );
    let sglang = canonicalize(
        &fixture("sglang-0.5.23-basic.msgpack", EngineKind::Sglang),
        config(16, STANDARD),
    );
    assert_eq!(token_hashes(&vllm[0]), token_hashes(&sglang[0]));
}

#[test]
fn lora_name_salts_the_token_hash() {
    let batch = fixture("vllm-0.33.0-lora-gpu.msgpack", EngineKind::Vllm);
    let events = canonicalize(&batch, config(16, STANDARD));
    let tokens: Vec<u32> = (0..32).collect();
    let salt = HashSalt {
        lora_name: Some("tenant-a"),
        cache_namespace: None,
    };
    assert_eq!(
        token_hashes(&events[0]),
        block_hashes(&tokens, 16, STANDARD, salt)
    );
}

#[test]
fn sglang_cache_salt_salts_the_token_hash_in_both_encodings() {
    let tokens: Vec<u32> = (0..32).collect();
    let salt = HashSalt {
        lora_name: None,
        cache_namespace: Some("salt-1"),
    };
    let expected = block_hashes(&tokens, 16, STANDARD, salt);
    for name in [
        "sglang-0.5.19-salt-metadata.msgpack",
        "sglang-0.5.23-salt-session.msgpack",
    ] {
        let events = canonicalize(&fixture(name, EngineKind::Sglang), config(16, STANDARD));
        assert_eq!(token_hashes(&events[0]), expected, "{name}");
    }
}

#[test]
fn vllm_extra_keys_give_salt_and_multimodal_hashes() {
    let mut event = stored(2, 4);
    event.lora_name = Some("tenant-a".to_owned());
    let keys = vec![
        ExtraKey::Text("tenant-a".to_owned()),
        ExtraKey::Multimodal {
            identifier: "mm-0123abcd".to_owned(),
            offset: 0,
        },
        ExtraKey::Text("salt-1".to_owned()),
    ];
    event.extra_keys = vec![Some(keys), None];
    let events = canonicalize(&one(EngineEvent::BlockStored(event)), config(4, STANDARD));
    let salt = HashSalt {
        lora_name: Some("tenant-a"),
        cache_namespace: Some("salt-1"),
    };
    let tokens: Vec<u32> = (0..8).collect();
    let mm = vec![vec![
        kvrelay_identity::hashing::mm_hash_from_identifier("mm-0123abcd").unwrap(),
    ]];
    let with_salt = block_hashes_with_mm(&tokens, 4, STANDARD, salt, &mm);
    let lora_only = block_hashes(
        &tokens,
        4,
        STANDARD,
        HashSalt {
            lora_name: Some("tenant-a"),
            cache_namespace: None,
        },
    );
    assert_eq!(token_hashes(&events[0]), vec![with_salt[0], lora_only[1]]);
}

#[test]
fn sixty_four_hex_multimodal_identifier_uses_its_first_sixteen_digits() {
    let id = "0123456789abcdef".repeat(4);
    assert_eq!(
        kvrelay_identity::hashing::mm_hash_from_identifier(&id),
        Some(0x0123_4567_89ab_cdef)
    );
    assert_eq!(kvrelay_identity::hashing::mm_hash_from_identifier(""), None);
}

#[test]
fn sglang_bigram_pages_hash_like_their_flat_tokens() {
    let batch = fixture("sglang-0.5.23-bigram.msgpack", EngineKind::Sglang);
    let EngineEvent::BlockStored(first) = &batch.events[0] else {
        panic!()
    };
    let TokenIds::Bigram(pairs) = &first.token_ids else {
        panic!("not bigram")
    };
    let flat: Vec<u32> = pairs
        .iter()
        .map(|p| p[0])
        .chain(pairs.last().map(|p| p[1]))
        .collect();
    let standard = canonicalize(&batch, config(16, STANDARD));
    assert_eq!(
        token_hashes(&standard[0]),
        block_hashes(&flat[..16], 16, STANDARD, HashSalt::default())
    );
    let eagle = canonicalize(&batch, config(16, EAGLE));
    assert_eq!(
        token_hashes(&eagle[0]),
        block_hashes(&flat, 16, EAGLE, HashSalt::default())
    );
}

#[test]
fn eagle_uses_the_next_blocks_first_token_then_the_lookahead() {
    let mut event = stored(2, 4);
    event.lookahead_token_ids = vec![vec![4], vec![99]];
    let events = canonicalize(&one(EngineEvent::BlockStored(event)), config(4, EAGLE));
    let tokens: Vec<u32> = (0..8).chain([99]).collect();
    assert_eq!(
        token_hashes(&events[0]),
        block_hashes(&tokens, 4, EAGLE, HashSalt::default())
    );
}

#[test]
fn eagle_without_a_following_token_is_rejected() {
    let mut out = Vec::new();
    let outcome = Canonicalizer::new(1, 0, config(4, EAGLE))
        .canonicalize(&one(EngineEvent::BlockStored(stored(2, 4))), &mut out);
    assert_eq!(
        outcome.rejected,
        vec![CanonicalizeError::MissingLookahead {
            event_idx: 0,
            block_idx: 1
        }]
    );
    assert!(out.is_empty());
}

#[test]
fn block_size_mismatch_is_rejected_and_the_rest_of_the_batch_applies() {
    let batch = EngineBatch {
        ts: 0.0,
        events: vec![
            EngineEvent::BlockStored(stored(1, 8)),
            EngineEvent::AllBlocksCleared,
        ],
        dp_rank: Some(3),
    };
    let mut out = Vec::new();
    let outcome = Canonicalizer::new(1, 0, config(4, STANDARD)).canonicalize(&batch, &mut out);
    assert_eq!(
        outcome.rejected,
        vec![CanonicalizeError::BlockSizeMismatch {
            event_idx: 0,
            block_size: 8,
            expected: 4
        }]
    );
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].source(), SourceId::new(1, 3));
}

#[test]
fn token_count_not_covering_the_blocks_is_rejected() {
    let mut event = stored(2, 4);
    event.token_ids = TokenIds::Flat((0..7).collect());
    let mut out = Vec::new();
    let outcome = Canonicalizer::new(1, 0, config(4, STANDARD))
        .canonicalize(&one(EngineEvent::BlockStored(event)), &mut out);
    assert!(matches!(
        outcome.rejected[..],
        [CanonicalizeError::TokenCountMismatch { n_tokens: 7, .. }]
    ));
}

#[test]
fn non_gpu_media_are_filtered() {
    for medium in ["CPU", "CPU_PINNED", "DISK", "EXTERNAL"] {
        let mut event = stored(1, 4);
        event.medium = Some(medium.to_owned());
        let removal = BlockRemoved {
            block_hashes: vec![EngineBlockHash::unsigned(0)],
            medium: Some(medium.to_owned()),
            group_idx: None,
        };
        let batch = EngineBatch {
            ts: 0.0,
            events: vec![
                EngineEvent::BlockStored(event),
                EngineEvent::BlockRemoved(removal),
            ],
            dp_rank: None,
        };
        let mut out = Vec::new();
        let outcome = Canonicalizer::new(1, 0, config(4, STANDARD)).canonicalize(&batch, &mut out);
        assert_eq!((outcome.n_filtered, out.len()), (2, 0), "{medium}");
    }
}

#[test]
fn non_full_attention_groups_are_filtered_and_removals_follow_the_learned_group() {
    let mut canonicalizer = Canonicalizer::new(1, 0, config(4, STANDARD));
    let mut sliding = stored(1, 4);
    sliding.group_idx = Some(0);
    sliding.kv_cache_spec_kind = Some("sliding_window".to_owned());
    let mut full = stored(1, 4);
    full.group_idx = Some(1);
    full.kv_cache_spec_kind = Some("full_attention".to_owned());
    let removal = |group| {
        EngineEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineBlockHash::unsigned(0)],
            medium: None,
            group_idx: Some(group),
        })
    };
    let batch = EngineBatch {
        ts: 0.0,
        events: vec![
            EngineEvent::BlockStored(sliding),
            EngineEvent::BlockStored(full),
            removal(0),
            removal(1),
        ],
        dp_rank: None,
    };
    let mut out = Vec::new();
    let outcome = canonicalizer.canonicalize(&batch, &mut out);
    assert_eq!(outcome.n_filtered, 2);
    assert_eq!(out.len(), 2);
    assert!(matches!(device(&out)[0].payload, EventPayload::Stored(_)));
    assert!(matches!(device(&out)[1].payload, EventPayload::Removed(_)));
}

#[test]
fn removal_from_group_other_than_zero_is_filtered_before_any_group_is_learned() {
    let batch = one(EngineEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![EngineBlockHash::unsigned(1)],
        medium: Some("GPU".to_owned()),
        group_idx: Some(2),
    }));
    let mut out = Vec::new();
    let outcome = Canonicalizer::new(1, 0, config(4, STANDARD)).canonicalize(&batch, &mut out);
    assert_eq!(outcome.n_filtered, 1);
}

#[test]
fn event_ids_increase_per_canonicalizer() {
    let batch = EngineBatch {
        ts: 0.0,
        events: vec![EngineEvent::AllBlocksCleared, EngineEvent::AllBlocksCleared],
        dp_rank: None,
    };
    let mut canonicalizer = Canonicalizer::new(1, 0, config(4, STANDARD));
    let mut out = Vec::new();
    canonicalizer.canonicalize(&batch, &mut out);
    canonicalizer.canonicalize(&batch, &mut out);
    let ids: Vec<u64> = out.iter().map(CanonicalEvent::event_id).collect();
    assert_eq!(ids, vec![0, 1, 2, 3]);
}

fn tiered(block_size: u32) -> CanonicalConfig {
    CanonicalConfig {
        lower_tiers: true,
        ..CanonicalConfig::new(block_size, STANDARD)
    }
}

fn on(medium: &str, stored: BlockStored) -> EngineEvent {
    EngineEvent::BlockStored(BlockStored {
        medium: Some(medium.to_owned()),
        ..stored
    })
}

fn removed_on(medium: &str, ids: &[u64]) -> EngineEvent {
    EngineEvent::BlockRemoved(BlockRemoved {
        block_hashes: ids.iter().copied().map(EngineBlockHash::unsigned).collect(),
        medium: Some(medium.to_owned()),
        group_idx: None,
    })
}

/// vLLM's offloading connector: no tokens, no parent, `block_size` 0, medium `CPU`.
fn connector_store(ids: &[u64]) -> EngineEvent {
    on(
        "CPU",
        BlockStored::new(
            ids.iter().copied().map(EngineBlockHash::unsigned).collect(),
            None,
            TokenIds::Flat(Vec::new()),
            0,
        ),
    )
}

#[test]
fn lower_tier_events_are_filtered_unless_the_pool_keeps_tiers() {
    let batch = EngineBatch {
        ts: 0.0,
        events: vec![
            connector_store(&[1]),
            on("CPU_PINNED", stored(1, 4)),
            removed_on("DISK", &[1]),
        ],
        dp_rank: None,
    };
    let mut out = Vec::new();
    let outcome = Canonicalizer::new(1, 0, config(4, STANDARD)).canonicalize(&batch, &mut out);
    assert_eq!((outcome.n_filtered, out.len()), (3, 0));
    let outcome = Canonicalizer::new(1, 0, tiered(4)).canonicalize(&batch, &mut out);
    assert_eq!((outcome.n_filtered, out.len()), (0, 3));
    let tiers: Vec<CacheTier> = out
        .iter()
        .map(|event| match event {
            CanonicalEvent::Tier(event) => event.tier,
            CanonicalEvent::Device(event) => panic!("{event:?}"),
        })
        .collect();
    assert_eq!(tiers, [CacheTier::Host, CacheTier::Host, CacheTier::Disk]);
}

/// Device and tier events keep the engine's order: an offload between a device store and
/// its eviction must resolve against the device lineage of that moment.
#[test]
fn device_and_tier_events_interleave_in_engine_order() {
    let batch = EngineBatch {
        ts: 0.0,
        events: vec![
            on("GPU", stored(2, 4)),
            connector_store(&[1]),
            removed_on("GPU", &[0, 1]),
            removed_on("CPU", &[1]),
            EngineEvent::AllBlocksCleared,
        ],
        dp_rank: Some(3),
    };
    let mut out = Vec::new();
    let outcome = Canonicalizer::new(9, 0, tiered(4)).canonicalize(&batch, &mut out);
    assert!(outcome.rejected.is_empty(), "{:?}", outcome.rejected);
    let source = SourceId::new(9, 3);
    let expected_tokens = block_hashes(
        &(0..8).collect::<Vec<u32>>(),
        4,
        STANDARD,
        HashSalt::default(),
    );
    assert_eq!(token_hashes(out[0].as_device().unwrap()), expected_tokens);
    assert_eq!(
        out[1],
        CanonicalEvent::Tier(TierEvent {
            source,
            event_id: 1,
            tier: CacheTier::Host,
            change: TierChange::Offloaded {
                engine_block_ids: vec![1]
            },
        })
    );
    assert!(matches!(
        out[2].as_device().map(|e| &e.payload),
        Some(EventPayload::Removed(_))
    ));
    assert_eq!(
        out[3],
        CanonicalEvent::Tier(TierEvent {
            source,
            event_id: 3,
            tier: CacheTier::Host,
            change: TierChange::Removed(RemovedBlocks {
                engine_block_ids: vec![1]
            }),
        })
    );
    // A clear names no medium: a device clear (the pool drops every tier of the source).
    assert_eq!(
        out[4].as_device().map(|e| &e.payload),
        Some(&EventPayload::AllCleared)
    );
}

/// A lower-tier store that carries tokens is hashed exactly as the device would hash
/// them (SGLang's host tier), as a chain inside the tier.
#[test]
fn a_tier_store_with_tokens_chains_inside_the_tier_with_device_hashes() {
    let batch = fixture("sglang-0.5.19-medium-cpu.msgpack", EngineKind::Sglang);
    let device = fixture("sglang-0.5.19-basic.msgpack", EngineKind::Sglang);
    let mut out = Vec::new();
    Canonicalizer::new(9, 0, tiered(16)).canonicalize(&batch, &mut out);
    let on_device = canonicalize(&device, config(16, STANDARD));
    let mut n_stored = 0;
    for (tier_event, device_event) in out.iter().zip(&on_device) {
        let CanonicalEvent::Tier(tier_event) = tier_event else {
            // The fixture's clear names no medium: a device clear.
            assert_eq!(device_event.payload, EventPayload::AllCleared);
            continue;
        };
        assert_eq!(tier_event.tier, CacheTier::Host);
        match (&tier_event.change, &device_event.payload) {
            (TierChange::Stored(tier), EventPayload::Stored(device)) => {
                assert_eq!(tier, device);
                n_stored += 1;
            }
            (TierChange::Removed(tier), EventPayload::Removed(device)) => assert_eq!(tier, device),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(n_stored, 2);
}

/// Tier events follow the attention-group rule, and a medium no tier is known for stays
/// filtered; a tier store whose tokens do not fit the pool's blocks is rejected.
#[test]
fn tier_events_keep_the_group_rule_and_unknown_media_stay_filtered() {
    let sliding = BlockStored {
        kv_cache_spec_kind: Some("sliding_window".to_owned()),
        ..stored(1, 4)
    };
    let batch = EngineBatch {
        ts: 0.0,
        events: vec![
            on("CPU", sliding),
            on("EXTERNAL", stored(1, 4)),
            on("REMOTE", stored(1, 4)),
            removed_on("EXTERNAL", &[0]),
            on("CPU", stored(1, 8)),
        ],
        dp_rank: None,
    };
    let mut out = Vec::new();
    let outcome = Canonicalizer::new(1, 0, tiered(4)).canonicalize(&batch, &mut out);
    assert_eq!(outcome.n_filtered, 4);
    assert!(out.is_empty());
    assert_eq!(
        outcome.rejected,
        vec![CanonicalizeError::BlockSizeMismatch {
            event_idx: 4,
            block_size: 8,
            expected: 4
        }]
    );
    for (medium, tier) in [
        (None, Some(CacheTier::Device)),
        (Some("gpu"), Some(CacheTier::Device)),
        (Some("cpu_pinned"), Some(CacheTier::Host)),
        (Some("Disk"), Some(CacheTier::Disk)),
        (Some("STORAGE"), Some(CacheTier::Disk)),
        (Some("EXTERNAL"), None),
    ] {
        assert_eq!(kvrelay_ingest::tier_of_medium(medium), tier, "{medium:?}");
    }
}

/// vLLM 0.33.0's offloading connector, as its own code publishes it (fixtures made by
/// vLLM's offload manager and event translator, see tests/fixtures/vllm-offload): the
/// default events name a chunk by its last device block and carry no tokens; the opt-in
/// self-describing events carry the chunk's tokens. Through a device filter and a host
/// lane, both put exactly the chunk's canonical prefix hashes in the lane, and the
/// tier's eviction takes them out again.
#[test]
fn vllm_offloading_connector_events_land_in_the_host_lane_at_their_prefix_positions() {
    use kvrelay_ckf::{CkfConfig, PoolFilter, TierLane};
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm-offload");
    let tokens: Vec<u32> = (0..48).collect();
    let token_hashes = block_hashes(&tokens, 16, STANDARD, HashSalt::default());
    let mut prefix = Vec::new();
    for (position, token_hash) in token_hashes.iter().enumerate() {
        prefix.push(match position {
            0 => kvrelay_identity::hashing::canonical_root(*token_hash),
            _ => kvrelay_identity::hashing::canonical_child(prefix[position - 1], *token_hash),
        });
    }
    for (name, expected_in_lane) in [
        ("offload-basic.msgpack", vec![prefix[1]]),
        (
            "offload-self-describing.msgpack",
            vec![prefix[0], prefix[1]],
        ),
    ] {
        let payload = std::fs::read(dir.join(name)).unwrap();
        let batch = decode_engine_batch(&payload, EngineKind::Vllm, &Limits::default()).unwrap();
        let mut out = Vec::new();
        let outcome = Canonicalizer::new(1, 0, tiered(16)).canonicalize(&batch, &mut out);
        assert!(
            outcome.rejected.is_empty(),
            "{name}: {:?}",
            outcome.rejected
        );
        assert_eq!(outcome.n_filtered, 0, "{name}");
        let mut device = PoolFilter::new(CkfConfig::new(1024)).unwrap();
        let mut host = TierLane::new(CacheTier::Host, CkfConfig::new(1024)).unwrap();
        // Apply all but the tier's final eviction, then check, then evict.
        let (last, rest) = out.split_last().unwrap();
        for event in rest {
            match event {
                CanonicalEvent::Device(event) => {
                    device.apply(event).unwrap();
                }
                CanonicalEvent::Tier(event) => {
                    assert_eq!(host.apply(&device, event).unwrap().unmapped, 0, "{name}");
                }
            }
        }
        assert_eq!(
            host.filter().n_canonicals(),
            expected_in_lane.len() as u64,
            "{name}"
        );
        for hash in &expected_in_lane {
            assert!(host.filter().contains(*hash), "{name}: {hash:#x}");
        }
        // The device evicted its third block; the host copy is independent of that.
        assert!(!device.contains(prefix[2]) && device.contains(prefix[1]));
        let CanonicalEvent::Tier(eviction) = last else {
            panic!("{name}: the last event is the tier's eviction")
        };
        host.apply(&device, eviction).unwrap();
        assert_eq!(host.filter().n_canonicals(), 0, "{name}");
    }
}

/// The connector's events without any device store (a step where the GPU published
/// nothing): offloads of blocks the device lineage does not hold are dropped and counted,
/// never guessed.
#[test]
fn offloads_of_blocks_the_device_never_reported_are_counted_and_dropped() {
    use kvrelay_ckf::{CkfConfig, PoolFilter, TierLane};
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/vllm-offload/offload-only.msgpack");
    let batch = decode_engine_batch(
        &std::fs::read(path).unwrap(),
        EngineKind::Vllm,
        &Limits::default(),
    )
    .unwrap();
    let mut out = Vec::new();
    Canonicalizer::new(1, 0, tiered(16)).canonicalize(&batch, &mut out);
    let device = PoolFilter::new(CkfConfig::new(1024)).unwrap();
    let mut host = TierLane::new(CacheTier::Host, CkfConfig::new(1024)).unwrap();
    for event in &out {
        let CanonicalEvent::Tier(event) = event else {
            panic!("{event:?}")
        };
        host.apply(&device, event).unwrap();
    }
    assert_eq!(host.counters().offloads_unmapped, 2);
    assert_eq!(host.filter().n_canonicals(), 0);
}
