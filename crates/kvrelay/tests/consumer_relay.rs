//! The consumer library against a real relay over loopback: replicas converge to the
//! producers' exact state, a relay restart is seen as a new incarnation (old replicas are
//! dropped, never scored against), a subscriber the relay cuts off for lagging
//! resubscribes and converges again, and a pool stream cut mid-snapshot (by a loopback
//! proxy) never installs and is resubscribed.
//!
//! The consumer crate tests itself against a fake relay only (layering keeps it from
//! depending on the server); this binary crate depends on both, so the real pairing is
//! tested here.

use std::net::SocketAddr;
use std::time::Duration;

use kvrelay_ckf::{EventPayload, RouterEvent, StoredBlock, StoredBlocks};
use kvrelay_codec::v1::{CatalogUpdate, Message, ProducerIdentity, StreamRequest, StreamRpc};
use kvrelay_consumer::{Consumer, ReplicaState, ResubscribeReason, ScoreRequest};
use kvrelay_server::{PoolMirror, ProbeStream, Relay, RelayConfig, WORKLOAD_TOKEN_SEED};

use crate::support;

use support::example_config;

/// Bound on every wait of these tests.
const DEADLINE: Duration = Duration::from_secs(30);
/// Pools of the example deployment.
const EXAMPLE_POOLS: usize = 4;

/// A consumer of the relay at `addr` that reconnects quickly.
fn start_consumer(addr: SocketAddr) -> Consumer {
    support::quick_consumer(vec![kvrelay_consumer::RelayEndpoint::new(
        &addr.to_string(),
        "dc-test",
    )])
}

/// Starts a relay and waits until every example pool is published.
async fn start_relay(config: RelayConfig) -> (Relay, CatalogUpdate) {
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(EXAMPLE_POOLS))
        .await
        .expect("every example pool is published");
    let catalog = relay.catalog();
    assert_eq!(catalog.pools.len(), EXAMPLE_POOLS);
    (relay, catalog)
}

/// An independent replica of one pool over its own stream, built on the codec.
struct Follower {
    stream: ProbeStream<tokio::net::TcpStream>,
    mirror: PoolMirror,
    addr: SocketAddr,
    producer: ProducerIdentity,
}

impl Follower {
    async fn subscribe(addr: SocketAddr, producer: ProducerIdentity) -> Self {
        let request = StreamRequest {
            subscriber_id: "consumer-relay-test-mirror".to_owned(),
            rpc: StreamRpc::SubscribePool {
                expected_producer: producer,
                resume_from_sequence: None,
            },
            auth_token: None,
        };
        Self {
            stream: ProbeStream::connect(addr, &request).await.unwrap(),
            mirror: PoolMirror::new(producer).unwrap(),
            addr,
            producer,
        }
    }

    /// Reads frames until the mirror holds a snapshot at `sequence` or later.
    async fn catch_up(&mut self, sequence: u64) -> &PoolMirror {
        while self.mirror.words().is_none() || self.mirror.sequence() < sequence {
            let frame = tokio::time::timeout(DEADLINE, self.stream.next_frame())
                .await
                .expect("a frame within the deadline")
                .unwrap()
                .expect("the pool stream stays open");
            if let Ok(Message::Error(error)) = Message::from_frame(&frame) {
                // A relay configured to cut every lagging subscriber (one test does) may
                // cut this one too: start over, as a consumer would.
                if error.effective_reason() == kvrelay_codec::v1::ErrorReason::SubscriberLagged {
                    *self = Self::subscribe(self.addr, self.producer).await;
                    continue;
                }
                panic!("relay ended the pool stream: {error:?}");
            }
            self.mirror.handle_frame(&frame).unwrap();
        }
        &self.mirror
    }
}

/// Waits for the workload, then checks every pool: the consumer's replica is current at
/// the producer's sequence and the follower's replica equals the producer's table bit for
/// bit.
async fn assert_converged(
    relay: &Relay,
    catalog: &CatalogUpdate,
    consumer: &Consumer,
    followers: &mut [Follower],
) {
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .expect("the workload finishes");
    relay.flush().await;
    for (pool, follower) in catalog.pools.iter().zip(followers) {
        let table = relay.producer_table(&pool.producer).await.unwrap();
        let current = consumer
            .wait_until(DEADLINE, |state, now| {
                state.pools(now).iter().any(|status| {
                    status.producer == pool.producer
                        && status.replica == ReplicaState::Current
                        && status.sequence == Some(table.sequence)
                })
            })
            .await;
        assert!(
            current,
            "pool {:?}: consumer replica not current at producer sequence {}: {:?}",
            pool.serving_endpoint,
            table.sequence,
            consumer.pools()
        );
        let mirror = follower.catch_up(table.sequence).await;
        assert_eq!(mirror.sequence(), table.sequence);
        assert_eq!(
            mirror.words().unwrap(),
            table.words.as_slice(),
            "pool {:?}: replica differs from its producer",
            pool.serving_endpoint
        );
    }
}

async fn followers_of(addr: SocketAddr, catalog: &CatalogUpdate) -> Vec<Follower> {
    let mut followers = Vec::new();
    for pool in &catalog.pools {
        followers.push(Follower::subscribe(addr, pool.producer).await);
    }
    followers
}

/// Scores the first `n` requests of the built-in trace for every base model; returns
/// (scored, legs answered by a current replica, legs that found a cached prefix).
fn score_trace(consumer: &Consumer, catalog: &CatalogUpdate, n: usize) -> (usize, usize, usize) {
    let models = kvrelay_consumer::served_base_models(catalog);
    let (mut scored, mut current_legs, mut hits) = (0, 0, 0);
    let requests = kvrelay_ingest::parse_request_trace(kvrelay_ingest::BUILTIN_REQUEST_TRACE)
        .expect("the built-in trace parses");
    for kvrelay_ingest::RequestRecord { hash_ids, .. } in requests.iter().take(n) {
        for kvrelay_consumer::ServedModel {
            model,
            kv_block_size,
        } in &models
        {
            let request = ScoreRequest {
                tokens: kvrelay_ingest::request_tokens(
                    hash_ids,
                    *kv_block_size,
                    WORKLOAD_TOKEN_SEED,
                ),
                model: model.clone(),
                lora: None,
                cache_namespace: None,
            };
            let ranking = consumer.score(&request).unwrap();
            scored += 1;
            for leg in ranking.candidates.iter().flat_map(|c| &c.legs) {
                // An answer comes only from a current replica; anything else is unknown.
                assert_eq!(
                    leg.prefix_blocks.is_some(),
                    leg.replica == ReplicaState::Current,
                    "{leg:?}"
                );
                if leg.replica == ReplicaState::Current {
                    current_legs += 1;
                }
                if leg.prefix_blocks.is_some_and(|blocks| blocks > 0) {
                    hits += 1;
                }
            }
        }
    }
    (scored, current_legs, hits)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_replicas_converge_on_a_real_relay() {
    let (relay, catalog) = start_relay(example_config("dc-test")).await;
    let addr = relay.wan_addr();
    let consumer = start_consumer(addr);
    // Subscribed while the workload runs, so deltas follow the snapshot.
    let mut followers = followers_of(addr, &catalog).await;

    assert_converged(&relay, &catalog, &consumer, &mut followers).await;

    let (scored, current_legs, hits) = score_trace(&consumer, &catalog, 100);
    assert!(scored > 0, "the trace's requests resolve to served models");
    assert!(current_legs > 0, "current replicas answer");
    assert!(hits > 0, "scoring finds the replayed prefixes on some pool");
    let metrics = consumer.metrics();
    assert_eq!(metrics.replicas_current, EXAMPLE_POOLS as u64);
    assert_eq!(metrics.max_replica_sequence_lag, 0);

    consumer.shutdown().await;
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dense_filters_are_published_followed_and_scored() {
    let mut config = example_config("dc-test");
    config.filters.format = kvrelay_server::FilterFormat::Dense;
    let (relay, catalog) = start_relay(config).await;
    for pool in &catalog.pools {
        let format = &pool.producer.ckf_format;
        assert_eq!(format.format_version, 2, "{:?}", pool.serving_endpoint);
        // v1 would round the same pool up to a power of two.
        let v1 = kvrelay_ckf::format::bucket_count_for(format.bucket_count * 4 * 95 / 100).unwrap();
        assert!(format.bucket_count < v1, "{format:?} against v1's {v1}");
    }
    let addr = relay.wan_addr();
    let consumer = start_consumer(addr);
    let mut followers = followers_of(addr, &catalog).await;

    // Replicas of the dense tables are bit-identical to their producers, and current.
    assert_converged(&relay, &catalog, &consumer, &mut followers).await;

    let (scored, current_legs, hits) = score_trace(&consumer, &catalog, 100);
    assert!(scored > 0 && current_legs > 0, "dense replicas answer");
    assert!(
        hits > 0,
        "scoring finds the replayed prefixes in dense filters"
    );
    assert_eq!(consumer.metrics().replicas_current, EXAMPLE_POOLS as u64);

    consumer.shutdown().await;
    relay.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_restart_is_seen_as_a_new_incarnation_and_replicas_converge_again() {
    let config = example_config("dc-test");
    let (first, before) = start_relay(config.clone()).await;
    let addr = first.wan_addr();
    let consumer = start_consumer(addr);
    let mut followers = followers_of(addr, &before).await;
    assert_converged(&first, &before, &consumer, &mut followers).await;
    assert!(score_trace(&consumer, &before, 20).2 > 0);
    let old_incarnation = first.incarnation();

    first.shutdown().await.unwrap();
    // The relay is gone: every replica of its producers is dropped, and nothing scores.
    let dropped = consumer
        .wait_until(DEADLINE, |state, now| state.pools(now).is_empty())
        .await;
    assert!(
        dropped,
        "old replicas survive the relay: {:?}",
        consumer.pools()
    );
    for kvrelay_consumer::ServedModel { model, .. } in kvrelay_consumer::served_base_models(&before)
    {
        let ranking = consumer.score(&ScoreRequest {
            tokens: (0..64).collect(),
            model,
            ..ScoreRequest::default()
        });
        assert!(
            ranking.is_err(),
            "scored against a relay that is gone: {ranking:?}"
        );
    }

    // A new relay on the same WAN port: a new incarnation with new producer generations.
    let mut again = config;
    again.wan.listen = addr;
    let (second, after) = start_relay(again).await;
    assert_ne!(second.incarnation(), old_incarnation);
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
    let mut followers = followers_of(addr, &after).await;
    assert_converged(&second, &after, &consumer, &mut followers).await;
    // Only the new incarnation's producers are replicated.
    let pools = consumer.pools();
    assert_eq!(pools.len(), EXAMPLE_POOLS, "{pools:?}");
    assert!(
        pools.iter().all(|status| after
            .pools
            .iter()
            .any(|pool| pool.producer == status.producer)),
        "{pools:?}"
    );
    assert!(score_trace(&consumer, &after, 20).2 > 0);

    consumer.shutdown().await;
    second.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_consumer_is_cut_off_and_recovers_to_current() {
    // An empty trace connects every discovered worker as a source and replays nothing;
    // the test brings its own burst. A one-byte backlog bound cannot hold any delta, even
    // coalesced: every live subscription is cut off for lagging at the first delta it is
    // offered (and cannot resume), while snapshots (sent lazily, not queued) still go
    // through.
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("empty.jsonl");
    std::fs::write(&trace, "").unwrap();
    let mut config = example_config("dc-test");
    config.workload = Some(kvrelay_server::WorkloadConfig {
        trace: Some(trace),
        speed: 0.0,
        loops: 1,
    });
    config.limits.subscriber_backlog_bytes = Some(1);
    let (relay, catalog) = start_relay(config).await;
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .expect("the empty workload finishes");
    let consumer = start_consumer(relay.wan_addr());
    let all_current = consumer
        .wait_until(DEADLINE, |state, now| {
            let pools = state.pools(now);
            pools.len() == EXAMPLE_POOLS
                && pools
                    .iter()
                    .all(|status| status.replica == ReplicaState::Current)
        })
        .await;
    assert!(all_current, "{:?}", consumer.pools());

    // The burst: stored chains on every source, each round flushed into its own delta.
    assert!(!relay.sources().is_empty());
    store_rounds(&relay, 20, 0).await;

    let lagged = consumer
        .wait_for_metrics(DEADLINE, |metrics| {
            metrics.resubscribes_for(ResubscribeReason::Lagged) > 0
        })
        .await;
    assert!(
        lagged,
        "the relay cut the consumer off: {:?}",
        consumer.metrics()
    );

    // Quiet again: a resubscription's snapshot is the producer's final state.
    let mut followers = followers_of(relay.wan_addr(), &catalog).await;
    let mut moved = false;
    for (pool, follower) in catalog.pools.iter().zip(&mut followers) {
        let table = relay.producer_table(&pool.producer).await.unwrap();
        moved |= table.sequence > 0;
        let current = consumer
            .wait_until(DEADLINE, |state, now| {
                state.pools(now).iter().any(|status| {
                    status.producer == pool.producer
                        && status.replica == ReplicaState::Current
                        && status.sequence == Some(table.sequence)
                })
            })
            .await;
        assert!(
            current,
            "pool {:?}: consumer replica not current at producer sequence {}: {:?}",
            pool.serving_endpoint,
            table.sequence,
            consumer.pools()
        );
        let mirror = follower.catch_up(table.sequence).await;
        assert_eq!(mirror.words().unwrap(), table.words.as_slice());
    }
    assert!(moved, "the burst moved some producer");

    consumer.shutdown().await;
    relay.shutdown().await.unwrap();
}

/// A loopback TCP proxy in front of a relay that cuts the first `cuts` pool streams of the
/// consumer after `cut_after` bytes from the relay; everything else passes through.
struct CuttingProxy {
    addr: SocketAddr,
    cut: tokio::sync::watch::Receiver<u32>,
    pool_streams: std::sync::Arc<std::sync::atomic::AtomicU32>,
    task: tokio::task::JoinHandle<()>,
}

impl CuttingProxy {
    async fn start(relay: SocketAddr, cuts: u32, cut_after: usize) -> Self {
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut_tx, cut) = tokio::sync::watch::channel(0u32);
        let cut_tx = std::sync::Arc::new(cut_tx);
        let pool_streams = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counter = std::sync::Arc::clone(&pool_streams);
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                let cut_tx = std::sync::Arc::clone(&cut_tx);
                let counter = std::sync::Arc::clone(&counter);
                connections.spawn(async move {
                    let _ =
                        proxy_connection(client, relay, (cuts, cut_after), &cut_tx, &counter).await;
                });
            }
        });
        Self {
            addr,
            cut,
            pool_streams,
            task,
        }
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn proxy_connection(
    mut client: tokio::net::TcpStream,
    relay: SocketAddr,
    (cuts, cut_after): (u32, usize),
    cut_tx: &tokio::sync::watch::Sender<u32>,
    pool_streams: &std::sync::atomic::AtomicU32,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut upstream = tokio::net::TcpStream::connect(relay).await?;
    // The stream request arrives in one write; its subscriber id names the stream.
    let mut request = vec![0u8; 64 * 1024];
    let n = client.read(&mut request).await?;
    request.truncate(n);
    let is_pool = request
        .windows(b"kvrelay-consumer/pool".len())
        .any(|window| window == b"kvrelay-consumer/pool");
    let mut cut_here = false;
    if is_pool {
        pool_streams.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        cut_tx.send_if_modified(|done| {
            cut_here = *done < cuts;
            if cut_here {
                *done += 1;
            }
            false
        });
    }
    upstream.write_all(&request).await?;
    let (mut client_read, mut client_write) = client.split();
    let (mut relay_read, mut relay_write) = upstream.split();
    let upward = tokio::io::copy(&mut client_read, &mut relay_write);
    let downward = async {
        let mut sent = 0usize;
        let mut buffer = vec![0u8; 16 * 1024];
        loop {
            let n = relay_read.read(&mut buffer).await?;
            if n == 0 {
                return Ok::<(), std::io::Error>(());
            }
            let n = if cut_here { n.min(cut_after - sent) } else { n };
            client_write.write_all(&buffer[..n]).await?;
            sent += n;
            if cut_here && sent >= cut_after {
                return Ok(());
            }
        }
    };
    tokio::select! {
        _ = upward => {}
        _ = downward => {}
    }
    if cut_here {
        // Announce the cut only once the connection is really gone.
        drop(client);
        drop(upstream);
        cut_tx.send_modify(|_| {});
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_mid_snapshot_never_installs_and_the_replica_recovers() {
    // The smallest example pool has 16384 buckets: a dense snapshot of 128 KiB in one
    // chunk, so a cut after 32 KiB always falls inside the first snapshot frame.
    const CUT_AFTER: usize = 32 * 1024;
    let (relay, catalog) = start_relay(example_config("dc-test")).await;
    assert!(
        catalog
            .pools
            .iter()
            .all(|pool| pool.producer.ckf_format.bucket_count * 8 > 2 * CUT_AFTER as u64)
    );
    let cuts = EXAMPLE_POOLS as u32;
    let proxy = CuttingProxy::start(relay.wan_addr(), cuts, CUT_AFTER).await;
    let consumer = start_consumer(proxy.addr);

    let mut cut = proxy.cut.clone();
    tokio::time::timeout(DEADLINE, cut.wait_for(|done| *done >= cuts))
        .await
        .expect("the first pool streams are cut")
        .unwrap();
    let resubscribed = consumer
        .wait_for_metrics(DEADLINE, |metrics| {
            metrics.resubscribes_for(ResubscribeReason::Disconnected) >= u64::from(cuts)
        })
        .await;
    assert!(resubscribed, "{:?}", consumer.metrics());

    let mut followers = followers_of(relay.wan_addr(), &catalog).await;
    assert_converged(&relay, &catalog, &consumer, &mut followers).await;
    let (_, current_legs, hits) = score_trace(&consumer, &catalog, 50);
    assert!(current_legs > 0 && hits > 0);
    // Every pool stream that was not cut installed its snapshot; no cut one did.
    let opened = proxy.pool_streams.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        consumer.metrics().snapshots_installed,
        u64::from(opened - cuts),
        "{:?}",
        consumer.metrics()
    );

    consumer.shutdown().await;
    drop(proxy);
    relay.shutdown().await.unwrap();
}

/// A loopback TCP proxy that can cut every connection through it and refuse new ones for
/// a while: a network outage between a consumer and its relay.
struct OutageProxy {
    addr: SocketAddr,
    up: std::sync::Arc<tokio::sync::watch::Sender<bool>>,
    task: tokio::task::JoinHandle<()>,
}

impl OutageProxy {
    async fn start(relay: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let up = std::sync::Arc::new(tokio::sync::watch::Sender::new(true));
        let link = std::sync::Arc::clone(&up);
        let task = tokio::spawn(async move {
            let mut connections = tokio::task::JoinSet::new();
            loop {
                let Ok((mut client, _)) = listener.accept().await else {
                    return;
                };
                let mut state = link.subscribe();
                if !*state.borrow_and_update() {
                    drop(client);
                    continue;
                }
                connections.spawn(async move {
                    let Ok(mut upstream) = tokio::net::TcpStream::connect(relay).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut upstream) => {}
                        _ = state.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        Self { addr, up, task }
    }

    fn set_up(&self, up: bool) {
        self.up.send_replace(up);
    }
}

impl Drop for OutageProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Stores `rounds` rounds of fresh 8-block chains, one on every source of `relay` per
/// round, flushing each round into its own delta; `salt` keeps calls apart (0: block and
/// event ids start at 0).
async fn store_rounds(relay: &Relay, rounds: u64, salt: u64) {
    let sources = relay.sources();
    for round in 0..rounds {
        for (at, source) in sources.iter().enumerate() {
            let first = (salt << 40) | ((round * 100 + at as u64) * 8);
            let blocks = (first..first + 8)
                .map(|id| StoredBlock {
                    engine_block_id: id,
                    token_hash: id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x5eed,
                })
                .collect();
            relay
                .submit(RouterEvent {
                    source: *source,
                    event_id: (salt << 32) + round,
                    payload: EventPayload::Stored(StoredBlocks {
                        parent_engine_block_id: None,
                        blocks,
                    }),
                })
                .await
                .unwrap();
        }
        relay.flush().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_an_outage_every_pool_resumes_without_a_snapshot() {
    let (relay, catalog) = start_relay(example_config("dc-test")).await;
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .expect("the workload finishes");
    let proxy = OutageProxy::start(relay.wan_addr()).await;
    let consumer = start_consumer(proxy.addr);
    let all_current = consumer
        .wait_until(DEADLINE, |state, now| {
            let pools = state.pools(now);
            pools.len() == EXAMPLE_POOLS
                && pools
                    .iter()
                    .all(|status| status.replica == ReplicaState::Current)
        })
        .await;
    assert!(all_current, "{:?}", consumer.pools());
    // The counter moves just after the replica turns current: wait for every pool's
    // snapshot to be counted before taking the baseline.
    let counted = consumer
        .wait_for_metrics(DEADLINE, |metrics| {
            metrics.snapshots_installed >= EXAMPLE_POOLS as u64
        })
        .await;
    assert!(counted, "{:?}", consumer.metrics());
    let snapshots_before = consumer.metrics().snapshots_installed;

    // Two seconds without a network, while every source keeps storing blocks.
    proxy.set_up(false);
    store_rounds(&relay, 10, 7).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let cut_off = consumer
        .wait_until(DEADLINE, |state, now| state.pools(now).is_empty())
        .await;
    assert!(
        cut_off,
        "a relay out of reach is not scored: {:?}",
        consumer.pools()
    );
    proxy.set_up(true);

    // Every replica comes back at its producer's sequence, without a new snapshot.
    for pool in &catalog.pools {
        let table = relay.producer_table(&pool.producer).await.unwrap();
        let current = consumer
            .wait_until(DEADLINE, |state, now| {
                state.pools(now).iter().any(|status| {
                    status.producer == pool.producer
                        && status.replica == ReplicaState::Current
                        && status.sequence == Some(table.sequence)
                })
            })
            .await;
        assert!(current, "{:?}", consumer.pools());
    }
    let metrics = consumer.metrics();
    assert_eq!(metrics.snapshots_installed, snapshots_before, "{metrics:?}");
    let (_, current_legs, hits) = score_trace(&consumer, &catalog, 50);
    assert!(current_legs > 0 && hits > 0);

    consumer.shutdown().await;
    drop(proxy);
    relay.shutdown().await.unwrap();
}
