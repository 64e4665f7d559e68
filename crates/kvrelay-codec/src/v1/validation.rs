//! Validation errors of decoded messages, split into malformed and unsupported.
//!
//! Validation reads a decoded message and never changes it or anything else. A
//! *malformed* value breaks a rule of this protocol version (the sender is broken); an
//! *unsupported* value is well formed for some newer version (an unknown enum code, identity
//! version or filter format), so a consumer quarantines just the entry that carries it.

use std::collections::BTreeSet;

use super::code::WorkerRole;

/// Why a decoded value is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ValidationError {
    /// An enum field carries an unknown code (unsupported).
    #[error("{field}: code {code} is not supported")]
    UnsupportedCode {
        /// The field.
        field: &'static str,
        /// The code.
        code: u32,
    },
    /// A version field names a version this codec does not speak (unsupported).
    #[error("{field}: version {version} is not supported")]
    UnsupportedVersion {
        /// The field.
        field: &'static str,
        /// The version.
        version: u32,
    },
    /// A filter format this codec does not speak (unsupported).
    #[error(
        "ckf format version {format_version} with {fingerprint_bits}-bit fingerprints and {slots_per_bucket} slots is not supported"
    )]
    UnsupportedFormat {
        /// Format version.
        format_version: u32,
        /// Fingerprint bits.
        fingerprint_bits: u32,
        /// Slots per bucket.
        slots_per_bucket: u32,
    },
    /// An enum or version field is 0 (unspecified).
    #[error("{field}: value is unspecified (0)")]
    Unspecified {
        /// The field.
        field: &'static str,
    },
    /// A text field is empty.
    #[error("{field}: must not be empty")]
    EmptyText {
        /// The field.
        field: &'static str,
    },
    /// A text field has leading or trailing whitespace.
    #[error("{field}: {value:?} has leading or trailing whitespace")]
    SurroundingWhitespace {
        /// The field.
        field: &'static str,
        /// The value.
        value: String,
    },
    /// A text field holds a control character.
    #[error("{field}: {value:?} contains a control character")]
    ControlCharacter {
        /// The field.
        field: &'static str,
        /// The value.
        value: String,
    },
    /// A text field is too long.
    #[error("{field}: length {len} bytes exceeds {max}")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// A bucket count that is not a power of two in `2..=2^24` (format 1).
    #[error("ckf bucket count {bucket_count} is not a power of two in 2..=16777216")]
    InvalidBucketCount {
        /// The bucket count.
        bucket_count: u64,
    },
    /// A producer with layout generation 0.
    #[error("producer layout_generation is 0")]
    ZeroLayoutGeneration,
    /// Query semantics with a zero block size.
    #[error("query_semantics.kv_block_size is 0")]
    ZeroBlockSize,
    /// A role list that must not be empty is empty.
    #[error("{field}: role list is empty")]
    EmptyRoles {
        /// The field.
        field: &'static str,
    },
    /// A role appears twice in one list.
    #[error("{field}: role {role} appears twice")]
    DuplicateRole {
        /// The field.
        field: &'static str,
        /// The repeated role.
        role: WorkerRole,
    },
    /// A role that is not allowed in this list.
    #[error("{field}: role {role} is not allowed here")]
    RoleNotAllowed {
        /// The field.
        field: &'static str,
        /// The role.
        role: WorkerRole,
    },
    /// A pool descriptor without registrations.
    #[error("pool has no model registrations")]
    NoRegistrations,
    /// Two registrations of one model in one pool.
    #[error("model {model:?} is registered twice in one pool")]
    DuplicateModel {
        /// The model.
        model: String,
    },
    /// An alias that collides with a model or another model's alias in one pool.
    #[error("alias {alias:?} collides with another model or alias in the pool")]
    AliasCollision {
        /// The alias.
        alias: String,
    },
    /// The same key twice in a complete collection.
    #[error("{field}: entry {key} appears twice")]
    DuplicateEntry {
        /// The collection.
        field: &'static str,
        /// The repeated key, displayed.
        key: String,
    },
    /// A catalog's coverage names a pool the catalog does not list.
    #[error("coverage names pool {pool}, which the catalog does not list")]
    CoverageOfUnlistedPool {
        /// The pool, displayed.
        pool: String,
    },
    /// A coverage list with more entries than the catalog has pools: some entry must
    /// repeat a pool or name an unlisted one.
    #[error("coverage has {coverage} entries for {pools} pools")]
    CoverageLongerThanPools {
        /// Coverage entries sent.
        coverage: usize,
        /// Pools listed.
        pools: usize,
    },
    /// A pool named as stalled (withheld) that the catalog also lists.
    #[error("stalled pool {pool} is also listed in the catalog")]
    StalledPoolListed {
        /// The pool id.
        pool: String,
    },
    /// A tier lane of a pool the catalog does not list, or a lane that is not usable for
    /// its pool (block size not a positive multiple of the pool's, or the lane's producer
    /// names a listed pool).
    #[error("tier lane of pool {pool}: {detail}")]
    InvalidTierLane {
        /// The pool, displayed.
        pool: String,
        /// What is wrong.
        detail: &'static str,
    },
    /// A coverage share above 100 percent.
    #[error("coverage: unroutable_percent {percent} is above 100")]
    CoverageShare {
        /// The share sent.
        percent: u8,
    },
    /// Counters that contradict each other.
    #[error("{field}: {detail}")]
    Inconsistent {
        /// The field.
        field: &'static str,
        /// What contradicts what, with values.
        detail: String,
    },
}

impl ValidationError {
    /// True for values a newer protocol version may send (quarantine the entry), false for
    /// malformed values (the sender is broken).
    pub fn is_unsupported(&self) -> bool {
        matches!(
            self,
            ValidationError::UnsupportedCode { .. }
                | ValidationError::UnsupportedVersion { .. }
                | ValidationError::UnsupportedFormat { .. }
        )
    }
}

/// An entry of a complete collection that failed validation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{collection}[{index}]: {error}")]
pub struct EntryError {
    /// The collection (`pools`, `entries`).
    pub collection: &'static str,
    /// The entry's index in the message.
    pub index: usize,
    /// Why.
    pub error: ValidationError,
}

/// The verdict on a complete collection (catalog pools, load pools, topology entries):
/// malformed data fails the whole message, unsupported entries are listed for quarantine.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CollectionCheck {
    /// Indices of the entries that passed, in message order.
    pub accepted: Vec<usize>,
    /// Unsupported entries: index and reason.
    pub quarantined: Vec<EntryError>,
}

/// Runs `check` on every entry: the first malformed entry fails the whole collection,
/// unsupported ones are quarantined.
pub(crate) fn check_collection<T>(
    collection: &'static str,
    entries: &[T],
    check: impl Fn(&T) -> Result<(), ValidationError>,
) -> Result<CollectionCheck, EntryError> {
    let mut verdict = CollectionCheck::default();
    for (index, entry) in entries.iter().enumerate() {
        match check(entry) {
            Ok(()) => verdict.accepted.push(index),
            Err(error) => {
                let entry_error = EntryError {
                    collection,
                    index,
                    error,
                };
                if !entry_error.error.is_unsupported() {
                    return Err(entry_error);
                }
                verdict.quarantined.push(entry_error);
            }
        }
    }
    Ok(verdict)
}

/// The index and key of the first key that repeats an earlier one (`O(n log n)`, so a
/// hostile collection cannot make validation quadratic).
pub(crate) fn first_duplicate<K: Ord>(keys: impl IntoIterator<Item = K>) -> Option<(usize, K)> {
    let mut seen = BTreeSet::new();
    for (index, key) in keys.into_iter().enumerate() {
        if seen.contains(&key) {
            return Some((index, key));
        }
        seen.insert(key);
    }
    None
}

/// A name: non-empty, no leading or trailing whitespace.
pub(crate) fn check_name(field: &'static str, value: &str) -> Result<(), ValidationError> {
    if value.is_empty() {
        return Err(ValidationError::EmptyText { field });
    }
    if value.trim() != value {
        return Err(ValidationError::SurroundingWhitespace {
            field,
            value: value.to_owned(),
        });
    }
    Ok(())
}

/// A label: non-empty, at most `max` bytes, no control characters.
pub(crate) fn check_label(
    field: &'static str,
    value: &str,
    max: usize,
) -> Result<(), ValidationError> {
    if value.is_empty() {
        return Err(ValidationError::EmptyText { field });
    }
    if value.len() > max {
        return Err(ValidationError::TooLong {
            field,
            len: value.len(),
            max,
        });
    }
    if value.chars().any(char::is_control) {
        return Err(ValidationError::ControlCharacter {
            field,
            value: value.to_owned(),
        });
    }
    Ok(())
}

/// Every role known and listed once; unknown roles are unsupported.
pub(crate) fn check_roles(
    field: &'static str,
    roles: &[WorkerRole],
) -> Result<(), ValidationError> {
    for (at, role) in roles.iter().enumerate() {
        role.check(field)?;
        if roles[..at].contains(role) {
            return Err(ValidationError::DuplicateRole { field, role: *role });
        }
    }
    Ok(())
}
