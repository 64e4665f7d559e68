//! The consumer over Dynamo's relay contract, against real relays on loopback: a fleet
//! whose second DC is followed over gRPC (`dynamo-grpc`, the relay's `[dynamo]` door)
//! ranks every request exactly like the same fleet followed over kvrelay's WAN protocol,
//! and a relay restart seen over gRPC is a new incarnation the replicas converge on again.

use std::time::Duration;

use kvrelay_codec::v1::CatalogUpdate;
use kvrelay_consumer::{Consumer, RelayEndpoint, RelayProtocol, ReplicaState, ScoreRequest};
use kvrelay_server::{DynamoConfig, Relay, RelayConfig, WORKLOAD_TOKEN_SEED};

use crate::support;

use support::example_config;

const DEADLINE: Duration = Duration::from_secs(30);

fn with_door(mut config: RelayConfig) -> RelayConfig {
    config.dynamo = Some(DynamoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        plaintext: true,
        ..DynamoConfig::default()
    });
    config
}

async fn start_relay(dc: &str) -> Relay {
    let relay = Relay::start(with_door(example_config(dc))).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(4))
        .await
        .expect("every example pool is published");
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .expect("the workload finishes");
    relay.flush().await;
    relay
}

fn consumer(relays: Vec<RelayEndpoint>) -> Consumer {
    support::quick_consumer(relays)
}

/// Waits until `consumer` holds every pool of `relay` current at its producer's sequence.
async fn wait_current(consumer: &Consumer, relay: &Relay) {
    let catalog = relay.catalog();
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
        assert!(
            current,
            "pool {:?} not current at {}: {:?}",
            pool.serving_endpoint,
            table.sequence,
            consumer.pools()
        );
    }
}

/// Every (request, model) of the first `n` trace requests, scored.
fn requests(catalog: &CatalogUpdate, n: usize) -> Vec<ScoreRequest> {
    let models = kvrelay_consumer::served_base_models(catalog);
    let trace = kvrelay_ingest::parse_request_trace(kvrelay_ingest::BUILTIN_REQUEST_TRACE).unwrap();
    let mut requests = Vec::new();
    for record in trace.iter().take(n) {
        for served in &models {
            requests.push(ScoreRequest {
                tokens: kvrelay_ingest::request_tokens(
                    &record.hash_ids,
                    served.kv_block_size,
                    WORKLOAD_TOKEN_SEED,
                ),
                model: served.model.clone(),
                lora: None,
                cache_namespace: None,
            });
        }
    }
    requests
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_followed_partly_over_grpc_ranks_exactly_like_one_followed_over_the_wan() {
    let east = start_relay("dc-east").await;
    let west = start_relay("dc-west").await;
    let east_wan = RelayEndpoint::new(&east.wan_addr().to_string(), "dc-east");
    let west_wan = RelayEndpoint {
        cost: 5.0,
        ..RelayEndpoint::new(&west.wan_addr().to_string(), "dc-west")
    };
    let west_grpc = RelayEndpoint {
        addr: west.dynamo_addr().unwrap().to_string(),
        protocol: RelayProtocol::DynamoGrpc,
        ..west_wan.clone()
    };
    let all_wan = consumer(vec![east_wan.clone(), west_wan]);
    let mixed = consumer(vec![east_wan, west_grpc]);
    for consumer in [&all_wan, &mixed] {
        wait_current(consumer, &east).await;
        wait_current(consumer, &west).await;
    }
    // Load windows arrive once a second on both doors; both consumers must have one.
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    let requests = requests(&east.catalog(), 200);
    assert!(!requests.is_empty());
    let (mut hits, mut grpc_legs) = (0, 0);
    for request in &requests {
        let expected = all_wan.score(request).unwrap();
        let ranked = mixed.score(request).unwrap();
        assert_eq!(ranked, expected, "{request:?}");
        for candidate in &ranked.candidates {
            if &*candidate.dc == "dc-west" {
                grpc_legs += candidate.legs.len();
            }
            hits += candidate
                .legs
                .iter()
                .filter(|leg| leg.prefix_blocks.is_some_and(|blocks| blocks > 0))
                .count();
        }
    }
    assert!(hits > 0, "the replayed prefixes are found");
    assert!(
        grpc_legs > 0,
        "the gRPC-followed DC takes part in the ranking"
    );
    // One HTTP/2 connection carries every stream to the gRPC-followed relay.
    let page = admin_metrics(&west).await;
    let served: f64 = page
        .lines()
        .find(|line| line.starts_with("kvrelay_dynamo_connections_total{outcome=\"served\"}"))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0.0);
    assert_eq!(served, 1.0, "{page}");

    mixed.shutdown().await;
    all_wan.shutdown().await;
    east.shutdown().await.unwrap();
    west.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_restart_seen_over_grpc_is_a_new_incarnation_and_replicas_converge_again() {
    let first = start_relay("dc-test").await;
    let door = first.dynamo_addr().unwrap();
    let grpc = consumer(vec![
        RelayEndpoint::new(&door.to_string(), "dc-test").with_protocol(RelayProtocol::DynamoGrpc),
    ]);
    wait_current(&grpc, &first).await;
    let old = first.incarnation();
    first.shutdown().await.unwrap();
    let dropped = grpc
        .wait_until(DEADLINE, |state, now| state.pools(now).is_empty())
        .await;
    assert!(
        dropped,
        "replicas of a gone relay survive: {:?}",
        grpc.pools()
    );

    // The same door address, a new relay process.
    let mut config = with_door(example_config("dc-test"));
    if let Some(dynamo) = &mut config.dynamo {
        dynamo.listen = door;
    }
    let second = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, second.workload_finished())
        .await
        .expect("the workload finishes");
    second.flush().await;
    assert_ne!(second.incarnation(), old);
    wait_current(&grpc, &second).await;
    grpc.shutdown().await;
    second.shutdown().await.unwrap();
}

async fn admin_metrics(relay: &Relay) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = relay.admin_addr().expect("admin is on");
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut page = String::new();
    tcp.read_to_string(&mut page).await.unwrap();
    page
}
