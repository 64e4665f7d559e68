//! Loopback end-to-end tests of a whole relay: discovery from a card directory, trace replay
//! into pool actors, and the WAN protocol to a probe client.

use crate::support;

use kvrelay_codec::v1::{ErrorReason, Message, StreamRpc};
use kvrelay_server::{MirrorProgress, PoolMirror, ProbeStream, Relay};
use support::{DEADLINE, deployment, first_message, next, request};

#[tokio::test]
async fn replicas_equal_their_producers_after_a_workload() {
    let dir = tempfile::tempdir().unwrap();
    let relay = Relay::start(deployment(dir.path(), 400)).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(2))
        .await
        .expect("pools within the deadline");
    let addr = relay.wan_addr();

    let (_catalog_stream, first) = first_message(addr, &request(StreamRpc::WatchCatalog)).await;
    let Message::CatalogUpdate(catalog) = first else {
        panic!("expected a catalog, got {first:?}")
    };
    assert_eq!(catalog.pools.len(), 2);

    // Subscribe while the workload may still run, so deltas follow the snapshot.
    let mut followers = Vec::new();
    for pool in &catalog.pools {
        let stream = ProbeStream::connect(
            addr,
            &request(StreamRpc::SubscribePool {
                expected_producer: pool.producer,
                resume_from_sequence: None,
            }),
        )
        .await
        .unwrap();
        followers.push((stream, PoolMirror::new(pool.producer).unwrap()));
    }
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .expect("workload within the deadline");
    relay.flush().await;
    for (stream, mirror) in &mut followers {
        let table = relay.producer_table(mirror.producer()).await.unwrap();
        assert!(
            table.words.iter().any(|word| *word != 0),
            "workload left pool empty"
        );
        while mirror.words().is_none() || mirror.sequence() < table.sequence {
            let frame = tokio::time::timeout(DEADLINE, stream.next_frame())
                .await
                .expect("frame in time")
                .unwrap()
                .expect("open stream");
            let progress = mirror.handle_frame(&frame).unwrap();
            assert_ne!(
                progress,
                MirrorProgress::Heartbeat,
                "no heartbeat before catching up at the default interval"
            );
        }
        assert_eq!(mirror.sequence(), table.sequence);
        assert_eq!(
            mirror.words().unwrap(),
            table.words.as_slice(),
            "replica differs from producer"
        );
    }
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn relay_info_names_a_new_incarnation_after_restart() {
    let dir = tempfile::tempdir().unwrap();
    let config = deployment(dir.path(), 10);
    let first = Relay::start(config.clone()).await.unwrap();
    let (_, message) = first_message(first.wan_addr(), &request(StreamRpc::RelayInfo)).await;
    let Message::RelayInfo(info) = message else {
        panic!("expected relay info, got {message:?}")
    };
    assert_eq!(info.protocol_major, kvrelay_codec::PROTOCOL_MAJOR);
    assert_eq!(info.relay.relay_incarnation, first.incarnation());
    first.shutdown().await.unwrap();

    let second = Relay::start(config).await.unwrap();
    let (_, message) = first_message(second.wan_addr(), &request(StreamRpc::RelayInfo)).await;
    let Message::RelayInfo(again) = message else {
        panic!("expected relay info, got {message:?}")
    };
    assert_ne!(again.relay.relay_incarnation, info.relay.relay_incarnation);
    second.shutdown().await.unwrap();
}

#[tokio::test]
async fn streams_end_with_publication_unavailable_on_shutdown() {
    let dir = tempfile::tempdir().unwrap();
    let relay = Relay::start(deployment(dir.path(), 10)).await.unwrap();
    let (mut stream, _) = first_message(relay.wan_addr(), &request(StreamRpc::WatchTopology)).await;
    relay.shutdown().await.unwrap();
    let error = support::until_error(&mut stream).await;
    assert_eq!(error.reason, ErrorReason::PublicationUnavailable);
}

#[tokio::test]
async fn a_stalled_subscriber_is_cut_off_while_others_keep_up() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = deployment(dir.path(), 50);
    // Short timeouts cut the stall quickly.
    support::add_big_pool(&config);
    config.limits.snapshot_progress_timeout_ms = 2_000;
    config.limits.write_timeout_ms = 2_000;
    let relay = Relay::start(config).await.unwrap();
    let big = support::big_pool(&relay).await;
    let subscribe = request(StreamRpc::SubscribePool {
        expected_producer: big,
        resume_from_sequence: None,
    });

    // The stalled client: a tiny receive buffer and never a read.
    let mut stalled = stalled_subscriber(&relay, &subscribe).await;

    // A healthy client gets the whole snapshot and equals the producer.
    let mut healthy = ProbeStream::connect(relay.wan_addr(), &subscribe)
        .await
        .unwrap();
    let mut mirror = PoolMirror::new(big).unwrap();
    while mirror.words().is_none() {
        let frame = tokio::time::timeout(DEADLINE, healthy.next_frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        if let Err(err) = mirror.handle_frame(&frame) {
            panic!(
                "healthy subscriber: {err}: {:?}",
                kvrelay_codec::v1::Message::from_frame(&frame)
            );
        }
    }
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .unwrap();
    relay.flush().await;
    let table = relay.producer_table(&big).await.unwrap();
    while mirror.sequence() < table.sequence {
        let frame = tokio::time::timeout(DEADLINE, healthy.next_frame())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        mirror.handle_frame(&frame).unwrap();
    }
    assert_eq!(mirror.words().unwrap(), table.words.as_slice());

    // Only the healthy pool stream is left open: the stalled one was cut off.
    tokio::time::timeout(
        DEADLINE,
        relay.wait_for_open_streams(kvrelay_server::StreamKind::Pool, 1),
    )
    .await
    .expect("the stalled subscriber is cut off");
    let mut stalled_mirror = PoolMirror::new(big).unwrap();
    while let Ok(Some(frame)) = tokio::time::timeout(DEADLINE, stalled.next_frame())
        .await
        .unwrap()
    {
        if stalled_mirror.handle_frame(&frame).is_err() {
            break;
        }
    }
    assert!(
        stalled_mirror.words().is_none(),
        "a cut-off subscriber never completes its snapshot"
    );
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn after_a_restart_consumers_see_a_new_incarnation_and_converge() {
    let dir = tempfile::tempdir().unwrap();
    let config = deployment(dir.path(), 100);
    let first = Relay::start(config.clone()).await.unwrap();
    let addr = first.wan_addr();
    tokio::time::timeout(DEADLINE, first.wait_for_pools(2))
        .await
        .unwrap();
    let (mut watcher, message) = first_message(addr, &request(StreamRpc::WatchCatalog)).await;
    let Message::CatalogUpdate(before) = message else {
        panic!("expected a catalog, got {message:?}")
    };
    first.shutdown().await.unwrap();
    let end = support::until_error(&mut watcher).await;
    assert_eq!(end.reason, ErrorReason::PublicationUnavailable);

    let mut again = config;
    again.wan.listen = addr;
    let second = Relay::start(again).await.unwrap();
    tokio::time::timeout(DEADLINE, second.wait_for_pools(2))
        .await
        .unwrap();
    let (_, message) = first_message(addr, &request(StreamRpc::WatchCatalog)).await;
    let Message::CatalogUpdate(after) = message else {
        panic!("expected a catalog, got {message:?}")
    };
    assert_ne!(
        after.relay.relay_incarnation,
        before.relay.relay_incarnation
    );
    for pool in &after.pools {
        assert!(
            before.pools.iter().all(|old| old.producer != pool.producer),
            "producers are fenced by incarnation"
        );
    }
    // An old producer identity is refused; the new one converges.
    let stale = request(StreamRpc::SubscribePool {
        expected_producer: before.pools[0].producer,
        resume_from_sequence: None,
    });
    let (_, refused) = first_message(addr, &stale).await;
    assert!(
        matches!(refused, Message::Error(ref error) if error.reason == ErrorReason::ProducerChanged),
        "{refused:?}"
    );
    tokio::time::timeout(DEADLINE, second.workload_finished())
        .await
        .unwrap();
    second.flush().await;
    for pool in &after.pools {
        let table = second.producer_table(&pool.producer).await.unwrap();
        let mirror = support::mirror_until(addr, pool.producer, table.sequence).await;
        assert_eq!(mirror.words().unwrap(), table.words.as_slice());
    }
    second.shutdown().await.unwrap();
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    tokio::time::timeout(DEADLINE, stream.read_to_string(&mut response))
        .await
        .unwrap()
        .unwrap();
    let status = response[9..12].parse().unwrap();
    (
        status,
        response
            .split("\r\n\r\n")
            .nth(1)
            .unwrap_or_default()
            .to_owned(),
    )
}

#[tokio::test]
async fn admin_http_serves_health_metrics_and_views_of_a_running_relay() {
    let dir = tempfile::tempdir().unwrap();
    let relay = Relay::start(deployment(dir.path(), 50)).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(2))
        .await
        .unwrap();
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .unwrap();
    let admin = relay.admin_addr().unwrap();
    assert_eq!(http_get(admin, "/healthz").await.0, 200);
    let (status, body) = http_get(admin, "/readyz").await;
    assert_eq!(status, 200, "{body}");
    let (_, metrics) = http_get(admin, "/metrics").await;
    assert!(metrics.contains("kvrelay_pools 2"), "{metrics}");
    assert!(
        metrics.contains("kvrelay_events_total{disposition=\"submitted\"}"),
        "{metrics}"
    );
    let (status, catalog) = http_get(admin, "/v1/catalog").await;
    assert_eq!(status, 200);
    let catalog: serde_json::Value = serde_json::from_str(&catalog).unwrap();
    assert_eq!(
        catalog["pools"].as_array().map(Vec::len),
        Some(2),
        "{catalog}"
    );
    for path in ["/v1/load", "/v1/topology"] {
        assert_eq!(http_get(admin, path).await.0, 200, "{path}");
    }
    let pool = relay.pool_reports().await.remove(0).pool;
    let (status, stats) = http_get(admin, &format!("/v1/pools/{pool}/stats")).await;
    assert_eq!(status, 200, "{stats}");
    assert!(stats.contains("\"generation\""), "{stats}");
    assert_eq!(http_get(admin, "/v1/pools/nope/stats").await.0, 404);
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn topology_reports_ready_models_linked_to_their_pools() {
    let dir = tempfile::tempdir().unwrap();
    let relay = Relay::start(deployment(dir.path(), 10)).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(2))
        .await
        .unwrap();
    let (mut stream, mut message) =
        first_message(relay.wan_addr(), &request(StreamRpc::WatchTopology)).await;
    // The first update may predate the pool links; later ones follow on every change.
    loop {
        let Message::TopologyUpdate(update) = &message else {
            panic!("expected topology, got {message:?}")
        };
        let linked = update
            .entries
            .iter()
            .all(|entry| entry.members.iter().all(|member| member.pool_id.is_some()));
        if update.entries.len() == 2 && linked {
            for entry in &update.entries {
                assert_eq!(
                    entry.state,
                    kvrelay_codec::v1::ReadinessState::Ready,
                    "{entry:?}"
                );
            }
            break;
        }
        message = next(&mut stream).await.expect("topology stream open");
    }
    relay.shutdown().await.unwrap();
}

/// Reads catalog updates until `done` holds for one.
async fn catalog_until<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut ProbeStream<T>,
    done: impl Fn(&kvrelay_codec::v1::CatalogUpdate) -> bool,
) -> kvrelay_codec::v1::CatalogUpdate {
    loop {
        match next(stream).await {
            Some(Message::CatalogUpdate(catalog)) if done(&catalog) => return catalog,
            Some(Message::CatalogUpdate(_)) => {}
            other => panic!("expected catalog updates, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn departed_endpoints_are_withdrawn_and_return_as_a_new_generation() {
    let dir = tempfile::tempdir().unwrap();
    let config = deployment(dir.path(), 20);
    let cards = config.discovery.dir.clone().unwrap();
    let relay = Relay::start(config).await.unwrap();
    let (mut watcher, _) = first_message(relay.wan_addr(), &request(StreamRpc::WatchCatalog)).await;
    let before = catalog_until(&mut watcher, |catalog| catalog.pools.len() == 2).await;
    let other = |catalog: &kvrelay_codec::v1::CatalogUpdate| {
        catalog
            .pools
            .iter()
            .find(|pool| pool.serving_endpoint.component == "other")
            .map(|pool| pool.producer)
    };
    let first_generation = other(&before).expect("the other endpoint is published");

    let card = cards.join("prod-other-generate-21.json");
    let saved = std::fs::read(&card).unwrap();
    std::fs::remove_file(&card).unwrap();
    let withdrawn = catalog_until(&mut watcher, |catalog| catalog.pools.len() == 1).await;
    assert!(other(&withdrawn).is_none());
    assert!(withdrawn.revision > before.revision);

    std::fs::write(&card, saved).unwrap();
    let back = catalog_until(&mut watcher, |catalog| catalog.pools.len() == 2).await;
    let second_generation = other(&back).expect("the endpoint is published again");
    assert!(second_generation.layout_generation > first_generation.layout_generation);
    assert_eq!(
        second_generation.pool_id, first_generation.pool_id,
        "same pool, new generation"
    );
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_quiet_catalog_stream_repeats_its_current_revision_as_a_heartbeat() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = deployment(dir.path(), 0);
    config.limits.heartbeat_interval_ms = 50;
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(2))
        .await
        .expect("pools within the deadline");
    let (mut watcher, _) = first_message(relay.wan_addr(), &request(StreamRpc::WatchCatalog)).await;
    let settled = catalog_until(&mut watcher, |catalog| catalog.pools.len() == 2).await;
    // No card changes from here on: what follows can only be heartbeats, each repeating
    // the settled revision and content.
    for _ in 0..2 {
        let repeated = tokio::time::timeout(DEADLINE, next(&mut watcher))
            .await
            .expect("a heartbeat within the deadline");
        match repeated {
            Some(Message::CatalogUpdate(catalog)) => assert_eq!(catalog, settled),
            other => panic!("expected a catalog heartbeat, got {other:?}"),
        }
    }
    relay.shutdown().await.unwrap();
}

/// The value of the unlabelled metric `family` in a Prometheus text page.
fn metric_value(page: &str, family: &str) -> f64 {
    page.lines()
        .find_map(|line| {
            let (name, value) = line.split_once(' ')?;
            (name == family)
                .then(|| value.trim().parse().ok())
                .flatten()
        })
        .unwrap_or_else(|| panic!("{family} not in the metrics page"))
}

/// The metrics page once `ready` holds for it (the stream counters are folded into the
/// relay's metrics periodically, not on every change).
async fn metrics_when(relay: &Relay, ready: impl Fn(&str) -> bool) -> String {
    let admin = relay.admin_addr().unwrap();
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let (status, page) = http_get(admin, "/metrics").await;
        assert_eq!(status, 200);
        if ready(&page) {
            return page;
        }
        assert!(tokio::time::Instant::now() < deadline, "{page}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A relay whose big pool (2^20+ buckets, an 8 MiB snapshot) has one subscriber stalled
/// mid-snapshot on a version a later change pinned: the pin bound (1) is reached. Returns
/// the relay, the big pool's producer and the stalled stream (kept open by the caller).
async fn relay_with_a_pinned_snapshot(
    dir: &std::path::Path,
    resume_window_bytes: u64,
) -> (
    Relay,
    kvrelay_codec::v1::ProducerIdentity,
    ProbeStream<tokio::net::TcpStream>,
) {
    // The trace workload is the pools' event source (it also routes `submit`).
    let mut config = deployment(dir, 5);
    support::add_big_pool(&config);
    config.limits.max_pinned_snapshots_per_pool = 1;
    config.limits.resume_window_bytes = resume_window_bytes;
    let relay = Relay::start(config).await.unwrap();
    let big = support::big_pool(&relay).await;
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .unwrap();
    relay.submit(support::big_pool_store(1)).await.unwrap();
    relay.flush().await;

    // A subscriber with a tiny receive buffer that never reads: its snapshot stays in
    // flight, so the next change pins the version it started on.
    let subscribe = request(StreamRpc::SubscribePool {
        expected_producer: big,
        resume_from_sequence: None,
    });
    let stalled = stalled_subscriber(&relay, &subscribe).await;
    // Started in the publisher (an open connection alone may not have subscribed yet).
    metrics_when(&relay, |page| {
        metric_value(
            page,
            "kvrelay_stream_subscriptions_total{start=\"snapshot\"}",
        ) >= 1.0
    })
    .await;
    relay.submit(support::big_pool_store(2)).await.unwrap();
    relay.flush().await;
    (relay, big, stalled)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reconnect_storm_shares_the_pinned_snapshot_and_every_subscriber_converges() {
    let dir = tempfile::tempdir().unwrap();
    let (relay, big, stalled) = relay_with_a_pinned_snapshot(dir.path(), 16 << 20).await;
    // Subscribers arriving at the bound share the pinned version and get the changes
    // since from the resume window: each equals the producer.
    for _ in 0..4 {
        let (mirror, table) = support::mirror_at_producer(&relay, big).await;
        assert_eq!(mirror.words().unwrap(), table.words.as_slice());
    }
    let page = metrics_when(&relay, |page| {
        metric_value(page, "kvrelay_stream_snapshots_shared_total") >= 4.0
    })
    .await;
    assert_eq!(
        metric_value(&page, "kvrelay_stream_snapshot_refusals_total"),
        0.0
    );
    // A subscriber that never reads would hold shutdown to its timeout.
    drop(stalled);
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_pin_bound_without_a_resume_window_a_subscriber_is_refused_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let (relay, big, stalled) = relay_with_a_pinned_snapshot(dir.path(), 0).await;
    let mut refused = ProbeStream::connect(
        relay.wan_addr(),
        &request(StreamRpc::SubscribePool {
            expected_producer: big,
            resume_from_sequence: None,
        }),
    )
    .await
    .unwrap();
    let error = tokio::time::timeout(DEADLINE, support::until_error(&mut refused))
        .await
        .expect("the subscriber at the bound is refused");
    assert_eq!(error.reason, ErrorReason::ResourceLimit, "{error:?}");
    let page = metrics_when(&relay, |page| {
        metric_value(page, "kvrelay_stream_snapshot_refusals_total") >= 1.0
    })
    .await;
    assert_eq!(
        metric_value(&page, "kvrelay_stream_snapshot_refusals_total"),
        1.0
    );
    assert_eq!(
        metric_value(&page, "kvrelay_stream_snapshots_shared_total"),
        0.0
    );
    // A subscriber that never reads would hold shutdown to its timeout.
    drop(stalled);
    relay.shutdown().await.unwrap();
}

/// A subscriber with a tiny receive buffer that never reads.
async fn stalled_subscriber(
    relay: &Relay,
    subscribe: &kvrelay_codec::v1::StreamRequest,
) -> ProbeStream<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let stalled_io = socket.connect(relay.wan_addr()).await.unwrap();
    ProbeStream::open(stalled_io, subscribe).await.unwrap()
}

/// A `SubscribePool` request for `producer`'s pool, from its beginning.
fn subscribe_pool(
    producer: kvrelay_codec::v1::ProducerIdentity,
) -> kvrelay_codec::v1::StreamRequest {
    request(StreamRpc::SubscribePool {
        expected_producer: producer,
        resume_from_sequence: None,
    })
}

/// Asserts that the stream's first message (within the deadline) is a pool frame.
async fn opens_with_a_pool_frame(stream: &mut ProbeStream<tokio::net::TcpStream>) {
    let opened = tokio::time::timeout(DEADLINE, stream.next_message())
        .await
        .unwrap();
    assert!(
        matches!(opened, Ok(Some(Message::PoolFrame(_)))),
        "{opened:?}"
    );
}

/// Opens a WAN stream to the relay from the loopback address `source` (any of
/// 127.0.0.0/8: a second host, as the relay sees it, without leaving loopback).
async fn connect_from(
    relay: &Relay,
    source: std::net::Ipv4Addr,
    request: &kvrelay_codec::v1::StreamRequest,
) -> ProbeStream<tokio::net::TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket
        .bind(std::net::SocketAddr::from((source, 0)))
        .unwrap();
    let io = socket.connect(relay.wan_addr()).await.unwrap();
    ProbeStream::open(io, request).await.unwrap()
}

/// One host cannot fill a pool's subscriber slots: past `max_streams_per_peer` streams of
/// one pool from one address, the next is refused (`resource_limit`, counted as
/// `per_peer`), the same host may still subscribe another pool, and a subscriber from
/// another address is served while the first host holds its streams.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_address_holds_at_most_its_share_of_a_pools_subscribers() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = deployment(dir.path(), 5);
    config.limits.max_streams_per_peer = 3;
    config.limits.max_subscribers_per_pool = 4;
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(2))
        .await
        .unwrap();
    let pools = relay.catalog().pools;
    let attacker = std::net::Ipv4Addr::new(127, 0, 0, 1);
    let honest = std::net::Ipv4Addr::new(127, 0, 0, 2);
    let first = pools[0].producer;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut stream = connect_from(&relay, attacker, &subscribe_pool(first)).await;
        opens_with_a_pool_frame(&mut stream).await;
        held.push(stream);
    }
    let mut refused = connect_from(&relay, attacker, &subscribe_pool(first)).await;
    let error = tokio::time::timeout(DEADLINE, support::until_error(&mut refused))
        .await
        .expect("the host's fourth subscriber of the pool is refused");
    assert_eq!(error.reason, ErrorReason::ResourceLimit, "{error:?}");
    assert!(error.message.contains("per peer"), "{error:?}");
    // The pool's own limit (4) is not reached: another host takes the last slot.
    let mut other_host = connect_from(&relay, honest, &subscribe_pool(first)).await;
    opens_with_a_pool_frame(&mut other_host).await;
    // The share is per pool: the same host still subscribes the other pool.
    let mut other_pool = connect_from(&relay, attacker, &subscribe_pool(pools[1].producer)).await;
    opens_with_a_pool_frame(&mut other_pool).await;
    let per_peer = "kvrelay_admission_rejected_total{stream=\"pool\",scope=\"per_peer\"}";
    let page = metrics_when(&relay, |page| metric_value(page, per_peer) >= 1.0).await;
    assert_eq!(metric_value(&page, per_peer), 1.0);
    // A released stream returns the host's share.
    held.pop();
    let readmitted = tokio::time::timeout(DEADLINE, async {
        loop {
            let mut stream = connect_from(&relay, attacker, &subscribe_pool(first)).await;
            if let Ok(Some(Message::PoolFrame(_))) = stream.next_message().await {
                return stream;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the host is admitted again once one of its streams ends");
    drop((held, readmitted, other_host, other_pool));
    relay.shutdown().await.unwrap();
}

/// The per-pool subscriber limit is the publication stream's own (one rule, one place):
/// a second subscriber of a pool limited to one is refused with `resource_limit` and
/// counted as a `per_pool` admission refusal, while another pool still admits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_pool_subscriber_limit_refuses_and_counts_the_extra_subscriber() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = deployment(dir.path(), 5);
    config.limits.max_subscribers_per_pool = 1;
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(2))
        .await
        .unwrap();
    let pools = relay.catalog().pools;
    let first = pools[0].producer;
    let mut held = ProbeStream::connect(relay.wan_addr(), &subscribe_pool(first))
        .await
        .unwrap();
    // The first subscriber is in (its snapshot starts) before the second asks.
    let opened = tokio::time::timeout(DEADLINE, held.next_message())
        .await
        .unwrap();
    assert!(matches!(opened, Ok(Some(_))), "{opened:?}");
    let mut refused = ProbeStream::connect(relay.wan_addr(), &subscribe_pool(first))
        .await
        .unwrap();
    let error = tokio::time::timeout(DEADLINE, support::until_error(&mut refused))
        .await
        .expect("the second subscriber of the pool is refused");
    assert_eq!(error.reason, ErrorReason::ResourceLimit, "{error:?}");
    let page = metrics_when(&relay, |page| {
        metric_value(
            page,
            "kvrelay_admission_rejected_total{stream=\"pool\",scope=\"per_pool\"}",
        ) >= 1.0
    })
    .await;
    assert_eq!(
        metric_value(
            &page,
            "kvrelay_admission_rejected_total{stream=\"pool\",scope=\"per_pool\"}"
        ),
        1.0
    );
    let (mirror, table) = support::mirror_at_producer(&relay, pools[1].producer).await;
    assert_eq!(mirror.words().unwrap(), table.words.as_slice());
    drop(held);
    relay.shutdown().await.unwrap();
}
