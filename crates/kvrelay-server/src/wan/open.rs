//! Opening a stream: the one path from a checked [`StreamRequest`] to an admitted feed,
//! taken by both front doors (our WAN protocol and the Dynamo contract).
//!
//! Order matters and is the same for every door: a pool request is matched against the
//! advertised catalog first (a stale or unknown producer never takes a slot), then the
//! stream type's admission limits (the peer address's share, then the total), then the
//! pool hub's own subscription (with its per-pool subscriber limit, counted like the
//! WAN's own refusals).

use std::net::IpAddr;
use std::sync::Arc;

use kvrelay_codec::v1::{
    CatalogUpdate, ErrorReason, LoadWindow, ProducerIdentity, RelayInfo, StreamRequest, StreamRpc,
    TopologyUpdate,
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::admission::{Admission, StreamKind, StreamPermit};
use crate::metrics::{RejectionLabels, RelayMetrics};
use crate::wan::source::{PoolFrameStream, PublicationViews, StreamFailure};

/// What an admitted stream carries.
pub(crate) enum StreamFeed {
    Info(RelayInfo),
    Catalog(watch::Receiver<Arc<CatalogUpdate>>),
    Topology(watch::Receiver<Arc<TopologyUpdate>>),
    Load(watch::Receiver<Arc<LoadWindow>>),
    Pool(PoolFrameStream),
}

/// An admitted stream; its slot is held until `permit` drops.
pub(crate) struct OpenedStream {
    pub(crate) feed: StreamFeed,
    pub(crate) permit: StreamPermit,
}

/// Opens streams for every door of one relay.
#[derive(Clone)]
pub(crate) struct StreamOpener {
    pub(crate) views: PublicationViews,
    pub(crate) admission: Admission,
    pub(crate) metrics: Arc<RelayMetrics>,
}

impl StreamKind {
    /// The stream type a request opens.
    pub(crate) fn of(rpc: &StreamRpc) -> Self {
        match rpc {
            StreamRpc::RelayInfo => Self::Info,
            StreamRpc::WatchCatalog => Self::Catalog,
            StreamRpc::SubscribePool { .. } => Self::Pool,
            StreamRpc::WatchLoad => Self::Load,
            StreamRpc::WatchTopology => Self::Topology,
        }
    }
}

impl StreamOpener {
    /// Admits and opens `request` (already checked). `coalesce`: whether a pool subscriber
    /// takes deltas spanning several sequences (else it is cut off when it lags).
    pub(crate) async fn open(
        &self,
        request: StreamRequest,
        peer: IpAddr,
        coalesce: bool,
        cancel: &CancellationToken,
    ) -> Result<OpenedStream, StreamFailure> {
        let kind = StreamKind::of(&request.rpc);
        let mut pool = None;
        if let StreamRpc::SubscribePool {
            expected_producer, ..
        } = &request.rpc
        {
            self.check_producer(expected_producer)?;
            pool = Some(expected_producer.pool_id);
        }
        let permit = self.admission.admit(kind, pool, peer).map_err(|err| {
            self.count_refusal(kind, err.scope());
            StreamFailure::new(ErrorReason::ResourceLimit, err.to_string())
        })?;
        let feed = match request.rpc {
            StreamRpc::RelayInfo => StreamFeed::Info(self.views.info),
            StreamRpc::WatchCatalog => StreamFeed::Catalog(self.views.catalog.clone()),
            StreamRpc::WatchTopology => StreamFeed::Topology(self.views.topology.clone()),
            StreamRpc::WatchLoad => StreamFeed::Load(self.views.load.clone()),
            StreamRpc::SubscribePool {
                expected_producer,
                resume_from_sequence,
            } => {
                let options = kvrelay_pool::SubscribeOptions {
                    resume_from: resume_from_sequence,
                    coalesce,
                };
                let subscribe =
                    self.views
                        .pools
                        .subscribe(expected_producer, request.subscriber_id, options);
                let subscribed = tokio::select! {
                    () = cancel.cancelled() => {
                        return Err(StreamFailure::new(ErrorReason::PublicationUnavailable, "relay is shutting down"));
                    }
                    subscribed = subscribe => subscribed,
                };
                StreamFeed::Pool(subscribed.inspect_err(|failure| {
                    if let Some(scope) = failure.admission_scope {
                        self.count_refusal(kind, scope);
                    }
                })?)
            }
        };
        Ok(OpenedStream { feed, permit })
    }

    /// A pool request must name the producer generation the catalog advertises now.
    fn check_producer(&self, expected: &ProducerIdentity) -> Result<(), StreamFailure> {
        let catalog = self.views.catalog.borrow().clone();
        // A pool, or a lower-tier lane of one: both are subscribed to by producer.
        let pools = catalog.pools.iter().map(|pool| &pool.producer);
        let lanes = catalog.tier_lanes.iter().map(|lane| &lane.producer);
        let Some(current) = pools
            .chain(lanes)
            .find(|producer| producer.pool_id == expected.pool_id)
        else {
            return Err(StreamFailure::new(
                ErrorReason::PoolNotFound,
                format!("pool {} is not in the catalog", expected.pool_id),
            ));
        };
        if current != expected {
            return Err(StreamFailure::new(
                ErrorReason::ProducerChanged,
                format!(
                    "pool {}: expected producer generation {} incarnation {}, current is generation {} incarnation {}",
                    expected.pool_id,
                    expected.layout_generation,
                    expected.producer_incarnation,
                    current.layout_generation,
                    current.producer_incarnation
                ),
            ));
        }
        Ok(())
    }

    fn count_refusal(&self, kind: StreamKind, scope: &'static str) {
        self.metrics
            .admission_rejected
            .get_or_create(&RejectionLabels {
                stream: kind.label(),
                scope,
            })
            .inc();
    }
}
