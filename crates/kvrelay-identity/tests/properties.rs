//! Property tests: serde round-trips of every identity type, digest properties, and
//! prefix-stability of token hashing.

#![allow(
    clippy::unwrap_used,
    reason = "strategies only build values that satisfy the constructors"
)]

use std::fmt::Debug;

use kvrelay_identity::hashing::{HashSalt, block_hashes, sequence_hashes};
use kvrelay_identity::{
    CacheSemanticsId, CanonicalModelId, CanonicalModelRegistration, CkfFormat, DcId,
    DcRelayIdentity, EndpointId, ExplicitIdentityMap, IdentitySource, IndexerDomainId,
    IndexerIdentitySpec, KvQueryHashFormat, KvQuerySemantics, MAX_CKF_BUCKET_COUNT, ModelAlias,
    ModelTarget, PoolId, ProducerIdentity, RoutingScopeId, WorkerRole, cache_semantics_id,
    routing_scope_id,
};
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use serde::Serialize;
use serde::de::DeserializeOwned;

fn config() -> ProptestConfig {
    ProptestConfig {
        cases: 64,
        ..ProptestConfig::default()
    }
}

fn assert_json_round_trip<T>(value: &T)
where
    T: Serialize + DeserializeOwned + PartialEq + Debug,
{
    let json = serde_json::to_string(value).unwrap();
    let back: T = serde_json::from_str(&json).unwrap();
    assert_eq!(&back, value, "json {json}");
}

/// A name: non-empty, no surrounding whitespace, may contain interior spaces.
fn name() -> impl Strategy<Value = String> {
    "[a-zA-Z0-9_:@-][a-zA-Z0-9 _:@.-]{0,14}[a-zA-Z0-9_:@-]|[a-zA-Z0-9]"
}

/// An endpoint part without separators, so Display parses back.
fn endpoint_part() -> impl Strategy<Value = String> {
    "[a-z0-9-]{1,10}"
}

fn source() -> impl Strategy<Value = IdentitySource> {
    prop_oneof![
        Just(IdentitySource::DefaultDerived),
        Just(IdentitySource::Explicit)
    ]
}

fn cache_semantics() -> impl Strategy<Value = CacheSemanticsId> {
    (any::<[u8; 16]>(), source()).prop_map(|(digest, source)| CacheSemanticsId::new(digest, source))
}

fn routing_scope() -> impl Strategy<Value = RoutingScopeId> {
    (any::<[u8; 16]>(), source()).prop_map(|(digest, source)| RoutingScopeId::new(digest, source))
}

fn domain() -> impl Strategy<Value = IndexerDomainId> {
    (cache_semantics(), routing_scope()).prop_map(|(cache_semantics, routing_scope)| {
        IndexerDomainId {
            cache_semantics,
            routing_scope,
        }
    })
}

fn pool() -> impl Strategy<Value = PoolId> {
    (domain(), any::<u64>()).prop_map(|(indexer_domain, dc)| PoolId {
        indexer_domain,
        dc_id: DcId(dc),
    })
}

fn endpoint() -> impl Strategy<Value = EndpointId> {
    (endpoint_part(), endpoint_part(), endpoint_part())
        .prop_map(|(ns, component, name)| EndpointId::new(&ns, &component, &name).unwrap())
}

fn hash_format() -> impl Strategy<Value = KvQueryHashFormat> {
    prop_oneof![
        Just(KvQueryHashFormat::DynamoStandardV1),
        Just(KvQueryHashFormat::DynamoEagleV1)
    ]
}

fn semantics() -> impl Strategy<Value = KvQuerySemantics> {
    (1u32.., hash_format()).prop_map(|(size, format)| KvQuerySemantics::new(size, format).unwrap())
}

fn model_id() -> impl Strategy<Value = CanonicalModelId> {
    name().prop_map(|name| CanonicalModelId::new(&name).unwrap())
}

fn alias() -> impl Strategy<Value = ModelAlias> {
    name().prop_map(|name| ModelAlias::new(&name).unwrap())
}

fn target() -> impl Strategy<Value = ModelTarget> {
    prop_oneof![
        model_id().prop_map(|base_model| ModelTarget::Base { base_model }),
        (model_id(), model_id()).prop_map(|(base_model, adapter)| ModelTarget::Lora {
            base_model,
            adapter
        }),
    ]
}

fn registration() -> impl Strategy<Value = CanonicalModelRegistration> {
    (model_id(), target(), vec(alias(), 0..5)).prop_map(|(model, target, aliases)| {
        CanonicalModelRegistration::new(model, target, aliases)
    })
}

fn identity_map() -> impl Strategy<Value = ExplicitIdentityMap> {
    btree_map("[a-z]{1,8}", "[ -~]{1,16}", 1..6)
        .prop_map(|entries| ExplicitIdentityMap::new(entries).unwrap())
}

fn ckf_format() -> impl Strategy<Value = CkfFormat> {
    let max_shift = MAX_CKF_BUCKET_COUNT.trailing_zeros();
    (any::<u64>(), 1..=max_shift).prop_map(|(seed, shift)| CkfFormat::v1(seed, 1 << shift).unwrap())
}

fn role() -> impl Strategy<Value = WorkerRole> {
    proptest::sample::select(WorkerRole::ALL.to_vec())
}

fn salt_parts() -> impl Strategy<Value = (Option<String>, Option<String>)> {
    (
        proptest::option::of("[a-z-]{0,8}"),
        proptest::option::of("[a-z-]{0,8}"),
    )
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn digest_ids_round_trip_through_json(
        cache in cache_semantics(),
        routing in routing_scope(),
        source in source(),
    ) {
        assert_json_round_trip(&cache);
        assert_json_round_trip(&routing);
        assert_json_round_trip(&source);
    }

    #[test]
    fn pools_and_domains_round_trip_through_json(pool in pool()) {
        assert_json_round_trip(&pool);
        assert_json_round_trip(&pool.indexer_domain);
        assert_json_round_trip(&pool.dc_id);
    }

    #[test]
    fn endpoints_round_trip_through_json_and_display(endpoint in endpoint()) {
        assert_json_round_trip(&endpoint);
        prop_assert_eq!(endpoint.to_string().parse::<EndpointId>().unwrap(), endpoint.clone());
        prop_assert_eq!(endpoint.dotted().parse::<EndpointId>().unwrap(), endpoint);
    }

    #[test]
    fn model_names_round_trip_through_json(
        registration in registration(),
        alias in alias(),
    ) {
        assert_json_round_trip(&registration);
        assert_json_round_trip(registration.model());
        assert_json_round_trip(registration.target());
        assert_json_round_trip(&alias);
    }

    #[test]
    fn registrations_stay_normalised(registration in registration()) {
        let aliases = registration.aliases();
        prop_assert!(aliases.windows(2).all(|pair| pair[0] < pair[1]));
        prop_assert!(aliases.iter().all(|a| a.as_str() != registration.model().as_str()));
    }

    #[test]
    fn query_types_round_trip_through_json(semantics in semantics(), role in role()) {
        assert_json_round_trip(&semantics);
        assert_json_round_trip(&semantics.hash_format());
        assert_json_round_trip(&role);
    }

    #[test]
    fn producer_types_round_trip_through_json(
        pool in pool(),
        incarnation in any::<u64>(),
        generation in 1u64..,
        format in ckf_format(),
        drt in any::<u64>(),
    ) {
        let producer = ProducerIdentity::new(pool, incarnation, generation, format).unwrap();
        assert_json_round_trip(&producer);
        assert_json_round_trip(&format);
        assert_json_round_trip(&DcRelayIdentity::new(drt, incarnation));
    }

    #[test]
    fn identity_specs_round_trip_through_json(
        semantics in proptest::option::of(identity_map()),
        routing_scope in proptest::option::of(identity_map()),
    ) {
        let spec = IndexerIdentitySpec { semantics, routing_scope };
        assert_json_round_trip(&spec);
    }

    #[test]
    fn explicit_maps_are_order_independent(
        entries in btree_map("[a-z]{1,6}", "[a-z0-9]{1,6}", 1..8),
        semantics in semantics(),
        endpoint in endpoint(),
    ) {
        let forward: Vec<(&str, &str)> =
            entries.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
        let mut backward = forward.clone();
        backward.reverse();
        let a = ExplicitIdentityMap::from_pairs(forward).unwrap();
        let b = ExplicitIdentityMap::from_pairs(backward).unwrap();
        prop_assert_eq!(
            cache_semantics_id("m", Some(&a), semantics),
            cache_semantics_id("m", Some(&b), semantics)
        );
        prop_assert_eq!(
            routing_scope_id(&endpoint, Some(&a)),
            routing_scope_id(&endpoint, Some(&b))
        );
    }

    #[test]
    fn framing_separates_shifted_endpoint_boundaries(
        text in "[a-z]{3,12}",
        cut_a in 1usize..12,
        cut_b in 1usize..12,
        name in endpoint_part(),
    ) {
        let len = text.len();
        let (cut_a, cut_b) = (1 + cut_a % (len - 1), 1 + cut_b % (len - 1));
        prop_assume!(cut_a != cut_b);
        let a = EndpointId::new(&text[..cut_a], &text[cut_a..], &name).unwrap();
        let b = EndpointId::new(&text[..cut_b], &text[cut_b..], &name).unwrap();
        prop_assert_ne!(routing_scope_id(&a, None), routing_scope_id(&b, None));
    }

    #[test]
    fn framing_separates_shifted_map_boundaries(
        text in "[a-z]{3,12}",
        cut_a in 1usize..12,
        cut_b in 1usize..12,
        semantics in semantics(),
    ) {
        let len = text.len();
        let (cut_a, cut_b) = (1 + cut_a % (len - 1), 1 + cut_b % (len - 1));
        prop_assume!(cut_a != cut_b);
        let a = ExplicitIdentityMap::from_pairs([(&text[..cut_a], &text[cut_a..])]).unwrap();
        let b = ExplicitIdentityMap::from_pairs([(&text[..cut_b], &text[cut_b..])]).unwrap();
        prop_assert_ne!(
            cache_semantics_id("m", Some(&a), semantics),
            cache_semantics_id("m", Some(&b), semantics)
        );
    }

    #[test]
    fn explicit_and_default_material_give_different_digests(
        map in identity_map(),
        endpoint in endpoint(),
        semantics in semantics(),
        model_source in name(),
    ) {
        prop_assert_ne!(
            *routing_scope_id(&endpoint, Some(&map)).digest(),
            *routing_scope_id(&endpoint, None).digest()
        );
        prop_assert_ne!(
            *cache_semantics_id(&model_source, Some(&map), semantics).digest(),
            *cache_semantics_id(&model_source, None, semantics).digest()
        );
    }

    #[test]
    fn digest_display_is_32_lowercase_hex(cache in cache_semantics()) {
        let text = cache.to_string();
        prop_assert_eq!(text.len(), 32);
        prop_assert!(text.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    }

    #[test]
    fn dc_id_display_parses_back(dc in any::<u64>()) {
        let dc = DcId(dc);
        prop_assert_eq!(dc.to_string().parse::<DcId>().unwrap(), dc);
    }

    #[test]
    fn hashing_a_prefix_gives_the_prefix_blocks(
        tokens in vec(any::<u32>(), 0..80),
        prefix_len in 0usize..80,
        block_size in 1u32..9,
        format in hash_format(),
        (lora, namespace) in salt_parts(),
    ) {
        let salt = HashSalt { lora_name: lora.as_deref(), cache_namespace: namespace.as_deref() };
        let prefix = &tokens[..prefix_len.min(tokens.len())];
        let full_blocks = block_hashes(&tokens, block_size, format, salt);
        let prefix_blocks = block_hashes(prefix, block_size, format, salt);
        prop_assert!(prefix_blocks.len() <= full_blocks.len());
        prop_assert_eq!(&prefix_blocks[..], &full_blocks[..prefix_blocks.len()]);
        let full_seqs = sequence_hashes(&full_blocks);
        let prefix_seqs = sequence_hashes(&prefix_blocks);
        prop_assert_eq!(&prefix_seqs[..], &full_seqs[..prefix_seqs.len()]);
    }

    #[test]
    fn block_counts_follow_the_window_rules(
        n_tokens in 0usize..100,
        block_size in 1u32..9,
    ) {
        let tokens: Vec<u32> = (0..n_tokens as u32).collect();
        let bs = block_size as usize;
        let standard =
            block_hashes(&tokens, block_size, KvQueryHashFormat::DynamoStandardV1, HashSalt::default());
        let eagle =
            block_hashes(&tokens, block_size, KvQueryHashFormat::DynamoEagleV1, HashSalt::default());
        prop_assert_eq!(standard.len(), n_tokens / bs);
        prop_assert_eq!(eagle.len(), n_tokens.saturating_sub(1) / bs);
    }
}
