//! What an embedder that brings its own events submits to a running relay.

use kvrelay_ckf::SourceId;

use super::{Relay, RelayError};

impl Relay {
    /// Submits one event of a connected source to its pool actor (for embedders and
    /// benchmarks that bring their own event source). Waits for mailbox room.
    pub async fn submit(&self, event: kvrelay_ckf::RouterEvent) -> Result<(), RelayError> {
        let source_id = event.source;
        let submitted = self.actor_of(source_id)?.submit(event).await;
        submitted.map_err(|err| submit_error(source_id, &err))
    }

    /// The actor of the pool `source_id` feeds now.
    fn actor_of(&self, source_id: SourceId) -> Result<kvrelay_pool::PoolActorHandle, RelayError> {
        let route = self.state.routes.borrow().routes.get(&source_id).cloned();
        route
            .map(|route| route.actor)
            .ok_or(RelayError::UnknownSource { source_id })
    }

    /// [`Relay::submit`] for a lower-tier event, in order with the source's device events
    /// (an offload resolves against the device blocks of that moment).
    pub async fn submit_tier(&self, event: kvrelay_ckf::TierEvent) -> Result<(), RelayError> {
        let source_id = event.source;
        let submitted = self.actor_of(source_id)?.submit_tier(event).await;
        submitted.map_err(|err| submit_error(source_id, &err))
    }
}

/// A submission refused by the pool's actor.
fn submit_error(source_id: SourceId, err: &kvrelay_pool::ActorError) -> RelayError {
    RelayError::Submit {
        source_id,
        message: err.to_string(),
    }
}
