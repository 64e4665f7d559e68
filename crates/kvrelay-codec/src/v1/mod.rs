//! Protocol v1: the WAN wire types (serde + bincode 2) and their validation.
//!
//! These types are the wire format, versioned with the frame's protocol major version 1;
//! a major 2 would live beside them in a `v2` module. They are self-contained (no
//! identity-crate types), with explicit conversions from domain types in [`convert`].
//! Enumerations are `u32` codes ([`code`]) so unknown values can be quarantined.

pub mod body;
pub mod catalog;
pub mod code;
pub mod convert;
pub mod identity;
pub mod info;
pub mod load;
pub mod message;
pub mod pool_frame;
pub mod request;
pub mod topology;
pub mod validation;

pub use body::{DecodeError, EncodeError};
pub use catalog::{
    CatalogUpdate, MAX_TIER_LANES_PER_POOL, PoolCoverage, PoolDescriptor, TierLaneDescriptor,
};
pub use code::{
    CoverageState, ErrorReason, HashFormat, IdentitySource, PoolFrameKind, ReadinessState,
    WorkerRole,
};
pub use identity::{
    CkfFormat, DigestId, EndpointId, ModelRegistration, POOL_IDENTITY_VERSION, PoolId,
    ProducerIdentity, QuerySemantics, RelayIdentity,
};
pub use info::{ErrorMessage, RelayInfo};
pub use load::{LoadWindow, PoolLoad};
pub use message::{Message, decode_message, encode_message};
pub use pool_frame::{
    PoolFrame, PoolFrameError, PoolFrameHeader, PoolPayload, encode_chunk_frame,
    encode_delta_frame, encode_heartbeat_frame,
};
pub use request::{StreamRequest, StreamRpc};
pub use topology::{AdapterReadiness, TopologyEntry, TopologyMember, TopologyUpdate};
pub use validation::{CollectionCheck, EntryError, ValidationError};
