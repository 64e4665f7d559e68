//! Identities and names of kvrelay, and reference-compatible token → block → sequence
//! hashing.
//!
//! This crate owns every id the other crates exchange: data centers ([`DcId`]), indexer
//! domains ([`CacheSemanticsId`], [`RoutingScopeId`], [`IndexerDomainId`]), pools
//! ([`PoolId`]), endpoints ([`EndpointId`]), model names ([`CanonicalModelId`],
//! [`ModelAlias`], [`ModelTarget`], [`CanonicalModelRegistration`]), query semantics
//! ([`KvQuerySemantics`], [`KvQueryHashFormat`]), roles ([`WorkerRole`]), and the
//! producer of a filter ([`DcRelayIdentity`], [`ProducerIdentity`], [`CkfFormat`]).
//!
//! # Invariants
//!
//! - Digests and hashes are bit-compatible with the reference system: identity digests are
//!   the first 16 bytes of BLAKE3 over length-framed, version-tagged material; block hashes
//!   are XXH3-64 over little-endian `u32` tokens with a salted seed; sequence hashes chain
//!   with the fixed seed [`hashing::XXH3_SEED`].
//! - Every type with an invariant has private fields and a validating constructor, and
//!   deserialising runs the same validation. Errors are typed per domain and collected in
//!   [`IdentityError`].
//! - Explicit identity maps are order independent; framing keeps `["ab","c"]` and
//!   `["a","bc"]` apart; default and explicit material never collide.
//!
//! # What it never does
//!
//! Pure: no tokio, no IO, no clock, no randomness. Random values (the relay incarnation)
//! are passed in by the caller.
//!
//! # Where to start reading
//!
//! [`resolve_indexer_domain`] (in `domain.rs`) shows how a model card and endpoint become
//! an [`IndexerDomainId`]; [`hashing`] turns tokens into the canonical keys the filter is
//! built from.
//!
//! ```
//! use kvrelay_identity::{
//!     hashing::{block_hashes, sequence_hashes, HashSalt},
//!     resolve_indexer_domain, DcId, EndpointId, IndexerIdentitySpec, KvQueryHashFormat,
//!     KvQuerySemantics, PoolId,
//! };
//!
//! let semantics = KvQuerySemantics::new(4, KvQueryHashFormat::DynamoStandardV1).unwrap();
//! let endpoint: EndpointId = "prod/router/generate".parse().unwrap();
//! let domain = resolve_indexer_domain(
//!     "meta/llama",
//!     &IndexerIdentitySpec::default(),
//!     semantics,
//!     &endpoint,
//! );
//! let pool = PoolId { indexer_domain: domain, dc_id: DcId::from_dc_name("dc-a") };
//! assert!(pool.relies_on_defaults());
//!
//! let tokens: Vec<u32> = (0..8).collect();
//! let blocks = block_hashes(&tokens, 4, semantics.hash_format(), HashSalt::default());
//! assert_eq!(sequence_hashes(&blocks), [9143094415614847814, 9510318385840434533]);
//! ```

mod dc;
mod digest;
mod domain;
mod endpoint;
mod error;
mod format;
pub mod hashing;
mod material;
mod model;
mod pool;
mod producer;
mod query;
mod relay;
mod role;
mod spec;

pub use dc::{DC_ID_TAG, DcId, DcIdParseError};
pub use digest::{CacheSemanticsId, DIGEST_LEN, IdentitySource, RoutingScopeId};
pub use domain::{IndexerDomainId, cache_semantics_id, resolve_indexer_domain, routing_scope_id};
pub use endpoint::{
    DEFAULT_ENDPOINT_COMPONENT, DEFAULT_ENDPOINT_NAME, DEFAULT_ENDPOINT_NAMESPACE, ENDPOINT_SCHEME,
    EndpointId, EndpointIdError, EndpointPart,
};
pub use error::IdentityError;
pub use format::{
    CKF_FINGERPRINT_BITS, CKF_FORMAT_DENSE, CKF_FORMAT_V1, CKF_SLOTS_PER_BUCKET, CkfFormat,
    CkfFormatError, DEFAULT_CKF_SEED, MAX_CKF_BUCKET_COUNT, MIN_CKF_BUCKET_COUNT,
};
pub use hashing::{
    HashSalt, XXH3_SEED, block_hash, block_hashes, block_hashes_with_mm, canonical_child,
    canonical_root, mm_hash_from_identifier, sequence_hashes,
};
pub use model::{
    CanonicalModelId, CanonicalModelRegistration, ModelAlias, ModelNameError, ModelNameKind,
    ModelTarget,
};
pub use pool::{POOL_IDENTITY_VERSION, PoolId};
pub use producer::{ProducerIdentity, ProducerIdentityError};
pub use query::{KvQueryHashFormat, KvQuerySemantics, KvQuerySemanticsError};
pub use relay::{DcRelayIdentity, DcRelayIdentityError, RELAY_INCARNATION_MASK};
pub use role::{WorkerRole, WorkerRoleParseError};
pub use spec::{
    ExplicitIdentityMap, IdentityMapError, IndexerIdentitySpec, MAX_IDENTITY_KEY_BYTES,
    MAX_IDENTITY_MAP_ENTRIES, MAX_IDENTITY_VALUE_BYTES,
};
