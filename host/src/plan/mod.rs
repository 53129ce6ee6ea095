//! Launch plans: how the forward's `(token tiles) × (vocab splits)` grid and the sm90 backward
//! kernels' `(m tiles) × (n groups)` grids are cut and ordered (`lmhead_core::split` does the
//! arithmetic), and the measurement overrides of both ([`overrides`]).

pub(crate) mod overrides;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use lmhead_core::config::TileConfig;
use lmhead_core::split;
use lmhead_core::Problem;

use crate::device::Gpu;
use overrides::Overrides;

/// The forward's vocab split and launch order for `cfg` with `slots` concurrent blocks on the
/// device, with the overrides `LMHEAD_FWD_L2=0` (no L2 model), `LMHEAD_FWD_SPLITS`,
/// `LMHEAD_FWD_RASTER`, `LMHEAD_FWD_FILL`. The sm90 forward reads the raster order and the fill;
/// its plan keeps the resident rows of `h` in L2, and its fillers ([`split::with_fill`]) the
/// SMs busy in the last wave. `measured`: `(splits, raster group)` that the tuning table holds
/// for this key and config ([`crate::tune::table::PlanEntry`]), in place of the L2 model's.
pub(crate) fn fwd(gpu: &Gpu, slots: u32, cfg: TileConfig, p: Problem, measured: Option<(u32, u32)>) -> split::SplitPlan {
    let m_tiles = p.t.div_ceil(cfg.bm as usize) as u32;
    let n_tiles = p.v.div_ceil(cfg.bn as usize) as u32;
    let ov = Overrides::get();
    let plan = if cfg.is_sm90() && gpu.info().l2_bytes > 0 && !ov.fwd_l2_off {
        let modelled = split::plan_l2(m_tiles, n_tiles, slots, split::L2Model::of(cfg.bm.into(), p.d as u64, gpu.info().l2_bytes));
        match measured {
            Some((splits, raster)) => measured_plan(modelled, n_tiles, splits, raster),
            None => modelled,
        }
    } else {
        split::plan(m_tiles, n_tiles, slots)
    };
    let plan = ov.fwd.apply(plan, n_tiles);
    if !cfg.is_sm90() {
        return split::SplitPlan { fill: 0, ..plan };
    }
    match ov.fwd.fill {
        Some(_) => plan,
        None => with_fill(plan, m_tiles, n_tiles, slots, k_steps(p.d)),
    }
}

/// `splits` splits in raster groups of `raster` token tiles, as `LMHEAD_FWD_SPLITS` /
/// `LMHEAD_FWD_RASTER` would force them (so that a plan measured through those overrides is the
/// plan the table gives).
fn measured_plan(modelled: split::SplitPlan, n_tiles: u32, splits: u32, raster: u32) -> split::SplitPlan {
    split::PlanOverride { splits: Some(splits), tiles: None, raster: Some(raster), fill: None }.apply(modelled, n_tiles)
}

/// 64-deep K steps of a `k`-deep tile, the unit of [`split::makespan_k_steps`].
fn k_steps(k: usize) -> u32 {
    k.div_ceil(64) as u32
}

/// How an sm90 backward grid of `m_tiles × n_tiles` output tiles (`k`-deep) is walked: the
/// forward's split planner ([`split::plan_l2`], with A's `BM × k` rows as the resident tile)
/// gives the consecutive n tiles per block and the raster group. With one tile per block, as
/// the `mma.sync` kernels take them, every tile pays a pipeline fill and an exposed epilogue
/// (measured on the H200 at t = 8192, d = 4096, chunks of 8192: d-logits ≈ 1.5× and `dh` ≈ 1.3×
/// the time per FLOP of the whole-vocab cuBLAS GEMM). `LMHEAD_BWD_TILES` and
/// `LMHEAD_BWD_RASTER` override the plan; fillers ([`split::with_fill`]) keep the SMs busy in
/// the last wave unless `LMHEAD_BWD_FILL` sets the fill.
pub(crate) fn bwd(gpu: &Gpu, cfg: TileConfig, m_tiles: u32, n_tiles: u32, k: usize) -> split::SplitPlan {
    if !cfg.is_sm90() {
        return split::SplitPlan::new(1, n_tiles);
    }
    let info = gpu.info();
    let l2 = split::L2Model::of(cfg.bm.into(), k as u64, info.l2_bytes);
    let ov = Overrides::get().bwd;
    let plan = ov.apply(split::plan_l2(m_tiles, n_tiles, info.sm_count, l2), n_tiles);
    match ov.fill {
        Some(_) => plan,
        None => with_fill(plan, m_tiles, n_tiles, info.sm_count, k_steps(k)),
    }
}

/// Distinct plans [`with_fill`] remembers before it starts over.
const FILL_MEMO_CAP: usize = 4096;

/// [`split::with_fill`], remembered per plan and grid: its launch-order model walks every block
/// (≈ 2 ms at 20 000 blocks on one core), and every forward call and every backward launch asks
/// for a plan.
fn with_fill(plan: split::SplitPlan, m_tiles: u32, n_tiles: u32, slots: u32, k_steps: u32) -> split::SplitPlan {
    type Key = (u32, u32, u32, u32, u32, u32, u32);
    static MEMO: OnceLock<Mutex<HashMap<Key, u32>>> = OnceLock::new();
    let key = (plan.tiles_per_split, plan.n_splits, plan.raster_group, m_tiles, n_tiles, slots, k_steps);
    let memo = MEMO.get_or_init(Default::default);
    // A poisoned lock only means another thread panicked mid-insert; the map is still sound.
    if let Some(&fill) = memo.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return split::SplitPlan { fill, ..plan };
    }
    let filled = split::with_fill(plan, m_tiles, n_tiles, slots, k_steps);
    let mut memo = memo.lock().unwrap_or_else(|e| e.into_inner());
    if memo.len() >= FILL_MEMO_CAP {
        memo.clear();
    }
    memo.insert(key, filled.fill);
    filled
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_measured_plan_is_the_forced_one() {
        // 131072 × 128256 × 4096 in 128 × 256 tiles: 1024 × 501 tiles; the L2 model's plan, and
        // 12 splits in groups of 11 as the table or the overrides give them.
        let (m, n) = (1024u32, 501u32);
        let modelled = split::plan_l2(m, n, 132, split::L2Model::of(128, 4096, 60 << 20));
        let forced = split::PlanOverride { splits: Some(12), tiles: None, raster: Some(11), fill: None }.apply(modelled, n);
        let got = measured_plan(modelled, n, 12, 11);
        assert_eq!(got, forced);
        assert_eq!((got.n_splits, got.tiles_per_split, got.raster_group), (12, 42, 11));
        assert_ne!(got, modelled);
    }

    #[test]
    fn remembered_fill_is_the_models() {
        for (m, n) in [(64u32, 970u32), (64, 40), (2048, 32), (132, 100)] {
            let plan = split::plan(m, n, 132);
            let want = split::with_fill(plan, m, n, 132, 32);
            assert_eq!(with_fill(plan, m, n, 132, 32), want);
            assert_eq!(with_fill(plan, m, n, 132, 32), want, "second, remembered answer");
        }
    }
}
