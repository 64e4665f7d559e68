//! Explicit conversions between domain types and the v1 wire types.
