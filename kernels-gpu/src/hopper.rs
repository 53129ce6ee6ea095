//! The Hopper mainloop: `wgmma.mma_async` on operands in shared memory (128-byte swizzle,
//! descriptors from `lmhead_core::wgmma`), fed by a multi-stage `cp.async` ring, and the fused
//! forward built on it.
//!
//! `T≙M, V≙N, D≙K`. A block has `WGM` warpgroups (4 warps each) stacked along M, each owning 64
//! rows of the `BM = 64·WGM` token tile and all `BN = 128·NW` vocab columns (NW `m64n128k16`
//! instructions per k16 step). Stages are 64 deep (one 128-byte line per operand row).
//!
//! **Pipeline.** Loads run `P = ST − 2` stages ahead. Iteration `j`: wait for stage `j`'s
//! `cp.async` group, `fence.proxy.async` (cp.async writes are generic-proxy writes; `wgmma`
//! reads through the async proxy), barrier, issue the loads of iteration `j + P` into the stage
//! of iteration `j − 2`, issue this stage's `wgmma`s, commit, and `wgmma.wait_group 1`: the
//! group of iteration `j − 1` is then complete, so by the next barrier every warpgroup is done
//! reading the stage that iteration `j + 1` overwrites. One `wgmma` group stays in flight while
//! the next stage is being waited for.
//!
//! The epilogue folds each 64-column half of a 128-column block with `fwd::fold_tile` (the
//! accumulator layout of `m64n128k16` is the `mma.sync` m16n8 layout per 8 columns, one m16 tile
//! per warp), and the block reduction is `fwd::store_partials` with one warp along N.

use crate::fwd::{fold_tile, load_label, local_column, store_partials};
use crate::intrinsics::{self, SmemAddr};
use crate::mainloop::{self, Acc, Operand, WarpPos};
use lmhead_core::lse::Lse2;
use lmhead_core::params::LogitsParams;
use lmhead_core::wgmma::desc_k_major_sw128;

const BK: usize = 64;

/// `cp.async.wait_group (P − 1)` for the prefetch distance `P = ST − 2`.
#[inline(always)]
fn wait_prefetched<const ST: usize>() {
    match ST {
        3 => intrinsics::cp_async_wait::<0>(),
        4 => intrinsics::cp_async_wait::<1>(),
        5 => intrinsics::cp_async_wait::<2>(),
        _ => intrinsics::cp_async_wait::<0>(),
    }
}

/// The fused forward on the Hopper mainloop. Same contract and outputs as `fwd::fwd`.
///
/// # Safety
/// Launched with `WGM·128` threads, a grid of `(ceil(t/BM), n_splits)` blocks and
/// `(BM + BN)·64·2·ST` bytes of dynamic shared memory (1024-byte aligned by its declaration);
/// `p` describes valid device buffers as for `fwd::fwd`.
#[inline(always)]
pub unsafe fn fwd_wg<const BM: usize, const BN: usize, const ST: usize, const WGM: usize, const NW: usize, const ENT: bool>(
    p: &LogitsParams,
) {
    const {
        assert!(BM == 64 * WGM && BN == 128 * NW && ST >= 3 && ST <= 5);
        assert!(BM * BK / 8 % (WGM * 128) == 0 && BN * BK / 8 % (WGM * 128) == 0);
    }
    let tid = intrinsics::thread_idx();
    let warp = tid >> 5;
    // Warp `warp` holds rows 16·warp .. 16·warp + 16 of the tile (its warpgroup's 64 rows).
    let w = WarpPos { tid, lane: tid & 31, wm0: 16 * warp, wn0: 0, warp_n: 0 };
    let wg_row0 = 64 * (warp / 4);
    let m0 = intrinsics::block_idx_x() * BM as u32;
    let split = intrinsics::block_idx_y();
    let v_tiles = p.v.div_ceil(BN as u32);
    let tile_begin = split * p.tiles_per_split;
    let n_tiles = (v_tiles - tile_begin).min(p.tiles_per_split);
    let kt = p.d.div_ceil(BK as u32);

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
    let a = Operand { ptr: p.h as *const u16, stride: p.h_row_stride, mn_bound: p.t, k_bound: p.d };
    let b = Operand { ptr: p.w as *const u16, stride: p.w_row_stride, mn_bound: p.v, k_bound: p.d };
    let ring: SmemAddr = intrinsics::smem_base();
    let threads = WGM * 128;
    let a_bytes = (BM * BK * 2) as u32;
    let stage_bytes = ((BM + BN) * BK * 2) as u32;
    // NW blocks of 128 columns, each two halves of (1 m16 tile) × (8 n8 tiles) per warp.
    let mut acc: [[[[f32; 4]; 8]; 2]; NW] = [[[[0.0; 4]; 8]; 2]; NW];

    let load = |s: SmemAddr, tile: u32, k: u32| {
        let n0 = (tile_begin + tile) * BN as u32;
        let k0 = k * BK as u32;
        // SAFETY: stage `s` holds BM·64 + BN·64 bf16 in the 128B-swizzled layout (swz_k::<64>);
        // operands are bounds-checked per 16-byte chunk; every thread runs this with its tid.
        unsafe {
            mainloop::load_tile::<BM, BK, true>(s, a, m0, k0, tid, threads);
            mainloop::load_tile::<BN, BK, true>(s + a_bytes, b, n0, k0, tid, threads);
        }
    };

    // ---- Main loop --------------------------------------------------------------------------
    let prefetch = ST as u32 - 2;
    let total = n_tiles * kt;
    let (mut lt, mut lk, mut issued, mut load_stage) = (0u32, 0u32, 0u32, 0u32);
    for _ in 0..prefetch {
        if issued < total {
            load(ring + load_stage * stage_bytes, lt, lk);
            issued += 1;
            lk += 1;
            if lk == kt {
                lk = 0;
                lt += 1;
            }
        }
        intrinsics::cp_async_commit();
        load_stage += 1;
    }
    let mut stage = 0u32;
    let mut tile = 0u32;
    while tile < n_tiles {
        let mut k = 0u32;
        while k < kt {
            wait_prefetched::<ST>();
            intrinsics::fence_proxy_async_shared();
            // SAFETY: every thread runs the same trip counts.
            unsafe { intrinsics::sync_threads() };
            if issued < total {
                load(ring + load_stage * stage_bytes, lt, lk);
                issued += 1;
                lk += 1;
                if lk == kt {
                    lk = 0;
                    lt += 1;
                }
            }
            intrinsics::cp_async_commit();
            load_stage = if load_stage + 1 == ST as u32 { 0 } else { load_stage + 1 };

            let a_s = ring + stage * stage_bytes + wg_row0 * 128;
            let b_s = ring + stage * stage_bytes + a_bytes;
            // SAFETY: the warpgroup is converged; the stage landed (wait + fence + barrier) and
            // is not overwritten before `wgmma_wait::<1>` of the next iteration retires this
            // group; accumulators are read only after `wgmma_wait::<0>` below.
            unsafe {
                intrinsics::wgmma_fence();
                unroll!(4, |kk| {
                    let koff = (kk * 32) as u32;
                    unroll!(NW, |nb| {
                        let bd = desc_k_major_sw128(b_s + (nb * 128 * 128) as u32 + koff);
                        intrinsics::wgmma_m64n128k16_bf16(&mut acc[nb], desc_k_major_sw128(a_s + koff), bd, k > 0 || kk > 0);
                    });
                });
                intrinsics::wgmma_commit();
                intrinsics::wgmma_wait::<1>();
            }
            stage = if stage + 1 == ST as u32 { 0 } else { stage + 1 };
            k += 1;
        }
        // SAFETY: the warpgroup is converged; all of this tile's groups retire here.
        unsafe { intrinsics::wgmma_wait::<0>() };
        let n0 = (tile_begin + tile) * BN as u32;
        unroll!(NW, |nb| {
            unroll!(2, |half| {
                let part: &mut Acc<1, 8> = core::array::from_mut(&mut acc[nb][half]);
                fold_tile::<64, 1, 8, ENT>(p, &w, n0 + (nb * 128 + half * 64) as u32, part, &mut st, &mut z_label, &label);
            });
        });
        tile += 1;
    }
    intrinsics::cp_async_wait::<0>();
    // SAFETY: every thread reaches this point once; afterwards the ring is free.
    unsafe { intrinsics::sync_threads() };

    // ---- Epilogue ---------------------------------------------------------------------------
    // SAFETY: all threads, ring drained behind the barrier above; BM·16 bytes fit the ring.
    unsafe { store_partials::<BM, 1, 1, ENT>(p, &w, &mut st, &mut z_label, m0, split, ring) };
}
