//! Kept logits: a forward that keeps the logits it computes, so that the backward forms the
//! d-logits from them instead of recomputing them (three GEMMs' worth of work per training step
//! instead of four), within a byte budget the caller sets ([`crate::FwdOptions::keep_logits`]).
//!
//! **What is kept.** The raw f32 dot products `a = h·wᵀ` of the kept rows, exactly the
//! accumulator values the forward folds into its log-sum-exp, `[rows][stride]` with
//! `stride = v` rounded up to 8 (padding columns are never read). The backward's d-logits of a
//! kept row are then the same function (`kernels-gpu/src/epilogue/dlogits.rs`) of the same kind
//! of f32 logit as the recompute's: the d-logits, `dh` and `dW` have today's accuracy by
//! construction. (A 16-bit format shifted by the row maximum would halve the memory, but an
//! fp16 `z − m` carries ~2⁻¹¹ relative error, about 0.01 absolute where `p` still matters
//! (`z − m ≳ −20`), i.e. ~1% relative error in `p`: several times the bf16 rounding of the
//! d-logits themselves; bf16 logits would be worse still. The probabilities cannot be kept:
//! the forward knows the log-sum-exp only after its merge.)
//!
//! **Which rows.** With `stride` as above and a budget of `B` bytes, the call keeps
//! `rows = t` when `4·t·stride ≤ B`, else the largest multiple of [`ROW_ALIGN`] rows that fits
//! ([`rows`]); the rest are recomputed as today. Rows are the caller's rows `[0, rows)` of the
//! call, whether or not the call compacts them ([`crate::Compaction`]): a compacted forward writes
//! each active row at its own index (ignored rows are not written and are never read: their
//! d-logits are zero), a compacted backward reads them through its row map. Under tensor
//! parallelism each rank keeps its shard's columns (`v` is the local vocabulary).
//!
//! **Memory:** `4 · rows · stride` bytes, the caller's buffer ([`len`] elements), on top of
//! today's workspace. The caller owns it, not the workspace: it must live from a forward to its
//! backward while other calls (other micro-batches' forwards) reuse the workspace, and a
//! framework's autograd frees it with the graph that saved it.
//!
//! **Cost.** The forward writes the buffer from the accumulator registers (`4·rows·stride` bytes
//! at HBM bandwidth, overlapped with the tensor cores); per vocab chunk the backward reads the
//! kept rows' columns once (an elementwise kernel, [`lmhead_core::config::fixed::DLOGITS_KEPT`])
//! instead of recomputing `rows × chunk × d` on the tensor cores. A budget of 0 runs exactly
//! today's kernels and allocates nothing.

use cudarc::driver::DevicePtr;

/// Kept rows come in whole multiples of this (a token tile of every config), unless all `t`
/// rows are kept.
pub const ROW_ALIGN: usize = 128;

/// Row stride of the kept buffer in elements for a local vocabulary of `v`.
pub const fn stride(v: usize) -> usize {
    v.next_multiple_of(8)
}

/// Rows of a `t`-token call over a local vocabulary of `v` that a budget of `budget` bytes
/// keeps (module docs).
pub fn rows(t: usize, v: usize, budget: usize) -> usize {
    if budget == 0 || t == 0 {
        return 0;
    }
    let fit = budget / (4 * stride(v).max(1));
    if fit >= t {
        t
    } else {
        fit / ROW_ALIGN * ROW_ALIGN
    }
}

/// Elements (f32) of the kept buffer of such a call: `rows · stride`.
pub fn len(t: usize, v: usize, budget: usize) -> usize {
    rows(t, v, budget) * stride(v)
}

/// What a backward reads of the forward's kept logits: the buffer and how many rows it holds
/// (the forward's [`crate::FwdReport::kept_rows`]).
#[derive(Clone, Copy)]
pub struct Kept<'a> {
    pub logits: &'a dyn DevicePtr<f32>,
    pub rows: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_all_or_whole_tiles_within_the_budget() {
        let (t, v) = (1000, 32_001);
        let row = 4 * stride(v);
        assert_eq!(stride(v), 32_008);
        assert_eq!(rows(t, v, 0), 0);
        assert_eq!(rows(0, v, usize::MAX), 0);
        assert_eq!(rows(t, v, usize::MAX), t);
        assert_eq!(rows(t, v, t * row), t);
        assert_eq!(rows(t, v, t * row - 1), 896);
        assert_eq!(rows(t, v, 128 * row), 128);
        assert_eq!(rows(t, v, 128 * row - 1), 0);
        assert_eq!(rows(100, v, 100 * row), 100, "a call smaller than a tile is kept whole");
        for b in [0, row, 300 * row, 777 * row + 5, usize::MAX] {
            let r = rows(t, v, b);
            assert!(r == t || r.is_multiple_of(ROW_ALIGN));
            assert!(len(t, v, b) * 4 <= b);
        }
    }
}
