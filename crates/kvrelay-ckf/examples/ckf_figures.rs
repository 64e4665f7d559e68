//! Prints, as one JSON object, the ckf figures criterion does not give: a paired apply
//! ratio (filter and refcount map timed in alternating turns, so slow drifts of a shared
//! machine cancel), prefix-query p50/p99 latency (filter vs exact baseline, on the
//! benchmark's table and on a cache-resident one), memory per block, and measured
//! false-positive and depth-inflation rates next to theory. Progress goes to stderr.
//! `cargo xtask bench` runs it and renders the object as a table; by hand:
//! `cargo run --release -p kvrelay-ckf --example ckf_figures [-- --quick] [SECTION...]`
//! with sections `apply`, `memory`, `query`, `accuracy`, `query_cache_resident` (all by
//! default).

#![allow(clippy::unwrap_used, reason = "a measurement script fails loudly")]

#[path = "../benches/workload/mod.rs"]
mod workload;

use std::time::{Duration, Instant};

use kvrelay_ckf::{CkfConfig, PoolFilter, PrefixDepths, PrefixQuery};
use serde_json::{Value, json};
use workload::{
    ApplySetup, ChainWorkload, QUERY_BLOCKS, QUERY_CAPACITY, QUERY_POOLS, QuerySetup, Rng,
    STEPS_PER_BATCH, apply_batch, apply_refcount, block_ops, query_setup_with_capacity,
};

/// Per-pool capacity of the cache-resident query table (16 pools × 32 KiB = 512 KiB).
const CACHE_RESIDENT_CAPACITY: u64 = 1 << 14;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let quick = args.iter().any(|a| a == "--quick");
    let sections: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with("--"))
        .map(String::as_str)
        .collect();
    let wanted = |section: &str| sections.is_empty() || sections.contains(&section);
    let (apply_rounds, query_rounds) = if quick { (10, 5) } else { (40, 20) };
    let mut figures = serde_json::Map::new();
    if wanted("apply") {
        eprintln!("ckf figures: paired apply ({apply_rounds} rounds)");
        figures.insert("apply".into(), apply_paired(apply_rounds));
    }
    if wanted("memory") {
        eprintln!("ckf figures: memory (filling a 1M-block filter)");
        figures.insert("memory".into(), memory());
    }
    if wanted("query") || wanted("accuracy") {
        let setup = query_setup_with_capacity(11, QUERY_CAPACITY);
        if wanted("query") {
            eprintln!("ckf figures: prefix query ({query_rounds} rounds)");
            figures.insert("query".into(), latency(&setup, query_rounds));
        }
        if wanted("accuracy") {
            eprintln!("ckf figures: accuracy");
            figures.insert("accuracy".into(), accuracy(&setup));
        }
    }
    if wanted("query_cache_resident") {
        eprintln!("ckf figures: prefix query on a cache-resident table");
        let small = query_setup_with_capacity(11, CACHE_RESIDENT_CAPACITY);
        figures.insert("query_cache_resident".into(), latency(&small, query_rounds));
    }
    println!(
        "{}",
        serde_json::to_string_pretty(&Value::Object(figures)).unwrap()
    );
}

/// The `q`-quantile of sorted `values`.
fn quantile(values: &[f64], q: f64) -> f64 {
    values[((values.len() - 1) as f64 * q).round() as usize]
}

fn rounded(value: f64, digits: i32) -> f64 {
    let scale = 10f64.powi(digits);
    (value * scale).round() / scale
}

/// Batches each side runs untimed after taking over the machine, so its hot lines are
/// back in cache (the other side's batches evicted them), then timed batches per turn.
const WARM_BATCHES: usize = 2;
const TIMED_BATCHES: usize = 8;

/// One side's turn: [`WARM_BATCHES`] untimed, then [`TIMED_BATCHES`] timed runs of
/// `batch` (which returns its time and block operations); the timed sums.
fn turn(mut batch: impl FnMut() -> (Duration, u64)) -> (Duration, u64) {
    for _ in 0..WARM_BATCHES {
        batch();
    }
    (0..TIMED_BATCHES).fold((Duration::ZERO, 0), |(elapsed, ops), _| {
        let (batch_elapsed, batch_ops) = batch();
        (elapsed + batch_elapsed, ops + batch_ops)
    })
}

/// The apply ratio (refcount map time / filter time) from `rounds` paired turns: each
/// turn runs a few warm-up and then timed batches of one side, then of the other (which
/// goes first alternates), so slow drifts of a shared machine cancel within a pair while
/// each side runs warm; median and quartiles over the pairs.
fn apply_paired(rounds: usize) -> Value {
    let mut setup = ApplySetup::new();
    let filter_turn = |setup: &mut ApplySetup| {
        turn(|| {
            let events = setup.filter_stream.steady(STEPS_PER_BATCH);
            let start = Instant::now();
            apply_batch(&mut setup.filter, &events);
            (start.elapsed(), block_ops(&events))
        })
    };
    let refcount_turn = |setup: &mut ApplySetup| {
        turn(|| {
            let events = setup.refcount_stream.steady(STEPS_PER_BATCH);
            let start = Instant::now();
            for event in &events {
                apply_refcount(&mut setup.refcounts, event);
            }
            (start.elapsed(), block_ops(&events))
        })
    };
    let (mut ratios, mut filter_ns, mut baseline_ns) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let (filter, baseline, ops): (Duration, Duration, u64) = if round % 2 == 0 {
            let (filter, ops) = filter_turn(&mut setup);
            (filter, refcount_turn(&mut setup).0, ops)
        } else {
            let (baseline, _) = refcount_turn(&mut setup);
            let (filter, ops) = filter_turn(&mut setup);
            (filter, baseline, ops)
        };
        ratios.push(baseline.as_secs_f64() / filter.as_secs_f64());
        filter_ns.push(filter.as_nanos() as f64 / ops as f64);
        baseline_ns.push(baseline.as_nanos() as f64 / ops as f64);
    }
    for values in [&mut ratios, &mut filter_ns, &mut baseline_ns] {
        values.sort_by(f64::total_cmp);
    }
    json!({
        "pairs": rounds,
        "timed_batches_per_turn": TIMED_BATCHES,
        "ratio_vs_refcount_map_p50": rounded(quantile(&ratios, 0.5), 3),
        "ratio_p25": rounded(quantile(&ratios, 0.25), 3),
        "ratio_p75": rounded(quantile(&ratios, 0.75), 3),
        "filter_ns_per_block_op_p50": rounded(quantile(&filter_ns, 0.5), 1),
        "refcount_map_ns_per_block_op_p50": rounded(quantile(&baseline_ns, 0.5), 1),
    })
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
    let mean = samples.iter().sum::<f64>() / samples.len() as f64;
    (quantile(&samples, 0.5), quantile(&samples, 0.99), mean)
}

fn latency(setup: &QuerySetup, rounds: usize) -> Value {
    let requests = &setup.work.requests;
    // Warm both structures once.
    percentiles(&setup.table, requests, 1);
    percentiles(&setup.exact, requests, 1);
    let (f50, f99, fmean) = percentiles(&setup.table, requests, rounds);
    let (e50, e99, emean) = percentiles(&setup.exact, requests, rounds);
    let mut out = PrefixDepths::default();
    let (mut filter_probes, mut exact_probes) = (0u64, 0u64);
    for request in requests {
        setup.table.prefix_depths_into(request, &mut out);
        filter_probes += u64::from(out.n_probes());
        setup.exact.prefix_depths_into(request, &mut out);
        exact_probes += u64::from(out.n_probes());
    }
    let n = requests.len() as f64;
    json!({
        "blocks": QUERY_BLOCKS,
        "pools": QUERY_POOLS,
        "requests": requests.len(),
        "table_mib": rounded(setup.table.table_bytes() as f64 / f64::from(1 << 20), 2),
        "filter_p50_ns": f50,
        "filter_p99_ns": f99,
        "filter_mean_ns": fmean.round(),
        "exact_p50_ns": e50,
        "exact_p99_ns": e99,
        "exact_mean_ns": emean.round(),
        "speedup_p50": rounded(e50 / f50, 2),
        "speedup_p99": rounded(e99 / f99, 2),
        "speedup_mean": rounded(emean / fmean, 2),
        "filter_probes_per_query": rounded(filter_probes as f64 / n, 1),
        "exact_lookups_per_query": rounded(exact_probes as f64 / n, 1),
    })
}

fn accuracy(setup: &QuerySetup) -> Value {
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
    let probes = (n_hashes * QUERY_POOLS) as u64;
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
    json!({
        "mean_load_percent": rounded(load * 100.0, 1),
        "false_positives": false_positives,
        "probes": probes,
        "fp_rate_per_probe": format!("{:.3e}", false_positives as f64 / probes as f64),
        "fp_rate_theory_1-(1-1/65535)^(8·load)": format!("{theory_fp:.3e}"),
        "inflated_pairs": inflated,
        "request_pool_pairs": pairs,
        "depth_inflation_rate": format!("{:.3e}", inflated as f64 / pairs as f64),
        "depth_inflation_theory_fp·P(depth<n)": format!("{:.3e}", theory_fp * open_pairs as f64 / pairs as f64),
        "inflated_extra_blocks": inflated_blocks,
        "under_reported_pairs": deflated,
    })
}

fn memory() -> Value {
    let mut stream = ChainWorkload::new(7, 16, 64);
    let mut filter = PoolFilter::new(CkfConfig::new(1 << 20)).unwrap();
    let start = Instant::now();
    let events = stream.fill((1 << 20) / 64);
    let n_ops = block_ops(&events);
    for event in &events {
        filter.apply(event).unwrap();
    }
    let fill_secs = start.elapsed().as_secs_f64();
    let memory = filter.memory();
    let resident = filter.n_resident();
    let mappings = filter.n_mappings();
    let slots = 4.0 * f64::from(filter.format().bucket_count());
    let mib = |bytes: u64| rounded(bytes as f64 / f64::from(1 << 20), 2);
    json!({
        "mappings": mappings,
        "resident_hashes": resident,
        "table_load_percent": rounded(100.0 * filter.occupied_slots() as f64 / slots, 1),
        "table_mib": mib(memory.table_bytes),
        "table_bits_per_resident_block": rounded(memory.table_bytes as f64 * 8.0 / resident as f64, 1),
        "lineage_mib": mib(memory.lineage_bytes),
        "owners_mib": mib(memory.owner_bytes),
        "ownership_bytes_per_mapping": rounded((memory.lineage_bytes + memory.owner_bytes) as f64 / mappings as f64, 1),
        "dirty_window_mib": mib(memory.dirty_window_bytes),
        "fill_million_block_ops_per_s": rounded(n_ops as f64 / fill_secs / 1e6, 2),
    })
}
