//! The pre-authentication phase of a WAN connection: reading the one stream request and
//! checking its bearer token.
//!
//! Everything here runs before the peer has proven anything, so every bound is small and
//! fixed before a byte is buffered: the request frame is read under `max_request_len`
//! (64 KiB by default, not the 8 MiB `max_frame_len` of publication frames), and the caller
//! runs TLS handshake and request reading under one deadline (`request_timeout_ms`). The
//! token is taken out of the request as soon as it is decoded, so no later log line, error
//! message or `Debug` output can carry it.

use futures::StreamExt;
use kvrelay_codec::MessageKind;
use kvrelay_codec::framing::{FramingError, RawFrameCodec};
use kvrelay_codec::v1::{ErrorReason, StreamRequest};
use tokio::io::AsyncRead;
use tokio_util::codec::FramedRead;

use crate::wan::source::StreamFailure;
use kvrelay_tls::BearerToken;

/// Initial read buffer; a typical request fits, larger ones grow it up to the limit.
const INITIAL_REQUEST_BUFFER: usize = 512;

/// A decoded, validated stream request and the token it presented (kept apart).
pub(crate) struct ReceivedRequest {
    /// The request, with `auth_token` always `None`.
    pub(crate) request: StreamRequest,
    /// The protocol minor the client wrote the request with.
    pub(crate) minor: u16,
    presented_token: Option<String>,
}

impl ReceivedRequest {
    /// Whether the presented token satisfies `expected` (always, when auth is off).
    pub(crate) fn authenticated(&self, expected: Option<&BearerToken>) -> bool {
        expected
            .is_none_or(|token| token.matches(self.presented_token.as_deref().map(str::as_bytes)))
    }
}

/// Reads exactly one stream request frame of at most `max_request_len` bytes (header
/// included) from `reader`, then decodes and validates it. Nothing may follow the frame.
pub(crate) async fn read_stream_request<R: AsyncRead + Unpin>(
    reader: &mut R,
    max_request_len: u32,
) -> Result<ReceivedRequest, StreamFailure> {
    let limits = kvrelay_codec::Limits {
        max_frame_len: max_request_len,
    };
    // The codec checks the declared length against `max_request_len` from the header,
    // before any body is buffered.
    let mut frames =
        FramedRead::with_capacity(reader, RawFrameCodec::new(limits), INITIAL_REQUEST_BUFFER);
    let frame = match frames.next().await {
        Some(Ok(frame)) => frame,
        Some(Err(FramingError::Frame(err))) => {
            let reason = kvrelay_codec::v1::DecodeError::from(err.clone()).reason();
            return Err(StreamFailure::new(
                reason,
                format!("stream request: {err} (max_request_len)"),
            ));
        }
        Some(Err(err)) => {
            return Err(StreamFailure::new(
                ErrorReason::InvalidRequest,
                format!("reading request: {err}"),
            ));
        }
        None => {
            return Err(StreamFailure::new(
                ErrorReason::InvalidRequest,
                "connection closed before a complete stream request",
            ));
        }
    };
    let following = frames.read_buffer().len();
    if following > 0 {
        return Err(StreamFailure::new(
            ErrorReason::InvalidRequest,
            format!("{following} bytes follow the stream request"),
        ));
    }
    if frame.kind() != Some(MessageKind::StreamRequest) {
        return Err(StreamFailure::new(
            ErrorReason::InvalidRequest,
            format!(
                "first frame has message kind {}, expected a stream request",
                frame.kind_code
            ),
        ));
    }
    let mut request = StreamRequest::decode_body(&frame.body, frame.minor)
        .map_err(|err| StreamFailure::new(err.reason(), err.to_string()))?;
    // Out of the request before validation: a validation message quotes offending values.
    let presented_token = request.auth_token.take();
    if presented_token
        .as_ref()
        .is_some_and(|token| token.len() > kvrelay_codec::limits::MAX_AUTH_TOKEN_LEN)
    {
        return Err(StreamFailure::new(
            ErrorReason::InvalidRequest,
            format!(
                "auth_token is longer than {} bytes",
                kvrelay_codec::limits::MAX_AUTH_TOKEN_LEN
            ),
        ));
    }
    request
        .check()
        .map_err(|refusal| StreamFailure::new(refusal.reason, refusal.message))?;
    Ok(ReceivedRequest {
        request,
        minor: frame.minor,
        presented_token,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use bytes::BytesMut;
    use kvrelay_codec::v1::{Message, StreamRpc, encode_message};

    use super::*;

    fn encoded(request: &StreamRequest) -> Vec<u8> {
        let mut frame = BytesMut::new();
        encode_message(
            &Message::StreamRequest(request.clone()),
            &kvrelay_codec::Limits::default(),
            &mut frame,
        )
        .unwrap();
        frame.to_vec()
    }

    fn catalog_request(token: Option<&str>) -> StreamRequest {
        StreamRequest {
            subscriber_id: "test".to_owned(),
            rpc: StreamRpc::WatchCatalog,
            auth_token: token.map(str::to_owned),
        }
    }

    #[tokio::test]
    async fn a_declared_length_over_the_request_limit_is_refused_from_the_header() {
        // Only the header is sent: the refusal must not wait for (or buffer) the body.
        let mut header = Vec::new();
        header.extend_from_slice(b"KVRW");
        header.extend_from_slice(&1u16.to_le_bytes());
        header.extend_from_slice(&0u16.to_le_bytes());
        header.extend_from_slice(&1u16.to_le_bytes());
        header.extend_from_slice(&0u16.to_le_bytes());
        header.extend_from_slice(&(8u32 * 1024 * 1024 - 16).to_le_bytes());
        let failure = read_stream_request(&mut header.as_slice(), 64 * 1024)
            .await
            .err()
            .unwrap();
        assert!(failure.message.contains("max_request_len"), "{failure:?}");
    }

    #[tokio::test]
    async fn a_request_cut_short_or_followed_by_bytes_is_refused() {
        let whole = encoded(&catalog_request(None));
        let cut = &whole[..whole.len() - 3];
        let failure = read_stream_request(&mut &cut[..], 64 * 1024)
            .await
            .err()
            .unwrap();
        assert_eq!(failure.reason, ErrorReason::InvalidRequest, "{failure:?}");
        let mut followed = whole.clone();
        followed.extend_from_slice(b"xyz");
        let failure = read_stream_request(&mut followed.as_slice(), 64 * 1024)
            .await
            .err()
            .unwrap();
        assert!(failure.message.contains("3 bytes follow"), "{failure:?}");
        assert!(
            read_stream_request(&mut whole.as_slice(), 64 * 1024)
                .await
                .is_ok()
        );
    }

    #[tokio::test]
    async fn the_token_is_kept_out_of_the_request() {
        let bytes = encoded(&catalog_request(Some("s3cret")));
        let received = read_stream_request(&mut bytes.as_slice(), 64 * 1024)
            .await
            .ok()
            .unwrap();
        assert_eq!(received.request.auth_token, None);
        assert!(!format!("{:?}", received.request).contains("s3cret"));
        let expected = BearerToken::new("s3cret").unwrap();
        assert!(received.authenticated(Some(&expected)));
        assert!(!received.authenticated(Some(&BearerToken::new("other").unwrap())));
        assert!(received.authenticated(None));
    }

    #[tokio::test]
    async fn a_token_with_control_characters_is_never_quoted_back() {
        let bytes = encoded(&catalog_request(Some("s3cret\n")));
        let received = read_stream_request(&mut bytes.as_slice(), 64 * 1024)
            .await
            .ok()
            .unwrap();
        assert!(!received.authenticated(Some(&BearerToken::new("s3cret").unwrap())));
    }
}
