//! Identity wire types: relay, pool, filter format, producer, endpoint, registrations and
//! query semantics.
//!
//! The producer identity is the subscription key: every field, recursively, takes part in
//! equality. Descriptive metadata (endpoint, models, roles) lives in the pool descriptor
//! and never does.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::code::{HashFormat, IdentitySource};
use super::validation::{ValidationError, check_name, first_duplicate};
use crate::cbi1::{self, Cbi1Layout};

/// The pool identity version this protocol speaks; another non-zero version is
/// unsupported.
pub const POOL_IDENTITY_VERSION: u32 = 1;

/// A relay process: its discovery instance and this run's incarnation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RelayIdentity {
    /// The discovery connection id of the relay's runtime.
    pub drt_instance_id: u64,
    /// Random per relay start; fences producer generations across restarts.
    pub relay_incarnation: u64,
}

/// A 16-byte identity digest and where its material came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DigestId {
    /// First 16 bytes of the BLAKE3 digest of the identity material (hex in JSON).
    #[serde(serialize_with = "digest_out", deserialize_with = "digest_in")]
    pub digest: [u8; 16],
    /// Default-derived or explicit.
    pub source: IdentitySource,
}

/// A pool: an indexer domain (cache semantics + routing scope) in one DC.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PoolId {
    /// Pool identity version, [`POOL_IDENTITY_VERSION`].
    pub identity_version: u32,
    /// What a cached block means (model source, block size, hash format).
    pub cache_semantics: DigestId,
    /// Which endpoint's workers share the cache domain.
    pub routing_scope: DigestId,
    /// The DC's stable id.
    pub dc_id: u64,
}

/// A filter's format: CKF format 1 is 16-bit fingerprints, 4 slots per bucket, a
/// power-of-two bucket count in `2..=2^24`; format 2 (kvrelay's dense format) the same
/// with any bucket count in that range. A consumer that knows only format 1 quarantines
/// a format 2 pool as unsupported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct CkfFormat {
    /// CKF format version (1, or 2 dense).
    pub format_version: u32,
    /// Filter seed.
    pub seed: u64,
    /// Number of buckets.
    pub bucket_count: u64,
    /// Fingerprint width in bits (16).
    pub fingerprint_bits: u32,
    /// Slots per bucket (4).
    pub slots_per_bucket: u32,
}

/// One producer generation of a pool: the exact key a subscription names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProducerIdentity {
    /// The pool.
    pub pool_id: PoolId,
    /// The relay incarnation that produces it.
    pub producer_incarnation: u64,
    /// The pool registry's generation (starts at 1; 0 is malformed).
    pub layout_generation: u64,
    /// The filter format.
    pub ckf_format: CkfFormat,
}

/// A serving endpoint: namespace, component, endpoint name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct EndpointId {
    /// Namespace.
    pub namespace: String,
    /// Component.
    pub component: String,
    /// Endpoint name.
    pub name: String,
}

/// A model a pool serves: a base model, or a LoRA adapter on one, plus aliases.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ModelRegistration {
    /// The canonical model id requests name.
    pub model: String,
    /// The base model.
    pub base_model: String,
    /// The LoRA adapter, for adapter registrations.
    pub adapter: Option<String>,
    /// Other names of the model (sorted, unique, never the model itself).
    pub aliases: Vec<String>,
}

/// How a consumer turns tokens into the pool's keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QuerySemantics {
    /// Tokens per KV block (> 0).
    pub kv_block_size: u32,
    /// The hashing pipeline.
    pub hash_format: HashFormat,
}

impl DigestId {
    /// Checks the source code.
    pub fn validate(&self, field: &'static str) -> Result<(), ValidationError> {
        self.source.check(field)
    }
}

impl PoolId {
    /// Checks the identity version and digest sources.
    pub fn validate(&self) -> Result<(), ValidationError> {
        match self.identity_version {
            POOL_IDENTITY_VERSION => {}
            0 => {
                return Err(ValidationError::Unspecified {
                    field: "pool_id.identity_version",
                });
            }
            version => {
                return Err(ValidationError::UnsupportedVersion {
                    field: "pool_id.identity_version",
                    version,
                });
            }
        }
        self.cache_semantics
            .validate("pool_id.cache_semantics.source")?;
        self.routing_scope.validate("pool_id.routing_scope.source")
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for byte in self.cache_semantics.digest {
            write!(f, "{byte:02x}")?;
        }
        f.write_str(":")?;
        for byte in self.routing_scope.digest {
            write!(f, "{byte:02x}")?;
        }
        write!(f, "/{:016x}", self.dc_id)
    }
}

impl CkfFormat {
    /// Checks the format: other versions, widths or slot counts are unsupported; a bad
    /// bucket count for format 1 is malformed.
    pub fn validate(&self) -> Result<(), ValidationError> {
        if self.format_version == 0 {
            return Err(ValidationError::Unspecified {
                field: "ckf_format.format_version",
            });
        }
        let known = [cbi1::CKF_FORMAT_VERSION, cbi1::CKF_FORMAT_DENSE_VERSION];
        if !known.iter().any(|&v| self.format_version == u32::from(v))
            || self.fingerprint_bits != u32::from(cbi1::FINGERPRINT_BITS)
            || self.slots_per_bucket != u32::from(cbi1::SLOTS_PER_BUCKET)
        {
            return Err(ValidationError::UnsupportedFormat {
                format_version: self.format_version,
                fingerprint_bits: self.fingerprint_bits,
                slots_per_bucket: self.slots_per_bucket,
            });
        }
        self.layout().map(|_| ())
    }

    /// The CBI1 layout of a valid format.
    pub fn layout(&self) -> Result<Cbi1Layout, ValidationError> {
        // `validate` has checked the version is 1 or 2 before any caller gets here; a
        // wider one fails the layout as unsupported.
        let version = u16::try_from(self.format_version).unwrap_or(u16::MAX);
        Cbi1Layout::for_format(version, self.seed, self.bucket_count).map_err(|_| {
            ValidationError::InvalidBucketCount {
                bucket_count: self.bucket_count,
            }
        })
    }

    /// The domain format of a valid wire format: what `kvrelay-ckf` tables, replicas and
    /// query lanes are built for.
    pub fn domain(&self) -> Result<kvrelay_identity::CkfFormat, ValidationError> {
        kvrelay_identity::CkfFormat::try_from(*self)
    }
}

impl ProducerIdentity {
    /// Checks the pool id, layout generation and format.
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.pool_id.validate()?;
        self.ckf_format.validate()?;
        if self.layout_generation == 0 {
            return Err(ValidationError::ZeroLayoutGeneration);
        }
        Ok(())
    }
}

impl EndpointId {
    /// Checks the three names.
    pub fn validate(&self, field: &'static str) -> Result<(), ValidationError> {
        check_name(field, &self.namespace)?;
        check_name(field, &self.component)?;
        check_name(field, &self.name)
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.component, self.name)
    }
}

impl ModelRegistration {
    /// Checks every name, and that aliases are unique and never the model itself.
    pub fn validate(&self) -> Result<(), ValidationError> {
        check_name("registration.model", &self.model)?;
        check_name("registration.base_model", &self.base_model)?;
        if let Some(adapter) = &self.adapter {
            check_name("registration.adapter", adapter)?;
        }
        for alias in &self.aliases {
            check_name("registration.aliases", alias)?;
            if *alias == self.model {
                return Err(ValidationError::AliasCollision {
                    alias: alias.clone(),
                });
            }
        }
        if let Some((_, alias)) = first_duplicate(&self.aliases) {
            return Err(ValidationError::AliasCollision {
                alias: alias.clone(),
            });
        }
        Ok(())
    }
}

impl QuerySemantics {
    /// Checks the block size and hash format.
    pub fn validate(&self) -> Result<(), ValidationError> {
        self.hash_format.check("query_semantics.hash_format")?;
        if self.kv_block_size == 0 {
            return Err(ValidationError::ZeroBlockSize);
        }
        Ok(())
    }
}

fn digest_out<S: Serializer>(digest: &[u8; 16], serializer: S) -> Result<S::Ok, S::Error> {
    if serializer.is_human_readable() {
        let text: String = digest.iter().map(|byte| format!("{byte:02x}")).collect();
        serializer.serialize_str(&text)
    } else {
        digest.serialize(serializer)
    }
}

fn digest_in<'de, D: Deserializer<'de>>(deserializer: D) -> Result<[u8; 16], D::Error> {
    if !deserializer.is_human_readable() {
        return <[u8; 16]>::deserialize(deserializer);
    }
    let text = String::deserialize(deserializer)?;
    let bad = || serde::de::Error::custom(format!("digest {text:?} is not 32 hex digits"));
    if text.len() != 32 || !text.is_ascii() {
        return Err(bad());
    }
    let mut digest = [0u8; 16];
    for (at, byte) in digest.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&text[2 * at..2 * at + 2], 16).map_err(|_| bad())?;
    }
    Ok(digest)
}
