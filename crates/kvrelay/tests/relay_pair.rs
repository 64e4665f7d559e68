//! Two `kvrelay relay` processes of one DC (same cards, same DC name) followed by one
//! consumer as a pair (`A,B=dc`): it follows A; when A is killed with SIGKILL it moves to
//! B at once and its replicas are current again, each pool listed once (the DC is never
//! counted twice); it stays on B when A comes back on its address (no flapping), and moves
//! back only when B goes away. A followed relay that goes silent (SIGSTOP: its sockets stay
//! open) is left for B once it missed its load windows, long before the catalog deadline.

use crate::support;

use std::time::{Duration, Instant};

use kvrelay_consumer::{
    BackoffConfig, Consumer, ConsumerConfig, RelayEndpoint, ReplicaState, StandbyMode,
};
use support::{RelayProcess, quick_consumer};

const DEADLINE: Duration = Duration::from_secs(30);
/// Pools of the example cards.
const EXAMPLE_POOLS: usize = 4;
const WORKLOAD: &[&str] = &["--builtin-workload"];

/// Waits until every example pool is current, each listed once.
async fn all_current(consumer: &Consumer) {
    let current = consumer
        .wait_until(DEADLINE, |state, now| {
            let pools = state.pools(now);
            pools.len() == EXAMPLE_POOLS
                && pools
                    .iter()
                    .all(|status| status.replica == ReplicaState::Current)
        })
        .await;
    assert!(current, "{:?}\n{:?}", consumer.pools(), consumer.relays());
}

/// The relay incarnation every pool is followed through now.
fn followed_incarnation(consumer: &Consumer) -> u64 {
    let pools = consumer.pools();
    let incarnation = pools[0].producer.producer_incarnation;
    assert!(
        pools
            .iter()
            .all(|status| status.producer.producer_incarnation == incarnation),
        "pools followed through two relays at once: {pools:?}"
    );
    incarnation
}

/// Waits until every example pool is current through an incarnation none of `left` (the
/// relays left behind); returns how long that took.
async fn current_through_another(consumer: &Consumer, left: &[u64]) -> Duration {
    let started = Instant::now();
    let moved = consumer
        .wait_until(DEADLINE, |state, now| {
            let pools = state.pools(now);
            pools.len() == EXAMPLE_POOLS
                && pools.iter().all(|status| {
                    status.replica == ReplicaState::Current
                        && !left.contains(&status.producer.producer_incarnation)
                })
        })
        .await;
    assert!(moved, "{:?}\n{:?}", consumer.pools(), consumer.relays());
    started.elapsed()
}

/// For 2 s the consumer keeps following `incarnation` (no flapping back).
async fn stays_on(consumer: &Consumer, incarnation: u64) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        assert_eq!(followed_incarnation(consumer), incarnation);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A consumer following `first` and `second` as one DC's pair with `mode`, with a quick
/// backoff and a catalog deadline (60 s) past every wait here: only a broken connection
/// or silence can move it.
fn pair_consumer(first: &RelayProcess, second: &RelayProcess, mode: StandbyMode) -> Consumer {
    let pair = RelayEndpoint::new(&first.wan.to_string(), "dc-proc")
        .with_standby(vec![second.wan.to_string()]);
    let mut config = ConsumerConfig::new(vec![pair]);
    config.standby = mode;
    config.backoff = BackoffConfig {
        initial: Duration::from_millis(20),
        max: Duration::from_millis(200),
        ..BackoffConfig::default()
    };
    config.limits.catalog_staleness_bound = Duration::from_secs(60);
    Consumer::start(config).unwrap()
}

fn signal(relay: &RelayProcess, name: &str) {
    let status = std::process::Command::new("kill")
        .args([&format!("-{name}"), &relay.child.id().unwrap().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill -{name}");
}

async fn kill(mut relay: RelayProcess) {
    relay.child.start_kill().unwrap();
    tokio::time::timeout(DEADLINE, relay.child.wait())
        .await
        .expect("the killed relay exits")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_fails_over_within_a_relay_pair_and_never_counts_the_dc_twice() {
    // The built-in trace gives every example pool sources (and its catalog entry).
    let first = RelayProcess::start(&[], WORKLOAD, &[]).await;
    let second = RelayProcess::start(&[], WORKLOAD, &[]).await;
    let pair = RelayEndpoint::new(&first.wan.to_string(), "dc-proc")
        .with_standby(vec![second.wan.to_string()]);
    let consumer = quick_consumer(vec![pair]);
    all_current(&consumer).await;
    let through_first = followed_incarnation(&consumer);
    assert_eq!(consumer.metrics().relay_failovers, 0);
    let (first_wan, second_wan) = (first.wan, second.wan);

    // SIGKILL of the followed relay: the standby takes over at once.
    let killed_at = Instant::now();
    kill(first).await;
    let unusable_for = current_through_another(&consumer, &[through_first]).await;
    let through_second = followed_incarnation(&consumer);
    assert_ne!(through_second, through_first);
    assert_eq!(consumer.metrics().relay_failovers, 1);
    assert_eq!(
        consumer.relays()[0].addr,
        second_wan.to_string(),
        "the status names the relay followed now"
    );
    eprintln!(
        "replicas current through the standby {unusable_for:?} after the kill ({:?} including the kill itself)",
        killed_at.elapsed()
    );

    // The killed relay comes back on its address: the consumer stays on the standby that
    // works (no flapping back).
    let first = RelayProcess::start_on(first_wan, WORKLOAD).await;
    stays_on(&consumer, through_second).await;
    assert_eq!(consumer.metrics().relay_failovers, 1);

    // Now the standby dies: the consumer moves back to the first relay at once.
    kill(second).await;
    current_through_another(&consumer, &[through_first, through_second]).await;
    assert_eq!(consumer.metrics().relay_failovers, 2);

    // A rolling upgrade's step: the standby is back, and the followed relay is stopped
    // gracefully (SIGTERM): the consumer moves at once.
    let second = RelayProcess::start_on(second_wan, WORKLOAD).await;
    let through_first_again = followed_incarnation(&consumer);
    signal(&first, "TERM");
    let unusable_for = current_through_another(&consumer, &[through_first_again]).await;
    eprintln!(
        "replicas current through the standby {unusable_for:?} after SIGTERM of the followed relay"
    );
    assert_eq!(consumer.metrics().relay_failovers, 3);
    drop(first);

    // Both gone: the DC's pools are unusable, never served stale.
    kill(second).await;
    let gone = consumer
        .wait_until(DEADLINE, |state, now| {
            state
                .pools(now)
                .iter()
                .all(|status| status.replica != ReplicaState::Current)
        })
        .await;
    assert!(gone, "{:?}", consumer.pools());
    consumer.shutdown().await;
}

/// A stopped relay keeps its connections open, so nothing resets them: the consumer
/// leaves it for the standby because it sent no load window for three of its windows
/// (the relay's default 1 s), not after the catalog deadline (set to a minute here, past
/// the test's wait), and counts it as a silence and a failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_followed_relay_is_left_for_the_standby_once_it_misses_its_load_windows() {
    let first = RelayProcess::start(&[], WORKLOAD, &[]).await;
    let second = RelayProcess::start(&[], WORKLOAD, &[]).await;
    let consumer = pair_consumer(&first, &second, StandbyMode::OnDemand);
    all_current(&consumer).await;
    let through_first = followed_incarnation(&consumer);

    signal(&first, "STOP");
    let unusable_for = current_through_another(&consumer, &[through_first]).await;
    eprintln!(
        "replicas current through the standby {unusable_for:?} after the followed relay stopped"
    );
    let metrics = consumer.metrics();
    assert_eq!((metrics.relay_silences, metrics.relay_failovers), (1, 1));
    let error = consumer.relays()[0].last_error.clone().unwrap_or_default();
    assert!(error.contains("sent no load window"), "{error}");

    // The stopped relay resumes: the consumer stays on the standby that works.
    signal(&first, "CONT");
    stays_on(&consumer, followed_incarnation(&consumer)).await;
    assert_eq!(consumer.metrics().relay_failovers, 1);
    consumer.shutdown().await;
    kill(first).await;
    kill(second).await;
}

/// With hot standbys both relays are followed all along and one is scored: SIGKILL of the
/// scored relay leaves every pool current through the other without a connection or a
/// snapshot (the replicas were there), the DC listed once; a scored relay that goes silent
/// (SIGSTOP) is switched away from, and the relays never swap back by themselves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hot_pair_switches_at_once_when_its_scored_relay_dies_or_goes_silent() {
    let first = RelayProcess::start(&[], WORKLOAD, &[]).await;
    let second = RelayProcess::start(&[], WORKLOAD, &[]).await;
    let consumer = pair_consumer(&first, &second, StandbyMode::Hot);
    all_current(&consumer).await;
    let standby_ready = consumer
        .wait_for_metrics(DEADLINE, |metrics| {
            metrics.standby_replicas_current == EXAMPLE_POOLS as u64
        })
        .await;
    assert!(standby_ready, "{:?}", consumer.metrics());
    let status = consumer.relays();
    assert_eq!(status.len(), 1, "one DC");
    assert_eq!(status[0].standbys.len(), 1);
    assert!(status[0].standbys[0].followed);
    assert_eq!(status[0].standbys[0].reachable, Some(true));
    // Whichever relay answered first is scored (a start, not a failover).
    assert_eq!(consumer.metrics().relay_failovers, 0);
    let (scored, standby) = if status[0].addr == first.wan.to_string() {
        (first, second)
    } else {
        (second, first)
    };
    let through_scored = followed_incarnation(&consumer);
    let connects = consumer.metrics().relay_connects;
    let scored_wan = scored.wan;

    // SIGKILL of the scored relay: the standby's replicas are scored as soon as the
    // connection's end is seen, with no new connection (and in microseconds: no
    // snapshot could be installed that fast).
    kill(scored).await;
    let unusable_for = current_through_another(&consumer, &[through_scored]).await;
    eprintln!("replicas current through the hot standby {unusable_for:?} after the kill");
    let metrics = consumer.metrics();
    assert_eq!(metrics.relay_failovers, 1);
    assert_eq!(
        metrics.relay_connects, connects,
        "no connection to take over"
    );
    assert_eq!(consumer.relays()[0].addr, standby.wan.to_string());
    let through_standby = followed_incarnation(&consumer);

    // The killed relay comes back (a new incarnation, followed again, not scored).
    let restarted = RelayProcess::start_on(scored_wan, WORKLOAD).await;
    let standby_back = consumer
        .wait_for_metrics(DEADLINE, |metrics| {
            metrics.standby_replicas_current == EXAMPLE_POOLS as u64
        })
        .await;
    assert!(standby_back, "{:?}", consumer.relays());
    stays_on(&consumer, through_standby).await;

    // The scored relay stops (its sockets stay open): silence switches to the other.
    signal(&standby, "STOP");
    current_through_another(&consumer, &[through_scored, through_standby]).await;
    let metrics = consumer.metrics();
    assert_eq!((metrics.relay_silences, metrics.relay_failovers), (1, 2));
    let through_restarted = followed_incarnation(&consumer);
    signal(&standby, "CONT");
    stays_on(&consumer, through_restarted).await;
    consumer.shutdown().await;
    kill(restarted).await;
    kill(standby).await;
}
