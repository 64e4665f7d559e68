//! Prints the ckf figures criterion does not give: prefix-query p50/p99 latency (filter
//! vs exact baseline), memory per block, measured false-positive and depth-inflation rates
//! next to theory. Run: `cargo run --release -p kvrelay-ckf --example ckf_figures`.

#![allow(clippy::unwrap_used, reason = "a measurement script fails loudly")]

#[path = "../benches/workload/mod.rs"]
mod workload;

use std::time::Instant;

use kvrelay_ckf::{CkfConfig, PoolFilter, PrefixDepths, PrefixQuery};
use workload::{
    ChainWorkload, QUERY_BLOCKS, QUERY_CAPACITY, QUERY_POOLS, QuerySetup, Rng,
    query_setup_with_capacity,
};

fn main() {
    // CKF_QUERY_CAPACITY overrides the per-pool capacity (e.g. a cache-resident table).
    let capacity = std::env::var("CKF_QUERY_CAPACITY")
        .ok()
        .and_then(|v| v.parse().ok());
    if capacity.is_none() {
        memory();
    }
    let setup = query_setup_with_capacity(11, capacity.unwrap_or(QUERY_CAPACITY));
    latency(&setup);
    accuracy(&setup);
}

/// Per-query latency percentiles over `rounds` passes of every request.
fn percentiles(index: &impl PrefixQuery, requests: &[Vec<u64>], rounds: usize) -> (f64, f64, f64) {
    let mut out = PrefixDepths::default();
    let mut samples = Vec::with_capacity(requests.len() * rounds);
    for _ in 0..rounds {
        for request in requests {
            let start = Instant::now();
            index.prefix_depths_into(request, &mut out);
            std::hint::black_box(out.depths());
            samples.push(start.elapsed().as_nanos() as f64);
        }
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    (at(0.5), at(0.99), mean)
}

fn latency(setup: &QuerySetup) {
    let requests = &setup.work.requests;
    // Warm both structures once.
    percentiles(&setup.table, requests, 1);
    percentiles(&setup.exact, requests, 1);
    let (f50, f99, fmean) = percentiles(&setup.table, requests, 20);
    let (e50, e99, emean) = percentiles(&setup.exact, requests, 20);
    let mut out = PrefixDepths::default();
    let (mut filter_probes, mut exact_probes) = (0u64, 0u64);
    for request in requests {
        setup.table.prefix_depths_into(request, &mut out);
        filter_probes += u64::from(out.n_probes());
        setup.exact.prefix_depths_into(request, &mut out);
        exact_probes += u64::from(out.n_probes());
    }
    println!(
        "## prefix query: {QUERY_BLOCKS} blocks, {QUERY_POOLS} pools, {} requests",
        requests.len()
    );
    println!(
        "filter : p50 {:.0} ns  p99 {:.0} ns  mean {:.0} ns  ({:.1} probes/query, all pools at once)",
        f50,
        f99,
        fmean,
        filter_probes as f64 / requests.len() as f64
    );
    println!(
        "exact  : p50 {:.0} ns  p99 {:.0} ns  mean {:.0} ns  ({:.1} lookups/query)",
        e50,
        e99,
        emean,
        exact_probes as f64 / requests.len() as f64
    );
    println!(
        "speedup: p50 {:.2}x  p99 {:.2}x  mean {:.2}x",
        e50 / f50,
        e99 / f99,
        emean / fmean
    );
    println!(
        "query table: {:.1} MiB for {} lanes",
        setup.table.table_bytes() as f64 / (1 << 20) as f64,
        setup.table.n_lanes()
    );
}

fn accuracy(setup: &QuerySetup) {
    let load = setup.mean_load;
    let theory_fp = 1.0 - (1.0 - 1.0 / 65535.0f64).powf(8.0 * load);
    // Per-probe false positives: random absent hashes, one-block requests, every lane.
    let mut rng = Rng::new(99);
    let n_hashes = 200_000;
    let mut out = PrefixDepths::default();
    let mut false_positives = 0u64;
    for _ in 0..n_hashes {
        setup.table.prefix_depths_into(&[rng.next_u64()], &mut out);
        false_positives += out.depths().iter().filter(|d| **d == Some(1)).count() as u64;
    }
    let probes = (n_hashes * QUERY_POOLS) as f64;
    println!("## accuracy at mean load {:.1} %", load * 100.0);
    println!(
        "false-positive rate per probe: measured {:.3e} ({} / {:.0}), theory 1-(1-1/65535)^(8α) = {:.3e}",
        false_positives as f64 / probes,
        false_positives,
        probes,
        theory_fp
    );
    // Depth inflation over (request, pool) pairs, against the exact depths.
    let (mut pairs, mut open_pairs, mut inflated, mut inflated_blocks, mut deflated) =
        (0u64, 0u64, 0u64, 0u64, 0u64);
    for (request, exact) in setup.work.requests.iter().zip(&setup.work.depths) {
        setup.table.prefix_depths_into(request, &mut out);
        for (pool, &want) in exact.iter().enumerate() {
            let got = out.depth(pool).unwrap();
            pairs += 1;
            if (want as usize) < QUERY_BLOCKS {
                open_pairs += 1;
            }
            if got > want {
                inflated += 1;
                inflated_blocks += u64::from(got - want);
            } else if got < want {
                deflated += 1;
            }
        }
    }
    println!(
        "depth inflation: {} of {} (request, pool) pairs = {:.3e} ({} extra blocks); under-reports {}; theory ≈ ε·P(depth<n) = {:.3e}",
        inflated,
        pairs,
        inflated as f64 / pairs as f64,
        inflated_blocks,
        deflated,
        theory_fp * open_pairs as f64 / pairs as f64
    );
}

fn memory() {
    let mut stream = ChainWorkload::new(7, 16, 64);
    let mut filter = PoolFilter::new(CkfConfig::new(1 << 20)).unwrap();
    let start = Instant::now();
    let events = stream.fill((1 << 20) / 64);
    let n_ops = workload::block_ops(&events);
    for event in &events {
        filter.apply(event).unwrap();
    }
    let fill_secs = start.elapsed().as_secs_f64();
    let memory = filter.memory();
    let resident = filter.n_resident();
    let mappings = filter.n_mappings();
    println!(
        "## memory: filter sized for 1M blocks, {} mappings, {} resident hashes, load {:.1} %",
        mappings,
        resident,
        100.0 * filter.occupied_slots() as f64 / (4.0 * f64::from(filter.format().bucket_count()))
    );
    println!(
        "table: {:.2} MiB = {:.1} bits per resident block (16-bit fingerprints at {:.0} % load)",
        memory.table_bytes as f64 / (1 << 20) as f64,
        memory.table_bytes as f64 * 8.0 / resident as f64,
        100.0 * resident as f64 / (4.0 * f64::from(filter.format().bucket_count()))
    );
    println!(
        "exact ownership: lineage {:.1} MiB + owners {:.1} MiB = {:.1} bytes per mapping; dirty window {:.2} MiB",
        memory.lineage_bytes as f64 / (1 << 20) as f64,
        memory.owner_bytes as f64 / (1 << 20) as f64,
        (memory.lineage_bytes + memory.owner_bytes) as f64 / mappings as f64,
        memory.dirty_window_bytes as f64 / (1 << 20) as f64
    );
    println!(
        "fill: {} block ops in {:.3} s = {:.2} M ops/s (growing maps, no deltas)",
        n_ops,
        fill_secs,
        n_ops as f64 / fill_secs / 1e6
    );
    println!("counters: {:?}", filter.counters());
}
