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
