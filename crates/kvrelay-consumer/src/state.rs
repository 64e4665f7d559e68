//! The sans-IO core of the consumer: per-relay catalogs, load samples and the replica
//! store, fed with wire messages and asked for rankings.
//!
//! [`ConsumerState`] is synchronous and deterministic (the caller passes `now`). The async
//! client in [`crate::client`] only moves frames between sockets and this state, under a
//! lock; tests and benchmarks drive it directly. Every method validates before mutating.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrelay_ckf::GrownRows;
use kvrelay_codec::v1::{
    CatalogUpdate, LoadWindow, PoolFrame, PoolId, PoolPayload, ProducerIdentity, RelayIdentity,
    TopologyUpdate,
};
use kvrelay_identity::CkfFormat;

use crate::budget;
use crate::catalog::{Coverage, PoolEntry, PoolKey, QuarantinedEntry};
use crate::config::{ConfigError, ConsumerConfig, RelayEndpoint};
use crate::load::LoadSample;
use crate::metrics::{ConsumerMetrics, ResubscribeReason};
use crate::projection::{self, AdmittedPool, ProjectedCatalog};
use crate::readiness::TopologyView;
use crate::scoring::{
    self, Ranking, ReplicaState, ScoreError, ScoreInputs, ScoreRequest, ScratchPool,
};
use crate::store::{ReplicaStore, StoreError};
use crate::weights::ScoreWeights;

/// What a catalog changed: subscriptions to start and to stop.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CatalogChange {
    /// New producer generations to subscribe to.
    pub added: Vec<(PoolKey, ProducerIdentity)>,
    /// Generations that left the catalog or were quarantined (replica and load dropped).
    pub removed: Vec<PoolKey>,
    /// Entries newly quarantined by this catalog (including those over budget).
    pub newly_quarantined: usize,
    /// Of those, entries newly quarantined because they did not fit the relay's replica
    /// memory budget ([`crate::Limits::max_replica_bytes_per_relay`]).
    pub newly_over_budget: usize,
}

/// A catalog that cannot be applied; the relay's epoch must restart.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CatalogError {
    /// The relay identity differs from the one this epoch started with.
    #[error("relay identity changed from {previous:?} to {current:?} within one connection epoch")]
    RelayChanged {
        /// The epoch's identity.
        previous: RelayIdentity,
        /// The catalog's identity.
        current: RelayIdentity,
    },
    /// The revision went backwards.
    #[error("catalog revision went backwards from {previous} to {current}")]
    RevisionBackwards {
        /// The last applied revision.
        previous: u64,
        /// The catalog's revision.
        current: u64,
    },
    /// The same revision arrived with different content.
    #[error("catalog revision {revision} was repeated with different content")]
    RevisionContentChanged {
        /// The repeated revision.
        revision: u64,
    },
    /// The catalog has more entries (listed and stalled) than
    /// [`crate::Limits::max_pools_per_relay`].
    #[error("catalog has {n_pools} pools (listed and stalled), above max_pools_per_relay {max}")]
    TooManyPools {
        /// Entries in the catalog, listed and stalled.
        n_pools: usize,
        /// The limit.
        max: usize,
    },
    /// Two entries carry one pool id: the envelope is not trustworthy.
    #[error("catalog lists pool {pool} twice")]
    DuplicatePool {
        /// The repeated pool id.
        pool: String,
    },
    /// The catalog's coverage names a pool it does not list, names one twice or states a
    /// share above 100 %: the envelope is not trustworthy.
    #[error("catalog coverage is malformed: {0}")]
    MalformedCoverage(#[source] kvrelay_codec::v1::EntryError),
    /// The catalog names a stalled pool twice, or one it also lists.
    #[error("catalog stalled list is malformed: {0}")]
    MalformedStalled(#[source] kvrelay_codec::v1::EntryError),
    /// The relay index is not configured.
    #[error("relay index {relay} is not configured ({n_relays} relays)")]
    UnknownRelay {
        /// The index.
        relay: usize,
        /// Relays configured.
        n_relays: usize,
    },
}

/// A pool frame that was refused; the subscription must be dropped and renewed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("pool frame refused ({}): {detail}", reason.as_str())]
pub struct PoolFrameRefused {
    /// The resubscribe reason it maps to.
    pub reason: ResubscribeReason,
    /// What was wrong, with values.
    pub detail: String,
}

/// A pool frame checked against the producer it was subscribed for, with its payload
/// copied out: the CBI1 checksum, layout and bounds are verified and the words or images
/// decoded here, with no state involved, so the async client does this before it takes
/// the state's write lock and applying ([`ConsumerState::apply_checked_frame`]) is only
/// the table write. Scoring waits for that, never for a checksum pass.
#[derive(Debug, Clone)]
pub struct CheckedPoolFrame {
    relay: RelayIdentity,
    producer: ProducerIdentity,
    sequence: u64,
    payload: CheckedPayload,
}

#[derive(Debug, Clone)]
enum CheckedPayload {
    SnapshotChunk(kvrelay_ckf::SnapshotChunk),
    Delta(kvrelay_ckf::Delta),
    Heartbeat,
}

/// What installing a chunk of the snapshot at `sequence` did.
fn chunk_outcome(sequence: u64, complete: bool) -> FrameOutcome {
    if complete {
        FrameOutcome::SnapshotInstalled(sequence)
    } else {
        FrameOutcome::ChunkStored
    }
}

/// A replica's refusal as the subscription's resubscribe reason: a gap (sequence or
/// heartbeat) resubscribes as such, anything else is a validation failure.
fn store_refusal(err: StoreError) -> PoolFrameRefused {
    let reason = match &err {
        StoreError::Replica {
            source: kvrelay_ckf::ReplicaError::SequenceGap { .. },
            ..
        }
        | StoreError::HeartbeatMismatch { .. } => ResubscribeReason::Gap,
        _ => ResubscribeReason::Validation,
    };
    PoolFrameRefused {
        reason,
        detail: err.to_string(),
    }
}

impl CheckedPoolFrame {
    /// Checks `frame` against `producer` (the generation it was subscribed for) and
    /// copies its payload out; a refusal names the resubscribe reason.
    pub fn check(frame: &PoolFrame, producer: &ProducerIdentity) -> Result<Self, PoolFrameRefused> {
        let payload = frame.check(producer).map_err(|err| {
            use kvrelay_codec::cbi1::Cbi1Error;
            use kvrelay_codec::v1::PoolFrameError;
            let reason = match &err {
                PoolFrameError::ProducerChanged { .. } => ResubscribeReason::ProducerChanged,
                PoolFrameError::Cbi1(Cbi1Error::ChecksumMismatch { .. }) => {
                    ResubscribeReason::Checksum
                }
                _ => ResubscribeReason::Validation,
            };
            PoolFrameRefused {
                reason,
                detail: err.to_string(),
            }
        })?;
        // `check` tied the payload's epoch and layout to the header and producer.
        let payload = match payload {
            PoolPayload::SnapshotChunk(view) => {
                CheckedPayload::SnapshotChunk(view.to_snapshot_chunk())
            }
            PoolPayload::Delta(view) => CheckedPayload::Delta(view.to_delta()),
            PoolPayload::Heartbeat => CheckedPayload::Heartbeat,
        };
        Ok(Self {
            relay: frame.header.relay,
            producer: *producer,
            sequence: frame.header.sequence,
            payload,
        })
    }

    /// The sequence the frame brings its replica to.
    pub fn sequence(&self) -> u64 {
        self.sequence
    }
}

/// What an accepted pool frame did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameOutcome {
    /// A snapshot chunk was stored; the snapshot is not complete yet.
    ChunkStored,
    /// The last chunk arrived: the replica is installed at this sequence.
    SnapshotInstalled(u64),
    /// A delta moved the replica to this sequence.
    DeltaApplied(u64),
    /// A heartbeat confirmed this sequence.
    Heartbeat(u64),
}

/// One pool as the consumer sees it (for status output and tests).
#[derive(Debug, Clone, PartialEq)]
pub struct PoolStatus {
    /// The consumer-local key of this producer generation.
    pub key: PoolKey,
    /// The DC (relay) name.
    pub dc: String,
    /// The pool id as text.
    pub pool: String,
    /// The producer generation.
    pub producer: ProducerIdentity,
    /// The replica's state now.
    pub replica: ReplicaState,
    /// What the relay says of the pool's filter: a current replica of a degraded pool
    /// answers, but may miss what the engines cache.
    pub coverage: Coverage,
    /// The installed sequence, when ready.
    pub sequence: Option<u64>,
    /// The newest sequence the relay announced for this pool (catalog or frames), if any.
    pub announced_sequence: Option<u64>,
    /// Time since the replica last heard from its stream (snapshot, delta or
    /// heartbeat); `None` before it first did.
    pub age: Option<Duration>,
    /// Whether the pool is answered by a hot standby's replica now
    /// ([`crate::StandbyMode::Hot`]): the scored relay's own replica of it is not current
    /// (a resubscription, a snapshot in flight) and another relay of the DC has it
    /// current. `replica`, `sequence`, `announced_sequence` and `age` are then that
    /// replica's.
    pub through_standby: bool,
    /// The pool's lower-tier lanes this consumer follows, in tier order (empty without).
    pub tier_lanes: Vec<TierLaneStatus>,
}

/// One lower-tier lane of a pool as the consumer holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct TierLaneStatus {
    /// Host memory or disk.
    pub tier: kvrelay_ckf::CacheTier,
    /// The lane's consumer-local key.
    pub key: PoolKey,
    /// The lane replica's state now.
    pub replica: ReplicaState,
    /// The installed sequence, when ready.
    pub sequence: Option<u64>,
}

/// One followed relay as the consumer sees it (for status output and readiness).
#[derive(Debug, Clone, PartialEq)]
pub struct RelayStatus {
    /// The DC name configured for the relay.
    pub dc: String,
    /// The relay's `host:port`: with a pair followed on demand, the address followed now
    /// (as [`crate::Consumer::relays`] reports it; the state reports the first).
    pub addr: String,
    /// Whether its pools are the DC's scored ones: always for a relay followed on demand;
    /// with [`crate::StandbyMode::Hot`], for one relay of each DC at a time.
    pub scored: bool,
    /// The revision of the catalog applied this epoch; `None` before the first one (or
    /// after the relay's view was forgotten).
    pub catalog_revision: Option<u64>,
    /// The relay incarnation its view was learned from; `None` before its first answer
    /// (or after the view was forgotten).
    pub incarnation: Option<u64>,
    /// True while the relay's connection is broken: its view is kept only for resuming,
    /// and its pools are neither listed nor scored.
    pub suspended: bool,
    /// Catalog entries admitted from this relay.
    pub admitted_pools: usize,
    /// Catalog entries quarantined from this relay.
    pub quarantined_entries: usize,
    /// Pools the relay withholds as stalled (its last catalog's `stalled`): served there
    /// but not progressing, so neither listed nor scored.
    pub stalled_pools: usize,
    /// Why the relay's last connection epoch ended, if one has; filled by
    /// [`crate::Consumer::relays`] (the sans-IO state does not see connections).
    pub last_error: Option<String>,
    /// The DC's addresses not followed now (a pair's standby), each with its last probe;
    /// filled by [`crate::Consumer::relays`], empty for a lone relay.
    pub standbys: Vec<StandbyStatus>,
}

impl RelayStatus {
    /// Whether the relay's pools can be scored: its connection is up and it sent a
    /// catalog this epoch (the one rule for a relay in view; readiness, the router's
    /// answers and hot standbys' statuses use it).
    pub fn in_view(&self) -> bool {
        !self.suspended && self.catalog_revision.is_some()
    }
}

/// A relay of a pair that is not followed now, as last checked
/// ([`crate::Limits::standby_probe_interval`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StandbyStatus {
    /// Its configured `host:port`.
    pub addr: String,
    /// Whether it answered its last probe; `None` before the first one.
    pub reachable: Option<bool>,
    /// Time since that probe ended.
    pub checked_ago: Option<Duration>,
    /// The relay incarnation it reported, when it answered.
    pub incarnation: Option<u64>,
    /// Why it did not answer (or why the consumer left it), when it did not.
    pub error: Option<String>,
    /// Whether it is followed all along ([`crate::StandbyMode::Hot`]), its replicas
    /// kept current to take over at once; then `reachable` says whether its catalog
    /// stream is up now and `checked_ago` is `None`.
    pub followed: bool,
}

/// A DC's scored relay changed ([`crate::StandbyMode::Hot`]): its pools are now
/// answered from another of its relays' replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScoredSwitch {
    /// The DC's index in [`ConsumerConfig::relays`].
    pub dc: usize,
    /// The relay (index of [`ConsumerState::relays`]) scored before.
    pub from: usize,
    /// The relay scored now.
    pub to: usize,
}

/// One relay's catalog as last applied.
#[derive(Debug, Default)]
struct RelayView {
    identity: Option<RelayIdentity>,
    revision: Option<u64>,
    /// Admitted entries by producer generation.
    pools: HashMap<ProducerIdentity, PoolEntry>,
    quarantined: Vec<QuarantinedEntry>,
    /// Pools the last catalog named as stalled (withheld).
    stalled: usize,
    /// False while the relay's connection is broken and its view is only kept for
    /// resuming: its pools are neither listed nor scored.
    suspended: bool,
}

/// The consumer's state: catalogs, loads and replicas of every followed relay.
///
/// A relay index names one followed relay ([`ConsumerConfig::followed_relays`]): a DC
/// (its standbys tried in turn by the client) with [`crate::StandbyMode::OnDemand`], one
/// address with [`crate::StandbyMode::Hot`]. Then every relay of a DC keeps its own view
/// and replicas and exactly one of them is scored ([`ConsumerState::scored_relay`]), so a
/// DC is never counted twice.
#[derive(Debug)]
pub struct ConsumerState {
    relays: Vec<RelayEndpoint>,
    /// Per relay: its DC's index in the configuration.
    relay_dcs: Vec<usize>,
    /// Per DC: the relay whose pools are scored.
    scored: Vec<usize>,
    /// Per relay: whether it stopped sending load windows ([`ConsumerState::set_silent`]).
    silent: Vec<bool>,
    /// Per DC: a change of its scored relay not yet taken ([`ConsumerState::poll_switch`]);
    /// one per DC at most, so a caller that never takes them holds nothing more.
    switches: Vec<Option<ScoredSwitch>>,
    /// Per DC: whether it was ever scored through a fit relay. Until then a move is the
    /// start (whichever relay answered first), not a failover, and is not reported.
    settled: Vec<bool>,
    dcs: Vec<Arc<str>>,
    weights: ScoreWeights,
    max_pools_per_relay: usize,
    max_replica_bytes_per_relay: u64,
    /// Whether pools' lower-tier lanes are followed ([`ConsumerConfig::follow_tier_lanes`]).
    follow_tier_lanes: bool,
    /// Whether pools' format twins are followed ([`ConsumerConfig::follow_format_twins`]).
    follow_format_twins: bool,
    relay_views: Vec<RelayView>,
    /// Per relay: the DC id its pools carry, pinned by the first catalog that admitted
    /// one (kept across reconnects and restarts: a relay address serves one DC).
    relay_dc_ids: Vec<Option<u64>>,
    /// Every admitted entry of every relay, rebuilt when a catalog changes.
    entries: Vec<PoolEntry>,
    /// Per entry (empty when no DC has a hot standby): the same pool's replica at the
    /// fittest other relay of its DC, which answers while the entry's own cannot.
    alternates: Vec<Option<PoolKey>>,
    loads: hashbrown::HashMap<PoolKey, LoadSample>,
    producers: HashMap<PoolKey, (usize, ProducerIdentity)>,
    store: ReplicaStore,
    next_key: u64,
    /// Per entry, its scoring tie-break rank (rebuilt with `entries`).
    tie_ranks: Vec<u32>,
    /// Per relay, its last topology (`None`: readiness unknown).
    topologies: Vec<Option<TopologyView>>,
    /// Reusable scoring buffers for concurrent readers.
    scratches: ScratchPool,
}

impl ConsumerState {
    /// An empty state for `config` (validated).
    pub fn new(config: &ConsumerConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let (relay_dcs, relays): (Vec<usize>, Vec<RelayEndpoint>) =
            config.followed_relays().into_iter().unzip();
        let scored = (0..config.relays.len())
            .map(|dc| relay_dcs.iter().position(|&of| of == dc).unwrap_or(0))
            .collect();
        Ok(Self {
            silent: vec![false; relays.len()],
            switches: vec![None; config.relays.len()],
            settled: vec![false; config.relays.len()],
            scored,
            dcs: relays.iter().map(|r| Arc::from(r.dc.as_str())).collect(),
            relay_dcs,
            weights: config.weights,
            max_pools_per_relay: config.limits.max_pools_per_relay,
            max_replica_bytes_per_relay: config.limits.max_replica_bytes_per_relay,
            follow_tier_lanes: config.follow_tier_lanes,
            follow_format_twins: config.follow_format_twins,
            relay_views: relays.iter().map(|_| RelayView::default()).collect(),
            relay_dc_ids: vec![None; relays.len()],
            entries: Vec::new(),
            alternates: Vec::new(),
            loads: hashbrown::HashMap::new(),
            producers: HashMap::new(),
            store: ReplicaStore::new(
                config.limits.staleness_bound,
                config.limits.max_query_table_bytes,
            ),
            next_key: 1,
            tie_ranks: Vec::new(),
            topologies: relays.iter().map(|_| None).collect(),
            scratches: ScratchPool::default(),
            relays,
        })
    }

    /// The followed relays, by index ([`ConsumerConfig::followed_relays`]).
    pub fn relays(&self) -> &[RelayEndpoint] {
        &self.relays
    }

    /// The index in [`ConsumerConfig::relays`] of relay `relay`'s DC.
    pub fn relay_dc(&self, relay: usize) -> Option<usize> {
        self.relay_dcs.get(relay).copied()
    }

    /// The relay whose pools DC `dc` (its index in [`ConsumerConfig::relays`]) is scored
    /// with now.
    pub fn scored_relay(&self, dc: usize) -> Option<usize> {
        self.scored.get(dc).copied()
    }

    /// Marks relay `relay` silent (it stopped sending load windows) or heard again. A
    /// silent relay's pools keep their replicas; with [`crate::StandbyMode::Hot`] its DC
    /// is scored through another of its relays that is not.
    pub fn set_silent(&mut self, relay: usize, silent: bool) {
        if let Some(flag) = self.silent.get_mut(relay)
            && *flag != silent
        {
            *flag = silent;
            self.rebuild_entries();
        }
    }

    /// Takes a change of some DC's scored relay, if one happened since the last call (the
    /// first relay each DC was scored with and the one it is scored with now).
    pub fn poll_switch(&mut self) -> Option<ScoredSwitch> {
        self.switches.iter_mut().find_map(Option::take)
    }

    /// How fit relay `relay` is to be scored: a relay with no catalog or a broken
    /// connection not at all, then a silent one, then one withholding stalled pools.
    fn fitness(&self, relay: usize) -> u8 {
        let view = &self.relay_views[relay];
        if view.suspended || view.revision.is_none() {
            0
        } else if self.silent[relay] {
            1
        } else if view.stalled > 0 {
            2
        } else {
            3
        }
    }

    /// Moves each DC's scoring to its fittest relay when that one is strictly fitter than
    /// the relay scored now (the first in configuration order among equals): two relays
    /// that are both fine never swap, and one that comes back is not preferred again.
    fn choose_scored(&mut self) {
        for dc in 0..self.scored.len() {
            let current = self.scored[dc];
            let best = (0..self.relays.len())
                .filter(|&relay| self.relay_dcs[relay] == dc)
                .fold(current, |best, relay| {
                    if self.fitness(relay) > self.fitness(best) {
                        relay
                    } else {
                        best
                    }
                });
            if best != current {
                self.scored[dc] = best;
                if self.settled[dc] {
                    let from = self.switches[dc].map_or(current, |pending| pending.from);
                    self.switches[dc] = Some(ScoredSwitch { dc, from, to: best });
                }
            }
            if self.fitness(best) > 0 {
                self.settled[dc] = true;
            }
        }
    }

    /// The revision of relay `relay`'s last applied catalog, if any this epoch.
    pub fn catalog_revision(&self, relay: usize) -> Option<u64> {
        self.relay_views.get(relay)?.revision
    }

    /// The DC id of relay `relay`'s pools, moving to quarantine every admitted entry of
    /// another DC: one whose DC id differs from the one the relay's pools carry (pinned by
    /// its first admitting catalog, else the first admitted entry's), or that another
    /// relay already serves. A relay presenting another DC's pools would otherwise have
    /// them labelled with its configured DC, and a DC followed through two relays would be
    /// counted twice. Returns the DC id to pin (nothing is pinned here: the caller pins
    /// it once the catalog is accepted).
    fn quarantine_foreign_dcs(
        &self,
        relay: usize,
        projected: &mut ProjectedCatalog,
    ) -> Option<u64> {
        // Relays of one DC (hot standbys) serve the same pools; any other relay does not.
        let dc_index = self.relay_dcs[relay];
        let served_elsewhere = |dc_id: u64| {
            self.relay_dc_ids
                .iter()
                .enumerate()
                .find(|(other, pinned)| {
                    self.relay_dcs[*other] != dc_index && **pinned == Some(dc_id)
                })
                .map(|(other, _)| other)
        };
        let sibling_pinned = || {
            self.relay_dc_ids
                .iter()
                .enumerate()
                .find_map(|(other, pinned)| {
                    (self.relay_dcs[other] == dc_index).then_some(*pinned)?
                })
        };
        let own = self.relay_dc_ids[relay]
            .or_else(sibling_pinned)
            .or_else(|| {
                projected
                    .admitted
                    .iter()
                    .map(|pool| pool.producer.pool_id.dc_id)
                    .find(|dc_id| served_elsewhere(*dc_id).is_none())
            });
        let dc = &self.relays[relay].dc;
        let (kept, foreign): (Vec<AdmittedPool>, Vec<AdmittedPool>) =
            std::mem::take(&mut projected.admitted)
                .into_iter()
                .partition(|pool| {
                    let dc_id = pool.producer.pool_id.dc_id;
                    own == Some(dc_id) && served_elsewhere(dc_id).is_none()
                });
        projected.admitted = kept;
        for pool in foreign {
            let dc_id = pool.producer.pool_id.dc_id;
            let reason = match served_elsewhere(dc_id) {
                Some(other) => format!(
                    "foreign dc: pool of DC id {dc_id:016x}, which relay {} already serves (a DC is never counted twice)",
                    self.relays[other].dc
                ),
                None => format!(
                    "foreign dc: pool of DC id {dc_id:016x}, but this relay's pools are of DC id {}",
                    own.map_or_else(|| "unknown".to_owned(), |own| format!("{own:016x}"))
                ),
            };
            projected.quarantined.push(QuarantinedEntry {
                dc: dc.clone(),
                entry: pool.producer.pool_id.to_string(),
                reason,
            });
        }
        own
    }

    /// Applies a complete catalog from relay `relay`.
    ///
    /// Each entry is validated alone: a failing entry is quarantined (and its previous
    /// replica and load dropped) while the others stay usable. So is an entry that does
    /// not fit the relay's replica memory budget (see [`crate::Limits`]; entries admitted
    /// before keep their place, new ones are admitted in catalog order while they fit).
    /// Entries already admitted
    /// under the same producer generation keep their key and replica even if their
    /// metadata changed; new generations get a new key (subscribe to them); absent ones
    /// are dropped. A repeated revision is a heartbeat and must carry the same content.
    pub fn apply_catalog(
        &mut self,
        relay: usize,
        update: &CatalogUpdate,
    ) -> Result<CatalogChange, CatalogError> {
        let n_relays = self.relays.len();
        let Some(config) = self.relays.get(relay) else {
            return Err(CatalogError::UnknownRelay { relay, n_relays });
        };
        // Stalled pools count too: the work of checking them is bounded by the same limit.
        let n_pools = update.pools.len().saturating_add(update.stalled.len());
        if n_pools > self.max_pools_per_relay {
            return Err(CatalogError::TooManyPools {
                n_pools,
                max: self.max_pools_per_relay,
            });
        }
        update
            .validate_coverage()
            .map_err(CatalogError::MalformedCoverage)?;
        update
            .validate_stalled()
            .map_err(CatalogError::MalformedStalled)?;
        let mut projected = projection::project_catalog(&config.dc, update)
            .map_err(|dup| CatalogError::DuplicatePool { pool: dup.pool })?;
        if (self.follow_format_twins || self.follow_tier_lanes)
            && projection::lanes_usable(&config.dc, update, &mut projected)
        {
            if self.follow_format_twins {
                projection::adopt_format_twins(update, &mut projected);
            }
            if self.follow_tier_lanes {
                projection::attach_lanes(update, &mut projected);
            }
        }
        let dc_id = self.quarantine_foreign_dcs(relay, &mut projected);
        let view = &self.relay_views[relay];
        let n_over_budget = budget::admit_within(
            &mut projected,
            &config.dc,
            self.max_replica_bytes_per_relay,
            |producer| view.pools.contains_key(producer),
        );
        let n_lanes_over_budget = budget::admit_lanes_within(
            &mut projected,
            &config.dc,
            self.max_replica_bytes_per_relay,
        );
        if let Some(previous) = view.identity
            && previous != update.relay
        {
            return Err(CatalogError::RelayChanged {
                previous,
                current: update.relay,
            });
        }
        if let Some(previous) = view.revision {
            if update.revision < previous {
                return Err(CatalogError::RevisionBackwards {
                    previous,
                    current: update.revision,
                });
            }
            if update.revision == previous
                && !same_content(view, &projected.admitted, &projected.quarantined)
            {
                return Err(CatalogError::RevisionContentChanged {
                    revision: update.revision,
                });
            }
        }

        let is_new = |q: &&QuarantinedEntry| !view.quarantined.contains(q);
        let newly_quarantined = projected.quarantined.iter().filter(is_new).count();
        // `admit_within` appended the entries over budget last.
        let n_over_budget = n_over_budget + n_lanes_over_budget;
        let newly_over_budget = projected.quarantined
            [projected.quarantined.len() - n_over_budget..]
            .iter()
            .filter(is_new)
            .count();
        let mut change = CatalogChange {
            newly_quarantined,
            newly_over_budget,
            ..CatalogChange::default()
        };
        let mut previous = std::mem::take(&mut self.relay_views[relay].pools);
        // Lane keys by producer, like pools': a lane kept keeps its replica.
        let mut previous_lanes: HashMap<ProducerIdentity, PoolKey> = previous
            .values()
            .flat_map(|entry| {
                entry
                    .tier_lanes
                    .iter()
                    .map(|lane| (lane.producer, lane.key))
            })
            .collect();
        let mut next = HashMap::with_capacity(projected.admitted.len());
        for admitted in projected.admitted {
            // A pool kept under the same generation keeps its replica, unless what the
            // replica follows changed (its format twin came or went).
            let replica_producer = *admitted.replica_producer();
            let AdmittedPool {
                producer,
                mut entry,
            } = admitted;
            entry.relay = relay;
            entry.key = match previous.remove(&producer) {
                Some(old) if old.format_twin == entry.format_twin => old.key,
                Some(old) => {
                    self.forget(old.key);
                    change.removed.push(old.key);
                    self.new_key(relay, replica_producer, &mut change)
                }
                None => self.new_key(relay, replica_producer, &mut change),
            };
            for lane in &mut entry.tier_lanes {
                lane.key = match previous_lanes.remove(&lane.producer) {
                    Some(key) => key,
                    None => self.new_key(relay, lane.producer, &mut change),
                };
            }
            next.insert(producer, entry);
        }
        for gone in previous.into_values() {
            self.forget(gone.key);
            change.removed.push(gone.key);
        }
        for (_, gone) in previous_lanes {
            self.forget(gone);
            change.removed.push(gone);
        }
        if !next.is_empty() {
            self.relay_dc_ids[relay] = dc_id;
        }
        let view = &mut self.relay_views[relay];
        view.identity = Some(update.relay);
        view.revision = Some(update.revision);
        view.pools = next;
        view.quarantined = projected.quarantined;
        view.stalled = update.stalled.len();
        view.suspended = false;
        self.rebuild_entries();
        Ok(change)
    }

    /// Forgets everything learned from relay `relay` (its epoch ended or it restarted);
    /// returns the keys dropped.
    pub fn reset_relay(&mut self, relay: usize) -> Vec<PoolKey> {
        let Some(view) = self.relay_views.get_mut(relay) else {
            return Vec::new();
        };
        let dropped: Vec<PoolKey> = std::mem::take(view)
            .pools
            .values()
            .flat_map(PoolEntry::keys)
            .collect();
        for &key in &dropped {
            self.forget(key);
        }
        self.topologies[relay] = None;
        self.silent[relay] = false;
        self.rebuild_entries();
        dropped
    }

    /// Keeps relay `relay`'s catalog view after its connection broke, with every replica
    /// suspended (not scored; intact for resumption) and its loads and topology cleared,
    /// so the next epoch with the same incarnation resumes each pool without a snapshot.
    /// Returns the keys kept.
    pub fn suspend_relay(&mut self, relay: usize) -> Vec<PoolKey> {
        let Some(view) = self.relay_views.get(relay) else {
            return Vec::new();
        };
        let keys: Vec<PoolKey> = view.pools.values().flat_map(PoolEntry::keys).collect();
        for key in &keys {
            self.store.suspend(*key);
            self.loads.remove(key);
        }
        self.topologies[relay] = None;
        // Silence is a fact of a connection: the next one watches afresh.
        self.silent[relay] = false;
        self.relay_views[relay].suspended = true;
        self.rebuild_entries();
        keys
    }

    /// The relay incarnation `relay`'s view was learned from, if any.
    pub fn relay_identity(&self, relay: usize) -> Option<RelayIdentity> {
        self.relay_views.get(relay).and_then(|view| view.identity)
    }

    /// The pool keys admitted from relay `relay`.
    pub fn relay_keys(&self, relay: usize) -> Vec<PoolKey> {
        self.relay_views
            .get(relay)
            .map(|view| view.pools.values().flat_map(PoolEntry::keys).collect())
            .unwrap_or_default()
    }

    /// Replaces relay `relay`'s load samples with a complete window. Admitted pools absent
    /// from the window lose their sample (missing is not zero). Windows from another
    /// relay incarnation are ignored.
    pub fn apply_load_window(&mut self, relay: usize, window: &LoadWindow) {
        let Some(view) = self.relay_views.get(relay) else {
            return;
        };
        if view
            .identity
            .is_some_and(|identity| identity != window.relay)
        {
            return;
        }
        for entry in view.pools.values() {
            self.loads.remove(&entry.key);
        }
        for (producer, sample) in projection::project_load(window) {
            if let Some(entry) = view.pools.get(&producer) {
                self.loads.insert(entry.key, sample);
            }
        }
    }

    /// Replaces relay `relay`'s serving topology with a complete update; returns how many
    /// entries failed validation (they read as unknown). Updates from another relay
    /// incarnation are ignored. See [`crate::readiness`] for how it filters candidates.
    pub fn apply_topology(&mut self, relay: usize, update: &TopologyUpdate) -> usize {
        let Some(view) = self.relay_views.get(relay) else {
            return 0;
        };
        if view
            .identity
            .is_some_and(|identity| identity != update.relay)
        {
            return 0;
        }
        let (topology, n_invalid) = TopologyView::from_update(update);
        self.topologies[relay] = Some(topology);
        n_invalid
    }

    /// Forgets relay `relay`'s topology (its stream was lost: readiness is unknown).
    pub fn clear_topology(&mut self, relay: usize) {
        if let Some(slot) = self.topologies.get_mut(relay) {
            *slot = None;
        }
    }

    /// Drops relay `relay`'s load samples (its load stream was lost: loads are unknown).
    pub fn clear_loads(&mut self, relay: usize) {
        let Some(view) = self.relay_views.get(relay) else {
            return;
        };
        for entry in view.pools.values() {
            self.loads.remove(&entry.key);
        }
    }

    /// The producer generation behind `key`, while it is admitted.
    pub fn producer(&self, key: PoolKey) -> Option<ProducerIdentity> {
        self.producers.get(&key).map(|(_, producer)| *producer)
    }

    /// Prepares `key`'s replica for a new subscription; returns the producer generation
    /// to subscribe to and, when a suspended replica is kept intact, the sequence to
    /// resume from (otherwise the replica is reset to empty for a snapshot).
    pub fn begin_subscription(
        &mut self,
        key: PoolKey,
    ) -> Result<(ProducerIdentity, Option<u64>), StoreError> {
        self.begin_subscription_prepared(key, None)
    }

    /// The expensive part of [`ConsumerState::begin_subscription`] (a replica table's
    /// growth: allocation and copy), done with `&self` so a caller can run it under a
    /// shared lock while queries go on, then hand it to
    /// [`ConsumerState::begin_subscription_prepared`] under the exclusive lock. `None`
    /// when the subscription needs no new table rows.
    pub fn prepare_subscription(&self, key: PoolKey) -> Result<Option<GrownRows>, StoreError> {
        let (_, format) = self.subscription_format(key)?;
        if self.store.resume_point(key, format).is_some() {
            return Ok(None);
        }
        self.store.prepare_lane(key, format)
    }

    /// [`ConsumerState::begin_subscription`] using rows from
    /// [`ConsumerState::prepare_subscription`]: swapped in when the table did not change
    /// since (else it grows itself); `prepared` then holds the old rows, which the caller
    /// frees after releasing its lock.
    pub fn begin_subscription_prepared(
        &mut self,
        key: PoolKey,
        prepared: Option<&mut GrownRows>,
    ) -> Result<(ProducerIdentity, Option<u64>), StoreError> {
        let (producer, format) = self.subscription_format(key)?;
        if let Some(sequence) = self.store.resume_point(key, format) {
            return Ok((producer, Some(sequence)));
        }
        self.store.reset_prepared(key, format, prepared)?;
        Ok((producer, None))
    }

    fn subscription_format(
        &self,
        key: PoolKey,
    ) -> Result<(ProducerIdentity, CkfFormat), StoreError> {
        let (_, producer) = *self
            .producers
            .get(&key)
            .ok_or(StoreError::UnknownKey { key: key.0 })?;
        let format =
            projection::domain_format(&producer).ok_or(StoreError::UnknownKey { key: key.0 })?;
        Ok((producer, format))
    }

    /// Marks `key`'s replica unusable (its stream broke) until a new snapshot.
    pub fn invalidate(&self, key: PoolKey) {
        self.store.invalidate(key);
    }

    /// Marks `key`'s replica unusable until its stream resumes: it keeps its table at its
    /// sequence so the next subscription can resume without a snapshot. A replica that
    /// refused a frame stays invalid.
    pub fn suspend(&mut self, key: PoolKey) {
        self.store.suspend(key);
    }

    /// Checks and applies one pool frame for `key`. On `Err` the replica is unusable and
    /// the subscription must be renewed; nothing was half applied.
    pub fn apply_pool_frame(
        &mut self,
        key: PoolKey,
        frame: &PoolFrame,
        now: Instant,
    ) -> Result<FrameOutcome, PoolFrameRefused> {
        let checked = self
            .subscribed(key)
            .and_then(|(_, producer)| CheckedPoolFrame::check(frame, &producer));
        match checked {
            Ok(checked) => self.apply_checked_frame(key, &checked, now),
            Err(err) => {
                self.store.invalidate(key);
                Err(err)
            }
        }
    }

    /// Applies a frame already checked by [`CheckedPoolFrame::check`] (outside any lock):
    /// only the catalog's producer and relay are compared and the table written. On
    /// `Err` the replica is unusable until a new snapshot.
    pub fn apply_checked_frame(
        &mut self,
        key: PoolKey,
        frame: &CheckedPoolFrame,
        now: Instant,
    ) -> Result<FrameOutcome, PoolFrameRefused> {
        if let Some(outcome) = self.apply_beside_queries(key, frame, now) {
            return outcome;
        }
        let result = self.install_chunk(key, frame, now);
        if result.is_err() {
            self.store.invalidate(key);
        }
        result
    }

    /// [`ConsumerState::apply_checked_frame`] with `&self`: a caller applies under a
    /// shared lock while queries go on (they never wait for it; each probe still sees a
    /// delta whole, see `kvrelay_ckf::QueryTable`). Applies to the consumer's tables must
    /// not run concurrently with each other: the client runs them under its lock's
    /// upgradable read, which excludes the next one (and a table's growth) but not
    /// queries. Deltas, heartbeats and the chunks of a replica that no query can be
    /// reading (reset since it last answered, as a new subscription's is) go in here;
    /// `None` for a chunk over a replica that answered queries (a snapshot over a resumed
    /// one), which needs [`ConsumerState::apply_checked_frame`]. On `Err` the replica is
    /// unusable until a new snapshot.
    pub fn apply_beside_queries(
        &self,
        key: PoolKey,
        frame: &CheckedPoolFrame,
        now: Instant,
    ) -> Option<Result<FrameOutcome, PoolFrameRefused>> {
        let result = match &frame.payload {
            CheckedPayload::SnapshotChunk(chunk) => match self.check_origin(key, frame) {
                Err(err) => Err(err),
                Ok(()) => self
                    .store
                    .install_chunk_beside_queries(key, chunk, now)?
                    .map(|complete| chunk_outcome(frame.sequence, complete))
                    .map_err(store_refusal),
            },
            CheckedPayload::Delta(delta) => self.check_origin(key, frame).and_then(|()| {
                self.store
                    .apply_delta(key, delta, now)
                    .map_err(store_refusal)?;
                Ok(FrameOutcome::DeltaApplied(frame.sequence))
            }),
            CheckedPayload::Heartbeat => self.check_origin(key, frame).and_then(|()| {
                self.store
                    .heartbeat(key, frame.sequence, now)
                    .map_err(store_refusal)?;
                Ok(FrameOutcome::Heartbeat(frame.sequence))
            }),
        };
        if result.is_err() {
            self.store.invalidate(key);
        }
        Some(result)
    }

    /// The relay and producer `key` stands for in the catalog.
    fn subscribed(&self, key: PoolKey) -> Result<(usize, ProducerIdentity), PoolFrameRefused> {
        self.producers
            .get(&key)
            .copied()
            .ok_or_else(|| PoolFrameRefused {
                reason: ResubscribeReason::ProducerChanged,
                detail: format!("pool key {} is no longer in the catalog", key.0),
            })
    }

    /// Whether `frame` comes from the producer and relay the catalog names for `key`;
    /// when it does, its sequence is announced (for lag).
    fn check_origin(&self, key: PoolKey, frame: &CheckedPoolFrame) -> Result<(), PoolFrameRefused> {
        let (relay, producer) = self.subscribed(key)?;
        if producer != frame.producer {
            return Err(PoolFrameRefused {
                reason: ResubscribeReason::ProducerChanged,
                detail: format!(
                    "frame checked for {:?}, catalog holds {:?} under key {}",
                    frame.producer, producer, key.0
                ),
            });
        }
        if let Some(identity) = self.relay_views[relay].identity
            && identity != frame.relay
        {
            return Err(PoolFrameRefused {
                reason: ResubscribeReason::RelayRestart,
                detail: format!(
                    "frame from relay {:?}, catalog from {:?}",
                    frame.relay, identity
                ),
            });
        }
        self.store.announce(key, frame.sequence);
        Ok(())
    }

    fn install_chunk(
        &mut self,
        key: PoolKey,
        frame: &CheckedPoolFrame,
        now: Instant,
    ) -> Result<FrameOutcome, PoolFrameRefused> {
        self.check_origin(key, frame)?;
        let CheckedPayload::SnapshotChunk(chunk) = &frame.payload else {
            return Err(PoolFrameRefused {
                reason: ResubscribeReason::Validation,
                detail: "not a snapshot chunk".to_owned(),
            });
        };
        let complete = self
            .store
            .install_chunk(key, chunk, now)
            .map_err(store_refusal)?;
        Ok(chunk_outcome(frame.sequence, complete))
    }

    /// Ranks the candidates for `request` at `now`.
    pub fn score(&self, request: &ScoreRequest, now: Instant) -> Result<Ranking, ScoreError> {
        let mut out = Ranking::default();
        self.score_into(request, now, &mut out)?;
        Ok(out)
    }

    /// Ranks the candidates for `request` at `now` into `out`, reusing its buffers: a
    /// caller that keeps one [`Ranking`] across requests allocates (nearly) nothing per
    /// call. On `Err`, `out` is unchanged.
    pub fn score_into(
        &self,
        request: &ScoreRequest,
        now: Instant,
        out: &mut Ranking,
    ) -> Result<(), ScoreError> {
        self.score_top_into(request, now, usize::MAX, out)
    }

    /// Like [`ConsumerState::score_into`], keeping only the best `limit` candidates
    /// (ranked exactly as the full ranking's first `limit`; cheaper than a full sort).
    pub fn score_top_into(
        &self,
        request: &ScoreRequest,
        now: Instant,
        limit: usize,
        out: &mut Ranking,
    ) -> Result<(), ScoreError> {
        let inputs = ScoreInputs {
            entries: &self.entries,
            alternates: &self.alternates,
            relays: &self.relays,
            dcs: &self.dcs,
            loads: &self.loads,
            weights: &self.weights,
            tie_ranks: &self.tie_ranks,
            topologies: &self.topologies,
        };
        self.scratches.with(|scratch| {
            scoring::rank_into(&inputs, &self.store, request, now, limit, scratch, out)
        })
    }

    /// Every admitted pool with its replica state at `now`, sorted by DC then pool.
    pub fn pools(&self, now: Instant) -> Vec<PoolStatus> {
        let mut out: Vec<PoolStatus> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(idx, entry)| {
                let (_, producer) = *self.producers.get(&entry.key)?;
                let (answering, through_standby) = self.answering(idx, now);
                Some(PoolStatus {
                    key: entry.key,
                    dc: self.relays[entry.relay].dc.clone(),
                    pool: entry.pool_label.to_string(),
                    producer,
                    replica: self.store.status(answering, now),
                    coverage: entry.coverage,
                    sequence: self.store.sequence(answering),
                    announced_sequence: self.store.announced(answering),
                    age: self.store.age(answering, now),
                    through_standby,
                    tier_lanes: entry
                        .tier_lanes
                        .iter()
                        .map(|lane| TierLaneStatus {
                            tier: lane.tier,
                            key: lane.key,
                            replica: self.store.status(lane.key, now),
                            sequence: self.store.sequence(lane.key),
                        })
                        .collect(),
                })
            })
            .collect();
        out.sort_by(|a, b| a.dc.cmp(&b.dc).then_with(|| a.pool.cmp(&b.pool)));
        out
    }

    /// Every followed relay's catalog state, in [`ConsumerState::relays`] order.
    pub fn relay_statuses(&self) -> Vec<RelayStatus> {
        self.relays
            .iter()
            .zip(&self.relay_views)
            .enumerate()
            .map(|(idx, (relay, view))| RelayStatus {
                dc: relay.dc.clone(),
                addr: relay.addr.clone(),
                scored: self.scored[self.relay_dcs[idx]] == idx,
                catalog_revision: view.revision,
                incarnation: view.identity.map(|identity| identity.relay_incarnation),
                suspended: view.suspended,
                admitted_pools: view.pools.len(),
                quarantined_entries: view.quarantined.len(),
                stalled_pools: view.stalled,
                last_error: None,
                standbys: Vec::new(),
            })
            .collect()
    }

    /// Every quarantined entry, over all relays.
    pub fn quarantined(&self) -> Vec<QuarantinedEntry> {
        self.relay_views
            .iter()
            .flat_map(|view| view.quarantined.iter().cloned())
            .collect()
    }

    /// Fills the gauges of `out` at `now`.
    pub(crate) fn fill_gauges(&self, out: &mut ConsumerMetrics, now: Instant) {
        let mut max_age = Duration::ZERO;
        let mut max_lag = 0u64;
        for (idx, entry) in self.entries.iter().enumerate() {
            let (key, _) = self.answering(idx, now);
            match self.store.status(key, now) {
                ReplicaState::Current => {
                    out.replicas_current += 1;
                    let installed = self.store.sequence(key).unwrap_or(0);
                    let announced = self.store.announced(key).unwrap_or(installed);
                    max_lag = max_lag.max(announced.saturating_sub(installed));
                }
                ReplicaState::Assembling => out.replicas_assembling += 1,
                ReplicaState::Stale => out.replicas_stale += 1,
                ReplicaState::Missing => {}
            }
            if let Some(age) = self.store.age(key, now) {
                max_age = max_age.max(age);
            }
            if !entry.coverage.is_complete() {
                out.pools_incomplete += 1;
            }
        }
        // Hot standbys' replicas: what a switch of the scored relay would score at once.
        out.standby_replicas_current = self
            .relay_views
            .iter()
            .enumerate()
            .filter(|(relay, view)| {
                self.scored[self.relay_dcs[*relay]] != *relay && !view.suspended
            })
            .flat_map(|(_, view)| view.pools.values())
            .filter(|entry| self.store.status(entry.key, now) == ReplicaState::Current)
            .count() as u64;
        out.query_table_bytes = self.store.table_bytes();
        out.query_table_huge_page_advised_bytes = self.store.huge_page_advised_bytes();
        out.max_replica_age = max_age;
        out.max_replica_sequence_lag = max_lag;
        out.quarantined_entries = self
            .relay_views
            .iter()
            .map(|view| view.quarantined.len() as u64)
            .sum();
    }

    /// A new replica key for `producer` of relay `relay`, announced in `change` (subscribe
    /// to it).
    fn new_key(
        &mut self,
        relay: usize,
        producer: ProducerIdentity,
        change: &mut CatalogChange,
    ) -> PoolKey {
        let key = PoolKey(self.next_key);
        self.next_key += 1;
        self.producers.insert(key, (relay, producer));
        change.added.push((key, producer));
        key
    }

    fn forget(&mut self, key: PoolKey) {
        self.store.remove(key);
        self.loads.remove(&key);
        self.producers.remove(&key);
    }

    /// Rebuilds the scored entries: the pools of each DC's scored relay (chosen first),
    /// unless its connection is broken.
    fn rebuild_entries(&mut self) {
        self.choose_scored();
        let mut entries: Vec<PoolEntry> = self
            .relay_views
            .iter()
            .enumerate()
            .filter(|(relay, view)| {
                !view.suspended && self.scored[self.relay_dcs[*relay]] == *relay
            })
            .flat_map(|(_, view)| view.pools.values().cloned())
            .collect();
        entries.sort_by(|a, b| {
            a.relay
                .cmp(&b.relay)
                .then_with(|| a.pool_label.cmp(&b.pool_label))
        });
        self.tie_ranks = scoring::tie_ranks(&entries, &self.dcs);
        self.alternates = self.hot_alternates(&entries);
        self.entries = entries;
    }

    /// Per scored entry, the same pool (same pool id, block size and hash format) at the
    /// fittest other unbroken relay of its DC, if any; empty when no DC has one, so a
    /// consumer without hot standbys pays nothing for this.
    fn hot_alternates(&self, entries: &[PoolEntry]) -> Vec<Option<PoolKey>> {
        let mut standby: HashMap<(usize, PoolId), (u8, &PoolEntry)> = HashMap::new();
        for (relay, view) in self.relay_views.iter().enumerate() {
            let dc = self.relay_dcs[relay];
            if self.scored[dc] == relay || view.suspended {
                continue;
            }
            let fitness = self.fitness(relay);
            for (producer, entry) in &view.pools {
                let slot = standby
                    .entry((dc, producer.pool_id))
                    .or_insert((fitness, entry));
                if fitness > slot.0 {
                    *slot = (fitness, entry);
                }
            }
        }
        if standby.is_empty() {
            return Vec::new();
        }
        entries
            .iter()
            .map(|entry| {
                let (_, alternate) = standby.get(&(self.relay_dcs[entry.relay], entry.pool_id))?;
                (alternate.block_size == entry.block_size
                    && alternate.hash_format == entry.hash_format)
                    .then_some(alternate.key)
            })
            .collect()
    }

    /// The replica that answers for scored entry `idx` at `now`: its own, or (hot
    /// standbys) the same pool's replica at another relay of its DC while its own is not
    /// current and that one is; `true` for the latter.
    fn answering(&self, idx: usize, now: Instant) -> (PoolKey, bool) {
        let own = self.entries[idx].key;
        match self.alternates.get(idx) {
            Some(Some(alternate))
                if self.store.status(own, now) != ReplicaState::Current
                    && self.store.status(*alternate, now) == ReplicaState::Current =>
            {
                (*alternate, true)
            }
            _ => (own, false),
        }
    }
}

/// Whether a repeated revision carries what was applied (ignoring assigned keys).
fn same_content(
    view: &RelayView,
    admitted: &[AdmittedPool],
    quarantined: &[QuarantinedEntry],
) -> bool {
    view.pools.len() == admitted.len()
        && view.quarantined == quarantined
        && admitted.iter().all(|pool| {
            view.pools.get(&pool.producer).is_some_and(|old| {
                // Keys are assigned on admission: compare lanes by everything else.
                let mut tier_lanes = pool.entry.tier_lanes.clone();
                for (lane, old_lane) in tier_lanes.iter_mut().zip(&old.tier_lanes) {
                    lane.key = old_lane.key;
                }
                PoolEntry {
                    key: old.key,
                    relay: old.relay,
                    tier_lanes,
                    ..pool.entry.clone()
                } == *old
            })
        })
}
