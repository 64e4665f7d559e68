//! Bearer tokens as presented over HTTP and the WAN: the one constant-time comparison
//! every listener uses (relay WAN and admin, router API).

/// Whether `presented` equals `expected`, in time that depends only on `expected`'s
/// length, never on where the two differ (an attacker learns nothing from timing but
/// the expected length, which the protocol bounds anyway).
pub fn token_matches(expected: &[u8], presented: Option<&[u8]>) -> bool {
    let Some(presented) = presented else {
        return false;
    };
    let mut diff = u8::from(presented.len() != expected.len());
    for (at, byte) in expected.iter().enumerate() {
        diff |= byte ^ presented.get(at).copied().unwrap_or(0);
    }
    diff == 0
}

/// The token of an `Authorization: Bearer <token>` header value, if it is one.
pub fn bearer_of(authorization: Option<&[u8]>) -> Option<&[u8]> {
    authorization?.strip_prefix(b"Bearer ")
}

/// Whether `headers` carry `Authorization: Bearer <expected>` (compared in constant
/// time): the check of every token-guarded HTTP listener (relay admin, router API).
pub fn bearer_matches(expected: &[u8], headers: &axum::http::HeaderMap) -> bool {
    let authorization = headers
        .get(axum::http::header::AUTHORIZATION)
        .map(axum::http::HeaderValue::as_bytes);
    token_matches(expected, bearer_of(authorization))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_token_matches() {
        assert!(token_matches(b"s3cret", Some(b"s3cret")));
        for wrong in [&b"s3cre"[..], b"s3cret!", b"S3cret", b"", b"x3cret"] {
            assert!(!token_matches(b"s3cret", Some(wrong)), "{wrong:?}");
        }
        assert!(!token_matches(b"s3cret", None));
    }

    #[test]
    fn bearer_headers_are_parsed_strictly() {
        assert_eq!(bearer_of(Some(b"Bearer abc")), Some(&b"abc"[..]));
        assert_eq!(bearer_of(Some(b"bearer abc")), None);
        assert_eq!(bearer_of(Some(b"Basic abc")), None);
        assert_eq!(bearer_of(None), None);
    }

    #[test]
    fn headers_match_only_with_the_exact_bearer_token() {
        let mut headers = axum::http::HeaderMap::new();
        assert!(!bearer_matches(b"s3cret", &headers));
        headers.insert(
            axum::http::header::AUTHORIZATION,
            axum::http::HeaderValue::from_static("Bearer s3cret"),
        );
        assert!(bearer_matches(b"s3cret", &headers));
        assert!(!bearer_matches(b"other", &headers));
    }
}
