//! Cross-crate benchmarks of kvrelay.
//!
//! - `examples/e2e_bench.rs`: in-process loopback figures (ingest → pool actor → WAN →
//!   replica), `cargo xtask bench e2e`.
//! - The stream benchmark (`cargo xtask bench stream [--quick]`): separate processes, as a
//!   deployment runs them. `stream-engine` (N of them) replays its share of a request trace
//!   through a simulated vLLM prefix cache and publishes vLLM msgpack batches on ZMQ PUB
//!   with a replay ROUTER; a real `kvrelay relay` ingests them; `stream-follower` follows
//!   the pool with `kvrelay_consumer::Consumer`; `stream-bench` starts them all, paces the
//!   runs and prints the table (see docs/benchmarks.md).
//!
//! This library holds what the processes share: the engine cache simulation ([`sim`]), the
//! probe-stamp line format ([`stamps`]), percentiles, `/proc` memory figures and a minimal
//! HTTP GET for the relay's admin endpoints.

pub mod events;
pub mod sim;
pub mod stamps;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Tokens per block of the simulated engines (vLLM's default).
pub const BLOCK_SIZE: u32 = 16;
/// Tokens per block of the trace's `hash_ids` (the Mooncake release uses 512).
pub const TRACE_BLOCK_TOKENS: u32 = 512;
/// Seed of the synthesized block tokens (the relay's workload seed, so the tokens a
/// consumer scores are the ones the engines published).
pub const TOKEN_SEED: u64 = 0x6b76_7265_6c61_7931;
/// Model name of the benchmark's cards.
pub const MODEL: &str = "bench-model";
/// The ZMQ topic vLLM publishes KV events on.
pub const TOPIC: &[u8] = b"kv-events";

/// The `p`-quantile (0..=1) of sorted `values`, `None` when empty.
pub fn percentile(sorted: &[f64], p: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = ((sorted.len() as f64 - 1.0) * p.clamp(0.0, 1.0)).round() as usize;
    sorted.get(rank.min(sorted.len() - 1)).copied()
}

/// Peak and current resident memory of a process, bytes (`/proc/<pid>/status` VmHWM and
/// VmRSS).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Memory {
    /// Peak resident set (VmHWM).
    pub peak_bytes: u64,
    /// Resident set now (VmRSS).
    pub current_bytes: u64,
}

/// Reads [`Memory`] of `pid`; `None` when the process is gone or not on Linux.
pub fn process_memory(pid: u32) -> Option<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|line| line.starts_with(name))?;
        let kb: u64 = line
            .trim_start_matches(name)
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()?;
        Some(kb * 1024)
    };
    Some(Memory {
        peak_bytes: field("VmHWM:")?,
        current_bytes: field("VmRSS:")?,
    })
}

/// CPU time (user + system) `pid` has used, in seconds (`/proc/<pid>/stat`, in the
/// kernel's fixed 100 ticks per second of the user ABI); `None` when the process is gone.
pub fn process_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: fields are counted after its `)`.
    let after_name = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / 100.0)
}

/// `GET http://{addr}{path}` over HTTP/1.0 (the admin endpoints are small and local);
/// returns the status code and body.
pub fn http_get(addr: &str, path: &str, timeout: Duration) -> Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = Vec::new();
    stream
        .read_to_end(&mut response)
        .with_context(|| format!("reading {path} from {addr}"))?;
    let text = String::from_utf8_lossy(&response);
    let Some((head, body)) = text.split_once("\r\n\r\n") else {
        bail!("malformed HTTP response from {addr}{path}");
    };
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status code in the response from {addr}{path}"))?;
    Ok((status, body.to_owned()))
}

/// Sum of every sample of `name` in an OpenMetrics text whose labels contain all of
/// `labels` (`key="value"` pairs); 0 when there is none.
pub fn metric_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let mut sum = 0.0;
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (label_text, value) = if let Some(inner) = rest.strip_prefix('{') {
            let Some((labels, value)) = inner.split_once('}') else {
                continue;
            };
            (labels, value)
        } else if rest.starts_with(' ') {
            ("", rest)
        } else {
            continue;
        };
        let matches = labels
            .iter()
            .all(|(key, want)| label_text.contains(&format!("{key}=\"{want}\"")));
        if matches && let Some(number) = value.split_whitespace().next() {
            sum += number.parse::<f64>().unwrap_or(0.0);
        }
    }
    sum
}

/// Every `(label value, sample)` of `name` with a nonzero sample, for the label `key`.
pub fn metric_by_label(text: &str, name: &str, key: &str) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    let prefix = format!("{name}{{");
    for line in text.lines() {
        let Some(inner) = line.strip_prefix(&prefix) else {
            continue;
        };
        let Some((labels, value)) = inner.split_once('}') else {
            continue;
        };
        let Some(value) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        let wanted = format!("{key}=\"");
        let Some(start) = labels.find(&wanted) else {
            continue;
        };
        let after = &labels[start + wanted.len()..];
        let label = after.split('"').next().unwrap_or_default().to_owned();
        if value != 0.0 {
            out.push((label, value));
        }
    }
    out
}

#[cfg(test)]
mod tests {

    use super::*;

    #[test]
    fn flags_refuse_unknown_names_and_stray_words() {
        let parse = |args: &[&str]| Flags::parse(args.iter().map(|arg| (*arg).to_owned()));
        let flags = parse(&["--runs", "flat", "--quick"]);
        assert!(flags.ensure_known(&["runs", "quick"]).is_ok());
        assert!(!flags.wants_help());
        let err = parse(&["--rnus", "flat"])
            .ensure_known(&["runs", "quick"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("--rnus") && err.contains("--runs"), "{err}");
        let err = parse(&["flat"])
            .ensure_known(&["runs"])
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"flat\""), "{err}");
        assert!(parse(&["--help"]).wants_help());
        assert!(parse(&["-h"]).wants_help());
    }

    #[test]
    fn percentiles_pick_nearest_rank() {
        let values: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&values, 0.5), Some(51.0));
        assert_eq!(percentile(&values, 0.99), Some(99.0));
        assert_eq!(percentile(&[], 0.5), None);
    }

    #[test]
    fn metrics_are_summed_by_label() {
        let text = "# HELP x\nkvrelay_frames_sent_total{stream=\"pool\"} 3\n\
                    kvrelay_frames_sent_total{stream=\"catalog\"} 2\n\
                    kvrelay_errors_sent_total{reason=\"subscriber_lagged\"} 4\n\
                    kvrelay_errors_sent_total{reason=\"other\"} 0\n";
        assert_eq!(
            metric_sum(text, "kvrelay_frames_sent_total", &[("stream", "pool")]),
            3.0
        );
        assert_eq!(metric_sum(text, "kvrelay_frames_sent_total", &[]), 5.0);
        assert_eq!(
            metric_by_label(text, "kvrelay_errors_sent_total", "reason"),
            vec![("subscriber_lagged".to_owned(), 4.0)]
        );
    }
}

/// `--name value` command-line flags of the benchmark processes. A minimal parser, but a
/// strict one: [`Flags::ensure_known`] refuses a misspelt flag or a stray word instead of
/// running a long benchmark with a default the user did not ask for.
#[derive(Debug, Clone, Default)]
pub struct Flags {
    values: std::collections::BTreeMap<String, String>,
    switches: std::collections::BTreeSet<String>,
    /// Words that are not flags (or the value of one), in order.
    strays: Vec<String>,
}

impl Flags {
    /// The process's flags: `--name value` pairs and bare `--switch`es.
    pub fn from_env() -> Self {
        Self::parse(std::env::args().skip(1))
    }

    /// Parses `args`: a `--name` followed by a value not starting with `--` is a pair.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Self {
        let mut flags = Self::default();
        let mut args = args.into_iter().peekable();
        while let Some(arg) = args.next() {
            let Some(name) = arg.strip_prefix("--") else {
                flags.strays.push(arg);
                continue;
            };
            match args.peek() {
                Some(value) if !value.starts_with("--") => {
                    let value = value.clone();
                    args.next();
                    flags.values.insert(name.to_owned(), value);
                }
                _ => {
                    flags.switches.insert(name.to_owned());
                }
            }
        }
        flags
    }

    /// Whether `--help` or `-h` was given.
    pub fn wants_help(&self) -> bool {
        self.switches.contains("help") || self.strays.iter().any(|word| word == "-h")
    }

    /// An error naming the first flag not in `known` (names without the leading `--`), or
    /// the first word that is not a flag's value.
    pub fn ensure_known(&self, known: &[&str]) -> Result<()> {
        let mut given = self.values.keys().chain(self.switches.iter());
        if let Some(unknown) = given.find(|name| !known.contains(&name.as_str())) {
            let mut names: Vec<String> = known.iter().map(|name| format!("--{name}")).collect();
            names.sort();
            anyhow::bail!(
                "unknown flag --{unknown} (known: {}; --help for usage)",
                names.join(", ")
            );
        }
        if let Some(stray) = self.strays.first() {
            anyhow::bail!("unexpected argument {stray:?} (flags are --name value)");
        }
        Ok(())
    }

    /// Whether the bare switch `--name` was given.
    pub fn switch(&self, name: &str) -> bool {
        self.switches.contains(name)
    }

    /// The raw value of `--name`.
    pub fn raw(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str)
    }

    /// `--name` parsed, or `default` when absent.
    pub fn get_or<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T> {
        match self.values.get(name) {
            None => Ok(default),
            Some(text) => text
                .parse()
                .map_err(|_| anyhow::anyhow!("--{name}: cannot parse {text:?}")),
        }
    }

    /// `--name` parsed; an error when absent.
    pub fn get<T: std::str::FromStr>(&self, name: &str) -> Result<T> {
        let text = self
            .values
            .get(name)
            .with_context(|| format!("--{name} is required"))?;
        text.parse()
            .map_err(|_| anyhow::anyhow!("--{name}: cannot parse {text:?}"))
    }
}
