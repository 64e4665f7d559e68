//! The relay host: wiring, WAN server and admin HTTP.
