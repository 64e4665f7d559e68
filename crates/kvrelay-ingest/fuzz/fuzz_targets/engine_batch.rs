//! The engine batch decoder (the only decoder fed by engines): arbitrary bytes never panic
//! the decoder or the canonicalizer, decoded batches stay within the limits, and a decoded
//! batch re-encoded in each engine layout decodes to the same logical events.
#![no_main]

use kvrelay_identity::KvQueryHashFormat;
use kvrelay_ingest::{
    CanonicalConfig, Canonicalizer, EngineKind, EngineLayout, Limits, decode_engine_batch,
    encode_engine_batch,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Small limits so the fuzzer reaches the bound checks with short inputs.
    let limits = Limits {
        max_events_per_batch: 64,
        max_blocks_per_event: 64,
        max_tokens_per_event: 1_024,
        ..Limits::default()
    };
    for engine in [EngineKind::Vllm, EngineKind::Sglang] {
        let Ok(batch) = decode_engine_batch(data, engine, &limits) else {
            continue;
        };
        assert!(batch.events.len() <= limits.max_events_per_batch as usize);
        for format in [KvQueryHashFormat::DynamoStandardV1, KvQueryHashFormat::DynamoEagleV1] {
            let config = CanonicalConfig::new(4, format);
            let mut canonicalizer = Canonicalizer::new(1, 0, config);
            let mut out = Vec::new();
            let outcome = canonicalizer.canonicalize(&batch, &mut out);
            assert_eq!(outcome.n_events, out.len());
            assert!(out.len() + outcome.n_filtered + outcome.rejected.len() <= batch.events.len());
        }
        for map_events in [false, true] {
            let layout = EngineLayout { engine, map_events, map_batch: map_events };
            let mut bytes = Vec::new();
            encode_engine_batch(&batch, layout, &mut bytes);
            if let Ok(again) = decode_engine_batch(&bytes, engine, &limits) {
                assert_eq!(again.events.len(), batch.events.len());
            }
        }
    }
});
