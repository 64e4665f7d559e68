//! The source abstraction: what every source yields, the handle that owns its tasks, and
//! the probe that reports its real state and counters to whoever watches it.

use std::sync::Arc;
use std::time::Duration;

use kvrelay_ckf::{RouterEvent, SourceId, TierEvent};

use crate::canonical::CanonicalEvent;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::sequence::ResetReason;
use crate::stats::{Counters, SourceStats};

/// One item a source yields, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceOutput {
    /// A canonical router event (device memory).
    Event(RouterEvent),
    /// An event about a lower tier (host memory, disk), in order with the device events;
    /// yielded only by sources whose `CanonicalConfig::lower_tiers` is set.
    Tier(TierEvent),
    /// A lifecycle signal.
    Signal(SourceSignal),
    /// Every event of the engine batch `seq` has been yielded (this follows them; sent
    /// for batches that yielded events). An owner that has applied everything before this
    /// item can resume the source after `seq` ([`crate::ZmqSourceConfig::resume_after`]).
    /// ZMQ sources only.
    Applied {
        /// The batch's sequence.
        seq: u64,
        /// XXH3-64 of the batch's payload ([`crate::batch_digest`]): a resume compares
        /// the engine's replay of this batch with it.
        digest: u64,
    },
}

impl From<CanonicalEvent> for SourceOutput {
    fn from(event: CanonicalEvent) -> Self {
        match event {
            CanonicalEvent::Device(event) => SourceOutput::Event(event),
            CanonicalEvent::Tier(event) => SourceOutput::Tier(event),
        }
    }
}

/// Source lifecycle signals.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceSignal {
    /// The transport connected (or reconnected) to `endpoint`.
    Connected {
        /// The endpoint or server.
        endpoint: String,
    },
    /// A sequence gap was detected; a replay or a reset follows.
    Gap {
        /// The first missing sequence.
        expected: u64,
        /// The sequence received.
        got: u64,
    },
    /// The source was reset: an `AllCleared` event for each of its sources follows.
    Reset {
        /// The sources being cleared.
        sources: Vec<SourceId>,
        /// Why.
        reason: ResetReason,
    },
    /// The transport was lost; the source keeps trying to reconnect.
    Lost {
        /// The endpoint or server.
        endpoint: String,
    },
}

/// What a source's transport is doing now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SourceState {
    /// Dialling, or redialling after the connection was lost; no publisher is connected.
    Connecting,
    /// A publisher is connected (its handshake completed) and batches flow in order.
    Connected,
    /// Connected, and a replay is filling a gap or probing a tail.
    Replaying,
    /// The reader failed or panicked; it is restarted after a backoff.
    Failed,
    /// Connected, and the engine's history is still being recovered: its replay from
    /// the start (joining a running engine, resuming a checkpoint, following a restarted
    /// engine) has not ended, or an engine that has published nothing yet has not been
    /// probed. Only sources with a replay endpoint join; what their pool holds for them
    /// is incomplete until they have.
    Joining,
}

impl SourceState {
    /// Every state, in label order.
    pub const ALL: [SourceState; 5] = [
        SourceState::Connecting,
        SourceState::Connected,
        SourceState::Replaying,
        SourceState::Failed,
        SourceState::Joining,
    ];

    /// A stable lowercase name (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            SourceState::Connecting => "connecting",
            SourceState::Connected => "connected",
            SourceState::Replaying => "replaying",
            SourceState::Failed => "failed",
            SourceState::Joining => "joining",
        }
    }

    /// Whether the source currently delivers current state (connected, not replaying).
    pub fn is_current(self) -> bool {
        self == SourceState::Connected
    }

    /// Whether events flow (a replaying or joining source is connected and catching up):
    /// what a pool's readiness asks of its sources.
    pub fn delivers(self) -> bool {
        matches!(
            self,
            SourceState::Connected | SourceState::Replaying | SourceState::Joining
        )
    }
}

/// Which transport a source uses (the `transport` metric label).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Transport {
    /// vLLM / SGLang over ZMQ.
    Zmq,
    /// Dynamo over NATS.
    Nats,
    /// An in-process trace.
    Trace,
}

impl Transport {
    /// A stable lowercase name (metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Zmq => "zmq",
            Transport::Nats => "nats",
            Transport::Trace => "trace",
        }
    }
}

/// The parts a source's state is made of: the reader owns `transport`, the driver owns
/// `replaying` and `joining` (its sequence tracker's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StateParts {
    pub(crate) transport: SourceState,
    pub(crate) replaying: bool,
    pub(crate) joining: bool,
}

impl StateParts {
    fn state(self) -> SourceState {
        match self.transport {
            SourceState::Connected if self.joining => SourceState::Joining,
            SourceState::Connected if self.replaying => SourceState::Replaying,
            other => other,
        }
    }
}

/// The writer side of a source's state.
#[derive(Debug, Clone)]
pub(crate) struct StateCell {
    tx: Arc<watch::Sender<StateParts>>,
}

impl StateCell {
    pub(crate) fn new(initial: SourceState) -> Self {
        let (tx, _rx) = watch::channel(StateParts {
            transport: initial,
            replaying: false,
            joining: false,
        });
        Self { tx: Arc::new(tx) }
    }

    pub(crate) fn set_transport(&self, transport: SourceState) {
        self.tx.send_if_modified(|parts| {
            let changed = parts.transport != transport;
            parts.transport = transport;
            changed
        });
    }

    /// The driver's sequence state, read from its tracker: whether a replay runs, and
    /// whether the engine's history is still being recovered
    /// ([`crate::SequenceTracker::is_joining`]).
    pub(crate) fn follow<P>(&self, sequence: &crate::SequenceTracker<P>) {
        let (replaying, joining) = (sequence.is_replaying(), sequence.is_joining());
        self.tx.send_if_modified(|parts| {
            let changed = parts.replaying != replaying || parts.joining != joining;
            parts.replaying = replaying;
            parts.joining = joining;
            changed
        });
    }

    pub(crate) fn probe(&self, transport: Transport, counters: Arc<Counters>) -> SourceProbe {
        SourceProbe {
            transport,
            counters,
            state: self.tx.subscribe(),
        }
    }
}

/// A read-only, clonable view of one source: its real state and its counters. It stays
/// valid after the source stops (the state then no longer changes).
#[derive(Debug, Clone)]
pub struct SourceProbe {
    transport: Transport,
    counters: Arc<Counters>,
    state: watch::Receiver<StateParts>,
}

impl SourceProbe {
    /// The source's transport.
    pub fn transport(&self) -> Transport {
        self.transport
    }

    /// The source's state now.
    pub fn state(&self) -> SourceState {
        self.state.borrow().state()
    }

    /// A snapshot of the source's counters.
    pub fn stats(&self) -> SourceStats {
        self.counters.snapshot()
    }

    /// Waits until the state may have changed; `false` once the source has stopped.
    pub async fn changed(&mut self) -> bool {
        self.state.changed().await.is_ok()
    }
}

/// The owner's handle on a running source: its output queue, counters and tasks.
///
/// Dropping the handle cancels the source's tasks; [`SourceHandle::shutdown`] also waits
/// for them (bounded by `Limits::shutdown_timeout_ms`).
#[derive(Debug)]
pub struct SourceHandle {
    output: mpsc::Receiver<SourceOutput>,
    probe: SourceProbe,
    cancel: CancellationToken,
    tracker: TaskTracker,
    shutdown_timeout: Duration,
}

impl SourceHandle {
    /// A handle on an in-process source, always connected (trace replay).
    pub(crate) fn new(
        output: mpsc::Receiver<SourceOutput>,
        counters: Arc<Counters>,
        cancel: CancellationToken,
        tracker: TaskTracker,
        shutdown_timeout: Duration,
    ) -> Self {
        let probe = StateCell::new(SourceState::Connected).probe(Transport::Trace, counters);
        Self::with_probe(output, probe, cancel, tracker, shutdown_timeout)
    }

    pub(crate) fn with_probe(
        output: mpsc::Receiver<SourceOutput>,
        probe: SourceProbe,
        cancel: CancellationToken,
        tracker: TaskTracker,
        shutdown_timeout: Duration,
    ) -> Self {
        Self {
            output,
            probe,
            cancel,
            tracker,
            shutdown_timeout,
        }
    }

    /// The next output; `None` once the source has stopped and its queue is drained.
    pub async fn next(&mut self) -> Option<SourceOutput> {
        self.output.recv().await
    }

    /// The next output if one is queued now.
    pub fn try_next(&mut self) -> Option<SourceOutput> {
        self.output.try_recv().ok()
    }

    /// A snapshot of the source's counters.
    pub fn stats(&self) -> SourceStats {
        self.probe.stats()
    }

    /// The source's state now.
    pub fn state(&self) -> SourceState {
        self.probe.state()
    }

    /// A clonable view of the source's state and counters, for metrics and readiness.
    /// Its [`SourceProbe::changed`] wakes on changes after this call.
    pub fn probe(&self) -> SourceProbe {
        let mut probe = self.probe.clone();
        probe.state.mark_unchanged();
        probe
    }

    /// Cancels the source and waits for its tasks, up to the shutdown timeout.
    /// Returns `false` if the tasks did not finish in time.
    pub async fn shutdown(self) -> bool {
        self.cancel.cancel();
        self.tracker.close();
        tokio::time::timeout(self.shutdown_timeout, self.tracker.wait())
            .await
            .is_ok()
    }
}

impl Drop for SourceHandle {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

/// Sends `item` unless cancelled; returns `false` when the source must stop.
pub(crate) async fn emit(
    tx: &mpsc::Sender<SourceOutput>,
    cancel: &CancellationToken,
    item: SourceOutput,
) -> bool {
    tokio::select! {
        biased;
        () = cancel.cancelled() => false,
        sent = tx.send(item) => sent.is_ok(),
    }
}
