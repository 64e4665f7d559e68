//! Scoring a request against every candidate deployment: prefix depth per pool with that
//! pool's query semantics and salts, load, and per-DC cost, combined by
//! [`ScoreWeights`].
//!
//! Pure and synchronous: the caller passes the catalog entries, the depth source (the
//! replica store, or an exact index in tests and benchmarks), load samples and `now`.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kvrelay_identity::KvQueryHashFormat;
use kvrelay_identity::hashing::{HashSalt, block_hashes, sequence_hashes};

use crate::candidate::{self, Candidate, CandidateShape};
use crate::catalog::{PoolEntry, PoolKey};
use crate::config::RelayConfig;
use crate::load::LoadSample;
use crate::weights::{ScoreTerms, ScoreWeights};

/// A request to score: its tokens, model name and salts.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ScoreRequest {
    /// The prompt's token ids.
    pub tokens: Vec<u32>,
    /// A canonical model id or alias.
    pub model: String,
    /// A LoRA adapter name on the model, if any.
    pub lora: Option<String>,
    /// The cache namespace salt (tenant isolation), if any.
    pub cache_namespace: Option<String>,
}

/// How usable a pool's replica was for this request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReplicaStatus {
    /// Installed, in sequence and fresh: its depth is an estimate.
    Current,
    /// Subscribed, still assembling its first snapshot.
    Assembling,
    /// Installed but older than the staleness bound.
    Stale,
    /// No replica (not subscribed yet, or dropped after a failure).
    Missing,
}

impl ReplicaStatus {
    /// The snake_case name used in JSON and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Current => "current",
            Self::Assembling => "assembling",
            Self::Stale => "stale",
            Self::Missing => "missing",
        }
    }
}

/// A pool's answer to a prefix query.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaDepth {
    /// A current replica estimates this many leading blocks as cached.
    Current(u32),
    /// No usable estimate, and why.
    Unusable(ReplicaStatus),
}

/// Anything that answers prefix depths for a group of pools sharing one hash chain.
pub trait DepthSource {
    /// Writes into `out[i]` the depth of `keys[i]` for `sequence_hashes` at `now`.
    /// `out.len() == keys.len()`.
    fn depths(
        &self,
        keys: &[PoolKey],
        sequence_hashes: &[u64],
        now: Instant,
        out: &mut [ReplicaDepth],
    );
}

/// One leg (pool) of a scored candidate.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredLeg {
    /// The leg's role in the candidate: `aggregated`, `prefill`, `decode` or `decode_only`.
    pub role: &'static str,
    /// The pool id, as text (shared, cheap to clone).
    pub pool: Arc<str>,
    /// The serving endpoint, `namespace.component.endpoint` (shared, cheap to clone).
    pub endpoint: Arc<str>,
    /// The pool's block size, tokens.
    pub block_size: u32,
    /// Whether the replica could answer.
    pub replica: ReplicaStatus,
    /// Estimated cached leading blocks; `None` when the replica is unusable.
    pub prefix_blocks: Option<u32>,
    /// Estimated cached leading tokens (blocks × block size, clamped to the prompt).
    pub prefix_tokens: Option<u32>,
    /// KV occupancy in `[0, 1]`; `None` when unknown.
    pub load: Option<f64>,
}

/// One ranked candidate deployment.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredCandidate {
    /// The DC (relay) it lives in (shared, cheap to clone).
    pub dc: Arc<str>,
    /// Aggregated, disaggregated pair or decode-only.
    pub shape: CandidateShape,
    /// The legs: one, or prefill then decode for a pair.
    pub legs: Vec<ScoredLeg>,
    /// Cached prefix fraction credited (prefill or only leg), `None` when unusable.
    pub prefix_fraction: Option<f64>,
    /// Load fraction used (max over legs), `None` when any leg's load is unknown.
    pub load_fraction: Option<f64>,
    /// The DC's configured cost.
    pub dc_cost: f64,
    /// The combined score; candidates are sorted by it, highest first.
    pub score: f64,
}

/// The ranked answer for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Ranking {
    /// The canonical base model the request resolved to.
    pub model: String,
    /// The LoRA adapter whose salt was applied, if any.
    pub lora: Option<String>,
    /// Candidates, best first.
    pub candidates: Vec<ScoredCandidate>,
}

/// A request that cannot be scored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ScoreError {
    /// No catalog entry registers the name as a model or alias.
    #[error("model {model:?} is not served by any known pool")]
    UnknownModel {
        /// The requested name.
        model: String,
    },
    /// The name binds to more than one model across the catalogs (fail closed).
    #[error("model name {model:?} is ambiguous across catalogs: {bindings:?}")]
    AmbiguousModel {
        /// The requested name.
        model: String,
        /// The distinct bindings found.
        bindings: Vec<String>,
    },
    /// No pool registers the adapter on the model.
    #[error("lora adapter {adapter:?} on model {model:?} is not served by any known pool")]
    UnknownAdapter {
        /// The canonical base model.
        model: String,
        /// The requested adapter.
        adapter: String,
    },
    /// The model is itself a LoRA adapter and another adapter was requested on it.
    #[error("model {model:?} is a lora adapter; adapter {adapter:?} cannot be applied on it")]
    AdapterOnAdapter {
        /// The resolved LoRA model.
        model: String,
        /// The requested adapter.
        adapter: String,
    },
}

/// Everything the pure scoring function reads.
pub(crate) struct ScoreInputs<'a> {
    pub(crate) entries: &'a [PoolEntry],
    pub(crate) relays: &'a [RelayConfig],
    /// The relays' DC names, shared into results.
    pub(crate) dcs: &'a [Arc<str>],
    pub(crate) loads: &'a HashMap<PoolKey, LoadSample>,
    pub(crate) weights: &'a ScoreWeights,
}

/// Ranks the candidates for `request`.
pub(crate) fn rank(
    inputs: &ScoreInputs<'_>,
    depths: &dyn DepthSource,
    request: &ScoreRequest,
    now: Instant,
) -> Result<Ranking, ScoreError> {
    let resolved = candidate::resolve(inputs.entries, &request.model, request.lora.as_deref())?;
    let cands = candidate::candidates(inputs.entries, &resolved);

    // Every pool that appears as a leg, grouped by query semantics so each group hashes
    // the request once and probes all its pools together.
    let mut legs: Vec<usize> = cands
        .iter()
        .flat_map(|c| std::iter::once(c.first).chain(c.decode))
        .collect();
    legs.sort_unstable();
    legs.dedup();
    let mut groups: Vec<((u32, KvQueryHashFormat), Vec<usize>)> = Vec::new();
    for &idx in &legs {
        let entry = &inputs.entries[idx];
        let semantics = (entry.block_size, entry.hash_format);
        match groups.iter_mut().find(|(s, _)| *s == semantics) {
            Some((_, members)) => members.push(idx),
            None => groups.push((semantics, vec![idx])),
        }
    }
    let salt = HashSalt {
        lora_name: resolved.lora_salt.as_deref(),
        cache_namespace: request.cache_namespace.as_deref(),
    };
    let mut depth_of: Vec<ReplicaDepth> =
        vec![ReplicaDepth::Unusable(ReplicaStatus::Missing); inputs.entries.len()];
    let mut keys = Vec::new();
    let mut out = Vec::new();
    for ((block_size, format), members) in &groups {
        let hashes = sequence_hashes(&block_hashes(&request.tokens, *block_size, *format, salt));
        keys.clear();
        keys.extend(members.iter().map(|&idx| inputs.entries[idx].key));
        out.clear();
        out.resize(keys.len(), ReplicaDepth::Unusable(ReplicaStatus::Missing));
        depths.depths(&keys, &hashes, now, &mut out);
        for (&idx, &depth) in members.iter().zip(&out) {
            depth_of[idx] = depth;
        }
    }

    let n_tokens = request.tokens.len();
    let mut scored: Vec<ScoredCandidate> = cands
        .iter()
        .map(|cand| {
            let depth = |idx: usize| depth_of[idx];
            score_candidate(inputs, cand, &depth, n_tokens)
        })
        .collect();
    scored.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then_with(|| a.dc.cmp(&b.dc))
            .then_with(|| a.legs[0].pool.cmp(&b.legs[0].pool))
    });
    Ok(Ranking {
        model: resolved.base_model,
        lora: resolved.lora_salt,
        candidates: scored,
    })
}

fn score_candidate(
    inputs: &ScoreInputs<'_>,
    cand: &Candidate,
    depth: &dyn Fn(usize) -> ReplicaDepth,
    n_tokens: usize,
) -> ScoredCandidate {
    let first_role = match cand.shape {
        CandidateShape::Aggregated => "aggregated",
        CandidateShape::Disaggregated => "prefill",
        CandidateShape::DecodeOnly => "decode_only",
    };
    let mut legs = vec![leg(
        inputs,
        cand.first,
        first_role,
        depth(cand.first),
        n_tokens,
    )];
    if let Some(decode) = cand.decode {
        legs.push(leg(inputs, decode, "decode", depth(decode), n_tokens));
    }
    let fraction = |leg: &ScoredLeg| {
        leg.prefix_tokens.map(|tokens| {
            if n_tokens == 0 {
                0.0
            } else {
                f64::from(tokens) / n_tokens as f64
            }
        })
    };
    let prefix_fraction = fraction(&legs[0]);
    let decode_prefix_fraction = legs.get(1).and_then(fraction);
    let load_fraction = legs
        .iter()
        .try_fold(0.0_f64, |acc, leg| leg.load.map(|load| acc.max(load)));
    let relay = &inputs.relays[inputs.entries[cand.first].relay];
    let terms = ScoreTerms {
        prefix_fraction,
        decode_prefix_fraction,
        load_fraction,
        dc_cost: relay.cost,
    };
    ScoredCandidate {
        dc: Arc::clone(&inputs.dcs[inputs.entries[cand.first].relay]),
        shape: cand.shape,
        legs,
        prefix_fraction,
        load_fraction,
        dc_cost: relay.cost,
        score: inputs.weights.score(&terms),
    }
}

fn leg(
    inputs: &ScoreInputs<'_>,
    idx: usize,
    role: &'static str,
    depth: ReplicaDepth,
    n_tokens: usize,
) -> ScoredLeg {
    let entry = &inputs.entries[idx];
    let (replica, prefix_blocks) = match depth {
        ReplicaDepth::Current(blocks) => (ReplicaStatus::Current, Some(blocks)),
        ReplicaDepth::Unusable(status) => (status, None),
    };
    let n_tokens_u32 = u32::try_from(n_tokens).unwrap_or(u32::MAX);
    let prefix_tokens =
        prefix_blocks.map(|blocks| blocks.saturating_mul(entry.block_size).min(n_tokens_u32));
    ScoredLeg {
        role,
        pool: Arc::clone(&entry.pool_label),
        endpoint: Arc::clone(&entry.endpoint),
        block_size: entry.block_size,
        replica,
        prefix_blocks,
        prefix_tokens,
        load: inputs.loads.get(&entry.key).and_then(LoadSample::fraction),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;

    use kvrelay_identity::KvQueryHashFormat;

    use super::*;
    use crate::catalog::{Registration, Roles, Target};

    /// Depths by pool key, recording the hash chains it was asked about.
    #[derive(Default)]
    struct FixedDepths {
        depths: HashMap<PoolKey, ReplicaDepth>,
        asked: RefCell<Vec<(Vec<PoolKey>, Vec<u64>)>>,
    }

    impl DepthSource for FixedDepths {
        fn depths(
            &self,
            keys: &[PoolKey],
            hashes: &[u64],
            _now: Instant,
            out: &mut [ReplicaDepth],
        ) {
            self.asked
                .borrow_mut()
                .push((keys.to_vec(), hashes.to_vec()));
            for (key, slot) in keys.iter().zip(out) {
                *slot = self
                    .depths
                    .get(key)
                    .copied()
                    .unwrap_or(ReplicaDepth::Unusable(ReplicaStatus::Missing));
            }
        }
    }

    const AGG: Roles = Roles {
        prefill: false,
        decode: false,
        aggregated: true,
    };
    const PREFILL: Roles = Roles {
        prefill: true,
        decode: false,
        aggregated: false,
    };
    const DECODE: Roles = Roles {
        prefill: false,
        decode: true,
        aggregated: false,
    };

    fn entry(key: u64, relay: usize, ns: &str, roles: Roles, block_size: u32) -> PoolEntry {
        PoolEntry {
            key: PoolKey(key),
            relay,
            pool_label: format!("pool-{key}").into(),
            namespace: ns.to_owned(),
            endpoint: format!("{ns}.worker.generate").into(),
            registrations: vec![
                Registration {
                    model: "m".into(),
                    target: Target::Base,
                    aliases: vec![],
                },
                Registration {
                    model: "m-sql".into(),
                    target: Target::Lora {
                        base_model: "m".into(),
                        adapter: "sql".into(),
                    },
                    aliases: vec![],
                },
            ],
            block_size,
            hash_format: KvQueryHashFormat::DynamoStandardV1,
            roles,
        }
    }

    fn relays() -> Vec<RelayConfig> {
        vec![
            RelayConfig {
                addr: "a:1".into(),
                dc: "dc-a".into(),
                cost: 0.0,
            },
            RelayConfig {
                addr: "b:1".into(),
                dc: "dc-b".into(),
                cost: 20.0,
            },
        ]
    }

    fn request(n_tokens: u32) -> ScoreRequest {
        ScoreRequest {
            tokens: (0..n_tokens).collect(),
            model: "m".into(),
            ..ScoreRequest::default()
        }
    }

    fn run(
        entries: &[PoolEntry],
        loads: &HashMap<PoolKey, LoadSample>,
        depths: &FixedDepths,
        req: &ScoreRequest,
    ) -> Ranking {
        let relays = relays();
        let weights = ScoreWeights::default();
        let dcs: Vec<Arc<str>> = relays.iter().map(|r| Arc::from(r.dc.as_str())).collect();
        let inputs = ScoreInputs {
            entries,
            relays: &relays,
            dcs: &dcs,
            loads,
            weights: &weights,
        };
        rank(&inputs, depths, req, Instant::now()).unwrap()
    }

    #[test]
    fn deeper_cached_prefix_ranks_first() {
        let entries = vec![entry(1, 0, "a", AGG, 4), entry(2, 0, "b", AGG, 4)];
        let mut depths = FixedDepths::default();
        depths.depths.insert(PoolKey(1), ReplicaDepth::Current(1));
        depths.depths.insert(PoolKey(2), ReplicaDepth::Current(4));
        let ranking = run(&entries, &HashMap::new(), &depths, &request(16));
        assert_eq!(&*ranking.candidates[0].legs[0].pool, "pool-2");
        assert_eq!(ranking.candidates[0].legs[0].prefix_tokens, Some(16));
        assert_eq!(ranking.candidates[0].prefix_fraction, Some(1.0));
    }

    #[test]
    fn unusable_replica_is_reported_unknown_not_zero() {
        let entries = vec![entry(1, 0, "a", AGG, 4)];
        let mut depths = FixedDepths::default();
        depths
            .depths
            .insert(PoolKey(1), ReplicaDepth::Unusable(ReplicaStatus::Stale));
        let ranking = run(&entries, &HashMap::new(), &depths, &request(16));
        let leg = &ranking.candidates[0].legs[0];
        assert_eq!(leg.replica, ReplicaStatus::Stale);
        assert_eq!(leg.prefix_blocks, None);
        assert_eq!(ranking.candidates[0].prefix_fraction, None);
    }

    #[test]
    fn pools_with_one_semantics_share_one_probe_and_one_hash_chain() {
        let entries = vec![
            entry(1, 0, "a", AGG, 4),
            entry(2, 1, "b", AGG, 4),
            entry(3, 1, "c", AGG, 8),
        ];
        let depths = FixedDepths::default();
        run(&entries, &HashMap::new(), &depths, &request(16));
        let asked = depths.asked.borrow();
        assert_eq!(asked.len(), 2, "one probe per distinct query semantics");
        let four = asked.iter().find(|(keys, _)| keys.len() == 2).unwrap();
        assert_eq!(four.1.len(), 4, "16 tokens in blocks of 4");
        let eight = asked.iter().find(|(keys, _)| keys.len() == 1).unwrap();
        assert_eq!(eight.1.len(), 2, "16 tokens in blocks of 8");
    }

    #[test]
    fn lora_and_namespace_salts_change_the_hash_chain() {
        let entries = vec![entry(1, 0, "a", AGG, 4)];
        let chain = |req: &ScoreRequest| {
            let depths = FixedDepths::default();
            run(&entries, &HashMap::new(), &depths, req);
            let asked = depths.asked.borrow();
            asked[0].1.clone()
        };
        let plain = chain(&request(8));
        let lora = chain(&ScoreRequest {
            lora: Some("sql".into()),
            ..request(8)
        });
        let ns = chain(&ScoreRequest {
            cache_namespace: Some("tenant".into()),
            ..request(8)
        });
        let expected_lora = sequence_hashes(&block_hashes(
            &request(8).tokens,
            4,
            KvQueryHashFormat::DynamoStandardV1,
            HashSalt {
                lora_name: Some("sql"),
                cache_namespace: None,
            },
        ));
        assert_eq!(lora, expected_lora);
        assert_ne!(plain, lora);
        assert_ne!(plain, ns);
        assert_ne!(lora, ns);
    }

    #[test]
    fn disaggregated_pair_scores_both_legs() {
        let entries = vec![entry(1, 0, "ns", PREFILL, 4), entry(2, 0, "ns", DECODE, 4)];
        let mut depths = FixedDepths::default();
        depths.depths.insert(PoolKey(1), ReplicaDepth::Current(2));
        depths.depths.insert(PoolKey(2), ReplicaDepth::Current(4));
        let mut loads = HashMap::new();
        loads.insert(
            PoolKey(1),
            LoadSample {
                kv_used_blocks: 10,
                total_kv_blocks: 100,
                observed_ranks: 1,
                expected_ranks: 1,
            },
        );
        loads.insert(
            PoolKey(2),
            LoadSample {
                kv_used_blocks: 60,
                total_kv_blocks: 100,
                observed_ranks: 1,
                expected_ranks: 1,
            },
        );
        let ranking = run(&entries, &loads, &depths, &request(16));
        let cand = &ranking.candidates[0];
        assert_eq!(cand.shape, CandidateShape::Disaggregated);
        assert_eq!(
            cand.legs.iter().map(|l| l.role).collect::<Vec<_>>(),
            vec!["prefill", "decode"]
        );
        assert_eq!(cand.prefix_fraction, Some(0.5));
        assert_eq!(
            cand.load_fraction,
            Some(0.6),
            "the busier leg bounds the pair"
        );
        let w = ScoreWeights::default();
        let expected = w.prefix * 0.5 + w.decode_leg * 1.0 - w.load * 0.6;
        assert!((cand.score - expected).abs() < 1e-12);
    }

    #[test]
    fn dc_cost_breaks_an_otherwise_equal_tie() {
        let entries = vec![entry(1, 1, "a", AGG, 4), entry(2, 0, "a", AGG, 4)];
        let mut depths = FixedDepths::default();
        depths.depths.insert(PoolKey(1), ReplicaDepth::Current(2));
        depths.depths.insert(PoolKey(2), ReplicaDepth::Current(2));
        let ranking = run(&entries, &HashMap::new(), &depths, &request(16));
        assert_eq!(&*ranking.candidates[0].dc, "dc-a");
        assert_eq!(ranking.candidates[1].dc_cost, 20.0);
    }

    #[test]
    fn prefix_tokens_are_clamped_to_the_prompt() {
        // Eagle-style or partial trailing windows must never credit more than the prompt.
        let entries = vec![entry(1, 0, "a", AGG, 4)];
        let mut depths = FixedDepths::default();
        depths.depths.insert(PoolKey(1), ReplicaDepth::Current(10));
        let ranking = run(&entries, &HashMap::new(), &depths, &request(18));
        assert_eq!(ranking.candidates[0].legs[0].prefix_tokens, Some(18));
    }

    #[test]
    fn ranking_is_deterministic_for_equal_scores() {
        let entries = vec![entry(2, 0, "b", AGG, 4), entry(1, 0, "a", AGG, 4)];
        let depths = FixedDepths::default();
        let ranking = run(&entries, &HashMap::new(), &depths, &request(8));
        let pools: Vec<_> = ranking
            .candidates
            .iter()
            .map(|c| c.legs[0].pool.to_string())
            .collect();
        assert_eq!(pools, vec!["pool-1", "pool-2"]);
    }
}
