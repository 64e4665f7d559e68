//! Lanes (lower tiers and format twins): attached, published in their pool's descriptor,
//! fed through their pool's actor and retired with it.

#![allow(clippy::unwrap_used, clippy::panic, reason = "test")]

use kvrelay_ckf::{
    CacheTier, CkfConfig, EventPayload, FilterDensity, PoolFilter, RemovedBlocks, RouterEvent,
    SourceId, StoredBlock, StoredBlocks, TierChange, TierEvent,
};

use super::tests::Gates;
use super::tests::behaviour::{pool, registry_with, request, stored_event, test_limits};
use super::*;
use crate::error::AttachError;
use crate::subscription::PoolFrameKind;

fn lane(tier: CacheTier, block_size: u32) -> LaneRequest {
    LaneRequest {
        tier,
        expected_unique_blocks: 64,
        block_size,
        density: FilterDensity::V1,
    }
}

fn dense() -> FilterDensity {
    FilterDensity::Dense {
        load_percent: 95,
        size_classes_per_octave: 0,
    }
}

fn tier_event(tier: CacheTier, change: TierChange) -> TierEvent {
    TierEvent {
        source: SourceId::new(1, 0),
        event_id: 0,
        tier,
        change,
    }
}

#[tokio::test]
async fn a_host_lane_is_named_by_its_pool_and_fed_the_offloads_its_pool_resolves() {
    let registry = registry_with(test_limits(), Gates::default());
    let mut attach = request(pool(1), "ns.c.e", "llama");
    // The test pools hash 64-token blocks; the host tier keeps 2-block chunks.
    attach.tier_lanes = vec![lane(CacheTier::Host, 128)];
    let attachment = registry.attach(attach).await.unwrap();
    let host = &attachment.tier_lanes[0];
    assert_eq!(host.tier, CacheTier::Host);
    assert_eq!(host.pool, pool(1).tier_lane(CacheTier::Host.code()));

    // One pool in the catalog; its descriptor names the lane, which is not a pool.
    let catalog = registry.catalog();
    assert_eq!(catalog.len(), 1);
    let descriptor = catalog.pool(pool(1)).unwrap();
    assert_eq!(
        descriptor.tier_lanes,
        vec![TierLaneDescriptor {
            tier: CacheTier::Host,
            producer: host.actor.identity(),
            block_size: 128,
        }]
    );
    assert!(catalog.pool(host.pool).is_none());

    // A device store, then the engine offloads it (and a block it never reported), and
    // reports a disk tier the pool keeps no lane of.
    attachment.actor.submit(stored_event(5)).await.unwrap();
    let offload = TierChange::Offloaded {
        engine_block_ids: vec![5, 99],
    };
    let pool_actor = &attachment.actor;
    pool_actor
        .submit_tier(tier_event(CacheTier::Host, offload))
        .await
        .unwrap();
    pool_actor
        .submit_tier(tier_event(CacheTier::Disk, TierChange::Cleared))
        .await
        .unwrap();
    pool_actor.flush().await.unwrap();
    host.actor.flush().await.unwrap();
    let stats = pool_actor.stats().await.unwrap();
    assert_eq!(
        (
            stats.tier_events,
            stats.tier_events_without_lane,
            stats.offloads_unmapped
        ),
        (2, 1, 1)
    );
    let host_stats = host.actor.stats().await.unwrap();
    assert_eq!(host_stats.filter.resident_blocks, 1);
    assert_eq!(host_stats.events_applied, 1);

    // The lane is subscribed to like a pool.
    let mut subscription = registry.subscribe(host.actor.identity()).await.unwrap();
    let first = subscription.next_frame().await.unwrap();
    assert_eq!(first.kind, PoolFrameKind::SnapshotChunk);

    // A device eviction leaves the host copy; a clear of the source (no tier named)
    // drops every tier of it.
    pool_actor
        .submit(RouterEvent {
            source: SourceId::new(1, 0),
            event_id: 7,
            payload: EventPayload::Removed(kvrelay_ckf::RemovedBlocks {
                engine_block_ids: vec![5],
            }),
        })
        .await
        .unwrap();
    pool_actor.flush().await.unwrap();
    host.actor.flush().await.unwrap();
    assert_eq!(host.actor.stats().await.unwrap().filter.resident_blocks, 1);
    pool_actor
        .submit(RouterEvent {
            source: SourceId::new(1, 0),
            event_id: 8,
            payload: EventPayload::AllCleared,
        })
        .await
        .unwrap();
    pool_actor.flush().await.unwrap();
    host.actor.flush().await.unwrap();
    assert_eq!(host.actor.stats().await.unwrap().filter.resident_blocks, 0);

    // Retiring the pool retires its lane: its subscribers end, nothing is left.
    registry.detach(attachment).await;
    assert!(registry.catalog().is_empty());
    let mut ended = false;
    for _ in 0..16 {
        if subscription.next_frame().await.is_err() {
            ended = true;
            break;
        }
    }
    assert!(ended, "the lane's subscription ends with its pool");
    let stats = registry.stats();
    assert_eq!((stats.pools, stats.reservations), (0, 0));
}

#[tokio::test]
async fn a_stored_chain_on_a_tier_chains_inside_the_lane() {
    let registry = registry_with(test_limits(), Gates::default());
    let mut attach = request(pool(2), "ns.c.e", "llama");
    attach.tier_lanes = vec![lane(CacheTier::Disk, 64), lane(CacheTier::Host, 64)];
    let attachment = registry.attach(attach).await.unwrap();
    // Lanes come back in tier order whatever the request's order.
    let tiers: Vec<CacheTier> = attachment.tier_lanes.iter().map(|l| l.tier).collect();
    assert_eq!(tiers, [CacheTier::Host, CacheTier::Disk]);
    let chain = StoredBlocks {
        parent_engine_block_id: None,
        blocks: vec![
            StoredBlock {
                engine_block_id: 1,
                token_hash: 10,
            },
            StoredBlock {
                engine_block_id: 2,
                token_hash: 20,
            },
        ],
    };
    attachment
        .actor
        .submit_tier(tier_event(CacheTier::Disk, TierChange::Stored(chain)))
        .await
        .unwrap();
    attachment.actor.flush().await.unwrap();
    let disk = &attachment.tier_lanes[1];
    disk.actor.flush().await.unwrap();
    assert_eq!(disk.actor.stats().await.unwrap().filter.resident_blocks, 2);
    // Nothing reached the device filter or the host lane.
    assert_eq!(
        attachment
            .actor
            .stats()
            .await
            .unwrap()
            .filter
            .resident_blocks,
        0
    );
    let host = &attachment.tier_lanes[0];
    host.actor.flush().await.unwrap();
    assert_eq!(host.actor.stats().await.unwrap().filter.resident_blocks, 0);
    registry.detach(attachment).await;
}

#[tokio::test]
async fn invalid_lanes_are_refused_before_anything_is_reserved() {
    let registry = registry_with(test_limits(), Gates::default());
    for (lanes, reason) in [
        (vec![lane(CacheTier::Device, 64)], "format must differ"),
        (
            vec![LaneRequest::format_twin(128, 64, dense())],
            "block size is the pool's",
        ),
        (
            vec![lane(CacheTier::Host, 64), lane(CacheTier::Host, 128)],
            "twice",
        ),
        (vec![lane(CacheTier::Host, 96)], "multiple"),
        (vec![lane(CacheTier::Host, 0)], "multiple"),
    ] {
        let mut attach = request(pool(3), "ns.c.e", "llama");
        attach.tier_lanes = lanes;
        match registry.attach(attach).await {
            Err(AttachError::InvalidLane { reason: got, .. }) => {
                assert!(got.contains(reason), "{got} vs {reason}")
            }
            other => panic!("{other:?}"),
        }
        let stats = registry.stats();
        assert_eq!((stats.pools, stats.reservations), (0, 0));
    }
    // The endpoint stays free for a valid attach, and a lane does not take its endpoint
    // from another pool.
    let mut attach = request(pool(3), "ns.c.e", "llama");
    attach.tier_lanes = vec![lane(CacheTier::Host, 64)];
    let attachment = registry.attach(attach).await.unwrap();
    assert!(matches!(
        registry.attach(request(pool(4), "ns.c.e", "llama")).await,
        Err(AttachError::EndpointAlreadyAssigned { .. })
    ));
    let other = registry
        .attach(request(pool(4), "ns.c.other", "llama"))
        .await
        .unwrap();
    registry.detach(attachment).await;
    registry.detach(other).await;
}

/// A tier event whose lane has stopped (it retires with its pool) is counted, not lost
/// silently.
#[tokio::test]
async fn a_tier_event_for_a_stopped_lane_is_counted() {
    let registry = registry_with(test_limits(), Gates::default());
    let mut attach = request(pool(5), "ns.c.e", "llama");
    attach.tier_lanes = vec![lane(CacheTier::Host, 64)];
    let attachment = registry.attach(attach).await.unwrap();
    attachment.tier_lanes[0].actor.fence().await;
    attachment
        .actor
        .submit_tier(tier_event(CacheTier::Host, TierChange::Cleared))
        .await
        .unwrap();
    attachment.actor.flush().await.unwrap();
    let stats = attachment.actor.stats().await.unwrap();
    assert_eq!((stats.tier_events, stats.tier_events_without_lane), (1, 1));
    registry.detach(attachment).await;
}

/// Every block of `source` a lane or pool holds, as sorted (engine id, canonical) pairs.
async fn holdings(actor: &PoolActorHandle) -> Vec<(SourceId, Vec<(u64, u64)>)> {
    actor.flush().await.unwrap();
    let mut sources = actor.export_mappings().await.unwrap();
    sources.sort_by_key(|entry| entry.source);
    sources
        .into_iter()
        .map(|mut entry| {
            entry.mappings.sort_unstable();
            (entry.source, entry.mappings)
        })
        .collect()
}

/// A v1 pool's dense format twin holds exactly what the pool's filter holds after every
/// kind of change: chains (one refused for an unknown parent), removals, a source's
/// clear and a checkpoint restore, word for word what a dense filter fed the same events
/// holds, without a lineage of its own, and is subscribed to like any lane.
#[tokio::test]
async fn a_format_twin_holds_what_its_pool_holds_in_its_own_format() {
    let registry = registry_with(test_limits(), Gates::default());
    let mut attach = request(pool(6), "ns.c.e", "llama");
    let expected = attach.expected_unique_blocks;
    attach.tier_lanes = vec![
        lane(CacheTier::Host, 64),
        LaneRequest::format_twin(64, expected, dense()),
    ];
    let attachment = registry.attach(attach).await.unwrap();
    let tiers: Vec<CacheTier> = attachment.tier_lanes.iter().map(|l| l.tier).collect();
    assert_eq!(tiers, [CacheTier::Device, CacheTier::Host]);
    let twin = &attachment.tier_lanes[0];
    assert_eq!(twin.pool, pool(6).tier_lane(CacheTier::Device.code()));
    let pool_format = *attachment.actor.identity().format();
    let twin_format = *twin.actor.identity().format();
    assert_eq!(pool_format.format_version(), 1);
    assert_eq!(twin_format.format_version(), 2);
    assert!(twin_format.bucket_count() < pool_format.bucket_count());
    let descriptor = registry.catalog().pool(pool(6)).unwrap().clone();
    assert_eq!(descriptor.tier_lanes[0].block_size, 64);
    assert_eq!(descriptor.tier_lanes[0].producer, twin.actor.identity());

    let chain = |source: u64, parent: Option<u64>, ids: &[u64]| RouterEvent {
        source: SourceId::new(source, 0),
        event_id: 0,
        payload: EventPayload::Stored(StoredBlocks {
            parent_engine_block_id: parent,
            blocks: ids
                .iter()
                .map(|&id| StoredBlock {
                    engine_block_id: id,
                    token_hash: id * 7,
                })
                .collect(),
        }),
    };
    let pool_actor = &attachment.actor;
    let events = [
        chain(1, None, &[1, 2, 3]),
        chain(1, Some(3), &[4]),
        chain(2, None, &[1, 2]),
        // Refused by the pool's filter (unknown parent): the twin never sees it.
        chain(2, Some(99), &[5]),
        RouterEvent {
            source: SourceId::new(1, 0),
            event_id: 0,
            payload: EventPayload::Removed(RemovedBlocks {
                engine_block_ids: vec![4],
            }),
        },
        chain(3, None, &[8, 9]),
        RouterEvent {
            source: SourceId::new(3, 0),
            event_id: 0,
            payload: EventPayload::AllCleared,
        },
    ];
    let dense_config = CkfConfig::new(expected).with_density(dense());
    let mut reference = PoolFilter::new(dense_config).unwrap();
    for event in events {
        let _ = reference.apply(&event);
        pool_actor.submit(event).await.unwrap();
    }
    let held = holdings(pool_actor).await;
    assert_eq!(held.len(), 2, "{held:?}");
    assert_eq!(twin.actor.words().await.unwrap().1, reference.words());
    assert!(
        holdings(&twin.actor).await.is_empty(),
        "a twin keeps no lineage"
    );
    let pool_stats = pool_actor.stats().await.unwrap().filter;
    let twin_stats = twin.actor.stats().await.unwrap().filter;
    // Sources 1 and 2 share blocks 1 and 2 (same tokens, no parent): 3 distinct blocks.
    assert_eq!(
        (pool_stats.resident_blocks, twin_stats.resident_blocks),
        (3, 3)
    );
    assert_eq!(twin_stats.owned_blocks, 3);
    assert_eq!(twin_stats.sources, 0);
    // The host lane got no device event.
    let host = &attachment.tier_lanes[1];
    assert!(holdings(&host.actor).await.is_empty());

    // The twin is a lane: subscribed to by its producer.
    let mut subscription = registry.subscribe(twin.actor.identity()).await.unwrap();
    let first = subscription.next_frame().await.unwrap();
    assert_eq!(first.kind, PoolFrameKind::SnapshotChunk);
    let exported = pool_actor.export_mappings().await.unwrap();
    registry.detach(attachment).await;

    // A restored generation's twin gets the restored mappings too.
    let mut attach = request(pool(6), "ns.c.e", "llama");
    attach.tier_lanes = vec![LaneRequest::format_twin(64, expected, dense())];
    let restored = registry.attach(attach).await.unwrap();
    assert_eq!(restored.actor.restore(exported).await.unwrap(), 5);
    let restored_twin = &restored.tier_lanes[0].actor;
    assert_eq!(restored_twin.words().await.unwrap().1, reference.words());
    assert_eq!(restored_twin.stats().await.unwrap().filter.owned_blocks, 3);
    registry.detach(restored).await;
}

/// A clear of a source holding more blocks than one twin command carries reaches the
/// twin in pieces, all of them; engine events sent to the twin itself are refused,
/// counted as a source-protocol fault, and change nothing.
#[tokio::test]
async fn a_large_clear_reaches_the_twin_and_the_twin_refuses_engine_events() {
    let registry = registry_with(test_limits(), Gates::default());
    let blocks = crate::actor::MAX_MEMBERSHIPS_PER_COMMAND as u64 * 2 + 100;
    let mut attach = request(pool(7), "ns.c.e", "llama");
    attach.expected_unique_blocks = blocks;
    attach.tier_lanes = vec![LaneRequest::format_twin(64, blocks, dense())];
    let attachment = registry.attach(attach).await.unwrap();
    let twin = &attachment.tier_lanes[0].actor;

    for first in (0..blocks).step_by(500) {
        let end = (first + 500).min(blocks);
        let mut chain = StoredBlocks::new_chain(first, (first..end).map(|i| i * 31 + 5));
        chain.parent_engine_block_id = first.checked_sub(1);
        let event = RouterEvent {
            source: SourceId::new(1, 0),
            event_id: first,
            payload: EventPayload::Stored(chain),
        };
        attachment.actor.submit(event).await.unwrap();
    }
    let pool_owned = attachment.actor.stats().await.unwrap().filter.owned_blocks;
    assert_eq!(pool_owned, blocks);
    assert_eq!(twin.stats().await.unwrap().filter.owned_blocks, blocks);

    let refused_before = twin.stats().await.unwrap();
    twin.submit(stored_event(1)).await.unwrap();
    let refused = twin.stats().await.unwrap();
    assert_eq!(refused.events_rejected, refused_before.events_rejected + 1);
    assert_eq!(
        refused
            .faults
            .get(crate::actor::FaultCategory::SourceProtocol),
        1
    );
    assert_eq!(refused.filter.owned_blocks, blocks);

    attachment
        .actor
        .submit(RouterEvent {
            source: SourceId::new(1, 0),
            event_id: blocks,
            payload: EventPayload::AllCleared,
        })
        .await
        .unwrap();
    assert_eq!(
        attachment.actor.stats().await.unwrap().filter.owned_blocks,
        0
    );
    let cleared = twin.stats().await.unwrap();
    assert_eq!(cleared.filter.owned_blocks, 0);
    assert_eq!(cleared.filter.occupied_slots, 0);
    assert_eq!(cleared.filter.counters.invariant_violations, 0);
    assert!(twin.words().await.unwrap().1.iter().all(|&word| word == 0));
    registry.detach(attachment).await;
}
