//! [`DcId`]: the stable logical identity of a data center.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// The BLAKE3 domain tag hashed before an operator's dc-id text.
pub const DC_ID_TAG: &str = "dynamo/indexer-dc/v1";

/// A data center's stable logical identity.
///
/// It survives restarts, scaling and endpoint replacement; it is never derived from an
/// endpoint and never folded into a routing scope. Serialises as a bare number; `Display`
/// prints 16 zero-padded lowercase hex digits, which `FromStr` parses back.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct DcId(pub u64);

impl DcId {
    /// Derives the id from an operator's dc-id text (`--dc-id`), reference-compatibly:
    /// the first 8 bytes (little-endian) of BLAKE3(`dynamo/indexer-dc/v1` ‖ u32-LE length
    /// of the text ‖ text).
    ///
    /// Texts longer than `u32::MAX` bytes cannot be framed; their length is saturated,
    /// which no operator text reaches.
    ///
    /// ```
    /// use kvrelay_identity::DcId;
    /// let dc = DcId::from_dc_name("dc-a");
    /// assert_eq!(dc.as_u64(), 356084303347317832);
    /// assert_eq!(dc.to_string(), "04f110c98b1bfc48");
    /// ```
    pub fn from_dc_name(text: &str) -> Self {
        let mut hasher = blake3::Hasher::new();
        hasher.update(DC_ID_TAG.as_bytes());
        let len = u32::try_from(text.len()).unwrap_or(u32::MAX);
        hasher.update(&len.to_le_bytes());
        hasher.update(text.as_bytes());
        let digest = hasher.finalize();
        let mut first = [0u8; 8];
        first.copy_from_slice(&digest.as_bytes()[..8]);
        Self(u64::from_le_bytes(first))
    }

    /// The raw value.
    pub const fn as_u64(self) -> u64 {
        self.0
    }
}

impl fmt::Display for DcId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Debug for DcId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DcId({self})")
    }
}

/// Why text did not parse as a [`DcId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DcIdParseError {
    /// The text is not exactly 16 hex digits.
    #[error("dc id {text:?} is not 16 hex digits")]
    NotHex {
        /// The offending text.
        text: String,
    },
}

impl FromStr for DcId {
    type Err = DcIdParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let not_hex = || DcIdParseError::NotHex {
            text: text.to_owned(),
        };
        if text.len() != 16 || !text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
            return Err(not_hex());
        }
        u64::from_str_radix(text, 16)
            .map(Self)
            .map_err(|_| not_hex())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dc_a_matches_the_reference_value() {
        assert_eq!(DcId::from_dc_name("dc-a"), DcId(356_084_303_347_317_832));
    }

    #[test]
    fn dc_b_matches_the_reference_value() {
        assert_eq!(DcId::from_dc_name("dc-b"), DcId(12_108_926_959_882_871_670));
    }

    #[test]
    fn display_is_16_zero_padded_hex_digits() {
        assert_eq!(DcId(1).to_string(), "0000000000000001");
        assert_eq!(DcId::from_dc_name("dc-a").to_string(), "04f110c98b1bfc48");
    }

    #[test]
    fn display_parses_back() {
        let dc = DcId::from_dc_name("dc-b");
        assert_eq!(dc.to_string().parse::<DcId>(), Ok(dc));
    }

    #[test]
    fn parse_rejects_short_or_non_hex_text() {
        for text in [
            "",
            "1",
            "+000000000000001",
            "000000000000000g",
            "00000000000000001",
        ] {
            assert_eq!(
                text.parse::<DcId>(),
                Err(DcIdParseError::NotHex {
                    text: text.to_owned()
                })
            );
        }
    }

    #[test]
    fn serialises_as_a_bare_number() {
        assert_eq!(serde_json::to_string(&DcId(42)).unwrap(), "42");
        assert_eq!(serde_json::from_str::<DcId>("42").unwrap(), DcId(42));
    }
}
