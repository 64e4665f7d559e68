//! `cargo xtask services`: the external servers and tools the integration tests start, in
//! one list, found on `PATH` or installed.
//!
//! `cargo xtask ci` runs this first. A missing program is installed when it can be (root,
//! or passwordless `sudo -n`, with `apt-get`: `apt-get update`, then one `apt-get install`
//! of every missing package), and the run says so; otherwise it stops at once and prints
//! the exact command. No test is ever skipped because a program is missing.

use std::process::Command;

use anyhow::{Context, Result, bail};

/// A program the tests run, and the Debian package that provides it.
struct Requirement {
    binary: &'static str,
    version_arg: &'static str,
    package: &'static str,
    used_by: &'static str,
}

/// The one list of programs the test suite needs beyond the Rust toolchain.
const REQUIREMENTS: &[Requirement] = &[
    Requirement {
        binary: "etcd",
        version_arg: "--version",
        package: "etcd-server",
        used_by: "etcd discovery tests (a real etcd on loopback)",
    },
    Requirement {
        binary: "nats-server",
        version_arg: "--version",
        package: "nats-server",
        used_by: "Dynamo NATS ingest tests (a real NATS server on loopback)",
    },
    Requirement {
        binary: "prlimit",
        version_arg: "--version",
        package: "util-linux",
        used_by: "the descriptor-limit test (starts the relay under a limit)",
    },
];

/// Finds every required program (installing the missing ones when this user can), then
/// the Python environment of the Dynamo-interop tests (`crate::interop`).
pub(crate) fn run() -> Result<()> {
    programs()?;
    crate::interop::ensure()
}

/// Finds every required program, installing the missing ones when this user can.
fn programs() -> Result<()> {
    let missing = report();
    if missing.is_empty() {
        return Ok(());
    }
    let packages: Vec<&str> = missing.iter().map(|r| r.package).collect();
    let binaries: Vec<&str> = missing.iter().map(|r| r.binary).collect();
    let root = is_root();
    // A user with passwordless sudo can install too (CI runners often are one).
    let sudo = !root && passwordless_sudo();
    let install = match plan(
        &binaries,
        &packages,
        root || sudo,
        crate::command::available("apt-get", "--version"),
    ) {
        Plan::Nothing => return Ok(()),
        Plan::Stop(message) => bail!(message),
        Plan::Install(command) => command,
    };
    eprintln!(
        "==> installing {} ({}): {install}",
        packages.join(" "),
        if root {
            "running as root"
        } else {
            "with sudo -n"
        }
    );
    let apt = |args: &[&str]| {
        let mut command = if root {
            Command::new("apt-get")
        } else {
            let mut sudo = Command::new("sudo");
            sudo.args(["-n", "env", "DEBIAN_FRONTEND=noninteractive", "apt-get"]);
            sudo
        };
        command.args(args).env("DEBIAN_FRONTEND", "noninteractive");
        command
    };
    crate::command::run(&mut apt(&["update", "-qq"]), "apt-get update")?;
    let mut install_args = vec!["install", "-y", "-qq", "--no-install-recommends"];
    install_args.extend(&packages);
    crate::command::run(
        &mut apt(&install_args),
        &format!("apt-get install {}", packages.join(" ")),
    )?;
    let still_missing = report();
    if !still_missing.is_empty() {
        bail!(
            "still missing after installing: {}",
            still_missing
                .iter()
                .map(|r| r.binary)
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}

/// What to do about missing programs.
#[derive(Debug, PartialEq, Eq)]
enum Plan {
    Nothing,
    /// Install them with this command (root with apt-get).
    Install(String),
    /// Stop with this message, which holds the exact command.
    Stop(String),
}

fn plan(binaries: &[&str], packages: &[&str], can_install: bool, has_apt: bool) -> Plan {
    if packages.is_empty() {
        return Plan::Nothing;
    }
    let install = format!(
        "apt-get update && apt-get install -y --no-install-recommends {}",
        packages.join(" ")
    );
    if can_install && has_apt {
        return Plan::Install(install);
    }
    let why = if has_apt {
        "not root and no passwordless sudo"
    } else {
        "no apt-get"
    };
    Plan::Stop(format!(
        "missing {} ({why}, so not installing); install as root with:\n    sudo sh -c '{install}'",
        binaries.join(", ")
    ))
}

/// Prints one line per program and returns the missing ones.
fn report() -> Vec<&'static Requirement> {
    let mut missing = Vec::new();
    for requirement in REQUIREMENTS {
        let found = crate::command::available(requirement.binary, requirement.version_arg);
        eprintln!(
            "    {:<12} {:<8} (debian package {}; {})",
            requirement.binary,
            if found { "found" } else { "MISSING" },
            requirement.package,
            requirement.used_by
        );
        if !found {
            missing.push(requirement);
        }
    }
    missing
}

/// Whether `sudo -n true` succeeds (sudo without a password prompt).
fn passwordless_sudo() -> bool {
    Command::new("sudo")
        .args(["-n", "true"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Whether this process runs as root (`id -u` prints 0).
fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .context("running id -u")
        .map(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn root_with_apt_installs_every_missing_package_in_one_command() {
        assert_eq!(
            plan(&["etcd", "nats-server"], &["etcd-server", "nats-server"], true, true),
            Plan::Install(
                "apt-get update && apt-get install -y --no-install-recommends etcd-server nats-server"
                    .into()
            )
        );
    }

    #[test]
    fn a_user_who_cannot_install_is_stopped_with_the_exact_command() {
        let Plan::Stop(message) = plan(&["nats-server"], &["nats-server"], false, true) else {
            panic!("a non-root user must be stopped");
        };
        assert!(message.contains("missing nats-server"), "{message}");
        assert!(
            message.contains("sudo sh -c 'apt-get update && apt-get install -y --no-install-recommends nats-server'"),
            "{message}"
        );
        assert!(matches!(
            plan(&["etcd"], &["etcd-server"], true, false),
            Plan::Stop(_)
        ));
    }

    #[test]
    fn nothing_missing_needs_nothing() {
        assert_eq!(plan(&[], &[], false, false), Plan::Nothing);
    }
}
