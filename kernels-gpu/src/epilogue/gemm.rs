//! The backward GEMMs' epilogue, shared by both mainloops: `dh[t, d] (+)= Σ_v dl[t, v] · W[v, d]`
//! and `dW[v, d] = Σ_t dl[t, v] · h[t, d]` end here, each finished `C` tile added to the f32
//! accumulator and/or written to the output (bf16 or f32).

use super::{Acc, WarpPos};
use crate::intrinsics;
use lmhead_core::params::GemmParams;

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
