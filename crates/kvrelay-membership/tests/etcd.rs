//! The etcd backend against a real etcd server on loopback (Debian package `etcd-server`).
//!
//! Each test starts its own etcd on free ports with a temporary data directory, waits for
//! its "ready to serve client requests" log line (bounded), and kills it on drop. Set
//! `ETCD_BIN` to use another binary than `/usr/bin/etcd`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "a test harness fails loudly on any setup error"
)]

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use kvrelay_identity::EndpointId;
use kvrelay_membership::{
    Discovery, DiscoveryEvent, DiscoveryQuery, DiscoveryScope, DiscoveryWatch, EtcdClientLimits,
    EtcdDiscovery, EtcdError, MembershipSubscription, MembershipView, MembershipWatch,
    ModelCardInstance, ModelCardInstanceId, WatchConfig,
};
use tokio_util::sync::CancellationToken;

const READY_LINE: &str = "ready to serve client requests";
const STARTUP_DEADLINE: Duration = Duration::from_secs(30);
const EVENT_DEADLINE: Duration = Duration::from_secs(30);

struct EtcdServer {
    child: Child,
    client_port: u16,
}

impl EtcdServer {
    fn binary() -> PathBuf {
        let binary = std::env::var_os("ETCD_BIN")
            .map_or_else(|| PathBuf::from("/usr/bin/etcd"), PathBuf::from);
        assert!(
            binary.exists(),
            "etcd binary not found at {} (install the Debian package etcd-server, or set ETCD_BIN)",
            binary.display()
        );
        binary
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Starts etcd on the given client port (0 = pick one) with `data_dir`.
    fn start(data_dir: &Path, client_port: u16) -> Self {
        let client_port = if client_port == 0 {
            Self::free_port()
        } else {
            client_port
        };
        let peer_port = Self::free_port();
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut child = Command::new(Self::binary())
            .arg("--name=kvrelay-test")
            .arg(format!("--data-dir={}", data_dir.display()))
            .arg(format!("--listen-client-urls={client_url}"))
            .arg(format!("--advertise-client-urls={client_url}"))
            .arg(format!("--listen-peer-urls={peer_url}"))
            .arg(format!("--initial-advertise-peer-urls={peer_url}"))
            .arg(format!("--initial-cluster=kvrelay-test={peer_url}"))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning etcd");
        let stderr = child.stderr.take().unwrap();
        let (ready_sender, ready) = mpsc::channel();
        // Drains etcd's log for its whole life so the pipe never fills.
        std::thread::spawn(move || {
            let mut ready_sender = Some(ready_sender);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if line.contains(READY_LINE)
                    && let Some(sender) = ready_sender.take()
                {
                    let _ = sender.send(());
                }
            }
        });
        let mut server = Self { child, client_port };
        if ready.recv_timeout(STARTUP_DEADLINE).is_err() {
            server.stop();
            panic!("etcd on port {client_port} not ready within {STARTUP_DEADLINE:?}");
        }
        server
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for EtcdServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn card(namespace: &str, endpoint: &str, worker: u64) -> ModelCardInstance {
    ModelCardInstance {
        id: ModelCardInstanceId {
            namespace: namespace.into(),
            component: "backend".into(),
            endpoint: endpoint.into(),
            instance_id: worker,
            model_suffix: None,
        },
        card_json: serde_json::json!({
            "display_name": "llama", "kv_cache_block_size": 16, "worker_type": "aggregated",
            "runtime_config": {"total_kv_blocks": 1024, "data_parallel_size": 1}
        }),
    }
}

async fn connect(server: &EtcdServer) -> EtcdDiscovery {
    EtcdDiscovery::connect(&[server.url()], Duration::from_secs(5))
        .await
        .unwrap()
}

async fn next_event(watch: &mut DiscoveryWatch) -> DiscoveryEvent {
    tokio::time::timeout(EVENT_DEADLINE, watch.next())
        .await
        .expect("no etcd event within the deadline")
        .expect("etcd watch closed")
        .expect("etcd watch failed")
}

async fn wait_for(
    subscription: &mut MembershipSubscription,
    what: &str,
    accept: impl Fn(&MembershipView) -> bool,
) -> MembershipView {
    let current = subscription.current();
    if accept(&current) {
        return current;
    }
    tokio::time::timeout(EVENT_DEADLINE, async {
        loop {
            let view = subscription
                .changed()
                .await
                .expect("membership watch stopped");
            if accept(&view) {
                return view;
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("membership view never showed {what}"))
}

fn endpoint(name: &str) -> EndpointId {
    EndpointId::new("prod", "backend", name).unwrap()
}

fn has(view: &MembershipView, name: &str) -> bool {
    view.endpoint(&endpoint(name)).is_some()
}

#[tokio::test]
async fn etcd_lists_watches_puts_and_deletes() {
    let data = tempfile::tempdir().unwrap();
    let server = EtcdServer::start(data.path(), 0);
    let etcd = connect(&server).await;
    etcd.put_card(&card("prod", "a", 1)).await.unwrap();
    etcd.put_card(&card("staging", "a", 2)).await.unwrap();

    let (listing, mut watch) = etcd
        .list_and_watch(&DiscoveryQuery::AllModels)
        .await
        .unwrap();
    assert_eq!(listing.len(), 2);
    let prod = DiscoveryQuery::NamespacedModels {
        namespace: "prod".into(),
    };
    assert_eq!(etcd.list(&prod).await.unwrap(), vec![card("prod", "a", 1)]);

    let added = card("prod", "b", 3);
    etcd.put_card(&added).await.unwrap();
    assert_eq!(
        next_event(&mut watch).await,
        DiscoveryEvent::Added(added.clone())
    );
    etcd.delete_card(&added.id).await.unwrap();
    assert_eq!(
        next_event(&mut watch).await,
        DiscoveryEvent::Removed(added.id)
    );
}

#[tokio::test]
async fn reference_key_layout_is_used() {
    let data = tempfile::tempdir().unwrap();
    let server = EtcdServer::start(data.path(), 0);
    let etcd = connect(&server).await;
    let instance = card("prod", "generate", 0x9e1f_5065_d819_3fef);
    etcd.put_card(&instance).await.unwrap();
    let listing = etcd
        .client()
        .list_prefix(b"v1/mdc/prod/backend/generate/9e1f5065d8193fef")
        .await
        .unwrap();
    assert_eq!(listing.records.len(), 1);
    let stored = ModelCardInstance::from_record_json(&listing.records[0].value).unwrap();
    assert_eq!(stored, instance);
}

#[tokio::test]
async fn generated_card_set_round_trips_through_etcd() {
    let data = tempfile::tempdir().unwrap();
    let server = EtcdServer::start(data.path(), 0);
    let etcd = connect(&server).await;
    let mut written: Vec<ModelCardInstance> = (0..200)
        .map(|n| {
            let mut instance = card("prod", &format!("e{}", n % 13), n);
            if n % 4 == 0 {
                instance.id.model_suffix = Some(format!("adapter-{n}"));
            }
            instance
        })
        .collect();
    for instance in &written {
        etcd.put_card(instance).await.unwrap();
    }
    let mut listed = etcd.list(&DiscoveryQuery::AllModels).await.unwrap();
    listed.sort_by(|a, b| a.id.cmp(&b.id));
    written.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(listed, written);
}

#[tokio::test]
async fn membership_watch_rebinds_and_reconciles_across_server_restarts() {
    let data = tempfile::tempdir().unwrap();
    let mut server = EtcdServer::start(data.path(), 0);
    let port = server.client_port;
    let etcd = connect(&server).await;
    etcd.put_card(&card("prod", "x", 1)).await.unwrap();
    etcd.put_card(&card("prod", "y", 2)).await.unwrap();

    let scope = DiscoveryScope {
        namespaces: vec!["prod".into()],
        ..DiscoveryScope::default()
    };
    let discovery: Arc<dyn Discovery> = Arc::new(etcd.clone());
    let watch = MembershipWatch::start(
        discovery,
        &scope,
        WatchConfig::default(),
        &CancellationToken::new(),
    )
    .await
    .unwrap();
    let mut subscription = watch.subscribe();
    assert_eq!(watch.view().len(), 2);

    // Same data directory: the watch breaks, rebinds, and later events flow again.
    server.stop();
    let mut server = EtcdServer::start(data.path(), port);
    // A new client: the old one's first request after the restart fails while reconnecting.
    let writer = connect(&server).await;
    writer.put_card(&card("prod", "w", 3)).await.unwrap();
    wait_for(
        &mut subscription,
        "the card put after the restart",
        |view| has(view, "w"),
    )
    .await;

    // An empty server on the same address: only a re-list can drop x, y and w.
    server.stop();
    let fresh = tempfile::tempdir().unwrap();
    let server = EtcdServer::start(fresh.path(), port);
    let writer = connect(&server).await;
    writer.put_card(&card("prod", "z", 4)).await.unwrap();
    let view = wait_for(&mut subscription, "exactly the new server's card", |view| {
        view.len() == 1 && has(view, "z")
    })
    .await;
    assert!(!has(&view, "x"));
    watch.shutdown().await;
}

/// More than tonic's default 4 MiB receive limit under `v1/mdc/` (a scale ceiling of
/// about 3,500 real cards with one unpaginated read): the listing pages, every card
/// arrives, a junk record is skipped and counted, a record over the record limit is
/// stepped over and counted.
#[tokio::test]
async fn listing_pages_past_four_mebibytes_and_counts_junk() {
    let data = tempfile::tempdir().unwrap();
    let server = EtcdServer::start(data.path(), 0);
    let limits = EtcdClientLimits {
        max_record_bytes: 200 * 1024,
        page_keys: 64,
        timeout: Duration::from_secs(5),
    };
    let etcd = EtcdDiscovery::connect_with_limits(&[server.url()], limits)
        .await
        .unwrap();
    // 5 MiB of cards: each carries 40 KiB of padding in its card JSON.
    let padding = "p".repeat(40 * 1024);
    let mut written = Vec::new();
    for n in 0..128 {
        let mut instance = card("prod", &format!("e{}", n % 7), n);
        instance.card_json["padding"] = serde_json::Value::String(padding.clone());
        etcd.put_card(&instance).await.unwrap();
        written.push(instance);
    }
    let client = etcd.client();
    client
        .put(
            b"v1/mdc/prod/backend/junk/00000000000000ff",
            b"{not json",
            0,
        )
        .await
        .unwrap();
    client
        .put(
            b"v1/mdc/prod/backend/huge/00000000000000fe",
            &vec![b'x'; 300 * 1024],
            0,
        )
        .await
        .unwrap();

    let mut listed = etcd.list(&DiscoveryQuery::AllModels).await.unwrap();
    listed.sort_by(|a, b| a.id.cmp(&b.id));
    written.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(listed.len(), written.len());
    assert_eq!(listed, written);
    let skips = etcd.skips();
    assert_eq!(skips.malformed, 1, "the junk record is counted");
    assert_eq!(skips.too_large, 1, "the oversized record is counted");
    // A relisting (reconcile, rebind) does not count the same records again.
    etcd.list(&DiscoveryQuery::AllModels).await.unwrap();
    assert_eq!(etcd.skips(), skips);
}

/// A watch whose start revision was compacted away ends with `WatchCancelled`; a watch
/// over leased records sees them go when the lease is revoked.
#[tokio::test]
async fn compacted_watch_is_cancelled_and_lease_end_removes_cards() {
    let data = tempfile::tempdir().unwrap();
    let server = EtcdServer::start(data.path(), 0);
    let etcd = connect(&server).await;
    let client = etcd.client();
    for n in 0..5 {
        etcd.put_card(&card("prod", "c", n)).await.unwrap();
    }
    let listing = client.list_prefix(b"v1/mdc/").await.unwrap();
    client.compact(listing.revision).await.unwrap();
    // etcd creates the watch, then cancels it with the compaction revision.
    let error = match client.watch_prefix(b"v1/mdc/", 2).await {
        Ok(mut watch) => tokio::time::timeout(EVENT_DEADLINE, watch.next())
            .await
            .expect("no cancellation within the deadline")
            .unwrap_err(),
        Err(error) => error,
    };
    assert!(
        matches!(error, EtcdError::WatchCancelled { compact_revision, .. } if compact_revision > 0),
        "{error}"
    );

    let (_, mut watch) = etcd
        .list_and_watch(&DiscoveryQuery::AllModels)
        .await
        .unwrap();
    let lease = client.grant_lease(60).await.unwrap();
    let leased = card("prod", "leased", 0xabc);
    client
        .put(
            kvrelay_membership::card_key(&leased.id).as_bytes(),
            leased.to_record_json().as_bytes(),
            lease,
        )
        .await
        .unwrap();
    assert_eq!(
        next_event(&mut watch).await,
        DiscoveryEvent::Added(leased.clone())
    );
    client.revoke_lease(lease).await.unwrap();
    assert_eq!(
        next_event(&mut watch).await,
        DiscoveryEvent::Removed(leased.id)
    );
}
