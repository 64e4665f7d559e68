//! Discovered event sources: rescans a file store's `event_sources/` and `event_channels/`
//! records, joins them into engine sources, merges them with `[[sources]]` (configuration
//! wins) and publishes the per-endpoint source map the supervisor attaches pumps from.
//!
//! A record that does not parse is skipped and logged once per (file, error); a conflict
//! with a configured source is logged once per `(worker, rank)`. A missing bucket directory
//! counts as empty (the runtime creates it on its first registration).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use kvrelay_identity::EndpointId;
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::config::{ConfigError, SourceConfig};
use crate::event_advert::{self, ChannelAdvert, SourceAdvert};
use crate::host::discovery::FILE_RESCAN_INTERVAL;

/// Largest advert record read, in bytes.
const MAX_RECORD_BYTES: u64 = 64 * 1024;
/// Most records read per bucket and scan.
const MAX_RECORDS: usize = 4_096;

/// Engine sources by endpoint.
pub(crate) type SourceMap = BTreeMap<EndpointId, Vec<SourceConfig>>;

/// Groups sources by their `namespace.component.endpoint`.
pub(crate) fn group(sources: &[SourceConfig]) -> Result<SourceMap, ConfigError> {
    let mut grouped = SourceMap::new();
    for source in sources {
        let parts: Vec<&str> = source.endpoint.split('.').collect();
        let endpoint = match parts.as_slice() {
            [namespace, component, name] => EndpointId::new(namespace, component, name).ok(),
            _ => None,
        };
        let Some(endpoint) = endpoint else {
            return Err(ConfigError::InvalidField {
                field: "sources.endpoint",
                value: source.endpoint.clone(),
                reason: "must be namespace.component.endpoint",
            });
        };
        grouped.entry(endpoint).or_default().push(source.clone());
    }
    Ok(grouped)
}

/// The rescan task of one store directory.
pub(crate) struct EventScan {
    pub(crate) dir: PathBuf,
    pub(crate) configured: Vec<SourceConfig>,
    pub(crate) sources: watch::Sender<SourceMap>,
    pub(crate) cancel: CancellationToken,
}

impl EventScan {
    pub(crate) async fn run(self) {
        let mut ticker = tokio::time::interval(FILE_RESCAN_INTERVAL);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut warned: BTreeSet<(PathBuf, String)> = BTreeSet::new();
        let mut conflicted: BTreeSet<(u64, u32)> = BTreeSet::new();
        loop {
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => break,
                _ = ticker.tick() => {}
            }
            let dir = self.dir.clone();
            let Ok(scan) = tokio::task::spawn_blocking(move || read_store(&dir)).await else {
                continue;
            };
            let current: BTreeSet<(PathBuf, String)> = scan.rejected.into_iter().collect();
            for (path, error) in current.difference(&warned) {
                // `?` escapes control characters a file name or record may carry.
                warn!(path = ?path, error = ?error, "ignoring event advert record");
            }
            warned = current;
            let joined = event_advert::join(&scan.sources, &scan.channels);
            let (merged, conflicts) = event_advert::merge(&self.configured, joined);
            for (worker_id, dp_rank) in conflicts.difference(&conflicted) {
                warn!(
                    worker_id,
                    dp_rank,
                    "discovered event source conflicts with [[sources]]; using the configured one"
                );
            }
            conflicted = conflicts;
            let map = match group(&merged) {
                Ok(map) => map,
                Err(err) => {
                    warn!(error = %err, "discovered event sources not applied");
                    continue;
                }
            };
            self.sources.send_if_modified(|current| {
                if *current == map {
                    return false;
                }
                info!(
                    sources = map.values().map(Vec::len).sum::<usize>(),
                    "event sources changed"
                );
                *current = map;
                true
            });
        }
    }
}

/// One scan of the store.
#[derive(Default)]
struct StoreScan {
    sources: Vec<SourceAdvert>,
    channels: Vec<ChannelAdvert>,
    rejected: Vec<(PathBuf, String)>,
}

fn read_store(dir: &Path) -> StoreScan {
    let mut scan = StoreScan::default();
    for (path, text) in read_bucket(&dir.join("event_sources"), &mut scan.rejected) {
        match event_advert::parse_source(&text) {
            Ok(advert) => scan.sources.push(advert),
            Err(err) => scan.rejected.push((path, err.to_string())),
        }
    }
    for (path, text) in read_bucket(&dir.join("event_channels"), &mut scan.rejected) {
        match event_advert::parse_channel(&text) {
            Ok(advert) => scan.channels.push(advert),
            // Channels of other transports or topics are not engine sources.
            Err(event_advert::AdvertError::UnsupportedTransport { .. })
            | Err(event_advert::AdvertError::WrongTopic { .. }) => {}
            Err(err) => scan.rejected.push((path, err.to_string())),
        }
    }
    scan
}

/// The records of one bucket directory, in name order (bounded in count and size).
fn read_bucket(bucket: &Path, rejected: &mut Vec<(PathBuf, String)>) -> Vec<(PathBuf, String)> {
    let Ok(entries) = std::fs::read_dir(bucket) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.is_file())
        .collect();
    paths.sort();
    if paths.len() > MAX_RECORDS {
        rejected.push((
            bucket.to_path_buf(),
            format!("more than {MAX_RECORDS} records; reading the first"),
        ));
        paths.truncate(MAX_RECORDS);
    }
    let mut records = Vec::new();
    for path in paths {
        let mut text = String::new();
        let read = std::fs::File::open(&path)
            .and_then(|file| file.take(MAX_RECORD_BYTES + 1).read_to_string(&mut text));
        match read {
            Ok(len) if len as u64 > MAX_RECORD_BYTES => {
                rejected.push((path, format!("record larger than {MAX_RECORD_BYTES} bytes")))
            }
            Ok(_) => records.push((path, text)),
            // Removed between listing and reading: gone on the next scan.
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => rejected.push((path, err.to_string())),
        }
    }
    records
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn reference_store_yields_its_source_and_bad_records_are_rejected() {
        let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/discovery");
        let dir = tempfile::tempdir().unwrap();
        for bucket in ["event_sources", "event_channels"] {
            std::fs::create_dir_all(dir.path().join(bucket)).unwrap();
            for entry in std::fs::read_dir(fixtures.join(bucket)).unwrap() {
                let entry = entry.unwrap();
                std::fs::copy(
                    entry.path(),
                    dir.path().join(bucket).join(entry.file_name()),
                )
                .unwrap();
            }
        }
        std::fs::write(dir.path().join("event_sources/broken"), "{").unwrap();
        let scan = read_store(dir.path());
        assert_eq!(scan.sources.len(), 1);
        assert_eq!(scan.channels.len(), 1);
        assert_eq!(scan.rejected.len(), 1);
        assert!(scan.rejected[0].0.ends_with("broken"));
    }

    #[test]
    fn missing_buckets_are_empty() {
        let dir = tempfile::tempdir().unwrap();
        let scan = read_store(&dir.path().join("absent"));
        assert!(scan.sources.is_empty() && scan.channels.is_empty() && scan.rejected.is_empty());
    }
}
