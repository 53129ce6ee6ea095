//! The d-logits epilogue, shared by both mainloops: per-row coefficients loaded once per block
//! ([`row_coeffs`]), then each finished logits tile turned into bf16 d-logits
//! ([`dlogits_pair`]) and written into the staging buffer ([`store_dlogits`]; the `Sm90`
//! TMA-store path packs the same pairs into its store boxes instead).
//!
//! With raw logits `a = h·wᵀ`, `z = a / T` (temperature), `p = e^{z − lse}`:
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

use super::labels::{load_label, local_column};
use super::{Acc, WarpPos};
use crate::intrinsics::{self, exp2, fma};
use lmhead_core::lse::LOG2_E;
use lmhead_core::params::LogitsParams;

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

/// The coefficients of row `row` as slot `(0, 0)` of a `RowCoeffs<1>` (the kept-logits
/// d-logits, one row per block): [`row_coeffs`] itself, for a warp position whose slot `(0, 0)`
/// is that row (slot `(0, 1)`, eight rows below, is loaded too and not used).
///
/// # Safety
/// `row < p.t`; `p` as for [`row_coeffs`].
#[inline(always)]
pub(crate) unsafe fn one_row_coeffs<const ENT: bool>(p: &LogitsParams, row: u32) -> RowCoeffs<1> {
    let w = WarpPos { tid: 0, lane: 0, wm0: 0, wn0: 0, warp_n: 0 };
    // SAFETY: the caller's contract; rows at or past t are not read.
    unsafe { row_coeffs::<1, ENT>(p, &w, row) }
}

impl<const MI: usize> RowCoeffs<MI> {
    /// `−lse · log2e` of row `(mi, h)`.
    #[inline(always)]
    pub(crate) fn neg_lse2(&self, mi: usize, h: usize) -> f32 {
        -self.lse2[mi][h]
    }

    /// The label's column of row `(mi, h)` relative to the chunk (−1: none in it).
    #[inline(always)]
    pub(crate) fn label(&self, mi: usize, h: usize) -> i32 {
        self.label[mi][h]
    }

    /// The f32 d-logit of column `c` (relative to the chunk) of row `(mi, h)` from its
    /// probability `pr` and its logit `z = a / T` (read only with `ENT`):
    /// `g_ℓ (onehot − p) − g_H p (z − μ)`, the `1/T` in the coefficients.
    #[inline(always)]
    pub(crate) fn dlogit<const ENT: bool>(&self, mi: usize, h: usize, c: u32, pr: f32, z: f32) -> f32 {
        let onehot = if c as i32 == self.label[mi][h] { 1.0 } else { 0.0 };
        let mut x = self.gl[mi][h] * (onehot - pr);
        if ENT {
            x -= self.ge[mi][h] * pr * (z - self.mu[mi][h]);
        }
        x
    }

    /// Whether row `(mi, h)`'s gradient coefficients are both zero (an ignored row, or zero
    /// upstream gradients): its d-logits are zero whatever its logits.
    #[inline(always)]
    pub(crate) fn is_zero<const ENT: bool>(&self, mi: usize, h: usize) -> bool {
        self.gl[mi][h] == 0.0 && (!ENT || self.ge[mi][h] == 0.0)
    }
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
        let x = co.dlogit::<ENT>(mi, h, c + e as u32, pr, raw[e] * p.inv_temp);
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
