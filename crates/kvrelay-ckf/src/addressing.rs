//! Format v1 addressing: fingerprint, primary bucket and XOR alternate bucket of a hash.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use kvrelay_identity::CkfFormat;

/// Mixed into the seed for the fingerprint-to-offset hash.
const ALTERNATE_SEED_MIX: u64 = 0x9E37_79B9_7F4A_7C15;

/// Where a hash lives: its nonzero 16-bit fingerprint and its two candidate buckets.
///
/// `primary != alternate`, and each is the other's alternate for this fingerprint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Address {
    /// The 16-bit fingerprint, never 0 (0 marks an empty slot).
    pub fingerprint: u16,
    /// The primary bucket index.
    pub primary: u32,
    /// The alternate bucket index (`primary XOR offset(fingerprint)`).
    pub alternate: u32,
}

/// A hash's fingerprint and primary bucket: an [`Address`] whose alternate bucket is
/// derived only when needed (most inserts and removals never look at it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Home {
    /// The nonzero 16-bit fingerprint.
    pub(crate) fingerprint: u16,
    /// The primary bucket index.
    pub(crate) primary: u32,
}

/// Computes [`Address`]es for one [`CkfFormat`] (seed and bucket count).
///
/// ```
/// use kvrelay_ckf::Addressing;
/// use kvrelay_identity::{CkfFormat, DEFAULT_CKF_SEED};
/// let format = CkfFormat::v1(DEFAULT_CKF_SEED, 524_288)?;
/// let address = Addressing::new(format).address(11);
/// assert_eq!((address.fingerprint, address.primary, address.alternate), (0xD6F8, 410_005, 65_990));
/// # Ok::<(), kvrelay_identity::CkfFormatError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Addressing {
    seed: u64,
    alternate_seed: u64,
    mask: u64,
}

impl Addressing {
    /// The addressing of `format`.
    pub fn new(format: CkfFormat) -> Self {
        Self {
            seed: format.seed(),
            alternate_seed: format.seed() ^ ALTERNATE_SEED_MIX,
            mask: u64::from(format.bucket_mask()),
        }
    }

    /// The address of a 64-bit (canonical sequence) hash.
    #[inline]
    pub fn address(&self, hash: u64) -> Address {
        let Home {
            fingerprint,
            primary,
        } = self.home(hash);
        Address {
            fingerprint,
            primary,
            alternate: self.alternate(primary, fingerprint),
        }
    }

    /// The fingerprint and primary bucket of a hash (its address without the alternate).
    #[inline]
    pub(crate) fn home(&self, hash: u64) -> Home {
        let mixed = xxh3_64_with_seed(&hash.to_le_bytes(), self.seed);
        let low = (mixed & 0xFFFF) as u16;
        // Masked by a bucket count <= 2^24, so it fits in u32.
        Home {
            fingerprint: if low == 0 { 1 } else { low },
            primary: ((mixed >> 16) & self.mask) as u32,
        }
    }

    /// The other candidate bucket of `fingerprint` when it sits in `bucket_idx`.
    #[inline]
    pub fn alternate(&self, bucket_idx: u32, fingerprint: u16) -> u32 {
        let offset = xxh3_64_with_seed(&fingerprint.to_le_bytes(), self.alternate_seed) & self.mask;
        let offset = if offset == 0 { 1 } else { offset as u32 };
        bucket_idx ^ offset
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_identity::DEFAULT_CKF_SEED;

    #[test]
    fn reproduces_the_worked_example() {
        let format = CkfFormat::v1(DEFAULT_CKF_SEED, 524_288).unwrap();
        let addressing = Addressing::new(format);
        let address = addressing.address(11);
        assert_eq!(address.fingerprint, 0xD6F8);
        assert_eq!(address.primary, 410_005);
        assert_eq!(address.alternate, 65_990);
        assert_eq!(addressing.alternate(65_990, 0xD6F8), 410_005);
    }

    #[test]
    fn alternate_is_an_involution_and_never_the_same_bucket() {
        let format = CkfFormat::v1(DEFAULT_CKF_SEED, 2).unwrap();
        let addressing = Addressing::new(format);
        for hash in 0..2000u64 {
            let address = addressing.address(hash);
            assert_ne!(address.primary, address.alternate);
            assert_eq!(
                addressing.alternate(address.alternate, address.fingerprint),
                address.primary
            );
            assert_ne!(address.fingerprint, 0);
        }
    }
}
