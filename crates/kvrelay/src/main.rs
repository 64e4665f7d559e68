//! The kvrelay command-line tool: `relay`, `router`, `route`, `demo`, `inspect`, `hash`.
//!
//! Each subcommand lives in its own module exposing an `...Args` clap struct and a `run`
//! function; commands that need tokio build their own runtime.
//!
//! Errors print as one line on stderr. Bad arguments or bad input files exit with code 2,
//! other failures with code 1.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod demo;
mod demo_routing;
mod fd_limit;
mod hash;
mod inspect;
mod relay;
mod route;
mod router;
mod usage;

pub(crate) use usage::UsageError;

/// kvrelay: cross-datacenter KV-cache-aware routing relay.
#[derive(Debug, Parser)]
#[command(name = "kvrelay", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the relay service for this datacenter.
    Relay(relay::RelayArgs),
    /// Serve route requests over HTTP, following the relays of every DC.
    Router(router::RouterArgs),
    /// Rank the pools of remote relays for a request.
    Route(route::RouteArgs),
    /// Run the one-command demo: relay, trace replay and consumer on loopback.
    Demo(demo::DemoArgs),
    /// Compute reference-compatible block and sequence hashes of a token sequence.
    Hash(hash::HashArgs),
    /// Inspect identities, filter addresses, frames, memberships and engine batches.
    #[command(subcommand)]
    Inspect(inspect::InspectCommand),
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) if err.use_stderr() => {
            // Usage errors print as one line (clap's first line) and exit with code 2.
            let rendered = err.to_string();
            let first_line = rendered
                .lines()
                .find(|line| !line.trim().is_empty())
                .unwrap_or("");
            eprintln!("{first_line}");
            return ExitCode::from(2);
        }
        Err(help_or_version) => {
            let _ = help_or_version.print();
            return ExitCode::SUCCESS;
        }
    };
    let result = match cli.command {
        Command::Relay(args) => relay::run(args),
        Command::Router(args) => router::run(args),
        Command::Route(args) => route::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Hash(args) => hash::run(&args),
        Command::Inspect(command) => inspect::run(command),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("error: {err:#}");
            if err.downcast_ref::<UsageError>().is_some() {
                ExitCode::from(2)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}
