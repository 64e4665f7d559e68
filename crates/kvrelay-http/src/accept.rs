//! Accepting sockets without spinning: [`AcceptBackoff`] for the WAN and admin listeners.
//!
//! `accept` fails without a connection to show for it when the process or the system is out
//! of file descriptors (EMFILE, ENFILE) or memory (ENOBUFS, ENOMEM). Retrying at once spins a
//! core while the condition lasts, so the listener sleeps, doubling from
//! [`ACCEPT_BACKOFF_MIN`] to [`ACCEPT_BACKOFF_MAX`], and says so at warn (rate-limited).
//! Other errors (a peer that reset before accept) are per-connection: retried at once.
//! Every failure is counted in `kvrelay_accept_errors_total{listener, kind}`.

use std::io;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use crate::metrics::{AcceptErrorLabels, RelayMetrics};
use crate::throttle::LogThrottle;

/// First sleep after a resource-exhaustion accept error.
pub(crate) const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
/// Longest sleep between accept attempts while resources stay exhausted.
pub(crate) const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// What an accept error means for the loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AcceptErrorKind {
    /// Out of descriptors or memory: back off before the next attempt.
    ResourceExhausted,
    /// A per-connection failure: accept again at once.
    Transient,
}

/// Classifies an accept error.
pub(crate) fn classify(err: &io::Error) -> AcceptErrorKind {
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
pub(crate) struct AcceptBackoff {
    listener: &'static str,
    next: Duration,
    throttle: LogThrottle,
}

impl AcceptBackoff {
    /// The backoff of the listener named `listener` (`wan`, `admin`) in metrics and logs.
    pub(crate) fn new(listener: &'static str) -> Self {
        Self {
            listener,
            next: ACCEPT_BACKOFF_MIN,
            throttle: LogThrottle::default(),
        }
    }

    /// A socket was accepted: the next exhaustion starts from the shortest sleep again.
    pub(crate) fn accepted(&mut self) {
        self.next = ACCEPT_BACKOFF_MIN;
    }

    /// Counts and logs `err`; returns how long to sleep before accepting again (zero for a
    /// transient error).
    pub(crate) fn failed(&mut self, err: &io::Error, metrics: &RelayMetrics) -> Duration {
        let kind = classify(err);
        let label = match kind {
            AcceptErrorKind::ResourceExhausted => "fd_limit",
            AcceptErrorKind::Transient => "other",
        };
        metrics
            .accept_errors
            .get_or_create(&AcceptErrorLabels {
                listener: self.listener,
                kind: label,
            })
            .inc();
        match kind {
            AcceptErrorKind::Transient => {
                debug!(listener = self.listener, error = %err, "accept failed");
                Duration::ZERO
            }
            AcceptErrorKind::ResourceExhausted => {
                let sleep = self.next;
                self.next = (self.next * 2).min(ACCEPT_BACKOFF_MAX);
                if let Some(suppressed) = self.throttle.admit(Instant::now()) {
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
    use super::*;

    #[test]
    fn descriptor_exhaustion_backs_off_and_doubles_up_to_the_cap() {
        let metrics = RelayMetrics::new();
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
        let text = metrics.encode();
        assert!(
            text.contains("kvrelay_accept_errors_total{listener=\"wan\",kind=\"fd_limit\"} 11"),
            "{text}"
        );
    }

    #[test]
    fn a_reset_before_accept_is_retried_at_once() {
        let metrics = RelayMetrics::new();
        let mut backoff = AcceptBackoff::new("admin");
        let reset = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(backoff.failed(&reset, &metrics), Duration::ZERO);
    }
}
