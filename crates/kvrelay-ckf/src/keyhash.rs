//! A fast hasher for maps keyed by 64-bit hashes and engine ids (hashbrown tables).
//!
//! Keys are mostly already-random hashes; engine ids may be small sequential integers, so
//! the final step is a full 64×64→128-bit folded multiply that spreads every input bit.

use std::hash::{BuildHasher, Hasher};

/// Folded-multiply constant (odd, high entropy).
const MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// Builds [`KeyHasher`]s; deterministic (no per-process random state).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KeyHashBuilder;

/// Hashbrown map with [`KeyHashBuilder`].
pub(crate) type KeyMap<K, V> = hashbrown::HashMap<K, V, KeyHashBuilder>;

/// A small multiply-fold hasher for integer keys.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct KeyHasher(u64);

impl BuildHasher for KeyHashBuilder {
    type Hasher = KeyHasher;

    fn build_hasher(&self) -> KeyHasher {
        KeyHasher(0)
    }
}

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        fold_multiply(self.0, MIX)
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut buf = [0u8; 8];
            buf[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(buf));
        }
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = fold_multiply(self.0 ^ x, MIX).wrapping_add(x);
    }

    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }
}

/// The hash of open-addressing tables keyed by `u64`: one folded multiply, whose low bits
/// depend on every key bit (the high half of the product carries the key's high bits
/// down), so sequential, strided and high-bit keys all spread.
#[inline]
pub(crate) fn mix(key: u64) -> u64 {
    fold_multiply(key, MIX)
}

#[inline]
fn fold_multiply(a: u64, b: u64) -> u64 {
    let full = u128::from(a).wrapping_mul(u128::from(b));
    (full as u64) ^ ((full >> 64) as u64)
}

/// Hashbrown set with [`KeyHashBuilder`].
pub(crate) type KeySet<K> = hashbrown::HashSet<K, KeyHashBuilder>;
