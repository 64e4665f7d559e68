//! A relay pair's standby, checked while it is not needed: every
//! [`Limits::standby_probe_interval`](crate::Limits::standby_probe_interval) (the
//! [`StandbyProbe`] schedule decides when), each of a DC's addresses that is not followed
//! is asked for its relay info on a connection of its own, and the answer (or why there
//! was none) is kept for [`Consumer::relays`](crate::Consumer::relays) and the
//! `standbys_unreachable` gauge. Without it a dead standby is found only at the failover
//! that needed it. A relay the link just left for a failure counts as unreachable until a
//! probe hears from it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Shared;
use super::epoch::relay_info_at;
use crate::link::StandbyProbe;
use crate::metrics::Counter;
use crate::state::StandbyStatus;

/// The last check of one standby address.
#[derive(Debug, Clone)]
pub(super) struct StandbyRecord {
    at: Instant,
    /// The relay incarnation it reported, or why it did not answer.
    outcome: Result<u64, String>,
}

impl Shared {
    /// Keeps what was learnt of address `addr` of DC `relay` at `now`; logs only a change
    /// of reachability (a dead standby is probed every interval).
    pub(super) fn record_standby(
        &self,
        relay: usize,
        addr: usize,
        now: Instant,
        outcome: Result<u64, String>,
    ) {
        let dc = self.dc(relay);
        let peer = &self.endpoints[relay][addr].addr;
        let mut records = self.standbys.lock();
        let was_reachable = records[relay][addr]
            .as_ref()
            .map(|record| record.outcome.is_ok());
        match (&outcome, was_reachable) {
            (Err(error), None | Some(true)) => {
                warn!(dc = %dc, peer = %peer, error = %error, "standby relay unreachable: the DC has no working standby");
            }
            (Ok(incarnation), Some(false)) => {
                info!(dc = %dc, peer = %peer, incarnation, "standby relay answers again");
            }
            _ => {}
        }
        records[relay][addr] = Some(StandbyRecord { at: now, outcome });
    }

    /// DC `relay`'s addresses not followed now, with their last check.
    pub(super) fn standby_statuses(&self, relay: usize, now: Instant) -> Vec<StandbyStatus> {
        let active = self.active[relay].load(Ordering::Relaxed);
        let records = self.standbys.lock();
        self.endpoints[relay]
            .iter()
            .zip(&records[relay])
            .enumerate()
            .filter(|(addr, _)| *addr != active)
            .map(|(_, (endpoint, record))| StandbyStatus {
                addr: endpoint.addr.clone(),
                reachable: record.as_ref().map(|record| record.outcome.is_ok()),
                checked_ago: record
                    .as_ref()
                    .map(|record| now.saturating_duration_since(record.at)),
                incarnation: record
                    .as_ref()
                    .and_then(|record| record.outcome.as_ref().ok().copied()),
                error: record
                    .as_ref()
                    .and_then(|record| record.outcome.as_ref().err().cloned()),
                followed: false,
            })
            .collect()
    }
}

/// Probes DC `relay`'s standby addresses until `cancel`; returns at once for a lone relay
/// or with probing off.
pub(super) async fn run_standby_probe(
    shared: Arc<Shared>,
    relay: usize,
    cancel: CancellationToken,
) {
    let mut probe = StandbyProbe::new(
        shared.config.limits.standby_probe_interval,
        shared.endpoints[relay].len(),
        Instant::now(),
        rand::random::<f64>(),
    );
    while let Some(due) = probe.poll_timeout() {
        let due = tokio::time::Instant::from_std(due);
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            () = tokio::time::sleep_until(due) => {}
        }
        if !probe.handle_timeout(Instant::now(), rand::random::<f64>()) {
            continue;
        }
        let active = shared.active[relay].load(Ordering::Relaxed);
        for (addr, endpoint) in shared.endpoints[relay].iter().enumerate() {
            if addr == active {
                continue;
            }
            let answer = tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                answer = relay_info_at(&shared, endpoint) => answer,
            };
            let outcome = answer
                .map(|identity| identity.relay_incarnation)
                .map_err(|err| err.to_string());
            if outcome.is_err() {
                shared.metrics.incr(Counter::StandbyProbeFailures);
            }
            shared.record_standby(relay, addr, Instant::now(), outcome);
        }
        shared.bump();
    }
}
