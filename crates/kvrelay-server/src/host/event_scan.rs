//! Discovered event sources: rescans the reference runtime's `event_sources/` and
//! `event_channels/` records (a file store's `v1` directory, or etcd's `v1/...` prefixes),
//! joins them into engine sources, merges them with `[[sources]]` (configuration wins) and
//! publishes the per-endpoint source map the supervisor attaches pumps from.
//!
//! A record that does not parse is skipped, logged and counted once per (record, error)
//! (`discovery_skipped_total{reason="malformed_advert"}`); a channel of a transport we do
//! not read (NATS, the ZMQ broker) is skipped and counted once per record
//! (`reason="unsupported_channel"`); a conflict with a configured source is logged once per
//! `(worker, rank)`. A missing bucket directory counts as empty (the runtime creates it on
//! its first registration). An etcd listing that fails keeps the last map (an etcd outage
//! never detaches every source), is counted (`discovery_advert_listing_failures_total`)
//! and logged rate-limited; a record gone with its lease is gone on the next listing.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvrelay_identity::EndpointId;
use kvrelay_membership::{EtcdClient, EtcdError};
use kvrelay_pacing::LogBudget;
use tokio::sync::watch;
use tokio::time::MissedTickBehavior;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::config::{ConfigError, SourceConfig};
use crate::event_advert::{self, ChannelAdvert, SourceAdvert};
use crate::host::discovery::FILE_RESCAN_INTERVAL;
use crate::metrics::{ReasonLabel, RelayMetrics};

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

/// Where the advert records live.
pub(crate) enum AdvertStore {
    /// A file store's `v1` directory.
    Dir(PathBuf),
    /// etcd, under `v1/event_sources/` and `v1/event_channels/`.
    Etcd(Box<EtcdClient>),
}

/// The rescan task of one store.
pub(crate) struct EventScan {
    pub(crate) store: AdvertStore,
    pub(crate) configured: Vec<SourceConfig>,
    pub(crate) sources: watch::Sender<SourceMap>,
    pub(crate) metrics: Arc<RelayMetrics>,
    pub(crate) cancel: CancellationToken,
}

impl EventScan {
    pub(crate) async fn run(self) {
        let mut ticker = tokio::time::interval(FILE_RESCAN_INTERVAL);
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut warned: BTreeSet<(String, String)> = BTreeSet::new();
        let mut unsupported_seen: BTreeSet<String> = BTreeSet::new();
        // Publishers whose advert carries a recovery target we do not call, counted once.
        let mut recovery_seen: BTreeSet<u64> = BTreeSet::new();
        let mut conflicted: BTreeSet<(u64, u32)> = BTreeSet::new();
        let mut failures = LogBudget::default();
        loop {
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => break,
                _ = ticker.tick() => {}
            }
            let scan = match &self.store {
                AdvertStore::Dir(dir) => {
                    let dir = dir.clone();
                    match tokio::task::spawn_blocking(move || read_store(&dir)).await {
                        Ok(scan) => scan,
                        Err(_) => continue,
                    }
                }
                AdvertStore::Etcd(client) => match read_etcd(client).await {
                    Ok(scan) => scan,
                    Err(err) => {
                        self.metrics.discovery_advert_listing_failures.inc();
                        if let Some(suppressed) = failures.admit(std::time::Instant::now()) {
                            warn!(error = %err, suppressed, "listing event adverts in etcd failed; keeping the last sources");
                        }
                        continue;
                    }
                },
            };
            let current: BTreeSet<(String, String)> = scan.rejected.into_iter().collect();
            for (record, error) in current.difference(&warned) {
                // `?` escapes control characters a file name, key or record may carry.
                warn!(record = ?record, error = ?error, "ignoring event advert record");
                self.count_skipped("malformed_advert");
            }
            warned = current;
            let unsupported: BTreeSet<String> = scan.unsupported.into_iter().collect();
            for record in unsupported.difference(&unsupported_seen) {
                debug!(record = ?record, "skipping an event channel of a transport the relay does not read");
                self.count_skipped("unsupported_channel");
            }
            unsupported_seen = unsupported;
            let recoverable: BTreeSet<u64> = scan
                .sources
                .iter()
                .filter(|source| source.recoverable)
                .map(|source| source.publisher_id)
                .collect();
            for publisher in recoverable.difference(&recovery_seen) {
                debug!(
                    publisher,
                    "an advertised source's recovery target is not called (no request-plane client); it resets instead"
                );
                self.metrics.discovery_recovery_targets_unused.inc();
            }
            recovery_seen = recoverable;
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

impl EventScan {
    fn count_skipped(&self, reason: &'static str) {
        self.metrics
            .discovery_skipped
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }
}

/// One scan of the store; records are named by path or key.
#[derive(Default)]
struct StoreScan {
    sources: Vec<SourceAdvert>,
    channels: Vec<ChannelAdvert>,
    rejected: Vec<(String, String)>,
    /// Channels of transports the relay does not read (NATS, the ZMQ broker).
    unsupported: Vec<String>,
}

impl StoreScan {
    fn source(&mut self, record: String, text: &str) {
        match event_advert::parse_source(text) {
            Ok(advert) => self.sources.push(advert),
            Err(err) => self.rejected.push((record, err.to_string())),
        }
    }

    fn channel(&mut self, record: String, text: &str) {
        match event_advert::parse_channel(text) {
            Ok(advert) => self.channels.push(advert),
            // Channels of other topics are not engine sources.
            Err(event_advert::AdvertError::WrongTopic { .. }) => {}
            // A KV-event channel we cannot read: the worker's events are out of reach.
            Err(event_advert::AdvertError::UnsupportedTransport { .. }) => {
                self.unsupported.push(record);
            }
            Err(err) => self.rejected.push((record, err.to_string())),
        }
    }
}

fn read_store(dir: &Path) -> StoreScan {
    let mut scan = StoreScan::default();
    let mut rejected = Vec::new();
    for (path, text) in read_bucket(&dir.join("event_sources"), &mut rejected) {
        scan.source(path.display().to_string(), &text);
    }
    for (path, text) in read_bucket(&dir.join("event_channels"), &mut rejected) {
        scan.channel(path.display().to_string(), &text);
    }
    scan.rejected.extend(
        rejected
            .into_iter()
            .map(|(path, why)| (path.display().to_string(), why)),
    );
    scan
}

/// The etcd prefixes of the two buckets (the reference runtime's key layout).
const ETCD_SOURCES: &[u8] = b"v1/event_sources/";
const ETCD_CHANNELS: &[u8] = b"v1/event_channels/";

/// One listing of both buckets in etcd (paged by the client, bounded in count and size
/// like a directory scan).
async fn read_etcd(client: &EtcdClient) -> Result<StoreScan, EtcdError> {
    let mut scan = StoreScan::default();
    for prefix in [ETCD_SOURCES, ETCD_CHANNELS] {
        let listing = client.list_prefix(prefix).await?;
        let bucket = String::from_utf8_lossy(prefix).into_owned();
        for key in &listing.too_large {
            scan.rejected.push((
                String::from_utf8_lossy(key).into_owned(),
                "record larger than the etcd receive limit".to_owned(),
            ));
        }
        if listing.records.len() > MAX_RECORDS {
            scan.rejected.push((
                bucket.clone(),
                format!("more than {MAX_RECORDS} records; reading the first"),
            ));
        }
        for record in listing.records.iter().take(MAX_RECORDS) {
            let key = String::from_utf8_lossy(&record.key).into_owned();
            if record.value.len() as u64 > MAX_RECORD_BYTES {
                scan.rejected
                    .push((key, format!("record larger than {MAX_RECORD_BYTES} bytes")));
                continue;
            }
            let Ok(text) = std::str::from_utf8(&record.value) else {
                scan.rejected.push((key, "record is not UTF-8".to_owned()));
                continue;
            };
            if prefix == ETCD_SOURCES {
                scan.source(key, text);
            } else {
                scan.channel(key, text);
            }
        }
    }
    Ok(scan)
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
