//! Registry, hub and load behaviour tests (ported from the reference's registry tests,
//! each tagged with the reference test it covers).

use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::error::HubFailure;

/// Test-only gates that freeze hub initialisation and eviction at chosen points.
#[derive(Default)]
pub(super) struct Gates {
    pub(super) initialization: Gate,
    pub(super) post_snapshot: Gate,
    pub(super) eviction: Gate,
}

/// A closed gate is a semaphore with no permits; the test adds permits to open it.
#[derive(Default, Clone)]
pub(super) struct Gate(Option<Arc<Semaphore>>);

impl Gate {
    pub(super) async fn pass(&self, cancel: &CancellationToken) -> Result<(), HubFailure> {
        let Some(gate) = &self.0 else {
            return Ok(());
        };
        tokio::select! {
            biased;
            () = cancel.cancelled() => Err(HubFailure::Retired),
            permit = gate.acquire() => {
                drop(permit);
                Ok(())
            }
        }
    }

    pub(super) async fn pass_uncancellable(&self) {
        if let Some(gate) = &self.0 {
            let _permit = gate.acquire().await;
        }
    }
}

pub(super) mod behaviour {
    use std::sync::mpsc as std_mpsc;
    use std::time::Duration;

    use kvrelay_ckf::{EventPayload, RouterEvent, SourceId, StoredBlock, StoredBlocks};
    use kvrelay_identity::{
        CacheSemanticsId, CanonicalModelId, CanonicalModelRegistration, DcId, DcRelayIdentity,
        IdentitySource, IndexerDomainId, KvQueryHashFormat, KvQuerySemantics, ModelAlias,
        ModelTarget, PoolId, RoutingScopeId, WorkerRole,
    };
    use tokio::sync::oneshot;

    use super::super::publication_tests::next_end;
    use super::super::*;
    use super::{Gate, Gates};
    use crate::catalog::PoolDescriptor;
    use crate::error::SubscriptionEnd;
    use crate::subscription::PoolFrameKind;

    pub(crate) fn pool(seed: u8) -> PoolId {
        PoolId {
            indexer_domain: IndexerDomainId {
                cache_semantics: CacheSemanticsId::new([seed; 16], IdentitySource::Explicit),
                routing_scope: RoutingScopeId::new(
                    [seed.wrapping_add(1); 16],
                    IdentitySource::Explicit,
                ),
            },
            dc_id: DcId(3),
        }
    }

    fn relay() -> DcRelayIdentity {
        DcRelayIdentity::new(11, 7)
    }

    pub(crate) fn test_limits() -> Limits {
        Limits {
            max_delta_buckets: 1,
            ..Limits::default()
        }
    }

    pub(crate) fn registry_with(limits: Limits, gates: Gates) -> PoolRegistry {
        limits.validate().unwrap();
        PoolRegistry::build(
            RegistryConfig {
                relay: relay(),
                limits,
            },
            gates,
        )
    }

    fn registry() -> PoolRegistry {
        registry_with(test_limits(), Gates::default())
    }

    fn hub_limited(max_initialized_hubs: usize, gates: Gates) -> PoolRegistry {
        registry_with(
            Limits {
                max_initialized_hubs,
                ..test_limits()
            },
            gates,
        )
    }

    fn closed_gate() -> (Gate, Arc<Semaphore>) {
        let semaphore = Arc::new(Semaphore::new(0));
        (Gate(Some(semaphore.clone())), semaphore)
    }

    /// A one-hub registry whose idle-hub eviction waits on the returned semaphore.
    fn eviction_gated_single_hub() -> (PoolRegistry, Arc<Semaphore>) {
        let (eviction, eviction_gate) = closed_gate();
        let registry = hub_limited(
            1,
            Gates {
                eviction,
                ..Gates::default()
            },
        );
        (registry, eviction_gate)
    }

    /// Attaches `pool(seed)` at `endpoint` serving the `llama` model.
    pub(crate) async fn attach_llama(
        registry: &PoolRegistry,
        seed: u8,
        endpoint: &str,
    ) -> PoolAttachment {
        registry
            .attach(request(pool(seed), endpoint, "llama"))
            .await
            .unwrap()
    }

    /// Detaches every attachment, in order.
    async fn detach_all<const N: usize>(registry: &PoolRegistry, attachments: [PoolAttachment; N]) {
        for attachment in attachments {
            registry.detach(attachment).await;
        }
    }

    /// Subscribes to `producer` on a spawned task, so the caller can race it.
    fn spawn_subscribe(
        registry: &PoolRegistry,
        producer: ProducerIdentity,
    ) -> tokio::task::JoinHandle<Result<crate::subscription::PoolSubscription, SubscribeError>>
    {
        let registry = registry.clone();
        tokio::spawn(async move { registry.subscribe(producer).await })
    }

    /// Leaves `victim`'s hub initialised but idle, then subscribes `requester` on a spawned
    /// task and waits until that subscription has claimed the victim's hub for eviction.
    async fn claim_idle_hub(
        registry: &PoolRegistry,
        victim: &PoolAttachment,
        requester: &PoolAttachment,
    ) -> tokio::task::JoinHandle<Result<crate::subscription::PoolSubscription, SubscribeError>>
    {
        drop(registry.subscribe(victim.identity()).await.unwrap());
        let requester_subscribe = spawn_subscribe(registry, requester.identity());
        wait_for("the idle hub to be claimed", || {
            phase(registry, victim.generation) == "evicting"
        })
        .await;
        requester_subscribe
    }

    fn model(name: &str) -> CanonicalModelId {
        CanonicalModelId::new(name).unwrap()
    }

    fn alias(name: &str) -> ModelAlias {
        ModelAlias::new(name).unwrap()
    }

    fn registration(name: &str) -> CanonicalModelRegistration {
        CanonicalModelRegistration::base(model(name), vec![alias(&format!("{name}-alias"))])
    }

    fn semantics() -> KvQuerySemantics {
        KvQuerySemantics::new(64, KvQueryHashFormat::DynamoStandardV1).unwrap()
    }

    pub(crate) fn request(pool: PoolId, endpoint: &str, name: &str) -> AttachRequest {
        AttachRequest {
            pool,
            endpoint: endpoint.parse().unwrap(),
            registrations: vec![registration(name)],
            query_semantics: semantics(),
            roles: vec![WorkerRole::Aggregated],
            expected_unique_blocks: 32,
            filter_density: kvrelay_ckf::FilterDensity::V1,
            load_capacity: Some(Vec::new()),
            tier_lanes: Vec::new(),
        }
    }

    fn with_capacity(mut request: AttachRequest, workers: Vec<WorkerCapacity>) -> AttachRequest {
        request.load_capacity = Some(workers);
        request
    }

    pub(crate) fn stored_event(id: u64) -> RouterEvent {
        RouterEvent {
            source: SourceId::new(1, 0),
            event_id: id,
            payload: EventPayload::Stored(StoredBlocks {
                parent_engine_block_id: None,
                blocks: vec![StoredBlock {
                    engine_block_id: id,
                    token_hash: id,
                }],
            }),
        }
    }

    fn phase(registry: &PoolRegistry, generation: u64) -> &'static str {
        registry.inner.core.lock().slot_phase(generation)
    }

    fn hubs_in_use(registry: &PoolRegistry) -> usize {
        registry.inner.core.lock().hubs_in_use()
    }

    async fn wait_for(what: &str, mut condition: impl FnMut() -> bool) {
        tokio::time::timeout(Duration::from_secs(5), async {
            while !condition() {
                tokio::task::yield_now().await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("timed out waiting for {what}"));
    }

    async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(Duration::from_secs(5), future)
            .await
            .unwrap_or_else(|_| panic!("timed out waiting for {what}"))
    }

    struct GatedBuilder {
        builder: Box<
            dyn FnOnce(kvrelay_ckf::CkfConfig) -> Result<FilterState, kvrelay_ckf::ConfigError>
                + Send,
        >,
        started: oneshot::Receiver<()>,
        release: std_mpsc::Sender<()>,
        finished: oneshot::Receiver<()>,
    }

    fn gated_builder() -> GatedBuilder {
        let (started_tx, started) = oneshot::channel();
        let (release, release_rx) = std_mpsc::channel::<()>();
        let (finished_tx, finished) = oneshot::channel();
        let builder = move |config: kvrelay_ckf::CkfConfig| {
            let _ = started_tx.send(());
            release_rx
                .recv_timeout(Duration::from_secs(5))
                .expect("test must release the builder");
            let result = FilterState::build(config);
            let _ = finished_tx.send(());
            result
        };
        GatedBuilder {
            builder: Box::new(builder),
            started,
            release,
            finished,
        }
    }

    /// An attach of `pool(1)` on a spawned task whose filter builder has started and blocks
    /// until `release` is sent; `finished` fires once the builder has returned.
    struct StartedAttach {
        attach: tokio::task::JoinHandle<Result<PoolAttachment, AttachError>>,
        release: std_mpsc::Sender<()>,
        finished: oneshot::Receiver<()>,
    }

    async fn start_gated_attach(registry: &PoolRegistry) -> StartedAttach {
        let gated = gated_builder();
        let task_registry = registry.clone();
        let builder = gated.builder;
        let attach = tokio::spawn(async move {
            task_registry
                .attach_with_builder(request(pool(1), "first.router.generate", "llama"), builder)
                .await
        });
        within("builder start", gated.started).await.unwrap();
        StartedAttach {
            attach,
            release: gated.release,
            finished: gated.finished,
        }
    }

    #[tokio::test]
    async fn one_model_binds_to_independent_pools() {
        // spec: one_model_binds_to_independent_pools
        let registry = registry();
        let first = attach_llama(&registry, 1, "fast.router.generate").await;
        let second = attach_llama(&registry, 2, "slow.router.generate").await;

        let catalog = registry.catalog();
        assert_eq!(registry.stats().pools, 2);
        assert_eq!(catalog.relay().drt_instance_id(), 11);
        assert_eq!(catalog.relay().relay_incarnation(), 7);
        assert_eq!(catalog.len(), 2);
        assert_eq!(
            catalog.pool(pool(1)).unwrap().serving_endpoint,
            "fast.router.generate".parse().unwrap()
        );
        assert!(
            catalog
                .pools()
                .all(|d| d.registrations[0].model().as_str() == "llama")
        );

        detach_all(&registry, [first, second]).await;
    }

    #[tokio::test]
    async fn actor_drains_images_without_a_subscriber() {
        // spec: default_registry_materializes_publication_images_eagerly
        let registry = registry();
        let attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        attachment.actor.submit(stored_event(1)).await.unwrap();
        attachment.actor.flush().await.unwrap();
        let stats = attachment.actor.stats().await.unwrap();
        assert!(stats.emitted_images > 0);
        assert_eq!(stats.publications, 0, "no hub attached, nothing delivered");
        registry.detach(attachment).await;
    }

    /// What one generation exports (a checkpoint's content) restores into another exactly;
    /// a contradictory restore is refused whole and changes nothing.
    #[tokio::test]
    async fn exported_ownership_restores_into_a_new_generation() {
        let sorted = |mut sources: Vec<crate::SourceMappings>| {
            for source in &mut sources {
                source.mappings.sort_unstable();
            }
            sources
        };
        let registry = registry();
        let first = attach_llama(&registry, 1, "fast.router.generate").await;
        for id in 1..=20 {
            first.actor.submit(stored_event(id)).await.unwrap();
        }
        let mut other_source = stored_event(99);
        other_source.source = SourceId::new(2, 1);
        first.actor.submit(other_source).await.unwrap();
        let exported = sorted(first.actor.export_mappings().await.unwrap());
        assert_eq!(exported.len(), 2);
        assert_eq!(exported[0].mappings.len(), 20);

        let second = attach_llama(&registry, 2, "slow.router.generate").await;
        assert_eq!(second.actor.restore(exported.clone()).await.unwrap(), 21);
        assert_eq!(
            sorted(second.actor.export_mappings().await.unwrap()),
            exported
        );
        let (before, after) = (
            first.actor.stats().await.unwrap(),
            second.actor.stats().await.unwrap(),
        );
        assert_eq!(after.filter.resident_blocks, before.filter.resident_blocks);
        assert_eq!(
            second.actor.source_blocks().await.unwrap(),
            first.actor.source_blocks().await.unwrap()
        );

        let mut contradictory = exported.clone();
        contradictory[1].mappings.push((99, 0xDEAD));
        contradictory[0].mappings.clear();
        let err = second.actor.restore(contradictory).await.unwrap_err();
        assert!(matches!(err, crate::TransferError::Fault(_)), "{err}");
        assert_eq!(
            sorted(second.actor.export_mappings().await.unwrap()),
            exported
        );
        detach_all(&registry, [first, second]).await;
    }

    #[tokio::test]
    async fn burst_attach_publishes_a_sorted_revisioned_catalog() {
        // spec: burst_attach_defers_catalog_materialization_until_observed
        let registry = registry();
        let watch = registry.watch_catalog();
        let mut attachments = Vec::new();
        for seed in (1..=32u8).rev() {
            attachments.push(
                registry
                    .attach(request(
                        pool(seed),
                        &format!("pool-{seed}.router.generate"),
                        &format!("model-{seed}"),
                    ))
                    .await
                    .unwrap(),
            );
        }
        assert_eq!(watch.borrow().revision(), 32);
        let catalog = registry.catalog();
        let ids: Vec<PoolId> = catalog.pools().map(PoolDescriptor::pool_id).collect();
        assert!(
            ids.windows(2).all(|pair| pair[0] < pair[1]),
            "pools sorted by id"
        );
        let json = serde_json::to_value(&catalog).unwrap();
        assert_eq!(json["drt_instance_id"], 11);
        assert_eq!(json["relay_incarnation"], 7);
        assert_eq!(json["revision"], 32);
        assert!(json.get("process_incarnation").is_none());
        assert_eq!(json["pools"].as_array().unwrap().len(), 32);
        assert!(json["pools"][0].get("producer").is_some());
        assert!(json["pools"][0].get("pool_roles").is_some());

        registry.shutdown().await;
        assert_eq!(
            catalog.len(),
            attachments.len(),
            "a taken snapshot is immutable"
        );
        assert!(registry.catalog().is_empty());
        assert_eq!(registry.catalog().revision(), 33);
    }

    #[tokio::test]
    async fn catalog_publishes_and_preserves_generation_query_semantics() {
        // spec: catalog_publishes_and_preserves_generation_query_semantics
        let registry = registry();
        let expected = KvQuerySemantics::new(128, KvQueryHashFormat::DynamoEagleV1).unwrap();
        let mut req = request(pool(1), "fast.router.generate", "llama");
        req.query_semantics = expected;
        let mut attachment = registry.attach(req).await.unwrap();
        let producer = attachment.identity();
        let catalog = registry.catalog();
        assert_eq!(catalog.pool(pool(1)).unwrap().producer, producer);
        assert_eq!(catalog.pool(pool(1)).unwrap().query_semantics, expected);

        registry
            .replace_registrations(
                &mut attachment,
                vec![CanonicalModelRegistration::base(
                    model("llama"),
                    vec![alias("chat")],
                )],
            )
            .unwrap();
        let catalog = registry.catalog();
        let descriptor = catalog.pool(pool(1)).unwrap();
        assert_eq!(descriptor.producer, producer);
        assert_eq!(descriptor.query_semantics, expected);
        assert_eq!(descriptor.registrations[0].aliases(), [alias("chat")]);
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn registration_updates_remain_pool_local() {
        // spec: registration_updates_remain_pool_local
        let registry = registry();
        let mut first = attach_llama(&registry, 1, "fast.router.generate").await;
        let mut second = registry
            .attach(request(pool(2), "slow.router.generate", "mistral"))
            .await
            .unwrap();
        registry
            .replace_registrations(
                &mut first,
                vec![CanonicalModelRegistration::base(
                    model("llama"),
                    vec![alias("mistral-alias")],
                )],
            )
            .unwrap();
        assert!(
            registry
                .catalog()
                .pools()
                .all(|d| d.registrations[0].aliases() == [alias("mistral-alias")])
        );
        registry
            .replace_registrations(
                &mut second,
                vec![CanonicalModelRegistration::base(
                    model("mistral"),
                    vec![alias("llama-alias")],
                )],
            )
            .unwrap();
        let catalog = registry.catalog();
        assert_eq!(
            catalog.pool(pool(1)).unwrap().registrations[0].aliases(),
            [alias("mistral-alias")]
        );
        assert_eq!(
            catalog.pool(pool(2)).unwrap().registrations[0].aliases(),
            [alias("llama-alias")]
        );
        detach_all(&registry, [first, second]).await;
    }

    #[tokio::test]
    async fn invalid_registrations_and_roles_are_rejected_before_reserving() {
        let registry = registry();
        let cases: Vec<(AttachRequest, &str)> = vec![
            (
                {
                    let mut r = request(pool(1), "a.b.c", "llama");
                    r.registrations.clear();
                    r
                },
                "at least one canonical model",
            ),
            (
                {
                    let mut r = request(pool(1), "a.b.c", "llama");
                    r.registrations.push(registration("llama"));
                    r
                },
                "duplicate canonical model",
            ),
            (
                {
                    let mut r = request(pool(1), "a.b.c", "llama");
                    r.registrations.push(CanonicalModelRegistration::new(
                        model("llama"),
                        ModelTarget::Lora {
                            base_model: model("x"),
                            adapter: model("llama"),
                        },
                        vec![],
                    ));
                    r
                },
                "conflicting targets",
            ),
            (
                {
                    let mut r = request(pool(1), "a.b.c", "llama");
                    r.registrations.push(CanonicalModelRegistration::base(
                        model("mistral"),
                        vec![alias("llama")],
                    ));
                    r
                },
                "conflicts with a canonical model",
            ),
            (
                {
                    let mut r = request(pool(1), "a.b.c", "llama");
                    r.registrations.push(CanonicalModelRegistration::base(
                        model("mistral"),
                        vec![alias("llama-alias")],
                    ));
                    r
                },
                "claimed by both",
            ),
            (
                {
                    let mut r = request(pool(1), "a.b.c", "llama");
                    r.roles.clear();
                    r
                },
                "at least one declared worker role",
            ),
            (
                {
                    let mut r = request(pool(1), "a.b.c", "llama");
                    r.roles.push(WorkerRole::Aggregated);
                    r
                },
                "repeats declared worker role",
            ),
        ];
        for (req, message) in cases {
            let error = registry.attach(req).await.unwrap_err();
            assert!(
                error.to_string().contains(message),
                "{error} should mention {message}"
            );
        }
        assert_eq!(registry.stats().reservations, 0);
        assert_eq!(registry.catalog().revision(), 0);
    }

    #[tokio::test]
    async fn one_pool_cannot_be_owned_by_two_endpoints() {
        // spec: one_pool_cannot_be_owned_by_two_endpoints
        let registry = registry();
        let attachment = attach_llama(&registry, 1, "first.router.generate").await;
        let error = registry
            .attach(request(pool(1), "second.router.generate", "llama"))
            .await
            .unwrap_err();
        assert!(
            matches!(error, AttachError::PoolAlreadyOwned { .. }),
            "{error}"
        );
        assert!(error.to_string().contains("already owned"));
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn endpoint_reassignment_waits_for_prior_pool_removal() {
        // spec: endpoint_reassignment_waits_for_prior_pool_removal
        let registry = registry();
        let endpoint = "fast.router.generate";
        let first = registry
            .attach(request(pool(1), endpoint, "llama"))
            .await
            .unwrap();
        assert!(
            registry
                .withdraw(first.pool, first.generation, RetirementMode::Graceful)
                .await
        );
        assert!(registry.catalog().is_empty());
        let error = registry
            .attach(request(pool(2), endpoint, "llama"))
            .await
            .unwrap_err();
        assert!(error.to_string().contains("already assigned"), "{error}");
        assert!(registry.catalog().is_empty());

        registry.detach(first).await;
        let second = registry
            .attach(request(pool(2), endpoint, "llama"))
            .await
            .unwrap();
        let catalog = registry.catalog();
        assert_eq!(catalog.len(), 1);
        assert_eq!(
            catalog.pool(pool(2)).unwrap().serving_endpoint,
            endpoint.parse().unwrap()
        );
        registry.detach(second).await;
    }

    #[tokio::test]
    async fn cancelled_allocation_rolls_back_and_allows_reattach() {
        // spec: cancelled_allocation_rolls_back_and_allows_reattach
        let registry = registry();
        let gated = start_gated_attach(&registry).await;
        let attach = gated.attach;
        attach.abort();
        assert!(attach.await.unwrap_err().is_cancelled());
        assert_eq!(registry.stats().reservations, 0);

        gated.release.send(()).unwrap();
        within("builder finish", gated.finished).await.unwrap();
        let attachment = attach_llama(&registry, 1, "second.router.generate").await;
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn shutdown_during_allocation_never_publishes_the_pool() {
        // spec: shutdown_during_allocation_never_publishes_the_pool
        let registry = registry();
        let gated = start_gated_attach(&registry).await;
        let attach = gated.attach;
        let shutdown = tokio::spawn({
            let registry = registry.clone();
            async move { registry.shutdown().await }
        });
        wait_for("reservations cleared", || {
            registry.stats().reservations == 0
        })
        .await;
        assert!(registry.catalog().is_empty());

        gated.release.send(()).unwrap();
        within("builder finish", gated.finished).await.unwrap();
        let error = attach.await.unwrap().unwrap_err();
        assert!(
            error.to_string().contains("retired before commit"),
            "{error}"
        );
        within("shutdown", shutdown).await.unwrap();
        assert_eq!(registry.stats().pools, 0);
        assert!(registry.catalog().is_empty());
        assert_eq!(registry.stats().tasks, 0);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn filter_allocation_does_not_block_the_async_executor() {
        // spec: ckf_allocation_does_not_block_the_async_executor
        let registry = registry();
        let gated = start_gated_attach(&registry).await;
        let attach = gated.attach;
        // The single executor thread still runs other tasks while the builder blocks.
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move { tx.send(()).unwrap() });
        within("another task to run", rx).await.unwrap();

        gated.release.send(()).unwrap();
        let attachment = within("attach", attach).await.unwrap().unwrap();
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn failed_filter_build_rolls_back_the_pool_reservation() {
        // spec: failed_actor_build_rolls_back_the_pool_reservation
        let registry = registry();
        let mut first = request(pool(1), "first.router.generate", "llama");
        first.expected_unique_blocks = 0;
        let mut second = request(pool(1), "second.router.generate", "llama");
        second.expected_unique_blocks = 0;
        let first_error = registry.attach(first).await.unwrap_err();
        let second_error = registry.attach(second).await.unwrap_err();
        assert!(
            first_error.to_string().contains("greater than zero"),
            "{first_error}"
        );
        assert!(
            second_error.to_string().contains("greater than zero"),
            "{second_error}"
        );
        assert_eq!(registry.stats().pools, 0);
        assert_eq!(registry.stats().reservations, 0);
        assert_eq!(registry.catalog().revision(), 0);
    }

    #[tokio::test]
    async fn reattaching_a_pool_allocates_a_new_layout_generation() {
        // spec: reattaching_a_pool_allocates_a_new_layout_generation
        let registry = registry();
        let first = attach_llama(&registry, 1, "fast.router.generate").await;
        let first_generation = first.generation;
        registry.detach(first).await;
        let replacement = attach_llama(&registry, 1, "fast.router.generate").await;
        assert!(replacement.generation > first_generation);
        registry.detach(replacement).await;
    }

    #[tokio::test]
    async fn relay_incarnation_fences_an_identical_pool_layout() {
        // spec: relay_incarnation_fences_an_identical_pool_layout
        let first_registry = PoolRegistry::new(RegistryConfig {
            relay: DcRelayIdentity::new(11, 7),
            limits: test_limits(),
        })
        .unwrap();
        let second_registry = PoolRegistry::new(RegistryConfig {
            relay: DcRelayIdentity::new(11, 8),
            limits: test_limits(),
        })
        .unwrap();
        let first = attach_llama(&first_registry, 1, "fast.router.generate").await;
        let second = attach_llama(&second_registry, 1, "fast.router.generate").await;
        assert_ne!(first.identity(), second.identity());
        assert_eq!(first.generation, second.generation);
        first_registry.detach(first).await;
        second_registry.detach(second).await;
    }

    #[tokio::test]
    async fn withdraw_removes_catalog_before_actor_retirement() {
        // spec: withdraw_removes_catalog_before_actor_retirement
        let registry = registry();
        let attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        assert!(
            registry
                .withdraw(
                    attachment.pool,
                    attachment.generation,
                    RetirementMode::Graceful
                )
                .await
        );
        assert!(registry.catalog().is_empty());
        assert!(attachment.generation_cancel.is_cancelled());
        attachment.actor.stats().await.unwrap();
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn adapter_registration_changes_without_replacing_pool_generation() {
        // spec: adapter_registration_changes_without_replacing_pool_generation
        let registry = registry();
        let mut attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        let generation = attachment.generation;
        let revision = registry.catalog().revision();
        registry
            .replace_registrations(
                &mut attachment,
                vec![
                    CanonicalModelRegistration::base(model("llama"), vec![]),
                    CanonicalModelRegistration::new(
                        model("tenant-a"),
                        ModelTarget::Lora {
                            base_model: model("llama"),
                            adapter: model("tenant-a"),
                        },
                        vec![],
                    ),
                ],
            )
            .unwrap();
        assert_eq!(attachment.generation, generation);
        let catalog = registry.catalog();
        assert_eq!(catalog.revision(), revision + 1);
        assert!(
            catalog
                .pool(pool(1))
                .unwrap()
                .registrations
                .iter()
                .any(|r| r.model() == &model("tenant-a"))
        );
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn declared_role_change_updates_catalog_without_replacing_generation() {
        // spec: declared_role_change_updates_catalog_without_replacing_generation
        let registry = registry();
        let mut attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        let producer = attachment.identity();
        registry
            .replace_roles(&mut attachment, vec![WorkerRole::Decode])
            .unwrap();
        let catalog = registry.catalog();
        assert_eq!(catalog.pool(pool(1)).unwrap().producer, producer);
        assert_eq!(
            catalog.pool(pool(1)).unwrap().pool_roles.as_ref(),
            [WorkerRole::Decode]
        );
        assert!(registry.replace_roles(&mut attachment, Vec::new()).is_err());
        assert_eq!(
            registry
                .catalog()
                .pool(pool(1))
                .unwrap()
                .pool_roles
                .as_ref(),
            [WorkerRole::Decode]
        );
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn one_lora_target_binds_to_independent_pools() {
        // spec: one_lora_target_binds_to_independent_pools
        let registry = registry();
        let lora = ModelTarget::Lora {
            base_model: model("llama"),
            adapter: model("tenant-a"),
        };
        let registrations = || {
            vec![
                CanonicalModelRegistration::base(model("llama"), vec![]),
                CanonicalModelRegistration::new(model("tenant-a"), lora.clone(), vec![]),
            ]
        };
        let mut first = request(pool(1), "fast.router.generate", "llama");
        first.registrations = registrations();
        let mut second = request(pool(2), "slow.router.generate", "llama");
        second.registrations = registrations();
        let first = registry.attach(first).await.unwrap();
        let second = registry.attach(second).await.unwrap();
        let catalog = registry.catalog();
        assert_eq!(catalog.len(), 2);
        assert!(
            catalog
                .pools()
                .all(|d| d.registrations.iter().any(|r| r.target() == &lora))
        );
        detach_all(&registry, [first, second]).await;
    }

    #[tokio::test]
    async fn fencing_withdraws_pool_from_catalog() {
        // spec: fencing_withdraws_pool_from_catalog
        let registry = registry();
        let attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        let actor = attachment.actor.clone();
        registry.retire(attachment, RetirementMode::Fenced).await;
        assert!(registry.watch_catalog().borrow().is_empty());
        assert!(actor.is_stopped());
        assert_eq!(registry.stats().pools, 0);
    }

    #[tokio::test]
    async fn fencing_withdraws_only_the_target_pool_descriptor() {
        // spec: fencing_withdraws_only_the_target_pool_descriptor
        let registry = registry();
        let with_alias = attach_llama(&registry, 1, "fast.router.generate").await;
        let mut req = request(pool(2), "slow.router.generate", "llama");
        req.registrations = vec![CanonicalModelRegistration::base(model("llama"), vec![])];
        let without_alias = registry.attach(req).await.unwrap();
        registry.retire(with_alias, RetirementMode::Fenced).await;
        let catalog = registry.catalog();
        assert_eq!(catalog.len(), 1);
        assert!(
            catalog.pool(pool(2)).unwrap().registrations[0]
                .aliases()
                .is_empty()
        );
        registry.detach(without_alias).await;
    }

    #[tokio::test]
    async fn publication_hub_is_lazy_and_shared_by_concurrent_subscribers() {
        // spec: publication_hub_is_lazy_and_shared_by_concurrent_subscribers
        let registry = registry();
        let attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        let producer = attachment.identity();
        assert_eq!(phase(&registry, attachment.generation), "vacant");
        let tasks: Vec<_> = (0..8)
            .map(|_| {
                let registry = registry.clone();
                tokio::spawn(async move { registry.subscribe(producer).await })
            })
            .collect();
        let mut subscriptions = Vec::new();
        for task in tasks {
            let subscription = within("subscribe", task).await.unwrap().unwrap();
            assert_eq!(subscription.identity(), producer);
            subscriptions.push(subscription);
        }
        assert_eq!(phase(&registry, attachment.generation), "ready");
        assert_eq!(
            hubs_in_use(&registry),
            1,
            "one hub shared by all subscribers"
        );
        drop(subscriptions);
        let generation = attachment.generation;
        registry.detach(attachment).await;
        assert_eq!(phase(&registry, generation), "retired");
        assert_eq!(hubs_in_use(&registry), 0);
    }

    #[tokio::test]
    async fn initialized_hub_limit_protects_active_hubs_and_reclaims_idle_hubs() {
        // spec: initialized_hub_limit_protects_active_hubs_and_reclaims_idle_hubs
        let registry = hub_limited(1, Gates::default());
        let first = attach_llama(&registry, 1, "fast.router.generate").await;
        let second = attach_llama(&registry, 2, "slow.router.generate").await;

        let first_subscription = registry.subscribe(first.identity()).await.unwrap();
        let error = registry.subscribe(second.identity()).await.unwrap_err();
        assert_eq!(error, SubscribeError::InitializedHubLimit { limit: 1 });

        drop(first_subscription);
        let second_subscription = registry.subscribe(second.identity()).await.unwrap();
        assert_eq!(phase(&registry, first.generation), "vacant");
        assert_eq!(phase(&registry, second.generation), "ready");
        assert_eq!(
            registry.catalog().len(),
            2,
            "eviction never touches the catalog"
        );

        drop(second_subscription);
        let reopened = registry.subscribe(first.identity()).await.unwrap();
        assert_eq!(phase(&registry, first.generation), "ready");
        assert_eq!(phase(&registry, second.generation), "vacant");
        drop(reopened);
        detach_all(&registry, [first, second]).await;
        assert_eq!(hubs_in_use(&registry), 0);
    }

    #[tokio::test]
    async fn pending_admission_prevents_idle_hub_eviction() {
        // spec: pending_admission_prevents_idle_hub_eviction
        let registry = hub_limited(1, Gates::default());
        let first = attach_llama(&registry, 1, "fast.router.generate").await;
        let second = attach_llama(&registry, 2, "slow.router.generate").await;
        drop(registry.subscribe(first.identity()).await.unwrap());
        let admission = registry
            .inner
            .core
            .lock()
            .begin_admission(&first.identity())
            .unwrap();

        let error = registry.subscribe(second.identity()).await.unwrap_err();
        assert_eq!(error, SubscribeError::InitializedHubLimit { limit: 1 });
        assert_eq!(phase(&registry, first.generation), "ready");

        registry
            .inner
            .core
            .lock()
            .end_admission(admission.generation);
        let subscription = registry.subscribe(second.identity()).await.unwrap();
        assert_eq!(phase(&registry, first.generation), "vacant");
        drop(subscription);
        detach_all(&registry, [first, second]).await;
    }

    #[tokio::test]
    async fn concurrent_pressure_claims_one_idle_victim() {
        // spec: concurrent_pressure_claims_one_idle_victim
        let (registry, eviction_gate) = eviction_gated_single_hub();
        let first = attach_llama(&registry, 1, "first.router.generate").await;
        let second = attach_llama(&registry, 2, "second.router.generate").await;
        let third = attach_llama(&registry, 3, "third.router.generate").await;
        let second_subscribe = claim_idle_hub(&registry, &first, &second).await;
        let third_subscribe = spawn_subscribe(&registry, third.identity());
        eviction_gate.add_permits(1);

        let second_subscription = within("second", second_subscribe).await.unwrap().unwrap();
        let third_error = within("third", third_subscribe).await.unwrap().unwrap_err();
        assert_eq!(
            third_error,
            SubscribeError::InitializedHubLimit { limit: 1 }
        );
        assert_eq!(phase(&registry, first.generation), "vacant");
        assert_eq!(hubs_in_use(&registry), 1);

        drop(second_subscription);
        detach_all(&registry, [first, second, third]).await;
        assert_eq!(hubs_in_use(&registry), 0);
    }

    #[tokio::test]
    async fn generation_retirement_wins_idle_eviction_race() {
        // spec: generation_retirement_wins_idle_eviction_race
        let (registry, eviction_gate) = eviction_gated_single_hub();
        let first = attach_llama(&registry, 1, "first.router.generate").await;
        let second = attach_llama(&registry, 2, "second.router.generate").await;
        let second_subscribe = claim_idle_hub(&registry, &first, &second).await;

        assert!(registry.fence_generation(
            first.pool,
            first.generation,
            "test retirement during idle eviction"
        ));
        eviction_gate.add_permits(1);
        let second_subscription = within("second", second_subscribe).await.unwrap().unwrap();
        wait_for("the victim to retire", || {
            phase(&registry, first.generation) == "retired"
        })
        .await;

        drop(second_subscription);
        detach_all(&registry, [first, second]).await;
        assert_eq!(hubs_in_use(&registry), 0);
    }

    #[tokio::test]
    async fn requester_retirement_does_not_abandon_claimed_idle_eviction() {
        // spec: requester_retirement_does_not_abandon_claimed_idle_eviction
        let (registry, eviction_gate) = eviction_gated_single_hub();
        let first = attach_llama(&registry, 1, "first.router.generate").await;
        let second = attach_llama(&registry, 2, "second.router.generate").await;
        let third = attach_llama(&registry, 3, "third.router.generate").await;
        let second_subscribe = claim_idle_hub(&registry, &first, &second).await;

        assert!(registry.fence_generation(
            second.pool,
            second.generation,
            "test requester retirement"
        ));
        let error = within("the requester to give up", second_subscribe)
            .await
            .unwrap()
            .unwrap_err();
        assert!(
            matches!(
                error,
                SubscribeError::Unavailable {
                    reason: crate::Unavailability::Retired
                }
            ),
            "{error}"
        );
        wait_for("the requester slot to retire", || {
            phase(&registry, second.generation) == "retired"
        })
        .await;
        assert_eq!(phase(&registry, first.generation), "evicting");

        eviction_gate.add_permits(1);
        wait_for("the victim and its capacity to be released", || {
            phase(&registry, first.generation) == "vacant" && hubs_in_use(&registry) == 0
        })
        .await;
        let third_subscription = registry.subscribe(third.identity()).await.unwrap();
        assert_eq!(hubs_in_use(&registry), 1);

        drop(third_subscription);
        detach_all(&registry, [first, second, third]).await;
        assert_eq!(hubs_in_use(&registry), 0);
    }

    #[tokio::test]
    async fn terminal_hub_failure_withdraws_catalog_and_load_visibility() {
        // spec: terminal_hub_failure_withdraws_catalog_and_load_visibility
        let registry = registry();
        let attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
        assert_eq!(registry.catalog().len(), 1);
        assert_eq!(registry.load().len(), 1);

        registry.inner.encoding.close();
        attachment.actor.submit(stored_event(1)).await.unwrap();
        attachment.actor.flush().await.unwrap();
        within(
            "the generation to be fenced",
            attachment.generation_cancel.cancelled(),
        )
        .await;
        assert!(registry.catalog().is_empty());
        assert!(registry.load().is_empty());
        assert!(subscription.next_frame().await.is_err());
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn stale_generation_cannot_fence_or_initialize_replacement_hub() {
        // spec: stale_generation_cannot_fence_or_initialize_replacement_hub
        let registry = registry();
        let first = attach_llama(&registry, 1, "fast.router.generate").await;
        let stale_generation = first.generation;
        let stale_producer = first.identity();
        registry.detach(first).await;

        let replacement = attach_llama(&registry, 1, "fast.router.generate").await;
        let current = replacement.identity();
        assert_ne!(stale_producer, current);
        assert!(!registry.fence_generation(pool(1), stale_generation, "stale terminal callback"));
        assert!(!replacement.generation_cancel.is_cancelled());
        assert_eq!(registry.catalog().len(), 1);

        assert!(matches!(
            registry.validate_active_producer(&stale_producer),
            Err(SubscribeError::ProducerMismatch { pool: p, .. }) if p == pool(1)
        ));
        let token = registry.validate_active_producer(&current).unwrap();
        assert!(!token.is_cancelled());
        let error = registry.subscribe(stale_producer).await.unwrap_err();
        assert!(
            matches!(error, SubscribeError::ProducerMismatch { .. }),
            "{error}"
        );
        assert_eq!(phase(&registry, replacement.generation), "vacant");

        let subscription = registry.subscribe(current).await.unwrap();
        assert_eq!(subscription.identity(), current);
        assert_eq!(phase(&registry, replacement.generation), "ready");
        drop(subscription);
        registry.detach(replacement).await;
        assert!(token.is_cancelled());
    }

    #[tokio::test]
    async fn delta_published_before_snapshot_is_consumed_still_follows_it() {
        // spec: publication_source_streams_snapshot_before_concurrent_delta
        let registry = registry();
        let attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        let producer = attachment.identity();
        let mut subscription = registry.subscribe(producer).await.unwrap();
        attachment.actor.submit(stored_event(1)).await.unwrap();
        attachment.actor.flush().await.unwrap();

        let snapshot = within("snapshot", subscription.next_frame()).await.unwrap();
        assert_eq!(snapshot.kind, PoolFrameKind::SnapshotChunk);
        assert_eq!(snapshot.base_sequence, snapshot.sequence);
        let delta = within("delta", subscription.next_frame()).await.unwrap();
        assert_eq!(delta.kind, PoolFrameKind::Delta);
        assert_eq!(delta.base_sequence, snapshot.sequence);
        assert_eq!(delta.sequence, snapshot.sequence + 1);
        drop(subscription);
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn retired_generation_ends_its_streams_and_refuses_stale_producers() {
        // spec: publication_source_limit_and_retirement_are_generation_safe
        let registry = registry_with(
            Limits {
                stream: crate::StreamLimits {
                    max_subscribers: 1,
                    ..crate::StreamLimits::default()
                },
                ..test_limits()
            },
            Gates::default(),
        );
        let first = attach_llama(&registry, 1, "fast.router.generate").await;
        let stale = first.identity();
        let mut stream = registry.subscribe(stale).await.unwrap();
        let error = registry.subscribe(stale).await.unwrap_err();
        assert_eq!(
            error,
            SubscribeError::SubscriberLimit {
                pool: pool(1),
                limit: 1
            }
        );

        registry.detach(first).await;
        assert_eq!(
            next_end(&mut stream).await,
            SubscriptionEnd::ProducerWithdrawn
        );
        drop(stream);

        let replacement = attach_llama(&registry, 1, "fast.router.generate").await;
        let error = registry.subscribe(stale).await.unwrap_err();
        assert!(
            matches!(error, SubscribeError::ProducerMismatch { .. }),
            "{error}"
        );
        let current = registry.subscribe(replacement.identity()).await.unwrap();
        registry.shutdown().await;
        drop(current);
        drop(replacement);
    }

    /// A subscriber whose hub initialisation is held at the (closed) initialisation gate.
    struct GatedInitialization {
        registry: PoolRegistry,
        attachment: PoolAttachment,
        subscriber: tokio::task::JoinHandle<Result<crate::PoolSubscription, SubscribeError>>,
        _gate: Arc<Semaphore>,
    }

    async fn gated_initialization() -> GatedInitialization {
        let (initialization, gate) = closed_gate();
        let registry = registry_with(
            test_limits(),
            Gates {
                initialization,
                ..Gates::default()
            },
        );
        let attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        let generation = attachment.generation;
        let subscriber = spawn_subscribe(&registry, attachment.identity());
        wait_for("initialisation to start", || {
            phase(&registry, generation) == "initializing"
        })
        .await;
        GatedInitialization {
            registry,
            attachment,
            subscriber,
            _gate: gate,
        }
    }

    #[tokio::test]
    async fn retirement_cancels_in_flight_hub_initialization() {
        // spec: retirement_cancels_in_flight_hub_initialization
        let gated = gated_initialization().await;
        let registry = gated.registry;
        let generation = gated.attachment.generation;
        within("detach", registry.detach(gated.attachment)).await;
        assert!(
            within("subscriber", gated.subscriber)
                .await
                .unwrap()
                .is_err()
        );
        assert_eq!(phase(&registry, generation), "retired");
        assert_eq!(registry.stats().pools, 0);
        assert!(registry.catalog().is_empty());
        assert_eq!(hubs_in_use(&registry), 0);
    }

    #[tokio::test]
    async fn cancellation_after_actor_snapshot_retires_the_publication_lease() {
        // spec: cancellation_after_actor_snapshot_retires_the_publication_lease
        let (post_snapshot, _gate) = closed_gate();
        let registry = registry_with(
            test_limits(),
            Gates {
                post_snapshot,
                ..Gates::default()
            },
        );
        let attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        let generation = attachment.generation;
        let subscriber = spawn_subscribe(&registry, attachment.identity());
        wait_for("the actor to be attached", || {
            phase(&registry, generation) == "initializing"
        })
        .await;
        // The lease is live once the actor sequences a delta.
        let mut event_id = 1;
        within("the lease to become active", async {
            loop {
                attachment
                    .actor
                    .submit(stored_event(event_id))
                    .await
                    .unwrap();
                attachment.actor.flush().await.unwrap();
                if attachment.actor.stats().await.unwrap().publications > 0 {
                    break;
                }
                event_id += 1;
                tokio::task::yield_now().await;
            }
        })
        .await;

        attachment.generation_cancel.cancel();
        assert!(within("subscriber", subscriber).await.unwrap().is_err());
        wait_for("the slot to retire", || {
            phase(&registry, generation) == "retired"
        })
        .await;
        // Let the actor process the detach before measuring.
        attachment.actor.flush().await.unwrap();
        let before = attachment.actor.stats().await.unwrap().publications;
        attachment
            .actor
            .submit(stored_event(event_id + 1))
            .await
            .unwrap();
        attachment.actor.flush().await.unwrap();
        let stats = attachment.actor.stats().await.unwrap();
        assert_eq!(stats.publications, before, "the abandoned hub gets nothing");
        assert!(!stats.publishing);
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn local_only_pool_publishes_no_serving_facts() {
        // spec: local_only_pool_publishes_no_serving_facts
        let registry = registry();
        let mut req = request(pool(1), "fast.router.generate", "llama");
        req.load_capacity = None;
        let attachment = registry.attach(req).await.unwrap();
        assert_eq!(registry.catalog().len(), 1);
        assert!(registry.load().is_empty());
        assert!(
            !registry
                .replace_load_capacity(attachment.pool, attachment.generation, &[])
                .unwrap()
        );
        assert!(!registry.observe_load(
            attachment.pool,
            attachment.generation,
            LoadObservation::default()
        ));
        attachment.actor.stats().await.unwrap();
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn invalid_load_capacity_does_not_block_pool_attach() {
        // spec: invalid_load_capacity_does_not_block_pool_attach
        let registry = registry();
        let req = with_capacity(
            request(pool(1), "fast.router.generate", "llama"),
            vec![WorkerCapacity {
                data_parallel_size: 0,
                ..WorkerCapacity::single_rank(1, Some(100))
            }],
        );
        let attachment = registry.attach(req).await.unwrap();
        assert_eq!(registry.catalog().len(), 1);
        let load = registry.load();
        assert_eq!(load.len(), 1);
        assert_eq!(load[0].kv_used_blocks, None);
        assert_eq!(load[0].total_kv_blocks, None);
        assert_eq!(load[0].kv_expected_ranks, 0);
        assert!(load[0].has_degraded_coverage());
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn scheduler_only_load_is_accepted_without_changing_snapshot() {
        // spec: scheduler_only_load_is_accepted_without_changing_snapshot
        let registry = registry();
        let req = with_capacity(
            request(pool(1), "fast.router.generate", "llama"),
            vec![WorkerCapacity::single_rank(1, Some(100))],
        );
        let attachment = registry.attach(req).await.unwrap();
        let before = registry.load();
        let watch = registry.watch_load();
        assert!(!watch.has_changed().unwrap());
        assert!(registry.observe_load(
            attachment.pool,
            attachment.generation,
            LoadObservation {
                worker_id: 1,
                dp_rank: 0,
                active_decode_blocks: Some(30),
                active_prefill_tokens: Some(512),
                ..LoadObservation::default()
            },
        ));
        assert_eq!(registry.load(), before);
        assert!(!watch.has_changed().unwrap());
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn invalid_capacity_refresh_withdraws_authoritative_load_snapshot() {
        // spec: invalid_capacity_refresh_withdraws_authoritative_load_snapshot
        let registry = registry();
        let req = with_capacity(
            request(pool(1), "fast.router.generate", "llama"),
            vec![WorkerCapacity::single_rank(1, Some(100))],
        );
        let attachment = registry.attach(req).await.unwrap();
        assert!(registry.observe_load(
            attachment.pool,
            attachment.generation,
            LoadObservation {
                worker_id: 1,
                dp_rank: 0,
                kv_used_blocks: Some(40),
                ..LoadObservation::default()
            },
        ));
        assert!(!registry.load()[0].has_degraded_coverage());
        let mut watch = registry.watch_load();

        let error = registry
            .replace_load_capacity(
                attachment.pool,
                attachment.generation,
                &[WorkerCapacity {
                    data_parallel_size: 0,
                    ..WorkerCapacity::single_rank(1, Some(100))
                }],
            )
            .unwrap_err();
        assert!(
            error.to_string().contains("zero data_parallel_size"),
            "{error}"
        );
        assert!(watch.has_changed().unwrap());
        let load = watch.borrow_and_update().clone();
        assert_eq!(load.len(), 1);
        assert_eq!(load[0].kv_used_blocks, None);
        assert_eq!(load[0].total_kv_blocks, None);
        assert_eq!(load[0].kv_expected_ranks, 0);
        assert!(load[0].has_degraded_coverage());
        assert_eq!(registry.catalog().len(), 1);
        registry.detach(attachment).await;
    }

    #[tokio::test]
    async fn load_is_generation_scoped_and_withdrawn_with_the_pool() {
        // spec: load_is_generation_scoped_and_withdrawn_with_the_pool
        let registry = registry();
        let req = with_capacity(
            request(pool(1), "fast.router.generate", "llama"),
            vec![WorkerCapacity::single_rank(1, Some(100))],
        );
        let attachment = registry.attach(req).await.unwrap();
        let old_generation = attachment.generation;
        let old_producer = attachment.identity();
        let initial = registry.load();
        assert_eq!(initial.len(), 1);
        assert_eq!(initial[0].kv_expected_ranks, 1);
        assert_eq!(initial[0].kv_observed_ranks, 0);
        assert_eq!(initial[0].kv_used_blocks, None);
        assert_eq!(initial[0].total_kv_blocks, Some(100));
        assert!(initial[0].has_degraded_coverage());

        let observation = LoadObservation {
            worker_id: 1,
            dp_rank: 0,
            kv_used_blocks: Some(40),
            active_decode_blocks: Some(30),
            active_prefill_tokens: Some(512),
        };
        assert!(registry.observe_load(pool(1), old_generation, observation));
        let observed = registry.load()[0];
        assert_eq!(observed.kv_used_blocks, Some(40));
        assert_eq!(observed.total_kv_blocks, Some(100));
        assert!(!observed.has_degraded_coverage());

        assert!(
            registry
                .withdraw(pool(1), old_generation, RetirementMode::Graceful)
                .await
        );
        assert!(registry.load().is_empty());
        assert!(!registry.observe_load(
            pool(1),
            old_generation,
            LoadObservation {
                kv_used_blocks: Some(99),
                ..observation
            }
        ));
        registry.detach(attachment).await;

        let replacement = attach_llama(&registry, 1, "fast.router.generate").await;
        assert_ne!(replacement.generation, old_generation);
        assert_ne!(replacement.identity(), old_producer);
        assert!(
            !registry
                .replace_load_capacity(
                    pool(1),
                    old_generation,
                    &[WorkerCapacity::single_rank(1, Some(999))]
                )
                .unwrap()
        );
        assert_eq!(registry.load()[0].kv_expected_ranks, 0);
        registry.detach(replacement).await;
    }

    #[tokio::test]
    async fn dropping_the_last_registry_handle_ends_every_task() {
        let registry = registry();
        let subscribed = attach_llama(&registry, 1, "fast.router.generate").await;
        let idle = registry
            .attach(request(pool(2), "slow.router.generate", "mistral"))
            .await
            .unwrap();
        let mut subscription = registry.subscribe(subscribed.identity()).await.unwrap();
        assert_eq!(phase(&registry, subscribed.generation), "ready");
        let tracker = registry.inner.tracker.clone();
        assert!(tracker.len() >= 3, "two actors and one hub are running");

        // The owner keeps its attachments and subscription but drops every handle.
        drop(registry);
        within("every registry task to end", tracker.wait()).await;
        assert!(tracker.is_empty());
        for attachment in [&subscribed, &idle] {
            assert!(attachment.actor.is_stopped());
            assert!(attachment.generation_cancel.is_cancelled());
        }
        assert!(
            subscribed.actor.submit(stored_event(1)).await.is_err(),
            "a stopped actor refuses events"
        );
        assert_eq!(
            next_end(&mut subscription).await,
            SubscriptionEnd::ShuttingDown
        );
    }

    #[tokio::test]
    async fn dropping_the_last_handle_abandons_a_gated_hub_initialisation() {
        let gated = gated_initialization().await;
        gated.subscriber.abort();
        assert!(within("subscriber", gated.subscriber).await.is_err());
        let tracker = gated.registry.inner.tracker.clone();

        // The initialisation task holds the registry but not the owner's guard.
        drop(gated.registry);
        within("every registry task to end", tracker.wait()).await;
        assert!(gated.attachment.actor.is_stopped());
    }

    #[tokio::test]
    async fn dropping_one_registry_clone_keeps_the_registry_running() {
        let registry = registry();
        let attachment = attach_llama(&registry, 1, "fast.router.generate").await;
        drop(registry.clone());
        assert!(!registry.inner.shutdown.is_cancelled());
        assert!(!attachment.actor.is_stopped());
        let mut subscription = registry.subscribe(attachment.identity()).await.unwrap();
        let snapshot = subscription.next_frame().await.unwrap();
        assert_eq!(snapshot.kind, PoolFrameKind::SnapshotChunk);
        attachment.actor.submit(stored_event(1)).await.unwrap();
        attachment.actor.flush().await.unwrap();
        let delta = within("a delta", subscription.next_frame()).await.unwrap();
        assert_eq!(delta.kind, PoolFrameKind::Delta);
        registry.detach(attachment).await;
        registry.shutdown().await;
    }
}
