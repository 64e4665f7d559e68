//! `kvrelay demo --json` end to end (the binary, as a user runs it): every replica matches
//! its producer, and in the routing comparison the router's choices find more of the
//! prompts in cache than round robin and least-load routing on the same requests.

use std::process::Command;

#[test]
fn the_demo_checks_every_replica_and_shows_the_routing_value() {
    let chart = tempfile::tempdir().unwrap();
    let chart_path = chart.path().join("routing.svg");
    let output = Command::new(env!("CARGO_BIN_EXE_kvrelay"))
        .args([
            "demo",
            "--json",
            "--speed",
            "0",
            "--routing-requests",
            "300",
        ])
        .arg("--routing-chart")
        .arg(&chart_path)
        .output()
        .expect("the demo runs");
    assert!(
        output.status.success(),
        "demo failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    // A healthy run warns about nothing (its relays once watched card directories that
    // were deleted under them).
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        !stderr.contains(" WARN ") && !stderr.contains(" ERROR "),
        "the demo logged a warning: {stderr}"
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(report["ok"], true, "{report}");
    let policies = report["routing"]["policies"].as_array().unwrap();
    let cached = |name: &str| {
        policies
            .iter()
            .find(|line| line["policy"] == name)
            .and_then(|line| line["cached_tokens"].as_u64())
            .unwrap_or_else(|| panic!("policy {name} in {report}"))
    };
    for line in policies {
        assert_eq!(line["requests"], 300, "{line}");
        assert_eq!(
            line["prompt_tokens"], policies[0]["prompt_tokens"],
            "same requests"
        );
    }
    assert!(
        cached("kvrelay") > cached("round robin") && cached("kvrelay") > cached("least load"),
        "{}",
        report["routing"]
    );
    // The engines offload GPU evictions to host memory: routing that sees the host lanes
    // finds some of its prompts there.
    let kvrelay = policies
        .iter()
        .find(|line| line["policy"] == "kvrelay")
        .unwrap();
    assert!(
        kvrelay["host_tokens"].as_u64().unwrap() > 0,
        "{}",
        report["routing"]
    );
    let svg = std::fs::read_to_string(&chart_path).unwrap();
    assert_eq!(svg.matches("<rect").count(), 4);
    assert_eq!(report["routing_chart"], chart_path.display().to_string());
}
