//! The host supervisor: the one owner of pool attachments.
//!
//! It turns each membership view into attached pool generations (attach when an endpoint is
//! materializable and has a connected source, update registrations/roles/capacity in
//! place, withdraw first and then retire when that stops holding or the binding changes),
//! republishes the catalog, load windows and topology in wire form, refreshes per-pool stats
//! for admin and metrics, and on shutdown retires every generation before the registry
//! shuts down.
//!
//! Run loop branches (one `biased` select): shutdown; a new membership view; a catalog
//! change; a load change; the load-window tick; a fenced generation (rebuilt on the next
//! reconcile).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use futures::future::select_all;
use kvrelay_ckf::SourceId;
use kvrelay_identity::{DcId, EndpointId, KvQuerySemantics, PoolId, WorkerRole};
use kvrelay_membership::{EndpointMembership, MembershipView, TopologyState};
use kvrelay_pool::{
    AttachRequest, PoolActorHandle, PoolAttachment, PoolRegistry, RetirementMode, WorkerCapacity,
};
use tokio::sync::watch;
use tokio::time::{Instant, MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::config::SourceConfig;
use crate::host::state::{HostState, PoolStatus, Route, Routes};
use crate::host::wire;
use crate::host::{pump, scrape};

/// Filter sizing when no worker declares its KV capacity, in blocks.
pub(crate) const DEFAULT_EXPECTED_UNIQUE_BLOCKS: u64 = 65_536;
/// Smallest filter sizing, in blocks.
pub(crate) const MIN_EXPECTED_UNIQUE_BLOCKS: u64 = 1_024;

/// What makes a generation: a change here builds a new generation.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Binding {
    pool: PoolId,
    query_semantics: KvQuerySemantics,
}

struct Attached {
    binding: Binding,
    attachment: PoolAttachment,
    endpoint: EndpointMembership,
}

pub(crate) struct Supervisor {
    pub(crate) registry: PoolRegistry,
    pub(crate) state: Arc<HostState>,
    pub(crate) dc_id: DcId,
    /// Whether every discovered worker has a connected source (the trace workload).
    pub(crate) workload_sources: bool,
    /// Endpoints with engine sources (`[[sources]]` plus discovered adverts), current value.
    pub(crate) configured_sources: BTreeMap<EndpointId, Vec<SourceConfig>>,
    /// Updates of `configured_sources` (closed at once when nothing discovers sources).
    pub(crate) source_updates: watch::Receiver<BTreeMap<EndpointId, Vec<SourceConfig>>>,
    /// The NATS server carrying every endpoint's Dynamo KV events, if any.
    pub(crate) nats_server: Option<crate::config::NatsConfig>,
    pub(crate) views: watch::Receiver<Option<MembershipView>>,
    pub(crate) cancel: CancellationToken,
}

impl Supervisor {
    pub(crate) async fn run(mut self) {
        let mut attached: BTreeMap<EndpointId, Attached> = BTreeMap::new();
        let mut pumps = Pumps::default();
        let mut catalog = self.registry.watch_catalog();
        let mut load = self.registry.watch_load();
        let window = self.state.limits.load_window();
        let mut ticker = tokio::time::interval_at(Instant::now() + window, window);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut window_sequence = 0u64;
        let mut topology: Option<TopologyState> = None;
        self.publish_catalog(&catalog.borrow_and_update().clone());
        let mut sources_open = true;
        loop {
            let fenced = async {
                if attached.is_empty() {
                    return futures::future::pending::<EndpointId>().await;
                }
                let waits = attached.iter().map(|(endpoint, entry)| {
                    let token = entry.attachment.generation_cancel.clone();
                    let endpoint = endpoint.clone();
                    Box::pin(async move {
                        token.cancelled().await;
                        endpoint
                    })
                });
                select_all(waits).await.0
            };
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => break,
                changed = self.views.changed() => {
                    if changed.is_err() {
                        break;
                    }
                    let view = self.views.borrow_and_update().clone();
                    if let Some(view) = view {
                        self.reconcile(&view, &mut attached, &mut pumps).await;
                        self.update_topology(&mut topology, &view, &attached, &catalog.borrow());
                    }
                }
                changed = self.source_updates.changed(), if sources_open => {
                    if changed.is_err() {
                        sources_open = false;
                        continue;
                    }
                    let next = self.source_updates.borrow_and_update().clone();
                    let touched: BTreeSet<EndpointId> = self
                        .configured_sources
                        .keys()
                        .chain(next.keys())
                        .filter(|endpoint| self.configured_sources.get(*endpoint) != next.get(*endpoint))
                        .cloned()
                        .collect();
                    self.configured_sources = next;
                    for endpoint in &touched {
                        pumps.stop(endpoint);
                    }
                    let view = self.views.borrow().clone();
                    if let Some(view) = view {
                        self.reconcile(&view, &mut attached, &mut pumps).await;
                        self.update_topology(&mut topology, &view, &attached, &catalog.borrow());
                    }
                }
                changed = catalog.changed() => {
                    if changed.is_ok() {
                        let current = catalog.borrow_and_update().clone();
                        self.publish_catalog(&current);
                        if let Some(view) = self.views.borrow().clone() {
                            self.update_topology(&mut topology, &view, &attached, &current);
                        }
                    }
                }
                changed = load.changed() => {
                    if changed.is_ok() {
                        load.borrow_and_update();
                    }
                }
                _ = ticker.tick() => {
                    window_sequence += 1;
                    let snapshots = load.borrow().clone();
                    self.state.publish_load(wire::load_window(self.state.relay, window_sequence, window, &snapshots));
                    self.refresh_stats(&attached).await;
                }
                endpoint = fenced => {
                    if let Some(entry) = attached.remove(&endpoint) {
                        warn!(endpoint = %endpoint.dotted(), generation = entry.attachment.generation, "pool generation fenced; rebuilding");
                        self.registry.retire(entry.attachment, RetirementMode::Fenced).await;
                        self.publish_routes(&attached);
                    }
                    let view = self.views.borrow().clone();
                    if let Some(view) = view {
                        self.reconcile(&view, &mut attached, &mut pumps).await;
                        self.update_topology(&mut topology, &view, &attached, &catalog.borrow());
                    }
                }
            }
        }
        // Shutdown: stop the sources, withdraw and retire every generation, stop the registry.
        pumps.stop_all().await;
        for (_, entry) in std::mem::take(&mut attached) {
            self.registry
                .retire(entry.attachment, RetirementMode::Fenced)
                .await;
        }
        self.publish_routes(&attached);
        self.registry.shutdown().await;
    }

    async fn reconcile(
        &self,
        view: &MembershipView,
        attached: &mut BTreeMap<EndpointId, Attached>,
        pumps: &mut Pumps,
    ) {
        self.state.mark_discovery_listed();
        // Departed or no longer materializable endpoints, and changed bindings: retire.
        let mut desired: BTreeMap<EndpointId, (Binding, &EndpointMembership)> = BTreeMap::new();
        for membership in view.endpoints() {
            if let Some(binding) = self.binding_of(membership) {
                desired.insert(membership.endpoint.clone(), (binding, membership));
            }
        }
        let stale: Vec<EndpointId> = attached
            .iter()
            .filter(|(endpoint, entry)| {
                desired
                    .get(*endpoint)
                    .is_none_or(|(binding, _)| *binding != entry.binding)
            })
            .map(|(endpoint, _)| endpoint.clone())
            .collect();
        for endpoint in stale {
            pumps.stop(&endpoint);
            if let Some(entry) = attached.remove(&endpoint) {
                info!(endpoint = %endpoint.dotted(), generation = entry.attachment.generation, "retiring pool");
                self.registry
                    .retire(entry.attachment, RetirementMode::Graceful)
                    .await;
            }
        }
        for (endpoint, (binding, membership)) in desired {
            match attached.get_mut(&endpoint) {
                Some(entry) => {
                    if !entry.endpoint.same_content(membership) {
                        self.update_in_place(entry, membership);
                    }
                }
                None => {
                    let request = AttachRequest {
                        pool: binding.pool,
                        endpoint: endpoint.clone(),
                        registrations: membership.registrations.clone(),
                        query_semantics: binding.query_semantics,
                        roles: roles_of(membership),
                        expected_unique_blocks: expected_unique_blocks(membership),
                        load_capacity: Some(capacities(membership)),
                    };
                    match self.registry.attach(request).await {
                        Ok(attachment) => {
                            info!(endpoint = %endpoint.dotted(), generation = attachment.generation, "pool attached");
                            attached.insert(
                                endpoint,
                                Attached {
                                    binding,
                                    attachment,
                                    endpoint: membership.clone(),
                                },
                            );
                        }
                        Err(err) => {
                            warn!(endpoint = %endpoint.dotted(), error = %err, "pool attach failed")
                        }
                    }
                }
            }
        }
        // Start the sources of every attached endpoint whose sources are not running (new
        // pools, and endpoints whose sources changed).
        for (endpoint, entry) in attached.iter() {
            let configured = self
                .configured_sources
                .get(endpoint)
                .map_or(&[][..], Vec::as_slice);
            if !configured.is_empty() || self.nats_server.is_some() {
                pumps.start(
                    endpoint,
                    configured,
                    entry.binding.query_semantics,
                    self,
                    &self.cancel,
                );
            }
        }
        self.publish_routes(attached);
    }

    /// Feeds membership, liveness (an attached pool's workers with connected sources, owned
    /// by its generation) and pool links into the topology state; publishes on change.
    fn update_topology(
        &self,
        topology: &mut Option<TopologyState>,
        view: &MembershipView,
        attached: &BTreeMap<EndpointId, Attached>,
        catalog: &kvrelay_pool::PoolCatalog,
    ) {
        let state = topology.get_or_insert_with(|| TopologyState::new(view.clone()));
        let mut changed = state.replace_membership(view.clone());
        for (endpoint, entry) in attached {
            let slot = entry.attachment.generation;
            changed |= state.claim_availability(endpoint, slot);
            let live: BTreeSet<u64> =
                sources_of(&entry.endpoint, self.configured_sources.get(endpoint))
                    .into_iter()
                    .map(|(source, _)| source.worker_id)
                    .collect();
            changed |= state.replace_availability(endpoint, slot, Some(live));
        }
        changed |= state.replace_pool_links(
            catalog
                .pools()
                .map(|pool| (pool.serving_endpoint.clone(), pool.pool_id())),
        );
        let first = self.state.topology.borrow().revision == 0;
        if changed || first {
            self.state
                .publish_topology(wire::topology_update(self.state.relay, &state.snapshot()));
        }
    }

    fn update_in_place(&self, entry: &mut Attached, membership: &EndpointMembership) {
        let attachment = &mut entry.attachment;
        if entry.endpoint.registrations != membership.registrations
            && let Err(err) = self
                .registry
                .replace_registrations(attachment, membership.registrations.clone())
        {
            warn!(error = %err, "replacing registrations failed");
        }
        if entry.endpoint.roles != membership.roles
            && let Err(err) = self
                .registry
                .replace_roles(attachment, roles_of(membership))
        {
            warn!(error = %err, "replacing roles failed");
        }
        if let Err(err) = self.registry.replace_load_capacity(
            attachment.pool,
            attachment.generation,
            &capacities(membership),
        ) {
            warn!(error = %err, "replacing load capacity failed");
        }
        entry.endpoint = membership.clone();
    }

    fn binding_of(&self, membership: &EndpointMembership) -> Option<Binding> {
        if !membership.is_materializable() {
            return None;
        }
        let has_source = (self.workload_sources || self.nats_server.is_some())
            && !membership.worker_topology.is_empty()
            || self.configured_sources.contains_key(&membership.endpoint);
        if !has_source {
            return None;
        }
        let domain = membership.domain?;
        Some(Binding {
            pool: PoolId {
                indexer_domain: domain.id,
                dc_id: self.dc_id,
            },
            query_semantics: domain.query_semantics,
        })
    }

    fn publish_catalog(&self, catalog: &kvrelay_pool::PoolCatalog) {
        self.state.publish_catalog(wire::catalog_update(catalog));
    }

    fn publish_routes(&self, attached: &BTreeMap<EndpointId, Attached>) {
        let mut routes = BTreeMap::new();
        let mut pools = BTreeMap::new();
        for (endpoint, entry) in attached {
            let sources = sources_of(&entry.endpoint, self.configured_sources.get(endpoint));
            for (source, capacity) in &sources {
                routes.insert(
                    *source,
                    Route {
                        pool: entry.attachment.pool,
                        generation: entry.attachment.generation,
                        actor: entry.attachment.actor.clone(),
                        capacity: *capacity,
                        block_size: entry.binding.query_semantics.kv_block_size(),
                    },
                );
            }
            pools.insert(
                wire::pool_key(&entry.attachment.pool),
                PoolStatus {
                    endpoint: endpoint.dotted(),
                    generation: entry.attachment.generation,
                    sources: sources.len(),
                    stats: None,
                },
            );
        }
        self.state.publish_routes(Routes { routes }, pools);
    }

    async fn refresh_stats(&self, attached: &BTreeMap<EndpointId, Attached>) {
        let mut stats = Vec::new();
        for entry in attached.values() {
            let actor: &PoolActorHandle = &entry.attachment.actor;
            if let Ok(actor_stats) = actor.stats().await {
                stats.push((wire::pool_key(&entry.attachment.pool), actor_stats));
            }
        }
        self.state.record_pool_stats(stats);
    }
}

/// The running configured sources, per endpoint.
#[derive(Default)]
struct Pumps {
    tracker: TaskTracker,
    running: BTreeMap<EndpointId, CancellationToken>,
}

impl Pumps {
    fn start(
        &mut self,
        endpoint: &EndpointId,
        sources: &[SourceConfig],
        semantics: KvQuerySemantics,
        supervisor: &Supervisor,
        parent: &CancellationToken,
    ) {
        if self.running.contains_key(endpoint) {
            return;
        }
        let cancel = parent.child_token();
        for source in sources {
            pump::spawn_zmq(
                &self.tracker,
                source,
                semantics,
                supervisor.state.clone(),
                cancel.clone(),
            );
            if let Some(url) = &source.metrics_url {
                self.tracker.spawn(scrape::run(
                    url.clone(),
                    SourceId::new(source.worker_id, source.dp_rank),
                    supervisor.state.limits.load_window(),
                    supervisor.state.clone(),
                    supervisor.registry.clone(),
                    cancel.clone(),
                ));
            }
        }
        if let Some(server) = &supervisor.nats_server {
            pump::spawn_nats(
                &self.tracker,
                server,
                endpoint,
                supervisor.state.clone(),
                cancel.clone(),
            );
        }
        self.running.insert(endpoint.clone(), cancel);
    }

    fn stop(&mut self, endpoint: &EndpointId) {
        if let Some(cancel) = self.running.remove(endpoint) {
            cancel.cancel();
        }
    }

    async fn stop_all(&mut self) {
        for (_, cancel) in std::mem::take(&mut self.running) {
            cancel.cancel();
        }
        self.tracker.close();
        self.tracker.wait().await;
    }
}

fn roles_of(membership: &EndpointMembership) -> Vec<WorkerRole> {
    if membership.roles.is_empty() {
        vec![WorkerRole::Aggregated]
    } else {
        membership.roles.clone()
    }
}

/// Per-rank capacity in blocks, by worker, from the runtime configs.
fn capacities(membership: &EndpointMembership) -> Vec<WorkerCapacity> {
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

fn expected_unique_blocks(membership: &EndpointMembership) -> u64 {
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

/// Default per-rank capacity of a simulated source when its card declares none, in blocks.
const DEFAULT_SOURCE_CAPACITY: u64 = 4_096;

/// The sources of an endpoint with their per-rank capacity: every (worker, rank) of its
/// cards, plus statically configured ones.
fn sources_of(
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
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use kvrelay_membership::{
        DiscoveryEvent, EndpointFilter, MembershipProjection, ModelCardInstance,
        ModelCardInstanceId,
    };

    use super::*;

    fn card(total_kv_blocks: Option<u64>, dp_start: u32, dp_size: u32) -> serde_json::Value {
        let mut runtime = serde_json::json!({"data_parallel_start_rank": dp_start, "data_parallel_size": dp_size});
        if let Some(blocks) = total_kv_blocks {
            runtime["total_kv_blocks"] = blocks.into();
        }
        serde_json::json!({
            "display_name": "m", "source_path": "models/m", "kv_cache_block_size": 16,
            "worker_type": "aggregated", "runtime_config": runtime
        })
    }

    fn membership(cards: &[(u64, serde_json::Value)]) -> EndpointMembership {
        let mut projection = MembershipProjection::new(EndpointFilter::default());
        for (instance, card_json) in cards {
            let id = ModelCardInstanceId::from_path(&format!("prod/backend/generate/{instance:x}"))
                .unwrap();
            projection.handle_event(DiscoveryEvent::Added(ModelCardInstance {
                id,
                card_json: card_json.clone(),
            }));
        }
        projection.project();
        projection.view().endpoints().next().unwrap().clone()
    }

    #[test]
    fn sources_cover_every_rank_of_every_worker() {
        let endpoint = membership(&[(1, card(Some(100), 4, 2)), (2, card(None, 0, 1))]);
        let sources = sources_of(&endpoint, None);
        assert_eq!(
            sources,
            vec![
                (SourceId::new(1, 4), 100),
                (SourceId::new(1, 5), 100),
                (SourceId::new(2, 0), DEFAULT_SOURCE_CAPACITY)
            ]
        );
    }

    #[test]
    fn filter_sizing_sums_declared_capacity_with_a_floor_and_a_default() {
        assert_eq!(
            expected_unique_blocks(&membership(&[(1, card(Some(100), 0, 2))])),
            MIN_EXPECTED_UNIQUE_BLOCKS
        );
        assert_eq!(
            expected_unique_blocks(&membership(&[
                (1, card(Some(40_000), 0, 2)),
                (2, card(Some(10_000), 0, 1))
            ])),
            90_000
        );
        assert_eq!(
            expected_unique_blocks(&membership(&[(1, card(None, 0, 1))])),
            DEFAULT_EXPECTED_UNIQUE_BLOCKS
        );
    }

    #[test]
    fn capacities_name_each_worker_rank_range() {
        let capacity = capacities(&membership(&[(7, card(Some(64), 2, 3))]));
        assert_eq!(
            capacity,
            vec![WorkerCapacity {
                worker_id: 7,
                data_parallel_start_rank: 2,
                data_parallel_size: 3,
                total_kv_blocks: Some(64)
            }]
        );
    }
}
