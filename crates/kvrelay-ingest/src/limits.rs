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

/// Default [`Limits::idle_reconnect_ms`].
pub const DEFAULT_IDLE_RECONNECT_MS: u64 = 10_000;

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
    /// Silence after which a ZMQ subscriber reconnects (ms). The pure-Rust transport
    /// does not report a vanished publisher, so a restarted engine is found again by
    /// reconnecting after this much silence.
    pub idle_reconnect_ms: u64,
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
            idle_reconnect_ms: DEFAULT_IDLE_RECONNECT_MS,
        }
    }
}
