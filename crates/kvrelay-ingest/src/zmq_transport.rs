//! The libzmq side of a ZMQ source: a blocking SUB reader and a blocking DEALER replay
//! exchange, each run on a tokio blocking thread and checking cancellation between polls.
//!
//! libzmq (the implementation the engines publish with) enforces the transport bounds
//! before anything is allocated: `ZMQ_MAXMSGSIZE` is the payload limit, so a frame header
//! declaring more closes that connection; ZMTP heartbeats drop a publisher that stops
//! answering; libzmq redials with exponential backoff; `ZMQ_RCVHWM` bounds what it queues.
//! A socket monitor reports handshakes and disconnects, which set the source's state.
//!
//! libzmq 4.3 abandons an endpoint after a *protocol* error (such as a frame over
//! `ZMQ_MAXMSGSIZE`) instead of redialling it, so on every disconnect the reader drops the
//! endpoint and dials it again itself, after a delay that doubles per disconnect (from
//! `reconnect_interval_ms` up to `reconnect_interval_max_ms`) and starts over once a valid
//! batch arrives: a hostile peer costs one handshake per delay, never a busy loop.
//!
//! libzmq bounds each frame, not the frame count of one multipart message: a message of
//! more than three frames is drained and rejected (counted as `framing`).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::error::RejectionKind;
use crate::event_plane::parse_event_plane;
use crate::limits::Limits;
use crate::log_limit::RejectionLog;
use crate::metered::{ByteBudget, Metered};
use crate::source::{SourceState, StateCell};
use crate::stats::Counters;
use crate::zmq_config::{FaultInjection, ZmqWire};
use crate::zmq_frames::{ReplayReply, ZmqFrameError, parse_live, parse_replay, replay_request};

/// How long one poll waits before cancellation is checked again.
const POLL_INTERVAL_MS: i64 = 50;
/// Messages drained per wake-up before cancellation and the monitor are checked again.
const MAX_MESSAGES_PER_WAKE: usize = 256;
/// Frames of the largest live message (an engine's `[topic, seq, payload]`, Dynamo's
/// event plane `[topic, publisher, seq, frame]`).
const MAX_FRAMES: usize = 4;
/// Frames of the largest replay reply (`[empty, topic, seq, payload]`).
const MAX_REPLAY_FRAMES: usize = 4;

/// The process's libzmq context (one I/O thread serves every source).
fn context() -> &'static zmq::Context {
    static CONTEXT: OnceLock<zmq::Context> = OnceLock::new();
    CONTEXT.get_or_init(zmq::Context::new)
}

/// A unique in-process address for one socket monitor.
fn monitor_address() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "inproc://kvrelay-zmq-monitor-{}",
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// What the reader forwards to the driver.
#[derive(Debug)]
pub(crate) enum ReaderEvent {
    /// A publisher completed its handshake.
    Connected,
    /// The publisher's connection was lost (libzmq redials).
    Disconnected,
    /// A live batch, admitted against the source's byte budget.
    Batch { seq: u64, payload: Metered },
}

/// Why the reader returned.
#[derive(Debug)]
pub(crate) enum ReaderExit {
    /// Cancelled, or the driver is gone: the source is stopping.
    Stopped,
    /// libzmq failed; the reader is restarted.
    Failed(zmq::Error),
}

/// Everything one reader run needs.
#[derive(Debug, Clone)]
pub(crate) struct ReaderParams {
    pub(crate) endpoint: String,
    pub(crate) topic: String,
    pub(crate) wire: ZmqWire,
    pub(crate) limits: Limits,
    pub(crate) budget: ByteBudget,
    pub(crate) fault: FaultInjection,
}

fn clamp_ms(ms: u64) -> i32 {
    i32::try_from(ms).unwrap_or(i32::MAX)
}

/// Applies the configured bounds to a socket before it connects.
fn configure(socket: &zmq::Socket, limits: &Limits) -> Result<(), zmq::Error> {
    socket.set_maxmsgsize(i64::try_from(limits.max_payload_bytes).unwrap_or(i64::MAX))?;
    socket.set_rcvhwm(i32::try_from(limits.receive_high_water_mark).unwrap_or(i32::MAX))?;
    socket.set_heartbeat_ivl(clamp_ms(limits.heartbeat_interval_ms))?;
    socket.set_heartbeat_timeout(clamp_ms(limits.heartbeat_timeout_ms))?;
    socket.set_heartbeat_ttl(clamp_ms(limits.heartbeat_timeout_ms))?;
    socket.set_handshake_ivl(clamp_ms(limits.handshake_timeout_ms))?;
    socket.set_reconnect_ivl(clamp_ms(limits.reconnect_interval_ms.max(1)))?;
    socket.set_reconnect_ivl_max(clamp_ms(limits.reconnect_interval_max_ms))?;
    socket.set_linger(0)?;
    Ok(())
}

/// Rejects endpoints libzmq's C API cannot take (an interior NUL would panic the binding).
pub(crate) fn endpoint_is_valid(endpoint: &str) -> bool {
    !endpoint.is_empty() && !endpoint.contains('\0')
}

/// Reads one message of at most `max_frames` frames without blocking: `Ok(None)` when
/// none is queued, `Ok(Some(Err(n)))` when it had `n > max_frames` frames (all drained).
fn recv_frames(
    socket: &zmq::Socket,
    max_frames: usize,
) -> Result<Option<Result<Vec<Bytes>, usize>>, zmq::Error> {
    let first = match socket.recv_msg(zmq::DONTWAIT) {
        Ok(message) => message,
        Err(zmq::Error::EAGAIN) => return Ok(None),
        Err(err) => return Err(err),
    };
    let mut more = first.get_more();
    let mut frames = vec![Bytes::copy_from_slice(&first)];
    let mut n_frames = 1usize;
    // A multipart message is delivered whole, so its remaining frames are queued now.
    while more {
        let frame = socket.recv_msg(0)?;
        more = frame.get_more();
        n_frames += 1;
        if n_frames <= max_frames {
            frames.push(Bytes::copy_from_slice(&frame));
        }
    }
    if n_frames > max_frames {
        return Ok(Some(Err(n_frames)));
    }
    Ok(Some(Ok(frames)))
}

/// Logs a rejection when its rate limit allows, with the count since the last line.
pub(crate) fn log_rejection(
    log: &mut RejectionLog,
    kind: RejectionKind,
    peer: &str,
    error: &dyn std::fmt::Display,
) {
    if let Some(count) = log.note(kind, Instant::now()) {
        warn!(peer, reason = kind.as_str(), count, error = %error, "rejected zmq input");
    }
}

/// Runs one reader: connects, then forwards batches and connection events until
/// cancelled, the driver is gone, or libzmq fails.
pub(crate) fn run_reader(
    params: &ReaderParams,
    live: &mpsc::Sender<ReaderEvent>,
    state: &StateCell,
    counters: &Counters,
    cancel: &CancellationToken,
) -> ReaderExit {
    match read(params, live, state, counters, cancel) {
        Ok(()) => ReaderExit::Stopped,
        Err(err) => ReaderExit::Failed(err),
    }
}

fn read(
    params: &ReaderParams,
    live: &mpsc::Sender<ReaderEvent>,
    state: &StateCell,
    counters: &Counters,
    cancel: &CancellationToken,
) -> Result<(), zmq::Error> {
    let limits = &params.limits;
    let peer = params.endpoint.as_str();
    if !endpoint_is_valid(peer) {
        return Err(zmq::Error::EINVAL);
    }
    let ctx = context();
    let sub = ctx.socket(zmq::SUB)?;
    configure(&sub, limits)?;
    let monitor_at = monitor_address();
    sub.monitor(
        &monitor_at,
        zmq::SocketEvent::HANDSHAKE_SUCCEEDED as i32 | zmq::SocketEvent::DISCONNECTED as i32,
    )?;
    let monitor = ctx.socket(zmq::PAIR)?;
    monitor.set_linger(0)?;
    monitor.connect(&monitor_at)?;
    sub.set_subscribe(params.topic.as_bytes())?;
    sub.connect(peer)?;
    state.set_transport(SourceState::Connecting);
    let mut rejections = RejectionLog::new(Duration::from_millis(limits.log_interval_ms));
    let initial_delay = Duration::from_millis(limits.reconnect_interval_ms.max(1));
    let max_delay = Duration::from_millis(limits.reconnect_interval_max_ms).max(initial_delay);
    let mut redial_delay = initial_delay;
    let mut redial_at: Option<Instant> = None;
    loop {
        if cancel.is_cancelled() {
            return Ok(());
        }
        params.fault.check_reader();
        let mut timeout = POLL_INTERVAL_MS;
        if let Some(at) = redial_at {
            let now = Instant::now();
            if now >= at {
                sub.connect(peer)?;
                redial_at = None;
            } else {
                let until = at.saturating_duration_since(now).as_millis();
                timeout = timeout.min(i64::try_from(until).unwrap_or(i64::MAX).max(1));
            }
        }
        let mut items = [
            monitor.as_poll_item(zmq::POLLIN),
            sub.as_poll_item(zmq::POLLIN),
        ];
        zmq::poll(&mut items, timeout)?;
        let (monitor_ready, sub_ready) = (items[0].is_readable(), items[1].is_readable());
        if monitor_ready {
            while let Some(Ok(frames)) = recv_frames(&monitor, 2)? {
                let Some(event) = frames.first().and_then(|f| f.get(..2)) else {
                    continue;
                };
                let event = u16::from_le_bytes([event[0], event[1]]);
                let forwarded = if event == zmq::SocketEvent::HANDSHAKE_SUCCEEDED as u16 {
                    counters.connect();
                    state.set_transport(SourceState::Connected);
                    info!(peer, "zmq publisher connected");
                    ReaderEvent::Connected
                } else if event == zmq::SocketEvent::DISCONNECTED as u16 {
                    counters.disconnect();
                    state.set_transport(SourceState::Connecting);
                    // Drop the endpoint (libzmq may have abandoned it) and redial later.
                    let _ = sub.disconnect(peer);
                    redial_at = Some(Instant::now() + redial_delay);
                    info!(
                        peer,
                        redial_ms = redial_delay.as_millis() as u64,
                        "zmq publisher disconnected; redialling"
                    );
                    redial_delay = (redial_delay * 2).min(max_delay);
                    ReaderEvent::Disconnected
                } else {
                    continue;
                };
                if live.blocking_send(forwarded).is_err() {
                    return Ok(());
                }
            }
        }
        if !sub_ready {
            continue;
        }
        for _ in 0..MAX_MESSAGES_PER_WAKE {
            let Some(frames) = recv_frames(&sub, MAX_FRAMES)? else {
                break;
            };
            let parsed = match frames {
                Ok(frames) => parse_wire(params.wire, &frames, limits.max_payload_bytes),
                Err(n_frames) => Err(ZmqFrameError::FrameCount {
                    n_frames,
                    expected: "at most 4",
                }),
            };
            match parsed {
                Ok((seq, payload)) => {
                    redial_delay = initial_delay;
                    // Over the byte budget: dropped here, so neither this queue nor
                    // libzmq's (drained on) holds it; the driver sees a gap.
                    let len = payload.len();
                    let Some(payload) = params.budget.admit(payload) else {
                        counters.reject(RejectionKind::Overflow);
                        let reason = format!(
                            "message of {len} bytes dropped: {}",
                            params.budget.describe()
                        );
                        log_rejection(&mut rejections, RejectionKind::Overflow, peer, &reason);
                        continue;
                    };
                    if live
                        .blocking_send(ReaderEvent::Batch { seq, payload })
                        .is_err()
                    {
                        return Ok(());
                    }
                }
                Err(err) => {
                    counters.reject(RejectionKind::Framing);
                    log_rejection(&mut rejections, RejectionKind::Framing, peer, &err);
                }
            }
        }
    }
}

/// Splits a live message of `wire` into its sequence and what the driver decodes.
fn parse_wire(
    wire: ZmqWire,
    frames: &[Bytes],
    max_payload_bytes: usize,
) -> Result<(u64, Bytes), ZmqFrameError> {
    match wire {
        ZmqWire::Engine(_) => parse_live(frames, max_payload_bytes),
        ZmqWire::DynamoEventPlane { publisher_id } => {
            let message = parse_event_plane(frames, max_payload_bytes)?;
            if message.publisher_id != publisher_id {
                return Err(ZmqFrameError::ForeignPublisher {
                    expected: publisher_id,
                    got: message.publisher_id,
                });
            }
            Ok((message.sequence, message.frame))
        }
    }
}

/// What a replay exchange forwards to the driver.
#[derive(Debug)]
pub(crate) enum ReplayEvent {
    Batch {
        epoch: u64,
        seq: u64,
        payload: Metered,
    },
    End {
        epoch: u64,
    },
    Failed {
        epoch: u64,
    },
}

/// Why a replay exchange did not end with the end marker.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ReplayError {
    #[error("zmq: {0}")]
    Zmq(#[from] zmq::Error),
    #[error("timed out")]
    TimedOut,
    #[error("cancelled")]
    Cancelled,
    #[error("driver stopped")]
    DriverGone,
}

/// Which replay to ask for, and of whom.
#[derive(Debug, Clone)]
pub(crate) struct ReplayJob {
    /// The engine's ROUTER replay endpoint.
    pub(crate) endpoint: String,
    /// The first sequence wanted.
    pub(crate) from_seq: u64,
    /// The tracker's replay epoch the replies belong to.
    pub(crate) epoch: u64,
}

/// One replay exchange: asks `endpoint` for every batch from `from_seq` and forwards the
/// replies until the end marker, within `limits.replay_timeout_ms`.
pub(crate) fn run_replay(
    job: &ReplayJob,
    limits: &Limits,
    budget: &ByteBudget,
    tx: &mpsc::Sender<ReplayEvent>,
    counters: &Counters,
    cancel: &CancellationToken,
) -> Result<(), ReplayError> {
    let (endpoint, from_seq, epoch) = (job.endpoint.as_str(), job.from_seq, job.epoch);
    if !endpoint_is_valid(endpoint) {
        return Err(ReplayError::Zmq(zmq::Error::EINVAL));
    }
    let deadline = Instant::now() + Duration::from_millis(limits.replay_timeout_ms);
    let dealer = context().socket(zmq::DEALER)?;
    configure(&dealer, limits)?;
    dealer.connect(endpoint)?;
    let [delimiter, start] = replay_request(from_seq);
    dealer.send(&delimiter[..], zmq::SNDMORE)?;
    dealer.send(&start[..], 0)?;
    let mut rejections = RejectionLog::new(Duration::from_millis(limits.log_interval_ms));
    loop {
        if cancel.is_cancelled() {
            return Err(ReplayError::Cancelled);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(ReplayError::TimedOut);
        }
        let wait = deadline
            .saturating_duration_since(now)
            .as_millis()
            .min(POLL_INTERVAL_MS as u128);
        if dealer.poll(zmq::POLLIN, wait as i64)? == 0 {
            continue;
        }
        while let Some(frames) = recv_frames(&dealer, MAX_REPLAY_FRAMES)? {
            let parsed = match frames {
                Ok(frames) => parse_replay(&frames, limits.max_payload_bytes),
                Err(n_frames) => Err(ZmqFrameError::FrameCount {
                    n_frames,
                    expected: "2 to 4",
                }),
            };
            match parsed {
                Ok(ReplayReply::End) => return Ok(()),
                Ok(ReplayReply::Batch { seq, payload }) => {
                    let len = payload.len();
                    let Some(payload) = budget.admit(payload) else {
                        // The replay comes back incomplete; the tracker decides (a reset).
                        counters.reject(RejectionKind::Overflow);
                        let reason = format!(
                            "replayed message of {len} bytes dropped: {}",
                            budget.describe()
                        );
                        log_rejection(&mut rejections, RejectionKind::Overflow, endpoint, &reason);
                        continue;
                    };
                    tx.blocking_send(ReplayEvent::Batch {
                        epoch,
                        seq,
                        payload,
                    })
                    .map_err(|_| ReplayError::DriverGone)?;
                }
                Err(err) => {
                    counters.reject(RejectionKind::Framing);
                    log_rejection(&mut rejections, RejectionKind::Framing, endpoint, &err);
                }
            }
        }
        debug!(peer = endpoint, "zmq replay waiting for more replies");
    }
}
