//! [`WorkerRole`]: what a worker does in disaggregated serving.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A worker's serving role.
///
/// Ordered by declaration, so sorted role lists read prefill, decode, encode, aggregated,
/// legacy. Serialised snake_case. `Legacy` means the card named no worker type; it is not
/// the same as an unspecified or malformed wire value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerRole {
    /// Prefill worker.
    Prefill,
    /// Decode worker.
    Decode,
    /// Encode (multimodal encoder) worker.
    Encode,
    /// Aggregated prefill+decode worker.
    Aggregated,
    /// The card named no worker type.
    Legacy,
}

impl WorkerRole {
    /// Every role, in order.
    pub const ALL: [Self; 5] = [
        Self::Prefill,
        Self::Decode,
        Self::Encode,
        Self::Aggregated,
        Self::Legacy,
    ];

    /// The lowercase name (same as serde).
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Prefill => "prefill",
            Self::Decode => "decode",
            Self::Encode => "encode",
            Self::Aggregated => "aggregated",
            Self::Legacy => "legacy",
        }
    }
}

impl fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Text that names no [`WorkerRole`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerRoleParseError {
    /// Not one of the lowercase role names.
    #[error("unknown worker role {text:?}, expected prefill, decode, encode, aggregated or legacy")]
    Unknown {
        /// The offending text.
        text: String,
    },
}

impl FromStr for WorkerRole {
    type Err = WorkerRoleParseError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|role| role.as_str() == text)
            .ok_or_else(|| WorkerRoleParseError::Unknown {
                text: text.to_owned(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roles_sort_in_declaration_order() {
        let mut roles = vec![
            WorkerRole::Legacy,
            WorkerRole::Aggregated,
            WorkerRole::Encode,
            WorkerRole::Decode,
            WorkerRole::Prefill,
        ];
        roles.sort();
        assert_eq!(roles, WorkerRole::ALL);
    }

    #[test]
    fn serde_name_equals_as_str_and_parses_back() {
        for role in WorkerRole::ALL {
            let json = serde_json::to_string(&role).unwrap();
            assert_eq!(json, format!("\"{}\"", role.as_str()));
            assert_eq!(role.as_str().parse::<WorkerRole>(), Ok(role));
        }
    }

    #[test]
    fn unknown_role_is_rejected() {
        assert_eq!(
            "unspecified".parse::<WorkerRole>(),
            Err(WorkerRoleParseError::Unknown {
                text: "unspecified".to_owned()
            })
        );
    }
}
