//! Trace replay as a source: timed router events (from an event trace or a generated
//! [`crate::TraceWorkload`]) emitted in order, paced by their time offsets.

use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info_span};

use crate::event_trace::TimedEvent;
use crate::limits::Limits;
use crate::source::{SourceHandle, SourceOutput, emit};
use crate::stats::Counters;

/// How to replay a trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TraceReplayConfig {
    /// Time compression: 1.0 replays in real time, 10.0 ten times faster; 0 or less
    /// replays as fast as the consumer takes events.
    pub speedup: f64,
    /// Bounds (queue depth, shutdown timeout).
    pub limits: Limits,
}

/// Starts replaying `events` (in order); must be called inside a tokio runtime. The
/// source ends (its handle yields `None`) after the last event.
pub fn spawn_trace_replay(events: Vec<TimedEvent>, config: TraceReplayConfig) -> SourceHandle {
    let counters = Counters::shared();
    let cancel = CancellationToken::new();
    let tracker = TaskTracker::new();
    let (tx, rx) = mpsc::channel(config.limits.output_queue_depth.max(1));
    let task_counters = counters.clone();
    let task_cancel = cancel.child_token();
    tracker.spawn(
        async move {
            let start = tokio::time::Instant::now();
            for timed in events {
                if config.speedup > 0.0 {
                    let offset =
                        Duration::from_secs_f64(timed.t_ms as f64 / 1000.0 / config.speedup);
                    tokio::select! {
                        biased;
                        () = task_cancel.cancelled() => return,
                        () = tokio::time::sleep_until(start + offset) => {}
                    }
                }
                task_counters.message();
                task_counters.events(1);
                if !emit(&tx, &task_cancel, SourceOutput::Event(timed.event)).await {
                    return;
                }
            }
        }
        .instrument(info_span!("trace_replay")),
    );
    tracker.close();
    SourceHandle::new(
        rx,
        counters,
        cancel,
        tracker,
        Duration::from_millis(config.limits.shutdown_timeout_ms),
    )
}
