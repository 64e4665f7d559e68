//! [`EndpointId`]: the `namespace/component/name` triple naming a serving endpoint.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Namespace used when parsed text names none.
pub const DEFAULT_ENDPOINT_NAMESPACE: &str = "NS";

/// Component used when parsed text names none.
pub const DEFAULT_ENDPOINT_COMPONENT: &str = "C";

/// Endpoint name used when parsed text names none.
pub const DEFAULT_ENDPOINT_NAME: &str = "E";

/// The URL scheme accepted (and stripped) when parsing an [`EndpointId`].
pub const ENDPOINT_SCHEME: &str = "dyn://";

/// Which part of an endpoint triple a validation error is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EndpointPart {
    /// The namespace.
    Namespace,
    /// The component.
    Component,
    /// The endpoint name.
    Name,
}

impl fmt::Display for EndpointPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Namespace => "namespace",
            Self::Component => "component",
            Self::Name => "name",
        })
    }
}

/// Why an endpoint triple was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EndpointIdError {
    /// A part is the empty string.
    #[error("endpoint {part} must not be empty")]
    Empty {
        /// The empty part.
        part: EndpointPart,
    },
    /// A part starts or ends with whitespace.
    #[error("endpoint {part} {value:?} must not contain leading or trailing whitespace")]
    SurroundingWhitespace {
        /// The offending part.
        part: EndpointPart,
        /// Its value.
        value: String,
    },
    /// A part holds a character no part may hold: a control character (NUL, newline,
    /// escape, ...), or `.` or `/`, the separators of the reference's key layout
    /// (`ns/component/endpoint/..` keys, `namespace.<ns>.component.<c>..` subjects).
    #[error("endpoint {part} {value:?} must not contain {character:?}")]
    InvalidCharacter {
        /// The offending part.
        part: EndpointPart,
        /// Its value (`Debug`-quoted in the message, so control characters are escaped).
        value: String,
        /// The first offending character.
        character: char,
    },
}

/// A serving endpoint: `{namespace, component, name}`.
///
/// Invariant: every part is non-empty, has no leading or trailing whitespace (the rule
/// the WAN validator applies to every text field), and holds no control character, `.`
/// or `/` (so every part is one segment of a key or subject, and safe to log). `Display` is `ns/component/name`;
/// [`EndpointId::dotted`] gives `ns.component.name`. Parsing (`FromStr`) strips an optional
/// `dyn://`, trims spaces, slashes and dots, splits on `.` or `/` and drops empty parts:
/// one part is the component, two are namespace and component, a third and further parts
/// are joined with `_` into the name; missing parts take the `NS`/`C`/`E` defaults.
/// `Display` and parsing round-trip when no part contains `.`, `/` or `_`-joined pieces.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "RawEndpointId")]
pub struct EndpointId {
    namespace: String,
    component: String,
    name: String,
}

impl EndpointId {
    /// Validates the three parts.
    ///
    /// ```
    /// use kvrelay_identity::EndpointId;
    /// let endpoint = EndpointId::new("prod", "router", "generate").unwrap();
    /// assert_eq!(endpoint.to_string(), "prod/router/generate");
    /// assert_eq!(endpoint.dotted(), "prod.router.generate");
    /// ```
    pub fn new(namespace: &str, component: &str, name: &str) -> Result<Self, EndpointIdError> {
        check_part(EndpointPart::Namespace, namespace)?;
        check_part(EndpointPart::Component, component)?;
        check_part(EndpointPart::Name, name)?;
        Ok(Self {
            namespace: namespace.to_owned(),
            component: component.to_owned(),
            name: name.to_owned(),
        })
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The component.
    pub fn component(&self) -> &str {
        &self.component
    }

    /// The endpoint name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `namespace.component.name`.
    pub fn dotted(&self) -> String {
        format!("{}.{}.{}", self.namespace, self.component, self.name)
    }

    /// `dyn://namespace.component.name`.
    pub fn as_url(&self) -> String {
        format!("{ENDPOINT_SCHEME}{}", self.dotted())
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.namespace, self.component, self.name)
    }
}

impl FromStr for EndpointId {
    type Err = EndpointIdError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let text = text.strip_prefix(ENDPOINT_SCHEME).unwrap_or(text);
        let mut parts = text
            .trim_matches([' ', '/', '.'])
            .split(['.', '/'])
            .filter(|part| !part.is_empty());
        let first = parts.next();
        let second = parts.next();
        let rest: Vec<&str> = parts.collect();
        let (namespace, component) = match (first, second) {
            (None, _) => (DEFAULT_ENDPOINT_NAMESPACE, DEFAULT_ENDPOINT_COMPONENT),
            (Some(component), None) => (DEFAULT_ENDPOINT_NAMESPACE, component),
            (Some(namespace), Some(component)) => (namespace, component),
        };
        let name = if rest.is_empty() {
            DEFAULT_ENDPOINT_NAME.to_owned()
        } else {
            rest.join("_")
        };
        Self::new(namespace, component, &name)
    }
}

/// The unvalidated serde shape of [`EndpointId`].
#[derive(Deserialize)]
struct RawEndpointId {
    namespace: String,
    component: String,
    name: String,
}

impl TryFrom<RawEndpointId> for EndpointId {
    type Error = EndpointIdError;

    fn try_from(raw: RawEndpointId) -> Result<Self, Self::Error> {
        check_part(EndpointPart::Namespace, &raw.namespace)?;
        check_part(EndpointPart::Component, &raw.component)?;
        check_part(EndpointPart::Name, &raw.name)?;
        Ok(Self {
            namespace: raw.namespace,
            component: raw.component,
            name: raw.name,
        })
    }
}

fn check_part(part: EndpointPart, value: &str) -> Result<(), EndpointIdError> {
    if value.is_empty() {
        return Err(EndpointIdError::Empty { part });
    }
    if value.trim() != value {
        return Err(EndpointIdError::SurroundingWhitespace {
            part,
            value: value.to_owned(),
        });
    }
    if let Some(character) = value
        .chars()
        .find(|character| character.is_control() || matches!(character, '.' | '/'))
    {
        return Err(EndpointIdError::InvalidCharacter {
            part,
            value: value.to_owned(),
            character,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, expected: (&str, &str, &str)) {
        let endpoint: EndpointId = text.parse().unwrap();
        assert_eq!(
            (endpoint.namespace(), endpoint.component(), endpoint.name()),
            expected,
            "parsing {text:?}"
        );
    }

    #[test]
    fn three_parts_split_on_dots_or_slashes() {
        check("prod/router/generate", ("prod", "router", "generate"));
        check("prod.router.generate", ("prod", "router", "generate"));
        check("prod.router/generate", ("prod", "router", "generate"));
    }

    #[test]
    fn scheme_and_surrounding_separators_are_stripped() {
        check("dyn://prod.router.generate", ("prod", "router", "generate"));
        check(" /prod//router/generate./ ", ("prod", "router", "generate"));
    }

    #[test]
    fn one_part_is_the_component() {
        check("router", ("NS", "router", "E"));
    }

    #[test]
    fn two_parts_are_namespace_and_component() {
        check("prod/router", ("prod", "router", "E"));
    }

    #[test]
    fn extra_parts_are_joined_into_the_name() {
        check(
            "prod/router/generate/v2.fast",
            ("prod", "router", "generate_v2_fast"),
        );
    }

    #[test]
    fn empty_text_gives_all_defaults() {
        check("", ("NS", "C", "E"));
        check("dyn://", ("NS", "C", "E"));
    }

    #[test]
    fn display_and_dotted_forms() {
        let endpoint = EndpointId::new("prod", "router", "generate").unwrap();
        assert_eq!(endpoint.to_string(), "prod/router/generate");
        assert_eq!(endpoint.dotted(), "prod.router.generate");
        assert_eq!(endpoint.as_url(), "dyn://prod.router.generate");
        assert_eq!(endpoint.to_string().parse::<EndpointId>(), Ok(endpoint));
    }

    #[test]
    fn empty_part_is_rejected() {
        assert_eq!(
            EndpointId::new("prod", "", "generate"),
            Err(EndpointIdError::Empty {
                part: EndpointPart::Component
            })
        );
    }

    #[test]
    fn part_with_surrounding_whitespace_is_rejected() {
        assert_eq!(
            EndpointId::new("prod", "router", " generate"),
            Err(EndpointIdError::SurroundingWhitespace {
                part: EndpointPart::Name,
                value: " generate".to_owned(),
            })
        );
        assert!("prod\t/router/generate".parse::<EndpointId>().is_err());
    }

    #[test]
    fn serde_uses_field_names_and_revalidates() {
        let endpoint = EndpointId::new("prod", "router", "generate").unwrap();
        let json = serde_json::to_string(&endpoint).unwrap();
        assert_eq!(
            json,
            r#"{"namespace":"prod","component":"router","name":"generate"}"#
        );
        assert_eq!(serde_json::from_str::<EndpointId>(&json).unwrap(), endpoint);
        let bad = r#"{"namespace":"","component":"router","name":"generate"}"#;
        assert!(serde_json::from_str::<EndpointId>(bad).is_err());
    }

    #[test]
    fn control_characters_and_separators_are_rejected_in_every_part() {
        for bad in [
            "inj\n2026 ERROR forged",
            "nul\0",
            "esc\u{1b}[31m",
            "a.b",
            "a/b",
            "del\u{7f}",
        ] {
            for (at, part) in [
                EndpointPart::Namespace,
                EndpointPart::Component,
                EndpointPart::Name,
            ]
            .into_iter()
            .enumerate()
            {
                let mut parts = ["ns", "component", "name"];
                parts[at] = bad;
                let err = EndpointId::new(parts[0], parts[1], parts[2]).unwrap_err();
                assert!(
                    matches!(err, EndpointIdError::InvalidCharacter { part: got, .. } if got == part),
                    "{bad:?}: {err}"
                );
                assert!(!err.to_string().contains('\n'), "{err}");
            }
        }
        assert!(EndpointId::new("prod-1", "back_end", "generate:v2 é").is_ok());
    }
}
