//! Canonical identity material: the length-framed, version-tagged bytes that get digested.
//!
//! `framed(x)` is the u32-LE byte length of `x` followed by its bytes; a count is a u32 LE.
//! The selected inputs are either an explicit map (count, then `framed(key) ‖ framed(value)`
//! per entry in key order) or the default strings (count, then `framed(s)` per string).

use crate::digest::{DIGEST_LEN, IdentitySource};
use crate::spec::ExplicitIdentityMap;

/// Tag of cache-semantics material built from the model source.
pub(crate) const CACHE_SEMANTICS_DEFAULT_TAG: &str = "dynamo/indexer-cache-semantics/default/v1";
/// Tag of cache-semantics material built from an explicit map.
pub(crate) const CACHE_SEMANTICS_EXPLICIT_TAG: &str = "dynamo/indexer-cache-semantics/explicit/v1";
/// Tag of routing-scope material built from the endpoint triple.
pub(crate) const ROUTING_SCOPE_DEFAULT_TAG: &str = "dynamo/indexer-routing-scope/default/v1";
/// Tag of routing-scope material built from an explicit map.
pub(crate) const ROUTING_SCOPE_EXPLICIT_TAG: &str = "dynamo/indexer-routing-scope/explicit/v1";

/// The two tags of one digest axis.
#[derive(Debug, Clone, Copy)]
pub(crate) struct AxisTags {
    pub(crate) default: &'static str,
    pub(crate) explicit: &'static str,
}

pub(crate) const CACHE_SEMANTICS_TAGS: AxisTags = AxisTags {
    default: CACHE_SEMANTICS_DEFAULT_TAG,
    explicit: CACHE_SEMANTICS_EXPLICIT_TAG,
};

pub(crate) const ROUTING_SCOPE_TAGS: AxisTags = AxisTags {
    default: ROUTING_SCOPE_DEFAULT_TAG,
    explicit: ROUTING_SCOPE_EXPLICIT_TAG,
};

/// Streams canonical material into BLAKE3.
pub(crate) struct Material {
    hasher: blake3::Hasher,
    source: IdentitySource,
}

impl Material {
    /// Starts material with the axis tag, then the selected inputs: `explicit` when given,
    /// else `defaults` in order.
    pub(crate) fn start(
        tags: AxisTags,
        defaults: &[&str],
        explicit: Option<&ExplicitIdentityMap>,
    ) -> Self {
        let mut material = Self {
            hasher: blake3::Hasher::new(),
            source: IdentitySource::DefaultDerived,
        };
        match explicit {
            Some(map) => {
                material.source = IdentitySource::Explicit;
                material.framed(tags.explicit.as_bytes());
                material.count(map.len());
                for (key, value) in map.iter() {
                    material.framed(key.as_bytes());
                    material.framed(value.as_bytes());
                }
            }
            None => {
                material.framed(tags.default.as_bytes());
                material.count(defaults.len());
                for default in defaults {
                    material.framed(default.as_bytes());
                }
            }
        }
        material
    }

    /// Appends a u32 LE.
    pub(crate) fn u32(&mut self, value: u32) {
        self.hasher.update(&value.to_le_bytes());
    }

    /// Appends a u16 LE.
    pub(crate) fn u16(&mut self, value: u16) {
        self.hasher.update(&value.to_le_bytes());
    }

    /// The first 16 bytes of the BLAKE3 digest, and the material's source.
    pub(crate) fn finish(self) -> ([u8; DIGEST_LEN], IdentitySource) {
        let hash = self.hasher.finalize();
        let mut digest = [0u8; DIGEST_LEN];
        digest.copy_from_slice(&hash.as_bytes()[..DIGEST_LEN]);
        (digest, self.source)
    }

    fn framed(&mut self, bytes: &[u8]) {
        self.count(bytes.len());
        self.hasher.update(bytes);
    }

    fn count(&mut self, n: usize) {
        // Inputs are names and bounded maps; none approaches 4 GiB, so saturation never
        // happens in practice and keeps this function total.
        self.u32(u32::try_from(n).unwrap_or(u32::MAX));
    }
}
