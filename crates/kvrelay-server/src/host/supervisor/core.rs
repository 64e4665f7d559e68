//! The supervision core: every decision of the host supervisor, with no runtime.
//!
//! Inputs (`handle_*`): a membership view, the configured engine sources, attach / retire /
//! fence outcomes, source states, pool health (the shell reads each actor's
//! `stalled_for` at its own `now`), catalog changes and load ticks. The core keeps no
//! clock and needs no runtime. Outputs: [`Command`]s from
//! [`SupervisionCore::poll_command`] (attach, retire, update in place, start / stop sources,
//! publish routes / catalog / topology / load) and the readiness facts of
//! [`SupervisionCore::facts`]. The async shell (`supervisor.rs`) executes commands,
//! running independent attaches and retirements concurrently.
//!
//! Rules kept here and nowhere else:
//! - an endpoint gets a pool when it is materializable and has an event source; a change
//!   of pool or query semantics retires the generation (withdraw first) and attaches a new
//!   one once the retirement finished; registrations, roles and capacity change in place;
//! - at most one attach or retirement is in flight per endpoint; endpoints never wait for
//!   each other;
//! - a source is not connected until its state says so (`Connecting` when started);
//! - a pool whose incoming events were mostly unroutable over the last
//!   `degraded_readings` health readings (stored blocks whose parent chain was never
//!   seen: the engine's history is lost, so the filter misses what it caches) is
//!   *degraded*: named by readiness with the share, counted, still advertised (what it
//!   holds is right, only incomplete) with its share in the catalog's coverage (rounded to
//!   10 %, so consumers see it and a drifting share does not re-send the catalog), until a
//!   window passes with less than half;
//! - a pool one of whose sources is still *joining* (its engine's history being replayed
//!   from the start: a relay start, a resume, a restarted engine) is *recovering*: named
//!   by readiness and in the catalog's coverage until every source has joined (a
//!   degraded pool is advertised as degraded);
//! - a pool whose filter, or one of its lanes (a format twin, a lower tier), held owned
//!   blocks it could not place (capacity omissions) at any reading of the last
//!   `degraded_readings` is *overfull*: counted and advertised with the largest omitted
//!   share of the window in the catalog's coverage (unless degraded), but still ready (it
//!   makes progress; the cards declared too little capacity);
//! - a pool whose actor holds pending events without progress for `stall_bound` is
//!   *stalled*: withheld from the advertised catalog and named by readiness until it
//!   makes progress again.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

use kvrelay_ckf::SourceId;
use kvrelay_identity::{DcId, EndpointId, KvQuerySemantics, PoolId, WorkerRole};
use kvrelay_ingest::SourceState;
use kvrelay_membership::{EndpointMembership, MembershipView, TopologySnapshot, TopologyState};
use kvrelay_pool::{AttachRequest, PoolCatalog, RetirementMode, WorkerCapacity};

use crate::config::SourceConfig;
use crate::host::wire;

/// Filter sizing when no worker declares its KV capacity, in blocks.
pub(crate) const DEFAULT_EXPECTED_UNIQUE_BLOCKS: u64 = 65_536;
/// Smallest filter sizing, in blocks.
pub(crate) const MIN_EXPECTED_UNIQUE_BLOCKS: u64 = 1_024;
/// Default per-rank capacity of a simulated source when its card declares none, in blocks.
const DEFAULT_SOURCE_CAPACITY: u64 = 4_096;

/// Fixed facts of one relay.
#[derive(Debug, Clone)]
pub(crate) struct CoreConfig {
    pub(crate) dc_id: DcId,
    /// Every discovered worker has a connected source (the trace workload).
    pub(crate) workload_sources: bool,
    /// A NATS server carries every endpoint's Dynamo KV events.
    pub(crate) nats: bool,
    /// Pending events without progress for this long make a pool stalled.
    pub(crate) stall_bound: Duration,
    /// Health readings a pool's unroutable share is judged over (at least 1).
    pub(crate) degraded_readings: usize,
    /// The lower-tier lanes every pool keeps.
    pub(crate) tiers: crate::config::TiersConfig,
    /// The format every pool's filter is built in (`[filters]`).
    pub(crate) filter_density: kvrelay_ckf::FilterDensity,
    /// The format of every pool's format twin, if pools have one (`[filters]`).
    pub(crate) twin_density: Option<kvrelay_ckf::FilterDensity>,
}

/// Identifies one event source.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum SourceKey {
    /// A vLLM/SGLang ZMQ source of one worker rank.
    Engine(SourceId),
    /// The Dynamo NATS subscription of one endpoint.
    Nats(EndpointId),
}

/// What the core asks the shell to do.
#[derive(Debug, Clone)]
pub(crate) enum Command {
    /// Attach a pool for `endpoint`; answer with `handle_attached` or
    /// `handle_attach_failed`.
    Attach {
        endpoint: EndpointId,
        request: Box<AttachRequest>,
    },
    /// Retire `endpoint`'s generation; answer with `handle_retired`.
    Retire {
        endpoint: EndpointId,
        generation: u64,
        mode: RetirementMode,
    },
    /// Update an attached generation in place.
    Update {
        endpoint: EndpointId,
        generation: u64,
        registrations: Option<Vec<kvrelay_identity::CanonicalModelRegistration>>,
        roles: Option<Vec<WorkerRole>>,
        capacity: Vec<WorkerCapacity>,
    },
    /// Start `endpoint`'s sources (engines and, when set, its NATS subscription).
    StartSources {
        endpoint: EndpointId,
        engines: Vec<SourceConfig>,
        nats: bool,
        semantics: KvQuerySemantics,
    },
    /// Stop every source of `endpoint`.
    StopSources { endpoint: EndpointId },
    /// Drop every block `sources` hold in `endpoint`'s generation: they left the endpoint
    /// (a worker's card gone, an advertised source gone) while the pool lives on.
    ClearSources {
        endpoint: EndpointId,
        generation: u64,
        sources: Vec<SourceId>,
    },
    /// Route each source's events to its pool generation.
    PublishRoutes(Vec<RoutePlan>),
    /// Advertise `catalog` without the `withheld` pools, with the `coverage` of each pool
    /// whose filter is known incomplete, under `revision`.
    PublishCatalog {
        catalog: PoolCatalog,
        withheld: BTreeSet<PoolId>,
        coverage: BTreeMap<PoolId, CoverageFact>,
        revision: u64,
    },
    /// Publish serving readiness.
    PublishTopology(TopologySnapshot),
    /// Publish load window `window_sequence`.
    PublishLoad { window_sequence: u64 },
}

/// Where one attached endpoint's sources route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RoutePlan {
    pub(crate) endpoint: EndpointId,
    pub(crate) pool: PoolId,
    pub(crate) generation: u64,
    pub(crate) block_size: u32,
    /// Every source of the endpoint with its per-rank capacity in blocks.
    pub(crate) sources: Vec<(SourceId, u64)>,
}

/// One pool's health as the shell read it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct HealthFact {
    pub(crate) pending_events: usize,
    pub(crate) stalled_for: Duration,
    /// Events applied since the generation started (cumulative).
    pub(crate) events_applied: u64,
    /// Stored events dropped as unroutable since the generation started (cumulative).
    pub(crate) unroutable_events: u64,
    /// The fill of the pool's filter or one of its lanes, whichever omits the largest
    /// share ([`FilterFill::fuller`]).
    pub(crate) fill: FilterFill,
}

/// How many of a filter's owned blocks it could not place.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct FilterFill {
    /// Canonical blocks owned by at least one source.
    pub(crate) owned_blocks: u64,
    /// Owned blocks the filter holds no fingerprint for (capacity omissions).
    pub(crate) omitted_blocks: u64,
}

impl FilterFill {
    /// A filter's fill from its owned and resident block counts.
    pub(crate) fn of(owned_blocks: u64, resident_blocks: u64) -> Self {
        Self {
            owned_blocks,
            omitted_blocks: owned_blocks.saturating_sub(resident_blocks),
        }
    }

    /// Whether the filter misses any owned block.
    pub(crate) fn is_overfull(self) -> bool {
        self.omitted_blocks > 0
    }

    /// Of two filters, the one omitting the larger share of its owned blocks (a pool is
    /// as incomplete as its least complete filter: a consumer may follow any of them).
    pub(crate) fn fuller(self, other: Self) -> Self {
        let share = |fill: Self, of: Self| {
            u128::from(fill.omitted_blocks) * u128::from(of.owned_blocks.max(1))
        };
        if share(other, self) > share(self, other) {
            other
        } else {
            self
        }
    }

    /// The omitted share in percent, rounded to the nearest multiple of 10.
    pub(crate) fn omitted_percent_rounded(self) -> u8 {
        percent_rounded_to_ten(self.omitted_blocks, self.owned_blocks)
    }
}

/// `part` of `whole` in percent, rounded to the nearest multiple of 10 (so a drifting
/// share does not re-send the catalog); 100 at most.
fn percent_rounded_to_ten(part: u64, whole: u64) -> u8 {
    // In u128: `part × 10` must not saturate for counts near u64::MAX.
    let whole = u128::from(whole.max(1));
    let tenths = (u128::from(part).min(whole) * 10 + whole / 2) / whole;
    u8::try_from(tenths * 10).unwrap_or(100)
}

/// One health reading as the history keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct HealthReading {
    events_applied: u64,
    unroutable_events: u64,
    fill: FilterFill,
}

/// Over the last window of readings: events dropped as unroutable, and all events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Degraded {
    pub(crate) unroutable_events: u64,
    pub(crate) events: u64,
}

impl Degraded {
    /// The unroutable share in percent, rounded to the nearest multiple of 10.
    pub(crate) fn unroutable_percent_rounded(self) -> u8 {
        percent_rounded_to_ten(self.unroutable_events, self.events)
    }
}

/// What the catalog says of a pool whose filter is known incomplete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CoverageFact {
    /// Most of its recent events were unroutable; the share in percent, rounded to a
    /// multiple of 10.
    Degraded { unroutable_percent: u8 },
    /// A source is still joining: its engine's history is being replayed.
    Recovering,
    /// Its filter (or a lane's) could not place some owned blocks; the largest omitted
    /// share of the window in percent, rounded to a multiple of 10.
    Overfull { omitted_percent: u8 },
}

/// Readiness and per-pool facts, for admin and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct HostFacts {
    /// Why the relay is not ready (empty: ready).
    pub(crate) unready: Vec<String>,
    /// Attached pools by pool key.
    pub(crate) pools: BTreeMap<String, PoolFacts>,
    /// Sources by state, over every running source.
    pub(crate) sources: BTreeMap<&'static str, usize>,
    /// Whether an attach or retirement is still in flight.
    pub(crate) settling: bool,
}

/// One attached pool's facts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PoolFacts {
    pub(crate) endpoint: EndpointId,
    pub(crate) pool: PoolId,
    pub(crate) generation: u64,
    /// Sources by state (workload sources count as connected).
    pub(crate) sources: BTreeMap<&'static str, usize>,
    /// Whether the pool is withheld from the catalog as stalled.
    pub(crate) stalled: bool,
    /// Set while most of its recent events were unroutable.
    pub(crate) degraded: Option<Degraded>,
    /// Set while a reading of the window found owned blocks its filter (or a lane's)
    /// could not place: the fill with the largest omitted share.
    pub(crate) overfull: Option<FilterFill>,
}

impl PoolFacts {
    /// Sources whose events flow (connected, replaying or joining).
    pub(crate) fn delivering_sources(&self) -> usize {
        delivering_sources(&self.sources)
    }

    /// Sources still joining (their engines' history being replayed from the start).
    pub(crate) fn joining_sources(&self) -> usize {
        joining_sources(&self.sources)
    }
}

fn delivering_sources(sources: &BTreeMap<&'static str, usize>) -> usize {
    SourceState::ALL
        .iter()
        .filter(|state| state.delivers())
        .map(|state| sources.get(state.as_str()).copied().unwrap_or(0))
        .sum()
}

fn joining_sources(sources: &BTreeMap<&'static str, usize>) -> usize {
    sources
        .get(SourceState::Joining.as_str())
        .copied()
        .unwrap_or(0)
}

/// What makes a generation: a change here builds a new generation.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Binding {
    pool: PoolId,
    query_semantics: KvQuerySemantics,
}

#[derive(Debug)]
#[allow(
    clippy::large_enum_variant,
    reason = "one slot per endpoint, moved rarely; boxing buys nothing measurable"
)]
enum Slot {
    Attaching {
        binding: Binding,
    },
    Attached {
        binding: Binding,
        generation: u64,
        membership: EndpointMembership,
    },
    Retiring,
    /// The attach failed (e.g. `max_pools` reached). Not tried again until something that
    /// could change the answer happens: a membership or source change, or a retirement
    /// (which frees a pool). Without this every reconcile, including the one after each
    /// other endpoint's attach, retried, logged and counted every refused endpoint.
    Refused,
}

/// The supervisor's state and decisions.
#[derive(Debug)]
pub(crate) struct SupervisionCore {
    config: CoreConfig,
    view: Option<MembershipView>,
    configured: BTreeMap<EndpointId, Vec<SourceConfig>>,
    slots: BTreeMap<EndpointId, Slot>,
    /// Sources started per endpoint, with their last state.
    running: BTreeMap<EndpointId, BTreeMap<SourceKey, SourceState>>,
    /// The sources each attached generation was last routed (cards' ranks plus configured
    /// and advertised engines), to notice the ones that leave.
    pool_sources: BTreeMap<EndpointId, (u64, BTreeSet<SourceId>)>,
    stalled: BTreeSet<PoolId>,
    /// Per attached pool and generation: its last `degraded_readings + 1` readings
    /// (cumulative applied and unroutable event counts, filter fill), oldest first.
    event_history: BTreeMap<(PoolId, u64), VecDeque<HealthReading>>,
    /// The advertised coverage of pools known incomplete (degraded, recovering, overfull).
    coverage: BTreeMap<PoolId, CoverageFact>,
    /// Times the withheld set or the coverage changed: added to the registry revision so
    /// the advertised catalog's revision moves whenever its content does.
    advertised_changes: u64,
    catalog: Option<PoolCatalog>,
    topology: Option<TopologyState>,
    topology_published: bool,
    window_sequence: u64,
    shutting_down: bool,
    commands: VecDeque<Command>,
}

impl SupervisionCore {
    pub(crate) fn new(
        config: CoreConfig,
        configured: BTreeMap<EndpointId, Vec<SourceConfig>>,
    ) -> Self {
        Self {
            config,
            view: None,
            configured,
            slots: BTreeMap::new(),
            running: BTreeMap::new(),
            pool_sources: BTreeMap::new(),
            stalled: BTreeSet::new(),
            event_history: BTreeMap::new(),
            coverage: BTreeMap::new(),
            advertised_changes: 0,
            catalog: None,
            topology: None,
            topology_published: false,
            window_sequence: 0,
            shutting_down: false,
            commands: VecDeque::new(),
        }
    }

    /// The next command, oldest first.
    pub(crate) fn poll_command(&mut self) -> Option<Command> {
        self.commands.pop_front()
    }

    /// A new membership view (discovery listed or changed).
    pub(crate) fn handle_membership(&mut self, view: MembershipView) {
        self.view = Some(view);
        self.clear_refused();
        self.reconcile();
    }

    /// The engine sources per endpoint changed (`[[sources]]` plus adverts). Sources of
    /// touched endpoints restart.
    pub(crate) fn handle_configured_sources(
        &mut self,
        next: BTreeMap<EndpointId, Vec<SourceConfig>>,
    ) {
        let touched: Vec<EndpointId> = self
            .configured
            .keys()
            .chain(next.keys())
            .filter(|endpoint| self.configured.get(*endpoint) != next.get(*endpoint))
            .cloned()
            .collect();
        self.configured = next;
        for endpoint in &touched {
            self.stop_sources(endpoint);
        }
        self.clear_refused();
        self.reconcile();
    }

    /// The attach of `endpoint` succeeded with `generation`.
    pub(crate) fn handle_attached(&mut self, endpoint: &EndpointId, generation: u64) {
        let Some(Slot::Attaching { binding }) = self.slots.remove(endpoint) else {
            // Not asked for (cannot happen); retire what we did not expect.
            self.commands.push_back(Command::Retire {
                endpoint: endpoint.clone(),
                generation,
                mode: RetirementMode::Graceful,
            });
            return;
        };
        let membership = self
            .view
            .as_ref()
            .and_then(|view| view.endpoint(endpoint))
            .cloned()
            .filter(|_| !self.shutting_down);
        match membership {
            Some(membership) => {
                self.slots.insert(
                    endpoint.clone(),
                    Slot::Attached {
                        binding,
                        generation,
                        membership,
                    },
                );
            }
            None => {
                // The endpoint left (or the relay began shutting down) while attaching.
                self.slots.insert(endpoint.clone(), Slot::Retiring);
                self.commands.push_back(Command::Retire {
                    endpoint: endpoint.clone(),
                    generation,
                    mode: RetirementMode::Graceful,
                });
            }
        }
        self.reconcile();
    }

    /// The attach of `endpoint` failed; it is tried again after the next membership or
    /// source change or retirement, not on every reconcile.
    pub(crate) fn handle_attach_failed(&mut self, endpoint: &EndpointId) {
        if matches!(self.slots.get(endpoint), Some(Slot::Attaching { .. })) {
            self.slots.insert(endpoint.clone(), Slot::Refused);
        }
        self.publish_routes();
    }

    /// Refused endpoints become candidates again (something that could change the answer
    /// happened).
    fn clear_refused(&mut self) {
        self.slots.retain(|_, slot| !matches!(slot, Slot::Refused));
    }

    /// The retirement of `endpoint`'s generation finished.
    pub(crate) fn handle_retired(&mut self, endpoint: &EndpointId) {
        if matches!(self.slots.get(endpoint), Some(Slot::Retiring)) {
            self.slots.remove(endpoint);
        }
        // A pool was freed: a refused attach may fit now.
        self.clear_refused();
        self.reconcile();
    }

    /// `endpoint`'s generation was fenced (terminal failure): retire it and rebuild.
    pub(crate) fn handle_fenced(&mut self, endpoint: &EndpointId, generation: u64) {
        if let Some(Slot::Attached {
            generation: current,
            ..
        }) = self.slots.get(endpoint)
            && *current == generation
        {
            self.slots.insert(endpoint.clone(), Slot::Retiring);
            self.commands.push_back(Command::Retire {
                endpoint: endpoint.clone(),
                generation,
                mode: RetirementMode::Fenced,
            });
            self.publish_routes();
        }
    }

    /// A source reported `state`. Ignored for sources that are not running.
    pub(crate) fn handle_source_state(&mut self, key: &SourceKey, state: SourceState) {
        let mut changed = false;
        for sources in self.running.values_mut() {
            if let Some(current) = sources.get_mut(key)
                && *current != state
            {
                *current = state;
                changed = true;
            }
        }
        if changed {
            self.update_topology();
            self.refresh_coverage();
        }
    }

    /// The registry's catalog changed.
    pub(crate) fn handle_catalog(&mut self, catalog: PoolCatalog) {
        self.catalog = Some(catalog);
        self.publish_catalog();
        self.update_topology();
    }

    /// One health reading per attached pool, by endpoint and generation. Pools not read
    /// (retiring, attaching) keep their previous stall state.
    pub(crate) fn handle_pool_health(&mut self, readings: &[(EndpointId, u64, HealthFact)]) {
        let mut next = self.stalled.clone();
        for (endpoint, generation, fact) in readings {
            let Some(Slot::Attached {
                binding,
                generation: current,
                ..
            }) = self.slots.get(endpoint)
            else {
                continue;
            };
            if current != generation {
                continue;
            }
            let history = self
                .event_history
                .entry((binding.pool, *generation))
                .or_default();
            history.push_back(HealthReading {
                events_applied: fact.events_applied,
                unroutable_events: fact.unroutable_events,
                fill: fact.fill,
            });
            while history.len() > self.config.degraded_readings.max(1) + 1 {
                history.pop_front();
            }
            if fact.pending_events > 0 && fact.stalled_for >= self.config.stall_bound {
                next.insert(binding.pool);
            } else {
                next.remove(&binding.pool);
            }
        }
        let coverage = self.coverage_facts();
        self.replace_advertised(next, coverage);
    }

    /// The load window ticked.
    pub(crate) fn handle_load_tick(&mut self) {
        self.window_sequence += 1;
        self.commands.push_back(Command::PublishLoad {
            window_sequence: self.window_sequence,
        });
    }

    /// Shutdown: stop every source and retire every attached generation (fenced).
    pub(crate) fn handle_shutdown(&mut self) {
        self.shutting_down = true;
        let endpoints: Vec<EndpointId> = self.running.keys().cloned().collect();
        for endpoint in &endpoints {
            self.stop_sources(endpoint);
        }
        let attached: Vec<(EndpointId, u64)> = self
            .slots
            .iter()
            .filter_map(|(endpoint, slot)| match slot {
                Slot::Attached { generation, .. } => Some((endpoint.clone(), *generation)),
                Slot::Attaching { .. } | Slot::Retiring | Slot::Refused => None,
            })
            .collect();
        for (endpoint, generation) in attached {
            self.slots.insert(endpoint.clone(), Slot::Retiring);
            self.commands.push_back(Command::Retire {
                endpoint,
                generation,
                mode: RetirementMode::Fenced,
            });
        }
        self.publish_routes();
    }

    /// Whether an attach or retirement is still in flight.
    pub(crate) fn is_settling(&self) -> bool {
        self.slots
            .values()
            .any(|slot| matches!(slot, Slot::Attaching { .. } | Slot::Retiring))
    }

    /// Readiness and per-pool facts now.
    pub(crate) fn facts(&self) -> HostFacts {
        let mut facts = HostFacts {
            settling: self.view.is_none() || self.is_settling(),
            ..HostFacts::default()
        };
        if self.view.is_none() {
            facts
                .unready
                .push("discovery has not listed yet".to_owned());
        }
        for sources in self.running.values() {
            for state in sources.values() {
                *facts.sources.entry(state.as_str()).or_default() += 1;
            }
        }
        for (endpoint, binding, generation, membership) in self.attached() {
            let key = wire::pool_key(&binding.pool);
            let sources = self.pool_source_states(endpoint, membership);
            let stalled = self.stalled.contains(&binding.pool);
            let degraded = self.degraded(binding.pool, generation);
            let joining = joining_sources(&sources);
            if delivering_sources(&sources) == 0 {
                let states: Vec<String> = sources
                    .iter()
                    .map(|(state, n)| format!("{n} {state}"))
                    .collect();
                facts.unready.push(format!(
                    "pool {key} ({}) has no connected source ({})",
                    endpoint.dotted(),
                    if states.is_empty() {
                        "none started".to_owned()
                    } else {
                        states.join(", ")
                    }
                ));
            }
            if stalled {
                facts.unready.push(format!(
                    "pool {key} ({}) is stalled: pending events made no progress for {} ms; withheld from the catalog",
                    endpoint.dotted(),
                    self.config.stall_bound.as_millis()
                ));
            }
            if joining > 0 && degraded.is_none() {
                facts.unready.push(format!(
                    "pool {key} ({}) is recovering: {joining} of its sources are still joining (their engines' history is being replayed; the filter misses what it has not reached yet)",
                    endpoint.dotted(),
                ));
            }
            if let Some(degraded) = degraded {
                facts.unready.push(format!(
                    "pool {key} ({}) is degraded: {} of its last {} events were unroutable (stored blocks whose parents were never seen: the engine's history is lost and the filter misses what it caches)",
                    endpoint.dotted(),
                    degraded.unroutable_events,
                    degraded.events,
                ));
            }
            facts.pools.insert(
                key,
                PoolFacts {
                    endpoint: endpoint.clone(),
                    pool: binding.pool,
                    generation,
                    sources,
                    stalled,
                    degraded,
                    overfull: self.overfull(binding.pool, generation),
                },
            );
        }
        facts
    }

    fn pool_source_states(
        &self,
        endpoint: &EndpointId,
        membership: &EndpointMembership,
    ) -> BTreeMap<&'static str, usize> {
        let mut states = BTreeMap::new();
        if self.config.workload_sources {
            let n = sources_of(membership, None).len();
            if n > 0 {
                states.insert(SourceState::Connected.as_str(), n);
            }
        }
        for state in self
            .running
            .get(endpoint)
            .into_iter()
            .flat_map(|s| s.values())
        {
            *states.entry(state.as_str()).or_default() += 1;
        }
        states
    }

    fn reconcile(&mut self) {
        if self.shutting_down {
            return;
        }
        let Some(view) = self.view.clone() else {
            return;
        };
        let mut desired: BTreeMap<EndpointId, (Binding, &EndpointMembership)> = BTreeMap::new();
        for membership in view.endpoints() {
            if let Some(binding) = self.binding_of(membership) {
                desired.insert(membership.endpoint.clone(), (binding, membership));
            }
        }
        // Retire what is no longer wanted or whose binding changed; update the rest in place.
        let endpoints: Vec<EndpointId> = self.slots.keys().cloned().collect();
        for endpoint in endpoints {
            let wanted = desired.get(&endpoint);
            if matches!(self.slots.get(&endpoint), Some(Slot::Refused)) {
                if wanted.is_none() {
                    self.slots.remove(&endpoint);
                }
                continue;
            }
            let Some(Slot::Attached {
                binding,
                generation,
                membership,
            }) = self.slots.get_mut(&endpoint)
            else {
                continue;
            };
            match wanted {
                Some((wanted, next)) if wanted == binding => {
                    if !membership.same_content(next) {
                        let registrations = (membership.registrations != next.registrations)
                            .then(|| next.registrations.clone());
                        let roles = (membership.roles != next.roles).then(|| roles_of(next));
                        self.commands.push_back(Command::Update {
                            endpoint: endpoint.clone(),
                            generation: *generation,
                            registrations,
                            roles,
                            capacity: capacities(next),
                        });
                        *membership = (*next).clone();
                    }
                }
                _ => {
                    let generation = *generation;
                    self.slots.insert(endpoint.clone(), Slot::Retiring);
                    self.stop_sources(&endpoint);
                    self.commands.push_back(Command::Retire {
                        endpoint,
                        generation,
                        mode: RetirementMode::Graceful,
                    });
                }
            }
        }
        // Attach what is wanted and has no slot.
        for (endpoint, (binding, membership)) in &desired {
            if self.slots.contains_key(endpoint) {
                continue;
            }
            let request = AttachRequest {
                pool: binding.pool,
                endpoint: endpoint.clone(),
                registrations: membership.registrations.clone(),
                query_semantics: binding.query_semantics,
                roles: roles_of(membership),
                expected_unique_blocks: expected_unique_blocks(membership),
                filter_density: self.config.filter_density,
                load_capacity: Some(capacities(membership)),
                tier_lanes: pool_lanes(&self.config, binding, membership),
            };
            self.slots.insert(
                endpoint.clone(),
                Slot::Attaching {
                    binding: binding.clone(),
                },
            );
            self.commands.push_back(Command::Attach {
                endpoint: endpoint.clone(),
                request: Box::new(request),
            });
        }
        // Start the sources of attached endpoints whose sources are not running.
        let mut starts = Vec::new();
        for (endpoint, slot) in &self.slots {
            let Slot::Attached { binding, .. } = slot else {
                continue;
            };
            if self.running.contains_key(endpoint) {
                continue;
            }
            let engines = self.configured.get(endpoint).cloned().unwrap_or_default();
            if engines.is_empty() && !self.config.nats {
                continue;
            }
            starts.push((endpoint.clone(), engines, binding.query_semantics));
        }
        for (endpoint, engines, semantics) in starts {
            let mut states = BTreeMap::new();
            for engine in &engines {
                states.insert(
                    SourceKey::Engine(SourceId::new(engine.worker_id, engine.dp_rank)),
                    SourceState::Connecting,
                );
            }
            if self.config.nats {
                states.insert(SourceKey::Nats(endpoint.clone()), SourceState::Connecting);
            }
            self.running.insert(endpoint.clone(), states);
            self.commands.push_back(Command::StartSources {
                endpoint,
                engines,
                nats: self.config.nats,
                semantics,
            });
        }
        self.publish_routes();
        // A retired pool is no longer stalled, and its event history goes with it.
        let live: BTreeSet<PoolId> = self.attached_pools().collect();
        self.event_history
            .retain(|(pool, _), _| live.contains(pool));
        let next: BTreeSet<PoolId> = self.stalled.intersection(&live).copied().collect();
        let coverage = self.coverage_facts();
        self.replace_advertised(next, coverage);
        self.update_topology();
    }

    /// Whether `pool`'s generation had mostly unroutable events over its reading window:
    /// at least one unroutable event and no more applied than unroutable ones.
    fn degraded(&self, pool: PoolId, generation: u64) -> Option<Degraded> {
        let history = self.event_history.get(&(pool, generation))?;
        let (first, last) = (history.front()?, history.back()?);
        let applied = last.events_applied.saturating_sub(first.events_applied);
        let unroutable = last
            .unroutable_events
            .saturating_sub(first.unroutable_events);
        (unroutable > 0 && unroutable >= applied).then_some(Degraded {
            unroutable_events: unroutable,
            events: applied.saturating_add(unroutable),
        })
    }

    /// Whether `pool`'s generation had owned blocks a filter could not place at any
    /// reading of its window: the fill with the largest omitted share.
    fn overfull(&self, pool: PoolId, generation: u64) -> Option<FilterFill> {
        let history = self.event_history.get(&(pool, generation))?;
        history
            .iter()
            .map(|reading| reading.fill)
            .filter(|fill| fill.is_overfull())
            .reduce(FilterFill::fuller)
    }

    /// The coverage the catalog advertises now, for every attached generation known
    /// incomplete: degraded (with its unroutable share), else overfull (with its omitted
    /// share), else recovering while a source joins.
    fn coverage_facts(&self) -> BTreeMap<PoolId, CoverageFact> {
        self.attached()
            .filter_map(|(endpoint, binding, generation, membership)| {
                let fact = match (
                    self.degraded(binding.pool, generation),
                    self.overfull(binding.pool, generation),
                ) {
                    (Some(degraded), _) => CoverageFact::Degraded {
                        unroutable_percent: degraded.unroutable_percent_rounded(),
                    },
                    (None, Some(fill)) => CoverageFact::Overfull {
                        omitted_percent: fill.omitted_percent_rounded(),
                    },
                    (None, None)
                        if joining_sources(&self.pool_source_states(endpoint, membership)) > 0 =>
                    {
                        CoverageFact::Recovering
                    }
                    (None, None) => return None,
                };
                Some((binding.pool, fact))
            })
            .collect()
    }

    /// Re-advertises the catalog if a pool's coverage changed.
    fn refresh_coverage(&mut self) {
        let coverage = self.coverage_facts();
        self.replace_advertised(self.stalled.clone(), coverage);
    }

    /// Every attached generation: its endpoint, binding, generation and membership.
    fn attached(
        &self,
    ) -> impl Iterator<Item = (&EndpointId, &Binding, u64, &EndpointMembership)> + '_ {
        self.slots.iter().filter_map(|(endpoint, slot)| match slot {
            Slot::Attached {
                binding,
                generation,
                membership,
            } => Some((endpoint, binding, *generation, membership)),
            Slot::Attaching { .. } | Slot::Retiring | Slot::Refused => None,
        })
    }

    fn attached_pools(&self) -> impl Iterator<Item = PoolId> + '_ {
        self.attached().map(|(_, binding, _, _)| binding.pool)
    }

    /// A source that left an attached generation's routes (its worker's card gone, its
    /// advert or `[[sources]]` entry gone) still owns blocks in the pool: without this they
    /// would attract requests to a DC that no longer holds them, for as long as the pool
    /// lives. Compared with the routes published before; a source kept by configuration
    /// while its card is gone stays routed, so it stays (configuration wins).
    /// Returns the `ClearSources` commands and remembers `plans`' sources.
    fn departed_sources(&mut self, plans: &[RoutePlan]) -> Vec<Command> {
        let current: BTreeMap<EndpointId, (u64, BTreeSet<SourceId>)> = plans
            .iter()
            .map(|plan| {
                let sources = plan.sources.iter().map(|(source, _)| *source).collect();
                (plan.endpoint.clone(), (plan.generation, sources))
            })
            .collect();
        let mut clears = Vec::new();
        for (endpoint, (generation, sources)) in &current {
            let Some((before_generation, before)) = self.pool_sources.get(endpoint) else {
                continue;
            };
            if before_generation != generation {
                continue;
            }
            let departed: Vec<SourceId> = before.difference(sources).copied().collect();
            if !departed.is_empty() {
                clears.push(Command::ClearSources {
                    endpoint: endpoint.clone(),
                    generation: *generation,
                    sources: departed,
                });
            }
        }
        self.pool_sources = current;
        clears
    }

    fn stop_sources(&mut self, endpoint: &EndpointId) {
        if self.running.remove(endpoint).is_some() {
            self.commands.push_back(Command::StopSources {
                endpoint: endpoint.clone(),
            });
        }
    }

    fn replace_advertised(
        &mut self,
        stalled: BTreeSet<PoolId>,
        coverage: BTreeMap<PoolId, CoverageFact>,
    ) {
        if stalled != self.stalled || coverage != self.coverage {
            self.stalled = stalled;
            self.coverage = coverage;
            self.advertised_changes += 1;
            self.publish_catalog();
        }
    }

    fn publish_catalog(&mut self) {
        let Some(catalog) = &self.catalog else {
            return;
        };
        self.commands.push_back(Command::PublishCatalog {
            catalog: catalog.clone(),
            withheld: self.stalled.clone(),
            coverage: self.coverage.clone(),
            revision: catalog.revision().saturating_add(self.advertised_changes),
        });
    }

    fn publish_routes(&mut self) {
        let plans = self
            .attached()
            .map(|(endpoint, binding, generation, membership)| RoutePlan {
                endpoint: endpoint.clone(),
                pool: binding.pool,
                generation,
                block_size: binding.query_semantics.kv_block_size(),
                sources: sources_of(membership, self.configured.get(endpoint)),
            })
            .collect::<Vec<_>>();
        let clears = self.departed_sources(&plans);
        // Routes first: a departed source's late events are dropped, then its blocks go.
        self.commands.push_back(Command::PublishRoutes(plans));
        self.commands.extend(clears);
    }

    /// Feeds membership, liveness (workers with a source that delivers, owned by the
    /// attached generation) and pool links into the topology; publishes on change.
    fn update_topology(&mut self) {
        let Some(view) = &self.view else {
            return;
        };
        let topology = self
            .topology
            .get_or_insert_with(|| TopologyState::new(view.clone()));
        let mut changed = topology.replace_membership(view.clone());
        for (endpoint, slot) in &self.slots {
            let Slot::Attached {
                generation,
                membership,
                ..
            } = slot
            else {
                continue;
            };
            changed |= topology.claim_availability(endpoint, *generation);
            let live = live_workers(
                &self.config,
                membership,
                self.configured.get(endpoint),
                self.running.get(endpoint),
            );
            changed |= topology.replace_availability(endpoint, *generation, Some(live));
        }
        if let Some(catalog) = &self.catalog {
            changed |= topology.replace_pool_links(
                catalog
                    .pools()
                    .map(|pool| (pool.serving_endpoint.clone(), pool.pool_id())),
            );
        }
        if changed || !self.topology_published {
            self.topology_published = true;
            self.commands
                .push_back(Command::PublishTopology(topology.snapshot()));
        }
    }

    fn binding_of(&self, membership: &EndpointMembership) -> Option<Binding> {
        if !membership.is_materializable() {
            return None;
        }
        let has_source = (self.config.workload_sources || self.config.nats)
            && !membership.worker_topology.is_empty()
            || self.configured.contains_key(&membership.endpoint);
        if !has_source {
            return None;
        }
        let domain = membership.domain?;
        Some(Binding {
            pool: PoolId {
                indexer_domain: domain.id,
                dc_id: self.config.dc_id,
            },
            query_semantics: domain.query_semantics,
        })
    }
}

/// Workers with a source that delivers events: all of them under the trace workload or a
/// delivering NATS subscription, else those with a delivering engine source.
fn live_workers(
    config: &CoreConfig,
    membership: &EndpointMembership,
    configured: Option<&Vec<SourceConfig>>,
    running: Option<&BTreeMap<SourceKey, SourceState>>,
) -> BTreeSet<u64> {
    let all = || {
        sources_of(membership, configured)
            .into_iter()
            .map(|(source, _)| source.worker_id)
            .collect()
    };
    if config.workload_sources {
        return all();
    }
    let Some(running) = running else {
        return BTreeSet::new();
    };
    let nats_delivers = running
        .iter()
        .any(|(key, state)| matches!(key, SourceKey::Nats(_)) && state.delivers());
    if nats_delivers {
        return all();
    }
    running
        .iter()
        .filter_map(|(key, state)| match key {
            SourceKey::Engine(source) if state.delivers() => Some(source.worker_id),
            SourceKey::Engine(_) | SourceKey::Nats(_) => None,
        })
        .collect()
}

pub(crate) fn roles_of(membership: &EndpointMembership) -> Vec<WorkerRole> {
    if membership.roles.is_empty() {
        vec![WorkerRole::Aggregated]
    } else {
        membership.roles.clone()
    }
}

/// Per-rank capacity in blocks, by worker, from the runtime configs.
pub(crate) fn capacities(membership: &EndpointMembership) -> Vec<WorkerCapacity> {
    membership
        .runtime_configs
        .iter()
        .map(|(worker_id, config)| WorkerCapacity {
            worker_id: *worker_id,
            data_parallel_start_rank: config.data_parallel_start_rank,
            data_parallel_size: config.data_parallel_size.max(1),
            total_kv_blocks: config.total_kv_blocks,
        })
        .collect()
}

/// The lanes a pool is attached with: its lower tiers (`[tiers]`), then its format twin
/// if `[filters]` asks for one (sized like the pool, in the twin's format).
fn pool_lanes(
    config: &CoreConfig,
    binding: &Binding,
    membership: &EndpointMembership,
) -> Vec<kvrelay_pool::LaneRequest> {
    let block_size = binding.query_semantics.kv_block_size();
    let expected = expected_unique_blocks(membership);
    let mut lanes = config.tiers.lanes(block_size, expected);
    if let Some(density) = config.twin_density {
        lanes.push(kvrelay_pool::LaneRequest::format_twin(
            block_size, expected, density,
        ));
    }
    lanes
}

pub(crate) fn expected_unique_blocks(membership: &EndpointMembership) -> u64 {
    let declared: u64 = membership
        .runtime_configs
        .values()
        .filter_map(|config| {
            config
                .total_kv_blocks
                .map(|blocks| blocks.saturating_mul(u64::from(config.data_parallel_size.max(1))))
        })
        .fold(0u64, u64::saturating_add);
    if declared == 0 {
        DEFAULT_EXPECTED_UNIQUE_BLOCKS
    } else {
        declared.max(MIN_EXPECTED_UNIQUE_BLOCKS)
    }
}

/// The sources of an endpoint with their per-rank capacity: every (worker, rank) of its
/// cards, plus statically configured ones.
pub(crate) fn sources_of(
    membership: &EndpointMembership,
    configured: Option<&Vec<SourceConfig>>,
) -> Vec<(SourceId, u64)> {
    let mut sources = BTreeMap::new();
    for (worker_id, config) in &membership.runtime_configs {
        let capacity = config.total_kv_blocks.unwrap_or(DEFAULT_SOURCE_CAPACITY);
        for offset in 0..config.data_parallel_size.max(1) {
            let rank = config.data_parallel_start_rank.saturating_add(offset);
            sources.insert(SourceId::new(*worker_id, rank), capacity);
        }
    }
    for source in configured.into_iter().flatten() {
        sources
            .entry(SourceId::new(source.worker_id, source.dp_rank))
            .or_insert(DEFAULT_SOURCE_CAPACITY);
    }
    sources.into_iter().collect()
}

#[cfg(test)]
mod tests;
