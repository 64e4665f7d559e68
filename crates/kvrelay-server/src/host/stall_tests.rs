//! A stalled pool actor (test hook) makes `/readyz` answer 503 naming the pool and
//! withholds the pool from the advertised catalog; once the actor progresses, both
//! recover.

#![allow(clippy::unwrap_used, clippy::panic, reason = "tests")]

use std::time::Duration;

use kvrelay_ckf::{EventPayload, RouterEvent, StoredBlock, StoredBlocks};

use super::Relay;
use crate::admin::AdminView;
use crate::admin::tests::get;
use crate::config::{RelayConfig, WorkloadConfig};
use crate::host::admin_view::HostAdminView;

const DEADLINE: Duration = Duration::from_secs(30);

fn config(dir: &std::path::Path) -> RelayConfig {
    let cards = dir.join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    let record = serde_json::json!({
        "type": "Model", "namespace": "prod", "component": "backend", "endpoint": "generate",
        "instance_id": 0x11,
        "card_json": {
            "display_name": "model-a", "source_path": "models/model-a",
            "kv_cache_block_size": 16, "model_type": "Chat | Completions",
            "worker_type": "aggregated", "needs": [],
            "runtime_config": {"total_kv_blocks": 256, "data_parallel_start_rank": 0,
                "data_parallel_size": 1, "enable_local_indexer": true, "enable_eagle": false}
        }
    });
    std::fs::write(
        cards.join("prod-backend-generate-11.json"),
        record.to_string(),
    )
    .unwrap();
    let trace = dir.join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": [1, 2, 3]}\n",
    )
    .unwrap();
    let mut config = RelayConfig {
        dc_id: "dc-stall".to_owned(),
        ..RelayConfig::default()
    };
    config.wan.listen = "127.0.0.1:0".parse().unwrap();
    config.admin.enabled = true;
    config.admin.listen = "127.0.0.1:0".parse().unwrap();
    config.discovery.dir = Some(cards);
    config.workload = Some(WorkloadConfig {
        trace: Some(trace),
        speed: 0.0,
        loops: 1,
    });
    config.limits.pool_stall_timeout_ms = 200;
    config
}

/// Polls `condition` every 10 ms until it holds (bounded by the deadline).
async fn until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !condition() {
        assert!(tokio::time::Instant::now() < deadline, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_actor_is_unready_and_withheld_until_it_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let relay = Relay::start(config(dir.path())).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .unwrap();
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .unwrap();
    let view = HostAdminView {
        state: relay.state.clone(),
        admission: relay.admission.clone(),
    };
    let admin = relay.admin_addr().unwrap();
    until("ready", || view.readiness().ready).await;
    let (status, body) = get(admin, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    let before = relay.catalog();
    assert_eq!(before.pools.len(), 1);
    let (key, status) = relay.state.pools().into_iter().next().unwrap();

    let release = status.actor.stall().await.unwrap();
    let source = relay.sources()[0];
    relay
        .submit(RouterEvent {
            source,
            event_id: 1,
            payload: EventPayload::Stored(StoredBlocks {
                parent_engine_block_id: None,
                blocks: vec![StoredBlock {
                    engine_block_id: 9_999,
                    token_hash: 9_999,
                }],
            }),
        })
        .await
        .unwrap();

    until("stalled", || !view.readiness().ready).await;
    let readiness = view.readiness();
    assert!(
        readiness
            .reasons
            .iter()
            .any(|reason| reason.contains(&key) && reason.contains("stalled")),
        "{readiness:?}"
    );
    let (status, body) = get(admin, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&key) && body.contains("stalled"), "{body}");
    until("withheld", || relay.catalog().pools.is_empty()).await;
    let withheld = relay.catalog();
    assert!(withheld.revision > before.revision);
    // Named apart, so a consumer of a relay pair can move to the other relay.
    assert_eq!(withheld.stalled, vec![before.pools[0].producer.pool_id]);
    let stats = view.pool_stats(&key).unwrap();
    assert_eq!(stats["stalled"], true, "{stats}");
    assert_eq!(stats["health"]["pending_events"], 1, "{stats}");

    drop(release);
    until("ready again", || view.readiness().ready).await;
    until("advertised again", || relay.catalog().pools.len() == 1).await;
    let (status, body) = get(admin, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    let after = relay.catalog();
    assert!(after.revision > withheld.revision);
    assert_eq!(after.pools[0].producer, before.pools[0].producer);
    assert!(after.stalled.is_empty());
    relay.shutdown().await.unwrap();
}
