//! The fused forward on the Hopper mainloop: each 64-column half of a 128-column block folded with
//! `epilogue::fwd::fold_tile` (the accumulator layout of `m64n128k16` is the `mma.sync` m16n8
//! layout per 8 columns, one m16 tile per warp), and the block reduction
//! `epilogue::fwd::store_partials` with one warp along N.

use super::pipeline::{tma_pipeline, tma_split, BK};
use super::{block_work, half, warp_pos, WgAcc};
use crate::body::Grid;
use crate::epilogue::fwd::{fold_tile, store_partials};
use crate::epilogue::kept::{kept_rows, KeptRows};
use crate::epilogue::labels::{load_label, local_column};
use crate::intrinsics;
use lmhead_core::lse::Lse2;
use lmhead_core::params::LogitsParams;

/// The fused forward on the Hopper mainloop. Same contract and outputs as `sm80::fwd::fwd`.
///
/// # Safety
/// Launched with `(WGM + 1)·128` threads (the last warpgroup is the producer), a grid of
/// `(ceil(t/BM), n_splits)` blocks, or `2·n_splits` with `p.fill > 0` (less than the last
/// split's length; partials `[2·n_splits][t]`), and `(BM + BN)·64·2·ST` bytes of dynamic shared
/// memory (plus `16·ST` for the mbarriers, and `p.tmaps` set); `p` describes valid device
/// buffers as for `sm80::fwd::fwd`. With `KEEP`, also `p.kept` as `epilogue::kept::store_q`
/// needs it (and `p.kept_map` 0 or `t` rows).
#[inline(always)]
pub unsafe fn fwd_wg<
    const BM: usize,
    const BN: usize,
    const ST: usize,
    const WGM: usize,
    const NW: usize,
    const ENT: bool,
    const KEEP: bool,
>(
    p: &LogitsParams,
) {
    let tid = intrinsics::thread_idx();
    let v_tiles = p.v.div_ceil(BN as u32);
    let work = block_work(Grid { group: p.raster_group, per: p.tiles_per_split, n_total: v_tiles, fill: p.fill });
    let (m0, split, n_tiles) = (work.m_tile * BM as u32, work.slot, work.count);
    let kt = p.d.div_ceil(BK as u32);
    let n0_first = work.first * BN as u32;
    // SAFETY: first call, by every thread; the kernel contract provides the maps.
    unsafe { tma_split::<BM, BN, ST, WGM, false, false>(tid, p.tmaps, m0, n0_first, n_tiles, kt) };
    let w = warp_pos(tid);

    // ---- Prologue: per-row state and labels ------------------------------------------------
    let mut st = [[Lse2::<f32>::EMPTY; 2]; 1];
    let mut z_label = [[0.0f32; 2]; 1];
    let mut label = [[-1i32; 2]; 1];
    unroll!(2, |h| {
        let row = m0 + w.row(0, h);
        if row < p.t {
            // SAFETY: row < t and labels holds t elements (kernel contract).
            label[0][h] = local_column(p, unsafe { load_label(p.labels, p.label_kind, row) });
        }
    });
    // SAFETY: the map holds t rows (kernel contract); not read without KEEP.
    let kept = if KEEP { unsafe { kept_rows::<1>(p, &w, m0) } } else { KeptRows::none() };
    let mut acc: WgAcc<NW> = [[[[0.0; 4]; 8]; 2]; NW];

    // ---- Main loop, each tile folded into the row states ------------------------------------
    let finish = #[inline(always)]
    |tile: u32, acc: &mut WgAcc<NW>| {
        let n0 = n0_first + tile * BN as u32;
        unroll!(NW, |nb| {
            unroll!(2, |h| {
                // SAFETY: the consumer warps run this converged; the kept buffer per the kernel
                // contract.
                unsafe {
                    fold_tile::<64, 1, 8, ENT, KEEP>(
                        p,
                        &w,
                        n0 + (nb * 128 + h * 64) as u32,
                        half(acc, nb, h),
                        &mut st,
                        &mut z_label,
                        &label,
                        &kept,
                    )
                };
            });
        });
    };
    // SAFETY: every thread calls with the same arguments; smem and operands per the contract.
    unsafe { tma_pipeline::<BM, BN, ST, WGM, NW, false, false>(tid, n_tiles, kt, &mut acc, finish) };

    // ---- Epilogue ---------------------------------------------------------------------------
    // SAFETY: all consumer threads, ring drained behind the pipeline's last barrier; BM·16 bytes
    // fit.
    unsafe { store_partials::<BM, 1, 1, ENT>(p, &w, &mut st, &mut z_label, m0, split, intrinsics::smem_base(), (WGM * 128) as u32) };
}
