//! Level 00 of the kernel ladder: the obviously correct forward. One block per token, each
//! thread walks vocab rows `tid, tid + 256, …`, forms the logit with plain f32 FMAs and folds it
//! into its own `(m, s, t)` state; the block merges the 256 states. No tensor cores, no tiling,
//! no shared operand reuse: it exists as a second GPU reference and as the first rung to compare
//! the fast kernels against.

use crate::epilogue::labels::load_label;
use crate::intrinsics::{self, exp2, log2};
use lmhead_core::config::fixed::THREADS;
use lmhead_core::lse::{Lse2, LN_2, LOG2_E};
use lmhead_core::params::NaiveParams;

#[inline(always)]
fn bf16(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// # Safety
/// Launched with `fixed::THREADS` threads, `t` blocks and `THREADS · 16` bytes of dynamic shared
/// memory; buffers as in [`NaiveParams`].
#[inline(always)]
pub unsafe fn naive_fwd(p: &NaiveParams) {
    let row = intrinsics::block_idx_x();
    if row >= p.t {
        return; // uniform for the whole block
    }
    let tid = intrinsics::thread_idx();
    // SAFETY: row < t.
    let label = unsafe { load_label(p.labels, p.label_kind, row) };
    let h = p.h as *const u16;
    let w = p.w as *const u16;
    let d = p.d as usize;
    let mut x = Lse2::<f32>::EMPTY;
    let mut z_label = 0.0f32;
    let mut v = tid;
    while v < p.v {
        let mut dot = 0.0f32;
        for k in 0..d {
            // SAFETY: row < t, v < v, k < d: inside h [t][d] and W [v][d].
            unsafe { dot += bf16(*h.add(row as usize * d + k)) * bf16(*w.add(v as usize * d + k)) };
        }
        let z = dot * p.inv_temp;
        if v as i64 == label {
            z_label = z;
        }
        x = x.push(z * LOG2_E as f32, exp2);
        v += THREADS;
    }
    let smem = intrinsics::smem_base();
    // SAFETY: tid < THREADS; the block has THREADS · 16 bytes of dynamic shared memory.
    unsafe { intrinsics::st_shared_v4(smem + tid * 16, [x.m, x.s, x.t, z_label]) };
    // SAFETY: every thread of the block reaches this barrier (the early return is uniform).
    unsafe { intrinsics::sync_threads() };
    if tid == 0 {
        let mut y = Lse2::<f32>::EMPTY;
        let mut z = 0.0f32;
        for i in 0..THREADS {
            // SAFETY: written above by thread i.
            let [m, s, t, zl] = unsafe { intrinsics::ld_shared_v4(smem + i * 16) };
            y = y.merge(Lse2 { m, s, t }, exp2);
            z += zl;
        }
        let ln2 = LN_2 as f32;
        let lse = y.lse2(log2) * ln2;
        let ignored = label == p.ignore_index;
        let r = row as usize;
        // SAFETY: row < t; outputs hold t floats (entropy may be null).
        unsafe {
            *(p.lse as *mut f32).add(r) = lse;
            *(p.logprob as *mut f32).add(r) = if ignored { 0.0 } else { z - lse };
            if p.entropy != 0 {
                *(p.entropy as *mut f32).add(r) = if ignored { 0.0 } else { y.entropy2(log2) * ln2 };
            }
        }
    }
}
