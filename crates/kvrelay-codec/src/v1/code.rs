//! Enumerations carried as `u32` codes, so an unknown value decodes and can be judged
//! *unsupported* (quarantined) instead of failing the whole message.
//!
//! Code 0 is "unspecified" and always malformed. In human-readable formats (the JSON of
//! `kvrelay inspect`) a known code is written as its snake_case name.

use std::fmt;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::validation::ValidationError;

macro_rules! wire_code {
    (
        $(#[$meta:meta])*
        $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $code:literal, $text:literal; )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )*
            /// A code this protocol version does not know (0: unspecified, malformed).
            Unrecognized(u32),
        }

        impl $name {
            /// Every known value, in code order.
            pub const KNOWN: &'static [$name] = &[$($name::$variant),*];

            /// The wire code.
            pub fn code(self) -> u32 {
                match self {
                    $( $name::$variant => $code, )*
                    $name::Unrecognized(code) => code,
                }
            }

            /// The value for a wire code; unknown codes become `Unrecognized`.
            pub fn from_code(code: u32) -> Self {
                match code {
                    $( $code => $name::$variant, )*
                    other => $name::Unrecognized(other),
                }
            }

            /// The snake_case name of a known value.
            pub fn name(self) -> Option<&'static str> {
                match self {
                    $( $name::$variant => Some($text), )*
                    $name::Unrecognized(_) => None,
                }
            }

            /// The value for a snake_case name.
            pub fn from_name(name: &str) -> Option<Self> {
                match name {
                    $( $text => Some($name::$variant), )*
                    _ => None,
                }
            }

            /// `Ok` for a known value; unspecified (0) is malformed, any other unknown code
            /// is unsupported. `field` names the field in the error.
            pub fn check(self, field: &'static str) -> Result<(), ValidationError> {
                match self {
                    $name::Unrecognized(0) => Err(ValidationError::Unspecified { field }),
                    $name::Unrecognized(code) => {
                        Err(ValidationError::UnsupportedCode { field, code })
                    }
                    _ => Ok(()),
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                match self.name() {
                    Some(name) => f.write_str(name),
                    None => write!(f, "unrecognized({})", self.code()),
                }
            }
        }

        impl Serialize for $name {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                match self.name() {
                    Some(name) if serializer.is_human_readable() => serializer.serialize_str(name),
                    _ => serializer.serialize_u32(self.code()),
                }
            }
        }

        impl<'de> Deserialize<'de> for $name {
            fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
                if deserializer.is_human_readable() {
                    fn lookup(name: &str) -> Option<u32> {
                        $name::from_name(name).map($name::code)
                    }
                    deserializer
                        .deserialize_any(CodeVisitor { what: stringify!($name), lookup })
                        .map($name::from_code)
                } else {
                    u32::deserialize(deserializer).map($name::from_code)
                }
            }
        }
    };
}

wire_code! {
    /// Where an identity digest came from.
    IdentitySource {
        /// Derived from default inputs (model source, endpoint triple).
        DefaultDerived = 1, "default_derived";
        /// Derived from an operator's explicit identity map.
        Explicit = 2, "explicit";
    }
}

wire_code! {
    /// The token → block hash → sequence hash pipeline a pool's keys come from.
    HashFormat {
        /// Dynamo's standard v1 hashing.
        DynamoStandardV1 = 1, "dynamo_standard_v1";
        /// Dynamo's Eagle v1 hashing (windows of block_size + 1 tokens).
        DynamoEagleV1 = 2, "dynamo_eagle_v1";
    }
}

wire_code! {
    /// How completely a pool's filter covers what its engines cache (protocol minor 2).
    CoverageState {
        /// Most of the pool's recent events were unroutable: stored blocks whose parents
        /// the relay never saw (an engine's history was lost). What the filter holds is
        /// right, but it misses blocks the engines cache.
        Degraded = 1, "degraded";
        /// The relay is rebuilding the pool's filter from its engines' replay (a relay
        /// start, a resume, a restarted engine): it misses what the replay has not reached
        /// yet. The share is 0.
        Recovering = 2, "recovering";
        /// The pool's filter, or one of its lanes (a format twin, a lower tier), holds
        /// blocks it could not place (capacity omissions: the engines cache more than their
        /// cards declared): a prefix it does not report may be cached. The share is the
        /// omitted share of the owned blocks, percent, rounded to a multiple of 10 (0:
        /// under 5 %). Receivers older than this state report it as unrecognized, never
        /// as complete.
        Overfull = 3, "overfull";
    }
}

wire_code! {
    /// A worker role in a disaggregated deployment.
    WorkerRole {
        /// Prefill worker.
        Prefill = 1, "prefill";
        /// Decode worker.
        Decode = 2, "decode";
        /// Encode (multimodal) worker.
        Encode = 3, "encode";
        /// Aggregated prefill + decode worker.
        Aggregated = 4, "aggregated";
        /// A worker whose card declared no role.
        Legacy = 5, "legacy";
    }
}

wire_code! {
    /// Whether a model can serve requests in a namespace.
    ReadinessState {
        /// Some member's availability is not authoritative yet.
        Unknown = 1, "unknown";
        /// Authoritatively not servable.
        Unavailable = 2, "unavailable";
        /// Servable.
        Ready = 3, "ready";
    }
}

wire_code! {
    /// What a pool frame carries.
    PoolFrameKind {
        /// One chunk of a snapshot (`base_sequence == sequence`).
        SnapshotChunk = 1, "snapshot_chunk";
        /// One delta (`sequence > base_sequence`; `base_sequence + 1` unless coalesced).
        Delta = 2, "delta";
        /// No change (`base_sequence == sequence`, empty payload).
        Heartbeat = 3, "heartbeat";
    }
}

wire_code! {
    /// The machine-readable reason of an error frame. Clients act on the reason; the
    /// message is for people. An unrecognized reason is handled like `Internal`.
    ErrorReason {
        /// The peer speaks another protocol major version or contract.
        ContractMismatch = 1, "contract_mismatch";
        /// The request is missing or has invalid fields.
        InvalidRequest = 2, "invalid_request";
        /// The request uses a feature or format this relay does not support.
        UnsupportedFeature = 3, "unsupported_feature";
        /// The pool is not in the catalog.
        PoolNotFound = 4, "pool_not_found";
        /// The requested producer generation is no longer current.
        ProducerChanged = 5, "producer_changed";
        /// An admission limit is reached.
        ResourceLimit = 6, "resource_limit";
        /// The subscriber fell behind and was cut off.
        SubscriberLagged = 7, "subscriber_lagged";
        /// The snapshot could not be handed over in time.
        SnapshotProgressTimeout = 8, "snapshot_progress_timeout";
        /// The publication is gone (retired generation, shutdown).
        PublicationUnavailable = 9, "publication_unavailable";
        /// The producer broke an identity, sequence or bucket invariant.
        InvalidPublication = 10, "invalid_publication";
        /// A relay bug.
        Internal = 11, "internal";
    }
}

/// Accepts a code number or (through `lookup`) a name.
struct CodeVisitor {
    what: &'static str,
    lookup: fn(&str) -> Option<u32>,
}

impl Visitor<'_> for CodeVisitor {
    type Value = u32;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a {} name or code", self.what)
    }

    fn visit_u64<E: de::Error>(self, value: u64) -> Result<u32, E> {
        u32::try_from(value)
            .map_err(|_| E::custom(format!("{} code {value} exceeds u32", self.what)))
    }

    fn visit_str<E: de::Error>(self, value: &str) -> Result<u32, E> {
        (self.lookup)(value)
            .ok_or_else(|| E::custom(format!("unknown {} name {value:?}", self.what)))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn known_codes_round_trip() {
        for role in WorkerRole::KNOWN {
            assert_eq!(WorkerRole::from_code(role.code()), *role);
        }
    }

    #[test]
    fn unspecified_code_is_malformed_and_unknown_code_unsupported() {
        assert_eq!(
            WorkerRole::from_code(0).check("role"),
            Err(ValidationError::Unspecified { field: "role" })
        );
        let err = WorkerRole::from_code(77).check("role").unwrap_err();
        assert!(err.is_unsupported());
    }

    #[test]
    fn json_uses_names_for_known_codes_and_numbers_otherwise() {
        assert_eq!(
            serde_json::to_string(&WorkerRole::Decode).unwrap(),
            "\"decode\""
        );
        assert_eq!(
            serde_json::to_string(&WorkerRole::Unrecognized(9)).unwrap(),
            "9"
        );
        assert_eq!(
            serde_json::from_str::<WorkerRole>("\"prefill\"").unwrap(),
            WorkerRole::Prefill
        );
        assert_eq!(
            serde_json::from_str::<WorkerRole>("9").unwrap(),
            WorkerRole::Unrecognized(9)
        );
    }
}
