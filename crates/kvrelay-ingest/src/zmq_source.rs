//! vLLM / SGLang over ZMQ: a SUB on the engine's PUB endpoint, and DEALER replays from its
//! ROUTER replay endpoint, driven by the pure [`SequenceTracker`].
//!
//! Tasks (all on the handle's tracker, under its cancellation token):
//! - the **reader** owns the SUB socket, reconnects after `idle_reconnect_ms` of silence,
//!   and forwards parsed `(seq, payload)` into a bounded queue;
//! - the **driver** feeds the tracker with live batches and replay replies, and drains its
//!   actions: decode + canonicalize + emit, request a replay, or reset (clear) the source;
//! - one **replay** task per replay request, bounded by `replay_timeout_ms`.
//!
//! The driver's loop is one biased `select!`: cancellation, then replay replies, then
//! live batches. Both queues are tokio mpsc receivers (cancel-safe).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvrelay_ckf::SourceId;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, debug, info, info_span, warn};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::canonical::{CanonicalConfig, Canonicalizer};
use crate::engine::EngineKind;
use crate::engine_decoder::decode_engine_batch;
use crate::error::RejectionKind;
use crate::limits::Limits;
use crate::sequence::{SequenceAction, SequenceConfig, SequenceTracker};
use crate::source::{SourceHandle, SourceOutput, SourceSignal, emit};
use crate::stats::Counters;
use crate::zmq_frames::{ReplayReply, parse_live, parse_replay, replay_request};

/// Where and how to subscribe to one engine publisher (one DP rank's PUB socket).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ZmqSourceConfig {
    /// The worker the publisher belongs to.
    pub worker_id: u64,
    /// The rank used when a batch names none.
    pub dp_rank: u32,
    /// vLLM or SGLang (positional layouts differ).
    pub engine: EngineKind,
    /// The PUB endpoint to connect to, e.g. `tcp://10.0.0.5:5557`.
    pub endpoint: String,
    /// The ROUTER replay endpoint, if the engine has one, e.g. `tcp://10.0.0.5:5558`.
    pub replay_endpoint: Option<String>,
    /// The subscription topic prefix (`""` for all).
    pub topic: String,
    /// The pool's hashing rules.
    pub canonical: CanonicalConfig,
    /// Bounds and timeouts.
    pub limits: Limits,
}

/// Starts a ZMQ source; must be called inside a tokio runtime.
pub fn spawn_zmq_source(config: ZmqSourceConfig) -> SourceHandle {
    let limits = config.limits;
    let counters = Counters::shared();
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let (out_tx, out_rx) = mpsc::channel(limits.output_queue_depth.max(1));
    let (live_tx, live_rx) = mpsc::channel(limits.live_queue_depth.max(1));
    let span = info_span!(
        "zmq_source",
        worker_id = config.worker_id,
        dp_rank = config.dp_rank
    );
    tracker.spawn(
        reader(
            config.endpoint.clone(),
            config.topic.clone(),
            limits,
            live_tx,
            counters.clone(),
            cancel.child_token(),
        )
        .instrument(span.clone()),
    );
    let driver = Driver {
        canonicalizer: Canonicalizer::new(config.worker_id, config.dp_rank, config.canonical),
        config,
        counters: counters.clone(),
        out: out_tx,
        cancel: cancel.child_token(),
        tracker: tracker.clone(),
        seen_sources: BTreeSet::new(),
    };
    tracker.spawn(driver.run(live_rx).instrument(span));
    SourceHandle::new(
        out_rx,
        counters,
        cancel,
        tracker,
        Duration::from_millis(limits.shutdown_timeout_ms),
    )
}

/// What the reader forwards to the driver.
#[derive(Debug)]
enum ReaderEvent {
    Connected,
    Batch { seq: u64, payload: Bytes },
}

/// What a replay task forwards to the driver.
#[derive(Debug)]
enum ReplayEvent {
    Batch {
        epoch: u64,
        seq: u64,
        payload: Bytes,
    },
    End {
        epoch: u64,
    },
    Failed {
        epoch: u64,
    },
}

async fn reader(
    endpoint: String,
    topic: String,
    limits: Limits,
    live: mpsc::Sender<ReaderEvent>,
    counters: Arc<Counters>,
    cancel: CancellationToken,
) {
    let idle = Duration::from_millis(limits.idle_reconnect_ms.max(1));
    'reconnect: loop {
        let mut socket = SubSocket::new();
        let connected = tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            result = socket.connect(&endpoint) => result,
        };
        if let Err(err) = connected {
            warn!(peer = %endpoint, error = %err, "zmq connect failed");
            tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(idle) => continue 'reconnect,
            }
        }
        if let Err(err) = socket.subscribe(&topic).await {
            warn!(peer = %endpoint, error = %err, "zmq subscribe failed");
            continue 'reconnect;
        }
        info!(peer = %endpoint, "zmq subscriber connected");
        if live.send(ReaderEvent::Connected).await.is_err() {
            return;
        }
        loop {
            // `recv` only removes a message when it returns it, so dropping it on
            // cancellation or timeout loses nothing.
            let message = tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                received = tokio::time::timeout(idle, socket.recv()) => received,
            };
            let message = match message {
                Err(_elapsed) => {
                    debug!(peer = %endpoint, "zmq subscriber idle; reconnecting");
                    continue 'reconnect;
                }
                Ok(Err(err)) => {
                    warn!(peer = %endpoint, error = %err, "zmq receive failed; reconnecting");
                    continue 'reconnect;
                }
                Ok(Ok(message)) => message,
            };
            let frames = message.into_vec();
            match parse_live(&frames, limits.max_payload_bytes) {
                Ok((seq, payload)) => {
                    if live
                        .send(ReaderEvent::Batch { seq, payload })
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                Err(err) => {
                    counters.reject(RejectionKind::Framing);
                    warn!(peer = %endpoint, error = %err, "rejected zmq message");
                }
            }
        }
    }
}

struct Driver {
    config: ZmqSourceConfig,
    canonicalizer: Canonicalizer,
    counters: Arc<Counters>,
    out: mpsc::Sender<SourceOutput>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    /// Every `(worker, rank)` this publisher has reported; a reset clears them all.
    /// Bounded by the ranks one publisher can name (u32), in practice one or a few.
    seen_sources: BTreeSet<SourceId>,
}

impl Driver {
    async fn run(mut self, mut live: mpsc::Receiver<ReaderEvent>) {
        let mut sequence = SequenceTracker::new(SequenceConfig {
            replay_available: self.config.replay_endpoint.is_some(),
            max_buffered: self.config.limits.max_buffered_during_replay,
        });
        let (replay_tx, mut replay_rx) = mpsc::channel(self.config.limits.live_queue_depth.max(1));
        loop {
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => return,
                Some(event) = replay_rx.recv() => match event {
                    ReplayEvent::Batch { epoch, seq, payload } => {
                        self.counters.message();
                        sequence.handle_replay(epoch, seq, payload);
                    }
                    ReplayEvent::End { epoch } => sequence.handle_replay_end(epoch),
                    ReplayEvent::Failed { epoch } => sequence.handle_replay_failed(epoch),
                },
                received = live.recv() => match received {
                    None => return,
                    Some(ReaderEvent::Connected) => {
                        let signal = SourceSignal::Connected { endpoint: self.config.endpoint.clone() };
                        if !emit(&self.out, &self.cancel, SourceOutput::Signal(signal)).await {
                            return;
                        }
                    }
                    Some(ReaderEvent::Batch { seq, payload }) => {
                        self.counters.message();
                        sequence.handle_live(seq, payload);
                    }
                },
            }
            while let Some(action) = sequence.poll_action() {
                if !self.act(action, &replay_tx).await {
                    return;
                }
            }
        }
    }

    /// Carries out one tracker action; `false` when the source must stop.
    async fn act(
        &mut self,
        action: SequenceAction<Bytes>,
        replay_tx: &mpsc::Sender<ReplayEvent>,
    ) -> bool {
        match action {
            SequenceAction::Apply { seq, payload } => self.apply(seq, &payload).await,
            SequenceAction::Gap { expected, got } => {
                self.counters.gap();
                warn!(seq = got, expected, "zmq sequence gap");
                emit(
                    &self.out,
                    &self.cancel,
                    SourceOutput::Signal(SourceSignal::Gap { expected, got }),
                )
                .await
            }
            SequenceAction::RequestReplay { from_seq, epoch } => {
                self.counters.replay();
                if let Some(endpoint) = self.config.replay_endpoint.clone() {
                    let span = info_span!("zmq_replay", seq = from_seq);
                    self.tracker.spawn(
                        replay(
                            endpoint,
                            from_seq,
                            epoch,
                            self.config.limits,
                            replay_tx.clone(),
                            self.counters.clone(),
                            self.cancel.child_token(),
                        )
                        .instrument(span),
                    );
                }
                true
            }
            SequenceAction::Reset(reason) => {
                self.counters.reset();
                warn!(reason = reason.as_str(), "zmq source reset");
                self.canonicalizer.reset();
                if self.seen_sources.is_empty() {
                    self.seen_sources
                        .insert(self.canonicalizer.default_source());
                }
                let sources: Vec<SourceId> = self.seen_sources.iter().copied().collect();
                let signal = SourceSignal::Reset {
                    sources: sources.clone(),
                    reason,
                };
                if !emit(&self.out, &self.cancel, SourceOutput::Signal(signal)).await {
                    return false;
                }
                for source in sources {
                    let clear = self.canonicalizer.clear_event(source);
                    self.counters.events(1);
                    if !emit(&self.out, &self.cancel, SourceOutput::Event(clear)).await {
                        return false;
                    }
                }
                true
            }
        }
    }

    async fn apply(&mut self, seq: u64, payload: &[u8]) -> bool {
        let batch = match decode_engine_batch(payload, self.config.engine, &self.config.limits) {
            Ok(batch) => batch,
            Err(err) => {
                self.counters.reject(err.rejection_kind());
                warn!(seq, error = %err, "rejected engine batch");
                return true;
            }
        };
        self.seen_sources
            .insert(self.canonicalizer.source_of(&batch));
        let mut events = Vec::with_capacity(batch.events.len());
        let outcome = self.canonicalizer.canonicalize(&batch, &mut events);
        self.counters.filtered(outcome.n_filtered);
        for err in &outcome.rejected {
            self.counters.reject(RejectionKind::Canonicalize);
            warn!(seq, error = %err, "rejected engine event");
        }
        self.counters.events(events.len());
        for event in events {
            if !emit(&self.out, &self.cancel, SourceOutput::Event(event)).await {
                return false;
            }
        }
        true
    }
}

/// Sends `Failed` for its epoch when dropped unfinished (including by a panic inside the
/// transport), so the tracker never waits for a replay that will not end.
struct ReplayGuard {
    epoch: u64,
    tx: mpsc::Sender<ReplayEvent>,
    finished: bool,
}

impl Drop for ReplayGuard {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.tx.try_send(ReplayEvent::Failed { epoch: self.epoch });
        }
    }
}

async fn replay(
    endpoint: String,
    from_seq: u64,
    epoch: u64,
    limits: Limits,
    tx: mpsc::Sender<ReplayEvent>,
    counters: Arc<Counters>,
    cancel: CancellationToken,
) {
    let mut guard = ReplayGuard {
        epoch,
        tx: tx.clone(),
        finished: false,
    };
    let deadline = Duration::from_millis(limits.replay_timeout_ms);
    let run = replay_exchange(&endpoint, from_seq, epoch, limits, &tx, &counters);
    let outcome = tokio::select! {
        biased;
        () = cancel.cancelled() => return,
        outcome = tokio::time::timeout(deadline, run) => outcome,
    };
    match outcome {
        Ok(Ok(())) => {
            guard.finished = true;
            let _ = tx.send(ReplayEvent::End { epoch }).await;
        }
        Ok(Err(reason)) => warn!(peer = %endpoint, reason, "zmq replay failed"),
        Err(_elapsed) => warn!(peer = %endpoint, "zmq replay timed out"),
    }
}

async fn replay_exchange(
    endpoint: &str,
    from_seq: u64,
    epoch: u64,
    limits: Limits,
    tx: &mpsc::Sender<ReplayEvent>,
    counters: &Counters,
) -> Result<(), String> {
    let mut socket = DealerSocket::new();
    socket
        .connect(endpoint)
        .await
        .map_err(|err| err.to_string())?;
    let request =
        ZmqMessage::try_from(replay_request(from_seq).to_vec()).map_err(|err| err.to_string())?;
    socket.send(request).await.map_err(|err| err.to_string())?;
    loop {
        let message = socket.recv().await.map_err(|err| err.to_string())?;
        match parse_replay(&message.into_vec(), limits.max_payload_bytes) {
            Ok(ReplayReply::End) => return Ok(()),
            Ok(ReplayReply::Batch { seq, payload }) => {
                tx.send(ReplayEvent::Batch {
                    epoch,
                    seq,
                    payload,
                })
                .await
                .map_err(|_| "driver stopped".to_owned())?;
            }
            Err(err) => {
                counters.reject(RejectionKind::Framing);
                warn!(peer = %endpoint, error = %err, "rejected zmq replay reply");
            }
        }
    }
}
