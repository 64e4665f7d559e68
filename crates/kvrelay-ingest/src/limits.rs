//! Every bound of the ingest crate, with its documented default.
//!
//! `Limits` is plain data; the relay reads it from its `[ingest]` TOML table (every key
//! optional, falling back to the const beside it) and checks it with [`Limits::validate`]
//! before any source starts.

use std::time::Duration;

use kvrelay_pacing::BackoffConfig;
use serde::{Deserialize, Serialize};

/// Default [`Limits::max_events_per_batch`].
pub const DEFAULT_MAX_EVENTS_PER_BATCH: u32 = 65_536;
/// Default [`Limits::max_blocks_per_event`].
pub const DEFAULT_MAX_BLOCKS_PER_EVENT: u32 = 65_536;
/// Default [`Limits::max_tokens_per_event`] (1 Mi tokens).
pub const DEFAULT_MAX_TOKENS_PER_EVENT: u32 = 1 << 20;
/// Default [`Limits::max_payload_bytes`] (64 MiB, the TensorRT-LLM publisher's cap).
pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 64 << 20;
/// Default [`Limits::output_queue_depth`] (messages).
pub const DEFAULT_OUTPUT_QUEUE_DEPTH: usize = 1_024;
/// Default [`Limits::live_queue_depth`] (transport messages between reader and tracker).
pub const DEFAULT_LIVE_QUEUE_DEPTH: usize = 1_024;
/// Default [`Limits::max_buffered_during_replay`] (batches).
pub const DEFAULT_MAX_BUFFERED_DURING_REPLAY: usize = 10_000;
/// Default [`Limits::replay_timeout_ms`].
pub const DEFAULT_REPLAY_TIMEOUT_MS: u64 = 5_000;
/// Default [`Limits::shutdown_timeout_ms`].
pub const DEFAULT_SHUTDOWN_TIMEOUT_MS: u64 = 2_000;

/// Default [`Limits::heartbeat_interval_ms`].
pub const DEFAULT_HEARTBEAT_INTERVAL_MS: u64 = 1_000;
/// Default [`Limits::heartbeat_timeout_ms`].
pub const DEFAULT_HEARTBEAT_TIMEOUT_MS: u64 = 3_000;
/// Default [`Limits::handshake_timeout_ms`].
pub const DEFAULT_HANDSHAKE_TIMEOUT_MS: u64 = 5_000;
/// Default [`Limits::reconnect_interval_ms`].
pub const DEFAULT_RECONNECT_INTERVAL_MS: u64 = 100;
/// Default [`Limits::reconnect_interval_max_ms`].
pub const DEFAULT_RECONNECT_INTERVAL_MAX_MS: u64 = 5_000;
/// Default [`Limits::receive_high_water_mark`] (messages queued inside libzmq).
pub const DEFAULT_RECEIVE_HIGH_WATER_MARK: u32 = 10_000;
/// Default [`Limits::restart_backoff_initial_ms`].
pub const DEFAULT_RESTART_BACKOFF_INITIAL_MS: u64 = 100;
/// Default [`Limits::restart_backoff_max_ms`].
pub const DEFAULT_RESTART_BACKOFF_MAX_MS: u64 = 5_000;
/// Default [`Limits::log_interval_ms`].
pub const DEFAULT_LOG_INTERVAL_MS: u64 = 10_000;
/// Default [`Limits::tail_probe_idle_ms`].
pub const DEFAULT_TAIL_PROBE_IDLE_MS: u64 = 1_000;
/// Default [`Limits::max_queued_bytes`] (128 MiB): two messages of the largest default
/// payload.
pub const DEFAULT_MAX_QUEUED_BYTES: usize = 128 << 20;
/// Default [`Limits::max_queued_bytes_total`] (1 GiB): eight sources at their own
/// default bound at once.
pub const DEFAULT_MAX_QUEUED_BYTES_TOTAL: usize = 1 << 30;
/// Largest accepted [`Limits::max_queued_bytes`] and [`Limits::max_queued_bytes_total`]
/// (64 GiB).
pub const MAX_QUEUED_BYTES_CAP: usize = 1 << 36;
/// Default payload limit of a Dynamo NATS source (1 MiB): one JSON router event list.
pub const DEFAULT_NATS_MAX_PAYLOAD_BYTES: usize = 1 << 20;

/// Largest accepted [`Limits::max_payload_bytes`] (1 GiB): far above any engine's message,
/// small enough that libzmq's message-size check stays meaningful.
pub const MAX_PAYLOAD_BYTES_CAP: usize = 1 << 30;
/// Largest accepted queue depth or buffered-batch count (1 Mi entries); each entry may hold a
/// whole payload, so the product with `max_payload_bytes` is the real memory bound.
pub const MAX_QUEUE_DEPTH_CAP: usize = 1 << 20;
/// Largest accepted [`Limits::receive_high_water_mark`] (1 Mi messages).
pub const MAX_RECEIVE_HIGH_WATER_MARK_CAP: u32 = 1 << 20;
/// Longest accepted duration of any `*_ms` bound: one day, inside libzmq's `int`
/// millisecond options.
pub const MAX_DURATION_MS: u64 = 24 * 3600 * 1000;

/// A [`Limits`] value that [`Limits::validate`] refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("ingest limit {name} = {value} {reason}")]
pub struct LimitError {
    /// The field (the `[ingest]` key).
    pub name: &'static str,
    /// The offending value.
    pub value: u64,
    /// What is expected.
    pub reason: &'static str,
}

/// Bounds on decoding, buffering and waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Events one batch may declare.
    pub max_events_per_batch: u32,
    /// Block hashes one event may declare.
    pub max_blocks_per_event: u32,
    /// Token positions one stored event may declare.
    pub max_tokens_per_event: u32,
    /// Largest transport payload accepted (bytes).
    pub max_payload_bytes: usize,
    /// Depth of a source's output queue (messages); a full queue applies backpressure.
    pub output_queue_depth: usize,
    /// Depth of the queue from the socket reader to the sequence tracker (messages).
    pub live_queue_depth: usize,
    /// Live batches buffered while a replay runs; overflow resets the source.
    pub max_buffered_during_replay: usize,
    /// Bytes of received ZMQ messages one source holds at once, wherever they wait (the
    /// reader-to-driver queue, the replay buffer, the batch being applied). A message that
    /// would pass it is dropped on arrival and counted (`overflow`), so the source sees a gap
    /// (replayed, or a reset). At least `max_payload_bytes`.
    pub max_queued_bytes: usize,
    /// Bytes of received ZMQ messages all the sources of one relay hold together (its
    /// owner makes one [`crate::QueueBudget`] of it and gives it to every source): past
    /// it a message is dropped on arrival and counted (`overflow`) like one over
    /// `max_queued_bytes`. Without it the relay's memory for queued messages would grow
    /// with the number of engines. At least `max_payload_bytes`.
    pub max_queued_bytes_total: usize,
    /// How long one replay may take before it counts as failed (ms).
    pub replay_timeout_ms: u64,
    /// How long shutdown waits for a source's tasks (ms).
    pub shutdown_timeout_ms: u64,
    /// ZMTP heartbeat interval of a ZMQ subscriber (ms): a PING is sent after this much
    /// silence from the publisher.
    pub heartbeat_interval_ms: u64,
    /// How long a PING may stay unanswered before the connection is dropped and redialled
    /// (ms); a vanished publisher is detected within interval + timeout.
    pub heartbeat_timeout_ms: u64,
    /// How long a connection may take to complete the ZMTP handshake (ms).
    pub handshake_timeout_ms: u64,
    /// First delay before libzmq redials a lost publisher (ms).
    pub reconnect_interval_ms: u64,
    /// Longest redial delay (ms); the delay doubles up to it.
    pub reconnect_interval_max_ms: u64,
    /// Messages libzmq queues for a subscriber before it drops new ones (ZMQ_RCVHWM).
    pub receive_high_water_mark: u32,
    /// First delay before a failed or panicked source reader is restarted (ms).
    pub restart_backoff_initial_ms: u64,
    /// Longest restart delay (ms); the delay doubles up to it.
    pub restart_backoff_max_ms: u64,
    /// Rejections are logged at most once per source, reason and interval (ms), with the
    /// count since the previous line.
    pub log_interval_ms: u64,
    /// With a replay endpoint: silence after the last batch after which the replay socket
    /// is asked for anything newer, so a tail lost in flight is recovered (ms).
    pub tail_probe_idle_ms: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_events_per_batch: DEFAULT_MAX_EVENTS_PER_BATCH,
            max_blocks_per_event: DEFAULT_MAX_BLOCKS_PER_EVENT,
            max_tokens_per_event: DEFAULT_MAX_TOKENS_PER_EVENT,
            max_payload_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            output_queue_depth: DEFAULT_OUTPUT_QUEUE_DEPTH,
            live_queue_depth: DEFAULT_LIVE_QUEUE_DEPTH,
            max_buffered_during_replay: DEFAULT_MAX_BUFFERED_DURING_REPLAY,
            max_queued_bytes: DEFAULT_MAX_QUEUED_BYTES,
            max_queued_bytes_total: DEFAULT_MAX_QUEUED_BYTES_TOTAL,
            replay_timeout_ms: DEFAULT_REPLAY_TIMEOUT_MS,
            shutdown_timeout_ms: DEFAULT_SHUTDOWN_TIMEOUT_MS,
            heartbeat_interval_ms: DEFAULT_HEARTBEAT_INTERVAL_MS,
            heartbeat_timeout_ms: DEFAULT_HEARTBEAT_TIMEOUT_MS,
            handshake_timeout_ms: DEFAULT_HANDSHAKE_TIMEOUT_MS,
            reconnect_interval_ms: DEFAULT_RECONNECT_INTERVAL_MS,
            reconnect_interval_max_ms: DEFAULT_RECONNECT_INTERVAL_MAX_MS,
            receive_high_water_mark: DEFAULT_RECEIVE_HIGH_WATER_MARK,
            restart_backoff_initial_ms: DEFAULT_RESTART_BACKOFF_INITIAL_MS,
            restart_backoff_max_ms: DEFAULT_RESTART_BACKOFF_MAX_MS,
            log_interval_ms: DEFAULT_LOG_INTERVAL_MS,
            tail_probe_idle_ms: DEFAULT_TAIL_PROBE_IDLE_MS,
        }
    }
}

impl Limits {
    /// The backoff every engine-source reconnect loop runs under (ZMQ reader restarts,
    /// the NATS subscription): doubling from `restart_backoff_initial_ms` to
    /// `restart_backoff_max_ms`; a source that stayed up longer than the ceiling starts over.
    pub fn restart_backoff(&self) -> BackoffConfig {
        let initial = Duration::from_millis(self.restart_backoff_initial_ms.max(1));
        let max = Duration::from_millis(self.restart_backoff_max_ms).max(initial);
        BackoffConfig::doubling(initial, max)
    }

    /// Checks every bound: counts nonzero and within their caps (a zero
    /// `receive_high_water_mark` would mean *unbounded* to libzmq), durations within
    /// `1 ms..=1 day`, and each backoff's ceiling at least its first delay.
    pub fn validate(&self) -> Result<(), LimitError> {
        let widen = |value: usize| u64::try_from(value).unwrap_or(u64::MAX);
        let counts = [
            (
                "max_events_per_batch",
                u64::from(self.max_events_per_batch),
                u64::MAX,
            ),
            (
                "max_blocks_per_event",
                u64::from(self.max_blocks_per_event),
                u64::MAX,
            ),
            (
                "max_tokens_per_event",
                u64::from(self.max_tokens_per_event),
                u64::MAX,
            ),
            (
                "max_payload_bytes",
                widen(self.max_payload_bytes),
                widen(MAX_PAYLOAD_BYTES_CAP),
            ),
            (
                "output_queue_depth",
                widen(self.output_queue_depth),
                widen(MAX_QUEUE_DEPTH_CAP),
            ),
            (
                "live_queue_depth",
                widen(self.live_queue_depth),
                widen(MAX_QUEUE_DEPTH_CAP),
            ),
            (
                "max_buffered_during_replay",
                widen(self.max_buffered_during_replay),
                widen(MAX_QUEUE_DEPTH_CAP),
            ),
            (
                "receive_high_water_mark",
                u64::from(self.receive_high_water_mark),
                u64::from(MAX_RECEIVE_HIGH_WATER_MARK_CAP),
            ),
            (
                "max_queued_bytes",
                widen(self.max_queued_bytes),
                widen(MAX_QUEUED_BYTES_CAP),
            ),
            (
                "max_queued_bytes_total",
                widen(self.max_queued_bytes_total),
                widen(MAX_QUEUED_BYTES_CAP),
            ),
        ];
        for (name, value, cap) in counts {
            if value == 0 {
                return Err(LimitError {
                    name,
                    value,
                    reason: "must be nonzero",
                });
            }
            if value > cap {
                return Err(LimitError {
                    name,
                    value,
                    reason: "is above its documented cap",
                });
            }
        }
        for (name, bytes) in [
            ("max_queued_bytes", self.max_queued_bytes),
            ("max_queued_bytes_total", self.max_queued_bytes_total),
        ] {
            if bytes < self.max_payload_bytes {
                return Err(LimitError {
                    name,
                    value: widen(bytes),
                    reason: "is below max_payload_bytes (a largest message could never be held)",
                });
            }
        }
        let durations = [
            ("replay_timeout_ms", self.replay_timeout_ms),
            ("shutdown_timeout_ms", self.shutdown_timeout_ms),
            ("heartbeat_interval_ms", self.heartbeat_interval_ms),
            ("heartbeat_timeout_ms", self.heartbeat_timeout_ms),
            ("handshake_timeout_ms", self.handshake_timeout_ms),
            ("reconnect_interval_ms", self.reconnect_interval_ms),
            ("reconnect_interval_max_ms", self.reconnect_interval_max_ms),
            (
                "restart_backoff_initial_ms",
                self.restart_backoff_initial_ms,
            ),
            ("restart_backoff_max_ms", self.restart_backoff_max_ms),
            ("log_interval_ms", self.log_interval_ms),
            ("tail_probe_idle_ms", self.tail_probe_idle_ms),
        ];
        for (name, value) in durations {
            if value == 0 || value > MAX_DURATION_MS {
                return Err(LimitError {
                    name,
                    value,
                    reason: "must be between 1 ms and one day",
                });
            }
        }
        if self.reconnect_interval_max_ms < self.reconnect_interval_ms {
            return Err(LimitError {
                name: "reconnect_interval_max_ms",
                value: self.reconnect_interval_max_ms,
                reason: "must be at least reconnect_interval_ms",
            });
        }
        if self.restart_backoff_max_ms < self.restart_backoff_initial_ms {
            return Err(LimitError {
                name: "restart_backoff_max_ms",
                value: self.restart_backoff_max_ms,
                reason: "must be at least restart_backoff_initial_ms",
            });
        }
        Ok(())
    }

    /// The defaults with the NATS payload limit ([`DEFAULT_NATS_MAX_PAYLOAD_BYTES`]): a
    /// Dynamo event list is small, and anyone able to publish on the subject could
    /// otherwise make the relay parse up to the ZMQ limit per message.
    pub fn nats() -> Self {
        Self {
            max_payload_bytes: DEFAULT_NATS_MAX_PAYLOAD_BYTES,
            ..Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test")]

    use super::*;

    #[test]
    fn the_defaults_and_the_nats_defaults_are_valid() {
        assert_eq!(Limits::default().validate(), Ok(()));
        assert_eq!(Limits::nats().validate(), Ok(()));
    }

    #[test]
    fn a_zero_high_water_mark_is_refused_because_libzmq_reads_it_as_unbounded() {
        let limits = Limits {
            receive_high_water_mark: 0,
            ..Limits::default()
        };
        let err = limits.validate().unwrap_err();
        assert_eq!(err.name, "receive_high_water_mark");
        assert_eq!(err.reason, "must be nonzero");
    }

    #[test]
    fn the_relay_wide_byte_budget_holds_a_largest_message_and_has_a_cap() {
        let below = Limits {
            max_queued_bytes_total: DEFAULT_MAX_PAYLOAD_BYTES - 1,
            ..Limits::default()
        };
        assert_eq!(below.validate().unwrap_err().name, "max_queued_bytes_total");
        let above = Limits {
            max_queued_bytes_total: MAX_QUEUED_BYTES_CAP + 1,
            ..Limits::default()
        };
        let err = above.validate().unwrap_err();
        assert_eq!(
            (err.name, err.reason),
            ("max_queued_bytes_total", "is above its documented cap")
        );
        // Below one source's own bound is allowed: the smaller bound wins.
        let tight = Limits {
            max_queued_bytes_total: DEFAULT_MAX_PAYLOAD_BYTES,
            ..Limits::default()
        };
        assert_eq!(tight.validate(), Ok(()));
    }

    #[test]
    fn a_byte_budget_below_one_largest_message_is_refused() {
        let limits = Limits {
            max_queued_bytes: DEFAULT_MAX_PAYLOAD_BYTES - 1,
            ..Limits::default()
        };
        let err = limits.validate().unwrap_err();
        assert_eq!(err.name, "max_queued_bytes");
        let fits = Limits {
            max_queued_bytes: DEFAULT_MAX_PAYLOAD_BYTES,
            ..Limits::default()
        };
        assert_eq!(fits.validate(), Ok(()));
    }

    #[test]
    fn every_count_and_duration_is_checked_by_name() {
        let cases: [(&str, Limits); 6] = [
            (
                "output_queue_depth",
                Limits {
                    output_queue_depth: 0,
                    ..Limits::default()
                },
            ),
            (
                "max_payload_bytes",
                Limits {
                    max_payload_bytes: MAX_PAYLOAD_BYTES_CAP + 1,
                    ..Limits::default()
                },
            ),
            (
                "max_buffered_during_replay",
                Limits {
                    max_buffered_during_replay: MAX_QUEUE_DEPTH_CAP + 1,
                    ..Limits::default()
                },
            ),
            (
                "tail_probe_idle_ms",
                Limits {
                    tail_probe_idle_ms: 0,
                    ..Limits::default()
                },
            ),
            (
                "heartbeat_timeout_ms",
                Limits {
                    heartbeat_timeout_ms: MAX_DURATION_MS + 1,
                    ..Limits::default()
                },
            ),
            (
                "reconnect_interval_max_ms",
                Limits {
                    reconnect_interval_ms: 500,
                    reconnect_interval_max_ms: 100,
                    ..Limits::default()
                },
            ),
        ];
        for (name, limits) in cases {
            assert_eq!(limits.validate().map_err(|err| err.name), Err(name));
        }
    }

    #[test]
    fn the_restart_backoff_ceiling_must_reach_its_first_delay() {
        let limits = Limits {
            restart_backoff_initial_ms: 2_000,
            restart_backoff_max_ms: 1_000,
            ..Limits::default()
        };
        assert_eq!(
            limits.validate().map_err(|err| err.name),
            Err("restart_backoff_max_ms")
        );
    }

    #[test]
    fn a_partial_table_keeps_the_other_defaults() {
        let limits: Limits =
            serde_json::from_str(r#"{"tail_probe_idle_ms": 250, "output_queue_depth": 64}"#)
                .unwrap();
        assert_eq!(limits.tail_probe_idle_ms, 250);
        assert_eq!(limits.output_queue_depth, 64);
        assert_eq!(limits.max_payload_bytes, DEFAULT_MAX_PAYLOAD_BYTES);
        let unknown = serde_json::from_str::<Limits>(r#"{"tail_probe_idle": 250}"#);
        assert!(unknown.is_err(), "a misspelt key must be refused");
    }
}
