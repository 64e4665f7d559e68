//! The relay host: starts every part of a relay from a [`RelayConfig`] and stops them in
//! order.
//!
//! Tasks (all owned, under child tokens of one root): discovery (cards → membership view),
//! the supervisor (views → pool generations, catalog/load/topology publication), the trace
//! workload (events into pool actors), the WAN accept loop with one task per connection,
//! and admin HTTP. Shutdown order, bounded by `limits.shutdown_timeout_ms`: stop the WAN
//! (every stream gets `publication_unavailable`), stop the workload and discovery, let the
//! supervisor retire every generation and shut the registry down, then stop admin HTTP.

mod admin_view;
mod checkpoint;
mod discovery;
mod embed;
mod event_scan;
mod publisher;
mod pump;
mod replay;
mod report;
mod scrape;
#[cfg(test)]
mod stall_tests;
mod state;
mod supervisor;
mod wire;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kvrelay_ckf::SourceId;
use kvrelay_codec::v1::{self, RelayInfo};
use kvrelay_identity::{DcId, DcRelayIdentity};
use kvrelay_membership::{DiscoveryScope, MembershipView};
use kvrelay_pool::{PoolRegistry, RegistryConfig};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use crate::admission::{Admission, StreamKind};
use crate::config::{AuthTable, RelayConfig};
use crate::metrics::RelayMetrics;
use crate::mirror::{MirrorError, MirrorProgress, PoolMirror};
use crate::wan::WanServer;
use crate::wan::connection::ConnectionContext;
use crate::wan::open::StreamOpener;
use crate::wan::source::PublicationViews;
use kvrelay_tls::ServerTls;
pub use report::{DiscoveryStartError, PoolReport, ProducerTable, RelayError, RelayProgress};
use state::HostState;

/// Seed of the embedded workload's synthesized block tokens (the ingest workload's
/// default), so a consumer scoring
/// `kvrelay_ingest::request_tokens(hash_ids, block_size, WORKLOAD_TOKEN_SEED)` finds the
/// blocks the relay's trace replay stored.
pub const WORKLOAD_TOKEN_SEED: u64 = kvrelay_ingest::DEFAULT_WORKLOAD_SEED;

/// A running relay.
pub struct Relay {
    identity: DcRelayIdentity,
    wan_addr: SocketAddr,
    dynamo_addr: Option<SocketAddr>,
    admin_addr: Option<SocketAddr>,
    root: CancellationToken,
    wan_cancel: CancellationToken,
    host_cancel: CancellationToken,
    admin_cancel: CancellationToken,
    wan_tracker: TaskTracker,
    host_tracker: TaskTracker,
    admin_tracker: TaskTracker,
    registry: PoolRegistry,
    state: Arc<HostState>,
    admission: Admission,
    workload_done: watch::Receiver<bool>,
}

impl std::fmt::Debug for Relay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relay")
            .field("wan_addr", &self.wan_addr)
            .field("admin_addr", &self.admin_addr)
            .finish_non_exhaustive()
    }
}

impl Relay {
    /// Validates `config`, binds the listeners and starts every task. Each start gets a new
    /// random relay incarnation.
    pub async fn start(config: RelayConfig) -> Result<Self, RelayError> {
        config.validate()?;
        let tls = config.wan.tls.as_ref().map(ServerTls::load).transpose()?;
        let token = config
            .wan
            .auth
            .as_ref()
            .map(|auth| auth.load(AuthTable::Wan))
            .transpose()?;
        let admin_token = config
            .admin
            .auth
            .as_ref()
            .map(|auth| auth.load(AuthTable::Admin))
            .transpose()?;
        for warning in config.exposure_warnings() {
            warn!(%warning, "listener exposed without protection");
        }
        let trace = match &config.workload {
            Some(workload) => Some(match &workload.trace {
                Some(path) => replay::read_trace(path)?,
                None => kvrelay_ingest::parse_request_trace(kvrelay_ingest::BUILTIN_REQUEST_TRACE)
                    .map_err(|err| RelayError::Trace {
                        path: PathBuf::from("<builtin>"),
                        message: err.to_string(),
                    })?,
            }),
            None => None,
        };
        let scope = DiscoveryScope {
            namespaces: config.discovery.namespaces.clone(),
            endpoint_prefixes: config.discovery.endpoint_prefixes.clone(),
            watch_all: config.discovery.watch_all,
        };
        scope.validate().map_err(DiscoveryStartError::from)?;
        let dc_id = DcId::from_dc_name(&config.dc_id);
        let identity = DcRelayIdentity::new(dc_id.as_u64(), rand::random::<u64>());
        let limits = config.limits.clone();
        let registry = PoolRegistry::new(RegistryConfig {
            relay: identity,
            limits: limits.pool(),
        })?;
        let metrics = Arc::new(RelayMetrics::new());
        metrics.stream.follow(registry.stream_stats_reader());
        let relay = v1::RelayIdentity::from(identity);
        let state = Arc::new(HostState::new(
            relay,
            limits.clone(),
            metrics.clone(),
            limits.load_window_ms,
            kvrelay_ingest::QueueBudget::new(config.ingest.max_queued_bytes_total),
        ));
        let admission = Admission::new(&limits);

        let root = CancellationToken::new();
        let wan_cancel = root.child_token();
        let host_cancel = root.child_token();
        let admin_cancel = root.child_token();
        let wan_tracker = TaskTracker::new();
        let host_tracker = TaskTracker::new();
        let admin_tracker = TaskTracker::new();

        let membership = match discovery::start(&config.discovery, &scope, &host_cancel).await {
            Ok(membership) => membership,
            Err(err) => {
                root.cancel();
                return Err(err.into());
            }
        };
        let etcd_client = membership.etcd_client();
        let (views_tx, views_rx) = watch::channel::<Option<MembershipView>>(None);
        host_tracker.spawn(
            discovery::forward(membership, views_tx, metrics.clone(), host_cancel.clone())
                .instrument(info_span!("discovery")),
        );
        let configured_sources = match event_scan::group(&config.sources) {
            Ok(grouped) => grouped,
            Err(err) => {
                root.cancel();
                return Err(RelayError::Config(err));
            }
        };
        let (sources_tx, source_updates) = watch::channel(configured_sources.clone());
        // Adverts from the file store when one is named, else from the etcd backend.
        let advert_store = match (&config.discovery.event_sources_dir, etcd_client) {
            (Some(dir), _) => Some(event_scan::AdvertStore::Dir(dir.clone())),
            (None, Some(client)) if config.discovery.etcd_event_adverts => {
                Some(event_scan::AdvertStore::Etcd(Box::new(client)))
            }
            (None, _) => None,
        };
        if let Some(store) = advert_store {
            let scan = event_scan::EventScan {
                store,
                configured: config.sources.clone(),
                sources: sources_tx,
                metrics: metrics.clone(),
                cancel: host_cancel.clone(),
            };
            host_tracker.spawn(scan.run().instrument(info_span!("event_sources")));
        }
        let checkpointer = config
            .state
            .clone()
            .map(|state_config| checkpoint::Checkpointer::new(state_config, &state));
        let supervisor = supervisor::Supervisor {
            registry: registry.clone(),
            state: state.clone(),
            core: supervisor::CoreConfig {
                dc_id,
                workload_sources: trace.is_some(),
                nats: config.nats.is_some(),
                stall_bound: limits.pool_stall_timeout(),
                degraded_readings: supervisor::degraded_readings(&limits),
                tiers: config.tiers.clone(),
                filter_density: config.filters.density(),
                twin_density: config.filters.twin_density(),
            },
            configured_sources,
            source_updates,
            nats_server: config.nats.clone(),
            ingest_limits: config.ingest,
            views: views_rx,
            cancel: host_cancel.clone(),
            checkpointer: checkpointer.clone(),
        };
        if let Some(checkpointer) = checkpointer {
            host_tracker.spawn(
                checkpointer
                    .run(state.clone(), host_cancel.clone())
                    .instrument(info_span!("checkpoints")),
            );
        }
        host_tracker.spawn(supervisor.run().instrument(info_span!("supervisor")));

        let (done_tx, workload_done) = watch::channel(trace.is_none());
        if let (Some(requests), Some(workload)) = (trace, config.workload.clone()) {
            let driver = replay::WorkloadDriver {
                state: state.clone(),
                registry: registry.clone(),
                requests,
                speed: workload.speed,
                loops: workload.loops,
                done: done_tx,
            };
            host_tracker.spawn(
                driver
                    .run(host_cancel.clone())
                    .instrument(info_span!("workload")),
            );
        }

        let codec_limits = limits.codec();
        let views = PublicationViews {
            info: RelayInfo {
                protocol_major: kvrelay_codec::PROTOCOL_MAJOR,
                protocol_minor: kvrelay_codec::PROTOCOL_MINOR,
                relay,
                max_frame_len: limits.max_frame_len,
            },
            catalog: state.catalog.subscribe(),
            load: state.load.subscribe(),
            topology: state.topology.subscribe(),
            pools: Arc::new(publisher::RegistryPublisher {
                registry: registry.clone(),
            }),
        };
        let opener = StreamOpener {
            views,
            admission: admission.clone(),
            metrics: metrics.clone(),
        };
        let ctx = ConnectionContext {
            opener: opener.clone(),
            metrics: metrics.clone(),
            limits: limits.clone(),
            codec_limits,
            tls,
            token,
            cancel: wan_cancel.clone(),
            refusal_log: kvrelay_pacing::SharedLogBudget::default(),
        };
        let server = match WanServer::bind(config.wan.listen, ctx).await {
            Ok(server) => server,
            Err(err) => {
                root.cancel();
                return Err(RelayError::Bind {
                    what: "wan",
                    addr: config.wan.listen,
                    message: err.to_string(),
                });
            }
        };
        let wan_addr = server.local_addr().map_err(|err| RelayError::Bind {
            what: "wan",
            addr: config.wan.listen,
            message: err.to_string(),
        })?;
        wan_tracker.spawn(
            server
                .run(wan_tracker.clone())
                .instrument(info_span!("wan", addr = %wan_addr)),
        );

        let dynamo_addr = match &config.dynamo {
            None => None,
            Some(door) => {
                let bind_failed = |err: &dyn std::fmt::Display| RelayError::Bind {
                    what: "dynamo",
                    addr: door.listen,
                    message: err.to_string(),
                };
                let tls = match door.tls.as_ref().map(ServerTls::load).transpose() {
                    Ok(tls) => tls,
                    Err(err) => {
                        root.cancel();
                        return Err(err.into());
                    }
                };
                let token = match door
                    .auth
                    .as_ref()
                    .map(|auth| auth.load(AuthTable::Dynamo))
                    .transpose()
                {
                    Ok(token) => token,
                    Err(err) => {
                        root.cancel();
                        return Err(err.into());
                    }
                };
                let bound = crate::dynamo::DynamoDoor {
                    opener,
                    metrics: metrics.clone(),
                    limits: limits.clone(),
                    tls,
                    token,
                    cancel: wan_cancel.clone(),
                }
                .bind(door.listen, wan_tracker.clone())
                .await;
                match bound {
                    Ok((addr, serve)) => {
                        wan_tracker.spawn(serve.instrument(info_span!("dynamo", %addr)));
                        Some(addr)
                    }
                    Err(err) => {
                        root.cancel();
                        return Err(bind_failed(&err));
                    }
                }
            }
        };

        let admin_addr = if config.admin.enabled {
            let view = Arc::new(admin_view::HostAdminView {
                state: state.clone(),
                admission: admission.clone(),
            });
            let bounds = crate::http::HttpBounds {
                header_read_timeout: Duration::from_millis(config.admin.header_read_timeout_ms),
                connection_timeout: Duration::from_millis(config.admin.connection_timeout_ms),
                max_connections: config.admin.max_connections,
                token: admin_token,
            };
            match crate::admin::bind(
                config.admin.listen,
                view,
                metrics.clone(),
                bounds,
                admin_cancel.clone(),
            )
            .await
            {
                Ok((addr, serve)) => {
                    admin_tracker.spawn(
                        async move {
                            if let Err(err) = serve.await {
                                warn!(error = %err, "admin server stopped");
                            }
                        }
                        .instrument(info_span!("admin", %addr)),
                    );
                    Some(addr)
                }
                Err(err) => {
                    root.cancel();
                    return Err(RelayError::Bind {
                        what: "admin",
                        addr: config.admin.listen,
                        message: err.to_string(),
                    });
                }
            }
        } else {
            None
        };
        info!(%wan_addr, dynamo = ?dynamo_addr, admin = ?admin_addr, dc = %config.dc_id, incarnation = identity.relay_incarnation(), "relay started");
        Ok(Self {
            identity,
            wan_addr,
            dynamo_addr,
            admin_addr,
            root,
            wan_cancel,
            host_cancel,
            admin_cancel,
            wan_tracker,
            host_tracker,
            admin_tracker,
            registry,
            state,
            admission,
            workload_done,
        })
    }

    /// The bound WAN address.
    pub fn wan_addr(&self) -> SocketAddr {
        self.wan_addr
    }

    /// The bound Dynamo-contract (gRPC) address, when `[dynamo]` is set.
    pub fn dynamo_addr(&self) -> Option<SocketAddr> {
        self.dynamo_addr
    }

    /// The bound admin HTTP address, when enabled.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin_addr
    }

    /// This relay's incarnation (new on every start).
    pub fn incarnation(&self) -> u64 {
        self.identity.relay_incarnation()
    }

    /// Live figures.
    pub fn progress(&self) -> RelayProgress {
        let workload = &self.state.workload;
        let pool_label = RelayMetrics::stream(StreamKind::Pool);
        let pools = self.state.pools();
        RelayProgress {
            pools: self.state.catalog_snapshot().pools.len(),
            sources: self.state.routes.borrow().routes.len(),
            requests: workload.requests.load(Ordering::Relaxed),
            events: workload.events.load(Ordering::Relaxed),
            blocks_stored: workload.blocks_stored.load(Ordering::Relaxed),
            blocks_removed: workload.blocks_removed.load(Ordering::Relaxed),
            events_dropped: workload.events_dropped.load(Ordering::Relaxed),
            workload_done: *self.workload_done.borrow(),
            frames_published: self
                .state
                .metrics
                .frames_sent
                .get_or_create(&pool_label)
                .get(),
            bytes_published: self
                .state
                .metrics
                .bytes_sent
                .get_or_create(&pool_label)
                .get(),
            filter_load_max: pools
                .values()
                .map(|pool| state::filter_load(&pool.actor.health(tokio::time::Instant::now())))
                .fold(0.0, f64::max),
            catalog_revision: self.state.catalog_snapshot().revision,
        }
    }

    /// Waits until the trace workload has been replayed and every actor flushed (at once
    /// when there is no workload).
    pub async fn workload_finished(&self) {
        let mut done = self.workload_done.clone();
        let _ = done.wait_for(|done| *done).await;
    }

    /// The current catalog, as published on the WAN.
    pub fn catalog(&self) -> v1::CatalogUpdate {
        (*self.state.catalog_snapshot()).clone()
    }

    /// Whether discovery has not listed yet, or an attach or retirement is in flight (the
    /// catalog may still change without any discovery change).
    pub fn is_settling(&self) -> bool {
        self.state.facts().settling
    }

    /// Waits until the catalog holds at least `n_pools` pools.
    pub async fn wait_for_pools(&self, n_pools: usize) {
        let mut catalog = self.state.catalog.subscribe();
        let _ = catalog
            .wait_for(|catalog| catalog.pools.len() >= n_pools)
            .await;
    }

    /// Per-pool figures, read fresh from each actor's health (O(1), never through its
    /// mailbox, so a stalled pool still reports).
    pub async fn pool_reports(&self) -> Vec<PoolReport> {
        let now = tokio::time::Instant::now();
        let facts = self.state.facts();
        let mut reports: Vec<PoolReport> = self
            .state
            .pools()
            .into_iter()
            .map(|(key, status)| {
                let health = status.actor.health(now);
                let stats = &health.stats;
                let pool_facts = facts.pools.get(&key);
                PoolReport {
                    endpoint: status.endpoint.clone(),
                    generation: status.generation,
                    sources: status.routed_sources,
                    connected_sources: pool_facts
                        .map_or(0, supervisor::PoolFacts::delivering_sources),
                    stalled: pool_facts.is_some_and(|facts| facts.stalled),
                    degraded: pool_facts.is_some_and(|facts| facts.degraded.is_some()),
                    sequence: stats.sequence,
                    resident_blocks: stats.filter.resident_blocks,
                    bucket_count: stats.filter.bucket_count,
                    capacity_omissions: stats.filter.counters.capacity_omissions,
                    events_applied: stats.events_applied,
                    events_rejected: stats.events_rejected,
                    unroutable_events: stats.unroutable_events,
                    unroutable_blocks: stats.unroutable_blocks,
                    faults: stats.faults.total(),
                    pending_events: health.pending_events,
                    pool: key,
                }
            })
            .collect();
        reports.sort_by(|a, b| a.endpoint.cmp(&b.endpoint));
        reports
    }

    /// The connected sources, in order.
    pub fn sources(&self) -> Vec<SourceId> {
        self.state.routes.borrow().routes.keys().copied().collect()
    }

    /// The connected sources feeding each producer generation (the pool behind a catalog
    /// entry), for embedders that bring their own events and must pick a pool's source.
    /// Sources are in order; producers in the order their first source appears.
    pub fn sources_by_producer(&self) -> Vec<(v1::ProducerIdentity, Vec<SourceId>)> {
        let mut out: Vec<(v1::ProducerIdentity, Vec<SourceId>)> = Vec::new();
        for (source, route) in &self.state.routes.borrow().routes {
            let producer = v1::ProducerIdentity::from(route.actor.identity());
            match out.iter_mut().find(|(known, _)| *known == producer) {
                Some((_, sources)) => sources.push(*source),
                None => out.push((producer, vec![*source])),
            }
        }
        out
    }

    /// Settles every pool actor: pending events are published and taken by the pool's
    /// publication, so a subscription (or [`Relay::producer_table`]) opened afterwards
    /// starts at or after them.
    pub async fn flush(&self) {
        let routes = self.state.routes.borrow().clone();
        for route in routes.routes.values() {
            let _ = route.actor.settle().await;
        }
    }

    /// Reads the table of `producer` through its publication (an in-process subscription):
    /// exactly what a replica at the returned sequence must hold.
    pub async fn producer_table(
        &self,
        producer: &v1::ProducerIdentity,
    ) -> Result<ProducerTable, RelayError> {
        let pool = wire::wire_pool_key(&producer.pool_id);
        let table_error = |message: String| RelayError::ProducerTable {
            pool: pool.clone(),
            message,
        };
        let catalog = self.registry.catalog();
        // A pool, or a lower-tier lane of one.
        let lanes = catalog
            .pools()
            .flat_map(|entry| entry.tier_lanes.iter().map(|lane| lane.producer));
        let Some(identity) = catalog
            .pools()
            .map(|entry| entry.producer)
            .chain(lanes)
            .find(|identity| v1::ProducerIdentity::from(*identity) == *producer)
        else {
            return Err(RelayError::UnknownPool { pool });
        };
        drop(catalog);
        let mut subscription = self
            .registry
            .subscribe(identity)
            .await
            .map_err(|err| table_error(err.to_string()))?;
        let mut mirror =
            PoolMirror::new(*producer).map_err(|err: MirrorError| table_error(err.to_string()))?;
        loop {
            let frame = subscription
                .next_frame()
                .await
                .map_err(|err| table_error(err.to_string()))?;
            match mirror
                .handle_bytes(&frame.bytes)
                .map_err(|err| table_error(err.to_string()))?
            {
                MirrorProgress::SnapshotComplete => break,
                MirrorProgress::Assembling | MirrorProgress::Delta | MirrorProgress::Heartbeat => {}
            }
        }
        Ok(ProducerTable {
            producer: *producer,
            sequence: mirror.sequence(),
            words: mirror.words().map(<[u64]>::to_vec).unwrap_or_default(),
        })
    }

    /// Open WAN streams of `kind`.
    pub fn open_streams(&self, kind: StreamKind) -> u32 {
        self.admission.active(kind)
    }

    /// Waits until at most `at_most` WAN streams of `kind` are open.
    pub async fn wait_for_open_streams(&self, kind: StreamKind, at_most: u32) {
        self.admission.wait_for_at_most(kind, at_most).await;
    }

    /// Runs until SIGINT or SIGTERM, then shuts down in order.
    pub async fn run_until_signal(self) -> Result<(), RelayError> {
        kvrelay_http::wait_for_signal().await;
        info!("signal received; shutting down");
        self.shutdown().await
    }

    /// Ordered, bounded shutdown: WAN, then workload/discovery/pools, then admin HTTP.
    pub async fn shutdown(self) -> Result<(), RelayError> {
        let bound = self.state.limits.shutdown_timeout();
        let timeout_ms = self.state.limits.shutdown_timeout_ms;
        self.state.live.store(false, Ordering::SeqCst);
        let ordered = async {
            self.wan_cancel.cancel();
            self.wan_tracker.close();
            self.wan_tracker.wait().await;
            self.host_cancel.cancel();
            self.host_tracker.close();
            self.host_tracker.wait().await;
            self.admin_cancel.cancel();
            self.admin_tracker.close();
            self.admin_tracker.wait().await;
        };
        let result = tokio::time::timeout(bound, ordered).await;
        self.root.cancel();
        match result {
            Ok(()) => {
                info!("relay stopped");
                Ok(())
            }
            Err(_) => {
                warn!(
                    timeout_ms,
                    "shutdown bound exceeded; abandoning remaining tasks"
                );
                Err(RelayError::ShutdownTimedOut { timeout_ms })
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.root.cancel();
    }
}
