//! SIGTERM stops a relay in order: open streams get `publication_unavailable`, and
//! `run_until_signal` returns once every task has stopped. (Alone in its test binary:
//! the signal goes to the whole process.)

use crate::support;

use std::time::Duration;

use kvrelay_codec::v1::{ErrorReason, StreamRpc};
use kvrelay_server::Relay;
use support::{DEADLINE, deployment, first_message, request};
use tokio::signal::unix::{SignalKind, signal};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_shuts_the_relay_down_in_order() {
    // Installing a listener first makes SIGTERM catchable for the whole process.
    let mut own_listener = signal(SignalKind::terminate()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let relay = Relay::start(deployment(dir.path(), 10)).await.unwrap();
    let (mut watcher, _) = first_message(relay.wan_addr(), &request(StreamRpc::WatchCatalog)).await;
    let mut running = tokio::spawn(relay.run_until_signal());

    // The relay's own listener may register after a first signal, so repeat the signal
    // until it has stopped.
    let pid = std::process::id().to_string();
    let mut repeat = tokio::time::interval(Duration::from_millis(50));
    let stopped = tokio::time::timeout(DEADLINE, async {
        loop {
            tokio::select! {
                result = &mut running => return result,
                _ = repeat.tick() => {
                    let status = std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
                    assert!(status.success());
                }
            }
        }
    })
    .await
    .expect("the relay stops within the deadline");
    stopped.unwrap().unwrap();
    assert!(own_listener.recv().await.is_some());
    let end = support::until_error(&mut watcher).await;
    assert_eq!(end.reason, ErrorReason::PublicationUnavailable);
}
