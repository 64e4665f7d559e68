//! One prefix search over several [`QueryTable`]s at once.
//!
//! A table holds lanes of one format (bucket count and seed), so pools of different sizes
//! live in different tables. Searching the tables one after another pays every table's
//! memory round trips in turn: a request over six tables waits for six gallops. The
//! joint search runs the shared search once over *virtual lanes*: every table group of up
//! to 64 lanes is packed into a virtual group of 64 bits (a table group is never split),
//! a position is located once in every table, and each round's batch prefetches the rows
//! of every table before the first read waits. A round thus costs about one memory
//! latency whatever the number of tables, and every lane is searched by exactly the rules
//! of its own table (the answers are the same as searching the tables one by one; the
//! verification window is the largest of the tables', which only verifies more).
//!
//! Up to [`MAX_JOINT_TABLES`] tables are searched together; more are searched in chunks
//! of that many.

use crate::query::{QueryTable, RowView};
use crate::search::{Location, ProbeView, Prober, SearchScratch, search};

/// Tables located and probed together in one search; more are searched in chunks.
pub const MAX_JOINT_TABLES: usize = 8;

/// Where a hash lives in each table of a joint search.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct JointLocation([Location; MAX_JOINT_TABLES]);

/// One table group placed in a virtual group: table lanes `64 * table_group + i` for the
/// bits `i` of `mask` are virtual bits `i + shift`.
#[derive(Debug, Clone, Copy)]
struct Part {
    table: usize,
    table_group: usize,
    shift: u32,
    mask: u64,
}

/// Per table and lane of a joint search, the matched prefix depth in blocks (`None`: the
/// lane is not ready, or the table was not searched). Reuse one value across queries to
/// avoid allocating.
#[derive(Debug, Clone, Default)]
pub struct JointDepths {
    /// Depths by table (from `table_starts[t]`), then lane.
    depths: Vec<Option<u32>>,
    table_starts: Vec<usize>,
    /// The last search's virtual layout and answers (reused buffers).
    parts: Vec<Part>,
    group_parts: Vec<(usize, usize)>,
    virtual_depths: Vec<Option<u32>>,
    scratch: SearchScratch<JointLocation>,
    n_probes: u32,
}

impl JointDepths {
    /// The depth of `lane` of the `table`-th table searched.
    pub fn depth(&self, table: usize, lane: usize) -> Option<u32> {
        let start = *self.table_starts.get(table)?;
        let end = self
            .table_starts
            .get(table + 1)
            .copied()
            .unwrap_or(self.depths.len());
        self.depths.get(start..end)?.get(lane).copied().flatten()
    }

    /// Positions probed by the last query, summed over its chunks (a position probed in
    /// every table of a chunk counts once).
    pub fn n_probes(&self) -> u32 {
        self.n_probes
    }
}

/// Fills `out` with every lane's matched prefix depth in each of `tables` for the
/// request's canonical sequence hashes, searching up to [`MAX_JOINT_TABLES`] tables in
/// one search (see the module docs).
pub fn joint_prefix_depths_into(
    tables: &[&QueryTable],
    sequence_hashes: &[u64],
    out: &mut JointDepths,
) {
    out.depths.clear();
    out.table_starts.clear();
    out.n_probes = 0;
    for table in tables {
        out.table_starts.push(out.depths.len());
        out.depths.resize(out.depths.len() + table.n_lanes(), None);
    }
    for (chunk_index, chunk) in tables.chunks(MAX_JOINT_TABLES).enumerate() {
        let first_table = chunk_index * MAX_JOINT_TABLES;
        lay_out(chunk, &mut out.parts, &mut out.group_parts);
        let prober = JointProber {
            tables: chunk,
            parts: &out.parts,
            group_parts: &out.group_parts,
        };
        let window = chunk
            .iter()
            .map(|table| table.verification_window())
            .max()
            .unwrap_or(1);
        search(
            &prober,
            sequence_hashes,
            window,
            &mut out.scratch,
            &mut out.virtual_depths,
        );
        out.n_probes = out.n_probes.saturating_add(out.scratch.n_probes);
        for (group, &(start, end)) in out.group_parts.iter().enumerate() {
            for part in out.parts.get(start..end).unwrap_or_default() {
                let mut rest = part.mask;
                while rest != 0 {
                    let bit = rest.trailing_zeros();
                    rest &= rest - 1;
                    let virtual_lane = group * 64 + (bit + part.shift) as usize;
                    let lane = part.table_group * 64 + bit as usize;
                    let slot = out.table_starts[first_table + part.table] + lane;
                    if let (Some(depth), Some(out_slot)) = (
                        out.virtual_depths.get(virtual_lane),
                        out.depths.get_mut(slot),
                    ) {
                        *out_slot = *depth;
                    }
                }
            }
        }
    }
}

/// Packs every group of `tables` into virtual groups of 64 bits, in table order, never
/// splitting a table group: `parts` lists them, `group_parts` each virtual group's range.
fn lay_out(tables: &[&QueryTable], parts: &mut Vec<Part>, group_parts: &mut Vec<(usize, usize)>) {
    parts.clear();
    group_parts.clear();
    let mut used = 0u32;
    let mut group_start = 0;
    for (table, lanes) in tables.iter().map(|table| table.n_lanes()).enumerate() {
        for table_group in 0..lanes.div_ceil(64) {
            let width = (lanes - table_group * 64).min(64) as u32;
            if used + width > 64 {
                group_parts.push((group_start, parts.len()));
                group_start = parts.len();
                used = 0;
            }
            let mask = if width == 64 {
                u64::MAX
            } else {
                (1u64 << width) - 1
            };
            parts.push(Part {
                table,
                table_group,
                shift: used,
                mask,
            });
            used += width;
        }
    }
    if parts.len() > group_start {
        group_parts.push((group_start, parts.len()));
    }
}

/// The tables of one chunk as one prober of virtual lanes.
struct JointProber<'a> {
    tables: &'a [&'a QueryTable],
    parts: &'a [Part],
    group_parts: &'a [(usize, usize)],
}

impl Prober for JointProber<'_> {
    type Location = JointLocation;
    type View<'b>
        = JointView<'b>
    where
        Self: 'b;

    fn n_lanes(&self) -> usize {
        self.group_parts.len() * 64
    }

    fn ready_lanes(&self, group: usize) -> u64 {
        parts_of(self.parts, self.group_parts, group)
            .iter()
            .fold(0, |ready, part| {
                let table_ready = self
                    .tables
                    .get(part.table)
                    .map_or(0, |table| table.ready_lanes(part.table_group));
                ready | ((table_ready & part.mask) << part.shift)
            })
    }

    fn view(&self) -> JointView<'_> {
        JointView {
            views: std::array::from_fn(|i| self.tables.get(i).map(|table| table.view())),
            n_tables: self.tables.len().min(MAX_JOINT_TABLES),
            parts: self.parts,
            group_parts: self.group_parts,
        }
    }
}

fn parts_of<'a>(parts: &'a [Part], group_parts: &[(usize, usize)], group: usize) -> &'a [Part] {
    group_parts
        .get(group)
        .and_then(|&(start, end)| parts.get(start..end))
        .unwrap_or_default()
}

/// Every table's [`RowView`] with the virtual layout (see [`Prober::view`]).
#[derive(Clone, Copy)]
struct JointView<'a> {
    views: [Option<RowView<'a>>; MAX_JOINT_TABLES],
    n_tables: usize,
    parts: &'a [Part],
    group_parts: &'a [(usize, usize)],
}

impl ProbeView for JointView<'_> {
    type Location = JointLocation;

    #[inline]
    fn locate(&self, hash: u64) -> JointLocation {
        let mut location = JointLocation::default();
        for (slot, view) in location.0.iter_mut().zip(&self.views).take(self.n_tables) {
            if let Some(view) = view {
                *slot = view.locate(hash);
            }
        }
        location
    }

    #[inline]
    fn prefetch(&self, location: &JointLocation, group: usize, lanes: u64) {
        for (view, part, table_lanes) in self.asked(group, lanes) {
            if let Some(at) = location.0.get(part.table) {
                view.prefetch(at, part.table_group, table_lanes);
            }
        }
    }

    /// Every table's lines: lanes of different tables never share one.
    fn lines_per_row(&self, group: usize, lanes: u64) -> u32 {
        self.asked(group, lanes)
            .map(|(view, part, table_lanes)| view.lines_per_row(part.table_group, table_lanes))
            .sum()
    }

    #[inline]
    fn probe(&self, location: &JointLocation, group: usize, lanes: u64) -> u64 {
        let mut present = 0u64;
        for (view, part, table_lanes) in self.asked(group, lanes) {
            if let Some(at) = location.0.get(part.table) {
                present |=
                    (view.probe(at, part.table_group, table_lanes) & table_lanes) << part.shift;
            }
        }
        present
    }
}

impl<'a> JointView<'a> {
    /// The tables holding some of `lanes` of virtual `group`: each one's view, its part
    /// of the group and those lanes as its own lane bits.
    #[inline]
    fn asked(
        &self,
        group: usize,
        lanes: u64,
    ) -> impl Iterator<Item = (&RowView<'a>, &'a Part, u64)> + '_ {
        parts_of(self.parts, self.group_parts, group)
            .iter()
            .filter_map(move |part| {
                let table_lanes = (lanes >> part.shift) & part.mask;
                let view = self.views.get(part.table)?.as_ref()?;
                (table_lanes != 0).then_some((view, part, table_lanes))
            })
    }
}
