//! Typed errors of the pool registry, its actors and its publication hubs.
//!
//! One enum per failure domain. Messages are lowercase phrases naming the thing and the
//! value. [`SubscriptionEnd`] is not an error of a call but the typed reason a pool
//! subscription stream ended; the server maps both to wire reasons.

use kvrelay_ckf::{ApplyError, ConfigError, PublishError};
use kvrelay_identity::{
    CanonicalModelId, EndpointId, ModelAlias, PoolId, ProducerIdentityError, WorkerRole,
};

use crate::actor::FaultCategory;

/// A [`crate::Limits`] value that cannot work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitsError {
    /// A capacity or duration is zero.
    #[error("limit {field} must be greater than zero")]
    Zero {
        /// The field's name.
        field: &'static str,
    },
    /// A bound of the publication stream cannot work.
    #[error(transparent)]
    Stream(#[from] kvrelay_ckf::stream::StreamLimitsError),
    /// A codec bound cannot work.
    #[error(transparent)]
    Codec(#[from] kvrelay_codec::LimitsError),
}

/// Worker capacity that cannot be turned into declared ranks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LoadCapacityError {
    /// The same worker appears twice.
    #[error("worker {worker_id} is declared twice")]
    DuplicateWorker {
        /// The worker.
        worker_id: u64,
    },
    /// A worker declares no ranks.
    #[error("worker {worker_id} has zero data_parallel_size")]
    ZeroDataParallelSize {
        /// The worker.
        worker_id: u64,
    },
    /// A worker declares more ranks than supported.
    #[error("worker {worker_id} declares {ranks} data-parallel ranks, above the supported {max}")]
    TooManyRanks {
        /// The worker.
        worker_id: u64,
        /// Declared ranks.
        ranks: u32,
        /// The supported maximum.
        max: u32,
    },
    /// `start + size` overflows.
    #[error("worker {worker_id} data-parallel rank range {start}+{size} overflows")]
    RankRangeOverflow {
        /// The worker.
        worker_id: u64,
        /// First rank.
        start: u32,
        /// Rank count.
        size: u32,
    },
}

/// Registrations or roles a pool cannot carry.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RegistrationError {
    /// No canonical model at all.
    #[error("pool {pool} requires at least one canonical model registration")]
    NoRegistrations {
        /// The pool.
        pool: PoolId,
    },
    /// A model is registered twice with the same target.
    #[error("duplicate canonical model registration {model}")]
    DuplicateModel {
        /// The model.
        model: CanonicalModelId,
    },
    /// A model is registered twice with different targets.
    #[error("canonical model {model} resolves to conflicting targets in the same pool")]
    ConflictingTargets {
        /// The model.
        model: CanonicalModelId,
    },
    /// An alias names a canonical model of the same pool.
    #[error("model alias {alias} conflicts with a canonical model of the same pool")]
    AliasIsModel {
        /// The alias.
        alias: ModelAlias,
    },
    /// Two models claim one alias.
    #[error("model alias {alias} is claimed by both {first} and {second} in the same pool")]
    AliasClaimedTwice {
        /// The alias.
        alias: ModelAlias,
        /// The first claimant.
        first: CanonicalModelId,
        /// The second claimant.
        second: CanonicalModelId,
    },
    /// No declared worker role.
    #[error("pool requires at least one declared worker role")]
    NoRoles,
    /// A role repeats.
    #[error("pool repeats declared worker role {role:?}")]
    DuplicateRole {
        /// The role.
        role: WorkerRole,
    },
}

/// Why an attach failed. On any error nothing was published and the reservation is gone.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AttachError {
    /// The registry is shutting down.
    #[error("pool registry is shutting down")]
    ShuttingDown,
    /// Registrations or roles are invalid.
    #[error(transparent)]
    Registration(#[from] RegistrationError),
    /// Another endpoint owns or reserves the pool (collisions are fenced, never merged).
    #[error(
        "pool {pool} is already owned by endpoint {owner} and cannot also attach endpoint {endpoint}"
    )]
    PoolAlreadyOwned {
        /// The pool.
        pool: PoolId,
        /// Its current owner.
        owner: Box<EndpointId>,
        /// The endpoint that asked.
        endpoint: Box<EndpointId>,
    },
    /// The endpoint already has a pool (it must be removed first).
    #[error(
        "endpoint {endpoint} is already assigned to pool {assigned} and cannot attach pool {pool}"
    )]
    EndpointAlreadyAssigned {
        /// The endpoint.
        endpoint: Box<EndpointId>,
        /// Its current pool.
        assigned: PoolId,
        /// The pool it asked for.
        pool: PoolId,
    },
    /// The registry already holds `max_pools` pools (attaching ones included).
    #[error("pool limit {limit} reached; pool {pool} not attached")]
    PoolLimit {
        /// The pool that asked.
        pool: PoolId,
        /// The configured `max_pools`.
        limit: usize,
    },
    /// The pool's filter would take the registry past `max_filter_bytes_total`.
    #[error(
        "filter memory limit {limit} bytes reached ({in_use} in use); pool {pool} needs {bytes} and is not attached"
    )]
    FilterMemoryLimit {
        /// The pool that asked.
        pool: PoolId,
        /// Its filter table's bytes.
        bytes: u64,
        /// Bytes held by attached and attaching pools.
        in_use: u64,
        /// The configured `max_filter_bytes_total`.
        limit: u64,
    },
    /// Layout generations are exhausted (`u64::MAX` attaches).
    #[error("layout generation space exhausted")]
    GenerationsExhausted,
    /// A lower-tier lane request is invalid (device tier, repeated tier, a block size
    /// that is not a positive multiple of the pool's, or no expected blocks).
    #[error("pool {pool}: invalid {tier} lane: {reason}")]
    InvalidLane {
        /// The pool.
        pool: PoolId,
        /// The lane's tier.
        tier: kvrelay_ckf::CacheTier,
        /// What is wrong.
        reason: &'static str,
    },
    /// The filter could not be built.
    #[error("pool {pool} filter could not be built: {error}")]
    Filter {
        /// The pool.
        pool: PoolId,
        /// The filter's build error.
        #[source]
        error: ConfigError,
    },
    /// The task building the filter failed (panicked or was cancelled).
    #[error("pool {pool} filter build task failed")]
    FilterTask {
        /// The pool.
        pool: PoolId,
    },
    /// The producer identity could not be formed from the built filter.
    #[error("pool {pool} producer identity is invalid: {error}")]
    Identity {
        /// The pool.
        pool: PoolId,
        /// The identity's validation error.
        #[source]
        error: ProducerIdentityError,
    },
    /// The reservation was retired (shutdown) while the filter was being built.
    #[error("pool {pool} generation {generation} reservation was retired before commit")]
    RetiredBeforeCommit {
        /// The pool.
        pool: PoolId,
        /// The reserved generation.
        generation: u64,
    },
}

impl AttachError {
    /// A stable label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            AttachError::ShuttingDown => "shutting_down",
            AttachError::Registration(_) => "registration",
            AttachError::PoolAlreadyOwned { .. } => "pool_already_owned",
            AttachError::EndpointAlreadyAssigned { .. } => "endpoint_already_assigned",
            AttachError::PoolLimit { .. } => "pool_limit",
            AttachError::FilterMemoryLimit { .. } => "filter_memory_limit",
            AttachError::GenerationsExhausted => "generations_exhausted",
            AttachError::InvalidLane { .. } => "invalid_lane",
            AttachError::Filter { .. } => "filter",
            AttachError::FilterTask { .. } => "filter_task",
            AttachError::Identity { .. } => "identity",
            AttachError::RetiredBeforeCommit { .. } => "retired_before_commit",
        }
    }
}

/// Why an operation on an attached pool generation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The pool is not attached.
    #[error("pool {pool} is not attached")]
    NotAttached {
        /// The pool.
        pool: PoolId,
    },
    /// The generation was withdrawn, fenced or replaced.
    #[error("pool {pool} generation {generation} is no longer active")]
    GenerationInactive {
        /// The pool.
        pool: PoolId,
        /// The caller's generation.
        generation: u64,
    },
    /// Registrations or roles are invalid.
    #[error(transparent)]
    Registration(#[from] RegistrationError),
    /// Capacity is invalid (the load snapshot was degraded and republished).
    #[error(transparent)]
    Capacity(#[from] LoadCapacityError),
}

/// [`crate::PoolActorHandle::submit_batch`] stopped: `queued` events went to the actor before
/// `cause` refused the rest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{cause} after {queued} events of the batch were queued")]
pub struct BatchSubmitError {
    /// Events queued before the failure (whole chunks, from the front of the batch).
    pub queued: usize,
    /// Why the rest was refused.
    #[source]
    pub cause: ActorError,
}

/// Why a pool actor refused a command.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ActorError {
    /// The actor is shutting down or fenced and takes no new commands.
    #[error("pool actor is shutting down")]
    ShuttingDown,
    /// The actor stopped before answering.
    #[error("pool actor stopped before answering")]
    Stopped,
    /// The caller cancelled the submission before the actor took it.
    #[error("submission cancelled before the pool actor took it")]
    Cancelled,
}

/// What went wrong inside a pool actor, with the filter's own typed error. Nothing changed
/// in the filter when it was raised; [`PoolFault::category`] says who should act.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PoolFault {
    /// An event or source operation was rejected by the filter.
    #[error(transparent)]
    Apply(#[from] ApplyError),
    /// A delta could not be built (the window is kept and retried).
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// The table copy for a new hub's snapshot could not be allocated.
    #[error("allocation of {bytes} bytes for a snapshot failed")]
    SnapshotAllocation {
        /// Bytes requested.
        bytes: u64,
    },
    /// A format twin could not apply its pool's membership log (an allocation failed): it
    /// no longer mirrors its pool, so the generation is rebuilt.
    #[error("format twin lost part of its pool's membership log: {0}")]
    TwinDiverged(ApplyError),
    /// An operation the filter's kind does not take: events, tier changes or mappings
    /// sent to a format twin (fed its pool's membership log), or a membership log sent
    /// to a filter fed events.
    #[error("a {kind} does not take {operation}")]
    WrongFeed {
        /// The filter's kind.
        kind: &'static str,
        /// What it was sent.
        operation: &'static str,
    },
}

impl PoolFault {
    /// How bad it is, and so what remedy applies.
    pub fn category(&self) -> FaultCategory {
        match self {
            Self::Apply(ApplyError::AllocationFailed { .. })
            | Self::Publish(PublishError::AllocationFailed { .. })
            | Self::SnapshotAllocation { .. } => FaultCategory::Resource,
            Self::Publish(PublishError::SequenceExhausted { .. }) | Self::TwinDiverged(_) => {
                FaultCategory::ProducerInvariant
            }
            Self::Apply(_) | Self::Publish(_) | Self::WrongFeed { .. } => {
                FaultCategory::SourceProtocol
            }
        }
    }
}

/// Why a hub could not take a publication feed from its actor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FeedError {
    /// The actor is gone.
    #[error(transparent)]
    Actor(#[from] ActorError),
    /// The actor could not copy its table.
    #[error(transparent)]
    Fault(#[from] PoolFault),
}

/// Why exporting or restoring a pool actor's ownership failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TransferError {
    /// The actor is gone.
    #[error(transparent)]
    Actor(#[from] ActorError),
    /// The filter refused the state or could not copy it; nothing changed.
    #[error(transparent)]
    Fault(#[from] PoolFault),
}

/// Why a subscription could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubscribeError {
    /// No active generation of this pool.
    #[error("pool {pool} not found")]
    UnknownPool {
        /// The pool.
        pool: PoolId,
    },
    /// The pool's active generation is not the expected producer.
    #[error(
        "pool {pool}: expected producer generation {expected_generation}, got {current_generation}"
    )]
    ProducerMismatch {
        /// The pool.
        pool: PoolId,
        /// The generation the subscriber asked for.
        expected_generation: u64,
        /// The active generation.
        current_generation: u64,
    },
    /// The pool already has its maximum number of subscribers.
    #[error("pool {pool} has reached max_subscribers_per_pool {limit}")]
    SubscriberLimit {
        /// The pool.
        pool: PoolId,
        /// The limit.
        limit: usize,
    },
    /// Snapshots in flight pin the maximum of table versions and the resume window no
    /// longer reaches the newest; retry shortly.
    #[error("pool {pool} has {limit} snapshot versions in flight (max_pinned_snapshots)")]
    SnapshotLimit {
        /// The pool.
        pool: PoolId,
        /// The limit.
        limit: usize,
    },
    /// Every hub slot is taken by a hub with subscribers.
    #[error("initialized publication hubs reached max_initialized_hubs {limit}")]
    InitializedHubLimit {
        /// The limit.
        limit: usize,
    },
    /// The generation retired, failed or the registry is shutting down.
    #[error("pool publication unavailable: {reason}")]
    Unavailable {
        /// What happened.
        reason: Unavailability,
    },
}

impl SubscribeError {
    /// The generation retired (before or while the subscriber waited for it).
    pub(crate) fn retired() -> Self {
        Self::Unavailable {
            reason: Unavailability::Retired,
        }
    }
}

/// Why a pool's publication cannot take a subscriber now (`SubscribeError::Unavailable`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unavailability {
    /// The generation retired (before or while the subscriber waited for it).
    #[error("pool generation retired")]
    Retired,
    /// Another generation of the pool became active while the subscriber was admitted.
    #[error("pool publication generation changed")]
    GenerationChanged,
    /// The slot's admission counter would overflow (2^64 admissions in flight).
    #[error("pool publication admission counter exhausted")]
    AdmissionsExhausted,
    /// The generation's hub failed and fenced it.
    #[error("publication hub failed: {0}")]
    HubFailed(HubFailure),
    /// The generation's hub has already stopped.
    #[error("publication hub stopped: {0}")]
    HubStopped(SubscriptionEnd),
    /// The registry is shutting down.
    #[error("relay shutting down")]
    ShuttingDown,
}

/// Why a publication hub could not start, or had to stop and fence its generation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HubFailure {
    /// The generation retired before its hub started.
    #[error("pool generation retired")]
    Retired,
    /// The pool actor refused the publication lease.
    #[error("failed to attach to the pool actor: {0}")]
    Attach(FeedError),
    /// The actor's feed is of another producer than the hub's.
    #[error("pool actor identity differs from the hub's producer")]
    IdentityMismatch,
    /// The stream bounds derived for the pool cannot work.
    #[error("stream limits: {0}")]
    StreamLimits(#[from] kvrelay_ckf::stream::StreamLimitsError),
    /// The registry is shutting down (its encoding permits are closed).
    #[error("encoding permits closed")]
    PermitsClosed,
    /// A delta could not be encoded.
    #[error("delta encoding failed: {0}")]
    Encode(#[from] kvrelay_codec::v1::EncodeError),
    /// The publisher refused a delta: the actor's feed broke its sequence.
    #[error("the publisher refused a delta: {0}")]
    Publish(#[from] kvrelay_ckf::stream::PublishError),
}

/// Why a subscription stream ended. Every end is terminal: the subscriber must open a new
/// subscription (and take a new snapshot) to continue.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubscriptionEnd {
    /// The subscriber's backlog, coalesced, still exceeded the byte bound (a snapshot is
    /// cheaper); it never receives a gapped stream.
    #[error("subscriber lagged")]
    SubscriberLagged,
    /// The producer generation was withdrawn, fenced or replaced.
    #[error("producer generation withdrawn")]
    ProducerWithdrawn,
    /// The subscriber took longer than `snapshot_progress_timeout` between chunks.
    #[error("snapshot progress timeout after {timeout_ms} ms")]
    SnapshotProgressTimeout {
        /// The timeout (ms).
        timeout_ms: u64,
    },
    /// The hub found an invalid publication and fenced the generation.
    #[error("invalid publication: {reason}")]
    InvalidPublication {
        /// What was wrong.
        reason: HubFailure,
    },
    /// The registry is shutting down.
    #[error("relay shutting down")]
    ShuttingDown,
    /// A frame could not be encoded (a bug: please report it).
    #[error("internal error: {reason}")]
    Internal {
        /// What the encoder refused.
        reason: kvrelay_codec::v1::EncodeError,
    },
}
