//! The watch loop over the memory backend, on a paused clock.

use std::time::Duration;

use kvrelay_identity::EndpointId;

use super::*;
use crate::instance::ModelCardInstanceId;
use crate::memory::MemoryDiscovery;

fn card(endpoint: &str, worker: u64) -> ModelCardInstance {
    ModelCardInstance {
        id: ModelCardInstanceId {
            namespace: "prod".into(),
            component: "backend".into(),
            endpoint: endpoint.into(),
            instance_id: worker,
            model_suffix: None,
        },
        card_json: serde_json::json!({
            "display_name": "llama", "kv_cache_block_size": 16, "worker_type": "aggregated"
        }),
    }
}

fn scope() -> DiscoveryScope {
    DiscoveryScope {
        namespaces: vec!["prod".into()],
        ..DiscoveryScope::default()
    }
}

fn endpoint(name: &str) -> EndpointId {
    EndpointId::new("prod", "backend", name).unwrap()
}

async fn start(discovery: &Arc<MemoryDiscovery>) -> MembershipWatch {
    let discovery: Arc<dyn Discovery> = discovery.clone();
    MembershipWatch::start(
        discovery,
        &scope(),
        WatchConfig::default(),
        &CancellationToken::new(),
    )
    .await
    .unwrap()
}

/// Waits (bounded) for a view satisfying `accept`.
async fn wait_for(
    subscription: &mut MembershipSubscription,
    accept: impl Fn(&MembershipView) -> bool,
) -> MembershipView {
    let current = subscription.current();
    if accept(&current) {
        return current;
    }
    tokio::time::timeout(Duration::from_secs(600), async {
        loop {
            let view = subscription.changed().await.expect("watch stopped");
            if accept(&view) {
                return view;
            }
        }
    })
    .await
    .expect("no matching membership view within the deadline")
}

#[tokio::test(start_paused = true)]
async fn initial_listing_is_the_first_view() {
    let discovery = Arc::new(MemoryDiscovery::new());
    discovery.put(card("generate", 1));
    let watch = start(&discovery).await;
    assert!(watch.view().endpoint(&endpoint("generate")).is_some());
    watch.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn invalid_scope_is_rejected_before_listing() {
    let discovery: Arc<dyn Discovery> = Arc::new(MemoryDiscovery::new());
    let result = MembershipWatch::start(
        discovery,
        &DiscoveryScope::default(),
        WatchConfig::default(),
        &CancellationToken::new(),
    )
    .await;
    assert_eq!(
        result.err(),
        Some(MembershipWatchError::Config(DiscoveryScopeError::NoScope))
    );
}

#[tokio::test(start_paused = true)]
async fn failed_initial_listing_fails_start() {
    let discovery = Arc::new(MemoryDiscovery::new());
    discovery.fail_next_opens(1);
    let dyn_discovery: Arc<dyn Discovery> = discovery.clone();
    let result = MembershipWatch::start(
        dyn_discovery,
        &scope(),
        WatchConfig::default(),
        &CancellationToken::new(),
    )
    .await;
    assert!(matches!(result, Err(MembershipWatchError::Discovery(_))));
}

#[tokio::test(start_paused = true)]
async fn added_and_removed_cards_publish_new_views() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let watch = start(&discovery).await;
    let mut subscription = watch.subscribe();
    discovery.put(card("generate", 1));
    wait_for(&mut subscription, |view| view.len() == 1).await;
    discovery.remove(&card("generate", 1).id);
    wait_for(&mut subscription, MembershipView::is_empty).await;
    watch.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn cards_of_other_namespaces_are_not_watched() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let watch = start(&discovery).await;
    let mut subscription = watch.subscribe();
    let mut other = card("generate", 1);
    other.id.namespace = "staging".into();
    discovery.put(other);
    discovery.put(card("marker", 2));
    let view = wait_for(&mut subscription, |view| !view.is_empty()).await;
    assert_eq!(view.len(), 1);
    assert!(view.endpoint(&endpoint("marker")).is_some());
    watch.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn closed_watch_rebinds_and_reconciles_missed_changes() {
    let discovery = Arc::new(MemoryDiscovery::new());
    discovery.put(card("stale", 1));
    let watch = start(&discovery).await;
    let mut subscription = watch.subscribe();
    // Changes the watch never hears about, then the watch breaks.
    discovery.remove_unannounced(&card("stale", 1).id);
    discovery.put_unannounced(card("fresh", 2));
    discovery.close_watches();
    let view = wait_for(&mut subscription, |view| {
        view.endpoint(&endpoint("fresh")).is_some()
    })
    .await;
    assert!(view.endpoint(&endpoint("stale")).is_none());
    assert_eq!(discovery.n_opens(), 2);
    watch.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn rebinding_backs_off_exponentially_up_to_the_cap() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let watch = start(&discovery).await;
    let mut subscription = watch.subscribe();
    let began = tokio::time::Instant::now();
    discovery.fail_next_opens(8);
    discovery.put_unannounced(card("after-outage", 1));
    discovery.close_watches();
    wait_for(&mut subscription, |view| !view.is_empty()).await;
    // 1 initial open + 8 failures + 1 success; delays 0.1+0.2+0.4+0.8+1.6+3.2+5+5+5 s.
    assert_eq!(discovery.n_opens(), 10);
    assert_eq!(began.elapsed(), Duration::from_millis(21_300));
    watch.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn periodic_reconcile_heals_a_missed_event() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let watch = start(&discovery).await;
    let mut subscription = watch.subscribe();
    let began = tokio::time::Instant::now();
    discovery.put_unannounced(card("missed", 1));
    wait_for(&mut subscription, |view| !view.is_empty()).await;
    assert_eq!(began.elapsed(), DEFAULT_RECONCILE_INTERVAL);
    assert_eq!(discovery.n_opens(), 1);
    watch.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn taint_update_reaches_the_view() {
    let discovery = Arc::new(MemoryDiscovery::new());
    discovery.put(card("generate", 1));
    let watch = start(&discovery).await;
    let mut subscription = watch.subscribe();
    discovery.update_taints(&card("generate", 1).id, vec!["drain".into()]);
    wait_for(&mut subscription, |view| {
        view.endpoint(&endpoint("generate"))
            .is_some_and(|membership| membership.runtime_configs[&1].taints.contains("drain"))
    })
    .await;
    watch.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_the_task_and_ends_subscriptions() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let watch = start(&discovery).await;
    let mut subscription = watch.subscribe();
    watch.shutdown().await;
    assert!(subscription.changed().await.is_none());
}

#[tokio::test(start_paused = true)]
async fn a_malformed_card_alone_is_counted_at_once() {
    // The malformed card changes no card, so the view does not change; the counter must
    // still move without waiting for another change or the reconcile.
    let discovery = Arc::new(MemoryDiscovery::new());
    discovery.put(card("good", 2));
    let watch = start(&discovery).await;
    let mut bad = card("bad", 1);
    bad.card_json = serde_json::json!({"display_name": 7});
    discovery.put(bad);
    for _ in 0..100 {
        if watch.stats().malformed_cards == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(watch.stats().malformed_cards, 1);
    assert!(watch.view().endpoint(&endpoint("bad")).is_none());
    watch.shutdown().await;
}

#[tokio::test(start_paused = true)]
async fn malformed_card_is_counted_and_skipped() {
    let discovery = Arc::new(MemoryDiscovery::new());
    let watch = start(&discovery).await;
    let mut subscription = watch.subscribe();
    let mut bad = card("bad", 1);
    bad.card_json = serde_json::json!({"display_name": 7});
    discovery.put(bad);
    discovery.put(card("good", 2));
    wait_for(&mut subscription, |view| !view.is_empty()).await;
    assert_eq!(watch.stats().malformed_cards, 1);
    assert!(watch.view().endpoint(&endpoint("bad")).is_none());
    watch.shutdown().await;
}
