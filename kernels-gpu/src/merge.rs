//! Small per-row kernels after the forward mainloop: merging the vocab splits into lse, log-prob
//! and entropy, the tensor-parallel steps (row state, rescale to the global maximum, finish), and
//! an f32 → bf16 cast. One thread per row; the reads of one split are coalesced across threads.
//!
//! Row states for tensor parallelism are SoA `[5][t]` f32: `m_local, m_global, s, z_label, t`.
//! `m_global` starts as a copy of `m_local` and is all-reduced with MAX; after `rescale`, the
//! contiguous slots `s, z_label` (and `t` when entropy is wanted) are all-reduced with SUM.
//! Also the label check that runs before a forward.

use crate::epilogue::labels::load_label;
use crate::intrinsics::{self, exp2, log2};
use lmhead_core::lse::{Lse2, LN_2};
use lmhead_core::params::{CastParams, MergeParams, Partial, STATUS_BAD_LABEL};

#[inline(always)]
fn row_index() -> u32 {
    intrinsics::block_idx_x() * lmhead_core::config::fixed::THREADS + intrinsics::thread_idx()
}

/// The merged `(m, s, t)` state and label logit of `row` over all splits.
///
/// # Safety
/// `row < p.t`; `p.partials` holds `n_splits · t` partials.
#[inline(always)]
unsafe fn merge_splits(p: &MergeParams, row: u32) -> (Lse2<f32>, f32) {
    let mut x = Lse2::<f32>::EMPTY;
    let mut z = 0.0f32;
    for s in 0..p.n_splits {
        let idx = s as u64 * p.t as u64 + row as u64;
        // SAFETY: s < n_splits, row < t (caller); Partial is 16-byte aligned.
        let [m, ss, t, zl] = unsafe { intrinsics::ld_global_v4((p.partials as *const Partial).add(idx as usize) as *const f32) };
        x = x.merge(Lse2 { m, s: ss, t }, exp2);
        z += zl;
    }
    (x, z)
}

/// Write lse, log-prob and (if requested) entropy of `row` from its global state.
///
/// # Safety
/// `row < p.t`; the output pointers hold `t` elements (entropy may be 0); `status` is a valid
/// `u32`.
#[inline(always)]
unsafe fn finish_row(p: &MergeParams, row: u32, x: Lse2<f32>, z_label: f32) {
    let r = row as usize;
    // SAFETY: row < t, labels holds t labels.
    let label = unsafe { load_label(p.labels, p.label_kind, row) };
    let ln2 = LN_2 as f32;
    let lse = x.lse2(log2) * ln2;
    let (mut logprob, mut entropy) = (z_label - lse, x.entropy2(log2) * ln2);
    if label == p.ignore_index {
        logprob = 0.0;
        entropy = 0.0;
    } else if label < 0 || label >= p.v_total {
        // A bad label must not produce a plausible number: NaN, and the status bit for the host.
        logprob = f32::NAN;
        entropy = f32::NAN;
        // SAFETY: status points to one u32 (contract).
        unsafe { intrinsics::atomic_or(p.status as *mut u32, STATUS_BAD_LABEL) };
    }
    // SAFETY: row < t and every output holds t floats.
    unsafe {
        *(p.lse as *mut f32).add(r) = lse;
        *(p.logprob as *mut f32).add(r) = logprob;
        if p.entropy != 0 {
            *(p.entropy as *mut f32).add(r) = entropy;
        }
    }
}

/// The label check that runs before anything else of a forward: for each row whose label is
/// neither `ignore_index` nor in `[0, v_total)`, set [`STATUS_BAD_LABEL`] in `status[0]` and
/// lower `status[1]` (the host sets it to `u32::MAX`) to the row. Reads only the labels.
///
/// # Safety
/// Grid covers `t` rows with `fixed::THREADS` threads per block; `labels` holds `t` labels of
/// `label_kind`; `status` points to two `u32`.
#[inline(always)]
pub unsafe fn check_labels(p: &MergeParams) {
    let row = row_index();
    if row < p.t {
        // SAFETY: row < t, labels holds t labels (contract).
        let label = unsafe { load_label(p.labels, p.label_kind, row) };
        if label != p.ignore_index && (label < 0 || label >= p.v_total) {
            // SAFETY: status points to two u32 (contract).
            unsafe {
                intrinsics::atomic_or(p.status as *mut u32, STATUS_BAD_LABEL);
                intrinsics::atomic_min((p.status as *mut u32).add(1), row);
            }
        }
    }
}

/// Single-device merge: partials → lse, log-prob, entropy.
///
/// # Safety
/// Grid covers `t` rows with `fixed::THREADS` threads per block; buffers as in [`MergeParams`].
#[inline(always)]
pub unsafe fn fwd_merge(p: &MergeParams) {
    let row = row_index();
    if row < p.t {
        // SAFETY: row < t; buffers per contract.
        unsafe {
            let (x, z) = merge_splits(p, row);
            finish_row(p, row, x, z);
        }
    }
}

/// Tensor-parallel step 1: partials → the local row state `[5][t]`.
///
/// # Safety
/// As [`fwd_merge`]; `row_state` holds `5·t` floats.
#[inline(always)]
pub unsafe fn fwd_row_state(p: &MergeParams) {
    let row = row_index();
    if row < p.t {
        let t = p.t as usize;
        let r = row as usize;
        // SAFETY: row < t; row_state holds 5·t floats.
        unsafe {
            let (x, z) = merge_splits(p, row);
            let rs = p.row_state as *mut f32;
            *rs.add(r) = x.m;
            *rs.add(t + r) = x.m;
            *rs.add(2 * t + r) = x.s;
            *rs.add(3 * t + r) = z;
            *rs.add(4 * t + r) = x.t;
        }
    }
}

/// Tensor-parallel step 2 (after the MAX all-reduce of `m_global`): move `s, t` to the global
/// maximum, so that the SUM all-reduce adds states with the same reference.
///
/// # Safety
/// As [`fwd_row_state`].
#[inline(always)]
pub unsafe fn fwd_rescale(p: &MergeParams) {
    let row = row_index();
    if row < p.t {
        let t = p.t as usize;
        let r = row as usize;
        // SAFETY: row < t; row_state holds 5·t floats.
        unsafe {
            let rs = p.row_state as *mut f32;
            let x = Lse2 { m: *rs.add(r), s: *rs.add(2 * t + r), t: *rs.add(4 * t + r) };
            let m_global = *rs.add(t + r);
            if m_global != f32::NEG_INFINITY {
                let y = x.rescale(m_global, exp2);
                *rs.add(2 * t + r) = y.s;
                *rs.add(4 * t + r) = y.t;
            }
        }
    }
}

/// Tensor-parallel step 3 (after the SUM all-reduce): row states → outputs.
///
/// # Safety
/// As [`fwd_row_state`].
#[inline(always)]
pub unsafe fn fwd_finish(p: &MergeParams) {
    let row = row_index();
    if row < p.t {
        let t = p.t as usize;
        let r = row as usize;
        // SAFETY: row < t; row_state holds 5·t floats; outputs per contract.
        unsafe {
            let rs = p.row_state as *const f32;
            let x = Lse2 { m: *rs.add(t + r), s: *rs.add(2 * t + r), t: *rs.add(4 * t + r) };
            finish_row(p, row, x, *rs.add(3 * t + r));
        }
    }
}

/// `dst[i] = bf16(src[i])` for `i < n` (grid-stride).
///
/// # Safety
/// `src` holds `n` f32, `dst` `n` bf16.
#[inline(always)]
pub unsafe fn cast_f32_bf16(p: &CastParams) {
    let stride = intrinsics::grid_dim_x() as u64 * lmhead_core::config::fixed::THREADS as u64;
    let mut i = row_index() as u64;
    while i < p.n {
        // SAFETY: i < n.
        unsafe {
            let x = *(p.src as *const f32).add(i as usize);
            *(p.dst as *mut u16).add(i as usize) = intrinsics::pack_bf16x2(x, 0.0) as u16;
        }
        i += stride;
    }
}
