//! The snapshot assembler fed a sequence of sealed CBI1 payloads over a two-chunk layout:
//! it never panics and only completes with exactly one word per bucket.
#![no_main]

use bytes::Bytes;
use kvrelay_codec::SnapshotAssembler;
use kvrelay_codec::cbi1::{self, Cbi1Layout, Cbi1Payload};
use libfuzzer_sys::fuzz_target;

mod support;

const BUCKETS: u64 = 1 << 20;

fuzz_target!(|data: &[u8]| {
    let Ok(layout) = Cbi1Layout::new(0, BUCKETS) else {
        return;
    };
    let mut assembler = SnapshotAssembler::new(layout, 7);
    // Each step: u8 chunk index, u8 chunk count, u8 epoch, u8 word-count selector, u8 offset
    // selector. The payload is built here and sealed so it reaches the assembler.
    for step in data.chunks_exact(5) {
        let words = match step[3] % 4 {
            0 => 0,
            1 => 1,
            2 => 1 << 19,
            _ => usize::from(step[3]),
        };
        let offset = match step[4] % 3 {
            0 => 0,
            1 => 1 << 19,
            _ => u64::from(step[4]),
        };
        let mut payload = Vec::with_capacity(64 + words * 8);
        payload.extend_from_slice(b"CBI1");
        payload.extend_from_slice(&1u16.to_le_bytes());
        payload.extend_from_slice(&1u16.to_le_bytes());
        payload.extend_from_slice(&[16, 4]);
        payload.extend_from_slice(&1u16.to_le_bytes());
        payload.extend_from_slice(&0u64.to_le_bytes());
        payload.extend_from_slice(&BUCKETS.to_le_bytes());
        payload.extend_from_slice(&7u64.to_le_bytes());
        payload.extend_from_slice(&u64::from(step[2] % 2).to_le_bytes());
        payload.extend_from_slice(&0u32.to_le_bytes());
        payload.extend_from_slice(&u32::from(step[0] % 3).to_le_bytes());
        payload.extend_from_slice(&u32::from(step[1] % 3).to_le_bytes());
        payload.extend_from_slice(&offset.to_le_bytes());
        payload.resize(payload.len() + words * 8, step[2]);
        support::reseal(&mut payload);
        let Ok(Cbi1Payload::Chunk(chunk)) = cbi1::decode_cbi1(&Bytes::from(payload), &layout)
        else {
            continue;
        };
        if let Ok(Some(snapshot)) = assembler.handle_chunk(&chunk) {
            assert_eq!(snapshot.words.len() as u64, BUCKETS);
        }
    }
});
