//! A relay fed by a real vLLM-style ZMQ publisher configured in `[[sources]]`: engine
//! batches on the wire become filter content a WAN replica sees.

use crate::support;

use kvrelay_codec::v1::StreamRpc;
use kvrelay_server::{ProbeStream, Relay, SourceConfig, SourceEngine};
use support::{DEADLINE, Feed, mirror_at_producer, publish_until_resident, request, single_worker};
use zeromq::{PubSocket, Socket};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zmq_engine_events_reach_a_wan_replica() {
    let mut publisher = PubSocket::new();
    let endpoint = publisher
        .bind("tcp://127.0.0.1:0")
        .await
        .unwrap()
        .to_string();

    let dir = tempfile::tempdir().unwrap();
    let mut config = single_worker(dir.path(), "dc-zmq", "prod");
    config.sources = vec![SourceConfig {
        endpoint: "prod.backend.generate".to_owned(),
        worker_id: 0x11,
        dp_rank: 0,
        engine: SourceEngine::Vllm,
        zmq: endpoint,
        replay: None,
        metrics_url: None,
        publisher_id: None,
    }];
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .unwrap();

    publish_until_resident(
        &relay,
        &mut publisher,
        Feed::Vllm,
        "no engine event reached the pool",
    )
    .await;

    let producer = relay.catalog().pools[0].producer;
    let (mirror, table) = mirror_at_producer(&relay, producer).await;
    assert!(table.words.iter().any(|word| *word != 0));
    assert_eq!(mirror.words().unwrap(), table.words.as_slice());
    relay.shutdown().await.unwrap();
}

/// Serves one fixed metrics page to every connection.
async fn serve_metrics(page: &'static str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let mut request = Vec::new();
            let mut buf = [0u8; 1024];
            while !request.windows(4).any(|window| window == b"\r\n\r\n") {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&buf[..n]),
                }
            }
            let response = format!(
                "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                page.len()
            );
            let _ = stream.write_all(response.as_bytes()).await;
        }
    });
    format!("http://{addr}/metrics")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scraped_kv_usage_becomes_the_pool_load() {
    let url = serve_metrics("# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine=\"0\",model_name=\"a\"} 0.5\n").await;
    let dir = tempfile::tempdir().unwrap();
    let mut config = single_worker(dir.path(), "dc-load", "prod");
    config.limits.load_window_ms = 50;
    config.sources = vec![SourceConfig {
        endpoint: "prod.backend.generate".to_owned(),
        worker_id: 0x11,
        dp_rank: 0,
        engine: SourceEngine::Vllm,
        // No engine publishes here; only the metrics endpoint matters in this test.
        zmq: "tcp://127.0.0.1:9".to_owned(),
        replay: None,
        metrics_url: Some(url),
        publisher_id: None,
    }];
    let relay = Relay::start(config).await.unwrap();
    tokio::time::timeout(DEADLINE, relay.wait_for_pools(1))
        .await
        .unwrap();
    let mut stream = ProbeStream::connect(relay.wan_addr(), &request(StreamRpc::WatchLoad))
        .await
        .unwrap();
    loop {
        let message = support::next(&mut stream).await.expect("load stream open");
        let kvrelay_codec::v1::Message::LoadWindow(window) = message else {
            panic!("expected a load window, got {message:?}")
        };
        if let Some(pool) = window.pools.first()
            && pool.kv_used_blocks == Some(512)
        {
            assert_eq!(pool.total_kv_blocks, Some(1024));
            assert!(pool.authoritative, "{pool:?}");
            break;
        }
    }
    relay.shutdown().await.unwrap();
}
