//! Admission control: independent fail-fast limits per stream type, the pool streams
//! included (the per-pool subscriber limit is the publication stream's own,
//! `max_subscribers_per_pool`, refused by the pool's hub), and each peer address's share
//! of every one of them (`max_streams_per_peer`: streams of one type, for pool streams of
//! one pool), so one host cannot take the slots every honest subscriber needs. (The
//! connection limits at accept, total and per peer address, are
//! `kvrelay_http::ConnectionAdmission`, shared with the HTTP listeners.)
//!
//! Admission never waits: a request over a limit is rejected at once with a resource-limit
//! error, so a flood of clients cannot queue behind each other. A [`StreamPermit`] holds its
//! slots until it is dropped, which is when the connection ends.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};

use kvrelay_codec::v1::PoolId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, watch};

use crate::limits::Limits;

/// The stream types of the WAN protocol, for admission and metrics labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// `RelayInfo`.
    Info,
    /// `WatchCatalog`.
    Catalog,
    /// `SubscribePool`.
    Pool,
    /// `WatchLoad`.
    Load,
    /// `WatchTopology`.
    Topology,
}

impl StreamKind {
    /// Every kind, for metric initialisation.
    pub const ALL: [StreamKind; 5] = [
        Self::Info,
        Self::Catalog,
        Self::Pool,
        Self::Load,
        Self::Topology,
    ];

    /// The metrics label of this kind.
    pub fn label(self) -> &'static str {
        match self {
            Self::Info => "info",
            Self::Catalog => "catalog",
            Self::Pool => "pool",
            Self::Load => "load",
            Self::Topology => "topology",
        }
    }
}

/// Which limit refused a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdmissionError {
    /// The per-type limit (for pools: the total across pools) is reached.
    #[error("{} stream limit {limit} reached", kind.label())]
    StreamLimit {
        /// The stream type.
        kind: StreamKind,
        /// The configured limit.
        limit: u32,
    },
    /// The peer address already holds `limit` streams of this type (for pool streams: of
    /// this pool).
    #[error("{} stream limit per peer address ({limit}) reached", kind.label())]
    PeerLimit {
        /// The stream type.
        kind: StreamKind,
        /// The configured per-peer limit.
        limit: u32,
    },
}

impl AdmissionError {
    /// The metrics `scope` label: `total` or `per_peer` (`per_pool` is counted when the
    /// pool's hub refuses a subscriber).
    pub fn scope(&self) -> &'static str {
        match self {
            Self::StreamLimit { .. } => "total",
            Self::PeerLimit { .. } => "per_peer",
        }
    }
}

/// The admission controller shared by every connection.
#[derive(Debug, Clone)]
pub(crate) struct Admission {
    inner: Arc<AdmissionInner>,
}

#[derive(Debug)]
struct AdmissionInner {
    info: Arc<Semaphore>,
    catalog: Arc<Semaphore>,
    pool: Arc<Semaphore>,
    load: Arc<Semaphore>,
    topology: Arc<Semaphore>,
    limits: Limits,
    /// Streams each peer address holds, per type (and pool); entries at zero are removed.
    per_peer: Mutex<HashMap<PeerSlot, u32>>,
    /// Bumped after every released permit, for waiters on stream counts.
    released: watch::Sender<u64>,
}

/// What a peer's share is counted against: a stream type, and for pool streams the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PeerSlot {
    peer: IpAddr,
    kind: StreamKind,
    pool: Option<PoolId>,
}

/// Slots held by one admitted stream; released on drop.
#[derive(Debug)]
pub(crate) struct StreamPermit {
    _permit: OwnedSemaphorePermit,
    _peer_share: PeerShare,
    // Declared last: dropped after the slots above are returned.
    _release: ReleaseSignal,
}

#[derive(Debug)]
struct ReleaseSignal {
    admission: Arc<AdmissionInner>,
}

/// One slot of a peer's share; returned on drop.
#[derive(Debug)]
struct PeerShare {
    admission: Arc<AdmissionInner>,
    slot: PeerSlot,
}

impl Drop for PeerShare {
    fn drop(&mut self) {
        let mut shares = self.admission.shares();
        if let Some(held) = shares.get_mut(&self.slot) {
            *held = held.saturating_sub(1);
            if *held == 0 {
                shares.remove(&self.slot);
            }
        }
    }
}

impl Drop for ReleaseSignal {
    fn drop(&mut self) {
        self.admission
            .released
            .send_modify(|count| *count = count.wrapping_add(1));
    }
}

impl Admission {
    /// A controller enforcing `limits`.
    pub(crate) fn new(limits: &Limits) -> Self {
        let permits = |n: u32| {
            Arc::new(Semaphore::new(
                usize::try_from(n).unwrap_or(Semaphore::MAX_PERMITS),
            ))
        };
        Self {
            inner: Arc::new(AdmissionInner {
                info: permits(limits.max_info_streams),
                catalog: permits(limits.max_catalog_streams),
                pool: permits(limits.max_pool_streams_total),
                load: permits(limits.max_load_streams),
                topology: permits(limits.max_topology_streams),
                limits: limits.clone(),
                per_peer: Mutex::new(HashMap::new()),
                released: watch::Sender::new(0),
            }),
        }
    }

    /// Admits one stream of `kind` from `peer` (for a pool stream, of `pool`), or refuses
    /// it at once. The peer's share is checked first, so a host over its share never takes
    /// one of the slots everyone shares.
    pub(crate) fn admit(
        &self,
        kind: StreamKind,
        pool: Option<PoolId>,
        peer: IpAddr,
    ) -> Result<StreamPermit, AdmissionError> {
        let share = self.take_share(PeerSlot { peer, kind, pool })?;
        let permit = self.take(kind)?;
        Ok(StreamPermit {
            _permit: permit,
            _peer_share: share,
            _release: self.release_signal(),
        })
    }

    /// Streams of `kind` (of `pool`) `peer` holds now.
    #[cfg(test)]
    fn held_by(&self, kind: StreamKind, pool: Option<PoolId>, peer: IpAddr) -> u32 {
        let slot = PeerSlot { peer, kind, pool };
        self.inner.shares().get(&slot).copied().unwrap_or(0)
    }

    fn take_share(&self, slot: PeerSlot) -> Result<PeerShare, AdmissionError> {
        let limit = self.inner.limits.max_streams_per_peer;
        let mut shares = self.inner.shares();
        let held = shares.entry(slot).or_insert(0);
        if *held >= limit {
            return Err(AdmissionError::PeerLimit {
                kind: slot.kind,
                limit,
            });
        }
        *held += 1;
        Ok(PeerShare {
            admission: self.inner.clone(),
            slot,
        })
    }

    /// Streams of `kind` currently admitted.
    pub(crate) fn active(&self, kind: StreamKind) -> u32 {
        let limit = self.inner.limit(kind);
        let available =
            u32::try_from(self.inner.semaphore(kind).available_permits()).unwrap_or(limit);
        limit.saturating_sub(available)
    }

    /// Waits until at most `at_most` streams of `kind` are open.
    pub(crate) async fn wait_for_at_most(&self, kind: StreamKind, at_most: u32) {
        let mut released = self.inner.released.subscribe();
        loop {
            if self.active(kind) <= at_most {
                return;
            }
            if released.changed().await.is_err() {
                return;
            }
        }
    }

    fn release_signal(&self) -> ReleaseSignal {
        ReleaseSignal {
            admission: self.inner.clone(),
        }
    }

    fn take(&self, kind: StreamKind) -> Result<OwnedSemaphorePermit, AdmissionError> {
        match self.inner.semaphore(kind).clone().try_acquire_owned() {
            Ok(permit) => Ok(permit),
            Err(TryAcquireError::NoPermits | TryAcquireError::Closed) => {
                Err(AdmissionError::StreamLimit {
                    kind,
                    limit: self.inner.limit(kind),
                })
            }
        }
    }
}

impl AdmissionInner {
    /// The share table; a panic elsewhere while it was held leaves counts that are still
    /// whole numbers, so a poisoned lock is used as is.
    fn shares(&self) -> std::sync::MutexGuard<'_, HashMap<PeerSlot, u32>> {
        self.per_peer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn semaphore(&self, kind: StreamKind) -> &Arc<Semaphore> {
        match kind {
            StreamKind::Info => &self.info,
            StreamKind::Catalog => &self.catalog,
            StreamKind::Pool => &self.pool,
            StreamKind::Load => &self.load,
            StreamKind::Topology => &self.topology,
        }
    }

    fn limit(&self, kind: StreamKind) -> u32 {
        match kind {
            StreamKind::Info => self.limits.max_info_streams,
            StreamKind::Catalog => self.limits.max_catalog_streams,
            StreamKind::Pool => self.limits.max_pool_streams_total,
            StreamKind::Load => self.limits.max_load_streams,
            StreamKind::Topology => self.limits.max_topology_streams,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(limits: Limits) -> Admission {
        Admission::new(&limits)
    }

    const HOST: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 1));
    const OTHER_HOST: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));

    fn pool(id: u8) -> Option<PoolId> {
        Some(PoolId {
            identity_version: kvrelay_codec::v1::POOL_IDENTITY_VERSION,
            cache_semantics: kvrelay_codec::v1::DigestId {
                digest: [id; 16],
                source: kvrelay_codec::v1::IdentitySource::Explicit,
            },
            routing_scope: kvrelay_codec::v1::DigestId {
                digest: [id; 16],
                source: kvrelay_codec::v1::IdentitySource::Explicit,
            },
            dc_id: 1,
        })
    }

    #[test]
    fn a_peer_holds_at_most_its_share_per_type_and_per_pool() {
        let admission = admission(Limits {
            max_streams_per_peer: 2,
            ..Limits::default()
        });
        let _a = admission.admit(StreamKind::Pool, pool(1), HOST).unwrap();
        let _b = admission.admit(StreamKind::Pool, pool(1), HOST).unwrap();
        assert_eq!(
            admission
                .admit(StreamKind::Pool, pool(1), HOST)
                .unwrap_err(),
            AdmissionError::PeerLimit {
                kind: StreamKind::Pool,
                limit: 2
            }
        );
        // Another pool, another type and another host each have their own share.
        assert!(admission.admit(StreamKind::Pool, pool(2), HOST).is_ok());
        assert!(admission.admit(StreamKind::Catalog, None, HOST).is_ok());
        assert!(
            admission
                .admit(StreamKind::Pool, pool(1), OTHER_HOST)
                .is_ok()
        );
    }

    #[test]
    fn a_refusal_by_share_takes_no_shared_slot_and_a_release_returns_the_share() {
        let admission = admission(Limits {
            max_streams_per_peer: 1,
            max_load_streams: 2,
            ..Limits::default()
        });
        let held = admission.admit(StreamKind::Load, None, HOST).unwrap();
        for _ in 0..10 {
            assert_eq!(
                admission
                    .admit(StreamKind::Load, None, HOST)
                    .unwrap_err()
                    .scope(),
                "per_peer"
            );
        }
        // The refused attempts left the shared slot free for another host.
        assert_eq!(admission.active(StreamKind::Load), 1);
        let _other = admission.admit(StreamKind::Load, None, OTHER_HOST).unwrap();
        drop(held);
        assert_eq!(admission.held_by(StreamKind::Load, None, HOST), 0);
        // A refusal by the total limit returns the share it took.
        let _third = admission.admit(StreamKind::Load, None, HOST).unwrap();
        let crowded = admission.admit(
            StreamKind::Load,
            None,
            IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 3)),
        );
        assert_eq!(crowded.unwrap_err().scope(), "total");
        assert_eq!(
            admission.held_by(
                StreamKind::Load,
                None,
                IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 3))
            ),
            0
        );
        assert!(
            admission.inner.shares().len() == 2,
            "entries at zero are removed"
        );
    }

    #[test]
    fn stream_limit_rejects_only_its_own_kind() {
        let admission = admission(Limits {
            max_catalog_streams: 1,
            ..Limits::default()
        });
        let _held = admission.admit(StreamKind::Catalog, None, HOST).unwrap();
        assert_eq!(
            admission
                .admit(StreamKind::Catalog, None, HOST)
                .unwrap_err(),
            AdmissionError::StreamLimit {
                kind: StreamKind::Catalog,
                limit: 1
            }
        );
        assert!(admission.admit(StreamKind::Load, None, HOST).is_ok());
    }

    #[test]
    fn pool_streams_are_bounded_in_total() {
        let admission = admission(Limits {
            max_pool_streams_total: 2,
            ..Limits::default()
        });
        let _a = admission.admit(StreamKind::Pool, pool(1), HOST).unwrap();
        let _b = admission.admit(StreamKind::Pool, pool(1), HOST).unwrap();
        assert_eq!(
            admission
                .admit(StreamKind::Pool, pool(1), HOST)
                .unwrap_err(),
            AdmissionError::StreamLimit {
                kind: StreamKind::Pool,
                limit: 2
            }
        );
    }

    #[test]
    fn dropping_a_permit_frees_its_slot() {
        let admission = admission(Limits {
            max_load_streams: 1,
            ..Limits::default()
        });
        let held = admission.admit(StreamKind::Load, None, HOST).unwrap();
        assert_eq!(admission.active(StreamKind::Load), 1);
        drop(held);
        assert_eq!(admission.active(StreamKind::Load), 0);
        assert!(admission.admit(StreamKind::Load, None, HOST).is_ok());
    }
}
