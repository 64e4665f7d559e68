//! The contract's rules that are not the schema: constants, request checks, and how an
//! error reason travels (a status code plus the `kv-relay-error-reason` metadata).
//!
//! kvrelay's [`ErrorReason`] codes are the contract's `RelayErrorReason` numbers, so a
//! reason crosses the door unchanged; only its carrier differs.

use kvrelay_codec::v1::{ErrorMessage, ErrorReason};
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

use crate::proto::RelayErrorReason;

/// `protocol_version` of every answer.
pub const PROTOCOL_VERSION: u32 = 1;

/// `contract_marker` (field 127) of every request and answer: "KVR1".
pub const CONTRACT_MARKER: u32 = 0x4B56_5231;

/// The ASCII metadata key that carries a failure's `RelayErrorReason` name.
pub const ERROR_REASON_KEY: &str = "kv-relay-error-reason";

/// Largest message either side sends or accepts: one full CBI1 chunk with headroom.
pub const MAX_MESSAGE_BYTES: usize = 8 * 1024 * 1024;

/// The gRPC service name health and reflection report.
pub const SERVICE_NAME: &str = "dynamo.kvrelay.v1.KvEventRelay";

/// A request's marker must be the contract's.
pub fn check_marker(marker: u32) -> Result<(), ErrorMessage> {
    if marker == CONTRACT_MARKER {
        return Ok(());
    }
    Err(ErrorMessage::new(
        ErrorReason::ContractMismatch,
        &format!("contract_marker {marker:#010x}, expected {CONTRACT_MARKER:#010x}"),
    ))
}

/// The contract's status code for a reason.
pub fn status_code(reason: ErrorReason) -> Code {
    match reason {
        ErrorReason::ContractMismatch
        | ErrorReason::ProducerChanged
        | ErrorReason::InvalidPublication
        | ErrorReason::UnsupportedFeature => Code::FailedPrecondition,
        ErrorReason::InvalidRequest => Code::InvalidArgument,
        ErrorReason::PoolNotFound => Code::NotFound,
        ErrorReason::ResourceLimit
        | ErrorReason::SubscriberLagged
        | ErrorReason::SnapshotProgressTimeout => Code::ResourceExhausted,
        ErrorReason::PublicationUnavailable => Code::Unavailable,
        _ => Code::Internal,
    }
}

/// The contract's enum for a reason (an unrecognised one is unspecified).
pub fn relay_error_reason(reason: ErrorReason) -> RelayErrorReason {
    i32::try_from(reason.code())
        .ok()
        .and_then(|code| RelayErrorReason::try_from(code).ok())
        .unwrap_or(RelayErrorReason::Unspecified)
}

/// A failure as the contract sends it: its code, its message, the reason metadata.
pub fn status_of(failure: &ErrorMessage) -> Status {
    let reason = failure.effective_reason();
    let mut status = Status::new(status_code(reason), failure.message.clone());
    let name = relay_error_reason(reason).as_str_name();
    status
        .metadata_mut()
        .insert(ERROR_REASON_KEY, MetadataValue::from_static(name));
    status
}

/// The reason a received status carries: the metadata's name when it is a known one,
/// else the status code's reason (missing, unknown and unspecified names all fall back).
pub fn reason_of(status: &Status) -> ErrorReason {
    let named = status
        .metadata()
        .get(ERROR_REASON_KEY)
        .and_then(|value| value.to_str().ok())
        .and_then(RelayErrorReason::from_str_name)
        .filter(|reason| *reason != RelayErrorReason::Unspecified)
        .and_then(|reason| u32::try_from(reason as i32).ok())
        .map(ErrorReason::from_code);
    named.unwrap_or(match status.code() {
        Code::InvalidArgument => ErrorReason::InvalidRequest,
        Code::NotFound => ErrorReason::PoolNotFound,
        Code::FailedPrecondition => ErrorReason::ContractMismatch,
        Code::ResourceExhausted => ErrorReason::ResourceLimit,
        Code::Unavailable => ErrorReason::PublicationUnavailable,
        _ => ErrorReason::Internal,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_round_trips_through_a_status() {
        for reason in ErrorReason::KNOWN {
            let status = status_of(&ErrorMessage::new(*reason, "why"));
            assert_eq!(reason_of(&status), *reason, "{reason}");
            assert_eq!(status.code(), status_code(*reason));
            let name = status
                .metadata()
                .get(ERROR_REASON_KEY)
                .and_then(|v| v.to_str().ok());
            let expected = format!(
                "RELAY_ERROR_REASON_{}",
                reason.name().map(str::to_uppercase).unwrap_or_default()
            );
            assert_eq!(name, Some(expected.as_str()));
        }
    }

    #[test]
    fn lag_is_resource_exhausted_with_its_own_name() {
        let status = status_of(&ErrorMessage::new(ErrorReason::SubscriberLagged, "slow"));
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(
            status
                .metadata()
                .get(ERROR_REASON_KEY)
                .and_then(|v| v.to_str().ok()),
            Some("RELAY_ERROR_REASON_SUBSCRIBER_LAGGED")
        );
    }

    #[test]
    fn a_missing_or_unknown_name_falls_back_to_the_code() {
        let mut status = Status::new(Code::NotFound, "gone");
        assert_eq!(reason_of(&status), ErrorReason::PoolNotFound);
        status.metadata_mut().insert(
            ERROR_REASON_KEY,
            MetadataValue::from_static("RELAY_ERROR_REASON_FROM_THE_FUTURE"),
        );
        assert_eq!(reason_of(&status), ErrorReason::PoolNotFound);
        status.metadata_mut().insert(
            ERROR_REASON_KEY,
            MetadataValue::from_static("RELAY_ERROR_REASON_UNSPECIFIED"),
        );
        assert_eq!(reason_of(&status), ErrorReason::PoolNotFound);
    }

    #[test]
    fn only_the_contract_marker_passes() {
        assert!(check_marker(CONTRACT_MARKER).is_ok());
        assert_eq!(
            check_marker(0).map_err(|e| e.reason),
            Err(ErrorReason::ContractMismatch)
        );
        assert_eq!(
            check_marker(CONTRACT_MARKER.swap_bytes()).map_err(|e| e.reason),
            Err(ErrorReason::ContractMismatch)
        );
    }
}
