//! The consumer's view of the relays' catalogs: supported pool entries and quarantined ones.
//!
//! Entries are the consumer-side projection of catalog descriptors, reduced to what
//! scoring needs: where the pool lives (relay, namespace, endpoint), what it serves
//! (registrations), how its keys are hashed (query semantics) and which roles it plays.
//! A [`PoolKey`] names one producer generation inside this consumer; a new generation of
//! the same pool gets a new key, so nothing keyed by an old generation can leak into it.

use std::sync::Arc;

use kvrelay_identity::KvQueryHashFormat;

/// A consumer-local handle of one producer generation (one pool replica slot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolKey(pub(crate) u64);

impl PoolKey {
    /// The raw key, for logs.
    pub fn as_u64(self) -> u64 {
        self.0
    }
}

/// What a registration serves: a base model or a LoRA adapter on a base model.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Target {
    /// The base model itself.
    Base,
    /// A LoRA adapter on `base_model`; requests hash with the adapter name as salt.
    Lora { base_model: String, adapter: String },
}

/// One model a pool serves, under its canonical id and aliases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Registration {
    pub(crate) model: String,
    pub(crate) target: Target,
    pub(crate) aliases: Vec<String>,
}

/// The roles a pool plays, as flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Roles {
    pub(crate) prefill: bool,
    pub(crate) decode: bool,
    /// Aggregated, or legacy (a card without a worker type serves whole requests).
    pub(crate) aggregated: bool,
}

/// One supported catalog entry.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PoolEntry {
    pub(crate) key: PoolKey,
    /// The pool's id on the wire (a DC's relays name one pool alike).
    pub(crate) pool_id: kvrelay_codec::v1::PoolId,
    /// The pool's format twin this consumer follows instead of the pool's own filter
    /// (the catalog's device lane: the same blocks in a smaller format), if any.
    pub(crate) format_twin: Option<kvrelay_codec::v1::ProducerIdentity>,
    /// Index of the relay (in the configuration) that published it.
    pub(crate) relay: usize,
    /// The pool id as text, for output.
    pub(crate) pool_label: Arc<str>,
    /// The serving endpoint's namespace: prefill/decode pairs form within one namespace.
    pub(crate) namespace: String,
    /// The serving endpoint as `namespace.component.endpoint`.
    pub(crate) endpoint: Arc<str>,
    pub(crate) registrations: Vec<Registration>,
    pub(crate) block_size: u32,
    pub(crate) hash_format: KvQueryHashFormat,
    pub(crate) roles: Roles,
    /// What the relay says of the pool's filter (catalog coverage, protocol minor 2).
    pub(crate) coverage: Coverage,
    /// The pool's lower-tier lanes this consumer follows (catalog protocol minor 4), in
    /// tier order (host, then disk); empty for a device-only pool.
    pub(crate) tier_lanes: Vec<TierLaneEntry>,
}

impl PoolEntry {
    /// The pool's replica key and those of its lanes: everything subscribed for it.
    pub(crate) fn keys(&self) -> impl Iterator<Item = PoolKey> + '_ {
        std::iter::once(self.key).chain(self.tier_lanes.iter().map(|lane| lane.key))
    }
}

/// One lower-tier lane of a pool: a replica of what the pool's workers hold on the tier.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct TierLaneEntry {
    /// Host memory or disk.
    pub(crate) tier: kvrelay_ckf::CacheTier,
    /// Pool blocks per lane block: the lane holds every `stride`-th prefix position.
    pub(crate) stride: u32,
    /// The lane's producer generation (its subscription key on the wire).
    pub(crate) producer: kvrelay_codec::v1::ProducerIdentity,
    /// Its replica key (assigned when admitted, like a pool's).
    pub(crate) key: PoolKey,
}

/// How completely a pool's filter covers what its engines cache, as its relay says
/// (the catalog's coverage; a relay older than protocol minor 2 says nothing: complete).
///
/// A pool that is not complete still answers: what its filter holds is right (a prefix
/// it reports is cached), but a prefix it does not report may be cached too. Scoring is
/// unchanged; the coverage travels with each leg and pool status so a router can weigh it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Coverage {
    /// Nothing known missing.
    #[default]
    Complete,
    /// Most of the pool's recent events were unroutable (an engine's history was lost):
    /// the filter misses blocks the engines cache.
    Degraded {
        /// The unroutable share of its recent events, percent (a multiple of 10).
        unroutable_percent: u8,
    },
    /// The relay is rebuilding the filter from its engines' replay (a relay start, a
    /// resume, a restarted engine): it misses what the replay has not reached yet.
    Recovering,
    /// The pool's filter, or one of its lanes, holds blocks it could not place (capacity
    /// omissions: the engines cache more than their cards declared).
    Overfull {
        /// The omitted share of the owned blocks, percent (a multiple of 10; 0: under 5 %).
        omitted_percent: u8,
    },
    /// A state a newer relay sent that this consumer does not know: not complete.
    Unrecognized {
        /// The state's wire code.
        code: u32,
        /// The unroutable share the relay sent, percent.
        unroutable_percent: u8,
    },
}

impl Coverage {
    /// The snake_case name used in JSON and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Complete => "complete",
            Self::Degraded { .. } => "degraded",
            Self::Recovering => "recovering",
            Self::Overfull { .. } => "overfull",
            Self::Unrecognized { .. } => "unrecognized",
        }
    }

    /// Whether nothing is known missing.
    pub fn is_complete(self) -> bool {
        self == Self::Complete
    }

    /// The share of recent events the relay could not route, percent (0 unless degraded
    /// or unrecognized).
    pub fn unroutable_percent(self) -> u8 {
        match self {
            Self::Complete | Self::Recovering | Self::Overfull { .. } => 0,
            Self::Degraded { unroutable_percent }
            | Self::Unrecognized {
                unroutable_percent, ..
            } => unroutable_percent,
        }
    }

    /// The share of the pool's owned blocks its filter could not place, percent (0 unless
    /// overfull).
    pub fn omitted_percent(self) -> u8 {
        match self {
            Self::Overfull { omitted_percent } => omitted_percent,
            _ => 0,
        }
    }

    /// The coverage a catalog entry states.
    pub(crate) fn from_wire(coverage: &kvrelay_codec::v1::PoolCoverage) -> Self {
        let unroutable_percent = coverage.unroutable_percent;
        match coverage.state {
            kvrelay_codec::v1::CoverageState::Degraded => Self::Degraded { unroutable_percent },
            kvrelay_codec::v1::CoverageState::Recovering => Self::Recovering,
            kvrelay_codec::v1::CoverageState::Overfull => Self::Overfull {
                omitted_percent: unroutable_percent,
            },
            other => Self::Unrecognized {
                code: other.code(),
                unroutable_percent,
            },
        }
    }
}

/// A catalog entry that was not admitted, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantinedEntry {
    /// The relay's DC name.
    pub dc: String,
    /// The entry's pool id text when it could be read, else its position in the catalog.
    pub entry: String,
    /// Why it was quarantined.
    pub reason: String,
}

/// A pool id of test entries, distinct per `n`.
#[cfg(test)]
pub(crate) fn test_pool_id(n: u64) -> kvrelay_codec::v1::PoolId {
    let digest = kvrelay_codec::v1::DigestId {
        digest: [n as u8; 16],
        source: kvrelay_codec::v1::IdentitySource::Explicit,
    };
    kvrelay_codec::v1::PoolId {
        identity_version: 1,
        cache_semantics: digest,
        routing_scope: digest,
        dc_id: 1,
    }
}
