//! The relay side of a WAN stream, sans-IO: what a stream sends, when, and which reason
//! ends it. The relay's connection task only moves bytes: it feeds values and timeouts in
//! (`handle_*`, the caller's `now`) and writes what comes out (`poll_*`), so a second front
//! door (another transport, another contract) drives the same rules.
//!
//! - Watched streams (catalog, topology, load): [`WatchSession`] sends the current value at
//!   once, then each value that [supersedes](Watched::supersedes) the last one sent (every
//!   catalog and topology; only a newer load window), and re-sends the current catalog or
//!   topology after a heartbeat interval without changes, so a consumer can tell a quiet
//!   relay from a dead one. Load windows carry their own sequence and are never re-sent.
//! - Pool streams: [`PoolFrameEncoder`] (how a frame of a producer generation is encoded),
//!   [`accepts_coalesced_deltas`] (a minor-1 client takes one delta spanning
//!   several sequences) and the bound each frame write gets ([`WriteBound`]): a snapshot
//!   chunk the client does not take in time is a `snapshot_progress_timeout`, any other
//!   frame a `subscriber_lagged`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use kvrelay_ckf::Delta;
use kvrelay_ckf::stream::Transmit;

use crate::Limits;
use crate::v1::{
    CatalogUpdate, EncodeError, ErrorReason, LoadWindow, Message, PoolFrameHeader, PoolFrameKind,
    ProducerIdentity, RelayIdentity, TopologyUpdate, encode_chunk_frame, encode_delta_frame,
    encode_heartbeat_frame,
};

/// A value a watched stream carries.
pub trait Watched {
    /// Whether the current value is re-sent after a heartbeat interval without changes.
    const RESENT_ON_HEARTBEAT: bool;

    /// Whether `self`, published after `sent` went out, is sent too.
    fn supersedes(&self, sent: &Self) -> bool;

    /// The message that carries it.
    fn to_message(&self) -> Message;
}

impl Watched for CatalogUpdate {
    const RESENT_ON_HEARTBEAT: bool = true;

    fn supersedes(&self, _sent: &Self) -> bool {
        true
    }

    fn to_message(&self) -> Message {
        Message::CatalogUpdate(self.clone())
    }
}

impl Watched for TopologyUpdate {
    const RESENT_ON_HEARTBEAT: bool = true;

    fn supersedes(&self, _sent: &Self) -> bool {
        true
    }

    fn to_message(&self) -> Message {
        Message::TopologyUpdate(self.clone())
    }
}

impl Watched for LoadWindow {
    const RESENT_ON_HEARTBEAT: bool = false;

    /// Only a newer window: a republished or older one would move the consumer back.
    fn supersedes(&self, sent: &Self) -> bool {
        self.window_sequence > sent.window_sequence
    }

    fn to_message(&self) -> Message {
        Message::LoadWindow(self.clone())
    }
}

/// One pool frame as the relay fans it out to every door: the complete encoded v1 frame
/// (header included, shared between subscribers) and what its write is bound by.
#[derive(Debug, Clone)]
pub struct EncodedPoolFrame {
    /// The frame, header included.
    pub frame: Bytes,
    /// Whether it is a snapshot chunk (written under [`WriteBound::SnapshotChunk`]).
    pub snapshot: bool,
    /// Whether it is a heartbeat (for metrics).
    pub heartbeat: bool,
}

impl EncodedPoolFrame {
    /// The bound its write gets.
    pub fn write_bound(&self) -> WriteBound {
        WriteBound::of_pool_frame(self.snapshot)
    }
}

/// Encodes the frames of one producer generation, as every door sends them: each frame a
/// complete codec frame (header included) ready to write, its CBI1 payload encoded in
/// place. The relay's pool hub and any test relay encode through this one type, so a
/// frame's header is built in one place.
#[derive(Debug, Clone, Copy)]
pub struct PoolFrameEncoder {
    relay: RelayIdentity,
    producer: ProducerIdentity,
    limits: Limits,
}

impl PoolFrameEncoder {
    /// An encoder for `producer`, published by `relay`.
    pub fn new(relay: RelayIdentity, producer: ProducerIdentity, limits: Limits) -> Self {
        Self {
            relay,
            producer,
            limits,
        }
    }

    /// The producer generation it encodes for.
    pub fn producer(&self) -> ProducerIdentity {
        self.producer
    }

    /// Chunk `chunk_index` of the snapshot of `table` at `sequence`, sent at
    /// `sent_unix_us` (the caller's clock).
    pub fn snapshot_chunk(
        &self,
        sequence: u64,
        table: &[u64],
        chunk_index: u32,
        sent_unix_us: u64,
    ) -> Result<Bytes, EncodeError> {
        let header = self.header(
            PoolFrameKind::SnapshotChunk,
            sequence,
            sequence,
            sent_unix_us,
        );
        let mut buf = BytesMut::new();
        encode_chunk_frame(&header, table, chunk_index, &self.limits, &mut buf)?;
        Ok(buf.freeze())
    }

    /// One delta (coalesced or not).
    pub fn delta(&self, delta: &Delta, sent_unix_us: u64) -> Result<Bytes, EncodeError> {
        let header = self.header(
            PoolFrameKind::Delta,
            delta.base_sequence,
            delta.sequence,
            sent_unix_us,
        );
        let mut buf = BytesMut::with_capacity(128 + delta.images.len() * 12);
        encode_delta_frame(&header, &delta.images, &self.limits, &mut buf)?;
        Ok(buf.freeze())
    }

    /// A heartbeat at `sequence`.
    pub fn heartbeat(&self, sequence: u64, sent_unix_us: u64) -> Result<Bytes, EncodeError> {
        let header = self.header(PoolFrameKind::Heartbeat, sequence, sequence, sent_unix_us);
        let mut buf = BytesMut::with_capacity(128);
        encode_heartbeat_frame(&header, &self.limits, &mut buf)?;
        Ok(buf.freeze())
    }

    /// What a publisher handed out for one subscriber, encoded (a delta's own encoding is
    /// not reused here: the relay's hub shares it between subscribers itself).
    pub fn transmit<T>(
        &self,
        transmit: &Transmit<T>,
        sent_unix_us: u64,
    ) -> Result<EncodedPoolFrame, EncodeError> {
        let (frame, snapshot, heartbeat) = match transmit {
            Transmit::SnapshotChunk {
                words,
                sequence,
                chunk_index,
                ..
            } => (
                self.snapshot_chunk(*sequence, words, *chunk_index, sent_unix_us)?,
                true,
                false,
            ),
            Transmit::Delta { delta, .. } => (self.delta(delta, sent_unix_us)?, false, false),
            Transmit::Heartbeat { sequence } => {
                (self.heartbeat(*sequence, sent_unix_us)?, false, true)
            }
        };
        Ok(EncodedPoolFrame {
            frame,
            snapshot,
            heartbeat,
        })
    }

    fn header(
        &self,
        kind: PoolFrameKind,
        base_sequence: u64,
        sequence: u64,
        sent_unix_us: u64,
    ) -> PoolFrameHeader {
        PoolFrameHeader {
            relay: self.relay,
            producer: self.producer,
            base_sequence,
            sequence,
            kind,
            sent_unix_us,
        }
    }
}

/// One value to write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchTransmit<T> {
    /// The value.
    pub value: Arc<T>,
    /// Whether it is a heartbeat re-send (counted apart).
    pub heartbeat: bool,
}

/// One watched stream's behaviour.
#[derive(Debug)]
pub struct WatchSession<T> {
    sent: Arc<T>,
    pending: Option<WatchTransmit<T>>,
    heartbeat_interval: Duration,
    next_heartbeat: Option<Instant>,
}

impl<T: Watched> WatchSession<T> {
    /// A stream opened at `now` whose current value is `current` (sent first).
    pub fn new(current: Arc<T>, heartbeat_interval: Duration, now: Instant) -> Self {
        Self {
            pending: Some(WatchTransmit {
                value: current.clone(),
                heartbeat: false,
            }),
            sent: current,
            heartbeat_interval,
            next_heartbeat: T::RESENT_ON_HEARTBEAT.then(|| now + heartbeat_interval),
        }
    }

    /// The publication has a new value at `now`.
    pub fn handle_value(&mut self, next: Arc<T>, now: Instant) {
        if !next.supersedes(&self.sent) {
            return;
        }
        self.sent = next.clone();
        // Only the newest value matters: one not yet written is replaced.
        self.pending = Some(WatchTransmit {
            value: next,
            heartbeat: false,
        });
        if T::RESENT_ON_HEARTBEAT {
            self.next_heartbeat = Some(now + self.heartbeat_interval);
        }
    }

    /// The deadline of [`WatchSession::poll_timeout`] passed (or any wake-up at `now`).
    pub fn handle_timeout(&mut self, now: Instant) {
        let Some(due) = self.next_heartbeat else {
            return;
        };
        if now < due {
            return;
        }
        if self.pending.is_none() {
            self.pending = Some(WatchTransmit {
                value: self.sent.clone(),
                heartbeat: true,
            });
        }
        self.next_heartbeat = Some(now + self.heartbeat_interval);
    }

    /// The next value to write, if any.
    pub fn poll_transmit(&mut self) -> Option<WatchTransmit<T>> {
        self.pending.take()
    }

    /// When [`WatchSession::handle_timeout`] is due next (`None`: never, for load).
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_heartbeat
    }
}

/// Whether a client that negotiated protocol minor `minor` takes coalesced deltas (one
/// delta spanning several sequences, minor 1 and later).
pub fn accepts_coalesced_deltas(minor: u16) -> bool {
    minor >= 1
}

/// Which bound one frame write gets, and the reason that ends the stream past it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteBound {
    /// Any frame but a snapshot chunk: `write_timeout_ms`, then `subscriber_lagged`.
    Frame,
    /// A snapshot chunk: `snapshot_progress_timeout_ms`, then `snapshot_progress_timeout`
    /// (the write timeout does not apply: it would cut a large snapshot off first).
    SnapshotChunk,
}

impl WriteBound {
    /// The bound of a pool frame, by whether it is part of a snapshot.
    pub fn of_pool_frame(snapshot: bool) -> Self {
        if snapshot {
            Self::SnapshotChunk
        } else {
            Self::Frame
        }
    }

    /// The reason and message a stream ends with when a write outlives this bound.
    pub fn exceeded(self) -> (ErrorReason, &'static str) {
        match self {
            Self::Frame => (
                ErrorReason::SubscriberLagged,
                "frame not accepted within write_timeout_ms",
            ),
            Self::SnapshotChunk => (
                ErrorReason::SnapshotProgressTimeout,
                "snapshot frame not accepted within snapshot_progress_timeout_ms",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const HEARTBEAT: Duration = Duration::from_secs(10);

    /// A watched value for the tests: a version, re-sent on heartbeat or not.
    #[derive(Debug, Clone, PartialEq, Eq)]
    struct Versioned<const RESENT: bool>(u64);

    impl<const RESENT: bool> Watched for Versioned<RESENT> {
        const RESENT_ON_HEARTBEAT: bool = RESENT;

        fn supersedes(&self, sent: &Self) -> bool {
            self.0 > sent.0
        }

        fn to_message(&self) -> Message {
            Message::Error(crate::v1::ErrorMessage::new(ErrorReason::Internal, "test"))
        }
    }

    fn drain<T>(session: &mut WatchSession<T>) -> Vec<WatchTransmit<T>>
    where
        T: Watched,
    {
        std::iter::from_fn(|| session.poll_transmit()).collect()
    }

    #[test]
    fn the_current_value_goes_first_then_each_newer_one() {
        let start = Instant::now();
        let mut session = WatchSession::new(Arc::new(Versioned::<true>(1)), HEARTBEAT, start);
        assert_eq!(
            drain(&mut session),
            vec![WatchTransmit {
                value: Arc::new(Versioned(1)),
                heartbeat: false
            }]
        );
        session.handle_value(Arc::new(Versioned(1)), start);
        assert_eq!(drain(&mut session), Vec::new(), "not newer: not sent");
        session.handle_value(Arc::new(Versioned(2)), start);
        session.handle_value(Arc::new(Versioned(3)), start);
        // Two changes before the writer got to them: only the newest goes out.
        assert_eq!(drain(&mut session).len(), 1);
    }

    #[test]
    fn a_quiet_stream_resends_its_current_value_each_interval() {
        let start = Instant::now();
        let mut session = WatchSession::new(Arc::new(Versioned::<true>(4)), HEARTBEAT, start);
        drain(&mut session);
        assert_eq!(session.poll_timeout(), Some(start + HEARTBEAT));
        session.handle_timeout(start + HEARTBEAT - Duration::from_millis(1));
        assert_eq!(drain(&mut session), Vec::new(), "not due yet");
        session.handle_timeout(start + HEARTBEAT);
        assert_eq!(
            drain(&mut session),
            vec![WatchTransmit {
                value: Arc::new(Versioned(4)),
                heartbeat: true
            }]
        );
        assert_eq!(session.poll_timeout(), Some(start + HEARTBEAT * 2));
        // A change re-arms the heartbeat from the change.
        let changed = start + HEARTBEAT + Duration::from_secs(3);
        session.handle_value(Arc::new(Versioned(5)), changed);
        assert_eq!(session.poll_timeout(), Some(changed + HEARTBEAT));
    }

    #[test]
    fn load_windows_are_never_resent() {
        let start = Instant::now();
        let mut session = WatchSession::new(Arc::new(Versioned::<false>(1)), HEARTBEAT, start);
        drain(&mut session);
        assert_eq!(session.poll_timeout(), None);
        session.handle_timeout(start + HEARTBEAT * 5);
        assert_eq!(drain(&mut session), Vec::new());
    }

    #[test]
    fn only_a_newer_load_window_supersedes() {
        let window = |window_sequence| LoadWindow {
            relay: crate::v1::RelayIdentity {
                drt_instance_id: 1,
                relay_incarnation: 2,
            },
            window_sequence,
            observed_unix_ms: 0,
            window_ms: 1000,
            pools: Vec::new(),
        };
        assert!(window(2).supersedes(&window(1)));
        assert!(!window(1).supersedes(&window(1)));
        assert!(!window(0).supersedes(&window(1)));
    }

    #[test]
    fn write_bounds_end_streams_with_their_own_reason() {
        assert_eq!(WriteBound::of_pool_frame(true), WriteBound::SnapshotChunk);
        assert_eq!(WriteBound::of_pool_frame(false), WriteBound::Frame);
        assert_eq!(
            WriteBound::Frame.exceeded().0,
            ErrorReason::SubscriberLagged
        );
        assert_eq!(
            WriteBound::SnapshotChunk.exceeded().0,
            ErrorReason::SnapshotProgressTimeout
        );
        assert!(!accepts_coalesced_deltas(0));
        assert!(accepts_coalesced_deltas(1));
    }

    proptest! {
        /// Whatever the order of values, wake-ups and writes: what is written is strictly
        /// increasing apart from heartbeats, a heartbeat repeats the last value written,
        /// at most one heartbeat goes out per interval, and once drained the last value
        /// written is the newest published.
        #[test]
        fn written_values_follow_the_model(
            steps in proptest::collection::vec((0u8..3, 0u64..20, 0u64..15_000), 1..200),
        ) {
            let start = Instant::now();
            let mut now = start;
            let mut session = WatchSession::new(Arc::new(Versioned::<true>(0)), HEARTBEAT, start);
            let mut newest = 0u64;
            let mut last_written: Option<u64> = None;
            let mut n_heartbeats = 0u32;
            for (kind, version, advance_ms) in steps {
                now += Duration::from_millis(advance_ms);
                match kind {
                    0 => {
                        newest = newest.max(version);
                        session.handle_value(Arc::new(Versioned(version)), now);
                    }
                    1 => session.handle_timeout(now),
                    _ => {
                        for transmit in drain(&mut session) {
                            let value = transmit.value.0;
                            if let Some(previous) = last_written {
                                if transmit.heartbeat {
                                    prop_assert_eq!(value, previous);
                                    n_heartbeats += 1;
                                } else {
                                    prop_assert!(value > previous);
                                }
                            }
                            last_written = Some(value);
                        }
                        let intervals = now.duration_since(start).as_millis() / HEARTBEAT.as_millis();
                        prop_assert!(u128::from(n_heartbeats) <= intervals);
                    }
                }
            }
            for transmit in drain(&mut session) {
                last_written = Some(transmit.value.0);
            }
            prop_assert_eq!(last_written, Some(newest));
        }
    }
}
