//! The relay host: wiring, WAN server and admin HTTP.
//!
//! Owns the running relay process: [`Relay::start`] turns a [`RelayConfig`] into listeners
//! and tasks, enforces every bound in [`Limits`], serves the WAN protocol over TCP
//! (optionally TLS and a bearer token), serves Dynamo's relay contract over gRPC on its own
//! port when `[dynamo]` is set (`dynamo.rs`, a thin driver of the same streams), serves
//! admin HTTP (health, readiness, Prometheus
//! metrics, JSON views), and [`Relay::shutdown`] stops everything in order.
//!
//! Invariants: every bound comes from [`Limits`]; every spawned task belongs to a
//! `TaskTracker` under a child `CancellationToken`; shutdown is ordered and bounded by
//! `Limits::shutdown_timeout_ms`; a malformed or hostile client gets an error frame and is
//! closed without affecting any other connection; wire errors are mapped from domain errors
//! in one place per source (`host/publisher.rs`, `wan/connection.rs`).
//!
//! Start reading at `config.rs` (the file format), then `host/mod.rs` (the wiring), then
//! `wan/connection.rs` (one connection's life).

mod admin;
mod admission;
mod config;
mod dynamo;
mod event_advert;
mod host;
mod http;
mod limits;
mod metrics;
mod mirror;
mod probe;
mod source_metrics;
mod wan;

pub use admission::{AdmissionError, StreamKind};
pub use config::{
    AdminConfig, AuthConfig, ConfigError, DEFAULT_ADMIN_CONNECTION_TIMEOUT_MS,
    DEFAULT_ADMIN_HEADER_READ_TIMEOUT_MS, DEFAULT_ADMIN_LISTEN, DEFAULT_ADMIN_MAX_CONNECTIONS,
    DEFAULT_CHECKPOINT_INTERVAL_MS, DEFAULT_CHECKPOINT_MAX_AGE_MS,
    DEFAULT_CHECKPOINT_MAX_FILE_BYTES, DEFAULT_CHECKPOINT_SHUTDOWN_TIMEOUT_MS, DEFAULT_DC_ID,
    DEFAULT_DENSE_SIZE_CLASSES_PER_OCTAVE, DEFAULT_DYNAMO_LISTEN, DEFAULT_REPLAY_SPEED,
    DEFAULT_TIER_CAPACITY_RATIO, DEFAULT_WAN_LISTEN, DiscoveryBackend, DiscoveryConfig,
    DynamoConfig, ExposureWarning, FilterFormat, FiltersConfig, MAX_BLOCKS_PER_CHUNK,
    MAX_TIER_CAPACITY_RATIO, NatsConfig, RelayConfig, RelayOverrides, SourceConfig, SourceEngine,
    StateConfig, TierConfig, TiersConfig, WanConfig, WorkloadConfig,
};
pub use host::{
    DiscoveryStartError, PoolReport, ProducerTable, Relay, RelayError, RelayProgress,
    WORKLOAD_TOKEN_SEED,
};
pub use kvrelay_tls::{ListenerTls, ServerTls, TlsError, TokenError};

/// The old name of the `[wan.tls]` table, kept for one release.
#[deprecated(note = "renamed `ListenerTls` (the router's `[tls]` is the same table)")]
pub type TlsConfig = ListenerTls;
pub use limits::*;
pub use mirror::{MirrorError, MirrorProgress, PoolMirror};
pub use probe::{ProbeError, ProbeStream};
