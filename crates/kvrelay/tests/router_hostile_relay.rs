//! Issue #32 on the real binary: a relay (or anyone on a plaintext path to one) that
//! advertises what it likes must not take `kvrelay router` past the bounds it was
//! configured with. The relay here is a few dozen lines that answer the WAN protocol's
//! first requests with a catalog and then hold every other stream silent: replicas are
//! allocated when their subscriptions begin, before any snapshot, so no filter words
//! need to be sent for the memory to be claimed.
//!
//! - 32 pools of the largest filter (2^24 buckets, 128 MiB of table per lane) against a
//!   router whose `max_query_table_bytes` is 512 MiB: the router's peak RSS stays within
//!   that budget (it took 2.14 GB for four such pools before the budget, and 32 killed
//!   it), the refused replicas are counted, and the API answers throughout.
//! - 4,096 tiny pools against a router run under `prlimit --nofile=1024`: it opens at most
//!   `max_pool_streams_per_relay` pool streams, does not retry in a loop, and its API
//!   keeps answering (it stopped accepting before).

use crate::support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use kvrelay_codec::Limits;
use kvrelay_codec::v1::{
    CatalogUpdate, CkfFormat, DigestId, EndpointId, HashFormat, IdentitySource, Message,
    ModelRegistration, PoolDescriptor, PoolId, ProducerIdentity, QuerySemantics, RelayIdentity,
    RelayInfo, StreamRpc, WorkerRole, decode_message, encode_message,
};
use kvrelay_identity::DcId;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Bound of every wait.
const DEADLINE: Duration = Duration::from_secs(60);
/// The DC the router is told the hostile relay serves.
const DC: &str = "dc-hostile";

/// What the hostile relay has seen.
#[derive(Default)]
struct Seen {
    /// Pool subscriptions received.
    subscriptions: AtomicU64,
    /// Pool streams open now, and the most at once.
    open_pool_streams: AtomicU64,
    peak_pool_streams: AtomicU64,
}

/// A relay that advertises `n_pools` pools of `bucket_count` buckets and never sends a
/// filter word: pool streams are held open and silent until the router closes them.
struct HostileRelay {
    addr: SocketAddr,
    seen: Arc<Seen>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for HostileRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn digest(text: &str) -> [u8; 16] {
    let mut out = [0u8; 16];
    out[..8].copy_from_slice(&DcId::from_dc_name(text).as_u64().to_le_bytes());
    out[8..].copy_from_slice(
        &DcId::from_dc_name(&format!("{text}#"))
            .as_u64()
            .to_le_bytes(),
    );
    out
}

fn catalog(relay: RelayIdentity, n_pools: usize, bucket_count: u64) -> CatalogUpdate {
    let pools = (0..n_pools)
        .map(|idx| PoolDescriptor {
            producer: ProducerIdentity {
                pool_id: PoolId {
                    identity_version: 1,
                    cache_semantics: DigestId {
                        digest: digest("m:16"),
                        source: IdentitySource::DefaultDerived,
                    },
                    routing_scope: DigestId {
                        digest: digest(&format!("pool-{idx}")),
                        source: IdentitySource::DefaultDerived,
                    },
                    dc_id: DcId::from_dc_name(DC).as_u64(),
                },
                producer_incarnation: 1,
                layout_generation: 1,
                ckf_format: CkfFormat {
                    format_version: 1,
                    seed: 7,
                    bucket_count,
                    fingerprint_bits: 16,
                    slots_per_bucket: 4,
                },
            },
            serving_endpoint: EndpointId {
                namespace: "hostile".to_owned(),
                component: format!("pool-{idx}"),
                name: "generate".to_owned(),
            },
            registrations: vec![ModelRegistration {
                model: "m".to_owned(),
                base_model: "m".to_owned(),
                adapter: None,
                aliases: Vec::new(),
            }],
            query_semantics: QuerySemantics {
                kv_block_size: 16,
                hash_format: HashFormat::DynamoStandardV1,
            },
            pool_roles: vec![WorkerRole::Aggregated],
        })
        .collect();
    CatalogUpdate {
        relay,
        revision: 1,
        pools,
        coverage: Vec::new(),
        stalled: Vec::new(),
        tier_lanes: Vec::new(),
    }
}

impl HostileRelay {
    async fn start(n_pools: usize, bucket_count: u64) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Seen::default());
        let relay = RelayIdentity {
            drt_instance_id: 66,
            relay_incarnation: 1,
        };
        let catalog = Arc::new(Message::CatalogUpdate(catalog(
            relay,
            n_pools,
            bucket_count,
        )));
        let task = tokio::spawn({
            let seen = Arc::clone(&seen);
            async move {
                loop {
                    let Ok((socket, _)) = listener.accept().await else {
                        continue;
                    };
                    let seen = Arc::clone(&seen);
                    let catalog = Arc::clone(&catalog);
                    tokio::spawn(serve(socket, relay, catalog, seen));
                }
            }
        });
        Self { addr, seen, task }
    }
}

async fn write(socket: &mut TcpStream, message: &Message) -> bool {
    let mut buf = BytesMut::new();
    encode_message(message, &Limits::default(), &mut buf).unwrap();
    socket.write_all(&buf).await.is_ok()
}

/// Reads until the peer closes (a held stream).
async fn hold(socket: &mut TcpStream) {
    let mut sink = [0u8; 256];
    while matches!(socket.read(&mut sink).await, Ok(n) if n > 0) {}
}

async fn serve(
    mut socket: TcpStream,
    relay: RelayIdentity,
    catalog: Arc<Message>,
    seen: Arc<Seen>,
) {
    let mut buf = BytesMut::new();
    let request = loop {
        match decode_message(&mut buf, &Limits::default()) {
            Ok(Some(Message::StreamRequest(request))) => break request,
            Ok(Some(_)) | Err(_) => return,
            Ok(None) => {}
        }
        if matches!(socket.read_buf(&mut buf).await, Ok(0) | Err(_)) {
            return;
        }
    };
    match request.rpc {
        StreamRpc::RelayInfo => {
            let info = Message::RelayInfo(RelayInfo {
                protocol_major: kvrelay_codec::PROTOCOL_MAJOR,
                protocol_minor: kvrelay_codec::PROTOCOL_MINOR,
                relay,
                max_frame_len: Limits::default().max_frame_len,
            });
            write(&mut socket, &info).await;
        }
        StreamRpc::WatchCatalog => {
            // The same catalog again every 5 s, as a relay's catalog heartbeat.
            while write(&mut socket, &catalog).await {
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
        StreamRpc::SubscribePool { .. } => {
            seen.subscriptions.fetch_add(1, Ordering::Relaxed);
            let open = seen.open_pool_streams.fetch_add(1, Ordering::Relaxed) + 1;
            seen.peak_pool_streams.fetch_max(open, Ordering::Relaxed);
            hold(&mut socket).await;
            seen.open_pool_streams.fetch_sub(1, Ordering::Relaxed);
        }
        _ => hold(&mut socket).await,
    }
}

/// A `kvrelay router` process following one relay.
struct RouterProcess {
    child: tokio::process::Child,
    http: SocketAddr,
    /// The first 64 KiB the router wrote to stderr.
    log: Arc<std::sync::Mutex<String>>,
    _dir: tempfile::TempDir,
}

impl Drop for RouterProcess {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

impl RouterProcess {
    /// Runs `wrapper... kvrelay router` with a config of `consumer_keys` under
    /// `[consumer]`, following `relay`, and waits for its address line.
    async fn start(wrapper: &[&str], relay: SocketAddr, consumer_keys: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("router.toml");
        std::fs::write(
            &config,
            format!(
                "listen = \"127.0.0.1:0\"\n\n[[relays]]\naddress = \"{relay}\"\ndc = \"{DC}\"\n\n\
                 [consumer]\n{consumer_keys}\n"
            ),
        )
        .unwrap();
        let mut command = support::kvrelay_command(wrapper);
        command
            .arg("router")
            .arg("--config")
            .arg(&config)
            .env_remove("KVRELAY_ROUTER_CONFIG")
            .env_remove("KVRELAY_ROUTER_LISTEN")
            .env_remove("KVRELAY_ROUTER_RELAYS")
            .env("KVRELAY_LOG", "warn")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().expect("the router starts");
        let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let mut early = String::new();
        let http = tokio::time::timeout(Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(rest) = line.strip_prefix("kvrelay router: HTTP ") {
                    return rest.split(' ').next().unwrap().parse().unwrap();
                }
                early.push_str(&line);
                early.push('\n');
            }
            panic!("the router exited before printing its address:\n{early}");
        })
        .await
        .expect("the router prints its address in time");
        // Keep draining stderr so the router never blocks on a full pipe.
        let log = Arc::new(std::sync::Mutex::new(early));
        tokio::spawn({
            let log = Arc::clone(&log);
            async move {
                while let Ok(Some(line)) = lines.next_line().await {
                    let mut log = log.lock().unwrap();
                    if log.len() < 64 << 10 {
                        log.push_str(&line);
                        log.push('\n');
                    }
                }
            }
        });
        Self {
            child,
            http,
            log,
            _dir: dir,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id().unwrap()
    }

    /// A field of `/proc/<pid>/status` in bytes (`VmRSS`, `VmHWM`).
    fn status_bytes(&self, field: &str) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let line = status
            .lines()
            .find(|line| line.starts_with(field))
            .unwrap_or_else(|| panic!("no {field} in {status}"));
        let kib: u64 = line
            .split_whitespace()
            .nth(1)
            .and_then(|value| value.parse().ok())
            .unwrap();
        kib * 1024
    }

    fn open_descriptors(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .unwrap()
            .count()
    }

    /// The value of one metric sample line starting with `series` (0 when absent).
    async fn metric(&self, series: &str) -> u64 {
        let (status, body) = support::http_get(self.http, "/metrics")
            .await
            .expect("the router answers /metrics");
        assert_eq!(status, 200, "{body}");
        body.lines()
            .find(|line| line.starts_with(series))
            .and_then(|line| line.rsplit(' ').next())
            .and_then(|value| value.parse::<f64>().ok())
            .map_or(0, |value| value as u64)
    }

    /// `/healthz` answers 200 and `/v1/route` answers at all (no replica is current, so
    /// any status will do: what matters is that the API is served).
    async fn assert_serving(&self) {
        let (status, _) = support::http_get(self.http, "/healthz")
            .await
            .expect("the router answers /healthz");
        assert_eq!(status, 200);
        let body = r#"{"model":"m","tokens":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]}"#;
        let request = format!(
            "POST /v1/route HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n\
             content-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let answered = tokio::time::timeout(Duration::from_secs(5), async {
            let mut socket = TcpStream::connect(self.http).await.ok()?;
            socket.write_all(request.as_bytes()).await.ok()?;
            let mut answer = Vec::new();
            socket.read_to_end(&mut answer).await.ok()?;
            Some(String::from_utf8_lossy(&answer).into_owned())
        })
        .await
        .ok()
        .flatten()
        .expect("the router answers /v1/route");
        assert!(answer_status(&answered).is_some(), "{answered}");
    }
}

fn answer_status(answer: &str) -> Option<u16> {
    answer
        .strip_prefix("HTTP/1.1 ")
        .and_then(|rest| rest.get(..3))
        .and_then(|code| code.parse().ok())
}

async fn wait_for(router: &RouterProcess, what: &str, mut condition: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !condition().await {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; the router said:\n{}",
            router.log.lock().unwrap()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_pools_from_a_relay_stay_within_the_routers_query_table_budget() {
    const BUCKETS: u64 = 1 << 24;
    const BUDGET: u64 = 512 << 20;
    let lane = BUCKETS * 8;
    let relay = HostileRelay::start(32, BUCKETS).await;
    // The per-relay share admits all 32 (4 GiB): the table budget is what bounds them.
    let router = RouterProcess::start(
        &[],
        relay.addr,
        &format!("max_query_table_bytes = {BUDGET}\nbackoff_max_ms = 1000"),
    )
    .await;
    let baseline = router.status_bytes("VmRSS");

    // Two lanes fit (a one-lane table, then the two-lane table beside it while it is laid
    // out: 384 MiB); a third needs a four-lane table (512 MiB) beside the two-lane one.
    wait_for(
        &router,
        "every other pool refused at least once",
        async || {
            router
                .metric("kvrelay_consumer_resubscribes_total{reason=\"over_budget\"}")
                .await
                >= 30
        },
    )
    .await;
    let held = router.metric("kvrelay_consumer_query_table_bytes").await;
    assert!(
        (2 * lane..2 * lane + 4096).contains(&held),
        "two lanes held, {held} bytes"
    );
    router.assert_serving().await;

    // Refusals go on (after backoff) without growing anything.
    let before = router
        .metric("kvrelay_consumer_resubscribes_total{reason=\"over_budget\"}")
        .await;
    wait_for(&router, "more refusals", async || {
        router
            .metric("kvrelay_consumer_resubscribes_total{reason=\"over_budget\"}")
            .await
            > before + 30
    })
    .await;
    router.assert_serving().await;
    assert_eq!(
        router.metric("kvrelay_consumer_query_table_bytes").await,
        held
    );

    let peak = router.status_bytes("VmHWM");
    eprintln!(
        "router RSS at start {} MiB, peak {} MiB, budget {} MiB, relay subscriptions {}",
        baseline >> 20,
        peak >> 20,
        BUDGET >> 20,
        relay.seen.subscriptions.load(Ordering::Relaxed)
    );
    // The process beyond its tables (runtime, buffers, allocator) is well under 64 MiB.
    assert!(
        peak <= BUDGET + baseline + (64 << 20),
        "peak RSS {peak} over the {BUDGET}-byte budget (+ {baseline} at start)"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_pools_from_a_relay_leave_the_router_descriptors_to_serve() {
    const POOLS: usize = 4096;
    const STREAMS: u64 = 256;
    let relay = HostileRelay::start(POOLS, 1024).await;
    let router = RouterProcess::start(
        &["prlimit", "--nofile=1024:1024", "--"],
        relay.addr,
        &format!("max_pool_streams_per_relay = {STREAMS}"),
    )
    .await;

    wait_for(&router, "the router's pool streams", async || {
        relay.seen.open_pool_streams.load(Ordering::Relaxed) == STREAMS
    })
    .await;
    let subscriptions = relay.seen.subscriptions.load(Ordering::Relaxed);
    // Held streams are not retried, and the waiting pools do not spin on connects: over
    // three seconds of API traffic nothing new reaches the relay.
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(3) {
        router.assert_serving().await;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let descriptors = router.open_descriptors();
    eprintln!(
        "router descriptors {descriptors}, relay subscriptions {subscriptions} then {}, peak \
         pool streams {}",
        relay.seen.subscriptions.load(Ordering::Relaxed),
        relay.seen.peak_pool_streams.load(Ordering::Relaxed)
    );
    assert_eq!(
        relay.seen.peak_pool_streams.load(Ordering::Relaxed),
        STREAMS
    );
    assert_eq!(
        relay.seen.subscriptions.load(Ordering::Relaxed),
        subscriptions,
        "no subscription was retried while its stream was held"
    );
    assert!(
        descriptors < 1024 - 256,
        "{descriptors} descriptors open: the API has room"
    );
}

/// The router raises its soft open file limit to the hard one at start (the common soft
/// default, 1,024, is below what four relays' pool streams allow), and warns, naming the
/// keys to change, when its bounds still allow more descriptors than that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_raises_its_open_file_limit_and_warns_when_its_bounds_exceed_it() {
    let relay = HostileRelay::start(4, 1024).await;
    let router = RouterProcess::start(
        &["prlimit", "--nofile=256:2048", "--"],
        relay.addr,
        "max_pool_streams_per_relay = 4096",
    )
    .await;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", router.pid())).unwrap();
    let open_files = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))
        .unwrap();
    assert_eq!(
        open_files.split_whitespace().collect::<Vec<_>>()[3..5],
        ["2048", "2048"],
        "{open_files}"
    );
    wait_for(&router, "the descriptor warning", async || {
        let log = router.log.lock().unwrap();
        log.contains("open file limit is below")
            && log.contains("demand=")
            && log.contains("max_pool_streams_per_relay")
    })
    .await;
    router.assert_serving().await;
    // The metrics say it too, for alerts: the limit and the (larger) demand.
    assert_eq!(router.metric("kvrelay_router_open_file_limit ").await, 2048);
    let demand = router.metric("kvrelay_router_max_open_descriptors ").await;
    assert!(
        demand > 4096 + 64,
        "the pool streams and the reserve at least: {demand}"
    );
}
