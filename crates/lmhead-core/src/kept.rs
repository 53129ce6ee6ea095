//! The kept-logits format (`FwdOptions::keep_logits`), one definition for the forward that
//! writes it (`kernels-gpu/src/epilogue/kept.rs`), the backward kernel that reads it
//! (`kernels-gpu/src/kept.rs`), the host that sizes and checks the buffer and the CPU backend
//! that writes it too (`host/src/keep.rs`).
//!
//! A buffer of `rows` kept rows over a local vocabulary of `v`, row stride `s = stride(v)`, is
//! three planes, one after the other:
//!
//! 1. **q**, fp16 `[rows][s]`: `q_j = 2^{y_j − g}` for column `j`, with `y_j = a_j · log2e / T`
//!    the scaled raw dot product and `g` the maximum of `y` over the [`GROUP`] columns of `j`'s
//!    group (so `q ∈ [0, 1]`, exactly 1 at the group's maximum);
//! 2. **group maxima**, f32 `[rows][s / GROUP]`: that `g` per group;
//! 3. **label logits**, f32 `[rows]`: the raw dot product `a_y` of the row's label column, where
//!    the label is one of the local columns (unwritten otherwise).
//!
//! `p_j = q_j · 2^{g − lse·log2e}` then carries fp16's rounding, at most 2⁻¹¹ relative (rms
//! about 2⁻¹³), a tenth of the bf16 rounding of the d-logits themselves; `z_j = (g + log2 q_j)·ln 2`
//! is within 2⁻¹¹ absolute of the logit, which the entropy's `p_j (z_j − μ)` multiplies by `p_j`.
//! The label column's `1 − p_y`, which cancels in a peaked row, is formed from the f32 label
//! logit as the recompute forms it. A column whose `q` is below fp16's range (2⁻²⁴ of its
//! group's maximum) reads as 0.

/// Columns per group maximum (a multiple of 8: the backward reads 8 columns of one group).
pub const GROUP: usize = 32;

/// Columns one thread of the backward's kept d-logits kernel forms (two runs of 8 columns, a
/// block apart, loaded together so that each thread has two 16-byte loads in flight).
pub const READ_COLS: usize = 16;

/// Row stride of the kept planes for a local vocabulary of `v`: `v` rounded up to [`GROUP`].
pub const fn stride(v: usize) -> usize {
    v.next_multiple_of(GROUP)
}

/// Bytes one kept row takes in the three planes: `2·s + 4·s/GROUP + 4` with `s = stride(v)`.
pub const fn row_bytes(v: usize) -> usize {
    let s = stride(v);
    2 * s + 4 * (s / GROUP) + 4
}

/// Byte offset of the group maxima in a buffer of `rows` rows of stride `s` (16-byte aligned
/// when the buffer is: `s` is a multiple of [`GROUP`]).
pub const fn max_plane(rows: u64, s: u64) -> u64 {
    2 * rows * s
}

/// Byte offset of the label logits in a buffer of `rows` rows of stride `s` (4-byte aligned).
pub const fn label_plane(rows: u64, s: u64) -> u64 {
    max_plane(rows, s) + 4 * rows * (s / GROUP as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planes_follow_each_other_and_stay_aligned() {
        assert_eq!(stride(1), 32);
        assert_eq!(stride(32_000), 32_000);
        assert_eq!(stride(32_001), 32_032);
        let (rows, s) = (3u64, stride(100) as u64);
        assert_eq!(max_plane(rows, s) % 16, 0);
        assert_eq!(label_plane(rows, s), 2 * 3 * 128 + 4 * 3 * 4);
        assert_eq!(label_plane(rows, s) + 4 * rows, rows * row_bytes(100) as u64);
    }
}
