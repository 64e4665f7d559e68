//! Admission control: independent fail-fast limits per stream type, a global pool-stream
//! limit and a per-pool subscriber limit. (The connection limits at accept, total and per
//! peer address, are `kvrelay_http::ConnectionAdmission`, shared with the HTTP listeners.)
//!
//! Admission never waits: a request over a limit is rejected at once with a resource-limit
//! error, so a flood of clients cannot queue behind each other. A [`StreamPermit`] holds its
//! slots until it is dropped, which is when the connection ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

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
    /// The pool already has its maximum number of subscribers.
    #[error("pool subscriber limit {limit} reached")]
    PoolSubscriberLimit {
        /// The configured limit.
        limit: u32,
    },
}

impl AdmissionError {
    /// The metrics `scope` label: `total` or `per_pool`.
    pub fn scope(&self) -> &'static str {
        match self {
            Self::StreamLimit { .. } => "total",
            Self::PoolSubscriberLimit { .. } => "per_pool",
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
    // Keyed by pools that passed catalog lookup, so bounded by the catalog's size; the lock is
    // never held across an await.
    per_pool: Mutex<HashMap<Vec<u8>, u32>>,
    /// Bumped after every released permit, for waiters on stream counts.
    released: watch::Sender<u64>,
}

/// Slots held by one admitted stream; released on drop.
#[derive(Debug)]
pub(crate) struct StreamPermit {
    _permit: OwnedSemaphorePermit,
    _pool_slot: Option<PoolSlot>,
    // Declared last: dropped after the slots above are returned.
    _release: ReleaseSignal,
}

#[derive(Debug)]
struct ReleaseSignal {
    admission: Arc<AdmissionInner>,
}

impl Drop for ReleaseSignal {
    fn drop(&mut self) {
        self.admission
            .released
            .send_modify(|count| *count = count.wrapping_add(1));
    }
}

#[derive(Debug)]
struct PoolSlot {
    admission: Arc<AdmissionInner>,
    pool_key: Vec<u8>,
}

impl Drop for PoolSlot {
    fn drop(&mut self) {
        let mut map = self
            .admission
            .per_pool
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = map.get_mut(&self.pool_key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                map.remove(&self.pool_key);
            }
        }
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
                per_pool: Mutex::new(HashMap::new()),
                released: watch::Sender::new(0),
            }),
        }
    }

    /// Admits one stream of `kind` that is not a pool subscription, or refuses it at once.
    pub(crate) fn admit(&self, kind: StreamKind) -> Result<StreamPermit, AdmissionError> {
        let permit = self.take(kind)?;
        Ok(StreamPermit {
            _permit: permit,
            _pool_slot: None,
            _release: self.release_signal(),
        })
    }

    /// Admits one subscription to the pool named by `pool_key` (any stable byte encoding of
    /// its id): first the total pool-stream limit, then the per-pool limit.
    pub(crate) fn admit_pool(&self, pool_key: &[u8]) -> Result<StreamPermit, AdmissionError> {
        let permit = self.take(StreamKind::Pool)?;
        let limit = self.inner.limits.max_subscribers_per_pool;
        {
            let mut map = self
                .inner
                .per_pool
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let count = map.entry(pool_key.to_vec()).or_insert(0);
            if *count >= limit {
                return Err(AdmissionError::PoolSubscriberLimit { limit });
            }
            *count += 1;
        }
        Ok(StreamPermit {
            _permit: permit,
            _pool_slot: Some(PoolSlot {
                admission: self.inner.clone(),
                pool_key: pool_key.to_vec(),
            }),
            _release: self.release_signal(),
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

    #[test]
    fn stream_limit_rejects_only_its_own_kind() {
        let admission = admission(Limits {
            max_catalog_streams: 1,
            ..Limits::default()
        });
        let _held = admission.admit(StreamKind::Catalog).unwrap();
        assert_eq!(
            admission.admit(StreamKind::Catalog).unwrap_err(),
            AdmissionError::StreamLimit {
                kind: StreamKind::Catalog,
                limit: 1
            }
        );
        assert!(admission.admit(StreamKind::Load).is_ok());
    }

    #[test]
    fn dropping_a_permit_frees_its_slot() {
        let admission = admission(Limits {
            max_load_streams: 1,
            ..Limits::default()
        });
        let held = admission.admit(StreamKind::Load).unwrap();
        assert_eq!(admission.active(StreamKind::Load), 1);
        drop(held);
        assert_eq!(admission.active(StreamKind::Load), 0);
        assert!(admission.admit(StreamKind::Load).is_ok());
    }

    #[test]
    fn per_pool_limit_is_independent_per_pool() {
        let admission = admission(Limits {
            max_subscribers_per_pool: 1,
            ..Limits::default()
        });
        let _a = admission.admit_pool(b"a").unwrap();
        assert_eq!(
            admission.admit_pool(b"a").unwrap_err(),
            AdmissionError::PoolSubscriberLimit { limit: 1 }
        );
        assert!(admission.admit_pool(b"b").is_ok());
    }

    #[test]
    fn refused_pool_subscription_does_not_hold_a_total_slot() {
        let admission = admission(Limits {
            max_subscribers_per_pool: 1,
            max_pool_streams_total: 2,
            ..Limits::default()
        });
        let _a = admission.admit_pool(b"a").unwrap();
        assert!(admission.admit_pool(b"a").is_err());
        assert_eq!(admission.active(StreamKind::Pool), 1);
        let _b = admission.admit_pool(b"b").unwrap();
        assert_eq!(
            admission.admit_pool(b"c").unwrap_err(),
            AdmissionError::StreamLimit {
                kind: StreamKind::Pool,
                limit: 2
            }
        );
    }
}
