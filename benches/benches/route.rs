//! What the router's HTTP layer adds: `POST /v1/route` on a keep-alive loopback connection
//! against `Consumer::score_top_into` in the same process (the baseline), for a 64-block
//! request over 16 and 256 pools, ranking every pool and keeping the best 8 (`top_k`). The pools come from the consumer tests' in-process
//! relay (the WAN protocol over loopback TCP); the router follows it like any relay.
//! Floors on the same kind of connection: `baseline-tcp-bare` (the transport: a task on
//! the same runtime answering each request with a fixed empty 200, no HTTP machinery),
//! `baseline-tcp-bare-post` (the same, carrying the route request's body) and `baseline-http-healthz` (`GET /healthz` through hyper and axum: no
//! body, no scoring). p50/p99 per request are printed to stderr after each case, and after
//! each `http-route-*` case the mean time its handlers spent scoring (the consumer's own
//! score-latency sum over the case), to set against the back-to-back baseline.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "benchmark setup"
)]
#![allow(missing_docs, reason = "criterion macros generate undocumented items")]

#[path = "../../crates/kvrelay-consumer/tests/support/mod.rs"]
mod support;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use kvrelay_consumer::{ConsumerMetrics, Ranking, ReplicaState, ScoreRequest};
use kvrelay_identity::hashing::HashSalt;
use kvrelay_router::{RouterConfig, RouterService};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use support::{FakeRelay, PoolSpec};

const BLOCK: u32 = 16;
const REQUEST_BLOCKS: u32 = 64;

fn family_tokens(family: u32, n_blocks: u32) -> Vec<u32> {
    (0..n_blocks * BLOCK)
        .map(|i| family * 1_000_000 + i)
        .collect()
}

struct Setup {
    relay: FakeRelay,
    router: RouterService,
    request: ScoreRequest,
}

/// `n_pools` pools of ~1,500 blocks each: the request's family at a depth varying by
/// pool plus 24 unrelated chains; the router's replicas current.
async fn setup(n_pools: usize) -> Setup {
    let specs = (0..n_pools)
        .map(|i| {
            let name: &'static str = Box::leak(format!("pool{i}").into_boxed_str());
            let mut spec = PoolSpec::aggregated(name, "llama");
            spec.block_size = BLOCK;
            spec.expected_blocks = 4096;
            spec
        })
        .collect();
    let relay = FakeRelay::start("dc-a", 1, specs).await;
    let mut family = 2u32;
    for pool in 0..n_pools {
        let depth = (pool as u32 * 7) % (REQUEST_BLOCKS + 1);
        relay.store(pool, 0, &family_tokens(1, depth), HashSalt::default());
        for worker in 0..24u64 {
            family += 1;
            relay.store(
                pool,
                worker % 4,
                &family_tokens(family, 64),
                HashSalt::default(),
            );
        }
    }
    let mut config = RouterConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        ..RouterConfig::default()
    };
    config
        .relays
        .push(RouterConfig::parse_relay(&relay.relay_arg()).unwrap());
    let router = RouterService::start(&config, |_| None).await.unwrap();
    let current = router
        .consumer()
        .wait_until(Duration::from_secs(60), |state, now| {
            let pools = state.pools(now);
            pools.len() == n_pools && pools.iter().all(|p| p.replica == ReplicaState::Current)
        })
        .await;
    assert!(current, "every replica current");
    Setup {
        relay,
        router,
        request: ScoreRequest {
            tokens: family_tokens(1, REQUEST_BLOCKS),
            model: "llama".into(),
            ..ScoreRequest::default()
        },
    }
}

/// One keep-alive HTTP/1.1 client connection: blocking std I/O on the benchmark's own
/// thread, as a client in another process sees the router (a tokio client on the router's
/// runtime would add a thread hand-off per direction to every request).
struct Client {
    stream: BufReader<TcpStream>,
    request: Vec<u8>,
    body: Vec<u8>,
}

impl Client {
    fn connect(setup: &Setup, top_k: Option<usize>) -> Self {
        Self::post_route(setup.router.local_addr(), setup, top_k)
    }

    /// A client sending the route request of `setup` (as [`Client::connect`]) to `addr`.
    fn post_route(addr: std::net::SocketAddr, setup: &Setup, top_k: Option<usize>) -> Self {
        let stream = TcpStream::connect(addr).unwrap();
        stream.set_nodelay(true).unwrap();
        let mut body = serde_json::json!({ "tokens": setup.request.tokens, "model": "llama" });
        if let Some(top_k) = top_k {
            body["top_k"] = top_k.into();
        }
        let body = body.to_string();
        let request = format!(
            "POST /v1/route HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes();
        Self::with_request(stream, request)
    }

    /// A client sending `GET /healthz`: the loopback HTTP floor (no body, no scoring).
    fn health(setup: &Setup) -> Self {
        let stream = TcpStream::connect(setup.router.local_addr()).unwrap();
        stream.set_nodelay(true).unwrap();
        Self::with_request(
            stream,
            b"GET /healthz HTTP/1.1\r\nHost: router\r\n\r\n".to_vec(),
        )
    }

    fn with_request(stream: TcpStream, request: Vec<u8>) -> Self {
        stream.set_nodelay(true).unwrap();
        Self {
            stream: BufReader::new(stream),
            request,
            body: Vec::new(),
        }
    }

    /// Sends the request and reads the whole answer (which must be `200`); returns its
    /// body length.
    fn route(&mut self) -> usize {
        self.stream.get_mut().write_all(&self.request).unwrap();
        let mut line = String::new();
        let mut length = None;
        let mut status_ok = false;
        loop {
            line.clear();
            self.stream.read_line(&mut line).unwrap();
            if line.starts_with("HTTP/1.1 ") {
                status_ok = line.starts_with("HTTP/1.1 200");
            } else if let Some((name, value)) = line.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                length = value.trim().parse::<usize>().ok();
            } else if line == "\r\n" {
                break;
            }
        }
        assert!(status_ok, "the router answers 200");
        let length = length.expect("a Content-Length");
        self.body.resize(length, 0);
        self.stream.read_exact(&mut self.body).unwrap();
        length
    }
}

/// The transport floor without HTTP machinery: a task on the router's runtime answering
/// each request (its head up to the blank line, then `Content-Length` body bytes) with a
/// fixed empty `200`, as hyper would but with no parsing beyond that, no routing and no
/// handler. Returns its address.
async fn bare_responder() -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            stream.set_nodelay(true).unwrap();
            tokio::spawn(async move {
                let mut pending: Vec<u8> = Vec::with_capacity(1 << 16);
                let mut chunk = vec![0u8; 1 << 16];
                loop {
                    while let Some(head_end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                        let total = head_end + 4 + content_length(&pending[..head_end]);
                        if pending.len() < total {
                            break;
                        }
                        pending.drain(..total);
                        let reply = b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n";
                        if stream.write_all(reply).await.is_err() {
                            return;
                        }
                    }
                    match stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => pending.extend_from_slice(&chunk[..n]),
                    }
                }
            });
        }
    });
    addr
}

/// The `Content-Length` of a request head (0 when absent).
fn content_length(head: &[u8]) -> usize {
    String::from_utf8_lossy(head)
        .lines()
        .find_map(|line| {
            let (name, value) = line.split_once(':')?;
            name.eq_ignore_ascii_case("content-length")
                .then(|| value.trim().parse().ok())
                .flatten()
        })
        .unwrap_or(0)
}

/// Per-request latencies of the current case.
static SAMPLES: Mutex<Vec<Duration>> = Mutex::new(Vec::new());

fn record(elapsed: Duration) {
    SAMPLES.lock().unwrap().push(elapsed);
}

/// Runs `request` `iters` times, recording each; returns the total.
fn timed(iters: u64, mut request: impl FnMut() -> usize) -> Duration {
    let start = Instant::now();
    for _ in 0..iters {
        let started = Instant::now();
        request();
        record(started.elapsed());
    }
    start.elapsed()
}

fn report(case: &str) {
    let mut samples = std::mem::take(&mut *SAMPLES.lock().unwrap());
    if samples.is_empty() {
        return;
    }
    samples.sort_unstable();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    eprintln!(
        "{case}: requests {} p50 {:?} p99 {:?}",
        samples.len(),
        at(0.5),
        at(0.99)
    );
}

/// The mean time the consumer spent scoring inside the router's handlers between two
/// snapshots of its metrics (its own score-latency sum and count): the scoring share of an
/// HTTP request, measured where it ran rather than back to back in the baseline.
fn report_handler_scoring(case: &str, before: &ConsumerMetrics, after: &ConsumerMetrics) {
    let scores = after.scores.saturating_sub(before.scores);
    if scores == 0 {
        return;
    }
    let spent = after
        .score_latency_sum
        .saturating_sub(before.score_latency_sum);
    eprintln!(
        "{case}: scoring inside the handler: {scores} scores, mean {:?}",
        spent / u32::try_from(scores).unwrap_or(u32::MAX)
    );
}

fn bench_route(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for n_pools in [16usize, 256] {
        let setup = runtime.block_on(setup(n_pools));
        let group_name = format!("route-{n_pools}-pools");
        let mut group = c.benchmark_group(&group_name);

        let bare = runtime.block_on(bare_responder());
        let mut transport = Client::with_request(
            TcpStream::connect(bare).unwrap(),
            b"GET / HTTP/1.1\r\nHost: bare\r\n\r\n".to_vec(),
        );
        group.bench_function("baseline-tcp-bare", |b| {
            b.iter_custom(|iters| timed(iters, || transport.route()));
        });
        report(&format!("{group_name}/baseline-tcp-bare"));
        // The same floor carrying the route request's bytes (the 1,024 token ids): what
        // moving the request costs without HTTP parsing, routing or a handler.
        let mut transport_post = Client::post_route(bare, &setup, Some(8));
        group.bench_function("baseline-tcp-bare-post", |b| {
            b.iter_custom(|iters| timed(iters, || transport_post.route()));
        });
        report(&format!("{group_name}/baseline-tcp-bare-post"));

        let mut floor = Client::health(&setup);
        group.bench_function("baseline-http-healthz", |b| {
            b.iter_custom(|iters| timed(iters, || floor.route()));
        });
        report(&format!("{group_name}/baseline-http-healthz"));
        for (case, top_k) in [("all", None), ("top-8", Some(8))] {
            let limit = top_k.unwrap_or(usize::MAX);
            let mut ranking = Ranking::default();
            let baseline = format!("baseline-score-into-{case}");
            group.bench_function(baseline.as_str(), |b| {
                b.iter_custom(|iters| {
                    timed(iters, || {
                        setup
                            .router
                            .consumer()
                            .score_top_into(&setup.request, limit, &mut ranking)
                            .unwrap();
                        ranking.candidates.len()
                    })
                });
            });
            // (Empty when a filter on the command line skipped the case.)
            assert!(
                ranking.candidates.is_empty() || ranking.candidates.len() == n_pools.min(limit)
            );
            report(&format!("{group_name}/{baseline}"));

            let mut client = Client::connect(&setup, top_k);
            let http = format!("http-route-{case}");
            let before = setup.router.consumer().metrics();
            group.bench_function(http.as_str(), |b| {
                b.iter_custom(|iters| timed(iters, || client.route()));
            });
            report(&format!("{group_name}/{http}"));
            report_handler_scoring(
                &format!("{group_name}/{http}"),
                &before,
                &setup.router.consumer().metrics(),
            );
        }
        group.finish();
        let Setup { relay, router, .. } = setup;
        runtime.block_on(async move {
            router.shutdown().await;
            relay.stop().await;
        });
    }
}

criterion_group!(benches, bench_route);
criterion_main!(benches);
