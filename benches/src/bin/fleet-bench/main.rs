//! `cargo xtask bench fleet [--quick] [--json FILE]`: one router's view of a fleet of DCs,
//! each caching millions of blocks, queried against the strongest exact index we can
//! build, in the same process and run (issue #37, item 1).
//!
//! **The fleet.** Shapes come from the Mooncake trace (`../shared/traces/`): its requests'
//! prefix chains (block ids; equal ids are a shared prefix) form a template forest. A
//! *tenant* is a copy of that forest with its own token hashes (tenant `t`, block `k` →
//! `splitmix(t, k)`). Each DC caches a subset of tenants, drawn by Zipf popularity (s = 1)
//! over `TENANTS` tenants, so popular tenants are cached in many DCs and rare ones in few;
//! of each tenant it holds every template request with probability ½ (the union of their
//! chains, so what it holds is prefix-closed and DCs hold different parts of one tenant).
//! Tenants are added until the DC holds the target number of distinct blocks.
//!
//! **Each DC's filter** is built by the relay's own producer (`PoolFilter`, in the dense
//! format at its 95 % design load, then again in v1, each sized for the target) from
//! stored events (one per chain: its new suffix, parented on
//! the longest prefix already stored), then installed into one lane of a `QueryTable`, as
//! a router's replicas are. **The exact baseline** is one hash map from sequence hash to a
//! bitmask of the DCs holding it (keys are already uniform 64-bit hashes, so it uses them
//! as their own hash): a probe per position answers every DC.
//!
//! **Requests** (ground truth from the exact index): a DC and one of its tenants, one of
//! the template's requests (cached there or not), plus 0–3 fresh blocks; one in ten is a
//! fresh chain cached nowhere. Reported per DC count: full-map query throughput of both
//! (median of paired rounds, so both see the same machine state) and their ratio, p50/p99
//! per request, accuracy of the filter's depths against the exact ones (underestimates
//! must be 0), wrong best-DC picks, filter bits per resident membership and bytes, and a
//! probe's false-positive rate (never-stored hashes against every lane).
//!
//! **The relay's side of the first DC's pool** (`relay_pool` in the JSON): its producer's
//! apply rate and memory, then (`relay_pool.publication`, `relay_side.rs`) what publishing
//! it costs: the snapshot's encoding and its trip over loopback TCP into a replica, and
//! what a subscriber that missed 10 to 6,000 deltas of churn is sent to catch up; in the
//! v1 pass of the first DC count, what a dense format twin adds to it
//! (`relay_pool.format_twin`, `twin.rs`).

// The run's figures are one `json!` object, deeper than the macro's default limit.
#![recursion_limit = "256"]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvrelay_benches::{Flags, process_memory};
use kvrelay_ckf::{
    CkfConfig, FilterDensity, PoolFilter, PrefixDepths, PrefixQuery, QueryTable, SnapshotChunk,
};
use serde_json::{Value, json};

mod applying;
mod fleet;
mod mixed;
mod pages;
mod relay_side;
mod ties;
mod twin;

#[global_allocator]
static ALLOCATOR: pages::AdvisingAllocator = pages::AdvisingAllocator;

use applying::{quantile_us, scoring_while_applying};

use fleet::{
    BuiltDc, ExactMap, Rng, TENANTS, Zipf, build_dc, exact_depths, load_trace, paired_medians,
    requests,
};

/// The reference's published full-map ratios against its own exact index
/// (ai-dynamo/dynamo#11225), by DC count.
const REFERENCE_RATIOS: [(usize, f64); 3] = [(4, 0.345), (16, 0.165), (64, 0.084)];

/// The reference's router RSS at 64 DCs (2.0 GiB for about 640 M resident memberships,
/// ai-dynamo/dynamo#11225), per membership: the yardstick for ours at whatever size fits.
const REFERENCE_ROUTER_BYTES_PER_MEMBERSHIP: f64 = 2.0 * (1u64 << 30) as f64 / 640e6;

pub(crate) fn rounded(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// The share of (probe, lane) pairs that find a hash no DC ever stored: a probe's
/// false-positive rate, over `probes` random hashes against every lane.
fn false_positive_rate(table: &QueryTable, n_lanes: usize, probes: u64) -> f64 {
    let mut rng = Rng(0x0DDB_1A5E_5BAD_5EED);
    let mut depths = PrefixDepths::default();
    let mut hits = 0u64;
    for _ in 0..probes {
        table.prefix_depths_into(&[rng.next()], &mut depths);
        hits += (0..n_lanes)
            .filter(|&lane| depths.depth(lane) == Some(1))
            .count() as u64;
    }
    hits as f64 / (probes * n_lanes as u64).max(1) as f64
}

/// The formats a run builds, by name.
fn density_named(name: &str) -> Result<FilterDensity> {
    let lighter = |load_percent| FilterDensity::Dense {
        load_percent,
        size_classes_per_octave: 0,
    };
    match name {
        "dense" => Ok(FilterDensity::DENSE),
        "dense90" => Ok(lighter(90)),
        "dense85" => Ok(lighter(85)),
        "dense80" => Ok(lighter(80)),
        "v1" => Ok(FilterDensity::V1),
        other => {
            bail!("--formats: `{other}` is not a format (dense, dense90, dense85, dense80, v1)")
        }
    }
}

fn density_name(density: FilterDensity) -> &'static str {
    match density {
        FilterDensity::V1 => "v1",
        FilterDensity::Dense {
            size_classes_per_octave: 0,
            load_percent,
        } => match load_percent {
            90 => "dense90",
            85 => "dense85",
            80 => "dense80",
            _ => "dense",
        },
        FilterDensity::Dense {
            size_classes_per_octave,
            ..
        } => match size_classes_per_octave {
            1 => "dense_classed1",
            2 => "dense_classed2",
            4 => "dense_classed4",
            16 => "dense_classed16",
            _ => "dense_classed",
        },
    }
}

/// `--size-classes LIST`: the dense size classes per octave the mixed-size run measures
/// (8, the relay's default, unless told; each of 1, 2, 4, 8 and 16).
fn size_classes(flags: &Flags) -> Result<Vec<FilterDensity>> {
    flags
        .raw("size-classes")
        .unwrap_or("8")
        .split(',')
        .map(|n| match n.parse::<u8>() {
            Ok(classes @ (1 | 2 | 4 | 8 | 16)) => Ok(FilterDensity::Dense {
                load_percent: 95,
                size_classes_per_octave: classes,
            }),
            _ => bail!("--size-classes: `{n}` is not one of 1, 2, 4, 8, 16"),
        })
        .collect()
}

fn run(
    template: &[Vec<u32>],
    n_dcs: usize,
    blocks_per_dc: u64,
    n_requests: usize,
    density: FilterDensity,
    outages: &[u64],
    measure_twin: bool,
) -> Result<Value> {
    let started = Instant::now();
    let mut fleet = Fleet::new(template, blocks_per_dc, density)?;
    let mut exact = ExactMap::default();
    let mut dcs = Vec::with_capacity(n_dcs);
    let mut relay_pool = Value::Null;
    let mut first_snapshot = Vec::new();
    let mut capacity_omissions = 0u64;
    for dc in 0..n_dcs {
        let (built, mut filter) = fleet.build(dc, &mut exact)?;
        capacity_omissions += filter.counters().capacity_omissions;
        let Installed {
            chunks,
            snapshot_copy,
        } = fleet.install(dc, &mut filter)?;
        if dc == 0 {
            // The relay's side of one DC-sized pool: what its producer costs.
            let memory = filter.memory();
            let per_block = |bytes: u64| rounded(bytes as f64 / built.resident as f64, 1);
            relay_pool = json!({
                "blocks": built.resident,
                "apply_blocks_per_s": (built.blocks_applied as f64 / built.apply_time.as_secs_f64()).round() as u64,
                "snapshot_copy_ms": rounded(snapshot_copy.as_secs_f64() * 1e3, 1),
                "snapshot_chunks": chunks.len(),
                "memory_bytes": memory.total_bytes(),
                "bytes_per_block": per_block(memory.total_bytes()),
                "table_bytes_per_block": per_block(memory.table_bytes),
                "lineage_bytes_per_block": per_block(memory.lineage_bytes),
                "owner_bytes_per_block": per_block(memory.owner_bytes),
                "dirty_window_bytes": memory.dirty_window_bytes,
            });
            relay_pool["publication"] = relay_side::measure(&mut filter, outages)?;
            if measure_twin && density == FilterDensity::V1 {
                relay_pool["format_twin"] = twin::measure(template, blocks_per_dc)?;
            }
        }
        if dc == 0 {
            first_snapshot = chunks;
        }
        eprintln!(
            "  DC {:>2}/{n_dcs}: {} blocks from {} tenants, load {:.2}, {:.0} s",
            dc + 1,
            built.resident,
            built.tenants.len(),
            filter.load_factor(),
            started.elapsed().as_secs_f64()
        );
        dcs.push(built);
    }
    let table = fleet.table;
    let memberships: u64 = dcs.iter().map(|dc| dc.resident).sum();
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    let requests = requests(template, &dcs, n_requests, &mut rng);

    // Accuracy, against the exact index.
    let mut truth = vec![0u32; n_dcs];
    let mut ours = PrefixDepths::default();
    let (mut under, mut over, mut probes_total) = (0u64, 0u64, 0u64);
    let mut best_picks = ties::BestPicks::default();
    // How far overestimates go past the exact depth, in blocks (the depth inflation).
    let mut inflation_blocks = 0u64;
    for hashes in &requests {
        truth.iter_mut().for_each(|depth| *depth = 0);
        exact_depths(&exact, hashes, n_dcs, &mut truth);
        table.prefix_depths_into(hashes, &mut ours);
        probes_total += u64::from(ours.n_probes());
        for (dc, &exact_depth) in truth.iter().enumerate() {
            let depth = ours.depth(dc).unwrap_or(0);
            under += u64::from(depth < exact_depth);
            over += u64::from(depth > exact_depth);
            inflation_blocks += u64::from(depth.saturating_sub(exact_depth));
        }
        best_picks.record(hashes, &truth, |dc| ours.depth(dc).unwrap_or(0));
    }

    // Throughput: paired rounds, median of each.
    let (exact_median, table_median) = paired_medians(
        &requests,
        |hashes| {
            exact_depths(&exact, hashes, n_dcs, &mut truth);
            truth[0]
        },
        |hashes| {
            table.prefix_depths_into(hashes, &mut ours);
            ours.depth(0).unwrap_or(0)
        },
    );
    let per_second = |d: Duration| n_requests as f64 / d.as_secs_f64();
    let exact_qps = per_second(exact_median);
    let table_qps = per_second(table_median);

    // Per-request latency.
    let mut exact_lat = Vec::with_capacity(requests.len());
    let mut table_lat = Vec::with_capacity(requests.len());
    for hashes in &requests {
        let t = Instant::now();
        exact_depths(&exact, hashes, n_dcs, &mut truth);
        exact_lat.push(t.elapsed());
        let t = Instant::now();
        table.prefix_depths_into(hashes, &mut ours);
        table_lat.push(t.elapsed());
    }
    exact_lat.sort_unstable();
    table_lat.sort_unstable();

    let table_bytes = table.table_bytes();
    let table_advised = table.huge_pages_advised();
    let fp_probes = if n_requests >= 100_000 {
        200_000
    } else {
        50_000
    };
    let fp_rate = false_positive_rate(&table, n_dcs, fp_probes);
    let bits_per_membership = rounded(table_bytes as f64 * 8.0 / memberships as f64, 2);
    let applying = scoring_while_applying(table, &requests, &dcs, n_dcs, &first_snapshot)?;
    let exact_bytes = exact.allocation_size() as u64;
    let reference = REFERENCE_RATIOS
        .iter()
        .find(|(dcs, _)| *dcs == n_dcs)
        .map(|(_, ratio)| *ratio);
    let mean_len =
        requests.iter().map(Vec::len).sum::<usize>() as f64 / requests.len().max(1) as f64;
    let mut figures = json!({
        "dcs": n_dcs,
        "format": density_name(density),
        "blocks_per_dc": blocks_per_dc,
        "memberships": memberships,
        "distinct_blocks": exact.len(),
        "requests": n_requests,
        "mean_request_blocks": rounded(mean_len, 1),
        "query_per_s": table_qps.round() as u64,
        "exact_per_s": exact_qps.round() as u64,
        "query_vs_exact": rounded(table_qps / exact_qps, 3),
        "reference_query_vs_its_exact": reference,
        "query_p50_us": rounded(quantile_us(&table_lat, 0.5), 2),
        "query_p99_us": rounded(quantile_us(&table_lat, 0.99), 2),
        "exact_p50_us": rounded(quantile_us(&exact_lat, 0.5), 2),
        "exact_p99_us": rounded(quantile_us(&exact_lat, 0.99), 2),
        "probes_per_request": rounded(probes_total as f64 / n_requests as f64, 1),
        "bits_per_membership": bits_per_membership,
        "false_positives_per_probe": fp_rate,
        "capacity_omissions": capacity_omissions,
        "depth_inflation_blocks_per_dc_answer": inflation_blocks as f64 / (n_requests * n_dcs) as f64,
        "query_table_bytes": table_bytes,
        "huge_pages": pages::huge_pages(),
        "query_table_huge_pages_advised": table_advised,
        "process_huge_page_bytes": pages::anon_huge_page_bytes(),
        "exact_index_bytes": exact_bytes,
        "process_rss_bytes": process_memory(std::process::id()).map_or(0, |m| m.current_bytes),
        "score_p99_idle_us": rounded(applying.idle_p99_us, 2),
        "score_p99_applying_us": rounded(applying.beside_p99_us, 2),
        "score_p99_applying_vs_idle": rounded(applying.beside_p99_us / applying.idle_p99_us, 2),
        "score_p99_applying_write_locked_us": rounded(applying.write_locked_p99_us, 2),
        "score_p99_applying_write_locked_vs_idle": rounded(applying.write_locked_p99_us / applying.idle_p99_us, 2),
        "deltas_applied_per_s": applying.deltas_per_s.round() as u64,
        "snapshot_install_ms": rounded(applying.snapshot[1].install_ms, 1),
        "score_longest_during_snapshot_us": rounded(applying.snapshot[1].longest_score_us, 1),
        "snapshot_install_write_locked_ms": rounded(applying.snapshot[0].install_ms, 1),
        "score_longest_during_snapshot_write_locked_us": rounded(applying.snapshot[0].longest_score_us, 1),
        "underestimates": under,
        "overestimates": over,
        "build_seconds": rounded(started.elapsed().as_secs_f64(), 1),
        "relay_pool": relay_pool,
    });
    if let (Value::Object(figures), Value::Object(picks)) =
        (&mut figures, best_picks.figures(bits_per_membership))
    {
        figures.extend(picks);
    }
    Ok(figures)
}

/// The fleet as a router sees it, one DC at a time: each DC's filter is built by the
/// relay's producer ([`Fleet::build`]) and its snapshot installed into one lane of
/// `table` ([`Fleet::install`]).
struct Fleet<'a> {
    template: &'a [Vec<u32>],
    zipf: Zipf,
    blocks_per_dc: u64,
    config: CkfConfig,
    table: QueryTable,
}

/// A DC's snapshot as [`Fleet::install`] installed it into the DC's lane.
struct Installed {
    chunks: Vec<SnapshotChunk>,
    /// How long the producer took to copy the snapshot.
    snapshot_copy: Duration,
}

impl<'a> Fleet<'a> {
    /// An empty fleet of DCs of `blocks_per_dc` blocks shaped by `template`, filters in
    /// `density`.
    fn new(template: &'a [Vec<u32>], blocks_per_dc: u64, density: FilterDensity) -> Result<Self> {
        let config = CkfConfig::new(blocks_per_dc).with_density(density);
        let format = config.format().context("sizing the DC filters")?;
        Ok(Self {
            template,
            zipf: Zipf::new(TENANTS),
            blocks_per_dc,
            config,
            table: QueryTable::new(format, pages::query_config()).context("query table")?,
        })
    }

    /// Builds DC `dc`'s producer filter, marking its blocks in `exact`.
    fn build(&self, dc: usize, exact: &mut ExactMap) -> Result<(BuiltDc, PoolFilter)> {
        let mut filter = PoolFilter::new(self.config).context("a DC filter")?;
        let built = build_dc(
            dc,
            self.template,
            &self.zipf,
            self.blocks_per_dc,
            &mut filter,
            exact,
            &mut |_, _| Ok(()),
        )?;
        Ok((built, filter))
    }

    /// Installs DC `dc`'s snapshot from `filter` into a new lane, as a router's replica.
    fn install(&mut self, dc: usize, filter: &mut PoolFilter) -> Result<Installed> {
        let lane = self.table.add_lane().context("a query lane")?;
        let copying = Instant::now();
        let chunks = filter.snapshot().context("a DC snapshot")?.chunks;
        let snapshot_copy = copying.elapsed();
        for chunk in &chunks {
            self.table
                .install_chunk(lane, chunk)
                .map_err(|err| anyhow::anyhow!("installing DC {dc}: {err}"))?;
        }
        Ok(Installed {
            chunks,
            snapshot_copy,
        })
    }
}

/// The router's side alone, in a process of its own (`--replicas-only`): every DC's
/// filter is built as in [`run`], its snapshot installed into one lane of a query table
/// (as a router's replicas are), and everything else freed (the producer filter, the
/// builder's maps; no exact index is built). Prints the process's resident bytes then,
/// one JSON line: what a router's replicas of this fleet cost in memory, without its HTTP
/// service and runtime.
fn replicas_only(
    template: &[Vec<u32>],
    n_dcs: usize,
    blocks_per_dc: u64,
    density: FilterDensity,
) -> Result<()> {
    let mut fleet = Fleet::new(template, blocks_per_dc, density)?;
    let mut memberships = 0u64;
    for dc in 0..n_dcs {
        // Everything but the lane is freed, the builder's map before the install.
        let mut exact = ExactMap::default();
        let (built, mut filter) = fleet.build(dc, &mut exact)?;
        drop(exact);
        memberships += built.resident;
        fleet.install(dc, &mut filter)?;
    }
    let table = fleet.table;
    let memory = process_memory(std::process::id()).context("reading /proc/self/status")?;
    println!(
        "{}",
        json!({
            "rss_bytes": memory.current_bytes,
            "huge_page_bytes": pages::anon_huge_page_bytes(),
            "table_bytes": table.table_bytes(),
            "memberships": memberships,
        })
    );
    Ok(())
}

/// Runs [`replicas_only`] in a child process and returns its JSON line.
fn measure_replicas_process(
    trace: &std::path::Path,
    n_dcs: usize,
    blocks_per_dc: u64,
    density: FilterDensity,
) -> Result<Value> {
    let output = std::process::Command::new(std::env::current_exe()?)
        .arg("--replicas-only")
        .arg("--formats")
        .arg(density_name(density))
        .arg("--trace")
        .arg(trace)
        .arg("--dcs")
        .arg(n_dcs.to_string())
        .arg("--blocks-per-dc")
        .arg(blocks_per_dc.to_string())
        .args((!pages::huge_pages()).then_some("--small-pages"))
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("starting the replicas-only process")?;
    if !output.status.success() {
        bail!("the replicas-only process failed: {}", output.status);
    }
    let line = String::from_utf8(output.stdout).context("its output")?;
    serde_json::from_str(line.trim()).context("its JSON line")
}

/// Flags of `fleet-bench`.
const FLAGS: [&str; 10] = [
    "quick",
    "size-classes",
    "small-pages",
    "formats",
    "trace",
    "json",
    "dcs",
    "blocks-per-dc",
    "replicas-only",
    "help",
];

fn main() -> Result<()> {
    let flags = Flags::from_env();
    if flags.wants_help() {
        println!(
            "fleet-bench [--quick] [--trace PATH] [--json FILE] [--dcs 4,16,64] [--blocks-per-dc N] [--formats dense,v1] (also dense90, dense85, dense80: lighter dense loads) [--size-classes 8] (the dense size classes per octave the mixed-size run measures: any of 1, 2, 4, 8, 16) [--small-pages] (neither the query table nor the exact baseline on transparent huge pages)"
        );
        return Ok(());
    }
    flags.ensure_known(&FLAGS)?;
    let quick = flags.switch("quick");
    pages::use_huge_pages(!flags.switch("small-pages"));
    let trace = PathBuf::from(
        flags
            .raw("trace")
            .unwrap_or("../shared/traces/mooncake-synthetic.jsonl"),
    );
    let json_out = flags.raw("json").map(PathBuf::from);
    let dc_counts: Vec<usize> = match flags.raw("dcs") {
        None => vec![4, 16, 64],
        Some(list) => list
            .split(',')
            .map(|n| n.parse::<usize>().context("--dcs: a DC count"))
            .collect::<Result<_>>()?,
    };
    let blocks_override: Option<u64> = flags
        .raw("blocks-per-dc")
        .map(|_| flags.get("blocks-per-dc"))
        .transpose()?;
    if dc_counts.iter().any(|&n| n == 0 || n > 64) {
        bail!("DC counts must be 1..=64 (one bitmask word in the exact index)");
    }
    let densities: Vec<FilterDensity> = flags
        .raw("formats")
        .unwrap_or("dense,v1")
        .split(',')
        .map(density_named)
        .collect::<Result<_>>()?;
    if densities.is_empty() || densities.len() > 2 {
        bail!("--formats: one or two of dense, v1");
    }
    let classed = size_classes(&flags)?;
    let template = load_trace(&trace)?;
    if flags.switch("replicas-only") {
        let (&[n_dcs], Some(blocks_per_dc), &[density]) =
            (dc_counts.as_slice(), blocks_override, densities.as_slice())
        else {
            bail!("--replicas-only needs one --dcs count, --blocks-per-dc and one --formats");
        };
        return replicas_only(&template, n_dcs, blocks_per_dc, density);
    }
    let n_requests = if quick { 20_000 } else { 100_000 };
    // Deltas a subscriber misses (100 a second at the default publication window).
    let outages: &[u64] = if quick {
        &[10, 100, 1_000]
    } else {
        &[10, 100, 1_000, 6_000]
    };
    let mut runs = Vec::new();
    let mut table_rows = Vec::new();
    let mut mixed_rows: Vec<(&str, Value)> = Vec::new();
    for &n_dcs in &dc_counts {
        // 24 GiB here: 10 M blocks per DC up to 16 DCs, 2.5 M at 64 (160 M memberships).
        let blocks_per_dc: u64 = blocks_override.unwrap_or(match (quick, n_dcs) {
            (true, _) => 200_000,
            (false, n) if n <= 16 => 10_000_000,
            (false, _) => 2_500_000,
        });
        // The first format's figures are the run's; a second format's are nested under
        // its name, for a comparison measured in the same run.
        let mut first: Option<Value> = None;
        for &density in &densities {
            let name = density_name(density);
            eprintln!(
                "==> fleet: {n_dcs} DCs x {blocks_per_dc} blocks, {name} filters, {n_requests} requests"
            );
            let mut figures = run(
                &template,
                n_dcs,
                blocks_per_dc,
                n_requests,
                density,
                outages,
                // The twin's cost is a relay figure: once per invocation is enough.
                Some(&n_dcs) == dc_counts.first(),
            )?;
            eprintln!("==> fleet: the router's replicas alone ({name}), in a process of their own");
            let replicas = measure_replicas_process(&trace, n_dcs, blocks_per_dc, density)?;
            let rss = replicas["rss_bytes"].as_u64().unwrap_or(0);
            let memberships = replicas["memberships"].as_u64().unwrap_or(0).max(1);
            let per_membership = rss as f64 / memberships as f64;
            figures["router_rss_bytes"] = json!(rss);
            figures["router_huge_page_bytes"] = replicas["huge_page_bytes"].clone();
            figures["router_rss_bytes_per_membership"] = json!(rounded(per_membership, 3));
            figures["router_rss_vs_reference_per_membership"] = json!(rounded(
                per_membership / REFERENCE_ROUTER_BYTES_PER_MEMBERSHIP,
                3
            ));
            table_rows.push(figures.clone());
            match &mut first {
                None => first = Some(figures),
                Some(run) => run[name] = figures,
            }
        }
        // Pools of different sizes, at the largest DC count only (and at most 1 M blocks
        // per DC): one query table per distinct format.
        if let (Some(run), true) = (&mut first, Some(&n_dcs) == dc_counts.iter().max()) {
            let mixed_blocks = blocks_per_dc.min(1_000_000);
            let mut mixed = serde_json::Map::new();
            let mut mixed_densities = densities.clone();
            if densities.contains(&FilterDensity::DENSE) {
                mixed_densities.extend(&classed);
            }
            for &density in &mixed_densities {
                let name = density_name(density);
                eprintln!(
                    "==> fleet: {n_dcs} DCs of 0.75-1.25 x {mixed_blocks} blocks, {name} filters"
                );
                let figures =
                    mixed::run_mixed(&template, n_dcs, mixed_blocks, n_requests / 5, density)?;
                mixed_rows.push((name, figures.clone()));
                mixed.insert(name.to_owned(), figures);
            }
            run["mixed_sizes"] = Value::Object(mixed);
        }
        runs.extend(first);
    }
    let mut table = String::from(
        "| DCs | format | blocks/DC | query/s | exact/s | ratio | reference | p99 µs (ours / exact) | bits/membership | FP/probe | router RSS MiB (B/membership; vs reference) | under | over | wrong best (ties; expected) | score p99 applying/idle (write-locked baseline) | deltas/s | longest score during a snapshot µs (write-locked) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for run in &table_rows {
        table.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} / {} | {} | {:.2e} | {:.0} ({}; {}×) | {} | {} | {} ({}; {}) | {} ({}) | {} | {} ({}) |\n",
            run["dcs"],
            run["format"].as_str().unwrap_or("?"),
            run["blocks_per_dc"],
            run["query_per_s"],
            run["exact_per_s"],
            run["query_vs_exact"],
            run["reference_query_vs_its_exact"],
            run["query_p99_us"],
            run["exact_p99_us"],
            run["bits_per_membership"],
            run["false_positives_per_probe"].as_f64().unwrap_or(0.0),
            run["router_rss_bytes"].as_u64().unwrap_or(0) as f64 / f64::from(1u32 << 20),
            run["router_rss_bytes_per_membership"],
            run["router_rss_vs_reference_per_membership"],
            run["underestimates"],
            run["overestimates"],
            run["wrong_best_dc"],
            run["wrong_best_dc_ties"],
            run["wrong_best_dc_expected"],
            run["score_p99_applying_vs_idle"],
            run["score_p99_applying_write_locked_vs_idle"],
            run["deltas_applied_per_s"],
            run["score_longest_during_snapshot_us"],
            run["score_longest_during_snapshot_write_locked_us"],
        ));
    }
    if !mixed_rows.is_empty() {
        table.push_str(
            "\n| DCs of different sizes | format | query tables | joint query/s | exact/s | ratio | tables one by one: query/s (ratio) | joint / one by one | bits/membership | under |\n|---|---|---|---|---|---|---|---|---|---|\n",
        );
        for (name, run) in &mixed_rows {
            table.push_str(&format!(
                "| {} | {name} | {} | {} | {} | {} | {} ({}) | {} | {} | {} |\n",
                run["dcs"],
                run["tables"],
                run["query_per_s"],
                run["exact_per_s"],
                run["query_vs_exact"],
                run["sequential_query_per_s"],
                run["sequential_vs_exact"],
                run["joint_vs_sequential"],
                run["bits_per_membership"],
                run["underestimates"],
            ));
        }
    }
    print!("{table}");
    let document = json!({ "runs": runs });
    if let Some(path) = json_out {
        std::fs::write(&path, serde_json::to_string_pretty(&document)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
