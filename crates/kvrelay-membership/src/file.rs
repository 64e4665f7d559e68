//! [`FileDiscovery`]: a directory of card files, polled for changes.
//!
//! Each regular file directly in the directory holds one discovery record, the JSON the
//! reference runtime stores in etcd (`{"type":"Model","namespace",..,"card_json":{..}}`);
//! the reference file store's `v1/mdc/` directory can be used as is. Hidden files and
//! records of other types are skipped. Write files atomically ([`write_card_file`] does):
//! a file that stops parsing keeps its previous card until it parses again, so a torn
//! write never withdraws a card.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
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
        /// Its size.
        n_bytes: u64,
        /// The limit.
        max: u64,
    },
    /// The content is not a model record.
    #[error(transparent)]
    Record(#[from] InstanceRecordError),
}

/// Reads every card file in `dir` (blocking); files over `limits.max_card_file_bytes` are
/// skipped.
pub fn read_card_dir(
    dir: &Path,
    limits: &MembershipLimits,
) -> Result<CardDirListing, DiscoveryError> {
    let io_error = |path: &Path, error: std::io::Error| DiscoveryError::Io {
        path: path.to_owned(),
        reason: error.to_string(),
    };
    let mut listing = CardDirListing::default();
    let entries = std::fs::read_dir(dir).map_err(|error| io_error(dir, error))?;
    for entry in entries {
        let entry = entry.map_err(|error| io_error(dir, error))?;
        let path = entry.path();
        let hidden = entry.file_name().to_string_lossy().starts_with('.');
        let is_file = entry.file_type().is_ok_and(|kind| kind.is_file());
        if hidden || !is_file {
            continue;
        }
        match read_card_file(&path, limits) {
            Ok(instance) => {
                listing.cards.insert(path, instance);
            }
            Err(CardFileError::Record(InstanceRecordError::NotAModel { .. })) => {}
            Err(error) => listing.skipped.push((path, error)),
        }
    }
    listing.skipped.sort_by(|left, right| left.0.cmp(&right.0));
    Ok(listing)
}

/// Reads one card file (blocking).
pub fn read_card_file(
    path: &Path,
    limits: &MembershipLimits,
) -> Result<ModelCardInstance, CardFileError> {
    let read_error = |error: std::io::Error| CardFileError::Read {
        reason: error.to_string(),
    };
    let n_bytes = std::fs::metadata(path).map_err(read_error)?.len();
    if n_bytes > limits.max_card_file_bytes {
        return Err(CardFileError::TooLarge {
            n_bytes,
            max: limits.max_card_file_bytes,
        });
    }
    let bytes = std::fs::read(path).map_err(read_error)?;
    Ok(ModelCardInstance::from_record_json(&bytes)?)
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
#[derive(Debug, Clone)]
pub struct FileDiscovery {
    dir: PathBuf,
    poll_interval: Duration,
    limits: MembershipLimits,
}

impl FileDiscovery {
    /// Watches `dir`, scanning every `poll_interval`, with the default limits.
    pub fn new(dir: &Path, poll_interval: Duration) -> Self {
        Self {
            dir: dir.to_owned(),
            poll_interval,
            limits: MembershipLimits::default(),
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

    async fn scan(&self) -> Result<CardDirListing, DiscoveryError> {
        let dir = self.dir.clone();
        let limits = self.limits;
        tokio::task::spawn_blocking(move || read_card_dir(&dir, &limits))
            .await
            .map_err(|error| DiscoveryError::Io {
                path: self.dir.clone(),
                reason: format!("scan task failed: {error}"),
            })?
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
