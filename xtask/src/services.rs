//! `cargo xtask services`: reports which external servers and tools the integration tests
//! need.

use anyhow::{Result, bail};

/// The servers integration tests start on loopback, and the tools they run, with the
/// Debian package providing each (`prlimit` starts the relay under a descriptor limit).
const SERVICES: &[(&str, &str, &str)] = &[
    ("etcd", "--version", "etcd-server"),
    ("nats-server", "--version", "nats-server"),
    ("prlimit", "--version", "util-linux"),
];

/// Prints a table of required servers and fails if any is missing.
pub(crate) fn run() -> Result<()> {
    let mut missing = Vec::new();
    println!("{:<14} {:<10} debian package", "server", "status");
    for (binary, version_arg, package) in SERVICES {
        let found = crate::command::available(binary, version_arg);
        println!(
            "{binary:<14} {:<10} {package}",
            if found { "found" } else { "MISSING" }
        );
        if !found {
            missing.push(*package);
        }
    }
    if !missing.is_empty() {
        bail!(
            "missing servers; install with: apt-get install -y {}",
            missing.join(" ")
        );
    }
    Ok(())
}
