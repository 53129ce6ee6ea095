//! The backward d-logits of the kept rows (`FwdOptions::keep_logits`): an elementwise kernel that
//! reads the forward's kept logits (`epilogue::kept`) instead of recomputing them on the tensor
//! cores, and writes the same bf16 d-logits into the staging buffer: the same function
//! (`epilogue::dlogits::dlogits_pair`) of the same f32 raw dot products, with the same per-row
//! coefficients (`one_row_coeffs`).
//!
//! One block per (launch row, [`COLS`] columns of the chunk); each thread forms 8 consecutive
//! columns: two 16-byte streaming loads of kept logits, one 16-byte store of d-logits. Columns
//! past the chunk up to the staging stride are written as zeros, as the recompute writes them.
//! A row whose gradient coefficients are zero (ignored, or zero upstream gradients) gets zero
//! d-logits without reading its logits, which a compacted forward did not write.

use crate::epilogue::dlogits::{dlogits_pair, one_row_coeffs};
use crate::intrinsics;
use lmhead_core::config::fixed::THREADS;
use lmhead_core::params::LogitsParams;

/// Columns of a block: 8 per thread.
pub const COLS: u32 = 8 * THREADS;

/// Backward d-logits of rows `[0, t)` of the launch from the kept logits.
///
/// # Safety
/// Grid `(t, ceil(staging_stride / COLS))`, `THREADS` threads; labels, `lse`, the non-null
/// gradients (and `entropy` when `ENT`) hold `t` elements; `staging` holds
/// `t · staging_stride` bf16 (16-byte aligned, stride a multiple of 8); `kept` holds
/// `kept_rows · kept_stride` f32 (16-byte aligned, stride a multiple of 8 and at least
/// `v_chunk_begin + v_chunk`), and every launch row's caller row (`kept_map`, or the row itself)
/// whose coefficients are not zero is below `kept_rows` (else its d-logits are NaN).
#[inline(always)]
pub unsafe fn dlogits_kept<const ENT: bool>(p: &LogitsParams) {
    let row = intrinsics::block_idx_x();
    let c = (intrinsics::block_idx_y() * THREADS + intrinsics::thread_idx()) * 8;
    if row >= p.t || c as u64 >= p.staging_stride {
        return;
    }
    // SAFETY: row < t (kernel contract).
    let co = unsafe { one_row_coeffs::<ENT>(p, row) };
    let mut raw = [0.0f32; 8];
    if !co.is_zero::<ENT>(0, 0) && c < p.v_chunk {
        // SAFETY: row < t and the map holds t entries.
        let caller = if p.kept_map != 0 { unsafe { *(p.kept_map as *const u32).add(row as usize) } } else { row };
        if caller >= p.kept_rows {
            // The host's promise broken: no plausible number.
            raw = [f32::NAN; 8];
        } else {
            let base = (p.kept as *const f32).wrapping_add(caller as usize * p.kept_stride as usize + p.v_chunk_begin as usize);
            if p.v_chunk_begin % 8 == 0 {
                // SAFETY: c is a multiple of 8 below v_chunk and the chunk begins at a multiple of
                // 8, so begin + c + 8 ≤ begin + round8(v_chunk) ≤ kept_stride (a multiple of 8
                // at least begin + v_chunk): two aligned 16-byte loads inside the caller's row.
                let (a, b) =
                    unsafe { (intrinsics::ld_global_cs_v4(base.add(c as usize)), intrinsics::ld_global_cs_v4(base.add(c as usize + 4))) };
                raw = [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]];
            } else {
                unroll!(8, |e| {
                    if c + (e as u32) < p.v_chunk {
                        // SAFETY: begin + c + e < begin + v_chunk ≤ kept_stride: inside the row.
                        raw[e] = unsafe { *base.add(c as usize + e) };
                    }
                });
            }
        }
    }
    let mut out = [0u32; 4];
    if !co.is_zero::<ENT>(0, 0) {
        unroll!(4, |j| {
            out[j] = dlogits_pair::<1, ENT>(p, &co, 0, 0, c + 2 * j as u32, [raw[2 * j], raw[2 * j + 1]]);
        });
    }
    let idx = row as u64 * p.staging_stride + c as u64;
    // SAFETY: row < t and c + 8 ≤ staging_stride (c and the stride multiples of 8): inside the
    // staging buffer, 16-byte aligned.
    unsafe { intrinsics::st_global_v4_b32((p.staging as *mut u32).add((idx / 2) as usize), out) };
}
