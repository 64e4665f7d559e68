//! Pure parsing of vLLM/SGLang ZMQ multipart frames (live PUB messages, replay replies);
//! Dynamo's event-plane messages are split by [`crate::event_plane`].

use bytes::Bytes;

/// A ZMQ message whose frames are not a known engine layout.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ZmqFrameError {
    /// Wrong number of frames.
    #[error("message has {n_frames} frames, expected {expected}")]
    FrameCount {
        /// Frames received.
        n_frames: usize,
        /// What was expected.
        expected: &'static str,
    },
    /// The sequence frame is not 8 bytes.
    #[error("sequence frame has {len} bytes, expected 8")]
    SeqWidth {
        /// Its length.
        len: usize,
    },
    /// An event-plane publisher-id frame that is not 8 bytes.
    #[error("publisher id frame has {len} bytes, expected 8")]
    PublisherIdWidth {
        /// Its length.
        len: usize,
    },
    /// An event-plane message of another publisher than the advertised one.
    #[error("event-plane message of publisher {got:#x}, advertised {expected:#x}")]
    ForeignPublisher {
        /// The advertised publisher id.
        expected: u64,
        /// The message's.
        got: u64,
    },
    /// The payload exceeds the limit.
    #[error("payload of {len} bytes exceeds max_payload_bytes {max}")]
    PayloadTooLarge {
        /// Payload length.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// One replay reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayReply {
    /// A buffered batch.
    Batch {
        /// Its sequence.
        seq: u64,
        /// Its payload.
        payload: Bytes,
    },
    /// The end marker (sequence −1).
    End,
}

/// Parses a live message `[topic, seq, payload]` (or `[seq, payload]`).
pub fn parse_live(
    frames: &[Bytes],
    max_payload_bytes: usize,
) -> Result<(u64, Bytes), ZmqFrameError> {
    let (seq, payload) = match frames {
        [_, seq, payload] | [seq, payload] => (seq, payload),
        _ => {
            return Err(ZmqFrameError::FrameCount {
                n_frames: frames.len(),
                expected: "2 or 3",
            });
        }
    };
    check_payload(payload, max_payload_bytes)?;
    Ok((parse_seq(seq)?, payload.clone()))
}

/// Parses a replay reply as a DEALER receives it: an optional empty delimiter, then
/// `[seq, payload]` (older engines) or `[topic, seq, payload]` (vLLM ≥ 0.26, SGLang ≥ 0.5.22).
pub fn parse_replay(
    frames: &[Bytes],
    max_payload_bytes: usize,
) -> Result<ReplayReply, ZmqFrameError> {
    let rest = match frames {
        [first, rest @ ..] if first.is_empty() && rest.len() >= 2 => rest,
        all => all,
    };
    let (seq, payload) = match rest {
        [_, seq, payload] | [seq, payload] => (seq, payload),
        _ => {
            return Err(ZmqFrameError::FrameCount {
                n_frames: frames.len(),
                expected: "2 to 4",
            });
        }
    };
    let seq_bytes = seq_array(seq)?;
    if seq_bytes == [0xff; 8] {
        return Ok(ReplayReply::End);
    }
    check_payload(payload, max_payload_bytes)?;
    Ok(ReplayReply::Batch {
        seq: u64::from_be_bytes(seq_bytes),
        payload: payload.clone(),
    })
}

/// The frames of a replay request from `start_seq`, as a DEALER sends them.
pub fn replay_request(start_seq: u64) -> [Bytes; 2] {
    [
        Bytes::new(),
        Bytes::copy_from_slice(&start_seq.to_be_bytes()),
    ]
}

fn parse_seq(frame: &[u8]) -> Result<u64, ZmqFrameError> {
    seq_array(frame).map(u64::from_be_bytes)
}

fn seq_array(frame: &[u8]) -> Result<[u8; 8], ZmqFrameError> {
    <[u8; 8]>::try_from(frame).map_err(|_| ZmqFrameError::SeqWidth { len: frame.len() })
}

fn check_payload(payload: &[u8], max: usize) -> Result<(), ZmqFrameError> {
    if payload.len() > max {
        return Err(ZmqFrameError::PayloadTooLarge {
            len: payload.len(),
            max,
        });
    }
    Ok(())
}
