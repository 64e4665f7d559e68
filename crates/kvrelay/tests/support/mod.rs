//! Test support shared by this crate's integration tests: the example deployment as an
//! in-process relay's config, a `kvrelay relay` process with its stderr collected, a CA
//! from the TLS crate's test support, the certificates it issues, and a relay's TLS material written into
//! a temporary directory.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the support"
)]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test support: a broken fixture must fail the test loudly"
)]

use std::net::SocketAddr;
use std::path::PathBuf;

use kvrelay_tls::test_ca::Purpose;

/// The example deployment (`examples/deployment/cards`) with the built-in trace replayed
/// once, as fast as possible, on loopback with free ports, as datacenter `dc_id`.
pub(crate) fn example_config(dc_id: &str) -> kvrelay_server::RelayConfig {
    let cards = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../examples/deployment/cards");
    let mut config = kvrelay_server::RelayConfig {
        dc_id: dc_id.to_owned(),
        ..kvrelay_server::RelayConfig::default()
    };
    config.wan.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.admin.listen = SocketAddr::from(([127, 0, 0, 1], 0));
    config.discovery.dir = Some(cards);
    config.workload = Some(kvrelay_server::WorkloadConfig {
        trace: None,
        speed: 0.0,
        loops: 1,
    });
    config
}

/// The TLS crate's test CA.
pub(crate) type Authority = kvrelay_tls::test_ca::TestAuthority;

/// A CA, a relay certificate signed by it for `names`, and a stranger CA.
pub(crate) struct Material {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) ca: Authority,
    pub(crate) ca_pem: PathBuf,
    pub(crate) stranger_pem: PathBuf,
    pub(crate) server_cert: PathBuf,
    pub(crate) server_key: PathBuf,
}

pub(crate) fn material(names: &[&str]) -> Material {
    let dir = tempfile::tempdir().unwrap();
    let ca = Authority::new("kvrelay test ca").unwrap();
    let ca_pem = ca.write(dir.path(), "ca").unwrap();
    let stranger_pem = Authority::new("another ca")
        .unwrap()
        .write(dir.path(), "stranger")
        .unwrap();
    let (server_cert, server_key) = ca
        .issue_to(dir.path(), "server", names, Purpose::Server)
        .unwrap();
    Material {
        dir,
        ca,
        ca_pem,
        stranger_pem,
        server_cert,
        server_key,
    }
}

/// The `kvrelay` binary as a command, run under `wrapper` (e.g. `prlimit ... --`) when
/// it is not empty.
pub(crate) fn kvrelay_command(wrapper: &[&str]) -> tokio::process::Command {
    let binary = env!("CARGO_BIN_EXE_kvrelay");
    match wrapper.split_first() {
        Some((program, rest)) => {
            let mut command = tokio::process::Command::new(program);
            command.args(rest).arg(binary);
            command
        }
        None => tokio::process::Command::new(binary),
    }
}

/// A `kvrelay relay` process on loopback (free ports, the example cards unless told
/// otherwise, no workload)
/// whose stderr is collected; killed on drop.
pub(crate) struct RelayProcess {
    pub(crate) child: tokio::process::Child,
    pub(crate) wan: SocketAddr,
    pub(crate) admin: SocketAddr,
    /// Every stderr line so far.
    pub(crate) stderr: std::sync::Arc<std::sync::Mutex<String>>,
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

impl RelayProcess {
    /// Runs `wrapper... kvrelay relay <defaults> args...` with `envs` and waits (at most
    /// 30 s) for the line naming its addresses. `wrapper` may be empty.
    pub(crate) async fn start(wrapper: &[&str], args: &[&str], envs: &[(&str, &str)]) -> Self {
        let cards = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/deployment/cards"
        );
        Self::start_with_cards(cards, wrapper, args, envs).await
    }

    /// [`RelayProcess::start`] with the cards of directory `cards`.
    pub(crate) async fn start_with_cards(
        cards: &str,
        wrapper: &[&str],
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> Self {
        Self::start_listening(cards, "127.0.0.1:0", wrapper, args, envs).await
    }

    /// [`RelayProcess::start`] with the example cards, `args`, and its WAN listener on
    /// `wan` (a relay restarted on the address its consumers know).
    pub(crate) async fn start_on(wan: SocketAddr, args: &[&str]) -> Self {
        let cards = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/deployment/cards"
        );
        Self::start_listening(cards, &wan.to_string(), &[], args, &[]).await
    }

    async fn start_listening(
        cards: &str,
        wan: &str,
        wrapper: &[&str],
        args: &[&str],
        envs: &[(&str, &str)],
    ) -> Self {
        use tokio::io::AsyncBufReadExt;

        let mut command = kvrelay_command(wrapper);
        command
            .args(["relay", "--dc-id", "dc-proc", "--cards", cards])
            .args(["--listen", wan, "--admin-listen", "127.0.0.1:0"])
            .args(args)
            .env_remove("KVRELAY_CONFIG")
            .env_remove("KVRELAY_TOKEN")
            .env_remove("KVRELAY_TOKEN_FILE")
            .env_remove("KVRELAY_LOG")
            .env_remove("KVRELAY_LOG_FORMAT")
            .envs(envs.iter().copied())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = command.spawn().expect("the relay starts");
        let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let stderr = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let collect = |line: &str| {
            let mut text = stderr.lock().unwrap();
            text.push_str(line);
            text.push('\n');
        };
        let addresses = tokio::time::timeout(std::time::Duration::from_secs(30), async {
            while let Ok(Some(line)) = lines.next_line().await {
                collect(&line);
                if let Some(rest) = line.strip_prefix("kvrelay relay: WAN ") {
                    let (wan, admin) = rest.split_once(" admin ").unwrap();
                    return Some((wan.parse().unwrap(), admin.parse().unwrap()));
                }
            }
            None
        })
        .await
        .expect("the relay prints its addresses in time");
        let Some((wan, admin)) = addresses else {
            panic!("the relay exited: {}", stderr.lock().unwrap());
        };
        let collected = stderr.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                let mut text = collected.lock().unwrap();
                text.push_str(&line);
                text.push('\n');
            }
        });
        Self {
            child,
            wan,
            admin,
            stderr,
        }
    }

    /// Everything the relay wrote to stderr so far.
    pub(crate) fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
}

/// One HTTP/1.1 GET: the status and body, or `None` if nothing answers within a second.
pub(crate) async fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let exchange = async {
        let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n");
        stream.write_all(request.as_bytes()).await.ok()?;
        let mut response = String::new();
        stream.read_to_string(&mut response).await.ok()?;
        let status = response.get(9..12)?.parse().ok()?;
        let body = response
            .split_once("\r\n\r\n")
            .map(|(_, body)| body.to_owned())
            .unwrap_or_default();
        Some((status, body))
    };
    tokio::time::timeout(std::time::Duration::from_secs(1), exchange)
        .await
        .ok()
        .flatten()
}

/// Tokens per KV block of the engines these tests simulate (vLLM's default).
pub(crate) const BLOCK_SIZE: u32 = 16;

/// The tokens of chained blocks `ids`: block `id` holds `id * 100 + 0..16`, so a request
/// for those tokens hashes to the same blocks on every relay.
pub(crate) fn tokens_of(ids: &[u64]) -> Vec<u32> {
    ids.iter()
        .flat_map(|id| (0..BLOCK_SIZE).map(move |at| (*id as u32) * 100 + at))
        .collect()
}

/// vLLM's event for blocks `ids` (engine ids, chained after `parent`) stored on the GPU.
pub(crate) fn stored(ids: &[u64], parent: Option<u64>) -> kvrelay_ingest::EngineEvent {
    use kvrelay_ingest::{BlockStored, EngineBlockHash, EngineEvent, TokenIds};
    EngineEvent::BlockStored(BlockStored {
        medium: Some("GPU".to_owned()),
        ..BlockStored::new(
            ids.iter().copied().map(EngineBlockHash::unsigned).collect(),
            parent.map(EngineBlockHash::unsigned),
            TokenIds::Flat(tokens_of(ids)),
            BLOCK_SIZE,
        )
    })
}

/// vLLM's event for blocks `ids` evicted from the GPU.
pub(crate) fn removed(ids: &[u64]) -> kvrelay_ingest::EngineEvent {
    use kvrelay_ingest::{BlockRemoved, EngineBlockHash, EngineEvent};
    EngineEvent::BlockRemoved(BlockRemoved {
        block_hashes: ids.iter().copied().map(EngineBlockHash::unsigned).collect(),
        medium: Some("GPU".to_owned()),
        group_idx: None,
    })
}

/// A vLLM engine's event publisher: a libzmq PUB socket sending `[topic, seq, batch]`
/// (one event per batch, sequence numbers from 0), as vLLM publishes.
pub(crate) struct VllmEngine {
    socket: zmq::Socket,
    pub(crate) seq: u64,
}

impl VllmEngine {
    pub(crate) fn bind(context: &zmq::Context, addr: SocketAddr) -> Self {
        let socket = context.socket(zmq::PUB).unwrap();
        socket.set_linger(0).unwrap();
        socket.bind(&format!("tcp://{addr}")).unwrap();
        Self { socket, seq: 0 }
    }

    pub(crate) fn publish(&mut self, event: kvrelay_ingest::EngineEvent) {
        use kvrelay_ingest::{EngineBatch, EngineKind, EngineLayout, encode_engine_batch};
        let layout = EngineLayout {
            engine: EngineKind::Vllm,
            map_events: false,
            map_batch: false,
        };
        let batch = EngineBatch {
            ts: 0.0,
            events: vec![event],
            dp_rank: Some(0),
        };
        let mut payload = Vec::new();
        encode_engine_batch(&batch, layout, &mut payload);
        let seq = self.seq.to_be_bytes();
        self.socket
            .send_multipart([&b"kv-events"[..], &seq[..], &payload[..]], 0)
            .unwrap();
        self.seq += 1;
    }
}

/// A consumer of `relays` that reconnects quickly (20 ms doubling to 200 ms), so the tests'
/// relay restarts and refusals show within their deadlines.
pub(crate) fn quick_consumer(
    relays: Vec<kvrelay_consumer::RelayEndpoint>,
) -> kvrelay_consumer::Consumer {
    let mut config = kvrelay_consumer::ConsumerConfig::new(relays);
    config.backoff = kvrelay_consumer::BackoffConfig {
        initial: std::time::Duration::from_millis(20),
        max: std::time::Duration::from_millis(200),
        ..kvrelay_consumer::BackoffConfig::default()
    };
    kvrelay_consumer::Consumer::start(config).unwrap()
}

/// One worker's card in `cards`: instance 0x11 of `prod.backend.generate`, one rank,
/// `total_kv_blocks` of capacity, vLLM's block size.
pub(crate) fn write_card(cards: &std::path::Path, total_kv_blocks: u64) {
    let record = serde_json::json!({
        "type": "Model", "namespace": "prod", "component": "backend", "endpoint": "generate",
        "instance_id": 0x11,
        "card_json": {
            "display_name": "model-a", "source_path": "models/model-a",
            "kv_cache_block_size": BLOCK_SIZE, "model_type": "Chat | Completions",
            "worker_type": "aggregated", "needs": [],
            "runtime_config": {"total_kv_blocks": total_kv_blocks, "data_parallel_start_rank": 0,
                "data_parallel_size": 1, "enable_local_indexer": true, "enable_eagle": false}
        }
    });
    std::fs::write(
        cards.join("prod-backend-generate-11.json"),
        record.to_string(),
    )
    .unwrap();
}

/// The value of the Prometheus series `series` (name and labels exactly) in `metrics`.
pub(crate) fn sample(metrics: &str, series: &str) -> Option<u64> {
    metrics
        .lines()
        .find(|line| line.starts_with(series) && line[series.len()..].starts_with(' '))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse::<f64>().ok())
        .map(|value| value as u64)
}

/// `GET path` on `addr`, answered 200 with JSON.
pub(crate) async fn get_json(addr: SocketAddr, path: &str) -> serde_json::Value {
    let (status, body) = http_get(addr, path)
        .await
        .unwrap_or_else(|| panic!("GET {path} got no answer"));
    assert_eq!(status, 200, "GET {path}: {body}");
    serde_json::from_str(&body).unwrap_or_else(|_| panic!("GET {path}: {body}"))
}

/// A `kvrelay relay` process with [`write_card`]'s 1,024-block card and one vLLM source of
/// it (worker 17, rank 0) whose engine is not up yet (its address is reserved here).
pub(crate) struct VllmRelay {
    pub(crate) relay: RelayProcess,
    /// Where the engine publishes ([`VllmEngine::bind`] it there).
    pub(crate) engine_addr: SocketAddr,
    _dir: tempfile::TempDir,
}

/// Starts a [`VllmRelay`] whose config file ends with `extra` (TOML tables).
pub(crate) async fn vllm_relay(extra: &str) -> VllmRelay {
    let reserved = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let engine_addr = reserved.local_addr().unwrap();
    drop(reserved);
    let dir = tempfile::tempdir().unwrap();
    let cards = dir.path().join("cards");
    std::fs::create_dir_all(&cards).unwrap();
    write_card(&cards, 1024);
    let config = dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "[[sources]]\nendpoint = \"prod.backend.generate\"\nworker_id = 17\ndp_rank = 0\n\
             engine = \"vllm\"\nzmq = \"tcp://{engine_addr}\"\n\n{extra}"
        ),
    )
    .unwrap();
    let relay = RelayProcess::start_with_cards(
        cards.to_str().unwrap(),
        &[],
        &["--config", config.to_str().unwrap()],
        &[],
    )
    .await;
    VllmRelay {
        relay,
        engine_addr,
        _dir: dir,
    }
}

/// PUB/SUB drops what is sent before the subscription lands: publishes removals of
/// unknown blocks (counted no-ops) until the relay applied one (30 s at most); returns
/// the pool's stats path.
pub(crate) async fn warm_up(admin: SocketAddr, engine: &mut VllmEngine) -> String {
    let pools = get_json(admin, "/v1/pools").await;
    let stats_path = format!(
        "/v1/pools/{}/stats",
        pools["pools"][0]["pool"].as_str().unwrap()
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        engine.publish(removed(&[1_000_000 + engine.seq]));
        let applied = get_json(admin, &stats_path).await["stats"]["events_applied"]
            .as_u64()
            .unwrap_or(0);
        if applied > 0 {
            return stats_path;
        }
        assert!(std::time::Instant::now() < deadline, "no batch arrived");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// The relay's first catalog pool and first lane, once `/v1/catalog` lists both (30 s at
/// most).
pub(crate) async fn first_pool_and_lane(
    admin: SocketAddr,
) -> (serde_json::Value, serde_json::Value) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let catalog = get_json(admin, "/v1/catalog").await;
        if let (Some(pool), Some(lane)) = (catalog["pools"].get(0), catalog["tier_lanes"].get(0)) {
            return (pool.clone(), lane.clone());
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no lane in the catalog: {catalog}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
