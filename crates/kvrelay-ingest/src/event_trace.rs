//! The JSONL event-trace format (version 1) and the Mooncake-style request-trace format.
//!
//! An event trace is one JSON object per line. The first line is a header:
//! `{"format":"kvrelay-event-trace","version":1,"block_size":16,"hash_format":"dynamo_standard_v1"}`.
//! Every later line is one router event with its time offset:
//! - `{"t_ms":0,"worker_id":1,"dp_rank":0,"event_id":0,"kind":"stored","parent":null,"blocks":[[engine_block_id,token_hash],...]}`
//! - `{"t_ms":5,"worker_id":1,"dp_rank":0,"event_id":1,"kind":"removed","block_ids":[engine_block_id,...]}`
//! - `{"t_ms":9,"worker_id":1,"dp_rank":0,"event_id":2,"kind":"cleared"}`
//!
//! All ids and hashes are unsigned 64-bit JSON integers. Unknown keys are ignored; a bad
//! line is a typed error naming its line number, and readers skip it.
//!
//! A request trace (Mooncake FAST'25 style) is one object per line with `timestamp`
//! (ms), `input_length` (tokens), optional `output_length`, and `hash_ids` (the request's
//! prefix block ids; equal ids are the same block, a request's ids form its chain).

use kvrelay_ckf::{EventPayload, RemovedBlocks, RouterEvent, SourceId, StoredBlock, StoredBlocks};
use kvrelay_identity::KvQueryHashFormat;
use serde::{Deserialize, Serialize};

/// The header's `format` value.
pub const EVENT_TRACE_FORMAT: &str = "kvrelay-event-trace";
/// The event-trace version this crate writes and reads.
pub const EVENT_TRACE_VERSION: u32 = 1;

/// The first line of an event trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventTraceHeader {
    /// Always [`EVENT_TRACE_FORMAT`].
    pub format: String,
    /// Always [`EVENT_TRACE_VERSION`].
    pub version: u32,
    /// Tokens per block the token hashes were computed with.
    pub block_size: u32,
    /// The hash format the token hashes were computed with.
    pub hash_format: KvQueryHashFormat,
}

impl EventTraceHeader {
    /// A version-1 header.
    pub fn new(block_size: u32, hash_format: KvQueryHashFormat) -> Self {
        Self {
            format: EVENT_TRACE_FORMAT.to_owned(),
            version: EVENT_TRACE_VERSION,
            block_size,
            hash_format,
        }
    }
}

/// A router event at a time offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimedEvent {
    /// Milliseconds from the start of the trace.
    pub t_ms: u64,
    /// The event.
    pub event: RouterEvent,
}

/// One request of a request trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Arrival, ms from the start (0 when absent).
    #[serde(default)]
    pub timestamp: u64,
    /// Prompt length in tokens (0 when absent; the workload uses `hash_ids` only).
    #[serde(default)]
    pub input_length: u64,
    /// Output length in tokens.
    #[serde(default)]
    pub output_length: u64,
    /// Prefix block ids, in chain order.
    pub hash_ids: Vec<u64>,
}

/// A malformed trace line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceError {
    /// The line is not valid JSON of the expected shape.
    #[error("line {line_no}: {reason}")]
    Malformed {
        /// 1-based line number.
        line_no: usize,
        /// The JSON parser's message.
        reason: String,
    },
    /// The header names another format or version.
    #[error("line 1: unsupported trace format {format:?} version {version}")]
    UnsupportedHeader {
        /// The header's format.
        format: String,
        /// The header's version.
        version: u32,
    },
    /// The trace is empty.
    #[error("event trace has no header line")]
    MissingHeader,
}

/// The serialised form of one event line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct EventLine {
    t_ms: u64,
    worker_id: u64,
    #[serde(default)]
    dp_rank: u32,
    #[serde(default)]
    event_id: u64,
    #[serde(flatten)]
    body: EventBody,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum EventBody {
    Stored {
        parent: Option<u64>,
        blocks: Vec<(u64, u64)>,
    },
    Removed {
        block_ids: Vec<u64>,
    },
    Cleared,
}

/// Formats the header line (no trailing newline).
pub fn format_header(header: &EventTraceHeader) -> String {
    serde_json::to_string(header).unwrap_or_default()
}

/// Formats one event line (no trailing newline).
pub fn format_event(event: &TimedEvent) -> String {
    let body = match &event.event.payload {
        EventPayload::Stored(stored) => EventBody::Stored {
            parent: stored.parent_engine_block_id,
            blocks: stored
                .blocks
                .iter()
                .map(|block| (block.engine_block_id, block.token_hash))
                .collect(),
        },
        EventPayload::Removed(removed) => EventBody::Removed {
            block_ids: removed.engine_block_ids.clone(),
        },
        EventPayload::AllCleared => EventBody::Cleared,
    };
    let line = EventLine {
        t_ms: event.t_ms,
        worker_id: event.event.source.worker_id,
        dp_rank: event.event.source.dp_rank,
        event_id: event.event.event_id,
        body,
    };
    serde_json::to_string(&line).unwrap_or_default()
}

/// Writes a whole trace: the header, then one line per event.
pub fn format_event_trace(header: &EventTraceHeader, events: &[TimedEvent]) -> String {
    let mut out = format_header(header);
    out.push('\n');
    for event in events {
        out.push_str(&format_event(event));
        out.push('\n');
    }
    out
}

/// Parses the header line.
pub fn parse_header(line: &str) -> Result<EventTraceHeader, TraceError> {
    let header: EventTraceHeader =
        serde_json::from_str(line).map_err(|err| TraceError::Malformed {
            line_no: 1,
            reason: err.to_string(),
        })?;
    if header.format != EVENT_TRACE_FORMAT || header.version != EVENT_TRACE_VERSION {
        return Err(TraceError::UnsupportedHeader {
            format: header.format,
            version: header.version,
        });
    }
    Ok(header)
}

/// Parses one event line; `line_no` (1-based) is for the error.
pub fn parse_event(line: &str, line_no: usize) -> Result<TimedEvent, TraceError> {
    let parsed: EventLine = serde_json::from_str(line).map_err(|err| TraceError::Malformed {
        line_no,
        reason: err.to_string(),
    })?;
    let payload = match parsed.body {
        EventBody::Stored { parent, blocks } => EventPayload::Stored(StoredBlocks {
            parent_engine_block_id: parent,
            blocks: blocks
                .into_iter()
                .map(|(engine_block_id, token_hash)| StoredBlock {
                    engine_block_id,
                    token_hash,
                })
                .collect(),
        }),
        EventBody::Removed { block_ids } => EventPayload::Removed(RemovedBlocks {
            engine_block_ids: block_ids,
        }),
        EventBody::Cleared => EventPayload::AllCleared,
    };
    Ok(TimedEvent {
        t_ms: parsed.t_ms,
        event: RouterEvent {
            source: SourceId::new(parsed.worker_id, parsed.dp_rank),
            event_id: parsed.event_id,
            payload,
        },
    })
}

/// A parsed event trace: its header, the good events, and each bad line's error.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventTrace {
    /// The header.
    pub header: EventTraceHeader,
    /// Events of the good lines, in file order.
    pub events: Vec<TimedEvent>,
    /// One error per rejected line.
    pub rejected: Vec<TraceError>,
}

/// Parses a whole event trace; bad event lines are collected, a bad header fails.
pub fn parse_event_trace(text: &str) -> Result<EventTrace, TraceError> {
    let mut lines = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty());
    let (_, first) = lines.next().ok_or(TraceError::MissingHeader)?;
    let header = parse_header(first)?;
    let mut events = Vec::new();
    let mut rejected = Vec::new();
    for (idx, line) in lines {
        match parse_event(line, idx + 1) {
            Ok(event) => events.push(event),
            Err(err) => rejected.push(err),
        }
    }
    Ok(EventTrace {
        header,
        events,
        rejected,
    })
}

/// Parses a request trace; any bad line fails the whole trace.
pub fn parse_request_trace(text: &str) -> Result<Vec<RequestRecord>, TraceError> {
    text.lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(idx, line)| {
            serde_json::from_str(line).map_err(|err| TraceError::Malformed {
                line_no: idx + 1,
                reason: err.to_string(),
            })
        })
        .collect()
}
