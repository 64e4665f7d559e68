//! The stream request: the first and only frame a client sends on a connection.

use bytes::BytesMut;
use serde::{Deserialize, Serialize};

use super::body::{DecodeError, EncodeError, decode_appended, decode_prefix, encode_body};
use super::code::ErrorReason;
use super::identity::ProducerIdentity;
use super::info::ErrorMessage;
use super::validation::{ValidationError, check_label};
use crate::frame::MessageKind;
use crate::limits::{MAX_AUTH_TOKEN_LEN, MAX_SUBSCRIBER_ID_LEN};

/// What a client asks a relay for. Every stream opens with a complete state, then changes.
/// `Debug` shows whether a token is present, never the token.
#[derive(Clone, PartialEq, Eq, Serialize)]
pub struct StreamRequest {
    /// A diagnostic label: non-empty, at most 128 UTF-8 bytes, no control characters.
    pub subscriber_id: String,
    /// The stream.
    pub rpc: StreamRpc,
    /// A bearer token, when the relay requires one (at most 4096 bytes).
    pub auth_token: Option<String>,
}

impl std::fmt::Debug for StreamRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamRequest")
            .field("subscriber_id", &self.subscriber_id)
            .field("rpc", &self.rpc)
            .field(
                "auth_token",
                &self.auth_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

/// The stream a request opens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamRpc {
    /// One `RelayInfo` frame.
    RelayInfo,
    /// Complete catalog updates.
    WatchCatalog,
    /// Snapshot chunks then deltas of one exact producer generation.
    SubscribePool {
        /// The producer generation the client saw in the catalog.
        expected_producer: ProducerIdentity,
        /// The last sequence the client applied of that generation, when it kept its
        /// replica: the relay resumes from there if it can (protocol minor 1; older
        /// clients send nothing and always get a snapshot).
        resume_from_sequence: Option<u64>,
    },
    /// Complete load windows.
    WatchLoad,
    /// Complete topology updates.
    WatchTopology,
}

impl StreamRpc {
    /// The wire code.
    pub fn code(&self) -> u32 {
        match self {
            StreamRpc::RelayInfo => 1,
            StreamRpc::WatchCatalog => 2,
            StreamRpc::SubscribePool { .. } => 3,
            StreamRpc::WatchLoad => 4,
            StreamRpc::WatchTopology => 5,
        }
    }
}

impl StreamRequest {
    /// Checks the subscriber id, the token and the expected producer.
    pub fn validate(&self) -> Result<(), ValidationError> {
        check_label("subscriber_id", &self.subscriber_id, MAX_SUBSCRIBER_ID_LEN)?;
        if let Some(token) = &self.auth_token {
            check_label("auth_token", token, MAX_AUTH_TOKEN_LEN)?;
        }
        if let StreamRpc::SubscribePool {
            expected_producer, ..
        } = &self.rpc
        {
            expected_producer.validate()?;
        }
        Ok(())
    }

    /// [`StreamRequest::validate`], as the relay refuses a request (whichever door it came
    /// through): a value a newer protocol may send is `unsupported_feature`, anything else
    /// `invalid_request`.
    pub fn check(&self) -> Result<(), ErrorMessage> {
        self.validate().map_err(|err| {
            let reason = if err.is_unsupported() {
                ErrorReason::UnsupportedFeature
            } else {
                ErrorReason::InvalidRequest
            };
            ErrorMessage::new(reason, &err.to_string())
        })
    }

    /// Appends the body to `dst`.
    pub fn encode_body(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        let (rpc, expected_producer, resume_from_sequence) = match &self.rpc {
            StreamRpc::SubscribePool {
                expected_producer,
                resume_from_sequence,
            } => (
                self.rpc.code(),
                Some(*expected_producer),
                *resume_from_sequence,
            ),
            other => (other.code(), None, None),
        };
        let wire = RequestWire {
            subscriber_id: self.subscriber_id.clone(),
            rpc,
            expected_producer,
            auth_token: self.auth_token.clone(),
        };
        encode_body(MessageKind::StreamRequest, &wire, dst)?;
        // Minor 1 appends its fields after the minor-0 body; older relays skip them.
        encode_body(
            MessageKind::StreamRequest,
            &RequestWireMinor1 {
                resume_from_sequence,
            },
            dst,
        )
    }

    /// Decodes a body sent with protocol minor `minor`.
    pub fn decode_body(body: &[u8], minor: u16) -> Result<Self, DecodeError> {
        let (wire, used): (RequestWire, usize) = decode_prefix(MessageKind::StreamRequest, body)?;
        // A minor-0 sender has nothing after its body; minor 1 and newer append fields.
        let minor1: RequestWireMinor1 =
            decode_appended(MessageKind::StreamRequest, &body[used..], minor, 1)?;
        let needs_producer = wire.rpc == 3;
        let rpc = match (wire.rpc, wire.expected_producer) {
            (1, None) => StreamRpc::RelayInfo,
            (2, None) => StreamRpc::WatchCatalog,
            (3, Some(expected_producer)) => StreamRpc::SubscribePool {
                expected_producer,
                resume_from_sequence: minor1.resume_from_sequence,
            },
            (4, None) => StreamRpc::WatchLoad,
            (5, None) => StreamRpc::WatchTopology,
            (code @ (0 | 6..), _) => {
                return Err(match code {
                    0 => DecodeError::RpcArguments {
                        rpc: 0,
                        detail: "rpc is unspecified",
                    },
                    code => DecodeError::UnsupportedRpc { code },
                });
            }
            (rpc, _) => {
                return Err(DecodeError::RpcArguments {
                    rpc,
                    detail: if needs_producer {
                        "expected_producer is missing"
                    } else {
                        "expected_producer is only allowed for subscribe_pool"
                    },
                });
            }
        };
        Ok(Self {
            subscriber_id: wire.subscriber_id,
            rpc,
            auth_token: wire.auth_token,
        })
    }
}

/// Fields protocol minor 1 appends to a request body.
#[derive(Serialize, Deserialize, Default)]
struct RequestWireMinor1 {
    resume_from_sequence: Option<u64>,
}

#[derive(Serialize, Deserialize)]
struct RequestWire {
    subscriber_id: String,
    rpc: u32,
    expected_producer: Option<ProducerIdentity>,
    auth_token: Option<String>,
}
