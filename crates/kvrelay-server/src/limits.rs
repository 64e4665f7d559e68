//! Every bound the relay server enforces, in one place, each default a documented const.
//!
//! `Limits` is plain data read from the `[limits]` table of the relay's TOML file; every field
//! is optional there and falls back to the const beside it. [`Limits::validate`] rejects zero
//! capacities and durations before the server starts.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::config::ConfigError;

/// Default concurrent `WatchCatalog` streams (whole relay).
pub const DEFAULT_MAX_CATALOG_STREAMS: u32 = 64;
/// Default concurrent `SubscribePool` streams across all pools: every router (or other
/// consumer) holds one stream per pool it follows, so a relay needs at least
/// `routers × pools`; 1,024 covers, say, 8 routers on 128 pools (64 used to leave a
/// second router on a 40-pool relay refused forever).
pub const DEFAULT_MAX_POOL_STREAMS_TOTAL: u32 = 1024;
/// Default concurrent subscribers of one pool (the stream's own default).
pub const DEFAULT_MAX_SUBSCRIBERS_PER_POOL: u32 =
    kvrelay_ckf::stream::DEFAULT_MAX_SUBSCRIBERS as u32;
/// Default streams of one type one peer IP address may hold at once (pool streams: of one
/// pool). A router holds one of each; 8 leaves room for several routers behind one address
/// and their reconnect overlap, while one host can take at most an eighth of a pool's
/// default 64 subscriber slots.
pub const DEFAULT_MAX_STREAMS_PER_PEER: u32 = 8;
/// Default concurrent `WatchLoad` streams.
pub const DEFAULT_MAX_LOAD_STREAMS: u32 = 64;
/// Default concurrent `WatchTopology` streams.
pub const DEFAULT_MAX_TOPOLOGY_STREAMS: u32 = 64;
/// Default concurrent `RelayInfo` requests being answered.
pub const DEFAULT_MAX_INFO_STREAMS: u32 = 64;
/// Default concurrent TCP connections, including ones that have not sent a request yet.
pub const DEFAULT_MAX_CONNECTIONS: u32 = 1024;
/// Default number of publication hubs holding a filter mirror at once.
pub const DEFAULT_MAX_INITIALIZED_HUBS: u32 = 64;
/// Default time a new connection has from accept to a complete stream request, TLS handshake
/// included (one budget), in ms.
pub const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 5_000;
/// Default time one snapshot frame may wait for the client to accept it, in ms (the
/// stream's own default).
pub const DEFAULT_SNAPSHOT_PROGRESS_TIMEOUT_MS: u64 =
    kvrelay_ckf::stream::DEFAULT_SNAPSHOT_PROGRESS_TIMEOUT.as_millis() as u64;
/// Default idle interval after which a stream sends a heartbeat, in ms (the stream's own
/// default).
pub const DEFAULT_HEARTBEAT_INTERVAL_MS: u64 =
    kvrelay_ckf::stream::DEFAULT_HEARTBEAT_INTERVAL.as_millis() as u64;
/// Default publication window, in ms (the pool's own default): a change after a quiet
/// window is published at once, later ones wait until a window has passed.
pub const DEFAULT_PUBLICATION_WINDOW_MS: u64 =
    kvrelay_pool::DEFAULT_PUBLICATION_WINDOW.as_millis() as u64;
/// Default changed buckets that end a publication window early (the pool's own default).
pub const DEFAULT_MAX_DELTA_BUCKETS: u32 = kvrelay_pool::DEFAULT_MAX_DELTA_BUCKETS;
/// Default bytes of recent deltas each pool keeps so a reconnecting consumer resumes
/// without a snapshot (the stream's own default, 16 MiB).
pub const DEFAULT_RESUME_WINDOW_BYTES: u64 = kvrelay_ckf::stream::DEFAULT_RESUME_WINDOW_BYTES;
/// Default time any single frame write may take before the client counts as stalled, in ms.
pub const DEFAULT_WRITE_TIMEOUT_MS: u64 = 30_000;
/// Default load window published on `WatchLoad`, in ms.
pub const DEFAULT_LOAD_WINDOW_MS: u64 = 1_000;
/// Default largest frame the server reads or writes, in bytes (the codec's own default,
/// 8 MiB).
pub const DEFAULT_MAX_FRAME_LEN: u32 = kvrelay_codec::limits::DEFAULT_MAX_FRAME_LEN;
/// Default bound on the whole ordered shutdown, in ms.
pub const DEFAULT_SHUTDOWN_TIMEOUT_MS: u64 = 10_000;
/// Default largest stream request frame, header included, in bytes (64 KiB). A real request
/// is a few KB (the longest token and subscriber id fit well inside); it is read before
/// authentication, so it gets its own small bound instead of `max_frame_len`.
pub const DEFAULT_MAX_REQUEST_LEN: u32 = 64 * 1024;
/// Default pools the relay holds at once; a card set that would attach more is refused
/// (logged and counted per refused endpoint).
pub const DEFAULT_MAX_POOLS: u32 = 1024;
/// Default concurrent TCP connections from one peer IP address.
pub const DEFAULT_MAX_CONNECTIONS_PER_PEER: u32 = 128;
/// Default filter table bytes the relay holds across pools (the pool crate's own
/// default, 4 GiB).
pub const DEFAULT_MAX_FILTER_BYTES_TOTAL: u64 = kvrelay_pool::DEFAULT_MAX_FILTER_BYTES_TOTAL;
/// Default time a pool actor may hold pending events without finishing a command before
/// the pool counts as stalled (`/readyz` 503, withheld from the catalog), in ms.
pub const DEFAULT_POOL_STALL_TIMEOUT_MS: u64 = 10_000;

/// Every bound of the relay server. Plain data; see the `DEFAULT_*` consts for defaults.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Concurrent `WatchCatalog` streams.
    pub max_catalog_streams: u32,
    /// Concurrent `SubscribePool` streams across all pools.
    pub max_pool_streams_total: u32,
    /// Concurrent subscribers of one pool.
    pub max_subscribers_per_pool: u32,
    /// Concurrent streams of one type from one peer IP address (pool streams: of one
    /// pool), on both doors together.
    pub max_streams_per_peer: u32,
    /// Concurrent `WatchLoad` streams.
    pub max_load_streams: u32,
    /// Concurrent `WatchTopology` streams.
    pub max_topology_streams: u32,
    /// Concurrent `RelayInfo` requests.
    pub max_info_streams: u32,
    /// Concurrent TCP connections (accepted sockets).
    pub max_connections: u32,
    /// Publication hubs holding a filter mirror at once.
    pub max_initialized_hubs: u32,
    /// Time from accept to a complete stream request, TLS handshake included, in ms.
    pub request_timeout_ms: u64,
    /// Time one snapshot frame may wait for the client, in ms.
    pub snapshot_progress_timeout_ms: u64,
    /// Idle interval before a heartbeat, in ms.
    pub heartbeat_interval_ms: u64,
    /// Time one frame write may take, in ms.
    pub write_timeout_ms: u64,
    /// Load window, in ms.
    pub load_window_ms: u64,
    /// Largest frame read or written, in bytes.
    pub max_frame_len: u32,
    /// Bytes of deltas pending for one subscriber, after coalescing, before it is cut off
    /// as lagged; unset: one snapshot of the pool's table (at least 1 MiB). A backlog that
    /// merges into more than one frame holds is sent as several coalesced deltas.
    pub subscriber_backlog_bytes: Option<u64>,
    /// The backlog bound of a subscriber that takes every delta one by one (the gRPC door
    /// of Dynamo's contract, protocol minor 0) is at least this many bytes; 0: the same
    /// bound as everyone. Default: the stream's own (16 MiB, Dynamo's relay queue bound).
    pub uncoalesced_backlog_bytes: u64,
    /// Bytes of recent deltas each pool keeps for resuming consumers (0: never resume).
    pub resume_window_bytes: u64,
    /// Table versions one pool's snapshots in flight may pin, each a whole copy of the
    /// table once a delta arrives (the ckf publisher's default).
    pub max_pinned_snapshots_per_pool: u32,
    /// Publication window, in ms ([`DEFAULT_PUBLICATION_WINDOW_MS`]).
    pub publication_window_ms: u64,
    /// Changed buckets that end a publication window early ([`DEFAULT_MAX_DELTA_BUCKETS`]).
    pub max_delta_buckets: u32,
    /// Bound on the ordered shutdown, in ms.
    pub shutdown_timeout_ms: u64,
    /// Largest stream request frame (read before authentication), in bytes.
    pub max_request_len: u32,
    /// Concurrent TCP connections from one peer IP address.
    pub max_connections_per_peer: u32,
    /// Pools held at once.
    pub max_pools: u32,
    /// Filter table bytes held at once across pools ([`DEFAULT_MAX_FILTER_BYTES_TOTAL`]).
    pub max_filter_bytes_total: u64,
    /// Pending events without progress before a pool counts as stalled
    /// ([`DEFAULT_POOL_STALL_TIMEOUT_MS`]).
    pub pool_stall_timeout_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_catalog_streams: DEFAULT_MAX_CATALOG_STREAMS,
            max_pool_streams_total: DEFAULT_MAX_POOL_STREAMS_TOTAL,
            max_subscribers_per_pool: DEFAULT_MAX_SUBSCRIBERS_PER_POOL,
            max_streams_per_peer: DEFAULT_MAX_STREAMS_PER_PEER,
            max_load_streams: DEFAULT_MAX_LOAD_STREAMS,
            max_topology_streams: DEFAULT_MAX_TOPOLOGY_STREAMS,
            max_info_streams: DEFAULT_MAX_INFO_STREAMS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_initialized_hubs: DEFAULT_MAX_INITIALIZED_HUBS,
            request_timeout_ms: DEFAULT_REQUEST_TIMEOUT_MS,
            snapshot_progress_timeout_ms: DEFAULT_SNAPSHOT_PROGRESS_TIMEOUT_MS,
            heartbeat_interval_ms: DEFAULT_HEARTBEAT_INTERVAL_MS,
            write_timeout_ms: DEFAULT_WRITE_TIMEOUT_MS,
            load_window_ms: DEFAULT_LOAD_WINDOW_MS,
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            subscriber_backlog_bytes: None,
            uncoalesced_backlog_bytes: kvrelay_ckf::stream::DEFAULT_MIN_UNCOALESCED_BACKLOG_BYTES,
            resume_window_bytes: DEFAULT_RESUME_WINDOW_BYTES,
            max_pinned_snapshots_per_pool: kvrelay_pool::StreamLimits::default()
                .max_pinned_snapshots as u32,
            publication_window_ms: DEFAULT_PUBLICATION_WINDOW_MS,
            max_delta_buckets: DEFAULT_MAX_DELTA_BUCKETS,
            shutdown_timeout_ms: DEFAULT_SHUTDOWN_TIMEOUT_MS,
            max_request_len: DEFAULT_MAX_REQUEST_LEN,
            max_connections_per_peer: DEFAULT_MAX_CONNECTIONS_PER_PEER,
            max_pools: DEFAULT_MAX_POOLS,
            max_filter_bytes_total: DEFAULT_MAX_FILTER_BYTES_TOTAL,
            pool_stall_timeout_ms: DEFAULT_POOL_STALL_TIMEOUT_MS,
        }
    }
}

/// Longest duration accepted for any `*_ms` limit: one year, well inside tokio's timer range.
const MAX_DURATION_MS: u64 = 365 * 24 * 3600 * 1000;
/// Smallest accepted stream request limit: a frame header plus a request with the longest
/// subscriber id and token the protocol allows.
pub const MIN_MAX_REQUEST_LEN: u32 = 8 * 1024;

/// Smallest accepted frame limit (the codec's): a frame must hold a maximal CBI1 chunk
/// plus envelope headroom.
pub const MIN_MAX_FRAME_LEN: u32 = kvrelay_codec::limits::MIN_MAX_FRAME_LEN;

impl Limits {
    /// Checks that every capacity is nonzero, every duration is in `1..=1 year` and the frame
    /// limit holds a maximal snapshot chunk.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let counts = [
            ("max_catalog_streams", u64::from(self.max_catalog_streams)),
            (
                "max_pool_streams_total",
                u64::from(self.max_pool_streams_total),
            ),
            (
                "max_subscribers_per_pool",
                u64::from(self.max_subscribers_per_pool),
            ),
            ("max_streams_per_peer", u64::from(self.max_streams_per_peer)),
            ("max_load_streams", u64::from(self.max_load_streams)),
            ("max_topology_streams", u64::from(self.max_topology_streams)),
            ("max_info_streams", u64::from(self.max_info_streams)),
            ("max_connections", u64::from(self.max_connections)),
            ("max_initialized_hubs", u64::from(self.max_initialized_hubs)),
            (
                "subscriber_backlog_bytes",
                self.subscriber_backlog_bytes.unwrap_or(1),
            ),
            ("max_delta_buckets", u64::from(self.max_delta_buckets)),
            (
                "max_pinned_snapshots_per_pool",
                u64::from(self.max_pinned_snapshots_per_pool),
            ),
            (
                "max_connections_per_peer",
                u64::from(self.max_connections_per_peer),
            ),
            ("max_pools", u64::from(self.max_pools)),
            ("max_filter_bytes_total", self.max_filter_bytes_total),
        ];
        for (name, value) in counts {
            if value == 0 {
                return Err(ConfigError::InvalidLimit {
                    name,
                    value,
                    reason: "must be nonzero",
                });
            }
        }
        let durations = [
            ("request_timeout_ms", self.request_timeout_ms),
            (
                "snapshot_progress_timeout_ms",
                self.snapshot_progress_timeout_ms,
            ),
            ("heartbeat_interval_ms", self.heartbeat_interval_ms),
            ("write_timeout_ms", self.write_timeout_ms),
            ("load_window_ms", self.load_window_ms),
            ("shutdown_timeout_ms", self.shutdown_timeout_ms),
            ("pool_stall_timeout_ms", self.pool_stall_timeout_ms),
            ("publication_window_ms", self.publication_window_ms),
        ];
        for (name, value) in durations {
            if value == 0 || value > MAX_DURATION_MS {
                return Err(ConfigError::InvalidLimit {
                    name,
                    value,
                    reason: "must be between 1 ms and one year",
                });
            }
        }
        if self.max_frame_len < MIN_MAX_FRAME_LEN {
            return Err(ConfigError::InvalidLimit {
                name: "max_frame_len",
                value: u64::from(self.max_frame_len),
                reason: "must hold a maximal snapshot chunk (at least 4259904 bytes)",
            });
        }
        let max_delta_frame = u64::from(self.max_delta_buckets)
            .saturating_mul(kvrelay_ckf::stream::IMAGE_WIRE_BYTES)
            .saturating_add(kvrelay_ckf::stream::DELTA_FRAME_OVERHEAD);
        if max_delta_frame > u64::from(self.max_frame_len) {
            return Err(ConfigError::InvalidLimit {
                name: "max_delta_buckets",
                value: u64::from(self.max_delta_buckets),
                reason: "a delta of that many buckets (12 bytes each) must fit max_frame_len",
            });
        }
        self.pool()
            .validate()
            .map_err(|err| ConfigError::InvalidLimit {
                name: "pool",
                value: 0,
                reason: if matches!(err, kvrelay_pool::LimitsError::Codec(_)) {
                    "max_frame_len is outside the codec's range"
                } else {
                    "a pool or stream bound is zero"
                },
            })?;
        if self.max_request_len < MIN_MAX_REQUEST_LEN || self.max_request_len > self.max_frame_len {
            return Err(ConfigError::InvalidLimit {
                name: "max_request_len",
                value: u64::from(self.max_request_len),
                reason: "must be at least 8192 bytes and at most max_frame_len",
            });
        }
        Ok(())
    }

    /// The codec's bounds, composed from these.
    pub fn codec(&self) -> kvrelay_codec::Limits {
        kvrelay_codec::Limits {
            max_frame_len: self.max_frame_len,
        }
    }

    /// The pool registry's bounds, composed from these (every other pool bound keeps the
    /// pool crate's own default).
    pub fn pool(&self) -> kvrelay_pool::Limits {
        let defaults = kvrelay_pool::Limits::default();
        kvrelay_pool::Limits {
            max_initialized_hubs: self.max_initialized_hubs as usize,
            max_pools: self.max_pools as usize,
            max_filter_bytes_total: self.max_filter_bytes_total,
            publication_window: Duration::from_millis(self.publication_window_ms),
            max_delta_buckets: self.max_delta_buckets,
            stream: kvrelay_pool::StreamLimits {
                max_subscribers: self.max_subscribers_per_pool as usize,
                max_backlog_bytes: self.subscriber_backlog_bytes,
                min_uncoalesced_backlog_bytes: self.uncoalesced_backlog_bytes,
                resume_window_bytes: self.resume_window_bytes,
                max_pinned_snapshots: self.max_pinned_snapshots_per_pool as usize,
                heartbeat_interval: self.heartbeat_interval(),
                snapshot_progress_timeout: self.snapshot_progress_timeout(),
                ..defaults.stream.clone()
            },
            codec: self.codec(),
            ..defaults
        }
    }

    /// The pool stall bound as a `Duration`.
    pub fn pool_stall_timeout(&self) -> Duration {
        Duration::from_millis(self.pool_stall_timeout_ms)
    }

    /// How often pool health is checked: a quarter of the stall bound, within 10 ms..1 s,
    /// so a stall is seen at most a quarter bound late.
    pub fn pool_health_interval(&self) -> Duration {
        Duration::from_millis((self.pool_stall_timeout_ms / 4).clamp(10, 1_000))
    }

    /// Every stream the relay admits at once, all types together (the bound on calls one
    /// Dynamo-contract connection may carry).
    pub fn max_streams_admitted(&self) -> u32 {
        [
            self.max_info_streams,
            self.max_catalog_streams,
            self.max_pool_streams_total,
            self.max_load_streams,
            self.max_topology_streams,
        ]
        .into_iter()
        .fold(0u32, u32::saturating_add)
    }

    /// The request timeout as a `Duration`.
    pub fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// The snapshot progress timeout as a `Duration`.
    pub fn snapshot_progress_timeout(&self) -> Duration {
        Duration::from_millis(self.snapshot_progress_timeout_ms)
    }

    /// The heartbeat interval as a `Duration`.
    pub fn heartbeat_interval(&self) -> Duration {
        Duration::from_millis(self.heartbeat_interval_ms)
    }

    /// The per-frame write timeout as a `Duration`.
    pub fn write_timeout(&self) -> Duration {
        Duration::from_millis(self.write_timeout_ms)
    }

    /// The load window as a `Duration`.
    pub fn load_window(&self) -> Duration {
        Duration::from_millis(self.load_window_ms)
    }

    /// The shutdown bound as a `Duration`.
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown_timeout_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(Limits::default().validate(), Ok(()));
    }

    #[test]
    fn subscribers_without_coalescing_get_their_own_backlog_floor() {
        let limits: Limits = toml::from_str("subscriber_backlog_bytes = 1048576").unwrap();
        let stream = limits.pool().stream;
        assert_eq!(
            (
                stream.backlog_bound(1024),
                stream.uncoalesced_backlog_bound(1024)
            ),
            (1 << 20, 16 << 20)
        );
        let same: Limits =
            toml::from_str("subscriber_backlog_bytes = 1048576\nuncoalesced_backlog_bytes = 0")
                .unwrap();
        assert_eq!(same.validate(), Ok(()));
        assert_eq!(same.pool().stream.uncoalesced_backlog_bound(1024), 1 << 20);
    }

    #[test]
    fn zero_capacity_is_rejected_with_its_name() {
        let limits = Limits {
            max_subscribers_per_pool: 0,
            ..Limits::default()
        };
        let err = limits.validate().unwrap_err();
        assert_eq!(
            err.to_string(),
            "limit max_subscribers_per_pool = 0 must be nonzero"
        );
    }

    #[test]
    fn zero_duration_is_rejected() {
        let limits = Limits {
            heartbeat_interval_ms: 0,
            ..Limits::default()
        };
        assert!(matches!(
            limits.validate(),
            Err(ConfigError::InvalidLimit {
                name: "heartbeat_interval_ms",
                ..
            })
        ));
    }

    #[test]
    fn frame_limit_must_hold_a_snapshot_chunk() {
        let limits = Limits {
            max_frame_len: 1024,
            ..Limits::default()
        };
        assert!(matches!(
            limits.validate(),
            Err(ConfigError::InvalidLimit {
                name: "max_frame_len",
                ..
            })
        ));
    }
}
