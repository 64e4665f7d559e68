//! The WAN server's view of pool publications: subscriptions through the pool registry.

use futures::future::BoxFuture;
use futures::stream;
use kvrelay_codec::v1::{self, ErrorReason};
use kvrelay_pool::{PoolFrameKind, PoolRegistry, SubscribeError, SubscriptionEnd};

use kvrelay_codec::session::EncodedPoolFrame;

use crate::wan::source::{PoolFrameStream, PoolPublisher, StreamFailure};

pub(crate) struct RegistryPublisher {
    pub(crate) registry: PoolRegistry,
}

impl PoolPublisher for RegistryPublisher {
    fn subscribe(
        &self,
        expected: v1::ProducerIdentity,
        subscriber: String,
        options: kvrelay_pool::SubscribeOptions,
    ) -> BoxFuture<'static, Result<PoolFrameStream, StreamFailure>> {
        let registry = self.registry.clone();
        Box::pin(async move {
            // The catalog lookup already matched the wire identity; find the domain identity
            // whose wire form it is.
            let catalog = registry.catalog();
            let pools = catalog.pools().map(|pool| pool.producer);
            let lanes = catalog
                .pools()
                .flat_map(|pool| pool.tier_lanes.iter().map(|lane| lane.producer));
            let Some(identity) = pools
                .chain(lanes)
                .find(|producer| v1::ProducerIdentity::from(*producer) == expected)
            else {
                return Err(StreamFailure::new(
                    ErrorReason::ProducerChanged,
                    "producer is no longer current",
                ));
            };
            drop(catalog);
            let subscription = registry
                .subscribe_with(identity, options)
                .await
                .map_err(subscribe_failure)?;
            tracing::debug!(subscriber = %subscriber, generation = identity.layout_generation(), start = ?subscription.start(), "pool subscription opened");
            let frames = stream::unfold(Some(subscription), |state| async move {
                let mut subscription = state?;
                match subscription.next_frame().await {
                    Ok(frame) => {
                        let out = EncodedPoolFrame {
                            snapshot: frame.kind == PoolFrameKind::SnapshotChunk,
                            heartbeat: frame.kind == PoolFrameKind::Heartbeat,
                            frame: frame.bytes,
                        };
                        Some((Ok(out), Some(subscription)))
                    }
                    Err(end) => Some((Err(end_failure(end)), None)),
                }
            });
            Ok(Box::pin(frames) as PoolFrameStream)
        })
    }
}

/// The one place pool subscription errors become wire reasons.
fn subscribe_failure(err: SubscribeError) -> StreamFailure {
    let reason = match &err {
        SubscribeError::UnknownPool { .. } => ErrorReason::PoolNotFound,
        SubscribeError::ProducerMismatch { .. } => ErrorReason::ProducerChanged,
        SubscribeError::SubscriberLimit { .. }
        | SubscribeError::SnapshotLimit { .. }
        | SubscribeError::InitializedHubLimit { .. } => ErrorReason::ResourceLimit,
        _ => ErrorReason::PublicationUnavailable,
    };
    let failure = StreamFailure::new(reason, err.to_string());
    // The one per-pool subscriber limit is the publication stream's; counted like the
    // WAN's own admission refusals.
    match err {
        SubscribeError::SubscriberLimit { .. } => failure.admission("per_pool"),
        _ => failure,
    }
}

fn end_failure(end: SubscriptionEnd) -> StreamFailure {
    let reason = match &end {
        SubscriptionEnd::SubscriberLagged => ErrorReason::SubscriberLagged,
        SubscriptionEnd::SnapshotProgressTimeout { .. } => ErrorReason::SnapshotProgressTimeout,
        SubscriptionEnd::InvalidPublication { .. } => ErrorReason::InvalidPublication,
        SubscriptionEnd::Internal { .. } => ErrorReason::Internal,
        _ => ErrorReason::PublicationUnavailable,
    };
    StreamFailure::new(reason, end.to_string())
}
