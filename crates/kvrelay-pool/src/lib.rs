//! Pool registry, pool actors and publication hubs: which pool generations a relay
//! publishes, the one task that owns each generation's filter, and the bounded fan-out of
//! its snapshot and deltas to subscribers.
//!
//! # API for the relay server
//!
//! - **[`PoolRegistry`]** (cloneable handle; build with [`PoolRegistry::new`] from a
//!   [`RegistryConfig`] = relay identity + [`Limits`]):
//!   - [`PoolRegistry::attach`]`(`[`AttachRequest`]`)` → [`PoolAttachment`] (pool,
//!     layout generation, [`PoolActorHandle`], generation token);
//!     validates registrations and roles, reserves pool and endpoint, builds the filter
//!     off the executor. [`PoolAttachment::identity`] is the [`ProducerIdentity`](kvrelay_identity::ProducerIdentity)
//!     subscribers name.
//!   - [`PoolRegistry::detach`] (graceful) / [`PoolRegistry::retire`]`(.., mode)`:
//!     withdraw from catalog and load first, stop the hub, stop the actor (drain or
//!     fence), remove. [`PoolRegistry::withdraw`], [`PoolRegistry::fence_generation`],
//!     [`PoolRegistry::remove`] are the individual steps; all are no-ops for a stale
//!     generation.
//!   - [`PoolRegistry::replace_registrations`], [`PoolRegistry::replace_roles`],
//!     [`PoolRegistry::replace_load_capacity`] (same generation), and
//!     [`PoolRegistry::observe_load`] / [`PoolRegistry::clear_load_observations`].
//!   - [`PoolRegistry::watch_catalog`] → `watch::Receiver<`[`PoolCatalog`]`>`: complete,
//!     revisioned, sorted by pool, `serde_json`-serialisable. [`PoolRegistry::watch_load`]
//!     → `watch::Receiver<Vec<`[`PoolLoadSnapshot`]`>>` sorted by pool.
//!   - [`PoolRegistry::subscribe`]`(expected)` (or [`PoolRegistry::subscribe_with`] with
//!     [`SubscribeOptions`]: a resume point, coalescing) → [`PoolSubscription`] or
//!     [`SubscribeError`] (unknown pool, producer mismatch, subscriber limit,
//!     initialized-hub limit, unavailable).
//!   - [`PoolRegistry::shutdown`]: fences everything, ends subscriptions with
//!     `ShuttingDown`, waits for every task. Dropping the last handle without it still
//!     cancels every task (without waiting). [`PoolRegistry::stats`] for metrics.
//! - **[`PoolActorHandle`]**: [`PoolActorHandle::submit`] (bounded mailbox +
//!   block-weighted permits; returns when queued), [`PoolActorHandle::clear_source`],
//!   [`PoolActorHandle::flush`], [`PoolActorHandle::stats`] ([`PoolActorStats`]: sequence,
//!   counters, filter load and omissions), [`PoolActorHandle::source_blocks`] (per-source
//!   block counts for load), and [`PoolActorHandle::health`] ([`PoolHealth`]: the same
//!   counters plus mailbox depth, pending events and their age, faults by
//!   [`FaultCategory`] with the latest typed [`ActorFault`] of each, read in O(1) without
//!   the mailbox, so a stalled actor is still visible). Faults never make the actor wait.
//! - **[`PoolSubscription`]**: call [`PoolSubscription::next_frame`] in a loop and write
//!   each [`PoolFrame::bytes`] to the socket as is (a complete codec frame). Order:
//!   snapshot chunk(s) or a resumption, then deltas in sequence (a subscriber that fell
//!   behind gets them coalesced into one), heartbeats after
//!   `heartbeat_interval` of quiet; then a terminal [`SubscriptionEnd`] (subscriber
//!   lagged, producer withdrawn, snapshot progress timeout, invalid publication, shutting
//!   down) that the server maps to a wire error reason.
//!
//! # Invariants
//!
//! - One actor task owns each generation's filter; nothing else touches it.
//! - A subscriber gets a consistent snapshot at `S` (or resumes at the `S` it named) and
//!   then deltas whose bases chain exactly from `S`, including those published while its
//!   snapshot was being sent; it never sees a gap. Lag is absorbed by coalescing; only a
//!   coalesced backlog over the byte bound ends it with `SubscriberLagged`. The decisions
//!   live in the sans-IO `kvrelay_ckf::stream::Publisher`.
//! - The catalog withdraws a generation before its actor stops; a stale generation can
//!   never fence, withdraw or initialise its replacement; layout generations never repeat.
//! - Every bound is in [`Limits`]; every spawn joins the registry's `TaskTracker` under a
//!   cancellation token, so shutdown leaves no task, permit or hub unit behind.
//!
//! # Where to start reading
//!
//! `registry/core.rs` (the sync decision core and the hub slot state machine), then
//! `actor.rs`, `hub.rs` and `subscription.rs`.
//!
//! ```
//! use kvrelay_identity::*;
//! use kvrelay_pool::{AttachRequest, Limits, PoolFrameKind, PoolRegistry, RegistryConfig};
//!
//! # tokio::runtime::Runtime::new().unwrap().block_on(async {
//! let registry = PoolRegistry::new(RegistryConfig {
//!     relay: DcRelayIdentity::new(1, 42),
//!     limits: Limits::default(),
//! })?;
//! let semantics = KvQuerySemantics::new(16, KvQueryHashFormat::DynamoStandardV1)?;
//! let endpoint: EndpointId = "prod.backend.generate".parse()?;
//! let domain = resolve_indexer_domain("meta/llama", &IndexerIdentitySpec::default(), semantics, &endpoint);
//! let attachment = registry
//!     .attach(AttachRequest {
//!         pool: PoolId { indexer_domain: domain, dc_id: DcId::from_dc_name("dc-a") },
//!         endpoint,
//!         registrations: vec![CanonicalModelRegistration::base(CanonicalModelId::new("llama")?, vec![])],
//!         query_semantics: semantics,
//!         roles: vec![WorkerRole::Aggregated],
//!         expected_unique_blocks: 1024,
//!         filter_density: kvrelay_ckf::FilterDensity::V1,
//!         load_capacity: None,
//!         tier_lanes: Vec::new(),
//!     })
//!     .await?;
//! assert_eq!(registry.catalog().len(), 1);
//! let mut subscription = registry.subscribe(attachment.identity()).await?;
//! let first = subscription.next_frame().await?;
//! assert_eq!(first.kind, PoolFrameKind::SnapshotChunk);
//! drop(subscription);
//! registry.detach(attachment).await;
//! registry.shutdown().await;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

mod actor;
mod catalog;
mod checkpoint;
mod error;
mod filter;
mod frame;
mod health;
mod hub;
mod limits;
mod load;
mod registry;
mod subscription;

pub use actor::{
    ActorFault, EventChunk, FaultCategory, FaultCounts, MAX_EVENTS_PER_BATCH, PoolActorHandle,
    PoolActorStats,
};
pub use catalog::{PoolCatalog, PoolDescriptor, TierLaneDescriptor};
pub use checkpoint::{
    CHECKPOINT_MAGIC, CHECKPOINT_VERSION, CheckpointError, MAX_CHECKPOINT_IDENTITY_BYTES,
    PoolCheckpoint, SourceCheckpoint,
};
pub use error::{
    ActorError, AttachError, BatchSubmitError, FeedError, HubFailure, LimitsError,
    LoadCapacityError, PoolError, PoolFault, RegistrationError, SubscribeError, SubscriptionEnd,
    TransferError, Unavailability,
};
pub use filter::{FilterStats, SourceMappings};
pub use health::PoolHealth;
pub use hub::SubscribeOptions;
pub use kvrelay_ckf::stream::{Start as SubscriptionStart, StreamLimits, StreamStats};
pub use limits::{
    DEFAULT_ACTOR_MAILBOX, DEFAULT_ACTOR_PENDING_BLOCKS, DEFAULT_ALLOCATION_CONCURRENCY,
    DEFAULT_ENCODING_PERMITS, DEFAULT_HUB_DELTA_QUEUE, DEFAULT_MAX_DELTA_BUCKETS,
    DEFAULT_MAX_FILTER_BYTES_TOTAL, DEFAULT_MAX_INITIALIZED_HUBS, DEFAULT_MAX_POOLS,
    DEFAULT_PUBLICATION_WINDOW, Limits,
};
pub use load::{
    LoadObservation, LoadObservationOutcome, MAX_DATA_PARALLEL_RANKS, PoolLoadSnapshot,
    PoolLoadState, WorkerCapacity,
};
pub use registry::{
    AttachRequest, LaneAttachment, LaneRequest, PoolAttachment, PoolRegistry, RegistryConfig,
    RegistryStats, RetirementMode, StreamStatsReader,
};
pub use subscription::{PoolFrame, PoolFrameKind, PoolSubscription};
