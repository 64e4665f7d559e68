//! Following a relay over the contract: a kvrelay [`StreamRequest`] opened as the matching
//! RPC, its answers handed back as kvrelay v1 [`Message`]s, so a consumer follows a Dynamo
//! relay (or our own gRPC door) with exactly the code that follows our WAN protocol.
//!
//! - A relay's refusal or stream failure (a status carrying the contract's reason
//!   metadata, or a status that could only come from the service, like `UNIMPLEMENTED`)
//!   becomes one `Message::Error` with that reason, as our relay's error frame does.
//! - A transport failure (no connection, a reset, a status without a reason) is a
//!   [`ClientError::Transport`], as a socket error is on our protocol.
//! - The contract has no resume: a `resume_from_sequence` is not sent, and the stream
//!   starts with a snapshot (a resume miss, which every consumer handles).
//! - A catalog pool the v1 model can represent is passed on for the consumer's own catalog
//!   validation (which quarantines and counts unsupported ones); one it cannot represent,
//!   and a readiness or load entry this side cannot take, is left out (the rest is kept);
//!   a pool frame that does not convert ends the stream.

use kvrelay_codec::v1::{
    ErrorMessage, ErrorReason, LoadWindow, Message, PoolFrame, RelayInfo, StreamRequest, StreamRpc,
    TopologyUpdate,
};
use tonic::codec::Streaming;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;
use tonic::{Code, Request, Status};

use crate::contract::{self, CONTRACT_MARKER, MAX_MESSAGE_BYTES, PROTOCOL_VERSION};
use crate::convert::{ContractError, ReceivedCatalog};
use crate::proto;
use crate::proto::kv_event_relay_client::KvEventRelayClient;

/// Why a contract stream cannot go on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// The connection failed, or the call failed without an answer from the service.
    #[error("gRPC transport: {0}")]
    Transport(Box<Status>),
    /// An answer kvrelay's model cannot take (the stream must be dropped).
    #[error("contract answer: {0}")]
    Contract(#[from] ContractError),
    /// An answer without the contract's marker or protocol version.
    #[error(
        "contract mismatch: protocol_version {protocol_version}, contract_marker {marker:#010x}"
    )]
    Mismatch {
        /// The answer's protocol version.
        protocol_version: u32,
        /// The answer's marker.
        marker: u32,
    },
    /// The bearer token is not valid as gRPC metadata.
    #[error("the bearer token is not valid gRPC metadata")]
    Token,
}

/// One open contract stream, read as kvrelay messages.
pub struct ContractStream {
    inner: Inner,
    /// Entries of received updates this side could not represent and left out, since the
    /// last [`ContractStream::take_left_out`].
    left_out: u64,
}

enum Inner {
    /// One message to deliver, then the end.
    Once(Option<Message>),
    Catalog(Streaming<proto::KvPoolCatalogUpdate>),
    Readiness(Streaming<proto::ServingReadinessUpdate>),
    Load(Streaming<proto::KvPoolLoadUpdate>),
    Pool(Streaming<proto::FilterUpdate>),
    Ended,
}

impl std::fmt::Debug for ContractStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.inner {
            Inner::Once(_) => "once",
            Inner::Catalog(_) => "catalog",
            Inner::Readiness(_) => "readiness",
            Inner::Load(_) => "load",
            Inner::Pool(_) => "pool",
            Inner::Ended => "ended",
        };
        f.debug_struct("ContractStream")
            .field("rpc", &kind)
            .finish()
    }
}

/// A failure of the relay's own making (a refusal or a stream failure), as kvrelay's
/// error message; `None` for a transport failure.
fn relay_failure(status: &Status) -> Option<ErrorMessage> {
    let from_service = status.metadata().contains_key(contract::ERROR_REASON_KEY)
        || matches!(status.code(), Code::Unimplemented | Code::Unauthenticated);
    if !from_service {
        return None;
    }
    let reason = match status.code() {
        // A relay without the RPC, or one that wants a token: neither will change on retry.
        Code::Unimplemented => ErrorReason::UnsupportedFeature,
        _ => contract::reason_of(status),
    };
    Some(ErrorMessage::new(reason, status.message()))
}

fn failed(status: Status) -> Result<ContractStream, ClientError> {
    match relay_failure(&status) {
        Some(error) => Ok(ContractStream {
            inner: Inner::Once(Some(Message::Error(error))),
            left_out: 0,
        }),
        None => Err(ClientError::Transport(Box::new(status))),
    }
}

/// A request carrying the bearer token, if any.
fn call<T>(authorization: Option<&MetadataValue<Ascii>>, message: T) -> Request<T> {
    let mut call = Request::new(message);
    if let Some(value) = authorization {
        call.metadata_mut().insert("authorization", value.clone());
    }
    call
}

fn check_answer(protocol_version: u32, marker: u32) -> Result<(), ClientError> {
    if protocol_version == PROTOCOL_VERSION && marker == CONTRACT_MARKER {
        Ok(())
    } else {
        Err(ClientError::Mismatch {
            protocol_version,
            marker,
        })
    }
}

/// Opens `request` on `channel` (with `token` as `authorization: Bearer ..`, if any).
pub async fn open(
    channel: Channel,
    token: Option<&str>,
    request: StreamRequest,
) -> Result<ContractStream, ClientError> {
    let authorization = token
        .map(|token| {
            MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| ClientError::Token)
        })
        .transpose()?;
    let mut client = KvEventRelayClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let subscriber_id = request.subscriber_id;
    let inner = match request.rpc {
        StreamRpc::RelayInfo => {
            let answer = match client
                .get_relay_info(call(
                    authorization.as_ref(),
                    proto::RelayInfoRequest {
                        contract_marker: CONTRACT_MARKER,
                    },
                ))
                .await
            {
                Ok(answer) => answer.into_inner(),
                Err(status) => return failed(status),
            };
            check_answer(answer.protocol_version, answer.contract_marker)?;
            let relay = answer
                .relay
                .ok_or(ContractError::Missing { field: "relay" })?;
            Inner::Once(Some(Message::RelayInfo(RelayInfo {
                // The contract's v1 is our protocol major 1; it has no minor features.
                protocol_major: kvrelay_codec::PROTOCOL_MAJOR,
                protocol_minor: 0,
                relay: kvrelay_codec::v1::RelayIdentity {
                    drt_instance_id: relay.drt_instance_id,
                    relay_incarnation: relay.relay_incarnation,
                },
                max_frame_len: u32::try_from(MAX_MESSAGE_BYTES).unwrap_or(u32::MAX),
            })))
        }
        StreamRpc::WatchCatalog => match client
            .watch_kv_pool_catalog(call(
                authorization.as_ref(),
                proto::WatchKvPoolCatalogRequest {
                    subscriber_id,
                    contract_marker: CONTRACT_MARKER,
                },
            ))
            .await
        {
            Ok(stream) => Inner::Catalog(stream.into_inner()),
            Err(status) => return failed(status),
        },
        StreamRpc::WatchTopology => match client
            .subscribe_serving_readiness(call(
                authorization.as_ref(),
                proto::SubscribeServingReadinessRequest {
                    subscriber_id,
                    contract_marker: CONTRACT_MARKER,
                },
            ))
            .await
        {
            Ok(stream) => Inner::Readiness(stream.into_inner()),
            Err(status) => return failed(status),
        },
        StreamRpc::WatchLoad => match client
            .subscribe_kv_pool_load(call(
                authorization.as_ref(),
                proto::SubscribeKvPoolLoadRequest {
                    subscriber_id,
                    contract_marker: CONTRACT_MARKER,
                },
            ))
            .await
        {
            Ok(stream) => Inner::Load(stream.into_inner()),
            Err(status) => return failed(status),
        },
        StreamRpc::SubscribePool {
            expected_producer, ..
        } => match client
            .subscribe_kv_pool(call(
                authorization.as_ref(),
                proto::SubscribeKvPoolRequest {
                    subscriber_id,
                    expected_producer: Some(expected_producer.into()),
                    contract_marker: CONTRACT_MARKER,
                },
            ))
            .await
        {
            Ok(stream) => Inner::Pool(stream.into_inner()),
            Err(status) => return failed(status),
        },
    };
    Ok(ContractStream { inner, left_out: 0 })
}

impl ContractStream {
    /// Entries (catalog pools, readiness and load entries) the updates received since the
    /// last call carried but this side could not represent, so left out of the messages
    /// handed back (each update's other entries are kept). Counted every time an update
    /// carries one: a relay that keeps sending one shows as a rising count.
    pub fn take_left_out(&mut self) -> u64 {
        std::mem::take(&mut self.left_out)
    }

    /// The next message, or `None` at the end of the stream. Cancel safe.
    pub async fn next(&mut self) -> Result<Option<Message>, ClientError> {
        let received = match &mut self.inner {
            Inner::Once(message) => return Ok(message.take()),
            Inner::Ended => return Ok(None),
            Inner::Catalog(stream) => stream.message().await.map(|next| next.map(catalog)),
            Inner::Readiness(stream) => stream.message().await.map(|next| next.map(readiness)),
            Inner::Load(stream) => stream.message().await.map(|next| next.map(load)),
            Inner::Pool(stream) => stream.message().await.map(|next| next.map(pool)),
        };
        match received {
            Ok(Some(converted)) => {
                let (message, left_out) = converted?;
                self.left_out += left_out;
                Ok(Some(message))
            }
            Ok(None) => {
                self.inner = Inner::Ended;
                Ok(None)
            }
            Err(status) => {
                self.inner = Inner::Ended;
                match relay_failure(&status) {
                    Some(error) => Ok(Some(Message::Error(error))),
                    None => Err(ClientError::Transport(Box::new(status))),
                }
            }
        }
    }
}

/// A converted update and how many of its entries were left out.
type Converted = Result<(Message, u64), ClientError>;

/// Entries an update offered that its conversion did not keep.
fn left_out(offered: usize, kept: usize) -> u64 {
    u64::try_from(offered.saturating_sub(kept)).unwrap_or(u64::MAX)
}

fn catalog(update: proto::KvPoolCatalogUpdate) -> Converted {
    check_answer(update.protocol_version, update.contract_marker)?;
    let offered = update
        .snapshot
        .as_ref()
        .map_or(0, |snapshot| snapshot.pools.len());
    let received = ReceivedCatalog::try_from(update)?;
    if let Some(first) = received.unsupported.first() {
        tracing::debug!(
            left_out = received.unsupported.len(),
            first = %first,
            "catalog pools this consumer cannot take were left out"
        );
    }
    let dropped = left_out(offered, received.catalog.pools.len());
    Ok((Message::CatalogUpdate(received.catalog), dropped))
}

fn readiness(update: proto::ServingReadinessUpdate) -> Converted {
    check_answer(update.protocol_version, update.contract_marker)?;
    let offered = update.entries.len();
    let converted = TopologyUpdate::try_from(update)?;
    let dropped = left_out(offered, converted.entries.len());
    Ok((Message::TopologyUpdate(converted), dropped))
}

fn load(update: proto::KvPoolLoadUpdate) -> Converted {
    check_answer(update.protocol_version, update.contract_marker)?;
    let offered = update.pools.len();
    let converted = LoadWindow::try_from(update)?;
    let dropped = left_out(offered, converted.pools.len());
    Ok((Message::LoadWindow(converted), dropped))
}

fn pool(update: proto::FilterUpdate) -> Converted {
    check_answer(update.protocol_version, update.contract_marker)?;
    // A pool frame is whole or refused: nothing in it is left out.
    Ok((Message::PoolFrame(PoolFrame::try_from(update)?), 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relay() -> Option<proto::RelayIdentity> {
        Some(proto::RelayIdentity {
            drt_instance_id: 1,
            relay_incarnation: 2,
        })
    }

    #[test]
    fn entries_this_side_cannot_represent_are_counted_as_left_out() {
        // A pool, a readiness entry and a load entry, each without its producer or
        // registration: the update is kept, the entry is left out and counted.
        let (message, dropped) = catalog(proto::KvPoolCatalogUpdate {
            protocol_version: PROTOCOL_VERSION,
            relay: relay(),
            revision: 1,
            snapshot: Some(proto::KvPoolCatalogSnapshot {
                pools: vec![proto::KvPoolDescriptor::default()],
            }),
            contract_marker: CONTRACT_MARKER,
        })
        .unwrap();
        assert!(matches!(message, Message::CatalogUpdate(ref update) if update.pools.is_empty()));
        assert_eq!(dropped, 1);

        let (message, dropped) = readiness(proto::ServingReadinessUpdate {
            protocol_version: PROTOCOL_VERSION,
            relay: relay(),
            entries: vec![Default::default(), Default::default()],
            contract_marker: CONTRACT_MARKER,
            ..Default::default()
        })
        .unwrap();
        assert!(
            matches!(message, Message::TopologyUpdate(ref update) if update.entries.is_empty())
        );
        assert_eq!(dropped, 2);

        let (message, dropped) = load(proto::KvPoolLoadUpdate {
            protocol_version: PROTOCOL_VERSION,
            relay: relay(),
            pools: vec![proto::KvPoolLoadEntry::default()],
            contract_marker: CONTRACT_MARKER,
            ..Default::default()
        })
        .unwrap();
        assert!(matches!(message, Message::LoadWindow(ref window) if window.pools.is_empty()));
        assert_eq!(dropped, 1);
    }

    #[test]
    fn a_whole_update_with_nothing_left_out_counts_nothing() {
        let (_, dropped) = load(proto::KvPoolLoadUpdate {
            protocol_version: PROTOCOL_VERSION,
            relay: relay(),
            contract_marker: CONTRACT_MARKER,
            ..Default::default()
        })
        .unwrap();
        assert_eq!(dropped, 0);
    }
}
