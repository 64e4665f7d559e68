//! A `kvrelay relay` process restarted next to a running engine: a libzmq publisher in the
//! vLLM layout sends 40 stored events whose parent the relay never saw, then 50 valid root
//! blocks. The bad events are counted as unroutable (never faults, never a stall), the
//! valid blocks become resident at once, and `/readyz` tells the truth before the engine
//! is reachable, while it publishes and after it is gone. Everything is read the way an
//! operator reads it: the admin HTTP endpoints of the binary.

use crate::support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use support::{VllmEngine as Engine, get_json, http_get, removed, sample, stored, vllm_relay};

const DEADLINE: Duration = Duration::from_secs(30);

async fn get(admin: SocketAddr, path: &str) -> (u16, String) {
    http_get(admin, path)
        .await
        .unwrap_or_else(|| panic!("GET {path} got no answer"))
}

/// Polls `path` every 20 ms until `accept` takes its status and body (bounded).
async fn poll_until<T>(
    admin: SocketAddr,
    path: &str,
    mut accept: impl FnMut(u16, &str) -> Option<T>,
) -> T {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (status, body) = get(admin, path).await;
        if let Some(value) = accept(status, &body) {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "GET {path} stayed {status}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_relay_counts_unknown_parents_and_keeps_the_pool_live() {
    // The engine is not up yet.
    let setup = vllm_relay("").await;
    let admin = setup.relay.admin;

    // Before: the pool exists but no engine is reachable, and readiness names it.
    let pool = poll_until(admin, "/v1/pools", |status, body| {
        let listing: serde_json::Value = serde_json::from_str(body).ok()?;
        let first = listing["pools"].get(0)?;
        (status == 200).then(|| first["pool"].as_str().unwrap().to_owned())
    })
    .await;
    let stats_path = format!("/v1/pools/{pool}/stats");
    let listing = get_json(admin, "/v1/pools").await;
    assert_eq!(listing["pools"][0]["links"]["stats"], stats_path.as_str());
    let (status, body) = get(admin, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&pool), "{body}");
    assert!(body.contains("no connected source"), "{body}");

    // The engine comes up; the source connects and the relay is ready.
    let context = zmq::Context::new();
    let mut engine = Engine::bind(&context, setup.engine_addr);
    poll_until(admin, "/readyz", |status, _| (status == 200).then_some(())).await;

    // PUB/SUB drops what is sent before the subscription lands: publish removals of
    // unknown blocks (counted no-ops) until one is applied.
    let deadline = Instant::now() + DEADLINE;
    let warm_up = loop {
        engine.publish(removed(&[engine.seq + 1]));
        let applied = get_json(admin, &stats_path).await["stats"]["events_applied"]
            .as_u64()
            .unwrap();
        if applied > 0 {
            break applied;
        }
        assert!(Instant::now() < deadline, "no batch arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // Warm-up removals published before the first one landed may still be in flight.
    let warm_up_sent = engine.seq;

    for at in 0..40 {
        engine.publish(stored(&[10_000 + at], Some(999_999)));
    }
    for at in 0..50 {
        engine.publish(stored(&[1 + at], None));
    }
    // The 50 valid blocks become resident (bounded by the deadline; speed is the
    // benchmarks' business, the time is printed).
    let sent_at = Instant::now();
    let landed = poll_until(admin, &stats_path, |_, body| {
        let stats: serde_json::Value = serde_json::from_str(body).ok()?;
        (stats["stats"]["resident_blocks"].as_u64()? >= 50).then_some(stats)
    })
    .await;
    eprintln!(
        "valid blocks resident {:?} after the last publish",
        sent_at.elapsed()
    );
    let counts = &landed["stats"];
    assert_eq!(counts["resident_blocks"], 50, "{landed}");
    assert_eq!(counts["unroutable_events"], 40, "{landed}");
    assert_eq!(counts["unroutable_blocks"], 40, "{landed}");
    assert_eq!(counts["faults"]["source_protocol"], 0, "{landed}");
    let applied = counts["events_applied"].as_u64().unwrap();
    assert!(
        (warm_up + 50..=warm_up_sent + 50).contains(&applied),
        "events applied {applied} outside {}..={}",
        warm_up + 50,
        warm_up_sent + 50
    );
    assert_eq!(landed["health"]["pending_events"], 0, "{landed}");
    assert_eq!(landed["sources"]["connected"], 1, "{landed}");
    assert_eq!(landed["stalled"], false, "{landed}");

    // After: still ready, and the metrics say what happened.
    let (status, body) = get(admin, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    poll_until(admin, "/metrics", |_, metrics| {
        (sample(metrics, "kvrelay_pool_unroutable_blocks_total") == Some(40)).then_some(())
    })
    .await;
    let (_, metrics) = get(admin, "/metrics").await;
    assert_eq!(
        sample(
            &metrics,
            "kvrelay_pool_faults_total{category=\"source_protocol\"}"
        ),
        Some(0),
        "{metrics}"
    );
    assert_eq!(
        sample(&metrics, "kvrelay_sources{state=\"connected\"}"),
        Some(1),
        "{metrics}"
    );

    // The engine goes away. Without a replay endpoint nothing can tell whether it still
    // held batches: the pool's stats count the unverified tail, and readiness names the
    // pool as having no connected source.
    assert_eq!(landed["ingest"]["unverified_tails"], 0, "{landed}");
    drop(engine);
    drop(context);
    let body = poll_until(admin, "/readyz", |status, body| {
        (status == 503).then(|| body.to_owned())
    })
    .await;
    assert!(body.contains(&pool), "{body}");
    assert!(body.contains("no connected source"), "{body}");
    let gone = poll_until(admin, &stats_path, |_, body| {
        let stats: serde_json::Value = serde_json::from_str(body).ok()?;
        (stats["ingest"]["unverified_tails"] == 1).then_some(stats)
    })
    .await;
    assert_eq!(gone["ingest"]["disconnects"], 1, "{gone}");
    assert_eq!(gone["sources"]["connecting"], 1, "{gone}");
    assert_eq!(gone["stats"]["resident_blocks"], 50, "{gone}");
}
