//! Model cards, discovery backends and the membership projection with topology and readiness.
