//! Operator-supplied identity: [`ExplicitIdentityMap`] and [`IndexerIdentitySpec`].
//!
//! An explicit map replaces the default digest material (model source path, endpoint
//! triple) so that pools in different places can deliberately share an identity.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

/// Most entries an [`ExplicitIdentityMap`] may hold.
pub const MAX_IDENTITY_MAP_ENTRIES: usize = 32;

/// Longest key of an [`ExplicitIdentityMap`], in UTF-8 bytes.
pub const MAX_IDENTITY_KEY_BYTES: usize = 128;

/// Longest value of an [`ExplicitIdentityMap`], in UTF-8 bytes.
pub const MAX_IDENTITY_VALUE_BYTES: usize = 1024;

/// Why an explicit identity map was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityMapError {
    /// The map has no entries.
    #[error("explicit identity map must not be empty")]
    Empty,
    /// The map has more than [`MAX_IDENTITY_MAP_ENTRIES`] entries.
    #[error("explicit identity map has {n_entries} entries, at most {max} allowed")]
    TooManyEntries {
        /// Number of entries given.
        n_entries: usize,
        /// The limit.
        max: usize,
    },
    /// A key is the empty string.
    #[error("explicit identity map key must not be empty")]
    EmptyKey,
    /// A value is the empty string.
    #[error("explicit identity map value for key {key:?} must not be empty")]
    EmptyValue {
        /// The key whose value is empty.
        key: String,
    },
    /// A key is longer than [`MAX_IDENTITY_KEY_BYTES`].
    #[error("explicit identity map key {key:?} is {len} bytes, at most {max} allowed")]
    KeyTooLong {
        /// The offending key.
        key: String,
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// A value is longer than [`MAX_IDENTITY_VALUE_BYTES`].
    #[error("explicit identity map value for key {key:?} is {len} bytes, at most {max} allowed")]
    ValueTooLong {
        /// The key whose value is too long.
        key: String,
        /// The value's length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// The same key was given twice.
    #[error("explicit identity map key {key:?} appears more than once")]
    DuplicateKey {
        /// The repeated key.
        key: String,
    },
}

/// A validated, key-sorted string→string map that replaces default digest material.
///
/// Invariants: 1..=[`MAX_IDENTITY_MAP_ENTRIES`] entries; keys 1..=[`MAX_IDENTITY_KEY_BYTES`]
/// bytes; values 1..=[`MAX_IDENTITY_VALUE_BYTES`] bytes; no duplicate keys (deserialising
/// a JSON object with a repeated key fails). Serialises as a JSON object.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct ExplicitIdentityMap {
    entries: BTreeMap<String, String>,
}

impl ExplicitIdentityMap {
    /// Validates `entries` (in any order) into a map; a repeated key is an error.
    ///
    /// ```
    /// use kvrelay_identity::ExplicitIdentityMap;
    /// let map = ExplicitIdentityMap::from_pairs([("weights", "revision-a")]).unwrap();
    /// assert_eq!(map.get("weights"), Some("revision-a"));
    /// ```
    pub fn from_pairs<'a>(
        entries: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, IdentityMapError> {
        Self::from_owned_pairs(
            entries
                .into_iter()
                .map(|(key, value)| (key.to_owned(), value.to_owned())),
        )
    }

    /// Validates an already key-unique map.
    pub fn new(entries: BTreeMap<String, String>) -> Result<Self, IdentityMapError> {
        validate(&entries)?;
        Ok(Self { entries })
    }

    /// The number of entries (at least 1).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Always false: an explicit map is never empty. Present for API symmetry.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The value stored for `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.entries.get(key).map(String::as_str)
    }

    /// Entries in ascending key order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &str)> {
        self.entries
            .iter()
            .map(|(key, value)| (key.as_str(), value.as_str()))
    }

    fn from_owned_pairs(
        pairs: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self, IdentityMapError> {
        let mut entries = BTreeMap::new();
        for (key, value) in pairs {
            if entries.contains_key(&key) {
                return Err(IdentityMapError::DuplicateKey { key });
            }
            entries.insert(key, value);
        }
        Self::new(entries)
    }
}

impl TryFrom<BTreeMap<String, String>> for ExplicitIdentityMap {
    type Error = IdentityMapError;

    fn try_from(entries: BTreeMap<String, String>) -> Result<Self, Self::Error> {
        Self::new(entries)
    }
}

impl<'de> Deserialize<'de> for ExplicitIdentityMap {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct MapVisitor;

        impl<'de> Visitor<'de> for MapVisitor {
            type Value = ExplicitIdentityMap;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map of string keys to string values")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
                let mut entries = BTreeMap::new();
                let mut n_entries = 0usize;
                while let Some(key) = access.next_key::<String>()? {
                    n_entries += 1;
                    if n_entries > MAX_IDENTITY_MAP_ENTRIES {
                        // Count the rest without keeping it, so the bound holds.
                        access.next_value::<serde::de::IgnoredAny>()?;
                        continue;
                    }
                    let value = access.next_value::<String>()?;
                    if entries.contains_key(&key) {
                        let err = IdentityMapError::DuplicateKey { key };
                        return Err(serde::de::Error::custom(err));
                    }
                    entries.insert(key, value);
                }
                if n_entries > MAX_IDENTITY_MAP_ENTRIES {
                    let err = IdentityMapError::TooManyEntries {
                        n_entries,
                        max: MAX_IDENTITY_MAP_ENTRIES,
                    };
                    return Err(serde::de::Error::custom(err));
                }
                ExplicitIdentityMap::new(entries).map_err(serde::de::Error::custom)
            }
        }

        deserializer.deserialize_map(MapVisitor)
    }
}

/// Optional explicit identity for each digest axis of an indexer domain.
///
/// A missing axis falls back to the default material. JSON fields are omitted when absent;
/// unknown fields are ignored, as in the reference, so newer cards still parse.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IndexerIdentitySpec {
    /// Replaces the model source path in the cache-semantics digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub semantics: Option<ExplicitIdentityMap>,
    /// Replaces the endpoint triple in the routing-scope digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing_scope: Option<ExplicitIdentityMap>,
}

impl IndexerIdentitySpec {
    /// Whether both axes use the defaults.
    pub fn is_empty(&self) -> bool {
        self.semantics.is_none() && self.routing_scope.is_none()
    }
}

fn validate(entries: &BTreeMap<String, String>) -> Result<(), IdentityMapError> {
    if entries.is_empty() {
        return Err(IdentityMapError::Empty);
    }
    if entries.len() > MAX_IDENTITY_MAP_ENTRIES {
        return Err(IdentityMapError::TooManyEntries {
            n_entries: entries.len(),
            max: MAX_IDENTITY_MAP_ENTRIES,
        });
    }
    for (key, value) in entries {
        if key.is_empty() {
            return Err(IdentityMapError::EmptyKey);
        }
        if key.len() > MAX_IDENTITY_KEY_BYTES {
            return Err(IdentityMapError::KeyTooLong {
                key: key.clone(),
                len: key.len(),
                max: MAX_IDENTITY_KEY_BYTES,
            });
        }
        if value.is_empty() {
            return Err(IdentityMapError::EmptyValue { key: key.clone() });
        }
        if value.len() > MAX_IDENTITY_VALUE_BYTES {
            return Err(IdentityMapError::ValueTooLong {
                key: key.clone(),
                len: value.len(),
                max: MAX_IDENTITY_VALUE_BYTES,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(pairs: &[(&str, &str)], expected: Result<(), IdentityMapError>) {
        let got = ExplicitIdentityMap::from_pairs(pairs.iter().copied()).map(|_| ());
        assert_eq!(got, expected, "pairs {pairs:?}");
    }

    #[test]
    fn empty_map_is_rejected() {
        check(&[], Err(IdentityMapError::Empty));
    }

    #[test]
    fn thirty_two_entries_are_accepted_and_thirty_three_rejected() {
        let keys: Vec<String> = (0..33).map(|idx| format!("k{idx}")).collect();
        let pairs: Vec<(&str, &str)> = keys.iter().map(|key| (key.as_str(), "v")).collect();
        check(&pairs[..32], Ok(()));
        check(
            &pairs,
            Err(IdentityMapError::TooManyEntries {
                n_entries: 33,
                max: 32,
            }),
        );
    }

    #[test]
    fn empty_key_is_rejected() {
        check(&[("", "v")], Err(IdentityMapError::EmptyKey));
    }

    #[test]
    fn empty_value_is_rejected_naming_the_key() {
        check(
            &[("weights", "")],
            Err(IdentityMapError::EmptyValue {
                key: "weights".to_owned(),
            }),
        );
    }

    #[test]
    fn key_of_128_bytes_is_accepted_and_129_rejected() {
        let long = "k".repeat(129);
        check(&[(&long[..128], "v")], Ok(()));
        check(
            &[(&long, "v")],
            Err(IdentityMapError::KeyTooLong {
                key: long.clone(),
                len: 129,
                max: 128,
            }),
        );
    }

    #[test]
    fn value_of_1024_bytes_is_accepted_and_1025_rejected() {
        let long = "v".repeat(1025);
        check(&[("k", &long[..1024])], Ok(()));
        check(
            &[("k", &long)],
            Err(IdentityMapError::ValueTooLong {
                key: "k".to_owned(),
                len: 1025,
                max: 1024,
            }),
        );
    }

    #[test]
    fn repeated_key_in_pairs_is_rejected() {
        check(
            &[("a", "1"), ("a", "2")],
            Err(IdentityMapError::DuplicateKey {
                key: "a".to_owned(),
            }),
        );
    }

    #[test]
    fn deserialising_rejects_duplicate_json_keys() {
        let err = serde_json::from_str::<ExplicitIdentityMap>(r#"{"a":"1","a":"2"}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"a\" appears more than once"), "{err}");
    }

    #[test]
    fn deserialising_revalidates_entries() {
        let err = serde_json::from_str::<ExplicitIdentityMap>(r#"{"a":""}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("must not be empty"), "{err}");
        assert!(serde_json::from_str::<ExplicitIdentityMap>("{}").is_err());
    }

    #[test]
    fn deserialising_counts_every_entry_past_the_limit() {
        let body: Vec<String> = (0..40).map(|idx| format!("\"k{idx}\":\"v\"")).collect();
        let json = format!("{{{}}}", body.join(","));
        let err = serde_json::from_str::<ExplicitIdentityMap>(&json)
            .unwrap_err()
            .to_string();
        assert!(err.contains("has 40 entries, at most 32"), "{err}");
    }

    #[test]
    fn entries_iterate_in_key_order() {
        let map = ExplicitIdentityMap::from_pairs([("b", "2"), ("a", "1")]).unwrap();
        let keys: Vec<&str> = map.iter().map(|(key, _)| key).collect();
        assert_eq!(keys, ["a", "b"]);
        assert_eq!(serde_json::to_string(&map).unwrap(), r#"{"a":"1","b":"2"}"#);
    }

    #[test]
    fn empty_spec_serialises_without_fields() {
        let spec = IndexerIdentitySpec::default();
        assert!(spec.is_empty());
        assert_eq!(serde_json::to_string(&spec).unwrap(), "{}");
        let parsed: IndexerIdentitySpec = serde_json::from_str("{}").unwrap();
        assert_eq!(parsed, spec);
    }

    #[test]
    fn spec_with_one_axis_is_not_empty() {
        let spec: IndexerIdentitySpec =
            serde_json::from_str(r#"{"routing_scope":{"fleet":"global"}}"#).unwrap();
        assert!(!spec.is_empty());
        assert!(spec.semantics.is_none());
    }

    #[test]
    fn spec_ignores_unknown_fields() {
        let spec: IndexerIdentitySpec =
            serde_json::from_str(r#"{"future":1,"semantics":{"a":"b"}}"#).unwrap();
        assert_eq!(spec.semantics.unwrap().get("a"), Some("b"));
    }
}
