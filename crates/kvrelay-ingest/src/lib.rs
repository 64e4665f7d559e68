//! KV event sources: vLLM and SGLang over ZMQ, Dynamo's event plane over ZMQ and NATS,
//! trace replay.
//!
//! Every source yields canonical [`kvrelay_ckf::RouterEvent`]s for one or more
//! `(worker_id, dp_rank)` sources, in each source's order, plus lifecycle signals.
//!
//! # Layers
//!
//! - Pure (no tokio, usable anywhere): [`decode_engine_batch`] (msgpack → [`EngineBatch`]),
//!   [`Canonicalizer`] ([`EngineBatch`] → router events, with the media/attention-group
//!   filtering rule), [`SequenceTracker`] (gap → replay, buffering, resets), the event
//!   trace format and the [`TraceWorkload`] generator.
//! - Async shells: the ZMQ source, the NATS source and trace replay wrap the pure parts.
//!
//! The transports are default features: `zmq` (the ZMQ source, libzmq) and `nats` (the
//! NATS source, async-nats). Without them the crate keeps its decoders, the canonicalizer,
//! trace replay and the event-plane parsers (the fuzz targets build it so).
//!
//! Malformed input is a typed error, counted per source and kind; a source never stops
//! on bad data. Start reading at [`decode_engine_batch`] and [`Canonicalizer`].

// Without a transport, the shells' shared parts (budgets, rejection logs, source
// bookkeeping) have no caller; they are built anyway, so the crate compiles the same way.
#![cfg_attr(
    not(all(feature = "zmq", feature = "nats")),
    allow(
        dead_code,
        reason = "shared shell helpers serve the transport features"
    )
)]

mod canonical;
mod dynamo_event;
mod engine;
mod engine_decoder;
mod engine_encoder;
mod error;
mod event_plane;
mod event_trace;
pub mod limits;
mod log_limit;
mod metered;
mod msgpack;
#[cfg(feature = "nats")]
mod nats_source;
mod sequence;
mod source;
mod stats;
mod trace_replay;
mod workload;
mod zmq_config;
mod zmq_frames;
#[cfg(feature = "zmq")]
mod zmq_source;
#[cfg(feature = "zmq")]
mod zmq_transport;

pub use canonical::{
    BatchOutcome, CanonicalConfig, CanonicalEvent, Canonicalizer, is_device_medium,
    stored_token_hashes, tier_of_medium,
};
pub use dynamo_event::{
    DynamoDecoded, DynamoEventError, decode_dynamo_events, decode_dynamo_events_msgpack,
    dynamo_kv_event_subject, tier_of_storage_tier,
};
pub use engine::{
    BlockRemoved, BlockStored, EngineBatch, EngineBlockHash, EngineEvent, EngineKind, ExtraKey,
    HashRepr, TokenIds,
};
pub use engine_decoder::decode_engine_batch;
pub use engine_encoder::{EngineLayout, encode_engine_batch};
pub use error::{CanonicalizeError, DecodeError, RejectionKind, SourceError};
pub use event_plane::{
    EventPlaneError, EventPlaneMessage, FRAME_HEADER_BYTES as EVENT_PLANE_FRAME_HEADER_BYTES,
    FRAME_VERSION as EVENT_PLANE_FRAME_VERSION, decode_event_plane_frame, encode_event_plane,
    parse_event_plane,
};
pub use event_trace::{
    EVENT_TRACE_FORMAT, EVENT_TRACE_VERSION, EventTrace, EventTraceHeader, RequestRecord,
    TimedEvent, TraceError, format_event, format_event_trace, format_header, parse_event,
    parse_event_trace, parse_header, parse_request_trace,
};
pub use limits::{LimitError, Limits};
pub use metered::QueueBudget;
#[cfg(feature = "nats")]
pub use nats_source::{NatsAuth, NatsSourceConfig, NatsTls, spawn_nats_source};
pub use sequence::{
    ResetReason, ResumePoint, SequenceAction, SequenceConfig, SequenceTracker, batch_digest,
};
pub use source::{SourceHandle, SourceOutput, SourceProbe, SourceSignal, SourceState, Transport};
pub use stats::{ReplayOutcome, SourceStats};
pub use trace_replay::{TraceReplayConfig, spawn_trace_replay};
pub use workload::{
    BUILTIN_REQUEST_TRACE, CacheChange, DEFAULT_WORKLOAD_SEED, Routing, StoredRun, TraceWorkload,
    TraceWorkloadConfig, WorkerCache, block_token_hash, block_tokens, request_tokens,
    route_by_first_block,
};
pub use zmq_config::{FaultInjection, ZmqSourceConfig, ZmqWire};
pub use zmq_frames::{ReplayReply, ZmqFrameError, parse_live, parse_replay, replay_request};
#[cfg(feature = "zmq")]
pub use zmq_source::spawn_zmq_source;
