//! `cargo xtask tidy`: machine-checked house rules (STYLE.md rule 29).
//!
//! Each finding names a `file:line` and the STYLE.md rule it enforces. The same checks run
//! as a `#[test]` so `cargo test` alone catches a violation.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::command::{cargo_bin, workspace_root};

/// Runs every tidy check and fails listing all findings.
pub(crate) fn run() -> Result<()> {
    eprintln!("==> tidy (layering, purity, docs, hygiene, manifests)");
    let findings = check_all(&workspace_root())?;
    if findings.is_empty() {
        return Ok(());
    }
    for finding in &findings {
        eprintln!("{finding}");
    }
    bail!("tidy found {} problem(s)", findings.len())
}

/// One violated rule at one place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Finding {
    path: String,
    line: usize,
    rule: u8,
    message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}: [rule {}] {}",
            self.path, self.line, self.rule, self.message
        )
    }
}

/// A workspace crate's declared layer (`[package.metadata.kvrelay]`).
#[derive(Debug, Clone)]
struct CrateInfo {
    name: String,
    layer: String,
    rank: i64,
    manifest: PathBuf,
    /// Internal (`kvrelay*`) dependencies: (name, kind) where kind is normal/dev/build.
    internal_deps: Vec<(String, String)>,
}

fn check_all(root: &Path) -> Result<Vec<Finding>> {
    let crates = load_crates(root)?;
    let allow = load_allow_list(root)?;
    let mut findings = Vec::new();
    check_layering(root, &crates, &mut findings)?;
    check_purity(root, &crates, &mut findings)?;
    check_sources(root, &crates, &allow, &mut findings)?;
    check_file_lengths(root, &crates, &allow, &mut findings)?;
    check_public_names(root, &crates, &allow, &mut findings)?;
    check_manifests(root, &crates, &mut findings)?;
    check_generated(root, &mut findings)?;
    check_no_protoc_build(root, &mut findings)?;
    Ok(findings)
}

/// Checked-in generated code must be what `cargo xtask codegen` writes now.
fn check_generated(root: &Path, findings: &mut Vec<Finding>) -> Result<()> {
    for output in crate::codegen::stale_outputs(root)? {
        findings.push(Finding {
            path: output.to_owned(),
            line: 1,
            rule: 29,
            message: "generated code is stale: run `cargo xtask codegen` and commit the result"
                .into(),
        });
    }
    Ok(())
}

/// No crate the workspace builds (xtask aside) may depend, at any depth and of any kind,
/// on a crate whose build script compiles protobuf definitions: a fresh machine has no
/// `protoc`, and the generated code is checked in instead.
fn check_no_protoc_build(root: &Path, findings: &mut Vec<Finding>) -> Result<()> {
    let metadata = cargo_metadata(root, "--locked")?;
    for (member, offender) in protoc_build_paths(&metadata) {
        findings.push(Finding {
            path: "Cargo.lock".into(),
            line: 1,
            rule: 29,
            message: format!(
                "{member} depends on {offender}, whose build script compiles protobuf with protoc; \
                 check generated code in through `cargo xtask codegen` instead"
            ),
        });
    }
    Ok(())
}

/// (workspace member, protoc-running crate it reaches) pairs in a `cargo metadata` graph.
fn protoc_build_paths(metadata: &serde_json::Value) -> Vec<(String, String)> {
    use std::collections::{BTreeSet, HashMap};
    let name_of = |id: &str| -> String {
        metadata["packages"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["id"] == id)
            .and_then(|p| p["name"].as_str())
            .unwrap_or(id)
            .to_owned()
    };
    let mut edges: HashMap<&str, Vec<&str>> = HashMap::new();
    for node in metadata["resolve"]["nodes"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let Some(id) = node["id"].as_str() else {
            continue;
        };
        let deps = node["deps"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| d["pkg"].as_str())
            .collect();
        edges.insert(id, deps);
    }
    let mut found = BTreeSet::new();
    for member in metadata["workspace_members"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let Some(member) = member.as_str() else {
            continue;
        };
        let member_name = name_of(member);
        if member_name == "xtask" {
            continue;
        }
        let mut seen = std::collections::HashSet::new();
        let mut stack = vec![member];
        while let Some(id) = stack.pop() {
            if !seen.insert(id) {
                continue;
            }
            let name = name_of(id);
            if crate::codegen::PROTOC_BUILD_CRATES.contains(&name.as_str()) {
                found.insert((member_name.clone(), name));
            }
            stack.extend(edges.get(id).into_iter().flatten().copied());
        }
    }
    found.into_iter().collect()
}

fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// `cargo metadata --format-version 1 FLAG`, parsed.
fn cargo_metadata(root: &Path, flag: &str) -> Result<serde_json::Value> {
    let output = Command::new(cargo_bin())
        .args(["metadata", "--format-version", "1", flag])
        .current_dir(root)
        .output()
        .context("running cargo metadata")?;
    if !output.status.success() {
        bail!(
            "cargo metadata failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    serde_json::from_slice(&output.stdout).context("parsing cargo metadata output")
}

fn load_crates(root: &Path) -> Result<Vec<CrateInfo>> {
    let metadata = cargo_metadata(root, "--no-deps")?;
    let mut crates = Vec::new();
    for package in metadata["packages"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
    {
        let name = package["name"].as_str().unwrap_or_default().to_owned();
        let declared = &package["metadata"]["kvrelay"];
        let internal_deps = package["dependencies"]
            .as_array()
            .map(Vec::as_slice)
            .unwrap_or_default()
            .iter()
            .filter_map(|dep| {
                let dep_name = dep["name"].as_str()?;
                dep_name.starts_with("kvrelay").then(|| {
                    (
                        dep_name.to_owned(),
                        dep["kind"].as_str().unwrap_or("normal").to_owned(),
                    )
                })
            })
            .collect();
        crates.push(CrateInfo {
            name,
            layer: declared["layer"].as_str().unwrap_or_default().to_owned(),
            rank: declared["rank"].as_i64().unwrap_or(-1),
            manifest: PathBuf::from(package["manifest_path"].as_str().unwrap_or_default()),
            internal_deps,
        });
    }
    crates.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(crates)
}

/// `xtask/tidy-allow.txt`: `path<TAB or spaces>pattern  # reason` lines that exempt a file
/// from a hygiene check.
fn load_allow_list(root: &Path) -> Result<Vec<(String, String)>> {
    let path = root.join("xtask").join("tidy-allow.txt");
    if !path.exists() {
        return Ok(Vec::new());
    }
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let mut allow = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let mut parts = line.split_whitespace();
        if let (Some(file), Some(pattern)) = (parts.next(), parts.next()) {
            allow.push((file.to_owned(), pattern.to_owned()));
        }
    }
    Ok(allow)
}

fn check_layering(root: &Path, crates: &[CrateInfo], findings: &mut Vec<Finding>) -> Result<()> {
    let by_name: BTreeMap<&str, &CrateInfo> = crates.iter().map(|c| (c.name.as_str(), c)).collect();
    for info in crates.iter().filter(|c| c.name != "xtask") {
        let manifest = relative(root, &info.manifest);
        if !matches!(info.layer.as_str(), "pure" | "async" | "bin") || info.rank < 0 {
            findings.push(Finding {
                path: manifest.clone(),
                line: 1,
                rule: 2,
                message: format!(
                    "crate {} must declare [package.metadata.kvrelay] layer (pure/async/bin) and rank",
                    info.name
                ),
            });
            continue;
        }
        for (dep, kind) in &info.internal_deps {
            let Some(target) = by_name.get(dep.as_str()) else {
                continue;
            };
            if target.rank >= info.rank {
                findings.push(Finding {
                    path: manifest.clone(),
                    line: 1,
                    rule: 2,
                    message: format!(
                        "{} (rank {}) has a {kind} dependency on {dep} (rank {}): edges must point to lower ranks",
                        info.name, info.rank, target.rank
                    ),
                });
            }
            if info.layer == "pure" && kind == "normal" && target.layer != "pure" {
                findings.push(Finding {
                    path: manifest.clone(),
                    line: 1,
                    rule: 2,
                    message: format!(
                        "pure crate {} depends on {} crate {dep}",
                        info.name, target.layer
                    ),
                });
            }
        }
    }
    let architecture = root.join("ARCHITECTURE.md");
    let text = std::fs::read_to_string(&architecture)
        .with_context(|| format!("reading {}", architecture.display()))?;
    for info in crates.iter().filter(|c| c.name != "xtask") {
        let row = text
            .lines()
            .enumerate()
            .find(|(_, line)| line.starts_with('|') && line.contains(&format!("`{}`", info.name)));
        match row {
            None => findings.push(Finding {
                path: "ARCHITECTURE.md".into(),
                line: 1,
                rule: 2,
                message: format!("the crate table has no row for `{}`", info.name),
            }),
            Some((idx, line)) => {
                let cells: Vec<&str> = line.split('|').map(str::trim).collect();
                let layer_ok = cells.iter().any(|c| *c == info.layer);
                let rank_ok = cells.iter().any(|c| *c == info.rank.to_string());
                if !layer_ok || !rank_ok {
                    findings.push(Finding {
                        path: "ARCHITECTURE.md".into(),
                        line: idx + 1,
                        rule: 2,
                        message: format!(
                            "row for `{}` must show layer {} and rank {} as in its Cargo.toml",
                            info.name, info.layer, info.rank
                        ),
                    });
                }
            }
        }
    }
    Ok(())
}

/// A blocking sleep call, spelled in pieces so this file does not flag itself.
const SLEEP_CALL: &str = concat!("thread::", "sleep(");

/// Source patterns a pure crate must not contain outside feature-gated shells.
const IMPURE_PATTERNS: &[&str] = &[
    "tokio::",
    "std::fs",
    "std::net",
    "Instant::now",
    "SystemTime::now",
    concat!("thread::", "sleep"),
    "thread_rng",
    "rand::rng",
];

fn check_purity(root: &Path, crates: &[CrateInfo], findings: &mut Vec<Finding>) -> Result<()> {
    for info in crates.iter().filter(|c| c.layer == "pure") {
        let output = Command::new(cargo_bin())
            .args([
                "tree",
                "-e",
                "normal",
                "--no-default-features",
                "--prefix",
                "none",
                "-p",
                &info.name,
            ])
            .current_dir(root)
            .output()
            .with_context(|| format!("running cargo tree for {}", info.name))?;
        let tree = String::from_utf8_lossy(&output.stdout);
        for banned in ["tokio ", "mio ", "socket2 "] {
            if tree.lines().any(|line| line.starts_with(banned)) {
                findings.push(Finding {
                    path: relative(root, &info.manifest),
                    line: 1,
                    rule: 10,
                    message: format!(
                        "pure crate {} pulls in {} without default features",
                        info.name,
                        banned.trim()
                    ),
                });
            }
        }
        let src = info
            .manifest
            .parent()
            .map(|dir| dir.join("src"))
            .unwrap_or_default();
        let files = rust_files(&src)?;
        let gated = gated_module_paths(&files)?;
        for file in files {
            if gated.iter().any(|gate| file.starts_with(gate)) {
                continue;
            }
            let text = read(&file)?;
            if text.contains("#![cfg(feature") || text.contains("#![cfg(test") {
                continue;
            }
            let lines = code_lines(&text).take_while(|(_, line)| !starts_test_module(line));
            for (idx, line) in lines {
                for pattern in IMPURE_PATTERNS {
                    if line.contains(pattern) {
                        findings.push(Finding {
                            path: relative(root, &file),
                            line: idx + 1,
                            rule: 10,
                            message: format!("pure crate source uses `{pattern}`"),
                        });
                    }
                }
            }
        }
    }
    Ok(())
}

/// Files and directories of modules declared under `#[cfg(feature = ..)]` or
/// `#[cfg(test)]`: the feature-gated shells and tests that purity does not apply to.
fn gated_module_paths(files: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut gated = Vec::new();
    for file in files {
        let text = read(file)?;
        let Some(dir) = file.parent() else { continue };
        let stem = file
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default();
        let module_dir = if matches!(stem, "lib" | "main" | "mod") {
            dir.to_path_buf()
        } else {
            dir.join(stem)
        };
        let lines: Vec<&str> = text.lines().map(str::trim).collect();
        for (idx, line) in lines.iter().enumerate() {
            let Some(name) = declared_module(line) else {
                continue;
            };
            let mut attributes = lines[..idx]
                .iter()
                .rev()
                .take_while(|l| l.starts_with("#["));
            if attributes.any(|a| a.starts_with("#[cfg(feature") || a.starts_with("#[cfg(test")) {
                gated.push(module_dir.join(format!("{name}.rs")));
                gated.push(module_dir.join(name));
            }
        }
    }
    Ok(gated)
}

/// The module name of a `mod name;` declaration (any visibility).
fn declared_module(line: &str) -> Option<&str> {
    let declaration = line.strip_suffix(';')?;
    let (prefix, name) = declaration.split_once("mod ")?;
    let prefix = prefix.trim();
    (prefix.is_empty() || prefix.starts_with("pub")).then_some(name.trim())
}

/// Whether a line opens an inline test module (`mod tests {`); purity checks stop there.
fn starts_test_module(line: &str) -> bool {
    let trimmed = line.trim();
    trimmed.starts_with("mod tests") && trimmed.ends_with('{')
}

fn check_sources(
    root: &Path,
    crates: &[CrateInfo],
    allow: &[(String, String)],
    findings: &mut Vec<Finding>,
) -> Result<()> {
    let allowed = |path: &str, pattern: &str| allow.iter().any(|(f, p)| f == path && p == pattern);
    let architecture = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap_or_default();
    for info in crates {
        let Some(crate_dir) = info.manifest.parent() else {
            continue;
        };
        let is_library = info.layer == "pure" || info.layer == "async";
        if info.name != "xtask" && !architecture.contains(&info.name) {
            findings.push(Finding {
                path: "ARCHITECTURE.md".into(),
                line: 1,
                rule: 29,
                message: format!("ARCHITECTURE.md does not mention {}", info.name),
            });
        }
        for file in rust_files(&crate_dir.join("src"))? {
            let text = read(&file)?;
            let rel = relative(root, &file);
            let first = text
                .lines()
                .find(|line| !line.trim().is_empty())
                .unwrap_or_default();
            if !first.starts_with("//!") {
                findings.push(Finding {
                    path: rel.clone(),
                    line: 1,
                    rule: 28,
                    message: "source file must start with `//!` module docs".into(),
                });
            }
            check_markers(&rel, &text, findings);
            if is_library {
                for (idx, line) in code_lines(&text) {
                    for banned in ["dbg!(", "todo!(", "unimplemented!(", "println!("] {
                        if line.contains(banned) && !allowed(&rel, banned) {
                            findings.push(Finding {
                                path: rel.clone(),
                                line: idx + 1,
                                rule: 29,
                                message: format!("library code must not use `{banned}`"),
                            });
                        }
                    }
                }
            }
            check_test_hygiene(&rel, &text, &allowed, findings);
        }
        for dir in ["tests", "benches"] {
            for file in rust_files(&crate_dir.join(dir))? {
                let text = read(&file)?;
                let rel = relative(root, &file);
                check_markers(&rel, &text, findings);
                check_test_hygiene(&rel, &text, &allowed, findings);
            }
        }
    }
    Ok(())
}

/// Longest file, in code lines before its test module, without an allow-list entry.
const MAX_CODE_LINES: usize = 600;

/// Whether `rel` is generated code (checked against its generator, not read by people).
fn is_generated(rel: &str) -> bool {
    rel.ends_with("/generated.rs") || rel.contains("/generated/")
}

/// Non-blank, non-comment lines before the file's test module: what a reader must read.
fn code_lines_before_tests(text: &str) -> usize {
    code_lines(text)
        .take_while(|(_, line)| !starts_test_module(line))
        .filter(|(_, line)| !line.trim().is_empty())
        .count()
}

/// Rule 30: a source file over [`MAX_CODE_LINES`] lines of code before its tests needs an
/// allow-list entry (`path long-file # reason`): split it by job instead, where possible.
fn check_file_lengths(
    root: &Path,
    crates: &[CrateInfo],
    allow: &[(String, String)],
    findings: &mut Vec<Finding>,
) -> Result<()> {
    for info in crates {
        let Some(crate_dir) = info.manifest.parent() else {
            continue;
        };
        for file in rust_files(&crate_dir.join("src"))? {
            let rel = relative(root, &file);
            let test_file = rel.ends_with("/tests.rs") || rel.ends_with("_tests.rs");
            if is_generated(&rel)
                || test_file
                || allow.iter().any(|(f, p)| *f == rel && p == "long-file")
            {
                continue;
            }
            let n_lines = code_lines_before_tests(&read(&file)?);
            if n_lines > MAX_CODE_LINES {
                findings.push(Finding {
                    path: rel,
                    line: 1,
                    rule: 30,
                    message: format!(
                        "{n_lines} lines of code before the tests (at most {MAX_CODE_LINES}): \
                         split it by job, or add `long-file` with a reason to xtask/tidy-allow.txt"
                    ),
                });
            }
        }
    }
    Ok(())
}

/// The name a line declares as a public type (`pub struct|enum|trait Name`), if any.
fn public_type_name(line: &str) -> Option<&str> {
    let rest = line.trim_start().strip_prefix("pub ")?;
    let rest = ["struct ", "enum ", "trait "]
        .iter()
        .find_map(|keyword| rest.strip_prefix(keyword))?;
    let end = rest
        .find(|c: char| !(c.is_alphanumeric() || c == '_'))
        .unwrap_or(rest.len());
    (end > 0).then(|| &rest[..end])
}

/// Names every crate may declare for its own: its TOML table and its configuration errors
/// (read as `kvrelay_ingest::Limits`, `kvrelay_pool::Limits`: one concept per crate).
const CRATE_SCOPED_NAMES: &[&str] = &["Limits", "LimitsError", "ConfigError"];

/// The codec's wire messages: each mirrors the domain type it carries under the same name
/// on purpose (`v1::PoolId` is the wire form of `kvrelay_identity::PoolId`), converted at
/// one seam.
const WIRE_MIRRORS: &str = "crates/kvrelay-codec/src/v1/";

/// Rule 31: one name per concept. A public type name declared by two crates needs an
/// allow-list entry `path pub-name:Name # reason` for every declaring file but one.
fn check_public_names(
    root: &Path,
    crates: &[CrateInfo],
    allow: &[(String, String)],
    findings: &mut Vec<Finding>,
) -> Result<()> {
    // name → (crate, file, line) of every declaration outside tests and generated code.
    let mut declared: std::collections::BTreeMap<String, Vec<(String, String, usize)>> =
        std::collections::BTreeMap::new();
    for info in crates.iter().filter(|c| c.layer != "bin") {
        let Some(crate_dir) = info.manifest.parent() else {
            continue;
        };
        for file in rust_files(&crate_dir.join("src"))? {
            let rel = relative(root, &file);
            if is_generated(&rel) || rel.starts_with(WIRE_MIRRORS) {
                continue;
            }
            let text = read(&file)?;
            if text.contains("#![cfg(test") {
                continue;
            }
            for (idx, line) in code_lines(&text).take_while(|(_, line)| !starts_test_module(line)) {
                if let Some(name) = public_type_name(line)
                    && !CRATE_SCOPED_NAMES.contains(&name)
                {
                    declared.entry(name.to_owned()).or_default().push((
                        info.name.clone(),
                        rel.clone(),
                        idx + 1,
                    ));
                }
            }
        }
    }
    for (name, places) in declared {
        let mut crates_declaring: Vec<&str> = places.iter().map(|(c, _, _)| c.as_str()).collect();
        crates_declaring.dedup();
        if crates_declaring.len() < 2 {
            continue;
        }
        let pattern = format!("pub-name:{name}");
        let unexcused: Vec<_> = places
            .iter()
            .filter(|(_, rel, _)| !allow.iter().any(|(f, p)| f == rel && *p == pattern))
            .collect();
        if unexcused.len() < 2 {
            continue;
        }
        for (krate, rel, line) in unexcused {
            findings.push(Finding {
                path: rel.clone(),
                line: *line,
                rule: 31,
                message: format!(
                    "public type `{name}` is also declared by another crate ({}): one name per \
                     concept (rename one, or add `{pattern}` with a reason to xtask/tidy-allow.txt)",
                    crates_declaring
                        .iter()
                        .filter(|other| *other != krate)
                        .copied()
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            });
        }
    }
    Ok(())
}

/// `TODO`/`FIXME`/`XXX` need an issue reference like `(#12)`.
fn check_markers(rel: &str, text: &str, findings: &mut Vec<Finding>) {
    for (idx, line) in text.lines().enumerate() {
        // Spelled in pieces so this file does not flag itself.
        for marker in [
            concat!("TO", "DO"),
            concat!("FIX", "ME"),
            concat!("X", "XX"),
        ] {
            if let Some(pos) = line.find(marker)
                && !line[pos..].contains("(#")
            {
                findings.push(Finding {
                    path: rel.to_owned(),
                    line: idx + 1,
                    rule: 29,
                    message: format!("`{marker}` without an issue reference `(#N)`"),
                });
            }
        }
    }
}

fn check_test_hygiene(
    rel: &str,
    text: &str,
    allowed: &dyn Fn(&str, &str) -> bool,
    findings: &mut Vec<Finding>,
) {
    for (idx, line) in code_lines(text) {
        for banned in [
            concat!("#[ig", "nore"),
            concat!("#[should", "_panic"),
            SLEEP_CALL,
        ] {
            if line.contains(banned) && !allowed(rel, banned) {
                findings.push(Finding {
                    path: rel.to_owned(),
                    line: idx + 1,
                    rule: 26,
                    message: format!(
                        "`{banned}` is banned (waiting must use signals; see STYLE rule 25)"
                    ),
                });
            }
        }
    }
}

fn check_manifests(root: &Path, crates: &[CrateInfo], findings: &mut Vec<Finding>) -> Result<()> {
    for info in crates {
        let text = read(&info.manifest)?;
        let manifest: toml::Value = toml::from_str(&text)
            .with_context(|| format!("parsing {}", info.manifest.display()))?;
        let rel = relative(root, &info.manifest);
        if manifest
            .get("lints")
            .and_then(|l| l.get("workspace"))
            .and_then(toml::Value::as_bool)
            != Some(true)
        {
            findings.push(Finding {
                path: rel.clone(),
                line: 1,
                rule: 1,
                message: "crate must set `[lints] workspace = true`".into(),
            });
        }
        for table in ["dependencies", "dev-dependencies", "build-dependencies"] {
            let Some(deps) = manifest.get(table).and_then(toml::Value::as_table) else {
                continue;
            };
            for (name, spec) in deps {
                let uses_workspace =
                    spec.get("workspace").and_then(toml::Value::as_bool) == Some(true);
                if !uses_workspace {
                    let line = text
                        .lines()
                        .position(|l| l.trim_start().starts_with(name.as_str()))
                        .map_or(1, |i| i + 1);
                    findings.push(Finding {
                        path: rel.clone(),
                        line,
                        rule: 1,
                        message: format!("[{table}] {name} must use `workspace = true`"),
                    });
                }
            }
        }
    }
    let root_manifest = read(&root.join("Cargo.toml"))?;
    for lint in ["unwrap_used", "expect_used", "panic"] {
        if !root_manifest
            .lines()
            .any(|l| l.starts_with(lint) && l.contains("deny"))
        {
            findings.push(Finding {
                path: "Cargo.toml".into(),
                line: 1,
                rule: 20,
                message: format!("[workspace.lints.clippy] must deny {lint}"),
            });
        }
    }
    Ok(())
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// Lines that are not comments (so docs may mention banned patterns).
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines().enumerate().filter(|(_, line)| {
        let trimmed = line.trim_start();
        !(trimmed.starts_with("//") || trimmed.starts_with("*") || trimmed.starts_with("/*"))
    })
}

fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    if !dir.is_dir() {
        return Ok(files);
    }
    let mut stack = vec![dir.to_path_buf()];
    while let Some(current) = stack.pop() {
        let entries = std::fs::read_dir(&current)
            .with_context(|| format!("reading {}", current.display()))?;
        for entry in entries {
            let path = entry
                .with_context(|| format!("reading {}", current.display()))?
                .path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|ext| ext == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_type_names_are_read_from_declarations_only() {
        assert_eq!(
            public_type_name("pub struct Readiness {"),
            Some("Readiness")
        );
        assert_eq!(
            public_type_name("    pub enum SourceState {"),
            Some("SourceState")
        );
        assert_eq!(
            public_type_name("pub trait Discovery: Send"),
            Some("Discovery")
        );
        assert_eq!(public_type_name("pub struct Pair<T>(T);"), Some("Pair"));
        assert_eq!(public_type_name("pub(crate) struct Hidden;"), None);
        assert_eq!(public_type_name("struct Private;"), None);
        assert_eq!(public_type_name("pub fn struct_like() {}"), None);
    }

    #[test]
    fn file_length_counts_code_before_the_tests_only() {
        let text = "//! docs\n\nfn a() {}\n// comment\nfn b() {}\n#[cfg(test)]\nmod tests {\nfn t() {}\n}\n";
        // `fn a`, `fn b` and the `#[cfg(test)]` attribute; comments, blanks and tests not.
        assert_eq!(code_lines_before_tests(text), 3);
        assert!(is_generated("crates/x/src/etcd/generated.rs"));
        assert!(!is_generated("crates/x/src/etcd/client.rs"));
    }

    #[test]
    fn workspace_passes_tidy() {
        let findings = check_all(&workspace_root()).expect("tidy checks run");
        let listing: Vec<String> = findings.iter().map(ToString::to_string).collect();
        assert!(
            findings.is_empty(),
            "tidy findings:\n{}",
            listing.join("\n")
        );
    }

    #[test]
    fn protoc_build_crates_are_found_at_any_depth_except_under_xtask() {
        let metadata = serde_json::json!({
            "packages": [
                {"id": "a", "name": "kvrelay-a"}, {"id": "b", "name": "middle"},
                {"id": "p", "name": "prost-build"}, {"id": "x", "name": "xtask"},
                {"id": "t", "name": "tonic-prost-build"}
            ],
            "workspace_members": ["a", "x"],
            "resolve": {"nodes": [
                {"id": "a", "deps": [{"pkg": "b"}]}, {"id": "b", "deps": [{"pkg": "p"}]},
                {"id": "p", "deps": []}, {"id": "x", "deps": [{"pkg": "t"}]},
                {"id": "t", "deps": [{"pkg": "p"}]}
            ]}
        });
        assert_eq!(
            protoc_build_paths(&metadata),
            vec![("kvrelay-a".to_owned(), "prost-build".to_owned())]
        );
    }

    #[test]
    fn module_declarations_are_recognised_with_any_visibility() {
        assert_eq!(declared_module("mod watch;"), Some("watch"));
        assert_eq!(declared_module("pub(crate) mod etcd;"), Some("etcd"));
        assert_eq!(declared_module("mod tests {"), None);
        assert_eq!(declared_module("let model = 1;"), None);
    }

    #[test]
    fn feature_gated_modules_are_exempt_from_purity() {
        let dir = std::env::temp_dir().join(format!("xtask-tidy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let lib = dir.join("lib.rs");
        std::fs::write(
            &lib,
            "//! x\n#[cfg(feature = \"watch\")]\nmod watch;\nmod core;\n",
        )
        .unwrap();
        let gated = gated_module_paths(&[lib]).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(gated.contains(&dir.join("watch.rs")));
        assert!(gated.contains(&dir.join("watch")));
        assert!(!gated.contains(&dir.join("core.rs")));
    }

    #[test]
    fn marker_without_issue_reference_is_reported() {
        let mut findings = Vec::new();
        check_markers(
            "a.rs",
            "let x = 1; // TODO fix\n// TODO(#4) tracked\n",
            &mut findings,
        );
        assert_eq!(findings.len(), 1);
        assert_eq!(findings[0].line, 1);
        assert_eq!(findings[0].rule, 29);
    }

    #[test]
    fn sleeping_test_is_reported_unless_allowed() {
        let mut findings = Vec::new();
        let text = format!("fn t() {{ std::{SLEEP_CALL}d); }}\n");
        check_test_hygiene("t.rs", &text, &|_, _| false, &mut findings);
        assert_eq!(findings.len(), 1);
        findings.clear();
        check_test_hygiene("t.rs", &text, &|_, _| true, &mut findings);
        assert!(findings.is_empty());
    }
}
