//! [`FileDiscovery`]: a directory of card files, polled for changes.
//!
//! Each regular file directly in the directory holds one discovery record, the JSON the
//! reference runtime stores in etcd (`{"type":"Model","namespace",..,"card_json":{..}}`);
//! the reference file store's `v1/mdc/` directory can be used as is. Hidden files and
//! records of other types are skipped quietly. Symlinks are followed (a mounted ConfigMap
//! is a directory of symlinks); FIFOs, sockets and devices are skipped without being
//! opened, and reads stop at the size limit even if a file grows. Unchanged files
//! (same length, mtime, inode and ctime) are not read again. Write files atomically ([`write_card_file`] does):
//! a file that stops parsing keeps its previous card until it parses again, so a torn
//! write never withdraws a card.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::discovery::{Discovery, DiscoveryError, DiscoveryFuture, DiscoveryWatch};
use crate::instance::{
    DiscoveryEvent, DiscoveryQuery, InstanceRecordError, ModelCardInstance, ModelCardInstanceId,
};
use crate::limits::MembershipLimits;

/// Default interval between directory scans.
pub const DEFAULT_FILE_POLL_INTERVAL: Duration = Duration::from_millis(500);

/// One scan of a card directory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CardDirListing {
    /// Parsed cards, keyed by file path (sorted).
    pub cards: BTreeMap<PathBuf, ModelCardInstance>,
    /// Files that were skipped, with why.
    pub skipped: Vec<(PathBuf, CardFileError)>,
}

impl CardDirListing {
    /// The cards, one per instance id (for a repeated id the last path wins).
    pub fn instances(&self) -> Vec<ModelCardInstance> {
        let mut by_id: BTreeMap<&ModelCardInstanceId, &ModelCardInstance> = BTreeMap::new();
        for instance in self.cards.values() {
            by_id.insert(&instance.id, instance);
        }
        by_id.into_values().cloned().collect()
    }
}

/// Why one card file was skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CardFileError {
    /// The file could not be read.
    #[error("cannot read: {reason}")]
    Read {
        /// The OS message.
        reason: String,
    },
    /// The file is larger than [`MembershipLimits::max_card_file_bytes`].
    #[error("file is {n_bytes} bytes, more than {max} allowed")]
    TooLarge {
        /// Its size (or how much was read before the limit stopped the read).
        n_bytes: u64,
        /// The limit.
        max: u64,
    },
    /// The path (or what a symlink points to) is not a regular file: a FIFO, a socket or
    /// a device; it is never opened.
    #[error("not a regular file")]
    NotARegularFile,
    /// The directory holds more than [`MembershipLimits::max_card_files`] candidate files;
    /// this one (after the first `max` in name order) is not read.
    #[error("more than {max} card files in the directory")]
    TooManyFiles {
        /// The limit.
        max: usize,
    },
    /// The content is not a model record.
    #[error(transparent)]
    Record(#[from] InstanceRecordError),
}

impl CardFileError {
    /// A closed-set label for metrics (`kvrelay_discovery_skipped_total{reason}`).
    pub fn reason_label(&self) -> &'static str {
        match self {
            Self::Read { .. } => "unreadable",
            Self::TooLarge { .. } => "too_large",
            Self::NotARegularFile => "not_regular_file",
            Self::TooManyFiles { .. } => "too_many_files",
            Self::Record(_) => "malformed",
        }
    }
}

/// How many card files were skipped, by reason, counting each file once per change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CardFileSkips {
    /// Unreadable files.
    pub unreadable: u64,
    /// Files over the size limit.
    pub too_large: u64,
    /// FIFOs, sockets, devices.
    pub not_regular_file: u64,
    /// Files past the file-count limit.
    pub too_many_files: u64,
    /// Files that are not a valid model record.
    pub malformed: u64,
}

impl CardFileSkips {
    /// Every counter with its `reason_label`.
    pub fn by_reason(&self) -> [(&'static str, u64); 5] {
        [
            ("unreadable", self.unreadable),
            ("too_large", self.too_large),
            ("not_regular_file", self.not_regular_file),
            ("too_many_files", self.too_many_files),
            ("malformed", self.malformed),
        ]
    }

    fn count(&mut self, error: &CardFileError) {
        let counter = match error {
            CardFileError::Read { .. } => &mut self.unreadable,
            CardFileError::TooLarge { .. } => &mut self.too_large,
            CardFileError::NotARegularFile => &mut self.not_regular_file,
            CardFileError::TooManyFiles { .. } => &mut self.too_many_files,
            CardFileError::Record(_) => &mut self.malformed,
        };
        *counter += 1;
    }
}

/// Reads every card file in `dir` (blocking); files over `limits.max_card_file_bytes`,
/// files that are not regular and files past `limits.max_card_files` are skipped.
pub fn read_card_dir(
    dir: &Path,
    limits: &MembershipLimits,
) -> Result<CardDirListing, DiscoveryError> {
    Ok(CardDirScanner::default().scan(dir, limits)?.listing)
}

/// Reads one card file (blocking): follows a symlink, refuses anything but a regular file
/// without opening it, and never reads more than `limits.max_card_file_bytes` + 1 bytes,
/// even if the file grows while it is read.
pub fn read_card_file(
    path: &Path,
    limits: &MembershipLimits,
) -> Result<ModelCardInstance, CardFileError> {
    use std::io::Read;

    let read_error = |error: std::io::Error| CardFileError::Read {
        reason: error.to_string(),
    };
    let max = limits.max_card_file_bytes;
    let metadata = std::fs::metadata(path).map_err(read_error)?;
    if !metadata.is_file() {
        return Err(CardFileError::NotARegularFile);
    }
    if metadata.len() > max {
        return Err(CardFileError::TooLarge {
            n_bytes: metadata.len(),
            max,
        });
    }
    let file = std::fs::File::open(path).map_err(read_error)?;
    // The path may have been swapped since the check above.
    if !file.metadata().map_err(read_error)?.is_file() {
        return Err(CardFileError::NotARegularFile);
    }
    let capacity = usize::try_from(metadata.len().min(max)).unwrap_or(0);
    let mut bytes = Vec::with_capacity(capacity);
    file.take(max.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    let n_bytes = bytes.len() as u64;
    if n_bytes > max {
        return Err(CardFileError::TooLarge { n_bytes, max });
    }
    Ok(ModelCardInstance::from_record_json(&bytes)?)
}

/// What identifies one version of a file without reading it: an unchanged stamp means the
/// previous result (card or skip) still holds, so unchanged files are never re-read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileStamp {
    len: u64,
    modified: Option<std::time::SystemTime>,
    /// Inode and change time: an atomic rename or a rewrite within one mtime tick still
    /// changes the stamp.
    #[cfg(unix)]
    inode: (u64, u64, i64, i64),
}

impl FileStamp {
    fn of(metadata: &std::fs::Metadata) -> Self {
        #[cfg(unix)]
        use std::os::unix::fs::MetadataExt;
        Self {
            len: metadata.len(),
            modified: metadata.modified().ok(),
            #[cfg(unix)]
            inode: (
                metadata.dev(),
                metadata.ino(),
                metadata.ctime(),
                metadata.ctime_nsec(),
            ),
        }
    }
}

/// One file's last result.
type FileResult = Result<ModelCardInstance, CardFileError>;

/// A card directory reader that remembers each file's last result by [`FileStamp`].
#[derive(Debug, Default)]
struct CardDirScanner {
    known: BTreeMap<PathBuf, (FileStamp, FileResult)>,
}

/// One scan: the listing, and the skips not seen before (new or changed files).
struct Scan {
    listing: CardDirListing,
    new_skips: Vec<(PathBuf, CardFileError)>,
    /// Files this scan opened and parsed (new or changed ones).
    n_read: u64,
}

impl CardDirScanner {
    fn scan(&mut self, dir: &Path, limits: &MembershipLimits) -> Result<Scan, DiscoveryError> {
        let io_error = |path: &Path, error: std::io::Error| DiscoveryError::Io {
            path: path.to_owned(),
            reason: error.to_string(),
        };
        let mut candidates = Vec::new();
        let entries = std::fs::read_dir(dir).map_err(|error| io_error(dir, error))?;
        for entry in entries {
            let entry = entry.map_err(|error| io_error(dir, error))?;
            let hidden = entry.file_name().to_string_lossy().starts_with('.');
            let is_dir = entry.file_type().is_ok_and(|kind| kind.is_dir());
            if !hidden && !is_dir {
                candidates.push(entry.path());
            }
        }
        candidates.sort();
        let mut known = BTreeMap::new();
        let mut scan = Scan {
            listing: CardDirListing::default(),
            new_skips: Vec::new(),
            n_read: 0,
        };
        for (at, path) in candidates.into_iter().enumerate() {
            let result = if at >= limits.max_card_files {
                let error = CardFileError::TooManyFiles {
                    max: limits.max_card_files,
                };
                if !matches!(self.known.get(&path), Some((_, Err(previous))) if *previous == error)
                {
                    scan.new_skips.push((path.clone(), error.clone()));
                }
                // Not stamped: past the limit nothing about the file is read.
                scan.listing.skipped.push((path, error));
                continue;
            } else {
                // Follows symlinks: a link to a directory is skipped quietly, like a directory.
                match std::fs::metadata(&path) {
                    Ok(metadata) if metadata.is_dir() => continue,
                    Ok(metadata) => {
                        let stamp = FileStamp::of(&metadata);
                        match self.known.remove(&path) {
                            Some((previous, result)) if previous == stamp => (stamp, result, false),
                            _ => {
                                scan.n_read += 1;
                                (stamp, read_card_file(&path, limits), true)
                            }
                        }
                    }
                    Err(error) => {
                        // Vanished between listing and stat, or a dangling symlink.
                        let result = Err(CardFileError::Read {
                            reason: error.to_string(),
                        });
                        let changed = !matches!(self.known.get(&path), Some((_, previous)) if *previous == result);
                        scan.record(&path, &result, changed);
                        continue;
                    }
                }
            };
            let (stamp, result, changed) = result;
            scan.record(&path, &result, changed);
            known.insert(path, (stamp, result));
        }
        self.known = known;
        scan.listing
            .skipped
            .sort_by(|left, right| left.0.cmp(&right.0));
        Ok(scan)
    }
}

impl Scan {
    fn record(&mut self, path: &Path, result: &FileResult, changed: bool) {
        match result {
            Ok(instance) => {
                self.listing.cards.insert(path.to_owned(), instance.clone());
            }
            // Records of other types (endpoints, adverts) share the store: not an error.
            Err(CardFileError::Record(InstanceRecordError::NotAModel { .. })) => {}
            Err(error) => {
                if changed {
                    self.new_skips.push((path.to_owned(), error.clone()));
                }
                self.listing.skipped.push((path.to_owned(), error.clone()));
            }
        }
    }
}

/// The file name used for a card: its instance path with `/` replaced by `.`, plus
/// `.json`.
pub fn card_file_name(id: &ModelCardInstanceId) -> String {
    format!("{}.json", id.to_path().replace('/', "."))
}

/// Writes a card's record into `dir` atomically (temporary file, then rename); blocking.
pub fn write_card_file(
    dir: &Path,
    instance: &ModelCardInstance,
) -> Result<PathBuf, DiscoveryError> {
    let path = dir.join(card_file_name(&instance.id));
    let temporary = dir.join(format!(".{}.tmp", card_file_name(&instance.id)));
    let io_error = |path: &Path, error: std::io::Error| DiscoveryError::Io {
        path: path.to_owned(),
        reason: error.to_string(),
    };
    std::fs::write(&temporary, instance.to_record_json())
        .map_err(|error| io_error(&temporary, error))?;
    std::fs::rename(&temporary, &path).map_err(|error| io_error(&path, error))?;
    Ok(path)
}

/// Discovery from a directory of card files, rescanned every poll interval.
///
/// Each scan only stats unchanged files (their last result is reused); a skipped file is
/// logged at warn and counted ([`FileDiscovery::skips`]) once per change.
#[derive(Debug, Clone)]
pub struct FileDiscovery {
    dir: PathBuf,
    poll_interval: Duration,
    limits: MembershipLimits,
    skips: Arc<Mutex<CardFileSkips>>,
    /// Card files opened and parsed so far (shared by every clone).
    reads: Arc<AtomicU64>,
    /// Shared by the watch's rescans and every `list` (the periodic reconcile), so a file
    /// is read, logged and counted once per change whoever scans.
    scanner: Arc<Mutex<CardDirScanner>>,
}

impl FileDiscovery {
    /// Watches `dir`, scanning every `poll_interval`, with the default limits.
    pub fn new(dir: &Path, poll_interval: Duration) -> Self {
        Self {
            dir: dir.to_owned(),
            poll_interval,
            limits: MembershipLimits::default(),
            skips: Arc::default(),
            reads: Arc::default(),
            scanner: Arc::default(),
        }
    }

    /// The same discovery with explicit limits.
    pub fn with_limits(self, limits: MembershipLimits) -> Self {
        Self { limits, ..self }
    }

    /// The watched directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Files skipped so far, by reason (shared by every clone of this discovery).
    pub fn skips(&self) -> CardFileSkips {
        *self.skips.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Card files opened and parsed so far: new and changed files only, since an unchanged
    /// file's last result is reused (shared by every clone of this discovery).
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// The limits this discovery reads under.
    pub fn limits(&self) -> &MembershipLimits {
        &self.limits
    }

    /// Scans the directory on a blocking thread with the shared scanner.
    async fn scan(&self) -> Result<CardDirListing, DiscoveryError> {
        let dir = self.dir.clone();
        let limits = self.limits;
        let scanner = self.scanner.clone();
        let scan = tokio::task::spawn_blocking(move || {
            scanner
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .scan(&dir, &limits)
        })
        .await
        .map_err(|error| DiscoveryError::Io {
            path: self.dir.clone(),
            reason: format!("scan task failed: {error}"),
        })??;
        self.reads.fetch_add(scan.n_read, Ordering::Relaxed);
        let mut skips = self.skips.lock().unwrap_or_else(PoisonError::into_inner);
        for (path, error) in &scan.new_skips {
            skips.count(error);
            // `?` on the path escapes control characters a file name may carry.
            tracing::warn!(path = ?path, reason = %error, "card file skipped");
        }
        Ok(scan.listing)
    }
}

/// The scan state a file watch diffs against.
struct ScanState {
    discovery: FileDiscovery,
    query: DiscoveryQuery,
    listing: CardDirListing,
    current: BTreeMap<ModelCardInstanceId, serde_json::Value>,
}

impl ScanState {
    /// Rescans; a file that no longer parses keeps its previous card.
    async fn rescan(&mut self) -> Result<Vec<DiscoveryEvent>, DiscoveryError> {
        let mut next = self.discovery.scan().await?;
        for (path, _) in &next.skipped {
            if let Some(previous) = self.listing.cards.get(path) {
                next.cards.insert(path.clone(), previous.clone());
            }
        }
        let next_current = current_cards(&next, &self.query);
        let mut events = Vec::new();
        for id in self.current.keys() {
            if !next_current.contains_key(id) {
                events.push(DiscoveryEvent::Removed(id.clone()));
            }
        }
        for (id, card_json) in &next_current {
            if self.current.get(id) != Some(card_json) {
                events.push(DiscoveryEvent::Added(ModelCardInstance {
                    id: id.clone(),
                    card_json: card_json.clone(),
                }));
            }
        }
        self.listing = next;
        self.current = next_current;
        Ok(events)
    }
}

fn current_cards(
    listing: &CardDirListing,
    query: &DiscoveryQuery,
) -> BTreeMap<ModelCardInstanceId, serde_json::Value> {
    listing
        .instances()
        .into_iter()
        .filter(|instance| query.matches(&instance.id))
        .map(|instance| (instance.id, instance.card_json))
        .collect()
}

impl Discovery for FileDiscovery {
    fn list<'a>(
        &'a self,
        query: &'a DiscoveryQuery,
    ) -> DiscoveryFuture<'a, Vec<ModelCardInstance>> {
        Box::pin(async move {
            let listing = self.scan().await?;
            Ok(listing
                .instances()
                .into_iter()
                .filter(|instance| query.matches(&instance.id))
                .collect())
        })
    }

    fn list_and_watch<'a>(
        &'a self,
        query: &'a DiscoveryQuery,
    ) -> DiscoveryFuture<'a, (Vec<ModelCardInstance>, DiscoveryWatch)> {
        Box::pin(async move {
            let listing = self.scan().await?;
            let current = current_cards(&listing, query);
            let instances = current
                .iter()
                .map(|(id, card_json)| ModelCardInstance {
                    id: id.clone(),
                    card_json: card_json.clone(),
                })
                .collect();
            let mut interval = tokio::time::interval(self.poll_interval);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval.reset();
            let state = ScanState {
                discovery: self.clone(),
                query: query.clone(),
                listing,
                current,
            };
            let batches = futures::stream::unfold(Some((state, interval)), |step| async move {
                let (mut state, mut interval) = step?;
                interval.tick().await;
                match state.rescan().await {
                    Ok(events) => Some((Ok(events), Some((state, interval)))),
                    Err(error) => Some((Err(error), None)),
                }
            });
            let events = futures::StreamExt::flat_map(batches, |batch| {
                let items: Vec<Result<DiscoveryEvent, DiscoveryError>> = match batch {
                    Ok(events) => events.into_iter().map(Ok).collect(),
                    Err(error) => vec![Err(error)],
                };
                futures::stream::iter(items)
            });
            Ok((instances, DiscoveryWatch::from_stream(events)))
        })
    }
}

#[cfg(test)]
mod tests;
