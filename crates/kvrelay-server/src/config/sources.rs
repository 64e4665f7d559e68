//! Where the relay's input comes from: `[discovery]` (model cards), `[[sources]]` (engine
//! event sources), `[workload]` (a trace replay) and `[nats]` (Dynamo's event plane).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::redacted;

/// The `[discovery]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DiscoveryConfig {
    /// Which backend lists and watches model cards.
    pub backend: DiscoveryBackend,
    /// Directory of card files (`backend = "file"`).
    pub dir: Option<PathBuf>,
    /// A file store's `v1` directory whose `event_sources/` and `event_channels/` records
    /// (the reference runtime's KV event adverts) add ZMQ engine sources; rescanned every
    /// 500 ms. `[[sources]]` entries win on a `(worker_id, dp_rank)` conflict.
    pub event_sources_dir: Option<PathBuf>,
    /// etcd endpoints (`backend = "etcd"`), e.g. `http://127.0.0.1:2379`.
    pub etcd_endpoints: Vec<String>,
    /// With `backend = "etcd"` (and no `event_sources_dir`): read the reference runtime's
    /// KV event adverts from the same etcd (`v1/event_sources/`, `v1/event_channels/`,
    /// relisted every 500 ms; gone with their lease), as bare-metal Dynamo deployments
    /// keep them. Default on.
    pub etcd_event_adverts: bool,
    /// Namespaces to watch (empty with `watch_all` = every namespace).
    pub namespaces: Vec<String>,
    /// Endpoint prefixes (`namespace.component[.endpoint]`) to watch.
    pub endpoint_prefixes: Vec<String>,
    /// Watch every namespace.
    pub watch_all: bool,
    /// Largest card file the file backend reads, in bytes
    /// ([`kvrelay_membership::DEFAULT_MAX_CARD_FILE_BYTES`], 4 MiB); a larger file is
    /// skipped, logged once and counted as `too_large`. A file growing while it is read is
    /// cut at this bound too.
    pub max_card_file_bytes: u64,
    /// Most card files the file backend reads per scan, in name order
    /// ([`kvrelay_membership::DEFAULT_MAX_CARD_FILES`]); the rest are skipped and counted
    /// as `too_many_files`.
    pub max_card_files: u32,
}

impl Default for DiscoveryConfig {
    fn default() -> Self {
        Self {
            backend: DiscoveryBackend::File,
            dir: None,
            event_sources_dir: None,
            etcd_endpoints: Vec::new(),
            etcd_event_adverts: true,
            namespaces: Vec::new(),
            endpoint_prefixes: Vec::new(),
            watch_all: true,
            max_card_file_bytes: kvrelay_membership::DEFAULT_MAX_CARD_FILE_BYTES,
            max_card_files: DEFAULT_MAX_CARD_FILES,
        }
    }
}

/// [`kvrelay_membership::DEFAULT_MAX_CARD_FILES`] as the config's integer type.
const DEFAULT_MAX_CARD_FILES: u32 = {
    let files = kvrelay_membership::DEFAULT_MAX_CARD_FILES;
    assert!(files <= u32::MAX as usize);
    files as u32
};

/// Largest `discovery.max_card_file_bytes` accepted: 64 MiB, far above any real card
/// (a few KB), so a typo cannot make every rescan read gigabytes.
pub(crate) const MAX_CARD_FILE_BYTES_CEILING: u64 = 64 * 1024 * 1024;

/// A discovery backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DiscoveryBackend {
    /// A watched directory of card JSON files.
    File,
    /// etcd.
    Etcd,
}

/// One `[[sources]]` entry: an engine's KV event socket for one (worker, rank).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    /// Serving endpoint as `namespace.component.endpoint`.
    pub endpoint: String,
    /// Worker (instance) id.
    pub worker_id: u64,
    /// Data-parallel rank.
    #[serde(default)]
    pub dp_rank: u32,
    /// Which engine publishes the events.
    pub engine: SourceEngine,
    /// ZMQ PUB endpoint, e.g. `tcp://10.0.0.5:5557`.
    pub zmq: String,
    /// Optional ZMQ ROUTER replay endpoint (vLLM and SGLang only).
    pub replay: Option<String>,
    /// With `engine = "dynamo"` (and only then, required): the event-plane publisher whose
    /// messages are read. Dynamo picks it anew for each worker incarnation, so Dynamo
    /// sources are normally discovered from their adverts, which name it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher_id: Option<u64>,
    /// Optional Prometheus endpoint of the engine to scrape KV usage from.
    pub metrics_url: Option<String>,
}

/// An engine kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SourceEngine {
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
    /// Dynamo's event plane: a Dynamo worker's `KvEventPublisher` (what the event channels
    /// Dynamo workers advertise carry), its blocks hashed by Dynamo.
    Dynamo,
}

/// The `[workload]` table: replay a trace into the discovered pools.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadConfig {
    /// The request trace (JSONL); absent = the small trace built into the binary.
    #[serde(default)]
    pub trace: Option<PathBuf>,
    /// Replay speed multiplier; 0 = as fast as possible.
    #[serde(default)]
    pub speed: f64,
    /// Replay the trace this many times (0 = forever).
    #[serde(default = "one")]
    pub loops: u32,
}

fn one() -> u32 {
    1
}

/// The `[nats]` table. `Debug` never shows the token, password or NKey seed.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// The NATS server, e.g. `nats://127.0.0.1:4222`.
    pub server: String,
    /// Largest payload decoded (bytes); default 1 MiB.
    #[serde(default = "default_nats_max_payload_bytes")]
    pub max_payload_bytes: usize,
    /// Server token (at most one of `token`, `user`, `nkey_seed`, `credentials_file`).
    #[serde(default)]
    pub token: Option<String>,
    /// User name; needs `password`.
    #[serde(default)]
    pub user: Option<String>,
    /// Password of `user`.
    #[serde(default)]
    pub password: Option<String>,
    /// NKey seed (`SU...`).
    #[serde(default)]
    pub nkey_seed: Option<String>,
    /// A `.creds` file (JWT + NKey seed).
    #[serde(default)]
    pub credentials_file: Option<PathBuf>,
    /// Refuse a connection that is not upgraded to TLS.
    #[serde(default)]
    pub tls_required: bool,
    /// PEM CA certificates to trust for the server.
    #[serde(default)]
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate (with `tls_key`) for mutual TLS.
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of `tls_cert`.
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("server", &self.server)
            .field("max_payload_bytes", &self.max_payload_bytes)
            .field("token", &redacted(self.token.as_ref()))
            .field("user", &self.user)
            .field("password", &redacted(self.password.as_ref()))
            .field("nkey_seed", &redacted(self.nkey_seed.as_ref()))
            .field("credentials_file", &self.credentials_file)
            .field("tls_required", &self.tls_required)
            .field("tls_ca", &self.tls_ca)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .finish()
    }
}

fn default_nats_max_payload_bytes() -> usize {
    kvrelay_ingest::limits::DEFAULT_NATS_MAX_PAYLOAD_BYTES
}

impl NatsConfig {
    /// The bounds of the NATS source: `ingest` (the `[ingest]` table) with this table's
    /// `max_payload_bytes`.
    pub fn limits(&self, ingest: kvrelay_ingest::Limits) -> kvrelay_ingest::Limits {
        kvrelay_ingest::Limits {
            max_payload_bytes: self.max_payload_bytes,
            ..ingest
        }
    }

    /// A server with the default limit, no credentials and no TLS.
    pub fn plain(server: String) -> Self {
        Self {
            server,
            max_payload_bytes: default_nats_max_payload_bytes(),
            token: None,
            user: None,
            password: None,
            nkey_seed: None,
            credentials_file: None,
            tls_required: false,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
        }
    }

    /// The ingest credentials, or why the table is inconsistent.
    pub fn auth(&self) -> Result<kvrelay_ingest::NatsAuth, &'static str> {
        use kvrelay_ingest::NatsAuth;
        let methods = [
            self.token.is_some(),
            self.user.is_some(),
            self.nkey_seed.is_some(),
            self.credentials_file.is_some(),
        ];
        if methods.iter().filter(|set| **set).count() > 1 {
            return Err("give at most one of token, user, nkey_seed, credentials_file");
        }
        if self.user.is_some() != self.password.is_some() {
            return Err("user and password go together");
        }
        Ok(
            match (&self.token, &self.user, &self.password, &self.nkey_seed) {
                (Some(token), ..) => NatsAuth::Token(token.clone()),
                (_, Some(user), Some(password), _) => NatsAuth::UserPassword {
                    user: user.clone(),
                    password: password.clone(),
                },
                (.., Some(seed)) => NatsAuth::NKey { seed: seed.clone() },
                _ => match &self.credentials_file {
                    Some(path) => NatsAuth::CredentialsFile(path.clone()),
                    None => NatsAuth::None,
                },
            },
        )
    }

    /// The ingest TLS options.
    pub fn tls(&self) -> kvrelay_ingest::NatsTls {
        kvrelay_ingest::NatsTls {
            required: self.tls_required,
            root_certificates: self.tls_ca.clone(),
            client_certificate: self.tls_cert.clone(),
            client_key: self.tls_key.clone(),
        }
    }
}
