//! `kvrelay route`: connect to relays, let replicas settle, rank the pools for one request
//! and print the ranking as JSON.
//!
//! TLS and the bearer token apply to every `--relay`. The token comes from a file or the
//! environment, never from a flag: a command line is readable by every local user.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use kvrelay_consumer::{
    BearerToken, ConsumerConfig, RelayEndpoint, RelayTls, RouteReport, ScoreRequest,
    ScoredCandidate, route_once,
};
use serde_json::{Value, json};

use crate::usage::usage;

/// Arguments of `kvrelay route`.
#[derive(Debug, clap::Args)]
pub(crate) struct RouteArgs {
    /// A relay to watch, `ADDR[+STANDBY..][=DC[:COST]]` (repeatable; `+` names a relay pair
    /// of one DC), e.g. `10.0.0.7:7400=us-east:12.5`.
    #[arg(long = "relay", required = true)]
    relays: Vec<String>,
    /// The model: canonical id or alias.
    #[arg(long)]
    model: String,
    /// A LoRA adapter on the model.
    #[arg(long)]
    lora: Option<String>,
    /// The cache namespace salt.
    #[arg(long)]
    namespace: Option<String>,
    /// File of token ids, separated by whitespace or commas.
    #[arg(long)]
    tokens_file: std::path::PathBuf,
    /// Longest wait for catalogs and replicas before scoring, in milliseconds.
    #[arg(long, default_value_t = 5000)]
    settle_ms: u64,
    #[command(flatten)]
    security: SecurityArgs,
}

/// How `kvrelay route` reaches secured relays (the same for every `--relay`).
#[derive(Debug, Default, clap::Args)]
pub(crate) struct SecurityArgs {
    /// Connect over TLS, trusting only the CAs in this PEM bundle.
    #[arg(long, env = "KVRELAY_ROUTE_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// Client certificate chain (PEM) for relays that require mutual TLS.
    #[arg(long, env = "KVRELAY_ROUTE_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, env = "KVRELAY_ROUTE_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Name the relay certificates must carry (default: each relay address's host).
    #[arg(long, env = "KVRELAY_ROUTE_TLS_SERVER_NAME", requires = "tls_ca")]
    tls_server_name: Option<String>,
    /// Refused: a token on the command line is visible to every local user in
    /// `/proc/<pid>/cmdline`. Set KVRELAY_ROUTE_TOKEN or use --token-file.
    #[arg(long, hide = true)]
    token: Option<String>,
    /// File holding the bearer token sent to the relays (or set KVRELAY_ROUTE_TOKEN).
    #[arg(long, env = "KVRELAY_ROUTE_TOKEN_FILE")]
    token_file: Option<PathBuf>,
}

/// Environment variable holding the bearer token sent to relays (never a flag).
const TOKEN_ENV: &str = "KVRELAY_ROUTE_TOKEN";

impl SecurityArgs {
    /// The TLS settings and token for every relay. `env_token` is the token from the
    /// environment; a token file named by flag or env beats it, like the relay's.
    fn resolve(
        &self,
        env_token: Option<String>,
    ) -> Result<(Option<RelayTls>, Option<BearerToken>)> {
        if self.token.is_some() {
            return Err(usage(
                "--token is refused: a token on the command line is visible to every local \
                 user in /proc/<pid>/cmdline; set KVRELAY_ROUTE_TOKEN or use --token-file"
                    .to_owned(),
            ));
        }
        let token = match (&self.token_file, env_token) {
            (Some(path), _) => {
                Some(BearerToken::from_file(path).map_err(|err| usage(err.to_string()))?)
            }
            (None, Some(text)) => {
                Some(BearerToken::new(&text).map_err(|err| usage(format!("{TOKEN_ENV}: {err}")))?)
            }
            (None, None) => None,
        };
        let tls = self.tls_ca.as_ref().map(|ca| RelayTls {
            ca: ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
            server_name: self.tls_server_name.clone(),
        });
        Ok((tls, token))
    }
}

/// Runs `kvrelay route` (blocking; the consumer builds its own single-threaded runtime).
pub(crate) fn run(args: RouteArgs) -> Result<()> {
    let (tls, token) = args.security.resolve(crate::relay::secret_env(TOKEN_ENV))?;
    if token.is_some() && tls.is_none() {
        eprintln!("kvrelay route: warning: the bearer token is sent without TLS (no --tls-ca)");
    }
    let relays = args
        .relays
        .iter()
        .map(|text| {
            let relay = text
                .parse::<RelayEndpoint>()
                .map_err(|err| usage(err.to_string()))?;
            Ok(RelayEndpoint {
                tls: tls.clone(),
                token: token.clone(),
                ..relay
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let config = ConsumerConfig::new(relays);
    config.validate().map_err(|err| usage(err.to_string()))?;
    let text = std::fs::read_to_string(&args.tokens_file)
        .with_context(|| format!("reading tokens file {}", args.tokens_file.display()))
        .map_err(|err| usage(format!("{err:#}")))?;
    let tokens = parse_tokens(&text)?;
    let request = ScoreRequest {
        tokens,
        model: args.model,
        lora: args.lora,
        cache_namespace: args.namespace,
    };
    let report = route_once(config, &request, Duration::from_millis(args.settle_ms))?;
    println!("{}", serde_json::to_string_pretty(&report_json(&report))?);
    if let Err(err) = &report.ranking {
        // A relay that could not be reached (TLS, token) is the likely cause: say so.
        let causes = report
            .relay_errors
            .iter()
            .filter_map(|(dc, error)| error.as_ref().map(|error| format!("{dc}: {error}")))
            .collect::<Vec<_>>();
        if causes.is_empty() {
            anyhow::bail!("{err}");
        }
        anyhow::bail!("{err} (relay errors: {})", causes.join("; "));
    }
    Ok(())
}

fn parse_tokens(text: &str) -> Result<Vec<u32>> {
    text.split(|c: char| c.is_whitespace() || c == ',')
        .filter(|part| !part.is_empty())
        .map(|part| {
            part.parse::<u32>()
                .map_err(|_| usage(format!("token {part:?} is not a u32")))
        })
        .collect()
}

fn report_json(report: &RouteReport) -> Value {
    let n_not_ready = report
        .ranking
        .as_ref()
        .map_or(0, |ranking| ranking.n_not_ready);
    let (model, lora, candidates, error) = match &report.ranking {
        Ok(ranking) => (
            Value::from(ranking.model.clone()),
            json!(ranking.lora),
            ranking
                .candidates
                .iter()
                .enumerate()
                .map(|(i, c)| candidate_json(i + 1, c))
                .collect(),
            Value::Null,
        ),
        Err(err) => (
            Value::Null,
            Value::Null,
            Vec::new(),
            Value::from(err.to_string()),
        ),
    };
    json!({
        "model": model,
        "lora": lora,
        "settled": report.settled,
        "candidates": candidates,
        "n_not_ready": n_not_ready,
        "error": error,
        "pools": report.pools.iter().map(|p| json!({
            "dc": p.dc,
            "pool": p.pool,
            "replica": p.replica.as_str(),
            "coverage": p.coverage.as_str(),
            "unroutable_percent": p.coverage.unroutable_percent(),
            "omitted_percent": p.coverage.omitted_percent(),
            "sequence": p.sequence,
        })).collect::<Vec<_>>(),
        "relay_errors": report.relay_errors.iter().map(|(dc, error)| json!({
            "dc": dc,
            "error": error,
        })).collect::<Vec<_>>(),
        "quarantined": report.quarantined.iter().map(|q| json!({
            "dc": q.dc,
            "entry": q.entry,
            "reason": q.reason,
        })).collect::<Vec<_>>(),
    })
}

fn candidate_json(rank: usize, candidate: &ScoredCandidate) -> Value {
    json!({
        "rank": rank,
        "dc": &*candidate.dc,
        "shape": candidate.shape.as_str(),
        "readiness": candidate.readiness.as_str(),
        "score": candidate.score,
        "prefix_fraction": candidate.prefix_fraction,
        "load": candidate.load_fraction,
        "dc_cost": candidate.dc_cost,
        "legs": candidate.legs.iter().map(|leg| json!({
            "role": leg.role,
            "pool": &*leg.pool,
            "endpoint": &*leg.endpoint,
            "block_size": leg.block_size,
            "replica": leg.replica.as_str(),
            "coverage": leg.coverage.as_str(),
            "unroutable_percent": leg.coverage.unroutable_percent(),
            "omitted_percent": leg.coverage.omitted_percent(),
            "prefix_blocks": leg.prefix_blocks,
            "prefix_tokens": leg.prefix_tokens,
            "load": leg.load,
        })).collect::<Vec<_>>(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_split_on_whitespace_and_commas() {
        assert_eq!(parse_tokens("1, 2\n3\t4,,5").unwrap(), vec![1, 2, 3, 4, 5]);
    }

    #[test]
    fn token_file_beats_the_environment_and_a_token_flag_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "from-file\n").unwrap();
        let args = SecurityArgs {
            token_file: Some(file),
            ..SecurityArgs::default()
        };
        let (tls, token) = args.resolve(Some("from-env".into())).unwrap();
        assert!(tls.is_none());
        assert_eq!(token, Some(BearerToken::new("from-file").unwrap()));
        let (_, token) = SecurityArgs::default()
            .resolve(Some("from-env".into()))
            .unwrap();
        assert_eq!(token, Some(BearerToken::new("from-env").unwrap()));
        let flag = SecurityArgs {
            token: Some("on-the-command-line".into()),
            ..SecurityArgs::default()
        };
        let err = flag.resolve(None).unwrap_err();
        assert!(err.downcast_ref::<crate::UsageError>().is_some());
        assert!(!format!("{err:#}").contains("on-the-command-line"));
    }

    #[test]
    fn tls_flags_become_the_relay_tls() {
        let args = SecurityArgs {
            tls_ca: Some("ca.pem".into()),
            tls_cert: Some("c.pem".into()),
            tls_key: Some("c.key".into()),
            tls_server_name: Some("relay.example".into()),
            ..SecurityArgs::default()
        };
        let (tls, token) = args.resolve(None).unwrap();
        assert_eq!(
            tls,
            Some(RelayTls {
                ca: "ca.pem".into(),
                cert: Some("c.pem".into()),
                key: Some("c.key".into()),
                server_name: Some("relay.example".into()),
            })
        );
        assert!(token.is_none());
    }

    #[test]
    fn non_numeric_token_is_a_usage_error() {
        let err = parse_tokens("1 two").unwrap_err();
        assert!(err.downcast_ref::<crate::UsageError>().is_some());
    }
}
