//! Dynamo's event plane on ZMQ, as a Dynamo worker's `KvEventPublisher` publishes it on the
//! channel it advertises (`EventChannel` with a `Zmq` transport). Pure (no IO).
//!
//! One message is four ZMQ frames:
//! 1. the topic (`kv-events`; not checked: the advert already named the channel),
//! 2. the publisher id, u64 big-endian,
//! 3. the publisher's sequence, u64 big-endian (0, 1, 2, … per publisher),
//! 4. a frame: one version byte ([`FRAME_VERSION`]), the body length as u32 big-endian, then
//!    the body: the msgpack envelope `{publisher_id, sequence, published_at, topic,
//!    payload}` whose `payload` (msgpack bin) holds the router events
//!    ([`crate::decode_dynamo_events_msgpack`]).
//!
//! The reader splits the frames ([`parse_event_plane`]) so the sequence tracker sees the
//! sequence before anything is decoded; the driver decodes the frame
//! ([`decode_event_plane_frame`]) and checks that the envelope agrees with the frames it came
//! in, so a message cannot claim one publisher or sequence outside and another inside.

use bytes::Bytes;
use kvrelay_ckf::{EventPayload, RouterEvent};
use serde::Deserialize;

use crate::dynamo_event::{DynamoDecoded, DynamoEventError, decode_dynamo_events_msgpack};
use crate::error::RejectionKind;
use crate::limits::Limits;
use crate::zmq_frames::ZmqFrameError;

/// The frame version this decoder reads.
pub const FRAME_VERSION: u8 = 1;
/// Bytes before a frame's body: the version and the body length.
pub const FRAME_HEADER_BYTES: usize = 5;

/// One event-plane message, split but not decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventPlaneMessage {
    /// The publisher id of frame 2.
    pub publisher_id: u64,
    /// The sequence of frame 3.
    pub sequence: u64,
    /// Frame 4 (header and envelope).
    pub frame: Bytes,
}

/// Splits an event-plane message `[topic, publisher_id, sequence, frame]`.
pub fn parse_event_plane(
    frames: &[Bytes],
    max_payload_bytes: usize,
) -> Result<EventPlaneMessage, ZmqFrameError> {
    let [_topic, publisher_id, sequence, frame] = frames else {
        return Err(ZmqFrameError::FrameCount {
            n_frames: frames.len(),
            expected: "4",
        });
    };
    if frame.len() > max_payload_bytes {
        return Err(ZmqFrameError::PayloadTooLarge {
            len: frame.len(),
            max: max_payload_bytes,
        });
    }
    let be_u64 = |frame: &[u8]| <[u8; 8]>::try_from(frame).ok().map(u64::from_be_bytes);
    Ok(EventPlaneMessage {
        publisher_id: be_u64(publisher_id).ok_or(ZmqFrameError::PublisherIdWidth {
            len: publisher_id.len(),
        })?,
        sequence: be_u64(sequence).ok_or(ZmqFrameError::SeqWidth {
            len: sequence.len(),
        })?,
        frame: frame.clone(),
    })
}

/// An event-plane frame that cannot be read, or does not agree with its message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EventPlaneError {
    /// Shorter than the header.
    #[error(
        "event-plane frame of {len} bytes is shorter than its {FRAME_HEADER_BYTES}-byte header"
    )]
    Truncated {
        /// The frame's length.
        len: usize,
    },
    /// A version this decoder does not read.
    #[error("event-plane frame version {version} is not {FRAME_VERSION}")]
    Version {
        /// The version byte.
        version: u8,
    },
    /// The header's body length is not the body's.
    #[error("event-plane frame declares a {declared}-byte body and carries {actual}")]
    Length {
        /// The header's length.
        declared: u64,
        /// Bytes after the header.
        actual: usize,
    },
    /// The body is not an envelope.
    #[error("event-plane envelope: {reason}")]
    Envelope {
        /// The parser's message.
        reason: String,
    },
    /// The envelope names another publisher or sequence than the frames around it.
    #[error("event-plane envelope {field} {envelope} disagrees with its frame's {frame}")]
    Disagrees {
        /// `publisher_id` or `sequence`.
        field: &'static str,
        /// The frames' value.
        frame: u64,
        /// The envelope's value.
        envelope: u64,
    },
    /// The envelope's payload is not router events within the limits.
    #[error(transparent)]
    Events(#[from] DynamoEventError),
}

impl EventPlaneError {
    /// The rejection kind this error is counted under.
    pub fn rejection_kind(&self) -> RejectionKind {
        match self {
            EventPlaneError::Truncated { .. }
            | EventPlaneError::Version { .. }
            | EventPlaneError::Length { .. }
            | EventPlaneError::Disagrees { .. } => RejectionKind::Framing,
            EventPlaneError::Envelope { .. } => RejectionKind::Malformed,
            EventPlaneError::Events(err) => err.rejection_kind(),
        }
    }
}

#[derive(Deserialize)]
struct Envelope<'a> {
    publisher_id: u64,
    sequence: u64,
    #[serde(borrow)]
    payload: &'a [u8],
}

/// Decodes the frame of `message` into its router events, checking the header and that the
/// envelope names the message's publisher and sequence.
pub fn decode_event_plane_frame(
    message: &EventPlaneMessage,
    limits: &Limits,
    lower_tiers: bool,
) -> Result<DynamoDecoded, EventPlaneError> {
    let frame = &message.frame[..];
    let (Some(&version), Some(length), Some(body)) = (
        frame.first(),
        frame.get(1..FRAME_HEADER_BYTES),
        frame.get(FRAME_HEADER_BYTES..),
    ) else {
        return Err(EventPlaneError::Truncated { len: frame.len() });
    };
    if version != FRAME_VERSION {
        return Err(EventPlaneError::Version { version });
    }
    let declared = length
        .iter()
        .fold(0u64, |acc, byte| (acc << 8) | u64::from(*byte));
    if usize::try_from(declared).ok() != Some(body.len()) {
        return Err(EventPlaneError::Length {
            declared,
            actual: body.len(),
        });
    }
    let envelope: Envelope<'_> =
        rmp_serde::from_slice(body).map_err(|err| EventPlaneError::Envelope {
            reason: err.to_string(),
        })?;
    for (field, frame, envelope) in [
        ("publisher_id", message.publisher_id, envelope.publisher_id),
        ("sequence", message.sequence, envelope.sequence),
    ] {
        if frame != envelope {
            return Err(EventPlaneError::Disagrees {
                field,
                frame,
                envelope,
            });
        }
    }
    Ok(decode_dynamo_events_msgpack(
        envelope.payload,
        limits,
        lower_tiers,
    )?)
}

/// Encodes `events` as the event-plane message `sequence` of publisher `publisher_id`, the
/// four frames a Dynamo worker's publisher sends (for tests, benchmarks and fixtures; the
/// relay only reads them). Written with the msgpack encoder directly, independently of the
/// serde types the decoder reads with, so a round trip checks one against the other.
pub fn encode_event_plane(publisher_id: u64, sequence: u64, events: &[RouterEvent]) -> [Bytes; 4] {
    let mut payload = Vec::new();
    write_array(&mut payload, events.len());
    for event in events {
        write_router_event(&mut payload, event);
    }
    let mut body = Vec::with_capacity(payload.len() + 64);
    write_map(&mut body, 5);
    write_key_uint(&mut body, "publisher_id", publisher_id);
    write_key_uint(&mut body, "sequence", sequence);
    write_key_uint(&mut body, "published_at", 0);
    write_str(&mut body, "topic");
    write_str(&mut body, KV_EVENTS_TOPIC);
    write_str(&mut body, "payload");
    // Writing to a Vec cannot fail; lengths beyond u32 are not produced by callers.
    let _ = rmp::encode::write_bin(&mut body, &payload);
    let mut frame = Vec::with_capacity(FRAME_HEADER_BYTES + body.len());
    frame.push(FRAME_VERSION);
    frame.extend_from_slice(&u32::try_from(body.len()).unwrap_or(u32::MAX).to_be_bytes());
    frame.extend_from_slice(&body);
    [
        Bytes::from_static(KV_EVENTS_TOPIC.as_bytes()),
        Bytes::copy_from_slice(&publisher_id.to_be_bytes()),
        Bytes::copy_from_slice(&sequence.to_be_bytes()),
        Bytes::from(frame),
    ]
}

/// The topic Dynamo's KV event publishers use.
const KV_EVENTS_TOPIC: &str = "kv-events";

fn write_router_event(out: &mut Vec<u8>, event: &RouterEvent) {
    write_map(out, 3);
    write_key_uint(out, "worker_id", event.source.worker_id);
    write_str(out, "storage_tier");
    write_str(out, "device");
    write_str(out, "event");
    write_map(out, 3);
    write_key_uint(out, "event_id", event.event_id);
    write_str(out, "data");
    match &event.payload {
        EventPayload::Stored(stored) => {
            write_map(out, 1);
            write_str(out, "stored");
            write_map(out, 2);
            write_str(out, "parent_hash");
            match stored.parent_engine_block_id {
                Some(parent) => write_uint(out, parent),
                None => {
                    let _ = rmp::encode::write_nil(out);
                }
            }
            write_str(out, "blocks");
            write_array(out, stored.blocks.len());
            for block in &stored.blocks {
                write_map(out, 2);
                write_key_uint(out, "block_hash", block.engine_block_id);
                write_key_uint(out, "tokens_hash", block.token_hash);
            }
        }
        EventPayload::Removed(removed) => {
            write_map(out, 1);
            write_str(out, "removed");
            write_map(out, 1);
            write_str(out, "block_hashes");
            write_array(out, removed.engine_block_ids.len());
            for id in &removed.engine_block_ids {
                write_uint(out, *id);
            }
        }
        EventPayload::AllCleared => write_str(out, "cleared"),
    }
    write_key_uint(out, "dp_rank", u64::from(event.source.dp_rank));
}

fn write_map(out: &mut Vec<u8>, len: u32) {
    let _ = rmp::encode::write_map_len(out, len);
}

fn write_array(out: &mut Vec<u8>, len: usize) {
    let _ = rmp::encode::write_array_len(out, u32::try_from(len).unwrap_or(u32::MAX));
}

fn write_str(out: &mut Vec<u8>, text: &str) {
    let _ = rmp::encode::write_str(out, text);
}

fn write_uint(out: &mut Vec<u8>, value: u64) {
    let _ = rmp::encode::write_uint(out, value);
}

fn write_key_uint(out: &mut Vec<u8>, key: &str, value: u64) {
    write_str(out, key);
    write_uint(out, value);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "test")]
    use super::*;

    /// The device events of a decoded payload (every test payload is device-only).
    fn device(decoded: &DynamoDecoded) -> Vec<kvrelay_ckf::RouterEvent> {
        decoded
            .events
            .iter()
            .map(|event| match event {
                crate::CanonicalEvent::Device(event) => event.clone(),
                crate::CanonicalEvent::Tier(event) => panic!("unexpected tier event {event:?}"),
            })
            .collect()
    }
    use kvrelay_ckf::{RemovedBlocks, SourceId, StoredBlock, StoredBlocks};
    use proptest::prelude::*;

    /// Frames 2–4 of the first message a Dynamo 1.6.1 worker published on its event plane
    /// (`KvEventPublisher.publish_stored` of three 16-token blocks with engine ids 1001,
    /// 1002 and -1003; captured from the wheel's runtime with a plain SUB socket).
    const STORED_PUBLISHER: &str = "001aa34c14623e6e";
    const STORED_SEQUENCE: &str = "0000000000000000";

    fn message(publisher: u64, sequence: u64, body: &[u8]) -> EventPlaneMessage {
        let mut frame = vec![FRAME_VERSION];
        frame.extend_from_slice(&u32::try_from(body.len()).unwrap().to_be_bytes());
        frame.extend_from_slice(body);
        EventPlaneMessage {
            publisher_id: publisher,
            sequence,
            frame: Bytes::from(frame),
        }
    }

    /// An envelope as Dynamo's msgpack codec writes it (a map with named fields).
    fn envelope(publisher: u64, sequence: u64, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        rmp::encode::write_map_len(&mut out, 5).unwrap();
        rmp::encode::write_str(&mut out, "publisher_id").unwrap();
        rmp::encode::write_uint(&mut out, publisher).unwrap();
        rmp::encode::write_str(&mut out, "sequence").unwrap();
        rmp::encode::write_uint(&mut out, sequence).unwrap();
        rmp::encode::write_str(&mut out, "published_at").unwrap();
        rmp::encode::write_uint(&mut out, 1_796_465_541_701).unwrap();
        rmp::encode::write_str(&mut out, "topic").unwrap();
        rmp::encode::write_str(&mut out, "kv-events").unwrap();
        rmp::encode::write_str(&mut out, "payload").unwrap();
        rmp::encode::write_bin(&mut out, payload).unwrap();
        out
    }

    fn hex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|at| u8::from_str_radix(&text[at..at + 2], 16).unwrap())
            .collect()
    }

    fn frames(publisher: &str, sequence: &str, frame: Vec<u8>) -> Vec<Bytes> {
        vec![
            Bytes::from_static(b"kv-events"),
            Bytes::from(hex(publisher)),
            Bytes::from(hex(sequence)),
            Bytes::from(frame),
        ]
    }

    #[test]
    fn a_captured_dynamo_message_decodes_to_its_stored_blocks() {
        let captured = hex(include_str!("../tests/fixtures/dynamo_event_plane/stored.hex").trim());
        let message = parse_event_plane(
            &frames(STORED_PUBLISHER, STORED_SEQUENCE, captured),
            Limits::default().max_payload_bytes,
        )
        .unwrap();
        assert_eq!(message.publisher_id, 0x001a_a34c_1462_3e6e);
        assert_eq!(message.sequence, 0);
        let decoded = decode_event_plane_frame(&message, &Limits::default(), false).unwrap();
        assert_eq!(decoded.n_filtered, 0);
        assert_eq!(decoded.events.len(), 1);
        let event = &device(&decoded)[0];
        assert_eq!(event.source, SourceId::new(14_836_952_846_273_569_127, 0));
        assert_eq!(event.event_id, 1);
        let EventPayload::Stored(stored) = &event.payload else {
            panic!("{event:?}");
        };
        assert_eq!(stored.parent_engine_block_id, None);
        let ids: Vec<u64> = stored.blocks.iter().map(|b| b.engine_block_id).collect();
        // The engine's signed ids, as Dynamo carries them: two's complement.
        assert_eq!(ids, [1001, 1002, (-1003i64).cast_unsigned()]);
        // Dynamo's tokens_hash of tokens 100..148 is this crate's block hash of them.
        let tokens: Vec<u32> = (100..148).collect();
        let ours = kvrelay_identity::hashing::block_hashes(
            &tokens,
            16,
            kvrelay_identity::KvQueryHashFormat::DynamoStandardV1,
            kvrelay_identity::hashing::HashSalt::default(),
        );
        let theirs: Vec<u64> = stored.blocks.iter().map(|b| b.token_hash).collect();
        assert_eq!(theirs, ours);
    }

    #[test]
    fn removed_and_cleared_events_decode() {
        let mut payload = Vec::new();
        rmp::encode::write_array_len(&mut payload, 2).unwrap();
        for (event_id, data) in [(3u64, "removed"), (4, "cleared")] {
            rmp::encode::write_map_len(&mut payload, 2).unwrap();
            rmp::encode::write_str(&mut payload, "worker_id").unwrap();
            rmp::encode::write_uint(&mut payload, 9).unwrap();
            rmp::encode::write_str(&mut payload, "event").unwrap();
            rmp::encode::write_map_len(&mut payload, 3).unwrap();
            rmp::encode::write_str(&mut payload, "event_id").unwrap();
            rmp::encode::write_uint(&mut payload, event_id).unwrap();
            rmp::encode::write_str(&mut payload, "dp_rank").unwrap();
            rmp::encode::write_uint(&mut payload, 1).unwrap();
            rmp::encode::write_str(&mut payload, "data").unwrap();
            if data == "removed" {
                rmp::encode::write_map_len(&mut payload, 1).unwrap();
                rmp::encode::write_str(&mut payload, "removed").unwrap();
                rmp::encode::write_map_len(&mut payload, 1).unwrap();
                rmp::encode::write_str(&mut payload, "block_hashes").unwrap();
                rmp::encode::write_array_len(&mut payload, 1).unwrap();
                rmp::encode::write_uint(&mut payload, 1002).unwrap();
            } else {
                rmp::encode::write_str(&mut payload, "cleared").unwrap();
            }
        }
        let decoded = decode_event_plane_frame(
            &message(5, 7, &envelope(5, 7, &payload)),
            &Limits::default(),
            false,
        )
        .unwrap();
        assert_eq!(decoded.events.len(), 2);
        assert_eq!(device(&decoded)[0].source, SourceId::new(9, 1));
        assert_eq!(
            device(&decoded)[0].payload,
            EventPayload::Removed(RemovedBlocks {
                engine_block_ids: vec![1002]
            })
        );
        assert_eq!(device(&decoded)[1].payload, EventPayload::AllCleared);
    }

    #[test]
    fn an_envelope_that_disagrees_with_its_frames_is_refused() {
        let payload = [0x90]; // an empty array of events
        for (frames_publisher, frames_sequence, field) in
            [(6, 7, "publisher_id"), (5, 8, "sequence")]
        {
            let err = decode_event_plane_frame(
                &message(frames_publisher, frames_sequence, &envelope(5, 7, &payload)),
                &Limits::default(),
                false,
            )
            .unwrap_err();
            assert!(
                matches!(err, EventPlaneError::Disagrees { field: f, .. } if f == field),
                "{err}"
            );
            assert_eq!(err.rejection_kind(), RejectionKind::Framing);
        }
        let ok = decode_event_plane_frame(
            &message(5, 7, &envelope(5, 7, &payload)),
            &Limits::default(),
            false,
        )
        .unwrap();
        assert!(ok.events.is_empty());
    }

    #[test]
    fn bad_headers_are_typed_errors() {
        let body = envelope(5, 7, &[0x90]);
        let mut wrong_version = message(5, 7, &body);
        let mut bytes = wrong_version.frame.to_vec();
        bytes[0] = 2;
        wrong_version.frame = Bytes::from(bytes);
        let mut short = message(5, 7, &body);
        short.frame = short.frame.slice(..3);
        let mut long_declared = message(5, 7, &body);
        long_declared.frame = long_declared.frame.slice(..long_declared.frame.len() - 1);
        let limits = Limits::default();
        assert!(matches!(
            decode_event_plane_frame(&wrong_version, &limits, false),
            Err(EventPlaneError::Version { version: 2 })
        ));
        assert!(matches!(
            decode_event_plane_frame(&short, &limits, false),
            Err(EventPlaneError::Truncated { len: 3 })
        ));
        assert!(matches!(
            decode_event_plane_frame(&long_declared, &limits, false),
            Err(EventPlaneError::Length { .. })
        ));
        let garbage = message(5, 7, &[0xc1, 0xc1]);
        let err = decode_event_plane_frame(&garbage, &limits, false).unwrap_err();
        assert!(matches!(err, EventPlaneError::Envelope { .. }), "{err}");
        assert_eq!(err.rejection_kind(), RejectionKind::Malformed);
    }

    #[test]
    fn split_checks_frame_count_widths_and_size() {
        let ok = frames("0000000000000005", "0000000000000007", vec![1, 0, 0, 0, 0]);
        assert!(parse_event_plane(&ok, 5).is_ok());
        assert!(matches!(
            parse_event_plane(&ok, 4),
            Err(ZmqFrameError::PayloadTooLarge { len: 5, max: 4 })
        ));
        assert!(matches!(
            parse_event_plane(&ok[..3], 1024),
            Err(ZmqFrameError::FrameCount { n_frames: 3, .. })
        ));
        let narrow_id = frames("05", "0000000000000007", vec![1, 0, 0, 0, 0]);
        assert!(matches!(
            parse_event_plane(&narrow_id, 1024),
            Err(ZmqFrameError::PublisherIdWidth { len: 1 })
        ));
        let narrow_seq = frames("0000000000000005", "07", vec![1, 0, 0, 0, 0]);
        assert!(matches!(
            parse_event_plane(&narrow_seq, 1024),
            Err(ZmqFrameError::SeqWidth { len: 1 })
        ));
    }

    #[test]
    fn too_many_events_or_blocks_are_refused_whole() {
        let limits = Limits {
            max_events_per_batch: 1,
            max_blocks_per_event: 1,
            ..Limits::default()
        };
        let cleared = RouterEvent {
            source: SourceId::new(9, 0),
            event_id: 1,
            payload: EventPayload::AllCleared,
        };
        let two_events = encode_event_plane(5, 7, &[cleared.clone(), cleared]);
        let message = parse_event_plane(&two_events, usize::MAX).unwrap();
        let err = decode_event_plane_frame(&message, &limits, false).unwrap_err();
        assert!(
            matches!(
                err,
                EventPlaneError::Events(DynamoEventError::TooMany {
                    field: "events",
                    n: 2,
                    max: 1
                })
            ),
            "{err}"
        );
        assert_eq!(err.rejection_kind(), RejectionKind::Schema);
        let json = br#"{"worker_id": 9, "event": {"event_id": 1, "data": {"removed": {"block_hashes": [1, 2]}}}}"#;
        assert!(matches!(
            crate::decode_dynamo_events(json, &limits, false),
            Err(DynamoEventError::TooMany {
                field: "blocks",
                n: 2,
                max: 1
            })
        ));
    }

    fn arb_event() -> impl Strategy<Value = RouterEvent> {
        let source = (any::<u64>(), 0u32..4).prop_map(|(worker, rank)| SourceId::new(worker, rank));
        let payload = prop_oneof![
            (
                proptest::option::of(any::<u64>()),
                proptest::collection::vec((any::<u64>(), any::<u64>()), 1..6)
            )
                .prop_map(|(parent, blocks)| EventPayload::Stored(StoredBlocks {
                    parent_engine_block_id: parent,
                    blocks: blocks
                        .into_iter()
                        .map(|(engine_block_id, token_hash)| StoredBlock {
                            engine_block_id,
                            token_hash
                        })
                        .collect(),
                })),
            proptest::collection::vec(any::<u64>(), 0..6).prop_map(|engine_block_ids| {
                EventPayload::Removed(RemovedBlocks { engine_block_ids })
            }),
            Just(EventPayload::AllCleared),
        ];
        (source, any::<u64>(), payload).prop_map(|(source, event_id, payload)| RouterEvent {
            source,
            event_id,
            payload,
        })
    }

    proptest! {
        /// What the encoder writes, the splitter and decoder read back exactly.
        #[test]
        fn encoded_messages_decode_to_their_events(
            publisher in any::<u64>(),
            sequence in any::<u64>(),
            events in proptest::collection::vec(arb_event(), 0..8),
        ) {
            let frames = encode_event_plane(publisher, sequence, &events);
            let message = parse_event_plane(&frames, usize::MAX).unwrap();
            prop_assert_eq!(message.publisher_id, publisher);
            prop_assert_eq!(message.sequence, sequence);
            let decoded = decode_event_plane_frame(&message, &Limits::default(), false).unwrap();
            prop_assert_eq!(decoded.n_filtered, 0);
            prop_assert_eq!(device(&decoded), events);
        }

        /// Any bytes in the frame are an answer or a typed error, never a panic.
        #[test]
        fn arbitrary_bodies_never_panic(body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_event_plane_frame(&message(1, 2, &body), &Limits::default(), false);
            // Also behind a valid envelope, as the events payload.
            let _ = decode_event_plane_frame(&message(1, 2, &envelope(1, 2, &body)), &Limits::default(), false);
        }
    }
}
