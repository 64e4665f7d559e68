//! The bearer token: one type with one set of rules for every listener and client.
//!
//! A token is trimmed, non-empty, at most the WAN protocol's
//! [`MAX_AUTH_TOKEN_LEN`](kvrelay_codec::limits::MAX_AUTH_TOKEN_LEN) bytes and free of
//! control characters: a relay configured with a token no client can send (or that an
//! HTTP header cannot carry) is refused at load, naming the field. Presented tokens are
//! compared in constant time, and `Debug` never shows the token.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kvrelay_codec::limits::MAX_AUTH_TOKEN_LEN;

/// A bearer token, expected by a listener or presented by a client.
#[derive(Clone, PartialEq, Eq)]
pub struct BearerToken(Arc<str>);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(..)")
    }
}

impl BearerToken {
    /// A token from its text, trimmed. Must be non-empty, at most 4,096 bytes and free of
    /// control characters.
    pub fn new(text: &str) -> Result<Self, TokenError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(TokenError::Empty);
        }
        if text.len() > MAX_AUTH_TOKEN_LEN {
            return Err(TokenError::TooLong {
                len: text.len(),
                max: MAX_AUTH_TOKEN_LEN,
            });
        }
        if text.chars().any(char::is_control) {
            return Err(TokenError::ControlCharacter);
        }
        Ok(Self(Arc::from(text)))
    }

    /// Reads a token from `path` (its trimmed contents).
    pub fn from_file(path: &Path) -> Result<Self, TokenError> {
        let text = std::fs::read_to_string(path).map_err(|err| TokenError::Read {
            path: path.to_path_buf(),
            message: err.to_string(),
        })?;
        Self::new(&text).map_err(|err| TokenError::File {
            path: path.to_path_buf(),
            message: err.to_string(),
        })
    }

    /// The token's text, to send it; never log it.
    pub fn secret(&self) -> &str {
        &self.0
    }

    /// Whether `presented` is this token, in time that depends only on this token's
    /// length, never on where the two differ.
    pub fn matches(&self, presented: Option<&[u8]>) -> bool {
        let Some(presented) = presented else {
            return false;
        };
        let expected = self.0.as_bytes();
        let mut diff = u8::from(presented.len() != expected.len());
        for (at, byte) in expected.iter().enumerate() {
            diff |= byte ^ presented.get(at).copied().unwrap_or(0);
        }
        diff == 0
    }

    /// Whether an HTTP `Authorization` header value is `Bearer <this token>` (constant
    /// time): the check of every token-guarded HTTP listener (relay admin, router API).
    pub fn matches_authorization(&self, authorization: Option<&[u8]>) -> bool {
        self.matches(bearer_of(authorization))
    }
}

/// The token of an `Authorization: Bearer <token>` header value, if it is one.
pub fn bearer_of(authorization: Option<&[u8]>) -> Option<&[u8]> {
    authorization?.strip_prefix(b"Bearer ")
}

/// A bearer token that cannot be used. Never quotes the token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    /// The token is empty (after trimming).
    #[error("bearer token must not be empty")]
    Empty,
    /// The token is longer than the protocol allows.
    #[error("bearer token is {len} bytes, at most {max} allowed")]
    TooLong {
        /// Its length.
        len: usize,
        /// The protocol's bound.
        max: usize,
    },
    /// The token contains a control character.
    #[error("bearer token must not contain control characters")]
    ControlCharacter,
    /// The token file could not be read.
    #[error("reading token file {path}: {message}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The token file holds no usable token.
    #[error("token file {path}: {message}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with its contents.
        message: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(text: &str) -> BearerToken {
        BearerToken::new(text).unwrap()
    }

    #[test]
    fn only_the_exact_token_matches() {
        let expected = token("s3cret");
        assert!(expected.matches(Some(b"s3cret")));
        for wrong in [&b"s3cre"[..], b"s3cret!", b"S3cret", b"", b"x3cret"] {
            assert!(!expected.matches(Some(wrong)), "{wrong:?}");
        }
        assert!(!expected.matches(None));
    }

    #[test]
    fn bearer_headers_are_parsed_strictly() {
        assert_eq!(bearer_of(Some(b"Bearer abc")), Some(&b"abc"[..]));
        assert_eq!(bearer_of(Some(b"bearer abc")), None);
        assert_eq!(bearer_of(Some(b"Basic abc")), None);
        assert_eq!(bearer_of(None), None);
        let expected = token("abc");
        assert!(expected.matches_authorization(Some(b"Bearer abc")));
        assert!(!expected.matches_authorization(Some(b"Bearer abd")));
        assert!(!expected.matches_authorization(Some(b"abc")));
        assert!(!expected.matches_authorization(None));
    }

    #[test]
    fn token_is_trimmed_bounded_and_never_printed() {
        let token = token("  s3cret\n");
        assert_eq!(token.secret(), "s3cret");
        assert!(!format!("{token:?}").contains("s3cret"));
        assert_eq!(BearerToken::new(" \n"), Err(TokenError::Empty));
        assert!(BearerToken::new(&"x".repeat(MAX_AUTH_TOKEN_LEN)).is_ok());
        assert!(matches!(
            BearerToken::new(&"x".repeat(MAX_AUTH_TOKEN_LEN + 1)),
            Err(TokenError::TooLong {
                len: 4097,
                max: 4096
            })
        ));
        assert_eq!(
            BearerToken::new("a\u{7}b"),
            Err(TokenError::ControlCharacter)
        );
        assert_eq!(
            BearerToken::new("a\u{85}b"),
            Err(TokenError::ControlCharacter)
        );
    }

    #[test]
    fn token_file_errors_name_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing");
        assert!(matches!(
            BearerToken::from_file(&missing),
            Err(TokenError::Read { path, .. }) if path == missing
        ));
        let empty = dir.path().join("empty");
        std::fs::write(&empty, "\n").unwrap();
        let err = BearerToken::from_file(&empty).unwrap_err();
        assert!(err.to_string().contains("empty"), "{err}");
        assert!(matches!(err, TokenError::File { path, .. } if path == empty));
        let good = dir.path().join("good");
        std::fs::write(&good, "abc\n").unwrap();
        assert_eq!(BearerToken::from_file(&good), Ok(token("abc")));
    }
}
