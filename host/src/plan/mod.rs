//! Launch plans: how the forward's `(token tiles) × (vocab splits)` grid and the sm90 backward
//! kernels' `(m tiles) × (n groups)` grids are cut and ordered. The decisions are
//! `lmhead_core::heuristics`' (`fwd_plan`, `bwd_plan`, `fills`; `lmhead_core::split` does the
//! arithmetic); here they meet the measurement overrides that benches and tests may set
//! ([`overrides`]) and a memo of the fillers' launch-order model.

pub(crate) mod overrides;

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use lmhead_core::config::TileConfig;
use lmhead_core::heuristics;
use lmhead_core::split;
use lmhead_core::Problem;

use crate::device::Gpu;

/// The forward's vocab split and launch order for `cfg` with `slots` concurrent blocks on the
/// device: [`heuristics::fwd_plan`] with its fillers, under the overrides in force.
pub(crate) fn fwd(gpu: &Gpu, slots: u32, cfg: TileConfig, p: Problem) -> split::SplitPlan {
    let dev = crate::tune::limits_of(gpu.info());
    let (m_tiles, n_tiles) = heuristics::tiles(cfg, p);
    let ov = overrides::current();
    let plan = if ov.fwd_l2_off { split::plan(m_tiles, n_tiles, slots) } else { heuristics::fwd_plan(cfg, p, &dev, slots) };
    let plan = ov.fwd.apply(plan, n_tiles);
    if !heuristics::fills(cfg) {
        return split::SplitPlan { fill: 0, ..plan };
    }
    match ov.fwd.fill {
        Some(_) => plan,
        None => with_fill(plan, m_tiles, n_tiles, slots, heuristics::k_steps(p.d)),
    }
}

/// How a backward kernel of `cfg` walks its `m_tiles × n_tiles` output tiles (`k`-deep):
/// [`heuristics::bwd_plan`] with its fillers, under the overrides in force (a portable kernel
/// takes one tile per block, whatever they say).
pub(crate) fn bwd(gpu: &Gpu, cfg: TileConfig, m_tiles: u32, n_tiles: u32, k: usize) -> split::SplitPlan {
    let dev = crate::tune::limits_of(gpu.info());
    let plan = heuristics::bwd_plan(cfg, m_tiles, n_tiles, k, &dev);
    if !cfg.is_sm90() {
        return plan;
    }
    let ov = overrides::current().bwd;
    let plan = ov.apply(plan, n_tiles);
    match ov.fill {
        Some(_) => plan,
        None => with_fill(plan, m_tiles, n_tiles, dev.sm_count, heuristics::k_steps(k)),
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
    fn remembered_fill_is_the_models() {
        for (m, n) in [(64u32, 970u32), (64, 40), (2048, 32), (132, 100)] {
            let plan = split::plan(m, n, 132);
            let want = split::with_fill(plan, m, n, 132, 32);
            assert_eq!(with_fill(plan, m, n, 132, 32), want);
            assert_eq!(with_fill(plan, m, n, 132, 32), want, "second, remembered answer");
        }
    }
}
