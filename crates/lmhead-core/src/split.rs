//! Vocab-split planning for the forward: how many vocab tiles one block walks.
//!
//! The grid is `(token tiles) × (vocab splits)`; every block walks `tiles_per_split` vocab tiles
//! and writes one partial per row. More splits fill the machine for small `t`; fewer splits mean
//! less partial traffic and longer, better pipelined blocks. The plan minimises the modelled
//! makespan `waves · (tiles_per_split + BLOCK_OVERHEAD)`: every vocab tile costs about the same,
//! and every block pays about one more tile's worth for its pipeline fill, cross-warp reduction
//! and partial write. Ties go to fewer splits.

/// A block's fixed cost in units of one vocab tile (see the module docs).
pub const BLOCK_OVERHEAD: u64 = 1;

/// The chosen split of the vocab tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitPlan {
    pub tiles_per_split: u32,
    pub n_splits: u32,
    /// Token tiles per raster group of the launch order (0 = plain; see [`raster`]).
    pub raster_group: u32,
    /// Vocab tiles cut from the end of every split into a block of their own, launched after
    /// every main block (0 = none; see [`block_work`] and [`with_fill`]). Always less than the
    /// last split's length, so that no block is empty.
    pub fill: u32,
}

impl SplitPlan {
    /// A plan of `n_splits` splits of `tiles_per_split` tiles, plain order, no fill.
    pub const fn new(tiles_per_split: u32, n_splits: u32) -> SplitPlan {
        SplitPlan { tiles_per_split, n_splits, raster_group: 0, fill: 0 }
    }

    /// Blocks per token tile, the grid's `y`, which is also the number of partials per row: one
    /// per split, and one more per split for its filler.
    pub const fn blocks_per_row(&self) -> u32 {
        if self.fill > 0 {
            2 * self.n_splits
        } else {
            self.n_splits
        }
    }
}

/// What one block of a split plan's grid does: the token tile, the partial slot it writes
/// (`< blocks_per_row`), and the `count ≥ 1` consecutive vocab tiles from `first`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockWork {
    pub m_tile: u32,
    pub slot: u32,
    pub first: u32,
    pub count: u32,
}

/// The work of block `(bx, by)` in a grid of `gx` token tiles × `blocks_per_row` over `v_tiles`
/// vocab tiles, split by `per` tiles in [`raster`] groups of `group`, with `fill` tiles of every
/// split moved to a filler block. Launch order (`x` fastest) takes the main blocks (`by <
/// n_splits`, the first `len − fill` tiles of split `by`'s range) before the fillers (`by =
/// n_splits + s`, the last `fill` tiles of split `s`), each set in its own raster order: the
/// fillers run on the SMs the main blocks' last wave leaves idle. `fill` must be less than
/// every split's length (the host's plan keeps it so); larger values are clamped, never read
/// out of range.
pub const fn block_work(bx: u32, by: u32, gx: u32, v_tiles: u32, per: u32, group: u32, fill: u32) -> BlockWork {
    let per = if per == 0 { 1 } else { per };
    let n_splits = v_tiles.div_ceil(per);
    let filler = fill > 0 && by >= n_splits;
    let y = if filler { by - n_splits } else { by };
    let (m_tile, s) = raster(bx, y, gx, n_splits, group);
    let first = s * per;
    let len = v_tiles.saturating_sub(first);
    let len = if len < per { len } else { per };
    let f = if len == 0 {
        0
    } else if fill < len {
        fill
    } else {
        len - 1
    };
    if filler {
        BlockWork { m_tile, slot: n_splits + s, first: first + len - f, count: f }
    } else {
        BlockWork { m_tile, slot: s, first, count: len - f }
    }
}

/// A measurement override of a plan (benches and tests set them in the host): a forced split
/// count or a forced tile count per block, and a forced raster group. [`PlanOverride::apply`]
/// keeps the plan covering every tile exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanOverride {
    pub splits: Option<u32>,
    pub tiles: Option<u32>,
    pub raster: Option<u32>,
    /// Tiles per filler (0 = none; clamped below the last split's length).
    pub fill: Option<u32>,
}

impl PlanOverride {
    /// No override.
    pub const NONE: PlanOverride = PlanOverride { splits: None, tiles: None, raster: None, fill: None };

    /// `plan` with the overrides of `self` for a walk over `n_tiles` tiles (a split or tile count
    /// of 0 is ignored; counts beyond `n_tiles` are clamped, a fill to below the last split's
    /// length; a new split drops the plan's fill unless `fill` is set).
    pub fn apply(&self, mut plan: SplitPlan, n_tiles: u32) -> SplitPlan {
        let n = n_tiles.max(1);
        let per = match (self.tiles.filter(|&t| t >= 1), self.splits.filter(|&s| s >= 1)) {
            (Some(t), _) => Some(t.min(n)),
            (None, Some(s)) => Some(n.div_ceil(s.min(n))),
            (None, None) => None,
        };
        if let Some(per) = per {
            plan.tiles_per_split = per;
            plan.n_splits = n.div_ceil(per);
            plan.fill = 0;
        }
        if let Some(g) = self.raster {
            plan.raster_group = g;
        }
        if let Some(f) = self.fill {
            plan.fill = f.min(last_split_len(plan, n).saturating_sub(1));
        }
        plan
    }
}

/// Plan the split for `m_tiles` token tiles and `n_tiles` vocab tiles on `slots` concurrent
/// blocks (SM count × blocks per SM).
pub fn plan(m_tiles: u32, n_tiles: u32, slots: u32) -> SplitPlan {
    let mut best = SplitPlan::new(n_tiles.max(1), 1);
    let mut best_cost = u64::MAX;
    for (per, n_splits) in split_options(n_tiles) {
        let cost = makespan(m_tiles, n_splits, per, slots);
        if cost < best_cost {
            best_cost = cost;
            best = SplitPlan::new(per, n_splits);
        }
    }
    best
}

/// Every distinct `(tiles_per_split, n_splits)` of `n_tiles` vocab tiles, from one split up to
/// one tile per split.
fn split_options(n_tiles: u32) -> impl Iterator<Item = (u32, u32)> {
    let n_tiles = n_tiles.max(1);
    let mut per = Some(n_tiles);
    core::iter::from_fn(move || {
        let p = per?;
        let n_splits = n_tiles.div_ceil(p);
        // Next smaller tiles_per_split that changes n_splits.
        per = (p > 1).then(|| n_tiles.div_ceil(n_splits + 1).min(p - 1));
        Some((p, n_splits))
    })
}

/// The modelled makespan of a split: `waves · (tiles_per_split + BLOCK_OVERHEAD)`.
fn makespan(m_tiles: u32, n_splits: u32, per: u32, slots: u32) -> u64 {
    let blocks = m_tiles.max(1) as u64 * n_splits as u64;
    blocks.div_ceil(slots.max(1) as u64) * (per as u64 + BLOCK_OVERHEAD)
}

/// The forward's L2 model: one token tile's rows of `h` (`BM × d × 2` bytes) and the L2 budget
/// they should fit in.
#[derive(Clone, Copy, Debug)]
pub struct L2Model {
    pub h_tile_bytes: u64,
    pub budget_bytes: u64,
}

impl L2Model {
    /// The model for tiles of `rows` bf16 rows, `k` deep, on a device with `l2_bytes` of L2:
    /// the budget is [`L2_SHARE`] of it.
    pub fn of(rows: u32, k: u64, l2_bytes: u64) -> L2Model {
        L2Model { h_tile_bytes: rows as u64 * k * 2, budget_bytes: (l2_bytes as f64 * L2_SHARE) as u64 }
    }
}

/// The share of the L2 cache that the resident blocks' rows of `h` may take in [`plan_l2`]; the
/// rest holds the `W` tiles being streamed (each read by the resident blocks of its split
/// within a short window), partials and other work.
pub const L2_SHARE: f64 = 0.6;

/// [`plan`], made L2-aware. A forward block re-reads its token tile's rows of `h` for every
/// vocab tile it walks; the `S` resident blocks of one token tile (one per split) share those
/// reads. When the resident rows do not fit in L2, `h` streams from DRAM at about
/// `(resident blocks / S) × BM·d·2` bytes per vocab-tile period: on the H200 ≈ 2.6 TB/s / S,
/// whatever `d` (it cancels). That costs time directly and, as much, clock: the H200 runs these
/// shapes at its power limit, and DRAM traffic lowers the SM clock. Measured
/// (measured on the H200; git history of docs/perf-notes.md): t = 16384, d = 2048, one split, 64 MB of `h` resident: DRAM 56% of
/// peak, 1.13–1.21× the GEMM → 1.02–1.04× re-planned; t = 8192, d = 4096, two splits, 64 MB
/// resident: DRAM 44%, SM clock 1.40 GHz, 14.7 ms under ncu → with 8 splits in raster groups of
/// 16: DRAM 18%, 1.50 GHz, 13.8 ms; t = 8192, d = 8192 (128 MB resident): 1.07× → 1.03–1.04×.
/// So a plain plan whose resident rows overflow the budget is replaced by the split count with
/// the least modelled makespan among those whose resident rows fit, launched in raster groups
/// of `ceil(slots / S)` token tiles × every split ([`raster`]) so that the resident blocks
/// really are those rows. The plain plan stands only if the rows its own launch order keeps
/// resident fit: with more than one wave, token tile first, those are `slots` token tiles of
/// one split, not `slots / S` tiles × `S` splits (measured on the H200 at t = 131072, v = 62080,
/// d = 2048, 1024 token tiles × 5 splits: 66 MiB of `h` resident, DRAM 57% of peak, SM clock
/// 1.41 GHz, forward 1.09–1.10× the GEMM and 1.21× with entropy; in groups of 27 token tiles
/// 1.06–1.07× and 1.09×).
pub fn plan_l2(m_tiles: u32, n_tiles: u32, slots: u32, l2: L2Model) -> SplitPlan {
    let plain = plan(m_tiles, n_tiles, slots);
    let m_tiles = m_tiles.max(1);
    let n_tiles = n_tiles.max(1);
    let slots = slots.max(1);
    let resident_rows = |n_splits: u32| m_tiles.min(slots.div_ceil(n_splits));
    let fits = |n_splits: u32| resident_rows(n_splits) as u64 * l2.h_tile_bytes <= l2.budget_bytes;
    // Launched token tile first, a plan of more than one wave keeps `min(m_tiles, slots)` token
    // tiles resident (the first `slots` blocks), not `resident_rows`.
    let one_wave = m_tiles as u64 * plain.n_splits as u64 <= slots as u64;
    let plain_rows = if one_wave { m_tiles } else { m_tiles.min(slots) };
    if plain_rows as u64 * l2.h_tile_bytes <= l2.budget_bytes {
        return plain;
    }
    let mut best: Option<(u64, SplitPlan)> = None;
    for (per, n_splits) in split_options(n_tiles).filter(|&(_, n)| fits(n)) {
        let cost = makespan(m_tiles, n_splits, per, slots);
        if best.is_none_or(|(c, _)| cost < c) {
            best = Some((cost, SplitPlan { raster_group: resident_rows(n_splits), ..SplitPlan::new(per, n_splits) }));
        }
    }
    best.map_or(plain, |(_, p)| p)
}

/// A block's fixed cost — launch, barrier set-up, the pipeline's fill and drain, the partial
/// write — in 64-deep K steps of its mainloop, for [`with_fill`]. An estimate: a few µs, against
/// ≈ 0.6 µs per K step of a 128 × 256 tile on the H200.
pub const BLOCK_FIXED_K_STEPS: u64 = 4;

/// The least modelled gain (a fraction of the makespan) for which [`with_fill`] adds fillers.
pub const FILL_MIN_GAIN: f64 = 0.005;

/// The length of the last split of `plan` over `n_tiles` tiles (the others have `tiles_per_split`).
pub const fn last_split_len(plan: SplitPlan, n_tiles: u32) -> u32 {
    let per = if plan.tiles_per_split == 0 { 1 } else { plan.tiles_per_split };
    let n_splits = n_tiles.div_ceil(per);
    if n_splits == 0 {
        0
    } else {
        n_tiles - (n_splits - 1) * per
    }
}

/// The modelled makespan, in K steps, of `plan`'s `m_tiles × blocks_per_row` blocks over
/// `n_tiles` vocab tiles of `k_steps` K steps each, on `slots` concurrent blocks: blocks start in
/// launch order, each on the first slot to free up, and take `count · k_steps +`
/// [`BLOCK_FIXED_K_STEPS`].
#[cfg(feature = "std")]
pub fn makespan_k_steps(plan: SplitPlan, m_tiles: u32, n_tiles: u32, slots: u32, k_steps: u32) -> u64 {
    use core::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut free: BinaryHeap<Reverse<u64>> = (0..slots.max(1)).map(|_| Reverse(0)).collect();
    let mut end = 0;
    for by in 0..plan.blocks_per_row() {
        for bx in 0..m_tiles {
            let w = block_work(bx, by, m_tiles, n_tiles, plan.tiles_per_split, plan.raster_group, plan.fill);
            let Reverse(start) = free.pop().unwrap_or(Reverse(0));
            let t = start + w.count as u64 * k_steps as u64 + BLOCK_FIXED_K_STEPS;
            end = end.max(t);
            free.push(Reverse(t));
        }
    }
    end
}

/// `plan` with fillers where they shorten its modelled makespan ([`makespan_k_steps`]) by at
/// least [`FILL_MIN_GAIN`]. A plan whose blocks do not divide into whole waves leaves SMs idle
/// while its last wave runs (128 blocks on 132 SMs idle 3% of them throughout); cutting `fill`
/// tiles off every split shortens every main block, and the fillers, launched after them, run
/// on the SMs that would have idled. The fillers keep the main blocks' raster order, so the
/// ones running together share their rows of `h` and tiles of `W` as the main blocks do.
/// The fill is chosen near the balance point `waves · (per − fill + o) = total / slots` (`o`: a
/// block's fixed cost in tiles) and below the last split's length.
#[cfg(feature = "std")]
pub fn with_fill(plan: SplitPlan, m_tiles: u32, n_tiles: u32, slots: u32, k_steps: u32) -> SplitPlan {
    let plan = SplitPlan { fill: 0, ..plan };
    let last = last_split_len(plan, n_tiles);
    if m_tiles == 0 || last < 2 {
        return plan;
    }
    let base = makespan_k_steps(plan, m_tiles, n_tiles, slots, k_steps);
    let (slots_f, o) = (slots.max(1) as f64, BLOCK_FIXED_K_STEPS as f64 / k_steps.max(1) as f64);
    let waves = (m_tiles as u64 * plan.n_splits as u64).div_ceil(slots.max(1) as u64) as f64;
    let total = m_tiles as f64 * (n_tiles as f64 + 2.0 * plan.n_splits as f64 * o);
    let balance = plan.tiles_per_split as f64 + o - total / (slots_f * waves);
    let lo = (balance.floor() - 1.0).max(1.0) as u32;
    let hi = ((balance.ceil() + 1.0).max(1.0) as u32).min(last - 1);
    let mut best = (base, plan);
    for fill in lo..=hi {
        let p = SplitPlan { fill, ..plan };
        let t = makespan_k_steps(p, m_tiles, n_tiles, slots, k_steps);
        if t < best.0 {
            best = (t, p);
        }
    }
    if (best.0 as f64) <= base as f64 * (1.0 - FILL_MIN_GAIN) {
        best.1
    } else {
        plan
    }
}

/// The (token tile, split) a forward block works on. Launch order is `x` (token tile) fastest;
/// with `group = 0` block `(x, y)` takes token tile `x` of split `y`. With `group = G > 0` the
/// linear launch index walks groups of `G` token tiles (the last one shorter), each group
/// taking all its tiles × every split before the next, so that the blocks resident at one time
/// touch about `resident / splits` rows of `h` rather than all of them.
pub const fn raster(x: u32, y: u32, gx: u32, gy: u32, group: u32) -> (u32, u32) {
    if group == 0 {
        return (x, y);
    }
    let g = if group > gx { gx } else { group };
    let b = x + y * gx;
    // `g ≥ 1`, `gy ≥ 1` and `rows ≥ 1` for any launched block; the checked forms keep the
    // kernels free of panic paths.
    let group_idx = match b.checked_div(g * gy) {
        Some(q) => q,
        None => return (x, y),
    };
    let first = group_idx * g;
    let rows = if gx - first < g { gx - first } else { g };
    let local = b - group_idx * g * gy;
    match (local.checked_rem(rows), local.checked_div(rows)) {
        (Some(r), Some(q)) => (first + r, q),
        _ => (x, y),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1 << 20;

    fn h200(d: u64) -> L2Model {
        L2Model { h_tile_bytes: 128 * d * 2, budget_bytes: (50.0 * L2_SHARE) as u64 * MB }
    }

    #[test]
    fn l2_plan_splits_when_h_does_not_fit() {
        let m = L2Model::of(128, 2048, 60 * MB);
        assert_eq!((m.h_tile_bytes, m.budget_bytes), (128 * 2048 * 2, (60.0 * MB as f64 * L2_SHARE) as u64));
        // t = 16384, v = 248320, d = 2048 on 132 SMs: the plain plan (1 split, 128 token tiles
        // resident, 64 MB of h) is replaced by one whose resident rows fit, in raster groups.
        let p = plan_l2(128, 970, 132, h200(2048));
        assert!(p.n_splits > 1 && p.raster_group > 0, "{p:?}");
        assert!(p.raster_group as u64 * 128 * 2048 * 2 <= 30 * MB, "{p:?}");
        assert!(p.raster_group as u64 * p.n_splits as u64 >= 132, "one group fills the machine: {p:?}");
        // A plan that fits already stands: t = 1024 (8 token tiles), and t = 4096 at d = 1024.
        assert_eq!(plan_l2(8, 594, 132, h200(4096)), plan(8, 594, 132));
        assert_eq!(plan_l2(32, 594, 132, h200(1024)), plan(32, 594, 132));
        // A multi-split plan whose resident rows overflow is re-planned too (t = 8192, d = 4096:
        // 2 splits, 64 token tiles = 64 MB resident).
        let plain = plan(64, 594, 132);
        let p = plan_l2(64, 594, 132, h200(4096));
        assert!(plain.n_splits >= 2 && p.n_splits > plain.n_splits && p.raster_group > 0, "{plain:?} {p:?}");
        assert!(p.raster_group as u64 * 128 * 4096 * 2 <= 30 * MB, "{p:?}");
        // A plain plan that fits in raster order only gets the raster groups: t = 131072,
        // v = 62080, d = 2048 (1024 token tiles × 243 vocab tiles, 5 splits).
        let plain = plan(1024, 243, 132);
        let p = plan_l2(1024, 243, 132, h200(2048));
        assert!(plain.n_splits > 1 && plain.raster_group == 0, "{plain:?}");
        assert!(p.raster_group > 0 && p.raster_group as u64 * 128 * 2048 * 2 <= 30 * MB, "{p:?}");
        let cost = |p: SplitPlan| makespan(1024, p.n_splits, p.tiles_per_split, 132);
        assert_eq!(cost(p), cost(plain), "{plain:?} {p:?}");
        // Nothing fits (d = 1 << 20): the plain plan.
        assert_eq!(plan_l2(128, 512, 132, h200(1 << 20)), plan(128, 512, 132));
        // Every plan still covers every tile, and where some plan fits, the rows that the launch
        // order keeps resident (the raster group × its splits, or the first `slots` blocks)
        // fit.
        for m in [1u32, 8, 32, 64, 128, 256, 512, 1024, 2048] {
            for n in [1u32, 63, 75, 122, 243, 501, 594, 970] {
                for d in [1024u64, 2048, 4096, 5120, 8192] {
                    let l2 = h200(d);
                    let p = plan_l2(m, n, 132, l2);
                    assert_eq!(n.div_ceil(p.tiles_per_split), p.n_splits, "{p:?}");
                    let resident = if m as u64 * p.n_splits as u64 <= 132 {
                        m
                    } else if p.raster_group == 0 {
                        m.min(132)
                    } else {
                        p.raster_group.min(m).min(132u32.div_ceil(p.n_splits))
                    };
                    // (The fewest rows any split count keeps resident: one tile per split.)
                    let any_fits = m.min(132u32.div_ceil(n)) as u64 * l2.h_tile_bytes <= l2.budget_bytes;
                    assert!(!any_fits || resident as u64 * l2.h_tile_bytes <= l2.budget_bytes, "m {m} n {n} d {d}: {p:?}");
                }
            }
        }
    }

    #[test]
    fn overrides_keep_every_tile_covered() {
        let base = plan(64, 594, 132);
        assert_eq!(PlanOverride::default().apply(base, 594), base);
        let p = PlanOverride { splits: Some(8), raster: Some(16), ..Default::default() }.apply(base, 594);
        assert_eq!((p.tiles_per_split, p.n_splits, p.raster_group), (75, 8, 16));
        // 594 = 7 · 75 + 69: the fill stays below the last split's 69 tiles.
        let p = PlanOverride { splits: Some(8), fill: Some(100), ..Default::default() }.apply(base, 594);
        assert_eq!((p.n_splits, p.fill, p.blocks_per_row()), (8, 68, 16));
        let p = PlanOverride { tiles: Some(3), ..Default::default() }.apply(base, 16);
        assert_eq!((p.tiles_per_split, p.n_splits), (3, 6));
        // Clamped and ignored values.
        let p = PlanOverride { splits: Some(1000), ..Default::default() }.apply(base, 10);
        assert_eq!((p.tiles_per_split, p.n_splits), (1, 10));
        let p = PlanOverride { tiles: Some(0), splits: Some(0), ..Default::default() }.apply(base, 594);
        assert_eq!(p, base);
        for n in 1..200u32 {
            for k in 1..20u32 {
                for o in [PlanOverride { splits: Some(k), ..Default::default() }, PlanOverride { tiles: Some(k), ..Default::default() }] {
                    let p = o.apply(base, n);
                    assert!(p.tiles_per_split >= 1 && n.div_ceil(p.tiles_per_split) == p.n_splits, "{o:?} n {n}: {p:?}");
                }
            }
        }
    }

    #[test]
    #[cfg(feature = "std")]
    fn block_work_covers_every_tile_once() {
        for (m, n) in [(1u32, 1u32), (3, 7), (8, 970), (64, 243), (5, 100)] {
            for per in [1u32, 2, 7, 30, 243, 1000] {
                for group in [0u32, 1, 2, 4] {
                    let base = SplitPlan { raster_group: group, ..SplitPlan::new(per.min(n), n.div_ceil(per.min(n))) };
                    for fill in [0u32, 1, 3, 1000] {
                        let plan = PlanOverride { fill: Some(fill), ..Default::default() }.apply(base, n);
                        assert!(plan.fill == 0 || plan.fill < last_split_len(plan, n), "{plan:?}");
                        let mut seen = std::vec![0u8; (m * n) as usize];
                        let mut slots = std::vec![false; (m * plan.blocks_per_row()) as usize];
                        for by in 0..plan.blocks_per_row() {
                            for bx in 0..m {
                                let w = block_work(bx, by, m, n, plan.tiles_per_split, group, plan.fill);
                                assert!(w.count >= 1 && w.m_tile < m && w.slot < plan.blocks_per_row(), "{plan:?} {w:?}");
                                let slot = (w.m_tile * plan.blocks_per_row() + w.slot) as usize;
                                assert!(!slots[slot], "slot twice: {plan:?} {w:?}");
                                slots[slot] = true;
                                for v in w.first..w.first + w.count {
                                    seen[(w.m_tile * n + v) as usize] += 1;
                                }
                            }
                        }
                        assert!(seen.iter().all(|&c| c == 1), "m {m} n {n}: {plan:?}");
                    }
                }
            }
        }
        // The fillers come after every main block in launch order and take the ends of the splits.
        let w = block_work(0, 2, 4, 10, 5, 0, 2);
        assert_eq!(w, BlockWork { m_tile: 0, slot: 2, first: 3, count: 2 });
        assert_eq!(block_work(3, 1, 4, 10, 5, 0, 2), BlockWork { m_tile: 3, slot: 1, first: 5, count: 3 });
    }

    #[test]
    #[cfg(feature = "std")]
    fn fillers_use_the_idle_sms_of_the_last_wave() {
        // t = 8192, v = 248320 (64 token tiles × 970 vocab tiles), 2 splits: 128 blocks on 132
        // SMs. With fillers every SM works, and the makespan falls by about the idle share.
        let base = plan(64, 970, 132);
        assert_eq!((base.n_splits, base.fill), (2, 0), "{base:?}");
        let p = with_fill(base, 64, 970, 132, 32);
        assert!(p.fill > 0 && (p.n_splits, p.tiles_per_split) == (base.n_splits, base.tiles_per_split), "{p:?}");
        let (t0, t1) = (makespan_k_steps(base, 64, 970, 132, 32), makespan_k_steps(p, 64, 970, 132, 32));
        assert!(t1 as f64 <= t0 as f64 * 0.975, "{t0} -> {t1} ({p:?})");
        // Whole waves of equal blocks gain nothing: 132 token tiles × 1 split.
        let whole = plan(132, 100, 132);
        assert_eq!(with_fill(whole, 132, 100, 132, 32), whole);
        // A last split of one tile leaves no room for a fill.
        let one = SplitPlan::new(10, 11);
        assert_eq!(last_split_len(one, 101), 1);
        assert_eq!(with_fill(one, 7, 101, 132, 32).fill, 0);
        // The fill never grows the makespan, whatever the shape.
        for m in [1u32, 8, 64, 128, 256, 1024] {
            for n in [1u32, 63, 243, 485, 970] {
                let base = plan(m, n, 132);
                let p = with_fill(base, m, n, 132, 32);
                assert!(p.fill < last_split_len(p, n).max(1));
                assert!(makespan_k_steps(p, m, n, 132, 32) <= makespan_k_steps(base, m, n, 132, 32), "m {m} n {n}: {p:?}");
            }
        }
    }

    #[test]
    fn raster_is_a_permutation() {
        for (gx, gy) in [(1u32, 1u32), (5, 3), (64, 2), (128, 8), (7, 16)] {
            for group in [0u32, 1, 2, 4, 8, 16, 200] {
                let mut seen = [false; 1024];
                for y in 0..gy {
                    for x in 0..gx {
                        let (m, s) = raster(x, y, gx, gy, group);
                        assert!(m < gx && s < gy, "{gx}x{gy} g{group}: ({x},{y}) -> ({m},{s})");
                        let i = (m + s * gx) as usize;
                        assert!(!seen[i], "{gx}x{gy} g{group}: ({m},{s}) twice");
                        seen[i] = true;
                    }
                }
            }
        }
        // Group 4 of 8 token tiles × 2 splits: the first 8 blocks cover tiles 0..4 of both splits.
        let first: [(u32, u32); 8] = core::array::from_fn(|x| raster(x as u32, 0, 8, 2, 4));
        assert_eq!(first, [(0, 0), (1, 0), (2, 0), (3, 0), (0, 1), (1, 1), (2, 1), (3, 1)]);
    }

    #[test]
    fn covers_every_tile_exactly() {
        for m in [1u32, 3, 64, 1000] {
            for n in [1u32, 2, 7, 250, 1187] {
                let p = plan(m, n, 132);
                assert!(p.tiles_per_split >= 1);
                assert_eq!(n.div_ceil(p.tiles_per_split), p.n_splits);
                assert!(p.n_splits as u64 * p.tiles_per_split as u64 >= n as u64);
                assert!((p.n_splits as u64 - 1) * (p.tiles_per_split as u64) < n as u64);
            }
        }
    }

    #[test]
    fn small_token_counts_split_the_vocab() {
        // One token tile on 132 SMs: the vocab is spread over (nearly) every SM.
        let p = plan(1, 1187, 132);
        assert!(p.n_splits >= 100, "{p:?}");
        // Enough token tiles to fill the machine many times over: long blocks, few splits.
        let p = plan(2048, 1187, 132);
        assert!(p.tiles_per_split >= 64 && p.n_splits <= 16, "{p:?}");
    }

    #[test]
    fn balanced_example() {
        // 64 token tiles × 1187 vocab tiles on 132 slots: a perfect plan has no idle wave tail.
        let p = plan(64, 1187, 132);
        let waves = (64 * p.n_splits as u64).div_ceil(132);
        let ideal = (64u64 * 1187).div_ceil(132);
        assert!(waves * p.tiles_per_split as u64 <= ideal + ideal / 50, "{p:?}");
    }
}
