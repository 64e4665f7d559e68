//! [`IndexerDomainId`] and the digests that resolve it.
//!
//! Cache semantics = BLAKE3(framed tag ‖ selected ‖ kv_block_size u32 LE ‖ hash-format
//! identity version u16 LE), first 16 bytes; routing scope = BLAKE3(framed tag ‖ selected),
//! first 16 bytes. See the `material` module for the encoding.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::digest::{CacheSemanticsId, RoutingScopeId};
use crate::endpoint::EndpointId;
use crate::material::{CACHE_SEMANTICS_TAGS, Material, ROUTING_SCOPE_TAGS};
use crate::query::KvQuerySemantics;
use crate::spec::{ExplicitIdentityMap, IndexerIdentitySpec};

/// The identity of an indexer domain: pools in the same domain share cache keys and
/// routing scope. `Display` is `<cache hex>:<routing hex>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct IndexerDomainId {
    /// What makes cache keys interchangeable.
    pub cache_semantics: CacheSemanticsId,
    /// Which routing scope the pools serve.
    pub routing_scope: RoutingScopeId,
}

impl IndexerDomainId {
    /// Whether either digest came from default inputs rather than an explicit map.
    pub const fn relies_on_defaults(&self) -> bool {
        self.cache_semantics.is_default_derived() || self.routing_scope.is_default_derived()
    }
}

impl fmt::Display for IndexerDomainId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.cache_semantics, self.routing_scope)
    }
}

/// The cache-semantics digest of a model.
///
/// `model_source` is the card's source path (the default input); `explicit` replaces it
/// when given. The block size and hash-format identity version are always mixed in.
///
/// ```
/// use kvrelay_identity::{cache_semantics_id, KvQueryHashFormat, KvQuerySemantics};
/// let semantics = KvQuerySemantics::new(512, KvQueryHashFormat::DynamoStandardV1).unwrap();
/// let id = cache_semantics_id("meta/llama", None, semantics);
/// assert_eq!(id.to_string(), "7d31eb9019357572470605f4a8be687e");
/// ```
pub fn cache_semantics_id(
    model_source: &str,
    explicit: Option<&ExplicitIdentityMap>,
    semantics: KvQuerySemantics,
) -> CacheSemanticsId {
    let mut material = Material::start(CACHE_SEMANTICS_TAGS, &[model_source], explicit);
    material.u32(semantics.kv_block_size());
    material.u16(semantics.hash_format().identity_version());
    let (digest, source) = material.finish();
    CacheSemanticsId::new(digest, source)
}

/// The routing-scope digest of a serving endpoint.
///
/// The default input is the triple `[namespace, component, name]`; `explicit` replaces it.
///
/// ```
/// use kvrelay_identity::{routing_scope_id, EndpointId};
/// let endpoint = EndpointId::new("prod", "router", "generate").unwrap();
/// let id = routing_scope_id(&endpoint, None);
/// assert_eq!(id.to_string(), "18270d3ba03effaec8d167ba02c7752d");
/// ```
pub fn routing_scope_id(
    endpoint: &EndpointId,
    explicit: Option<&ExplicitIdentityMap>,
) -> RoutingScopeId {
    let defaults = [endpoint.namespace(), endpoint.component(), endpoint.name()];
    let (digest, source) = Material::start(ROUTING_SCOPE_TAGS, &defaults, explicit).finish();
    RoutingScopeId::new(digest, source)
}

/// Resolves the indexer domain of a model served at `endpoint`.
///
/// Two endpoints with the same explicit maps on both axes resolve to the same domain; the
/// card's display name is never an input.
pub fn resolve_indexer_domain(
    model_source: &str,
    spec: &IndexerIdentitySpec,
    semantics: KvQuerySemantics,
    endpoint: &EndpointId,
) -> IndexerDomainId {
    IndexerDomainId {
        cache_semantics: cache_semantics_id(model_source, spec.semantics.as_ref(), semantics),
        routing_scope: routing_scope_id(endpoint, spec.routing_scope.as_ref()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest::IdentitySource;
    use crate::material::Material;
    use crate::query::KvQueryHashFormat;

    fn standard(block_size: u32) -> KvQuerySemantics {
        KvQuerySemantics::new(block_size, KvQueryHashFormat::DynamoStandardV1).unwrap()
    }

    #[test]
    fn length_framing_separates_shifted_boundaries() {
        let split_late = Material::start(CACHE_SEMANTICS_TAGS, &["ab", "c"], None).finish();
        let split_early = Material::start(CACHE_SEMANTICS_TAGS, &["a", "bc"], None).finish();
        assert_ne!(split_late, split_early);
    }

    #[test]
    fn block_size_and_format_always_enter_cache_semantics() {
        let map = ExplicitIdentityMap::from_pairs([("weights", "r")]).unwrap();
        for explicit in [None, Some(&map)] {
            let base = cache_semantics_id("m", explicit, standard(16));
            assert_ne!(base, cache_semantics_id("m", explicit, standard(32)));
            let eagle = KvQuerySemantics::new(16, KvQueryHashFormat::DynamoEagleV1).unwrap();
            assert_ne!(base, cache_semantics_id("m", explicit, eagle));
        }
    }

    #[test]
    fn explicit_map_marks_the_source() {
        let map = ExplicitIdentityMap::from_pairs([("weights", "r")]).unwrap();
        let id = cache_semantics_id("m", Some(&map), standard(16));
        assert_eq!(id.source(), IdentitySource::Explicit);
        let id = cache_semantics_id("m", None, standard(16));
        assert_eq!(id.source(), IdentitySource::DefaultDerived);
    }

    #[test]
    fn domain_display_joins_digests_with_a_colon() {
        let endpoint = EndpointId::new("prod", "router", "generate").unwrap();
        let domain = resolve_indexer_domain(
            "meta/llama",
            &IndexerIdentitySpec::default(),
            standard(512),
            &endpoint,
        );
        assert_eq!(
            domain.to_string(),
            "7d31eb9019357572470605f4a8be687e:18270d3ba03effaec8d167ba02c7752d"
        );
    }
}
