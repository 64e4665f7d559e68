//! How often to try again and how often to say so: the one retry [`Backoff`] and the one
//! [`LogBudget`] every kvrelay loop uses (reconnecting consumers, engine-source restarts,
//! the NATS subscription, the membership watch, accept loops, refusal logging).
//!
//! Pure: no clock, no randomness, no IO. Callers pass their `now`, how long the attempt
//! stayed healthy and a jitter sample, so every rule here is tested without waiting.

mod backoff;
mod log_budget;

pub use backoff::{Backoff, BackoffConfig, BackoffConfigError, NO_JITTER, equal_jitter};
pub use log_budget::{DEFAULT_LOG_INTERVAL, LogBudget, SharedLogBudget};
