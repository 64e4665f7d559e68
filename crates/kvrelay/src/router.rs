//! `kvrelay router`: follow the relays of every DC and answer route requests over HTTP
//! until SIGINT or SIGTERM.
//!
//! Configuration precedence: flags, then `KVRELAY_ROUTER_*` environment variables, then
//! the TOML file given with `--config`, then built-in defaults (docs/consumer.md). Relays
//! given with `--relay` replace the file's `[[relays]]` (plaintext, no token; put TLS and
//! tokens in the file).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use kvrelay_consumer::ConsumerConfig;
use kvrelay_router::{RouterConfig, RouterService};

use crate::fd_limit::raise_open_file_limit;

use crate::relay::{LogFormat, init_logging};
use crate::usage::usage;

/// Arguments of `kvrelay router`.
#[derive(Debug, clap::Args)]
pub(crate) struct RouterArgs {
    /// The router's TOML configuration file.
    #[arg(long, short, env = "KVRELAY_ROUTER_CONFIG")]
    config: Option<PathBuf>,
    /// HTTP listen address (default 127.0.0.1:7480).
    #[arg(long, env = "KVRELAY_ROUTER_LISTEN")]
    listen: Option<SocketAddr>,
    /// A relay to follow, `ADDR[+STANDBY..]=DC[:COST]` (repeatable; `+` names a relay pair of
    /// one DC); replaces the file's relays.
    #[arg(long = "relay", env = "KVRELAY_ROUTER_RELAYS", value_delimiter = ',')]
    relays: Vec<String>,
    /// Log filter (tracing env-filter syntax).
    #[arg(long, env = "KVRELAY_LOG", default_value = "info")]
    log: String,
    /// Log line format: `text` (colours only on a terminal) or `json`.
    #[arg(long, env = "KVRELAY_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// Defaults, then the file, then environment and flags (already merged by clap); with the
/// consumer configuration they make (checked now, before anything starts).
fn resolve(args: &RouterArgs) -> Result<(RouterConfig, ConsumerConfig)> {
    let mut config = match &args.config {
        Some(path) => RouterConfig::from_file(path).map_err(|err| usage(err.to_string()))?,
        None => RouterConfig::default(),
    };
    if let Some(listen) = args.listen {
        config.listen = listen;
    }
    if !args.relays.is_empty() {
        config.relays = args
            .relays
            .iter()
            .map(|text| RouterConfig::parse_relay(text).map_err(|err| usage(err.to_string())))
            .collect::<Result<_>>()?;
    }
    // Everything else (tokens, PEMs, bounds) is checked now, before anything starts.
    let consumer = config
        .consumer_config(crate::relay::secret_env)
        .map_err(|err| usage(err.to_string()))?;
    Ok((config, consumer))
}

/// Raises the open file limit and says whether the router's bounds fit under it: past
/// the limit, connects and accepts fail with EMFILE (the API backs off and keeps what it
/// has, but a DC's pools go unfollowed), so the operator is told how many it may need.
fn check_descriptors(config: &RouterConfig, consumer: &ConsumerConfig) {
    let limit = raise_open_file_limit();
    let demand = config.max_open_descriptors(consumer);
    tracing::info!(
        soft_before = %crate::fd_limit::shown(limit.before),
        soft = %crate::fd_limit::shown(limit.now),
        hard = %crate::fd_limit::shown(limit.hard),
        demand,
        "open file limit"
    );
    if !limit.fits(demand) {
        tracing::warn!(
            soft = %crate::fd_limit::shown(limit.now),
            hard = %crate::fd_limit::shown(limit.hard),
            demand,
            relays = config.relays.len(),
            max_pool_streams_per_relay = consumer.limits.max_pool_streams_per_relay,
            http_max_connections = config.http.max_connections,
            "the open file limit is below what the router's bounds allow at once; raise \
             the hard limit (e.g. systemd LimitNOFILE) or lower \
             [consumer] max_pool_streams_per_relay or [http] max_connections"
        );
    }
}

/// Runs the router until a signal, then shuts it down gracefully.
pub(crate) fn run(args: RouterArgs) -> Result<()> {
    let (config, consumer) = resolve(&args)?;
    init_logging(&args.log, args.log_format);
    check_descriptors(&config, &consumer);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("building the tokio runtime")?;
    runtime.block_on(async move {
        let router = RouterService::start(&config, crate::relay::secret_env).await?;
        eprintln!(
            "kvrelay router: HTTP {} following {} relay(s)",
            router.local_addr(),
            config.relays.len()
        );
        kvrelay_http::wait_for_signal().await;
        tracing::info!("signal received; shutting down");
        router.shutdown().await;
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests fail loudly")]

    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: RouterArgs,
    }

    #[test]
    fn flags_beat_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("router.toml");
        std::fs::write(
            &file,
            "listen = \"127.0.0.1:9100\"\n[[relays]]\naddress = \"127.0.0.1:7400\"\ndc = \"file-dc\"\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let (from_file, consumer) =
            resolve(&Cli::parse_from(["router", "--config", path]).args).unwrap();
        assert_eq!(consumer.relays[0].dc, "file-dc");
        assert_eq!(from_file.listen.port(), 9100);
        assert_eq!(from_file.relays[0].dc, "file-dc");
        let (overridden, _) = resolve(
            &Cli::parse_from([
                "router",
                "--config",
                path,
                "--listen",
                "127.0.0.1:9200",
                "--relay",
                "127.0.0.1:7500=flag-dc:3",
            ])
            .args,
        )
        .unwrap();
        assert_eq!(overridden.listen.port(), 9200);
        assert_eq!(overridden.relays.len(), 1);
        assert_eq!(overridden.relays[0].dc, "flag-dc");
    }

    #[test]
    fn a_bad_relay_or_no_relay_is_a_usage_error() {
        let err = resolve(&Cli::parse_from(["router", "--relay", "127.0.0.1:7400=dc:-3"]).args)
            .unwrap_err();
        assert!(err.downcast_ref::<crate::UsageError>().is_some(), "{err:#}");
        let err = resolve(&Cli::parse_from(["router"]).args).unwrap_err();
        assert!(err.to_string().contains("relay"), "{err:#}");
    }
}
