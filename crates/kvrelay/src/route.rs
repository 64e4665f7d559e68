//! `kvrelay route`: connect to relays, let replicas settle, rank the pools for one request
//! and print the ranking as JSON.

use std::time::Duration;

use anyhow::{Context, Result};
use kvrelay_consumer::{
    ConsumerConfig, RelayConfig, RouteReport, ScoreRequest, ScoredCandidate, route_once,
};
use serde_json::{Value, json};

use crate::usage::usage;

/// Arguments of `kvrelay route`.
#[derive(Debug, clap::Args)]
pub(crate) struct RouteArgs {
    /// A relay to watch, `ADDR[=DC[:COST]]` (repeatable), e.g. `10.0.0.7:7400=us-east:12.5`.
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
}

/// Runs `kvrelay route` (blocking; the consumer builds its own single-threaded runtime).
pub(crate) fn run(args: RouteArgs) -> Result<()> {
    let relays = args
        .relays
        .iter()
        .map(|text| {
            text.parse::<RelayConfig>()
                .map_err(|err| usage(err.to_string()))
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
        anyhow::bail!("{err}");
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
            "sequence": p.sequence,
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
    fn non_numeric_token_is_a_usage_error() {
        let err = parse_tokens("1 two").unwrap_err();
        assert!(err.downcast_ref::<crate::UsageError>().is_some());
    }
}
