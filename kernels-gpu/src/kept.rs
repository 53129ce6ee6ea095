//! The backward d-logits of the kept rows (`FwdOptions::keep_logits`): an elementwise kernel that
//! reads the forward's kept logits (`epilogue::kept`, format `lmhead_core::kept`) instead of
//! recomputing them on the tensor cores, and writes the same bf16 d-logits into the staging
//! buffer: the same function (`RowCoeffs::dlogit`) with the same per-row coefficients
//! (`one_row_coeffs`) as the recompute, of `p_j = q_j · 2^{g − lse·log2e}` and
//! `z_j = (g + log2 q_j) · ln 2`; the label's column from its f32 raw logit exactly as the
//! recompute forms it (`1 − p_y` cancels in a peaked row).
//!
//! One block per (launch row, [`COLS`] columns of the chunk); each thread forms two runs of 8
//! consecutive columns: per run one 16-byte streaming load of `q` and one group maximum (both
//! runs' loads issued before any arithmetic), one 16-byte store of d-logits. Columns past the chunk up to the staging stride are written as zeros, as the
//! recompute writes them. A row whose gradient coefficients are zero (ignored, or zero upstream
//! gradients) gets zero d-logits without reading its logits, which a compacted forward did not
//! write.

use crate::epilogue::dlogits::{one_row_coeffs, RowCoeffs};
use crate::intrinsics::{self, exp2, fma};
use core::f32::consts::LN_2;
use lmhead_core::config::fixed::THREADS;
use lmhead_core::kept::{label_plane, max_plane, GROUP, READ_COLS};
use lmhead_core::params::LogitsParams;

/// Columns of a block: two runs of 8 per thread ([`READ_COLS`]), the second run of the block's
/// threads `8 · THREADS` columns after the first.
pub const COLS: u32 = READ_COLS as u32 * THREADS;

/// The f32 d-logit of chunk column `c` from its kept `q`, its group's maximum `g2` and
/// `es = 2^{g2 − lse·log2e}`; the label's column from the label's raw logit `label_raw`.
#[inline(always)]
fn from_kept<const ENT: bool>(p: &LogitsParams, co: &RowCoeffs<1>, c: u32, q: f32, g2: f32, es: f32, label_raw: f32) -> f32 {
    if c as i32 == co.label(0, 0) {
        let pr = exp2(fma(label_raw, p.scale2, co.neg_lse2(0, 0)));
        co.dlogit::<ENT>(0, 0, c, pr, label_raw * p.inv_temp)
    } else {
        // q = 0 (below fp16's range, or padding): p = 0, and log2 q = −∞ must not meet it.
        let z = if ENT && q > 0.0 { (g2 + intrinsics::log2(q)) * LN_2 } else { 0.0 };
        co.dlogit::<ENT>(0, 0, c, q * es, z)
    }
}

/// Backward d-logits of rows `[0, t)` of the launch from the kept logits.
///
/// # Safety
/// Grid `(t, ceil(staging_stride / COLS))`, `THREADS` threads; labels, `lse`, the non-null
/// gradients (and `entropy` when `ENT`) hold `t` elements; `staging` holds
/// `t · staging_stride` bf16 (16-byte aligned, stride a multiple of 8); `kept` holds the planes
/// of `kept_rows` rows of stride `kept_stride` (`lmhead_core::kept`; 16-byte aligned, the stride
/// a multiple of `GROUP` and at least `v_chunk_begin + v_chunk`), and every launch row's caller
/// row (`kept_map`, or the row itself) whose coefficients are not zero is below `kept_rows` (else
/// its d-logits are NaN).
#[inline(always)]
pub unsafe fn dlogits_kept<const ENT: bool>(p: &LogitsParams) {
    let row = intrinsics::block_idx_x();
    let c0 = intrinsics::block_idx_y() * COLS + intrinsics::thread_idx() * 8;
    let cs = [c0, c0 + 8 * THREADS];
    if row >= p.t || c0 as u64 >= p.staging_stride {
        return;
    }
    // SAFETY: row < t (kernel contract).
    let co = unsafe { one_row_coeffs::<ENT>(p, row) };
    let mut g = [[0.0f32; 8]; 2];
    if !co.is_zero::<ENT>(0, 0) && c0 < p.v_chunk {
        // SAFETY: row < t and the map holds t entries.
        let caller = if p.kept_map != 0 { unsafe { *(p.kept_map as *const u32).add(row as usize) } } else { row };
        if caller >= p.kept_rows {
            // The host's promise broken: no plausible number.
            g = [[f32::NAN; 8]; 2];
        } else {
            let (s, rows, begin) = (p.kept_stride, p.kept_rows as u64, p.v_chunk_begin as u64);
            let q_row = (p.kept as *const u16).wrapping_add((caller as u64 * s + begin) as usize);
            let max_row = (p.kept as *const f32).wrapping_add((max_plane(rows, s) / 4 + caller as u64 * (s / GROUP as u64)) as usize);
            let lc = co.label(0, 0);
            let label_raw = if lc >= 0 && cs.iter().any(|&c| lc >= c as i32 && lc < c as i32 + 8) {
                // SAFETY: caller < kept_rows: inside the label plane, which the forward wrote for
                // a row whose label is one of its columns (this one).
                unsafe { *(p.kept as *const f32).add((label_plane(rows, s) / 4 + caller as u64) as usize) }
            } else {
                0.0
            };
            let neg_lse2 = co.neg_lse2(0, 0);
            if begin % 8 == 0 {
                // Both runs' loads first, then both runs' arithmetic.
                let mut qv = [[0u32; 4]; 2];
                let mut g2 = [0.0f32; 2];
                unroll!(2, |u| {
                    if cs[u] < p.v_chunk {
                        // SAFETY: begin + c is a multiple of 8 below begin + v_chunk ≤ kept_stride
                        // (a multiple of GROUP, so of 8): one aligned 16-byte load inside the
                        // caller's q row, whose 8 columns share one group (GROUP a multiple of 8),
                        // whose maximum is inside the caller's row of maxima.
                        unsafe {
                            qv[u] = intrinsics::ld_global_cs_v4_b32(q_row.add(cs[u] as usize) as *const u32);
                            g2[u] = *max_row.add(((begin + cs[u] as u64) / GROUP as u64) as usize);
                        }
                    }
                });
                unroll!(2, |u| {
                    let es = exp2(g2[u] + neg_lse2);
                    unroll!(4, |j| {
                        let (q0, q1) = intrinsics::unpack_f16x2(qv[u][j]);
                        let cc = cs[u] + 2 * j as u32;
                        g[u][2 * j] = from_kept::<ENT>(p, &co, cc, q0, g2[u], es, label_raw);
                        g[u][2 * j + 1] = from_kept::<ENT>(p, &co, cc + 1, q1, g2[u], es, label_raw);
                    });
                });
            } else {
                unroll!(2, |u| {
                    unroll!(8, |e| {
                        let cc = cs[u] + e as u32;
                        if cc < p.v_chunk {
                            // SAFETY: begin + cc < begin + v_chunk ≤ kept_stride: inside the row
                            // of q and, divided by GROUP, inside its row of maxima.
                            let (q, g2) = unsafe { (*q_row.add(cc as usize), *max_row.add(((begin + cc as u64) / GROUP as u64) as usize)) };
                            let q = intrinsics::unpack_f16x2(q as u32).0;
                            g[u][e] = from_kept::<ENT>(p, &co, cc, q, g2, exp2(g2 + neg_lse2), label_raw);
                        }
                    });
                });
            }
        }
    }
    unroll!(2, |u| {
        let c = cs[u];
        if (c as u64) < p.staging_stride {
            let mut out = [0u32; 4];
            unroll!(4, |j| {
                let cc = c + 2 * j as u32;
                let lo = if cc < p.v_chunk { g[u][2 * j] } else { 0.0 };
                let hi = if cc + 1 < p.v_chunk { g[u][2 * j + 1] } else { 0.0 };
                out[j] = intrinsics::pack_bf16x2(lo, hi);
            });
            let idx = row as u64 * p.staging_stride + c as u64;
            // SAFETY: row < t and c + 8 ≤ staging_stride (c and the stride multiples of 8):
            // inside the staging buffer, 16-byte aligned.
            unsafe { intrinsics::st_global_v4_b32((p.staging as *mut u32).add((idx / 2) as usize), out) };
        }
    });
}
