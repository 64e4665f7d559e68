//! The pool frame body decoder and the full check against its own producer. Input: a
//! flag byte, a metadata length byte, metadata, payload; the target seals the metadata and
//! (flag bit 1) the CBI1 payload so the checks behind both checksums are reachable. Flag
//! bit 2 feeds the raw input unsealed instead.
#![no_main]

use bytes::{BufMut, Bytes, BytesMut};
use kvrelay_codec::PROTOCOL_MINOR;
use kvrelay_codec::v1::PoolFrame;
use libfuzzer_sys::fuzz_target;

mod support;

fuzz_target!(|data: &[u8]| {
    let (flag, rest) = support::flag(data);
    let minor = u16::from(flag & 1);
    let body = if flag & 4 != 0 {
        Bytes::copy_from_slice(rest)
    } else {
        let (meta_len, rest) = support::flag(rest);
        let meta_len = usize::from(meta_len).min(rest.len());
        let (meta, payload) = rest.split_at(meta_len);
        let mut payload = payload.to_vec();
        if flag & 2 != 0 {
            support::reseal(&mut payload);
        }
        let mut body = BytesMut::new();
        body.put_u32_le(meta_len as u32);
        body.put_slice(meta);
        body.put_u32_le(support::meta_checksum(minor, meta));
        body.put_slice(&payload);
        body.freeze()
    };
    let Ok(frame) = PoolFrame::decode_body(&body, minor) else {
        return;
    };
    let producer = frame.header.producer;
    let _ = frame.check(&producer);
    let mut dst = BytesMut::new();
    if frame.encode_body(&mut dst).is_ok() {
        // The encoder seals its metadata under this build's minor, whatever minor the
        // input came in at, so that is the minor its output decodes under.
        assert_eq!(
            PoolFrame::decode_body(&dst.freeze(), PROTOCOL_MINOR).ok(),
            Some(frame)
        );
    }
});
