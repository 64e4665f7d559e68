//! The publication wire codec and the WAN protocol messages.
