//! `cargo xtask codegen`: the workspace's one protobuf code generation path.
//!
//! Generated Rust is checked in, so building kvrelay needs no `protoc` and no build
//! script: `protox` (a protobuf compiler in Rust) parses the `.proto` files into a
//! descriptor set, `tonic-prost-build` turns that into messages and gRPC stubs, and rustfmt
//! formats the result. `cargo xtask tidy` regenerates every set in memory and fails when a
//! checked-in file differs (stale), and fails when any crate the workspace ships would run
//! protoc at build time (ARCHITECTURE.md, "Generated code").

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::command::workspace_root;

/// One `.proto` package compiled into one checked-in Rust file.
pub(crate) struct ProtoSet {
    /// The include root, relative to the workspace.
    include: &'static str,
    /// The files to compile, relative to `include`.
    files: &'static [&'static str],
    /// The protobuf package (prost names its output file after it).
    package: &'static str,
    /// The checked-in Rust file, relative to the workspace.
    output: &'static str,
    /// What the file is, for its module docs.
    summary: &'static str,
    build_client: bool,
    build_server: bool,
    /// Fields generated as `bytes::Bytes` (shared, never copied) instead of `Vec<u8>`.
    bytes_fields: &'static [&'static str],
    /// Also embed the encoded `FileDescriptorSet` (without source info) as
    /// `FILE_DESCRIPTOR_SET`, for gRPC reflection.
    descriptor_set: bool,
}

/// Every generated file in the workspace.
pub(crate) const PROTO_SETS: &[ProtoSet] = &[
    ProtoSet {
        include: "crates/kvrelay-membership/proto",
        files: &["etcd/rpc.proto"],
        package: "etcdserverpb",
        output: "crates/kvrelay-membership/src/etcd/generated.rs",
        summary: "etcd's v3 KV, Watch and Lease messages and gRPC clients (the subset discovery calls)",
        build_client: true,
        build_server: false,
        bytes_fields: &[],
        descriptor_set: false,
    },
    ProtoSet {
        include: "crates/kvrelay-dynamo/proto",
        files: &["dynamo/kvrelay/v1/relay.proto"],
        package: "dynamo.kvrelay.v1",
        output: "crates/kvrelay-dynamo/src/generated.rs",
        summary: "Dynamo's relay contract `dynamo.kvrelay.v1`: messages, the `KvEventRelay` server and client, and the descriptor set reflection serves",
        build_client: true,
        build_server: true,
        // A snapshot chunk is up to 4 MiB and fanned out to every subscriber.
        bytes_fields: &[".dynamo.kvrelay.v1.FilterUpdate.payload"],
        descriptor_set: true,
    },
];

/// Crates that compile protobuf definitions (and may run `protoc`) from a build script;
/// none may be in the build graph of a crate the workspace ships.
pub(crate) const PROTOC_BUILD_CRATES: &[&str] = &[
    "prost-build",
    "tonic-build",
    "tonic-prost-build",
    "protobuf-codegen",
    "protoc-bin-vendored",
    "protobuf-src",
    "protoc-rust",
];

/// Regenerates every checked-in file.
pub(crate) fn run() -> Result<()> {
    let root = workspace_root();
    for set in PROTO_SETS {
        let text = generate(&root, set)?;
        let output = root.join(set.output);
        let current = std::fs::read_to_string(&output).unwrap_or_default();
        if current == text {
            eprintln!("    {} is up to date", set.output);
            continue;
        }
        std::fs::write(&output, text).with_context(|| format!("writing {}", output.display()))?;
        eprintln!("    wrote {}", set.output);
    }
    Ok(())
}

/// The checked-in files that differ from what their `.proto` files generate now.
pub(crate) fn stale_outputs(root: &Path) -> Result<Vec<&'static str>> {
    let mut stale = Vec::new();
    for set in PROTO_SETS {
        let expected = generate(root, set)?;
        let current = std::fs::read_to_string(root.join(set.output)).unwrap_or_default();
        if current != expected {
            stale.push(set.output);
        }
    }
    Ok(stale)
}

/// The formatted Rust text of one set, with its module docs.
fn generate(root: &Path, set: &ProtoSet) -> Result<String> {
    let include = root.join(set.include);
    let files: Vec<PathBuf> = set.files.iter().map(|f| include.join(f)).collect();
    let descriptors = protox::compile(&files, [&include])
        .map_err(|error| anyhow::anyhow!("compiling {:?}: {error}", set.files))?;
    let embedded = if set.descriptor_set {
        let mut stripped = descriptors.clone();
        for file in &mut stripped.file {
            file.source_code_info = None;
        }
        let bytes = prost::Message::encode_to_vec(&stripped);
        format!(
            "\n/// The encoded `FileDescriptorSet` of {sources_plain} (no source info), for reflection.\npub const FILE_DESCRIPTOR_SET: &[u8] = &{bytes:?};\n",
            sources_plain = set.files.join(", "),
        )
    } else {
        String::new()
    };
    let scratch = tempfile::tempdir().context("creating a scratch directory")?;
    let mut builder = tonic_prost_build::configure()
        .build_client(set.build_client)
        .build_server(set.build_server)
        .build_transport(false);
    for field in set.bytes_fields {
        builder = builder.bytes(field);
    }
    builder
        .out_dir(scratch.path())
        .compile_fds(descriptors)
        .with_context(|| format!("generating Rust for {:?}", set.files))?;
    let generated_path = scratch.path().join(format!("{}.rs", set.package));
    let generated = std::fs::read_to_string(&generated_path)
        .with_context(|| format!("reading {}", generated_path.display()))?;
    let sources = set
        .files
        .iter()
        .map(|f| format!("`{}/{f}`", set.include))
        .collect::<Vec<_>>()
        .join(", ");
    let text = format!(
        "//! {summary}.\n//!\n//! @generated by `cargo xtask codegen` from {sources}; do not edit by hand\n//! (`cargo xtask tidy` fails when this file is stale).\n\n{generated}{embedded}",
        summary = set.summary,
    );
    rustfmt(&text)
}

/// `text` formatted by the toolchain's rustfmt (the same style `cargo fmt` checks).
fn rustfmt(text: &str) -> Result<String> {
    use std::io::Write as _;
    let mut child = Command::new("rustfmt")
        .args(["--edition", "2024", "--emit", "stdout", "--quiet"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting rustfmt")?;
    let mut stdin = child.stdin.take().context("rustfmt stdin")?;
    let input = text.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let output = child.wait_with_output().context("running rustfmt")?;
    writer
        .join()
        .map_err(|_| anyhow::anyhow!("rustfmt writer panicked"))?
        .context("writing to rustfmt")?;
    if !output.status.success() {
        bail!(
            "rustfmt failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    String::from_utf8(output.stdout).context("rustfmt wrote non-UTF-8")
}
