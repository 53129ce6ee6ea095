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
}

/// Plan the split for `m_tiles` token tiles and `n_tiles` vocab tiles on `slots` concurrent
/// blocks (SM count × blocks per SM).
pub fn plan(m_tiles: u32, n_tiles: u32, slots: u32) -> SplitPlan {
    let slots = slots.max(1) as u64;
    let m_tiles = m_tiles.max(1) as u64;
    let n_tiles = n_tiles.max(1);
    let mut best = SplitPlan { tiles_per_split: n_tiles, n_splits: 1, raster_group: 0 };
    let mut best_cost = u64::MAX;
    // Walk every distinct tiles_per_split (splits from 1 up); cost = waves × tiles per block.
    let mut per = n_tiles;
    loop {
        let n_splits = n_tiles.div_ceil(per);
        let blocks = m_tiles * n_splits as u64;
        let waves = blocks.div_ceil(slots);
        let cost = waves * (per as u64 + BLOCK_OVERHEAD);
        if cost < best_cost {
            best_cost = cost;
            best = SplitPlan { tiles_per_split: per, n_splits, raster_group: 0 };
        }
        if per == 1 {
            break;
        }
        // Next smaller tiles_per_split that changes n_splits.
        let next_splits = n_splits + 1;
        per = n_tiles.div_ceil(next_splits).min(per - 1);
    }
    best
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
