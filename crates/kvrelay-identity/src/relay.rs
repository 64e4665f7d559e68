//! [`DcRelayIdentity`]: who a relay process is, across restarts.

use serde::{Deserialize, Serialize};

/// Mask applied to a relay incarnation: the low 63 bits (the value fits an `i64`).
pub const RELAY_INCARNATION_MASK: u64 = i64::MAX as u64;

/// Why a relay identity was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DcRelayIdentityError {
    /// The incarnation has its top bit set.
    #[error("relay incarnation {incarnation} exceeds 63 bits")]
    IncarnationOutOfRange {
        /// The incarnation given.
        incarnation: u64,
    },
}

/// A relay's identity: the runtime's discovery connection id (stable across an
/// in-process restart) and a fresh random incarnation per start (63 bits), which fences
/// producer generations across relay lifetimes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawDcRelayIdentity")]
pub struct DcRelayIdentity {
    drt_instance_id: u64,
    relay_incarnation: u64,
}

impl DcRelayIdentity {
    /// Builds the identity from a random value drawn by the caller (this crate has no RNG);
    /// the value is masked to 63 bits.
    ///
    /// ```
    /// use kvrelay_identity::DcRelayIdentity;
    /// let relay = DcRelayIdentity::new(7, u64::MAX);
    /// assert_eq!(relay.relay_incarnation(), i64::MAX as u64);
    /// ```
    pub const fn new(drt_instance_id: u64, random: u64) -> Self {
        Self {
            drt_instance_id,
            relay_incarnation: random & RELAY_INCARNATION_MASK,
        }
    }

    /// Validates an identity received from elsewhere: the incarnation must fit 63 bits.
    pub const fn from_parts(
        drt_instance_id: u64,
        relay_incarnation: u64,
    ) -> Result<Self, DcRelayIdentityError> {
        if relay_incarnation & !RELAY_INCARNATION_MASK != 0 {
            return Err(DcRelayIdentityError::IncarnationOutOfRange {
                incarnation: relay_incarnation,
            });
        }
        Ok(Self {
            drt_instance_id,
            relay_incarnation,
        })
    }

    /// The runtime's discovery connection id.
    pub const fn drt_instance_id(&self) -> u64 {
        self.drt_instance_id
    }

    /// The per-start incarnation (63 bits).
    pub const fn relay_incarnation(&self) -> u64 {
        self.relay_incarnation
    }
}

/// The unvalidated serde shape of [`DcRelayIdentity`].
#[derive(Deserialize)]
struct RawDcRelayIdentity {
    drt_instance_id: u64,
    relay_incarnation: u64,
}

impl TryFrom<RawDcRelayIdentity> for DcRelayIdentity {
    type Error = DcRelayIdentityError;

    fn try_from(raw: RawDcRelayIdentity) -> Result<Self, Self::Error> {
        Self::from_parts(raw.drt_instance_id, raw.relay_incarnation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incarnation_is_masked_to_63_bits() {
        let relay = DcRelayIdentity::new(3, u64::MAX);
        assert_eq!(relay.relay_incarnation(), (1 << 63) - 1);
        assert_eq!(relay.drt_instance_id(), 3);
        assert_eq!(DcRelayIdentity::new(3, 1 << 63).relay_incarnation(), 0);
    }

    #[test]
    fn from_parts_rejects_the_top_bit() {
        assert_eq!(
            DcRelayIdentity::from_parts(3, 1 << 63),
            Err(DcRelayIdentityError::IncarnationOutOfRange {
                incarnation: 1 << 63
            })
        );
        assert!(DcRelayIdentity::from_parts(3, 5).is_ok());
    }

    #[test]
    fn deserialising_rejects_a_64_bit_incarnation() {
        let json = r#"{"drt_instance_id":1,"relay_incarnation":18446744073709551615}"#;
        assert!(serde_json::from_str::<DcRelayIdentity>(json).is_err());
    }
}
