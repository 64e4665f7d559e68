//! The router's configuration: listen address, the relays to follow, HTTP bounds, the
//! consumer's bounds and weights; parsed from TOML (`router.toml`) and overridden by the
//! caller (flags, then environment, then the file, then the defaults documented here).
//!
//! Everything is checked once, at start: a bad key, a bad relay, an unreadable token file
//! or PEM fails [`RouterConfig::consumer_config`] with an error naming what is wrong.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvrelay_consumer::{
    BackoffConfig, BearerToken, ConfigError, ConsumerConfig, Limits, RelayEndpoint, RelayProtocol,
    RelayTls, ScoreWeights, StandbyMode, TokenError,
};
use kvrelay_http::HttpBounds;
use serde::Deserialize;

/// Default listen address: loopback only (the API has no authentication of its own).
pub const DEFAULT_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 7480);

/// The whole router configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RouterConfig {
    /// HTTP listen address. Default [`DEFAULT_LISTEN`].
    pub listen: SocketAddr,
    /// The relays to follow, one per DC.
    pub relays: Vec<RelaySection>,
    /// Bounds of the HTTP API.
    pub http: HttpSection,
    /// Bounds and timeouts of the consumer that follows the relays.
    pub consumer: ConsumerSection,
    /// Ranking weights (see `kvrelay_consumer::weights`).
    pub weights: ScoreWeights,
    /// Authentication of the router's own API.
    pub auth: AuthSection,
    /// `[tls]`: TLS on the router's own listener (PEM files read at start; with
    /// `client_ca`, mutual TLS); plaintext without it.
    pub tls: Option<kvrelay_tls::ListenerTls>,
}

/// `[auth]`: an optional bearer token every API request must present
/// (`Authorization: Bearer <token>`), except `/healthz` and `/readyz`. Off by default: turn
/// it on whenever the listener is reachable from beyond the hosts that should route.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthSection {
    /// File holding the token (trimmed).
    pub token_file: Option<PathBuf>,
    /// Environment variable holding the token (used when `token_file` is unset).
    pub token_env: Option<String>,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            listen: DEFAULT_LISTEN,
            relays: Vec::new(),
            http: HttpSection::default(),
            consumer: ConsumerSection::default(),
            weights: ScoreWeights::default(),
            auth: AuthSection::default(),
            tls: None,
        }
    }
}

/// One `[[relays]]` entry.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelaySection {
    /// `host:port` of the relay's WAN listener.
    pub address: String,
    /// Further relays of the same DC (a relay pair), followed when `address` fails; one
    /// DC, never counted twice. Same protocol, TLS and token.
    #[serde(default)]
    pub standby: Vec<String>,
    /// The DC name reported with scores (unique across relays).
    pub dc: String,
    /// The DC's cost in the ranking (e.g. network latency in ms); finite, ≥ 0. Default 0.
    #[serde(default)]
    pub cost: f64,
    /// CA bundle (PEM) for TLS to this relay; without it the connection is plaintext.
    #[serde(default)]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate chain (PEM) for mutual TLS; needs `tls_key` and `tls_ca`.
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of `tls_cert`.
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
    /// Name the relay's certificate must carry (default: the address's host).
    #[serde(default)]
    pub tls_server_name: Option<String>,
    /// File holding the bearer token sent to this relay.
    #[serde(default)]
    pub token_file: Option<PathBuf>,
    /// Environment variable holding the bearer token (used when `token_file` is unset).
    #[serde(default)]
    pub token_env: Option<String>,
    /// `kvrelay` (default: our WAN protocol) or `dynamo-grpc` (Dynamo's relay contract:
    /// a Dynamo relay, or a kvrelay relay's `[dynamo]` port).
    #[serde(default)]
    pub protocol: Option<String>,
}

impl RelaySection {
    /// A plaintext relay without token at `address`, named `dc`, with `cost`.
    pub fn new(address: &str, dc: &str, cost: f64) -> Self {
        Self {
            address: address.to_owned(),
            standby: Vec::new(),
            dc: dc.to_owned(),
            cost,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_server_name: None,
            token_file: None,
            token_env: None,
            protocol: None,
        }
    }
}

/// `[http]`: bounds of the HTTP API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSection {
    /// Largest request body, bytes (`413` above). Default 4 MiB.
    pub max_body_bytes: usize,
    /// Requests scored at once; more get `503` with `Retry-After` instead of queueing.
    /// Default 64.
    pub max_concurrent_requests: u32,
    /// Requests in one `POST /v1/route/batch`. Default 256.
    pub max_batch: usize,
    /// Token ids in one request. Default 262,144.
    pub max_tokens: usize,
    /// Largest `top_k`. Default 1,024.
    pub max_top_k: usize,
    /// Concurrent connections. Default 256.
    pub max_connections: u32,
    /// Concurrent connections from one peer IP address, so one host cannot hold every
    /// slot (and shut out health probes). Default 64.
    pub max_connections_per_peer: u32,
    /// Time to send a request head; also the keep-alive idle bound, ms. Default 5,000.
    pub header_read_timeout_ms: u64,
    /// Longest life of one connection, ms. Default 300,000.
    pub connection_timeout_ms: u64,
    /// Time to receive a whole request body once its head has arrived, ms (`408` after).
    /// With `max_body_bytes` it sets the slowest rate a full-size body may arrive at
    /// (4 MiB in 10 s: about 410 KiB/s). A request holds no scoring permit while its body
    /// arrives. Default 10,000.
    pub body_timeout_ms: u64,
}

impl HttpSection {
    /// Default [`HttpSection::max_body_bytes`].
    pub const DEFAULT_MAX_BODY_BYTES: usize = 4 << 20;
    /// Default [`HttpSection::max_concurrent_requests`].
    pub const DEFAULT_MAX_CONCURRENT_REQUESTS: u32 = 64;
    /// Default [`HttpSection::max_batch`].
    pub const DEFAULT_MAX_BATCH: usize = 256;
    /// Default [`HttpSection::max_tokens`].
    pub const DEFAULT_MAX_TOKENS: usize = 256 << 10;
    /// Default [`HttpSection::max_top_k`].
    pub const DEFAULT_MAX_TOP_K: usize = 1024;
    /// Default [`HttpSection::max_connections`].
    pub const DEFAULT_MAX_CONNECTIONS: u32 = 256;
    /// Default [`HttpSection::max_connections_per_peer`].
    pub const DEFAULT_MAX_CONNECTIONS_PER_PEER: u32 =
        HttpBounds::default_per_peer(Self::DEFAULT_MAX_CONNECTIONS);
    /// Default [`HttpSection::header_read_timeout_ms`].
    pub const DEFAULT_HEADER_READ_TIMEOUT_MS: u64 =
        HttpBounds::DEFAULT_HEADER_READ_TIMEOUT.as_millis() as u64;
    /// Default [`HttpSection::connection_timeout_ms`].
    pub const DEFAULT_CONNECTION_TIMEOUT_MS: u64 = 300_000;
    /// Default [`HttpSection::body_timeout_ms`].
    pub const DEFAULT_BODY_TIMEOUT_MS: u64 = 10_000;

    /// The listener bounds.
    pub fn bounds(&self) -> HttpBounds {
        HttpBounds {
            header_read_timeout: Duration::from_millis(self.header_read_timeout_ms),
            connection_timeout: Duration::from_millis(self.connection_timeout_ms),
            max_connections: self.max_connections,
            max_connections_per_peer: self.max_connections_per_peer,
        }
    }
}

impl Default for HttpSection {
    fn default() -> Self {
        Self {
            max_body_bytes: Self::DEFAULT_MAX_BODY_BYTES,
            max_concurrent_requests: Self::DEFAULT_MAX_CONCURRENT_REQUESTS,
            max_batch: Self::DEFAULT_MAX_BATCH,
            max_tokens: Self::DEFAULT_MAX_TOKENS,
            max_top_k: Self::DEFAULT_MAX_TOP_K,
            max_connections: Self::DEFAULT_MAX_CONNECTIONS,
            max_connections_per_peer: Self::DEFAULT_MAX_CONNECTIONS_PER_PEER,
            header_read_timeout_ms: Self::DEFAULT_HEADER_READ_TIMEOUT_MS,
            connection_timeout_ms: Self::DEFAULT_CONNECTION_TIMEOUT_MS,
            body_timeout_ms: Self::DEFAULT_BODY_TIMEOUT_MS,
        }
    }
}

/// `[consumer]`: the consumer's bounds (defaults are `kvrelay_consumer::Limits`'s).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConsumerSection {
    /// Largest frame accepted from a relay, bytes.
    pub max_frame_len: u32,
    /// Catalog entries accepted per relay.
    pub max_pools_per_relay: usize,
    /// Time to connect and receive a stream's first frame, ms.
    pub connect_timeout_ms: u64,
    /// Replicas not heard from for this long are not scored, ms.
    pub staleness_bound_ms: u64,
    /// Catalog streams silent for this long fail the relay's epoch, ms.
    pub catalog_staleness_bound_ms: u64,
    /// How long a broken relay's view is kept for resuming, ms.
    pub resume_hold_ms: u64,
    /// Longest time a snapshot may take to assemble, ms.
    pub snapshot_assembly_timeout_ms: u64,
    /// Pool streams (connections) open at once to one relay.
    pub max_pool_streams_per_relay: usize,
    /// Replica memory one relay's catalog may claim, bytes (entries over it are
    /// quarantined). Lower it to bound what a hostile or misconfigured relay can make
    /// this process allocate.
    pub max_replica_bytes_per_relay: u64,
    /// Bytes all replica query tables may hold (spare stride and a growth's two copies
    /// included): the bound on this process's replica memory. Size it to what the
    /// machine can give the router.
    pub max_query_table_bytes: u64,
    /// A relay pair's followed relay is left for the standby after this many of its
    /// load windows without one (0: never for silence).
    pub relay_silence_windows: u32,
    /// The least silence that leaves a pair's followed relay, ms.
    pub min_relay_silence_ms: u64,
    /// No second move for silence or a stalled pool within this long of the last one, ms.
    pub failover_hold_ms: u64,
    /// After a followed relay's connection broke, unreachable attempts are retried every
    /// this long (half jitter), ms.
    pub rejoin_interval_ms: u64,
    /// How long after the break `rejoin_interval_ms` applies before the backoff, ms (0: off).
    pub rejoin_window_ms: u64,
    /// A relay pair's standby is probed every this long (half jitter), ms (0: off).
    pub standby_probe_interval_ms: u64,
    /// How a relay pair's standby is kept: `on-demand` (followed when the followed relay
    /// fails) or `hot` (followed all along, scored the moment the other is not fit).
    pub standby_mode: StandbyModeKey,
    /// Whether pools' lower-tier lanes (host memory, disk) are followed and scored
    /// (relays with `[tiers]`); `false` scores device memory only.
    pub follow_tier_lanes: bool,
    /// Whether a pool's dense format twin (relays with `[filters] format =
    /// "v1_and_dense"`) is followed in place of its v1 filter (about 0.63x the replica
    /// memory, the same blocks, about twice the false positives per probe); `false`
    /// follows every pool in its own format.
    pub follow_format_twins: bool,
    /// First reconnect/resubscribe delay (before jitter), ms.
    pub backoff_initial_ms: u64,
    /// Longest reconnect/resubscribe delay (before jitter), ms.
    pub backoff_max_ms: u64,
}

impl Default for ConsumerSection {
    fn default() -> Self {
        let limits = Limits::default();
        Self {
            max_frame_len: limits.max_frame_len,
            max_pools_per_relay: limits.max_pools_per_relay,
            connect_timeout_ms: millis(limits.connect_timeout),
            staleness_bound_ms: millis(limits.staleness_bound),
            catalog_staleness_bound_ms: millis(limits.catalog_staleness_bound),
            resume_hold_ms: millis(limits.resume_hold),
            snapshot_assembly_timeout_ms: millis(limits.snapshot_assembly_timeout),
            max_pool_streams_per_relay: limits.max_pool_streams_per_relay,
            max_replica_bytes_per_relay: limits.max_replica_bytes_per_relay,
            max_query_table_bytes: limits.max_query_table_bytes,
            relay_silence_windows: limits.relay_silence_windows,
            min_relay_silence_ms: millis(limits.min_relay_silence),
            failover_hold_ms: millis(limits.failover_hold),
            rejoin_interval_ms: millis(limits.rejoin_interval),
            rejoin_window_ms: millis(limits.rejoin_window),
            standby_probe_interval_ms: millis(limits.standby_probe_interval),
            standby_mode: StandbyModeKey::default(),
            follow_tier_lanes: true,
            follow_format_twins: true,
            backoff_initial_ms: millis(BackoffConfig::DEFAULT_INITIAL),
            backoff_max_ms: millis(BackoffConfig::DEFAULT_MAX),
        }
    }
}

/// `standby_mode` of `[consumer]`: read with the consumer's own parser
/// (`StandbyMode::from_str`), so the names and the refusal are the consumer's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StandbyModeKey(pub StandbyMode);

impl<'de> Deserialize<'de> for StandbyModeKey {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map(Self).map_err(serde::de::Error::custom)
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

impl ConsumerSection {
    /// The consumer's limits: these keys set, every other limit at its default.
    #[allow(
        clippy::field_reassign_with_default,
        reason = "limits added to the consumer later keep their default here"
    )]
    /// The consumer's bounds. Built field by field with no `..Default::default()`, so a
    /// bound added to the consumer does not compile here until the router has its key.
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            max_frame_len: self.max_frame_len,
            max_pools_per_relay: self.max_pools_per_relay,
            max_replica_bytes_per_relay: self.max_replica_bytes_per_relay,
            max_pool_streams_per_relay: self.max_pool_streams_per_relay,
            max_query_table_bytes: self.max_query_table_bytes,
            connect_timeout: Duration::from_millis(self.connect_timeout_ms),
            staleness_bound: Duration::from_millis(self.staleness_bound_ms),
            catalog_staleness_bound: Duration::from_millis(self.catalog_staleness_bound_ms),
            snapshot_assembly_timeout: Duration::from_millis(self.snapshot_assembly_timeout_ms),
            resume_hold: Duration::from_millis(self.resume_hold_ms),
            relay_silence_windows: self.relay_silence_windows,
            min_relay_silence: Duration::from_millis(self.min_relay_silence_ms),
            failover_hold: Duration::from_millis(self.failover_hold_ms),
            rejoin_interval: Duration::from_millis(self.rejoin_interval_ms),
            rejoin_window: Duration::from_millis(self.rejoin_window_ms),
            standby_probe_interval: Duration::from_millis(self.standby_probe_interval_ms),
        }
    }
}

/// `[weights]`: the ranking formula's weights, read straight into the consumer's own type.
#[deprecated(note = "use kvrelay_consumer::ScoreWeights: `[weights]` is read into it directly")]
pub type WeightsSection = ScoreWeights;

/// A router configuration that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RouterConfigError {
    /// A relay's `protocol` is not one the consumer speaks.
    #[error("relay {dc}: {source}")]
    RelayProtocol {
        /// The relay's DC.
        dc: String,
        /// What is wrong.
        #[source]
        source: kvrelay_consumer::ConfigError,
    },
    /// TOML text (not from a file) is not a valid configuration.
    #[error("router config: {message}")]
    Syntax {
        /// The parser's message (line, key, expected type).
        message: String,
    },
    /// The TOML file could not be read.
    #[error("reading router config {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The TOML is malformed or has an unknown key or a value of the wrong type.
    #[error("router config {path}: {message}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's message (names the key and line).
        message: String,
    },
    /// A relay given as `ADDR=DC[:COST]` could not be parsed.
    #[error("relay {text:?}: {source}")]
    RelayArgument {
        /// The argument.
        text: String,
        /// Why.
        #[source]
        source: ConfigError,
    },
    /// A relay's TLS settings are inconsistent.
    #[error("relay {dc:?}: {message}")]
    RelayTls {
        /// The relay's DC name.
        dc: String,
        /// What is missing.
        message: &'static str,
    },
    /// A relay's bearer token could not be loaded.
    #[error("relay {dc:?}: bearer token: {source}")]
    Token {
        /// The relay's DC name.
        dc: String,
        /// Why.
        #[source]
        source: TokenError,
    },
    /// The API token (`[auth]`) could not be loaded.
    #[error("[auth] bearer token: {source}")]
    ApiToken {
        /// Why.
        #[source]
        source: TokenError,
    },
    /// `[auth] token_env` names a variable that is not set.
    #[error("[auth] token_env {name:?} is not set")]
    ApiTokenEnvMissing {
        /// The variable.
        name: String,
    },
    /// `token_env` names a variable that is not set.
    #[error("relay {dc:?}: token_env {name:?} is not set")]
    TokenEnvMissing {
        /// The relay's DC name.
        dc: String,
        /// The variable.
        name: String,
    },
    /// An HTTP bound is zero.
    #[error("[http] {field} must be greater than 0")]
    ZeroBound {
        /// The key.
        field: &'static str,
    },
    /// The consumer rejected the resulting configuration (relays, weights, bounds, TLS).
    #[error(transparent)]
    Consumer(#[from] ConfigError),
}

impl RouterConfig {
    /// Reads and parses a TOML file (unknown keys are refused).
    pub fn from_file(path: &Path) -> Result<Self, RouterConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| RouterConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text).map_err(|err| match err {
            RouterConfigError::Syntax { message } => RouterConfigError::Parse {
                path: path.to_owned(),
                message,
            },
            other => other,
        })
    }

    /// Parses TOML text ([`RouterConfigError::Syntax`] with the parser's message, which
    /// names the line and the key).
    pub fn from_toml(text: &str) -> Result<Self, RouterConfigError> {
        toml::from_str(text).map_err(|err| RouterConfigError::Syntax {
            message: err.to_string().trim_end().to_owned(),
        })
    }

    /// Parses `[PROTOCOL://]ADDR[+STANDBY..]=DC[:COST]` (as `kvrelay route --relay`) into a plaintext
    /// relay (`dynamo-grpc://` follows it over Dynamo's relay contract).
    pub fn parse_relay(text: &str) -> Result<RelaySection, RouterConfigError> {
        let relay =
            text.parse::<RelayEndpoint>()
                .map_err(|source| RouterConfigError::RelayArgument {
                    text: text.to_owned(),
                    source,
                })?;
        Ok(RelaySection {
            protocol: (relay.protocol != RelayProtocol::default())
                .then(|| relay.protocol.name().to_owned()),
            standby: relay.standby.clone(),
            ..RelaySection::new(&relay.addr, &relay.dc, relay.cost)
        })
    }

    /// Checks the HTTP bounds and builds the consumer configuration, loading every token
    /// and PEM file. `env` looks up environment variables (`token_env`).
    pub fn consumer_config(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<ConsumerConfig, RouterConfigError> {
        let zero = [
            ("max_body_bytes", self.http.max_body_bytes == 0),
            (
                "max_concurrent_requests",
                self.http.max_concurrent_requests == 0,
            ),
            ("max_batch", self.http.max_batch == 0),
            ("max_tokens", self.http.max_tokens == 0),
            ("max_top_k", self.http.max_top_k == 0),
            ("max_connections", self.http.max_connections == 0),
            (
                "max_connections_per_peer",
                self.http.max_connections_per_peer == 0,
            ),
            (
                "header_read_timeout_ms",
                self.http.header_read_timeout_ms == 0,
            ),
            (
                "connection_timeout_ms",
                self.http.connection_timeout_ms == 0,
            ),
            ("body_timeout_ms", self.http.body_timeout_ms == 0),
        ];
        if let Some((field, _)) = zero.into_iter().find(|(_, is_zero)| *is_zero) {
            return Err(RouterConfigError::ZeroBound { field });
        }
        let relays = self
            .relays
            .iter()
            .map(|relay| relay_config(relay, &env))
            .collect::<Result<Vec<_>, _>>()?;
        let mut config = ConsumerConfig::new(relays);
        config.limits = self.consumer.limits();
        config.standby = self.consumer.standby_mode.0;
        config.follow_tier_lanes = self.consumer.follow_tier_lanes;
        config.follow_format_twins = self.consumer.follow_format_twins;
        config.backoff = BackoffConfig {
            initial: Duration::from_millis(self.consumer.backoff_initial_ms),
            max: Duration::from_millis(self.consumer.backoff_max_ms),
            ..BackoffConfig::default()
        };
        config.weights = self.weights;
        config.subscriber_id = "kvrelay-router".to_owned();
        config.validate()?;
        Ok(config)
    }

    /// The most file descriptors the router may hold at once by its bounds: `consumer`'s
    /// connections ([`ConsumerConfig::max_open_connections`]), the HTTP listener and
    /// `[http] max_connections`, and [`RouterConfig::DESCRIPTOR_RESERVE`] for the runtime,
    /// standard streams and files read while running. `kvrelay router` compares it with the
    /// open file limit at start.
    pub fn max_open_descriptors(&self, consumer: &ConsumerConfig) -> u64 {
        consumer
            .max_open_connections()
            .saturating_add(1 + u64::from(self.http.max_connections))
            .saturating_add(Self::DESCRIPTOR_RESERVE)
    }

    /// Descriptors [`RouterConfig::max_open_descriptors`] keeps for the process itself
    /// (the runtime's event queue and wakers, standard streams, PEM and token files).
    pub const DESCRIPTOR_RESERVE: u64 = 64;
}

impl RouterConfig {
    /// The API token of `[auth]`, if one is configured (`env` resolves `token_env`). The
    /// token follows the same rules as relay tokens: trimmed, non-empty, at most 4,096
    /// bytes, no control characters.
    pub fn api_token(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<BearerToken>, RouterConfigError> {
        let token_error = |source| RouterConfigError::ApiToken { source };
        match (&self.auth.token_file, &self.auth.token_env) {
            (Some(path), _) => Ok(Some(BearerToken::from_file(path).map_err(token_error)?)),
            (None, Some(name)) => {
                let text = env(name)
                    .ok_or_else(|| RouterConfigError::ApiTokenEnvMissing { name: name.clone() })?;
                Ok(Some(BearerToken::new(&text).map_err(token_error)?))
            }
            (None, None) => Ok(None),
        }
    }
}

fn relay_config(
    relay: &RelaySection,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<RelayEndpoint, RouterConfigError> {
    let tls_error = |message| RouterConfigError::RelayTls {
        dc: relay.dc.clone(),
        message,
    };
    let tls = match (&relay.tls_ca, &relay.tls_cert, &relay.tls_key) {
        (None, None, None) if relay.tls_server_name.is_none() => None,
        (None, _, _) => {
            return Err(tls_error(
                "tls_cert, tls_key and tls_server_name need tls_ca",
            ));
        }
        (Some(_), Some(_), None) | (Some(_), None, Some(_)) => {
            return Err(tls_error("tls_cert and tls_key go together"));
        }
        (Some(ca), cert, key) => Some(RelayTls {
            ca: ca.clone(),
            cert: cert.clone(),
            key: key.clone(),
            server_name: relay.tls_server_name.clone(),
        }),
    };
    let token_error = |source| RouterConfigError::Token {
        dc: relay.dc.clone(),
        source,
    };
    let token = match (&relay.token_file, &relay.token_env) {
        (Some(path), _) => Some(BearerToken::from_file(path).map_err(token_error)?),
        (None, Some(name)) => {
            let text = env(name).ok_or_else(|| RouterConfigError::TokenEnvMissing {
                dc: relay.dc.clone(),
                name: name.clone(),
            })?;
            Some(BearerToken::new(&text).map_err(token_error)?)
        }
        (None, None) => None,
    };
    let protocol = match &relay.protocol {
        None => RelayProtocol::default(),
        Some(text) => {
            text.parse::<RelayProtocol>()
                .map_err(|source| RouterConfigError::RelayProtocol {
                    dc: relay.dc.clone(),
                    source,
                })?
        }
    };
    Ok(RelayEndpoint {
        addr: relay.address.clone(),
        standby: relay.standby.clone(),
        dc: relay.dc.clone(),
        cost: relay.cost,
        tls,
        token,
        protocol,
    })
}

#[cfg(test)]
mod tests;
