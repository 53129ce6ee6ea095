//! The fused forward on the Hopper mainloop: each 64-column half of a 128-column block folded with
//! `epilogue::fwd::fold_tile` (the accumulator layout of `m64n128k16` is the `mma.sync` m16n8
//! layout per 8 columns, one m16 tile per warp), and the block reduction
//! `epilogue::fwd::store_partials` with one warp along N. The `_keep` entry stores each half
//! tile's kept `q` through [`StoreBoxes`] when the launch's rows are the caller's (no
//! `kept_map`), and from each thread (`epilogue::kept::store_q`) when they scatter.

use super::pipeline::{tma_pipeline, tma_split, TmaRing, BK};
use super::store::BOX_BYTES;
use super::{block_work, half, warp_pos, StoreBoxes, WgAcc};
use crate::body::Grid;
use crate::epilogue::fwd::{fold_tile, store_partials};
use crate::epilogue::kept::{kept_rows, KeptRows};
use crate::epilogue::labels::{load_label, local_column};
use crate::intrinsics;
use lmhead_core::config::TMA_STORE_BYTES;
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
/// needs it (and `p.kept_map` 0 or `t` rows), 1024 bytes after the ring then `TMA_STORE_BYTES`
/// of shared memory (`TileConfig::keep_smem_bytes`), and with `p.kept_map` 0 a third map in
/// `p.tmaps`: the q plane `[kept_rows][kept_stride]` as 16-bit elements, 64 × 64 boxes,
/// 128-byte swizzle.
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
    unsafe { tma_split::<BM, BN, ST, WGM, false, false, true>(tid, p.tmaps, m0, n0_first, n_tiles, kt) };
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
    // Rows in the caller's order go out through the store boxes; scattered ones from each
    // thread.
    let direct = p.kept_map != 0;
    // SAFETY: the map holds t rows (kernel contract); not read without KEEP.
    let kept = if KEEP { unsafe { kept_rows::<1>(p, &w, m0, direct) } } else { KeptRows::none() };
    // The host's `TileConfig::keep_smem_bytes` reserves exactly these boxes for the block.
    const { assert!(WGM as u32 * 2 * BOX_BYTES == TMA_STORE_BYTES as u32) };
    let mut out = StoreBoxes::new(TmaRing::new::<BM, BN, ST>().store_boxes(), (p.tmaps as *const u8).wrapping_add(256), tid);
    let wg_row = m0 + 64 * (tid >> 7);
    let mut acc: WgAcc<NW> = [[[[0.0; 4]; 8]; 2]; NW];

    // ---- Main loop, each tile folded into the row states ------------------------------------
    let finish = #[inline(always)]
    |tile: u32, acc: &mut WgAcc<NW>| {
        let n0 = n0_first + tile * BN as u32;
        unroll!(NW, |nb| {
            unroll!(2, |h| {
                let c0 = n0 + (nb * 128 + h * 64) as u32;
                let mut qv = [[[0u32; 2]; 8]; 1];
                // SAFETY: the consumer warps run this converged; the kept buffer per the kernel
                // contract.
                unsafe {
                    fold_tile::<64, 1, 8, ENT, KEEP, true>(p, &w, c0, half(acc, nb, h), &mut st, &mut z_label, &label, &kept, &mut qv)
                };
                // A half tile from the stride on (the second 128 columns of a last 256-wide
                // tile) has nothing to store; the condition is the warpgroup's (`c0`, `p`).
                if KEEP && !direct && (c0 as u64) < p.kept_stride {
                    // SAFETY: every consumer thread of the warpgroup takes this branch together,
                    // the same number of times; the boxes follow the ring and the q plane's map
                    // is the third one (kernel contract); this block alone writes these rows
                    // and columns of it.
                    unsafe { out.store::<true>(&qv[0], c0, wg_row) };
                }
            });
        });
    };
    // SAFETY: every thread calls with the same arguments; smem and operands per the contract.
    unsafe { tma_pipeline::<BM, BN, ST, WGM, NW, false, false>(tid, n_tiles, kt, &mut acc, finish) };
    if KEEP {
        out.drain();
    }

    // ---- Epilogue ---------------------------------------------------------------------------
    // SAFETY: all consumer threads, ring drained behind the pipeline's last barrier; BM·16 bytes
    // fit.
    unsafe { store_partials::<BM, 1, 1, ENT>(p, &w, &mut st, &mut z_label, m0, split, intrinsics::smem_base(), (WGM * 128) as u32) };
}
