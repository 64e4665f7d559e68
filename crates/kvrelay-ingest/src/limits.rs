//! Every bound of the ingest crate, with its documented default.

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
/// Default payload limit of a Dynamo NATS source (1 MiB): one JSON router event list.
pub const DEFAULT_NATS_MAX_PAYLOAD_BYTES: usize = 1 << 20;

/// Bounds on decoding, buffering and waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
