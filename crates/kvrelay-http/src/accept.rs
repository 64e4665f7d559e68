//! Accepting sockets without spinning: [`AcceptBackoff`] for every kvrelay listener.
//!
//! `accept` fails without a connection to show for it when the process or the system is out
//! of file descriptors (EMFILE, ENFILE) or memory (ENOBUFS, ENOMEM). Retrying at once spins a
//! core while the condition lasts, so the listener sleeps, doubling from
//! [`ACCEPT_BACKOFF_MIN`] to [`ACCEPT_BACKOFF_MAX`], and says so at warn (rate-limited).
//! Other errors (a peer that reset before accept) are per-connection: retried at once.
//! Every failure is reported to the listener's [`ListenerEvents`], which counts it (the relay
//! in `kvrelay_accept_errors_total{listener, kind}`).

use std::io;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use kvrelay_pacing::{Backoff, BackoffConfig, LogBudget, NO_JITTER};

/// First sleep after a resource-exhaustion accept error.
pub const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest sleep between accept attempts while resources stay exhausted.
pub const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// What an accept error means for the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptErrorKind {
    /// Out of descriptors or memory: back off before the next attempt.
    ResourceExhausted,
    /// A per-connection failure: accept again at once.
    Transient,
}

impl AcceptErrorKind {
    /// The metric label: `fd_limit` (descriptors or memory exhausted) or `other`.
    pub fn label(self) -> &'static str {
        match self {
            Self::ResourceExhausted => "fd_limit",
            Self::Transient => "other",
        }
    }
}

/// What happened to one accepted (or refused) connection of an HTTP listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConnectionOutcome {
    /// Admitted under the connection cap.
    Accepted,
    /// Closed at accept: the connection cap was reached.
    RejectedLimit,
    /// Closed at accept: the peer address already holds its share of connections.
    RejectedPeerLimit,
    /// Closed because a request head did not arrive within the header-read timeout
    /// (a slow head or an idle keep-alive).
    HeaderTimeout,
    /// Closed because the TLS handshake failed or did not finish within the header-read
    /// timeout.
    HandshakeFailed,
}

impl ConnectionOutcome {
    /// The metric label: `accepted`, `rejected_limit`, `rejected_peer_limit`,
    /// `header_timeout` or `handshake_failed`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Accepted => "accepted",
            Self::RejectedLimit => "rejected_limit",
            Self::RejectedPeerLimit => "rejected_peer_limit",
            Self::HeaderTimeout => "header_timeout",
            Self::HandshakeFailed => "handshake_failed",
        }
    }
}

/// Where a listener reports what it did, so the owner counts it in its own metrics.
pub trait ListenerEvents: Send + Sync + 'static {
    /// `accept` failed with an error of this kind.
    fn accept_error(&self, kind: AcceptErrorKind);
    /// A connection was accepted, refused or timed out (HTTP listeners only).
    fn connection(&self, outcome: ConnectionOutcome);
}

/// Classifies an accept error.
pub fn classify(err: &io::Error) -> AcceptErrorKind {
    // EMFILE 24, ENFILE 23, ENOBUFS 105, ENOMEM 12 on Linux; the raw codes differ elsewhere,
    // where only the std kinds below are recognised.
    #[cfg(target_os = "linux")]
    if matches!(err.raw_os_error(), Some(23 | 24 | 105 | 12)) {
        return AcceptErrorKind::ResourceExhausted;
    }
    if err.kind() == io::ErrorKind::OutOfMemory {
        return AcceptErrorKind::ResourceExhausted;
    }
    AcceptErrorKind::Transient
}

/// The backoff state of one accept loop.
#[derive(Debug)]
pub struct AcceptBackoff {
    listener: &'static str,
    backoff: Backoff,
    log_budget: LogBudget,
}

impl AcceptBackoff {
    /// The backoff of the listener named `listener` (`wan`, `admin`, `router`) in logs.
    pub fn new(listener: &'static str) -> Self {
        Self {
            listener,
            backoff: Backoff::new(BackoffConfig {
                initial: ACCEPT_BACKOFF_MIN,
                max: ACCEPT_BACKOFF_MAX,
                // Only an accepted socket resets the backoff (see `accepted`).
                healthy_reset: Duration::MAX,
            }),
            log_budget: LogBudget::default(),
        }
    }

    /// A socket was accepted: the next exhaustion starts from the shortest sleep again.
    pub fn accepted(&mut self) {
        self.backoff.reset();
    }

    /// Reports `err` to `events` and logs it; returns how long to sleep before accepting
    /// again (zero for a transient error).
    pub fn failed(&mut self, err: &io::Error, events: &dyn ListenerEvents) -> Duration {
        let kind = classify(err);
        events.accept_error(kind);
        match kind {
            AcceptErrorKind::Transient => {
                debug!(listener = self.listener, error = %err, "accept failed");
                Duration::ZERO
            }
            AcceptErrorKind::ResourceExhausted => {
                // Exact doubling: the sleep only paces one local loop, nothing to spread.
                let sleep = self.backoff.on_failure(Duration::ZERO, NO_JITTER);
                if let Some(suppressed) = self.log_budget.admit(Instant::now()) {
                    warn!(
                        listener = self.listener,
                        error = %err,
                        backoff_ms = sleep.as_millis() as u64,
                        suppressed,
                        "accept failed: out of file descriptors or memory; backing off"
                    );
                }
                sleep
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// Records every reported accept error.
    #[derive(Default)]
    struct Recorded(Mutex<Vec<AcceptErrorKind>>);

    impl ListenerEvents for Recorded {
        fn accept_error(&self, kind: AcceptErrorKind) {
            self.0
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(kind);
        }
        fn connection(&self, _outcome: ConnectionOutcome) {}
    }

    #[test]
    fn descriptor_exhaustion_backs_off_and_doubles_up_to_the_cap() {
        let metrics = Recorded::default();
        let mut backoff = AcceptBackoff::new("wan");
        let emfile = io::Error::from_raw_os_error(24);
        let mut sleeps = Vec::new();
        for _ in 0..10 {
            sleeps.push(backoff.failed(&emfile, &metrics));
        }
        assert_eq!(sleeps[0], ACCEPT_BACKOFF_MIN);
        assert_eq!(sleeps[1], ACCEPT_BACKOFF_MIN * 2);
        assert_eq!(sleeps[9], ACCEPT_BACKOFF_MAX);
        backoff.accepted();
        assert_eq!(backoff.failed(&emfile, &metrics), ACCEPT_BACKOFF_MIN);
        let recorded = metrics
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        assert_eq!(recorded.len(), 11);
        assert!(recorded.iter().all(|kind| kind.label() == "fd_limit"));
    }

    #[test]
    fn a_reset_before_accept_is_retried_at_once() {
        let metrics = Recorded::default();
        let mut backoff = AcceptBackoff::new("admin");
        let reset = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(backoff.failed(&reset, &metrics), Duration::ZERO);
        let recorded = metrics
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        assert_eq!(recorded.as_slice(), [AcceptErrorKind::Transient]);
    }
}
