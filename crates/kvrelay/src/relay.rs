//! `kvrelay relay`: run the relay service of one datacenter until SIGINT or SIGTERM.
//!
//! Configuration precedence: flags, then `KVRELAY_*` environment variables, then the TOML
//! file given with `--config`, then built-in defaults (see docs/operations.md).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use kvrelay_server::{Relay, RelayConfig, RelayOverrides, WorkloadConfig};

/// Arguments of `kvrelay relay` (boxed: they are large next to other subcommands).
#[derive(Debug, clap::Args)]
pub(crate) struct RelayArgs {
    #[command(flatten)]
    flags: Box<RelayFlags>,
}

/// The flags of `kvrelay relay`.
#[derive(Debug, clap::Args)]
struct RelayFlags {
    /// The relay's TOML configuration file.
    #[arg(long, short, env = "KVRELAY_CONFIG")]
    config: Option<PathBuf>,
    /// This datacenter's name (hashed into the DcId).
    #[arg(long, env = "KVRELAY_DC_ID")]
    dc_id: Option<String>,
    /// WAN listen address.
    #[arg(long, env = "KVRELAY_LISTEN")]
    listen: Option<SocketAddr>,
    /// Admin HTTP listen address.
    #[arg(long, env = "KVRELAY_ADMIN_LISTEN")]
    admin_listen: Option<SocketAddr>,
    /// Turn admin HTTP off.
    #[arg(long)]
    no_admin: bool,
    /// File discovery: a directory of model card records.
    #[arg(long, env = "KVRELAY_CARDS")]
    cards: Option<PathBuf>,
    /// etcd discovery endpoints (comma-separated).
    #[arg(long = "etcd", env = "KVRELAY_ETCD", value_delimiter = ',')]
    etcd: Vec<String>,
    /// Dynamo router events on this NATS server (every endpoint's KV-event subject).
    #[arg(long = "nats", env = "KVRELAY_NATS")]
    nats: Option<String>,
    /// Replay this request trace (JSONL) into the discovered pools.
    #[arg(long, env = "KVRELAY_TRACE")]
    trace: Option<PathBuf>,
    /// Replay the request trace built into the binary.
    #[arg(long, conflicts_with = "trace")]
    builtin_workload: bool,
    /// Trace replay speed (1.0 = real time, 0 = as fast as possible).
    #[arg(long)]
    replay_speed: Option<f64>,
    /// TLS certificate chain (PEM) of the WAN listener.
    #[arg(long, env = "KVRELAY_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM) of the WAN listener.
    #[arg(long, env = "KVRELAY_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require client certificates signed by these CAs (PEM).
    #[arg(long, env = "KVRELAY_TLS_CLIENT_CA")]
    tls_client_ca: Option<PathBuf>,
    /// Refused: a token on the command line is visible to every local user in
    /// `/proc/<pid>/cmdline`. Set KVRELAY_TOKEN or use --token-file.
    #[arg(long, hide = true)]
    token: Option<String>,
    /// File holding the bearer token clients must present (or set KVRELAY_TOKEN).
    #[arg(long, env = "KVRELAY_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// File holding the admin HTTP bearer token (or set KVRELAY_ADMIN_TOKEN).
    #[arg(long, env = "KVRELAY_ADMIN_TOKEN_FILE")]
    admin_token_file: Option<PathBuf>,
    /// Log filter (tracing env-filter syntax).
    #[arg(long, env = "KVRELAY_LOG", default_value = "info")]
    log: String,
    /// Log line format: `text` (colours only on a terminal) or `json` (one object a line).
    #[arg(long, env = "KVRELAY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum LogFormat {
    /// Human-readable lines; ANSI colours only when stderr is a terminal.
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// Environment variable holding the WAN bearer token (never a flag: see `--token`).
const TOKEN_ENV: &str = "KVRELAY_TOKEN";
/// Environment variable holding the admin HTTP bearer token.
const ADMIN_TOKEN_ENV: &str = "KVRELAY_ADMIN_TOKEN";

/// Runs the relay until a signal, then shuts down in order.
pub(crate) fn run(args: RelayArgs) -> Result<()> {
    let args = args.flags;
    if args.token.is_some() {
        return Err(crate::usage::usage(
            "--token is refused: a token on the command line is visible to every local user \
             in /proc/<pid>/cmdline; set KVRELAY_TOKEN or use --token-file"
                .to_owned(),
        ));
    }
    let config =
        resolve(args.clone_for_config(secret_env(TOKEN_ENV), secret_env(ADMIN_TOKEN_ENV)))?;
    init_logging(&args.log, args.log_format);
    // One descriptor per WAN, admin and engine connection: the soft default is too low.
    let limit = crate::fd_limit::raise_open_file_limit();
    tracing::info!(soft_before = %crate::fd_limit::shown(limit.before), soft = %crate::fd_limit::shown(limit.now), hard = %crate::fd_limit::shown(limit.hard), "open file limit");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(async move {
        let relay = Relay::start(config).await?;
        // Scripts parse this first line; the Dynamo door gets a line of its own.
        eprintln!(
            "kvrelay relay: WAN {} admin {}",
            relay.wan_addr(),
            relay
                .admin_addr()
                .map_or_else(|| "off".to_owned(), |addr| addr.to_string())
        );
        if let Some(addr) = relay.dynamo_addr() {
            eprintln!("kvrelay relay: Dynamo gRPC {addr}");
        }
        relay.run_until_signal().await?;
        Ok(())
    })
}

/// A secret from the environment; an empty value counts as unset.
pub(crate) fn secret_env(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .filter(|value| !value.trim().is_empty())
}

impl RelayFlags {
    fn clone_for_config(&self, token: Option<String>, admin_token: Option<String>) -> ConfigArgs {
        ConfigArgs {
            config: self.config.clone(),
            overrides: RelayOverrides {
                dc_id: self.dc_id.clone(),
                wan_listen: self.listen,
                admin_listen: self.admin_listen,
                admin_disabled: self.no_admin,
                cards_dir: self.cards.clone(),
                etcd_endpoints: self.etcd.clone(),
                trace: self.trace.clone(),
                replay_speed: self.replay_speed,
                nats_server: self.nats.clone(),
                tls_cert: self.tls_cert.clone(),
                tls_key: self.tls_key.clone(),
                tls_client_ca: self.tls_client_ca.clone(),
                // A file named by flag or env beats an inline token from the environment.
                token: token.filter(|_| self.token_file.is_none()),
                token_file: self.token_file.clone(),
                admin_token: admin_token.filter(|_| self.admin_token_file.is_none()),
                admin_token_file: self.admin_token_file.clone(),
            },
            builtin_workload: self.builtin_workload,
        }
    }
}

struct ConfigArgs {
    config: Option<PathBuf>,
    overrides: RelayOverrides,
    builtin_workload: bool,
}

/// Defaults, then the file, then environment and flags (already merged by clap).
fn resolve(args: ConfigArgs) -> Result<RelayConfig> {
    let mut config = match &args.config {
        Some(path) => {
            RelayConfig::from_file(path).map_err(|err| crate::usage::usage(err.to_string()))?
        }
        None => RelayConfig::default(),
    };
    let speed = args.overrides.replay_speed;
    config.apply(args.overrides);
    if args.builtin_workload && config.workload.is_none() {
        config.workload = Some(WorkloadConfig {
            trace: None,
            speed: speed.unwrap_or(0.0),
            loops: 1,
        });
    }
    config
        .validate()
        .map_err(|err| crate::usage::usage(err.to_string()))?;
    Ok(config)
}

/// Installs the stderr subscriber: `text` lines carry ANSI colours only when stderr is a
/// terminal (a file or a pipe gets plain text); `json` writes one object per line. Either
/// way field values are escaped by the formatter, and peer-supplied strings are logged with
/// `Debug` formatting, so no input can forge a line.
pub(crate) fn init_logging(filter: &str, format: LogFormat) {
    use std::io::IsTerminal;

    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder
            .with_ansi(std::io::stderr().is_terminal())
            .try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("relay.toml");
        std::fs::write(
            &path,
            "dc_id = \"from-file\"\n[discovery]\ndir = \"cards\"\n",
        )
        .unwrap();
        let config = resolve(ConfigArgs {
            config: Some(path.clone()),
            overrides: RelayOverrides {
                dc_id: Some("from-flag".into()),
                ..RelayOverrides::default()
            },
            builtin_workload: false,
        })
        .unwrap();
        assert_eq!(config.dc_id, "from-flag");
        let config = resolve(ConfigArgs {
            config: Some(path),
            overrides: RelayOverrides::default(),
            builtin_workload: true,
        })
        .unwrap();
        assert_eq!(config.dc_id, "from-file");
        assert!(
            config
                .workload
                .is_some_and(|workload| workload.trace.is_none())
        );
    }

    #[test]
    fn invalid_config_is_a_usage_error() {
        let err = resolve(ConfigArgs {
            config: None,
            overrides: RelayOverrides::default(),
            builtin_workload: false,
        })
        .unwrap_err();
        assert!(err.downcast_ref::<crate::UsageError>().is_some(), "{err:#}");
    }
}
