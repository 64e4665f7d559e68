//! The consumer against a fake relay over loopback TCP: convergence, mid-snapshot cuts,
//! lag, gaps, corruption, producer changes, relay restarts and quarantine.

use crate::support;

use std::time::{Duration, Instant};

use kvrelay_codec::v1::{HashFormat, WorkerRole};
use kvrelay_consumer::{
    Consumer, ConsumerConfig, ConsumerState, ReplicaState, ResubscribeReason, ScoreRequest,
};
use kvrelay_identity::hashing::HashSalt;
use support::{FakeRelay, Faults, PoolSpec, within};

const WAIT: Duration = Duration::from_secs(20);

fn config(relays: &[&FakeRelay]) -> ConsumerConfig {
    let mut config = ConsumerConfig::new(
        relays
            .iter()
            .map(|relay| relay.relay_arg().parse().unwrap())
            .collect(),
    );
    // Keep retries quick in tests; the schedule itself is unit-tested in `backoff`.
    config.backoff.initial = Duration::from_millis(10);
    config.backoff.max = Duration::from_millis(50);
    config
}

fn tokens(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| seed * 100_000 + i).collect()
}

/// Every pool of `relay` is current in the consumer at the producer's sequence.
fn converged(relay: &FakeRelay, n_pools: usize) -> impl Fn(&ConsumerState, Instant) -> bool + '_ {
    move |state, now| {
        let pools = state.pools(now);
        (0..n_pools).all(|idx| {
            let producer = relay.producer(idx);
            let (sequence, _) = relay.producer_state(idx);
            pools.iter().any(|p| {
                p.producer == producer
                    && p.replica == ReplicaState::Current
                    && p.sequence == Some(sequence)
            })
        })
    }
}

fn request(model: &str, tokens: Vec<u32>) -> ScoreRequest {
    ScoreRequest {
        tokens,
        model: model.to_owned(),
        ..ScoreRequest::default()
    }
}

fn depth_for(consumer: &Consumer, model: &str, toks: Vec<u32>, pool_endpoint: &str) -> Option<u32> {
    let ranking = consumer.score(&request(model, toks)).unwrap();
    ranking
        .candidates
        .iter()
        .flat_map(|c| &c.legs)
        .find(|leg| &*leg.endpoint == pool_endpoint)
        .and_then(|leg| leg.prefix_blocks)
}

#[tokio::test]
async fn replicas_converge_to_the_producers_and_follow_deltas() {
    let relay = FakeRelay::start(
        "dc-a",
        11,
        vec![
            PoolSpec::aggregated("alpha", "llama"),
            PoolSpec::aggregated("beta", "llama"),
        ],
    )
    .await;
    relay.store(0, 1, &tokens(1, 32), HashSalt::default());
    let consumer = Consumer::start(config(&[&relay])).unwrap();
    assert!(
        consumer.wait_until(WAIT, converged(&relay, 2)).await,
        "initial convergence"
    );
    assert_eq!(
        depth_for(&consumer, "llama", tokens(1, 32), "prod.alpha.generate"),
        Some(8)
    );
    assert_eq!(
        depth_for(&consumer, "llama", tokens(1, 32), "prod.beta.generate"),
        Some(0)
    );

    // Deltas after the snapshot are applied in order.
    relay.store(1, 2, &tokens(1, 16), HashSalt::default());
    relay.store(1, 2, &tokens(2, 40), HashSalt::default());
    relay.heartbeat(0);
    assert!(
        consumer.wait_until(WAIT, converged(&relay, 2)).await,
        "deltas applied"
    );
    assert_eq!(
        depth_for(&consumer, "llama", tokens(1, 32), "prod.beta.generate"),
        Some(4)
    );
    assert_eq!(
        depth_for(&consumer, "llama", tokens(2, 40), "prod.beta.generate"),
        Some(10)
    );
    let ranking = consumer.score(&request("llama", tokens(1, 32))).unwrap();
    assert!(
        ranking.candidates[0].legs[0].endpoint.contains("alpha"),
        "deeper prefix first"
    );

    let metrics = consumer.metrics();
    assert_eq!(metrics.replicas_current, 2);
    // The two stores reach the replica as two deltas or, when the second was published
    // before the first was sent, as one coalesced delta (as from the relay).
    assert!(metrics.deltas_applied >= 1);
    assert_eq!(metrics.snapshots_installed, 2);
    consumer.shutdown().await;
    relay.stop().await;
}

#[tokio::test]
async fn connection_cut_mid_snapshot_recovers_and_never_serves_a_partial_replica() {
    // Two million expected blocks size the filter at 2^20 buckets: a two-chunk snapshot.
    let mut spec = PoolSpec::aggregated("big", "llama");
    spec.expected_blocks = 2_000_000;
    let relay = FakeRelay::start("dc-a", 12, vec![spec]).await;
    relay.store(0, 1, &tokens(3, 64), HashSalt::default());
    relay.arm(Faults {
        cut_after_chunks: Some(1),
    });
    let consumer = Consumer::start(config(&[&relay])).unwrap();
    // Until converged, any answer for the pool must be "unknown", never a depth.
    let seen_partial = std::cell::Cell::new(false);
    let converged_now = consumer
        .wait_until(WAIT, |state, now| {
            let pools = state.pools(now);
            if let Some(pool) = pools.first()
                && pool.replica != ReplicaState::Current
            {
                let ranking = state.score(&request("llama", tokens(3, 64)), now).unwrap();
                if ranking.candidates[0].legs[0].prefix_blocks.is_some() {
                    seen_partial.set(true);
                }
            }
            converged(&relay, 1)(state, now)
        })
        .await;
    assert!(converged_now, "converged after the cut");
    assert!(
        !seen_partial.get(),
        "a non-current replica answered a depth"
    );
    assert!(
        relay.subscriptions_opened() >= 2,
        "resubscribed after the cut"
    );
    assert!(
        consumer
            .metrics()
            .resubscribes_for(ResubscribeReason::Disconnected)
            >= 1
    );
    assert_eq!(
        depth_for(&consumer, "llama", tokens(3, 64), "prod.big.generate"),
        Some(16)
    );
    consumer.shutdown().await;
    relay.stop().await;
}

#[tokio::test]
async fn a_broken_pool_stream_resumes_from_the_replica_without_a_snapshot() {
    let relay = FakeRelay::start("dc-a", 18, vec![PoolSpec::aggregated("alpha", "llama")]).await;
    relay.store(0, 1, &tokens(8, 16), HashSalt::default());
    let consumer = Consumer::start(config(&[&relay])).unwrap();
    assert!(consumer.wait_until(WAIT, converged(&relay, 1)).await);
    assert_eq!(consumer.metrics().snapshots_installed, 1);

    // The link breaks; the producer moves on while the consumer reconnects.
    relay.cut_pool_streams(0);
    relay.store(0, 1, &tokens(9, 16), HashSalt::default());
    relay.store(0, 1, &tokens(10, 16), HashSalt::default());
    assert!(
        consumer
            .wait_until(WAIT, |state, now| {
                converged(&relay, 1)(state, now) && relay.subscriptions_opened() >= 2
            })
            .await,
        "caught up on the new stream"
    );
    let metrics = consumer.metrics();
    assert_eq!(
        metrics.snapshots_installed, 1,
        "the resumed stream sent deltas, not a snapshot"
    );
    assert!(metrics.resubscribes_for(ResubscribeReason::Disconnected) >= 1);
    assert_eq!(
        depth_for(&consumer, "llama", tokens(10, 16), "prod.alpha.generate"),
        Some(4)
    );
    consumer.shutdown().await;
    relay.stop().await;
}

#[tokio::test]
async fn producer_change_moves_the_subscription_to_the_new_generation() {
    let relay = FakeRelay::start("dc-a", 16, vec![PoolSpec::aggregated("alpha", "llama")]).await;
    relay.store(0, 1, &tokens(7, 16), HashSalt::default());
    let consumer = Consumer::start(config(&[&relay])).unwrap();
    assert!(consumer.wait_until(WAIT, converged(&relay, 1)).await);
    let old = relay.producer(0);
    relay.replace_producer(0);
    relay.store(0, 1, &tokens(8, 8), HashSalt::default());
    assert!(
        consumer.wait_until(WAIT, converged(&relay, 1)).await,
        "new generation current"
    );
    let pools = consumer.pools();
    assert_eq!(pools.len(), 1);
    assert_ne!(pools[0].producer, old);
    // The old generation's blocks are gone with its replica.
    assert_eq!(
        depth_for(&consumer, "llama", tokens(7, 16), "prod.alpha.generate"),
        Some(0)
    );
    assert_eq!(
        depth_for(&consumer, "llama", tokens(8, 8), "prod.alpha.generate"),
        Some(2)
    );
    consumer.shutdown().await;
    relay.stop().await;
}

#[tokio::test]
async fn relay_restart_with_a_new_incarnation_resubscribes_everything() {
    let relay = FakeRelay::start("dc-a", 17, vec![PoolSpec::aggregated("alpha", "llama")]).await;
    relay.store(0, 1, &tokens(9, 16), HashSalt::default());
    let consumer = Consumer::start(config(&[&relay])).unwrap();
    assert!(consumer.wait_until(WAIT, converged(&relay, 1)).await);
    let addr = relay.addr;
    relay.stop().await;
    // While the relay is down nothing from it may answer.
    assert!(
        consumer
            .wait_until(WAIT, |state, now| state.pools(now).is_empty())
            .await,
        "state of the dead relay dropped"
    );
    let relay = FakeRelay::restart_on(
        addr,
        "dc-a",
        18,
        vec![PoolSpec::aggregated("alpha", "llama")],
    )
    .await;
    relay.store(0, 1, &tokens(10, 8), HashSalt::default());
    assert!(
        consumer.wait_until(WAIT, converged(&relay, 1)).await,
        "converged after restart"
    );
    assert_eq!(consumer.pools()[0].producer.producer_incarnation, 18);
    assert_eq!(
        depth_for(&consumer, "llama", tokens(10, 8), "prod.alpha.generate"),
        Some(2)
    );
    assert!(consumer.metrics().relay_connects >= 2);
    consumer.shutdown().await;
    relay.stop().await;
}

#[tokio::test]
async fn unsupported_catalog_entry_is_quarantined_and_the_rest_stay_usable() {
    let relay = FakeRelay::start("dc-a", 19, vec![PoolSpec::aggregated("alpha", "llama")]).await;
    relay.store(0, 1, &tokens(11, 8), HashSalt::default());
    let consumer = Consumer::start(config(&[&relay])).unwrap();
    assert!(consumer.wait_until(WAIT, converged(&relay, 1)).await);
    relay.add_raw_descriptor(|mut d| {
        d.producer.pool_id.dc_id ^= 1; // another pool id
        d.query_semantics.hash_format = HashFormat::Unrecognized(77);
        d
    });
    relay.add_raw_descriptor(|mut d| {
        d.producer.pool_id.dc_id ^= 2;
        d.pool_roles = vec![WorkerRole::Unrecognized(42)];
        d
    });
    assert!(
        consumer
            .wait_until(WAIT, |state, _| state.quarantined().len() == 2)
            .await
    );
    assert!(
        consumer.wait_until(WAIT, converged(&relay, 1)).await,
        "good pool kept"
    );
    assert_eq!(
        depth_for(&consumer, "llama", tokens(11, 8), "prod.alpha.generate"),
        Some(2)
    );
    let metrics = consumer.metrics();
    assert_eq!(metrics.quarantined_entries, 2);
    assert_eq!(metrics.quarantined_total, 2);
    relay.clear_raw_descriptors();
    assert!(
        consumer
            .wait_until(WAIT, |state, _| state.quarantined().is_empty())
            .await
    );
    consumer.shutdown().await;
    relay.stop().await;
}

#[tokio::test]
async fn ranking_combines_prefix_load_and_dc_cost_across_relays() {
    let near = FakeRelay::start("near", 21, vec![PoolSpec::aggregated("alpha", "llama")]).await;
    let far = FakeRelay::start("far", 22, vec![PoolSpec::aggregated("beta", "llama")]).await;
    near.store(0, 1, &tokens(12, 32), HashSalt::default());
    far.store(0, 1, &tokens(12, 32), HashSalt::default());
    near.publish_load(&[(90, 100)]);
    far.publish_load(&[(10, 100)]);
    let mut cfg = config(&[&near, &far]);
    cfg.relays[1].cost = 30.0;
    let consumer = Consumer::start(cfg).unwrap();
    assert!(consumer.wait_until(WAIT, converged(&near, 1)).await);
    assert!(consumer.wait_until(WAIT, converged(&far, 1)).await);
    assert!(
        consumer
            .wait_for_metrics(WAIT, |m| m.load_windows >= 2)
            .await
    );
    let ranking = consumer.score(&request("llama", tokens(12, 32))).unwrap();
    assert_eq!(ranking.candidates.len(), 2);
    // Equal prefixes: near has load 0.9 (-0.45), far has load 0.1 and cost 30 (-0.05-0.3).
    assert_eq!(&*ranking.candidates[0].dc, "far");
    assert_eq!(ranking.candidates[0].load_fraction, Some(0.1));
    assert_eq!(ranking.candidates[1].load_fraction, Some(0.9));
    consumer.shutdown().await;
    near.stop().await;
    far.stop().await;
}

#[tokio::test]
async fn lora_and_prefill_decode_pools_are_scored_with_their_salt_and_both_legs() {
    let mut prefill = PoolSpec::aggregated("prefill", "llama");
    prefill.roles = vec![WorkerRole::Prefill];
    prefill.namespace = "disagg";
    let mut decode = PoolSpec::aggregated("decode", "llama");
    decode.roles = vec![WorkerRole::Decode];
    decode.namespace = "disagg";
    let mut lora = PoolSpec::aggregated("lora", "llama");
    lora.adapter = Some("sql");
    let relay = FakeRelay::start("dc-a", 23, vec![prefill, decode, lora]).await;
    let salted = HashSalt {
        lora_name: Some("sql"),
        cache_namespace: None,
    };
    relay.store(0, 1, &tokens(13, 32), HashSalt::default());
    relay.store(1, 2, &tokens(13, 16), HashSalt::default());
    relay.store(2, 3, &tokens(13, 24), salted);
    let consumer = Consumer::start(config(&[&relay])).unwrap();
    assert!(consumer.wait_until(WAIT, converged(&relay, 3)).await);

    let base = consumer.score(&request("llama", tokens(13, 32))).unwrap();
    let pair = base
        .candidates
        .iter()
        .find(|c| c.legs.len() == 2)
        .expect("a prefill/decode pair");
    assert_eq!(pair.legs[0].prefix_blocks, Some(8));
    assert_eq!(pair.legs[1].prefix_blocks, Some(4));
    let lora_pool_unsalted = base
        .candidates
        .iter()
        .find(|c| &*c.legs[0].endpoint == "prod.lora.generate")
        .expect("the lora pool serves its base model too");
    assert_eq!(
        lora_pool_unsalted.legs[0].prefix_blocks,
        Some(0),
        "salted blocks never match unsalted"
    );

    let adapter = consumer
        .score(&ScoreRequest {
            lora: Some("sql".into()),
            ..request("llama", tokens(13, 32))
        })
        .unwrap();
    assert_eq!(
        adapter.candidates.len(),
        1,
        "only the pool registering the adapter"
    );
    assert_eq!(adapter.candidates[0].legs[0].prefix_blocks, Some(6));
    consumer.shutdown().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocking_route_once_settles_and_ranks() {
    let relay = FakeRelay::start("dc-a", 31, vec![PoolSpec::aggregated("alpha", "llama")]).await;
    relay.store(0, 1, &tokens(14, 16), HashSalt::default());
    let cfg = config(&[&relay]);
    let report = tokio::task::spawn_blocking(move || {
        kvrelay_consumer::route_once(cfg, &request("llama", tokens(14, 16)), WAIT)
    })
    .await
    .unwrap()
    .unwrap();
    assert!(report.settled);
    let ranking = report.ranking.unwrap();
    assert_eq!(ranking.candidates[0].legs[0].prefix_blocks, Some(4));
    assert_eq!(report.pools.len(), 1);
    relay.stop().await;
}

#[tokio::test]
async fn lost_load_stream_makes_loads_unknown_and_keeps_replicas() {
    let relay = FakeRelay::start("dc-a", 32, vec![PoolSpec::aggregated("alpha", "llama")]).await;
    relay.store(0, 1, &tokens(15, 8), HashSalt::default());
    relay.publish_load(&[(50, 100)]);
    let consumer = Consumer::start(config(&[&relay])).unwrap();
    assert!(consumer.wait_until(WAIT, converged(&relay, 1)).await);
    let load_of = |consumer: &Consumer| {
        consumer
            .score(&request("llama", tokens(15, 8)))
            .unwrap()
            .candidates[0]
            .load_fraction
    };
    assert!(
        consumer
            .wait_for_metrics(WAIT, |m| m.load_windows >= 1)
            .await
    );
    assert_eq!(load_of(&consumer), Some(0.5));
    let connects = consumer.metrics().relay_connects;
    relay.close_load_streams();
    relay.publish_load(&[(20, 100)]);
    assert!(
        consumer
            .wait_for_metrics(WAIT, |m| m.load_windows >= 2)
            .await,
        "load stream reopened"
    );
    assert_eq!(load_of(&consumer), Some(0.2));
    assert_eq!(
        relay.load_streams_opened(),
        2,
        "the consumer reopened its load stream"
    );
    let metrics = consumer.metrics();
    assert_eq!(metrics.relay_connects, connects, "the relay epoch survived");
    assert_eq!(
        metrics.snapshots_installed, 1,
        "the replica was never dropped"
    );
    consumer.shutdown().await;
    relay.stop().await;
}

#[tokio::test]
async fn unavailable_serving_entries_are_excluded_and_unknown_ones_marked() {
    use kvrelay_codec::v1::ReadinessState;
    use kvrelay_consumer::CandidateReadiness;
    let mut unknown = PoolSpec::aggregated("gamma", "llama");
    unknown.namespace = "staging";
    let mut down = PoolSpec::aggregated("beta", "llama");
    down.namespace = "canary";
    let relay = FakeRelay::start(
        "dc-a",
        31,
        vec![PoolSpec::aggregated("alpha", "llama"), down, unknown],
    )
    .await;
    let consumer = Consumer::start(config(&[&relay])).unwrap();
    assert!(
        consumer.wait_until(WAIT, converged(&relay, 3)).await,
        "initial convergence"
    );
    // No topology yet: every candidate is kept and marked unknown.
    let ranking = consumer.score(&request("llama", tokens(1, 16))).unwrap();
    assert_eq!(ranking.candidates.len(), 3);
    assert!(
        ranking
            .candidates
            .iter()
            .all(|c| c.readiness == CandidateReadiness::Unknown)
    );

    relay.publish_topology(&[
        ("prod", "llama", ReadinessState::Ready),
        ("canary", "llama", ReadinessState::Unavailable),
        ("staging", "llama", ReadinessState::Unknown),
    ]);
    assert!(
        consumer
            .wait_for_metrics(WAIT, |m| m.topologies_applied >= 1)
            .await,
        "topology applied"
    );
    let ranking = consumer.score(&request("llama", tokens(1, 16))).unwrap();
    let by_endpoint = |name: &str| {
        ranking
            .candidates
            .iter()
            .find(|c| &*c.legs[0].endpoint == name)
            .map(|c| c.readiness)
    };
    assert_eq!(
        by_endpoint("prod.alpha.generate"),
        Some(CandidateReadiness::Ready)
    );
    assert_eq!(
        by_endpoint("canary.beta.generate"),
        None,
        "unavailable is excluded"
    );
    assert_eq!(
        by_endpoint("staging.gamma.generate"),
        Some(CandidateReadiness::Unknown)
    );
    assert_eq!(ranking.n_not_ready, 1);
    consumer.shutdown().await;
}

/// A catalog that goes silent fails the relay's epoch at the catalog bound even while the
/// load stream keeps talking (each load window used to re-arm the catalog timeout, so a
/// wedged catalog was kept, and its replicas scored, forever).
#[tokio::test]
async fn a_silent_catalog_fails_the_epoch_even_while_load_windows_flow() {
    let relay = FakeRelay::start("dc-a", 32, vec![PoolSpec::aggregated("alpha", "llama")]).await;
    relay.store(0, 1, &tokens(16, 8), HashSalt::default());
    let mut config = config(&[&relay]);
    config.limits.catalog_staleness_bound = Duration::from_millis(600);
    let consumer = Consumer::start(config).unwrap();
    assert!(consumer.wait_until(WAIT, converged(&relay, 1)).await);
    // The fake sends its catalog once per stream and never again; the load stream gets a
    // window every 100 ms for 2.5 s, four per catalog bound.
    let mut interval = tokio::time::interval(Duration::from_millis(100));
    for n in 0..25u64 {
        interval.tick().await;
        relay.publish_load(&[(n, 100)]);
    }
    let metrics = consumer.metrics();
    assert!(
        metrics.relay_connects >= 2,
        "the silent catalog ended the epoch ({} connects)",
        metrics.relay_connects
    );
    let errors = consumer.relay_errors();
    assert!(
        errors.iter().any(|(_, error)| error
            .as_deref()
            .is_some_and(|e| e.contains("sent no catalog"))),
        "{errors:?}"
    );
    consumer.shutdown().await;
    relay.stop().await;
}

/// A relay advertising more pools than `max_pool_streams_per_relay` gets at most that many
/// streams (connections) at once; the rest wait, so a relay with thousands of pools cannot
/// take every descriptor of the process (until issue 33's multiplexed relay link).
#[tokio::test]
async fn pool_streams_per_relay_are_bounded() {
    let specs: Vec<PoolSpec> = ["p0", "p1", "p2", "p3", "p4", "p5"]
        .into_iter()
        .map(|name| PoolSpec::aggregated(name, "llama"))
        .collect();
    let relay = FakeRelay::start("dc-a", 32, specs).await;
    let mut config = config(&[&relay]);
    config.limits.max_pool_streams_per_relay = 2;
    let consumer = Consumer::start(config).unwrap();
    assert!(
        consumer
            .wait_until(WAIT, |state, now| {
                state
                    .pools(now)
                    .iter()
                    .filter(|pool| pool.replica == ReplicaState::Current)
                    .count()
                    == 2
            })
            .await,
        "two pools are followed"
    );
    assert_eq!(
        relay.pool_streams_peak(),
        2,
        "never more than the bound at once"
    );
    let current = consumer
        .pools()
        .iter()
        .filter(|p| p.replica == ReplicaState::Current)
        .count();
    assert_eq!(current, 2, "the others wait for a free stream");
    consumer.shutdown().await;
    relay.stop().await;

    let mut zero = ConsumerConfig::new(vec!["127.0.0.1:1=dc-z".parse().unwrap()]);
    zero.limits.max_pool_streams_per_relay = 0;
    assert!(Consumer::start(zero).is_err());
}

/// A relay pair whose followed relay withholds a pool as stalled: the consumer moves to the
/// other relay, which serves every pool; when that one stalls too within the stall hold,
/// the consumer stays (it would only bounce and re-snapshot), lists the pools it still
/// serves and reports the stalled one.
#[tokio::test]
async fn a_stalled_pool_at_the_followed_relay_moves_a_pair_once() {
    let pools = || {
        vec![
            PoolSpec::aggregated("alpha", "llama"),
            PoolSpec::aggregated("beta", "llama"),
        ]
    };
    let (first, second, mut config) = fake_pair(pools).await;
    // No standby probe: the relay left stays as it was left.
    config.limits.standby_probe_interval = Duration::ZERO;
    let consumer = Consumer::start(config).unwrap();
    assert!(
        consumer.wait_until(WAIT, converged(&first, 2)).await,
        "following the first relay"
    );
    let standbys = consumer.relays()[0].standbys.clone();
    assert_eq!(standbys.len(), 1);
    assert_eq!(
        (standbys[0].addr.clone(), standbys[0].reachable),
        (second.addr.to_string(), None),
        "never probed"
    );

    first.set_stalled(1, true);
    assert!(
        consumer.wait_until(WAIT, converged(&second, 2)).await,
        "moved to the second relay: {:?}",
        consumer.relays()
    );
    let metrics = consumer.metrics();
    assert_eq!((metrics.relay_stalls, metrics.relay_failovers), (1, 1));
    let status = consumer.relays().remove(0);
    let error = status.last_error.clone().unwrap_or_default();
    assert!(error.contains("withholds 1 stalled pool"), "{error}");
    // The relay left is now the standby, not working until a probe hears from it.
    assert_eq!(status.standbys.len(), 1);
    assert_eq!(status.standbys[0].addr, first.addr.to_string());
    assert_eq!(status.standbys[0].reachable, Some(false));
    assert_eq!(status.standbys[0].error.as_deref(), Some(error.as_str()));
    assert_eq!(metrics.standbys_unreachable, 1);

    // The second relay stalls as well, within the hold: the consumer stays, serving the
    // pool that is not stalled.
    second.set_stalled(0, true);
    let stays = consumer
        .wait_until(WAIT, |state, now| {
            let pools = state.pools(now);
            pools.len() == 1
                && pools[0].producer == second.producer(1)
                && pools[0].replica == ReplicaState::Current
                && state.relay_statuses()[0].stalled_pools == 1
        })
        .await;
    assert!(stays, "{:?}\n{:?}", consumer.pools(), consumer.relays());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let metrics = consumer.metrics();
    assert_eq!((metrics.relay_stalls, metrics.relay_failovers), (1, 1));
    consumer.shutdown().await;
    first.stop().await;
    second.stop().await;
}

/// Two fake relays of one DC (incarnations 11 and 12) serving `pools`, and a consumer
/// configuration following them as a pair. The fakes send load windows only when told, so
/// the silence watch is off.
async fn fake_pair(pools: impl Fn() -> Vec<PoolSpec>) -> (FakeRelay, FakeRelay, ConsumerConfig) {
    let first = FakeRelay::start("dc-a", 11, pools()).await;
    let second = FakeRelay::start("dc-a", 12, pools()).await;
    let pair = format!("{}+{}=dc-a", first.addr, second.addr);
    let mut config = config(&[]);
    config.relays = vec![pair.parse().unwrap()];
    config.limits.relay_silence_windows = 0;
    (first, second, config)
}

/// Polls `condition` every 10 ms until it holds, within the test's bound.
async fn eventually(what: &str, condition: impl Fn() -> bool) {
    within(what, async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// A pair's standby is probed while it is not needed: it shows as reachable with the
/// incarnation it reported, and as unreachable (status, gauge, counter) once it stops
/// answering, while the followed relay keeps serving.
#[tokio::test]
async fn a_pairs_standby_is_probed_and_shows_when_it_dies() {
    let (first, second, mut config) =
        fake_pair(|| vec![PoolSpec::aggregated("alpha", "llama")]).await;
    config.limits.standby_probe_interval = Duration::from_millis(50);
    let consumer = Consumer::start(config).unwrap();
    assert!(
        consumer.wait_until(WAIT, converged(&first, 1)).await,
        "following the first relay"
    );
    let standby = || consumer.relays()[0].standbys.clone();
    eventually("the standby's first answer", || {
        standby().first().and_then(|s| s.reachable) == Some(true)
    })
    .await;
    let seen = standby();
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].addr, second.addr.to_string());
    assert_eq!(seen[0].incarnation, Some(12));
    assert_eq!(seen[0].error, None);
    assert_eq!(consumer.metrics().standbys_unreachable, 0);

    second.stop().await;
    eventually("the standby's failed probe", || {
        standby().first().and_then(|s| s.reachable) == Some(false)
    })
    .await;
    let seen = standby();
    assert!(seen[0].error.is_some(), "{seen:?}");
    assert_eq!(seen[0].incarnation, None);
    let metrics = consumer.metrics();
    assert_eq!(metrics.standbys_unreachable, 1);
    assert!(metrics.standby_probe_failures >= 1);
    assert_eq!(metrics.relay_failovers, 0, "the followed relay is kept");
    assert!(consumer.wait_until(WAIT, converged(&first, 1)).await);
    consumer.shutdown().await;
    first.stop().await;
}
