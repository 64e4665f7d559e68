//! A relay fed by a Dynamo event-plane publisher advertised only through the reference
//! runtime's discovery records (`event_sources/` + `event_channels/`): its events reach a
//! WAN replica, and removing the records detaches the source and withdraws the pool.

use crate::support;

use std::path::Path;
use std::time::Duration;

use kvrelay_server::Relay;
use support::{
    DEADLINE, Feed, advert_records, mirror_at_producer, publish_until_resident, single_worker,
};
use zeromq::{PubSocket, Socket};

const WORKER: u64 = 0x11;
const PUBLISHER: u64 = 4_242;
const RECORD: &str =
    "namespace%2Fprod%2Fcomponent%2Fbackend%2Fendpoint%2Fgenerate%2Ftopic%2Fkv%2Devents%2F1092";

/// Writes the advert pair the reference runtime registers for one publisher.
fn advertise(store: &Path, zmq: &str) {
    let (source, channel) = advert_records(WORKER, PUBLISHER, zmq);
    for (bucket, record) in [("event_channels", channel), ("event_sources", source)] {
        std::fs::create_dir_all(store.join(bucket)).unwrap();
        std::fs::write(store.join(bucket).join(RECORD), record.to_string()).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advertised_zmq_source_feeds_a_wan_replica_and_detaches_when_withdrawn() {
    let mut publisher = PubSocket::new();
    let zmq = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store/v1");
    let mut config = single_worker(dir.path(), "dc-adverts", "prod");
    config.discovery.event_sources_dir = Some(store.clone());
    let relay = Relay::start(config).await.unwrap();
    assert!(relay.catalog().pools.is_empty(), "no source yet, no pool");

    advertise(&store, &zmq);
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .unwrap();

    publish_until_resident(
        &relay,
        &mut publisher,
        Feed::DynamoEventPlane {
            publisher: PUBLISHER,
            worker: WORKER,
        },
        "no advertised worker's event reached the pool",
    )
    .await;

    let producer = relay.catalog().pools[0].producer;
    let (mirror, table) = mirror_at_producer(&relay, producer).await;
    assert!(table.words.iter().any(|word| *word != 0));
    assert_eq!(mirror.words().unwrap(), table.words.as_slice());

    // Withdrawing the advert detaches the source: the pool has no source left and retires.
    std::fs::remove_file(store.join("event_sources").join(RECORD)).unwrap();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while !relay.catalog().pools.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "pool not withdrawn after its advert was removed"
        );
        tick.tick().await;
    }
    assert!(relay.sources().is_empty());
    relay.shutdown().await.unwrap();
}
