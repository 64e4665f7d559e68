//! The relay's side of one DC-sized pool beyond its filter (issue #37, item 4): what
//! publishing it costs, measured with the relay's own parts (ckf's `Publisher`, the
//! codec's `PoolFrameEncoder`) and a consumer's `Replica` behind a loopback TCP socket.
//!
//! - **Snapshot**: the publisher's mirror copy, encoding every CBI1 chunk frame (XXH3
//!   checksums included), then writing the frames to a socket on 127.0.0.1 while another
//!   thread reads, decodes, checks and installs them into a replica (send + install).
//! - **Catch-up after an outage**: the pool churns (each delta stores a fresh chain of
//!   [`CHAIN_BLOCKS`] blocks and evicts the oldest once [`LIVE_CHAINS`] are held), and a
//!   subscriber misses `n` deltas, either still connected (its backlog coalesces) or
//!   reconnecting with the sequence it holds (the resume window answers, or a snapshot).
//!   Reported: what it is sent to catch up, in frames and bytes, and the time to poll and
//!   encode it, against the snapshot; each replica is checked bit-identical after.
//! - **Memory by component** after the longest outage: the publisher's gauges (mirror,
//!   resume window, pending backlogs, pinned copies) next to their configured bounds.

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use bytes::{Bytes, BytesMut};
use kvrelay_ckf::stream::{Poll, Publisher, Start, StreamLimits, SubscriberId, Transmit};
use kvrelay_ckf::{
    Delta, EventPayload, PoolFilter, RemovedBlocks, Replica, RouterEvent, SourceId, StoredBlock,
    StoredBlocks,
};
use kvrelay_codec::Limits;
use kvrelay_codec::session::PoolFrameEncoder;
use kvrelay_codec::v1::{
    DigestId, IdentitySource, Message, PoolId, PoolPayload, ProducerIdentity, RelayIdentity,
    decode_message,
};
use serde_json::{Value, json};

use crate::fleet::{Rng, splitmix};
use crate::rounded;

/// Blocks stored by each churn delta (and, once [`LIVE_CHAINS`] chains are held, evicted).
const CHAIN_BLOCKS: usize = 256;
/// Churn chains held at once; older ones are evicted.
const LIVE_CHAINS: usize = 64;
/// Deltas per second the outages are expressed in: the pool's default publication window
/// is 10 ms, so a busy pool publishes up to 100 a second.
const DELTAS_PER_SECOND: f64 = 100.0;

/// A worker that keeps storing fresh chains and evicting the oldest.
struct Churn {
    source: SourceId,
    rng: Rng,
    next_engine_id: u64,
    held: VecDeque<Vec<u64>>,
}

impl Churn {
    fn new() -> Self {
        Self {
            // A worker id no DC builder uses.
            source: SourceId::new(u64::MAX - 1, 0),
            rng: Rng(0x9E37_79B9_7F4A_7C15),
            next_engine_id: 1,
            held: VecDeque::new(),
        }
    }

    fn apply(&mut self, filter: &mut PoolFilter, payload: EventPayload) -> Result<()> {
        let event = RouterEvent {
            source: self.source,
            event_id: self.next_engine_id,
            payload,
        };
        filter
            .apply(&event)
            .map_err(|err| anyhow!("churn event refused: {err}"))?;
        Ok(())
    }

    /// Stores one chain, evicts the oldest past [`LIVE_CHAINS`], and takes the delta.
    fn step(&mut self, filter: &mut PoolFilter) -> Result<Delta> {
        let blocks: Vec<StoredBlock> = (0..CHAIN_BLOCKS)
            .map(|_| {
                let engine_block_id = self.next_engine_id;
                self.next_engine_id += 1;
                StoredBlock {
                    engine_block_id,
                    token_hash: splitmix(self.rng.next()),
                }
            })
            .collect();
        self.held
            .push_back(blocks.iter().map(|b| b.engine_block_id).collect());
        self.apply(
            filter,
            EventPayload::Stored(StoredBlocks {
                parent_engine_block_id: None,
                blocks,
            }),
        )?;
        if self.held.len() > LIVE_CHAINS
            && let Some(oldest) = self.held.pop_front()
        {
            self.apply(
                filter,
                EventPayload::Removed(RemovedBlocks {
                    engine_block_ids: oldest,
                }),
            )?;
        }
        filter
            .take_delta()
            .map_err(|err| anyhow!("taking a churn delta: {err}"))?
            .context("a churn step changed no bucket")
    }
}

/// The pool's producer identity on the wire (only its format is checked by frames).
fn producer_of(filter: &PoolFilter) -> ProducerIdentity {
    let digest = |seed: u64| {
        let mut out = [0u8; 16];
        out[..8].copy_from_slice(&splitmix(seed).to_le_bytes());
        out[8..].copy_from_slice(&splitmix(seed + 1).to_le_bytes());
        DigestId {
            digest: out,
            source: IdentitySource::DefaultDerived,
        }
    };
    ProducerIdentity {
        pool_id: PoolId {
            identity_version: 1,
            cache_semantics: digest(1),
            routing_scope: digest(2),
            dc_id: 1,
        },
        producer_incarnation: 1,
        layout_generation: 1,
        ckf_format: filter.format().into(),
    }
}

/// An empty replica of `format`, as a consumer starts one.
fn new_replica(format: kvrelay_identity::CkfFormat) -> Result<Replica> {
    Replica::new(format).map_err(|err| anyhow!("a replica: {err}"))
}

/// What one subscriber was handed until it had nothing more to take.
#[derive(Default)]
struct Drained {
    frames: u64,
    bytes: u64,
    coalesced_frames: u64,
    snapshot_chunks: u64,
    /// Time in `poll_transmit` and encoding.
    busy: Duration,
    cut_off: bool,
}

impl Drained {
    /// One catch-up as reported: what was sent, against the snapshot's bytes.
    fn to_json(&self, kind: &str, snapshot_bytes: u64) -> Value {
        json!({
            "kind": kind,
            "frames": self.frames,
            "bytes": self.bytes,
            "vs_snapshot_bytes": rounded(self.bytes as f64 / snapshot_bytes as f64, 4),
            "poll_encode_ms": rounded(self.busy.as_secs_f64() * 1e3, 2),
        })
    }
}

/// Polls `id` until idle, encoding every frame; applies each to `replica`.
fn drain(
    publisher: &mut Publisher<()>,
    encoder: &PoolFrameEncoder,
    id: SubscriberId,
    replica: &mut Replica,
    now: Instant,
    mut keep: impl FnMut(Bytes),
) -> Result<Drained> {
    let mut out = Drained::default();
    loop {
        let started = Instant::now();
        let transmit = match publisher.poll_transmit(id, now) {
            Poll::Transmit(transmit) => transmit,
            Poll::CutOff(_) => {
                out.cut_off = true;
                return Ok(out);
            }
            Poll::Idle | Poll::Unknown => return Ok(out),
        };
        let encoded = encoder.transmit(&transmit, 0).context("encoding a frame")?;
        out.busy += started.elapsed();
        out.frames += 1;
        out.bytes += encoded.frame.len() as u64;
        if let Transmit::Delta { covers, .. } = &transmit
            && *covers > 1
        {
            out.coalesced_frames += 1;
        }
        // The replica takes the frame as a consumer does: decoded and checked.
        let mut wire = BytesMut::from(&encoded.frame[..]);
        let Some(Message::PoolFrame(frame)) =
            decode_message(&mut wire, &Limits::default()).map_err(|err| anyhow!("{err}"))?
        else {
            bail!("the encoder wrote something else than a pool frame");
        };
        match frame
            .check(&encoder.producer())
            .map_err(|err| anyhow!("checking a frame: {err}"))?
        {
            PoolPayload::SnapshotChunk(view) => {
                out.snapshot_chunks += 1;
                replica
                    .install_chunk(&view.to_snapshot_chunk())
                    .map_err(|err| anyhow!("installing a chunk: {err}"))?;
            }
            PoolPayload::Delta(view) => replica
                .apply_delta(&view.to_delta())
                .map_err(|err| anyhow!("applying a delta: {err}"))?,
            PoolPayload::Heartbeat => {}
        }
        keep(encoded.frame);
    }
}

/// Writes `frames` to a loopback socket while a reader thread decodes, checks and
/// installs them into a fresh replica; returns the time until the replica is current.
fn send_over_loopback(
    frames: &[Bytes],
    producer: ProducerIdentity,
    filter: &PoolFilter,
) -> Result<(Duration, Vec<u64>)> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding a loopback socket")?;
    let addr = listener.local_addr()?;
    let format = filter.format();
    let reader = std::thread::spawn(move || -> Result<(Instant, Vec<u64>)> {
        let (mut socket, _) = listener.accept().context("accepting the sender")?;
        let limits = Limits::default();
        let mut replica = new_replica(format)?;
        let mut buf = BytesMut::with_capacity(8 << 20);
        let mut read = vec![0u8; 1 << 20];
        loop {
            while let Some(message) =
                decode_message(&mut buf, &limits).map_err(|err| anyhow!("decoding: {err}"))?
            {
                let Message::PoolFrame(frame) = message else {
                    bail!("expected a pool frame");
                };
                let payload = frame
                    .check(&producer)
                    .map_err(|err| anyhow!("checking a frame: {err}"))?;
                let PoolPayload::SnapshotChunk(view) = payload else {
                    bail!("expected a snapshot chunk");
                };
                if replica
                    .install_chunk(&view.to_snapshot_chunk())
                    .map_err(|err| anyhow!("installing: {err}"))?
                {
                    let done = Instant::now();
                    let words = replica.words().context("installed replica")?.to_vec();
                    return Ok((done, words));
                }
            }
            let n = socket.read(&mut read).context("reading frames")?;
            ensure!(n > 0, "the sender closed before the snapshot completed");
            buf.extend_from_slice(&read[..n]);
        }
    });
    let mut socket = TcpStream::connect(addr).context("connecting to the reader")?;
    socket.set_nodelay(true)?;
    let started = Instant::now();
    for frame in frames {
        socket.write_all(frame).context("writing a frame")?;
    }
    let (done, words) = reader
        .join()
        .map_err(|_| anyhow!("the reader thread panicked"))??;
    Ok((done.duration_since(started), words))
}

/// Measures the relay's side of `filter`'s pool (it churns: use it for nothing after).
pub(crate) fn measure(filter: &mut PoolFilter, outages: &[u64]) -> Result<Value> {
    ensure!(
        filter
            .take_delta()
            .map_err(|err| anyhow!("{err}"))?
            .is_none(),
        "the pool has unpublished changes"
    );
    let limits = StreamLimits::default();
    let copying = Instant::now();
    let mut publisher: Publisher<()> =
        Publisher::new(filter.sequence(), filter.words().to_vec(), limits.clone())
            .map_err(|err| anyhow!("a publisher: {err}"))?;
    let mirror_copy = copying.elapsed();
    let producer = producer_of(filter);
    let relay = RelayIdentity {
        drt_instance_id: 1,
        relay_incarnation: 1,
    };
    let encoder = PoolFrameEncoder::new(relay, producer, Limits::default());
    let now = Instant::now();

    // The snapshot: encode every chunk, then send it to a replica over loopback.
    let (mut connected, _) = publisher
        .handle_subscribe(None, true, now)
        .map_err(|err| anyhow!("subscribing: {err}"))?;
    let mut connected_replica = new_replica(filter.format())?;
    let mut frames = Vec::new();
    let snapshot = drain(
        &mut publisher,
        &encoder,
        connected,
        &mut connected_replica,
        now,
        |frame| frames.push(frame),
    )?;
    let (send_install, received) = send_over_loopback(&frames, producer, filter)?;
    ensure!(
        received == publisher.words(),
        "the loopback replica differs"
    );
    drop(frames);
    eprintln!(
        "  relay side: snapshot {} frames, {:.1} MiB, encode {:.1} ms, send + install {:.1} ms",
        snapshot.frames,
        snapshot.bytes as f64 / (1u64 << 20) as f64,
        snapshot.busy.as_secs_f64() * 1e3,
        send_install.as_secs_f64() * 1e3
    );

    // Outages: a connected subscriber that stopped reading, and one that reconnects.
    let mut churn = Churn::new();
    let mut rows = Vec::new();
    let mut memory = Value::Null;
    let mut apply_time = Duration::ZERO;
    let mut applied = 0u64;
    let mut churn_images = 0u64;
    let omissions_before = filter.counters().capacity_omissions;
    for &missed in outages {
        let held = publisher.sequence();
        let mut reconnect_replica = new_replica(filter.format())?;
        for chunk in filter.snapshot().map_err(|err| anyhow!("{err}"))?.chunks {
            reconnect_replica
                .install_chunk(&chunk)
                .map_err(|err| anyhow!("{err}"))?;
        }
        for _ in 0..missed {
            let started = Instant::now();
            let delta = churn.step(filter)?;
            apply_time += started.elapsed();
            applied += 1;
            churn_images += delta.images.len() as u64;
            publisher
                .handle_delta(delta, now, |_| ())
                .map_err(|err| anyhow!("publishing churn: {err}"))?;
        }
        let stats = publisher.stats();
        memory = json!({
            "mirror_bytes": stats.mirror_bytes,
            "resume_window_bytes": stats.retained_bytes,
            "resume_window_deltas": stats.retained_deltas,
            "pending_backlog_bytes": stats.pending_bytes,
            "pinned_copy_bytes": stats.pinned_copy_bytes,
        });
        let mut caught_up = drain(
            &mut publisher,
            &encoder,
            connected,
            &mut connected_replica,
            now,
            |_| (),
        )?;
        let connected_kind = if caught_up.cut_off {
            // Cut off for its backlog: it resubscribes and takes a snapshot.
            publisher.handle_unsubscribe(connected);
            let (id, _) = publisher
                .handle_subscribe(None, true, now)
                .map_err(|err| anyhow!("resubscribing: {err}"))?;
            connected = id;
            connected_replica = new_replica(filter.format())?;
            caught_up = drain(
                &mut publisher,
                &encoder,
                id,
                &mut connected_replica,
                now,
                |_| (),
            )?;
            "cut off, snapshot"
        } else if caught_up.coalesced_frames > 0 {
            "coalesced deltas"
        } else {
            "deltas"
        };
        ensure!(
            connected_replica.words() == Some(publisher.words()),
            "the connected replica differs after catching up"
        );
        let (reconnected, start) = publisher
            .handle_subscribe(Some(held), true, now)
            .map_err(|err| anyhow!("reconnecting: {err}"))?;
        if let Start::Snapshot { .. } = start {
            reconnect_replica = new_replica(filter.format())?;
        }
        let resumed = drain(
            &mut publisher,
            &encoder,
            reconnected,
            &mut reconnect_replica,
            now,
            |_| (),
        )?;
        publisher.handle_unsubscribe(reconnected);
        ensure!(
            reconnect_replica.words() == Some(publisher.words()),
            "the reconnected replica differs after catching up"
        );
        let reconnect_kind = match start {
            Start::Resume { .. } => "resumed",
            Start::Snapshot { .. } => "snapshot",
        };
        let row = json!({
            "missed_deltas": missed,
            "missed_seconds_at_100_deltas_per_s": rounded(missed as f64 / DELTAS_PER_SECOND, 2),
            "connected": caught_up.to_json(connected_kind, snapshot.bytes),
            "reconnected": resumed.to_json(reconnect_kind, snapshot.bytes),
        });
        eprintln!(
            "  relay side: {missed} deltas missed: connected {connected_kind} {} B, reconnected {reconnect_kind} {} B",
            caught_up.bytes, resumed.bytes
        );
        rows.push(row);
    }
    let table_bytes = publisher.words().len() as u64 * 8;
    Ok(json!({
        "mirror_copy_ms": rounded(mirror_copy.as_secs_f64() * 1e3, 1),
        "snapshot_frames": snapshot.frames,
        "snapshot_bytes": snapshot.bytes,
        "snapshot_encode_ms": rounded(snapshot.busy.as_secs_f64() * 1e3, 1),
        "snapshot_send_install_ms": rounded(send_install.as_secs_f64() * 1e3, 1),
        "churn_blocks_per_delta": CHAIN_BLOCKS,
        "churn_bucket_images_per_delta": rounded(churn_images as f64 / applied.max(1) as f64, 1),
        "churn_capacity_omissions": filter.counters().capacity_omissions - omissions_before,
        "churn_apply_ms_per_delta": rounded(apply_time.as_secs_f64() * 1e3 / applied.max(1) as f64, 3),
        "catch_up": rows,
        "memory_after_longest_outage": memory,
        "bounds": {
            "mirror_bytes": table_bytes,
            "resume_window_bytes": limits.resume_window_bytes,
            "backlog_bytes_per_subscriber": publisher.backlog_bound(),
            "max_subscribers": limits.max_subscribers,
            "pinned_copies_bytes": limits.max_pinned_snapshots as u64 * table_bytes,
        },
    }))
}
