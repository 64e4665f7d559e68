//! [`EtcdDiscovery`]: model cards in etcd, under the reference runtime's key layout.
//!
//! Keys are `v1/mdc/<namespace>/<component>/<endpoint>/<instance_id hex>[/<suffix>]`, values
//! the discovery record JSON. A listing is one prefix range read; its revision starts the
//! watch (`revision + 1`), so listing and watch are consistent. A cancelled or compacted
//! watch, or a broken stream, ends the watch with an error and the caller rebinds.

use std::collections::VecDeque;
use std::time::Duration;

use etcd_client::{
    Client, ConnectOptions, EventType, GetOptions, WatchOptions, WatchStream, Watcher,
};
use futures::StreamExt;

use crate::discovery::{Discovery, DiscoveryError, DiscoveryFuture, DiscoveryWatch};
use crate::instance::{DiscoveryEvent, DiscoveryQuery, ModelCardInstance, ModelCardInstanceId};

/// The key prefix of model card records.
pub const ETCD_CARD_PREFIX: &str = "v1/mdc/";

/// Default connect and request timeout.
pub const DEFAULT_ETCD_TIMEOUT: Duration = Duration::from_secs(5);

/// Discovery backed by an etcd cluster.
#[derive(Clone)]
pub struct EtcdDiscovery {
    client: Client,
    endpoints: String,
}

impl std::fmt::Debug for EtcdDiscovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdDiscovery")
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

impl EtcdDiscovery {
    /// Connects to `endpoints` (`http://host:port`), failing after `timeout`.
    pub async fn connect(endpoints: &[String], timeout: Duration) -> Result<Self, DiscoveryError> {
        let joined = endpoints.join(",");
        let options = ConnectOptions::new()
            .with_connect_timeout(timeout)
            .with_timeout(timeout);
        let client = Client::connect(endpoints, Some(options))
            .await
            .map_err(|error| DiscoveryError::Etcd {
                endpoints: joined.clone(),
                reason: error.to_string(),
            })?;
        Ok(Self {
            client,
            endpoints: joined,
        })
    }

    /// Publishes (or replaces) a card record.
    pub async fn put_card(&self, instance: &ModelCardInstance) -> Result<(), DiscoveryError> {
        let mut client = self.client.clone();
        client
            .put(card_key(&instance.id), instance.to_record_json(), None)
            .await
            .map_err(|error| self.error(&error))?;
        Ok(())
    }

    /// Withdraws a card record.
    pub async fn delete_card(&self, id: &ModelCardInstanceId) -> Result<(), DiscoveryError> {
        let mut client = self.client.clone();
        client
            .delete(card_key(id), None)
            .await
            .map_err(|error| self.error(&error))?;
        Ok(())
    }

    fn error(&self, error: &etcd_client::Error) -> DiscoveryError {
        DiscoveryError::Etcd {
            endpoints: self.endpoints.clone(),
            reason: error.to_string(),
        }
    }

    /// The listing of `prefix` and the revision it was read at.
    async fn list_prefix(
        &self,
        prefix: &str,
    ) -> Result<(Vec<ModelCardInstance>, i64), DiscoveryError> {
        let mut client = self.client.clone();
        let response = client
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|error| self.error(&error))?;
        let revision = response.header().map_or(0, |header| header.revision());
        let instances = response
            .kvs()
            .iter()
            .filter_map(|kv| decode_record(kv.key(), kv.value()))
            .collect();
        Ok((instances, revision))
    }
}

/// The etcd key of a card.
pub fn card_key(id: &ModelCardInstanceId) -> String {
    format!("{ETCD_CARD_PREFIX}{}", id.to_path())
}

fn query_prefix(query: &DiscoveryQuery) -> String {
    match query {
        DiscoveryQuery::AllModels => ETCD_CARD_PREFIX.to_owned(),
        DiscoveryQuery::NamespacedModels { namespace } => {
            format!("{ETCD_CARD_PREFIX}{namespace}/")
        }
    }
}

fn decode_record(key: &[u8], value: &[u8]) -> Option<ModelCardInstance> {
    match ModelCardInstance::from_record_json(value) {
        Ok(instance) => Some(instance),
        Err(error) => {
            tracing::warn!(key = %String::from_utf8_lossy(key), %error, "etcd card record skipped");
            None
        }
    }
}

fn decode_removed_key(key: &[u8]) -> Option<ModelCardInstanceId> {
    let key = std::str::from_utf8(key).ok()?;
    ModelCardInstanceId::from_path(key.strip_prefix(ETCD_CARD_PREFIX)?).ok()
}

/// The open watch: the watcher handle must live as long as the stream.
struct OpenWatch {
    _watcher: Watcher,
    stream: WatchStream,
    pending: VecDeque<DiscoveryEvent>,
    prefix: String,
    endpoints: String,
}

impl OpenWatch {
    async fn next_event(&mut self) -> Option<Result<DiscoveryEvent, DiscoveryError>> {
        loop {
            if let Some(event) = self.pending.pop_front() {
                return Some(Ok(event));
            }
            let response = match self.stream.next().await? {
                Ok(response) => response,
                Err(error) => {
                    return Some(Err(DiscoveryError::Etcd {
                        endpoints: self.endpoints.clone(),
                        reason: error.to_string(),
                    }));
                }
            };
            if response.canceled() || response.compact_revision() > 0 {
                return Some(Err(DiscoveryError::WatchCancelled {
                    prefix: self.prefix.clone(),
                    reason: format!(
                        "{} (compact revision {})",
                        response.cancel_reason(),
                        response.compact_revision()
                    ),
                }));
            }
            for event in response.events() {
                let Some(kv) = event.kv() else {
                    continue;
                };
                let decoded = match event.event_type() {
                    EventType::Put => {
                        decode_record(kv.key(), kv.value()).map(DiscoveryEvent::Added)
                    }
                    EventType::Delete => decode_removed_key(kv.key()).map(DiscoveryEvent::Removed),
                };
                self.pending.extend(decoded);
            }
        }
    }
}

impl Discovery for EtcdDiscovery {
    fn list<'a>(
        &'a self,
        query: &'a DiscoveryQuery,
    ) -> DiscoveryFuture<'a, Vec<ModelCardInstance>> {
        Box::pin(async move { Ok(self.list_prefix(&query_prefix(query)).await?.0) })
    }

    fn list_and_watch<'a>(
        &'a self,
        query: &'a DiscoveryQuery,
    ) -> DiscoveryFuture<'a, (Vec<ModelCardInstance>, DiscoveryWatch)> {
        Box::pin(async move {
            let prefix = query_prefix(query);
            let (instances, revision) = self.list_prefix(&prefix).await?;
            let options = WatchOptions::new()
                .with_prefix()
                .with_start_revision(revision.saturating_add(1));
            let mut client = self.client.clone();
            let (watcher, stream) = client
                .watch(prefix.as_str(), Some(options))
                .await
                .map_err(|error| self.error(&error))?;
            let open = OpenWatch {
                _watcher: watcher,
                stream,
                pending: VecDeque::new(),
                prefix,
                endpoints: self.endpoints.clone(),
            };
            let events = futures::stream::unfold(Some(open), |open| async move {
                let mut open = open?;
                match open.next_event().await? {
                    Ok(event) => Some((Ok(event), Some(open))),
                    Err(error) => Some((Err(error), None)),
                }
            });
            Ok((instances, DiscoveryWatch::from_stream(events)))
        })
    }
}
