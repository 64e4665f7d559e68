//! Validation: malformed versus unsupported, per-entry quarantine, request rules, and
//! version evolution.

#![allow(clippy::unwrap_used, clippy::panic, reason = "tests fail by panicking")]

use bytes::{BufMut, BytesMut};
use kvrelay_codec::frame::{self, MessageKind};
use kvrelay_codec::v1::{
    self, CatalogUpdate, CkfFormat, CoverageState, DecodeError, DigestId, EndpointId, EntryError,
    ErrorMessage, ErrorReason, HashFormat, IdentitySource, Message, ModelRegistration,
    PoolCoverage, PoolDescriptor, PoolId, ProducerIdentity, QuerySemantics, RelayIdentity,
    StreamRequest, StreamRpc, TierLaneDescriptor, ValidationError, WorkerRole,
};
use kvrelay_codec::{FrameError, Limits};

fn producer(dc_id: u64) -> ProducerIdentity {
    let digest = |byte| DigestId {
        digest: [byte; 16],
        source: IdentitySource::Explicit,
    };
    ProducerIdentity {
        pool_id: PoolId {
            identity_version: 1,
            cache_semantics: digest(1),
            routing_scope: digest(2),
            dc_id,
        },
        producer_incarnation: 5,
        layout_generation: 1,
        ckf_format: CkfFormat {
            format_version: 1,
            seed: 1,
            bucket_count: 1 << 16,
            fingerprint_bits: 16,
            slots_per_bucket: 4,
        },
    }
}

fn descriptor(dc_id: u64) -> PoolDescriptor {
    PoolDescriptor {
        producer: producer(dc_id),
        serving_endpoint: EndpointId {
            namespace: "prod".into(),
            component: "backend".into(),
            name: "generate".into(),
        },
        registrations: vec![ModelRegistration {
            model: "llama-3-8b".into(),
            base_model: "llama-3-8b".into(),
            adapter: None,
            aliases: vec!["llama3".into()],
        }],
        query_semantics: QuerySemantics {
            kv_block_size: 16,
            hash_format: HashFormat::DynamoStandardV1,
        },
        pool_roles: vec![WorkerRole::Prefill, WorkerRole::Decode],
    }
}

fn catalog(pools: Vec<PoolDescriptor>) -> CatalogUpdate {
    CatalogUpdate {
        relay: RelayIdentity {
            drt_instance_id: 1,
            relay_incarnation: 5,
        },
        revision: 3,
        pools,
        coverage: Vec::new(),
        stalled: Vec::new(),
        tier_lanes: Vec::new(),
    }
}

fn check(pool: PoolDescriptor, expected: Result<(), ValidationError>) {
    assert_eq!(pool.validate(), expected);
}

#[test]
fn valid_descriptor_passes() {
    check(descriptor(1), Ok(()));
}

#[test]
fn descriptor_rules_name_the_offending_value() {
    let mut pool = descriptor(1);
    pool.registrations[0].model = " llama".into();
    check(
        pool,
        Err(ValidationError::SurroundingWhitespace {
            field: "registration.model",
            value: " llama".into(),
        }),
    );
    let mut pool = descriptor(1);
    pool.pool_roles = vec![WorkerRole::Decode, WorkerRole::Decode];
    check(
        pool,
        Err(ValidationError::DuplicateRole {
            field: "pool_roles",
            role: WorkerRole::Decode,
        }),
    );
    let mut pool = descriptor(1);
    pool.registrations.clear();
    check(pool, Err(ValidationError::NoRegistrations));
    let mut pool = descriptor(1);
    pool.query_semantics.kv_block_size = 0;
    check(pool, Err(ValidationError::ZeroBlockSize));
    let mut pool = descriptor(1);
    pool.producer.ckf_format.bucket_count = 3;
    check(
        pool,
        Err(ValidationError::InvalidBucketCount { bucket_count: 3 }),
    );
    let mut pool = descriptor(1);
    pool.registrations[0].aliases = vec!["llama-3-8b".into()];
    check(
        pool,
        Err(ValidationError::AliasCollision {
            alias: "llama-3-8b".into(),
        }),
    );
}

#[test]
fn unknown_codes_and_versions_are_unsupported_not_malformed() {
    let mut cases = Vec::new();
    let mut pool = descriptor(1);
    pool.producer.ckf_format.format_version = 3;
    cases.push(pool);
    let mut pool = descriptor(1);
    pool.query_semantics.hash_format = HashFormat::Unrecognized(9);
    cases.push(pool);
    let mut pool = descriptor(1);
    pool.pool_roles.push(WorkerRole::Unrecognized(40));
    cases.push(pool);
    let mut pool = descriptor(1);
    pool.producer.pool_id.identity_version = 2;
    cases.push(pool);
    for pool in cases {
        let err = pool.validate().unwrap_err();
        assert!(err.is_unsupported(), "{err}");
    }
    let mut pool = descriptor(1);
    pool.query_semantics.hash_format = HashFormat::Unrecognized(0);
    assert!(!pool.validate().unwrap_err().is_unsupported());
}

#[test]
fn a_dense_format_pool_is_valid_at_any_count_and_format_1_still_needs_a_power_of_two() {
    let mut pool = descriptor(1);
    pool.producer.ckf_format.format_version = 2;
    pool.producer.ckf_format.bucket_count = 263_158;
    check(pool.clone(), Ok(()));
    let layout = pool.producer.ckf_format.layout().unwrap();
    assert_eq!(
        (layout.format_version(), layout.bucket_count()),
        (2, 263_158)
    );
    let domain = pool.producer.ckf_format.domain().unwrap();
    assert!(domain.is_dense());
    assert_eq!(domain.bucket_count(), 263_158);
    pool.producer.ckf_format.bucket_count = 1;
    check(
        pool,
        Err(ValidationError::InvalidBucketCount { bucket_count: 1 }),
    );
    let mut pool = descriptor(1);
    pool.producer.ckf_format.bucket_count = 263_158;
    check(
        pool,
        Err(ValidationError::InvalidBucketCount {
            bucket_count: 263_158,
        }),
    );
}

#[test]
fn unsupported_catalog_entry_is_quarantined_and_the_rest_kept() {
    let mut newer = descriptor(2);
    newer.producer.ckf_format.format_version = 3;
    let verdict = catalog(vec![descriptor(1), newer, descriptor(3)])
        .validate()
        .unwrap();
    assert_eq!(verdict.accepted, vec![0, 2]);
    assert_eq!(verdict.quarantined.len(), 1);
    assert_eq!(verdict.quarantined[0].index, 1);
}

#[test]
fn malformed_catalog_entry_fails_the_update() {
    let mut broken = descriptor(2);
    broken.pool_roles.clear();
    assert_eq!(
        catalog(vec![descriptor(1), broken]).validate(),
        Err(EntryError {
            collection: "pools",
            index: 1,
            error: ValidationError::EmptyRoles {
                field: "pool_roles"
            },
        })
    );
}

#[test]
fn duplicate_pool_in_catalog_is_malformed() {
    let err = catalog(vec![descriptor(1), descriptor(1)])
        .validate()
        .unwrap_err();
    assert_eq!(err.index, 1);
    assert!(matches!(err.error, ValidationError::DuplicateEntry { .. }));
}

#[test]
fn validation_leaves_the_message_unchanged() {
    let update = catalog(vec![descriptor(1)]);
    let before = update.clone();
    let _ = update.validate();
    assert_eq!(update, before);
}

fn request(subscriber_id: &str) -> StreamRequest {
    StreamRequest {
        subscriber_id: subscriber_id.into(),
        rpc: StreamRpc::WatchCatalog,
        auth_token: None,
    }
}

#[test]
fn subscriber_id_rules() {
    assert_eq!(request(&"é".repeat(64)).validate(), Ok(()));
    assert_eq!(
        request("").validate(),
        Err(ValidationError::EmptyText {
            field: "subscriber_id"
        })
    );
    assert_eq!(
        request(&"a".repeat(129)).validate(),
        Err(ValidationError::TooLong {
            field: "subscriber_id",
            len: 129,
            max: 128
        })
    );
    assert!(matches!(
        request("router\n1").validate(),
        Err(ValidationError::ControlCharacter { .. })
    ));
}

#[test]
fn subscribe_pool_checks_the_expected_producer() {
    let mut expected_producer = producer(1);
    expected_producer.layout_generation = 0;
    let request = StreamRequest {
        subscriber_id: "router-a".into(),
        rpc: StreamRpc::SubscribePool {
            expected_producer,
            resume_from_sequence: None,
        },
        auth_token: Some("secret".into()),
    };
    assert_eq!(
        request.validate(),
        Err(ValidationError::ZeroLayoutGeneration)
    );
}

#[test]
fn a_refused_request_names_unsupported_values_apart_from_malformed_ones() {
    assert_eq!(request("router-a").check(), Ok(()));
    let malformed = request("").check().unwrap_err();
    assert_eq!(malformed.reason, v1::ErrorReason::InvalidRequest);
    let mut expected_producer = producer(1);
    expected_producer.ckf_format.fingerprint_bits = 8;
    let newer_format = StreamRequest {
        subscriber_id: "router-a".into(),
        rpc: StreamRpc::SubscribePool {
            expected_producer,
            resume_from_sequence: None,
        },
        auth_token: None,
    };
    let unsupported = newer_format.check().unwrap_err();
    assert_eq!(unsupported.reason, v1::ErrorReason::UnsupportedFeature);
    assert!(
        unsupported.message.contains("fingerprint"),
        "{}",
        unsupported.message
    );
}

#[test]
fn a_request_never_shows_its_token_in_debug_output() {
    let request = StreamRequest {
        subscriber_id: "router-a".into(),
        rpc: StreamRpc::RelayInfo,
        auth_token: Some("s3cr3t-token".into()),
    };
    let printed = format!("{request:?} {request:#?}");
    assert!(!printed.contains("s3cr3t"), "{printed}");
    assert!(printed.contains("router-a") && printed.contains("<redacted>"));
}

fn frame_with(kind_code: u16, minor: u16, body: &[u8]) -> BytesMut {
    let mut buf = BytesMut::new();
    buf.put_slice(b"KVRW");
    buf.put_u16_le(1);
    buf.put_u16_le(minor);
    buf.put_u16_le(kind_code);
    buf.put_u16_le(0);
    buf.put_u32_le(body.len() as u32);
    buf.put_slice(body);
    buf
}

#[test]
fn unknown_rpc_is_unsupported() {
    // subscriber_id "a", rpc 9, no producer, no token (bincode varints).
    let mut buf = frame_with(MessageKind::StreamRequest.code(), 0, &[1, b'a', 9, 0, 0]);
    let err = v1::decode_message(&mut buf, &Limits::default()).unwrap_err();
    assert_eq!(err, DecodeError::UnsupportedRpc { code: 9 });
    assert_eq!(err.reason(), ErrorReason::UnsupportedFeature);
}

#[test]
fn subscribe_pool_without_producer_is_invalid() {
    let mut buf = frame_with(MessageKind::StreamRequest.code(), 0, &[1, b'a', 3, 0, 0]);
    let err = v1::decode_message(&mut buf, &Limits::default()).unwrap_err();
    assert!(matches!(err, DecodeError::RpcArguments { rpc: 3, .. }));
    assert_eq!(err.reason(), ErrorReason::InvalidRequest);
}

#[test]
fn unknown_kind_is_skipped_and_the_stream_continues() {
    let mut buf = frame_with(42, 1, b"from the future");
    let error = Message::Error(ErrorMessage::new(ErrorReason::Internal, "boom"));
    v1::encode_message(&error, &Limits::default(), &mut buf).unwrap();
    let err = v1::decode_message(&mut buf, &Limits::default()).unwrap_err();
    assert!(err.is_unsupported());
    assert_eq!(
        v1::decode_message(&mut buf, &Limits::default()),
        Ok(Some(error))
    );
}

#[test]
fn newer_minor_may_append_fields_but_ours_may_not() {
    let mut body = BytesMut::new();
    ErrorMessage::new(ErrorReason::ResourceLimit, "limit")
        .encode_body(&mut body)
        .unwrap();
    body.put_slice(b"appended");
    let newer = frame_with(MessageKind::Error.code(), frame::PROTOCOL_MINOR + 1, &body);
    assert!(matches!(
        v1::decode_message(&mut newer.clone(), &Limits::default()),
        Ok(Some(Message::Error(_)))
    ));
    let same = frame_with(MessageKind::Error.code(), frame::PROTOCOL_MINOR, &body);
    assert_eq!(
        v1::decode_message(&mut same.clone(), &Limits::default()),
        Err(DecodeError::TrailingBytes {
            kind: "error",
            extra: 8
        })
    );
}

#[test]
fn other_major_is_a_contract_mismatch_reason() {
    let mut buf = frame_with(1, 0, b"");
    buf[4] = 2;
    let err = v1::decode_message(&mut buf, &Limits::default()).unwrap_err();
    assert_eq!(
        err,
        DecodeError::Frame(FrameError::ContractMismatch { major: 2 })
    );
    assert_eq!(err.reason(), ErrorReason::ContractMismatch);
}

#[test]
fn unrecognized_error_reason_is_handled_as_internal() {
    let message = ErrorMessage {
        reason: ErrorReason::Unrecognized(99),
        message: "new".into(),
    };
    assert!(message.validate().unwrap_err().is_unsupported());
    assert_eq!(message.effective_reason(), ErrorReason::Internal);
}

#[test]
fn long_error_message_is_cut_at_a_char_boundary() {
    let message = ErrorMessage::new(ErrorReason::Internal, &"é".repeat(3000));
    assert!(message.message.len() <= 4096);
    assert!(message.message.chars().all(|c| c == 'é'));
}

#[test]
fn resume_point_is_a_minor_1_field_and_minor_0_requests_still_decode() {
    let subscribe = |resume_from_sequence| StreamRequest {
        subscriber_id: "router-a".into(),
        rpc: StreamRpc::SubscribePool {
            expected_producer: producer(1),
            resume_from_sequence,
        },
        auth_token: None,
    };
    let mut body = BytesMut::new();
    subscribe(Some(41)).encode_body(&mut body).unwrap();
    assert_eq!(
        StreamRequest::decode_body(&body, frame::PROTOCOL_MINOR).unwrap(),
        subscribe(Some(41))
    );
    // A minor-0 client writes no resume field: the old body alone decodes, with none.
    let mut without = BytesMut::new();
    subscribe(None).encode_body(&mut without).unwrap();
    let minor0_body = &without[..without.len() - 1];
    assert_eq!(
        StreamRequest::decode_body(minor0_body, 0).unwrap(),
        subscribe(None)
    );
    // Minor-0 senders may not append anything.
    assert!(StreamRequest::decode_body(&body, 0).is_err());
}

fn coverage_of(pool: &PoolDescriptor, unroutable_percent: u8) -> PoolCoverage {
    PoolCoverage {
        pool_id: pool.producer.pool_id,
        state: CoverageState::Degraded,
        unroutable_percent,
    }
}

#[test]
fn coverage_is_a_minor_2_field_and_older_catalogs_still_decode() {
    let mut update = catalog(vec![descriptor(1), descriptor(2)]);
    update.coverage = vec![coverage_of(&update.pools[1], 70)];
    let mut body = BytesMut::new();
    update.encode_body(&mut body).unwrap();
    assert_eq!(
        CatalogUpdate::decode_body(&body, frame::PROTOCOL_MINOR).unwrap(),
        update
    );
    // A minor-1 relay writes the catalog without coverage: it decodes with none.
    let mut without = catalog(update.pools.clone());
    without.coverage.clear();
    let mut old_body = BytesMut::new();
    without.encode_body(&mut old_body).unwrap();
    // Without its three empty lists (coverage, minor 2; stalled, minor 3; tier lanes,
    // minor 4): one byte each.
    let minor1_body = &old_body[..old_body.len() - 3];
    assert_eq!(CatalogUpdate::decode_body(minor1_body, 1).unwrap(), without);
    // A minor-1 relay may not append anything.
    assert!(matches!(
        CatalogUpdate::decode_body(&body, 1),
        Err(DecodeError::TrailingBytes { .. })
    ));
}

#[test]
fn stalled_is_a_minor_3_field_and_minor_2_catalogs_still_decode() {
    let mut update = catalog(vec![descriptor(1)]);
    update.coverage = vec![coverage_of(&update.pools[0], 40)];
    update.stalled = vec![
        descriptor(2).producer.pool_id,
        descriptor(3).producer.pool_id,
    ];
    let mut body = BytesMut::new();
    update.encode_body(&mut body).unwrap();
    assert_eq!(CatalogUpdate::decode_body(&body, 4).unwrap(), update);
    // A minor-3 relay writes stalled and nothing after it (its body ends one empty list
    // earlier).
    assert_eq!(
        CatalogUpdate::decode_body(&body[..body.len() - 1], 3).unwrap(),
        update
    );
    let body = &body[..body.len() - 1];
    // A minor-2 relay writes coverage and nothing after it: no pool named stalled.
    let mut minor2 = update.clone();
    minor2.stalled.clear();
    let mut minor2_body = BytesMut::new();
    minor2.encode_body(&mut minor2_body).unwrap();
    let minor2_body = &minor2_body[..minor2_body.len() - 2];
    assert_eq!(CatalogUpdate::decode_body(minor2_body, 2).unwrap(), minor2);
    // A minor-2 relay may not append the stalled list.
    assert!(matches!(
        CatalogUpdate::decode_body(body, 2),
        Err(DecodeError::TrailingBytes { .. })
    ));
    // What a minor-2 consumer decodes of a minor-3 catalog: every older field, the stalled
    // list left as trailing bytes of a newer sender.
    #[derive(serde::Deserialize)]
    struct Minor2Catalog {
        relay: RelayIdentity,
        revision: u64,
        pools: Vec<PoolDescriptor>,
    }
    let config = bincode::config::standard();
    let (old, used): (Minor2Catalog, usize) =
        bincode::serde::decode_from_slice(body, config).unwrap();
    let (coverage, more): (Vec<PoolCoverage>, usize) =
        bincode::serde::decode_from_slice(&body[used..], config).unwrap();
    assert!(
        used + more < body.len(),
        "stalled follows the minor-2 fields"
    );
    assert_eq!(
        (old.relay, old.revision, old.pools, coverage),
        (update.relay, update.revision, update.pools, update.coverage)
    );
}

fn lane_of(pool: &PoolDescriptor, tier: u8, block_size: u32) -> TierLaneDescriptor {
    let mut producer = pool.producer;
    producer.pool_id.routing_scope.digest[0] ^= 0x80 | tier;
    TierLaneDescriptor {
        pool_id: pool.producer.pool_id,
        tier,
        block_size,
        producer,
    }
}

#[test]
fn tier_lanes_are_a_minor_4_field_that_older_consumers_skip() {
    let mut update = catalog(vec![descriptor(1), descriptor(2)]);
    update.tier_lanes = vec![
        lane_of(&update.pools[0], 1, 32),
        lane_of(&update.pools[1], 2, 16),
    ];
    assert!(update.validate().is_ok());
    let mut body = BytesMut::new();
    update.encode_body(&mut body).unwrap();
    assert_eq!(
        CatalogUpdate::decode_body(&body, frame::PROTOCOL_MINOR).unwrap(),
        update
    );
    // A minor-3 relay's catalog ends after `stalled`: it decodes with no lanes.
    let mut minor3 = update.clone();
    minor3.tier_lanes.clear();
    let mut minor3_body = BytesMut::new();
    minor3.encode_body(&mut minor3_body).unwrap();
    let minor3_body = &minor3_body[..minor3_body.len() - 1];
    assert_eq!(CatalogUpdate::decode_body(minor3_body, 3).unwrap(), minor3);
    // What a minor-3 consumer decodes of a minor-4 catalog: every older field; the lanes
    // are trailing bytes of a newer sender, so it keeps scoring device memory only.
    #[derive(serde::Deserialize)]
    struct Minor3Catalog {
        relay: RelayIdentity,
        revision: u64,
        pools: Vec<PoolDescriptor>,
    }
    let config = bincode::config::standard();
    let (old, mut used): (Minor3Catalog, usize) =
        bincode::serde::decode_from_slice(&body, config).unwrap();
    let (coverage, more): (Vec<PoolCoverage>, usize) =
        bincode::serde::decode_from_slice(&body[used..], config).unwrap();
    used += more;
    let (stalled, more): (Vec<PoolId>, usize) =
        bincode::serde::decode_from_slice(&body[used..], config).unwrap();
    used += more;
    assert!(used < body.len(), "the lanes follow the minor-3 fields");
    assert_eq!(
        (old.relay, old.revision, old.pools, coverage, stalled),
        (
            update.relay,
            update.revision,
            update.pools,
            update.coverage,
            update.stalled
        )
    );
}

#[test]
fn a_tier_lane_names_a_listed_pool_once_per_tier_with_a_multiple_block_size() {
    let update = catalog(vec![descriptor(1), descriptor(2)]);
    let cases: Vec<(Vec<TierLaneDescriptor>, &str)> = vec![
        (vec![lane_of(&descriptor(3), 1, 16)], "not listed"),
        (vec![lane_of(&update.pools[0], 1, 24)], "multiple"),
        (vec![lane_of(&update.pools[0], 1, 0)], "multiple"),
        (
            vec![
                lane_of(&update.pools[0], 1, 16),
                lane_of(&update.pools[0], 1, 32),
            ],
            "twice",
        ),
        (
            vec![TierLaneDescriptor {
                producer: update.pools[1].producer,
                ..lane_of(&update.pools[0], 1, 16)
            }],
            "listed pool",
        ),
        (
            (0..=2 * kvrelay_codec::v1::MAX_TIER_LANES_PER_POOL as u8)
                .map(|tier| lane_of(&update.pools[0], tier, 16))
                .collect(),
            "more lanes",
        ),
    ];
    for (lanes, expected) in cases {
        let mut bad = update.clone();
        bad.tier_lanes = lanes;
        let err = bad.validate().unwrap_err();
        assert_eq!(err.collection, "tier_lanes");
        match &err.error {
            ValidationError::InvalidTierLane { detail, .. } => {
                assert!(detail.contains(expected), "{detail} vs {expected}")
            }
            other => panic!("{other:?}"),
        }
    }
    // An unknown tier code is a newer relay's tier: valid here, skipped by consumers.
    let mut newer = update.clone();
    newer.tier_lanes = vec![lane_of(&update.pools[0], 9, 16)];
    assert!(newer.validate().is_ok());
}

#[test]
fn a_stalled_pool_is_named_once_and_never_also_listed() {
    let mut update = catalog(vec![descriptor(1), descriptor(2)]);
    update.stalled = vec![descriptor(3).producer.pool_id];
    assert!(update.validate().is_ok());
    update.stalled = vec![update.pools[1].producer.pool_id];
    let err = update.validate().unwrap_err();
    assert_eq!((err.collection, err.index), ("stalled", 0));
    assert!(
        matches!(err.error, ValidationError::StalledPoolListed { .. }),
        "{err:?}"
    );
    let other = descriptor(3).producer.pool_id;
    update.stalled = vec![other, descriptor(4).producer.pool_id, other];
    let err = update.validate().unwrap_err();
    assert_eq!((err.collection, err.index), ("stalled", 2));
    assert!(
        matches!(
            err.error,
            ValidationError::DuplicateEntry {
                field: "stalled",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn a_minor_1_consumer_reads_a_minor_2_catalog_without_its_coverage() {
    // What a consumer built before minor 2 decodes: the same fields, trailing bytes of a
    // newer sender skipped.
    #[derive(serde::Deserialize)]
    struct Minor1Catalog {
        relay: RelayIdentity,
        revision: u64,
        pools: Vec<PoolDescriptor>,
    }
    let mut update = catalog(vec![descriptor(1)]);
    update.coverage = vec![coverage_of(&update.pools[0], 100)];
    let mut body = BytesMut::new();
    update.encode_body(&mut body).unwrap();
    let config = bincode::config::standard();
    let (old, used): (Minor1Catalog, usize) =
        bincode::serde::decode_from_slice(&body, config).unwrap();
    assert!(used < body.len(), "coverage follows the minor-1 fields");
    assert_eq!(
        (old.relay, old.revision, old.pools),
        (update.relay, update.revision, update.pools)
    );
}

#[test]
fn coverage_must_name_listed_pools_once_with_a_share_of_at_most_100() {
    let pools = vec![descriptor(1), descriptor(2)];
    let mut update = catalog(pools.clone());
    update.coverage = vec![coverage_of(&pools[0], 100), coverage_of(&pools[1], 0)];
    assert!(update.validate().is_ok());

    update.coverage = vec![coverage_of(&descriptor(3), 50)];
    let err = update.validate().unwrap_err();
    assert_eq!((err.collection, err.index), ("coverage", 0));
    assert!(matches!(
        err.error,
        ValidationError::CoverageOfUnlistedPool { .. }
    ));

    update.coverage = vec![coverage_of(&pools[0], 101)];
    let err = update.validate().unwrap_err();
    assert_eq!(err.error, ValidationError::CoverageShare { percent: 101 });

    update.coverage = vec![coverage_of(&pools[1], 10), coverage_of(&pools[1], 20)];
    let err = update.validate().unwrap_err();
    assert_eq!((err.collection, err.index), ("coverage", 1));
    assert!(matches!(err.error, ValidationError::DuplicateEntry { .. }));

    // More entries than pools is refused before any entry is compared with the list.
    update.coverage = vec![coverage_of(&pools[0], 10); 100_000];
    let err = update.validate().unwrap_err();
    assert_eq!(
        err.error,
        ValidationError::CoverageLongerThanPools {
            coverage: 100_000,
            pools: 2
        }
    );
}

#[test]
fn an_overfull_coverage_state_round_trips_with_its_share() {
    let mut update = catalog(vec![descriptor(1)]);
    update.coverage = vec![PoolCoverage {
        state: CoverageState::Overfull,
        ..coverage_of(&update.pools[0], 20)
    }];
    let mut body = BytesMut::new();
    update.encode_body(&mut body).unwrap();
    let decoded = CatalogUpdate::decode_body(&body, frame::PROTOCOL_MINOR).unwrap();
    assert_eq!(decoded.coverage[0].state, CoverageState::Overfull);
    assert_eq!(decoded.coverage[0].state.code(), 3);
    assert_eq!(decoded.coverage[0].unroutable_percent, 20);
    assert!(decoded.validate().is_ok());
}

#[test]
fn an_unrecognized_coverage_state_decodes_and_validates() {
    // A newer relay's state: kept as a code for the consumer to report.
    let mut update = catalog(vec![descriptor(1)]);
    update.coverage = vec![PoolCoverage {
        state: CoverageState::from_code(9),
        ..coverage_of(&update.pools[0], 30)
    }];
    let mut body = BytesMut::new();
    update.encode_body(&mut body).unwrap();
    let decoded = CatalogUpdate::decode_body(&body, frame::PROTOCOL_MINOR).unwrap();
    assert_eq!(decoded.coverage[0].state, CoverageState::Unrecognized(9));
    assert!(decoded.validate().is_ok());
}
