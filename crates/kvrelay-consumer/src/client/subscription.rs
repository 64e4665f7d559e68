//! One pool of a relay followed through its subscriptions: each attempt opens a pool
//! stream, moves its messages through the [`PoolStream`] session and applies the checked
//! frames to the state; [`PoolFollow`] decides what becomes of the replica and when to
//! subscribe again.

use std::sync::Arc;
use std::time::Instant;

use kvrelay_codec::v1::{RelayIdentity, StreamRpc};
use parking_lot::RwLockUpgradableReadGuard;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::Shared;
use super::epoch::open;
use crate::catalog::PoolKey;
use crate::link::pool::{PoolFollow, PoolStream, ReplicaAfterStream, StreamEnd, begin_refused};
use crate::metrics::{Counter, ResubscribeReason};
use crate::state::FrameOutcome;

pub(super) async fn run_subscription(
    shared: Arc<Shared>,
    relay: usize,
    key: PoolKey,
    identity: RelayIdentity,
    cancel: CancellationToken,
) {
    let mut follow = PoolFollow::new(shared.config.backoff, Instant::now());
    loop {
        follow.handle_attempt(Instant::now());
        let reason = subscription_frames(&shared, relay, key, identity, &cancel).await;
        let after = follow.handle_ended(
            Instant::now(),
            reason,
            cancel.is_cancelled(),
            rand::random::<f64>(),
        );
        {
            let mut state = shared.state.write();
            match after.replica {
                ReplicaAfterStream::Suspend => state.suspend(key),
                ReplicaAfterStream::Invalidate => state.invalidate(key),
            }
        }
        shared.bump();
        let Some(retry_at) = after.retry_at else {
            return;
        };
        if let Some(reason) = reason {
            shared.metrics.resubscribe(reason);
        }
        tokio::select! {
            biased;
            () = cancel.cancelled() => return,
            () = tokio::time::sleep_until(retry_at.into()) => {}
        }
    }
}

/// One subscription attempt: a `None` reason means stop for good (cancelled, or the
/// generation left the catalog), `Some(reason)` means resubscribe after backoff.
async fn subscription_frames(
    shared: &Shared,
    relay: usize,
    key: PoolKey,
    identity: RelayIdentity,
    cancel: &CancellationToken,
) -> Option<ResubscribeReason> {
    let dc = &shared.dc(relay);
    let begun = {
        // A new lane may grow its format's table (allocate and copy every row): that
        // runs under the upgradable lock, which queries share, so scoring goes on while
        // frame writers wait; the write lock is then held only to swap the rows in.
        let state = shared.state.upgradable_read();
        match state.prepare_subscription(key) {
            Ok(mut prepared) => {
                let begun = RwLockUpgradableReadGuard::upgrade(state)
                    .begin_subscription_prepared(key, prepared.as_mut());
                // The old rows are freed here, after the write lock (a large table takes
                // milliseconds to unmap).
                drop(prepared);
                begun
            }
            Err(err) => Err(err),
        }
    };
    let (producer, resume_from_sequence) = match begun {
        Ok(begun) => begun,
        Err(err) => {
            let reason = begin_refused(&err);
            match reason {
                Some(ResubscribeReason::OverBudget) => {
                    // Pools may leave and free lanes; warn once, then only the
                    // `over_budget` resubscribe count says it goes on.
                    let first = !shared
                        .table_budget_warned
                        .swap(true, std::sync::atomic::Ordering::Relaxed);
                    if first {
                        warn!(dc = %dc, pool = key.as_u64(), error = %err, "replica not built: over max_query_table_bytes; retried after backoff (logged once, counted as resubscribes{{reason=over_budget}})");
                    } else {
                        debug!(dc = %dc, pool = key.as_u64(), error = %err, "replica not built: over max_query_table_bytes");
                    }
                }
                Some(_) => {
                    warn!(dc = %dc, pool = key.as_u64(), error = %err, "replica allocation failed; dropped, resubscribing");
                }
                None => {}
            }
            if reason.is_some() {
                shared.bump();
            }
            return reason;
        }
    };
    shared.bump();
    let rpc = StreamRpc::SubscribePool {
        expected_producer: producer,
        resume_from_sequence,
    };
    // One slot of the relay's pool streams, held while the stream is open.
    let slots = Arc::clone(&shared.pool_streams[relay]);
    let _slot = match slots.clone().try_acquire_owned() {
        Ok(slot) => slot,
        Err(_) => {
            if !shared.pool_streams_warned[relay].swap(true, std::sync::atomic::Ordering::Relaxed) {
                warn!(dc = %dc, limit = shared.config.limits.max_pool_streams_per_relay, "relay advertises more pools than max_pool_streams_per_relay; the rest wait for a free stream (logged once)");
            }
            tokio::select! {
                biased;
                () = cancel.cancelled() => return None,
                slot = slots.acquire_owned() => match slot {
                    Ok(slot) => slot,
                    Err(_) => return None,
                },
            }
        }
    };
    let stream = tokio::select! {
        biased;
        () = cancel.cancelled() => return None,
        stream = open(shared, relay, "pool", rpc) => stream,
    };
    let mut stream = match stream {
        Ok(stream) => stream,
        Err(err) => {
            debug!(dc = %dc, pool = key.as_u64(), error = %err, "pool subscription failed to open");
            return Some(ResubscribeReason::Disconnected);
        }
    };
    let limits = &shared.config.limits;
    let mut session = PoolStream::new(
        identity,
        producer,
        limits.staleness_bound,
        limits.snapshot_assembly_timeout,
        Instant::now(),
    );
    let end = loop {
        let stale_at = tokio::time::Instant::from_std(session.poll_timeout());
        let message = tokio::select! {
            biased;
            () = cancel.cancelled() => return None,
            () = tokio::time::sleep_until(stale_at) => match session.handle_timeout(Instant::now()) {
                Some(end) => break end,
                None => continue,
            },
            message = stream.next() => message,
        };
        let message = match message {
            Ok(Some(message)) => message,
            Ok(None) => break StreamEnd::Disconnected,
            Err(err) => {
                warn!(dc = %dc, pool = key.as_u64(), error = %err, "pool stream failed");
                break StreamEnd::Disconnected;
            }
        };
        // Checksum and copy happen here, outside the lock. The frame is then applied
        // under the upgradable read, which `score` shares (it never waits for an apply)
        // and which keeps applies and a table's growth one at a time; only a snapshot
        // chunk over a replica that answered queries takes the write lock.
        let checked = match session.handle_message(Instant::now(), &message) {
            Ok(checked) => checked,
            Err(end) => break end,
        };
        let now = Instant::now();
        let beside = shared
            .state
            .upgradable_read()
            .apply_beside_queries(key, &checked, now);
        let outcome = match beside {
            Some(outcome) => outcome,
            None => shared.state.write().apply_checked_frame(key, &checked, now),
        };
        match session.handle_applied(Instant::now(), outcome) {
            Ok(outcome) => {
                let counter = match outcome {
                    FrameOutcome::ChunkStored => None,
                    FrameOutcome::SnapshotInstalled(_) => Some(Counter::SnapshotsInstalled),
                    FrameOutcome::DeltaApplied(_) => Some(Counter::DeltasApplied),
                    FrameOutcome::Heartbeat(_) => Some(Counter::Heartbeats),
                };
                if let Some(counter) = counter {
                    shared.metrics.incr(counter);
                }
                shared.bump();
            }
            Err(end) => break end,
        }
    };
    log_stream_end(dc, key, &end);
    Some(end.reason())
}

/// One line per pool stream that ended with something to say.
fn log_stream_end(dc: &str, key: PoolKey, end: &StreamEnd) {
    let pool = key.as_u64();
    match end {
        StreamEnd::Refused { error, .. } => {
            warn!(dc = %dc, pool, reason = %error.effective_reason(), message = ?error.message, "relay ended pool stream");
        }
        StreamEnd::FrameRefused(refused) => {
            warn!(dc = %dc, pool, error = %refused, "pool frame refused; resubscribing");
        }
        StreamEnd::SnapshotOverdue { timeout } => {
            warn!(dc = %dc, pool, timeout = ?timeout, "snapshot did not complete in time; resubscribing");
        }
        StreamEnd::Unexpected { kind } => {
            warn!(dc = %dc, pool, kind, "pool stream carried a message of another kind; resubscribing");
        }
        StreamEnd::RelayRestarted | StreamEnd::Stale { .. } | StreamEnd::Disconnected => {
            debug!(dc = %dc, pool, end = ?end, "pool stream ended");
        }
    }
}
