//! TLS (server certificate, optional client certificates) and bearer-token authentication
//! on the WAN listener, with certificates generated per test by the TLS crate's test CA.

use crate::support;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kvrelay_codec::v1::{ErrorReason, Message, StreamRequest, StreamRpc};
use kvrelay_server::{AuthConfig, ListenerTls, ProbeStream, Relay, RelayConfig};
use kvrelay_tls::test_ca::{Issued, Purpose, TestAuthority};
use rustls::pki_types::ServerName;
use support::{DEADLINE, deployment, first_message, next, request};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct Material {
    _dir: tempfile::TempDir,
    ca: TestAuthority,
    server_cert: PathBuf,
    server_key: PathBuf,
    ca_pem: PathBuf,
}

fn material() -> Material {
    let dir = tempfile::tempdir().unwrap();
    let ca = TestAuthority::new("kvrelay test ca").unwrap();
    let server = ca.issue(&["localhost"], Purpose::Server).unwrap();
    let server_cert = dir.path().join("server.pem");
    let server_key = dir.path().join("server.key");
    let ca_pem = dir.path().join("ca.pem");
    std::fs::write(&server_cert, &server.cert_pem).unwrap();
    std::fs::write(&server_key, &server.key_pem).unwrap();
    std::fs::write(&ca_pem, ca.cert_pem()).unwrap();
    Material {
        _dir: dir,
        ca,
        server_cert,
        server_key,
        ca_pem,
    }
}

async fn tls_relay(material: &Material, client_ca: Option<&Path>) -> (tempfile::TempDir, Relay) {
    tls_relay_with(material, client_ca, |_| {}).await
}

async fn tls_relay_with(
    material: &Material,
    client_ca: Option<&Path>,
    configure: impl FnOnce(&mut RelayConfig),
) -> (tempfile::TempDir, Relay) {
    let dir = tempfile::tempdir().unwrap();
    let mut config: RelayConfig = deployment(dir.path(), 5);
    config.wan.tls = Some(ListenerTls {
        cert: material.server_cert.clone(),
        key: material.server_key.clone(),
        client_ca: client_ca.map(Path::to_path_buf),
    });
    configure(&mut config);
    let relay = Relay::start(config).await.unwrap();
    (dir, relay)
}

fn client_config(ca: &TestAuthority, identity: Option<Issued>) -> rustls::ClientConfig {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert_der()).unwrap();
    let builder = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots);
    match identity {
        None => builder.with_no_client_auth(),
        Some(issued) => builder
            .with_client_auth_cert(vec![issued.cert_der], issued.key_der)
            .unwrap(),
    }
}

/// Opens a TLS stream and returns the first message, or `None` if TLS or the stream failed.
async fn tls_first_message(
    addr: std::net::SocketAddr,
    config: rustls::ClientConfig,
    request: &StreamRequest,
) -> Option<Message> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.unwrap();
    let tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .ok()?;
    let mut stream = ProbeStream::open(tls, request).await.ok()?;
    tokio::time::timeout(DEADLINE, stream.next_message())
        .await
        .expect("answer within the deadline")
        .ok()
        .flatten()
}

#[tokio::test]
async fn tls_client_trusting_the_server_ca_is_served() {
    let material = material();
    let (_dir, relay) = tls_relay(&material, None).await;
    let message = tls_first_message(
        relay.wan_addr(),
        client_config(&material.ca, None),
        &request(StreamRpc::RelayInfo),
    )
    .await;
    assert!(
        matches!(message, Some(Message::RelayInfo(_))),
        "{message:?}"
    );
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn plaintext_client_gets_no_answer_from_a_tls_listener() {
    let material = material();
    let (_dir, relay) = tls_relay(&material, None).await;
    let mut tcp = TcpStream::connect(relay.wan_addr()).await.unwrap();
    let mut frame = bytes::BytesMut::new();
    kvrelay_codec::v1::encode_message(
        &Message::StreamRequest(request(StreamRpc::RelayInfo)),
        &kvrelay_codec::Limits::default(),
        &mut frame,
    )
    .unwrap();
    tcp.write_all(&frame).await.unwrap();
    let mut received = Vec::new();
    let _ = tokio::time::timeout(DEADLINE, tcp.read_to_end(&mut received))
        .await
        .expect("closed in time");
    assert!(
        !received.starts_with(b"KVRW"),
        "a plaintext client must not be answered in protocol frames"
    );
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn client_certificates_are_required_and_checked_when_configured() {
    let material = material();
    let (_dir, relay) = tls_relay(&material, Some(&material.ca_pem)).await;
    let addr = relay.wan_addr();
    let info = request(StreamRpc::RelayInfo);

    let without = tls_first_message(addr, client_config(&material.ca, None), &info).await;
    assert!(
        without.is_none(),
        "a client without a certificate must be refused, got {without:?}"
    );

    let stranger = TestAuthority::new("another ca").unwrap();
    let foreign = stranger.issue(&["client"], Purpose::Client).unwrap();
    let refused = tls_first_message(addr, client_config(&material.ca, Some(foreign)), &info).await;
    assert!(
        refused.is_none(),
        "a certificate from another CA must be refused, got {refused:?}"
    );

    let trusted = material.ca.issue(&["client"], Purpose::Client).unwrap();
    let served = tls_first_message(addr, client_config(&material.ca, Some(trusted)), &info).await;
    assert!(matches!(served, Some(Message::RelayInfo(_))), "{served:?}");
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn bearer_token_admits_the_right_client_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = deployment(dir.path(), 5);
    config.wan.auth = Some(AuthConfig {
        token: Some("s3cret-token".to_owned()),
        token_file: None,
    });
    let relay = Relay::start(config).await.unwrap();
    let addr = relay.wan_addr();

    for token in [None, Some("wrong"), Some("s3cret-token-but-longer")] {
        let mut refused = request(StreamRpc::RelayInfo);
        refused.auth_token = token.map(str::to_owned);
        let (_, message) = first_message(addr, &refused).await;
        let Message::Error(error) = message else {
            panic!("token {token:?} must be refused, got {message:?}")
        };
        assert_eq!(error.reason, ErrorReason::InvalidRequest);
    }
    let mut admitted = request(StreamRpc::WatchCatalog);
    admitted.auth_token = Some("s3cret-token".to_owned());
    let mut stream = ProbeStream::connect(addr, &admitted).await.unwrap();
    assert!(matches!(
        next(&mut stream).await,
        Some(Message::CatalogUpdate(_))
    ));
    relay.shutdown().await.unwrap();
}

/// Connects over TLS after `before_hello` of silence, then sends a `RelayInfo` request
/// after `before_request`; returns the first answer (`None`: closed without one).
async fn slow_tls_client(
    relay: &Relay,
    material: &Material,
    before_hello: Duration,
    before_request: Duration,
) -> Option<Message> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(client_config(&material.ca, None)));
    let tcp = TcpStream::connect(relay.wan_addr()).await.unwrap();
    tokio::time::sleep(before_hello).await;
    let tls = connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("the handshake completes within the budget");
    tokio::time::sleep(before_request).await;
    let mut stream = ProbeStream::open(tls, &request(StreamRpc::RelayInfo))
        .await
        .ok()?;
    tokio::time::timeout(DEADLINE, stream.next_message())
        .await
        .expect("answer or close within the deadline")
        .ok()
        .flatten()
}

#[tokio::test]
async fn tls_handshake_and_stream_request_share_one_request_timeout() {
    // Row 11: a client silent for most of request_timeout_ms before its ClientHello and
    // again before its request was served at nearly twice the budget.
    let material = material();
    let (_dir, relay) = tls_relay_with(&material, None, |config| {
        config.limits.request_timeout_ms = 1_000;
    })
    .await;
    let wait = Duration::from_millis(700);
    let message = slow_tls_client(&relay, &material, wait, wait).await;
    assert!(
        match &message {
            None => true,
            Some(Message::Error(error)) => error.reason == ErrorReason::InvalidRequest,
            Some(_) => false,
        },
        "cut off at the shared budget, not served: {message:?}"
    );
    relay.shutdown().await.unwrap();
}

#[tokio::test]
async fn slow_tls_client_within_the_shared_request_timeout_is_served() {
    let material = material();
    let (_dir, relay) = tls_relay_with(&material, None, |config| {
        config.limits.request_timeout_ms = 3_000;
    })
    .await;
    let wait = Duration::from_millis(300);
    let message = slow_tls_client(&relay, &material, wait, wait).await;
    assert!(
        matches!(message, Some(Message::RelayInfo(_))),
        "{message:?}"
    );
    relay.shutdown().await.unwrap();
}
