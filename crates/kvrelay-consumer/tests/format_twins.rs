//! Format twins: a relay with `[filters] format = "v1_and_dense"` lists every pool in v1
//! and names a dense copy of it as the pool's device lane. This consumer follows the
//! smaller twin in place of the pool's own filter; one that does not (an older one, or
//! `follow_format_twins = false`) keeps the v1 pool and never sees the twin.

use crate::support;

use std::time::Instant;

use kvrelay_ckf::FilterDensity;
use kvrelay_codec::v1::{CatalogUpdate, TierLaneDescriptor};
use kvrelay_consumer::{ConsumerConfig, ConsumerState, PoolKey, RelayEndpoint, ReplicaState};
use kvrelay_identity::hashing::HashSalt;
use support::pair::request;
use support::{PoolSpec, Producer, catalog_of, relay_identity};

const DENSE: FilterDensity = FilterDensity::Dense {
    load_percent: 95,
    size_classes_per_octave: 0,
};

fn config() -> ConsumerConfig {
    ConsumerConfig::new(vec![RelayEndpoint::new("127.0.0.1:7400", "dc-0")])
}

/// A v1 pool and its dense twin, as one relay publishes them.
fn pool_and_twin() -> (Producer, Producer) {
    let relay = relay_identity(1);
    let pool = Producer::new(&PoolSpec::aggregated("alpha", "llama"), "dc-0", relay, 1);
    let twin = Producer::with_density(
        &PoolSpec::aggregated("alpha-twin", "llama"),
        "dc-0",
        relay,
        2,
        DENSE,
    );
    (pool, twin)
}

/// `catalog` with `twin` named as `pool`'s device lane of `block_size` tokens.
fn with_twin(
    mut catalog: CatalogUpdate,
    pool: &Producer,
    twin: &Producer,
    block_size: u32,
) -> CatalogUpdate {
    catalog.tier_lanes.push(TierLaneDescriptor {
        pool_id: pool.descriptor.producer.pool_id,
        tier: kvrelay_ckf::CacheTier::Device.code(),
        block_size,
        producer: twin.descriptor.producer,
    });
    catalog
}

fn replica_bytes(producer: &Producer) -> u64 {
    producer.descriptor.producer.ckf_format.bucket_count * 8
}

fn install(state: &mut ConsumerState, key: PoolKey, producer: &mut Producer, now: Instant) {
    state.begin_subscription(key).unwrap();
    for frame in &producer.snapshot_frames() {
        state.apply_pool_frame(key, frame, now).unwrap();
    }
}

#[test]
fn a_pools_dense_twin_is_followed_in_place_of_its_v1_filter() {
    let (mut pool, mut twin) = pool_and_twin();
    assert_eq!(twin.descriptor.producer.ckf_format.format_version, 2);
    assert!(replica_bytes(&twin) < replica_bytes(&pool));
    let relay = relay_identity(1);
    let catalog = with_twin(catalog_of(relay, 1, &[&pool]), &pool, &twin, 4);
    let mut state = ConsumerState::new(&config()).unwrap();
    let change = state.apply_catalog(0, &catalog).unwrap();
    // One replica, subscribed through the twin; nothing quarantined.
    assert_eq!(change.added.len(), 1);
    let (key, producer) = change.added[0];
    assert_eq!(producer, twin.descriptor.producer);
    assert_eq!(state.producer(key), Some(twin.descriptor.producer));
    assert!(state.quarantined().is_empty());

    // The relay feeds both filters the same events; the consumer installs the twin's.
    let now = Instant::now();
    let tokens: Vec<u32> = (0..16).collect();
    pool.store(1, &tokens[..8], HashSalt::default());
    twin.store(1, &tokens[..8], HashSalt::default());
    install(&mut state, key, &mut twin, now);
    let ranking = state.score(&request(tokens.clone()), now).unwrap();
    assert_eq!(ranking.candidates[0].legs[0].prefix_blocks, Some(2));
    let pools = state.pools(now);
    assert_eq!(pools.len(), 1, "the twin is not a pool of its own");
    assert_eq!(pools[0].replica, ReplicaState::Current);
    assert!(
        pools[0].tier_lanes.is_empty(),
        "the twin is not a tier lane"
    );
    // A frame of the pool's own v1 stream does not belong to this replica.
    state.begin_subscription(key).unwrap();
    let v1_frame = &pool.snapshot_frames()[0];
    assert!(state.apply_pool_frame(key, v1_frame, now).is_err());

    // The same catalog keeps the replica; one without the twin moves the pool back to
    // its own v1 filter under a new key.
    let change = state.apply_catalog(0, &catalog).unwrap();
    assert!(change.added.is_empty() && change.removed.is_empty());
    let change = state
        .apply_catalog(0, &catalog_of(relay, 2, &[&pool]))
        .unwrap();
    assert_eq!(change.removed, vec![key]);
    assert_eq!(change.added.len(), 1);
    assert_eq!(change.added[0].1, pool.descriptor.producer);
}

#[test]
fn the_budget_counts_the_replica_actually_kept() {
    let (pool, twin) = pool_and_twin();
    let relay = relay_identity(1);
    let catalog = with_twin(catalog_of(relay, 1, &[&pool]), &pool, &twin, 4);
    // Room for the twin, not for the v1 filter.
    let mut config = config();
    config.limits.max_replica_bytes_per_relay = replica_bytes(&twin);
    let mut state = ConsumerState::new(&config).unwrap();
    let change = state.apply_catalog(0, &catalog).unwrap();
    assert_eq!(change.added.len(), 1);
    assert_eq!(change.newly_over_budget, 0);
    // Without twins the same budget cannot hold the pool.
    config.follow_format_twins = false;
    let mut state = ConsumerState::new(&config).unwrap();
    let change = state.apply_catalog(0, &catalog).unwrap();
    assert!(change.added.is_empty());
    assert_eq!(change.newly_over_budget, 1);
    assert!(state.quarantined()[0].reason.starts_with("over budget"));
}

#[test]
fn twins_not_worth_following_leave_the_pool_in_its_own_format() {
    let (pool, twin) = pool_and_twin();
    let relay = relay_identity(1);
    let subscribed = |config: &ConsumerConfig, catalog: &CatalogUpdate| {
        let mut state = ConsumerState::new(config).unwrap();
        let change = state.apply_catalog(0, catalog).unwrap();
        assert_eq!(change.added.len(), 1, "{change:?}");
        assert!(state.quarantined().is_empty(), "{:?}", state.quarantined());
        assert!(state.pools(Instant::now())[0].tier_lanes.is_empty());
        change.added[0].1
    };
    let own = pool.descriptor.producer;
    let catalog = with_twin(catalog_of(relay, 1, &[&pool]), &pool, &twin, 4);
    // Twins off (as a consumer older than them behaves: device lanes are skipped).
    let mut off = config();
    off.follow_format_twins = false;
    assert_eq!(subscribed(&off, &catalog), own);
    // A device lane whose blocks are not the pool's is no twin.
    let coarse = with_twin(catalog_of(relay, 1, &[&pool]), &pool, &twin, 8);
    assert_eq!(subscribed(&config(), &coarse), own);
    // A "twin" larger than the pool's own filter is not worth following.
    let big = Producer::new(
        &PoolSpec {
            expected_blocks: 1 << 16,
            ..PoolSpec::aggregated("alpha-big", "llama")
        },
        "dc-0",
        relay,
        3,
    );
    let larger = with_twin(catalog_of(relay, 1, &[&pool]), &pool, &big, 4);
    assert_eq!(subscribed(&config(), &larger), own);
}
