//! The counting cuckoo filter core: exact ownership, event application, publication images, replicas and multi-pool prefix queries.
