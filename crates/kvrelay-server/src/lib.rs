//! The relay host: wiring, WAN server and admin HTTP.
//!
//! Owns the running relay process: it turns a [`RelayConfig`] into listeners and tasks,
//! enforces every bound in [`Limits`], serves the WAN protocol over TCP (optionally TLS and a
//! bearer token), and serves admin HTTP (health, readiness, Prometheus metrics, JSON views).
//!
//! Invariants: every bound comes from [`Limits`]; every spawned task belongs to a
//! `TaskTracker` under a child `CancellationToken`; shutdown is ordered and bounded by
//! `Limits::shutdown_timeout_ms`; a malformed or hostile client gets an error frame and is
//! closed without affecting any other connection.
//!
//! Start reading at `config.rs` (the file format), then `wan/` (the listener and the
//! per-connection handler), then the host wiring.

mod admin;
mod admission;
mod config;
mod limits;
mod metrics;
mod tls;

pub use admission::{AdmissionError, StreamKind};
pub use config::{
    AdminConfig, AuthConfig, ConfigError, DiscoveryBackend, DiscoveryConfig, EngineKind,
    RelayConfig, RelayOverrides, SourceConfig, TlsConfig, WanConfig, WorkloadConfig,
    DEFAULT_ADMIN_LISTEN, DEFAULT_DC_ID, DEFAULT_REPLAY_SPEED, DEFAULT_WAN_LISTEN,
};
pub use limits::*;
pub use tls::{TlsError, WanTls};
