//! Card instances as discovery stores them: the instance id, the stored JSON record, and the
//! events a discovery watch yields.

use std::fmt;

use kvrelay_identity::{EndpointId, EndpointIdError};

/// Identifies one published card: a worker (`instance_id`) on an endpoint, plus the model
/// suffix that adapter (LoRA) cards carry.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ModelCardInstanceId {
    /// Dynamo namespace.
    pub namespace: String,
    /// Component within the namespace.
    pub component: String,
    /// Endpoint name within the component.
    pub endpoint: String,
    /// The worker: its discovery connection (lease) id.
    pub instance_id: u64,
    /// Present on adapter cards: one worker may publish a base card and several adapters.
    pub model_suffix: Option<String>,
}

/// Why a card instance path could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InstancePathError {
    /// The path does not have 4 or 5 `/`-separated parts.
    #[error("card instance path {path:?} has {n_parts} parts, expected 4 or 5")]
    PartCount {
        /// The offending path.
        path: String,
        /// How many parts it has.
        n_parts: usize,
    },
    /// The instance id part is not lowercase or uppercase hex fitting a u64.
    #[error("card instance path {path:?} has instance id {instance:?}, expected hex u64")]
    InstanceId {
        /// The offending path.
        path: String,
        /// The instance id part.
        instance: String,
    },
}

impl ModelCardInstanceId {
    /// The endpoint this card belongs to; fails when a part is empty or padded.
    pub fn endpoint_id(&self) -> Result<EndpointId, EndpointIdError> {
        EndpointId::new(&self.namespace, &self.component, &self.endpoint)
    }

    /// The discovery key path: `ns/comp/ep/<instance_id hex>[/<suffix>]`.
    pub fn to_path(&self) -> String {
        let mut path = format!(
            "{}/{}/{}/{:x}",
            self.namespace, self.component, self.endpoint, self.instance_id
        );
        if let Some(suffix) = &self.model_suffix {
            path.push('/');
            path.push_str(suffix);
        }
        path
    }

    /// Parses [`ModelCardInstanceId::to_path`] output (4 or 5 parts, hex instance id).
    pub fn from_path(path: &str) -> Result<Self, InstancePathError> {
        let parts: Vec<&str> = path.split('/').collect();
        let (namespace, component, endpoint, instance, suffix) = match parts.as_slice() {
            [ns, comp, ep, id] => (*ns, *comp, *ep, *id, None),
            [ns, comp, ep, id, suffix] => (*ns, *comp, *ep, *id, Some(*suffix)),
            _ => {
                return Err(InstancePathError::PartCount {
                    path: path.to_owned(),
                    n_parts: parts.len(),
                });
            }
        };
        let instance_id =
            u64::from_str_radix(instance, 16).map_err(|_| InstancePathError::InstanceId {
                path: path.to_owned(),
                instance: instance.to_owned(),
            })?;
        Ok(Self {
            namespace: namespace.to_owned(),
            component: component.to_owned(),
            endpoint: endpoint.to_owned(),
            instance_id,
            model_suffix: suffix.map(str::to_owned),
        })
    }
}

/// The key path with control characters escaped (`\n` as `\u{a}`): ids come from
/// peers (etcd keys, file names, record fields), and one holding a newline must not forge
/// a log line. Keys are built with [`ModelCardInstanceId::to_path`], never with this.
impl fmt::Display for ModelCardInstanceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write as _;
        for c in self.to_path().chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_unicode())?;
            } else {
                f.write_char(c)?;
            }
        }
        Ok(())
    }
}

/// One published card: its id and the card JSON exactly as stored (decoded later, so a
/// malformed card is a soft error of the projection, not of the backend).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelCardInstance {
    /// Which card this is.
    pub id: ModelCardInstanceId,
    /// The card as JSON (`card_json` of the stored record).
    pub card_json: serde_json::Value,
}

/// Why a stored discovery record could not be read as a card instance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InstanceRecordError {
    /// The bytes are not a JSON discovery record of the expected shape.
    #[error("discovery record is not valid model instance json: {reason}")]
    Json {
        /// The JSON parser's message.
        reason: String,
    },
    /// The record is a discovery entry of another kind (`Endpoint`, `EventSource`, ...).
    #[error("discovery record has type {kind:?}, expected \"Model\"")]
    NotAModel {
        /// The record's `type`.
        kind: String,
    },
}

impl ModelCardInstance {
    /// Reads the discovery record JSON the reference runtime stores for a card
    /// (`{"type":"Model","namespace",..,"instance_id",..,"model_suffix"?,"card_json":{..}}`).
    pub fn from_record_json(bytes: &[u8]) -> Result<Self, InstanceRecordError> {
        let value: serde_json::Value =
            serde_json::from_slice(bytes).map_err(|error| InstanceRecordError::Json {
                reason: error.to_string(),
            })?;
        let kind = value
            .get("type")
            .and_then(serde_json::Value::as_str)
            .unwrap_or_default();
        if kind != "Model" {
            return Err(InstanceRecordError::NotAModel {
                kind: kind.to_owned(),
            });
        }
        let record: record::ModelRecord =
            serde_json::from_value(value).map_err(|error| InstanceRecordError::Json {
                reason: error.to_string(),
            })?;
        Ok(record.into_instance())
    }

    /// The stored record JSON, as [`ModelCardInstance::from_record_json`] reads it.
    pub fn to_record_json(&self) -> String {
        let record = record::ModelRecordRef {
            kind: "Model",
            namespace: &self.id.namespace,
            component: &self.id.component,
            endpoint: &self.id.endpoint,
            instance_id: self.id.instance_id,
            model_suffix: self.id.model_suffix.as_deref(),
            card_json: &self.card_json,
        };
        // Serialising borrowed strings, a u64 and a `Value` into a String cannot fail.
        serde_json::to_string(&record).unwrap_or_default()
    }
}

/// A change reported by a discovery watch.
#[derive(Debug, Clone, PartialEq)]
pub enum DiscoveryEvent {
    /// A card was published or replaced.
    Added(ModelCardInstance),
    /// A card was withdrawn.
    Removed(ModelCardInstanceId),
    /// Only the card's `runtime_config.taints` changed.
    TaintsUpdated {
        /// Which card.
        id: ModelCardInstanceId,
        /// The new taint set.
        taints: Vec<String>,
    },
}

/// What a discovery backend is asked to list and watch.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum DiscoveryQuery {
    /// Every card in the store.
    AllModels,
    /// The cards of one namespace.
    NamespacedModels {
        /// The namespace.
        namespace: String,
    },
}

impl DiscoveryQuery {
    /// Whether a card with this id belongs to the query's result.
    pub fn matches(&self, id: &ModelCardInstanceId) -> bool {
        match self {
            Self::AllModels => true,
            Self::NamespacedModels { namespace } => &id.namespace == namespace,
        }
    }
}

mod record {
    //! The stored JSON shape of a model discovery record.

    use super::{ModelCardInstance, ModelCardInstanceId};
    use serde::{Deserialize, Serialize};

    #[derive(Deserialize)]
    pub(super) struct ModelRecord {
        namespace: String,
        component: String,
        endpoint: String,
        instance_id: u64,
        #[serde(default)]
        model_suffix: Option<String>,
        card_json: serde_json::Value,
    }

    impl ModelRecord {
        pub(super) fn into_instance(self) -> ModelCardInstance {
            ModelCardInstance {
                id: ModelCardInstanceId {
                    namespace: self.namespace,
                    component: self.component,
                    endpoint: self.endpoint,
                    instance_id: self.instance_id,
                    model_suffix: self.model_suffix,
                },
                card_json: self.card_json,
            }
        }
    }

    #[derive(Serialize)]
    pub(super) struct ModelRecordRef<'a> {
        #[serde(rename = "type")]
        pub(super) kind: &'static str,
        pub(super) namespace: &'a str,
        pub(super) component: &'a str,
        pub(super) endpoint: &'a str,
        pub(super) instance_id: u64,
        #[serde(skip_serializing_if = "Option::is_none")]
        pub(super) model_suffix: Option<&'a str>,
        pub(super) card_json: &'a serde_json::Value,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_escapes_control_characters_so_ids_cannot_forge_log_lines() {
        let id = ModelCardInstanceId {
            namespace: "prod\nWARN forged".into(),
            component: "backend".into(),
            endpoint: "generate\r".into(),
            instance_id: 1,
            model_suffix: None,
        };
        let shown = id.to_string();
        assert!(!shown.contains('\n') && !shown.contains('\r'), "{shown}");
        assert!(shown.contains("prod\\u{a}WARN forged"), "{shown}");
        assert!(id.to_path().contains('\n'), "keys keep the raw text");
    }

    fn id(suffix: Option<&str>) -> ModelCardInstanceId {
        ModelCardInstanceId {
            namespace: "bench".into(),
            component: "worker".into(),
            endpoint: "generate".into(),
            instance_id: 0x9e1f_5065_d819_3fef,
            model_suffix: suffix.map(str::to_owned),
        }
    }

    #[test]
    fn instance_path_uses_hex_instance_and_optional_suffix() {
        assert_eq!(id(None).to_path(), "bench/worker/generate/9e1f5065d8193fef");
        assert_eq!(
            id(Some("tenant-a")).to_path(),
            "bench/worker/generate/9e1f5065d8193fef/tenant-a"
        );
        for suffix in [None, Some("tenant-a")] {
            let parsed = ModelCardInstanceId::from_path(&id(suffix).to_path()).unwrap();
            assert_eq!(parsed, id(suffix));
        }
    }

    #[test]
    fn instance_path_with_wrong_shape_is_rejected() {
        assert!(matches!(
            ModelCardInstanceId::from_path("a/b/c"),
            Err(InstancePathError::PartCount { n_parts: 3, .. })
        ));
        assert!(matches!(
            ModelCardInstanceId::from_path("a/b/c/zz"),
            Err(InstancePathError::InstanceId { .. })
        ));
    }

    #[test]
    fn reference_record_decodes_and_round_trips() {
        let json =
            br#"{"type":"Model","namespace":"bench","component":"worker","endpoint":"generate",
            "instance_id":11393913980618096623,"card_json":{"display_name":"fake-model"}}"#;
        let instance = ModelCardInstance::from_record_json(json).unwrap();
        assert_eq!(instance.id, id(None));
        let again = ModelCardInstance::from_record_json(instance.to_record_json().as_bytes());
        assert_eq!(again.unwrap(), instance);
    }

    #[test]
    fn non_model_record_is_rejected_by_kind() {
        let json = br#"{"type":"Endpoint","namespace":"bench"}"#;
        assert_eq!(
            ModelCardInstance::from_record_json(json),
            Err(InstanceRecordError::NotAModel {
                kind: "Endpoint".into()
            })
        );
    }
}
