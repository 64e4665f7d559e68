//! Every bound this crate enforces, in one plain-data [`Limits`] struct.
//!
//! Each default is a documented `DEFAULT_*` const. [`Limits::validate`] rejects zero
//! capacities and durations before a registry starts; nothing else in the crate checks
//! them again.

use std::time::Duration;

use kvrelay_ckf::stream::StreamLimits;

use crate::error::LimitsError;

/// Commands a pool actor's mailbox holds before `submit` waits.
pub const DEFAULT_ACTOR_MAILBOX: usize = 256;
/// Block-weighted permits of events queued in one pool actor's mailbox (blocks).
pub const DEFAULT_ACTOR_PENDING_BLOCKS: u32 = 65_536;
/// The publication window: after a delta, the next one waits at least this long, so
/// changes arriving within it go out together (5 ms). A change after a quiet window is
/// published at once.
pub const DEFAULT_PUBLICATION_WINDOW: Duration = Duration::from_millis(5);
/// Changed buckets after which a delta is published before its window ends (65,536
/// buckets: a frame of about 768 KiB, under the default 8 MiB frame limit).
pub const DEFAULT_MAX_DELTA_BUCKETS: u32 = 65_536;
/// Deltas queued from a pool actor to its hub. When it is full the actor keeps
/// accumulating (deltas are absolute images, so nothing is lost) and retries.
pub const DEFAULT_HUB_DELTA_QUEUE: usize = 64;
/// Concurrent filter allocations (each runs on a blocking thread).
pub const DEFAULT_ALLOCATION_CONCURRENCY: usize = 2;
/// Publication hubs holding a filter mirror at once, across all pools.
pub const DEFAULT_MAX_INITIALIZED_HUBS: usize = 64;
/// Concurrent frame encodings (snapshot chunks and deltas), across all hubs.
pub const DEFAULT_ENCODING_PERMITS: usize = 2;

/// Pools (attached or being attached) the registry holds at once; one more attach is
/// refused with `AttachError::PoolLimit`.
pub const DEFAULT_MAX_POOLS: usize = 1024;

/// Filter table bytes (`bucket_count × 8`, summed over attached and attaching pools) the
/// registry holds at once: 4 GiB, 32 of the largest filters (2^24 buckets). One more
/// attach that would pass it is refused with `AttachError::FilterMemoryLimit`. A pool's
/// resident memory is a small multiple of its table (its publication hub's mirror, pinned
/// snapshots, the exact ownership index), so budget the process at about three times this.
pub const DEFAULT_MAX_FILTER_BYTES_TOTAL: u64 = 4 << 30;

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
    /// Publication window ([`DEFAULT_PUBLICATION_WINDOW`]).
    pub publication_window: Duration,
    /// Changed buckets that end a window early ([`DEFAULT_MAX_DELTA_BUCKETS`]).
    pub max_delta_buckets: u32,
    /// Actor → hub delta queue ([`DEFAULT_HUB_DELTA_QUEUE`]).
    pub hub_delta_queue: usize,
    /// Concurrent filter allocations ([`DEFAULT_ALLOCATION_CONCURRENCY`]).
    pub allocation_concurrency: usize,
    /// Initialized hubs across all pools ([`DEFAULT_MAX_INITIALIZED_HUBS`]).
    pub max_initialized_hubs: usize,
    /// Concurrent encodings ([`DEFAULT_ENCODING_PERMITS`]).
    pub encoding_permits: usize,
    /// The publication stream of each generation: subscribers, backlog bound, resume
    /// window, heartbeat and snapshot deadlines (`kvrelay_ckf::stream::StreamLimits`,
    /// whose own defaults apply).
    pub stream: StreamLimits,
    /// The codec's bounds; frames are encoded under its `max_frame_len`.
    pub codec: kvrelay_codec::Limits,
    /// Pools held at once, attaching ones included ([`DEFAULT_MAX_POOLS`]).
    pub max_pools: usize,
    /// Filter table bytes held at once, attaching pools included
    /// ([`DEFAULT_MAX_FILTER_BYTES_TOTAL`]): a count of pools does not bound memory when
    /// cards may each declare a large cache.
    pub max_filter_bytes_total: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            actor_mailbox: DEFAULT_ACTOR_MAILBOX,
            actor_pending_blocks: DEFAULT_ACTOR_PENDING_BLOCKS,
            publication_window: DEFAULT_PUBLICATION_WINDOW,
            max_delta_buckets: DEFAULT_MAX_DELTA_BUCKETS,
            hub_delta_queue: DEFAULT_HUB_DELTA_QUEUE,
            allocation_concurrency: DEFAULT_ALLOCATION_CONCURRENCY,
            max_initialized_hubs: DEFAULT_MAX_INITIALIZED_HUBS,
            encoding_permits: DEFAULT_ENCODING_PERMITS,
            stream: StreamLimits::default(),
            codec: kvrelay_codec::Limits::default(),
            max_pools: DEFAULT_MAX_POOLS,
            max_filter_bytes_total: DEFAULT_MAX_FILTER_BYTES_TOTAL,
        }
    }
}

impl Limits {
    /// Rejects a zero capacity or duration, naming the field.
    pub fn validate(&self) -> Result<(), LimitsError> {
        let counts = [
            ("actor_mailbox", self.actor_mailbox),
            ("actor_pending_blocks", self.actor_pending_blocks as usize),
            ("max_delta_buckets", self.max_delta_buckets as usize),
            ("hub_delta_queue", self.hub_delta_queue),
            ("allocation_concurrency", self.allocation_concurrency),
            ("max_initialized_hubs", self.max_initialized_hubs),
            ("encoding_permits", self.encoding_permits),
            ("max_pools", self.max_pools),
            (
                "max_filter_bytes_total",
                usize::try_from(self.max_filter_bytes_total).unwrap_or(usize::MAX),
            ),
        ];
        for (field, value) in counts {
            if value == 0 {
                return Err(LimitsError::Zero { field });
            }
        }
        let durations = [("publication_window", self.publication_window)];
        for (field, value) in durations {
            if value.is_zero() {
                return Err(LimitsError::Zero { field });
            }
        }
        self.stream.validate()?;
        self.codec.validate()?;
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
            publication_window: Duration::ZERO,
            ..Limits::default()
        };
        assert_eq!(
            limits.validate(),
            Err(LimitsError::Zero {
                field: "publication_window"
            })
        );
        let limits = Limits {
            stream: StreamLimits {
                heartbeat_interval: Duration::ZERO,
                ..StreamLimits::default()
            },
            ..Limits::default()
        };
        assert!(matches!(limits.validate(), Err(LimitsError::Stream(_))));
    }
}
