//! The epilogues both mainloops share, and the fragment layout they consume.
//!
//! Each mainloop (`sm80/`: `mma.sync`; `sm90/`: TMA + `wgmma`) ends every output tile with f32
//! accumulators in the `mma.sync` `m16n8` layout: per warp, `MI` 16-row tiles by `NI` 8-column
//! tiles, four values per thread each ([`Acc`]), placed in the block tile by [`WarpPos`]. The
//! `wgmma` accumulator of an `m64n128` instruction is that layout per 8 columns with one m16 tile
//! per warp, so the `Sm90` kernels hand it over as `Acc<1, 8>` per 64-column half. The
//! epilogues read only this layout:
//!
//! One file per pass:
//!
//! - [`fwd`]: the forward's online log-sum-exp fold and the block reduction into partials;
//! - [`dlogits`]: the backward d-logits (per-row coefficients, bf16 pairs, the staging store);
//! - [`gemm`]: the backward GEMMs' store (`C = acc (+ C_acc)`);
//! - [`labels`]: the label helpers all of them (and the merges) read.
//!
//! A new mainloop (an `sm100/` beside the others) produces the same fragments and calls these.

pub mod dlogits;
pub mod fwd;
pub mod gemm;
pub mod kept;
pub mod labels;

use crate::intrinsics;

/// Accumulator fragments of one warp in the `mma.sync` `m16n8` layout: `MI` m16 tiles by `NI`
/// n8 tiles, four f32 per thread each (`c0, c1` in row `lane / 4`, `c2, c3` eight rows below;
/// columns `2 · (lane % 4) + {0, 1}`).
pub type Acc<const MI: usize, const NI: usize> = [[[f32; 4]; NI]; MI];

/// Per-warp geometry of a block tile.
#[derive(Clone, Copy)]
pub struct WarpPos {
    pub tid: u32,
    pub lane: u32,
    /// Row of this warp's sub-tile inside the block tile.
    pub wm0: u32,
    /// Column of this warp's sub-tile inside the block tile.
    pub wn0: u32,
    /// Index of the warp along N.
    pub warp_n: u32,
}

impl WarpPos {
    #[inline(always)]
    pub fn new<const BM: usize, const BN: usize, const WM: usize, const WN: usize>() -> Self {
        let tid = intrinsics::thread_idx();
        let warp = tid >> 5;
        let (warp_m, warp_n) = (warp / WN as u32, warp % WN as u32);
        Self { tid, lane: tid & 31, wm0: warp_m * (BM / WM) as u32, wn0: warp_n * (BN / WN) as u32, warp_n }
    }

    /// Row (inside the block tile) of accumulator element `(mi, half)`: `half` 0 holds
    /// `c0, c1`, half 1 holds `c2, c3` eight rows below.
    #[inline(always)]
    pub fn row(&self, mi: usize, half: usize) -> u32 {
        self.wm0 + (mi * 16 + half * 8) as u32 + (self.lane >> 2)
    }

    /// Column (inside the block tile) of accumulator element `(ni, e)`, `e ∈ {0, 1}`.
    #[inline(always)]
    pub fn col(&self, ni: usize, e: usize) -> u32 {
        self.wn0 + (ni * 8 + e) as u32 + 2 * (self.lane & 3)
    }
}
