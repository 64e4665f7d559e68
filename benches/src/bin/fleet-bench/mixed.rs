//! Pools of different sizes (`mixed_sizes` in the JSON): every DC's target drawn from
//! 0.75–1.25× `blocks_per_dc`, so DCs differ in capacity as real deployments do. A query
//! table holds lanes of one format (bucket count and seed), so a router keeps one table
//! per distinct format and probes each once per position. v1's power-of-two rounding puts
//! most such DCs in one or two tables; dense formats, sized to each pool, differ for every
//! DC. This measures what that costs, against the same exact map as the main run: the
//! tables searched jointly (`kvrelay_ckf::joint_prefix_depths_into`, as the consumer
//! does) and, as a same-run baseline, one after another.

use std::time::Duration;

use anyhow::{Context, Result};
use kvrelay_ckf::{
    CkfConfig, FilterDensity, JointDepths, PoolFilter, PrefixDepths, PrefixQuery, QueryTable,
    joint_prefix_depths_into,
};
use kvrelay_identity::CkfFormat;
use serde_json::{Value, json};

use crate::fleet::{
    ExactMap, Rng, TENANTS, Zipf, build_dc, exact_depths, paired_medians, requests, splitmix,
};

/// One query table per distinct format, and where each DC's lane is.
struct Tables {
    tables: Vec<(CkfFormat, QueryTable)>,
    lane_of: Vec<(usize, usize)>,
}

impl Tables {
    /// Every table answers `hashes` one after another, into `answers` (one per table);
    /// DC `dc`'s depth is then `depth(answers, dc)`.
    fn query_one_by_one(&self, hashes: &[u64], answers: &mut [PrefixDepths]) {
        for ((_, table), answer) in self.tables.iter().zip(answers) {
            table.prefix_depths_into(hashes, answer);
        }
    }

    fn depth(&self, answers: &[PrefixDepths], dc: usize) -> u32 {
        let (table, lane) = self.lane_of[dc];
        answers[table].depth(lane).unwrap_or(0)
    }
}

/// Builds `n_dcs` DCs of different sizes in `density` and measures full-map queries
/// against the exact map, paired as in the main run.
pub(crate) fn run_mixed(
    template: &[Vec<u32>],
    n_dcs: usize,
    blocks_per_dc: u64,
    n_requests: usize,
    density: FilterDensity,
) -> Result<Value> {
    let zipf = Zipf::new(TENANTS);
    let mut exact = ExactMap::default();
    let mut tables = Tables {
        tables: Vec::new(),
        lane_of: Vec::with_capacity(n_dcs),
    };
    let mut dcs = Vec::with_capacity(n_dcs);
    let mut memberships = 0u64;
    for dc in 0..n_dcs {
        let target = blocks_per_dc * (75 + splitmix(dc as u64 ^ 0xA11C_E5EE) % 51) / 100;
        let mut filter =
            PoolFilter::new(CkfConfig::new(target).with_density(density)).context("a DC filter")?;
        let built = build_dc(
            dc,
            template,
            &zipf,
            target,
            &mut filter,
            &mut exact,
            &mut |_, _| Ok(()),
        )?;
        memberships += built.resident;
        let format = filter.format();
        let table = match tables.tables.iter().position(|(f, _)| *f == format) {
            Some(table) => table,
            None => {
                let table =
                    QueryTable::new(format, crate::pages::query_config()).context("a table")?;
                tables.tables.push((format, table));
                tables.tables.len() - 1
            }
        };
        let query_table = &mut tables.tables[table].1;
        let lane = query_table.add_lane().context("a query lane")?;
        for chunk in filter.snapshot().context("a DC snapshot")?.chunks {
            query_table
                .install_chunk(lane, &chunk)
                .map_err(|err| anyhow::anyhow!("installing DC {dc}: {err}"))?;
        }
        tables.lane_of.push((table, lane));
        dcs.push(built);
    }
    let requests = requests(template, &dcs, n_requests, &mut Rng(0x2545_F491_4F6C_DD1D));

    let mut truth = vec![0u32; n_dcs];
    let (mut under, mut joint_differs) = (0u64, 0u64);
    let refs: Vec<&QueryTable> = tables.tables.iter().map(|(_, table)| table).collect();
    let mut joint = JointDepths::default();
    let mut answers = vec![PrefixDepths::default(); tables.tables.len()];
    for hashes in &requests {
        truth.iter_mut().for_each(|depth| *depth = 0);
        exact_depths(&exact, hashes, n_dcs, &mut truth);
        tables.query_one_by_one(hashes, &mut answers);
        joint_prefix_depths_into(&refs, hashes, &mut joint);
        for (dc, &(table, lane)) in tables.lane_of.iter().enumerate() {
            let depth = joint.depth(table, lane).unwrap_or(0);
            under += u64::from(depth < truth[dc]);
            joint_differs += u64::from(depth != tables.depth(&answers, dc));
        }
    }

    let (exact_median, table_median) = paired_medians(
        &requests,
        |hashes| {
            exact_depths(&exact, hashes, n_dcs, &mut truth);
            truth[0]
        },
        |hashes| {
            joint_prefix_depths_into(&refs, hashes, &mut joint);
            joint.depth(0, 0).unwrap_or(0)
        },
    );
    let (exact_median_again, sequential_median) = paired_medians(
        &requests,
        |hashes| {
            exact_depths(&exact, hashes, n_dcs, &mut truth);
            truth[0]
        },
        |hashes| {
            tables.query_one_by_one(hashes, &mut answers);
            tables.depth(&answers, 0)
        },
    );
    let per_second = |d: Duration| n_requests as f64 / d.as_secs_f64();
    let (exact_qps, table_qps) = (per_second(exact_median), per_second(table_median));
    let (exact_again_qps, sequential_qps) = (
        per_second(exact_median_again),
        per_second(sequential_median),
    );
    let table_bytes: u64 = tables.tables.iter().map(|(_, t)| t.table_bytes()).sum();
    Ok(json!({
        "dcs": n_dcs,
        "tables": tables.tables.len(),
        "memberships": memberships,
        "query_per_s": table_qps.round() as u64,
        "exact_per_s": exact_qps.round() as u64,
        "query_vs_exact": (table_qps / exact_qps * 1000.0).round() / 1000.0,
        "sequential_query_per_s": sequential_qps.round() as u64,
        "sequential_vs_exact": (sequential_qps / exact_again_qps * 1000.0).round() / 1000.0,
        // Direct: each ratio against the exact map has its own exact pairing, and the
        // exact map's rate swings between pairings on a shared machine.
        "joint_vs_sequential": (table_qps / sequential_qps.max(1.0) * 100.0).round() / 100.0,
        "joint_vs_sequential_answers_differing": joint_differs,
        "bits_per_membership": (table_bytes as f64 * 800.0 / memberships.max(1) as f64).round() / 100.0,
        "underestimates": under,
    }))
}
