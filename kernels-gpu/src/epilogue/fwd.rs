//! The forward's epilogue, shared by both mainloops: each finished logits tile folded into
//! per-row online `(m, s, t)` states and the label's logit ([`fold_tile`]), then the block's
//! reduction of those states into one [`Partial`] per (split, row) ([`store_partials`]).
//!
//! With `ENT = false` the `t` sums are never stored, so their arithmetic is dead code and is
//! removed: the log-prob-only instance does no entropy work.

use crate::epilogue::kept::{self, KeptRows};
use crate::epilogue::{Acc, WarpPos};
use crate::intrinsics::{self, exp2, fma, max_nan};
use lmhead_core::lse::Lse2;
use lmhead_core::params::{LogitsParams, Partial};

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
///
/// With `KEEP`, also the kept logits of this thread's kept rows (`crate::epilogue::kept`): `q` of
/// each column from the fold's `2^{y − m}` as packed fp16 pairs into `qv` (`qv[mi][ni][h]`,
/// columns `w.col(ni, 0)` and `+1` of row `w.row(mi, h)`; zero where a row has only padding),
/// also stored here when `kept.direct`; the group maxima and the label's raw logit are stored
/// here. The fold itself is the same arithmetic either way. `DEFER` (the Hopper forward's twin)
/// issues those stores after each row's arithmetic instead of among it (measured a little
/// faster there; the `mma.sync` twin keeps them among it, where deferring spilled).
///
/// # Safety
/// The whole warp calls this converged; with `KEEP`, `p.kept` as `epilogue::kept::store_q`
/// needs it.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn fold_tile<const BN: usize, const MI: usize, const NI: usize, const ENT: bool, const KEEP: bool, const DEFER: bool>(
    p: &LogitsParams,
    w: &WarpPos,
    n0: u32,
    acc: &mut Acc<MI, NI>,
    st: &mut [[Lse2<f32>; 2]; MI],
    z_label: &mut [[f32; 2]; MI],
    label: &[[i32; 2]; MI],
    kept: &KeptRows<MI>,
    qv: &mut [[[u32; 2]; NI]; MI],
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
                            if KEEP {
                                // SAFETY: the kept buffer per the caller's contract.
                                unsafe { kept::store_label(p, kept, mi, h, acc[mi][ni][2 * h + e]) };
                            }
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
            // With KEEP, the same maximum from this thread's maxima of each group (the same
            // value: a maximum is exact), and the kept format's group maxima from them (every
            // lane: shuffles; the whole warp is converged here, per the caller).
            let mut gm = [f32::NEG_INFINITY; 8];
            if KEEP {
                // SAFETY: converged (caller).
                gm = unsafe { kept::group_max::<MI, NI>(acc, mi, h, &mut tmax) };
            } else {
                unroll!(NI, |ni| {
                    tmax = max_nan(max_nan(tmax, acc[mi][ni][2 * h]), acc[mi][ni][2 * h + 1]);
                });
            }
            let first_lane = w.lane & 3 == 0;
            if tmax != f32::NEG_INFINITY {
                let mut x = st[mi][h].absorb_max(tmax * scale2, exp2);
                let neg_m = -x.m;
                // `q = 2^{y − m} · 2^{m − g}` per group (an all-padding group: 0). The exponent
                // is capped where `2^{y − m}` has flushed to 0 anyway (`y − g` below −126 + …).
                let mut qs = [[0.0f32; 2]; 8];
                if KEEP {
                    unroll!(NI / 4, |g| {
                        let g2 = gm[g] * scale2;
                        qs[g] = [g2, if g2 == f32::NEG_INFINITY { 0.0 } else { exp2((x.m - g2).min(126.0)) }];
                    });
                }
                unroll!(NI, |ni| {
                    let mut q = [0.0f32; 2];
                    unroll!(2, |e| {
                        let u = fma(acc[mi][ni][2 * h + e], scale2, neg_m);
                        let pe = exp2(u);
                        x.s += pe;
                        if ENT {
                            x.t = fma(pe, u.max(f32::MIN), x.t);
                        }
                        if KEEP {
                            q[e] = pe * qs[ni / 4][1];
                        }
                    });
                    if KEEP {
                        let pair = intrinsics::pack_f16x2(q[0], q[1]);
                        qv[mi][ni][h] = pair;
                        let c = n0 + w.col(ni, 0);
                        // SAFETY: the kept buffer per the caller's contract; columns are even, and
                        // `c` begins a group at `ni % 4 == 0` on the quad's first lane.
                        unsafe {
                            if !DEFER && kept.direct {
                                kept::store_q(p, kept, mi, h, c, pair);
                            }
                            if !DEFER && ni % 4 == 0 && first_lane {
                                kept::store_group_max(p, kept, mi, h, c, qs[ni / 4][0]);
                            }
                        }
                    }
                });
                st[mi][h] = x;
                if KEEP && DEFER {
                    // The same stores after the row's arithmetic, each kind behind one branch.
                    // SAFETY: as above.
                    unsafe {
                        if kept.direct {
                            unroll!(NI, |ni| { kept::store_q(p, kept, mi, h, n0 + w.col(ni, 0), qv[mi][ni][h]) });
                        }
                        if first_lane {
                            unroll!(NI / 4, |g| { kept::store_group_max(p, kept, mi, h, n0 + w.col(4 * g, 0), qs[g][0]) });
                        }
                    }
                }
            } else if KEEP {
                // All of this thread's columns are padding: q = 0, group maxima −∞ (never read).
                unroll!(NI, |ni| {
                    qv[mi][ni][h] = 0;
                    let c = n0 + w.col(ni, 0);
                    // SAFETY: as above.
                    unsafe {
                        if kept.direct {
                            kept::store_q(p, kept, mi, h, c, 0);
                        }
                        if ni % 4 == 0 && first_lane {
                            kept::store_group_max(p, kept, mi, h, c, gm[ni / 4] * scale2);
                        }
                    }
                });
            }
        });
    });
    *acc = [[[0.0; 4]; NI]; MI];
}
