//! Reference-compatible token → block → sequence hashing.
//!
//! Tokens are hashed as little-endian `u32`s with XXH3-64. The block-hash seed starts at
//! [`XXH3_SEED`] and is salted (wrapping add) by the LoRA adapter name and the cache
//! namespace; the rolling sequence hash always uses the fixed [`XXH3_SEED`]. The filter is
//! keyed by canonical sequence hashes built with [`canonical_root`] and [`canonical_child`].

use std::borrow::Cow;

use xxhash_rust::xxh3::xxh3_64_with_seed;
use zerocopy::IntoBytes;

use crate::query::KvQueryHashFormat;

/// Seed of every block hash before salting, and of the rolling sequence hash.
pub const XXH3_SEED: u64 = 1337;

/// Seed used to hash a LoRA adapter name into the block-hash salt.
const LORA_SALT_SEED: u64 = 0;

/// Seed used to hash a cache namespace into the block-hash salt.
const NAMESPACE_SALT_SEED: u64 = 1;

/// The salt inputs of block hashing: optional LoRA adapter name and cache namespace.
///
/// Empty strings count as absent, as in the reference.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HashSalt<'a> {
    /// The LoRA adapter name the request or event runs under, if any.
    pub lora_name: Option<&'a str>,
    /// The cache namespace (tenant isolation salt), if any.
    pub cache_namespace: Option<&'a str>,
}

impl HashSalt<'_> {
    /// The block-hash seed for this salt: [`XXH3_SEED`] plus (wrapping) the salt hashes.
    pub fn seed(&self) -> u64 {
        let mut seed = XXH3_SEED;
        if let Some(lora) = self.lora_name.filter(|name| !name.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(lora.as_bytes(), LORA_SALT_SEED));
        }
        if let Some(ns) = self.cache_namespace.filter(|ns| !ns.is_empty()) {
            seed = seed.wrapping_add(xxh3_64_with_seed(ns.as_bytes(), NAMESPACE_SALT_SEED));
        }
        seed
    }
}

/// Hashes one window of tokens (the block's tokens, LE `u32` each) with `seed`.
///
/// `mm_hashes` are the block's multimodal object hashes; they are appended (sorted
/// ascending, LE `u64` each) after the token bytes, as the reference does.
pub fn block_hash(tokens: &[u32], mm_hashes: &[u64], seed: u64) -> u64 {
    let bytes = token_bytes(tokens);
    if mm_hashes.is_empty() {
        return xxh3_64_with_seed(&bytes, seed);
    }
    let mut buf = bytes.into_owned();
    append_mm_hashes(&mut buf, mm_hashes);
    xxh3_64_with_seed(&buf, seed)
}

/// Block hashes of `tokens` for `block_size` and `format`, complete blocks only.
///
/// Standard windows are `block_size` tokens with stride `block_size`; Eagle windows are
/// `block_size + 1` tokens with the same stride. A zero block size yields no hashes.
///
/// ```
/// use kvrelay_identity::hashing::{block_hashes, HashSalt};
/// use kvrelay_identity::KvQueryHashFormat;
/// let tokens: Vec<u32> = (0..13).collect();
/// let salt = HashSalt { lora_name: None, cache_namespace: Some("tenant-ns") };
/// let blocks = block_hashes(&tokens, 4, KvQueryHashFormat::DynamoEagleV1, salt);
/// assert_eq!(blocks[0], 14894569739370774171);
/// assert_eq!(blocks.len(), 3);
/// ```
pub fn block_hashes(
    tokens: &[u32],
    block_size: u32,
    format: KvQueryHashFormat,
    salt: HashSalt<'_>,
) -> Vec<u64> {
    let seed = salt.seed();
    let windows = BlockWindows::new(tokens.len(), block_size, format);
    let mut out = Vec::with_capacity(windows.n_blocks);
    // View (or encode) every covered token once, then hash each window's byte range.
    let bytes = token_bytes(&tokens[..windows.covered_tokens()]);
    for (start, end) in windows {
        out.push(xxh3_64_with_seed(&bytes[start * 4..end * 4], seed));
    }
    out
}

/// Block hashes where each block may carry multimodal hashes (`mm_per_block[i]` for
/// block `i`; missing entries mean no multimodal data).
pub fn block_hashes_with_mm(
    tokens: &[u32],
    block_size: u32,
    format: KvQueryHashFormat,
    salt: HashSalt<'_>,
    mm_per_block: &[Vec<u64>],
) -> Vec<u64> {
    let seed = salt.seed();
    let windows = BlockWindows::new(tokens.len(), block_size, format);
    let mut out = Vec::with_capacity(windows.n_blocks);
    let bytes = token_bytes(&tokens[..windows.covered_tokens()]);
    let mut scratch = Vec::new();
    for (block_idx, (start, end)) in windows.enumerate() {
        let window = &bytes[start * 4..end * 4];
        let mm = mm_per_block.get(block_idx).map_or(&[][..], Vec::as_slice);
        if mm.is_empty() {
            out.push(xxh3_64_with_seed(window, seed));
        } else {
            scratch.clear();
            scratch.extend_from_slice(window);
            append_mm_hashes(&mut scratch, mm);
            out.push(xxh3_64_with_seed(&scratch, seed));
        }
    }
    out
}

/// The multimodal hash of an object identifier: a 64-digit hex id gives its first 16 hex
/// digits as a `u64`; any other non-empty id gives XXH3-64 of its bytes (seed 0); an empty
/// id gives none.
///
/// ```
/// use kvrelay_identity::hashing::mm_hash_from_identifier;
/// let id = format!("00000000000000ff{}", "0".repeat(48));
/// assert_eq!(mm_hash_from_identifier(&id), Some(255));
/// assert_eq!(mm_hash_from_identifier(""), None);
/// ```
pub fn mm_hash_from_identifier(identifier: &str) -> Option<u64> {
    if identifier.is_empty() {
        return None;
    }
    let is_hex_digest =
        identifier.len() == 64 && identifier.bytes().all(|byte| byte.is_ascii_hexdigit());
    if is_hex_digest && let Ok(value) = u64::from_str_radix(&identifier[..16], 16) {
        return Some(value);
    }
    Some(xxh3_64_with_seed(identifier.as_bytes(), 0))
}

/// Rolling sequence hashes: `seq[0] = block[0]`, `seq[i] = chain(seq[i-1], block[i])`.
///
/// ```
/// use kvrelay_identity::hashing::sequence_hashes;
/// let seqs = sequence_hashes(&[9143094415614847814, 12124091508212882195]);
/// assert_eq!(seqs, [9143094415614847814, 9510318385840434533]);
/// ```
pub fn sequence_hashes(block_hashes: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(block_hashes.len());
    let mut parent: Option<u64> = None;
    for &block in block_hashes {
        let seq = match parent {
            None => canonical_root(block),
            Some(parent) => canonical_child(parent, block),
        };
        out.push(seq);
        parent = Some(seq);
    }
    out
}

/// Canonical sequence hash of a root block: its token hash.
#[inline]
pub fn canonical_root(token_hash: u64) -> u64 {
    token_hash
}

/// Canonical sequence hash of a block whose parent has canonical hash `parent`:
/// XXH3-64 of `le(parent) ‖ le(token_hash)` with seed [`XXH3_SEED`].
#[inline]
pub fn canonical_child(parent: u64, token_hash: u64) -> u64 {
    let mut buf = [0u8; 16];
    buf[..8].copy_from_slice(&parent.to_le_bytes());
    buf[8..].copy_from_slice(&token_hash.to_le_bytes());
    xxh3_64_with_seed(&buf, XXH3_SEED)
}

/// `tokens` as little-endian `u32` bytes: borrowed as-is on little-endian targets,
/// encoded into a new buffer elsewhere.
fn token_bytes(tokens: &[u32]) -> Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        Cow::Borrowed(tokens.as_bytes())
    } else {
        Cow::Owned(encode_tokens(tokens))
    }
}

/// Encodes `tokens` as little-endian `u32`s.
fn encode_tokens(tokens: &[u32]) -> Vec<u8> {
    let mut bytes = vec![0u8; tokens.len() * 4];
    for (chunk, token) in bytes.chunks_exact_mut(4).zip(tokens) {
        chunk.copy_from_slice(&token.to_le_bytes());
    }
    bytes
}

/// Appends multimodal hashes, sorted ascending, as little-endian `u64`s.
fn append_mm_hashes(buf: &mut Vec<u8>, mm_hashes: &[u64]) {
    let mut sorted = mm_hashes.to_vec();
    sorted.sort_unstable();
    for mm in sorted {
        buf.extend_from_slice(&mm.to_le_bytes());
    }
}

/// Tokens hashed per block: `block_size` for standard formats, `block_size + 1` for Eagle
/// (each window also covers the next block's first token); the stride is always
/// `block_size`. The one definition producers (ingest) and consumers (query hashing) use.
///
/// ```
/// use kvrelay_identity::hashing::block_window_len;
/// use kvrelay_identity::KvQueryHashFormat;
/// assert_eq!(block_window_len(16, KvQueryHashFormat::DynamoStandardV1), 16);
/// assert_eq!(block_window_len(16, KvQueryHashFormat::DynamoEagleV1), 17);
/// ```
pub fn block_window_len(block_size: u32, format: KvQueryHashFormat) -> usize {
    let stride = block_size as usize;
    if stride > 0 && format.is_eagle() {
        stride + 1
    } else {
        stride
    }
}

/// Start/end token offsets of each complete block window.
#[derive(Debug, Clone)]
struct BlockWindows {
    next_block: usize,
    n_blocks: usize,
    stride: usize,
    window: usize,
}

impl BlockWindows {
    fn new(n_tokens: usize, block_size: u32, format: KvQueryHashFormat) -> Self {
        let stride = block_size as usize;
        let window = block_window_len(block_size, format);
        // Complete windows: the last one must end within the tokens (none for stride 0).
        let n_blocks = (n_tokens + stride)
            .saturating_sub(window)
            .checked_div(stride)
            .unwrap_or(0);
        Self {
            next_block: 0,
            n_blocks,
            stride,
            window,
        }
    }
}

impl BlockWindows {
    /// Tokens from the start up to the end of the last complete window.
    fn covered_tokens(&self) -> usize {
        if self.n_blocks == 0 {
            0
        } else {
            (self.n_blocks - 1) * self.stride + self.window
        }
    }
}

impl Iterator for BlockWindows {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        if self.next_block >= self.n_blocks {
            return None;
        }
        let start = self.next_block * self.stride;
        self.next_block += 1;
        Some((start, start + self.window))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STANDARD: KvQueryHashFormat = KvQueryHashFormat::DynamoStandardV1;
    const EAGLE: KvQueryHashFormat = KvQueryHashFormat::DynamoEagleV1;

    fn tokens(n: u32) -> Vec<u32> {
        (0..n).collect()
    }

    #[test]
    fn standard_hashes_complete_blocks_only() {
        assert_eq!(
            block_hashes(&tokens(11), 4, STANDARD, HashSalt::default()).len(),
            2
        );
        assert_eq!(
            block_hashes(&tokens(12), 4, STANDARD, HashSalt::default()).len(),
            3
        );
        assert!(block_hashes(&tokens(3), 4, STANDARD, HashSalt::default()).is_empty());
    }

    #[test]
    fn eagle_needs_one_extra_token_per_window() {
        assert_eq!(
            block_hashes(&tokens(12), 4, EAGLE, HashSalt::default()).len(),
            2
        );
        assert_eq!(
            block_hashes(&tokens(13), 4, EAGLE, HashSalt::default()).len(),
            3
        );
        assert!(block_hashes(&[], 4, EAGLE, HashSalt::default()).is_empty());
    }

    #[test]
    fn eagle_window_overlaps_the_next_block_by_one_token() {
        let all = tokens(9);
        let blocks = block_hashes(&all, 4, EAGLE, HashSalt::default());
        assert_eq!(blocks[0], block_hash(&all[0..5], &[], XXH3_SEED));
        assert_eq!(blocks[1], block_hash(&all[4..9], &[], XXH3_SEED));
    }

    #[test]
    fn zero_block_size_yields_no_hashes() {
        assert!(block_hashes(&tokens(8), 0, STANDARD, HashSalt::default()).is_empty());
        assert!(block_hashes(&tokens(8), 0, EAGLE, HashSalt::default()).is_empty());
    }

    #[test]
    fn block_hash_is_xxh3_of_little_endian_tokens() {
        let window = [1u32, 0x0102_0304, u32::MAX];
        let mut bytes = Vec::new();
        for token in window {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        assert_eq!(block_hash(&window, &[], 99), xxh3_64_with_seed(&bytes, 99));
    }

    #[test]
    fn long_windows_hash_like_short_ones() {
        let window = tokens(300);
        let mut bytes = Vec::new();
        for token in &window {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        assert_eq!(block_hash(&window, &[], 7), xxh3_64_with_seed(&bytes, 7));
    }

    #[test]
    fn borrowed_token_bytes_equal_the_portable_encoding() {
        let window = tokens(37);
        assert_eq!(
            token_bytes(&window).as_ref(),
            encode_tokens(&window).as_slice()
        );
    }

    #[test]
    fn multimodal_hashes_are_appended_sorted() {
        let window = [5u32, 6];
        let mut bytes = Vec::new();
        for token in window {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        for mm in [3u64, 9] {
            bytes.extend_from_slice(&mm.to_le_bytes());
        }
        let expected = xxh3_64_with_seed(&bytes, XXH3_SEED);
        assert_eq!(block_hash(&window, &[9, 3], XXH3_SEED), expected);
        assert_eq!(block_hash(&window, &[3, 9], XXH3_SEED), expected);
    }

    #[test]
    fn multimodal_data_changes_only_its_block() {
        let all = tokens(8);
        let plain = block_hashes(&all, 4, STANDARD, HashSalt::default());
        let mm = block_hashes_with_mm(&all, 4, STANDARD, HashSalt::default(), &[vec![], vec![42]]);
        assert_eq!(mm[0], plain[0]);
        assert_ne!(mm[1], plain[1]);
        let none = block_hashes_with_mm(&all, 4, STANDARD, HashSalt::default(), &[]);
        assert_eq!(none, plain);
    }

    #[test]
    fn salt_changes_block_hashes_but_not_the_chain_seed() {
        let salt = HashSalt {
            lora_name: Some("adapter-a"),
            cache_namespace: None,
        };
        let salted = block_hashes(&tokens(8), 4, STANDARD, salt);
        let plain = block_hashes(&tokens(8), 4, STANDARD, HashSalt::default());
        assert_ne!(salted, plain);
        let seqs = sequence_hashes(&salted);
        assert_eq!(seqs[1], canonical_child(salted[0], salted[1]));
    }

    #[test]
    fn non_hex_identifier_hashes_its_bytes() {
        assert_eq!(
            mm_hash_from_identifier("image-1"),
            Some(xxh3_64_with_seed(b"image-1", 0))
        );
        let almost_hex = format!("{}g", "a".repeat(63));
        assert_eq!(
            mm_hash_from_identifier(&almost_hex),
            Some(xxh3_64_with_seed(almost_hex.as_bytes(), 0))
        );
    }

    #[test]
    fn sequence_chain_starts_at_the_first_block_hash() {
        let blocks = [11u64, 22, 33];
        let seqs = sequence_hashes(&blocks);
        assert_eq!(seqs[0], canonical_root(11));
        assert_eq!(seqs[0], 11);
        assert_eq!(seqs[1], canonical_child(11, 22));
        assert_eq!(seqs[2], canonical_child(seqs[1], 33));
        assert!(sequence_hashes(&[]).is_empty());
    }
}
