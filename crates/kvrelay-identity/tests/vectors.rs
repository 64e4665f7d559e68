//! Reference vectors: hashing (`vectors/hashing.json`, a copy of the shared vectors) and
//! the identity digests of spec §1.2, §2 and §8.

#![allow(
    clippy::unwrap_used,
    clippy::panic,
    reason = "test helpers fail the test on bad fixtures"
)]

use kvrelay_identity::hashing::{HashSalt, XXH3_SEED, block_hashes, sequence_hashes};
use kvrelay_identity::{
    DcId, EndpointId, ExplicitIdentityMap, IdentitySource, IndexerIdentitySpec, KvQueryHashFormat,
    KvQuerySemantics, cache_semantics_id, resolve_indexer_domain, routing_scope_id,
};
use serde::Deserialize;

const HASHING_JSON: &str = include_str!("vectors/hashing.json");

#[derive(Deserialize)]
struct Vectors {
    hashing: Vec<HashingVector>,
    dc_id: Vec<DcIdVector>,
}

#[derive(Deserialize)]
struct HashingVector {
    tokens: Vec<u32>,
    block_size: u32,
    format: String,
    lora: Option<String>,
    namespace: Option<String>,
    block_hashes: Vec<u64>,
    sequence_hashes: Vec<u64>,
}

#[derive(Deserialize)]
struct DcIdVector {
    text: String,
    dc_id: u64,
}

fn vectors() -> Vectors {
    serde_json::from_str(HASHING_JSON).unwrap()
}

fn format_named(name: &str) -> KvQueryHashFormat {
    match name {
        "standard" => KvQueryHashFormat::DynamoStandardV1,
        "eagle" => KvQueryHashFormat::DynamoEagleV1,
        other => panic!("unknown format {other:?} in vectors"),
    }
}

fn standard(block_size: u32) -> KvQuerySemantics {
    KvQuerySemantics::new(block_size, KvQueryHashFormat::DynamoStandardV1).unwrap()
}

fn prod_router_generate() -> EndpointId {
    EndpointId::new("prod", "router", "generate").unwrap()
}

#[test]
fn every_hashing_vector_reproduces() {
    let vectors = vectors();
    assert!(!vectors.hashing.is_empty());
    for (idx, vector) in vectors.hashing.iter().enumerate() {
        let salt = HashSalt {
            lora_name: vector.lora.as_deref(),
            cache_namespace: vector.namespace.as_deref(),
        };
        let blocks = block_hashes(
            &vector.tokens,
            vector.block_size,
            format_named(&vector.format),
            salt,
        );
        assert_eq!(blocks, vector.block_hashes, "block hashes of vector {idx}");
        assert_eq!(
            sequence_hashes(&blocks),
            vector.sequence_hashes,
            "sequence hashes of vector {idx}"
        );
    }
}

#[test]
fn every_dc_id_vector_reproduces() {
    let vectors = vectors();
    assert!(!vectors.dc_id.is_empty());
    for vector in &vectors.dc_id {
        assert_eq!(
            DcId::from_dc_name(&vector.text),
            DcId(vector.dc_id),
            "dc id of {:?}",
            vector.text
        );
    }
}

// spec: compute_block_hash test data vector
#[test]
fn xxh3_of_test_data_with_seed_1337_matches_reference() {
    let hash = xxhash_rust::xxh3::xxh3_64_with_seed(b"test data", XXH3_SEED);
    assert_eq!(hash, 13_226_331_709_069_118_873);
}

#[test]
fn lora_salt_matches_reference() {
    let salt = HashSalt {
        lora_name: Some("adapter-a"),
        cache_namespace: None,
    };
    assert_eq!(salt.seed(), 8_842_669_519_798_868_182);
}

#[test]
fn namespace_salt_matches_reference() {
    let salt = HashSalt {
        lora_name: None,
        cache_namespace: Some("tenant-a"),
    };
    assert_eq!(salt.seed(), 1_948_188_790_972_764_086);
}

#[test]
fn empty_salt_strings_count_as_absent() {
    let salt = HashSalt {
        lora_name: Some(""),
        cache_namespace: Some(""),
    };
    assert_eq!(salt.seed(), XXH3_SEED);
}

// spec: resolve_indexer_domain golden vector
#[test]
fn default_domain_matches_reference_golden_vector() {
    let domain = resolve_indexer_domain(
        "meta/llama",
        &IndexerIdentitySpec::default(),
        standard(512),
        &prod_router_generate(),
    );
    assert_eq!(
        domain.cache_semantics.to_string(),
        "7d31eb9019357572470605f4a8be687e"
    );
    assert_eq!(
        domain.routing_scope.to_string(),
        "18270d3ba03effaec8d167ba02c7752d"
    );
    assert_eq!(
        domain.cache_semantics.source(),
        IdentitySource::DefaultDerived
    );
    assert_eq!(
        domain.routing_scope.source(),
        IdentitySource::DefaultDerived
    );
    assert!(domain.relies_on_defaults());
}

#[test]
fn eagle_format_cache_semantics_matches_derived_vector() {
    let semantics = KvQuerySemantics::new(512, KvQueryHashFormat::DynamoEagleV1).unwrap();
    let id = cache_semantics_id("meta/llama", None, semantics);
    assert_eq!(id.to_string(), "deae03cf69f6e4a47cbec26ceba95354");
}

#[test]
fn block_size_64_cache_semantics_matches_derived_vector() {
    let id = cache_semantics_id("meta/llama", None, standard(64));
    assert_eq!(id.to_string(), "e7b20757355a7f4395af8e9d432d2e1c");
}

#[test]
fn explicit_semantics_matches_derived_vector() {
    let map = ExplicitIdentityMap::from_pairs([("weights", "revision-a")]).unwrap();
    let id = cache_semantics_id("meta/llama", Some(&map), standard(512));
    assert_eq!(id.to_string(), "0589b215f8e7d8eb601b0c98444c03be");
    assert_eq!(id.source(), IdentitySource::Explicit);
}

#[test]
fn explicit_semantics_ignores_the_model_source() {
    let map = ExplicitIdentityMap::from_pairs([("weights", "revision-a")]).unwrap();
    assert_eq!(
        cache_semantics_id("meta/llama", Some(&map), standard(512)),
        cache_semantics_id("other/model", Some(&map), standard(512))
    );
}

#[test]
fn explicit_maps_on_both_axes_federate_different_endpoints() {
    let spec = IndexerIdentitySpec {
        semantics: Some(ExplicitIdentityMap::from_pairs([("weights", "r1")]).unwrap()),
        routing_scope: Some(ExplicitIdentityMap::from_pairs([("fleet", "global")]).unwrap()),
    };
    let east = EndpointId::new("east", "backend", "generate").unwrap();
    let west = EndpointId::new("west", "worker", "generate").unwrap();
    let a = resolve_indexer_domain("a/model", &spec, standard(16), &east);
    let b = resolve_indexer_domain("b/model", &spec, standard(16), &west);
    assert_eq!(a, b);
    assert!(!a.relies_on_defaults());
}

#[test]
fn routing_scope_depends_on_every_endpoint_part() {
    let base = routing_scope_id(&prod_router_generate(), None);
    for other in [
        EndpointId::new("dev", "router", "generate").unwrap(),
        EndpointId::new("prod", "worker", "generate").unwrap(),
        EndpointId::new("prod", "router", "clear").unwrap(),
    ] {
        assert_ne!(routing_scope_id(&other, None), base, "{other}");
    }
}

#[test]
fn default_and_explicit_routing_material_never_collide() {
    // An explicit map whose framed entries resemble the default triple still differs,
    // because the material tags differ.
    let map = ExplicitIdentityMap::from_pairs([("prod", "router")]).unwrap();
    let endpoint = prod_router_generate();
    assert_ne!(
        routing_scope_id(&endpoint, Some(&map)).digest(),
        routing_scope_id(&endpoint, None).digest()
    );
}
