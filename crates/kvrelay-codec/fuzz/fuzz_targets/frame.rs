//! The frame decoder: arbitrary bytes, split at an arbitrary point, never panic and decode
//! like the whole.
#![no_main]

use bytes::BytesMut;
use kvrelay_codec::{Limits, decode_frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = Limits::default();
    let mut whole = BytesMut::from(data);
    let mut frames = Vec::new();
    while let Ok(Some(frame)) = decode_frame(&mut whole, &limits) {
        frames.push(frame);
    }
    // Feeding the same bytes in two pieces yields the same frames.
    let cut = data.first().map_or(0, |b| usize::from(*b)).min(data.len());
    let mut split = BytesMut::from(&data[..cut]);
    let mut again = Vec::new();
    let mut fed_rest = false;
    loop {
        match decode_frame(&mut split, &limits) {
            Ok(Some(frame)) => again.push(frame),
            Ok(None) if !fed_rest => {
                split.extend_from_slice(&data[cut..]);
                fed_rest = true;
            }
            _ => break,
        }
    }
    assert_eq!(frames, again);
});
