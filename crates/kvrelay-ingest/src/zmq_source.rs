//! vLLM / SGLang over ZMQ (libzmq): a SUB on the engine's PUB endpoint, and DEALER replays
//! from its ROUTER replay endpoint, driven by the pure [`SequenceTracker`]. The same source
//! reads a Dynamo worker's event plane ([`ZmqWire::DynamoEventPlane`]): the publisher's
//! sequence drives the same tracker (Dynamo publishers keep no replay buffer), and the
//! events arrive already hashed.
//!
//! Tasks (all on the handle's tracker, under its cancellation token):
//! - the **supervisor** runs the blocking libzmq reader ([`crate::zmq_transport`]) on a
//!   blocking thread and restarts it with backoff when it fails or panics (counted in
//!   `n_restarts`, state `failed` meanwhile);
//! - the **driver** feeds the tracker with live batches, replay replies, connection
//!   events and idle ticks, and drains its actions: decode + canonicalize + emit, request
//!   a replay, or reset (clear) the source;
//! - one **replay** task per replay request, bounded by `replay_timeout_ms`.
//!
//! Only the ranks the source declares are accepted; a reset clears the ranks seen since
//! the previous reset, once. Rejections are counted per kind and logged rate-limited.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvrelay_ckf::SourceId;
use kvrelay_pacing::{Backoff, NO_JITTER};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use crate::canonical::Canonicalizer;
use crate::engine_decoder::decode_engine_batch;
use crate::error::RejectionKind;
use crate::event_plane::{EventPlaneMessage, decode_event_plane_frame};
use crate::limits::Limits;
use crate::log_limit::RejectionLog;
use crate::metered::{ByteBudget, Metered};
use crate::sequence::{ResetReason, SequenceAction, SequenceConfig, SequenceTracker, batch_digest};
use crate::source::{
    SourceHandle, SourceOutput, SourceSignal, SourceState, StateCell, Transport, emit,
};
use crate::stats::{Counters, ReplayOutcome};
use crate::zmq_config::{ZmqSourceConfig, ZmqWire};
use crate::zmq_transport::{
    ReaderEvent, ReaderExit, ReaderParams, ReplayError, ReplayEvent, ReplayJob, run_reader,
    run_replay,
};

/// Starts a ZMQ source; must be called inside a tokio runtime.
pub fn spawn_zmq_source(config: ZmqSourceConfig) -> SourceHandle {
    let limits = config.limits;
    let counters = Counters::shared();
    let state = StateCell::new(SourceState::Connecting);
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let (out_tx, out_rx) = mpsc::channel(limits.output_queue_depth.max(1));
    let (live_tx, live_rx) = mpsc::channel(limits.live_queue_depth.max(1));
    let span = info_span!(
        "zmq_source",
        worker_id = config.worker_id,
        dp_rank = config.dp_rank
    );
    let shared = config.queue_budget.clone();
    let budget = ByteBudget::new(limits.max_queued_bytes, counters.clone(), shared);
    let params = ReaderParams {
        endpoint: config.endpoint.clone(),
        topic: config.topic.clone(),
        wire: config.wire,
        limits,
        budget: budget.clone(),
        fault: config.fault.clone(),
    };
    tracker.spawn(
        supervise_reader(
            params,
            live_tx,
            state.clone(),
            counters.clone(),
            cancel.child_token(),
        )
        .instrument(span.clone()),
    );
    let driver = Driver {
        budget,
        canonicalizer: Canonicalizer::new(config.worker_id, config.dp_rank, config.canonical),
        rejections: RejectionLog::new(Duration::from_millis(limits.log_interval_ms)),
        config,
        counters: counters.clone(),
        state: state.clone(),
        out: out_tx,
        cancel: cancel.child_token(),
        tracker: tracker.clone(),
        seen_sources: BTreeSet::new(),
        ever_reset: false,
        replay: None,
        applied_since_connect: false,
        batch_events: 0,
    };
    tracker.spawn(driver.run(live_rx).instrument(span));
    let probe = state.probe(Transport::Zmq, counters);
    SourceHandle::with_probe(
        out_rx,
        probe,
        cancel,
        tracker,
        Duration::from_millis(limits.shutdown_timeout_ms),
    )
}

/// Runs the blocking reader, restarting it with exponential backoff whenever it fails
/// or panics, until cancelled or the driver is gone.
async fn supervise_reader(
    params: ReaderParams,
    live: mpsc::Sender<ReaderEvent>,
    state: StateCell,
    counters: Arc<Counters>,
    cancel: CancellationToken,
) {
    let mut backoff = Backoff::new(params.limits.restart_backoff());
    loop {
        let started = Instant::now();
        let run = {
            let (params, live, state, counters, cancel) = (
                params.clone(),
                live.clone(),
                state.clone(),
                counters.clone(),
                cancel.clone(),
            );
            tokio::task::spawn_blocking(move || {
                run_reader(&params, &live, &state, &counters, &cancel)
            })
        };
        // The reader checks cancellation between polls, so awaiting it is bounded.
        let failure = match run.await {
            Ok(ReaderExit::Stopped) => return,
            Ok(ReaderExit::Failed(err)) => err.to_string(),
            Err(join) if join.is_panic() => "reader panicked".to_owned(),
            Err(_cancelled) => return,
        };
        if cancel.is_cancelled() || live.is_closed() {
            return;
        }
        counters.restart();
        state.set_transport(SourceState::Failed);
        // A reader that ran for longer than the longest sleep starts the backoff over.
        let delay = backoff.on_failure(started.elapsed(), NO_JITTER);
        warn!(peer = %params.endpoint, error = %failure, backoff_ms = delay.as_millis() as u64, "zmq reader failed; restarting");
        if live.send(ReaderEvent::Disconnected).await.is_err() {
            return;
        }
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
    }
}

/// The replay in flight, for counting its outcome.
#[derive(Debug, Clone, Copy)]
struct ReplayInFlight {
    epoch: u64,
    n_batches: u64,
    incomplete: bool,
}

struct Driver {
    config: ZmqSourceConfig,
    /// What the source's messages may hold; replays take from it too.
    budget: ByteBudget,
    canonicalizer: Canonicalizer,
    rejections: RejectionLog,
    counters: Arc<Counters>,
    state: StateCell,
    out: mpsc::Sender<SourceOutput>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    /// The declared `(worker, rank)`s reported since the last reset; a reset clears them
    /// once. Bounded by `declared_ranks`.
    seen_sources: BTreeSet<SourceId>,
    ever_reset: bool,
    replay: Option<ReplayInFlight>,
    /// Whether a batch was applied since the publisher last connected (a disconnect
    /// after batches may have lost a tail).
    applied_since_connect: bool,
    /// Events the batch being applied has yielded so far.
    batch_events: usize,
}

impl Driver {
    async fn run(mut self, mut live: mpsc::Receiver<ReaderEvent>) {
        let sequence_config = SequenceConfig {
            replay_available: self.config.replay_endpoint.is_some(),
            max_buffered: self.config.limits.max_buffered_during_replay,
        };
        let mut sequence = match self.config.resume_after {
            Some(point) => {
                // What was restored belongs to the default source: a reset clears it.
                self.seen_sources
                    .insert(self.canonicalizer.default_source());
                info!(
                    last_applied = point.last_applied,
                    "zmq source resuming after a checkpoint"
                );
                SequenceTracker::resumed(sequence_config, point.last_applied)
            }
            None => SequenceTracker::new(sequence_config),
        };
        // The resume replay's first answer is compared with the checkpoint's batch.
        let mut verify = self.config.resume_after.zip(sequence.replay_epoch());
        let (replay_tx, mut replay_rx) = mpsc::channel(self.config.limits.live_queue_depth.max(1));
        while let Some(action) = sequence.poll_action() {
            if !self.act(action, &replay_tx).await {
                return;
            }
        }
        self.state.follow(&sequence);
        let probe_idle = Duration::from_millis(self.config.limits.tail_probe_idle_ms.max(1));
        // Armed by each live batch (a tail probe) and by a connect before any batch (a join
        // probe); fires after `probe_idle` of silence.
        let mut probe_at: Option<tokio::time::Instant> = None;
        // Whether the publisher disconnected since it last connected.
        let mut lost = false;
        loop {
            let probe_sleep = async {
                match probe_at {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => return,
                Some(event) = replay_rx.recv() => match event {
                    ReplayEvent::Batch { epoch, seq, payload } => {
                        self.counters.message();
                        if let Some(replay) = self.replay.as_mut().filter(|r| r.epoch == epoch) {
                            replay.n_batches += 1;
                        }
                        // The resume replay's first batch: the checkpointed one, or the
                        // engine is another (a later one is the tracker's to judge).
                        let mismatch = match verify.take() {
                            Some((point, at)) if at == epoch => point.contradicted_by(seq, payload.bytes()).then_some(point),
                            other => { verify = other; None }
                        };
                        if let Some(point) = mismatch {
                            if !self.resume_mismatch(&mut sequence, point.last_applied, &mut probe_at).await {
                                return;
                            }
                            continue;
                        }
                        sequence.handle_replay(epoch, seq, payload);
                    }
                    ReplayEvent::End { epoch } => {
                        // Nothing from the checkpointed batch on: another engine answers.
                        if let Some((point, _)) = verify.take_if(|(_, at)| *at == epoch) {
                            self.finish_replay(epoch, false);
                            if !self.resume_mismatch(&mut sequence, point.last_applied, &mut probe_at).await {
                                return;
                            }
                            continue;
                        }
                        sequence.handle_replay_end(epoch);
                        self.finish_replay(epoch, false);
                    }
                    ReplayEvent::Failed { epoch } => {
                        sequence.handle_replay_failed(epoch);
                        self.finish_replay(epoch, true);
                    }
                },
                received = live.recv() => match received {
                    None => return,
                    Some(ReaderEvent::Connected) => {
                        self.applied_since_connect = false;
                        if std::mem::take(&mut lost) {
                            sequence.handle_reconnected();
                        }
                        if self.config.replay_endpoint.is_some() && sequence.next_seq().is_none() {
                            probe_at = Some(tokio::time::Instant::now() + probe_idle);
                        }
                        let signal = SourceSignal::Connected { endpoint: self.config.endpoint.clone() };
                        if !emit(&self.out, &self.cancel, SourceOutput::Signal(signal)).await {
                            return;
                        }
                    }
                    Some(ReaderEvent::Disconnected) => {
                        probe_at = None;
                        lost = true;
                        // The publisher may have closed with batches still queued on its
                        // side: probe its replay socket now, or count the unknown tail.
                        if !sequence.handle_idle() && self.applied_since_connect {
                            self.counters.unverified_tail();
                        }
                        self.applied_since_connect = false;
                        let signal = SourceSignal::Lost { endpoint: self.config.endpoint.clone() };
                        if !emit(&self.out, &self.cancel, SourceOutput::Signal(signal)).await {
                            return;
                        }
                    }
                    Some(ReaderEvent::Batch { seq, payload }) => {
                        self.counters.message();
                        self.applied_since_connect = true;
                        probe_at = Some(tokio::time::Instant::now() + probe_idle);
                        sequence.handle_live(seq, payload);
                    }
                },
                () = probe_sleep => {
                    probe_at = None;
                    if sequence.next_seq().is_none() {
                        sequence.handle_quiet_join();
                    } else {
                        sequence.handle_idle();
                    }
                }
            }
            while let Some(action) = sequence.poll_action() {
                if !self.act(action, &replay_tx).await {
                    return;
                }
            }
            self.state.follow(&sequence);
        }
    }

    /// Counts how the replay of `epoch` ended (stale epochs are ignored).
    fn finish_replay(&mut self, epoch: u64, failed: bool) {
        let Some(replay) = self.replay.filter(|r| r.epoch == epoch) else {
            return;
        };
        self.replay = None;
        let outcome = if failed {
            ReplayOutcome::Failed
        } else if replay.incomplete {
            ReplayOutcome::Incomplete
        } else if replay.n_batches > 0 {
            ReplayOutcome::Recovered
        } else {
            ReplayOutcome::Empty
        };
        self.counters.replay_outcome(outcome);
        info!(
            outcome = outcome.as_str(),
            n_batches = replay.n_batches,
            "zmq replay ended"
        );
    }

    /// Carries out one tracker action; `false` when the source must stop.
    async fn act(
        &mut self,
        action: SequenceAction<Metered>,
        replay_tx: &mpsc::Sender<ReplayEvent>,
    ) -> bool {
        match action {
            SequenceAction::Apply { seq, payload } => {
                self.batch_events = 0;
                // A batch that yielded nothing (rejected, filtered, empty) is not reported:
                // a resume replays it again, harmlessly, and nobody drains a marker per
                // rejected message.
                if !self.apply(seq, &payload).await {
                    return false;
                }
                self.batch_events == 0 || {
                    let digest = batch_digest(payload.bytes());
                    emit(
                        &self.out,
                        &self.cancel,
                        SourceOutput::Applied { seq, digest },
                    )
                    .await
                }
            }
            SequenceAction::Gap { expected, got } => {
                self.counters.gap();
                info!(seq = got, expected, "zmq sequence gap");
                emit(
                    &self.out,
                    &self.cancel,
                    SourceOutput::Signal(SourceSignal::Gap { expected, got }),
                )
                .await
            }
            SequenceAction::RequestReplay { from_seq, epoch } => {
                self.counters.replay();
                if let Some(stale) = self.replay.take() {
                    // A newer replay supersedes one still running.
                    self.replay = Some(stale);
                    self.finish_replay(stale.epoch, true);
                }
                if let Some(endpoint) = self.config.replay_endpoint.clone() {
                    info!(seq = from_seq, "zmq replay started");
                    self.replay = Some(ReplayInFlight {
                        epoch,
                        n_batches: 0,
                        incomplete: false,
                    });
                    let span = info_span!("zmq_replay", seq = from_seq);
                    self.tracker.spawn(
                        replay(
                            ReplayJob {
                                endpoint,
                                from_seq,
                                epoch,
                            },
                            self.config.limits,
                            self.budget.clone(),
                            replay_tx.clone(),
                            self.counters.clone(),
                            self.cancel.child_token(),
                        )
                        .instrument(span),
                    );
                }
                true
            }
            SequenceAction::Reset(reason) => self.reset(reason).await,
            SequenceAction::LateCopy { seq } => {
                self.counters.late_copy();
                tracing::debug!(seq, "zmq late live copy of a replayed batch dropped");
                true
            }
        }
    }

    /// The engine answering the resume replay is not the one the checkpoint followed:
    /// reset the source (clearing what was restored) and start over as a join, probing
    /// its replay from 0 after the usual quiet.
    async fn resume_mismatch(
        &mut self,
        sequence: &mut SequenceTracker<Metered>,
        seq: u64,
        probe_at: &mut Option<tokio::time::Instant>,
    ) -> bool {
        sequence.forget();
        self.replay = None;
        self.state.follow(sequence);
        let idle = Duration::from_millis(self.config.limits.tail_probe_idle_ms.max(1));
        *probe_at = Some(tokio::time::Instant::now() + idle);
        self.reset(ResetReason::ResumeMismatch { seq }).await
    }

    async fn reset(&mut self, reason: ResetReason) -> bool {
        self.counters.reset(&reason);
        if matches!(reason, ResetReason::ReplayIncomplete { .. })
            && let Some(replay) = self.replay.as_mut()
        {
            replay.incomplete = true;
        }
        warn!(reason = reason.as_str(), "zmq source reset");
        self.canonicalizer.reset();
        // Clear what this incarnation reported, once; before any batch, the first reset
        // still clears the default rank (state a previous relay run may have left).
        let mut sources = std::mem::take(&mut self.seen_sources);
        if sources.is_empty() && !self.ever_reset {
            sources.insert(self.canonicalizer.default_source());
        }
        self.ever_reset = true;
        let sources: Vec<SourceId> = sources.into_iter().collect();
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

    fn reject(&mut self, kind: RejectionKind, seq: u64, error: &dyn std::fmt::Display) {
        self.counters.reject(kind);
        if let Some(count) = self.rejections.note(kind, Instant::now()) {
            warn!(seq, reason = kind.as_str(), count, error = %error, "rejected engine input");
        }
    }

    /// Why `source` may not publish here: a rank outside the declared ones.
    fn undeclared_rank(&self, source: SourceId) -> Option<String> {
        let declared = &self.config.declared_ranks;
        (!declared.contains(&source.dp_rank)).then(|| {
            format!(
                "dp_rank {} outside the declared ranks {}..{}",
                source.dp_rank, declared.start, declared.end
            )
        })
    }

    async fn apply(&mut self, seq: u64, payload: &Metered) -> bool {
        let payload = payload.bytes();
        let engine = match self.config.wire {
            ZmqWire::Engine(engine) => engine,
            ZmqWire::DynamoEventPlane { publisher_id } => {
                let message = EventPlaneMessage {
                    publisher_id,
                    sequence: seq,
                    frame: payload.clone(),
                };
                return self.apply_event_plane(&message).await;
            }
        };
        let batch = match decode_engine_batch(payload, engine, &self.config.limits) {
            Ok(batch) => batch,
            Err(err) => {
                self.reject(err.rejection_kind(), seq, &err);
                return true;
            }
        };
        let source = self.canonicalizer.source_of(&batch);
        if let Some(reason) = self.undeclared_rank(source) {
            self.reject(RejectionKind::UndeclaredRank, seq, &reason);
            return true;
        }
        self.seen_sources.insert(source);
        let mut events = Vec::with_capacity(batch.events.len());
        let outcome = self.canonicalizer.canonicalize(&batch, &mut events);
        self.counters.filtered(outcome.n_filtered);
        for err in &outcome.rejected {
            self.reject(RejectionKind::Canonicalize, seq, err);
        }
        self.counters.events(events.len());
        for event in events {
            self.batch_events += 1;
            if !emit(&self.out, &self.cancel, event.into()).await {
                return false;
            }
        }
        true
    }
}

impl Driver {
    /// Applies one event-plane message: every event must belong to the advertised worker
    /// and a declared rank, or the whole message is rejected (nothing of it applied).
    async fn apply_event_plane(&mut self, message: &EventPlaneMessage) -> bool {
        let seq = message.sequence;
        let lower_tiers = self.config.canonical.lower_tiers;
        let decoded = match decode_event_plane_frame(message, &self.config.limits, lower_tiers) {
            Ok(decoded) => decoded,
            Err(err) => {
                self.reject(err.rejection_kind(), seq, &err);
                return true;
            }
        };

        if let Some(foreign) = decoded
            .events
            .iter()
            .find(|event| event.source().worker_id != self.config.worker_id)
        {
            let reason = format!(
                "worker {} on the publisher advertised for worker {}",
                foreign.source().worker_id,
                self.config.worker_id
            );
            self.reject(RejectionKind::UndeclaredWorker, seq, &reason);
            return true;
        }
        let undeclared = decoded
            .events
            .iter()
            .find_map(|event| self.undeclared_rank(event.source()));
        if let Some(reason) = undeclared {
            self.reject(RejectionKind::UndeclaredRank, seq, &reason);
            return true;
        }
        self.counters.filtered(decoded.n_filtered);
        self.counters.events(decoded.events.len());
        for event in decoded.events {
            self.seen_sources.insert(event.source());
            self.batch_events += 1;
            if !emit(&self.out, &self.cancel, event.into()).await {
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
    job: ReplayJob,
    limits: Limits,
    budget: ByteBudget,
    tx: mpsc::Sender<ReplayEvent>,
    counters: Arc<Counters>,
    cancel: CancellationToken,
) {
    let (endpoint, epoch) = (job.endpoint.clone(), job.epoch);
    let mut guard = ReplayGuard {
        epoch,
        tx: tx.clone(),
        finished: false,
    };
    let exchange = {
        let (tx, cancel) = (tx.clone(), cancel.clone());
        tokio::task::spawn_blocking(move || {
            run_replay(&job, &limits, &budget, &tx, &counters, &cancel)
        })
    };
    match exchange.await {
        Ok(Ok(())) => {
            guard.finished = true;
            let _ = tx.send(ReplayEvent::End { epoch }).await;
        }
        Ok(Err(ReplayError::Cancelled | ReplayError::DriverGone)) => {}
        Ok(Err(err)) => warn!(peer = %endpoint, error = %err, "zmq replay failed"),
        Err(join) => warn!(peer = %endpoint, error = %join, "zmq replay task failed"),
    }
}
