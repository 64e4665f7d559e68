//! The route answer's JSON, written directly.
//!
//! [`RouteResponse`](super::RouteResponse) is the answer's schema and `serde_json` its
//! reference encoding; through serde every key is a call that escapes it byte by byte,
//! which is most of the ~1 µs per candidate serde_json spends. This writer emits the same
//! bytes with the keys as literals, so an answer of all 16 or 256 candidates (what a
//! request without `top_k` gets) costs a fraction of that. The property test in
//! `api/tests.rs` holds it to serde_json's output byte for byte.

use kvrelay_consumer::{Ranking, ScoredCandidate, ScoredLeg};

/// Bytes reserved per candidate before writing (a one-leg candidate takes ~330).
const BYTES_PER_CANDIDATE: usize = 384;

/// Appends the JSON of `RouteResponse::from(ranking)` to `out`.
pub fn write_ranking(out: &mut Vec<u8>, ranking: &Ranking) {
    out.reserve(64 + ranking.candidates.len() * BYTES_PER_CANDIDATE);
    out.extend_from_slice(b"{\"model\":");
    string(out, &ranking.model);
    out.extend_from_slice(b",\"lora\":");
    or_null(out, ranking.lora.as_deref(), string);
    out.extend_from_slice(b",\"candidates\":[");
    comma_separated(out, &ranking.candidates, write_candidate);
    out.extend_from_slice(b"],\"not_ready\":");
    integer(out, ranking.n_not_ready);
    out.push(b'}');
}

/// Appends the JSON of the [`BatchResponse`](super::BatchResponse) of `answers`: each a
/// ranking or the error body that request got.
pub fn write_batch(
    out: &mut Vec<u8>,
    answers: &[Result<Ranking, serde_json::Value>],
) -> Result<(), serde_json::Error> {
    out.extend_from_slice(b"{\"answers\":[");
    for (index, answer) in answers.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        match answer {
            Ok(ranking) => write_ranking(out, ranking),
            Err(error) => serde_json::to_writer(&mut *out, error)?,
        }
    }
    out.extend_from_slice(b"]}");
    Ok(())
}

fn write_candidate(out: &mut Vec<u8>, candidate: &ScoredCandidate) {
    out.extend_from_slice(b"{\"dc\":");
    string(out, &candidate.dc);
    out.extend_from_slice(b",\"shape\":");
    string(out, candidate.shape.as_str());
    out.extend_from_slice(b",\"score\":");
    float(out, candidate.score);
    out.extend_from_slice(b",\"prefix_fraction\":");
    or_null(out, candidate.prefix_fraction, float);
    out.extend_from_slice(b",\"load_fraction\":");
    or_null(out, candidate.load_fraction, float);
    out.extend_from_slice(b",\"dc_cost\":");
    float(out, candidate.dc_cost);
    out.extend_from_slice(b",\"readiness\":");
    string(out, candidate.readiness.as_str());
    out.extend_from_slice(b",\"legs\":[");
    comma_separated(out, &candidate.legs, write_leg);
    out.extend_from_slice(b"]}");
}

fn write_leg(out: &mut Vec<u8>, leg: &ScoredLeg) {
    out.extend_from_slice(b"{\"role\":");
    string(out, leg.role);
    out.extend_from_slice(b",\"pool\":");
    string(out, &leg.pool);
    out.extend_from_slice(b",\"endpoint\":");
    string(out, &leg.endpoint);
    out.extend_from_slice(b",\"block_size\":");
    integer(out, leg.block_size);
    out.extend_from_slice(b",\"replica\":");
    string(out, leg.replica.as_str());
    out.extend_from_slice(b",\"coverage\":");
    string(out, leg.coverage.as_str());
    out.extend_from_slice(b",\"unroutable_percent\":");
    integer(out, leg.coverage.unroutable_percent());
    out.extend_from_slice(b",\"omitted_percent\":");
    integer(out, leg.coverage.omitted_percent());
    out.extend_from_slice(b",\"prefix_blocks\":");
    or_null(out, leg.prefix_blocks, integer);
    out.extend_from_slice(b",\"prefix_tokens\":");
    or_null(out, leg.prefix_tokens, integer);
    out.extend_from_slice(b",\"host_blocks\":");
    or_null(out, leg.host_blocks, integer);
    out.extend_from_slice(b",\"disk_blocks\":");
    or_null(out, leg.disk_blocks, integer);
    out.extend_from_slice(b",\"load\":");
    or_null(out, leg.load, float);
    out.push(b'}');
}

fn integer(out: &mut Vec<u8>, value: impl itoa::Integer) {
    out.extend_from_slice(itoa::Buffer::new().format(value).as_bytes());
}

/// As serde_json writes an `f64`: shortest round-trip text, `null` when not finite.
fn float(out: &mut Vec<u8>, value: f64) {
    if value.is_finite() {
        out.extend_from_slice(zmij::Buffer::new().format_finite(value).as_bytes());
    } else {
        out.extend_from_slice(b"null");
    }
}

/// `value` written by `write`, or `null` (serde's encoding of `None`).
fn or_null<T>(out: &mut Vec<u8>, value: Option<T>, write: impl FnOnce(&mut Vec<u8>, T)) {
    match value {
        Some(value) => write(out, value),
        None => out.extend_from_slice(b"null"),
    }
}

/// Each of `items` written by `write`, with commas between.
fn comma_separated<T>(out: &mut Vec<u8>, items: &[T], mut write: impl FnMut(&mut Vec<u8>, &T)) {
    for (index, item) in items.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        write(out, item);
    }
}

/// A JSON string as serde_json writes it: `"` and `\` escaped, the control characters
/// as `\b \t \n \f \r` or `\u00xx` (lowercase hex), everything else (including non-ASCII)
/// as is.
fn string(out: &mut Vec<u8>, value: &str) {
    let bytes = value.as_bytes();
    // Names rarely need escaping: one branch-free pass decides (it vectorises), then one
    // copy.
    let needs_escape = bytes.iter().fold(false, |any, &byte| {
        any | (byte < 0x20) | (byte == b'"') | (byte == b'\\')
    });
    if !needs_escape {
        out.reserve(bytes.len() + 2);
        out.push(b'"');
        out.extend_from_slice(bytes);
        out.push(b'"');
        return;
    }
    out.push(b'"');
    let mut plain_from = 0;
    for (at, &byte) in bytes.iter().enumerate() {
        let escape: &[u8] = match byte {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            0x08 => b"\\b",
            b'\t' => b"\\t",
            b'\n' => b"\\n",
            0x0c => b"\\f",
            b'\r' => b"\\r",
            0..0x20 => {
                out.extend_from_slice(&bytes[plain_from..at]);
                plain_from = at + 1;
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(byte >> 4)]);
                out.push(HEX[usize::from(byte & 0x0f)]);
                continue;
            }
            _ => continue,
        };
        out.extend_from_slice(&bytes[plain_from..at]);
        out.extend_from_slice(escape);
        plain_from = at + 1;
    }
    out.extend_from_slice(&bytes[plain_from..]);
    out.push(b'"');
}
