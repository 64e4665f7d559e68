//! The Python side of the interop tests: Dynamo's own relay and workers from the
//! `ai-dynamo-runtime` wheel, run as separate processes on loopback from the venv that
//! `cargo xtask services` creates. (The `kvrelay` crate's tests include this file too.)

#![allow(dead_code, reason = "each test binary uses a different subset")]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

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

/// A script of ours next to this file (found from either crate that includes it).
pub(crate) fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../kvrelay-dynamo/tests/interop")
        .join(name)
}

/// Every address a Dynamo process binds or advertises is loopback.
pub(crate) fn loopback(command: &mut Command) -> &mut Command {
    for name in [
        "DYN_EVENT_PLANE_HOST",
        "DYN_TCP_RPC_HOST",
        "DYN_TCP_RESPONSE_STREAM_HOST",
        "DYN_SYSTEM_HOST",
    ] {
        command.env(name, "127.0.0.1");
    }
    command.env("DYN_SELF_HOST_METADATA", "0")
}

/// Reads lines until one starts with `prefix`; returns the rest.
pub(crate) async fn expect_line(lines: &mut Lines<BufReader<ChildStdout>>, prefix: &str) -> String {
    tokio::time::timeout(START_DEADLINE, async {
        while let Some(line) = lines
            .next_line()
            .await
            .expect("reading the script's stdout")
        {
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.trim().to_owned();
            }
        }
        panic!("the Dynamo process exited before it printed {prefix:?}")
    })
    .await
    .expect("the Dynamo process answers within the deadline")
}

/// Dynamo's relay (`KvDcRelay`, in-memory discovery, ZMQ event plane, its gRPC door on a
/// free loopback port) and one Dynamo worker in one process (`dynamo_fleet.py`): the worker
/// registers `model-a` (aggregated, 16-token blocks) and publishes what the test asks.
/// Closing stdin shuts it down; it is killed when dropped anyway.
pub(crate) struct DynamoFleet {
    /// `host:port` of the relay's gRPC door.
    pub(crate) addr: String,
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
    _model_dir: tempfile::TempDir,
}

impl DynamoFleet {
    pub(crate) async fn start() -> Self {
        Self::start_on(0).await
    }

    /// [`DynamoFleet::start`] with the relay's gRPC door on loopback port `port` (0: any).
    pub(crate) async fn start_on(port: u16) -> Self {
        let model_dir = tempfile::tempdir().unwrap();
        std::fs::write(
            model_dir.path().join("config.json"),
            r#"{"model_type":"llama","max_position_embeddings":4096}"#,
        )
        .unwrap();
        let mut child = loopback(&mut Command::new(python()))
            .arg(script("dynamo_fleet.py"))
            .arg(model_dir.path())
            .arg(port.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("the interop python starts");
        let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
        let addr = expect_line(&mut lines, "bound ").await;
        Self {
            addr,
            child,
            lines,
            _model_dir: model_dir,
        }
    }

    async fn command(&mut self, line: &str, answer: &str) {
        let stdin = self.child.stdin.as_mut().expect("stdin is open");
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .unwrap();
        stdin.flush().await.unwrap();
        expect_line(&mut self.lines, answer).await;
    }

    /// Shuts the relay down (stdin closed) and waits until the process has exited, so its
    /// port is free again; killed if it takes longer than the start deadline.
    pub(crate) async fn stop(mut self) {
        drop(self.child.stdin.take());
        if tokio::time::timeout(START_DEADLINE, self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }

    /// The worker stores `blocks` chained blocks of tokens `first, first + 1, ...`.
    pub(crate) async fn store(&mut self, first: u32, blocks: u32) {
        self.command(&format!("store {first} {blocks}"), "stored")
            .await;
    }

    /// The worker evicts the blocks of the sequence stored from `first`.
    pub(crate) async fn remove(&mut self, first: u32, blocks: u32) {
        self.command(&format!("remove {first} {blocks}"), "removed")
            .await;
    }
}

impl Drop for DynamoFleet {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let _ = self.child.start_kill();
    }
}
