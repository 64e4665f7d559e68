//! The relay↔consumer pair of one pool stream without sockets (`support::pair`): the
//! relay's publisher and frame encoder on one side, the consumer's `link::pool` session
//! and state on the other, a simulated clock and injected network faults between them.
//! What the TCP fake's pool-stream tests cover, in microseconds and deterministically.

use crate::support;

use std::time::Duration;

use bytes::BytesMut;
use kvrelay_ckf::stream::StreamLimits;
use kvrelay_codec::session::PoolFrameEncoder;
use kvrelay_codec::v1::{ErrorMessage, ErrorReason, Message, encode_message};
use kvrelay_consumer::link::pool::StreamEnd;
use kvrelay_consumer::{Limits, ReplicaState, ResubscribeReason};
use support::pair::{Opened, Pair, WireFault};

const SETTLE: Duration = Duration::from_secs(60);

fn current_pair() -> Pair {
    let mut pair = Pair::new(StreamLimits::default(), Limits::default());
    assert!(pair.settle(SETTLE), "the first snapshot installs");
    pair
}

fn reasons(pair: &Pair) -> Vec<ResubscribeReason> {
    pair.ends.iter().map(StreamEnd::reason).collect()
}

fn error_bytes(reason: ErrorReason) -> bytes::Bytes {
    let mut frame = BytesMut::new();
    let error = Message::Error(ErrorMessage::new(reason, "injected"));
    encode_message(&error, &kvrelay_codec::Limits::default(), &mut frame).unwrap();
    frame.freeze()
}

#[test]
fn a_snapshot_then_deltas_keep_the_replica_equal_to_the_producer() {
    let mut pair = current_pair();
    assert_eq!(pair.opened, vec![Opened::Snapshot]);
    for chain in 0..6 {
        pair.store(chain as u64 % 3, chain);
        pair.run(Duration::from_millis(10));
        pair.check().unwrap();
        assert_eq!(
            pair.current_sequence(),
            Some(pair.producer.filter.sequence())
        );
    }
    pair.clear(1);
    pair.run(Duration::from_millis(10));
    pair.check().unwrap();
    assert_eq!(
        pair.current_sequence(),
        Some(pair.producer.filter.sequence())
    );
    assert!(pair.ends.is_empty(), "{:?}", pair.ends);
}

#[test]
fn deltas_a_slow_reader_missed_arrive_coalesced_in_one_frame() {
    let mut pair = current_pair();
    let applied = pair.frames_applied;
    for chain in 0..5 {
        pair.store(0, chain);
    }
    pair.relay_sends(usize::MAX);
    assert_eq!(pair.in_flight(), 1, "five deltas, one coalesced frame");
    pair.consumer_reads(usize::MAX);
    assert_eq!(pair.frames_applied, applied + 1);
    assert_eq!(
        pair.current_sequence(),
        Some(pair.producer.filter.sequence())
    );
    pair.check().unwrap();
}

#[test]
fn a_cut_mid_snapshot_never_serves_a_partial_replica_and_recovers() {
    let mut pair = Pair::sized(2_000_000, StreamLimits::default(), Limits::default());
    pair.store(0, 2);
    // The first of two chunks reaches the consumer; then the connection breaks.
    pair.relay_sends(1);
    pair.consumer_reads(usize::MAX);
    assert_eq!(pair.frames_applied, 1);
    assert_ne!(pair.replica(), ReplicaState::Current);
    pair.check().unwrap();
    pair.cut();
    pair.check().unwrap();
    assert_eq!(reasons(&pair), vec![ResubscribeReason::Disconnected]);
    assert!(pair.settle(SETTLE));
    pair.check().unwrap();
    assert_eq!(pair.opened, vec![Opened::Snapshot, Opened::Snapshot]);
}

#[test]
fn a_broken_stream_resumes_from_the_replica_without_a_snapshot() {
    let mut pair = current_pair();
    pair.store(0, 1);
    pair.run(Duration::from_millis(10));
    pair.cut();
    assert_ne!(
        pair.replica(),
        ReplicaState::Current,
        "suspended, not scored"
    );
    pair.check().unwrap();
    pair.store(1, 2);
    pair.store(2, 3);
    assert!(pair.settle(SETTLE));
    pair.check().unwrap();
    assert_eq!(pair.opened, vec![Opened::Snapshot, Opened::Resumed]);
}

#[test]
fn a_consumer_that_stops_reading_is_cut_off_for_lag_and_catches_up() {
    let stream = StreamLimits {
        max_backlog_bytes: Some(64),
        min_uncoalesced_backlog_bytes: 0,
        ..StreamLimits::default()
    };
    let mut pair = Pair::new(stream, Limits::default());
    assert!(pair.settle(SETTLE));
    // The consumer reads nothing while the producer goes on: the relay's backlog grows.
    for chain in 0..6 {
        pair.store(chain as u64, chain);
    }
    assert!(pair.settle(SETTLE));
    pair.check().unwrap();
    assert_eq!(reasons(&pair), vec![ResubscribeReason::Lagged]);
    assert!(
        matches!(&pair.ends[0], StreamEnd::Refused { error, .. } if error.effective_reason() == ErrorReason::SubscriberLagged),
        "{:?}",
        pair.ends
    );
    // The consumer kept its replica and asked to resume; what it missed is over the
    // relay's backlog bound, so the relay answered with a snapshot.
    assert!(pair.resume_asked[1].is_some(), "{:?}", pair.resume_asked);
    assert_eq!(pair.opened, vec![Opened::Snapshot, Opened::Snapshot]);
}

#[test]
fn a_silent_relay_makes_the_stream_stale_and_the_pool_resubscribes() {
    let mut pair = current_pair();
    let bound = Limits::default().staleness_bound;
    // The relay sends nothing (not even heartbeats) past the staleness bound.
    pair.advance(bound - Duration::from_secs(1));
    assert!(pair.ends.is_empty());
    pair.advance(Duration::from_secs(1));
    assert_eq!(pair.ends, vec![StreamEnd::Stale { bound }]);
    assert_ne!(pair.replica(), ReplicaState::Current);
    pair.check().unwrap();
    assert!(pair.settle(SETTLE));
    assert_eq!(pair.opened, vec![Opened::Snapshot, Opened::Resumed]);
}

#[test]
fn heartbeats_keep_a_quiet_stream_fresh() {
    let mut pair = current_pair();
    let bound = Limits::default().staleness_bound;
    let until = pair.now + bound * 4;
    while pair.now < until {
        pair.run(Duration::from_secs(1));
    }
    assert!(pair.ends.is_empty(), "{:?}", pair.ends);
    assert_eq!(
        pair.current_sequence(),
        Some(pair.producer.filter.sequence())
    );
}

#[test]
fn a_lost_delta_is_a_gap_and_the_replica_starts_over_from_a_snapshot() {
    let mut pair = current_pair();
    pair.store(0, 1);
    pair.relay_sends(usize::MAX);
    assert!(pair.on_wire(WireFault::Lose));
    pair.store(0, 2);
    pair.relay_sends(usize::MAX);
    pair.consumer_reads(usize::MAX);
    assert_eq!(reasons(&pair), vec![ResubscribeReason::Gap]);
    assert_eq!(pair.replica(), ReplicaState::Missing);
    pair.check().unwrap();
    assert!(pair.settle(SETTLE));
    assert_eq!(pair.opened, vec![Opened::Snapshot, Opened::Snapshot]);
}

#[test]
fn a_corrupted_delta_fails_its_checksum_and_nothing_of_it_is_applied() {
    let mut pair = current_pair();
    let before = pair.current_sequence();
    pair.store(0, 1);
    pair.relay_sends(usize::MAX);
    assert!(pair.on_wire(WireFault::Corrupt));
    pair.consumer_reads(usize::MAX);
    assert_eq!(reasons(&pair), vec![ResubscribeReason::Checksum]);
    assert!(before.is_some());
    assert_eq!(pair.replica(), ReplicaState::Missing);
    pair.check().unwrap();
    assert!(pair.settle(SETTLE));
    pair.check().unwrap();
}

#[test]
fn a_frame_from_another_relay_incarnation_ends_the_stream_as_a_restart() {
    let mut pair = current_pair();
    let restarted = PoolFrameEncoder::new(
        support::relay_identity(2),
        pair.producer.descriptor.producer,
        kvrelay_codec::Limits::default(),
    );
    let frame = restarted
        .heartbeat(pair.producer.filter.sequence(), 0)
        .unwrap();
    pair.inject(frame);
    pair.consumer_reads(1);
    assert_eq!(pair.ends, vec![StreamEnd::RelayRestarted]);
    assert_eq!(pair.replica(), ReplicaState::Missing);
    pair.check().unwrap();
}

#[test]
fn a_snapshot_that_never_completes_is_abandoned_at_the_assembly_deadline() {
    let consumer = Limits {
        snapshot_assembly_timeout: Duration::from_secs(2),
        ..Limits::default()
    };
    let mut pair = Pair::sized(2_000_000, StreamLimits::default(), consumer);
    // The first chunk arrives again and again (frames flow, so the stream is not stale),
    // the second never.
    pair.relay_sends(1);
    for _ in 0..30 {
        assert!(pair.on_wire(WireFault::Duplicate));
        pair.consumer_reads(1);
        pair.advance(Duration::from_millis(100));
        if !pair.ends.is_empty() {
            break;
        }
    }
    assert_eq!(
        pair.ends,
        vec![StreamEnd::SnapshotOverdue {
            timeout: Duration::from_secs(2)
        }]
    );
    assert_eq!(reasons(&pair), vec![ResubscribeReason::Stale]);
    pair.check().unwrap();
    assert!(pair.settle(SETTLE));
}

#[test]
fn a_retired_generation_stops_its_subscription_for_good() {
    let mut pair = current_pair();
    pair.inject(error_bytes(ErrorReason::ProducerChanged));
    pair.consumer_reads(1);
    assert_eq!(reasons(&pair), vec![ResubscribeReason::ProducerChanged]);
    // The relay's next catalog names a new generation: the old key leaves it.
    let relay = support::relay_identity(1);
    let mut spec = support::PoolSpec::aggregated("alpha", "llama");
    spec.expected_blocks = 1024;
    let next = support::Producer::new(&spec, "dc-0", relay, 2);
    let change = pair
        .state
        .apply_catalog(0, &support::catalog_of(relay, 2, &[&next]))
        .unwrap();
    assert_eq!(change.removed, vec![pair.key]);
    let opened = pair.opened.len();
    for _ in 0..100 {
        pair.run(Duration::from_millis(100));
    }
    assert_eq!(
        pair.opened.len(),
        opened,
        "the retired generation is not followed again"
    );
}

#[test]
fn a_subscription_the_relay_refuses_is_retried_after_backoff_and_resumes() {
    let stream = StreamLimits {
        max_subscribers: 1,
        ..StreamLimits::default()
    };
    let mut pair = Pair::new(stream, Limits::default());
    assert!(pair.settle(SETTLE));
    pair.cut();
    // Another subscriber takes the pool's only slot before the consumer comes back.
    let other = pair.other_subscriber().unwrap();
    for _ in 0..20 {
        pair.run(Duration::from_millis(100));
    }
    assert!(
        pair.ends[1..]
            .iter()
            .all(|end| matches!(end, StreamEnd::Refused { error, .. } if error.effective_reason() == ErrorReason::ResourceLimit)),
        "{:?}",
        pair.ends
    );
    let refusals = pair.ends.len() - 1;
    assert!(
        (2..=8).contains(&refusals),
        "retried, on a growing backoff: {refusals} refusals in 2 s"
    );
    pair.drop_subscriber(other);
    pair.store(0, 4);
    assert!(pair.settle(SETTLE));
    pair.check().unwrap();
    assert_eq!(pair.opened, vec![Opened::Snapshot, Opened::Resumed]);
}

/// One step of the pair proptest.
#[derive(Debug, Clone)]
enum Step {
    Store { worker: u64, chain: usize },
    Clear { worker: u64 },
    RelaySends(usize),
    ConsumerReads(usize),
    Wire(WireFault),
    Cut,
    Advance(Duration),
}

fn step() -> impl proptest::strategy::Strategy<Value = Step> {
    use proptest::prelude::*;
    prop_oneof![
        4 => (0..3u64, 0..6usize).prop_map(|(worker, chain)| Step::Store { worker, chain }),
        1 => (0..3u64).prop_map(|worker| Step::Clear { worker }),
        4 => (1..4usize).prop_map(Step::RelaySends),
        4 => (1..4usize).prop_map(Step::ConsumerReads),
        1 => Just(Step::Wire(WireFault::Lose)),
        1 => Just(Step::Wire(WireFault::Delay)),
        1 => Just(Step::Wire(WireFault::Duplicate)),
        1 => Just(Step::Wire(WireFault::Corrupt)),
        1 => Just(Step::Cut),
        // Up to 40 s: past the relay's heartbeat interval and the consumer's staleness
        // bound, so silences and heartbeats both happen.
        2 => (1..40_000u64).prop_map(|ms| Step::Advance(Duration::from_millis(ms))),
    ]
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(128))]

    /// Under random producer changes, partial sends and reads, lost, delayed, repeated and
    /// corrupted frames, cuts and silences, the consumer's replica always equals the
    /// producer at some sequence it published or says it is not current (and does not
    /// answer); once the network heals, the link alone (its backoff, resume and
    /// snapshots) brings it to the producer's newest sequence.
    #[test]
    fn the_replica_equals_the_producer_at_some_sequence_or_is_marked_not_current(
        steps in proptest::collection::vec(step(), 1..80),
        small_backlog in proptest::bool::ANY,
    ) {
        let stream = StreamLimits {
            max_backlog_bytes: small_backlog.then_some(256),
            min_uncoalesced_backlog_bytes: 0,
            ..StreamLimits::default()
        };
        let mut pair = Pair::new(stream, Limits::default());
        for step in steps {
            match step {
                Step::Store { worker, chain } => pair.store(worker, chain),
                Step::Clear { worker } => pair.clear(worker),
                Step::RelaySends(n) => pair.relay_sends(n),
                Step::ConsumerReads(n) => pair.consumer_reads(n),
                Step::Wire(fault) => {
                    pair.on_wire(fault);
                }
                Step::Cut => pair.cut(),
                Step::Advance(by) => pair.advance(by),
            }
            if let Err(broken) = pair.check() {
                proptest::prop_assert!(false, "after {:?}: {}", pair.ends, broken);
            }
        }
        proptest::prop_assert!(pair.settle(SETTLE), "healed: ends {:?}", pair.ends);
        proptest::prop_assert_eq!(pair.check(), Ok(()));
    }
}
