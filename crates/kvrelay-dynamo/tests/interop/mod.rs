//! The Python side of the interop tests: Dynamo's own relay (and, later, workers) from the
//! `ai-dynamo-runtime` wheel, run as separate processes on loopback from the venv that
//! `cargo xtask services` creates.

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// How long a Python process may take to start (imports of a 75 MB wheel included).
const START_DEADLINE: Duration = Duration::from_secs(60);

/// The interop venv's interpreter: `KVRELAY_INTEROP_PYTHON`, else the workspace's
/// `target/interop/venv`. Missing is a failure with the command that fixes it, never a skip.
pub(crate) fn python() -> PathBuf {
    let path = std::env::var_os("KVRELAY_INTEROP_PYTHON").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/interop/venv/bin/python"),
        PathBuf::from,
    );
    assert!(
        path.exists(),
        "no interop Python at {}: run `cargo xtask services` (it creates the venv with Dynamo's wheel)",
        path.display()
    );
    path
}

/// A script of ours next to this file.
pub(crate) fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/interop")
        .join(name)
}

/// Dynamo's relay (`KvDcRelay`, in-memory discovery, ZMQ event plane) serving its gRPC door
/// on a free loopback port; killed when dropped.
pub(crate) struct DynamoRelay {
    /// `host:port` of its gRPC door.
    pub(crate) addr: String,
    child: Child,
}

impl DynamoRelay {
    pub(crate) async fn start() -> Self {
        let mut child = Command::new(python())
            .arg(script("dynamo_relay.py"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("the interop python starts");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut lines = BufReader::new(stdout).lines();
        let addr = tokio::time::timeout(START_DEADLINE, async {
            while let Some(line) = lines.next_line().await.expect("reading the relay's stdout") {
                if let Some(addr) = line.strip_prefix("bound ") {
                    return addr.trim().to_owned();
                }
            }
            panic!("Dynamo's relay exited before it listened")
        })
        .await
        .expect("Dynamo's relay listens within the deadline");
        Self { addr, child }
    }
}

impl Drop for DynamoRelay {
    fn drop(&mut self) {
        // Closing stdin asks the script to shut the relay down; kill_on_drop ends it anyway.
        drop(self.child.stdin.take());
        let _ = self.child.start_kill();
    }
}
