//! Model cards, discovery, and the membership projection with topology and readiness.
//!
//! This crate owns what a relay learns from discovery: the model deployment card schema
//! ([`ModelDeploymentCard`]), the discovery scope ([`DiscoveryScope`]), the incremental
//! projection of cards into endpoint memberships ([`MembershipProjection`] →
//! [`MembershipView`]) with conflicts of three scopes, and serving topology/readiness
//! ([`TopologyState`]).
//!
//! Invariants: the core is sans-IO (no tokio, no clock, no filesystem, no sockets); a
//! one-card change re-projects only the endpoints it affects; a request-facing name claimed
//! by two targets anywhere in the scope is omitted everywhere (fail closed).
//!
//! The async shell sits behind the default `watch` feature: the [`Discovery`] trait, its
//! memory, file and etcd backends, and [`MembershipWatch`], the list/watch/reconcile loop.
//! Start reading at [`MembershipProjection`].

mod card;
mod config;
mod diagnostic;
#[cfg(feature = "watch")]
mod discovery;
mod endpoint;
#[cfg(feature = "watch")]
mod etcd;
#[cfg(feature = "watch")]
mod file;
mod instance;
mod limits;
mod membership;
#[cfg(feature = "watch")]
mod memory;
mod projection;
mod readiness;
mod topology;
#[cfg(feature = "watch")]
mod watch;

pub use card::{LoraInfo, ModelDeploymentCard, ModelType, RuntimeConfig, WorkerType};
pub use config::{DiscoveryScope, DiscoveryScopeError, EndpointFilter};
pub use diagnostic::{Diagnostic, ProjectionStats};
#[cfg(feature = "watch")]
pub use discovery::{Discovery, DiscoveryError, DiscoveryFuture, DiscoveryWatch};
#[cfg(feature = "watch")]
pub use etcd::{
    DEFAULT_ETCD_PAGE_KEYS, DEFAULT_ETCD_TIMEOUT, ETCD_CARD_PREFIX, EtcdChange, EtcdClient,
    EtcdClientLimits, EtcdDiscovery, EtcdError, EtcdListing, EtcdRecord, EtcdWatch, card_key,
};
#[cfg(feature = "watch")]
pub use file::{
    CardDirListing, CardFileError, CardFileSkips, DEFAULT_FILE_POLL_INTERVAL, FileDiscovery,
    card_file_name, read_card_dir, read_card_file, write_card_file,
};
pub use instance::{
    DiscoveryEvent, DiscoveryQuery, InstancePathError, InstanceRecordError, ModelCardInstance,
    ModelCardInstanceId,
};
pub use limits::{
    DEFAULT_MAX_CARD_FILE_BYTES, DEFAULT_MAX_CARD_FILES, DEFAULT_MAX_PENDING_DIAGNOSTICS,
    DEFAULT_MEMORY_WATCH_QUEUE_DEPTH, MAX_CARD_DATA_PARALLEL_SIZE, MAX_CARD_START_RANK,
    MAX_CARD_TOTAL_KV_BLOCKS, MembershipLimits,
};
pub use membership::{
    AdapterMembership, ConflictReason, ConflictScope, ConflictSubject, EndpointMembership,
    KvStateEndpoint, MembershipConflict, MembershipView, ResolvedDomain, WorkerId, WorkerTopology,
    role_of,
};
#[cfg(feature = "watch")]
pub use memory::MemoryDiscovery;
pub use projection::MembershipProjection;
pub use readiness::{Readiness, ReadinessUnit, evaluate_readiness};
pub use topology::{
    AdapterReadiness, ServingState, TopologyEntry, TopologyMember, TopologySnapshot, TopologyState,
};
#[cfg(feature = "watch")]
pub use watch::{
    DEFAULT_BACKOFF_INITIAL, DEFAULT_BACKOFF_MAX, DEFAULT_RECONCILE_INTERVAL,
    DEFAULT_SHUTDOWN_TIMEOUT, MembershipSubscription, MembershipWatch, MembershipWatchError,
    WatchConfig,
};
