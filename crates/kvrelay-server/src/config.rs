//! The relay's configuration: the TOML file format, overrides, and validation.
//!
//! Precedence is flags, then environment, then file, then defaults. The binary's clap layer
//! resolves flags against environment variables into one [`RelayOverrides`]; this module
//! parses the file (or starts from [`RelayConfig::default`]) and applies the overrides on top
//! with [`RelayConfig::apply`]. Nothing here touches a socket.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::limits::Limits;

mod filters;
mod listeners;
mod overrides;
mod sources;
mod state;
mod tiers;

pub use filters::{DEFAULT_DENSE_SIZE_CLASSES_PER_OCTAVE, FilterFormat, FiltersConfig};
pub(crate) use listeners::AuthTable;
pub use listeners::{
    AdminConfig, AuthConfig, DEFAULT_ADMIN_CONNECTION_TIMEOUT_MS,
    DEFAULT_ADMIN_HEADER_READ_TIMEOUT_MS, DEFAULT_ADMIN_LISTEN, DEFAULT_ADMIN_MAX_CONNECTIONS,
    DEFAULT_DYNAMO_LISTEN, DEFAULT_WAN_LISTEN, DynamoConfig, ExposureWarning, WanConfig,
};
pub use overrides::RelayOverrides;
use sources::MAX_CARD_FILE_BYTES_CEILING;
pub use sources::{
    DiscoveryBackend, DiscoveryConfig, NatsConfig, SourceConfig, SourceEngine, WorkloadConfig,
};
pub use state::{
    DEFAULT_CHECKPOINT_INTERVAL_MS, DEFAULT_CHECKPOINT_MAX_AGE_MS,
    DEFAULT_CHECKPOINT_MAX_FILE_BYTES, DEFAULT_CHECKPOINT_SHUTDOWN_TIMEOUT_MS, StateConfig,
};
pub use tiers::{
    DEFAULT_TIER_CAPACITY_RATIO, MAX_BLOCKS_PER_CHUNK, MAX_TIER_CAPACITY_RATIO, TierConfig,
    TiersConfig,
};

/// Default datacenter name.
pub const DEFAULT_DC_ID: &str = "dc-local";
/// Default trace replay speed: 0 means as fast as the pipeline accepts events.
pub const DEFAULT_REPLAY_SPEED: f64 = 0.0;

/// A configuration that failed to load or validate.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("reading config file {path}: {message}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The IO error text.
        message: String,
    },
    /// The file is not valid TOML for this schema.
    #[error("parsing config file {path}: {message}")]
    Parse {
        /// The file (`<inline>` for strings).
        path: PathBuf,
        /// The parser's message.
        message: String,
    },
    /// A limit is out of range.
    #[error("limit {name} = {value} {reason}")]
    InvalidLimit {
        /// The `[limits]` key.
        name: &'static str,
        /// The offending value.
        value: u64,
        /// What is expected.
        reason: &'static str,
    },
    /// An ingest bound (`[ingest]`, or `[nats] max_payload_bytes` applied to the NATS
    /// source's copy) is out of range.
    #[error("[{table}] {error}")]
    InvalidIngestLimit {
        /// The TOML table the value came from (`ingest` or `nats`).
        table: &'static str,
        /// What the ingest crate refused.
        error: kvrelay_ingest::LimitError,
    },
    /// A configured bearer token cannot be used (empty, over 4,096 bytes, a control
    /// character, an unreadable file). Never quotes the token.
    #[error("config field {field}: {source}")]
    Token {
        /// Dotted path of the field (`wan.auth.token`, `admin.auth.token_file`, ...).
        field: &'static str,
        /// What is wrong.
        #[source]
        source: kvrelay_tls::TokenError,
    },
    /// A field is invalid.
    #[error("config field {field} = {value:?}: {reason}")]
    InvalidField {
        /// Dotted path of the field.
        field: &'static str,
        /// The offending value.
        value: String,
        /// What is expected.
        reason: &'static str,
    },
}

/// The whole relay configuration, as read from `relay.toml`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RelayConfig {
    /// The operator's datacenter name (hashed into the `DcId`).
    pub dc_id: String,
    /// The WAN listener.
    pub wan: WanConfig,
    /// The admin HTTP listener.
    pub admin: AdminConfig,
    /// The Dynamo-contract door (gRPC), when present.
    pub dynamo: Option<DynamoConfig>,
    /// Where model cards come from.
    pub discovery: DiscoveryConfig,
    /// Statically configured engine event sources, in addition to discovered ones.
    pub sources: Vec<SourceConfig>,
    /// An optional trace to replay into the pools (the embedded workload).
    pub workload: Option<WorkloadConfig>,
    /// Dynamo router events on NATS: every discovered endpoint's KV-event subject.
    pub nats: Option<NatsConfig>,
    /// Every bound.
    pub limits: Limits,
    /// Bounds of every engine event source (decode, queues, replay, ZMQ transport); the
    /// NATS source takes its payload limit from `[nats] max_payload_bytes` instead.
    pub ingest: kvrelay_ingest::Limits,
    /// Pool checkpoints for warm restarts, when present.
    pub state: Option<StateConfig>,
    /// Lower cache tiers (host memory, disk) every pool keeps a lane of; none by default.
    pub tiers: TiersConfig,
    /// The format of every pool's filter (v1 by default, or the dense format).
    pub filters: FiltersConfig,
}

impl Default for RelayConfig {
    fn default() -> Self {
        Self {
            dc_id: DEFAULT_DC_ID.to_owned(),
            wan: WanConfig::default(),
            admin: AdminConfig::default(),
            dynamo: None,
            discovery: DiscoveryConfig::default(),
            sources: Vec::new(),
            workload: None,
            nats: None,
            limits: Limits::default(),
            ingest: kvrelay_ingest::Limits::default(),
            state: None,
            tiers: TiersConfig::default(),
            filters: FiltersConfig::default(),
        }
    }
}
impl RelayConfig {
    /// Parses a TOML document. `origin` names the file in errors.
    pub fn from_toml_str(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|err| ConfigError::Parse {
            path: origin.to_path_buf(),
            message: err.message().to_owned(),
        })
    }

    /// Reads and parses a TOML file (does not validate; call [`RelayConfig::validate`]).
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|err| ConfigError::Read {
            path: path.to_path_buf(),
            message: err.to_string(),
        })?;
        Self::from_toml_str(&text, path)
    }

    /// Applies overrides on top of this configuration.
    pub fn apply(&mut self, overrides: RelayOverrides) {
        if let Some(dc_id) = overrides.dc_id {
            self.dc_id = dc_id;
        }
        if let Some(listen) = overrides.wan_listen {
            self.wan.listen = listen;
        }
        if let Some(listen) = overrides.admin_listen {
            self.admin.listen = listen;
        }
        if overrides.admin_disabled {
            self.admin.enabled = false;
        }
        if let Some(dir) = overrides.cards_dir {
            self.discovery.backend = DiscoveryBackend::File;
            self.discovery.dir = Some(dir);
        }
        if !overrides.etcd_endpoints.is_empty() {
            self.discovery.backend = DiscoveryBackend::Etcd;
            self.discovery.etcd_endpoints = overrides.etcd_endpoints;
        }
        if let Some(trace) = overrides.trace {
            let workload = self.workload.get_or_insert(WorkloadConfig {
                trace: None,
                speed: DEFAULT_REPLAY_SPEED,
                loops: 1,
            });
            workload.trace = Some(trace);
        }
        if let Some(server) = overrides.nats_server {
            match self.nats.as_mut() {
                Some(nats) => nats.server = server,
                None => self.nats = Some(NatsConfig::plain(server)),
            }
        }
        if let (Some(speed), Some(workload)) = (overrides.replay_speed, self.workload.as_mut()) {
            workload.speed = speed;
        }
        if overrides.tls_cert.is_some() || overrides.tls_key.is_some() {
            let tls = self.wan.tls.get_or_insert(kvrelay_tls::ListenerTls {
                cert: PathBuf::new(),
                key: PathBuf::new(),
                client_ca: None,
            });
            if let Some(cert) = overrides.tls_cert {
                tls.cert = cert;
            }
            if let Some(key) = overrides.tls_key {
                tls.key = key;
            }
        }
        if let (Some(ca), Some(tls)) = (overrides.tls_client_ca, self.wan.tls.as_mut()) {
            tls.client_ca = Some(ca);
        }
        if overrides.token.is_some() || overrides.token_file.is_some() {
            self.wan.auth = Some(AuthConfig {
                token: overrides.token,
                token_file: overrides.token_file,
            });
        }
        if overrides.admin_token.is_some() || overrides.admin_token_file.is_some() {
            self.admin.auth = Some(AuthConfig {
                token: overrides.admin_token,
                token_file: overrides.admin_token_file,
            });
        }
    }

    /// Listeners this configuration exposes beyond loopback without protection.
    pub fn exposure_warnings(&self) -> Vec<ExposureWarning> {
        let mut warnings = Vec::new();
        let listen = self.wan.listen;
        if !listen.ip().is_loopback() {
            match (&self.wan.tls, &self.wan.auth) {
                (None, None) => warnings.push(ExposureWarning::WanUnprotected { listen }),
                (None, Some(_)) => warnings.push(ExposureWarning::WanTokenWithoutTls { listen }),
                (Some(_), _) => {}
            }
        }
        if let Some(dynamo) = &self.dynamo
            && !dynamo.listen.ip().is_loopback()
            && dynamo.tls.is_none()
            && dynamo.auth.is_none()
        {
            warnings.push(ExposureWarning::DynamoUnprotected {
                listen: dynamo.listen,
            });
        }
        let admin = self.admin.listen;
        if self.admin.enabled && !admin.ip().is_loopback() && self.admin.auth.is_none() {
            warnings.push(ExposureWarning::AdminUnprotected { listen: admin });
        }
        warnings
    }

    /// Checks everything that can be checked without touching the network.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.dc_id.is_empty() || self.dc_id.trim() != self.dc_id {
            return Err(ConfigError::InvalidField {
                field: "dc_id",
                value: self.dc_id.clone(),
                reason: "must be non-empty without surrounding whitespace",
            });
        }
        self.limits.validate()?;
        if let Some(state) = &self.state {
            state.validate()?;
        }
        self.tiers.validate()?;
        self.filters.validate(self.dynamo.is_some())?;
        self.ingest
            .validate()
            .map_err(|error| ConfigError::InvalidIngestLimit {
                table: "ingest",
                error,
            })?;
        if let Some(nats) = &self.nats {
            nats.limits(self.ingest).validate().map_err(|error| {
                ConfigError::InvalidIngestLimit {
                    table: "nats",
                    error,
                }
            })?;
        }
        match self.discovery.backend {
            DiscoveryBackend::File if self.discovery.dir.is_none() => {
                return Err(ConfigError::InvalidField {
                    field: "discovery.dir",
                    value: String::new(),
                    reason: "file discovery needs a card directory",
                });
            }
            DiscoveryBackend::Etcd if self.discovery.etcd_endpoints.is_empty() => {
                return Err(ConfigError::InvalidField {
                    field: "discovery.etcd_endpoints",
                    value: String::new(),
                    reason: "etcd discovery needs at least one endpoint",
                });
            }
            DiscoveryBackend::File | DiscoveryBackend::Etcd => {}
        }
        let card_bytes = self.discovery.max_card_file_bytes;
        if card_bytes == 0 || card_bytes > MAX_CARD_FILE_BYTES_CEILING {
            return Err(ConfigError::InvalidField {
                field: "discovery.max_card_file_bytes",
                value: card_bytes.to_string(),
                reason: "must be between 1 and 67108864 (64 MiB)",
            });
        }
        if self.discovery.max_card_files == 0 {
            return Err(ConfigError::InvalidField {
                field: "discovery.max_card_files",
                value: "0".to_owned(),
                reason: "must be at least 1",
            });
        }
        if let Some(tls) = &self.wan.tls
            && (tls.cert.as_os_str().is_empty() || tls.key.as_os_str().is_empty())
        {
            return Err(ConfigError::InvalidField {
                field: "wan.tls",
                value: format!("cert={} key={}", tls.cert.display(), tls.key.display()),
                reason: "TLS needs both a certificate and a key",
            });
        }
        if let Some(auth) = &self.wan.auth {
            auth.validate(AuthTable::Wan)?;
        }
        if let Some(auth) = &self.admin.auth {
            auth.validate(AuthTable::Admin)?;
        }
        if let Some(dynamo) = &self.dynamo {
            dynamo.validate()?;
        }
        let admin_bounds = [
            (
                "admin.header_read_timeout_ms",
                self.admin.header_read_timeout_ms,
            ),
            (
                "admin.connection_timeout_ms",
                self.admin.connection_timeout_ms,
            ),
            (
                "admin.max_connections",
                u64::from(self.admin.max_connections),
            ),
        ];
        for (name, value) in admin_bounds {
            if value == 0 || value > MAX_ADMIN_BOUND {
                return Err(ConfigError::InvalidLimit {
                    name,
                    value,
                    reason: "must be between 1 and one year in ms",
                });
            }
        }
        if let Some(workload) = &self.workload
            && !(workload.speed.is_finite() && workload.speed >= 0.0)
        {
            return Err(ConfigError::InvalidField {
                field: "workload.speed",
                value: workload.speed.to_string(),
                reason: "must be a finite number >= 0",
            });
        }
        if let Some(nats) = &self.nats
            && !nats.server.starts_with("nats://")
        {
            return Err(ConfigError::InvalidField {
                field: "nats.server",
                value: nats.server.clone(),
                reason: "must be a nats:// URL",
            });
        }
        if let Some(nats) = &self.nats {
            if let Err(reason) = nats.auth() {
                return Err(ConfigError::InvalidField {
                    field: "nats",
                    value: "credentials".to_owned(),
                    reason,
                });
            }
            if nats.tls_cert.is_some() != nats.tls_key.is_some() {
                return Err(ConfigError::InvalidField {
                    field: "nats.tls_cert",
                    value: "tls_cert/tls_key".to_owned(),
                    reason: "tls_cert and tls_key go together",
                });
            }
        }
        for source in &self.sources {
            if source.endpoint.split('.').count() != 3 {
                return Err(ConfigError::InvalidField {
                    field: "sources.endpoint",
                    value: source.endpoint.clone(),
                    reason: "must be namespace.component.endpoint",
                });
            }
            let dynamo = source.engine == SourceEngine::Dynamo;
            if dynamo && source.replay.is_some() {
                return Err(ConfigError::InvalidField {
                    field: "sources.replay",
                    value: source.endpoint.clone(),
                    reason: "a Dynamo event-plane publisher has no replay endpoint",
                });
            }
            if dynamo != source.publisher_id.is_some() {
                return Err(ConfigError::InvalidField {
                    field: "sources.publisher_id",
                    value: source.endpoint.clone(),
                    reason: "a source with engine = \"dynamo\" needs its publisher id, and only such a source has one",
                });
            }
        }
        Ok(())
    }
}

/// Largest accepted admin bound: one year in ms (counts are far below it).
const MAX_ADMIN_BOUND: u64 = 365 * 24 * 3600 * 1000;

/// Exactly one of an inline token and a token file; an inline token follows the token
/// rules (the file's contents are checked when the relay starts and reads it).
/// What `Debug` shows for a secret: whether it is set, never its value.
fn redacted<T>(secret: Option<&T>) -> Option<&'static str> {
    secret.map(|_| "<redacted>")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<RelayConfig, ConfigError> {
        RelayConfig::from_toml_str(text, Path::new("relay.toml"))
    }

    #[test]
    fn a_dynamo_source_needs_its_publisher_id_and_has_no_replay() {
        let source = |extra: &str| {
            format!(
                "[discovery]\ndir = \"cards\"\n[[sources]]\nendpoint = \"prod.backend.generate\"\nworker_id = 7\nzmq = \"tcp://127.0.0.1:5557\"\n{extra}"
            )
        };
        let dynamo = parse(&source("engine = \"dynamo\"\npublisher_id = 42")).unwrap();
        dynamo.validate().unwrap();
        assert_eq!(dynamo.sources[0].engine, SourceEngine::Dynamo);
        assert_eq!(dynamo.sources[0].publisher_id, Some(42));
        for (extra, field) in [
            ("engine = \"dynamo\"", "sources.publisher_id"),
            (
                "engine = \"vllm\"\npublisher_id = 42",
                "sources.publisher_id",
            ),
            (
                "engine = \"dynamo\"\npublisher_id = 42\nreplay = \"tcp://127.0.0.1:5558\"",
                "sources.replay",
            ),
        ] {
            let err = parse(&source(extra))
                .and_then(|config| config.validate())
                .unwrap_err();
            assert!(
                matches!(err, ConfigError::InvalidField { field: f, .. } if f == field),
                "{extra}: {err}"
            );
        }
    }

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(parse("").unwrap(), RelayConfig::default());
    }

    #[test]
    fn file_values_beat_defaults_and_missing_limits_keep_theirs() {
        let config = parse(
            r#"
            dc_id = "dc-west"
            [wan]
            listen = "0.0.0.0:9000"
            [discovery]
            dir = "cards"
            [limits]
            max_subscribers_per_pool = 3
            "#,
        )
        .unwrap();
        assert_eq!(config.dc_id, "dc-west");
        assert_eq!(config.wan.listen, "0.0.0.0:9000".parse().unwrap());
        assert_eq!(config.limits.max_subscribers_per_pool, 3);
        assert_eq!(
            config.limits.max_catalog_streams,
            Limits::default().max_catalog_streams
        );
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn the_ingest_table_sets_source_bounds_and_is_validated_by_the_ingest_crate() {
        let config = parse(
            r#"
            [discovery]
            dir = "cards"
            [ingest]
            tail_probe_idle_ms = 250
            max_payload_bytes = 1048576
            [nats]
            server = "nats://127.0.0.1:4222"
            max_payload_bytes = 65536
            "#,
        )
        .unwrap();
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(config.ingest.tail_probe_idle_ms, 250);
        assert_eq!(config.ingest.max_payload_bytes, 1 << 20);
        assert_eq!(
            config.ingest.output_queue_depth,
            kvrelay_ingest::limits::DEFAULT_OUTPUT_QUEUE_DEPTH
        );
        let nats = config.nats.as_ref().unwrap();
        let nats_limits = nats.limits(config.ingest);
        assert_eq!(nats_limits.max_payload_bytes, 65_536);
        assert_eq!(nats_limits.tail_probe_idle_ms, 250);

        let zero_hwm = parse("[discovery]\ndir = \"c\"\n[ingest]\nreceive_high_water_mark = 0\n")
            .unwrap()
            .validate()
            .unwrap_err();
        assert!(
            matches!(
                zero_hwm,
                ConfigError::InvalidIngestLimit { table: "ingest", error }
                    if error.name == "receive_high_water_mark"
            ),
            "{zero_hwm}"
        );
        assert_eq!(
            zero_hwm.to_string(),
            "[ingest] ingest limit receive_high_water_mark = 0 must be nonzero"
        );
        let zero_nats = parse(
            "[discovery]\ndir = \"c\"\n[nats]\nserver = \"nats://127.0.0.1:1\"\nmax_payload_bytes = 0\n",
        )
        .unwrap()
        .validate()
        .unwrap_err();
        assert!(
            matches!(
                zero_nats,
                ConfigError::InvalidIngestLimit { table: "nats", .. }
            ),
            "{zero_nats}"
        );
        let misspelt = parse("[ingest]\ntail_probe_idle = 1\n").unwrap_err();
        assert!(matches!(misspelt, ConfigError::Parse { .. }), "{misspelt}");
    }

    #[test]
    fn overrides_beat_file_values() {
        let mut config = parse("dc_id = \"from-file\"\n[discovery]\ndir = \"a\"\n").unwrap();
        config.apply(RelayOverrides {
            dc_id: Some("from-flag".into()),
            cards_dir: Some("b".into()),
            ..RelayOverrides::default()
        });
        assert_eq!(config.dc_id, "from-flag");
        assert_eq!(config.discovery.dir, Some(PathBuf::from("b")));
    }

    #[test]
    fn absent_overrides_keep_file_values() {
        let mut config = parse("dc_id = \"from-file\"\n").unwrap();
        config.apply(RelayOverrides::default());
        assert_eq!(config.dc_id, "from-file");
    }

    #[test]
    fn unknown_keys_are_rejected_with_the_file_name() {
        let err = parse("dc_idd = \"x\"").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("parsing config file relay.toml: unknown field"),
            "{err}"
        );
    }

    #[test]
    fn event_sources_dir_is_optional_and_read_from_the_discovery_table() {
        assert_eq!(RelayConfig::default().discovery.event_sources_dir, None);
        let config = parse("[discovery]\ndir = \"c\"\nevent_sources_dir = \"store/v1\"\n").unwrap();
        assert_eq!(
            config.discovery.event_sources_dir,
            Some(PathBuf::from("store/v1"))
        );
    }

    #[test]
    fn file_discovery_without_a_directory_is_invalid() {
        let err = RelayConfig::default().validate().unwrap_err();
        assert!(matches!(
            err,
            ConfigError::InvalidField {
                field: "discovery.dir",
                ..
            }
        ));
    }

    #[test]
    fn auth_needs_exactly_one_token_source() {
        let mut config = parse("[discovery]\ndir = \"c\"\n").unwrap();
        config.wan.auth = Some(AuthConfig {
            token: None,
            token_file: None,
        });
        assert!(matches!(
            config.validate(),
            Err(ConfigError::InvalidField {
                field: "wan.auth",
                ..
            })
        ));
    }

    #[test]
    fn tokens_no_client_could_send_are_refused_naming_the_field() {
        let mut config = parse("[discovery]\ndir = \"c\"\n").unwrap();
        config.wan.auth = Some(AuthConfig {
            token: Some("line\u{1b}break".into()),
            token_file: None,
        });
        let err = config.validate().unwrap_err();
        assert!(
            matches!(
                &err,
                ConfigError::Token {
                    field: "wan.auth.token",
                    source: kvrelay_tls::TokenError::ControlCharacter
                }
            ),
            "{err}"
        );
        assert!(
            !err.to_string().contains("line"),
            "the token is never quoted: {err}"
        );
        config.wan.auth = None;
        config.admin.auth = Some(AuthConfig {
            token: Some("x".repeat(4097)),
            token_file: None,
        });
        assert!(matches!(
            config.validate(),
            Err(ConfigError::Token {
                field: "admin.auth.token",
                source: kvrelay_tls::TokenError::TooLong { len: 4097, .. }
            })
        ));
        // A token file is read at start; its errors name the file's field and listener.
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "\n").unwrap();
        let auth = AuthConfig {
            token: None,
            token_file: Some(file),
        };
        assert!(matches!(
            auth.load(AuthTable::Admin),
            Err(ConfigError::Token {
                field: "admin.auth.token_file",
                source: kvrelay_tls::TokenError::File { .. }
            })
        ));
        std::fs::write(dir.path().join("token"), "s3cret\n").unwrap();
        let token = auth.load(AuthTable::Wan).unwrap();
        assert!(token.matches(Some(b"s3cret")));
    }

    #[test]
    fn example_config_parses_and_validates() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/relay.toml");
        let config = RelayConfig::from_file(&path).unwrap();
        assert_eq!(config.validate(), Ok(()));
        // The example spells out every ingest default; a changed default must change it.
        assert_eq!(config.ingest, kvrelay_ingest::Limits::default());
        // Its commented `[state]` table, uncommented, is the default one.
        let text = std::fs::read_to_string(&path).unwrap();
        let state = text
            .split_once("# [state]\n")
            .unwrap()
            .1
            .lines()
            .map_while(|line| line.strip_prefix("# "))
            .collect::<Vec<_>>()
            .join("\n");
        let state: StateConfig = toml::from_str(&state).unwrap();
        assert_eq!(
            state,
            StateConfig {
                dir: "/var/lib/kvrelay".into(),
                ..StateConfig::default()
            }
        );
    }

    #[test]
    fn exposure_beyond_loopback_without_protection_is_reported() {
        let mut config = parse("[discovery]\ndir = \"c\"\n").unwrap();
        assert_eq!(config.exposure_warnings(), Vec::new());
        config.wan.listen = "0.0.0.0:7400".parse().unwrap();
        config.admin.listen = "0.0.0.0:7401".parse().unwrap();
        assert_eq!(
            config.exposure_warnings(),
            vec![
                ExposureWarning::WanUnprotected {
                    listen: config.wan.listen
                },
                ExposureWarning::AdminUnprotected {
                    listen: config.admin.listen
                },
            ]
        );
        config.wan.auth = Some(AuthConfig {
            token: Some("t".into()),
            token_file: None,
        });
        config.admin.enabled = false;
        assert_eq!(
            config.exposure_warnings(),
            vec![ExposureWarning::WanTokenWithoutTls {
                listen: config.wan.listen
            }]
        );
    }

    #[test]
    fn debug_output_never_shows_a_token() {
        let mut config = parse("[discovery]\ndir = \"c\"\n").unwrap();
        config.wan.auth = Some(AuthConfig {
            token: Some("s3cr3t-wan".into()),
            token_file: None,
        });
        config.admin.auth = Some(AuthConfig {
            token: Some("s3cr3t-admin".into()),
            token_file: None,
        });
        let mut nats = NatsConfig::plain("nats://127.0.0.1:4222".into());
        nats.password = Some("s3cr3t-nats-password".into());
        nats.nkey_seed = Some("s3cr3t-nats-seed".into());
        nats.token = Some("s3cr3t-nats-token".into());
        config.nats = Some(nats);
        let overrides = RelayOverrides {
            token: Some("s3cr3t-flag".into()),
            admin_token: Some("s3cr3t-flag-admin".into()),
            ..RelayOverrides::default()
        };
        let printed = format!("{config:?} {config:#?} {overrides:?}");
        assert!(!printed.contains("s3cr3t"), "{printed}");
        assert!(printed.contains("<redacted>"), "{printed}");
    }

    #[test]
    fn card_file_bounds_are_read_and_checked() {
        let config =
            parse("[discovery]\ndir = \"c\"\nmax_card_file_bytes = 65536\nmax_card_files = 8\n")
                .unwrap();
        assert_eq!(
            (
                config.discovery.max_card_file_bytes,
                config.discovery.max_card_files
            ),
            (65_536, 8)
        );
        assert_eq!(config.validate(), Ok(()));
        for (toml, field) in [
            ("max_card_file_bytes = 0", "discovery.max_card_file_bytes"),
            (
                "max_card_file_bytes = 67108865",
                "discovery.max_card_file_bytes",
            ),
            ("max_card_files = 0", "discovery.max_card_files"),
        ] {
            let config = parse(&format!("[discovery]\ndir = \"c\"\n{toml}\n")).unwrap();
            assert!(
                matches!(
                    config.validate(),
                    Err(ConfigError::InvalidField { field: got, .. }) if got == field
                ),
                "{toml}"
            );
        }
    }

    #[test]
    fn zero_admin_bounds_are_rejected() {
        let mut config = parse("[discovery]\ndir = \"c\"\n").unwrap();
        config.admin.header_read_timeout_ms = 0;
        assert!(matches!(
            config.validate(),
            Err(ConfigError::InvalidLimit {
                name: "admin.header_read_timeout_ms",
                ..
            })
        ));
    }
}
