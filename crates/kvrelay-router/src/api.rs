//! The JSON API: request and response bodies, their validation, and the error body.
//!
//! Pure: no I/O, so every rule is unit-tested here. Requests are parsed strictly (unknown
//! fields refused) and every error names the field at fault:
//! `{"error": {"code": "invalid_request", "field": "tokens[3]", "message": "..."}}`.

use std::time::Duration;

use kvrelay_consumer::{
    PoolStatus, QuarantinedEntry, Ranking, RelayStatus, ScoreError, ScoreRequest, ScoredCandidate,
    ScoredLeg,
};
use serde::{Deserialize, Serialize};

use crate::config::HttpSection;

/// `POST /v1/route` body.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteRequest {
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// A canonical model id or alias.
    pub model: String,
    /// A LoRA adapter on the model.
    #[serde(default)]
    pub lora: Option<String>,
    /// The cache namespace salt (tenant isolation).
    #[serde(default)]
    pub namespace: Option<String>,
    /// Keep only the best `top_k` candidates (default: all).
    #[serde(default)]
    pub top_k: Option<usize>,
}

/// `POST /v1/route/batch` body.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// The requests, answered in order.
    pub requests: Vec<RouteRequest>,
}

/// An error answer: HTTP status plus a JSON body naming the field at fault, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: u16,
    /// A stable snake_case code.
    pub code: &'static str,
    /// The field at fault (`tokens[3]`, `requests[2].model`), if one is.
    pub field: Option<String>,
    /// What is wrong, for a human.
    pub message: String,
}

impl ApiError {
    fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            code: "invalid_request",
            field: Some(field.into()),
            message: message.into(),
        }
    }

    /// `413`: the body exceeds `max_body_bytes`.
    pub fn too_large(limit: usize) -> Self {
        Self {
            status: 413,
            code: "body_too_large",
            field: None,
            message: format!("request body exceeds max_body_bytes ({limit} bytes)"),
        }
    }

    /// `503`: the model (or adapter) is not in view while relays are out of view: it may
    /// be served behind them, so the answer is retryable rather than `404`.
    pub fn relays_unavailable(dcs: &[String]) -> Self {
        Self {
            status: 503,
            code: "relays_unavailable",
            field: None,
            message: format!(
                "model not found while the relays of {} are out of view; retry",
                dcs.join(", ")
            ),
        }
    }

    /// `401`: the request did not carry the configured bearer token.
    pub fn unauthorized() -> Self {
        Self {
            status: 401,
            code: "unauthorized",
            field: None,
            message: "missing or wrong bearer token (Authorization: Bearer <token>)".to_owned(),
        }
    }

    /// `408`: the body did not arrive within `body_timeout_ms`.
    pub fn body_timeout(timeout_ms: u64) -> Self {
        Self {
            status: 408,
            code: "body_timeout",
            field: None,
            message: format!("request body not received within body_timeout_ms ({timeout_ms} ms)"),
        }
    }

    /// `400`: the client closed or broke the connection before its body ended.
    pub fn body_aborted() -> Self {
        Self {
            status: 400,
            code: "body_aborted",
            field: None,
            message: "request body ended early".to_owned(),
        }
    }

    /// `503`: `max_concurrent_requests` are being scored.
    pub fn overloaded(limit: u32) -> Self {
        Self {
            status: 503,
            code: "overloaded",
            field: None,
            message: format!("{limit} requests are being scored (max_concurrent_requests); retry"),
        }
    }

    /// `415`: the body is not declared as JSON.
    pub fn not_json() -> Self {
        Self {
            status: 415,
            code: "unsupported_media_type",
            field: None,
            message: "send Content-Type: application/json".to_owned(),
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        let mut error = serde_json::json!({ "code": self.code, "message": self.message });
        if let Some(field) = &self.field {
            error["field"] = serde_json::Value::from(field.as_str());
        }
        serde_json::json!({ "error": error })
    }

    /// This error for the request at `index` of a batch (its field path prefixed).
    fn in_batch(mut self, index: usize) -> Self {
        let prefix = format!("requests[{index}]");
        self.field = Some(match self.field.take() {
            Some(field) if !field.is_empty() => format!("{prefix}.{field}"),
            _ => prefix,
        });
        self
    }
}

/// A request body of the API.
pub trait RequestBody: for<'de> Deserialize<'de> {
    /// `body` parsed by a fast parser of the body's common shape, or `None` when the body
    /// is outside it (then `serde_json` decides). Must agree with `serde_json` on every
    /// body it accepts, except that a batch stops after `max_batch + 1` requests (both are
    /// refused by validation for exceeding `max_batch`).
    fn parse_common_shape(body: &[u8], limits: &HttpSection) -> Option<Self>;
}

impl RequestBody for RouteRequest {
    fn parse_common_shape(body: &[u8], _limits: &HttpSection) -> Option<Self> {
        fast_path::route_request(body)
    }
}

impl RequestBody for BatchRequest {
    fn parse_common_shape(body: &[u8], limits: &HttpSection) -> Option<Self> {
        fast_path::batch_request(body, limits.max_batch)
    }
}

/// Parses a JSON body into `T`, naming the offending field on failure.
///
/// The common shape of a request goes through `T`'s fast parser (a 1,024-token request
/// in a fraction of `serde_json`'s time); any other body is parsed by `serde_json`, and
/// only a body that fails is parsed again with path tracking to name the field (tracking
/// costs ~40 % more on a 1,024-token request).
pub fn parse<T: RequestBody>(body: &[u8], limits: &HttpSection) -> Result<T, ApiError> {
    if let Some(parsed) = T::parse_common_shape(body, limits) {
        return Ok(parsed);
    }
    parse_with_serde(body)
}

/// [`parse`] without the fast parser: what decides every body outside the common shape.
pub fn parse_with_serde<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    match serde_json::from_slice(body) {
        Ok(parsed) => Ok(parsed),
        Err(_) => parse_tracked(body),
    }
}

/// The slow path of [`parse`]: the same parse with the path of the failure tracked.
fn parse_tracked<T: for<'de> Deserialize<'de>>(body: &[u8]) -> Result<T, ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let parsed: T = serde_path_to_error::deserialize(&mut deserializer).map_err(|err| {
        let path = err.path().to_string();
        let message = err.inner().to_string();
        // A missing, unknown or repeated field is reported at its parent: name the field.
        let named = ["missing field", "unknown field", "duplicate field"]
            .iter()
            .any(|kind| message.starts_with(kind))
            .then(|| backticked(&message))
            .flatten();
        let field = match (path.as_str(), named) {
            (".", Some(name)) => name,
            (".", None) => String::new(),
            (parent, Some(name)) if !parent.ends_with(name.as_str()) => format!("{parent}.{name}"),
            (parent, _) => parent.to_owned(),
        };
        ApiError::invalid(field, message)
    })?;
    deserializer.end().map_err(|err| {
        ApiError::invalid("", format!("trailing data after the JSON body: {err}"))
    })?;
    Ok(parsed)
}

/// The first `` `name` `` in a serde message.
fn backticked(message: &str) -> Option<String> {
    let start = message.find('`')? + 1;
    let len = message[start..].find('`')?;
    Some(message[start..start + len].to_owned())
}

impl RouteRequest {
    /// Checks the request against `limits`; returns the score request and the `top_k`.
    pub fn validate(self, limits: &HttpSection) -> Result<(ScoreRequest, usize), ApiError> {
        if self.tokens.len() > limits.max_tokens {
            return Err(ApiError::invalid(
                "tokens",
                format!(
                    "{} token ids exceed max_tokens ({})",
                    self.tokens.len(),
                    limits.max_tokens
                ),
            ));
        }
        if self.model.trim().is_empty() {
            return Err(ApiError::invalid("model", "model must be a non-empty name"));
        }
        let top_k = match self.top_k {
            None => usize::MAX,
            Some(0) => return Err(ApiError::invalid("top_k", "top_k must be at least 1")),
            Some(k) if k > limits.max_top_k => {
                return Err(ApiError::invalid(
                    "top_k",
                    format!("top_k {k} exceeds max_top_k ({})", limits.max_top_k),
                ));
            }
            Some(k) => k,
        };
        Ok((
            ScoreRequest {
                tokens: self.tokens,
                model: self.model,
                lora: self.lora,
                cache_namespace: self.namespace,
            },
            top_k,
        ))
    }
}

impl BatchRequest {
    /// Checks the batch size and every request; errors name `requests[i].field`.
    pub fn validate(self, limits: &HttpSection) -> Result<Vec<(ScoreRequest, usize)>, ApiError> {
        if self.requests.len() > limits.max_batch {
            return Err(ApiError::invalid(
                "requests",
                format!(
                    "{} requests exceed max_batch ({})",
                    self.requests.len(),
                    limits.max_batch
                ),
            ));
        }
        self.requests
            .into_iter()
            .enumerate()
            .map(|(index, request)| request.validate(limits).map_err(|err| err.in_batch(index)))
            .collect()
    }
}

/// A scoring failure as an API error (`404` unknown model/adapter, `409` ambiguous).
pub fn score_error(err: &ScoreError) -> ApiError {
    let (status, code, field) = match err {
        ScoreError::UnknownModel { .. } => (404, "unknown_model", "model"),
        ScoreError::AmbiguousModel { .. } => (409, "ambiguous_model", "model"),
        ScoreError::UnknownAdapter { .. } => (404, "unknown_adapter", "lora"),
        ScoreError::AdapterOnAdapter { .. } => (400, "adapter_on_adapter", "lora"),
        _ => (400, "unscorable", "model"),
    };
    ApiError {
        status,
        code,
        field: Some(field.to_owned()),
        message: err.to_string(),
    }
}

/// One ranked answer, borrowing the ranking (serialised without copying its strings).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RouteResponse<'a> {
    /// The canonical base model the request resolved to.
    pub model: &'a str,
    /// The LoRA adapter applied, if any.
    pub lora: Option<&'a str>,
    /// Candidates, best first.
    pub candidates: Vec<CandidateView<'a>>,
    /// Candidates left out because their serving entry is not ready.
    pub not_ready: usize,
}

/// `POST /v1/route/batch` body: one answer per request, in order.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BatchResponse<'a> {
    /// A ranking, or that request's error (`{"error": {...}}`).
    pub answers: Vec<BatchAnswer<'a>>,
}

/// One answer of a batch.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum BatchAnswer<'a> {
    /// The request was scored.
    Ranking(RouteResponse<'a>),
    /// The request could not be scored: the body a single request would have got.
    Error(&'a serde_json::Value),
}

/// One ranked candidate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CandidateView<'a> {
    /// The DC it lives in.
    pub dc: &'a str,
    /// `aggregated`, `disaggregated` or `decode_only`.
    pub shape: &'static str,
    /// The combined score (candidates are sorted by it, highest first).
    pub score: f64,
    /// Cached prefix fraction credited; `null` when no replica could answer.
    pub prefix_fraction: Option<f64>,
    /// Load fraction used; `null` when unknown.
    pub load_fraction: Option<f64>,
    /// The DC's configured cost.
    pub dc_cost: f64,
    /// The serving entry's readiness per the relay's topology.
    pub readiness: &'static str,
    /// The legs: one, or prefill then decode.
    pub legs: Vec<LegView<'a>>,
}

/// One leg (pool) of a candidate.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LegView<'a> {
    /// `aggregated`, `prefill`, `decode` or `decode_only`.
    pub role: &'static str,
    /// The pool id.
    pub pool: &'a str,
    /// The serving endpoint.
    pub endpoint: &'a str,
    /// Block size, tokens.
    pub block_size: u32,
    /// The replica's state for this answer.
    pub replica: &'static str,
    /// What the relay says of the pool's filter: `complete`, `recovering` (being rebuilt
    /// from the engines' replay), `degraded` (an engine's history was lost), `overfull`
    /// (the filter could not place every block) or `unrecognized` (a newer relay's
    /// state). Anything but `complete`: a prefix found is cached, one not found may be too.
    pub coverage: &'static str,
    /// The share of the pool's recent events its relay could not route, percent (0 unless
    /// degraded or unrecognized).
    pub unroutable_percent: u8,
    /// The share of the pool's owned blocks its filter could not place, percent (0 unless
    /// overfull).
    pub omitted_percent: u8,
    /// Estimated cached leading blocks; `null` when the replica is unusable.
    pub prefix_blocks: Option<u32>,
    /// Estimated cached leading tokens; `null` when the replica is unusable.
    pub prefix_tokens: Option<u32>,
    /// Blocks past `prefix_blocks` the pool holds in host memory; `null` when it has no
    /// host lane, or that lane's (or the device's) replica cannot answer.
    pub host_blocks: Option<u32>,
    /// Blocks past those held on disk; `null` as for `host_blocks`.
    pub disk_blocks: Option<u32>,
    /// KV occupancy in `[0, 1]`; `null` when unknown.
    pub load: Option<f64>,
}

impl<'a> From<&'a Ranking> for RouteResponse<'a> {
    fn from(ranking: &'a Ranking) -> Self {
        Self {
            model: &ranking.model,
            lora: ranking.lora.as_deref(),
            candidates: ranking.candidates.iter().map(CandidateView::from).collect(),
            not_ready: ranking.n_not_ready,
        }
    }
}

impl<'a> From<&'a ScoredCandidate> for CandidateView<'a> {
    fn from(candidate: &'a ScoredCandidate) -> Self {
        Self {
            dc: &candidate.dc,
            shape: candidate.shape.as_str(),
            score: candidate.score,
            prefix_fraction: candidate.prefix_fraction,
            load_fraction: candidate.load_fraction,
            dc_cost: candidate.dc_cost,
            readiness: candidate.readiness.as_str(),
            legs: candidate.legs.iter().map(LegView::from).collect(),
        }
    }
}

impl<'a> From<&'a ScoredLeg> for LegView<'a> {
    fn from(leg: &'a ScoredLeg) -> Self {
        Self {
            role: leg.role,
            pool: &leg.pool,
            endpoint: &leg.endpoint,
            block_size: leg.block_size,
            replica: leg.replica.as_str(),
            coverage: leg.coverage.as_str(),
            unroutable_percent: leg.coverage.unroutable_percent(),
            omitted_percent: leg.coverage.omitted_percent(),
            prefix_blocks: leg.prefix_blocks,
            prefix_tokens: leg.prefix_tokens,
            host_blocks: leg.host_blocks,
            disk_blocks: leg.disk_blocks,
            load: leg.load,
        }
    }
}

/// `GET /v1/pools` body.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolsView {
    /// Every configured relay.
    pub relays: Vec<RelayView>,
    /// Every admitted pool of a connected relay.
    pub pools: Vec<PoolView>,
    /// Catalog entries refused, with why.
    pub quarantined: Vec<QuarantinedView>,
}

/// One relay in [`PoolsView`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RelayView {
    /// Its DC name.
    pub dc: String,
    /// Its address.
    pub address: String,
    /// The catalog revision applied, if any.
    pub catalog_revision: Option<u64>,
    /// Whether its connection is broken (its pools are not scored).
    pub suspended: bool,
    /// Entries admitted.
    pub admitted_pools: usize,
    /// Entries quarantined.
    pub quarantined_entries: usize,
    /// Pools the relay withholds as stalled (not listed, not scored).
    pub stalled_pools: usize,
    /// Why its last connection ended, if one has.
    pub last_error: Option<String>,
    /// A relay pair's other addresses: each as last probed, or (hot standbys) as
    /// followed now.
    pub standbys: Vec<StandbyView>,
}

/// One standby relay in [`RelayView`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StandbyView {
    /// Its address.
    pub address: String,
    /// Whether it answered its last probe (`null` before the first).
    pub reachable: Option<bool>,
    /// Seconds since that probe.
    pub checked_seconds_ago: Option<f64>,
    /// Why it did not answer, when it did not.
    pub error: Option<String>,
    /// Whether it is followed all along (a hot standby: `reachable` is whether its
    /// catalog stream is up now, and it has no probe age).
    pub followed: bool,
}

/// One pool in [`PoolsView`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PoolView {
    /// Its DC.
    pub dc: String,
    /// The pool id.
    pub pool: String,
    /// The replica's state.
    pub replica: &'static str,
    /// What the relay says of the pool's filter (as in a route answer's legs).
    pub coverage: &'static str,
    /// The share of the pool's recent events its relay could not route, percent.
    pub unroutable_percent: u8,
    /// The share of the pool's owned blocks its filter could not place, percent.
    pub omitted_percent: u8,
    /// The installed sequence, when ready.
    pub sequence: Option<u64>,
    /// The newest sequence the relay announced.
    pub announced_sequence: Option<u64>,
    /// Seconds since the replica last heard from its stream.
    pub age_seconds: Option<f64>,
    /// Whether a hot standby's replica answers for the pool now (its scored relay's is not
    /// current).
    pub through_standby: bool,
    /// The pool's lower-tier lanes (relays with `[tiers]`): tier, replica state, sequence.
    pub tier_lanes: Vec<TierLaneView>,
}

/// One lower-tier lane of a pool in [`PoolView`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TierLaneView {
    /// `host` or `disk`.
    pub tier: &'static str,
    /// The lane replica's state.
    pub replica: &'static str,
    /// The installed sequence, when ready.
    pub sequence: Option<u64>,
}

/// One quarantined catalog entry in [`PoolsView`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuarantinedView {
    /// The relay's DC.
    pub dc: String,
    /// The entry's pool id when it could be read, else its position in the catalog.
    pub entry: String,
    /// Why it was refused.
    pub reason: String,
}

impl PoolsView {
    /// The view of `relays`, `pools` and `quarantined`.
    pub fn new(
        relays: &[RelayStatus],
        pools: &[PoolStatus],
        quarantined: &[QuarantinedEntry],
    ) -> Self {
        Self {
            relays: relays
                .iter()
                .map(|relay| RelayView {
                    dc: relay.dc.clone(),
                    address: relay.addr.clone(),
                    catalog_revision: relay.catalog_revision,
                    suspended: relay.suspended,
                    admitted_pools: relay.admitted_pools,
                    quarantined_entries: relay.quarantined_entries,
                    stalled_pools: relay.stalled_pools,
                    last_error: relay.last_error.clone(),
                    standbys: relay
                        .standbys
                        .iter()
                        .map(|standby| StandbyView {
                            address: standby.addr.clone(),
                            reachable: standby.reachable,
                            checked_seconds_ago: standby.checked_ago.map(|ago| ago.as_secs_f64()),
                            error: standby.error.clone(),
                            followed: standby.followed,
                        })
                        .collect(),
                })
                .collect(),
            pools: pools
                .iter()
                .map(|pool| PoolView {
                    dc: pool.dc.clone(),
                    pool: pool.pool.clone(),
                    replica: pool.replica.as_str(),
                    coverage: pool.coverage.as_str(),
                    unroutable_percent: pool.coverage.unroutable_percent(),
                    omitted_percent: pool.coverage.omitted_percent(),
                    sequence: pool.sequence,
                    announced_sequence: pool.announced_sequence,
                    age_seconds: pool.age.map(|age: Duration| age.as_secs_f64()),
                    through_standby: pool.through_standby,
                    tier_lanes: pool
                        .tier_lanes
                        .iter()
                        .map(|lane| TierLaneView {
                            tier: lane.tier.name(),
                            replica: lane.replica.as_str(),
                            sequence: lane.sequence,
                        })
                        .collect(),
                })
                .collect(),
            quarantined: quarantined
                .iter()
                .map(|entry| QuarantinedView {
                    dc: entry.dc.clone(),
                    entry: entry.entry.clone(),
                    reason: entry.reason.clone(),
                })
                .collect(),
        }
    }
}

mod encode;
mod fast_path;

pub use encode::{write_batch, write_ranking};

#[cfg(test)]
mod tests;
