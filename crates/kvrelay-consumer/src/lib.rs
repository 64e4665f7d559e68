//! Replicas of remote pools and request scoring across datacenters.
//!
//! The consumer watches the catalogs of any number of relays (one per DC), keeps a replica
//! of every advertised pool filter, and ranks the deployments that can serve a request by
//! estimated cached prefix, load and per-DC cost.
//!
//! # Invariants
//!
//! - A replica answers only while it is *current*: snapshot installed, deltas applied
//!   strictly in sequence, heard from within the staleness bound. Any gap, lag, producer
//!   change, checksum or validation failure drops that pool's replica and resubscribes.
//! - Catalog entries are validated one by one; a bad entry is quarantined, the rest stay.
//! - Missing is never zero: unusable replicas and unknown loads are reported as unknown.
//! - Model names that bind to more than one model anywhere are refused (fail closed).
//!
//! # What it never does
//!
//! It never serves a half-applied or gapped replica, never holds a lock across an
//! `.await`, and never leaves a task running after [`Consumer::shutdown`].
//!
//! # Where to start reading
//!
//! [`ConsumerState`] (the sans-IO core), [`scoring`] (the ranking of one request),
//! [`weights`] (the formula), [`readiness`] (topology filtering), then `client.rs` (the
//! async shell). Hot callers keep one [`Ranking`] and call `score_into`;
//! [`encode_prometheus`] exports the metrics.
//!
//! ```
//! use kvrelay_consumer::{ConsumerConfig, ConsumerState, RelayEndpoint, ScoreRequest};
//! let config = ConsumerConfig::new(vec!["127.0.0.1:7400=dc-a:5".parse::<RelayEndpoint>()?]);
//! let state = ConsumerState::new(&config)?;
//! let request = ScoreRequest { tokens: vec![1, 2, 3, 4], model: "llama".into(), ..Default::default() };
//! // No catalog yet: the model is unknown, never guessed.
//! assert!(state.score(&request, std::time::Instant::now()).is_err());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod budget;
mod candidate;
mod catalog;
mod client;
pub mod config;
mod exposition;
pub mod link;
mod load;
pub mod metrics;
mod oneshot;
mod projection;
pub mod readiness;
pub mod scoring;
mod served;
mod state;
mod store;
mod tiers;
pub mod weights;
mod wire;

pub use candidate::CandidateShape;
pub use catalog::{Coverage, PoolKey, QuarantinedEntry};
pub use client::Consumer;
pub use config::{ConfigError, ConsumerConfig, Limits, RelayEndpoint, RelayProtocol, StandbyMode};

/// The old name of [`RelayEndpoint`], kept for one release.
#[deprecated(
    note = "renamed `RelayEndpoint` (one name per concept: the relay's own \
                     configuration is `kvrelay_server::RelayConfig`)"
)]
pub type RelayConfig = RelayEndpoint;
pub use exposition::{METRIC_PREFIX, encode_prometheus};
pub use kvrelay_pacing::{Backoff, BackoffConfig, BackoffConfigError};
pub use kvrelay_tls::{BearerToken, RelayTls, TlsError, TokenError};
pub use load::LoadSample;
pub use metrics::{ConsumerMetrics, ResubscribeReason};
pub use oneshot::{RouteError, RouteReport, route_once};
pub use readiness::CandidateReadiness;
pub use scoring::{
    DepthSource, Ranking, ReplicaDepth, ReplicaState, ScoreError, ScoreRequest, ScoredCandidate,
    ScoredLeg,
};

/// The old name of [`ReplicaState`] (kvrelay-ckf's `ReplicaStatus` is the replica's own
/// state; this one is a candidate's replica as scoring reports it). Kept for one release.
#[deprecated(note = "renamed `ReplicaState`")]
pub type ReplicaStatus = ReplicaState;
pub use served::{ServedModel, served_base_models};
pub use state::{
    CatalogChange, CatalogError, CheckedPoolFrame, ConsumerState, FrameOutcome, PoolFrameRefused,
    PoolStatus, RelayStatus, ScoredSwitch, StandbyStatus, TierLaneStatus,
};
pub use store::StoreError;
pub use weights::{ScoreWeights, WeightError};
