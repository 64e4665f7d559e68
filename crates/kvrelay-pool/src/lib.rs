//! Pool registry, pool actor and publication hub lifecycle.

mod actor;
mod catalog;
mod error;
mod filter;
mod frame;
mod hub;
mod limits;
mod load;
mod registry;
mod subscription;

pub use actor::{ActorFault, FaultCategory, PoolActorHandle, PoolActorStats};
pub use catalog::{PoolCatalog, PoolDescriptor};
pub use error::{
    ActorError, AttachError, LimitsError, LoadCapacityError, PoolError, RegistrationError,
    SubscribeError, SubscriptionEnd,
};
pub use filter::FilterStats;
pub use limits::*;
pub use load::{
    LoadObservation, LoadObservationOutcome, MAX_DATA_PARALLEL_RANKS, PoolLoadSnapshot,
    PoolLoadState, WorkerCapacity,
};
pub use registry::{
    AttachRequest, PoolAttachment, PoolRegistry, RegistryConfig, RegistryStats, RetirementMode,
};
pub use subscription::{PoolFrame, PoolFrameKind, PoolSubscription};
