//! The listener tables: `[wan]` (with `[wan.tls]` and `[wan.auth]`) and `[admin]`, their
//! defaults, and the exposure warnings a listener beyond loopback without protection gets.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{ConfigError, redacted};

/// Default WAN listen address: loopback only, so an unconfigured relay is never exposed.
pub const DEFAULT_WAN_LISTEN: &str = "127.0.0.1:7400";
/// Default listen address of the Dynamo-contract door (`[dynamo]`), loopback only.
pub const DEFAULT_DYNAMO_LISTEN: &str = "127.0.0.1:7402";
/// Default admin HTTP listen address.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:7401";
/// Default time an admin HTTP connection has to send a complete request head, in ms; it
/// also bounds how long an idle keep-alive connection stays open (every HTTP listener's
/// default, 5 s).
pub const DEFAULT_ADMIN_HEADER_READ_TIMEOUT_MS: u64 =
    kvrelay_http::HttpBounds::DEFAULT_HEADER_READ_TIMEOUT.as_millis() as u64;
/// Default longest life of one admin HTTP connection, in ms (a slow reader of a large
/// `/metrics` answer is closed then; every HTTP listener's default, 60 s).
pub const DEFAULT_ADMIN_CONNECTION_TIMEOUT_MS: u64 =
    kvrelay_http::HttpBounds::DEFAULT_CONNECTION_TIMEOUT.as_millis() as u64;
/// Default concurrent admin HTTP connections; extra ones are closed at accept.
pub const DEFAULT_ADMIN_MAX_CONNECTIONS: u32 = 64;

/// The `[wan]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WanConfig {
    /// Listen address of the WAN protocol.
    pub listen: SocketAddr,
    /// Optional TLS on the WAN listener.
    pub tls: Option<kvrelay_tls::ListenerTls>,
    /// Optional bearer-token authentication.
    pub auth: Option<AuthConfig>,
}

impl Default for WanConfig {
    fn default() -> Self {
        Self {
            listen: default_socket(DEFAULT_WAN_LISTEN, 7400),
            tls: None,
            auth: None,
        }
    }
}

/// The `[dynamo]` table: Dynamo's relay contract (`dynamo.kvrelay.v1` over gRPC) on its
/// own port, beside the WAN port, publishing the same pools. Off unless the table is
/// present. It needs `[dynamo.tls]`, or `plaintext = true` to serve without TLS (Dynamo's
/// own relay serves plaintext only; ours never does so by default).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DynamoConfig {
    /// Listen address of the gRPC door.
    pub listen: SocketAddr,
    /// TLS on the door (the same table as `[wan.tls]`).
    pub tls: Option<kvrelay_tls::ListenerTls>,
    /// An optional bearer token every `KvEventRelay` call must present
    /// (`authorization: Bearer ..` metadata); gRPC health and reflection stay open.
    pub auth: Option<AuthConfig>,
    /// Serve without TLS; must be said explicitly when `tls` is absent.
    pub plaintext: bool,
}

impl Default for DynamoConfig {
    fn default() -> Self {
        Self {
            listen: default_socket(DEFAULT_DYNAMO_LISTEN, 7402),
            tls: None,
            auth: None,
            plaintext: false,
        }
    }
}

impl DynamoConfig {
    /// Exactly one of TLS or an explicit `plaintext = true`; a valid token table.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        match (&self.tls, self.plaintext) {
            (None, false) => {
                return Err(ConfigError::InvalidField {
                    field: "dynamo.plaintext",
                    value: "false".to_owned(),
                    reason: "the Dynamo door needs [dynamo.tls], or plaintext = true to serve without TLS",
                });
            }
            (Some(_), true) => {
                return Err(ConfigError::InvalidField {
                    field: "dynamo.plaintext",
                    value: "true".to_owned(),
                    reason: "set either [dynamo.tls] or plaintext = true, not both",
                });
            }
            (Some(tls), false)
                if tls.cert.as_os_str().is_empty() || tls.key.as_os_str().is_empty() =>
            {
                return Err(ConfigError::InvalidField {
                    field: "dynamo.tls",
                    value: format!("cert={} key={}", tls.cert.display(), tls.key.display()),
                    reason: "TLS needs both a certificate and a key",
                });
            }
            _ => {}
        }
        match &self.auth {
            Some(auth) => auth.validate(AuthTable::Dynamo),
            None => Ok(()),
        }
    }
}

/// The `[wan.auth]` table: exactly one of `token` or `token_file`. `Debug` never shows
/// the token, so a config logged or printed in an error does not leak it.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// The bearer token inline (prefer `token_file` or the environment).
    pub token: Option<String>,
    /// A file whose trimmed contents are the bearer token.
    pub token_file: Option<PathBuf>,
}

/// Which listener an [`AuthConfig`] guards, to name its fields in errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AuthTable {
    /// `[wan.auth]`.
    Wan,
    /// `[admin.auth]`.
    Admin,
    /// `[dynamo.auth]`.
    Dynamo,
}

impl AuthTable {
    pub(crate) fn table(self) -> &'static str {
        match self {
            Self::Wan => "wan.auth",
            Self::Admin => "admin.auth",
            Self::Dynamo => "dynamo.auth",
        }
    }

    pub(crate) fn token_field(self) -> &'static str {
        match self {
            Self::Wan => "wan.auth.token",
            Self::Admin => "admin.auth.token",
            Self::Dynamo => "dynamo.auth.token",
        }
    }

    pub(crate) fn token_file_field(self) -> &'static str {
        match self {
            Self::Wan => "wan.auth.token_file",
            Self::Admin => "admin.auth.token_file",
            Self::Dynamo => "dynamo.auth.token_file",
        }
    }
}

/// Where a token comes from, once the table has exactly one source.
enum TokenSource<'a> {
    Inline(&'a str),
    File(&'a Path),
}

impl AuthConfig {
    /// Checks the table without touching the file system: exactly one of `token` and
    /// `token_file`, and an inline token that follows the token rules (a file's contents
    /// are checked by [`AuthConfig::load`] when the relay starts).
    pub(crate) fn validate(&self, table: AuthTable) -> Result<(), ConfigError> {
        match self.source(table)? {
            TokenSource::Inline(token) => inline_token(token, table).map(drop),
            TokenSource::File(_) => Ok(()),
        }
    }

    /// The token this table configures (inline, or read from its file now), or the field
    /// that cannot be used.
    pub(crate) fn load(&self, table: AuthTable) -> Result<kvrelay_tls::BearerToken, ConfigError> {
        match self.source(table)? {
            TokenSource::Inline(token) => inline_token(token, table),
            TokenSource::File(path) => {
                kvrelay_tls::BearerToken::from_file(path).map_err(|source| ConfigError::Token {
                    field: table.token_file_field(),
                    source,
                })
            }
        }
    }

    /// The one "exactly one of token or token_file" check.
    fn source(&self, table: AuthTable) -> Result<TokenSource<'_>, ConfigError> {
        match (&self.token, &self.token_file) {
            (Some(token), None) => Ok(TokenSource::Inline(token)),
            (None, Some(path)) => Ok(TokenSource::File(path)),
            (Some(_), Some(_)) | (None, None) => Err(ConfigError::InvalidField {
                field: table.table(),
                value: String::new(),
                reason: "set exactly one of token or token_file",
            }),
        }
    }
}

/// An inline token under the token rules; errors name the table's `token` field.
fn inline_token(token: &str, table: AuthTable) -> Result<kvrelay_tls::BearerToken, ConfigError> {
    kvrelay_tls::BearerToken::new(token).map_err(|source| ConfigError::Token {
        field: table.token_field(),
        source,
    })
}

impl std::fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthConfig")
            .field("token", &redacted(self.token.as_ref()))
            .field("token_file", &self.token_file)
            .finish()
    }
}

/// The `[admin]` table.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdminConfig {
    /// Listen address of the admin HTTP server; `enabled = false` turns it off.
    pub listen: SocketAddr,
    /// Whether the admin HTTP server runs.
    pub enabled: bool,
    /// Time to send a complete request head (also the keep-alive idle bound), in ms.
    pub header_read_timeout_ms: u64,
    /// Longest life of one connection, in ms.
    pub connection_timeout_ms: u64,
    /// Concurrent connections; extra ones are closed at accept.
    pub max_connections: u32,
    /// Optional bearer token (`Authorization: Bearer ..`) required on every path except
    /// `/healthz` and `/readyz`.
    pub auth: Option<AuthConfig>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        Self {
            listen: default_socket(DEFAULT_ADMIN_LISTEN, 7401),
            enabled: true,
            header_read_timeout_ms: DEFAULT_ADMIN_HEADER_READ_TIMEOUT_MS,
            connection_timeout_ms: DEFAULT_ADMIN_CONNECTION_TIMEOUT_MS,
            max_connections: DEFAULT_ADMIN_MAX_CONNECTIONS,
            auth: None,
        }
    }
}

/// A listener reachable beyond loopback without protection; logged at warn on start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExposureWarning {
    /// The WAN listener is not on loopback and has neither TLS nor a bearer token.
    #[error(
        "WAN listener {listen} is reachable beyond loopback without TLS or a bearer token: anyone who can reach it can read every pool"
    )]
    WanUnprotected {
        /// The listen address.
        listen: SocketAddr,
    },
    /// The WAN listener has a bearer token but no TLS: the token crosses the network in
    /// clear text.
    #[error(
        "WAN listener {listen} checks a bearer token without TLS: the token travels in clear text"
    )]
    WanTokenWithoutTls {
        /// The listen address.
        listen: SocketAddr,
    },
    /// The Dynamo-contract door is not on loopback and serves plaintext without a token.
    #[error(
        "Dynamo-contract door {listen} is reachable beyond loopback in plaintext without a bearer token: anyone who can reach it can read every pool"
    )]
    DynamoUnprotected {
        /// The listen address.
        listen: SocketAddr,
    },
    /// Admin HTTP is not on loopback and has no bearer token.
    #[error(
        "admin HTTP {listen} is reachable beyond loopback without a bearer token: set admin.auth or listen on loopback"
    )]
    AdminUnprotected {
        /// The listen address.
        listen: SocketAddr,
    },
}

fn default_socket(text: &str, port: u16) -> SocketAddr {
    text.parse()
        .unwrap_or(SocketAddr::from(([127, 0, 0, 1], port)))
}
