//! The Dynamo-contract door of a running relay, followed by a gRPC client built from our
//! `.proto`, on loopback: the same pools, catalog, readiness and load as the WAN door, the
//! contract's error statuses and reason metadata, health, reflection, TLS and the token.

use crate::support;

use crate::interop;

use std::sync::Arc;

use kvrelay_codec::v1::{Message, PoolFrame, StreamRpc};
use kvrelay_dynamo::proto::kv_event_relay_client::KvEventRelayClient;
use kvrelay_dynamo::proto::{self, FilterUpdateKind};
use kvrelay_dynamo::{CONTRACT_MARKER, ERROR_REASON_KEY, ReceivedCatalog};
use kvrelay_server::{DynamoConfig, MirrorProgress, PoolMirror, Relay, RelayConfig};
use kvrelay_tls::test_ca::{Purpose, TestAuthority};
use support::{DEADLINE, deployment, first_message, request};
use tonic::transport::Channel;

fn with_door(mut config: RelayConfig) -> RelayConfig {
    config.dynamo = Some(DynamoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        plaintext: true,
        ..DynamoConfig::default()
    });
    config
}

/// A relay of the two-pool deployment (`n_requests` replayed) with the door on, once both
/// pools are published.
async fn relay_with_door(dir: &std::path::Path, n_requests: u64) -> Relay {
    let relay = Relay::start(with_door(deployment(dir, n_requests)))
        .await
        .unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(2))
        .await
        .expect("pools within the deadline");
    relay
}

async fn client(relay: &Relay) -> KvEventRelayClient<Channel> {
    let addr = relay.dynamo_addr().expect("the door is on");
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    KvEventRelayClient::new(channel)
        .max_decoding_message_size(kvrelay_dynamo::contract::MAX_MESSAGE_BYTES)
}

fn reason(status: &tonic::Status) -> &str {
    status
        .metadata()
        .get(ERROR_REASON_KEY)
        .and_then(|value| value.to_str().ok())
        .unwrap_or("<none>")
}

#[tokio::test]
async fn a_contract_client_follows_the_same_pools_as_the_wan_door() {
    let dir = tempfile::tempdir().unwrap();
    let relay = relay_with_door(dir.path(), 400).await;
    let mut grpc = client(&relay).await;

    let info = grpc
        .get_relay_info(proto::RelayInfoRequest {
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (info.protocol_version, info.contract_marker),
        (1, CONTRACT_MARKER)
    );
    let (_info_stream, wan_info) =
        first_message(relay.wan_addr(), &request(StreamRpc::RelayInfo)).await;
    let Message::RelayInfo(wan_info) = wan_info else {
        panic!("expected relay info")
    };
    assert_eq!(info.relay, Some(wan_info.relay.into()));

    // The catalog is the WAN door's, field for field.
    let mut catalogs = grpc
        .watch_kv_pool_catalog(proto::WatchKvPoolCatalogRequest {
            subscriber_id: "contract-test".to_owned(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    let update = catalogs.message().await.unwrap().expect("a catalog");
    assert_eq!(update.contract_marker, CONTRACT_MARKER);
    let received = ReceivedCatalog::try_from(update).unwrap();
    assert!(
        received.unsupported.is_empty(),
        "{:?}",
        received.unsupported
    );
    let (_catalog_stream, wan_catalog) =
        first_message(relay.wan_addr(), &request(StreamRpc::WatchCatalog)).await;
    let Message::CatalogUpdate(wan_catalog) = wan_catalog else {
        panic!("expected a catalog")
    };
    assert_eq!(received.catalog, wan_catalog);
    assert_eq!(received.catalog.pools.len(), 2);

    // Subscribe while the workload may still run, so deltas follow the snapshot.
    let mut followers = Vec::new();
    for pool in &received.catalog.pools {
        let stream = grpc
            .subscribe_kv_pool(proto::SubscribeKvPoolRequest {
                subscriber_id: "contract-test".to_owned(),
                expected_producer: Some(pool.producer.into()),
                contract_marker: CONTRACT_MARKER,
            })
            .await
            .unwrap()
            .into_inner();
        followers.push((stream, PoolMirror::new(pool.producer).unwrap()));
    }
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .expect("workload within the deadline");
    relay.flush().await;
    for (stream, mirror) in &mut followers {
        let table = relay.producer_table(mirror.producer()).await.unwrap();
        let mut deltas = 0;
        while mirror.words().is_none() || mirror.sequence() < table.sequence {
            let update = tokio::time::timeout(DEADLINE, stream.message())
                .await
                .expect("an update in time")
                .unwrap()
                .expect("an open stream");
            assert_eq!(
                (update.protocol_version, update.contract_marker),
                (1, CONTRACT_MARKER)
            );
            let kind = update.kind();
            if kind != FilterUpdateKind::Heartbeat {
                // Every payload is a CBI1 image.
                assert_eq!(&update.payload[..4], b"CBI1");
            }
            if kind == FilterUpdateKind::Delta {
                // The contract's deltas are never coalesced.
                assert_eq!(update.base_sequence + 1, update.sequence);
            }
            let frame = PoolFrame::try_from(update).unwrap();
            if mirror.handle_pool_frame(&frame).unwrap() == MirrorProgress::Delta {
                deltas += 1;
            }
        }
        assert_eq!(mirror.sequence(), table.sequence);
        assert_eq!(
            mirror.words().unwrap(),
            table.words.as_slice(),
            "the contract client's filter differs from the producer's"
        );
        assert!(deltas > 0 || table.sequence == mirror.sequence());
    }

    let readiness = grpc
        .subscribe_serving_readiness(proto::SubscribeServingReadinessRequest {
            subscriber_id: "contract-test".to_owned(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .expect("a readiness update");
    assert_eq!(readiness.contract_marker, CONTRACT_MARKER);
    let ready: Vec<_> = readiness
        .entries
        .iter()
        .filter(|entry| entry.state() == proto::ServingReadinessState::Ready)
        .map(|entry| entry.canonical_model_id.as_str())
        .collect();
    assert!(ready.contains(&"model-a"), "{readiness:?}");

    let mut windows = grpc
        .subscribe_kv_pool_load(proto::SubscribeKvPoolLoadRequest {
            subscriber_id: "contract-test".to_owned(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner();
    // One complete window per load interval: the first after both pools reported.
    let load = loop {
        let window = tokio::time::timeout(DEADLINE, windows.message())
            .await
            .expect("a window in time")
            .unwrap()
            .expect("an open stream");
        assert_eq!(window.contract_marker, CONTRACT_MARKER);
        if window.pools.len() == 2 {
            break window;
        }
    };
    for entry in &load.pools {
        assert!(entry.kv_observed_ranks <= entry.kv_expected_ranks);
    }
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn refusals_carry_the_contract_status_and_reason() {
    let dir = tempfile::tempdir().unwrap();
    let relay = relay_with_door(dir.path(), 20).await;
    let mut grpc = client(&relay).await;

    let status = grpc
        .get_relay_info(proto::RelayInfoRequest { contract_marker: 7 })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert_eq!(reason(&status), "RELAY_ERROR_REASON_CONTRACT_MISMATCH");

    for bad in ["", "line\nbreak"] {
        let status = grpc
            .watch_kv_pool_catalog(proto::WatchKvPoolCatalogRequest {
                subscriber_id: bad.to_owned(),
                contract_marker: CONTRACT_MARKER,
            })
            .await
            .expect_err("a bad subscriber id is refused");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{bad:?}");
        assert_eq!(reason(&status), "RELAY_ERROR_REASON_INVALID_REQUEST");
    }

    let catalog = grpc
        .watch_kv_pool_catalog(proto::WatchKvPoolCatalogRequest {
            subscriber_id: "t".to_owned(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap()
        .into_inner()
        .message()
        .await
        .unwrap()
        .unwrap();
    let current = ReceivedCatalog::try_from(catalog).unwrap().catalog.pools[0].producer;
    let subscribe = |producer: Option<proto::ProducerIdentity>| proto::SubscribeKvPoolRequest {
        subscriber_id: "t".to_owned(),
        expected_producer: producer,
        contract_marker: CONTRACT_MARKER,
    };

    let mut stale = current;
    stale.layout_generation += 1;
    let status = grpc
        .subscribe_kv_pool(subscribe(Some(stale.into())))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert_eq!(reason(&status), "RELAY_ERROR_REASON_PRODUCER_CHANGED");

    let mut unknown = current;
    unknown.pool_id.dc_id ^= 1;
    let status = grpc
        .subscribe_kv_pool(subscribe(Some(unknown.into())))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::NotFound);
    assert_eq!(reason(&status), "RELAY_ERROR_REASON_POOL_NOT_FOUND");

    let status = grpc
        .subscribe_kv_pool(subscribe(None))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);

    let mut foreign_format = current;
    foreign_format.ckf_format.fingerprint_bits = 8;
    let status = grpc
        .subscribe_kv_pool(subscribe(Some(foreign_format.into())))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::FailedPrecondition);
    assert_eq!(reason(&status), "RELAY_ERROR_REASON_UNSUPPORTED_FEATURE");

    let status = grpc
        .subscribe_serving_load(proto::SubscribeServingLoadRequest {
            subscriber_id: "t".to_owned(),
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::Unimplemented);

    let metrics = relay_metrics(&relay).await;
    assert!(
        metrics.contains(
            "kvrelay_dynamo_errors_total{rpc=\"SubscribeKvPool\",reason=\"producer_changed\"} 1"
        ),
        "{metrics}"
    );
    relay.shutdown().await.unwrap();
}

/// The door shares the WAN's per-peer admission: one host multiplexing calls on one
/// HTTP/2 connection holds at most `max_streams_per_peer` subscribers of a pool; the next
/// is `RESOURCE_EXHAUSTED` (counted as `per_peer`), and catalog streams have their own share.
#[tokio::test]
async fn one_connection_holds_at_most_its_peers_share_of_a_pool() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = with_door(deployment(dir.path(), 20));
    config.limits.max_streams_per_peer = 2;
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(2))
        .await
        .unwrap();
    let mut grpc = client(&relay).await;
    let producer = relay.catalog().pools[0].producer;
    let subscribe = || proto::SubscribeKvPoolRequest {
        subscriber_id: "greedy".to_owned(),
        expected_producer: Some(producer.into()),
        contract_marker: CONTRACT_MARKER,
    };
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut stream = grpc
            .subscribe_kv_pool(subscribe())
            .await
            .unwrap()
            .into_inner();
        let first = stream.message().await.unwrap().unwrap();
        assert_eq!(first.kind(), FilterUpdateKind::SnapshotChunk);
        held.push(stream);
    }
    let status = grpc
        .subscribe_kv_pool(subscribe())
        .await
        .expect_err("the host's third subscriber of the pool is refused");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(reason(&status), "RELAY_ERROR_REASON_RESOURCE_LIMIT");
    assert!(status.message().contains("per peer"), "{status:?}");
    let catalog = grpc
        .watch_kv_pool_catalog(proto::WatchKvPoolCatalogRequest {
            subscriber_id: "greedy".to_owned(),
            contract_marker: CONTRACT_MARKER,
        })
        .await;
    assert!(catalog.is_ok(), "{catalog:?}");
    let metrics = relay_metrics(&relay).await;
    assert!(
        metrics.contains("kvrelay_admission_rejected_total{stream=\"pool\",scope=\"per_peer\"} 1"),
        "{metrics}"
    );
    drop(held);
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn health_and_reflection_are_served() {
    let dir = tempfile::tempdir().unwrap();
    let relay = Relay::start(with_door(deployment(dir.path(), 5)))
        .await
        .unwrap();
    let addr = relay.dynamo_addr().unwrap();
    let channel = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let check = |service: &str| tonic_health::pb::HealthCheckRequest {
        service: service.to_owned(),
    };
    let serving = health
        .check(check(kvrelay_dynamo::contract::SERVICE_NAME))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        serving.status(),
        tonic_health::pb::health_check_response::ServingStatus::Serving
    );

    // Reflection lists the contract's service.
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    let mut reflection = ServerReflectionClient::new(channel);
    let request = tonic_reflection::pb::v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let answer = answers.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = answer.message_response else {
        panic!("expected a service list, got {answer:?}")
    };
    let names: Vec<_> = list.service.iter().map(|s| s.name.as_str()).collect();
    assert!(
        names.contains(&"dynamo.kvrelay.v1.KvEventRelay"),
        "{names:?}"
    );
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn with_a_token_and_tls_only_an_authorised_tls_client_is_served() {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestAuthority::new("kvrelay test ca").unwrap();
    let (cert, key) = ca
        .issue_to(dir.path(), "server", &["localhost"], Purpose::Server)
        .unwrap();
    let token_file = dir.path().join("token");
    std::fs::write(&token_file, "door-secret\n").unwrap();
    let mut config = deployment(dir.path(), 5);
    config.dynamo = Some(DynamoConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        tls: Some(kvrelay_server::ListenerTls {
            cert,
            key,
            client_ca: None,
        }),
        auth: Some(kvrelay_server::AuthConfig {
            token: None,
            token_file: Some(token_file),
        }),
        plaintext: false,
    });
    let relay = Relay::start(config).await.unwrap();
    let addr = relay.dynamo_addr().unwrap();

    // Plaintext gets no answer.
    let plain = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await;
    if let Ok(plain) = plain {
        let status = KvEventRelayClient::new(plain)
            .get_relay_info(proto::RelayInfoRequest {
                contract_marker: CONTRACT_MARKER,
            })
            .await
            .unwrap_err();
        assert_ne!(status.code(), tonic::Code::Ok);
    }

    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert_der()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(client));
    let connector = tower::service_fn(move |_: tonic::transport::Uri| {
        let tls = tls.clone();
        async move {
            let tcp = tokio::net::TcpStream::connect(addr).await?;
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            let stream = tls.connect(name, tcp).await?;
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
        }
    });
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(connector)
        .await
        .unwrap();
    let mut grpc = KvEventRelayClient::new(channel.clone());
    let status = grpc
        .get_relay_info(proto::RelayInfoRequest {
            contract_marker: CONTRACT_MARKER,
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unauthenticated);

    let mut request = tonic::Request::new(proto::RelayInfoRequest {
        contract_marker: CONTRACT_MARKER,
    });
    request
        .metadata_mut()
        .insert("authorization", "Bearer door-secret".parse().unwrap());
    let info = grpc.get_relay_info(request).await.unwrap().into_inner();
    assert_eq!(info.contract_marker, CONTRACT_MARKER);
    let metrics = relay_metrics(&relay).await;
    assert!(
        metrics.contains("kvrelay_dynamo_unauthorized_total 1"),
        "{metrics}"
    );
    relay.shutdown().await.unwrap();
}

#[test]
fn the_door_needs_tls_or_an_explicit_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = deployment(dir.path(), 1);
    config.dynamo = Some(DynamoConfig::default());
    let err = config.validate().unwrap_err().to_string();
    assert!(err.contains("dynamo.plaintext"), "{err}");
    config.dynamo = Some(DynamoConfig {
        plaintext: true,
        ..DynamoConfig::default()
    });
    config.validate().unwrap();
}

async fn relay_metrics(relay: &Relay) -> String {
    let addr = relay.admin_addr().expect("admin is on");
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut page = String::new();
    tcp.read_to_string(&mut page).await.unwrap();
    page
}

/// A Python client generated from our `.proto` by grpcio-tools (no code of ours on that
/// side) follows the relay: relay info, catalog, every pool's snapshot rebuilt from the
/// CBI1 payloads equal to the producer's table, readiness, load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_client_built_from_our_proto_rebuilds_every_pool() {
    let dir = tempfile::tempdir().unwrap();
    let relay = relay_with_door(dir.path(), 400).await;
    tokio::time::timeout(DEADLINE, relay.workload_finished())
        .await
        .expect("workload within the deadline");
    relay.flush().await;

    let out = dir.path().join("seen.json");
    let include =
        std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kvrelay-dynamo/proto");
    let status = tokio::time::timeout(
        std::time::Duration::from_secs(120),
        tokio::process::Command::new(interop::python())
            .arg(interop::script("contract_client.py"))
            .arg(relay.dynamo_addr().unwrap().to_string())
            .arg(include)
            .arg(&out)
            .kill_on_drop(true)
            .status(),
    )
    .await
    .expect("the python client finishes")
    .unwrap();
    assert!(status.success(), "the python client failed: {status}");
    let seen: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();

    let catalog = relay.catalog();
    assert_eq!(seen["revision"], catalog.revision);
    assert_eq!(seen["relay_incarnation"], catalog.relay.relay_incarnation);
    let pools = seen["pools"].as_array().unwrap();
    assert_eq!(pools.len(), catalog.pools.len());
    for pool in &catalog.pools {
        let endpoint = pool.serving_endpoint.to_string();
        let rebuilt = pools
            .iter()
            .find(|seen| seen["endpoint"] == endpoint.as_str())
            .unwrap_or_else(|| panic!("the python client did not see {endpoint}"));
        let table = relay.producer_table(&pool.producer).await.unwrap();
        assert_eq!(rebuilt["sequence"], table.sequence, "{endpoint}");
        assert_eq!(rebuilt["dc_id"], pool.producer.pool_id.dc_id, "{endpoint}");
        let words: Vec<String> = table
            .words
            .iter()
            .map(|word| format!("{word:016x}"))
            .collect();
        assert_eq!(
            rebuilt["words"],
            serde_json::json!(words),
            "{endpoint}: filter differs"
        );
        assert!(
            table.words.iter().any(|word| *word != 0),
            "{endpoint} is empty"
        );
    }
    let ready: Vec<&str> = seen["ready_models"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(serde_json::Value::as_str)
        .collect();
    assert!(ready.contains(&"model-a"), "{ready:?}");
    assert_eq!(seen["load_pools"], catalog.pools.len());
    relay.shutdown().await.unwrap();
}
