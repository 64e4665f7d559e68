//! Warm restart: each pool's exact ownership and, per engine source, the last batch it
//! applied (sequence and payload digest), written to `[state] dir` periodically and on graceful shutdown, and restored
//! into the pool's new generation before its sources start (which then resume after the
//! checkpointed batch; see `kvrelay_ingest::SequenceTracker::resumed`).
//!
//! Consistency without stopping anything: a source's position is recorded only after the
//! events of its batch were queued on the pool actor, and a checkpoint reads the positions
//! *before* it asks the actor (whose mailbox is FIFO) for its mappings. So every batch up
//! to a recorded position is in the exported state; batches after it may be too, and
//! applying a suffix of a source's log again converges to the same state (stores map,
//! removals unmap, last write wins).
//!
//! One file per pool, named by its pool key, written whole to a temporary name, synced and
//! renamed over the previous one: a crash leaves the old or the new file, never half of
//! one. The format is `kvrelay_pool::PoolCheckpoint` (checksummed, versioned).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvrelay_ckf::SourceId;
use kvrelay_identity::PoolId;
use kvrelay_ingest::ResumePoint;
use kvrelay_pool::{
    CheckpointError, PoolActorHandle, PoolCheckpoint, SourceCheckpoint, SourceMappings,
    TransferError,
};
use tracing::{info, warn};

use crate::config::StateConfig;
use crate::host::state::HostState;
use crate::host::wire::pool_key;
use crate::metrics::{OutcomeLabel, RelayMetrics};

/// The last batch each engine source applied, as its pump reports it.
#[derive(Debug, Clone, Default)]
pub(crate) struct SourcePositions {
    latest: Arc<Mutex<BTreeMap<SourceId, ResumePoint>>>,
}

impl SourcePositions {
    /// Every event of `source`'s batch `point` is queued on its pool actor.
    pub(crate) fn record(&self, source: SourceId, point: ResumePoint) {
        self.lock().insert(source, point);
    }

    /// `source` reset or stopped: what it applied before no longer continues.
    pub(crate) fn forget(&self, source: SourceId) {
        self.lock().remove(&source);
    }

    fn read(&self, sources: &[SourceId]) -> Vec<(SourceId, ResumePoint)> {
        let latest = self.lock();
        sources
            .iter()
            .filter_map(|source| latest.get(source).map(|point| (*source, *point)))
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<SourceId, ResumePoint>> {
        self.latest.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Why a checkpoint could not be written or read.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CheckpointIoError {
    #[error(transparent)]
    Actor(#[from] TransferError),
    #[error(transparent)]
    Format(#[from] CheckpointError),
    #[error("checkpoint of {bytes} bytes exceeds state.max_file_bytes ({max})")]
    TooLarge { bytes: u64, max: u64 },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("checkpoint task failed: {0}")]
    Join(String),
}

/// What one pool's checkpoint cost.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteFigures {
    pub(crate) bytes: u64,
    pub(crate) mappings: u64,
    /// Time the actor spent copying its mappings (it applies nothing meanwhile).
    pub(crate) export: Duration,
    /// Encoding, writing, syncing and renaming, off the executor.
    pub(crate) write: Duration,
}

/// Writes and restores pool checkpoints.
#[derive(Clone)]
pub(crate) struct Checkpointer {
    config: StateConfig,
    metrics: Arc<RelayMetrics>,
    positions: SourcePositions,
}

/// One routed pool, as a checkpoint round sees it.
struct RoutedPool {
    pool: PoolId,
    actor: PoolActorHandle,
    block_size: u32,
    sources: Vec<SourceId>,
}

impl Checkpointer {
    pub(crate) fn new(config: StateConfig, state: &HostState) -> Self {
        Self {
            config,
            metrics: state.metrics.clone(),
            positions: state.positions.clone(),
        }
    }

    pub(crate) fn interval(&self) -> Duration {
        self.config.checkpoint_interval()
    }

    pub(crate) fn shutdown_timeout(&self) -> Duration {
        self.config.shutdown_timeout()
    }

    /// Checkpoints every pool each interval until `cancel` fires.
    pub(crate) async fn run(
        self,
        state: Arc<HostState>,
        cancel: tokio_util::sync::CancellationToken,
    ) {
        let mut ticker = tokio::time::interval_at(
            tokio::time::Instant::now() + self.interval(),
            self.interval(),
        );
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                _ = ticker.tick() => {}
            }
            tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                () = self.checkpoint_all(&state) => {}
            }
        }
    }

    /// Checkpoints every pool that has routed sources, one after another.
    pub(crate) async fn checkpoint_all(&self, state: &HostState) {
        let routes = state.routes.borrow().clone();
        let mut pools: BTreeMap<String, RoutedPool> = BTreeMap::new();
        for (source, route) in &routes.routes {
            pools
                .entry(pool_key(&route.pool))
                .or_insert_with(|| RoutedPool {
                    pool: route.pool,
                    actor: route.actor.clone(),
                    block_size: route.block_size,
                    sources: Vec::new(),
                })
                .sources
                .push(*source);
        }
        for routed in pools.into_values() {
            let key = pool_key(&routed.pool);
            match self.write_pool(&routed).await {
                Ok(figures) => {
                    self.count_write("ok");
                    self.metrics.checkpoint_last_bytes.set(figures.bytes as i64);
                    self.metrics
                        .checkpoint_last_export_seconds
                        .set(figures.export.as_secs_f64());
                    self.metrics
                        .checkpoint_last_write_seconds
                        .set(figures.write.as_secs_f64());
                    tracing::debug!(pool = %key, bytes = figures.bytes, mappings = figures.mappings, export_ms = figures.export.as_millis() as u64, write_ms = figures.write.as_millis() as u64, "pool checkpointed");
                }
                Err(err) => {
                    self.count_write(match err {
                        CheckpointIoError::TooLarge { .. } => "too_large",
                        _ => "failed",
                    });
                    warn!(pool = %key, error = %err, "pool checkpoint failed");
                }
            }
        }
    }

    async fn write_pool(&self, routed: &RoutedPool) -> Result<WriteFigures, CheckpointIoError> {
        // Positions first, then the state (see the module docs).
        let positions = self.positions.read(&routed.sources);
        let started = Instant::now();
        let exported = routed.actor.export_mappings().await?;
        let export = started.elapsed();
        let mut by_source: BTreeMap<SourceId, Vec<(u64, u64)>> = exported
            .into_iter()
            .map(|SourceMappings { source, mappings }| (source, mappings))
            .collect();
        let checkpoint = PoolCheckpoint {
            identity: identity(&routed.pool, routed.block_size),
            written_unix_ms: unix_ms(SystemTime::now()),
            sources: positions
                .into_iter()
                .map(|(source, point)| SourceCheckpoint {
                    source,
                    last_sequence: point.last_applied,
                    last_digest: point.digest,
                    mappings: by_source.remove(&source).unwrap_or_default(),
                })
                .collect(),
        };
        let bytes = checkpoint.encoded_len() as u64;
        if bytes > self.config.max_file_bytes {
            return Err(CheckpointIoError::TooLarge {
                bytes,
                max: self.config.max_file_bytes,
            });
        }
        let path = self.path_of(&routed.pool);
        let dir = self.config.dir.clone();
        let mappings = checkpoint.n_mappings();
        let started = Instant::now();
        tokio::task::spawn_blocking(move || {
            let encoded = checkpoint.encode()?;
            write_atomic(&dir, &path, &encoded)
        })
        .await
        .map_err(|err| CheckpointIoError::Join(err.to_string()))??;
        Ok(WriteFigures {
            bytes,
            mappings,
            export,
            write: started.elapsed(),
        })
    }

    /// Restores `pool`'s checkpoint, if a usable one exists, into `actor` for the
    /// `engines` it still has; returns each restored source's last applied batch (its
    /// resume point). Anything unusable is discarded with one log line and a count.
    pub(crate) async fn restore_pool(
        &self,
        pool: &PoolId,
        block_size: u32,
        actor: &PoolActorHandle,
        engines: &[SourceId],
    ) -> BTreeMap<SourceId, ResumePoint> {
        let key = pool_key(pool);
        let path = self.path_of(pool);
        let max = self.config.max_file_bytes;
        let read = tokio::task::spawn_blocking(move || read_checkpoint(&path, max)).await;
        let checkpoint = match read {
            Ok(Ok(Some(checkpoint))) => checkpoint,
            Ok(Ok(None)) => {
                self.count_restore("none");
                return BTreeMap::new();
            }
            Ok(Err(err)) => {
                let outcome = match &err {
                    CheckpointIoError::Format(format) => format.kind(),
                    CheckpointIoError::TooLarge { .. } => "too_large",
                    _ => "unreadable",
                };
                self.count_restore(outcome);
                warn!(pool = %key, error = %err, "checkpoint discarded");
                return BTreeMap::new();
            }
            Err(join) => {
                self.count_restore("unreadable");
                warn!(pool = %key, error = %join, "checkpoint read failed");
                return BTreeMap::new();
            }
        };
        if checkpoint.identity != identity(pool, block_size) {
            self.count_restore("other_pool");
            warn!(pool = %key, found = %checkpoint.identity, "checkpoint of another pool or hashing discarded");
            return BTreeMap::new();
        }
        let age = unix_ms(SystemTime::now()).saturating_sub(checkpoint.written_unix_ms);
        if age > self.config.max_age_ms {
            self.count_restore("stale");
            warn!(pool = %key, age_ms = age, max_age_ms = self.config.max_age_ms, "stale checkpoint discarded");
            return BTreeMap::new();
        }
        // Only sources the pool still has: a departed worker's blocks stay gone.
        let n_checkpointed = checkpoint.sources.len();
        let (resume, restore): (BTreeMap<SourceId, ResumePoint>, Vec<SourceMappings>) = checkpoint
            .sources
            .into_iter()
            .filter(|entry| engines.contains(&entry.source))
            .map(|entry| {
                (
                    (
                        entry.source,
                        ResumePoint {
                            last_applied: entry.last_sequence,
                            digest: entry.last_digest,
                        },
                    ),
                    SourceMappings {
                        source: entry.source,
                        mappings: entry.mappings,
                    },
                )
            })
            .unzip();
        let started = Instant::now();
        match actor.restore(restore).await {
            Ok(mappings) => {
                self.count_restore("restored");
                self.metrics.checkpoint_restored_mappings.inc_by(mappings);
                for (source, point) in &resume {
                    self.positions.record(*source, *point);
                }
                info!(pool = %key, sources = resume.len(), skipped_sources = n_checkpointed - resume.len(), mappings, age_ms = age, restore_ms = started.elapsed().as_millis() as u64, "pool restored from its checkpoint");
                resume
            }
            Err(err) => {
                self.count_restore("refused");
                warn!(pool = %key, error = %err, "checkpoint refused by the pool; nothing restored");
                BTreeMap::new()
            }
        }
    }

    fn path_of(&self, pool: &PoolId) -> PathBuf {
        let name: String = pool_key(pool)
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        self.config.dir.join(format!("{name}.ckpt"))
    }

    fn count_write(&self, outcome: &'static str) {
        self.metrics
            .checkpoint_writes
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    fn count_restore(&self, outcome: &'static str) {
        self.metrics
            .checkpoint_restores
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }
}

/// What a checkpoint must have been written for: the pool (its indexer domain, which
/// covers the model and hashing, and its DC) and the block size.
fn identity(pool: &PoolId, block_size: u32) -> String {
    format!("kvrelay pool {} block_size {block_size}", pool_key(pool))
}

fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH).map_or(0, |since| {
        u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
    })
}

/// Writes `bytes` to `path` whole: a temporary file in `dir`, synced, renamed over `path`,
/// and the directory synced, so a crash leaves the old file or the new one.
fn write_atomic(dir: &Path, path: &Path, bytes: &[u8]) -> Result<(), CheckpointIoError> {
    use std::io::Write;
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| CheckpointIoError::Io { path, source }
    };
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let tmp = path.with_extension("ckpt.tmp");
    let mut file = std::fs::File::create(&tmp).map_err(io(&tmp))?;
    file.write_all(bytes).map_err(io(&tmp))?;
    file.sync_all().map_err(io(&tmp))?;
    drop(file);
    std::fs::rename(&tmp, path).map_err(io(path))?;
    std::fs::File::open(dir)
        .and_then(|dir| dir.sync_all())
        .map_err(io(dir))?;
    Ok(())
}

/// Reads and decodes `path`; `None` when there is no file. The size is checked before
/// anything is read.
fn read_checkpoint(
    path: &Path,
    max_bytes: u64,
) -> Result<Option<PoolCheckpoint>, CheckpointIoError> {
    let io = |source| CheckpointIoError::Io {
        path: path.to_path_buf(),
        source,
    };
    let len = match std::fs::metadata(path) {
        Ok(meta) => meta.len(),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(io(err)),
    };
    if len > max_bytes {
        return Err(CheckpointIoError::TooLarge {
            bytes: len,
            max: max_bytes,
        });
    }
    let bytes = std::fs::read(path).map_err(io)?;
    Ok(Some(PoolCheckpoint::decode(&bytes)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn checkpoint(identity: &str) -> PoolCheckpoint {
        PoolCheckpoint {
            identity: identity.to_owned(),
            written_unix_ms: unix_ms(SystemTime::now()),
            sources: vec![SourceCheckpoint {
                source: SourceId::new(1, 0),
                last_sequence: 9,
                last_digest: 99,
                mappings: vec![(1, 11), (2, 12)],
            }],
        }
    }

    #[test]
    fn an_atomic_write_replaces_the_file_whole_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let path = state.join("pool.ckpt");
        write_atomic(&state, &path, &checkpoint("a").encode().unwrap()).unwrap();
        write_atomic(&state, &path, &checkpoint("b").encode().unwrap()).unwrap();
        let read = read_checkpoint(&path, 1 << 20).unwrap().unwrap();
        assert_eq!(read.identity, "b");
        let names: Vec<_> = std::fs::read_dir(&state)
            .unwrap()
            .map(|entry| entry.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("pool.ckpt")]);
    }

    #[test]
    fn missing_oversized_and_corrupt_files_are_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pool.ckpt");
        assert!(read_checkpoint(&path, 1 << 20).unwrap().is_none());
        let bytes = checkpoint("a").encode().unwrap();
        std::fs::write(&path, &bytes).unwrap();
        assert!(matches!(
            read_checkpoint(&path, 16),
            Err(CheckpointIoError::TooLarge { .. })
        ));
        std::fs::write(&path, &bytes[..bytes.len() - 3]).unwrap();
        assert!(matches!(
            read_checkpoint(&path, 1 << 20),
            Err(CheckpointIoError::Format(_))
        ));
    }
}
