//! Helpers shared by the fuzz targets.

#![allow(dead_code, reason = "each target uses a subset")]

/// Rewrites the CBI1 checksum of `payload` (if it has a header) so the fuzzer can reach
/// the checks behind it.
pub fn reseal(payload: &mut [u8]) {
    if payload.len() >= 48 {
        let sum = xxhash_rust::xxh3::xxh3_64(&payload[48..]) as u32;
        payload[44..48].copy_from_slice(&sum.to_le_bytes());
    }
}

/// Splits the first byte off as a flag byte.
pub fn flag(data: &[u8]) -> (u8, &[u8]) {
    match data.split_first() {
        Some((first, rest)) => (*first, rest),
        None => (0, data),
    }
}

/// The pool frame metadata checksum.
pub fn meta_checksum(minor: u16, meta: &[u8]) -> u32 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::new();
    hasher.update(&minor.to_le_bytes());
    hasher.update(meta);
    hasher.digest() as u32
}
