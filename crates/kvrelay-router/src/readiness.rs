//! Whether the router can answer with every configured DC in view (`/readyz`).
//!
//! Pure: a function of the consumer's relay and pool views. Ready when every configured
//! relay has a catalog this epoch (not suspended) and every pool it admitted has a
//! current replica. Otherwise the reasons say which relay or pool is behind and why, at
//! most [`MAX_REASONS`] of them (then a count of the rest), so a large fleet's answer
//! stays small.

use kvrelay_consumer::{PoolStatus, RelayStatus, ReplicaState};
use serde::Serialize;

/// Reasons listed in one answer; the rest are counted.
pub const MAX_REASONS: usize = 32;

/// The `/readyz` answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RouterReadiness {
    /// Whether every relay and pool is current.
    pub ready: bool,
    /// Relays with a catalog this epoch, of those configured.
    pub relays_current: usize,
    /// Relays configured.
    pub relays: usize,
    /// Admitted pools with a current replica.
    pub pools_current: usize,
    /// Admitted pools of connected relays.
    pub pools: usize,
    /// Why not ready (empty when ready).
    pub reasons: Vec<String>,
}

/// What readiness needs of one admitted pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolState<'a> {
    /// Its DC.
    pub dc: &'a str,
    /// The pool id.
    pub pool: &'a str,
    /// Its replica's state.
    pub replica: ReplicaState,
}

impl<'a> From<&'a PoolStatus> for PoolState<'a> {
    fn from(status: &'a PoolStatus) -> Self {
        Self {
            dc: &status.dc,
            pool: &status.pool,
            replica: status.replica,
        }
    }
}

/// Assesses `relays` and `pools` (as `Consumer::relays` and `Consumer::pools` report).
pub fn assess<'a>(
    relays: &[RelayStatus],
    pools: impl IntoIterator<Item = PoolState<'a>>,
) -> RouterReadiness {
    let mut reasons = Vec::new();
    let mut relays_current = 0;
    for relay in relays {
        let why = if relay.suspended {
            Some("connection broken; pools not scored")
        } else if relay.catalog_revision.is_none() {
            Some("no catalog yet")
        } else {
            None
        };
        match why {
            None => relays_current += 1,
            Some(why) => reasons.push(match &relay.last_error {
                Some(error) => format!(
                    "relay {} ({}): {why} (last error: {error})",
                    relay.dc, relay.addr
                ),
                None => format!("relay {} ({}): {why}", relay.dc, relay.addr),
            }),
        }
    }
    let mut pools_current = 0;
    let mut n_pools = 0;
    for pool in pools {
        n_pools += 1;
        if pool.replica == ReplicaState::Current {
            pools_current += 1;
        } else {
            reasons.push(format!(
                "pool {} in {}: replica {}",
                pool.pool,
                pool.dc,
                pool.replica.as_str()
            ));
        }
    }
    if reasons.len() > MAX_REASONS {
        let more = reasons.len() - MAX_REASONS;
        reasons.truncate(MAX_REASONS);
        reasons.push(format!("... and {more} more"));
    }
    RouterReadiness {
        ready: reasons.is_empty(),
        relays_current,
        relays: relays.len(),
        pools_current,
        pools: n_pools,
        reasons,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relay(dc: &str, revision: Option<u64>, suspended: bool) -> RelayStatus {
        RelayStatus {
            dc: dc.to_owned(),
            addr: format!("127.0.0.1:{}", dc.len()),
            scored: true,
            catalog_revision: revision,
            incarnation: revision.map(|_| 1),
            suspended,
            admitted_pools: 1,
            quarantined_entries: 0,
            stalled_pools: 0,
            last_error: suspended.then(|| "connection reset".to_owned()),
            standbys: Vec::new(),
        }
    }

    fn pool<'a>(dc: &'a str, pool: &'a str, replica: ReplicaState) -> PoolState<'a> {
        PoolState { dc, pool, replica }
    }

    #[test]
    fn ready_only_when_every_relay_has_a_catalog_and_every_pool_is_current() {
        let relays = [relay("a", Some(3), false), relay("b", Some(1), false)];
        let pools = [pool("a", "p1", ReplicaState::Current)];
        let answer = assess(&relays, pools);
        assert!(answer.ready, "{answer:?}");
        assert_eq!((answer.relays_current, answer.pools_current), (2, 1));

        let pools = [
            pool("a", "p1", ReplicaState::Current),
            pool("b", "p2", ReplicaState::Assembling),
        ];
        let answer = assess(&relays, pools);
        assert!(!answer.ready);
        assert_eq!(answer.reasons, ["pool p2 in b: replica assembling"]);
    }

    #[test]
    fn a_relay_without_catalog_or_with_a_broken_connection_is_named() {
        let relays = [relay("a", None, false), relay("bb", Some(2), true)];
        let answer = assess(&relays, []);
        assert!(!answer.ready);
        assert_eq!(answer.relays_current, 0);
        assert_eq!(answer.reasons.len(), 2);
        assert!(answer.reasons[0].contains("relay a") && answer.reasons[0].contains("no catalog"));
        assert!(
            answer.reasons[1].contains("connection broken")
                && answer.reasons[1].contains("connection reset")
        );
    }

    #[test]
    fn no_relays_configured_is_vacuously_ready_and_reasons_are_capped() {
        assert!(assess(&[], []).ready);
        let relays = [relay("a", Some(1), false)];
        let names: Vec<String> = (0..MAX_REASONS + 5).map(|i| format!("p{i}")).collect();
        let answer = assess(
            &relays,
            names
                .iter()
                .map(|name| pool("a", name, ReplicaState::Missing)),
        );
        assert_eq!(answer.reasons.len(), MAX_REASONS + 1);
        assert_eq!(answer.reasons[MAX_REASONS], "... and 5 more");
        assert_eq!(answer.pools, MAX_REASONS + 5);
    }
}
