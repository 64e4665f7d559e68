//! Admission control: independent fail-fast limits per stream type, the pool streams
//! included (the per-pool subscriber limit is the publication stream's own,
//! `max_subscribers_per_pool`, refused by the pool's hub). (The connection limits at accept,
//! total and per peer address, are `kvrelay_http::ConnectionAdmission`, shared with the
//! HTTP listeners.)
//!
//! Admission never waits: a request over a limit is rejected at once with a resource-limit
//! error, so a flood of clients cannot queue behind each other. A [`StreamPermit`] holds its
//! slots until it is dropped, which is when the connection ends.

use std::sync::Arc;

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
}

impl AdmissionError {
    /// The metrics `scope` label: `total` (`per_pool` is counted when the pool's hub
    /// refuses a subscriber).
    pub fn scope(&self) -> &'static str {
        match self {
            Self::StreamLimit { .. } => "total",
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
    /// Bumped after every released permit, for waiters on stream counts.
    released: watch::Sender<u64>,
}

/// Slots held by one admitted stream; released on drop.
#[derive(Debug)]
pub(crate) struct StreamPermit {
    _permit: OwnedSemaphorePermit,
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
                released: watch::Sender::new(0),
            }),
        }
    }

    /// Admits one stream of `kind`, or refuses it at once.
    pub(crate) fn admit(&self, kind: StreamKind) -> Result<StreamPermit, AdmissionError> {
        let permit = self.take(kind)?;
        Ok(StreamPermit {
            _permit: permit,
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
    fn pool_streams_are_bounded_in_total() {
        let admission = admission(Limits {
            max_pool_streams_total: 2,
            ..Limits::default()
        });
        let _a = admission.admit(StreamKind::Pool).unwrap();
        let _b = admission.admit(StreamKind::Pool).unwrap();
        assert_eq!(
            admission.admit(StreamKind::Pool).unwrap_err(),
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
        let held = admission.admit(StreamKind::Load).unwrap();
        assert_eq!(admission.active(StreamKind::Load), 1);
        drop(held);
        assert_eq!(admission.active(StreamKind::Load), 0);
        assert!(admission.admit(StreamKind::Load).is_ok());
    }
}
