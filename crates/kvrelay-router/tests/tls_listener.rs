//! TLS on the router's own listener: a client trusting the router's CA is served, a
//! plaintext client and a client that never starts the handshake are closed (within the
//! header-read timeout) and counted as `handshake_failed`, and a bad key file stops the
//! start naming it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "test helpers fail loudly"
)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvrelay_router::{ListenerTls, RelaySection, RouterConfig, RouterError, RouterService};
use kvrelay_tls::test_ca::{Purpose, TestAuthority};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const DEADLINE: Duration = Duration::from_secs(10);

fn no_env(_: &str) -> Option<String> {
    None
}

struct Secured {
    _dir: tempfile::TempDir,
    ca: TestAuthority,
    tls: ListenerTls,
}

fn secured() -> Secured {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestAuthority::new("router test ca").unwrap();
    let (cert, key) = ca
        .issue_to(dir.path(), "router", &["127.0.0.1"], Purpose::Server)
        .unwrap();
    Secured {
        _dir: dir,
        ca,
        tls: ListenerTls {
            cert,
            key,
            client_ca: None,
        },
    }
}

fn config(tls: ListenerTls) -> RouterConfig {
    let mut config = RouterConfig {
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        tls: Some(tls),
        ..RouterConfig::default()
    };
    // A relay that is not there: the API answers anyway (probes, 503s).
    config
        .relays
        .push(RelaySection::new("127.0.0.1:1", "dc-a", 0.0));
    config.http.header_read_timeout_ms = 300;
    config
}

/// Sends one `GET path` over `stream` and returns the whole answer.
async fn get<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    path: &str,
) -> String {
    let request = format!("GET {path} HTTP/1.1\r\nHost: router\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(DEADLINE, stream.read_to_end(&mut answer))
        .await
        .expect("answer within the deadline")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

async fn tls_get(addr: SocketAddr, ca: &TestAuthority, path: &str) -> String {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert_der()).unwrap();
    let client = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client));
    let tcp = TcpStream::connect(addr).await.unwrap();
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let mut stream = connector.connect(name, tcp).await.unwrap();
    get(&mut stream, path).await
}

#[tokio::test]
async fn the_router_serves_tls_clients_and_closes_everyone_else() {
    let secured = secured();
    let router = RouterService::start(&config(secured.tls.clone()), no_env)
        .await
        .unwrap();
    let addr = router.local_addr();

    let answer = tls_get(addr, &secured.ca, "/healthz").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");

    // Plain HTTP on the TLS port: the handshake fails and the socket closes, no answer.
    let mut plain = TcpStream::connect(addr).await.unwrap();
    let answer = get(&mut plain, "/healthz").await;
    assert!(!answer.contains("200"), "{answer:?}");

    // A socket that never starts the handshake is closed after the header-read timeout.
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(DEADLINE, silent.read(&mut byte))
        .await
        .expect("closed within the header-read timeout");
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");

    let metrics = tls_get(addr, &secured.ca, "/metrics").await;
    let failed = metrics
        .lines()
        .find(|line| line.contains("handshake_failed") && !line.starts_with('#'))
        .unwrap_or_else(|| panic!("no handshake_failed count in {metrics}"));
    let count: f64 = failed.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(count >= 2.0, "{failed}");
    router.shutdown().await;
}

#[tokio::test]
async fn an_unusable_key_file_stops_the_start_naming_it() {
    let secured = secured();
    let dir = tempfile::tempdir().unwrap();
    let bad_key = dir.path().join("bad.key");
    std::fs::write(&bad_key, "not a key").unwrap();
    let tls = ListenerTls {
        key: bad_key.clone(),
        ..secured.tls.clone()
    };
    let err = RouterService::start(&config(tls), no_env)
        .await
        .unwrap_err();
    assert!(matches!(err, RouterError::Tls(_)), "{err}");
    assert!(err.to_string().contains("bad.key"), "{err}");
}
