//! Backward kernels: d-logits of one vocab chunk (recomputed logits tile, bf16 into a staging
//! buffer) and the two GEMMs that turn the staging buffer into `dh` and `dW`.
//!
//! **d-logits.** With raw logits `a = h·wᵀ`, `z = a / T` (temperature), `p = e^{z − lse}`:
//!
//! ```text
//! log-prob  ℓ = z_y − lse            ∂ℓ/∂z_j = onehot_j − p_j
//! entropy   H = lse − Σ_i p_i z_i     ∂H/∂z_j = p_j − (p_j + p_j z_j − p_j Σ_i p_i z_i)
//!                                            = −p_j (z_j − μ),  μ = Σ_i p_i z_i = lse − H
//! ```
//!
//! so with upstream gradients `g_ℓ`, `g_H` and `∂z/∂a = 1/T`:
//! `∂L/∂a_j = (1/T) · [g_ℓ (onehot_j − p_j) − g_H p_j (z_j − μ)]`. Rows whose label is
//! `ignore_index` have zero gradient. `μ` comes from the forward (`lse − entropy`), so no second
//! pass over the vocab is needed. `p_j = 2^{a_j · log2e/T − lse · log2e}` is one FFMA and one
//! `ex2`. Warning: `z_j − μ` cancels when `z_j ≈ μ`; in f32 with |z| ≲ 1e4 that leaves ~1e-3
//! absolute error in a term multiplied by `p_j`, below the bf16 rounding of the result.
//!
//! Columns past the chunk (padding up to the staging stride) are written as zeros, so the GEMMs
//! can read whole 16-byte chunks there.
//!
//! **GEMMs.** `dh[t, d] (+)= Σ_v dl[t, v] · W[v, d]` (A = staging, K-major; B = `W` chunk, N-major)
//! and `dW[v, d] = Σ_t dl[t, v] · h[t, d]` (A = stagingᵀ, M-major; B = `h`, N-major).

use crate::fwd::{load_label, local_column};
use crate::intrinsics::{self, exp2, fma};
use crate::mainloop::{self, Acc, Operand, WarpPos};
use lmhead_core::lse::LOG2_E;
use lmhead_core::params::{GemmParams, LogitsParams};

/// Backward d-logits of one vocab chunk.
///
/// # Safety
/// Launched with `WM·WN·32` threads, grid `(ceil(t/BM), ceil(v_chunk/BN))`, ring bytes of
/// dynamic shared memory; `p` describes valid buffers: `h`, `W`, labels, `lse`, the gradients
/// that are non-null (and `entropy` when `ENT`), and `staging [t][staging_stride]` with
/// `staging_stride ≥ v_chunk` rounded up to 8.
#[inline(always)]
pub unsafe fn dlogits<
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
    }
    let w = WarpPos::new::<BM, BN, WM, WN>();
    let m0 = intrinsics::block_idx_x() * BM as u32;
    let n0 = intrinsics::block_idx_y() * BN as u32;
    let chunk_end = p.v_chunk_begin + p.v_chunk;

    // ---- Prologue: per-row coefficients ------------------------------------------------------
    // SAFETY: buffers per the kernel contract.
    let coeffs = unsafe { row_coeffs::<MI, ENT>(p, &w, m0) };

    let a = Operand { ptr: p.h as *const u16, stride: p.h_row_stride, mn_bound: p.t, k_bound: p.d };
    let b = Operand { ptr: p.w as *const u16, stride: p.w_row_stride, mn_bound: chunk_end, k_bound: p.d };
    let ring = intrinsics::smem_base();
    let threads = WM * WN * 32;
    let a_bytes = (BM * BK * 2) as u32;
    let stage_bytes = ((BM + BN) * BK * 2) as u32;
    let kt = p.d.div_ceil(BK as u32);
    let mut acc: Acc<MI, NI> = [[[0.0; 4]; NI]; MI];

    let load = #[inline(always)]
    |s: u32, _: u32, k: u32| {
        let k0 = k * BK as u32;
        // SAFETY: stage `s` holds both tiles; chunks are bounds-checked; every thread of the
        // block runs this with its own tid.
        unsafe {
            mainloop::load_tile::<BM, BK, true>(s, a, m0, k0, w.tid, threads);
            mainloop::load_tile::<BN, BK, true>(s + a_bytes, b, p.v_chunk_begin + n0, k0, w.tid, threads);
        }
    };
    let compute = #[inline(always)]
    |s: u32, acc: &mut Acc<MI, NI>| {
        // SAFETY: the warp is converged; `s` holds a landed stage.
        unsafe { mainloop::mma_stage::<BM, BN, BK, MI, NI, true, true>(s, s + a_bytes, acc, w.wm0, w.wn0, w.lane) };
    };
    let finish = #[inline(always)]
    |_: u32, acc: &mut Acc<MI, NI>| {
        // ---- Epilogue: d-logits, bf16, into the staging buffer -----------------------
        // SAFETY: staging per the kernel contract.
        unsafe { store_dlogits::<MI, NI, ENT>(p, &w, m0, n0, acc, &coeffs) };
    };
    // SAFETY: all threads call with the same trip counts; the ring is the dynamic shared memory.
    unsafe { mainloop::pipeline::<ST, Acc<MI, NI>>(ring, stage_bytes, 1, kt, &mut acc, load, compute, finish) };
}

/// Backward GEMM `C[m, n] (+)= Σ_k A[m, k] · B[k, n]` with N-major B; `A_KMAJ` selects a
/// K-major (`dh`) or M-major (`dW`) A.
///
/// # Safety
/// Launched with `WM·WN·32` threads, grid `(ceil(m/BM), ceil(n/BN))`, ring bytes of dynamic
/// shared memory; `p` describes valid buffers (A readable over whole 16-byte chunks up to its
/// column bound rounded up to 8, `n % 8 == 0`, 8-byte aligned accumulator and output rows).
#[inline(always)]
pub unsafe fn gemm<
    const BM: usize,
    const BN: usize,
    const BK: usize,
    const ST: usize,
    const WM: usize,
    const WN: usize,
    const MI: usize,
    const NI: usize,
    const A_KMAJ: bool,
>(
    p: &GemmParams,
) {
    const {
        assert!(MI * 16 * WM == BM && NI * 8 * WN == BN && NI % 2 == 0);
    }
    let w = WarpPos::new::<BM, BN, WM, WN>();
    let m0 = intrinsics::block_idx_x() * BM as u32;
    let n0 = intrinsics::block_idx_y() * BN as u32;
    let a = Operand { ptr: p.a as *const u16, stride: p.a_stride, mn_bound: p.m, k_bound: p.k };
    let b = Operand { ptr: p.b as *const u16, stride: p.b_stride, mn_bound: p.n, k_bound: p.k };
    let ring = intrinsics::smem_base();
    let threads = WM * WN * 32;
    let a_bytes = (BM * BK * 2) as u32;
    let stage_bytes = ((BM + BN) * BK * 2) as u32;
    let kt = p.k.div_ceil(BK as u32);
    let mut acc: Acc<MI, NI> = [[[0.0; 4]; NI]; MI];

    let load = #[inline(always)]
    |s: u32, _: u32, k: u32| {
        let k0 = k * BK as u32;
        // SAFETY: stage `s` holds both tiles; chunks are bounds-checked; every thread of the
        // block runs this with its own tid.
        unsafe {
            mainloop::load_tile::<BM, BK, A_KMAJ>(s, a, m0, k0, w.tid, threads);
            mainloop::load_tile::<BN, BK, false>(s + a_bytes, b, n0, k0, w.tid, threads);
        }
    };
    let compute = #[inline(always)]
    |s: u32, acc: &mut Acc<MI, NI>| {
        // SAFETY: the warp is converged; `s` holds a landed stage.
        unsafe { mainloop::mma_stage::<BM, BN, BK, MI, NI, A_KMAJ, false>(s, s + a_bytes, acc, w.wm0, w.wn0, w.lane) };
    };
    let finish = #[inline(always)]
    |_: u32, acc: &mut Acc<MI, NI>| {
        // ---- Epilogue ----------------------------------------------------------------
        // SAFETY: C buffers per the kernel contract.
        unsafe { store_gemm::<MI, NI>(p, &w, m0, n0, acc) };
    };
    // SAFETY: all threads call with the same trip counts; the ring is the dynamic shared memory.
    unsafe { mainloop::pipeline::<ST, Acc<MI, NI>>(ring, stage_bytes, 1, kt, &mut acc, load, compute, finish) };
}

/// Per-row coefficients of the d-logits: `lse·log2e`, `g_ℓ/T`, `g_H/T`, `μ = lse − H` and the
/// label's column relative to the chunk (−1: none). Ignored rows keep zero gradients.
pub(crate) struct RowCoeffs<const MI: usize> {
    lse2: [[f32; 2]; MI],
    gl: [[f32; 2]; MI],
    ge: [[f32; 2]; MI],
    mu: [[f32; 2]; MI],
    label: [[i32; 2]; MI],
}

/// Load the coefficients of this thread's rows (`w.row(mi, h)` of the tile at `m0`).
///
/// # Safety
/// `p` describes `t` labels, `lse` and the non-null gradients (and `entropy` when `ENT`).
#[inline(always)]
pub(crate) unsafe fn row_coeffs<const MI: usize, const ENT: bool>(p: &LogitsParams, w: &WarpPos, m0: u32) -> RowCoeffs<MI> {
    let lse2_scale = LOG2_E as f32;
    let mut c = RowCoeffs { lse2: [[0.0; 2]; MI], gl: [[0.0; 2]; MI], ge: [[0.0; 2]; MI], mu: [[0.0; 2]; MI], label: [[-1; 2]; MI] };
    unroll!(MI, |mi| {
        unroll!(2, |h| {
            let row = m0 + w.row(mi, h);
            if row < p.t {
                let r = row as usize;
                // SAFETY: row < t; every per-row buffer holds t elements (caller).
                unsafe {
                    let lse = *(p.lse as *const f32).add(r);
                    c.lse2[mi][h] = lse * lse2_scale;
                    let raw = load_label(p.labels, p.label_kind, row);
                    let l = local_column(p, raw);
                    c.label[mi][h] = if l >= 0 { l - p.v_chunk_begin as i32 } else { -1 };
                    if raw != p.ignore_index {
                        if p.grad_logprob != 0 {
                            c.gl[mi][h] = *(p.grad_logprob as *const f32).add(r) * p.inv_temp;
                        }
                        if ENT {
                            c.ge[mi][h] = *(p.grad_entropy as *const f32).add(r) * p.inv_temp;
                            c.mu[mi][h] = lse - *(p.entropy as *const f32).add(r);
                        }
                    }
                }
            }
        });
    });
    c
}

/// The bf16 d-logits of columns `c` and `c + 1` (relative to the chunk; zeros past it) of row
/// `(mi, h)` of `co`, from their raw dot products, packed as [`intrinsics::pack_bf16x2`] does.
#[inline(always)]
pub(crate) fn dlogits_pair<const MI: usize, const ENT: bool>(
    p: &LogitsParams,
    co: &RowCoeffs<MI>,
    mi: usize,
    h: usize,
    c: u32,
    raw: [f32; 2],
) -> u32 {
    let neg_lse2 = -co.lse2[mi][h];
    let mut g = [0.0f32; 2];
    unroll!(2, |e| {
        let pr = exp2(fma(raw[e], p.scale2, neg_lse2));
        let onehot = if (c + e as u32) as i32 == co.label[mi][h] { 1.0 } else { 0.0 };
        let mut x = co.gl[mi][h] * (onehot - pr);
        if ENT {
            let z = raw[e] * p.inv_temp;
            x -= co.ge[mi][h] * pr * (z - co.mu[mi][h]);
        }
        g[e] = if c + (e as u32) < p.v_chunk { x } else { 0.0 };
    });
    intrinsics::pack_bf16x2(g[0], g[1])
}

/// Write the bf16 d-logits of one finished logits tile (raw dot products in `acc`, columns
/// `n0 + w.col(..)` relative to the chunk) into the staging buffer; padding columns get 0.
///
/// # Safety
/// `p.staging` holds `t · staging_stride` bf16 (`staging_stride` a multiple of 8).
#[inline(always)]
pub(crate) unsafe fn store_dlogits<const MI: usize, const NI: usize, const ENT: bool>(
    p: &LogitsParams,
    w: &WarpPos,
    m0: u32,
    n0: u32,
    acc: &Acc<MI, NI>,
    co: &RowCoeffs<MI>,
) {
    unroll!(MI, |mi| {
        unroll!(2, |h| {
            let row = m0 + w.row(mi, h);
            if row < p.t {
                unroll!(NI, |ni| {
                    let c = n0 + w.col(ni, 0);
                    let v = dlogits_pair::<MI, ENT>(p, co, mi, h, c, [acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]]);
                    if (c as u64) < p.staging_stride {
                        let idx = row as u64 * p.staging_stride + c as u64;
                        // SAFETY: row < t and c < stride (c even, stride a multiple of 8, so
                        // c + 1 < stride too): inside the staging buffer; 4-byte aligned because
                        // c and the stride are even.
                        unsafe { *(p.staging as *mut u32).add((idx / 2) as usize) = v };
                    }
                });
            }
        });
    });
}

/// The backward GEMMs' epilogue: `C = acc (+ C_acc)`, written to the f32 accumulator and/or the
/// output (bf16 or f32) as `p` asks.
///
/// # Safety
/// `p`'s C buffers hold `m · c_stride` elements, rows 8-byte aligned, `n` and `c_stride` even.
#[inline(always)]
pub(crate) unsafe fn store_gemm<const MI: usize, const NI: usize>(p: &GemmParams, w: &WarpPos, m0: u32, n0: u32, acc: &Acc<MI, NI>) {
    unroll!(MI, |mi| {
        unroll!(2, |h| {
            let row = m0 + w.row(mi, h);
            if row < p.m {
                unroll!(NI, |ni| {
                    let col = n0 + w.col(ni, 0);
                    if col < p.n {
                        let idx = (row as u64 * p.c_stride + col as u64) as usize;
                        let mut x0 = acc[mi][ni][2 * h];
                        let mut x1 = acc[mi][ni][2 * h + 1];
                        // SAFETY: row < m, col + 1 < n (n and col even): inside C, 8-byte
                        // aligned (col and c_stride even, base aligned).
                        unsafe {
                            if p.accumulate != 0 {
                                let (y0, y1) = intrinsics::ld_global_v2((p.c_acc as *const f32).add(idx));
                                x0 += y0;
                                x1 += y1;
                            }
                            if p.write_acc != 0 {
                                intrinsics::st_global_v2((p.c_acc as *mut f32).add(idx), x0, x1);
                            }
                            if p.c_out != 0 {
                                if p.out_f32 != 0 {
                                    intrinsics::st_global_v2((p.c_out as *mut f32).add(idx), x0, x1);
                                } else {
                                    *(p.c_out as *mut u32).add(idx / 2) = intrinsics::pack_bf16x2(x0, x1);
                                }
                            }
                        }
                    }
                });
            }
        });
    });
}
