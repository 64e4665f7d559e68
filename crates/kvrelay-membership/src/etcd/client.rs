//! [`EtcdClient`]: the few etcd v3 calls discovery makes, over tonic, with no `protoc`.
//!
//! Listings are paged (`limit` keys a page, every page read at the first page's revision,
//! so the listing is one consistent cut); a page too large for the receive limit is
//! retried at half the size, and a single record too large for it is stepped over
//! (counted by the caller as `too_large`). Watches are one create request on a stream the
//! client keeps open; the stream ends with an error when etcd cancels or compacts it.

use std::time::Duration;

use futures::StreamExt;
use tonic::transport::{Channel, Endpoint};

use super::generated::{
    self as pb, DeleteRangeRequest, KeyValue, LeaseGrantRequest, LeaseRevokeRequest, PutRequest,
    RangeRequest, WatchCreateRequest, WatchRequest, kv_client::KvClient, lease_client::LeaseClient,
    watch_client::WatchClient,
};

/// Default keys per listing page.
pub const DEFAULT_ETCD_PAGE_KEYS: u32 = 256;

/// Bytes of one gRPC message beyond its largest record: keys, revisions, framing.
const MESSAGE_OVERHEAD_BYTES: usize = 64 * 1024;

/// Why an etcd call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// An endpoint is not a valid URL.
    #[error("invalid etcd endpoint {endpoint:?}: {reason}")]
    InvalidEndpoint {
        /// The endpoint as configured.
        endpoint: String,
        /// Why it was refused.
        reason: String,
    },
    /// No endpoint was given.
    #[error("no etcd endpoint configured")]
    NoEndpoints,
    /// The call did not finish within the timeout.
    #[error("etcd {call} timed out after {timeout:?}")]
    Timeout {
        /// The RPC.
        call: &'static str,
        /// The bound.
        timeout: Duration,
    },
    /// etcd (or the transport) answered with an error status.
    #[error("etcd {call} failed: {code:?}: {message}")]
    Status {
        /// The RPC.
        call: &'static str,
        /// The gRPC status code.
        code: tonic::Code,
        /// The status message.
        message: String,
    },
    /// The watch was cancelled by etcd or its start revision was compacted.
    #[error("etcd watch cancelled: {reason} (compact revision {compact_revision})")]
    WatchCancelled {
        /// etcd's reason.
        reason: String,
        /// The oldest revision still kept, when the cause was compaction.
        compact_revision: i64,
    },
    /// The watch stream ended.
    #[error("etcd watch stream ended")]
    WatchEnded,
}

impl EtcdError {
    fn status(call: &'static str, status: &tonic::Status) -> Self {
        Self::Status {
            call,
            code: status.code(),
            message: status.message().to_owned(),
        }
    }

    /// Whether the answer was refused for exceeding the receive limit.
    fn is_message_too_large(&self) -> bool {
        matches!(
            self,
            Self::Status {
                code: tonic::Code::OutOfRange | tonic::Code::ResourceExhausted,
                ..
            }
        )
    }
}

/// The bounds of one client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EtcdClientLimits {
    /// Largest record (value) accepted, in bytes; the receive limit is this plus 64 KiB of
    /// message overhead, so one record of this size always fits in one message.
    pub max_record_bytes: u64,
    /// Keys a listing page asks for; halved (down to one) while a page does not fit.
    pub page_keys: u32,
    /// Connect timeout and the deadline of every unary call (and of a watch's creation).
    pub timeout: Duration,
}

impl Default for EtcdClientLimits {
    fn default() -> Self {
        Self {
            max_record_bytes: crate::DEFAULT_MAX_CARD_FILE_BYTES,
            page_keys: DEFAULT_ETCD_PAGE_KEYS,
            timeout: super::DEFAULT_ETCD_TIMEOUT,
        }
    }
}

impl EtcdClientLimits {
    /// The gRPC receive limit: the largest record plus message overhead.
    pub fn max_message_bytes(&self) -> usize {
        usize::try_from(self.max_record_bytes)
            .unwrap_or(usize::MAX)
            .saturating_add(MESSAGE_OVERHEAD_BYTES)
    }
}

/// A key-value record read from etcd.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EtcdRecord {
    /// The key.
    pub key: Vec<u8>,
    /// The value.
    pub value: Vec<u8>,
    /// The lease the key lives under (0: none).
    pub lease: i64,
}

impl From<KeyValue> for EtcdRecord {
    fn from(kv: KeyValue) -> Self {
        Self {
            key: kv.key,
            value: kv.value,
            lease: kv.lease,
        }
    }
}

/// One consistent listing of a prefix.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EtcdListing {
    /// The records, in key order.
    pub records: Vec<EtcdRecord>,
    /// The revision every page was read at; a watch from `revision + 1` misses nothing.
    pub revision: i64,
    /// Keys stepped over because their record exceeds the receive limit.
    pub too_large: Vec<Vec<u8>>,
}

/// A change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EtcdChange {
    /// A key was written.
    Put(EtcdRecord),
    /// A key was deleted (or its lease ended).
    Delete {
        /// The key.
        key: Vec<u8>,
    },
}

/// A client of one etcd cluster (several endpoints are balanced).
#[derive(Clone)]
pub struct EtcdClient {
    kv: KvClient<Channel>,
    watch: WatchClient<Channel>,
    lease: LeaseClient<Channel>,
    limits: EtcdClientLimits,
}

impl std::fmt::Debug for EtcdClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdClient")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl EtcdClient {
    /// A client of `endpoints` (`http://host:port`). Connections are made on first use and
    /// remade after failures; no call is made here (async only because the connection
    /// task needs the runtime).
    pub async fn connect(
        endpoints: &[String],
        limits: EtcdClientLimits,
    ) -> Result<Self, EtcdError> {
        let parsed = endpoints
            .iter()
            .map(|url| {
                Endpoint::from_shared(url.clone())
                    .map(|endpoint| {
                        endpoint
                            .connect_timeout(limits.timeout)
                            .tcp_nodelay(true)
                            .http2_keep_alive_interval(Duration::from_secs(10))
                            .keep_alive_timeout(limits.timeout)
                    })
                    .map_err(|error| EtcdError::InvalidEndpoint {
                        endpoint: url.clone(),
                        reason: error.to_string(),
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let channel = match parsed.as_slice() {
            [] => return Err(EtcdError::NoEndpoints),
            [one] => one.connect_lazy(),
            _ => Channel::balance_list(parsed.into_iter()),
        };
        let limit = limits.max_message_bytes();
        Ok(Self {
            kv: KvClient::new(channel.clone()).max_decoding_message_size(limit),
            watch: WatchClient::new(channel.clone()).max_decoding_message_size(limit),
            lease: LeaseClient::new(channel).max_decoding_message_size(limit),
            limits,
        })
    }

    /// The client's bounds.
    pub fn limits(&self) -> EtcdClientLimits {
        self.limits
    }

    async fn bounded<T>(
        &self,
        call: &'static str,
        future: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, EtcdError> {
        match tokio::time::timeout(self.limits.timeout, future).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(EtcdError::status(call, &status)),
            Err(_) => Err(EtcdError::Timeout {
                call,
                timeout: self.limits.timeout,
            }),
        }
    }

    async fn range(&self, request: RangeRequest) -> Result<pb::RangeResponse, EtcdError> {
        let mut kv = self.kv.clone();
        self.bounded("Range", kv.range(request)).await
    }

    /// Every record under `prefix`, paged, at one revision.
    pub async fn list_prefix(&self, prefix: &[u8]) -> Result<EtcdListing, EtcdError> {
        let range_end = prefix_end(prefix);
        let full_page = i64::from(self.limits.page_keys.max(1));
        let mut page = full_page;
        let mut from = prefix.to_vec();
        let mut listing = EtcdListing::default();
        loop {
            let request = RangeRequest {
                key: from.clone(),
                range_end: range_end.clone(),
                limit: page,
                revision: listing.revision,
                keys_only: false,
            };
            let response = match self.range(request).await {
                Ok(response) => response,
                Err(error) if error.is_message_too_large() && page > 1 => {
                    page /= 2;
                    continue;
                }
                Err(error) if error.is_message_too_large() => {
                    // One record alone exceeds the limit: learn its key and step over it.
                    let keys = self
                        .range(RangeRequest {
                            key: from.clone(),
                            range_end: range_end.clone(),
                            limit: 1,
                            revision: listing.revision,
                            keys_only: true,
                        })
                        .await?;
                    let Some(kv) = keys.kvs.into_iter().next() else {
                        return Err(error);
                    };
                    from = successor(&kv.key);
                    listing.too_large.push(kv.key);
                    continue;
                }
                Err(error) => return Err(error),
            };
            if listing.revision == 0 {
                listing.revision = response.header.map_or(0, |header| header.revision);
            }
            let next = response.kvs.last().map(|kv| successor(&kv.key));
            listing
                .records
                .extend(response.kvs.into_iter().map(EtcdRecord::from));
            match next {
                Some(next) if response.more => from = next,
                _ => break,
            }
            // A page that fit: grow back toward the configured size.
            page = (page.saturating_mul(2)).min(full_page);
        }
        Ok(listing)
    }

    /// Writes `value` at `key`, under `lease` when nonzero.
    pub async fn put(&self, key: &[u8], value: &[u8], lease: i64) -> Result<(), EtcdError> {
        let mut kv = self.kv.clone();
        let request = PutRequest {
            key: key.to_vec(),
            value: value.to_vec(),
            lease,
        };
        self.bounded("Put", kv.put(request)).await.map(drop)
    }

    /// Deletes `key`; returns how many keys were deleted (0 or 1).
    pub async fn delete(&self, key: &[u8]) -> Result<i64, EtcdError> {
        let mut kv = self.kv.clone();
        let request = DeleteRangeRequest {
            key: key.to_vec(),
            range_end: Vec::new(),
        };
        Ok(self
            .bounded("DeleteRange", kv.delete_range(request))
            .await?
            .deleted)
    }

    /// Discards history before `revision`.
    pub async fn compact(&self, revision: i64) -> Result<(), EtcdError> {
        let mut kv = self.kv.clone();
        let request = pb::CompactionRequest {
            revision,
            physical: true,
        };
        self.bounded("Compact", kv.compact(request)).await.map(drop)
    }

    /// Grants a lease of `ttl_seconds`; returns its id.
    pub async fn grant_lease(&self, ttl_seconds: i64) -> Result<i64, EtcdError> {
        let mut lease = self.lease.clone();
        let request = LeaseGrantRequest {
            ttl: ttl_seconds,
            id: 0,
        };
        Ok(self
            .bounded("LeaseGrant", lease.lease_grant(request))
            .await?
            .id)
    }

    /// Ends a lease now; every key under it is deleted.
    pub async fn revoke_lease(&self, id: i64) -> Result<(), EtcdError> {
        let mut lease = self.lease.clone();
        self.bounded("LeaseRevoke", lease.lease_revoke(LeaseRevokeRequest { id }))
            .await
            .map(drop)
    }

    /// Watches every key under `prefix` from `start_revision` on. Returns once etcd has
    /// created the watch (or refused it).
    pub async fn watch_prefix(
        &self,
        prefix: &[u8],
        start_revision: i64,
    ) -> Result<EtcdWatch, EtcdError> {
        let create = WatchRequest {
            request_union: Some(pb::watch_request::RequestUnion::CreateRequest(
                WatchCreateRequest {
                    key: prefix.to_vec(),
                    range_end: prefix_end(prefix),
                    start_revision,
                },
            )),
        };
        // The request stream stays open for the watch's life: etcd ends a watch whose
        // client closed its side.
        let requests =
            futures::stream::once(async move { create }).chain(futures::stream::pending());
        let mut client = self.watch.clone();
        let mut stream = self.bounded("Watch", client.watch(requests)).await?;
        let first = tokio::time::timeout(self.limits.timeout, stream.message())
            .await
            .map_err(|_| EtcdError::Timeout {
                call: "Watch",
                timeout: self.limits.timeout,
            })?
            .map_err(|status| EtcdError::status("Watch", &status))?
            .ok_or(EtcdError::WatchEnded)?;
        let mut watch = EtcdWatch {
            stream,
            pending: std::collections::VecDeque::new(),
        };
        watch.accept(first)?;
        Ok(watch)
    }
}

/// An open watch of a prefix.
pub struct EtcdWatch {
    stream: tonic::Streaming<pb::WatchResponse>,
    pending: std::collections::VecDeque<EtcdChange>,
}

impl std::fmt::Debug for EtcdWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdWatch")
            .field("pending", &self.pending.len())
            .finish_non_exhaustive()
    }
}

impl EtcdWatch {
    /// The next change; an error ends the watch (the caller lists again and rewatches).
    pub async fn next(&mut self) -> Result<EtcdChange, EtcdError> {
        loop {
            if let Some(change) = self.pending.pop_front() {
                return Ok(change);
            }
            let response = self
                .stream
                .message()
                .await
                .map_err(|status| EtcdError::status("Watch", &status))?
                .ok_or(EtcdError::WatchEnded)?;
            self.accept(response)?;
        }
    }

    fn accept(&mut self, response: pb::WatchResponse) -> Result<(), EtcdError> {
        if response.canceled || response.compact_revision > 0 {
            return Err(EtcdError::WatchCancelled {
                reason: response.cancel_reason,
                compact_revision: response.compact_revision,
            });
        }
        for event in response.events {
            let Some(kv) = event.kv else {
                continue;
            };
            let change = match pb::event::EventType::try_from(event.r#type) {
                Ok(pb::event::EventType::Put) => EtcdChange::Put(kv.into()),
                Ok(pb::event::EventType::Delete) => EtcdChange::Delete { key: kv.key },
                // An event type this client does not know: not a change it can apply.
                Err(_) => continue,
            };
            self.pending.push_back(change);
        }
        Ok(())
    }
}

/// The end of the key range holding every key that starts with `prefix` (etcd's rule:
/// the prefix with its last byte below 0xff incremented and the rest cut; `\0` for "to
/// the end of the keyspace" when every byte is 0xff).
pub(crate) fn prefix_end(prefix: &[u8]) -> Vec<u8> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < 0xff {
            end.push(last + 1);
            return end;
        }
    }
    vec![0]
}

/// The smallest key after `key`.
fn successor(key: &[u8]) -> Vec<u8> {
    let mut next = Vec::with_capacity(key.len() + 1);
    next.extend_from_slice(key);
    next.push(0);
    next
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_end_increments_the_last_byte_below_0xff() {
        assert_eq!(prefix_end(b"v1/mdc/"), b"v1/mdc0".to_vec());
        assert_eq!(prefix_end(b"a\xff\xff"), b"b".to_vec());
        assert_eq!(prefix_end(b"\xff"), vec![0]);
        assert_eq!(prefix_end(b""), vec![0]);
    }

    #[test]
    fn successor_is_the_next_key() {
        assert_eq!(successor(b"k"), b"k\0".to_vec());
        assert!(successor(b"k").as_slice() > b"k".as_slice());
    }

    #[test]
    fn receive_limit_fits_one_largest_record() {
        let limits = EtcdClientLimits {
            max_record_bytes: 1000,
            ..EtcdClientLimits::default()
        };
        assert_eq!(limits.max_message_bytes(), 1000 + MESSAGE_OVERHEAD_BYTES);
    }

    #[tokio::test]
    async fn no_endpoint_and_bad_urls_are_refused() {
        let limits = EtcdClientLimits::default();
        assert_eq!(
            EtcdClient::connect(&[], limits).await.unwrap_err(),
            EtcdError::NoEndpoints
        );
        let error = EtcdClient::connect(&["not a url".to_owned()], limits)
            .await
            .unwrap_err();
        assert!(
            matches!(error, EtcdError::InvalidEndpoint { .. }),
            "{error}"
        );
    }
}
