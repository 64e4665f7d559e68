//! The event-trace format, the LRU workload generator, the shipped traces and replay.
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

use kvrelay_ckf::{EventPayload, SourceId};
use kvrelay_ingest::{
    BUILTIN_REQUEST_TRACE, Limits, RequestRecord, Routing, SourceOutput, TraceError,
    TraceReplayConfig, TraceWorkload, TraceWorkloadConfig, format_event_trace, parse_event_trace,
    parse_request_trace, spawn_trace_replay,
};

fn repo_file(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(name)
}

/// The event trace shipped at `traces/events-small.jsonl`: the builtin workload with
/// default settings. Set `KVRELAY_BLESS=1` to rewrite it.
#[test]
fn shipped_event_trace_equals_the_generator_output() {
    let workload = TraceWorkload::builtin(TraceWorkloadConfig::default()).unwrap();
    let text = format_event_trace(&workload.header(), workload.events());
    let path = repo_file("traces/events-small.jsonl");
    if std::env::var_os("KVRELAY_BLESS").is_some() {
        std::fs::write(&path, &text).unwrap();
    }
    let shipped = std::fs::read_to_string(&path).unwrap();
    assert!(
        shipped == text,
        "traces/events-small.jsonl is stale; rerun with KVRELAY_BLESS=1"
    );
    assert!(
        shipped.len() < 1 << 20,
        "shipped trace is {} bytes",
        shipped.len()
    );
}

#[test]
fn event_trace_roundtrips_through_its_text_format() {
    let workload = TraceWorkload::builtin(TraceWorkloadConfig::default()).unwrap();
    let text = format_event_trace(&workload.header(), workload.events());
    let parsed = parse_event_trace(&text).unwrap();
    assert_eq!(parsed.header, workload.header());
    assert_eq!(parsed.events, workload.events());
    assert!(parsed.rejected.is_empty());
}

#[test]
fn bad_event_line_is_rejected_with_its_line_number_and_the_rest_parse() {
    let text = concat!(
        r#"{"format":"kvrelay-event-trace","version":1,"block_size":16,"hash_format":"dynamo_standard_v1"}"#,
        "\n",
        r#"{"t_ms":0,"worker_id":1,"kind":"cleared"}"#,
        "\n",
        r#"{"t_ms":1,"worker_id":1,"kind":"teleported"}"#,
        "\n",
        r#"{"t_ms":2,"worker_id":2,"dp_rank":1,"event_id":9,"kind":"removed","block_ids":[18446744073709551615]}"#,
        "\n",
    );
    let parsed = parse_event_trace(text).unwrap();
    assert_eq!(parsed.events.len(), 2);
    assert!(matches!(
        parsed.rejected[..],
        [TraceError::Malformed { line_no: 3, .. }]
    ));
    let EventPayload::Removed(removed) = &parsed.events[1].event.payload else {
        panic!()
    };
    assert_eq!(removed.engine_block_ids, vec![u64::MAX]);
    assert_eq!(parsed.events[1].event.source, SourceId::new(2, 1));
}

#[test]
fn unsupported_trace_version_is_rejected() {
    let err = parse_event_trace(
        r#"{"format":"kvrelay-event-trace","version":2,"block_size":16,"hash_format":"dynamo_standard_v1"}"#,
    )
    .unwrap_err();
    assert_eq!(
        err,
        TraceError::UnsupportedHeader {
            format: "kvrelay-event-trace".to_owned(),
            version: 2
        }
    );
}

/// Replays events onto an exact per-source model, checking engine semantics: parents
/// exist when a chain is stored, removed blocks exist, nothing is stored twice.
fn check_engine_semantics(workload: &TraceWorkload) -> BTreeMap<SourceId, usize> {
    let mut held: HashMap<SourceId, HashMap<u64, u64>> = HashMap::new();
    for timed in workload.events() {
        let blocks = held.entry(timed.event.source).or_default();
        match &timed.event.payload {
            EventPayload::Stored(stored) => {
                if let Some(parent) = stored.parent_engine_block_id {
                    assert!(blocks.contains_key(&parent), "parent {parent} unknown");
                }
                for block in &stored.blocks {
                    assert!(
                        blocks
                            .insert(block.engine_block_id, block.token_hash)
                            .is_none()
                    );
                }
            }
            EventPayload::Removed(removed) => {
                for id in &removed.engine_block_ids {
                    assert!(blocks.remove(id).is_some(), "removed unknown block {id}");
                }
            }
            EventPayload::AllCleared => blocks.clear(),
        }
        assert!(blocks.len() <= workload.config().capacity_blocks);
    }
    held.into_iter()
        .map(|(source, blocks)| (source, blocks.len()))
        .collect()
}

#[test]
fn generated_events_respect_engine_semantics_and_capacity() {
    for routing in [Routing::KvAware, Routing::RoundRobin, Routing::FirstBlock] {
        let config = TraceWorkloadConfig {
            capacity_blocks: 64,
            routing,
            ..TraceWorkloadConfig::default()
        };
        let workload = TraceWorkload::builtin(config).unwrap();
        let held = check_engine_semantics(&workload);
        assert_eq!(held.len(), 4, "{routing:?}");
        assert!(
            workload
                .events()
                .iter()
                .any(|e| matches!(e.event.payload, EventPayload::Removed(_)))
        );
    }
}

#[test]
fn mooncake_trace_generates_valid_events() {
    let path = repo_file("../shared/traces/mooncake-synthetic.jsonl");
    let text = std::fs::read_to_string(&path).unwrap();
    let requests = parse_request_trace(&text).unwrap();
    assert_eq!(requests.len(), 3993);
    let config = TraceWorkloadConfig {
        n_workers: 8,
        capacity_blocks: 4_096,
        ..TraceWorkloadConfig::default()
    };
    let workload = TraceWorkload::generate(&requests[..800], config);
    check_engine_semantics(&workload);
}

#[test]
fn kv_aware_routing_reuses_a_cached_prefix() {
    let requests = vec![
        RequestRecord {
            timestamp: 0,
            input_length: 48,
            output_length: 1,
            hash_ids: vec![1, 2, 3],
        },
        RequestRecord {
            timestamp: 1,
            input_length: 16,
            output_length: 1,
            hash_ids: vec![9],
        },
        RequestRecord {
            timestamp: 2,
            input_length: 64,
            output_length: 1,
            hash_ids: vec![1, 2, 3, 4],
        },
    ];
    let workload = TraceWorkload::generate(&requests, TraceWorkloadConfig::default());
    let events = workload.events();
    assert_eq!(events.len(), 3);
    assert_eq!(events[2].event.source, events[0].event.source);
    let EventPayload::Stored(first) = &events[0].event.payload else {
        panic!()
    };
    let EventPayload::Stored(last) = &events[2].event.payload else {
        panic!()
    };
    assert_eq!(
        last.parent_engine_block_id,
        Some(first.blocks[2].engine_block_id)
    );
    assert_eq!(last.blocks.len(), 1);
}

#[test]
fn request_trace_line_without_hash_ids_is_an_error() {
    let err = parse_request_trace("{\"timestamp\":0,\"input_length\":5}\n").unwrap_err();
    assert!(matches!(err, TraceError::Malformed { line_no: 1, .. }));
    assert!(!BUILTIN_REQUEST_TRACE.is_empty());
}

#[tokio::test(start_paused = true)]
async fn trace_replay_emits_every_event_in_order_then_ends() {
    let workload = TraceWorkload::builtin(TraceWorkloadConfig::default()).unwrap();
    let expected: Vec<_> = workload.events().iter().map(|e| e.event.clone()).collect();
    let mut source = spawn_trace_replay(
        workload.into_events(),
        TraceReplayConfig {
            speedup: 100.0,
            limits: Limits::default(),
        },
    );
    let mut got = Vec::new();
    while let Some(output) = source.next().await {
        let SourceOutput::Event(event) = output else {
            panic!("unexpected {output:?}")
        };
        got.push(event);
    }
    assert_eq!(got, expected);
    assert_eq!(source.stats().n_events, expected.len() as u64);
}

#[test]
fn a_worker_cache_chains_runs_on_the_prefix_it_holds_and_evicts_earlier_requests_first() {
    use kvrelay_ingest::{DEFAULT_WORKLOAD_SEED, WorkerCache};
    let source = SourceId::new(7, 0);
    let mut cache = WorkerCache::new(source, 3, 16, DEFAULT_WORKLOAD_SEED);
    let first = cache.serve(&[1, 2]);
    assert_eq!(first.len(), 1);
    let EventPayload::Stored(stored) = &first[0].payload else {
        panic!("expected a store, got {first:?}");
    };
    assert_eq!(stored.parent_engine_block_id, None);
    assert_eq!(stored.blocks.len(), 2);
    assert_eq!(
        stored.blocks[1].token_hash,
        kvrelay_ingest::block_token_hash(2, 16, DEFAULT_WORKLOAD_SEED)
    );
    let block_2 = stored.blocks[1].engine_block_id;
    // A full hit publishes nothing.
    assert!(cache.serve(&[1, 2]).is_empty());
    assert_eq!(cache.prefix_depth(&[1, 2, 3]), 2);
    // [1, 2, 3] fills the cache; the new run is parented on the held block 2.
    let third = cache.serve(&[1, 2, 3]);
    let EventPayload::Stored(stored) = &third[0].payload else {
        panic!("expected a store, got {third:?}");
    };
    assert_eq!(stored.parent_engine_block_id, Some(block_2));
    assert_eq!(cache.resident(), 3);
    // A new request evicts the least recently used block (1), never one of its own.
    let fourth = cache.serve(&[9]);
    assert!(
        matches!(&fourth[0].payload, EventPayload::Removed(removed) if removed.engine_block_ids.len() == 1),
        "{fourth:?}"
    );
    assert_eq!(cache.resident(), 3);
    let ids: Vec<u64> = [first, third, fourth]
        .iter()
        .flatten()
        .map(|event| event.event_id)
        .collect();
    assert!(ids.windows(2).all(|pair| pair[0] < pair[1]), "{ids:?}");
    assert_eq!(cache.source(), source);
}

#[test]
fn first_block_routing_is_fixed_per_first_block_and_in_range() {
    use kvrelay_ingest::route_by_first_block;
    assert_eq!(route_by_first_block(&[], 4), None);
    assert_eq!(route_by_first_block(&[5], 0), None);
    for first in 0..200u64 {
        let at = route_by_first_block(&[first, 1, 2], 4).unwrap();
        assert!(at < 4);
        assert_eq!(route_by_first_block(&[first, 9], 4), Some(at));
    }
    let spread: std::collections::BTreeSet<usize> = (0..200u64)
        .filter_map(|first| route_by_first_block(&[first], 4))
        .collect();
    assert_eq!(spread.len(), 4, "every worker gets requests");
}
