//! Scoring a request against every candidate deployment: prefix depth per pool with that
//! pool's query semantics and salts, load, and per-DC cost, combined by
//! [`ScoreWeights`].
//!
//! Pure and synchronous: the caller passes the catalog entries, the depth source (the
//! replica store, or an exact index in tests and benchmarks), load samples and `now`.

use std::sync::Arc;
use std::time::Instant;

use hashbrown::HashMap;
use kvrelay_identity::KvQueryHashFormat;
use kvrelay_identity::hashing::{HashSalt, block_hashes, sequence_hashes};
use parking_lot::Mutex;

use crate::candidate::{self, Candidate, CandidateShape, Resolved, Wanted};
use crate::catalog::{Coverage, PoolEntry, PoolKey};
use crate::config::RelayEndpoint;
use crate::load::LoadSample;
use crate::readiness::{self, CandidateReadiness, TopologyView, Verdict};
use crate::store::ProbeScratch;
use crate::tiers::{continue_in_lanes, credited_tokens};
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
pub enum ReplicaState {
    /// Installed, in sequence and fresh: its depth is an estimate.
    Current,
    /// Subscribed, still assembling its first snapshot.
    Assembling,
    /// Installed but older than the staleness bound.
    Stale,
    /// No replica (not subscribed yet, or dropped after a failure).
    Missing,
}

impl ReplicaState {
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
    Unusable(ReplicaState),
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
    pub replica: ReplicaState,
    /// What the relay says of the pool's filter: a degraded pool's depth is right where
    /// it finds a prefix but may miss one the engines cache.
    pub coverage: Coverage,
    /// Estimated cached leading blocks; `None` when the replica is unusable.
    pub prefix_blocks: Option<u32>,
    /// Estimated cached leading tokens (blocks × block size, clamped to the prompt).
    pub prefix_tokens: Option<u32>,
    /// Blocks past `prefix_blocks` the pool holds in host memory (the continuation found
    /// in its host lane); `None` when it has no host lane this consumer follows, the
    /// lane's replica cannot answer, or the device replica cannot.
    pub host_blocks: Option<u32>,
    /// Blocks past those the pool holds on disk; `None` as for `host_blocks`.
    pub disk_blocks: Option<u32>,
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
    /// Whether the relay's topology says the serving entry is ready (candidates whose
    /// entry is unavailable are excluded; see [`crate::readiness`]).
    pub readiness: CandidateReadiness,
    /// The combined score; candidates are sorted by it, highest first.
    pub score: f64,
}

/// The ranked answer for one request. `Default` is an empty ranking, to be filled (and
/// refilled without reallocating) by `score_into`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Ranking {
    /// The canonical base model the request resolved to.
    pub model: String,
    /// The LoRA adapter whose salt was applied, if any.
    pub lora: Option<String>,
    /// Candidates, best first.
    pub candidates: Vec<ScoredCandidate>,
    /// Candidates excluded because their serving entry is unavailable.
    pub n_not_ready: usize,
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
    /// Per entry, a hot standby's replica of the same pool that answers while the entry's
    /// own replica cannot; empty when there are none.
    pub(crate) alternates: &'a [Option<PoolKey>],
    pub(crate) relays: &'a [RelayEndpoint],
    /// The relays' DC names, shared into results.
    pub(crate) dcs: &'a [Arc<str>],
    pub(crate) loads: &'a HashMap<PoolKey, LoadSample>,
    pub(crate) weights: &'a ScoreWeights,
    /// Per entry, its rank by (DC name, pool id): equal text, equal rank (see
    /// [`tie_ranks`]).
    pub(crate) tie_ranks: &'a [u32],
    /// Per relay, its last topology (`None` or absent: readiness unknown).
    pub(crate) topologies: &'a [Option<TopologyView>],
}

/// Dense ranks of `entries` by (DC name of its relay, pool id): entries with equal text
/// share a rank, so ranking by it orders exactly like comparing the strings.
pub(crate) fn tie_ranks(entries: &[PoolEntry], dcs: &[Arc<str>]) -> Vec<u32> {
    let text = |idx: usize| (&*dcs[entries[idx].relay], &*entries[idx].pool_label);
    let mut by_text: Vec<usize> = (0..entries.len()).collect();
    by_text.sort_by(|&a, &b| text(a).cmp(&text(b)));
    let mut ranks = vec![0u32; entries.len()];
    let mut rank = 0u32;
    for (pos, &idx) in by_text.iter().enumerate() {
        if pos > 0 && text(by_text[pos - 1]) != text(idx) {
            rank += 1;
        }
        ranks[idx] = rank;
    }
    ranks
}

/// A key whose ascending order is `score`'s descending `f64::total_cmp` order.
fn descending_key(score: f64) -> u64 {
    let bits = score.to_bits();
    // Flip all bits of negatives and only the sign bit of positives: ascending total
    // order as unsigned integers; then invert for descending.
    let ascending = if bits >> 63 == 1 {
        !bits
    } else {
        bits | (1 << 63)
    };
    !ascending
}

/// A [`DepthSource`] that can reuse buffers across calls (the replica store does; any
/// plain [`DepthSource`] ignores the scratch).
pub(crate) trait DepthProbe {
    /// Like [`DepthSource::depths`], with reusable buffers.
    fn probe(
        &self,
        keys: &[PoolKey],
        sequence_hashes: &[u64],
        now: Instant,
        out: &mut [ReplicaDepth],
        scratch: &mut ProbeScratch,
    );
}

impl<T: DepthSource + ?Sized> DepthProbe for T {
    fn probe(
        &self,
        keys: &[PoolKey],
        sequence_hashes: &[u64],
        now: Instant,
        out: &mut [ReplicaDepth],
        _scratch: &mut ProbeScratch,
    ) {
        self.depths(keys, sequence_hashes, now, out);
    }
}

/// Scratches kept for reuse by [`ScratchPool`]; more concurrent scorers than this
/// allocate their own and drop them afterwards.
const MAX_POOLED_SCRATCHES: usize = 8;

/// Buffers reused across scoring passes, so a warm pass allocates only its result.
#[derive(Debug, Default)]
pub(crate) struct ScoreScratch {
    candidates: Vec<Candidate>,
    /// Per kept candidate, its readiness.
    readiness: Vec<CandidateReadiness>,
    serving: Vec<usize>,
    /// Per entry: whether some candidate uses it as a leg.
    needed: Vec<bool>,
    /// Distinct query semantics among the needed entries, in entry order.
    semantics: Vec<(u32, KvQueryHashFormat)>,
    members: Vec<usize>,
    keys: Vec<PoolKey>,
    out: Vec<ReplicaDepth>,
    depth_of: Vec<ReplicaDepth>,
    /// Per candidate, its formula terms and score.
    terms: Vec<CandidateTerms>,
    /// Per candidate, its sort key (score, then tie rank and index), in rank order.
    order: Vec<(u64, u64)>,
    probe: ProbeScratch,
    /// Per entry: blocks found in its host and disk lanes past its device prefix.
    lower_of: Vec<[Option<u32>; 2]>,
    /// The sequence hashes a lane of some stride is probed with.
    strided: Vec<u64>,
}

/// A small pool of [`ScoreScratch`] shared by concurrent readers of one state. It is a
/// cache of empty buffers, not state: losing one only costs an allocation.
#[derive(Debug, Default)]
pub(crate) struct ScratchPool {
    free: Mutex<Vec<ScoreScratch>>,
}

impl ScratchPool {
    /// Runs `f` with a pooled scratch (or a new one) and returns the scratch afterwards.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut ScoreScratch) -> R) -> R {
        let taken = self.free.lock().pop();
        let mut scratch = taken.unwrap_or_default();
        let result = f(&mut scratch);
        let mut free = self.free.lock();
        if free.len() < MAX_POOLED_SCRATCHES {
            free.push(scratch);
        }
        result
    }
}

/// One candidate's formula inputs, computed before ranking.
#[derive(Debug, Clone, Copy)]
struct CandidateTerms {
    candidate: Candidate,
    readiness: CandidateReadiness,
    prefix_fraction: Option<f64>,
    /// Per leg (first, decode): its load fraction.
    loads: [Option<f64>; 2],
    load_fraction: Option<f64>,
    score: f64,
}

/// Ranks the candidates for `request` into `out`, keeping at most `limit` (best first).
/// On `Err`, `out` is unchanged. Reuses `out`'s candidate and leg buffers.
pub(crate) fn rank_into(
    inputs: &ScoreInputs<'_>,
    depths: &dyn DepthProbe,
    request: &ScoreRequest,
    now: Instant,
    limit: usize,
    scratch: &mut ScoreScratch,
    out: &mut Ranking,
) -> Result<(), ScoreError> {
    let resolved = candidate::resolve(inputs.entries, &request.model, request.lora.as_deref())?;
    let ScoreScratch {
        candidates,
        readiness,
        serving,
        needed,
        semantics,
        members,
        keys,
        out: probe_out,
        depth_of,
        terms,
        order,
        probe,
        lower_of,
        strided,
    } = scratch;
    candidate::candidates_into(inputs.entries, &resolved, serving, candidates);
    readiness.clear();
    let mut n_not_ready = 0;
    candidates.retain(|cand| match candidate_verdict(inputs, &resolved, cand) {
        Verdict::Keep(ready) => {
            readiness.push(ready);
            true
        }
        Verdict::Exclude => {
            n_not_ready += 1;
            false
        }
    });

    // Every pool that appears as a leg, grouped by query semantics so each group hashes
    // the request once (per salt, fixed for the request) and probes all its pools together.
    let n_entries = inputs.entries.len();
    needed.clear();
    needed.resize(n_entries, false);
    for cand in candidates.iter() {
        needed[cand.first] = true;
        if let Some(decode) = cand.decode {
            needed[decode] = true;
        }
    }
    semantics.clear();
    for (entry, _) in inputs
        .entries
        .iter()
        .zip(needed.iter())
        .filter(|(_, n)| **n)
    {
        let key = (entry.block_size, entry.hash_format);
        if !semantics.contains(&key) {
            semantics.push(key);
        }
    }
    let salt = HashSalt {
        lora_name: resolved.lora_salt,
        cache_namespace: request.cache_namespace.as_deref(),
    };
    depth_of.clear();
    depth_of.resize(n_entries, ReplicaDepth::Unusable(ReplicaState::Missing));
    lower_of.clear();
    lower_of.resize(n_entries, [None; 2]);
    for &(block_size, format) in semantics.iter() {
        let hashes = sequence_hashes(&block_hashes(&request.tokens, block_size, format, salt));
        members.clear();
        members.extend((0..n_entries).filter(|&idx| {
            let entry = &inputs.entries[idx];
            needed[idx] && entry.block_size == block_size && entry.hash_format == format
        }));
        keys.clear();
        keys.extend(members.iter().map(|&idx| inputs.entries[idx].key));
        probe_out.clear();
        probe_out.resize(keys.len(), ReplicaDepth::Unusable(ReplicaState::Missing));
        depths.probe(keys, &hashes, now, probe_out, probe);
        for (&idx, &depth) in members.iter().zip(probe_out.iter()) {
            depth_of[idx] = depth;
        }
        // A pool whose replica cannot answer (resubscribing, a snapshot in flight) is
        // answered by its hot standby's replica, when that one is current.
        if !inputs.alternates.is_empty() {
            members.retain(|&idx| {
                matches!(depth_of[idx], ReplicaDepth::Unusable(_))
                    && inputs.alternates.get(idx).is_some_and(Option::is_some)
            });
            if !members.is_empty() {
                keys.clear();
                keys.extend(
                    members
                        .iter()
                        .filter_map(|&idx| inputs.alternates.get(idx).copied().flatten()),
                );
                probe_out.clear();
                probe_out.resize(keys.len(), ReplicaDepth::Unusable(ReplicaState::Missing));
                depths.probe(keys, &hashes, now, probe_out, probe);
                for (&idx, &depth) in members.iter().zip(probe_out.iter()) {
                    if matches!(depth, ReplicaDepth::Current(_)) {
                        depth_of[idx] = depth;
                    }
                }
            }
        }
        // Past the device prefix, each lower tier's lane continues it (host, then disk).
        for idx in 0..n_entries {
            let entry = &inputs.entries[idx];
            if !needed[idx]
                || entry.tier_lanes.is_empty()
                || entry.block_size != block_size
                || entry.hash_format != format
            {
                continue;
            }
            if let ReplicaDepth::Current(device) = depth_of[idx] {
                lower_of[idx] =
                    continue_in_lanes(entry, device, &hashes, now, depths, strided, probe);
            }
        }
    }

    let n_tokens = request.tokens.len();
    terms.clear();
    terms.extend(
        candidates
            .iter()
            .zip(readiness.iter())
            .map(|(cand, &ready)| {
                candidate_terms(inputs, cand, ready, depth_of, lower_of, n_tokens)
            }),
    );
    // Rank small integer keys, not results: best score first, then DC name, then the
    // first leg's pool id (both folded into the entry's precomputed tie rank), then
    // formation order (what a stable sort would keep).
    order.clear();
    order.extend(terms.iter().enumerate().map(|(cand_idx, t)| {
        let tie = inputs.tie_ranks[t.candidate.first];
        (
            descending_key(t.score),
            (u64::from(tie) << 32) | cand_idx as u64,
        )
    }));
    let keep = limit.min(order.len());
    if keep < order.len() {
        if keep > 0 {
            order.select_nth_unstable(keep - 1);
        }
        order.truncate(keep);
    }
    order.sort_unstable();

    out.model.clear();
    out.model.push_str(resolved.base_model);
    match (&mut out.lora, resolved.lora_salt) {
        (Some(lora), Some(salt)) => {
            lora.clear();
            lora.push_str(salt);
        }
        (lora, salt) => *lora = salt.map(str::to_owned),
    }
    out.n_not_ready = n_not_ready;
    out.candidates.truncate(order.len());
    out.candidates
        .reserve_exact(order.len() - out.candidates.len());
    for (rank, &(_, tie_and_idx)) in order.iter().enumerate() {
        let cand_terms = &terms[(tie_and_idx & u64::from(u32::MAX)) as usize];
        match out.candidates.get_mut(rank) {
            Some(slot) => fill_candidate(slot, inputs, cand_terms, (depth_of, lower_of), n_tokens),
            None => out.candidates.push(new_candidate(
                inputs,
                cand_terms,
                (depth_of, lower_of),
                n_tokens,
            )),
        }
    }
    Ok(())
}

/// The readiness rule for `cand` against its relay's topology.
fn candidate_verdict(
    inputs: &ScoreInputs<'_>,
    resolved: &Resolved<'_>,
    cand: &Candidate,
) -> Verdict {
    let entry = &inputs.entries[cand.first];
    let view = inputs.topologies.get(entry.relay).and_then(Option::as_ref);
    if view.is_none() {
        return Verdict::Keep(CandidateReadiness::Unknown);
    }
    // The adapter's canonical model id, as this pool registers it.
    let adapter = match resolved.target {
        Wanted::Base => None,
        lora @ Wanted::Lora { .. } => entry
            .registrations
            .iter()
            .find(|reg| lora.is(&reg.target))
            .map(|reg| reg.model.as_str()),
    };
    if matches!(resolved.target, Wanted::Lora { .. }) && adapter.is_none() {
        return Verdict::Keep(CandidateReadiness::Unknown);
    }
    readiness::verdict_of(view, &entry.namespace, resolved.base_model, adapter)
}

fn candidate_terms(
    inputs: &ScoreInputs<'_>,
    cand: &Candidate,
    readiness: CandidateReadiness,
    depth_of: &[ReplicaDepth],
    lower_of: &[[Option<u32>; 2]],
    n_tokens: usize,
) -> CandidateTerms {
    let fraction = |idx: usize| {
        let entry = &inputs.entries[idx];
        credited_tokens(
            entry,
            depth_of[idx],
            lower_of[idx],
            inputs.weights,
            n_tokens,
        )
        .map(|tokens| {
            if n_tokens == 0 {
                0.0
            } else {
                tokens / n_tokens as f64
            }
        })
    };
    let load = |idx: usize| {
        inputs
            .loads
            .get(&inputs.entries[idx].key)
            .and_then(LoadSample::fraction)
    };
    let prefix_fraction = fraction(cand.first);
    let decode_prefix_fraction = cand.decode.and_then(fraction);
    let loads = [load(cand.first), cand.decode.and_then(load)];
    let load_fraction = match (loads[0], cand.decode) {
        (first, None) => first,
        (Some(first), Some(_)) => loads[1].map(|decode| first.max(decode)),
        (None, Some(_)) => None,
    };
    let load_fraction = load_fraction.map(|load| load.max(0.0));
    let dc_cost = inputs.relays[inputs.entries[cand.first].relay].cost;
    let score = inputs.weights.score(&ScoreTerms {
        prefix_fraction,
        decode_prefix_fraction,
        load_fraction,
        dc_cost,
    });
    CandidateTerms {
        candidate: *cand,
        readiness,
        prefix_fraction,
        loads,
        load_fraction,
        score,
    }
}

/// Estimated cached leading tokens of `entry` (blocks × block size, clamped to the prompt).
pub(crate) fn prefix_tokens(
    entry: &PoolEntry,
    depth: ReplicaDepth,
    n_tokens: usize,
) -> Option<u32> {
    match depth {
        ReplicaDepth::Current(blocks) => {
            let n_tokens = u32::try_from(n_tokens).unwrap_or(u32::MAX);
            Some(blocks.saturating_mul(entry.block_size).min(n_tokens))
        }
        ReplicaDepth::Unusable(_) => None,
    }
}

/// A leg's plain values (everything but the shared labels).
struct LegValues {
    role: &'static str,
    block_size: u32,
    replica: ReplicaState,
    prefix_blocks: Option<u32>,
    prefix_tokens: Option<u32>,
    lower: [Option<u32>; 2],
    load: Option<f64>,
}

impl LegValues {
    /// A new leg of `entry` with these values.
    fn into_leg(self, entry: &PoolEntry) -> ScoredLeg {
        ScoredLeg {
            role: self.role,
            pool: Arc::clone(&entry.pool_label),
            endpoint: Arc::clone(&entry.endpoint),
            block_size: self.block_size,
            replica: self.replica,
            coverage: entry.coverage,
            prefix_blocks: self.prefix_blocks,
            prefix_tokens: self.prefix_tokens,
            host_blocks: self.lower[0],
            disk_blocks: self.lower[1],
            load: self.load,
        }
    }
}

/// The legs of `terms`' candidate: entry index, role, load.
fn legs_of(terms: &CandidateTerms) -> impl Iterator<Item = (usize, &'static str, Option<f64>)> {
    let cand = terms.candidate;
    let first_role = match cand.shape {
        CandidateShape::Aggregated => "aggregated",
        CandidateShape::Disaggregated => "prefill",
        CandidateShape::DecodeOnly => "decode_only",
    };
    std::iter::once((cand.first, first_role, terms.loads[0]))
        .chain(cand.decode.map(|decode| (decode, "decode", terms.loads[1])))
}

fn leg_values(
    entry: &PoolEntry,
    role: &'static str,
    (depth, lower): (ReplicaDepth, [Option<u32>; 2]),
    load: Option<f64>,
    n_tokens: usize,
) -> LegValues {
    let (replica, prefix_blocks) = match depth {
        ReplicaDepth::Current(blocks) => (ReplicaState::Current, Some(blocks)),
        ReplicaDepth::Unusable(status) => (status, None),
    };
    LegValues {
        role,
        block_size: entry.block_size,
        replica,
        prefix_blocks,
        prefix_tokens: prefix_tokens(entry, depth, n_tokens),
        lower,
        load,
    }
}

fn new_candidate(
    inputs: &ScoreInputs<'_>,
    terms: &CandidateTerms,
    depths: (&[ReplicaDepth], &[[Option<u32>; 2]]),
    n_tokens: usize,
) -> ScoredCandidate {
    let (depth_of, lower_of) = depths;
    let legs = legs_of(terms)
        .map(|(idx, role, load)| {
            let entry = &inputs.entries[idx];
            leg_values(entry, role, (depth_of[idx], lower_of[idx]), load, n_tokens).into_leg(entry)
        })
        .collect();
    let relay = inputs.entries[terms.candidate.first].relay;
    ScoredCandidate {
        dc: Arc::clone(&inputs.dcs[relay]),
        shape: terms.candidate.shape,
        legs,
        prefix_fraction: terms.prefix_fraction,
        load_fraction: terms.load_fraction,
        dc_cost: inputs.relays[relay].cost,
        readiness: terms.readiness,
        score: terms.score,
    }
}

/// Overwrites `slot` with `terms`' candidate, reusing its legs and keeping shared labels
/// that already point at the right text.
fn fill_candidate(
    slot: &mut ScoredCandidate,
    inputs: &ScoreInputs<'_>,
    terms: &CandidateTerms,
    depths: (&[ReplicaDepth], &[[Option<u32>; 2]]),
    n_tokens: usize,
) {
    let (depth_of, lower_of) = depths;
    let relay = inputs.entries[terms.candidate.first].relay;
    share(&mut slot.dc, &inputs.dcs[relay]);
    slot.shape = terms.candidate.shape;
    slot.prefix_fraction = terms.prefix_fraction;
    slot.load_fraction = terms.load_fraction;
    slot.dc_cost = inputs.relays[relay].cost;
    slot.score = terms.score;
    slot.readiness = terms.readiness;
    let n_legs = 1 + usize::from(terms.candidate.decode.is_some());
    slot.legs.truncate(n_legs);
    for (leg_idx, (idx, role, load)) in legs_of(terms).enumerate() {
        let entry = &inputs.entries[idx];
        let values = leg_values(entry, role, (depth_of[idx], lower_of[idx]), load, n_tokens);
        match slot.legs.get_mut(leg_idx) {
            Some(leg) => {
                share(&mut leg.pool, &entry.pool_label);
                share(&mut leg.endpoint, &entry.endpoint);
                leg.role = values.role;
                leg.block_size = values.block_size;
                leg.replica = values.replica;
                leg.prefix_blocks = values.prefix_blocks;
                leg.prefix_tokens = values.prefix_tokens;
                leg.host_blocks = values.lower[0];
                leg.disk_blocks = values.lower[1];
                leg.load = values.load;
            }
            None => slot.legs.push(values.into_leg(entry)),
        }
    }
}

/// Points `slot` at `source` unless it already does (skips two atomic operations).
fn share(slot: &mut Arc<str>, source: &Arc<str>) {
    if !Arc::ptr_eq(slot, source) {
        *slot = Arc::clone(source);
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
                    .unwrap_or(ReplicaDepth::Unusable(ReplicaState::Missing));
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
            pool_id: crate::catalog::test_pool_id(key),
            format_twin: None,
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
            coverage: Coverage::Complete,
            tier_lanes: Vec::new(),
        }
    }

    fn relays() -> Vec<RelayEndpoint> {
        vec![
            RelayEndpoint::new("a:1", "dc-a"),
            RelayEndpoint {
                cost: 20.0,
                ..RelayEndpoint::new("b:1", "dc-b")
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
        depths: &impl DepthSource,
        req: &ScoreRequest,
    ) -> Ranking {
        let relays = relays();
        let weights = ScoreWeights::default();
        let dcs: Vec<Arc<str>> = relays.iter().map(|r| Arc::from(r.dc.as_str())).collect();
        let inputs = ScoreInputs {
            entries,
            alternates: &[],
            relays: &relays,
            dcs: &dcs,
            loads,
            weights: &weights,
            tie_ranks: &tie_ranks(entries, &dcs),
            topologies: &[],
        };
        let mut out = Ranking::default();
        let mut scratch = ScoreScratch::default();
        rank_into(
            &inputs,
            depths,
            req,
            Instant::now(),
            usize::MAX,
            &mut scratch,
            &mut out,
        )
        .unwrap();
        out
    }

    /// Answers by membership: a key's depth is how many leading hashes its set holds.
    #[derive(Default)]
    struct SetDepths {
        sets: HashMap<PoolKey, std::collections::HashSet<u64>>,
        unusable: std::collections::HashSet<PoolKey>,
    }

    impl DepthSource for SetDepths {
        fn depths(
            &self,
            keys: &[PoolKey],
            hashes: &[u64],
            _now: Instant,
            out: &mut [ReplicaDepth],
        ) {
            for (key, slot) in keys.iter().zip(out) {
                *slot = match self.sets.get(key) {
                    _ if self.unusable.contains(key) => {
                        ReplicaDepth::Unusable(ReplicaState::Assembling)
                    }
                    Some(set) => ReplicaDepth::Current(
                        hashes.iter().take_while(|h| set.contains(h)).count() as u32,
                    ),
                    None => ReplicaDepth::Unusable(ReplicaState::Missing),
                };
            }
        }
    }

    fn lane(tier: kvrelay_ckf::CacheTier, key: u64, stride: u32) -> crate::catalog::TierLaneEntry {
        crate::catalog::TierLaneEntry {
            tier,
            stride,
            producer: kvrelay_codec::v1::ProducerIdentity {
                pool_id: crate::catalog::test_pool_id(key),
                producer_incarnation: 1,
                layout_generation: key,
                ckf_format: kvrelay_codec::v1::CkfFormat {
                    format_version: 1,
                    seed: 1,
                    bucket_count: 16,
                    fingerprint_bits: 16,
                    slots_per_bucket: 4,
                },
            },
            key: PoolKey(key),
        }
    }

    /// A pool whose device holds 2 of 8 blocks, its host lane (2-block chunks) 4 more and
    /// its disk 1 more outranks a pool holding 3 on its device: 8 + 0.9 × 16 + 0.6 × 4
    /// credited tokens of 32 against 12. The legs report each tier's blocks; a lane that
    /// cannot answer finds nothing and the pool scores on its device alone.
    #[test]
    fn a_prefix_continued_in_lower_tiers_is_credited_at_their_weights() {
        use kvrelay_ckf::CacheTier;
        let mut tiered = entry(1, 0, "a", AGG, 4);
        tiered.tier_lanes = vec![lane(CacheTier::Host, 11, 2), lane(CacheTier::Disk, 12, 1)];
        let entries = vec![tiered, entry(2, 0, "b", AGG, 4)];
        let req = request(32);
        let hashes = sequence_hashes(&block_hashes(
            &req.tokens,
            4,
            KvQueryHashFormat::DynamoStandardV1,
            HashSalt::default(),
        ));
        let at = |positions: &[usize]| positions.iter().map(|p| hashes[p - 1]).collect();
        let mut depths = SetDepths::default();
        depths.sets.insert(PoolKey(1), at(&[1, 2]));
        // Every second position: each 2-block chunk is keyed by its last block.
        depths.sets.insert(PoolKey(11), at(&[2, 4, 6]));
        depths.sets.insert(PoolKey(12), at(&[7]));
        depths.sets.insert(PoolKey(2), at(&[1, 2, 3]));
        let ranking = run(&entries, &HashMap::new(), &depths, &req);
        let best = &ranking.candidates[0];
        assert_eq!(&*best.legs[0].pool, "pool-1");
        let leg = &best.legs[0];
        assert_eq!(
            (leg.prefix_blocks, leg.host_blocks, leg.disk_blocks),
            (Some(2), Some(4), Some(1))
        );
        let expected = (8.0 + 0.9 * 16.0 + 0.6 * 4.0) / 32.0;
        assert!((best.prefix_fraction.unwrap() - expected).abs() < 1e-9);
        let other = &ranking.candidates[1].legs[0];
        assert_eq!((other.host_blocks, other.disk_blocks), (None, None));

        // The host lane assembling: nothing found there; the disk lane continues from the
        // device prefix (position 3 onward: it holds 7 only, so nothing either).
        depths.unusable.insert(PoolKey(11));
        let ranking = run(&entries, &HashMap::new(), &depths, &req);
        let leg = ranking
            .candidates
            .iter()
            .flat_map(|c| &c.legs)
            .find(|leg| &*leg.pool == "pool-1")
            .unwrap();
        assert_eq!((leg.host_blocks, leg.disk_blocks), (None, Some(0)));
        assert_eq!(&*ranking.candidates[0].legs[0].pool, "pool-2");
    }

    /// A lane chunk that straddles the device prefix counts from the device's end: the
    /// host's 4-block chunk ending at block 4 holds blocks 1-4, the device 1-3, so the
    /// host adds 1 block, not 4.
    #[test]
    fn a_chunk_straddling_the_device_prefix_counts_only_past_it() {
        use kvrelay_ckf::CacheTier;
        let mut tiered = entry(1, 0, "a", AGG, 4);
        tiered.tier_lanes = vec![lane(CacheTier::Host, 11, 4)];
        let req = request(32);
        let hashes = sequence_hashes(&block_hashes(
            &req.tokens,
            4,
            KvQueryHashFormat::DynamoStandardV1,
            HashSalt::default(),
        ));
        let mut depths = SetDepths::default();
        depths
            .sets
            .insert(PoolKey(1), hashes[..3].iter().copied().collect());
        depths
            .sets
            .insert(PoolKey(11), [hashes[3]].into_iter().collect());
        let ranking = run(&[tiered], &HashMap::new(), &depths, &req);
        let leg = &ranking.candidates[0].legs[0];
        assert_eq!((leg.prefix_blocks, leg.host_blocks), (Some(3), Some(1)));
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
            .insert(PoolKey(1), ReplicaDepth::Unusable(ReplicaState::Stale));
        let ranking = run(&entries, &HashMap::new(), &depths, &request(16));
        let leg = &ranking.candidates[0].legs[0];
        assert_eq!(leg.replica, ReplicaState::Stale);
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

    fn rank_with(
        entries: &[PoolEntry],
        depths: &FixedDepths,
        req: &ScoreRequest,
        limit: usize,
        scratch: &mut ScoreScratch,
        out: &mut Ranking,
    ) {
        let relays = relays();
        let weights = ScoreWeights::default();
        let dcs: Vec<Arc<str>> = relays.iter().map(|r| Arc::from(r.dc.as_str())).collect();
        let loads = HashMap::new();
        let inputs = ScoreInputs {
            entries,
            alternates: &[],
            relays: &relays,
            dcs: &dcs,
            loads: &loads,
            weights: &weights,
            tie_ranks: &tie_ranks(entries, &dcs),
            topologies: &[],
        };
        rank_into(&inputs, depths, req, Instant::now(), limit, scratch, out).unwrap();
    }

    fn mixed_entries() -> (Vec<PoolEntry>, FixedDepths) {
        let mut entries = Vec::new();
        let mut depths = FixedDepths::default();
        for key in 0..12u64 {
            let roles = match key % 3 {
                0 => AGG,
                1 => PREFILL,
                _ => DECODE,
            };
            let ns = format!("ns{}", key / 6);
            entries.push(entry(key, (key % 2) as usize, &ns, roles, 4));
            depths
                .depths
                .insert(PoolKey(key), ReplicaDepth::Current((key * 5 % 4) as u32));
        }
        (entries, depths)
    }

    #[test]
    fn top_limit_keeps_exactly_the_full_rankings_best_prefix() {
        let (entries, depths) = mixed_entries();
        let full = run(&entries, &HashMap::new(), &depths, &request(16));
        assert!(full.candidates.len() > 4);
        for limit in [0, 1, 3, full.candidates.len(), full.candidates.len() + 5] {
            let mut out = Ranking::default();
            rank_with(
                &entries,
                &depths,
                &request(16),
                limit,
                &mut ScoreScratch::default(),
                &mut out,
            );
            let keep = limit.min(full.candidates.len());
            assert_eq!(out.candidates, full.candidates[..keep], "limit {limit}");
        }
    }

    #[test]
    fn refilled_ranking_equals_a_fresh_one() {
        let (entries, depths) = mixed_entries();
        let mut scratch = ScoreScratch::default();
        let mut out = Ranking::default();
        // A longer ranking first, then a shorter LoRA one, then the long one again.
        rank_with(
            &entries,
            &depths,
            &request(16),
            usize::MAX,
            &mut scratch,
            &mut out,
        );
        let lora = ScoreRequest {
            lora: Some("sql".into()),
            ..request(8)
        };
        rank_with(&entries, &depths, &lora, 2, &mut scratch, &mut out);
        let fresh_lora = run(&entries, &HashMap::new(), &depths, &lora);
        assert_eq!(out.lora.as_deref(), Some("sql"));
        assert_eq!(out.candidates, fresh_lora.candidates[..2]);
        rank_with(
            &entries,
            &depths,
            &request(16),
            usize::MAX,
            &mut scratch,
            &mut out,
        );
        assert_eq!(out, run(&entries, &HashMap::new(), &depths, &request(16)));
    }

    #[test]
    fn descending_key_orders_like_reversed_total_cmp() {
        let values = [
            f64::NEG_INFINITY,
            -1.5,
            -0.0,
            0.0,
            1e-300,
            0.25,
            1.0,
            f64::INFINITY,
        ];
        for a in values {
            for b in values {
                assert_eq!(
                    descending_key(a).cmp(&descending_key(b)),
                    b.total_cmp(&a),
                    "{a} vs {b}"
                );
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 64, ..Default::default() })]

        /// The ranking is ordered by (score desc, DC name, pool id) for any depths, relays
        /// and label collisions, and a top-k ranking is exactly the full ranking's head.
        #[test]
        fn ranking_order_matches_a_stable_sort_by_score_dc_and_pool(
            pools in proptest::collection::vec((0u8..3, 0usize..2, 0u8..3, 0u32..5, 0u8..4), 1..24),
        ) {
            let mut entries = Vec::new();
            let mut depths = FixedDepths::default();
            for (key, &(role, relay, ns, depth, label)) in pools.iter().enumerate() {
                let roles = [AGG, PREFILL, DECODE][usize::from(role)];
                let mut e = entry(key as u64, relay, &format!("ns{ns}"), roles, 4);
                // Few distinct labels: equal (DC, pool) text must fall back to formation order.
                e.pool_label = format!("pool-{label}").into();
                entries.push(e);
                depths.depths.insert(PoolKey(key as u64), ReplicaDepth::Current(depth));
            }
            let req = request(16);
            let mut scratch = ScoreScratch::default();
            let ranked = run(&entries, &HashMap::new(), &depths, &req);
            let mut reference = ranked.candidates.clone();
            reference.sort_by(|a, b| {
                b.score
                    .total_cmp(&a.score)
                    .then_with(|| a.dc.cmp(&b.dc))
                    .then_with(|| a.legs[0].pool.cmp(&b.legs[0].pool))
            });
            // Equal keys keep their relative order in both: compare the keys only.
            let key = |c: &ScoredCandidate| (c.score.to_bits(), c.dc.clone(), c.legs[0].pool.clone());
            proptest::prop_assert_eq!(
                ranked.candidates.iter().map(key).collect::<Vec<_>>(),
                reference.iter().map(key).collect::<Vec<_>>()
            );
            for limit in [1usize, 3] {
                let mut top = Ranking::default();
                rank_with(&entries, &depths, &req, limit, &mut scratch, &mut top);
                let keep = limit.min(ranked.candidates.len());
                proptest::prop_assert_eq!(&top.candidates[..], &ranked.candidates[..keep]);
            }
        }
    }
}
