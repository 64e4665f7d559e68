//! Issue #16 row 10 on the real binary: a token never reaches `ps` or the log. The relay
//! refuses `--token` (it would sit in `/proc/<pid>/cmdline`), takes the token from the
//! environment, logs refused authentications at warn without the presented token even at
//! debug level, writes no ANSI colours when stderr is not a terminal, and `--log-format
//! json` writes one JSON object per log line.

use crate::support;

use std::time::{Duration, Instant};

use kvrelay_codec::v1::{Message, StreamRequest, StreamRpc};
use kvrelay_server::ProbeStream;
use support::RelayProcess;

const DEADLINE: Duration = Duration::from_secs(30);
const RIGHT_TOKEN: &str = "s3cr3t-right-token";
const WRONG_TOKEN: &str = "s3cr3t-wrong-token";

/// The relay's first answer to a `RelayInfo` request presenting `token`.
async fn relay_info(relay: &RelayProcess, token: Option<&str>) -> Option<Message> {
    let request = StreamRequest {
        subscriber_id: "log-test".to_owned(),
        rpc: StreamRpc::RelayInfo,
        auth_token: token.map(str::to_owned),
    };
    let mut stream = ProbeStream::connect(relay.wan, &request).await.unwrap();
    tokio::time::timeout(DEADLINE, stream.next_message())
        .await
        .expect("the relay answers in time")
        .unwrap()
}

/// Waits until the relay's log contains `needle`.
async fn log_until(relay: &RelayProcess, needle: &str) -> String {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let log = relay.log();
        if log.contains(needle) {
            return log;
        }
        assert!(Instant::now() < deadline, "no {needle:?} in: {log}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_token_flag_is_refused_before_anything_starts() {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args(["relay", "--token", RIGHT_TOKEN, "--listen", "127.0.0.1:0"])
        .env_remove("KVRELAY_TOKEN")
        .output()
        .await
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("--token is refused"), "{stderr}");
    assert!(
        stderr.contains("KVRELAY_TOKEN"),
        "names the safe way: {stderr}"
    );
    assert!(
        !stderr.contains("kvrelay relay: WAN"),
        "nothing started: {stderr}"
    );
}

#[tokio::test]
async fn refused_tokens_are_logged_at_warn_without_the_token_even_at_debug() {
    let relay =
        RelayProcess::start(&[], &["--log", "debug"], &[("KVRELAY_TOKEN", RIGHT_TOKEN)]).await;
    assert!(matches!(
        relay_info(&relay, Some(RIGHT_TOKEN)).await,
        Some(Message::RelayInfo(_))
    ));
    for token in [Some(WRONG_TOKEN), None] {
        assert!(matches!(
            relay_info(&relay, token).await,
            Some(Message::Error(_))
        ));
    }
    let log = log_until(&relay, "missing or wrong bearer token").await;
    assert!(
        log.lines()
            .any(|line| line.contains("WARN") && line.contains("bearer token")),
        "the refusal is a warning: {log}"
    );
    assert!(!log.contains("s3cr3t"), "a token reached the log: {log}");
    assert!(
        !log.contains('\u{1b}'),
        "ANSI escapes on a non-terminal: {log}"
    );
}

#[tokio::test]
async fn json_log_format_writes_one_object_per_line() {
    let relay = RelayProcess::start(
        &[],
        &["--log-format", "json"],
        &[("KVRELAY_TOKEN", RIGHT_TOKEN)],
    )
    .await;
    assert!(matches!(
        relay_info(&relay, Some(WRONG_TOKEN)).await,
        Some(Message::Error(_))
    ));
    let log = log_until(&relay, "missing or wrong bearer token").await;
    let mut n_objects = 0;
    for line in log.lines().filter(|line| !line.trim().is_empty()) {
        // The start-up banner naming the bound addresses is plain text for humans.
        if line.starts_with("kvrelay relay: ") {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|err| panic!("not JSON ({err}): {line:?}"));
        assert!(value.get("level").is_some(), "{line}");
        n_objects += 1;
    }
    assert!(n_objects >= 2, "{log}");
    assert!(!log.contains("s3cr3t"), "{log}");
}
