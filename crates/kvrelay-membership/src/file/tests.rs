//! The file backend against real temporary directories.

use std::path::Path;

use super::*;

fn card(endpoint: &str, worker: u64, name: &str) -> ModelCardInstance {
    ModelCardInstance {
        id: ModelCardInstanceId {
            namespace: "prod".into(),
            component: "backend".into(),
            endpoint: endpoint.into(),
            instance_id: worker,
            model_suffix: None,
        },
        card_json: serde_json::json!({"display_name": name, "kv_cache_block_size": 16}),
    }
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dynamo-mdc")
}

async fn next_event(watch: &mut DiscoveryWatch) -> DiscoveryEvent {
    tokio::time::timeout(Duration::from_secs(10), watch.next())
        .await
        .expect("no file discovery event within 10 s")
        .expect("file watch closed")
        .expect("file watch failed")
}

#[test]
fn reference_file_store_card_is_read() {
    let listing = read_card_dir(&fixture_dir(), &MembershipLimits::default()).unwrap();
    assert!(listing.skipped.is_empty());
    let instances = listing.instances();
    assert_eq!(instances.len(), 1);
    let id = &instances[0].id;
    assert_eq!(id.to_path(), "bench/worker/generate/9e1f5065d8193fef");
    let card: crate::ModelDeploymentCard =
        serde_json::from_value(instances[0].card_json.clone()).unwrap();
    assert_eq!(card.display_name, "fake-model");
    assert_eq!(card.kv_cache_block_size, 16);
}

#[test]
fn generated_cards_round_trip_through_files() {
    let dir = tempfile::tempdir().unwrap();
    let written: Vec<ModelCardInstance> = (0..100)
        .map(|n| {
            let mut instance = card(&format!("e{}", n % 7), n, &format!("model-{}", n % 3));
            if n % 5 == 0 {
                instance.id.model_suffix = Some(format!("lora-{n}"));
            }
            instance
        })
        .collect();
    for instance in &written {
        write_card_file(dir.path(), instance).unwrap();
    }
    let mut read = read_card_dir(dir.path(), &MembershipLimits::default())
        .unwrap()
        .instances();
    let mut expected = written;
    read.sort_by(|a, b| a.id.cmp(&b.id));
    expected.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(read, expected);
}

#[test]
fn invalid_and_foreign_files_are_skipped_with_reasons() {
    let dir = tempfile::tempdir().unwrap();
    write_card_file(dir.path(), &card("generate", 1, "llama")).unwrap();
    std::fs::write(dir.path().join("broken.json"), "{not json").unwrap();
    std::fs::write(dir.path().join("endpoint.json"), r#"{"type":"Endpoint"}"#).unwrap();
    std::fs::write(dir.path().join(".hidden"), "{").unwrap();
    let listing = read_card_dir(dir.path(), &MembershipLimits::default()).unwrap();
    assert_eq!(listing.instances().len(), 1);
    assert_eq!(listing.skipped.len(), 1);
    assert!(listing.skipped[0].0.ends_with("broken.json"));
}

#[test]
fn oversized_file_is_skipped() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_card_file(dir.path(), &card("generate", 1, "llama")).unwrap();
    let limits = MembershipLimits {
        max_card_file_bytes: 8,
        ..MembershipLimits::default()
    };
    let listing = read_card_dir(dir.path(), &limits).unwrap();
    assert!(listing.cards.is_empty());
    assert_eq!(listing.skipped.len(), 1);
    assert_eq!(listing.skipped[0].0, path);
    assert!(matches!(
        listing.skipped[0].1,
        CardFileError::TooLarge { max: 8, .. }
    ));
}

#[test]
fn missing_directory_is_an_io_error_naming_it() {
    let error = read_card_dir(
        Path::new("/nonexistent/cards"),
        &MembershipLimits::default(),
    )
    .unwrap_err();
    assert!(
        matches!(error, DiscoveryError::Io { ref path, .. } if path == Path::new("/nonexistent/cards"))
    );
}

#[tokio::test]
async fn watch_reports_added_changed_and_removed_files() {
    let dir = tempfile::tempdir().unwrap();
    let discovery = FileDiscovery::new(dir.path(), Duration::from_millis(10));
    let (listing, mut watch) = discovery
        .list_and_watch(&DiscoveryQuery::AllModels)
        .await
        .unwrap();
    assert!(listing.is_empty());

    let first = card("generate", 1, "llama");
    let path = write_card_file(dir.path(), &first).unwrap();
    assert_eq!(next_event(&mut watch).await, DiscoveryEvent::Added(first));

    let changed = card("generate", 1, "mistral");
    write_card_file(dir.path(), &changed).unwrap();
    assert_eq!(
        next_event(&mut watch).await,
        DiscoveryEvent::Added(changed.clone())
    );

    std::fs::remove_file(path).unwrap();
    assert_eq!(
        next_event(&mut watch).await,
        DiscoveryEvent::Removed(changed.id)
    );
}

#[tokio::test]
async fn torn_write_keeps_the_previous_card() {
    let dir = tempfile::tempdir().unwrap();
    let first = card("generate", 1, "llama");
    let path = write_card_file(dir.path(), &first).unwrap();
    let discovery = FileDiscovery::new(dir.path(), Duration::from_millis(10));
    let (listing, mut watch) = discovery
        .list_and_watch(&DiscoveryQuery::AllModels)
        .await
        .unwrap();
    assert_eq!(listing, vec![first]);
    std::fs::write(&path, "{\"type\":\"Mo").unwrap();
    let second = card("other", 2, "llama");
    write_card_file(dir.path(), &second).unwrap();
    // The next event is the new card, not a removal of the torn one.
    assert_eq!(next_event(&mut watch).await, DiscoveryEvent::Added(second));
}

#[tokio::test]
async fn namespaced_query_lists_only_its_namespace() {
    let dir = tempfile::tempdir().unwrap();
    let mut staging = card("generate", 2, "llama");
    staging.id.namespace = "staging".into();
    write_card_file(dir.path(), &card("generate", 1, "llama")).unwrap();
    write_card_file(dir.path(), &staging).unwrap();
    let discovery = FileDiscovery::new(dir.path(), DEFAULT_FILE_POLL_INTERVAL);
    let query = DiscoveryQuery::NamespacedModels {
        namespace: "prod".into(),
    };
    let listing = discovery.list(&query).await.unwrap();
    assert_eq!(listing.len(), 1);
    assert_eq!(listing[0].id.namespace, "prod");
}

#[test]
fn unchanged_files_are_not_read_again() {
    let dir = tempfile::tempdir().unwrap();
    for worker in 1..=3 {
        write_card_file(dir.path(), &card("generate", worker, "llama")).unwrap();
    }
    std::fs::write(dir.path().join("junk.json"), vec![b'x'; 1024]).unwrap();
    let limits = MembershipLimits::default();
    let mut scanner = CardDirScanner::default();
    let first = scanner.scan(dir.path(), &limits).unwrap();
    assert_eq!(first.listing.cards.len(), 3);
    assert_eq!(first.new_skips.len(), 1);
    assert_eq!(first.n_read, 4);
    let second = scanner.scan(dir.path(), &limits).unwrap();
    assert_eq!(second.listing, first.listing);
    assert!(
        second.new_skips.is_empty(),
        "a skip is reported once per change"
    );
    assert_eq!(second.n_read, 0, "unchanged files are only stat'ed");
    write_card_file(dir.path(), &card("generate", 2, "mistral")).unwrap();
    let third = scanner.scan(dir.path(), &limits).unwrap();
    assert_eq!(third.n_read, 1, "only the rewritten file is read");
    assert_eq!(third.listing.instances().len(), 3);
}

#[test]
fn fifos_and_device_symlinks_are_skipped_unopened_and_regular_symlinks_followed() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("fifo.json");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    std::os::unix::fs::symlink("/dev/zero", dir.path().join("zero.json")).unwrap();
    let elsewhere = tempfile::tempdir().unwrap();
    let target = write_card_file(elsewhere.path(), &card("generate", 7, "llama")).unwrap();
    std::os::unix::fs::symlink(&target, dir.path().join("linked.json")).unwrap();
    // Reading the FIFO or /dev/zero would block or never end; the scan must return.
    let listing = read_card_dir(dir.path(), &MembershipLimits::default()).unwrap();
    assert_eq!(listing.instances(), vec![card("generate", 7, "llama")]);
    let reasons: Vec<_> = listing
        .skipped
        .iter()
        .map(|(path, error)| (path.file_name().unwrap().to_owned(), error.clone()))
        .collect();
    assert_eq!(
        reasons,
        vec![
            ("fifo.json".into(), CardFileError::NotARegularFile),
            ("zero.json".into(), CardFileError::NotARegularFile),
        ]
    );
}

#[test]
fn files_past_the_count_limit_are_not_read() {
    let dir = tempfile::tempdir().unwrap();
    for worker in 1..=5 {
        write_card_file(dir.path(), &card("generate", worker, "llama")).unwrap();
    }
    let limits = MembershipLimits {
        max_card_files: 2,
        ..MembershipLimits::default()
    };
    let mut scanner = CardDirScanner::default();
    let scan = scanner.scan(dir.path(), &limits).unwrap();
    assert_eq!(scan.listing.cards.len(), 2);
    assert_eq!(scan.n_read, 2);
    assert_eq!(scan.listing.skipped.len(), 3);
    assert!(
        scan.listing
            .skipped
            .iter()
            .all(|(_, error)| *error == CardFileError::TooManyFiles { max: 2 })
    );
}

#[tokio::test]
async fn a_watch_counts_each_skipped_file_once_per_change() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("broken.json"), "{not json").unwrap();
    let discovery = FileDiscovery::new(dir.path(), Duration::from_millis(5));
    let (_, mut watch) = discovery
        .list_and_watch(&DiscoveryQuery::AllModels)
        .await
        .unwrap();
    assert_eq!(discovery.skips().malformed, 1);
    // A later card proves several rescans ran over the unchanged broken file.
    let first = card("generate", 1, "llama");
    write_card_file(dir.path(), &first).unwrap();
    assert_eq!(next_event(&mut watch).await, DiscoveryEvent::Added(first));
    assert_eq!(discovery.skips().malformed, 1);
    std::fs::write(dir.path().join("broken.json"), "{still not json").unwrap();
    let second = card("generate", 2, "llama");
    write_card_file(dir.path(), &second).unwrap();
    assert_eq!(next_event(&mut watch).await, DiscoveryEvent::Added(second));
    assert_eq!(discovery.skips().malformed, 2);
    assert_eq!(
        discovery
            .skips()
            .by_reason()
            .iter()
            .map(|(_, n)| n)
            .sum::<u64>(),
        2
    );
}
