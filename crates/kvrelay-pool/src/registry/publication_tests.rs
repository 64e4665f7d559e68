//! Publication behaviour end to end through the registry: replicas decoded from the wire
//! frames, lag, heartbeats, snapshot progress, hub overrun, actor cadence and shutdown.

use std::time::Duration;

use bytes::BytesMut;
use kvrelay_ckf::{
    Delta, EventPayload, RemovedBlocks, Replica, RouterEvent, SnapshotChunk, SourceId, StoredBlock,
    StoredBlocks,
};
use kvrelay_codec::v1::{self, Message, PoolPayload};

use super::tests::Gates;
use super::tests::behaviour::{
    attach_llama, pool, registry_with, request, stored_event, test_limits,
};
use super::*;
use crate::actor::FaultCategory;
use crate::error::{ActorError, PoolFault, SubscriptionEnd};
use crate::subscription::{PoolFrame, PoolFrameKind, PoolSubscription};
use crate::{StreamLimits, SubscribeOptions};

/// A consumer-side replica fed from encoded frames, checking every frame like a client.
pub(super) struct WireReplica {
    expected: v1::ProducerIdentity,
    replica: Replica,
    pub(super) sequence: Option<u64>,
}

impl WireReplica {
    pub(super) fn new(producer: &ProducerIdentity) -> Self {
        Self {
            expected: v1::ProducerIdentity::from(*producer),
            replica: Replica::new(*producer.format()).unwrap(),
            sequence: None,
        }
    }

    pub(super) fn feed(&mut self, frame: &PoolFrame) {
        let mut buf = BytesMut::from(&frame.bytes[..]);
        let message = v1::decode_message(&mut buf, &kvrelay_codec::Limits::default())
            .unwrap()
            .unwrap();
        assert!(buf.is_empty(), "one frame per PoolFrame");
        let Message::PoolFrame(wire) = message else {
            panic!("not a pool frame");
        };
        assert_eq!(wire.header.base_sequence, frame.base_sequence);
        assert_eq!(wire.header.sequence, frame.sequence);
        match wire.check(&self.expected).unwrap() {
            PoolPayload::SnapshotChunk(chunk) => {
                assert_eq!(frame.kind, PoolFrameKind::SnapshotChunk);
                let complete = self
                    .replica
                    .install_chunk(&SnapshotChunk {
                        sequence: chunk.header().epoch,
                        bucket_count: chunk.header().layout.bucket_count(),
                        chunk_index: chunk.chunk_index(),
                        chunk_count: chunk.chunk_count(),
                        first_bucket: chunk.bucket_offset(),
                        words: chunk.words().collect(),
                    })
                    .unwrap();
                if complete {
                    self.sequence = Some(frame.sequence);
                }
            }
            PoolPayload::Delta(delta) => {
                assert_eq!(frame.kind, PoolFrameKind::Delta);
                self.replica
                    .apply_delta(&Delta {
                        base_sequence: delta.base_epoch(),
                        sequence: delta.header().epoch,
                        images: delta.to_images(),
                    })
                    .unwrap();
                self.sequence = Some(frame.sequence);
            }
            PoolPayload::Heartbeat => {
                assert_eq!(frame.kind, PoolFrameKind::Heartbeat);
                assert_eq!(
                    Some(frame.sequence),
                    self.sequence,
                    "heartbeat at the installed sequence"
                );
            }
        }
    }

    pub(super) fn words(&self) -> &[u64] {
        self.replica.words().unwrap()
    }
}

/// Drains `subscription` into `replica` until it reaches `sequence`.
pub(super) async fn follow_until(
    subscription: &mut PoolSubscription,
    replica: &mut WireReplica,
    sequence: u64,
) {
    tokio::time::timeout(Duration::from_secs(10), async {
        while replica.sequence != Some(sequence) {
            let frame = subscription.next_frame().await.unwrap();
            replica.feed(&frame);
        }
    })
    .await
    .expect("subscriber to reach the producer's sequence");
}

fn chain(
    source: SourceId,
    event_id: u64,
    parent: Option<u64>,
    ids: std::ops::Range<u64>,
) -> RouterEvent {
    RouterEvent {
        source,
        event_id,
        payload: EventPayload::Stored(StoredBlocks {
            parent_engine_block_id: parent,
            blocks: ids
                .map(|id| StoredBlock {
                    engine_block_id: id,
                    token_hash: id * 7919,
                })
                .collect(),
        }),
    }
}

fn removed(source: SourceId, event_id: u64, ids: Vec<u64>) -> RouterEvent {
    RouterEvent {
        source,
        event_id,
        payload: EventPayload::Removed(RemovedBlocks {
            engine_block_ids: ids,
        }),
    }
}

/// Takes every encoding permit: a hub with a live subscriber then stalls on its next
/// delta until the returned permits are dropped.
async fn hold_encoding_permits(registry: &PoolRegistry) -> tokio::sync::OwnedSemaphorePermit {
    registry
        .inner
        .encoding
        .clone()
        .acquire_many_owned(registry.limits().encoding_permits as u32)
        .await
        .unwrap()
}

/// Reads `subscription` until it ends (within 5 s) and returns why.
pub(super) async fn next_end(subscription: &mut PoolSubscription) -> SubscriptionEnd {
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Err(end) = subscription.next_frame().await {
                return end;
            }
        }
    })
    .await
    .expect("the subscription to end")
}

#[tokio::test]
async fn subscriber_replica_is_bit_identical_to_the_producer() {
    let registry = registry_with(
        Limits {
            max_delta_buckets: 4,
            ..test_limits()
        },
        Gates::default(),
    );
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
    let mut replica = WireReplica::new(&attachment.identity());
    let a = SourceId::new(1, 0);
    let b = SourceId::new(2, 1);
    attachment
        .actor
        .submit(chain(a, 1, None, 0..8))
        .await
        .unwrap();
    attachment
        .actor
        .submit(chain(a, 2, Some(7), 8..12))
        .await
        .unwrap();
    attachment
        .actor
        .submit(chain(b, 1, None, 100..106))
        .await
        .unwrap();
    attachment
        .actor
        .submit(removed(a, 3, vec![10, 11]))
        .await
        .unwrap();
    attachment
        .actor
        .submit(removed(b, 2, vec![999]))
        .await
        .unwrap();
    attachment.actor.flush().await.unwrap();
    let (sequence, words) = attachment.actor.words().await.unwrap();
    follow_until(&mut subscription, &mut replica, sequence).await;
    assert_eq!(replica.words(), words.as_slice());
    let stats = attachment.actor.stats().await.unwrap();
    assert_eq!(stats.filter.counters.unknown_removals, 1);
    assert_eq!(
        attachment.actor.source_blocks().await.unwrap(),
        vec![(a, 10), (b, 6)]
    );
    drop(subscription);
    registry.detach(attachment).await;
}

#[tokio::test]
async fn a_slow_subscriber_catches_up_with_one_coalesced_delta_while_others_keep_up() {
    let registry = registry_with(test_limits(), Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let mut slow = registry.subscribe(attachment.identity()).await.unwrap();
    let mut fast = registry.subscribe(attachment.identity()).await.unwrap();
    let mut fast_replica = WireReplica::new(&attachment.identity());
    for id in 1..=6 {
        attachment.actor.submit(stored_event(id)).await.unwrap();
        attachment.actor.flush().await.unwrap();
        let (sequence, _) = attachment.actor.words().await.unwrap();
        follow_until(&mut fast, &mut fast_replica, sequence).await;
    }
    let (sequence, words) = attachment.actor.words().await.unwrap();
    // The slow one, reading only now: its snapshot, then everything since in one delta.
    let mut slow_replica = WireReplica::new(&attachment.identity());
    let chunk = slow.next_frame().await.unwrap();
    assert_eq!(chunk.kind, PoolFrameKind::SnapshotChunk);
    slow_replica.feed(&chunk);
    let delta = slow.next_frame().await.unwrap();
    assert_eq!(delta.kind, PoolFrameKind::Delta);
    assert_eq!(
        (delta.base_sequence, delta.sequence),
        (chunk.sequence, sequence)
    );
    assert_eq!(delta.covers as u64, sequence - chunk.sequence);
    slow_replica.feed(&delta);
    assert_eq!(slow_replica.words(), words.as_slice());
    assert_eq!(fast_replica.words(), words.as_slice());
    drop((slow, fast));
    registry.detach(attachment).await;
}

#[tokio::test]
async fn a_subscriber_that_cannot_coalesce_is_cut_off_past_its_own_bound() {
    // A coalesced bound of two one-image deltas; four deltas follow. With no floor of its
    // own the subscriber that takes every delta is cut off at that bound; with the
    // default floor (16 MiB) the four deltas are its backlog and it keeps up.
    let floors = [
        (0, true),
        (
            kvrelay_ckf::stream::DEFAULT_MIN_UNCOALESCED_BACKLOG_BYTES,
            false,
        ),
    ];
    for (floor, cut_off) in floors {
        let registry = registry_with(
            Limits {
                stream: StreamLimits {
                    max_backlog_bytes: Some(2 * (kvrelay_ckf::stream::DELTA_FRAME_OVERHEAD + 64)),
                    min_uncoalesced_backlog_bytes: floor,
                    ..StreamLimits::default()
                },
                ..test_limits()
            },
            Gates::default(),
        );
        let attachment = attach_llama(&registry, 1, "a.b.c").await;
        let options = SubscribeOptions {
            resume_from: None,
            coalesce: false,
        };
        let mut minor0 = registry
            .subscribe_with(attachment.identity(), options)
            .await
            .unwrap();
        let mut coalescing = registry.subscribe(attachment.identity()).await.unwrap();
        for id in 1..=4 {
            attachment.actor.submit(stored_event(id)).await.unwrap();
            attachment.actor.flush().await.unwrap();
        }
        let (sequence, words) = attachment.actor.words().await.unwrap();
        if cut_off {
            assert_eq!(
                next_end(&mut minor0).await,
                SubscriptionEnd::SubscriberLagged
            );
        } else {
            let mut replica = WireReplica::new(&attachment.identity());
            follow_until(&mut minor0, &mut replica, sequence).await;
            assert_eq!(replica.words(), words.as_slice(), "floor {floor}");
        }
        // The same backlog coalesced (one image per bucket) stays within the bound.
        let mut replica = WireReplica::new(&attachment.identity());
        follow_until(&mut coalescing, &mut replica, sequence).await;
        assert_eq!(replica.words(), words.as_slice());
        drop((minor0, coalescing));
        registry.detach(attachment).await;
    }
}

#[tokio::test]
async fn the_registry_sums_its_hubs_memory_gauges_and_drops_a_retired_hubs() {
    let registry = registry_with(test_limits(), Gates::default());
    let reader = registry.stream_stats_reader();
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
    for id in 1..=3 {
        attachment.actor.submit(stored_event(id)).await.unwrap();
        attachment.actor.flush().await.unwrap();
    }
    let (sequence, words) = attachment.actor.words().await.unwrap();
    let mut replica = WireReplica::new(&attachment.identity());
    follow_until(&mut subscription, &mut replica, sequence).await;
    // The hub reports on its timeout tick (1 s).
    let table_bytes = words.len() as u64 * 8;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while reader.get().mirror_bytes != table_bytes || reader.get().retained_deltas != 3 {
        assert!(
            std::time::Instant::now() < deadline,
            "gauges never reported: {:?}",
            reader.get()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(reader.get().retained_bytes > 0);
    drop(subscription);
    registry.detach(attachment).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let stats = reader.get();
        if (
            stats.mirror_bytes,
            stats.retained_bytes,
            stats.retained_deltas,
        ) == (0, 0, 0)
        {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a retired hub's gauges stayed: {stats:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Its counters stay.
    assert_eq!(reader.get().deltas, 3);
}

#[tokio::test]
async fn a_subscriber_resumes_from_its_sequence_without_a_snapshot() {
    let registry = registry_with(test_limits(), Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let mut first = registry.subscribe(attachment.identity()).await.unwrap();
    let mut replica = WireReplica::new(&attachment.identity());
    attachment.actor.submit(stored_event(1)).await.unwrap();
    attachment.actor.flush().await.unwrap();
    let (at, _) = attachment.actor.words().await.unwrap();
    follow_until(&mut first, &mut replica, at).await;
    drop(first);
    // Missed while disconnected.
    for id in 2..=5 {
        attachment.actor.submit(stored_event(id)).await.unwrap();
        attachment.actor.flush().await.unwrap();
    }
    let (sequence, words) = attachment.actor.words().await.unwrap();
    let options = SubscribeOptions {
        resume_from: Some(at),
        coalesce: true,
    };
    let mut resumed = registry
        .subscribe_with(attachment.identity(), options)
        .await
        .unwrap();
    assert_eq!(
        resumed.start(),
        crate::SubscriptionStart::Resume { from: at }
    );
    let delta = resumed.next_frame().await.unwrap();
    assert_eq!(delta.kind, PoolFrameKind::Delta);
    assert_eq!((delta.base_sequence, delta.sequence), (at, sequence));
    replica.feed(&delta);
    assert_eq!(replica.words(), words.as_slice());
    // Already current: a heartbeat at once.
    let options = SubscribeOptions {
        resume_from: Some(sequence),
        coalesce: true,
    };
    let mut current = registry
        .subscribe_with(attachment.identity(), options)
        .await
        .unwrap();
    let heartbeat = current.next_frame().await.unwrap();
    assert_eq!(
        (heartbeat.kind, heartbeat.sequence),
        (PoolFrameKind::Heartbeat, sequence)
    );
    drop((resumed, current));
    registry.detach(attachment).await;
}

#[tokio::test(start_paused = true)]
async fn quiet_stream_yields_heartbeats_at_the_last_sequence() {
    let registry = registry_with(
        Limits {
            stream: StreamLimits {
                heartbeat_interval: Duration::from_secs(10),
                ..StreamLimits::default()
            },
            ..test_limits()
        },
        Gates::default(),
    );
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    attachment.actor.submit(stored_event(1)).await.unwrap();
    attachment.actor.flush().await.unwrap();
    let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
    let mut replica = WireReplica::new(&attachment.identity());
    let chunk = subscription.next_frame().await.unwrap();
    replica.feed(&chunk);
    let started = tokio::time::Instant::now();
    let heartbeat = subscription.next_frame().await.unwrap();
    assert_eq!(heartbeat.kind, PoolFrameKind::Heartbeat);
    assert!(started.elapsed() >= Duration::from_secs(10));
    assert_eq!(heartbeat.sequence, chunk.sequence);
    replica.feed(&heartbeat);
    drop(subscription);
    registry.detach(attachment).await;
}

#[tokio::test(start_paused = true)]
async fn stalled_snapshot_consumer_times_out_without_fencing() {
    let registry = registry_with(
        Limits {
            stream: StreamLimits {
                snapshot_progress_timeout: Duration::from_secs(60),
                ..StreamLimits::default()
            },
            ..test_limits()
        },
        Gates::default(),
    );
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
    tokio::time::advance(Duration::from_secs(61)).await;
    assert_eq!(
        subscription.next_frame().await.unwrap_err(),
        SubscriptionEnd::SnapshotProgressTimeout { timeout_ms: 60_000 }
    );
    assert!(
        !attachment.generation_cancel.is_cancelled(),
        "a slow client does not fence the pool"
    );
    assert_eq!(registry.catalog().len(), 1);
    registry.detach(attachment).await;
}

#[tokio::test]
async fn shutdown_ends_subscriptions_and_leaves_no_task() {
    let registry = registry_with(test_limits(), Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
    let actor = attachment.actor.clone();
    registry.shutdown().await;
    assert_eq!(
        next_end(&mut subscription).await,
        SubscriptionEnd::ShuttingDown
    );
    assert!(actor.is_stopped());
    assert_eq!(
        actor.submit(stored_event(1)).await,
        Err(ActorError::ShuttingDown)
    );
    let stats = registry.stats();
    assert_eq!(
        (stats.pools, stats.initialized_hubs, stats.tasks),
        (0, 0, 0)
    );
    assert!(registry.subscribe(attachment.identity()).await.is_err());
    assert!(matches!(
        registry.attach(request(pool(2), "x.y.z", "llama")).await,
        Err(AttachError::ShuttingDown)
    ));
}

#[tokio::test]
async fn a_full_hub_feed_defers_publication_and_loses_nothing() {
    let registry = registry_with(
        Limits {
            hub_delta_queue: 1,
            publication_window: Duration::from_millis(2),
            ..test_limits()
        },
        Gates::default(),
    );
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
    // Hold every encoding permit: the hub stalls on its first delta while the actor
    // has more to publish than the feed holds.
    let held = hold_encoding_permits(&registry).await;
    for id in 1..=6 {
        attachment.actor.submit(stored_event(id)).await.unwrap();
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while attachment
        .actor
        .stats()
        .await
        .unwrap()
        .deferred_publications
        == 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no publication was deferred"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    drop(held);
    attachment.actor.flush().await.unwrap();
    // The subscriber is never cut off and converges on the producer.
    let (sequence, words) = attachment.actor.words().await.unwrap();
    let mut replica = WireReplica::new(&attachment.identity());
    follow_until(&mut subscription, &mut replica, sequence).await;
    assert_eq!(replica.words(), words.as_slice());
    assert!(!attachment.generation_cancel.is_cancelled());
    drop(subscription);
    registry.detach(attachment).await;
}

#[tokio::test]
async fn settle_returns_once_the_hub_holds_every_applied_change() {
    let registry = registry_with(test_limits(), Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    // A live subscriber makes the hub encode each delta, under the encoding permits.
    let mut live = registry.subscribe(attachment.identity()).await.unwrap();
    let held = hold_encoding_permits(&registry).await;
    for id in 1..=3 {
        attachment.actor.submit(stored_event(id)).await.unwrap();
    }
    // The actor has handed its delta to the feed, but the hub cannot take it yet.
    let actor = attachment.actor.clone();
    let mut settle = tokio::spawn(async move { actor.settle().await });
    let early = tokio::time::timeout(Duration::from_millis(200), &mut settle).await;
    assert!(
        early.is_err(),
        "settle returned before the hub took the delta: {early:?}"
    );
    // A plain flush only hands the changes to the feed: it returns meanwhile.
    attachment.actor.flush().await.unwrap();
    drop(held);
    tokio::time::timeout(Duration::from_secs(5), settle)
        .await
        .expect("settle returns once the hub has the delta")
        .unwrap()
        .unwrap();
    // A subscription opened now starts at the flushed sequence, not before it.
    let (sequence, words) = attachment.actor.words().await.unwrap();
    let mut late = registry.subscribe(attachment.identity()).await.unwrap();
    let first = late.next_frame().await.unwrap();
    assert_eq!(first.kind, PoolFrameKind::SnapshotChunk);
    assert_eq!(first.sequence, sequence);
    let mut replica = WireReplica::new(&attachment.identity());
    follow_until(&mut live, &mut replica, sequence).await;
    assert_eq!(replica.words(), words.as_slice());
    drop((live, late));
    registry.detach(attachment).await;
}

#[tokio::test(start_paused = true)]
async fn a_delta_is_published_once_max_delta_buckets_changed() {
    let registry = batching_registry(3, Duration::from_secs(3600));
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let subscription = registry.subscribe(attachment.identity()).await.unwrap();
    // The first change after a quiet window goes out at once.
    attachment.actor.submit(stored_event(1)).await.unwrap();
    assert_eq!(attachment.actor.stats().await.unwrap().publications, 1);
    // Later ones wait for the window, unless enough buckets changed.
    attachment
        .actor
        .submit(chain(SourceId::new(1, 0), 2, None, 10..12))
        .await
        .unwrap();
    assert_eq!(attachment.actor.stats().await.unwrap().publications, 1);
    attachment
        .actor
        .submit(chain(SourceId::new(1, 0), 3, None, 20..30))
        .await
        .unwrap();
    let stats = attachment.actor.stats().await.unwrap();
    assert_eq!(stats.publications, 2, "the size bound closes the batch");
    assert_eq!(stats.sequence, 2);
    drop(subscription);
    registry.detach(attachment).await;
}

#[tokio::test(start_paused = true)]
async fn a_change_after_a_quiet_window_goes_out_at_once_and_later_ones_wait_a_window() {
    let registry = batching_registry(1 << 16, Duration::from_millis(5));
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
    let chunk = subscription.next_frame().await.unwrap();
    let submitted = tokio::time::Instant::now();
    attachment.actor.submit(stored_event(1)).await.unwrap();
    let first = subscription.next_frame().await.unwrap();
    assert_eq!(first.kind, PoolFrameKind::Delta);
    assert_eq!(first.base_sequence, chunk.sequence);
    assert!(
        submitted.elapsed() < Duration::from_millis(5),
        "{:?}",
        submitted.elapsed()
    );
    attachment.actor.submit(stored_event(2)).await.unwrap();
    let second = subscription.next_frame().await.unwrap();
    assert_eq!(second.base_sequence, first.sequence);
    let waited = submitted.elapsed();
    assert!(
        waited >= Duration::from_millis(5) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    drop(subscription);
    registry.detach(attachment).await;
}

#[tokio::test(start_paused = true)]
async fn graceful_shutdown_publishes_the_tail_and_fence_discards_it() {
    for (mode, expect_tail) in [
        (RetirementMode::Graceful, true),
        (RetirementMode::Fenced, false),
    ] {
        let registry = batching_registry(1 << 16, Duration::from_secs(3600));
        let attachment = attach_llama(&registry, 1, "a.b.c").await;
        let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
        subscription.next_frame().await.unwrap();
        // The first change goes out at once; the next one waits a whole window.
        attachment.actor.submit(stored_event(1)).await.unwrap();
        assert_eq!(
            subscription.next_frame().await.unwrap().kind,
            PoolFrameKind::Delta
        );
        attachment.actor.submit(stored_event(2)).await.unwrap();
        let actor = attachment.actor.clone();
        // Stop the actor directly: the hub is still attached and sees what it published.
        match mode {
            RetirementMode::Graceful => actor.shutdown().await.unwrap(),
            RetirementMode::Fenced => actor.fence().await,
        }
        let got_tail = matches!(subscription.next_frame().await, Ok(frame) if frame.kind == PoolFrameKind::Delta);
        assert_eq!(got_tail, expect_tail, "{mode:?}");
        assert_eq!(
            actor.shutdown().await,
            Err(ActorError::ShuttingDown),
            "a second stop is refused"
        );
        registry.retire(attachment, mode).await;
        assert!(registry.catalog().is_empty());
    }
}

#[tokio::test]
async fn unknown_parents_are_unroutable_and_never_hold_up_later_events() {
    let registry = registry_with(test_limits(), Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let source = SourceId::new(9, 2);
    // Far more than any queue the actor once waited on.
    for event_id in 0..40 {
        let first = 1_000 + event_id * 2;
        attachment
            .actor
            .submit(chain(source, event_id, Some(12_345), first..first + 2))
            .await
            .unwrap();
    }
    for event_id in 0..50 {
        attachment
            .actor
            .submit(chain(source, 100 + event_id, None, event_id..event_id + 1))
            .await
            .unwrap();
    }
    let stats = tokio::time::timeout(Duration::from_secs(5), attachment.actor.stats())
        .await
        .unwrap()
        .unwrap();
    assert_eq!((stats.unroutable_events, stats.unroutable_blocks), (40, 80));
    assert_eq!(stats.faults.total(), 0, "unroutable blocks are not faults");
    assert_eq!((stats.events_applied, stats.events_rejected), (50, 40));
    assert_eq!(stats.filter.resident_blocks, 50);
    let health = attachment.actor.health(tokio::time::Instant::now());
    assert_eq!(health.stats, stats);
    assert!(health.latest_faults.is_empty());
    registry.detach(attachment).await;
}

#[tokio::test]
async fn contradictory_block_ids_are_typed_faults_that_reset_the_source() {
    let registry = registry_with(test_limits(), Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let source = SourceId::new(9, 2);
    let other = SourceId::new(9, 3);
    attachment
        .actor
        .submit(chain(source, 1, None, 0..3))
        .await
        .unwrap();
    attachment
        .actor
        .submit(chain(other, 1, None, 0..2))
        .await
        .unwrap();
    // Block 1 again, now as a root with different tokens: it contradicts the mapping.
    let mut contradiction = chain(source, 2, None, 1..2);
    if let EventPayload::Stored(stored) = &mut contradiction.payload {
        stored.blocks[0].token_hash = 424_242;
    }
    attachment.actor.submit(contradiction).await.unwrap();
    let stats = attachment.actor.stats().await.unwrap();
    assert_eq!(stats.faults.get(FaultCategory::SourceProtocol), 1);
    assert_eq!(stats.contradiction_resets, 1);
    assert_eq!(
        attachment.actor.source_blocks().await.unwrap(),
        vec![(other, 2)],
        "the contradicting source starts over; the others keep their blocks"
    );
    let health = attachment.actor.health(tokio::time::Instant::now());
    let fault = health
        .latest_fault(FaultCategory::SourceProtocol)
        .unwrap()
        .clone();
    assert_eq!((fault.source, fault.event_id), (Some(source), 2));
    assert!(
        matches!(
            fault.fault,
            PoolFault::Apply(kvrelay_ckf::ApplyError::ContradictoryBlockId {
                engine_block_id: 1,
                offered: 424_242,
                ..
            })
        ),
        "{:?}",
        fault.fault
    );
    registry.detach(attachment).await;
}

#[tokio::test]
async fn health_sees_a_stalled_actor_without_its_mailbox() {
    let registry = registry_with(test_limits(), Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let release = attachment.actor.stall().await.unwrap();
    attachment.actor.submit(stored_event(1)).await.unwrap();
    attachment.actor.submit(stored_event(2)).await.unwrap();
    let now = tokio::time::Instant::now();
    let health = attachment.actor.health(now + Duration::from_secs(3));
    assert_eq!(health.pending_events, 2);
    assert!(health.mailbox_depth >= 2, "{health:?}");
    assert!(health.oldest_pending_age >= Some(Duration::from_secs(3)));
    assert!(health.is_stalled(Duration::from_secs(3)), "{health:?}");
    drop(release);
    attachment.actor.flush().await.unwrap();
    let health = attachment.actor.health(tokio::time::Instant::now());
    assert_eq!((health.pending_events, health.stats.events_applied), (0, 2));
    assert!(!health.is_stalled(Duration::ZERO));
    registry.detach(attachment).await;
}

#[tokio::test]
async fn events_run_before_a_waiting_command_are_on_record_while_it_waits() {
    let registry = registry_with(test_limits(), Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    // Queue three events and a second stall behind a first one, so one wake of the actor
    // runs the events and then waits in the second stall.
    let first = attachment.actor.stall().await.unwrap();
    for id in 1..=3 {
        attachment.actor.submit(stored_event(id)).await.unwrap();
    }
    let second = attachment.actor.stall().await.unwrap();
    drop(first);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let health = attachment.actor.health(tokio::time::Instant::now());
        if health.stats.events_applied == 3 {
            assert_eq!(health.pending_events, 0, "{health:?}");
            assert!(!health.is_stalled(Duration::ZERO), "{health:?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the events applied before the waiting command were never recorded: {health:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(second);
    registry.detach(attachment).await;
}

/// A mixed stream of stores and removals from two sources: 3-block chains, every third
/// event removing the chain before the last.
fn mixed_events(count: u64) -> Vec<RouterEvent> {
    let mut events = Vec::new();
    for id in 0..count {
        let source = SourceId::new(1, u32::from(id % 2 == 1));
        let step = id / 2;
        let first = step * 3;
        let parent = step.checked_sub(1).map(|previous| previous * 3 + 2);
        events.push(chain(source, id + 1, parent, first..first + 3));
        if step >= 2 && step % 3 == 0 {
            let old = (step - 2) * 3;
            events.push(removed(source, id + 1, vec![old, old + 1, old + 2]));
        }
    }
    events
}

#[tokio::test]
async fn a_batch_applies_exactly_like_the_same_events_one_by_one() {
    // 4 block permits and 3-block events: chunks split by weight (one event each); 200
    // events also exceed MAX_EVENTS_PER_BATCH with the larger budget.
    for pending_blocks in [4, 1 << 16] {
        let limits = Limits {
            actor_pending_blocks: pending_blocks,
            ..test_limits()
        };
        let one_by_one = registry_with(limits.clone(), Gates::default());
        let batched = registry_with(limits, Gates::default());
        let single = attach_llama(&one_by_one, 1, "a.b.c").await;
        let batch = attach_llama(&batched, 1, "a.b.c").await;
        let events = mixed_events(200);
        assert!(events.len() > crate::MAX_EVENTS_PER_BATCH * 2);
        for event in events.clone() {
            single.actor.submit(event).await.unwrap();
        }
        batch
            .actor
            .submit_batch(events.clone(), &never())
            .await
            .unwrap();
        batch
            .actor
            .submit_batch(Vec::new(), &never())
            .await
            .unwrap();
        single.actor.flush().await.unwrap();
        batch.actor.flush().await.unwrap();
        assert_eq!(
            batch.actor.words().await.unwrap().1,
            single.actor.words().await.unwrap().1,
            "tables differ with {pending_blocks} block permits"
        );
        assert_eq!(
            batch.actor.source_blocks().await.unwrap(),
            single.actor.source_blocks().await.unwrap()
        );
        let stats = batch.actor.stats().await.unwrap();
        assert_eq!(stats.events_applied, events.len() as u64);
        assert_eq!(
            batch.actor.available_block_permits(),
            pending_blocks as usize
        );
        one_by_one.detach(single).await;
        batched.detach(batch).await;
    }
}

#[tokio::test]
async fn every_event_of_a_queued_batch_counts_as_pending() {
    let registry = registry_with(test_limits(), Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let release = attachment.actor.stall().await.unwrap();
    attachment
        .actor
        .submit_batch((1..=5).map(stored_event).collect(), &never())
        .await
        .unwrap();
    let health = attachment.actor.health(tokio::time::Instant::now());
    assert_eq!(health.pending_events, 5, "{health:?}");
    // The stall itself may still be queued; the five events take one slot.
    assert!(
        health.mailbox_depth <= 2,
        "one command for the batch: {health:?}"
    );
    drop(release);
    attachment.actor.flush().await.unwrap();
    let health = attachment.actor.health(tokio::time::Instant::now());
    assert_eq!((health.pending_events, health.stats.events_applied), (0, 5));
    registry.detach(attachment).await;
}

#[tokio::test]
async fn a_batch_cut_short_by_a_stopping_actor_reports_what_it_queued() {
    // 4 block permits, 3-block events: one event per chunk, and the second chunk waits for
    // permits while the stalled actor holds the first.
    let limits = Limits {
        actor_pending_blocks: 4,
        ..test_limits()
    };
    let registry = registry_with(limits, Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let source = SourceId::new(1, 0);
    let events: Vec<_> = (0..3)
        .map(|i| chain(source, i + 1, None, i * 3..i * 3 + 3))
        .collect();
    assert_eq!(attachment.actor.chunk_events(events.clone()).len(), 3);
    let release = attachment.actor.stall().await.unwrap();
    let actor = attachment.actor.clone();
    let submitting = tokio::spawn(async move { actor.submit_batch(events, &never()).await });
    let mut waits = 0;
    while attachment
        .actor
        .health(tokio::time::Instant::now())
        .pending_events
        < 1
    {
        waits += 1;
        assert!(waits < 10_000, "the first chunk was never queued");
        tokio::task::yield_now().await;
    }
    // The fence stops the actor: its queue is dropped (permits come back), and the
    // waiting chunk then finds the mailbox closed.
    attachment.actor.fence().await;
    let outcome = tokio::time::timeout(Duration::from_secs(10), submitting)
        .await
        .expect("submit_batch to return once the actor stopped")
        .unwrap();
    let err = outcome.expect_err("the actor stopped mid-batch");
    assert_eq!(err.queued, 1, "{err}");
    assert_eq!(err.cause, ActorError::ShuttingDown);
    drop(release);
    registry.detach(attachment).await;
}

#[tokio::test]
async fn a_cancelled_batch_reports_what_it_queued_and_leaves_the_rest() {
    // As above, but the caller cancels while the second chunk waits for permits.
    let limits = Limits {
        actor_pending_blocks: 4,
        ..test_limits()
    };
    let registry = registry_with(limits, Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let source = SourceId::new(1, 0);
    let events: Vec<_> = (0..3)
        .map(|i| chain(source, i + 1, None, i * 3..i * 3 + 3))
        .collect();
    let release = attachment.actor.stall().await.unwrap();
    let actor = attachment.actor.clone();
    let cancel = tokio_util::sync::CancellationToken::new();
    let stop = cancel.clone();
    let submitting = tokio::spawn(async move { actor.submit_batch(events, &stop).await });
    let mut waits = 0;
    while attachment
        .actor
        .health(tokio::time::Instant::now())
        .pending_events
        < 1
    {
        waits += 1;
        assert!(waits < 10_000, "the first chunk was never queued");
        tokio::task::yield_now().await;
    }
    cancel.cancel();
    let outcome = tokio::time::timeout(Duration::from_secs(10), submitting)
        .await
        .expect("submit_batch to return once cancelled")
        .unwrap();
    let err = outcome.expect_err("cancelled mid-batch");
    assert_eq!(
        (err.queued, err.cause.clone()),
        (1, ActorError::Cancelled),
        "{err}"
    );
    // The queued chunk still applies; the others were never queued.
    drop(release);
    attachment.actor.flush().await.unwrap();
    let stats = attachment.actor.stats().await.unwrap();
    assert_eq!(stats.events_applied, 1);
    assert_eq!(attachment.actor.available_block_permits(), 4);
    registry.detach(attachment).await;
}

/// A cancellation token that never fires.
fn never() -> tokio_util::sync::CancellationToken {
    tokio_util::sync::CancellationToken::new()
}

#[tokio::test]
async fn clearing_a_source_drops_only_its_blocks() {
    let registry = registry_with(test_limits(), Gates::default());
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    let a = SourceId::new(1, 0);
    let a_rank1 = SourceId::new(1, 1);
    attachment
        .actor
        .submit(chain(a, 1, None, 0..4))
        .await
        .unwrap();
    attachment
        .actor
        .submit(chain(a_rank1, 1, None, 0..3))
        .await
        .unwrap();
    attachment.actor.clear_source(a).await.unwrap();
    assert_eq!(
        attachment.actor.source_blocks().await.unwrap(),
        vec![(a_rank1, 3)]
    );
    registry.detach(attachment).await;
}

#[tokio::test]
async fn block_permits_are_returned_after_apply() {
    let registry = registry_with(
        Limits {
            actor_pending_blocks: 4,
            ..test_limits()
        },
        Gates::default(),
    );
    let attachment = attach_llama(&registry, 1, "a.b.c").await;
    // An event larger than the whole budget is admitted with the capped weight.
    attachment
        .actor
        .submit(chain(SourceId::new(1, 0), 1, None, 0..10))
        .await
        .unwrap();
    attachment.actor.flush().await.unwrap();
    assert_eq!(attachment.actor.available_block_permits(), 4);
    assert_eq!(attachment.actor.source_blocks().await.unwrap()[0].1, 10);
    registry.detach(attachment).await;
}

/// A registry that publishes once `max_delta_buckets` changed or a `window` passed.
fn batching_registry(max_delta_buckets: u32, window: Duration) -> PoolRegistry {
    registry_with(
        Limits {
            max_delta_buckets,
            publication_window: window,
            ..test_limits()
        },
        Gates::default(),
    )
}
