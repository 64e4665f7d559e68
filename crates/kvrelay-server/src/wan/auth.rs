//! Bearer-token authentication of WAN stream requests.
//!
//! Off unless configured. The token travels in the stream request (so it is only private on a
//! TLS listener) and is compared in constant time.

use std::path::Path;
use std::sync::Arc;

use crate::config::{AuthConfig, ConfigError};

/// The relay's expected bearer token.
#[derive(Clone)]
pub(crate) struct BearerToken {
    token: Arc<[u8]>,
}

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken(..)")
    }
}

impl BearerToken {
    /// Loads the token named by `config` (inline or from a file, trimmed).
    pub(crate) fn load(config: &AuthConfig) -> Result<Self, ConfigError> {
        let text = match (&config.token, &config.token_file) {
            (Some(token), _) => token.trim().to_owned(),
            (None, Some(path)) => read_token(path)?,
            (None, None) => String::new(),
        };
        if text.is_empty() {
            return Err(ConfigError::InvalidField {
                field: "wan.auth",
                value: String::new(),
                reason: "token must not be empty",
            });
        }
        Ok(Self {
            token: Arc::from(text.into_bytes()),
        })
    }

    /// Whether `presented` equals the token, in time independent of where they differ.
    pub(crate) fn matches(&self, presented: Option<&str>) -> bool {
        kvrelay_http::token_matches(&self.token, presented.map(str::as_bytes))
    }

    /// Whether HTTP `headers` carry `Authorization: Bearer <token>` (constant time).
    pub(crate) fn matches_headers(&self, headers: &axum::http::HeaderMap) -> bool {
        kvrelay_http::bearer_matches(&self.token, headers)
    }
}

#[cfg(test)]
impl BearerToken {
    /// A token for unit tests.
    pub(crate) fn for_tests(text: &str) -> Self {
        Self {
            token: Arc::from(text.as_bytes()),
        }
    }
}

fn read_token(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path)
        .map(|text| text.trim().to_owned())
        .map_err(|err| ConfigError::Read {
            path: path.to_path_buf(),
            message: err.to_string(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(text: &str) -> BearerToken {
        BearerToken::load(&AuthConfig {
            token: Some(text.into()),
            token_file: None,
        })
        .unwrap()
    }

    #[test]
    fn only_the_exact_token_matches() {
        let expected = token("s3cret");
        assert!(expected.matches(Some("s3cret")));
        assert!(!expected.matches(Some("s3cre")));
        assert!(!expected.matches(Some("s3cret!")));
        assert!(!expected.matches(Some("S3cret")));
        assert!(!expected.matches(None));
    }

    #[test]
    fn token_file_is_trimmed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        std::fs::write(&path, "abc\n").unwrap();
        let loaded = BearerToken::load(&AuthConfig {
            token: None,
            token_file: Some(path),
        })
        .unwrap();
        assert!(loaded.matches(Some("abc")));
    }
}
