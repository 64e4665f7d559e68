//! Typed errors of decoding, canonicalization and sources, and the rejection kinds they
//! are counted under.

/// A malformed engine message: the msgpack or its schema is not what any known engine
/// version sends.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The input ended inside a value.
    #[error("msgpack truncated at byte {offset}")]
    Truncated {
        /// Byte offset where more input was needed.
        offset: usize,
    },
    /// A byte that is not a msgpack marker (0xc1).
    #[error("invalid msgpack marker 0x{marker:02x} at byte {offset}")]
    InvalidMarker {
        /// Byte offset of the marker.
        offset: usize,
        /// The marker byte.
        marker: u8,
    },
    /// Bytes remain after the batch.
    #[error("{n_bytes} trailing bytes after the batch")]
    TrailingBytes {
        /// How many bytes follow the batch.
        n_bytes: usize,
    },
    /// A value has the wrong msgpack type.
    #[error("{field}: expected {expected}, got {got}")]
    UnexpectedType {
        /// The field (or position) being decoded.
        field: &'static str,
        /// What the schema expects.
        expected: &'static str,
        /// The msgpack kind found.
        got: &'static str,
    },
    /// The batch has fewer than the two required elements (`ts`, `events`).
    #[error("batch has {n_fields} elements, expected at least 2 (ts, events)")]
    BatchTooShort {
        /// Elements found.
        n_fields: u32,
    },
    /// A map-shaped batch lacks a required key.
    #[error("batch map lacks required key {key}")]
    MissingBatchKey {
        /// The missing key.
        key: &'static str,
    },
    /// An event carries no tag (empty array, or a map without `type`).
    #[error("event {event_idx} has no type tag")]
    MissingTag {
        /// Index of the event in the batch.
        event_idx: usize,
    },
    /// An event's tag names no known event kind.
    #[error("event {event_idx} has unknown type {tag:?}")]
    UnknownTag {
        /// Index of the event in the batch.
        event_idx: usize,
        /// The tag found (lossy UTF-8).
        tag: String,
    },
    /// An event lacks a field that has no default.
    #[error("event {event_idx} ({tag}) lacks required field {field}")]
    MissingField {
        /// Index of the event in the batch.
        event_idx: usize,
        /// The event kind.
        tag: &'static str,
        /// The missing field.
        field: &'static str,
    },
    /// An integer is outside the field's range.
    #[error("{field}: value {value} out of range")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// The value found (negative values as i128 text).
        value: i128,
    },
    /// A bytes block hash is empty.
    #[error("{field}: empty bytes block hash")]
    EmptyHashBytes {
        /// The field.
        field: &'static str,
    },
    /// A string is not valid UTF-8.
    #[error("{field}: string is not valid utf-8")]
    InvalidUtf8 {
        /// The field.
        field: &'static str,
    },
    /// A bigram token entry is not a pair.
    #[error("token_ids: bigram entry has {len} elements, expected 2")]
    BadBigram {
        /// Elements in the entry.
        len: u32,
    },
    /// `token_ids` mixes plain ids and bigram pairs.
    #[error("token_ids: mixes plain ids and bigram pairs")]
    MixedTokenShapes,
    /// A declared element count exceeds a limit.
    #[error("{field}: {n} elements exceed the limit {max}")]
    TooMany {
        /// The field.
        field: &'static str,
        /// Elements declared.
        n: u64,
        /// The limit.
        max: u64,
    },
}

/// A decoded event that cannot become a canonical router event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CanonicalizeError {
    /// The event's block size differs from the pool's query block size.
    #[error(
        "event {event_idx}: block_size {block_size} differs from the pool block size {expected}"
    )]
    BlockSizeMismatch {
        /// Index of the event in the batch.
        event_idx: usize,
        /// The event's block size.
        block_size: u32,
        /// The pool's block size.
        expected: u32,
    },
    /// The token count does not cover exactly the stored blocks.
    #[error("event {event_idx}: {n_tokens} tokens for {n_blocks} blocks of {block_size}")]
    TokenCountMismatch {
        /// Index of the event in the batch.
        event_idx: usize,
        /// Tokens carried.
        n_tokens: usize,
        /// Blocks stored.
        n_blocks: usize,
        /// Tokens per block.
        block_size: u32,
    },
    /// An Eagle-format pool needs one token past the last block, and the event has none.
    #[error("event {event_idx}: eagle hashing needs a lookahead token after block {block_idx}")]
    MissingLookahead {
        /// Index of the event in the batch.
        event_idx: usize,
        /// The block without a following token.
        block_idx: usize,
    },
    /// A stored event carries no blocks.
    #[error("event {event_idx}: stored event without blocks")]
    EmptyStored {
        /// Index of the event in the batch.
        event_idx: usize,
    },
}

/// Why a message, event or line was rejected; sources count rejections per kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum RejectionKind {
    /// The transport message has the wrong frame layout (count, seq width).
    Framing,
    /// The payload is not valid msgpack or JSON.
    Malformed,
    /// The payload decodes but does not match any engine schema.
    Schema,
    /// The event cannot be canonicalized (block size, token count, lookahead).
    Canonicalize,
    /// A bounded buffer or map overflowed and input was dropped.
    Overflow,
    /// The batch names a data-parallel rank the source's card does not declare.
    UndeclaredRank,
    /// An event-plane message carries events of another worker than the one its publisher
    /// was advertised for.
    UndeclaredWorker,
}

impl RejectionKind {
    /// Every kind, in counter order.
    pub const ALL: [RejectionKind; 7] = [
        RejectionKind::Framing,
        RejectionKind::Malformed,
        RejectionKind::Schema,
        RejectionKind::Canonicalize,
        RejectionKind::Overflow,
        RejectionKind::UndeclaredRank,
        RejectionKind::UndeclaredWorker,
    ];

    /// A stable lowercase name (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            RejectionKind::Framing => "framing",
            RejectionKind::Malformed => "malformed",
            RejectionKind::Schema => "schema",
            RejectionKind::Canonicalize => "canonicalize",
            RejectionKind::Overflow => "overflow",
            RejectionKind::UndeclaredRank => "undeclared_rank",
            RejectionKind::UndeclaredWorker => "undeclared_worker",
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            RejectionKind::Framing => 0,
            RejectionKind::Malformed => 1,
            RejectionKind::Schema => 2,
            RejectionKind::Canonicalize => 3,
            RejectionKind::Overflow => 4,
            RejectionKind::UndeclaredRank => 5,
            RejectionKind::UndeclaredWorker => 6,
        }
    }
}

impl DecodeError {
    /// The rejection kind this error is counted under.
    pub fn rejection_kind(&self) -> RejectionKind {
        match self {
            DecodeError::Truncated { .. }
            | DecodeError::InvalidMarker { .. }
            | DecodeError::TrailingBytes { .. }
            | DecodeError::InvalidUtf8 { .. } => RejectionKind::Malformed,
            _ => RejectionKind::Schema,
        }
    }
}

/// A source could not be started.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// Connecting or binding a socket failed.
    #[error("connect {endpoint}: {reason}")]
    Connect {
        /// The endpoint or server address.
        endpoint: String,
        /// The transport's error text.
        reason: String,
    },
    /// Subscribing failed.
    #[error("subscribe {subject}: {reason}")]
    Subscribe {
        /// The topic or subject.
        subject: String,
        /// The transport's error text.
        reason: String,
    },
    /// The configuration is invalid.
    #[error("invalid source config: {reason}")]
    Config {
        /// What is wrong.
        reason: String,
    },
}
