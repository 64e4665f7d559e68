//! What the WAN server serves: the views and pool publications the host provides.
//!
//! The WAN server never touches actors, hubs or discovery. It reads complete states from
//! `watch` channels (each value a complete message, ready to encode) and asks a
//! [`PoolPublisher`] for a pool's frame stream. The host implements both.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use kvrelay_codec::session::EncodedPoolFrame;
use kvrelay_codec::v1::{
    CatalogUpdate, ErrorReason, LoadWindow, ProducerIdentity, RelayInfo, TopologyUpdate,
};
use tokio::sync::watch;

/// A stream-ending failure with its wire reason; `message` is diagnostic only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct StreamFailure {
    pub(crate) reason: ErrorReason,
    pub(crate) message: String,
    /// For an admission refusal made below the WAN layer (the pool hub's subscriber
    /// limit), the `scope` label it is counted under.
    pub(crate) admission_scope: Option<&'static str>,
}

impl StreamFailure {
    pub(crate) fn new(reason: ErrorReason, message: impl Into<String>) -> Self {
        Self {
            reason,
            message: message.into(),
            admission_scope: None,
        }
    }

    /// Marks this failure as an admission refusal counted under `scope`.
    pub(crate) fn admission(mut self, scope: &'static str) -> Self {
        self.admission_scope = Some(scope);
        self
    }
}

/// A pool subscription: snapshot chunks, then contiguous deltas, with heartbeats in quiet
/// periods; ends with an error or `None` when the publication stops.
pub(crate) type PoolFrameStream = BoxStream<'static, Result<EncodedPoolFrame, StreamFailure>>;

/// Opens pool subscriptions for an exact producer identity.
pub(crate) trait PoolPublisher: Send + Sync + 'static {
    /// Subscribes to the pool whose current producer is `expected` (already checked against
    /// the catalog by the caller); the stream starts with a complete snapshot, or resumes
    /// from `options.resume_from` when the relay still holds what the client missed.
    fn subscribe(
        &self,
        expected: ProducerIdentity,
        subscriber: String,
        options: kvrelay_pool::SubscribeOptions,
    ) -> BoxFuture<'static, Result<PoolFrameStream, StreamFailure>>;
}

/// Everything the WAN server publishes.
#[derive(Clone)]
pub(crate) struct PublicationViews {
    pub(crate) info: RelayInfo,
    pub(crate) catalog: watch::Receiver<Arc<CatalogUpdate>>,
    pub(crate) load: watch::Receiver<Arc<LoadWindow>>,
    pub(crate) topology: watch::Receiver<Arc<TopologyUpdate>>,
    pub(crate) pools: Arc<dyn PoolPublisher>,
}
