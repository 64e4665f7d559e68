//! One relay connection epoch on a simulated clock (`kvrelay_consumer::link::epoch`): what
//! the relay's catalog, load and topology streams do to the consumer's view, and when the
//! epoch ends, with no socket. The tokio client drives the same session.

use crate::support;

use std::time::{Duration, Instant};

use kvrelay_codec::v1::{
    CatalogUpdate, ErrorMessage, ErrorReason, LoadWindow, Message, PoolLoad, ReadinessState,
    RelayIdentity,
};
use kvrelay_consumer::link::RelayLink;
use kvrelay_consumer::link::epoch::{EpochFault, EpochSession, SideLoss, SilenceStep};
use kvrelay_consumer::{
    BackoffConfig, CandidateReadiness, ConsumerConfig, ConsumerState, Limits, RelayEndpoint,
};
use kvrelay_pacing::NO_JITTER;
use support::pair::{request, topology};
use support::{PoolSpec, Producer, catalog_of, relay_identity};

const BACKOFF: BackoffConfig =
    BackoffConfig::doubling(Duration::from_millis(500), Duration::from_secs(30));

struct Epoch {
    now: Instant,
    state: ConsumerState,
    link: RelayLink,
    session: EpochSession,
    relay: RelayIdentity,
    producers: Vec<Producer>,
    revision: u64,
    window: u64,
}

fn limits() -> Limits {
    Limits::default()
}

impl Epoch {
    /// An epoch of a relay of `addresses` relays (2: a pair) with pools `names`.
    fn new(addresses: usize, names: &[&'static str]) -> Self {
        let now = Instant::now();
        let relay = relay_identity(1);
        let mut config = ConsumerConfig::new(vec![RelayEndpoint::new("127.0.0.1:7400", "dc-0")]);
        config.backoff = BACKOFF;
        let state = ConsumerState::new(&config).unwrap();
        let limits = limits();
        let link = RelayLink::new(BACKOFF, limits.resume_hold, limits.failover_hold, addresses);
        let producers = names
            .iter()
            .map(|name| Producer::new(&PoolSpec::aggregated(name, "llama"), "dc-0", relay, 1))
            .collect();
        Self {
            now,
            state,
            link,
            session: EpochSession::new(0, relay, &limits, BACKOFF, now),
            relay,
            producers,
            revision: 0,
            window: 0,
        }
    }

    fn catalog(&mut self) -> CatalogUpdate {
        self.revision += 1;
        catalog_of(
            self.relay,
            self.revision,
            &self.producers.iter().collect::<Vec<_>>(),
        )
    }

    fn send_catalog(
        &mut self,
        update: CatalogUpdate,
    ) -> Result<kvrelay_consumer::link::epoch::CatalogStep, EpochFault> {
        let message = Message::CatalogUpdate(update);
        self.session
            .handle_catalog(self.now, &message, &mut self.state, &mut self.link)
    }

    fn window(&mut self, used: u64) -> Message {
        self.window += 1;
        Message::LoadWindow(LoadWindow {
            relay: self.relay,
            window_sequence: self.window,
            observed_unix_ms: 1,
            window_ms: 1000,
            pools: self
                .producers
                .iter()
                .map(|producer| PoolLoad {
                    producer: producer.descriptor.producer,
                    kv_used_blocks: Some(used),
                    total_kv_blocks: Some(100),
                    kv_observed_ranks: 1,
                    kv_capacity_ranks: 1,
                    kv_expected_ranks: 1,
                    authoritative: true,
                })
                .collect(),
        })
    }

    fn send_window(&mut self, used: u64) -> Result<(), SideLoss> {
        let window = self.window(used);
        self.session
            .handle_load(self.now, &window, &mut self.state, NO_JITTER)
    }

    fn load(&self) -> Option<f64> {
        let ranking = self.state.score(&request(vec![1; 8]), self.now).unwrap();
        ranking.candidates[0].load_fraction
    }

    fn readiness(&self) -> CandidateReadiness {
        let ranking = self.state.score(&request(vec![1; 8]), self.now).unwrap();
        ranking.candidates[0].readiness
    }

    fn advance(&mut self, by: Duration) {
        self.now += by;
    }
}

#[test]
fn catalog_churn_subscribes_new_pools_once_and_unsubscribes_the_ones_that_left() {
    let mut epoch = Epoch::new(1, &["alpha", "beta"]);
    let catalog = epoch.catalog();
    let first = epoch.send_catalog(catalog).unwrap();
    assert_eq!(first.subscribe.len(), 2);
    assert!(first.unsubscribe.is_empty());
    // The same pools again (a heartbeat re-send, a metadata change): nothing to do.
    let catalog = epoch.catalog();
    let again = epoch.send_catalog(catalog).unwrap();
    assert_eq!(again, Default::default());
    // beta leaves, gamma joins.
    let beta_producer = epoch.producers.remove(1);
    let beta = *first
        .subscribe
        .iter()
        .find(|key| epoch.state.producer(**key) == Some(beta_producer.descriptor.producer))
        .unwrap();
    epoch.producers.push(Producer::new(
        &PoolSpec::aggregated("gamma", "llama"),
        "dc-0",
        epoch.relay,
        1,
    ));
    let catalog = epoch.catalog();
    let churn = epoch.send_catalog(catalog).unwrap();
    assert_eq!(churn.unsubscribe, vec![beta]);
    assert_eq!(epoch.state.producer(beta), None);
    assert_ne!(
        beta_producer.descriptor.producer,
        epoch.producers[1].descriptor.producer
    );
    assert_eq!(churn.subscribe.len(), 1);
    assert_eq!(
        epoch.state.producer(churn.subscribe[0]),
        Some(epoch.producers[1].descriptor.producer),
        "gamma is followed"
    );
}

#[test]
fn a_catalog_of_another_incarnation_ends_the_epoch_as_a_restart() {
    let mut epoch = Epoch::new(1, &["alpha"]);
    let catalog = epoch.catalog();
    epoch.send_catalog(catalog).unwrap();
    let mut restarted = epoch.catalog();
    restarted.relay = relay_identity(2);
    let fault = epoch.send_catalog(restarted).unwrap_err();
    assert_eq!(
        fault,
        EpochFault::RelayRestart {
            previous: relay_identity(1),
            current: relay_identity(2)
        }
    );
}

#[test]
fn the_next_epoch_drops_what_was_kept_of_another_incarnation() {
    let mut epoch = Epoch::new(1, &["alpha", "beta"]);
    let catalog = epoch.catalog();
    epoch.send_catalog(catalog).unwrap();
    // Same incarnation: what was kept stays for resuming.
    assert_eq!(epoch.session.begin(&mut epoch.state), 0);
    assert_eq!(epoch.state.pools(epoch.now).len(), 2);
    // The relay answers as another incarnation: both kept pools are dropped.
    let next = EpochSession::new(0, relay_identity(2), &limits(), BACKOFF, epoch.now);
    assert_eq!(next.begin(&mut epoch.state), 2);
    assert!(epoch.state.pools(epoch.now).is_empty());
}

#[test]
fn a_catalog_that_breaks_the_rules_or_an_error_or_another_message_ends_the_epoch() {
    let mut epoch = Epoch::new(1, &["alpha"]);
    let catalog = epoch.catalog();
    epoch.send_catalog(catalog.clone()).unwrap();
    let mut older = catalog;
    older.revision = 0;
    assert!(matches!(
        epoch.send_catalog(older),
        Err(EpochFault::Catalog(_))
    ));
    let error = Message::Error(ErrorMessage::new(ErrorReason::Internal, "boom"));
    let fault = epoch
        .session
        .handle_catalog(epoch.now, &error, &mut epoch.state, &mut epoch.link)
        .unwrap_err();
    assert!(
        matches!(
            fault,
            EpochFault::Relay {
                reason: ErrorReason::Internal,
                ..
            }
        ),
        "{fault:?}"
    );
    let window = epoch.window(1);
    let fault = epoch
        .session
        .handle_catalog(epoch.now, &window, &mut epoch.state, &mut epoch.link)
        .unwrap_err();
    assert!(matches!(fault, EpochFault::Unexpected { .. }), "{fault:?}");
}

#[test]
fn only_catalogs_keep_the_catalog_fresh() {
    let mut epoch = Epoch::new(1, &["alpha"]);
    let bound = limits().catalog_staleness_bound;
    let catalog = epoch.catalog();
    epoch.send_catalog(catalog).unwrap();
    assert_eq!(epoch.session.catalog_deadline(), epoch.now + bound);
    // Load windows and topology flow, the catalog does not.
    for _ in 0..10 {
        epoch.advance(bound / 10);
        epoch.send_window(10).unwrap();
        let update = Message::TopologyUpdate(topology(epoch.relay, ReadinessState::Ready));
        epoch
            .session
            .handle_topology(epoch.now, &update, &mut epoch.state, NO_JITTER)
            .unwrap();
    }
    assert_eq!(
        epoch.session.handle_catalog_timeout(epoch.now),
        Some(EpochFault::CatalogStale { timeout: bound })
    );
    // A catalog re-arms it.
    let catalog = epoch.catalog();
    epoch.send_catalog(catalog).unwrap();
    assert_eq!(epoch.session.handle_catalog_timeout(epoch.now), None);
}

#[test]
fn a_lost_load_stream_makes_loads_unknown_and_reopens_after_backoff() {
    let mut epoch = Epoch::new(1, &["alpha"]);
    let catalog = epoch.catalog();
    epoch.send_catalog(catalog).unwrap();
    epoch.send_window(50).unwrap();
    assert_eq!(epoch.load(), Some(0.5));
    assert_eq!(epoch.session.load_stream().poll_timeout(), None, "open");
    // The relay sends a topology update on the load stream: the stream is lost.
    let wrong = Message::TopologyUpdate(topology(epoch.relay, ReadinessState::Ready));
    let loss = epoch
        .session
        .handle_load(epoch.now, &wrong, &mut epoch.state, NO_JITTER)
        .unwrap_err();
    assert!(
        matches!(loss, SideLoss::Unexpected { stream: "load", .. }),
        "{loss:?}"
    );
    assert_eq!(epoch.load(), None, "unknown, never stale");
    let reopen = epoch.session.load_stream().poll_timeout().unwrap();
    assert_eq!(reopen, epoch.now + BACKOFF.initial);
    // Reopening fails once: the next try backs off further.
    epoch.advance(BACKOFF.initial);
    epoch
        .session
        .load_stream()
        .handle_open_failed(epoch.now, NO_JITTER);
    let second = epoch.session.load_stream().poll_timeout().unwrap();
    assert!(
        second - epoch.now > BACKOFF.initial,
        "{:?}",
        second - epoch.now
    );
    epoch.now = second;
    epoch.session.load_stream().handle_opened(epoch.now);
    assert_eq!(epoch.session.load_stream().poll_timeout(), None);
    epoch.send_window(20).unwrap();
    assert_eq!(epoch.load(), Some(0.2));
    // The replicas were never touched.
    assert_eq!(epoch.state.pools(epoch.now).len(), 1);
}

#[test]
fn a_lost_topology_stream_makes_readiness_unknown_until_it_reopens() {
    let mut epoch = Epoch::new(1, &["alpha"]);
    let catalog = epoch.catalog();
    epoch.send_catalog(catalog).unwrap();
    assert_eq!(
        epoch.session.topology_stream().poll_timeout(),
        Some(epoch.now),
        "opened at once"
    );
    epoch.session.topology_stream().handle_opened(epoch.now);
    let ready = Message::TopologyUpdate(topology(epoch.relay, ReadinessState::Ready));
    assert_eq!(
        epoch
            .session
            .handle_topology(epoch.now, &ready, &mut epoch.state, NO_JITTER),
        Ok(0)
    );
    assert_eq!(epoch.readiness(), CandidateReadiness::Ready);
    epoch
        .session
        .handle_topology_lost(epoch.now, &mut epoch.state, NO_JITTER);
    assert_eq!(epoch.readiness(), CandidateReadiness::Unknown);
    assert_eq!(
        epoch.session.topology_stream().poll_timeout(),
        Some(epoch.now + BACKOFF.initial)
    );
}

#[test]
fn a_lone_silent_relay_is_marked_and_unmarked_and_a_pairs_is_left() {
    // Lone: marked silent, kept, and unmarked by its next window.
    let mut epoch = Epoch::new(1, &["alpha"]);
    let catalog = epoch.catalog();
    epoch.send_catalog(catalog).unwrap();
    epoch.send_window(10).unwrap();
    let at = epoch.session.poll_silence().unwrap();
    epoch.now = at;
    let step = epoch
        .session
        .handle_silence_timeout(epoch.now, &mut epoch.state, &mut epoch.link)
        .unwrap();
    assert_eq!(step, SilenceStep::Marked);
    assert_eq!(
        epoch.session.poll_silence(),
        None,
        "disarmed until the next window"
    );
    epoch.send_window(10).unwrap();
    assert!(epoch.session.poll_silence().is_some(), "watched again");

    // A pair's followed relay: the epoch ends, for the other relay.
    let mut pair = Epoch::new(2, &["alpha"]);
    let catalog = pair.catalog();
    pair.send_catalog(catalog).unwrap();
    pair.send_window(10).unwrap();
    pair.now = pair.session.poll_silence().unwrap();
    let fault = pair
        .session
        .handle_silence_timeout(pair.now, &mut pair.state, &mut pair.link)
        .unwrap_err();
    assert!(matches!(fault, EpochFault::Silent { .. }), "{fault:?}");
}

#[test]
fn a_pairs_relay_withholding_stalled_pools_is_left() {
    let mut epoch = Epoch::new(2, &["alpha", "beta"]);
    let mut catalog = epoch.catalog();
    let withheld = catalog.pools.pop().unwrap();
    catalog.stalled.push(withheld.producer.pool_id);
    let fault = epoch.send_catalog(catalog).unwrap_err();
    assert_eq!(fault, EpochFault::Stalled { stalled: 1 });
}
