//! Every bound this crate enforces, in one plain-data [`Limits`] struct.
//!
//! Each default is a documented `DEFAULT_*` const. [`Limits::validate`] rejects zero
//! capacities and durations before a registry starts; nothing else in the crate checks
//! them again.

use std::time::Duration;

use crate::error::LimitsError;

/// Commands a pool actor's mailbox holds before `submit` waits.
pub const DEFAULT_ACTOR_MAILBOX: usize = 256;
/// Block-weighted permits of events queued in one pool actor's mailbox (blocks).
pub const DEFAULT_ACTOR_PENDING_BLOCKS: u32 = 65_536;
/// Applied events after which the actor publishes a delta (events).
pub const DEFAULT_PUBLISH_EVERY_N_EVENTS: u32 = 16;
/// Longest a non-empty pending batch waits before it is published (1 ms).
pub const DEFAULT_PUBLICATION_DELAY: Duration = Duration::from_millis(1);
/// Deltas queued from a pool actor to its hub before the hub counts as lagging.
pub const DEFAULT_HUB_DELTA_QUEUE: usize = 64;
/// Concurrent filter allocations (each runs on a blocking thread).
pub const DEFAULT_ALLOCATION_CONCURRENCY: usize = 2;
/// Publication hubs holding a filter mirror at once, across all pools.
pub const DEFAULT_MAX_INITIALIZED_HUBS: usize = 64;
/// Subscribers of one pool generation's hub.
pub const DEFAULT_MAX_SUBSCRIBERS_PER_POOL: usize = 64;
/// Concurrent frame encodings (snapshot chunks and deltas), across all hubs.
pub const DEFAULT_ENCODING_PERMITS: usize = 2;
/// Frames queued for one subscriber before it counts as lagging.
pub const DEFAULT_SUBSCRIBER_QUEUE_FRAMES: usize = 16;
/// Bytes queued for one subscriber before it counts as lagging (16 MiB).
pub const DEFAULT_SUBSCRIBER_QUEUE_BYTES: usize = 16 * 1024 * 1024;
/// Bytes charged per queued frame on top of its encoded length.
pub const FRAME_ACCOUNTING_OVERHEAD: usize = 256;
/// Quiet time after which a subscription yields a heartbeat (10 s).
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(10);
/// Longest a subscriber may take between two snapshot chunks (60 s).
pub const DEFAULT_SNAPSHOT_PROGRESS_TIMEOUT: Duration = Duration::from_secs(60);

/// Pools (attached or being attached) the registry holds at once; one more attach is
/// refused with `AttachError::PoolLimit`.
pub const DEFAULT_MAX_POOLS: usize = 1024;

/// Every bound of the pool registry, its actors and its hubs.
///
/// Plain data: build it with struct-update syntax from [`Limits::default`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Commands in one actor's mailbox ([`DEFAULT_ACTOR_MAILBOX`]).
    pub actor_mailbox: usize,
    /// Block permits of queued events per actor ([`DEFAULT_ACTOR_PENDING_BLOCKS`]); an
    /// event weighs its block count (at least 1, at most this value).
    pub actor_pending_blocks: u32,
    /// Events per published delta ([`DEFAULT_PUBLISH_EVERY_N_EVENTS`]).
    pub publish_every_n_events: u32,
    /// Soft publication timer ([`DEFAULT_PUBLICATION_DELAY`]).
    pub publication_delay: Duration,
    /// Actor → hub delta queue ([`DEFAULT_HUB_DELTA_QUEUE`]).
    pub hub_delta_queue: usize,
    /// Concurrent filter allocations ([`DEFAULT_ALLOCATION_CONCURRENCY`]).
    pub allocation_concurrency: usize,
    /// Initialized hubs across all pools ([`DEFAULT_MAX_INITIALIZED_HUBS`]).
    pub max_initialized_hubs: usize,
    /// Subscribers per pool ([`DEFAULT_MAX_SUBSCRIBERS_PER_POOL`]).
    pub max_subscribers_per_pool: usize,
    /// Concurrent encodings ([`DEFAULT_ENCODING_PERMITS`]).
    pub encoding_permits: usize,
    /// Frames per subscriber queue ([`DEFAULT_SUBSCRIBER_QUEUE_FRAMES`]).
    pub subscriber_queue_frames: usize,
    /// Bytes per subscriber queue ([`DEFAULT_SUBSCRIBER_QUEUE_BYTES`]).
    pub subscriber_queue_bytes: usize,
    /// Heartbeat interval ([`DEFAULT_HEARTBEAT_INTERVAL`]).
    pub heartbeat_interval: Duration,
    /// Snapshot progress timeout ([`DEFAULT_SNAPSHOT_PROGRESS_TIMEOUT`]).
    pub snapshot_progress_timeout: Duration,
    /// Pools held at once, attaching ones included ([`DEFAULT_MAX_POOLS`]).
    pub max_pools: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            actor_mailbox: DEFAULT_ACTOR_MAILBOX,
            actor_pending_blocks: DEFAULT_ACTOR_PENDING_BLOCKS,
            publish_every_n_events: DEFAULT_PUBLISH_EVERY_N_EVENTS,
            publication_delay: DEFAULT_PUBLICATION_DELAY,
            hub_delta_queue: DEFAULT_HUB_DELTA_QUEUE,
            allocation_concurrency: DEFAULT_ALLOCATION_CONCURRENCY,
            max_initialized_hubs: DEFAULT_MAX_INITIALIZED_HUBS,
            max_subscribers_per_pool: DEFAULT_MAX_SUBSCRIBERS_PER_POOL,
            encoding_permits: DEFAULT_ENCODING_PERMITS,
            subscriber_queue_frames: DEFAULT_SUBSCRIBER_QUEUE_FRAMES,
            subscriber_queue_bytes: DEFAULT_SUBSCRIBER_QUEUE_BYTES,
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            snapshot_progress_timeout: DEFAULT_SNAPSHOT_PROGRESS_TIMEOUT,
            max_pools: DEFAULT_MAX_POOLS,
        }
    }
}

impl Limits {
    /// Rejects a zero capacity or duration, naming the field.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let counts = [
            ("actor_mailbox", self.actor_mailbox),
            ("actor_pending_blocks", self.actor_pending_blocks as usize),
            (
                "publish_every_n_events",
                self.publish_every_n_events as usize,
            ),
            ("hub_delta_queue", self.hub_delta_queue),
            ("allocation_concurrency", self.allocation_concurrency),
            ("max_initialized_hubs", self.max_initialized_hubs),
            ("max_subscribers_per_pool", self.max_subscribers_per_pool),
            ("encoding_permits", self.encoding_permits),
            ("subscriber_queue_frames", self.subscriber_queue_frames),
            ("subscriber_queue_bytes", self.subscriber_queue_bytes),
            ("max_pools", self.max_pools),
        ];
        for (field, value) in counts {
            if value == 0 {
                return Err(LimitsError::Zero { field });
            }
        }
        let durations = [
            ("publication_delay", self.publication_delay),
            ("heartbeat_interval", self.heartbeat_interval),
            ("snapshot_progress_timeout", self.snapshot_progress_timeout),
        ];
        for (field, value) in durations {
            if value.is_zero() {
                return Err(LimitsError::Zero { field });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_limits_are_valid() {
        assert_eq!(Limits::default().validate(), Ok(()));
    }

    #[test]
    fn zero_capacity_is_rejected_by_name() {
        let limits = Limits {
            max_initialized_hubs: 0,
            ..Limits::default()
        };
        assert_eq!(
            limits.validate(),
            Err(LimitsError::Zero {
                field: "max_initialized_hubs"
            })
        );
    }

    #[test]
    fn zero_duration_is_rejected_by_name() {
        let limits = Limits {
            heartbeat_interval: Duration::ZERO,
            ..Limits::default()
        };
        assert_eq!(
            limits.validate(),
            Err(LimitsError::Zero {
                field: "heartbeat_interval"
            })
        );
    }
}
