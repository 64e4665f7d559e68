//! [`ConnectionAdmission`]: at accept, before any byte is read, a total and a per-peer
//! connection limit, shared by every kvrelay listener (the relay's WAN and admin ports, the
//! router's API), so one host holding idle connections cannot take every slot.
//!
//! Admission never waits: a socket over a limit is refused at once (the total limit
//! first). A [`ConnectionPermit`] holds its slots until it is dropped, which is when the
//! connection ends.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use crate::accept::ConnectionOutcome;

/// Why an accepted socket was closed before it was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectionRefusal {
    /// `max_connections` sockets are open.
    #[error("connection limit {limit} reached")]
    Total {
        /// The configured limit.
        limit: u32,
    },
    /// This peer address already holds `max_connections_per_peer` sockets.
    #[error("per-peer connection limit {limit} reached")]
    PerPeer {
        /// The configured limit.
        limit: u32,
    },
}

impl ConnectionRefusal {
    /// The connection outcome of this refusal (its metric label is `rejected_limit` or
    /// `rejected_peer_limit`).
    pub fn outcome(&self) -> ConnectionOutcome {
        match self {
            Self::Total { .. } => ConnectionOutcome::RejectedLimit,
            Self::PerPeer { .. } => ConnectionOutcome::RejectedPeerLimit,
        }
    }
}

/// Accepted sockets, in total and per peer IP address.
///
/// The per-peer map only holds addresses with an open socket, so it never holds more than
/// `max_connections` entries, whatever the peers do.
#[derive(Debug, Clone)]
pub struct ConnectionAdmission {
    inner: Arc<ConnectionInner>,
}

#[derive(Debug)]
struct ConnectionInner {
    max_total: u32,
    max_per_peer: u32,
    // The lock is never held across an await.
    open: Mutex<OpenConnections>,
}

#[derive(Debug, Default)]
struct OpenConnections {
    total: u32,
    per_peer: HashMap<IpAddr, u32>,
}

/// One admitted socket; its slots are released on drop.
#[derive(Debug)]
pub struct ConnectionPermit {
    inner: Arc<ConnectionInner>,
    peer: IpAddr,
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        let mut open = self
            .inner
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        open.total = open.total.saturating_sub(1);
        if let Some(count) = open.per_peer.get_mut(&self.peer) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.per_peer.remove(&self.peer);
            }
        }
    }
}

impl ConnectionAdmission {
    /// At most `max_total` sockets, and at most `max_per_peer` from one peer address.
    pub fn new(max_total: u32, max_per_peer: u32) -> Self {
        Self {
            inner: Arc::new(ConnectionInner {
                max_total,
                max_per_peer,
                open: Mutex::new(OpenConnections::default()),
            }),
        }
    }

    /// Admits one socket from `peer`, or refuses it at once (the total limit first).
    pub fn admit(&self, peer: IpAddr) -> Result<ConnectionPermit, ConnectionRefusal> {
        let mut open = self
            .inner
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if open.total >= self.inner.max_total {
            return Err(ConnectionRefusal::Total {
                limit: self.inner.max_total,
            });
        }
        let from_peer = open.per_peer.get(&peer).copied().unwrap_or(0);
        if from_peer >= self.inner.max_per_peer {
            return Err(ConnectionRefusal::PerPeer {
                limit: self.inner.max_per_peer,
            });
        }
        open.total += 1;
        open.per_peer.insert(peer, from_peer + 1);
        Ok(ConnectionPermit {
            inner: self.inner.clone(),
            peer,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([127, 0, 0, last])
    }

    #[test]
    fn one_peer_cannot_take_every_connection_slot() {
        let admission = ConnectionAdmission::new(3, 2);
        let _a1 = admission.admit(ip(1)).unwrap();
        let a2 = admission.admit(ip(1)).unwrap();
        assert_eq!(
            admission.admit(ip(1)).unwrap_err(),
            ConnectionRefusal::PerPeer { limit: 2 }
        );
        let _b1 = admission.admit(ip(2)).unwrap();
        assert_eq!(
            admission.admit(ip(3)).unwrap_err(),
            ConnectionRefusal::Total { limit: 3 }
        );
        drop(a2);
        assert!(admission.admit(ip(1)).is_ok());
    }

    #[test]
    fn released_peers_leave_the_map() {
        let admission = ConnectionAdmission::new(1024, 128);
        let permits: Vec<_> = (0..10).map(|at| admission.admit(ip(at)).unwrap()).collect();
        drop(permits);
        let open = admission.inner.open.lock().unwrap();
        assert_eq!(open.total, 0);
        assert!(open.per_peer.is_empty());
    }
}
