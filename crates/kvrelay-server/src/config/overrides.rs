//! [`RelayOverrides`]: what flags and environment set, applied over the file.

use std::net::SocketAddr;
use std::path::PathBuf;

use super::redacted;

/// Values resolved from flags and environment that beat the file. `None` keeps the file's.
/// `Debug` never shows a token.
#[derive(Clone, Default, PartialEq)]
pub struct RelayOverrides {
    /// `--dc-id` / `KVRELAY_DC_ID`.
    pub dc_id: Option<String>,
    /// `--listen` / `KVRELAY_LISTEN`.
    pub wan_listen: Option<SocketAddr>,
    /// `--admin-listen` / `KVRELAY_ADMIN_LISTEN`.
    pub admin_listen: Option<SocketAddr>,
    /// `--no-admin`.
    pub admin_disabled: bool,
    /// `--cards DIR` / `KVRELAY_CARDS`: file discovery from this directory.
    pub cards_dir: Option<PathBuf>,
    /// `--etcd URL` / `KVRELAY_ETCD`: etcd discovery.
    pub etcd_endpoints: Vec<String>,
    /// `--trace FILE` / `KVRELAY_TRACE`.
    pub trace: Option<PathBuf>,
    /// `--replay-speed X`.
    pub replay_speed: Option<f64>,
    /// `--nats URL` / `KVRELAY_NATS`.
    pub nats_server: Option<String>,
    /// `--tls-cert` / `KVRELAY_TLS_CERT`.
    pub tls_cert: Option<PathBuf>,
    /// `--tls-key` / `KVRELAY_TLS_KEY`.
    pub tls_key: Option<PathBuf>,
    /// `--tls-client-ca` / `KVRELAY_TLS_CLIENT_CA`.
    pub tls_client_ca: Option<PathBuf>,
    /// `KVRELAY_TOKEN` (prefer the environment over a flag for secrets).
    pub token: Option<String>,
    /// `--token-file` / `KVRELAY_TOKEN_FILE`.
    pub token_file: Option<PathBuf>,
    /// `KVRELAY_ADMIN_TOKEN`: the admin HTTP bearer token (environment only).
    pub admin_token: Option<String>,
    /// `--admin-token-file` / `KVRELAY_ADMIN_TOKEN_FILE`.
    pub admin_token_file: Option<PathBuf>,
}

impl std::fmt::Debug for RelayOverrides {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayOverrides")
            .field("dc_id", &self.dc_id)
            .field("wan_listen", &self.wan_listen)
            .field("admin_listen", &self.admin_listen)
            .field("admin_disabled", &self.admin_disabled)
            .field("cards_dir", &self.cards_dir)
            .field("etcd_endpoints", &self.etcd_endpoints)
            .field("trace", &self.trace)
            .field("replay_speed", &self.replay_speed)
            .field("nats_server", &self.nats_server)
            .field("tls_cert", &self.tls_cert)
            .field("tls_key", &self.tls_key)
            .field("tls_client_ca", &self.tls_client_ca)
            .field("token", &redacted(self.token.as_ref()))
            .field("token_file", &self.token_file)
            .field("admin_token", &redacted(self.admin_token.as_ref()))
            .field("admin_token_file", &self.admin_token_file)
            .finish()
    }
}
