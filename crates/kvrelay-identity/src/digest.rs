//! Identity digests: [`IdentitySource`], [`CacheSemanticsId`] and [`RoutingScopeId`].
//!
//! Both ids are the first 16 bytes of a BLAKE3 hash over canonical material (see
//! [`crate::cache_semantics_id`] and [`crate::routing_scope_id`]) plus the source that
//! material came from.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Number of digest bytes kept from the BLAKE3 output.
pub const DIGEST_LEN: usize = 16;

/// Whether a digest came from the default inputs or from an operator's explicit map.
///
/// Ordered `DefaultDerived < Explicit`; serialised as `"default_derived"` / `"explicit"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IdentitySource {
    /// Derived from the defaults: the model source path or the endpoint triple.
    DefaultDerived,
    /// Derived from an operator-supplied [`crate::ExplicitIdentityMap`].
    Explicit,
}

impl IdentitySource {
    /// The compact numeric form: `DefaultDerived` = 0, `Explicit` = 1.
    pub const fn as_u8(self) -> u8 {
        match self {
            Self::DefaultDerived => 0,
            Self::Explicit => 1,
        }
    }

    /// Inverse of [`IdentitySource::as_u8`]; `None` for any other value.
    pub const fn from_u8(value: u8) -> Option<Self> {
        match value {
            0 => Some(Self::DefaultDerived),
            1 => Some(Self::Explicit),
            _ => None,
        }
    }

    /// The snake_case name used by serde.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::DefaultDerived => "default_derived",
            Self::Explicit => "explicit",
        }
    }
}

impl fmt::Display for IdentitySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

macro_rules! digest_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        ///
        /// Ordered by digest bytes, then source. `Display` prints the 32 lowercase hex digits
        /// of the digest (the source is not shown). JSON: `{"digest":[16 integers],"source":..}`.
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        pub struct $name {
            digest: [u8; DIGEST_LEN],
            source: IdentitySource,
        }

        impl $name {
            /// Wraps a digest and the source of its material.
            pub const fn new(digest: [u8; DIGEST_LEN], source: IdentitySource) -> Self {
                Self { digest, source }
            }

            /// The 16 digest bytes.
            pub const fn digest(&self) -> &[u8; DIGEST_LEN] {
                &self.digest
            }

            /// Where the digested material came from.
            pub const fn source(&self) -> IdentitySource {
                self.source
            }

            /// Whether the material was the default one rather than an explicit map.
            pub const fn is_default_derived(&self) -> bool {
                matches!(self.source, IdentitySource::DefaultDerived)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write_hex(f, &self.digest)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({self}, {})", stringify!($name), self.source)
            }
        }
    };
}

digest_id!(
    /// The digest of what makes two pools' cache keys interchangeable: model source (or
    /// explicit semantics map), KV block size and hash-format identity version.
    CacheSemanticsId
);

digest_id!(
    /// The digest of the routing scope a pool serves: the endpoint triple (or explicit
    /// routing-scope map).
    RoutingScopeId
);

/// Writes `bytes` as lowercase hex.
pub(crate) fn write_hex(f: &mut fmt::Formatter<'_>, bytes: &[u8]) -> fmt::Result {
    for byte in bytes {
        write!(f, "{byte:02x}")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_32_lowercase_hex_digits_without_source() {
        let mut digest = [0u8; DIGEST_LEN];
        digest[0] = 0xab;
        digest[15] = 0x01;
        let id = CacheSemanticsId::new(digest, IdentitySource::Explicit);
        assert_eq!(id.to_string(), "ab000000000000000000000000000001");
    }

    #[test]
    fn ordering_compares_digest_before_source() {
        let low = RoutingScopeId::new([0; DIGEST_LEN], IdentitySource::Explicit);
        let high = RoutingScopeId::new([1; DIGEST_LEN], IdentitySource::DefaultDerived);
        assert!(low < high);
        let derived = RoutingScopeId::new([1; DIGEST_LEN], IdentitySource::DefaultDerived);
        let explicit = RoutingScopeId::new([1; DIGEST_LEN], IdentitySource::Explicit);
        assert!(derived < explicit);
    }

    #[test]
    fn source_serialises_snake_case_and_orders_default_first() {
        assert_eq!(
            serde_json::to_string(&IdentitySource::DefaultDerived).unwrap(),
            "\"default_derived\""
        );
        assert_eq!(
            serde_json::to_string(&IdentitySource::Explicit).unwrap(),
            "\"explicit\""
        );
        assert!(IdentitySource::DefaultDerived < IdentitySource::Explicit);
    }

    #[test]
    fn source_compact_form_round_trips() {
        for source in [IdentitySource::DefaultDerived, IdentitySource::Explicit] {
            assert_eq!(IdentitySource::from_u8(source.as_u8()), Some(source));
        }
        assert_eq!(IdentitySource::from_u8(2), None);
    }

    #[test]
    fn digest_serialises_as_integer_array_with_source() {
        let id = CacheSemanticsId::new([7; DIGEST_LEN], IdentitySource::DefaultDerived);
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(
            json,
            r#"{"digest":[7,7,7,7,7,7,7,7,7,7,7,7,7,7,7,7],"source":"default_derived"}"#
        );
        let back: CacheSemanticsId = serde_json::from_str(&json).unwrap();
        assert_eq!(back, id);
    }
}
