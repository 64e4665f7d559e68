//! Randomized churn: 64 pools, concurrent attach / detach / subscribe / evict / fence under
//! a small hub limit; ends with no leaked task, permit or hub unit, and every surviving
//! subscriber's replica bit-identical to its producer.

use std::time::Duration;

use kvrelay_ckf::{EventPayload, RemovedBlocks, RouterEvent, SourceId, StoredBlock, StoredBlocks};
use tokio::task::JoinSet;

use super::publication_tests::{WireReplica, follow_until};
use super::tests::Gates;
use super::tests::behaviour::{pool, registry_with, request, test_limits};
use super::*;
use crate::error::SubscriptionEnd;
use crate::subscription::PoolSubscription;

const POOLS: usize = 64;
const ROUNDS: usize = 60;
const OPS_PER_ROUND: usize = 24;

struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A chain whose block ids always sit at the same position of the same chain, so a
/// re-store never contradicts an earlier mapping.
fn random_event(rng: &mut SplitMix, event_id: u64) -> RouterEvent {
    let source = SourceId::new(rng.below(3), rng.below(2) as u32);
    let base = rng.below(64) * 8;
    let payload = if rng.below(3) == 0 {
        EventPayload::Removed(RemovedBlocks {
            engine_block_ids: (0..1 + rng.below(3)).map(|k| base + k).collect(),
        })
    } else {
        EventPayload::Stored(StoredBlocks {
            parent_engine_block_id: None,
            blocks: (0..1 + rng.below(4))
                .map(|k| StoredBlock {
                    engine_block_id: base + k,
                    token_hash: (base + k).wrapping_mul(0x9E37_79B9) ^ 0x55,
                })
                .collect(),
        })
    };
    RouterEvent {
        source,
        event_id,
        payload,
    }
}

fn endpoint(index: usize) -> String {
    format!("ns.pool-{index}.generate")
}

type Slots = Arc<Mutex<Vec<Option<PoolAttachment>>>>;

struct Follower {
    handle: tokio::task::JoinHandle<(
        Option<PoolSubscription>,
        WireReplica,
        Option<SubscriptionEnd>,
    )>,
    stop: CancellationToken,
    producer: ProducerIdentity,
}

fn follow(mut subscription: PoolSubscription) -> Follower {
    let stop = CancellationToken::new();
    let producer = subscription.identity();
    let mut replica = WireReplica::new(&producer);
    let token = stop.clone();
    let handle = tokio::spawn(async move {
        loop {
            tokio::select! {
                biased;
                () = token.cancelled() => return (Some(subscription), replica, None),
                frame = subscription.next_frame() => match frame {
                    Ok(frame) => replica.feed(&frame),
                    Err(end) => return (None, replica, Some(end)),
                },
            }
        }
    });
    Follower {
        handle,
        stop,
        producer,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_leaks_nothing_and_survivors_match_their_producers() {
    let limits = Limits {
        max_initialized_hubs: 4,
        max_delta_buckets: 4,
        ..test_limits()
    };
    let max_blocks = limits.actor_pending_blocks as usize;
    let registry = registry_with(limits, Gates::default());
    let slots: Slots = Arc::new(Mutex::new((0..POOLS).map(|_| None).collect()));
    for index in 0..POOLS {
        let mut req = request(pool(index as u8 + 1), &endpoint(index), "llama");
        req.expected_unique_blocks = 256;
        slots.lock()[index] = Some(registry.attach(req).await.unwrap());
    }

    let mut rng = SplitMix(0x5EED);
    let mut followers: Vec<Follower> = Vec::new();
    let mut ends = std::collections::BTreeMap::<String, usize>::new();
    let mut event_id = 0;
    for round in 0..ROUNDS {
        if round % 4 == 1 {
            // Every fourth round everybody leaves: hubs go idle and become eviction victims.
            for follower in followers.drain(..) {
                follower.handle.abort();
            }
        }
        let mut ops = JoinSet::new();
        let mut subscribes = Vec::new();
        for _ in 0..OPS_PER_ROUND {
            let index = rng.below(POOLS as u64) as usize;
            let dice = rng.below(100);
            let registry = registry.clone();
            let slots = slots.clone();
            if dice < 40 {
                let Some(actor) = slots.lock()[index].as_ref().map(|a| a.actor.clone()) else {
                    continue;
                };
                let events: Vec<RouterEvent> = (0..1 + rng.below(4))
                    .map(|_| {
                        event_id += 1;
                        random_event(&mut rng, event_id)
                    })
                    .collect();
                ops.spawn(async move {
                    for event in events {
                        // A pool retired meanwhile refuses events: that is fine.
                        let _ = actor.submit(event).await;
                    }
                });
            } else if dice < 75 {
                // Half the time join a pool that already has subscribers (shared hubs).
                let pick = rng.below(followers.len() as u64 * 2 + 1) as usize;
                let index = match followers.get(pick) {
                    Some(follower) => slots
                        .lock()
                        .iter()
                        .position(|slot| {
                            slot.as_ref()
                                .is_some_and(|a| a.identity() == follower.producer)
                        })
                        .unwrap_or(index),
                    None => index,
                };
                let Some(producer) = slots.lock()[index].as_ref().map(PoolAttachment::identity)
                else {
                    continue;
                };
                subscribes.push(tokio::spawn(
                    async move { registry.subscribe(producer).await },
                ));
            } else if dice < 83 {
                if !followers.is_empty() {
                    let victim = followers.swap_remove(rng.below(followers.len() as u64) as usize);
                    victim.handle.abort();
                }
            } else {
                let fenced = dice >= 96;
                ops.spawn(async move {
                    let Some(attachment) = slots.lock()[index].take() else {
                        return;
                    };
                    if fenced {
                        registry.fence_generation(
                            attachment.pool,
                            attachment.generation,
                            "stress fence",
                        );
                        registry.retire(attachment, RetirementMode::Fenced).await;
                    } else {
                        registry.detach(attachment).await;
                    }
                    let mut req = request(pool(index as u8 + 1), &endpoint(index), "llama");
                    req.expected_unique_blocks = 256;
                    let replacement = registry.attach(req).await.unwrap();
                    slots.lock()[index] = Some(replacement);
                });
            }
        }
        for subscribe in subscribes {
            match subscribe.await.unwrap() {
                Ok(subscription) => followers.push(follow(subscription)),
                Err(error) => {
                    *ends
                        .entry(format!("refused: {error:?}").chars().take(40).collect())
                        .or_default() += 1
                }
            }
        }
        while let Some(result) = ops.join_next().await {
            result.unwrap();
        }
    }

    // Stop every follower and keep the ones still subscribed to a live generation.
    let mut compared = 0;
    for follower in followers {
        follower.stop.cancel();
        let (subscription, mut replica, end) = follower.handle.await.unwrap();
        let Some(mut subscription) = subscription else {
            *ends.entry(format!("{:?}", end)).or_default() += 1;
            continue;
        };
        let actor = slots
            .lock()
            .iter()
            .flatten()
            .find(|attachment| attachment.identity() == follower.producer)
            .map(|attachment| attachment.actor.clone());
        let Some(actor) = actor else {
            continue;
        };
        actor.flush().await.unwrap();
        let (sequence, words) = actor.words().await.unwrap();
        follow_until(&mut subscription, &mut replica, sequence).await;
        assert_eq!(
            replica.words(),
            words.as_slice(),
            "replica of {:?}",
            follower.producer.pool_id()
        );
        compared += 1;
    }
    assert!(
        compared > 0,
        "some subscribers must survive the churn: {ends:?}"
    );
    assert!(
        registry.stats().hub_evictions > 0,
        "the churn must evict idle hubs"
    );

    let attachments: Vec<PoolAttachment> =
        slots.lock().iter_mut().filter_map(Option::take).collect();
    for attachment in &attachments {
        attachment.actor.flush().await.unwrap();
        assert_eq!(
            attachment.actor.available_block_permits(),
            max_blocks,
            "no leaked block permit"
        );
    }
    for attachment in attachments {
        registry.detach(attachment).await;
    }
    let stats = registry.stats();
    assert_eq!(
        (stats.pools, stats.reservations, stats.initialized_hubs),
        (0, 0, 0)
    );
    tokio::time::timeout(Duration::from_secs(10), async {
        while registry.stats().tasks != 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("every registry task to finish");
    assert!(registry.catalog().is_empty());
    assert!(registry.load().is_empty());
}
