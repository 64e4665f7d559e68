//! The relay's public result types: its error, live progress, per-pool reports and a
//! producer's published table.

use std::net::SocketAddr;
use std::path::PathBuf;

use kvrelay_ckf::SourceId;
use kvrelay_codec::v1;
use serde::Serialize;

use kvrelay_tls::TlsError;

/// Why discovery could not start (each source keeps its own typed error).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryStartError {
    /// The scope (namespaces, prefixes, `watch_all`) breaks its rules.
    #[error("scope: {0}")]
    Scope(#[from] kvrelay_membership::DiscoveryScopeError),
    /// etcd could not be reached.
    #[error("connecting to etcd {endpoints:?}: {source}")]
    Etcd {
        /// The configured endpoints.
        endpoints: Vec<String>,
        /// Why.
        #[source]
        source: kvrelay_membership::DiscoveryError,
    },
    /// The first listing or the watch failed.
    #[error(transparent)]
    Watch(#[from] kvrelay_membership::MembershipWatchError),
}

/// A relay that failed to start or stop.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RelayError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// TLS material failed to load.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A listener could not be bound.
    #[error("binding {what} listener {addr}: {message}")]
    Bind {
        /// `wan` or `admin`.
        what: &'static str,
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        message: String,
    },
    /// The pool registry rejected its limits (the pool crate's own error, field and value
    /// kept).
    #[error("pool registry: {0}")]
    Registry(#[from] kvrelay_pool::LimitsError),
    /// The workload trace could not be read.
    #[error("reading trace {path}: {message}")]
    Trace {
        /// The trace file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The discovery scope or backend is not usable.
    #[error("discovery: {0}")]
    Discovery(#[from] DiscoveryStartError),
    /// Shutdown did not finish within its bound.
    #[error("shutdown did not finish within shutdown_timeout_ms {timeout_ms}")]
    ShutdownTimedOut {
        /// The bound.
        timeout_ms: u64,
    },
    /// The pool is not published.
    #[error("pool {pool} is not in the catalog")]
    UnknownPool {
        /// The pool key.
        pool: String,
    },
    /// No attached pool has this source.
    #[error("source {source_id} is not connected to any pool")]
    UnknownSource {
        /// The source.
        source_id: SourceId,
    },
    /// The pool actor did not accept an event.
    #[error("pool actor refused an event of {source_id}: {message}")]
    Submit {
        /// The source.
        source_id: SourceId,
        /// The actor's message.
        message: String,
    },
    /// Reading a producer's table failed.
    #[error("reading producer table of pool {pool}: {message}")]
    ProducerTable {
        /// The pool key.
        pool: String,
        /// What went wrong.
        message: String,
    },
}

/// Live figures of a running relay (for progress displays and reports).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct RelayProgress {
    /// Pools in the catalog.
    pub pools: usize,
    /// Connected sources.
    pub sources: usize,
    /// Trace requests replayed.
    pub requests: u64,
    /// Events submitted to pool actors.
    pub events: u64,
    /// Blocks stored by the workload.
    pub blocks_stored: u64,
    /// Blocks removed by the workload.
    pub blocks_removed: u64,
    /// Events a pool actor did not accept.
    pub events_dropped: u64,
    /// Whether the workload finished (and every actor was flushed).
    pub workload_done: bool,
    /// Pool frames written on the WAN.
    pub frames_published: u64,
    /// Pool bytes written on the WAN.
    pub bytes_published: u64,
    /// Highest filter load factor across pools (0..1).
    pub filter_load_max: f64,
    /// Catalog revision.
    pub catalog_revision: u64,
}

/// One pool as the host sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolReport {
    /// URL-safe pool key (as in `/v1/pools/{pool}/stats`).
    pub pool: String,
    /// Serving endpoint, `namespace.component.endpoint`.
    pub endpoint: String,
    /// Layout generation.
    pub generation: u64,
    /// Sources routed to the pool (cards' ranks plus configured sources).
    pub sources: usize,
    /// Running sources that are connected (or replaying a gap).
    pub connected_sources: usize,
    /// Whether the pool is stalled (withheld from the catalog).
    pub stalled: bool,
    /// Whether most of its recent events were unroutable (history lost).
    pub degraded: bool,
    /// Published sequence.
    pub sequence: u64,
    /// Resident blocks (exact).
    pub resident_blocks: u64,
    /// Filter buckets.
    pub bucket_count: u64,
    /// Blocks the filter could not place.
    pub capacity_omissions: u64,
    /// Events applied.
    pub events_applied: u64,
    /// Events rejected (faults and unroutable events).
    pub events_rejected: u64,
    /// Stored events whose parent their source never reported.
    pub unroutable_events: u64,
    /// Blocks of those events.
    pub unroutable_blocks: u64,
    /// Faults of every category.
    pub faults: u64,
    /// Events submitted and not yet applied.
    pub pending_events: usize,
}

/// A producer's table as published: what every replica must equal at `sequence`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerTable {
    /// The producer generation.
    pub producer: v1::ProducerIdentity,
    /// The sequence of the table.
    pub sequence: u64,
    /// The bucket words.
    pub words: Vec<u64>,
}
