//! `cargo xtask bench [--quick] [BENCH]`: runs criterion benchmarks and prints a summary,
//! then the figures examples (ckf percentiles/paired ratio/memory/accuracy, growth stall,
//! checkpoint cost, e2e loopback). `BENCH` is a criterion bench target (its figures
//! example, if any, runs after it) or a figures example alone: `ckf-figures`,
//! `growth-stall`, `checkpoint`, `e2e`; or `fleet`, the
//! fleet-scale query benchmark (`--quick`, `--json FILE`, `--dcs 4,16,64`); or `stream`,
//! the multi-process stream benchmark of `benches/` (engines → `kvrelay relay` →
//! consumer; docs/benchmarks.md),
//! whose other arguments are passed to its driver (`--runs paced,low,flat`, `--seconds N`,
//! `--relay-limits key=value,..`).
//!
//! Every benchmark group measures its own baseline (ids starting with `baseline`) in the
//! same run, so the summary reports ratios that survive a noisy, shared machine:
//! `ratio = baseline time per element / our time per element` (above 1: faster than the
//! baseline; whole iterations are compared when the two declare different amounts of work).
//! Results are read from criterion's `target/criterion/**/new/*.json`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};
use serde::Deserialize;

use crate::command::{self, cargo_bin, workspace_root};

/// An example binary that prints one JSON object of figures, run after criterion and
/// rendered as a table (for what criterion cannot give: percentiles, paired ratios,
/// memory and accuracy, end-to-end runs).
struct FiguresExample {
    /// The `cargo xtask bench` target naming it alone.
    target: &'static str,
    /// Also run after this criterion bench target when it is run alone.
    with_bench: Option<&'static str>,
    package: &'static str,
    example: &'static str,
    /// Arguments for a full and for a `--quick` run.
    args: &'static [&'static str],
    quick_args: &'static [&'static str],
    title: &'static str,
}

const FIGURES_EXAMPLES: [FiguresExample; 4] = [
    FiguresExample {
        target: "ckf-figures",
        with_bench: Some("ckf"),
        package: "kvrelay-ckf",
        example: "ckf_figures",
        args: &[],
        quick_args: &["--quick"],
        title: "ckf figure (paired apply ratio, query percentiles, memory, accuracy)",
    },
    // Score latency while a new replica grows its query table (prepared vs write lock).
    FiguresExample {
        target: "growth-stall",
        with_bench: Some("score"),
        package: "kvrelay-consumer",
        example: "growth_stall",
        args: &[],
        quick_args: &["--quick"],
        title: "score while a query table grows (consumer)",
    },
    // What a pool checkpoint costs (actor export, encode, write + fsync, read, decode,
    // restore) at 1 M mappings.
    FiguresExample {
        target: "checkpoint",
        with_bench: Some("publication"),
        package: "kvrelay-pool",
        example: "checkpoint_cost",
        args: &[],
        quick_args: &["--quick"],
        title: "pool checkpoint cost (1 M mappings; 200 k quick)",
    },
    // The end-to-end loopback benchmark (ingest → actor → WAN → replica).
    FiguresExample {
        target: "e2e",
        with_bench: None,
        package: "kvrelay-benches",
        example: "e2e_bench",
        args: &["50000"],
        quick_args: &["20000"],
        title: "e2e figure (loopback)",
    },
];

/// Runs the benchmarks then prints the summary table.
pub(crate) fn run(args: &[String]) -> Result<()> {
    let quick = args.iter().any(|a| a == "--quick");
    if args.iter().any(|a| a == "dynamo") {
        // The stream benchmark's opt-in runs through kvrelay's gRPC door and Dynamo's
        // relay (its wheel lives in the interop venv).
        crate::interop::ensure()?;
        let root = workspace_root();
        let mut rest: Vec<String> = args.iter().filter(|a| *a != "dynamo").cloned().collect();
        rest.extend([
            "--runs".to_owned(),
            "dynamo-paced,dynamo-flat,dynamo-burst".to_owned(),
            "--python".to_owned(),
            crate::interop::python().display().to_string(),
            "--dynamo-scripts".to_owned(),
            root.join("benches").join("dynamo").display().to_string(),
        ]);
        let summary = run_stream(&rest)?;
        print!("{summary}");
        return write_summary(&summary);
    }
    if args.iter().any(|a| a == "fleet") {
        let rest: Vec<String> = args.iter().filter(|a| *a != "fleet").cloned().collect();
        let summary = run_fleet(&rest)?;
        print!("{summary}");
        return write_summary(&summary);
    }
    if args.iter().any(|a| a == "stream") {
        let rest: Vec<String> = args.iter().filter(|a| *a != "stream").cloned().collect();
        let summary = run_stream(&rest)?;
        print!("{summary}");
        return write_summary(&summary);
    }
    let bench_target = args.iter().find(|a| !a.starts_with("--")).cloned();
    let mut summary = String::new();
    if let Some(figures) = FIGURES_EXAMPLES
        .iter()
        .find(|f| bench_target.as_deref() == Some(f.target))
    {
        summary.push_str(&run_figures(figures, quick)?);
        print!("{summary}");
        return write_summary(&summary);
    }
    let criterion_dir = workspace_root().join("target").join("criterion");
    // Stale results from an earlier run must not leak into this run's table.
    if criterion_dir.exists() {
        std::fs::remove_dir_all(&criterion_dir)
            .with_context(|| format!("removing {}", criterion_dir.display()))?;
    }
    let mut cargo_args: Vec<String> = vec!["bench".into(), "--workspace".into(), "--locked".into()];
    cargo_args.push("--bench".into());
    cargo_args.push(bench_target.clone().unwrap_or_else(|| "*".into()));
    cargo_args.push("--".into());
    if quick {
        cargo_args.extend(
            ["--quick", "--warm-up-time", "1", "--measurement-time", "1"].map(String::from),
        );
        cargo_args.push("--noplot".into());
    } else {
        cargo_args.extend(
            ["--warm-up-time", "2", "--measurement-time", "5", "--noplot"].map(String::from),
        );
    }
    command::run(
        Command::new(cargo_bin())
            .args(&cargo_args)
            .current_dir(workspace_root()),
        &format!("cargo {}", cargo_args.join(" ")),
    )?;
    let results = collect(&criterion_dir)?;
    summary.push_str(&render(&results));
    for figures in &FIGURES_EXAMPLES {
        let wanted = match bench_target.as_deref() {
            None => true,
            Some(target) => figures.with_bench == Some(target),
        };
        if wanted {
            summary.push_str(&run_figures(figures, quick)?);
        }
    }
    print!("{summary}");
    write_summary(&summary)
}

fn write_summary(summary: &str) -> Result<()> {
    let summary_path = workspace_root().join("target").join("bench-summary.md");
    std::fs::write(&summary_path, summary)
        .with_context(|| format!("writing {}", summary_path.display()))?;
    eprintln!("summary written to {}", summary_path.display());
    Ok(())
}

/// The trace the stream benchmark replays (outside the repository, see STYLE/traces).
const STREAM_TRACE: &str = "../shared/traces/mooncake-synthetic.jsonl";

/// A benchmark driver of `benches/` that replays the trace: built with `build_packages`,
/// run with `--trace` and `driver_args` then the user's arguments; it prints progress on
/// stderr and its table on stdout.
struct TraceDriver {
    binary: &'static str,
    /// `-p` packages to build (their binaries).
    build_packages: &'static [&'static str],
    title: &'static str,
}

/// Builds and runs `driver`; returns its titled table.
fn run_trace_driver(driver: &TraceDriver, driver_args: &[&str], args: &[String]) -> Result<String> {
    let root = workspace_root();
    let mut build = vec!["build", "--release", "--locked"];
    for package in driver.build_packages {
        build.extend(["-p", package]);
    }
    build.push("--bins");
    command::cargo(&build)?;
    let target_dir =
        std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let binary = target_dir.join("release").join(driver.binary);
    let trace = root.join(STREAM_TRACE);
    if !trace.is_file() {
        anyhow::bail!("{} needs the trace {}", driver.binary, trace.display());
    }
    eprintln!("==> {}", binary.display());
    let output = Command::new(&binary)
        .arg("--trace")
        .arg(&trace)
        .args(driver_args)
        .args(args)
        .current_dir(&root)
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", binary.display()))?;
    if !output.status.success() {
        anyhow::bail!("{} failed with {}", driver.binary, output.status);
    }
    Ok(format!(
        "\n{}\n{}",
        driver.title,
        String::from_utf8_lossy(&output.stdout)
    ))
}

/// `cargo xtask bench fleet [--quick] [--json FILE] [--dcs 4,16,64]`: the fleet-scale
/// query benchmark (`benches/src/bin/fleet-bench/`), one process, against the exact
/// index built in the same run.
fn run_fleet(args: &[String]) -> Result<String> {
    let driver = TraceDriver {
        binary: "fleet-bench",
        build_packages: &["kvrelay-benches"],
        title: "fleet benchmark (query table vs exact index, same run)",
    };
    run_trace_driver(&driver, &[], args)
}

/// Builds the relay binary and the stream benchmark's processes, then runs its driver
/// (which writes `target/stream-bench.json`).
fn run_stream(args: &[String]) -> Result<String> {
    let driver = TraceDriver {
        binary: "stream-bench",
        build_packages: &["kvrelay", "kvrelay-benches"],
        title: "stream benchmark (figures in target/stream-bench.json)",
    };
    let out_dir = workspace_root().join("target");
    let out_dir = out_dir.to_string_lossy();
    run_trace_driver(&driver, &["--out-dir", &out_dir], args)
}

/// Runs a figures example and renders its JSON object as a table.
fn run_figures(figures: &FiguresExample, quick: bool) -> Result<String> {
    let mut args = vec![
        "run",
        "--release",
        "--locked",
        "--quiet",
        "-p",
        figures.package,
        "--example",
        figures.example,
        "--",
    ];
    args.extend(if quick {
        figures.quick_args
    } else {
        figures.args
    });
    eprintln!("==> cargo {}", args.join(" "));
    let output = Command::new(cargo_bin())
        .args(&args)
        .current_dir(workspace_root())
        .stderr(std::process::Stdio::inherit())
        .output()
        .with_context(|| format!("running the {} example", figures.example))?;
    if !output.status.success() {
        anyhow::bail!(
            "the {} example failed with {}",
            figures.example,
            output.status
        );
    }
    let values: serde_json::Value = serde_json::from_slice(&output.stdout)
        .with_context(|| format!("parsing the {} example's output", figures.example))?;
    Ok(render_figures(figures.title, &values))
}

/// Renders a flat or nested JSON object of figures as `| title | value |` rows.
fn render_figures(title: &str, figures: &serde_json::Value) -> String {
    fn walk(prefix: &str, value: &serde_json::Value, rows: &mut Vec<(String, String)>) {
        match value {
            serde_json::Value::Object(map) => {
                for (key, inner) in map {
                    let name = if prefix.is_empty() {
                        key.clone()
                    } else {
                        format!("{prefix}.{key}")
                    };
                    walk(&name, inner, rows);
                }
            }
            serde_json::Value::String(text) => rows.push((prefix.to_owned(), text.clone())),
            other => rows.push((prefix.to_owned(), other.to_string())),
        }
    }
    let mut rows = Vec::new();
    walk("", figures, &mut rows);
    let mut out = format!("\n| {title} | value |\n|---|---|\n");
    for (name, value) in rows {
        out.push_str(&format!("| {name} | {value} |\n"));
    }
    out
}

/// One benchmark's figures.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BenchResult {
    pub(crate) group: String,
    pub(crate) function: String,
    pub(crate) value: Option<String>,
    pub(crate) mean_ns: f64,
    pub(crate) throughput: Option<Throughput>,
}

/// Criterion's throughput declaration.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub(crate) enum Throughput {
    Bytes(u64),
    BytesDecimal(u64),
    Elements(u64),
}

impl Throughput {
    fn amount(self) -> u64 {
        match self {
            Self::Bytes(n) | Self::BytesDecimal(n) | Self::Elements(n) => n,
        }
    }
}

#[derive(Debug, Deserialize)]
struct BenchmarkJson {
    group_id: String,
    function_id: Option<String>,
    value_str: Option<String>,
    throughput: Option<Throughput>,
}

#[derive(Debug, Deserialize)]
struct EstimatesJson {
    mean: Estimate,
}

#[derive(Debug, Deserialize)]
struct Estimate {
    point_estimate: f64,
}

fn collect(criterion_dir: &Path) -> Result<Vec<BenchResult>> {
    let mut results = Vec::new();
    let mut stack = vec![criterion_dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|n| n == "new") {
                    if let Some(result) = read_result(&path)? {
                        results.push(result);
                    }
                } else {
                    stack.push(path);
                }
            }
        }
    }
    results
        .sort_by(|a, b| (&a.group, &a.value, &a.function).cmp(&(&b.group, &b.value, &b.function)));
    Ok(results)
}

fn read_result(new_dir: &Path) -> Result<Option<BenchResult>> {
    let benchmark_path: PathBuf = new_dir.join("benchmark.json");
    let estimates_path: PathBuf = new_dir.join("estimates.json");
    if !benchmark_path.is_file() || !estimates_path.is_file() {
        return Ok(None);
    }
    let benchmark: BenchmarkJson = serde_json::from_slice(
        &std::fs::read(&benchmark_path)
            .with_context(|| format!("reading {}", benchmark_path.display()))?,
    )
    .with_context(|| format!("parsing {}", benchmark_path.display()))?;
    let estimates: EstimatesJson = serde_json::from_slice(
        &std::fs::read(&estimates_path)
            .with_context(|| format!("reading {}", estimates_path.display()))?,
    )
    .with_context(|| format!("parsing {}", estimates_path.display()))?;
    Ok(Some(BenchResult {
        group: benchmark.group_id,
        function: benchmark.function_id.unwrap_or_default(),
        value: benchmark.value_str,
        mean_ns: estimates.mean.point_estimate,
        throughput: benchmark.throughput,
    }))
}

/// Time per throughput element (or per iteration without a declared throughput).
fn ns_per_element(result: &BenchResult) -> f64 {
    match result.throughput {
        Some(t) if t.amount() > 0 => result.mean_ns / t.amount() as f64,
        _ => result.mean_ns,
    }
}

/// Whether a result is a baseline: its function id (or, for benches named only by a
/// parameter, its parameter) starts with `baseline`.
fn is_baseline(result: &BenchResult) -> bool {
    result.function.starts_with("baseline")
        || (result.function.is_empty()
            && result
                .value
                .as_deref()
                .is_some_and(|v| v.starts_with("baseline")))
}

/// The same-run baseline of `result`: same group, a baseline id, and the same parameter
/// value when the baseline has one.
fn baseline_for<'a>(result: &BenchResult, all: &'a [BenchResult]) -> Option<&'a BenchResult> {
    let candidates: Vec<&BenchResult> = all
        .iter()
        .filter(|r| r.group == result.group && is_baseline(r) && *r != result)
        .collect();
    candidates
        .iter()
        .find(|r| !r.function.is_empty() && r.value == result.value)
        .or_else(|| {
            candidates
                .iter()
                .find(|r| r.value.is_none() || r.function.is_empty())
        })
        .or_else(|| {
            if candidates.len() == 1 {
                candidates.first()
            } else {
                None
            }
        })
        .copied()
}

/// `baseline / ours`, per throughput element when both declare the same amount of work,
/// else per iteration (e.g. a one-card update against a full projection).
fn ratio(base: &BenchResult, result: &BenchResult) -> f64 {
    let same_amount = match (base.throughput, result.throughput) {
        (Some(a), Some(b)) => a.amount() == b.amount(),
        _ => true,
    };
    if same_amount {
        ns_per_element(base) / ns_per_element(result)
    } else {
        base.mean_ns / result.mean_ns
    }
}

fn format_time(ns: f64) -> String {
    if ns >= 1e9 {
        format!("{:.2} s", ns / 1e9)
    } else if ns >= 1e6 {
        format!("{:.2} ms", ns / 1e6)
    } else if ns >= 1e3 {
        format!("{:.2} µs", ns / 1e3)
    } else {
        format!("{ns:.1} ns")
    }
}

fn format_rate(result: &BenchResult) -> String {
    let Some(throughput) = result.throughput else {
        return "-".into();
    };
    let per_second = throughput.amount() as f64 / (result.mean_ns / 1e9);
    let (value, unit) = match throughput {
        Throughput::Bytes(_) | Throughput::BytesDecimal(_) => {
            (per_second / (1024.0 * 1024.0), "MiB/s")
        }
        Throughput::Elements(_) => (per_second / 1e6, "M elem/s"),
    };
    format!("{value:.2} {unit}")
}

/// Renders the results as a Markdown table.
pub(crate) fn render(results: &[BenchResult]) -> String {
    let mut out = String::from(
        "\n| group | benchmark | param | mean | throughput | vs baseline |\n|---|---|---|---|---|---|\n",
    );
    let mut groups: BTreeMap<&str, usize> = BTreeMap::new();
    for result in results {
        *groups.entry(result.group.as_str()).or_default() += 1;
        let ratio = if is_baseline(result) {
            "(baseline)".to_owned()
        } else {
            baseline_for(result, results).map_or_else(
                || "-".to_owned(),
                |base| format!("{:.2}×", ratio(base, result)),
            )
        };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            result.group,
            result.function,
            result.value.as_deref().unwrap_or(""),
            format_time(result.mean_ns),
            format_rate(result),
            ratio
        ));
    }
    out.push_str(&format!(
        "\n{} benchmarks in {} groups\n",
        results.len(),
        groups.len()
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(function: &str, value: Option<&str>, mean_ns: f64, elements: u64) -> BenchResult {
        BenchResult {
            group: "g".into(),
            function: function.into(),
            value: value.map(String::from),
            mean_ns,
            throughput: Some(Throughput::Elements(elements)),
        }
    }

    #[test]
    fn ratio_compares_time_per_element_against_the_same_parameter_baseline() {
        let results = vec![
            result("baseline-xxh3", Some("64"), 100.0, 64),
            result("ours", Some("64"), 125.0, 64),
            result("baseline-xxh3", Some("128"), 100.0, 128),
            result("ours", Some("128"), 50.0, 128),
        ];
        let table = render(&results);
        assert!(
            table.contains("| g | ours | 64 | 125.0 ns | 512.00 M elem/s | 0.80× |"),
            "{table}"
        );
        assert!(
            table.contains("| g | ours | 128 | 50.0 ns | 2560.00 M elem/s | 2.00× |"),
            "{table}"
        );
    }

    #[test]
    fn benches_named_by_parameter_find_their_baseline() {
        let mut base = result("", Some("baseline-msgpack"), 100.0, 10);
        base.group = "decode".into();
        let mut ours = result("", Some("decode"), 50.0, 10);
        ours.group = "decode".into();
        let table = render(&[base, ours]);
        assert!(table.contains("(baseline)"), "{table}");
        assert!(table.contains("2.00×"), "{table}");
    }

    #[test]
    fn different_amounts_of_work_compare_whole_iterations() {
        let results = vec![
            result("baseline-full", None, 1_000_000.0, 10_000),
            result("update", None, 1_000.0, 1),
        ];
        let table = render(&results);
        assert!(table.contains("1000.00×"), "{table}");
    }

    #[test]
    fn figures_render_as_rows_with_dotted_names() {
        let figures = serde_json::json!({"blocks_per_s": 1000.5, "latency": {"p50_us": 12}, "rate": "1.5e-5"});
        let table = render_figures("e2e figure", &figures);
        assert!(table.contains("| e2e figure | value |"), "{table}");
        assert!(table.contains("| rate | 1.5e-5 |"), "{table}");
        assert!(table.contains("| blocks_per_s | 1000.5 |"), "{table}");
        assert!(table.contains("| latency.p50_us | 12 |"), "{table}");
    }

    #[test]
    fn benchmark_without_baseline_shows_no_ratio() {
        let results = vec![BenchResult {
            group: "solo".into(),
            function: "alone".into(),
            value: None,
            mean_ns: 2_000.0,
            throughput: None,
        }];
        assert!(render(&results).contains("| solo | alone |  | 2.00 µs | - | - |"));
    }
}
