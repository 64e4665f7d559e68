//! The counting cuckoo filter core: exact ownership, event application, publication
//! images, replicas and multi-pool prefix queries.
//!
//! # API for other crates
//!
//! - **Events in** ([`event`]): [`RouterEvent`] = [`SourceId`] `{worker_id, dp_rank}` +
//!   `event_id` + [`EventPayload`] (`Stored` chain with optional parent engine block id and
//!   per-block `engine_block_id` + `token_hash`; `Removed` engine block ids; `AllCleared`).
//! - **Lower tiers** ([`tier`]): [`TierEvent`]s (host memory, disk) feed a [`TierLane`]
//!   per tier beside the device filter; offloads resolve through the device lineage.
//! - **Producer** ([`ownership`]): [`PoolFilter::new`]`(`[`CkfConfig`]`)`, then
//!   [`PoolFilter::apply`] per event ([`ApplyError`] = rejected, nothing changed),
//!   [`PoolFilter::clear_source`], [`PoolFilter::remove_worker`],
//!   [`PoolFilter::reset_source`]; publish with [`PoolFilter::take_delta`] (call it at your
//!   cadence) and [`PoolFilter::snapshot`] (a barrier: pending tail delta, then chunks).
//!   [`PoolFilter::counters`] and [`PoolFilter::memory`] for telemetry.
//! - **Twin** ([`membership`]): [`MembershipFilter`] holds a pool's blocks in another
//!   format, fed the pool filter's owned-set log ([`PoolFilter::record_memberships`])
//!   instead of events, with no exact index of its own.
//! - **Images out** ([`image`]): [`BucketImage`] `{bucket_idx, word}` (absolute word),
//!   [`Delta`] `{base_sequence, sequence, images}` (coalesced, sorted, never empty) and
//!   [`SnapshotChunk`] `{sequence, bucket_count, chunk_index, chunk_count, first_bucket,
//!   words}`. Plain data; the codec crate owns their CBI1 bytes and checksum.
//! - **Stream** ([`stream`]): [`stream::Publisher`], the sans-IO publication state machine
//!   of one producer generation (sequencing, per-subscriber cursors, coalescing backlogs
//!   bounded in bytes, resumption window, heartbeat and snapshot deadlines).
//! - **Replica** ([`replica`]): [`Replica`] installs chunks and applies deltas strictly in
//!   sequence; any error leaves it invalid until a new snapshot.
//! - **Query** ([`query`]): [`QueryTable`] holds any number of pool lanes bucket-major and
//!   answers [`PrefixQuery::prefix_depths`]; [`ExactIndex`] is the exact baseline.
//! - **Addressing** ([`addressing`]): [`Addressing::address`] gives a hash's
//!   fingerprint, primary and alternate bucket for a `kvrelay_identity::CkfFormat`.
//!
//! # Invariants
//!
//! Pure and single-threaded: no tokio, no clock, no IO, no ambient randomness (relocation
//! is driven by the format's seed). Every fallible mutation validates first: on `Err` the
//! state is unchanged. Only an owner count going 0 → 1 inserts a fingerprint and only
//! 1 → 0 removes one. Start reading at [`ownership`].

pub mod addressing;
mod bucket;
pub mod counters;
pub mod event;
mod exact;
pub mod format;
pub mod huge_pages;
pub mod image;
pub mod joint;
mod keyhash;
mod lineage;
pub mod membership;
mod owners;
pub mod ownership;
mod prefetch;
mod publication;
pub mod query;
pub mod replica;
mod search;
mod slots;
pub mod stream;
mod table;
pub mod tier;

pub use addressing::{Address, Addressing};
pub use counters::{ApplyOutcome, FilterCounters, MemoryUsage};
pub use event::{
    CacheTier, EventPayload, RemovedBlocks, RouterEvent, SourceId, StoredBlock, StoredBlocks,
    TierChange, TierEvent, UnknownTier,
};
pub use format::{CkfConfig, ConfigError, FilterDensity};
pub use image::{BucketImage, Delta, MAX_BUCKET_COUNT, SNAPSHOT_CHUNK_BUCKETS, SnapshotChunk};
pub use joint::{JointDepths, MAX_JOINT_TABLES, joint_prefix_depths_into};
pub use membership::{Membership, MembershipFilter};
pub use ownership::{ApplyError, BarrierSnapshot, PoolFilter, PublishError};
pub use query::{
    ExactIndex, GrownRows, PrefixDepths, PrefixQuery, QueryConfig, QueryConfigError, QueryTable,
};
pub use replica::{Replica, ReplicaError, ReplicaStatus};
pub use tier::{TierApplyError, TierCounters, TierLane, TierOutcome};
