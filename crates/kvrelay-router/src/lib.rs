//! The kvrelay router service: follows the relays of every DC (a
//! [`kvrelay_consumer::Consumer`]) and answers "where should this request go" over HTTP,
//! so routers written in any language get the ranking without embedding the library.
//!
//! API (JSON; see docs/consumer.md):
//! - `POST /v1/route` `{tokens, model, lora?, namespace?, top_k?}` → the ranking, with
//!   the same semantics as [`kvrelay_consumer::Consumer::score`];
//! - `POST /v1/route/batch` `{requests: [...]}` → one answer (or error) per request;
//! - `GET /v1/pools` relays, replica states, sequences, ages, quarantined entries;
//! - `GET /metrics` (`kvrelay_router_*` then `kvrelay_consumer_*`), `/healthz`, `/readyz`.
//!
//! # Where to start reading
//! [`config`] (what can be set, with defaults), [`api`] (bodies and their validation,
//! pure), [`readiness`] (pure), then [`service`] (the handlers and the lifecycle).

pub mod api;
pub mod config;
pub mod metrics;
pub mod readiness;
pub mod service;

pub use config::{RelaySection, RouterConfig, RouterConfigError};
pub use kvrelay_tls::ListenerTls;
pub use readiness::RouterReadiness;
pub use service::{RouterError, RouterService};
