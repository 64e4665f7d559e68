//! Pool registry, pool actor and publication hub lifecycle.
