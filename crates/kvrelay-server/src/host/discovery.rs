//! File discovery for the host: a directory of card records, rescanned on an interval and
//! projected into a [`MembershipView`].
//!
//! Each regular file holds one discovery record (`{"type":"Model",...,"card_json":{..}}`).
//! Files that are not model records (endpoints, event channels) or do not parse are skipped
//! and logged once per file. A new view is published only when the projection changed.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvrelay_membership::{EndpointFilter, MembershipProjection, MembershipView, ModelCardInstance};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// How often the card directory is rescanned.
pub(crate) const FILE_RESCAN_INTERVAL: Duration = Duration::from_millis(500);

/// Lists `dir` until `cancel` fires, publishing every changed view on `views`.
pub(crate) async fn run_file_discovery(
    dir: PathBuf,
    filter: EndpointFilter,
    views: watch::Sender<Option<MembershipView>>,
    cancel: CancellationToken,
) {
    let mut projection = MembershipProjection::new(filter);
    let mut reported = BTreeSet::new();
    let mut first = true;
    loop {
        let listing = {
            let dir = dir.clone();
            tokio::task::spawn_blocking(move || list_cards(&dir)).await
        };
        match listing {
            Ok(Ok((instances, skipped))) => {
                for (path, reason) in skipped {
                    if reported.insert(path.clone()) {
                        debug!(path = %path.display(), %reason, "skipping discovery file");
                    }
                }
                let changed = projection.replace_all(instances);
                let projected = projection.project();
                while let Some(diagnostic) = projection.poll_diagnostic() {
                    warn!(?diagnostic, "membership projection");
                }
                if first || changed || projected {
                    let view = projection.view();
                    info!(endpoints = view.len(), cards = projection.n_cards(), "discovery listed");
                    views.send_replace(Some(view));
                    first = false;
                }
            }
            Ok(Err(err)) => warn!(dir = %dir.display(), error = %err, "listing card directory failed"),
            Err(err) => warn!(error = %err, "card listing task failed"),
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(FILE_RESCAN_INTERVAL) => {}
        }
    }
}

type Listing = (Vec<ModelCardInstance>, Vec<(PathBuf, String)>);

fn list_cards(dir: &Path) -> std::io::Result<Listing> {
    let mut instances = Vec::new();
    let mut skipped = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&dir)?.collect::<Result<_, _>>()?;
        entries.sort_by_key(std::fs::DirEntry::path);
        for entry in entries {
            let path = entry.path();
            let kind = entry.file_type()?;
            if kind.is_dir() {
                pending.push(path);
                continue;
            }
            if !kind.is_file() {
                continue;
            }
            match std::fs::read(&path) {
                Ok(bytes) => match ModelCardInstance::from_record_json(&bytes) {
                    Ok(instance) => instances.push(instance),
                    Err(err) => skipped.push((path, err.to_string())),
                },
                Err(err) => skipped.push((path, err.to_string())),
            }
        }
    }
    Ok((instances, skipped))
}
