//! The source abstraction: what every source yields, and the handle that owns its tasks.

use std::sync::Arc;
use std::time::Duration;

use kvrelay_ckf::{RouterEvent, SourceId};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::sequence::ResetReason;
use crate::stats::{Counters, SourceStats};

/// One item a source yields, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourceOutput {
    /// A canonical router event.
    Event(RouterEvent),
    /// A lifecycle signal.
    Signal(SourceSignal),
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

/// The owner's handle on a running source: its output queue, counters and tasks.
///
/// Dropping the handle cancels the source's tasks; [`SourceHandle::shutdown`] also waits
/// for them (bounded by `Limits::shutdown_timeout_ms`).
#[derive(Debug)]
pub struct SourceHandle {
    output: mpsc::Receiver<SourceOutput>,
    counters: Arc<Counters>,
    cancel: CancellationToken,
    tracker: TaskTracker,
    shutdown_timeout: Duration,
}

impl SourceHandle {
    pub(crate) fn new(
        output: mpsc::Receiver<SourceOutput>,
        counters: Arc<Counters>,
        cancel: CancellationToken,
        tracker: TaskTracker,
        shutdown_timeout: Duration,
    ) -> Self {
        Self {
            output,
            counters,
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
        self.counters.snapshot()
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
