//! `stream-engine`: one simulated vLLM worker of the stream benchmark.
//!
//! Takes requests `index, index + workers, ...` of the trace (round robin), serves each
//! through its LRU cache ([`kvrelay_benches::sim`]) and publishes the request's events as
//! one vLLM `KVEventBatch` (msgpack, array layout) on a ZMQ PUB socket as
//! `[topic, seq (8 B BE), payload]`, like vLLM's `ZmqEventPublisher`; a ROUTER socket
//! answers replay requests from its ring of recent batches (vLLM's replay protocol: the
//! batches from the requested sequence on, then the end marker, sequence -1).
//!
//! Protocol with the driver: prints `ready` once bound, waits for `go` on stdin (answering
//! replays meanwhile, from an empty ring), prints
//! `sent EVENTS BATCHES` about once a second, then `done EVENTS BATCHES UNIX_NS` and keeps
//! answering replays until `quit` (or stdin closes). Pacing: batch k is sent when the
//! events before it, at `--rate / --workers` events/s, are due (so each request's batch
//! goes out at once: the trace's natural bursts); `--rate 0` is flat out.
//!
//! `--precompute` serves and encodes every batch before `ready`, so that after `go` the
//! engine only hands bytes to libzmq: the offered rate is then far above what any relay
//! drains, and a run measures the relay's own sustained rate rather than the engines'.
//! `--max-events N` stops after the batch that brings this engine's events to `N` (in
//! either mode). A precomputed batch's stamp is still taken when it is sent.

use std::collections::VecDeque;
use std::io::{BufRead, Write};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use kvrelay_benches::sim::{VllmWorker, first_block_new, request_keys};
use kvrelay_benches::stamps::{Stamp, unix_ns};
use kvrelay_benches::{Flags, TOPIC};
use kvrelay_ingest::{EngineBatch, EngineKind, EngineLayout, encode_engine_batch};

/// vLLM's replay end marker (sequence -1).
const END_SEQ: [u8; 8] = [0xff; 8];

fn main() -> Result<()> {
    let flags = Flags::from_env();
    flags.ensure_known(&[
        "index",
        "workers",
        "worker-id",
        "trace",
        "capacity",
        "rate",
        "max-seconds",
        "publish",
        "replay",
        "stamps",
        "replay-batches",
        "send-hwm",
        "precompute",
        "max-events",
    ])?;
    let index: usize = flags.get("index")?;
    let workers: usize = flags.get_or("workers", 4)?;
    let worker_id: u64 = flags.get("worker-id")?;
    let trace: String = flags.get("trace")?;
    let capacity: usize = flags.get_or("capacity", 20_000)?;
    let rate: f64 = flags.get_or("rate", 0.0)?;
    let max_seconds: f64 = flags.get_or("max-seconds", f64::INFINITY)?;
    let publish: String = flags.get("publish")?;
    let replay_endpoint: String = flags.get("replay")?;
    let stamps_path: String = flags.get("stamps")?;
    // vLLM's defaults: `buffer_steps = 10_000` batches kept for replay, PUB `hwm = 100_000`.
    let replay_batches: usize = flags.get_or("replay-batches", 10_000)?;
    let send_hwm: i32 = flags.get_or("send-hwm", 100_000)?;
    let precompute = flags.switch("precompute");
    let max_events: u64 = flags.get_or("max-events", u64::MAX)?;

    let text = std::fs::read_to_string(&trace).with_context(|| format!("reading {trace}"))?;
    let requests = kvrelay_ingest::parse_request_trace(&text)?;
    let fresh = first_block_new(&requests);

    let context = zmq::Context::new();
    let publisher = context.socket(zmq::PUB)?;
    publisher.set_sndhwm(send_hwm)?;
    publisher.set_linger(0)?;
    publisher
        .bind(&publish)
        .with_context(|| format!("binding {publish}"))?;
    let replay = context.socket(zmq::ROUTER)?;
    replay.set_linger(0)?;
    replay
        .bind(&replay_endpoint)
        .with_context(|| format!("binding {replay_endpoint}"))?;
    let mut stamps = std::io::BufWriter::new(
        std::fs::File::create(&stamps_path).with_context(|| format!("creating {stamps_path}"))?,
    );

    let layout = EngineLayout {
        engine: EngineKind::Vllm,
        map_events: false,
        map_batch: false,
    };
    let mut batches = Batches {
        requests: &requests,
        fresh: &fresh,
        index,
        workers: workers.max(1),
        next: 0,
        cache: VllmWorker::new(worker_id, capacity),
        layout,
        events: 0,
        max_events,
    };
    let precomputed: Option<Vec<Batch>> = precompute.then(|| batches.by_ref().collect());

    let commands = stdin_lines();
    say("ready")?;
    // Waiting for `go` is spent answering replay requests, as an idle vLLM engine does: a
    // relay that joins now asks for the history from sequence 0 and gets the end marker at
    // once (unanswered, its replay would time out and reset the source).
    let ring: VecDeque<(u64, Vec<u8>)> = VecDeque::new();
    loop {
        match commands.try_recv() {
            Ok(line) if line == "go" => break,
            Ok(_) | Err(mpsc::TryRecvError::Empty) => {}
            Err(mpsc::TryRecvError::Disconnected) => return Ok(()),
        }
        serve_replay(&replay, &ring, Duration::from_millis(20))?;
    }

    let per_engine_rate = rate / workers.max(1) as f64;
    let mut ring = ring;
    let mut seq = 0u64;
    let mut events_sent = 0u64;
    let started = Instant::now();
    let mut next_progress = Duration::from_secs(1);
    let source: Box<dyn Iterator<Item = Batch> + '_> = match precomputed {
        Some(ready) => Box::new(ready.into_iter()),
        None => Box::new(batches),
    };
    for batch in source {
        if started.elapsed().as_secs_f64() >= max_seconds {
            break;
        }
        if per_engine_rate > 0.0 {
            let due = Duration::from_secs_f64(events_sent as f64 / per_engine_rate);
            if due.as_secs_f64() >= max_seconds {
                break;
            }
            // Waiting for the due time is spent answering replay requests.
            while let Some(left) = due.checked_sub(started.elapsed()) {
                if left < Duration::from_millis(1) {
                    break;
                }
                serve_replay(&replay, &ring, left)?;
            }
        } else {
            serve_replay(&replay, &ring, Duration::ZERO)?;
        }
        let sent_unix_ns = unix_ns();
        let seq_bytes = seq.to_be_bytes();
        publisher.send_multipart([TOPIC, &seq_bytes[..], &batch.payload[..]], 0)?;
        ring.push_back((seq, batch.payload));
        while ring.len() > replay_batches {
            ring.pop_front();
        }
        seq += 1;
        events_sent += batch.events;
        if batch.probe {
            // The probe is the request's first block (see `sim::first_block_new`).
            let stamp = Stamp {
                request: batch.request,
                sent_unix_ns,
                blocks: 1,
            };
            stamps.write_all(stamp.line().as_bytes())?;
            // The follower tails this file while the run goes on.
            stamps.flush()?;
        }
        if started.elapsed() >= next_progress {
            next_progress += Duration::from_secs(1);
            say(&format!("sent {events_sent} {seq}"))?;
        }
    }
    stamps.flush()?;
    say(&format!("done {events_sent} {seq} {}", unix_ns()))?;
    // Keep answering replays (the relay probes the tail after the publisher goes quiet).
    loop {
        match commands.try_recv() {
            Ok(line) if line == "quit" => return Ok(()),
            Ok(_) | Err(mpsc::TryRecvError::Empty) => {}
            Err(mpsc::TryRecvError::Disconnected) => return Ok(()),
        }
        serve_replay(&replay, &ring, Duration::from_millis(50))?;
    }
}

/// One request's events, encoded as the batch vLLM would publish.
struct Batch {
    /// The request's index in the trace.
    request: usize,
    /// Events in the batch.
    events: u64,
    /// The encoded `KVEventBatch`.
    payload: Vec<u8>,
    /// Whether the request's first block is new to the fleet (a latency probe).
    probe: bool,
}

/// This engine's batches in trace order: its round-robin share of the requests, each
/// served through its cache; a full hit publishes nothing (as vLLM) and is skipped.
struct Batches<'a> {
    requests: &'a [kvrelay_ingest::RequestRecord],
    fresh: &'a [bool],
    index: usize,
    workers: usize,
    /// The next request to look at.
    next: usize,
    cache: VllmWorker,
    layout: EngineLayout,
    /// Events in the batches made so far.
    events: u64,
    /// No batch is made once `events` reaches this.
    max_events: u64,
}

impl Iterator for Batches<'_> {
    type Item = Batch;

    fn next(&mut self) -> Option<Batch> {
        while self.events < self.max_events {
            let at = self.next;
            let request = self.requests.get(at)?;
            self.next += 1;
            if at % self.workers != self.index {
                continue;
            }
            let served = self.cache.serve(&request_keys(request));
            if served.events.is_empty() {
                continue;
            }
            let events = served.events.len() as u64;
            let probe = self.fresh.get(at).copied().unwrap_or(false) && served.stored_blocks > 0;
            let batch = EngineBatch {
                ts: unix_ns() as f64 / 1e9,
                events: served.events,
                dp_rank: Some(0),
            };
            let mut payload = Vec::new();
            encode_engine_batch(&batch, self.layout, &mut payload);
            self.events += events;
            return Some(Batch {
                request: at,
                events,
                payload,
                probe,
            });
        }
        None
    }
}

/// Prints one protocol line to the driver.
fn say(line: &str) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{line}")?;
    stdout.flush()?;
    Ok(())
}

/// Lines of stdin, read on their own thread.
fn stdin_lines() -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::stdin().lock().lines() {
            let Ok(line) = line else { return };
            if tx.send(line.trim().to_owned()).is_err() {
                return;
            }
        }
    });
    rx
}

/// Waits up to `wait` for replay requests and answers every one queued.
fn serve_replay(
    socket: &zmq::Socket,
    ring: &VecDeque<(u64, Vec<u8>)>,
    wait: Duration,
) -> Result<()> {
    let timeout = i64::try_from(wait.as_millis()).unwrap_or(i64::MAX);
    let mut items = [socket.as_poll_item(zmq::POLLIN)];
    if zmq::poll(&mut items, timeout)? == 0 {
        return Ok(());
    }
    loop {
        let frames = match socket.recv_multipart(zmq::DONTWAIT) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => return Ok(()),
            Err(err) => return Err(err.into()),
        };
        // [identity, empty, start_seq]
        let (Some(identity), Some(start)) = (frames.first(), frames.last()) else {
            continue;
        };
        let Ok(start) = <[u8; 8]>::try_from(start.as_slice()) else {
            continue;
        };
        let start = u64::from_be_bytes(start);
        for (seq, payload) in ring.iter().filter(|(seq, _)| *seq >= start) {
            let seq_bytes = seq.to_be_bytes();
            socket.send_multipart([&identity[..], &[][..], &seq_bytes[..], &payload[..]], 0)?;
        }
        socket.send_multipart([&identity[..], &[][..], &END_SEQ[..], &[][..]], 0)?;
    }
}
