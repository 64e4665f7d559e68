//! The hardened loop on a real loopback socket: the connection cap closes extra sockets
//! at accept, a half-sent request head is cut at the header-read timeout, every outcome
//! is reported, and cancelling stops the loop.

#![allow(clippy::unwrap_used, clippy::expect_used, reason = "tests fail loudly")]

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use kvrelay_http::{AcceptErrorKind, ConnectionOutcome, HttpBounds, ListenerEvents};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// Bound on every wait.
const DEADLINE: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Recorded(Mutex<Vec<ConnectionOutcome>>);

impl Recorded {
    fn count(&self, outcome: ConnectionOutcome) -> usize {
        let seen = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        seen.iter().filter(|o| **o == outcome).count()
    }
}

impl ListenerEvents for Recorded {
    fn accept_error(&self, _kind: AcceptErrorKind) {}
    fn connection(&self, outcome: ConnectionOutcome) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(outcome);
    }
}

/// Reads until the peer closes; returns what arrived.
async fn read_to_close(stream: &mut TcpStream) -> Vec<u8> {
    let mut out = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut out))
        .await
        .expect("the server closes the connection")
        .unwrap_or_default();
    out
}

/// A running loop on a loopback port.
struct Serving {
    addr: std::net::SocketAddr,
    events: Arc<Recorded>,
    cancel: CancellationToken,
    serving: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(bounds: HttpBounds, router: Router) -> Serving {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let events = Arc::new(Recorded::default());
    let cancel = CancellationToken::new();
    let serving = tokio::spawn(kvrelay_http::serve(
        listener,
        router,
        bounds,
        "test",
        events.clone(),
        cancel.clone(),
    ));
    Serving {
        addr,
        events,
        cancel,
        serving,
    }
}

#[tokio::test]
async fn the_cap_refuses_extra_sockets_and_a_slow_head_is_cut() {
    let bounds = HttpBounds {
        header_read_timeout: Duration::from_millis(300),
        connection_timeout: Duration::from_secs(30),
        max_connections: 1,
        // Above the global cap, so the global cap is what refuses here.
        max_connections_per_peer: 2,
    };
    let router = Router::new().route("/", get(|| async { "hello" }));
    let Serving {
        addr,
        events,
        cancel,
        serving,
    } = start(bounds, router).await;

    // The first connection sends half a head and holds the only slot.
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // Wait until the server has admitted it, then a second socket is closed at once.
    tokio::time::timeout(DEADLINE, async {
        while events.count(ConnectionOutcome::Accepted) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the first connection is accepted");
    let mut extra = TcpStream::connect(addr).await.unwrap();
    let refused = read_to_close(&mut extra).await;
    assert!(refused.is_empty(), "a refused socket gets no answer");
    assert_eq!(events.count(ConnectionOutcome::RejectedLimit), 1);

    // The slow head is cut at the header-read timeout, which frees the slot.
    let _ = read_to_close(&mut slow).await;
    tokio::time::timeout(DEADLINE, async {
        while events.count(ConnectionOutcome::HeaderTimeout) == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the slow head is reported as a header timeout");
    let mut ok = TcpStream::connect(addr).await.unwrap();
    ok.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = String::from_utf8(read_to_close(&mut ok).await).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.ends_with("hello"), "{answer}");

    cancel.cancel();
    tokio::time::timeout(DEADLINE, serving)
        .await
        .expect("the loop stops when cancelled")
        .unwrap()
        .unwrap();
}

/// One host holding its share of idle connections is refused more, while another host
/// (127.0.0.2, still loopback) is served: a flood from one address cannot shut out the
/// orchestrator's probes.
#[tokio::test]
async fn one_peer_is_capped_and_another_peer_is_still_served() {
    let bounds = HttpBounds {
        header_read_timeout: Duration::from_secs(30),
        connection_timeout: Duration::from_secs(30),
        max_connections: 8,
        max_connections_per_peer: 2,
    };
    let router = Router::new().route("/healthz", get(|| async { "ok" }));
    let Serving {
        addr,
        events,
        cancel,
        serving,
    } = start(bounds, router).await;

    // Two idle connections from 127.0.0.1 take that host's share.
    let mut idle = Vec::new();
    for _ in 0..2 {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    tokio::time::timeout(DEADLINE, async {
        while events.count(ConnectionOutcome::Accepted) < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("both idle connections are accepted");
    let mut third = TcpStream::connect(addr).await.unwrap();
    assert!(read_to_close(&mut third).await.is_empty());
    assert_eq!(events.count(ConnectionOutcome::RejectedPeerLimit), 1);
    assert_eq!(events.count(ConnectionOutcome::RejectedLimit), 0);

    // Another address is served while the first still holds its connections.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut probe = socket.connect(addr).await.unwrap();
    probe
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let answer = String::from_utf8(read_to_close(&mut probe).await).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // Closing one idle connection frees a slot for its host again.
    drop(idle.pop());
    tokio::time::timeout(DEADLINE, async {
        loop {
            let mut again = TcpStream::connect(addr).await.unwrap();
            again
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .unwrap();
            if !read_to_close(&mut again).await.is_empty() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the freed slot is usable");

    cancel.cancel();
    drop(idle);
    tokio::time::timeout(DEADLINE, serving)
        .await
        .expect("the loop stops when cancelled")
        .unwrap()
        .unwrap();
}
