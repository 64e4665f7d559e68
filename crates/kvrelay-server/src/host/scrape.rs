//! Load from an engine's Prometheus endpoint: vLLM's KV-cache usage gauge, scraped once per
//! load window for each `[[sources]]` entry with a `metrics_url`.
//!
//! The gauge (`vllm:kv_cache_usage_perc`, older `vllm:gpu_cache_usage_perc`, a fraction in
//! `[0, 1]`) times the source's per-rank capacity from its card gives `kv_used_blocks`. A
//! failed scrape clears nothing: the last observation stays until the next success.

use std::sync::Arc;
use std::time::Duration;

use kvrelay_ckf::SourceId;
use kvrelay_pool::{LoadObservation, PoolRegistry};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::host::state::HostState;

/// Gauge names tried in order.
const USAGE_GAUGES: [&str; 2] = ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"];
/// Largest metrics page read, in bytes.
const MAX_PAGE_BYTES: u64 = 4 * 1024 * 1024;

/// Scrapes `url` every `window` until `cancel` fires, observing load for `source`.
pub(crate) async fn run(
    url: String,
    source: SourceId,
    window: Duration,
    state: Arc<HostState>,
    registry: PoolRegistry,
    cancel: CancellationToken,
) {
    let mut ticker = tokio::time::interval(window);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let page = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            page = tokio::time::timeout(window, fetch(&url)) => page,
        };
        let usage = match page {
            Ok(Ok(page)) => kv_usage(&page, source.dp_rank),
            Ok(Err(err)) => {
                debug!(%url, error = %err, "metrics scrape failed");
                None
            }
            Err(_) => None,
        };
        let Some(usage) = usage else { continue };
        let route = state.routes.borrow().routes.get(&source).cloned();
        if let Some(route) = route {
            let used = (usage.clamp(0.0, 1.0) * route.capacity as f64).round() as u64;
            registry.observe_load(
                route.pool,
                route.generation,
                LoadObservation {
                    worker_id: source.worker_id,
                    dp_rank: source.dp_rank,
                    kv_used_blocks: Some(used),
                    active_decode_blocks: None,
                    active_prefill_tokens: None,
                },
            );
        }
    }
}

/// The KV usage fraction on a metrics page: the sample labelled with this rank
/// (`engine="<rank>"` or `dp_rank="<rank>"`) if there is one, else the first sample.
pub(crate) fn kv_usage(page: &str, dp_rank: u32) -> Option<f64> {
    for gauge in USAGE_GAUGES {
        let samples: Vec<(&str, f64)> = page
            .lines()
            .filter(|line| !line.starts_with('#'))
            .filter_map(|line| {
                let rest = line.strip_prefix(gauge)?;
                let (labels, value) = match rest.strip_prefix('{') {
                    Some(labelled) => {
                        let (labels, value) = labelled.split_once('}')?;
                        (labels, value)
                    }
                    None if rest.starts_with(' ') => ("", rest),
                    None => return None,
                };
                let value: f64 = value.split_whitespace().next()?.parse().ok()?;
                value.is_finite().then_some((labels, value))
            })
            .collect();
        let rank_labels = [
            format!("engine=\"{dp_rank}\""),
            format!("dp_rank=\"{dp_rank}\""),
        ];
        let for_rank = samples.iter().find(|(labels, _)| {
            rank_labels
                .iter()
                .any(|label| labels.contains(label.as_str()))
        });
        if let Some((_, value)) = for_rank.or(samples.first()) {
            return Some(*value);
        }
    }
    None
}

/// GETs an `http://host:port/path` URL (plain HTTP/1.1, `Connection: close`) and returns the
/// body of a 200 answer.
async fn fetch(url: &str) -> std::io::Result<String> {
    let invalid = |what: &str| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what}: {url}"))
    };
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| invalid("only http:// metrics URLs are supported"))?;
    let (authority, path) = match rest.find('/') {
        Some(at) => (&rest[..at], &rest[at..]),
        None => (rest, "/metrics"),
    };
    let mut stream = TcpStream::connect(authority).await?;
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nAccept: text/plain\r\nConnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    stream
        .take(MAX_PAGE_BYTES)
        .read_to_end(&mut response)
        .await?;
    let text = String::from_utf8_lossy(&response);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| invalid("malformed HTTP answer"))?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return Err(invalid("non-200 answer"));
    }
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Err(invalid("chunked metrics answers are not supported"));
    }
    Ok(body.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_labelled_sample_wins_over_the_first() {
        let page = "# HELP vllm:kv_cache_usage_perc usage\n\
                    vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n\
                    vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.75\n";
        assert_eq!(kv_usage(page, 1), Some(0.75));
        assert_eq!(kv_usage(page, 0), Some(0.25));
    }

    #[test]
    fn older_gauge_name_and_unlabelled_samples_are_read() {
        assert_eq!(kv_usage("vllm:gpu_cache_usage_perc 0.5\n", 3), Some(0.5));
    }

    #[test]
    fn pages_without_the_gauge_give_nothing() {
        assert_eq!(
            kv_usage(
                "vllm:num_requests_running 4\nvllm:kv_cache_usage_percent_x 0.1\n",
                0
            ),
            None
        );
    }
}
