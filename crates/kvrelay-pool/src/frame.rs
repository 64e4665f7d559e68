//! Pool frames are encoded by the codec's [`PoolFrameEncoder`] (one header rule for every
//! door and test relay); this module converts the wire identities once per hub and stamps
//! each frame with the wall clock.

use std::time::{SystemTime, UNIX_EPOCH};

use kvrelay_codec::session::PoolFrameEncoder;
use kvrelay_identity::{DcRelayIdentity, ProducerIdentity};

/// The encoder of `producer`'s frames, published by `relay`.
pub(crate) fn encoder(
    relay: DcRelayIdentity,
    producer: &ProducerIdentity,
    limits: kvrelay_codec::Limits,
) -> PoolFrameEncoder {
    PoolFrameEncoder::new(relay.into(), (*producer).into(), limits)
}

/// Now, in microseconds since the Unix epoch (a frame's `sent_unix_us`); 0 before it.
pub(crate) fn sent_now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
