//! Decoding the engines' own msgpack output (`shared/fixtures/engine-events`).
use std::path::PathBuf;

use kvrelay_ingest::{
    EngineBatch, EngineBlockHash, EngineEvent, EngineKind, ExtraKey, HashRepr, Limits, TokenIds,
    decode_engine_batch,
};
use serde_json::Value;

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/fixtures/engine-events")
}

fn read_json(name: &str) -> Value {
    let path = fixture_dir().join(name);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|err| panic!("read {}: {err}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn engine_of(name: &str) -> EngineKind {
    name.parse().unwrap()
}

/// The expected string form of a hash: decimal of the wire integer, or hex of the bytes.
fn hash_matches(actual: &EngineBlockHash, expected: &str) -> bool {
    match actual.repr {
        HashRepr::Unsigned => expected == actual.value.to_string(),
        HashRepr::Signed => expected == (actual.value as i64).to_string(),
        HashRepr::Bytes => {
            let tail = &expected[expected.len() - 16..];
            u64::from_str_radix(tail, 16).unwrap() == actual.value
        }
    }
}

fn opt_str(value: &Value) -> Option<String> {
    value.as_str().map(str::to_owned)
}

fn check_event(actual: &EngineEvent, expected: &Value, label: &str) {
    assert_eq!(actual.tag(), expected["type"].as_str().unwrap(), "{label}");
    match actual {
        EngineEvent::BlockStored(stored) => {
            let hashes = expected["block_hashes"].as_array().unwrap();
            assert_eq!(stored.block_hashes.len(), hashes.len(), "{label}");
            for (a, e) in stored.block_hashes.iter().zip(hashes) {
                assert!(
                    hash_matches(a, e.as_str().unwrap()),
                    "{label}: {a:?} vs {e}"
                );
            }
            match (
                &stored.parent_block_hash,
                expected["parent_block_hash"].as_str(),
            ) {
                (None, None) => {}
                (Some(a), Some(e)) => assert!(hash_matches(a, e), "{label}: parent"),
                other => panic!("{label}: parent mismatch {other:?}"),
            }
            let tokens = expected["token_ids"].as_array().unwrap();
            match &stored.token_ids {
                TokenIds::Flat(flat) => {
                    let want: Vec<u32> =
                        tokens.iter().map(|t| t.as_u64().unwrap() as u32).collect();
                    assert_eq!(flat, &want, "{label}");
                }
                TokenIds::Bigram(pairs) => {
                    let want: Vec<[u32; 2]> = tokens
                        .iter()
                        .map(|p| {
                            let p = p.as_array().unwrap();
                            [p[0].as_u64().unwrap() as u32, p[1].as_u64().unwrap() as u32]
                        })
                        .collect();
                    assert_eq!(pairs, &want, "{label}");
                }
            }
            assert_eq!(
                u64::from(stored.block_size),
                expected["block_size"].as_u64().unwrap()
            );
            assert_eq!(stored.lora_id, expected["lora_id"].as_i64(), "{label}");
            assert_eq!(stored.medium, opt_str(&expected["medium"]), "{label}");
            if let Some(name) = expected.get("lora_name") {
                assert_eq!(stored.lora_name, opt_str(name), "{label}");
            }
            let salt = expected.get("cache_salt").and_then(opt_str).or_else(|| {
                expected
                    .get("metadata")
                    .and_then(|m| opt_str(&m["cache_salt"]))
            });
            assert_eq!(stored.cache_salt, salt, "{label}");
            if let Some(group) = expected.get("group_idx") {
                assert_eq!(stored.group_idx.map(u64::from), group.as_u64(), "{label}");
            }
            if let Some(kind) = expected.get("kv_cache_spec_kind") {
                assert_eq!(stored.kv_cache_spec_kind, opt_str(kind), "{label}");
            }
            if let Some(window) = expected.get("kv_cache_spec_sliding_window") {
                assert_eq!(
                    stored.kv_cache_spec_sliding_window.map(u64::from),
                    window.as_u64()
                );
            }
            match expected.get("extra_keys").and_then(Value::as_array) {
                None => assert!(stored.extra_keys.is_empty(), "{label}"),
                Some(blocks) => {
                    assert_eq!(stored.extra_keys.len(), blocks.len(), "{label}");
                    for (a, e) in stored.extra_keys.iter().zip(blocks) {
                        check_extra_keys(a.as_deref(), e, label);
                    }
                }
            }
            match expected
                .get("lookahead_token_ids")
                .and_then(Value::as_array)
            {
                None => assert!(stored.lookahead_token_ids.is_empty(), "{label}"),
                Some(blocks) => {
                    let want: Vec<Vec<u32>> = blocks
                        .iter()
                        .map(|b| {
                            b.as_array()
                                .unwrap()
                                .iter()
                                .map(|t| t.as_u64().unwrap() as u32)
                                .collect()
                        })
                        .collect();
                    assert_eq!(stored.lookahead_token_ids, want, "{label}");
                }
            }
        }
        EngineEvent::BlockRemoved(removed) => {
            let hashes = expected["block_hashes"].as_array().unwrap();
            assert_eq!(removed.block_hashes.len(), hashes.len(), "{label}");
            for (a, e) in removed.block_hashes.iter().zip(hashes) {
                assert!(hash_matches(a, e.as_str().unwrap()), "{label}");
            }
            assert_eq!(removed.medium, opt_str(&expected["medium"]), "{label}");
            if let Some(group) = expected.get("group_idx") {
                assert_eq!(removed.group_idx.map(u64::from), group.as_u64(), "{label}");
            }
        }
        EngineEvent::AllBlocksCleared => {}
    }
}

fn check_extra_keys(actual: Option<&[ExtraKey]>, expected: &Value, label: &str) {
    let Some(keys) = expected.as_array() else {
        assert!(actual.is_none(), "{label}");
        return;
    };
    let actual = actual.unwrap();
    assert_eq!(actual.len(), keys.len(), "{label}");
    for (a, e) in actual.iter().zip(keys) {
        match (a, e) {
            (ExtraKey::Text(text), Value::String(want)) => assert_eq!(text, want),
            (ExtraKey::Multimodal { identifier, offset }, Value::Array(pair)) => {
                assert_eq!(identifier, pair[0].as_str().unwrap());
                assert_eq!(*offset, pair[1].as_i64().unwrap());
            }
            other => panic!("{label}: extra key mismatch {other:?}"),
        }
    }
}

fn decode_fixture(payload_name: &str, engine: EngineKind) -> EngineBatch {
    let bytes = std::fs::read(fixture_dir().join(payload_name)).unwrap();
    decode_engine_batch(&bytes, engine, &Limits::default())
        .unwrap_or_else(|err| panic!("{payload_name}: {err}"))
}

#[test]
fn every_engine_fixture_decodes_to_its_expected_events() {
    let index = read_json("index.json");
    let payloads = index["payloads"].as_array().unwrap();
    assert!(
        payloads.len() >= 24,
        "index lists {} payloads",
        payloads.len()
    );
    for entry in payloads {
        let payload = entry["payload"].as_str().unwrap();
        let sidecar = read_json(entry["sidecar"].as_str().unwrap());
        let batch = decode_fixture(payload, engine_of(entry["engine"].as_str().unwrap()));
        let expected = &sidecar["expected"];
        assert_eq!(batch.ts, expected["ts"].as_f64().unwrap(), "{payload}");
        assert_eq!(
            batch.dp_rank.map(u64::from),
            expected["dp_rank"].as_u64(),
            "{payload}"
        );
        let events = expected["events"].as_array().unwrap();
        assert_eq!(batch.events.len(), events.len(), "{payload}");
        for (idx, (a, e)) in batch.events.iter().zip(events).enumerate() {
            check_event(a, e, &format!("{payload} event {idx}"));
        }
    }
}

#[test]
fn vllm_uint64_hash_above_i64_max_is_kept_unsigned() {
    let batch = decode_fixture("vllm-0.33.0-basic.msgpack", EngineKind::Vllm);
    let EngineEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("not stored")
    };
    assert_eq!(stored.block_hashes[1].value, 0xFEDC_BA98_7654_3210);
    assert_eq!(stored.block_hashes[1].repr, HashRepr::Unsigned);
}

#[test]
fn sglang_negative_hash_has_the_same_bits_as_vllm_unsigned() {
    let batch = decode_fixture("sglang-0.5.23-basic.msgpack", EngineKind::Sglang);
    let EngineEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("not stored")
    };
    assert_eq!(stored.block_hashes[1].value, 0xFEDC_BA98_7654_3210);
    assert_eq!(stored.block_hashes[1].repr, HashRepr::Signed);
}

#[test]
fn bytes_hashes_fold_to_the_last_eight_bytes_big_endian() {
    let batch = decode_fixture("vllm-0.11.0-bytes-hashes.msgpack", EngineKind::Vllm);
    let EngineEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("not stored")
    };
    assert_eq!(stored.block_hashes[0].repr, HashRepr::Bytes);
}

#[test]
fn sglang_metadata_array_event_yields_its_cache_salt() {
    let batch = decode_fixture("sglang-0.5.19-salt-metadata.msgpack", EngineKind::Sglang);
    let EngineEvent::BlockStored(stored) = &batch.events[0] else {
        panic!("not stored")
    };
    assert_eq!(stored.cache_salt.as_deref(), Some("salt-1"));
}

#[test]
fn zmq_capture_payloads_decode_like_the_standalone_fixtures() {
    let index = read_json("index.json");
    for capture in index["zmq_captures"].as_array().unwrap() {
        let name = capture.as_str().unwrap();
        let json = read_json(name);
        let engine = engine_of(json["engine"].as_str().unwrap());
        for live in json["live"].as_array().unwrap() {
            let frames = live["frames_b64"].as_array().unwrap();
            assert_eq!(frames.len(), 3, "{name}");
            let payload = base64_decode(frames[2].as_str().unwrap());
            let standalone =
                std::fs::read(fixture_dir().join(live["payload_file"].as_str().unwrap())).unwrap();
            assert_eq!(payload, standalone, "{name}");
            decode_engine_batch(&payload, engine, &Limits::default()).unwrap();
        }
    }
}

/// Minimal standard base64 decoder for the capture files.
fn base64_decode(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    let mut acc = 0u32;
    let mut bits = 0;
    for c in text.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => continue,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}
