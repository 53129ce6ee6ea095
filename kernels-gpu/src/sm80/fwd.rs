//! The fused forward on the portable mainloop (`MmaSync`, [`super::mainloop`]).
//!
//! Grid: `x` = token tile (`BM` rows), `y` = vocab split (`tiles_per_split` consecutive
//! `BN`-wide vocab tiles). Each thread keeps the state of the rows it holds in its accumulator
//! fragments across every vocab tile of the split (`epilogue::fwd::fold_tile`); at the end the
//! block reduces them (quad shuffles, then shared memory across the warps along N) and writes
//! one [`Partial`](lmhead_core::params::Partial) per (split, row)
//! (`epilogue::fwd::store_partials`). `fwd_merge` (`crate::merge`) combines the splits. Nothing
//! of size `t × v` is written.

use super::mainloop::{self, Operand};
use crate::epilogue::fwd::{fold_tile, store_partials};
use crate::epilogue::kept::{kept_rows, KeptRows};
use crate::epilogue::labels::{load_label, local_column};
use crate::epilogue::{Acc, WarpPos};
use crate::intrinsics;
use lmhead_core::lse::Lse2;
use lmhead_core::params::LogitsParams;

/// The forward mainloop kernel.
///
/// # Safety
/// Launched with `WM·WN·32` threads, a grid of `(ceil(t/BM), n_splits)` blocks and
/// `max(ring, reduction)` bytes of dynamic shared memory; `p` describes valid device buffers:
/// `h [t][d]`, `W [v][d]` (bf16), labels `[t]`, partials `[n_splits][t]`; with `KEEP` also the
/// kept logits as `epilogue::kept::store_q` needs them (and `p.kept_map` 0 or `t` rows).
#[inline(always)]
pub unsafe fn fwd<
    const BM: usize,
    const BN: usize,
    const BK: usize,
    const ST: usize,
    const WM: usize,
    const WN: usize,
    const MI: usize,
    const NI: usize,
    const ENT: bool,
    const KEEP: bool,
>(
    p: &LogitsParams,
) {
    const {
        assert!(MI * 16 * WM == BM && NI * 8 * WN == BN && NI % 2 == 0);
        assert!(BK == 32 || BK == 64);
        assert!(BM <= WM * WN * 32, "one thread per row in the final reduction");
    }
    let w = WarpPos::new::<BM, BN, WM, WN>();
    let m0 = intrinsics::block_idx_x() * BM as u32;
    let split = intrinsics::block_idx_y();
    let v_tiles = p.v.div_ceil(BN as u32);
    let tile_begin = split * p.tiles_per_split;
    let n_tiles = (v_tiles - tile_begin).min(p.tiles_per_split);
    let kt = p.d.div_ceil(BK as u32);

    // ---- Prologue: per-row state and labels ------------------------------------------------
    let mut st = [[Lse2::<f32>::EMPTY; 2]; MI];
    let mut z_label = [[0.0f32; 2]; MI];
    let mut label = [[-1i32; 2]; MI];
    unroll!(MI, |mi| {
        unroll!(2, |h| {
            let row = m0 + w.row(mi, h);
            if row < p.t {
                // SAFETY: row < t and labels holds t elements (kernel contract).
                label[mi][h] = local_column(p, unsafe { load_label(p.labels, p.label_kind, row) });
            }
        });
    });

    let a = Operand { ptr: p.h as *const u16, stride: p.h_row_stride, mn_bound: p.t, k_bound: p.d };
    let b = Operand { ptr: p.w as *const u16, stride: p.w_row_stride, mn_bound: p.v, k_bound: p.d };
    let ring = intrinsics::smem_base();
    let threads = WM * WN * 32;
    let a_bytes = (BM * BK * 2) as u32;
    let stage_bytes = ((BM + BN) * BK * 2) as u32;
    let mut acc: Acc<MI, NI> = [[[0.0; 4]; NI]; MI];

    // ---- Main loop --------------------------------------------------------------------------
    let load = #[inline(always)]
    |s: u32, tile: u32, k: u32| {
        let n0 = (tile_begin + tile) * BN as u32;
        let k0 = k * BK as u32;
        // SAFETY: stage `s` holds BM·BK + BN·BK bf16; operands are bounds-checked per chunk;
        // every thread of the block runs this with its own tid.
        unsafe {
            mainloop::load_tile::<BM, BK, true>(s, a, m0, k0, w.tid, threads);
            mainloop::load_tile::<BN, BK, true>(s + a_bytes, b, n0, k0, w.tid, threads);
        }
    };
    let compute = #[inline(always)]
    |s: u32, acc: &mut Acc<MI, NI>| {
        // SAFETY: the warp is converged; `s` holds a landed stage.
        unsafe { mainloop::mma_stage::<BM, BN, BK, MI, NI, true, true>(s, s + a_bytes, acc, w.wm0, w.wn0, w.lane) };
    };
    let finish = #[inline(always)]
    |tile: u32, acc: &mut Acc<MI, NI>| {
        let n0 = (tile_begin + tile) * BN as u32;
        // The kept rows are looked up per tile (L1 hits), not held across the mainloop: the
        // instance without the mode then has no new variable, and its PTX stays the same.
        // SAFETY: the kept map per the kernel contract (not read without KEEP).
        // Each thread stores its own pairs (`direct`; `qv` is then dead).
        let kept = if KEEP { unsafe { kept_rows::<MI>(p, &w, m0, true) } } else { KeptRows::none() };
        let mut qv = [[[0u32; 2]; NI]; MI];
        // SAFETY: every thread of the block runs this converged; the kept buffer per the kernel
        // contract.
        unsafe { fold_tile::<BN, MI, NI, ENT, KEEP, false>(p, &w, n0, acc, &mut st, &mut z_label, &label, &kept, &mut qv) };
    };
    // SAFETY: all threads call with the same trip counts; the ring is the dynamic shared memory.
    unsafe { mainloop::pipeline::<ST, Acc<MI, NI>>(ring, stage_bytes, n_tiles, kt, &mut acc, load, compute, finish) };

    // ---- Epilogue: reduce the row states of the block and write the partials ---------------
    // SAFETY: all threads reach this with the ring drained (the pipeline ends behind a barrier).
    unsafe { store_partials::<BM, WN, MI, ENT>(p, &w, &mut st, &mut z_label, m0, split, ring, threads as u32) };
}
