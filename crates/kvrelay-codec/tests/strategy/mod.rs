//! Proptest strategies for every v1 wire type (shared by the integration tests).

#![allow(dead_code, reason = "each test file uses a subset")]

use bytes::Bytes;
use kvrelay_codec::v1::*;
use proptest::collection::vec;
use proptest::option;
use proptest::prelude::*;

pub(crate) fn text() -> impl Strategy<Value = String> {
    "\\PC{0,12}"
}

pub(crate) fn code<T: 'static + std::fmt::Debug + Clone>(
    from: fn(u32) -> T,
) -> impl Strategy<Value = T> {
    prop_oneof![4 => 1u32..=5, 1 => any::<u32>()].prop_map(from)
}

pub(crate) fn relay() -> impl Strategy<Value = RelayIdentity> {
    (any::<u64>(), any::<u64>()).prop_map(|(drt_instance_id, relay_incarnation)| RelayIdentity {
        drt_instance_id,
        relay_incarnation,
    })
}

pub(crate) fn digest() -> impl Strategy<Value = DigestId> {
    (any::<[u8; 16]>(), code(IdentitySource::from_code))
        .prop_map(|(digest, source)| DigestId { digest, source })
}

pub(crate) fn pool_id() -> impl Strategy<Value = PoolId> {
    (
        prop_oneof![Just(1u32), any::<u32>()],
        digest(),
        digest(),
        any::<u64>(),
    )
        .prop_map(
            |(identity_version, cache_semantics, routing_scope, dc_id)| PoolId {
                identity_version,
                cache_semantics,
                routing_scope,
                dc_id,
            },
        )
}

pub(crate) fn ckf_format() -> impl Strategy<Value = CkfFormat> {
    (
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
    )
        .prop_map(
            |(format_version, seed, bucket_count, fingerprint_bits, slots_per_bucket)| CkfFormat {
                format_version,
                seed,
                bucket_count,
                fingerprint_bits,
                slots_per_bucket,
            },
        )
}

pub(crate) fn producer() -> impl Strategy<Value = ProducerIdentity> {
    (pool_id(), any::<u64>(), any::<u64>(), ckf_format()).prop_map(
        |(pool_id, producer_incarnation, layout_generation, ckf_format)| ProducerIdentity {
            pool_id,
            producer_incarnation,
            layout_generation,
            ckf_format,
        },
    )
}

pub(crate) fn endpoint() -> impl Strategy<Value = EndpointId> {
    (text(), text(), text()).prop_map(|(namespace, component, name)| EndpointId {
        namespace,
        component,
        name,
    })
}

pub(crate) fn roles() -> impl Strategy<Value = Vec<WorkerRole>> {
    vec(code(WorkerRole::from_code), 0..4)
}

pub(crate) fn registration() -> impl Strategy<Value = ModelRegistration> {
    (text(), text(), option::of(text()), vec(text(), 0..3)).prop_map(
        |(model, base_model, adapter, aliases)| ModelRegistration {
            model,
            base_model,
            adapter,
            aliases,
        },
    )
}

pub(crate) fn descriptor() -> impl Strategy<Value = PoolDescriptor> {
    (
        producer(),
        endpoint(),
        vec(registration(), 0..3),
        (any::<u32>(), code(HashFormat::from_code)),
        roles(),
    )
        .prop_map(
            |(
                producer,
                serving_endpoint,
                registrations,
                (kv_block_size, hash_format),
                pool_roles,
            )| {
                PoolDescriptor {
                    producer,
                    serving_endpoint,
                    registrations,
                    query_semantics: QuerySemantics {
                        kv_block_size,
                        hash_format,
                    },
                    pool_roles,
                }
            },
        )
}

/// A catalog whose coverage names some of its own pools (any state code, any share), with
/// a few stalled (withheld) pools.
pub(crate) fn catalog() -> impl Strategy<Value = CatalogUpdate> {
    (
        relay(),
        any::<u64>(),
        vec(descriptor(), 0..4),
        vec(pool_id(), 0..3),
    )
        .prop_flat_map(|(relay, revision, pools, stalled)| {
            let n = pools.len();
            vec(
                option::of((code(CoverageState::from_code), any::<u8>())),
                n..=n,
            )
            .prop_map(move |marks| {
                let coverage = pools
                    .iter()
                    .zip(marks)
                    .filter_map(|(pool, mark)| {
                        let (state, unroutable_percent) = mark?;
                        Some(PoolCoverage {
                            pool_id: pool.producer.pool_id,
                            state,
                            unroutable_percent,
                        })
                    })
                    .collect();
                CatalogUpdate {
                    relay,
                    revision,
                    pools: pools.clone(),
                    coverage,
                    stalled: stalled.clone(),
                    tier_lanes: Vec::new(),
                }
            })
        })
}

pub(crate) fn pool_load() -> impl Strategy<Value = PoolLoad> {
    (
        producer(),
        option::of(any::<u64>()),
        option::of(any::<u64>()),
        any::<(u32, u32, u32)>(),
        any::<bool>(),
    )
        .prop_map(
            |(producer, kv_used_blocks, total_kv_blocks, ranks, authoritative)| PoolLoad {
                producer,
                kv_used_blocks,
                total_kv_blocks,
                kv_observed_ranks: ranks.0,
                kv_capacity_ranks: ranks.1,
                kv_expected_ranks: ranks.2,
                authoritative,
            },
        )
}

pub(crate) fn load_window() -> impl Strategy<Value = LoadWindow> {
    (relay(), any::<(u64, u64, u64)>(), vec(pool_load(), 0..4)).prop_map(
        |(relay, (window_sequence, observed_unix_ms, window_ms), pools)| LoadWindow {
            relay,
            window_sequence,
            observed_unix_ms,
            window_ms,
            pools,
        },
    )
}

pub(crate) fn member() -> impl Strategy<Value = TopologyMember> {
    (endpoint(), roles(), option::of(pool_id())).prop_map(|(endpoint, roles, pool_id)| {
        TopologyMember {
            endpoint,
            roles,
            pool_id,
        }
    })
}

pub(crate) fn adapter() -> impl Strategy<Value = AdapterReadiness> {
    (text(), code(ReadinessState::from_code), roles()).prop_map(
        |(canonical_model, state, missing_roles)| AdapterReadiness {
            canonical_model,
            state,
            missing_roles,
        },
    )
}

pub(crate) fn topology_entry() -> impl Strategy<Value = TopologyEntry> {
    (
        (text(), text(), code(ReadinessState::from_code)),
        (roles(), roles(), roles()),
        vec(member(), 0..3),
        any::<bool>(),
        vec(adapter(), 0..2),
    )
        .prop_map(
            |(
                (namespace, canonical_model, state),
                (present_roles, missing_roles, duplicate_role_endpoints),
                members,
                legacy_fallback_active,
                adapters,
            )| TopologyEntry {
                namespace,
                canonical_model,
                state,
                present_roles,
                missing_roles,
                members,
                duplicate_role_endpoints,
                legacy_fallback_active,
                adapters,
            },
        )
}

pub(crate) fn topology() -> impl Strategy<Value = TopologyUpdate> {
    (relay(), any::<u64>(), vec(topology_entry(), 0..3)).prop_map(|(relay, revision, entries)| {
        TopologyUpdate {
            relay,
            revision,
            entries,
        }
    })
}

pub(crate) fn stream_request() -> impl Strategy<Value = StreamRequest> {
    let rpc = prop_oneof![
        Just(StreamRpc::RelayInfo),
        Just(StreamRpc::WatchCatalog),
        (producer(), proptest::option::of(proptest::num::u64::ANY)).prop_map(
            |(expected_producer, resume_from_sequence)| StreamRpc::SubscribePool {
                expected_producer,
                resume_from_sequence
            }
        ),
        Just(StreamRpc::WatchLoad),
        Just(StreamRpc::WatchTopology),
    ];
    (text(), rpc, option::of(text())).prop_map(|(subscriber_id, rpc, auth_token)| StreamRequest {
        subscriber_id,
        rpc,
        auth_token,
    })
}

pub(crate) fn pool_frame() -> impl Strategy<Value = PoolFrame> {
    (
        relay(),
        producer(),
        any::<(u64, u64, u64)>(),
        code(PoolFrameKind::from_code),
        vec(any::<u8>(), 0..64),
    )
        .prop_map(
            |(relay, producer, (base_sequence, sequence, sent_unix_us), kind, payload)| PoolFrame {
                header: PoolFrameHeader {
                    relay,
                    producer,
                    base_sequence,
                    sequence,
                    kind,
                    sent_unix_us,
                },
                payload: Bytes::from(payload),
            },
        )
}

pub(crate) fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        stream_request().prop_map(Message::StreamRequest),
        (relay(), any::<(u16, u16, u32)>()).prop_map(|(relay, (major, minor, max))| {
            Message::RelayInfo(RelayInfo {
                protocol_major: major,
                protocol_minor: minor,
                relay,
                max_frame_len: max,
            })
        }),
        catalog().prop_map(Message::CatalogUpdate),
        load_window().prop_map(Message::LoadWindow),
        topology().prop_map(Message::TopologyUpdate),
        pool_frame().prop_map(Message::PoolFrame),
        (code(ErrorReason::from_code), text())
            .prop_map(|(reason, message)| Message::Error(ErrorMessage { reason, message })),
    ]
}
