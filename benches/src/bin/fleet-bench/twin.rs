//! What a dense *format twin* costs the relay (`relay_pool.format_twin` in the JSON): the
//! first DC's pool is built again in v1 three times from the same events, (a) alone (the
//! baseline), (b) with the twin the relay runs now (a `MembershipFilter` fed the pool
//! filter's membership log) and (c) with the twin it ran before (a second `PoolFilter`,
//! dense, fed the same events). Every producer publishes a delta every
//! `EVENTS_PER_DELTA` events, as the relay's do every publication window, so their dirty
//! windows stay the size one window needs. Reported: the twin's memory per block, the
//! time it adds per applied block (its deltas included), and whether (b) and (c) hold the
//! same table.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use kvrelay_ckf::{CkfConfig, FilterDensity, MembershipFilter, PoolFilter};
use serde_json::{Value, json};

use crate::fleet::{ExactMap, Zipf, build_dc};
use crate::rounded;

/// The dense format the relay's twins use by default (`[filters] format =
/// "v1_and_dense"`: 95 %, 8 size classes per octave).
const TWIN_DENSITY: FilterDensity = FilterDensity::Dense {
    load_percent: 95,
    size_classes_per_octave: 8,
};

/// Events between two deltas of every producer.
const EVENTS_PER_DELTA: u64 = 64;

/// One build of the pool: its own apply time, the twin's time and the pool's memory.
struct Build {
    blocks: u64,
    resident: u64,
    pool_apply: Duration,
    twin_apply: Duration,
    pool_bytes: u64,
}

fn build(
    template: &[Vec<u32>],
    blocks_per_dc: u64,
    record: bool,
    feed: &mut dyn FnMut(&mut PoolFilter, &kvrelay_ckf::RouterEvent, bool) -> Result<()>,
) -> Result<Build> {
    let mut pool = PoolFilter::new(CkfConfig::new(blocks_per_dc)).context("the v1 pool")?;
    pool.record_memberships(record);
    let mut exact = ExactMap::default();
    let mut twin_apply = Duration::ZERO;
    let mut events = 0u64;
    let built = build_dc(
        0,
        template,
        &Zipf::new(crate::fleet::TENANTS),
        blocks_per_dc,
        &mut pool,
        &mut exact,
        &mut |pool, event| {
            events += 1;
            let publish = events.is_multiple_of(EVENTS_PER_DELTA);
            let started = Instant::now();
            feed(pool, event, publish)?;
            twin_apply += started.elapsed();
            if publish {
                pool.take_delta().context("the pool's delta")?;
            }
            Ok(())
        },
    )?;
    Ok(Build {
        blocks: built.blocks_applied,
        resident: built.resident,
        pool_apply: built.apply_time,
        twin_apply,
        pool_bytes: pool.memory().total_bytes(),
    })
}

/// Runs the three builds (see the module docs) and returns their figures.
pub(crate) fn measure(template: &[Vec<u32>], blocks_per_dc: u64) -> Result<Value> {
    let twin_config = CkfConfig::new(blocks_per_dc).with_density(TWIN_DENSITY);
    eprintln!("  format twin: the first DC's pool alone, then with each kind of twin");
    let alone = build(template, blocks_per_dc, false, &mut |_, _, _| Ok(()))?;

    let mut fed_log = MembershipFilter::new(twin_config).context("the log-fed twin")?;
    let with_log = build(template, blocks_per_dc, true, &mut |pool, _, publish| {
        fed_log
            .apply(&pool.take_memberships())
            .map_err(|err| anyhow!("the log-fed twin refused the log: {err}"))?;
        if publish {
            fed_log.take_delta().context("the log-fed twin's delta")?;
        }
        Ok(())
    })?;

    let mut fed_events = PoolFilter::new(twin_config).context("the event-fed twin")?;
    let with_events = build(template, blocks_per_dc, false, &mut |_, event, publish| {
        fed_events
            .apply(event)
            .map_err(|err| anyhow!("the event-fed twin refused an event: {err}"))?;
        if publish {
            fed_events
                .take_delta()
                .context("the event-fed twin's delta")?;
        }
        Ok(())
    })?;

    let per_block = |bytes: u64| rounded(bytes as f64 / alone.resident as f64, 1);
    let ns_per_block =
        |time: Duration, blocks: u64| rounded(time.as_secs_f64() * 1e9 / blocks as f64, 1);
    let log_twin_bytes = fed_log.memory().total_bytes();
    let event_twin_bytes = fed_events.memory().total_bytes();
    let same_table = fed_log.words() == fed_events.words();
    eprintln!(
        "  format twin: {:.1} B/block fed the log against {:.1} fed events (pool {:.1}); \
         {:.0} against {:.0} ns per block; same table: {same_table}",
        per_block(log_twin_bytes),
        per_block(event_twin_bytes),
        per_block(alone.pool_bytes),
        ns_per_block(with_log.twin_apply, with_log.blocks),
        ns_per_block(with_events.twin_apply, with_events.blocks),
    );
    Ok(json!({
        "blocks": alone.resident,
        "twin_density": "dense 95 %, 8 size classes per octave",
        "pool_bytes_per_block": per_block(alone.pool_bytes),
        "log_fed_twin_bytes_per_block": per_block(log_twin_bytes),
        "event_fed_twin_bytes_per_block": per_block(event_twin_bytes),
        "log_fed_twin_parts_bytes_per_block": {
            "table": per_block(fed_log.memory().table_bytes),
            "dirty_window": per_block(fed_log.memory().dirty_window_bytes),
            "omitted": per_block(fed_log.memory().owner_bytes),
        },
        "relay_bytes_per_block_with_log_fed_twin": per_block(alone.pool_bytes + log_twin_bytes),
        "relay_bytes_per_block_with_event_fed_twin": per_block(alone.pool_bytes + event_twin_bytes),
        "pool_apply_ns_per_block": ns_per_block(alone.pool_apply, alone.blocks),
        "pool_apply_ns_per_block_recording": ns_per_block(with_log.pool_apply, with_log.blocks),
        "log_fed_twin_ns_per_block": ns_per_block(with_log.twin_apply, with_log.blocks),
        "event_fed_twin_ns_per_block": ns_per_block(with_events.twin_apply, with_events.blocks),
        "twins_hold_the_same_table": same_table,
        "capacity_omissions": {
            "log_fed": fed_log.counters().capacity_omissions,
            "event_fed": fed_events.counters().capacity_omissions,
        },
    }))
}
