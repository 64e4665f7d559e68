//! Reference vectors: the `ckf_address` entries of `vectors/hashing.json` (a copy of the
//! shared vectors).

use kvrelay_ckf::Addressing;
use kvrelay_identity::CkfFormat;
use serde_json::Value;

const HASHING_JSON: &str = include_str!("vectors/hashing.json");

fn field(entry: &Value, name: &str) -> u64 {
    entry[name].as_u64().unwrap()
}

#[test]
fn ckf_addresses_match_the_reference_vectors() {
    let vectors: Value = serde_json::from_str(HASHING_JSON).unwrap();
    let entries = vectors["ckf_address"].as_array().unwrap();
    assert!(!entries.is_empty());
    for entry in entries {
        let format =
            CkfFormat::v1(field(entry, "seed"), field(entry, "bucket_count") as u32).unwrap();
        let address = Addressing::new(format).address(field(entry, "hash"));
        assert_eq!(
            u64::from(address.fingerprint),
            field(entry, "fingerprint"),
            "{entry}"
        );
        assert_eq!(
            u64::from(address.primary),
            field(entry, "primary"),
            "{entry}"
        );
        assert_eq!(
            u64::from(address.alternate),
            field(entry, "alternate"),
            "{entry}"
        );
    }
}
