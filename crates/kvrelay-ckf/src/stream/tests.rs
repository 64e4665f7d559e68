//! Publisher tests: unit cases, and an in-memory pair proptest against a model replica.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

fn limits(chunk_buckets: u32) -> StreamLimits {
    StreamLimits {
        chunk_buckets: NonZeroU32::new(chunk_buckets).unwrap(),
        ..StreamLimits::default()
    }
}

fn delta(base: u64, images: &[(u32, u64)]) -> Delta {
    Delta {
        base_sequence: base,
        sequence: base + 1,
        images: images
            .iter()
            .map(|&(bucket_idx, word)| BucketImage { bucket_idx, word })
            .collect(),
    }
}

/// A subscriber's replica, as a consumer keeps it: words plus the installed sequence.
#[derive(Debug, Clone)]
struct ModelReplica {
    words: Vec<u64>,
    /// Installed and complete at this sequence.
    ready: Option<u64>,
    /// Snapshot being assembled: (sequence, next chunk).
    assembling: Option<(u64, u32)>,
}

impl ModelReplica {
    fn new(bucket_count: usize) -> Self {
        Self {
            words: vec![0; bucket_count],
            ready: None,
            assembling: None,
        }
    }

    /// Applies one transmit; returns the sequence it is complete at afterwards, if any.
    fn apply(
        &mut self,
        transmit: &Transmit<u64>,
        chunk_buckets: usize,
        coalescing: bool,
    ) -> Option<u64> {
        match transmit {
            Transmit::SnapshotChunk {
                words,
                sequence,
                chunk_index,
                chunk_count,
            } => {
                if *chunk_index == 0 {
                    self.ready = None;
                    self.assembling = Some((*sequence, 0));
                }
                let (assembling_at, next) =
                    self.assembling.expect("chunk without a snapshot start");
                assert_eq!(
                    (assembling_at, next),
                    (*sequence, *chunk_index),
                    "chunks in order"
                );
                let start = *chunk_index as usize * chunk_buckets;
                let end = (start + chunk_buckets).min(words.len());
                self.words[start..end].copy_from_slice(&words[start..end]);
                if chunk_index + 1 == *chunk_count {
                    self.assembling = None;
                    self.ready = Some(*sequence);
                } else {
                    self.assembling = Some((*sequence, chunk_index + 1));
                }
            }
            Transmit::Delta {
                delta,
                encoded,
                covers,
            } => {
                let at = self.ready.expect("delta before a complete snapshot");
                assert_eq!(delta.base_sequence, at, "a delta skips or repeats a change");
                assert!(delta.sequence > delta.base_sequence);
                if !coalescing {
                    assert_eq!(delta.sequence, delta.base_sequence + 1);
                }
                if let Some(encoded) = encoded {
                    assert_eq!(*covers, 1);
                    assert_eq!(
                        *encoded, delta.sequence,
                        "a lone delta keeps its own encoding"
                    );
                }
                for image in &delta.images {
                    self.words[image.bucket_idx as usize] = image.word;
                }
                self.ready = Some(delta.sequence);
            }
            Transmit::Heartbeat { sequence } => {
                assert_eq!(self.ready, Some(*sequence), "heartbeat at another sequence");
            }
        }
        self.ready
    }
}

#[test]
fn coalesce_keeps_the_latest_image_of_each_bucket() {
    let merged = coalesce([
        &delta(4, &[(1, 10), (5, 50)]),
        &delta(5, &[(2, 20), (5, 51)]),
        &delta(6, &[(1, 11)]),
    ])
    .unwrap();
    assert_eq!((merged.base_sequence, merged.sequence), (4, 7));
    let images: Vec<(u32, u64)> = merged
        .images
        .iter()
        .map(|i| (i.bucket_idx, i.word))
        .collect();
    assert_eq!(images, vec![(1, 11), (2, 20), (5, 51)]);
    assert_eq!(coalesce(std::iter::empty()), None);
}

#[test]
fn a_rejected_delta_changes_nothing() {
    let now = Instant::now();
    let mut publisher: Publisher<u64> = Publisher::new(3, vec![0; 8], limits(4)).unwrap();
    let cases = [
        (delta(2, &[(1, 1)]), "gap"),
        (
            Delta {
                base_sequence: 3,
                sequence: 3,
                images: vec![BucketImage {
                    bucket_idx: 1,
                    word: 1,
                }],
            },
            "stand still",
        ),
        (delta(3, &[]), "empty"),
        (delta(3, &[(8, 1)]), "out of range"),
        (delta(3, &[(2, 1), (2, 3)]), "unsorted"),
    ];
    for (bad, what) in cases {
        assert!(
            publisher.handle_delta(bad, now, |d| d.sequence).is_err(),
            "{what}"
        );
        assert_eq!(publisher.sequence(), 3, "{what}");
        assert!(publisher.words().iter().all(|&w| w == 0), "{what}");
    }
}

#[test]
fn a_slow_subscriber_gets_one_coalesced_delta() {
    let now = Instant::now();
    let mut publisher: Publisher<u64> = Publisher::new(0, vec![0; 8], limits(8)).unwrap();
    let (id, start) = publisher.handle_subscribe(None, true, now).unwrap();
    assert_eq!(start, Start::Snapshot { sequence: 0 });
    assert!(matches!(
        publisher.poll_transmit(id, now),
        Poll::Transmit(Transmit::SnapshotChunk { .. })
    ));
    for base in 0..100u64 {
        publisher
            .handle_delta(delta(base, &[((base % 8) as u32, base + 1)]), now, |d| {
                d.sequence
            })
            .unwrap();
    }
    let Poll::Transmit(Transmit::Delta {
        delta,
        encoded,
        covers,
    }) = publisher.poll_transmit(id, now)
    else {
        panic!("expected a delta");
    };
    assert_eq!((delta.base_sequence, delta.sequence, covers), (0, 100, 100));
    assert_eq!(encoded, None);
    assert_eq!(delta.images.len(), 8);
    assert!(matches!(publisher.poll_transmit(id, now), Poll::Idle));
    let stats = publisher.stats();
    assert_eq!(
        (
            stats.coalesced_frames,
            stats.coalesced_deltas,
            stats.cut_offs_backlog
        ),
        (1, 100, 0)
    );
}

#[test]
fn a_subscriber_without_coalescing_is_cut_off_at_the_byte_bound() {
    let now = Instant::now();
    let bound = 3 * (DELTA_FRAME_OVERHEAD + IMAGE_WIRE_BYTES);
    let stream_limits = StreamLimits {
        max_backlog_bytes: Some(bound),
        min_uncoalesced_backlog_bytes: 0,
        ..limits(8)
    };
    let mut publisher: Publisher<u64> = Publisher::new(0, vec![0; 8], stream_limits).unwrap();
    let (old, _) = publisher.handle_subscribe(None, false, now).unwrap();
    let (new, _) = publisher.handle_subscribe(None, true, now).unwrap();
    for base in 0..4u64 {
        publisher
            .handle_delta(delta(base, &[(1, base + 1)]), now, |d| d.sequence)
            .unwrap();
    }
    assert!(matches!(
        publisher.poll_transmit(old, now),
        Poll::CutOff(CutOff::Backlog { .. })
    ));
    // The coalescing subscriber's four deltas fold into one and stay within the bound.
    assert!(matches!(
        publisher.poll_transmit(new, now),
        Poll::Transmit(Transmit::SnapshotChunk { .. })
    ));
    let Poll::Transmit(Transmit::Delta { delta, covers, .. }) = publisher.poll_transmit(new, now)
    else {
        panic!("expected a delta");
    };
    assert_eq!((delta.base_sequence, delta.sequence, covers), (0, 4, 4));
    assert_eq!(publisher.stats().cut_offs_backlog, 1);
    assert_eq!(publisher.live_subscriber_count(), 1);
}

#[test]
fn a_subscriber_without_coalescing_keeps_up_to_its_own_larger_bound() {
    let now = Instant::now();
    let frame = DELTA_FRAME_OVERHEAD + IMAGE_WIRE_BYTES;
    let stream_limits = StreamLimits {
        max_backlog_bytes: Some(frame),
        min_uncoalesced_backlog_bytes: 4 * frame,
        ..limits(8)
    };
    let mut publisher: Publisher<u64> = Publisher::new(0, vec![0; 8], stream_limits).unwrap();
    assert_eq!(
        (
            publisher.backlog_bound(),
            publisher.uncoalesced_backlog_bound()
        ),
        (frame, 4 * frame)
    );
    let (uncoalesced, _) = publisher.handle_subscribe(None, false, now).unwrap();
    let publish = |publisher: &mut Publisher<u64>, base: u64| {
        publisher
            .handle_delta(delta(base, &[(1, base + 1)]), now, |d| d.sequence)
            .unwrap();
    };
    for base in 0..4 {
        publish(&mut publisher, base);
    }
    // Four separate deltas: within its own bound, though four times the coalesced one.
    assert!(matches!(
        publisher.poll_transmit(uncoalesced, now),
        Poll::Transmit(Transmit::SnapshotChunk { .. })
    ));
    for sequence in 1..=4 {
        let Poll::Transmit(Transmit::Delta { delta, covers, .. }) =
            publisher.poll_transmit(uncoalesced, now)
        else {
            panic!("expected delta {sequence}");
        };
        assert_eq!((delta.sequence, covers), (sequence, 1));
    }
    // A fifth pending delta passes it.
    for base in 4..9 {
        publish(&mut publisher, base);
    }
    assert!(matches!(
        publisher.poll_transmit(uncoalesced, now),
        Poll::CutOff(CutOff::Backlog { limit, .. }) if limit == 4 * frame
    ));
    // A bound below the coalesced one never lowers it.
    let floor_below = StreamLimits {
        max_backlog_bytes: Some(4 * frame),
        min_uncoalesced_backlog_bytes: frame,
        ..limits(8)
    };
    let publisher: Publisher<u64> = Publisher::new(0, vec![0; 8], floor_below).unwrap();
    assert_eq!(publisher.uncoalesced_backlog_bound(), 4 * frame);
}

#[test]
fn resume_sends_what_was_missed_or_a_heartbeat_when_current() {
    let now = Instant::now();
    let stream_limits = StreamLimits {
        resume_window_bytes: 3 * (DELTA_FRAME_OVERHEAD + IMAGE_WIRE_BYTES),
        ..limits(8)
    };
    let mut publisher: Publisher<u64> = Publisher::new(10, vec![0; 8], stream_limits).unwrap();
    for base in 10..15u64 {
        publisher
            .handle_delta(delta(base, &[(2, base)]), now, |d| d.sequence)
            .unwrap();
    }
    // Current: a heartbeat at once, no snapshot.
    let (current, start) = publisher.handle_subscribe(Some(15), true, now).unwrap();
    assert_eq!(start, Start::Resume { from: 15 });
    assert!(matches!(
        publisher.poll_transmit(current, now),
        Poll::Transmit(Transmit::Heartbeat { sequence: 15 })
    ));
    // Within the window (the last three deltas): one coalesced delta.
    let (behind, start) = publisher.handle_subscribe(Some(12), true, now).unwrap();
    assert_eq!(start, Start::Resume { from: 12 });
    let Poll::Transmit(Transmit::Delta { delta, .. }) = publisher.poll_transmit(behind, now) else {
        panic!("expected a delta");
    };
    assert_eq!((delta.base_sequence, delta.sequence), (12, 15));
    // Beyond the window, or ahead of the publisher: a snapshot.
    for from in [11, 16] {
        let (_, start) = publisher.handle_subscribe(Some(from), true, now).unwrap();
        assert_eq!(start, Start::Snapshot { sequence: 15 });
    }
    let stats = publisher.stats();
    assert_eq!(
        (stats.resumes, stats.resume_misses, stats.retained_deltas),
        (2, 2, 3)
    );
}

#[test]
fn a_stalled_snapshot_is_cut_off_and_heartbeats_follow_the_interval() {
    let t0 = Instant::now();
    let stream_limits = StreamLimits {
        heartbeat_interval: Duration::from_secs(10),
        snapshot_progress_timeout: Duration::from_secs(60),
        ..limits(4)
    };
    let mut publisher: Publisher<u64> = Publisher::new(0, vec![0; 8], stream_limits).unwrap();
    let (stalled, _) = publisher.handle_subscribe(None, true, t0).unwrap();
    let (reader, _) = publisher.handle_subscribe(None, true, t0).unwrap();
    for _ in 0..2 {
        assert!(matches!(
            publisher.poll_transmit(reader, t0),
            Poll::Transmit(Transmit::SnapshotChunk { .. })
        ));
    }
    assert!(matches!(publisher.poll_transmit(reader, t0), Poll::Idle));
    assert_eq!(
        publisher.poll_timeout(reader),
        Some(t0 + Duration::from_secs(10))
    );
    assert_eq!(
        publisher.poll_timeout(stalled),
        Some(t0 + Duration::from_secs(60))
    );
    publisher.handle_timeout(t0 + Duration::from_secs(61));
    assert!(matches!(
        publisher.poll_transmit(stalled, t0),
        Poll::CutOff(CutOff::SnapshotStalled { .. })
    ));
    assert!(matches!(
        publisher.poll_transmit(reader, t0 + Duration::from_secs(61)),
        Poll::Transmit(Transmit::Heartbeat { sequence: 0 })
    ));
    assert_eq!(publisher.stats().cut_offs_snapshot_stalled, 1);
    publisher.handle_unsubscribe(stalled);
    assert!(matches!(
        publisher.poll_transmit(stalled, t0),
        Poll::Unknown
    ));
}

#[test]
fn the_subscriber_limit_is_enforced() {
    let now = Instant::now();
    let stream_limits = StreamLimits {
        max_subscribers: 1,
        ..limits(8)
    };
    let mut publisher: Publisher<u64> = Publisher::new(0, vec![0; 8], stream_limits).unwrap();
    let (first, _) = publisher.handle_subscribe(None, true, now).unwrap();
    assert_eq!(
        publisher.handle_subscribe(None, true, now),
        Err(SubscribeRefused::SubscriberLimit { limit: 1 })
    );
    publisher.handle_unsubscribe(first);
    assert!(publisher.handle_subscribe(None, true, now).is_ok());
}

#[test]
fn no_encoding_without_a_live_subscriber() {
    let now = Instant::now();
    let mut publisher: Publisher<u64> = Publisher::new(0, vec![0; 8], limits(8)).unwrap();
    publisher
        .handle_delta(delta(0, &[(1, 1)]), now, |_| {
            panic!("encoded with nobody subscribed")
        })
        .unwrap();
    assert_eq!(publisher.words()[1], 1);
}

#[test]
fn snapshots_at_the_pin_bound_share_the_newest_version_or_are_refused() {
    let now = Instant::now();
    let bound = |window| StreamLimits {
        max_pinned_snapshots: 1,
        resume_window_bytes: window,
        ..limits(4)
    };
    for window in [DEFAULT_RESUME_WINDOW_BYTES, 0] {
        let mut publisher: Publisher<u64> = Publisher::new(0, vec![0; 8], bound(window)).unwrap();
        let mut producer = vec![0u64; 8];
        // A starts a snapshot at 0 and reads nothing; a delta makes version 0 a copy.
        let (a, _) = publisher.handle_subscribe(None, true, now).unwrap();
        publisher
            .handle_delta(delta(0, &[(3, 7)]), now, |d| d.sequence)
            .unwrap();
        producer[3] = 7;
        assert_eq!(publisher.stats().pinned_copies, 1);
        assert_eq!(publisher.stats().pinned_copy_bytes, 64);
        let b = publisher.handle_subscribe(None, true, now);
        if window == 0 {
            // The window cannot bring version 0 forward: refused, nothing pinned more.
            assert_eq!(b, Err(SubscribeRefused::SnapshotLimit { limit: 1 }));
            assert_eq!(publisher.stats().snapshot_refusals, 1);
            assert_eq!(publisher.stats().pinned_copies, 1);
            // Once A's snapshot is through, the pin is gone and B gets the mirror.
            while let Poll::Transmit(Transmit::SnapshotChunk { .. }) =
                publisher.poll_transmit(a, now)
            {}
            assert_eq!(publisher.stats().pinned_copies, 0);
            let (_, start) = publisher.handle_subscribe(None, true, now).unwrap();
            assert_eq!(start, Start::Snapshot { sequence: 1 });
            continue;
        }
        // B shares version 0 (no second copy) and gets the delta since from the window.
        let (b, start) = b.unwrap();
        assert_eq!(start, Start::Snapshot { sequence: 0 });
        assert_eq!(publisher.stats().snapshots_shared, 1);
        assert_eq!(publisher.stats().pinned_copies, 1);
        let mut replica = ModelReplica::new(8);
        let mut at = None;
        while let Poll::Transmit(transmit) = publisher.poll_transmit(b, now) {
            at = replica.apply(&transmit, 4, true);
        }
        assert_eq!(at, Some(1));
        assert_eq!(replica.words, producer);
    }
}

/// A lagging subscriber's backlog that merges into more images than one delta may carry
/// is handed out in runs that each fit, chaining exactly, instead of one delta no frame
/// can hold; the replica ends equal to the producer, with no snapshot.
#[test]
fn a_backlog_coalesces_in_runs_that_each_fit_a_frame() {
    let bucket_count = 64;
    let stream_limits = StreamLimits {
        max_delta_images: 10,
        ..limits(64)
    };
    let now = Instant::now();
    let mut producer = vec![0u64; bucket_count];
    let mut publisher: Publisher<u64> = Publisher::new(0, producer.clone(), stream_limits).unwrap();
    let (id, _) = publisher.handle_subscribe(None, true, now).unwrap();
    let mut replica = ModelReplica::new(bucket_count);
    while let Poll::Transmit(transmit) = publisher.poll_transmit(id, now) {
        replica.apply(&transmit, 64, true);
    }
    // 12 deltas of 4 distinct buckets each: 48 images, no bucket written twice.
    for step in 0..12u32 {
        let images: Vec<(u32, u64)> = (0..4)
            .map(|k| (step * 4 + k, u64::from(step) + 1))
            .collect();
        for &(bucket, word) in &images {
            producer[bucket as usize] = word;
        }
        publisher
            .handle_delta(delta(u64::from(step), &images), now, |d| d.sequence)
            .unwrap();
    }
    let mut sizes = Vec::new();
    let mut base = 0;
    while let Poll::Transmit(transmit) = publisher.poll_transmit(id, now) {
        if let Transmit::Delta { delta, covers, .. } = &transmit {
            assert_eq!(delta.base_sequence, base, "runs chain");
            base = delta.sequence;
            sizes.push((delta.images.len(), *covers));
        }
        replica.apply(&transmit, 64, true);
    }
    // Runs of two deltas (8 images; a third would make 12 > 10).
    assert_eq!(sizes, vec![(8, 2); 6]);
    assert_eq!(replica.words, producer);
    assert_eq!(publisher.stats().coalesced_frames, 6);
    assert_eq!(publisher.stats().snapshots, 1);
}

/// A zero `max_delta_images` is refused, naming the field.
#[test]
fn a_zero_max_delta_images_is_refused() {
    let zero = StreamLimits {
        max_delta_images: 0,
        ..StreamLimits::default()
    };
    assert_eq!(
        zero.validate(),
        Err(StreamLimitsError::Zero {
            field: "max_delta_images"
        })
    );
}

#[derive(Debug, Clone)]
enum Op {
    /// Publish a delta writing these buckets.
    Publish(Vec<(u32, u64)>),
    /// Subscriber `n` takes up to `k` frames.
    Read(usize, usize),
    /// Subscriber `n` disconnects (keeps its replica) and resubscribes, resuming.
    Reconnect(usize),
    /// Time passes (heartbeats, snapshot deadlines).
    Wait(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => proptest::collection::vec((0u32..32, 0u64..6), 1..6).prop_map(Op::Publish),
        3 => (0usize..3, 1usize..6).prop_map(|(n, k)| Op::Read(n, k)),
        1 => (0usize..3).prop_map(Op::Reconnect),
        1 => (0u64..30_000).prop_map(Op::Wait),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Random deltas, slow and stalled subscribers, disconnects and resumes, snapshots
    /// mid-stream, backlogs over the bound: whenever a subscriber's replica is complete
    /// at a sequence it equals the producer's table at that sequence, and no delta skips
    /// or repeats a change.
    #[test]
    fn every_subscriber_matches_the_producer_at_its_sequence(
        ops in proptest::collection::vec(op(), 1..120),
        chunk_buckets in prop_oneof![Just(8u32), Just(32)],
        backlog in prop_oneof![Just(None), (1u64..8).prop_map(|n| Some(n * (DELTA_FRAME_OVERHEAD + IMAGE_WIRE_BYTES)))],
        window in prop_oneof![Just(0u64), Just(2_000), Just(1 << 20)],
        coalescing in proptest::collection::vec(proptest::bool::ANY, 3),
        pins in prop_oneof![Just(1usize), Just(2), Just(8)],
        // Published deltas carry at most 5 images, so each fits on its own.
        max_images in prop_oneof![Just(DEFAULT_MAX_DELTA_IMAGES), Just(5usize), Just(8)],
    ) {
        let bucket_count = 32usize;
        let stream_limits = StreamLimits {
            max_backlog_bytes: backlog,
            resume_window_bytes: window,
            heartbeat_interval: Duration::from_secs(10),
            snapshot_progress_timeout: Duration::from_secs(60),
            max_pinned_snapshots: pins,
            max_delta_images: max_images,
            ..limits(chunk_buckets)
        };
        let t0 = Instant::now();
        let mut now = t0;
        let mut producer = vec![0u64; bucket_count];
        let mut history: BTreeMap<u64, Vec<u64>> = BTreeMap::from([(0, producer.clone())]);
        let mut publisher: Publisher<u64> = Publisher::new(0, producer.clone(), stream_limits).unwrap();
        let mut replicas: Vec<ModelReplica> = (0..3).map(|_| ModelReplica::new(bucket_count)).collect();
        // `None`: refused at the pin bound, retried at its next read.
        let mut ids: Vec<Option<SubscriberId>> = coalescing
            .iter()
            .map(|&c| publisher.handle_subscribe(None, c, now).ok().map(|(id, _)| id))
            .collect();
        let refused = |err: SubscribeRefused| matches!(err, SubscribeRefused::SnapshotLimit { .. });
        let mut sequence = 0u64;
        for op in ops {
            match op {
                Op::Publish(writes) => {
                    let mut images: BTreeMap<u32, u64> = BTreeMap::new();
                    for (bucket, word) in writes {
                        images.insert(bucket, word);
                    }
                    let next = Delta {
                        base_sequence: sequence,
                        sequence: sequence + 1,
                        images: images.iter().map(|(&bucket_idx, &word)| BucketImage { bucket_idx, word }).collect(),
                    };
                    for (&bucket, &word) in &images {
                        producer[bucket as usize] = word;
                    }
                    sequence += 1;
                    history.insert(sequence, producer.clone());
                    publisher.handle_delta(next, now, |d| d.sequence).unwrap();
                    prop_assert_eq!(publisher.words(), &producer[..]);
                }
                Op::Read(n, k) => {
                    if ids[n].is_none() {
                        let resume = replicas[n].ready.filter(|_| coalescing[n]);
                        match publisher.handle_subscribe(resume, coalescing[n], now) {
                            Ok((id, _)) => ids[n] = Some(id),
                            Err(err) => prop_assert!(refused(err)),
                        }
                    }
                    let Some(id) = ids[n] else { continue };
                    for _ in 0..k {
                        match publisher.poll_transmit(id, now) {
                            Poll::Transmit(transmit) => {
                                if let Transmit::Delta { delta, .. } = &transmit {
                                    prop_assert!(delta.images.len() <= max_images, "a delta of {} images", delta.images.len());
                                }
                                if let Some(at) = replicas[n].apply(&transmit, chunk_buckets as usize, coalescing[n]) {
                                    prop_assert_eq!(&replicas[n].words, &history[&at], "replica differs at {}", at);
                                }
                            }
                            Poll::Idle => break,
                            Poll::CutOff(_) => {
                                publisher.handle_unsubscribe(id);
                                let resume = replicas[n].ready.filter(|_| coalescing[n]);
                                ids[n] = match publisher.handle_subscribe(resume, coalescing[n], now) {
                                    Ok((id, _)) => Some(id),
                                    Err(err) => {
                                        prop_assert!(refused(err));
                                        None
                                    }
                                };
                                break;
                            }
                            Poll::Unknown => prop_assert!(false, "subscriber vanished"),
                        }
                    }
                }
                Op::Reconnect(n) => {
                    if let Some(id) = ids[n] {
                        publisher.handle_unsubscribe(id);
                    }
                    let resume = replicas[n].ready.filter(|_| coalescing[n]);
                    ids[n] = match publisher.handle_subscribe(resume, coalescing[n], now) {
                        Ok((id, start)) => {
                            if let Start::Resume { from } = start {
                                prop_assert_eq!(Some(from), replicas[n].ready);
                            }
                            Some(id)
                        }
                        Err(err) => {
                            prop_assert!(refused(err));
                            None
                        }
                    };
                }
                Op::Wait(ms) => {
                    now += Duration::from_millis(ms);
                    publisher.handle_timeout(now);
                }
            }
            prop_assert!(publisher.stats().pinned_copies <= pins as u64, "more pinned copies than the bound");
        }
        // Drained at rest, every subscriber converges to the producer. Two passes: a
        // subscriber refused at the pin bound gets in once the others' snapshots are
        // through.
        for _pass in 0..2 {
            for n in 0..3 {
                if ids[n].is_none() {
                    match publisher.handle_subscribe(None, coalescing[n], now) {
                        Ok((id, _)) => ids[n] = Some(id),
                        Err(err) => {
                            prop_assert!(refused(err));
                            continue;
                        }
                    }
                }
                for _ in 0..64 {
                    let Some(id) = ids[n] else { break };
                    match publisher.poll_transmit(id, now) {
                        Poll::Transmit(transmit) => {
                            replicas[n].apply(&transmit, chunk_buckets as usize, coalescing[n]);
                        }
                        Poll::CutOff(_) => {
                            publisher.handle_unsubscribe(id);
                            ids[n] = publisher.handle_subscribe(None, coalescing[n], now).ok().map(|(id, _)| id);
                        }
                        Poll::Idle | Poll::Unknown => break,
                    }
                }
            }
        }
        for replica in &replicas {
            prop_assert_eq!(replica.ready, Some(sequence));
            prop_assert_eq!(&replica.words, &producer);
        }
    }
}
