//! Fused forward: logits tiles on the tensor cores, each folded at once into per-row online
//! `(m, s, t)` states and the label's logit. Nothing of size `t × v` is written.
//!
//! `T≙M, V≙N, D≙K`. Grid: `x` = token tile (`BM` rows), `y` = vocab split (`tiles_per_split`
//! consecutive `BN`-wide vocab tiles). Each thread keeps the state of the rows it holds in its
//! accumulator fragments across every vocab tile of the split; at the end the block reduces them
//! (quad shuffles, then shared memory across the warps along N) and writes one
//! [`Partial`](lmhead_core::params::Partial) per (split, row). `fwd_merge` combines the splits.
//!
//! With `ENT = false` the `t` sums are never stored, so their arithmetic is dead code and is
//! removed: the log-prob-only instance does no entropy work.

use crate::intrinsics::{self, exp2, fma, max_nan};
use crate::mainloop::{self, Acc, Operand, WarpPos};
use lmhead_core::lse::Lse2;
use lmhead_core::params::{LogitsParams, Partial, LABELS_I64};

/// The label of row `row` (global vocab id, or `ignore_index`).
///
/// # Safety
/// `labels` holds more than `row` labels of kind `kind` ([`LABELS_I32`](lmhead_core::params::LABELS_I32)
/// or [`LABELS_I64`]).
#[inline(always)]
pub unsafe fn load_label(labels: u64, kind: u32, row: u32) -> i64 {
    // SAFETY: the caller guarantees `row` is inside `labels`.
    unsafe {
        if kind == LABELS_I64 {
            *(labels as *const i64).add(row as usize)
        } else {
            *(labels as *const i32).add(row as usize) as i64
        }
    }
}

/// Local column (in `[0, v)`) of `label`, or −1 when it is `ignore_index` or outside this shard.
#[inline(always)]
pub fn local_column(p: &LogitsParams, label: i64) -> i32 {
    let local = label.wrapping_sub(p.v_begin);
    if label == p.ignore_index || local < 0 || local >= p.v as i64 {
        -1
    } else {
        local as i32
    }
}

/// The forward mainloop kernel.
///
/// # Safety
/// Launched with `WM·WN·32` threads, a grid of `(ceil(t/BM), n_splits)` blocks and
/// `max(ring, reduction)` bytes of dynamic shared memory; `p` describes valid device buffers:
/// `h [t][d]`, `W [v][d]` (bf16), labels `[t]`, partials `[n_splits][t]`.
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
        fold_tile::<BN, MI, NI, ENT>(p, &w, n0, acc, &mut st, &mut z_label, &label);
    };
    // SAFETY: all threads call with the same trip counts; the ring is the dynamic shared memory.
    unsafe { mainloop::pipeline::<ST, Acc<MI, NI>>(ring, stage_bytes, n_tiles, kt, &mut acc, load, compute, finish) };

    // ---- Epilogue: reduce the row states of the block and write the partials ---------------
    // SAFETY: all threads reach this with the ring drained (the pipeline ends behind a barrier).
    unsafe { store_partials::<BM, WN, MI, ENT>(p, &w, &mut st, &mut z_label, m0, split, ring, threads as u32) };
}

/// The block's final reduction: merge the row states of the four lanes that share a row (quad
/// shuffles), then of the `WN` warps along N (through shared memory), and write one partial per
/// row of this block and split.
///
/// # Safety
/// Called once by the `threads` threads that hold row states (every thread of an `mma.sync`
/// block, the consumer warpgroups of a warp-specialised one; it has a named barrier for exactly
/// those), after the last use of the ring: `smem` must have `WN · BM · 16` bytes that no one
/// else reads or writes any more.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub unsafe fn store_partials<const BM: usize, const WN: usize, const MI: usize, const ENT: bool>(
    p: &LogitsParams,
    w: &WarpPos,
    st: &mut [[Lse2<f32>; 2]; MI],
    z_label: &mut [[f32; 2]; MI],
    m0: u32,
    split: u32,
    smem: u32,
    threads: u32,
) {
    // Quad reduction: lanes 4g..4g+3 hold the same rows.
    unroll!(MI, |mi| {
        unroll!(2, |h| {
            let mut x = st[mi][h];
            let mut z = z_label[mi][h];
            unroll!(2, |i| {
                let mask = 1u32 << i;
                // SAFETY: the whole warp executes these shuffles (no divergence here).
                let other = unsafe {
                    Lse2 {
                        m: intrinsics::shfl_xor(x.m, mask),
                        s: intrinsics::shfl_xor(x.s, mask),
                        t: if ENT { intrinsics::shfl_xor(x.t, mask) } else { 0.0 },
                    }
                };
                // SAFETY: as above.
                z += unsafe { intrinsics::shfl_xor(z, mask) };
                x = x.merge(other, exp2);
            });
            st[mi][h] = x;
            z_label[mi][h] = z;
        });
    });
    // Across the WN warps along N, through shared memory (the ring is free: the pipeline
    // drained it behind a barrier).
    let red = smem;
    if w.lane & 3 == 0 {
        unroll!(MI, |mi| {
            unroll!(2, |h| {
                let x = st[mi][h];
                let slot = w.warp_n * BM as u32 + w.row(mi, h);
                let t = if ENT { x.t } else { 0.0 };
                // SAFETY: slot < WN·BM; the reduction area fits the dynamic shared memory.
                unsafe { intrinsics::st_shared_v4(red + slot * 16, [x.m, x.s, t, z_label[mi][h]]) };
            });
        });
    }
    // SAFETY: the caller's `threads` threads (all that compute rows) reach this barrier once.
    unsafe { intrinsics::named_barrier::<1>(threads) };
    let row = w.tid;
    if (row as usize) < BM && m0 + row < p.t {
        let mut x = Lse2::<f32>::EMPTY;
        let mut z = 0.0f32;
        for wn in 0..WN as u32 {
            // SAFETY: written above for every (warp_n, row) before the barrier.
            let [m, s, t, zl] = unsafe { intrinsics::ld_shared_v4(red + (wn * BM as u32 + row) * 16) };
            x = x.merge(Lse2 { m, s, t }, exp2);
            z += zl;
        }
        let out = Partial { m: x.m, s: x.s, t: if ENT { x.t } else { 0.0 }, z_label: z };
        let idx = split as u64 * p.t as u64 + (m0 + row) as u64;
        // SAFETY: split < n_splits and m0 + row < t: inside `partials [n_splits][t]`, which is
        // 16-byte aligned (Partial is align(16)).
        unsafe { intrinsics::st_global_v4((p.partials as *mut Partial).add(idx as usize) as *mut f32, [out.m, out.s, out.t, out.z_label]) };
    }
}

/// Fold one finished `BM × BN` logits tile (raw dot products in `acc`) into the row states, then
/// zero `acc`.
///
/// Per row: the tile maximum of `y = acc · scale2` (`scale2 = log2 e / temperature > 0`, so the
/// maximum of `acc` scaled is the maximum of `y`), the state moved to the new maximum, then
/// `s += 2^{y − m}` (and `t += 2^{u} u`) per column. Columns past `v` are padding: `acc = −∞`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn fold_tile<const BN: usize, const MI: usize, const NI: usize, const ENT: bool>(
    p: &LogitsParams,
    w: &WarpPos,
    n0: u32,
    acc: &mut Acc<MI, NI>,
    st: &mut [[Lse2<f32>; 2]; MI],
    z_label: &mut [[f32; 2]; MI],
    label: &[[i32; 2]; MI],
) {
    let scale2 = p.scale2;
    // n0 < v < 2^31 and BN ≤ 256: no overflow.
    if n0 + BN as u32 > p.v {
        // Columns from `lim` on are past the vocab (all of them when n0 ≥ v: the second
        // 128-column block of a last 256-wide wgmma tile).
        let lim = p.v.saturating_sub(n0);
        unroll!(MI, |mi| {
            unroll!(NI, |ni| {
                unroll!(4, |e| {
                    if w.col(ni, e & 1) >= lim {
                        acc[mi][ni][e] = f32::NEG_INFINITY;
                    }
                });
            });
        });
    }
    // Label logits: only when a row's label falls in this warp's columns of this tile.
    let warp_col0 = n0 as i32 + w.wn0 as i32 + 2 * (w.lane & 3) as i32;
    unroll!(MI, |mi| {
        unroll!(2, |h| {
            let dcol = label[mi][h].wrapping_sub(warp_col0);
            if dcol >= 0 && dcol < (NI * 8) as i32 {
                unroll!(NI, |ni| {
                    unroll!(2, |e| {
                        if dcol == (ni * 8 + e) as i32 {
                            z_label[mi][h] = acc[mi][ni][2 * h + e] * p.inv_temp;
                        }
                    });
                });
            }
        });
    });
    unroll!(MI, |mi| {
        unroll!(2, |h| {
            // NaN-propagating maximum: a row of NaN logits must not look like an all-padding
            // tile (which is skipped) and silently drop out of the sums.
            let mut tmax = f32::NEG_INFINITY;
            unroll!(NI, |ni| {
                tmax = max_nan(max_nan(tmax, acc[mi][ni][2 * h]), acc[mi][ni][2 * h + 1]);
            });
            if tmax != f32::NEG_INFINITY {
                let mut x = st[mi][h].absorb_max(tmax * scale2, exp2);
                let neg_m = -x.m;
                unroll!(NI, |ni| {
                    unroll!(2, |e| {
                        let u = fma(acc[mi][ni][2 * h + e], scale2, neg_m);
                        let pe = exp2(u);
                        x.s += pe;
                        if ENT {
                            x.t = fma(pe, u.max(f32::MIN), x.t);
                        }
                    });
                });
                st[mi][h] = x;
            }
        });
    });
    *acc = [[[0.0; 4]; NI]; MI];
}
