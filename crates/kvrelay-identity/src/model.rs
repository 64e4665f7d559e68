//! Model names: [`CanonicalModelId`], [`ModelAlias`], [`ModelTarget`] and
//! [`CanonicalModelRegistration`].
//!
//! Names are validated for being non-empty without leading or trailing whitespace and
//! without control characters (a name reaches logs and other DCs' catalogs, where a newline
//! or an escape sequence would forge lines); any other characters and any length are
//! accepted, as in the reference.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which kind of model name a [`ModelNameError`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ModelNameKind {
    /// A [`CanonicalModelId`].
    CanonicalModelId,
    /// A [`ModelAlias`].
    ModelAlias,
}

impl fmt::Display for ModelNameKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::CanonicalModelId => "canonical model id",
            Self::ModelAlias => "model alias",
        })
    }
}

/// Why a model name was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ModelNameError {
    /// The name is the empty string.
    #[error("{kind} must not be empty")]
    Empty {
        /// Which kind of name.
        kind: ModelNameKind,
    },
    /// The name starts or ends with whitespace.
    #[error("{kind} {value:?} must not contain leading or trailing whitespace")]
    SurroundingWhitespace {
        /// Which kind of name.
        kind: ModelNameKind,
        /// The offending name.
        value: String,
    },
    /// The name holds a control character (NUL, newline, escape, ...).
    #[error("{kind} {value:?} must not contain control characters")]
    ControlCharacter {
        /// Which kind of name.
        kind: ModelNameKind,
        /// The offending name (`Debug`-quoted in the message).
        value: String,
    },
}

macro_rules! model_name {
    ($(#[$doc:meta])* $name:ident, $kind:expr) => {
        $(#[$doc])*
        ///
        /// Invariant: non-empty, no leading or trailing whitespace, no control characters.
        /// Serialises as a plain
        /// string; deserialising re-validates.
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Validates `value`.
            pub fn new(value: &str) -> Result<Self, ModelNameError> {
                check_name($kind, value)?;
                Ok(Self(value.to_owned()))
            }

            /// The name.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = ModelNameError;

            fn try_from(value: String) -> Result<Self, Self::Error> {
                check_name($kind, &value)?;
                Ok(Self(value))
            }
        }

        impl From<$name> for String {
            fn from(name: $name) -> Self {
                name.0
            }
        }

        impl std::str::FromStr for $name {
            type Err = ModelNameError;

            fn from_str(value: &str) -> Result<Self, Self::Err> {
                Self::new(value)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }
    };
}

model_name!(
    /// The canonical name a model is served under (a base model or a served LoRA adapter).
    CanonicalModelId,
    ModelNameKind::CanonicalModelId
);

model_name!(
    /// Another request-facing name for a canonical model.
    ModelAlias,
    ModelNameKind::ModelAlias
);

/// What a served model name runs: a base model, or a LoRA adapter on a base model.
///
/// Ordered `Base < Lora`. JSON is externally tagged: `{"Base":{"base_model":"x"}}`,
/// `{"Lora":{"base_model":"x","adapter":"y"}}`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum ModelTarget {
    /// A base model.
    Base {
        /// The base model.
        base_model: CanonicalModelId,
    },
    /// A LoRA adapter loaded on a base model.
    Lora {
        /// The base model the adapter runs on.
        base_model: CanonicalModelId,
        /// The runtime adapter name.
        adapter: CanonicalModelId,
    },
}

impl ModelTarget {
    /// The base model, for both variants.
    pub fn base_model(&self) -> &CanonicalModelId {
        match self {
            Self::Base { base_model } | Self::Lora { base_model, .. } => base_model,
        }
    }

    /// The adapter, for `Lora`.
    pub fn adapter(&self) -> Option<&CanonicalModelId> {
        match self {
            Self::Base { .. } => None,
            Self::Lora { adapter, .. } => Some(adapter),
        }
    }
}

/// A request-facing model name, what it runs, and its aliases.
///
/// Invariant (normalised on construction and on deserialising): aliases are sorted,
/// deduplicated and never equal to the model name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(from = "RawRegistration")]
pub struct CanonicalModelRegistration {
    model: CanonicalModelId,
    target: ModelTarget,
    aliases: Vec<ModelAlias>,
}

impl CanonicalModelRegistration {
    /// A registration of `model` running `target`, with `aliases` normalised.
    pub fn new(model: CanonicalModelId, target: ModelTarget, aliases: Vec<ModelAlias>) -> Self {
        let mut aliases = aliases;
        aliases.retain(|alias| alias.as_str() != model.as_str());
        aliases.sort_unstable();
        aliases.dedup();
        Self {
            model,
            target,
            aliases,
        }
    }

    /// A base-model registration: the target is `Base { base_model: model }`.
    ///
    /// ```
    /// use kvrelay_identity::{CanonicalModelId, CanonicalModelRegistration, ModelAlias};
    /// let model = CanonicalModelId::new("llama").unwrap();
    /// let aliases = vec![ModelAlias::new("b").unwrap(), ModelAlias::new("llama").unwrap()];
    /// let registration = CanonicalModelRegistration::base(model, aliases);
    /// assert_eq!(registration.aliases(), [ModelAlias::new("b").unwrap()]);
    /// ```
    pub fn base(model: CanonicalModelId, aliases: Vec<ModelAlias>) -> Self {
        let target = ModelTarget::Base {
            base_model: model.clone(),
        };
        Self::new(model, target, aliases)
    }

    /// The request-facing canonical name.
    pub fn model(&self) -> &CanonicalModelId {
        &self.model
    }

    /// What the name runs.
    pub fn target(&self) -> &ModelTarget {
        &self.target
    }

    /// Other request-facing names: sorted, unique, never equal to the model.
    pub fn aliases(&self) -> &[ModelAlias] {
        &self.aliases
    }

    /// The model name followed by the aliases.
    pub fn request_names(&self) -> impl Iterator<Item = &str> {
        std::iter::once(self.model.as_str()).chain(self.aliases.iter().map(ModelAlias::as_str))
    }
}

/// The un-normalised serde shape of [`CanonicalModelRegistration`].
#[derive(Deserialize)]
struct RawRegistration {
    model: CanonicalModelId,
    target: ModelTarget,
    #[serde(default)]
    aliases: Vec<ModelAlias>,
}

impl From<RawRegistration> for CanonicalModelRegistration {
    fn from(raw: RawRegistration) -> Self {
        Self::new(raw.model, raw.target, raw.aliases)
    }
}

fn check_name(kind: ModelNameKind, value: &str) -> Result<(), ModelNameError> {
    if value.is_empty() {
        return Err(ModelNameError::Empty { kind });
    }
    if value.trim() != value {
        return Err(ModelNameError::SurroundingWhitespace {
            kind,
            value: value.to_owned(),
        });
    }
    if value.chars().any(char::is_control) {
        return Err(ModelNameError::ControlCharacter {
            kind,
            value: value.to_owned(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(name: &str) -> CanonicalModelId {
        CanonicalModelId::new(name).unwrap()
    }

    fn alias(name: &str) -> ModelAlias {
        ModelAlias::new(name).unwrap()
    }

    #[test]
    fn empty_names_are_rejected() {
        assert_eq!(
            CanonicalModelId::new(""),
            Err(ModelNameError::Empty {
                kind: ModelNameKind::CanonicalModelId
            })
        );
        assert_eq!(
            ModelAlias::new(""),
            Err(ModelNameError::Empty {
                kind: ModelNameKind::ModelAlias
            })
        );
    }

    #[test]
    fn surrounding_whitespace_is_rejected_naming_the_value() {
        let err = CanonicalModelId::new("llama ").unwrap_err();
        assert_eq!(
            err,
            ModelNameError::SurroundingWhitespace {
                kind: ModelNameKind::CanonicalModelId,
                value: "llama ".to_owned()
            }
        );
        assert_eq!(
            err.to_string(),
            "canonical model id \"llama \" must not contain leading or trailing whitespace"
        );
        assert!(ModelAlias::new("\tb").is_err());
    }

    #[test]
    fn control_characters_are_rejected() {
        let err = CanonicalModelId::new("inj\nERROR forged \u{1b}[31m").unwrap_err();
        assert!(
            matches!(err, ModelNameError::ControlCharacter { .. }),
            "{err}"
        );
        assert!(!err.to_string().contains('\n'), "{err}");
        assert!(ModelAlias::new("a\0b").is_err());
    }

    #[test]
    fn interior_whitespace_and_any_characters_are_accepted() {
        assert!(CanonicalModelId::new("meta llama/3.1:8B@fp8 é").is_ok());
        assert!(ModelAlias::new(&"x".repeat(10_000)).is_ok());
    }

    #[test]
    fn names_serialise_as_plain_strings_and_revalidate() {
        assert_eq!(serde_json::to_string(&model("llama")).unwrap(), "\"llama\"");
        assert_eq!(
            serde_json::from_str::<ModelAlias>("\"b\"").unwrap(),
            alias("b")
        );
        assert!(serde_json::from_str::<CanonicalModelId>("\" x\"").is_err());
        assert!(serde_json::from_str::<ModelAlias>("\"\"").is_err());
    }

    #[test]
    fn target_serialises_externally_tagged() {
        let base = ModelTarget::Base {
            base_model: model("llama"),
        };
        assert_eq!(
            serde_json::to_string(&base).unwrap(),
            r#"{"Base":{"base_model":"llama"}}"#
        );
        let lora = ModelTarget::Lora {
            base_model: model("llama"),
            adapter: model("sql"),
        };
        assert_eq!(
            serde_json::to_string(&lora).unwrap(),
            r#"{"Lora":{"base_model":"llama","adapter":"sql"}}"#
        );
        assert!(base < lora);
        assert_eq!(lora.base_model(), &model("llama"));
        assert_eq!(lora.adapter(), Some(&model("sql")));
        assert_eq!(base.adapter(), None);
    }

    #[test]
    fn registration_drops_alias_equal_to_model_sorts_and_dedups() {
        let registration = CanonicalModelRegistration::base(
            model("llama"),
            vec![alias("c"), alias("llama"), alias("a"), alias("c")],
        );
        assert_eq!(registration.aliases(), [alias("a"), alias("c")]);
        assert_eq!(
            registration.target(),
            &ModelTarget::Base {
                base_model: model("llama")
            }
        );
        let names: Vec<&str> = registration.request_names().collect();
        assert_eq!(names, ["llama", "a", "c"]);
    }

    #[test]
    fn deserialising_a_registration_renormalises() {
        let json =
            r#"{"model":"m","target":{"Base":{"base_model":"m"}},"aliases":["z","m","a","z"]}"#;
        let registration: CanonicalModelRegistration = serde_json::from_str(json).unwrap();
        assert_eq!(registration.aliases(), [alias("a"), alias("z")]);
    }

    #[test]
    fn deserialising_a_registration_revalidates_names() {
        let json = r#"{"model":"m","target":{"Base":{"base_model":"m"}},"aliases":[" a"]}"#;
        assert!(serde_json::from_str::<CanonicalModelRegistration>(json).is_err());
    }
}
