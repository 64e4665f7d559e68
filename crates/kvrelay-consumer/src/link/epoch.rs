//! One connection epoch to a relay, sans-IO: what its catalog, load and topology streams
//! mean for the consumer's view of the relay, when the catalog is stale, when the relay is
//! silent, which pools to follow and which to stop following.
//!
//! [`EpochSession`] holds the epoch's state and applies what the relay says to the
//! [`ConsumerState`] it is handed (the tokio client hands it under its lock); the client
//! only opens streams, moves messages, runs pool subscriptions for the keys it is told and
//! counts and logs what it is told. Every input carries the caller's `now` (and a jitter
//! sample where a retry is scheduled), so the rules are tested on a simulated clock.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvrelay_codec::v1::{ErrorReason, Message, RelayIdentity};
use kvrelay_pacing::BackoffConfig;

use crate::Limits;
use crate::catalog::PoolKey;
use crate::state::{CatalogError, ConsumerState};

use super::{RelayLink, SideStream, SilenceWatch};

/// Why an epoch ends, as decided from what the relay sent (or did not send).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EpochFault {
    /// A catalog of another relay incarnation: the relay restarted.
    #[error("restarted: incarnation {previous:?} became {current:?}")]
    RelayRestart {
        /// The incarnation this epoch follows.
        previous: RelayIdentity,
        /// The one the catalog named.
        current: RelayIdentity,
    },
    /// The catalog broke the rules.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// The relay sent an error on the catalog stream.
    #[error("sent error {reason}: {message}")]
    Relay {
        /// The relay's reason.
        reason: ErrorReason,
        /// The relay's message.
        message: String,
    },
    /// A message the catalog stream never carries.
    #[error("sent an unexpected {kind} message on the catalog stream")]
    Unexpected {
        /// The message's kind.
        kind: &'static str,
    },
    /// No catalog within the catalog staleness bound.
    #[error("sent no catalog for {timeout:?}")]
    CatalogStale {
        /// The bound.
        timeout: Duration,
    },
    /// No load window for the silence bound; the DC's other relay is followed instead.
    #[error("sent no load window for {silent_for:?}: left for the DC's other relay")]
    Silent {
        /// How long it was silent.
        silent_for: Duration,
    },
    /// The relay withholds stalled pools; the DC's other relay is followed instead.
    #[error("withholds {stalled} stalled pool(s): left for the DC's other relay")]
    Stalled {
        /// How many pools it withholds.
        stalled: usize,
    },
}

/// What a catalog changed, for the driver to act on and count.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CatalogStep {
    /// Pools to start following (new ones, and on an epoch's first catalog the ones kept
    /// suspended from the previous epoch, which resume), in key order.
    pub subscribe: Vec<PoolKey>,
    /// Pools to stop following (they left the catalog or were quarantined), in key order.
    pub unsubscribe: Vec<PoolKey>,
    /// Entries newly quarantined by this catalog.
    pub newly_quarantined: usize,
    /// Of those, entries over the relay's replica budget.
    pub newly_over_budget: usize,
}

/// Why a side stream (load, topology) was lost on a message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SideLoss {
    /// The relay sent an error.
    #[error("relay sent error {reason}: {message}")]
    Relay {
        /// The relay's reason.
        reason: ErrorReason,
        /// The relay's message.
        message: String,
    },
    /// A message the stream never carries.
    #[error("unexpected {kind} message on the {stream} stream")]
    Unexpected {
        /// The message's kind.
        kind: &'static str,
        /// The stream.
        stream: &'static str,
    },
}

impl SideLoss {
    fn of(message: &Message, stream: &'static str) -> Self {
        match message {
            Message::Error(error) => SideLoss::Relay {
                reason: error.effective_reason(),
                message: error.message.clone(),
            },
            other => SideLoss::Unexpected {
                kind: other.kind().name(),
                stream,
            },
        }
    }
}

/// What a silence timeout did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SilenceStep {
    /// Nothing to do (not silent yet, or already marked).
    Nothing,
    /// The relay is marked silent and stays followed (a lone relay, or a move was made
    /// within the hold); its DC is scored through a hot standby meanwhile, if it has one.
    Marked,
}

/// One epoch of one relay (index `relay` in the consumer's relays).
#[derive(Debug)]
pub struct EpochSession {
    relay: usize,
    identity: RelayIdentity,
    catalog_bound: Duration,
    catalog_deadline: Instant,
    silence: SilenceWatch,
    marked_silent: bool,
    load: SideStream,
    topology: SideStream,
    subscribed: HashSet<PoolKey>,
}

impl EpochSession {
    /// An epoch of relay `relay`, which answered at `now` as `identity`; its catalog and
    /// load streams are being opened, its topology stream is opened at once.
    pub fn new(
        relay: usize,
        identity: RelayIdentity,
        limits: &Limits,
        backoff: BackoffConfig,
        now: Instant,
    ) -> Self {
        let mut load = SideStream::new(backoff, now);
        load.handle_opened(now);
        Self {
            relay,
            identity,
            catalog_bound: limits.catalog_staleness_bound,
            catalog_deadline: now + limits.catalog_staleness_bound,
            silence: SilenceWatch::new(limits),
            marked_silent: false,
            load,
            topology: SideStream::new(backoff, now),
            subscribed: HashSet::new(),
        }
    }

    /// The relay this epoch follows.
    pub fn identity(&self) -> RelayIdentity {
        self.identity
    }

    /// The epoch begins: what `state` kept of another incarnation (the relay restarted
    /// while we were away) is dropped; returns how many replicas that was.
    pub fn begin(&self, state: &mut ConsumerState) -> usize {
        if state
            .relay_identity(self.relay)
            .is_some_and(|kept| kept != self.identity)
        {
            return state.reset_relay(self.relay).len();
        }
        0
    }

    /// A catalog stream message arrived at `now`.
    pub fn handle_catalog(
        &mut self,
        now: Instant,
        message: &Message,
        state: &mut ConsumerState,
        link: &mut RelayLink,
    ) -> Result<CatalogStep, EpochFault> {
        // Re-armed by catalog frames only: frames of the load and topology streams must
        // not keep a silent catalog alive.
        self.catalog_deadline = now + self.catalog_bound;
        let update = match message {
            Message::CatalogUpdate(update) => update,
            Message::Error(error) => {
                return Err(EpochFault::Relay {
                    reason: error.effective_reason(),
                    message: error.message.clone(),
                });
            }
            other => {
                return Err(EpochFault::Unexpected {
                    kind: other.kind().name(),
                });
            }
        };
        if update.relay != self.identity {
            return Err(EpochFault::RelayRestart {
                previous: self.identity,
                current: update.relay,
            });
        }
        let change = state.apply_catalog(self.relay, update)?;
        if link.handle_stalled(now, update.stalled.len()) {
            return Err(EpochFault::Stalled {
                stalled: update.stalled.len(),
            });
        }
        let mut step = CatalogStep {
            newly_quarantined: change.newly_quarantined,
            newly_over_budget: change.newly_over_budget,
            ..CatalogStep::default()
        };
        for key in change.removed {
            if self.subscribed.remove(&key) {
                step.unsubscribe.push(key);
            }
        }
        for key in state.relay_keys(self.relay) {
            if self.subscribed.insert(key) {
                step.subscribe.push(key);
            }
        }
        // In key order, so the same catalogs give the same steps.
        step.subscribe.sort_unstable();
        step.unsubscribe.sort_unstable();
        Ok(step)
    }

    /// When the catalog is stale unless one arrives first.
    pub fn catalog_deadline(&self) -> Instant {
        self.catalog_deadline
    }

    /// The clock reached `now`: the epoch's end when the catalog is stale.
    pub fn handle_catalog_timeout(&self, now: Instant) -> Option<EpochFault> {
        (now >= self.catalog_deadline).then_some(EpochFault::CatalogStale {
            timeout: self.catalog_bound,
        })
    }

    /// A load stream message arrived at `now`; on `Err` the stream is lost (loads unknown,
    /// reopened after backoff) and the driver closes it.
    pub fn handle_load(
        &mut self,
        now: Instant,
        message: &Message,
        state: &mut ConsumerState,
        jitter: f64,
    ) -> Result<(), SideLoss> {
        let Message::LoadWindow(window) = message else {
            let loss = SideLoss::of(message, "load");
            self.handle_load_lost(now, state, jitter);
            return Err(loss);
        };
        self.silence.handle_window(now, window.window_ms);
        if self.marked_silent {
            self.marked_silent = false;
            state.set_silent(self.relay, false);
        }
        state.apply_load_window(self.relay, window);
        Ok(())
    }

    /// The load stream closed or failed at `now`: loads are unknown until it reopens, and
    /// silence is not known without windows (the catalog deadline still watches).
    pub fn handle_load_lost(&mut self, now: Instant, state: &mut ConsumerState, jitter: f64) {
        self.silence.disarm();
        if self.marked_silent {
            self.marked_silent = false;
            state.set_silent(self.relay, false);
        }
        state.clear_loads(self.relay);
        self.load.handle_lost(now, jitter);
    }

    /// The load stream's reopening: when (`poll_timeout`, `None` while it is open), and
    /// the driver reports it opened or failed to.
    pub fn load_stream(&mut self) -> &mut SideStream {
        &mut self.load
    }

    /// A topology stream message arrived at `now`: the number of entries that failed
    /// validation (their readiness is unknown), or the loss of the stream.
    pub fn handle_topology(
        &mut self,
        now: Instant,
        message: &Message,
        state: &mut ConsumerState,
        jitter: f64,
    ) -> Result<usize, SideLoss> {
        let Message::TopologyUpdate(update) = message else {
            let loss = SideLoss::of(message, "topology");
            self.handle_topology_lost(now, state, jitter);
            return Err(loss);
        };
        Ok(state.apply_topology(self.relay, update))
    }

    /// The topology stream closed or failed at `now`: readiness is unknown until it
    /// reopens.
    pub fn handle_topology_lost(&mut self, now: Instant, state: &mut ConsumerState, jitter: f64) {
        state.clear_topology(self.relay);
        self.topology.handle_lost(now, jitter);
    }

    /// The topology stream's (re)opening: when (`poll_timeout`: at once when the epoch
    /// starts, `None` while it is open), and the driver reports it opened or failed to.
    pub fn topology_stream(&mut self) -> &mut SideStream {
        &mut self.topology
    }

    /// When the relay is silent unless a load window arrives first.
    pub fn poll_silence(&self) -> Option<Instant> {
        self.silence.poll_timeout()
    }

    /// The silence watch fired at `now`: the epoch ends when the link leaves the relay;
    /// otherwise the relay is marked silent (and watched again from its next window).
    pub fn handle_silence_timeout(
        &mut self,
        now: Instant,
        state: &mut ConsumerState,
        link: &mut RelayLink,
    ) -> Result<SilenceStep, EpochFault> {
        let Some(silent_for) = self.silence.handle_timeout(now) else {
            return Ok(SilenceStep::Nothing);
        };
        if link.handle_silent(now) {
            return Err(EpochFault::Silent { silent_for });
        }
        self.silence.disarm();
        if self.marked_silent {
            return Ok(SilenceStep::Nothing);
        }
        self.marked_silent = true;
        state.set_silent(self.relay, true);
        Ok(SilenceStep::Marked)
    }
}
