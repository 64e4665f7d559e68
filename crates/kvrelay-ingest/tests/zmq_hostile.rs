//! Hostile publishers against the libzmq source, on loopback: a raw-TCP ZMTP peer that
//! declares absurd frame sizes, sends a multipart message over the limit or goes silent
//! after the handshake; an injected reader panic; a publisher naming ranks its card does
//! not declare. The process lives, the source reconnects (counted) and other sources keep
//! flowing.
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use kvrelay_identity::KvQueryHashFormat;
use kvrelay_ingest::{
    CanonicalConfig, EngineBatch, EngineEvent, EngineKind, EngineLayout, FaultInjection, Limits,
    QueueBudget, RejectionKind, SourceHandle, SourceOutput, SourceSignal, SourceState,
    ZmqSourceConfig, ZmqWire, encode_engine_batch, spawn_zmq_source,
};

const PAYLOAD_LIMIT: usize = 64 << 10;
const TOPIC: &[u8] = b"kv";

fn limits() -> Limits {
    Limits {
        max_payload_bytes: PAYLOAD_LIMIT,
        heartbeat_interval_ms: 100,
        heartbeat_timeout_ms: 300,
        handshake_timeout_ms: 1_000,
        reconnect_interval_ms: 20,
        reconnect_interval_max_ms: 200,
        restart_backoff_initial_ms: 300,
        restart_backoff_max_ms: 1_000,
        ..Limits::default()
    }
}

fn config(endpoint: String, worker_id: u64, fault: FaultInjection) -> ZmqSourceConfig {
    ZmqSourceConfig {
        worker_id,
        dp_rank: 0,
        declared_ranks: 0..1,
        wire: ZmqWire::Engine(EngineKind::Vllm),
        endpoint,
        replay_endpoint: None,
        topic: String::new(),
        canonical: CanonicalConfig::new(4, KvQueryHashFormat::DynamoStandardV1),
        limits: limits(),
        fault,
        resume_after: None,
        queue_budget: None,
    }
}

/// A batch clearing rank `rank`'s cache: small, valid, one router event.
fn cleared_payload(rank: u32) -> Vec<u8> {
    let batch = EngineBatch {
        ts: 0.0,
        events: vec![EngineEvent::AllBlocksCleared],
        dp_rank: Some(rank),
    };
    let mut payload = Vec::new();
    encode_engine_batch(
        &batch,
        EngineLayout {
            engine: EngineKind::Vllm,
            map_events: false,
            map_batch: false,
        },
        &mut payload,
    );
    payload
}

/// A libzmq PUB on a free loopback port.
fn publisher() -> (zmq::Socket, String) {
    let socket = zmq::Context::new().socket(zmq::PUB).unwrap();
    socket.set_linger(0).unwrap();
    socket.set_sndhwm(1_000_000).unwrap();
    socket.bind("tcp://127.0.0.1:*").unwrap();
    let endpoint = socket.get_last_endpoint().unwrap().unwrap();
    (socket, endpoint)
}

fn publish(socket: &zmq::Socket, seq: u64, payload: &[u8]) {
    let seq = seq.to_be_bytes();
    socket
        .send_multipart([TOPIC, &seq[..], payload], 0)
        .unwrap();
}

/// Waits (bounded) until `done` holds for the source's stats; panics with `what` if not.
async fn wait_for(source: &SourceHandle, what: &str, done: impl Fn(&SourceHandle) -> bool) {
    for _ in 0..400 {
        if done(source) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("{what}: {:?} state {:?}", source.stats(), source.state());
}

/// Drains a source's queued output, returning how many events it held.
fn drain(source: &mut SourceHandle) -> usize {
    let mut n = 0;
    while let Some(output) = source.try_next() {
        if matches!(output, SourceOutput::Event(_)) {
            n += 1;
        }
    }
    n
}

// --- a raw ZMTP 3.0 peer --------------------------------------------------------------

fn greeting() -> [u8; 64] {
    let mut greeting = [0u8; 64];
    greeting[0] = 0xff;
    greeting[9] = 0x7f;
    greeting[10] = 3; // major
    greeting[11] = 0; // minor: ZMTP 3.0
    greeting[12..16].copy_from_slice(b"NULL");
    greeting
}

fn ready_command() -> Vec<u8> {
    let mut body = vec![5];
    body.extend_from_slice(b"READY");
    body.push(11);
    body.extend_from_slice(b"Socket-Type");
    body.extend_from_slice(&3u32.to_be_bytes());
    body.extend_from_slice(b"PUB");
    let mut command = vec![0x04, body.len() as u8];
    command.extend_from_slice(&body);
    command
}

/// Completes the handshake as a PUB on an accepted connection.
fn handshake(stream: &mut TcpStream) {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    stream.write_all(&greeting()).unwrap();
    let mut peer = [0u8; 64];
    stream.read_exact(&mut peer).unwrap();
    assert_eq!(peer[0], 0xff, "peer greeting");
    stream.write_all(&ready_command()).unwrap();
    // The subscriber's READY: flags, size, then the body.
    let mut header = [0u8; 2];
    stream.read_exact(&mut header).unwrap();
    let mut body = vec![0u8; usize::from(header[1])];
    stream.read_exact(&mut body).unwrap();
}

/// A long frame header (flags `0x02`, or `0x03` with more) declaring `size` bytes.
fn long_frame_header(size: u64, more: bool) -> Vec<u8> {
    let mut header = vec![if more { 0x03 } else { 0x02 }];
    header.extend_from_slice(&size.to_be_bytes());
    header
}

fn frame(body: &[u8], more: bool) -> Vec<u8> {
    let mut out = long_frame_header(body.len() as u64, more);
    out.extend_from_slice(body);
    out
}

/// Whether the peer closed the connection within the read timeout.
fn closed_by_peer(stream: &mut TcpStream) -> bool {
    let mut sink = [0u8; 4096];
    loop {
        match stream.read(&mut sink) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(err) if err.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
    }
}

/// One hostile act per accepted connection, then a well-behaved finale that publishes a
/// valid batch; returns, per act, whether the relay closed that connection.
fn hostile_peer(listener: TcpListener) -> Vec<bool> {
    let mut closed = Vec::new();
    let accept = || {
        let (mut stream, _) = listener.accept().unwrap();
        handshake(&mut stream);
        stream
    };
    for declared in [1u64 << 40, 1u64 << 63, u64::MAX] {
        let mut stream = accept();
        stream
            .write_all(&long_frame_header(declared, false))
            .unwrap();
        closed.push(closed_by_peer(&mut stream));
    }
    // A multipart message over the limit: five frames of half the limit each.
    {
        let mut stream = accept();
        let half = vec![0u8; PAYLOAD_LIMIT / 2];
        for i in 0..5 {
            stream.write_all(&frame(&half, i < 4)).unwrap();
        }
        // The connection stays up (each frame is within the limit); the message is
        // rejected by the source. Then the peer goes silent: heartbeats close it.
        closed.push(closed_by_peer(&mut stream));
    }
    // The finale: a valid batch, so the source is shown to work on this endpoint again.
    let mut stream = accept();
    let payload = cleared_payload(0);
    let mut message = frame(TOPIC, true);
    message.extend(frame(&0u64.to_be_bytes(), true));
    message.extend(frame(&payload, false));
    // Paced by the socket: between sends, wait up to 20 ms for anything from the source
    // (heartbeats are read and ignored); a close ends the finale early.
    stream
        .set_read_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    let mut scratch = [0u8; 256];
    for _ in 0..50 {
        if stream.write_all(&message).is_err() {
            break;
        }
        if let Ok(0) = stream.read(&mut scratch) {
            break;
        }
    }
    closed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_frame_headers_close_only_that_connection_and_the_source_reconnects() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let hostile_endpoint = format!("tcp://{}", listener.local_addr().unwrap());
    let peer = std::thread::spawn(move || hostile_peer(listener));
    let mut hostile = spawn_zmq_source(config(hostile_endpoint, 1, FaultInjection::default()));

    // Another source on a well-behaved publisher, flowing throughout.
    let (good_pub, good_endpoint) = publisher();
    let mut good = spawn_zmq_source(config(good_endpoint, 2, FaultInjection::default()));
    let mut good_events = 0;
    let mut seq = 0u64;
    let finished = loop {
        publish(&good_pub, seq, &cleared_payload(0));
        seq += 1;
        good_events += drain(&mut good);
        if peer.is_finished() {
            break peer.join().unwrap();
        }
        assert!(seq < 2_000, "the hostile peer never finished");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(
        finished,
        vec![true, true, true, true],
        "each hostile connection is closed"
    );
    wait_for(&hostile, "hostile source events", |s| {
        s.stats().n_events >= 1
    })
    .await;
    let stats = hostile.stats();
    assert!(stats.n_disconnects >= 4, "{stats:?}");
    assert!(stats.n_connects >= 5, "{stats:?}");
    assert_eq!(stats.rejected(RejectionKind::Framing), 1, "{stats:?}");
    assert_eq!(stats.n_restarts, 0, "{stats:?}");
    assert!(drain(&mut hostile) >= 1);

    // The good source kept flowing while the other was attacked.
    let before = good_events;
    for _ in 0..20 {
        publish(&good_pub, seq, &cleared_payload(0));
        seq += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    wait_for(&good, "good source", |s| s.stats().n_events >= seq - 5).await;
    assert!(good_events + drain(&mut good) > before);
    assert_eq!(good.stats().n_disconnects, 0);
    assert!(hostile.shutdown().await);
    assert!(good.shutdown().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_injected_reader_panic_restarts_the_reader_and_readiness_shows_the_outage() {
    let (socket, endpoint) = publisher();
    let fault = FaultInjection::default();
    let mut source = spawn_zmq_source(config(endpoint, 1, fault.clone()));
    wait_for(&source, "connected", |s| {
        s.state() == SourceState::Connected
    })
    .await;
    // A probe taken now has seen the connected state; it wakes on later changes.
    let mut probe = source.probe();

    fault.panic_reader_once();
    let mut seen = Vec::new();
    for _ in 0..200 {
        match tokio::time::timeout(Duration::from_millis(50), probe.changed()).await {
            Ok(true) => {}
            Ok(false) => break,
            Err(_elapsed) => continue,
        }
        let state = probe.state();
        if seen.last() != Some(&state) {
            seen.push(state);
        }
        if state == SourceState::Connected && seen.contains(&SourceState::Failed) {
            break;
        }
    }
    assert_eq!(seen.first(), Some(&SourceState::Failed), "{seen:?}");
    assert_eq!(seen.last(), Some(&SourceState::Connected), "{seen:?}");
    assert_eq!(source.stats().n_restarts, 1);

    // The restarted reader delivers again.
    let mut signals = Vec::new();
    for seq in 0..200u64 {
        publish(&socket, seq, &cleared_payload(0));
        tokio::time::sleep(Duration::from_millis(10)).await;
        while let Some(output) = source.try_next() {
            if let SourceOutput::Signal(signal) = output {
                signals.push(signal);
            }
        }
        if source.stats().n_events > 0 {
            break;
        }
    }
    assert!(source.stats().n_events > 0, "{:?}", source.stats());
    assert!(
        signals
            .iter()
            .any(|s| matches!(s, SourceSignal::Lost { .. })),
        "{signals:?}"
    );
    assert!(source.shutdown().await);
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undeclared_ranks_are_rejected_and_counted_in_bounded_memory() {
    const N_RANKS: u64 = 300_000;
    const CHUNK: u64 = 5_000;
    let (socket, endpoint) = publisher();
    let mut source = spawn_zmq_source(config(endpoint, 1, FaultInjection::default()));
    wait_for(&source, "connected", |s| {
        s.state() == SourceState::Connected
    })
    .await;
    // Let the publisher register the subscription before counting on every message.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Warm up (allocator, queues), then measure.
    let mut seq = 0u64;
    let send_chunk = |seq: &mut u64, n: u64| {
        for _ in 0..n {
            publish(&socket, *seq, &cleared_payload(1_000 + *seq as u32));
            *seq += 1;
        }
    };
    send_chunk(&mut seq, CHUNK);
    wait_for(&source, "warm-up", |s| {
        s.stats().rejected(RejectionKind::UndeclaredRank) == CHUNK
    })
    .await;
    let rss_before = rss_bytes();
    while seq < N_RANKS + CHUNK {
        send_chunk(&mut seq, CHUNK);
        let target = seq;
        wait_for(&source, "rejections", move |s| {
            s.stats().rejected(RejectionKind::UndeclaredRank) == target
        })
        .await;
    }
    let rss_after = rss_bytes();
    let stats = source.stats();
    assert_eq!(
        stats.rejected(RejectionKind::UndeclaredRank),
        N_RANKS + CHUNK
    );
    assert_eq!(stats.n_events, 0);
    let growth = rss_after.saturating_sub(rss_before);
    // Unbounded per-rank state grows by ~10 MB for 300,000 ranks; the bound leaves room for
    // allocator and runtime noise while the whole suite runs (1.4–1.8 MB seen there).
    assert!(growth < 4 << 20, "RSS grew by {growth} bytes");

    // A reset (the sequence goes back) clears only the declared rank, once.
    publish(&socket, 0, &cleared_payload(0));
    let mut reset_sources = None;
    for _ in 0..200 {
        match tokio::time::timeout(Duration::from_millis(50), source.next()).await {
            Ok(Some(SourceOutput::Signal(SourceSignal::Reset { sources, .. }))) => {
                reset_sources = Some(sources);
                break;
            }
            Ok(Some(_)) | Err(_) => {}
            Ok(None) => break,
        }
    }
    let reset_sources = reset_sources.expect("a reset");
    assert!(reset_sources.len() <= 1, "{reset_sources:?}");
    assert!(source.shutdown().await);
}

/// A publisher of large messages against a source whose output nobody reads: the source
/// holds at most `max_queued_bytes` of them at any moment (the rest are dropped on arrival
/// and counted as `overflow`, so the source sees gaps instead of growing with what was
/// sent), and once its output is read again it gives the bytes back and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_beyond_the_byte_budget_are_dropped_and_counted() {
    overflow_against(Budget::OwnBound).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_messages_beyond_the_relay_wide_budget_are_dropped_and_counted() {
    overflow_against(Budget::Shared).await;
}

/// Which bound the overflow runs into.
#[derive(Clone, Copy, PartialEq)]
enum Budget {
    /// The source's own `max_queued_bytes`.
    OwnBound,
    /// A `QueueBudget` shared with other sources, its own bound set far above it.
    Shared,
}

/// Floods a stalled source with large messages: what the bound holds is kept, the rest
/// is dropped on arrival and counted, and everything comes back once it reads again.
async fn overflow_against(budget: Budget) {
    const MESSAGE: usize = 4 << 20;
    const SENT: u64 = 64; // 256 MiB offered against a 12 MiB budget
    // Three large messages and the two small batches below.
    let bound = 3 * MESSAGE + 1024;
    let limits = Limits {
        max_payload_bytes: MESSAGE + 1024,
        max_queued_bytes: if budget == Budget::Shared {
            64 * MESSAGE
        } else {
            bound
        },
        output_queue_depth: 1,
        ..limits()
    };
    let (socket, endpoint) = publisher();
    let mut config = config(endpoint, 1, FaultInjection::default());
    config.limits = limits;
    let shared = (budget == Budget::Shared).then(|| QueueBudget::new(bound));
    config.queue_budget = shared.clone();
    let mut source = spawn_zmq_source(config);
    wait_for(&source, "connected", |s| {
        s.state() == SourceState::Connected
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The connect signal fills the one-slot output queue, so the driver stalls emitting the
    // first batch's event; nobody reads, so from here the reader's queue is all that grows.
    let small = cleared_payload(0);
    publish(&socket, 0, &small);
    publish(&socket, 1, &small);
    wait_for(&source, "driver stalled", |s| s.stats().n_events == 1).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut big = cleared_payload(0);
    big.resize(MESSAGE, 0);
    for seq in 2..2 + SENT {
        publish(&socket, seq, &big);
    }
    wait_for(&source, "overflow counted", |s| {
        let stats = s.stats();
        stats.rejected(RejectionKind::Overflow) + stats.queued_bytes / (MESSAGE as u64) >= SENT
    })
    .await;
    let stats = source.stats();
    assert!(
        stats.peak_queued_bytes <= bound as u64,
        "held {} bytes at most, budget {bound}",
        stats.peak_queued_bytes,
    );
    assert_eq!(
        stats.queued_bytes,
        (3 * MESSAGE + 2 * small.len()) as u64,
        "the two small batches and three large messages are held: {stats:?}"
    );
    assert_eq!(
        stats.rejected(RejectionKind::Overflow),
        SENT - 3,
        "{stats:?}"
    );
    // Reading again: the waiting messages are decoded (malformed: trailing bytes), their
    // bytes return, and the source applies new batches.
    let mut events = 0;
    publish(&socket, 2 + SENT, &cleared_payload(0));
    for _ in 0..400 {
        events += drain(&mut source);
        if events >= 2 && source.stats().queued_bytes == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let stats = source.stats();
    assert!(events >= 2, "the source stopped: {stats:?}");
    assert_eq!(stats.queued_bytes, 0, "{stats:?}");
    if let Some(shared) = &shared {
        assert_eq!(shared.held(), 0, "the shared budget gets every byte back");
    }
    assert!(source.shutdown().await);
}
