//! Replicas of remote pools and request scoring across datacenters.
//!
//! The consumer watches the catalogs of any number of relays (one per DC), keeps a replica
//! of every advertised pool filter, and ranks the deployments that can serve a request by
//! estimated cached prefix, load and per-DC cost.
//!
//! Start reading at [`scoring`] (the ranking of one request) and [`weights`] (the formula).

pub mod backoff;
mod candidate;
mod catalog;
mod client;
pub mod config;
mod load;
pub mod metrics;
mod oneshot;
mod projection;
pub mod scoring;
mod state;
mod store;
pub mod weights;
mod wire;

pub use backoff::{Backoff, BackoffConfig};
pub use candidate::CandidateShape;
pub use catalog::{PoolKey, QuarantinedEntry};
pub use client::Consumer;
pub use config::{ConfigError, ConsumerConfig, Limits, RelayConfig};
pub use load::LoadSample;
pub use metrics::{ConsumerMetrics, ResubscribeReason};
pub use oneshot::{RouteError, RouteReport, route_once};
pub use scoring::{
    DepthSource, Ranking, ReplicaDepth, ReplicaStatus, ScoreError, ScoreRequest, ScoredCandidate,
    ScoredLeg,
};
pub use state::{CatalogChange, CatalogError, ConsumerState, FrameError, FrameOutcome, PoolStatus};
pub use store::StoreError;
pub use weights::{ScoreWeights, WeightError};
