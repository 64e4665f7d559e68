//! KV event sources advertised in discovery: the reference runtime's `EventSource` and
//! `EventChannel` records, parsed and joined into engine sources. Pure (no IO).
//!
//! An `EventSource` record names one `(worker_id, dp_rank)` of a KV-state endpoint and the
//! random publisher id of its event publisher; the `EventChannel` record with that
//! publisher id as its `instance_id` says where the publisher's events are read (a ZMQ
//! endpoint). [`join`] pairs them into [`SourceConfig`]s, and [`merge`] adds them to the
//! statically configured `[[sources]]`, the configuration winning on a `(worker, rank)`
//! conflict. Unknown fields are ignored, as the reference runtime adds fields over time.
//!
//! A channel carries Dynamo's event plane (the envelopes a Dynamo worker's
//! `KvEventPublisher` publishes), read from the advertised publisher only; an optional
//! `engine` key in the metadata (`vllm`, `sglang`; not written by Dynamo) says an engine
//! publishes its own batches there instead. Not used: the recovery target (a request-plane
//! query endpoint, which the ZMQ source cannot call; a reconnect without replay resets the
//! source, as for any publisher without a replay endpoint).

use std::collections::{BTreeMap, BTreeSet};

use kvrelay_identity::EndpointId;
use serde::Deserialize;

use crate::config::{SourceConfig, SourceEngine};

/// The topic of KV event adverts; very old runtimes used [`LEGACY_KV_EVENTS_TOPIC`].
pub(crate) const KV_EVENTS_TOPIC: &str = "kv-events";
/// The topic of KV event adverts in very old runtimes.
pub(crate) const LEGACY_KV_EVENTS_TOPIC: &str = "kv_events";

/// A discovery record that is not a usable KV event advert.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum AdvertError {
    /// Not JSON of the expected shape.
    #[error("advert record is malformed: {reason}")]
    Malformed {
        /// The JSON parser's message.
        reason: String,
    },
    /// A record of another type (e.g. `Endpoint` or `Model`).
    #[error("advert record type {found:?} is not {expected}")]
    WrongType {
        /// The type the caller asked for.
        expected: &'static str,
        /// The record's `type`.
        found: String,
    },
    /// The scope is not a single endpoint.
    #[error("advert scope kind {kind:?} is not endpoint")]
    WrongScope {
        /// The scope's `kind`.
        kind: String,
    },
    /// The topic is not the KV events topic.
    #[error("advert topic {topic:?} is not {KV_EVENTS_TOPIC}")]
    WrongTopic {
        /// The record's topic.
        topic: String,
    },
    /// An endpoint name that is not a valid endpoint id.
    #[error("advert endpoint {value:?} is invalid")]
    InvalidEndpoint {
        /// The endpoint as `namespace.component.name`.
        value: String,
    },
    /// The metadata names another publisher than the record.
    #[error("advert publisher id {record} disagrees with its metadata publisher id {metadata}")]
    PublisherMismatch {
        /// The record's `publisher_id`.
        record: u64,
        /// The metadata's `publisher_id`.
        metadata: u64,
    },
    /// The record is scoped to another endpoint than its KV-state endpoint.
    #[error("advert scope {scope} is not its kv-state endpoint {kv_state}")]
    ScopeMismatch {
        /// The scope endpoint, dotted.
        scope: String,
        /// The metadata's KV-state endpoint, dotted.
        kv_state: String,
    },
    /// A channel on a transport other than ZMQ.
    #[error("event channel transport {kind:?} is not Zmq")]
    UnsupportedTransport {
        /// The transport's `kind`.
        kind: String,
    },
}

/// One `EventSource` record: a KV event source for one `(worker, rank)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SourceAdvert {
    /// The KV-state endpoint the events belong to.
    pub(crate) endpoint: EndpointId,
    /// The event publisher's id (joins the channel's `instance_id`).
    pub(crate) publisher_id: u64,
    /// The worker.
    pub(crate) worker_id: u64,
    /// The data-parallel rank.
    pub(crate) dp_rank: u32,
    /// The engine, when the metadata names one.
    pub(crate) engine: Option<SourceEngine>,
    /// Whether the advert carries a recovery target.
    pub(crate) recoverable: bool,
}

/// One `EventChannel` record on ZMQ: where a publisher's events are read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChannelAdvert {
    /// The endpoint scope of the channel.
    pub(crate) endpoint: EndpointId,
    /// The publisher's id.
    pub(crate) publisher_id: u64,
    /// The ZMQ PUB endpoint, e.g. `tcp://10.0.0.5:46207`.
    pub(crate) zmq: String,
}

#[derive(Deserialize)]
struct RecordType {
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct Scope {
    kind: String,
    endpoint: Option<EndpointRef>,
}

#[derive(Deserialize)]
struct EndpointRef {
    namespace: String,
    component: String,
    name: String,
}

#[derive(Deserialize)]
struct SourceRecord {
    scope: Scope,
    topic: String,
    publisher_id: u64,
    metadata: serde_json::Value,
}

#[derive(Deserialize)]
struct SourceMetadata {
    kv_state_endpoint: EndpointRef,
    worker: WorkerRef,
    publisher_id: u64,
    #[serde(default)]
    recovery_target: Option<serde_json::Value>,
    #[serde(default)]
    engine: Option<SourceEngine>,
}

#[derive(Deserialize)]
struct WorkerRef {
    worker_id: u64,
    #[serde(default)]
    dp_rank: u32,
}

#[derive(Deserialize)]
struct ChannelRecord {
    scope: Scope,
    topic: String,
    instance_id: u64,
    transport: Transport,
}

#[derive(Deserialize)]
struct Transport {
    kind: String,
    #[serde(default)]
    config: Option<ZmqTransport>,
}

#[derive(Deserialize)]
struct ZmqTransport {
    endpoint: String,
}

fn malformed(err: &serde_json::Error) -> AdvertError {
    AdvertError::Malformed {
        reason: err.to_string(),
    }
}

fn check_type(text: &str, expected: &'static str) -> Result<(), AdvertError> {
    let record: RecordType = serde_json::from_str(text).map_err(|err| malformed(&err))?;
    if record.kind == expected {
        Ok(())
    } else {
        Err(AdvertError::WrongType {
            expected,
            found: record.kind,
        })
    }
}

fn check_topic(topic: String) -> Result<(), AdvertError> {
    if topic == KV_EVENTS_TOPIC || topic == LEGACY_KV_EVENTS_TOPIC {
        Ok(())
    } else {
        Err(AdvertError::WrongTopic { topic })
    }
}

/// A valid endpoint id whose parts have no `.` (sources name endpoints dotted).
fn endpoint_id(endpoint: &EndpointRef) -> Result<EndpointId, AdvertError> {
    let invalid = || AdvertError::InvalidEndpoint {
        value: format!(
            "{}.{}.{}",
            endpoint.namespace, endpoint.component, endpoint.name
        ),
    };
    let parts = [&endpoint.namespace, &endpoint.component, &endpoint.name];
    if parts.iter().any(|part| part.contains('.')) {
        return Err(invalid());
    }
    EndpointId::new(&endpoint.namespace, &endpoint.component, &endpoint.name).map_err(|_| invalid())
}

fn scope_endpoint(scope: Scope) -> Result<EndpointId, AdvertError> {
    match (scope.kind.as_str(), &scope.endpoint) {
        ("endpoint", Some(endpoint)) => endpoint_id(endpoint),
        _ => Err(AdvertError::WrongScope { kind: scope.kind }),
    }
}

/// Parses one `EventSource` record (its metadata may be an object or a JSON string).
pub(crate) fn parse_source(text: &str) -> Result<SourceAdvert, AdvertError> {
    check_type(text, "EventSource")?;
    let record: SourceRecord = serde_json::from_str(text).map_err(|err| malformed(&err))?;
    check_topic(record.topic)?;
    let scope = scope_endpoint(record.scope)?;
    let metadata: SourceMetadata = match record.metadata {
        serde_json::Value::String(inner) => serde_json::from_str(&inner),
        value => serde_json::from_value(value),
    }
    .map_err(|err| malformed(&err))?;
    if metadata.publisher_id != record.publisher_id {
        return Err(AdvertError::PublisherMismatch {
            record: record.publisher_id,
            metadata: metadata.publisher_id,
        });
    }
    let kv_state = endpoint_id(&metadata.kv_state_endpoint)?;
    if kv_state != scope {
        return Err(AdvertError::ScopeMismatch {
            scope: scope.dotted(),
            kv_state: kv_state.dotted(),
        });
    }
    Ok(SourceAdvert {
        endpoint: scope,
        publisher_id: record.publisher_id,
        worker_id: metadata.worker.worker_id,
        dp_rank: metadata.worker.dp_rank,
        engine: metadata.engine,
        recoverable: metadata
            .recovery_target
            .is_some_and(|target| !target.is_null()),
    })
}

/// Parses one `EventChannel` record on the ZMQ transport.
pub(crate) fn parse_channel(text: &str) -> Result<ChannelAdvert, AdvertError> {
    check_type(text, "EventChannel")?;
    let record: ChannelRecord = serde_json::from_str(text).map_err(|err| malformed(&err))?;
    check_topic(record.topic)?;
    let endpoint = scope_endpoint(record.scope)?;
    let zmq = match (record.transport.kind.as_str(), record.transport.config) {
        ("Zmq", Some(config)) if !config.endpoint.is_empty() => config.endpoint,
        _ => {
            return Err(AdvertError::UnsupportedTransport {
                kind: record.transport.kind,
            });
        }
    };
    Ok(ChannelAdvert {
        endpoint,
        publisher_id: record.instance_id,
        zmq,
    })
}

/// Pairs each source advert with the channel of its publisher (same endpoint scope); a
/// source without a channel has nowhere to be read and is left out. Sorted by
/// `(worker, rank)`; when several adverts claim one `(worker, rank)` the lowest publisher
/// id is kept (an ambiguous source, resolved deterministically).
pub(crate) fn join(sources: &[SourceAdvert], channels: &[ChannelAdvert]) -> Vec<SourceConfig> {
    let by_publisher: BTreeMap<(u64, &EndpointId), &ChannelAdvert> = channels
        .iter()
        .map(|channel| ((channel.publisher_id, &channel.endpoint), channel))
        .collect();
    let mut joined: BTreeMap<(u64, u32), (u64, SourceConfig)> = BTreeMap::new();
    for source in sources {
        let Some(channel) = by_publisher.get(&(source.publisher_id, &source.endpoint)) else {
            continue;
        };
        let key = (source.worker_id, source.dp_rank);
        if joined
            .get(&key)
            .is_some_and(|(publisher, _)| *publisher <= source.publisher_id)
        {
            continue;
        }
        joined.insert(
            key,
            (
                source.publisher_id,
                SourceConfig {
                    endpoint: source.endpoint.dotted(),
                    worker_id: source.worker_id,
                    dp_rank: source.dp_rank,
                    // What a Dynamo worker's advertised channel carries, unless the
                    // advert names an engine publishing its own batches there.
                    engine: source.engine.unwrap_or(SourceEngine::Dynamo),
                    zmq: channel.zmq.clone(),
                    replay: None,
                    metrics_url: None,
                    publisher_id: match source.engine {
                        None | Some(SourceEngine::Dynamo) => Some(source.publisher_id),
                        Some(SourceEngine::Vllm | SourceEngine::Sglang) => None,
                    },
                },
            ),
        );
    }
    joined.into_values().map(|(_, source)| source).collect()
}

/// Configured sources plus discovered ones; a discovered source whose `(worker, rank)` is
/// configured is dropped and its key returned as a conflict.
pub(crate) fn merge(
    configured: &[SourceConfig],
    discovered: Vec<SourceConfig>,
) -> (Vec<SourceConfig>, BTreeSet<(u64, u32)>) {
    let taken: BTreeSet<(u64, u32)> = configured
        .iter()
        .map(|source| (source.worker_id, source.dp_rank))
        .collect();
    let mut merged = configured.to_vec();
    let mut conflicts = BTreeSet::new();
    for source in discovered {
        let key = (source.worker_id, source.dp_rank);
        if taken.contains(&key) {
            conflicts.insert(key);
        } else {
            merged.push(source);
        }
    }
    (merged, conflicts)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    const SOURCE_FIXTURE: &str = include_str!(
        "../tests/fixtures/discovery/event_sources/namespace%2Fbench%2Fcomponent%2Fworker%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2Fda7f641dba047"
    );
    const CHANNEL_FIXTURE: &str = include_str!(
        "../tests/fixtures/discovery/event_channels/namespace%2Fbench%2Fcomponent%2Fworker%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2Fda7f641dba047"
    );

    fn endpoint() -> EndpointId {
        EndpointId::new("bench", "worker", "generate").unwrap()
    }

    fn edited(text: &str, edit: impl FnOnce(&mut serde_json::Value)) -> String {
        let mut value: serde_json::Value = serde_json::from_str(text).unwrap();
        edit(&mut value);
        value.to_string()
    }

    #[test]
    fn reference_event_source_record_parses() {
        let advert = parse_source(SOURCE_FIXTURE).unwrap();
        assert_eq!(
            advert,
            SourceAdvert {
                endpoint: endpoint(),
                publisher_id: 3_843_850_805_944_391,
                worker_id: 11_393_913_980_618_096_623,
                dp_rank: 0,
                engine: None,
                recoverable: true,
            }
        );
    }

    #[test]
    fn reference_event_channel_record_parses() {
        let channel = parse_channel(CHANNEL_FIXTURE).unwrap();
        assert_eq!(
            channel,
            ChannelAdvert {
                endpoint: endpoint(),
                publisher_id: 3_843_850_805_944_391,
                zmq: "tcp://127.0.0.1:46207".to_owned(),
            }
        );
    }

    #[test]
    fn reference_records_join_into_one_event_plane_source() {
        let joined = join(
            &[parse_source(SOURCE_FIXTURE).unwrap()],
            &[parse_channel(CHANNEL_FIXTURE).unwrap()],
        );
        assert_eq!(
            joined,
            vec![SourceConfig {
                endpoint: "bench.worker.generate".to_owned(),
                worker_id: 11_393_913_980_618_096_623,
                dp_rank: 0,
                engine: SourceEngine::Dynamo,
                zmq: "tcp://127.0.0.1:46207".to_owned(),
                replay: None,
                metrics_url: None,
                publisher_id: Some(3_843_850_805_944_391),
            }]
        );
    }

    #[test]
    fn an_advert_naming_an_engine_reads_that_engine_s_batches_without_a_publisher_filter() {
        let mut value: serde_json::Value = serde_json::from_str(SOURCE_FIXTURE).unwrap();
        value["metadata"]["engine"] = "vllm".into();
        let joined = join(
            &[parse_source(&value.to_string()).unwrap()],
            &[parse_channel(CHANNEL_FIXTURE).unwrap()],
        );
        assert_eq!(joined.len(), 1);
        assert_eq!(joined[0].engine, SourceEngine::Vllm);
        assert_eq!(joined[0].publisher_id, None);
    }

    #[test]
    fn metadata_as_a_json_string_and_an_engine_key_are_accepted() {
        let text = edited(SOURCE_FIXTURE, |value| {
            value["metadata"]["engine"] = "sglang".into();
            value["metadata"] = value["metadata"].to_string().into();
        });
        let advert = parse_source(&text).unwrap();
        assert_eq!(advert.engine, Some(SourceEngine::Sglang));
        assert_eq!(advert.worker_id, 11_393_913_980_618_096_623);
    }

    #[test]
    fn advert_without_recovery_target_is_live_only() {
        let text = edited(SOURCE_FIXTURE, |value| {
            value["metadata"]
                .as_object_mut()
                .unwrap()
                .remove("recovery_target");
        });
        assert!(!parse_source(&text).unwrap().recoverable);
    }

    #[test]
    fn malformed_records_are_typed_errors() {
        assert!(matches!(
            parse_source("{not json"),
            Err(AdvertError::Malformed { .. })
        ));
        assert_eq!(
            parse_source(CHANNEL_FIXTURE),
            Err(AdvertError::WrongType {
                expected: "EventSource",
                found: "EventChannel".to_owned()
            })
        );
        let missing_worker = edited(SOURCE_FIXTURE, |value| {
            value["metadata"].as_object_mut().unwrap().remove("worker");
        });
        assert!(matches!(
            parse_source(&missing_worker),
            Err(AdvertError::Malformed { .. })
        ));
        let namespace_scope = edited(SOURCE_FIXTURE, |value| {
            value["scope"] = serde_json::json!({"kind": "namespace", "namespace": "bench"});
        });
        assert_eq!(
            parse_source(&namespace_scope),
            Err(AdvertError::WrongScope {
                kind: "namespace".to_owned()
            })
        );
        let metrics_topic = edited(SOURCE_FIXTURE, |value| {
            value["topic"] = "kv_metrics".into();
        });
        assert_eq!(
            parse_source(&metrics_topic),
            Err(AdvertError::WrongTopic {
                topic: "kv_metrics".to_owned()
            })
        );
        let other_publisher = edited(SOURCE_FIXTURE, |value| {
            value["metadata"]["publisher_id"] = 5.into();
        });
        assert_eq!(
            parse_source(&other_publisher),
            Err(AdvertError::PublisherMismatch {
                record: 3_843_850_805_944_391,
                metadata: 5
            })
        );
        let other_kv_state = edited(SOURCE_FIXTURE, |value| {
            value["metadata"]["kv_state_endpoint"]["name"] = "prefill".into();
        });
        assert!(matches!(
            parse_source(&other_kv_state),
            Err(AdvertError::ScopeMismatch { .. })
        ));
        let bad_endpoint = edited(SOURCE_FIXTURE, |value| {
            value["scope"]["endpoint"]["namespace"] = "".into();
        });
        assert!(matches!(
            parse_source(&bad_endpoint),
            Err(AdvertError::InvalidEndpoint { .. })
        ));
        let dotted_part = edited(CHANNEL_FIXTURE, |value| {
            value["scope"]["endpoint"]["component"] = "a.b".into();
        });
        assert!(matches!(
            parse_channel(&dotted_part),
            Err(AdvertError::InvalidEndpoint { .. })
        ));
        let nats = edited(CHANNEL_FIXTURE, |value| {
            value["transport"] = serde_json::json!({"kind": "Nats"});
        });
        assert_eq!(
            parse_channel(&nats),
            Err(AdvertError::UnsupportedTransport {
                kind: "Nats".to_owned()
            })
        );
    }

    #[test]
    fn source_without_a_channel_of_its_publisher_is_left_out() {
        let source = parse_source(SOURCE_FIXTURE).unwrap();
        let mut channel = parse_channel(CHANNEL_FIXTURE).unwrap();
        channel.publisher_id += 1;
        assert!(
            join(
                std::slice::from_ref(&source),
                std::slice::from_ref(&channel)
            )
            .is_empty()
        );
        channel.publisher_id -= 1;
        channel.endpoint = EndpointId::new("bench", "worker", "prefill").unwrap();
        assert!(join(&[source], &[channel]).is_empty());
    }

    #[test]
    fn duplicate_adverts_of_one_rank_keep_the_lowest_publisher() {
        let first = parse_source(SOURCE_FIXTURE).unwrap();
        let mut second = first.clone();
        second.publisher_id = 1;
        let channel = parse_channel(CHANNEL_FIXTURE).unwrap();
        let mut other_channel = channel.clone();
        other_channel.publisher_id = 1;
        other_channel.zmq = "tcp://127.0.0.1:1".to_owned();
        let joined = join(&[first, second], &[channel, other_channel]);
        assert_eq!(joined.len(), 1);
        assert_eq!(joined[0].zmq, "tcp://127.0.0.1:1");
    }

    #[test]
    fn configured_source_wins_a_conflict() {
        let discovered = join(
            &[parse_source(SOURCE_FIXTURE).unwrap()],
            &[parse_channel(CHANNEL_FIXTURE).unwrap()],
        );
        let mut configured = discovered[0].clone();
        configured.zmq = "tcp://10.0.0.1:5557".to_owned();
        let (merged, conflicts) = merge(std::slice::from_ref(&configured), discovered.clone());
        assert_eq!(merged, vec![configured]);
        assert_eq!(conflicts, BTreeSet::from([(11_393_913_980_618_096_623, 0)]));
        let (merged, conflicts) = merge(&[], discovered.clone());
        assert_eq!(merged, discovered);
        assert!(conflicts.is_empty());
    }
}
