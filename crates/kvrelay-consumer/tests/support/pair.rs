//! The relay↔consumer pair of one pool stream, without sockets, on a simulated clock.
//!
//! - The relay's half is what the relay runs per pool: a producer filter, ckf's
//!   `Publisher` (sequencing, snapshots, resume window, coalescing, heartbeats, cut-offs)
//!   and the codec's `PoolFrameEncoder`.
//! - The consumer's half is `ConsumerState` driven by `kvrelay_consumer::link::pool`
//!   (`PoolStream`, `PoolFollow`) exactly as the tokio client drives them.
//! - Bytes cross through the codec's decoder. Between the halves the test injects what a
//!   network does: a frame lost, delayed, repeated or corrupted, a cut connection, a
//!   consumer that stops reading (the relay's backlog grows), a relay that goes silent.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use kvrelay_ckf::stream::{Poll, Publisher, Start, StreamLimits, SubscriberId};
use kvrelay_codec::session::PoolFrameEncoder;
use kvrelay_codec::v1::{ErrorReason, RelayIdentity, decode_message};
use kvrelay_consumer::link::pool::{
    PoolFollow, PoolStream, ReplicaAfterStream, StreamEnd, begin_refused,
};
use kvrelay_consumer::{
    BackoffConfig, ConsumerConfig, ConsumerState, Limits, PoolKey, RelayEndpoint, ReplicaState,
    ScoreRequest,
};
use kvrelay_identity::hashing::HashSalt;
use kvrelay_pacing::NO_JITTER;

use super::producer::{
    PoolSpec, Producer, catalog_of, cut_off_reason, error_frame, limits, relay_identity,
};

/// A score request for `tokens` of the pair's model.
pub(crate) fn request(tokens: Vec<u32>) -> ScoreRequest {
    ScoreRequest {
        tokens,
        model: "llama".into(),
        ..ScoreRequest::default()
    }
}

/// The depth each chain scores at in `state`'s one pool, or `None` when the replica does
/// not answer.
pub(crate) fn chain_depths(
    state: &ConsumerState,
    chains: &[Vec<u32>],
    now: Instant,
) -> Option<Vec<u32>> {
    chains
        .iter()
        .map(|tokens| {
            let ranking = state.score(&request(tokens.clone()), now).ok()?;
            ranking.candidates.first()?.legs[0].prefix_blocks
        })
        .collect()
}

/// A topology of one entry (`prod`, `llama`) in `state`, from `relay`.
pub(crate) fn topology(
    relay: RelayIdentity,
    state: kvrelay_codec::v1::ReadinessState,
) -> kvrelay_codec::v1::TopologyUpdate {
    kvrelay_codec::v1::TopologyUpdate {
        relay,
        revision: 1,
        entries: vec![kvrelay_codec::v1::TopologyEntry {
            namespace: "prod".into(),
            canonical_model: "llama".into(),
            state,
            present_roles: Vec::new(),
            missing_roles: Vec::new(),
            members: Vec::new(),
            duplicate_role_endpoints: Vec::new(),
            legacy_fallback_active: false,
            adapters: Vec::new(),
        }],
    }
}

/// The chains a pair's producer stores (by index) and its tests score.
pub(crate) fn chains() -> Vec<Vec<u32>> {
    (0..6u32)
        .map(|chain| (0..16 * (2 + chain)).map(|t| chain * 100_000 + t).collect())
        .collect()
}

/// One open pool stream: the relay's subscriber and the consumer's session, with the
/// bytes in flight between them.
struct OpenStream {
    id: SubscriberId,
    session: PoolStream,
    wire: VecDeque<Bytes>,
    /// The relay has written its last frame (an error) and closed its end.
    relay_closed: bool,
}

/// How one subscription began, as the relay saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Opened {
    Snapshot,
    Resumed,
}

/// One pool, one relay, one consumer.
pub(crate) struct Pair {
    pub(crate) now: Instant,
    pub(crate) producer: Producer,
    publisher: Publisher<()>,
    relay: RelayIdentity,
    pub(crate) state: ConsumerState,
    pub(crate) key: PoolKey,
    limits: Limits,
    follow: PoolFollow,
    open: Option<OpenStream>,
    retry_at: Option<Instant>,
    /// Why each stream ended, in order.
    pub(crate) ends: Vec<StreamEnd>,
    /// How each subscription began, in order.
    pub(crate) opened: Vec<Opened>,
    /// The sequence each subscription asked to resume from, in order.
    pub(crate) resume_asked: Vec<Option<u64>>,
    /// Frames that reached the consumer's state.
    pub(crate) frames_applied: usize,
    /// The producer's answers at each sequence it published (for the proptests).
    answers: HashMap<u64, Vec<u32>>,
    /// A replica that received every delta in order (the reference).
    whole: ConsumerState,
    whole_key: PoolKey,
}

/// Quick backoff so retries fit a test's simulated minutes.
pub(crate) const BACKOFF: BackoffConfig =
    BackoffConfig::doubling(Duration::from_millis(100), Duration::from_secs(2));

impl Pair {
    /// A pair whose relay streams under `stream` and whose consumer holds `consumer`
    /// limits; the consumer subscribes at once.
    pub(crate) fn new(stream: StreamLimits, consumer: Limits) -> Self {
        Self::sized(1024, stream, consumer)
    }

    /// [`Pair::new`] with a filter sized for `expected_blocks` (2,000,000: a snapshot of
    /// two chunks).
    pub(crate) fn sized(expected_blocks: u64, stream: StreamLimits, consumer: Limits) -> Self {
        let now = Instant::now();
        let relay = relay_identity(1);
        let mut spec = PoolSpec::aggregated("alpha", "llama");
        spec.expected_blocks = expected_blocks;
        let mut producer = Producer::new(&spec, "dc-0", relay, 1);
        let snapshot = producer.snapshot_frames();
        let publisher = Publisher::new(
            producer.filter.sequence(),
            producer.filter.words().to_vec(),
            stream,
        )
        .expect("stream limits");
        let catalog = catalog_of(relay, 1, &[&producer]);
        let mut config = ConsumerConfig::new(vec![RelayEndpoint::new("127.0.0.1:7400", "dc-0")]);
        config.limits = consumer;
        config.backoff = BACKOFF;
        let mut state = ConsumerState::new(&config).expect("consumer config");
        let key = state.apply_catalog(0, &catalog).expect("catalog").added[0].0;
        let mut whole = ConsumerState::new(&config).expect("consumer config");
        let whole_key = whole.apply_catalog(0, &catalog).expect("catalog").added[0].0;
        whole.begin_subscription(whole_key).expect("subscribe");
        for frame in snapshot {
            whole
                .apply_pool_frame(whole_key, &frame, now)
                .expect("snapshot");
        }
        let mut pair = Self {
            now,
            producer,
            publisher,
            relay,
            state,
            key,
            limits: consumer,
            follow: PoolFollow::new(BACKOFF, now),
            open: None,
            retry_at: Some(now),
            ends: Vec::new(),
            opened: Vec::new(),
            resume_asked: Vec::new(),
            frames_applied: 0,
            answers: HashMap::new(),
            whole,
            whole_key,
        };
        pair.record_answer();
        pair.tick();
        pair
    }

    fn record_answer(&mut self) {
        let depths = chain_depths(&self.whole, &chains(), self.now).expect("the reference answers");
        self.answers.insert(self.producer.filter.sequence(), depths);
    }

    /// The producer stores chain `chain` for `worker`; its delta goes to the publisher.
    pub(crate) fn store(&mut self, worker: u64, chain: usize) {
        let (_, delta) = self
            .producer
            .store_delta(worker, &chains()[chain], HashSalt::default());
        self.publish(delta);
    }

    /// The producer clears `worker`'s blocks.
    pub(crate) fn clear(&mut self, worker: u64) {
        let delta = self.producer.clear_delta(worker);
        self.publish(delta);
    }

    fn publish(&mut self, delta: Option<kvrelay_ckf::Delta>) {
        let Some(delta) = delta else { return };
        let frame = self.producer.encoder.delta(&delta, 0).expect("encode");
        let frame = super::decode_pool_frame(&mut BytesMut::from(&frame[..]));
        self.whole
            .apply_pool_frame(self.whole_key, &frame, self.now)
            .expect("the reference takes every delta in order");
        self.publisher
            .handle_delta(delta, self.now, |_| ())
            .expect("the producer and its publisher agree");
        self.record_answer();
    }

    /// The relay writes up to `max` frames of the open stream onto the wire.
    pub(crate) fn relay_sends(&mut self, max: usize) {
        let encoder =
            PoolFrameEncoder::new(self.relay, self.producer.descriptor.producer, limits());
        let Some(open) = self.open.as_mut() else {
            return;
        };
        for _ in 0..max {
            if open.relay_closed {
                return;
            }
            match self.publisher.poll_transmit(open.id, self.now) {
                Poll::Transmit(transmit) => {
                    let encoded = encoder.transmit(&transmit, 0).expect("encode");
                    open.wire.push_back(encoded.frame);
                }
                Poll::CutOff(cut) => {
                    open.wire
                        .push_back(error_frame(cut_off_reason(cut), cut.label()).freeze());
                    open.relay_closed = true;
                }
                Poll::Unknown => open.relay_closed = true,
                Poll::Idle => return,
            }
        }
    }

    /// The consumer reads up to `max` frames off the wire.
    pub(crate) fn consumer_reads(&mut self, max: usize) {
        for _ in 0..max {
            let Some(open) = self.open.as_mut() else {
                return;
            };
            let Some(bytes) = open.wire.pop_front() else {
                if open.relay_closed {
                    // The relay closed without a word (a cut-off without an error frame).
                    self.finish(StreamEnd::Disconnected);
                }
                return;
            };
            let mut buf = BytesMut::from(&bytes[..]);
            let message = match decode_message(&mut buf, &limits()) {
                Ok(Some(message)) => message,
                // A frame the codec refuses breaks the connection.
                Ok(None) | Err(_) => {
                    self.finish(StreamEnd::Disconnected);
                    return;
                }
            };
            let checked = match open.session.handle_message(self.now, &message) {
                Ok(checked) => checked,
                Err(end) => {
                    self.finish(end);
                    return;
                }
            };
            let outcome = self.state.apply_checked_frame(self.key, &checked, self.now);
            let Some(open) = self.open.as_mut() else {
                return;
            };
            match open.session.handle_applied(self.now, outcome) {
                Ok(_) => self.frames_applied += 1,
                Err(end) => {
                    self.finish(end);
                    return;
                }
            }
        }
    }

    /// Both halves move everything they can, then the clock advances by `step`.
    pub(crate) fn run(&mut self, step: Duration) {
        self.relay_sends(usize::MAX);
        self.consumer_reads(usize::MAX);
        self.advance(step);
    }

    /// Runs until the replica is current at the producer's sequence, at most `bound` of
    /// simulated time; whether it got there.
    pub(crate) fn settle(&mut self, bound: Duration) -> bool {
        let until = self.now + bound;
        while self.now < until {
            self.run(Duration::from_millis(50));
            if self.current_sequence() == Some(self.producer.filter.sequence()) {
                return true;
            }
        }
        false
    }

    /// The clock advances by `by`: the relay's timers, the stream's staleness and the
    /// consumer's retry run.
    pub(crate) fn advance(&mut self, by: Duration) {
        self.now += by;
        self.publisher.handle_timeout(self.now);
        let stale = self
            .open
            .as_ref()
            .and_then(|open| open.session.handle_timeout(self.now));
        if let Some(end) = stale {
            self.finish(end);
        }
        self.tick();
    }

    fn tick(&mut self) {
        if self.open.is_some() || self.retry_at.is_none_or(|at| at > self.now) {
            return;
        }
        self.follow.handle_attempt(self.now);
        let (producer, resume_from) = match self.state.begin_subscription(self.key) {
            Ok(begun) => begun,
            Err(err) => {
                let reason = begin_refused(&err);
                self.after(reason);
                return;
            }
        };
        self.resume_asked.push(resume_from);
        match self.publisher.handle_subscribe(resume_from, true, self.now) {
            Ok((id, start)) => {
                self.opened.push(match start {
                    Start::Snapshot { .. } => Opened::Snapshot,
                    Start::Resume { .. } => Opened::Resumed,
                });
                let session = PoolStream::new(
                    self.relay,
                    producer,
                    self.limits.staleness_bound,
                    self.limits.snapshot_assembly_timeout,
                    self.now,
                );
                self.open = Some(OpenStream {
                    id,
                    session,
                    wire: VecDeque::new(),
                    relay_closed: false,
                });
            }
            Err(_) => {
                // The relay refuses with a resource limit: one error frame, then closed.
                let error =
                    kvrelay_codec::v1::ErrorMessage::new(ErrorReason::ResourceLimit, "full");
                let mut session = PoolStream::new(
                    self.relay,
                    producer,
                    self.limits.staleness_bound,
                    self.limits.snapshot_assembly_timeout,
                    self.now,
                );
                let end = session
                    .handle_message(self.now, &kvrelay_codec::v1::Message::Error(error))
                    .expect_err("an error frame ends the stream");
                self.ends.push(end.clone());
                self.after(Some(end.reason()));
            }
        }
    }

    /// The open stream ends (at the consumer) with `end`; the relay forgets its subscriber.
    pub(crate) fn finish(&mut self, end: StreamEnd) {
        if let Some(open) = self.open.take() {
            self.publisher.handle_unsubscribe(open.id);
        }
        let reason = end.reason();
        self.ends.push(end);
        self.after(Some(reason));
    }

    fn after(&mut self, reason: Option<kvrelay_consumer::ResubscribeReason>) {
        let after = self.follow.handle_ended(self.now, reason, false, NO_JITTER);
        match after.replica {
            ReplicaAfterStream::Suspend => self.state.suspend(self.key),
            ReplicaAfterStream::Invalidate => self.state.invalidate(self.key),
        }
        self.retry_at = after.retry_at;
    }

    /// The connection breaks: what is in flight is lost.
    pub(crate) fn cut(&mut self) {
        if self.open.is_some() {
            self.finish(StreamEnd::Disconnected);
        }
    }

    /// Another subscriber of the relay's publisher (it takes a slot and never reads).
    pub(crate) fn other_subscriber(&mut self) -> Option<SubscriberId> {
        self.publisher
            .handle_subscribe(None, true, self.now)
            .ok()
            .map(|(id, _)| id)
    }

    /// That subscriber leaves.
    pub(crate) fn drop_subscriber(&mut self, id: SubscriberId) {
        self.publisher.handle_unsubscribe(id);
    }

    /// The frames in flight now.
    pub(crate) fn in_flight(&self) -> usize {
        self.open.as_ref().map_or(0, |open| open.wire.len())
    }

    /// Changes the oldest frame in flight with `fault`; false when nothing is in flight.
    pub(crate) fn on_wire(&mut self, fault: WireFault) -> bool {
        let Some(open) = self.open.as_mut() else {
            return false;
        };
        let Some(front) = open.wire.pop_front() else {
            return false;
        };
        match fault {
            WireFault::Lose => {}
            WireFault::Duplicate => {
                open.wire.push_front(front.clone());
                open.wire.push_front(front);
            }
            WireFault::Delay => match open.wire.pop_front() {
                Some(second) => {
                    open.wire.push_front(front);
                    open.wire.push_front(second);
                }
                None => open.wire.push_front(front),
            },
            WireFault::Corrupt => {
                let mut bytes = BytesMut::from(&front[..]);
                let last = bytes.len() - 1;
                bytes[last] ^= 0x5a;
                open.wire.push_front(bytes.freeze());
            }
        }
        true
    }

    /// Puts `frame` in flight ahead of everything else (a frame the relay should never
    /// have sent).
    pub(crate) fn inject(&mut self, frame: Bytes) {
        if let Some(open) = self.open.as_mut() {
            open.wire.push_front(frame);
        }
    }

    /// The replica's state now.
    pub(crate) fn replica(&self) -> ReplicaState {
        self.state.pools(self.now).remove(0).replica
    }

    /// The sequence of a current replica.
    pub(crate) fn current_sequence(&self) -> Option<u64> {
        let status = self.state.pools(self.now).remove(0);
        (status.replica == ReplicaState::Current)
            .then_some(status.sequence)
            .flatten()
    }

    /// The invariant: a current replica answers every chain exactly as the producer did
    /// at its sequence; one that is not current does not answer. `Err` says what broke.
    pub(crate) fn check(&self) -> Result<(), String> {
        let depths = chain_depths(&self.state, &chains(), self.now);
        match self.current_sequence() {
            Some(sequence) => match self.answers.get(&sequence) {
                None => Err(format!("current at a sequence never produced: {sequence}")),
                Some(expected) if depths.as_ref() != Some(expected) => Err(format!(
                    "at sequence {sequence}: answers {depths:?}, the producer {expected:?}"
                )),
                Some(_) => Ok(()),
            },
            None if depths.is_some() => Err("a replica that is not current answered".into()),
            None => Ok(()),
        }
    }
}

/// What the network does to the oldest frame in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WireFault {
    Lose,
    Duplicate,
    /// Swapped with the frame behind it.
    Delay,
    Corrupt,
}
