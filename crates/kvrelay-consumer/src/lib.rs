//! Replicas of remote pools and request scoring across datacenters.
