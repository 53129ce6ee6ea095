//! Kept logits: a forward that keeps the logits it computes, so that the backward forms the
//! d-logits from them instead of recomputing them (three GEMMs' worth of work per training step
//! instead of four), within a byte budget the caller sets ([`crate::FwdOptions::keep_logits`]).
//!
//! **What is kept.** Per kept row, the format of [`lmhead_core::kept`]: each column's
//! `q = 2^{y − g}` in fp16 (`y` the scaled logit, `g` the maximum of its 32-column group), the
//! group maxima in f32 and the label's raw logit in f32: [`row_bytes`] per row, a little over half
//! of the f32 logits. The backward forms `p = q · 2^{g − lse·log2e}` (fp16's rounding, at most
//! 2⁻¹¹ relative, against the d-logits' own bf16 rounding of 2⁻⁹) and the entropy's `z` from
//! `g + log2 q` (within 2⁻¹¹ absolute); the label's column, whose `1 − p` cancels in a peaked row,
//! from its f32 logit exactly as the recompute does. The probabilities themselves cannot be
//! kept (the forward knows the log-sum-exp only after its merge), nor a 16-bit logit: fp16
//! `z − m` carries ~2⁻¹¹ relative error of `z − m`, about 1% of `p` at `z − m ≈ −20`.
//!
//! **Which rows.** With a budget of `B` bytes, the call keeps `rows = t` when
//! `t · row_bytes ≤ B`, else the largest multiple of [`ROW_ALIGN`] rows that fits ([`rows`]); the
//! rest are recomputed as today. Rows are the caller's rows `[0, rows)` of the call, whether or
//! not the call compacts them ([`crate::Compaction`]): a compacted forward writes each active row
//! at its own index (ignored rows are not written and are never read: their d-logits are zero),
//! a compacted backward reads them through its row map. Under tensor parallelism each rank keeps
//! its shard's columns (`v` is the local vocabulary).
//!
//! **Memory:** `rows · row_bytes` bytes, the caller's buffer ([`len`] f32-sized elements; its
//! element type is only the unit of its length), on top of today's workspace. The caller owns it,
//! not the workspace: it must live from a forward to its backward while other calls (other
//! micro-batches' forwards) reuse the workspace, and a framework's autograd frees it with the
//! graph that saved it.
//!
//! **Cost.** The forward writes the buffer from the accumulator registers, reusing the fold's
//! exponentials (`rows · row_bytes` at HBM bandwidth, overlapped with the tensor cores); per
//! vocab chunk the backward reads the kept rows' columns once (an elementwise kernel,
//! [`lmhead_core::config::fixed::DLOGITS_KEPT`]) instead of recomputing `rows × chunk × d` on the
//! tensor cores. A budget of 0 runs exactly today's kernels and allocates nothing.

use cudarc::driver::DevicePtr;

/// Kept rows come in whole multiples of this (a token tile of every config), unless all `t`
/// rows are kept.
pub const ROW_ALIGN: usize = 128;

use lmhead_core::kept::{label_plane, max_plane};
pub use lmhead_core::kept::{row_bytes, stride, GROUP};

/// Element (4-byte) offsets of the group maxima and the label logits in a buffer of `rows` rows
/// of stride `s` (`lmhead_core::kept`'s planes).
fn planes(rows: usize, s: usize) -> (usize, usize) {
    ((max_plane(rows as u64, s as u64) / 4) as usize, (label_plane(rows as u64, s as u64) / 4) as usize)
}

/// Rows of a `t`-token call over a local vocabulary of `v` that a budget of `budget` bytes
/// keeps (module docs).
pub fn rows(t: usize, v: usize, budget: usize) -> usize {
    if budget == 0 || t == 0 {
        return 0;
    }
    let fit = budget / row_bytes(v);
    if fit >= t {
        t
    } else {
        fit / ROW_ALIGN * ROW_ALIGN
    }
}

/// Elements (4 bytes each) of a kept buffer of `rows` rows over a local vocabulary of `v`.
pub fn rows_len(rows: usize, v: usize) -> usize {
    rows * (row_bytes(v) / 4)
}

/// Elements (4 bytes each) of the kept buffer of such a call: [`rows_len`] of its [`rows`].
pub fn len(t: usize, v: usize, budget: usize) -> usize {
    rows_len(rows(t, v, budget), v)
}

/// The kept planes of `rows` rows of `logits` (`[t][v]`, f32 raw dot products, the label
/// column of each row or `None`) at `scale2 = log2e / T`, as the forward writes them: what the
/// CPU backend keeps, and what the GPU's buffer is checked against. Rows are written whole
/// (padding columns: `q = 0`, a padding-only group's maximum `−∞`); labels not given are 0.
pub fn encode(logits: &[f32], v: usize, labels: &[Option<usize>], scale2: f32) -> Vec<f32> {
    let (rows, s) = (labels.len(), stride(v));
    let mut out = vec![0f32; rows_len(rows, v)];
    let (maxima, label_logits) = planes(rows, s);
    let (q_plane, rest) = out.split_at_mut(maxima);
    let (max_plane, label_plane) = rest.split_at_mut(label_logits - maxima);
    for (r, label) in labels.iter().enumerate() {
        let row = &logits[r * v..(r + 1) * v];
        for g in 0..s / GROUP {
            let cols = g * GROUP..((g + 1) * GROUP).min(v);
            let m = row.get(cols.clone()).unwrap_or(&[]).iter().fold(f32::NEG_INFINITY, |m, &a| {
                if a.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(a)
                }
            });
            let g2 = m * scale2;
            max_plane[r * (s / GROUP) + g] = g2;
            for j in g * GROUP..(g + 1) * GROUP {
                let q = if j < v && g2 != f32::NEG_INFINITY { (row[j] * scale2 - g2).exp2() } else { 0.0 };
                let bits = half::f16::from_f32(q).to_bits() as u32;
                let w = &mut q_plane[(r * s + j) / 2];
                let old = w.to_bits();
                *w = f32::from_bits(if j.is_multiple_of(2) { (old & 0xffff_0000) | bits } else { (old & 0xffff) | (bits << 16) });
            }
        }
        label_plane[r] = label.map_or(0.0, |l| row[l]);
    }
    out
}

/// One kept column decoded from [`encode`]'s planes: `(q, g)` of row `r`, column `j`.
pub fn decode(kept: &[f32], rows: usize, v: usize, r: usize, j: usize) -> (f32, f32) {
    let s = stride(v);
    let w = kept[(r * s + j) / 2].to_bits();
    let bits = if j.is_multiple_of(2) { w & 0xffff } else { w >> 16 };
    (half::f16::from_bits(bits as u16).to_f32(), kept[planes(rows, s).0 + r * (s / GROUP) + j / GROUP])
}

/// The label logit of row `r` in [`encode`]'s planes.
pub fn label_logit(kept: &[f32], rows: usize, v: usize, r: usize) -> f32 {
    kept[planes(rows, stride(v)).1 + r]
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
        let row = row_bytes(v);
        assert_eq!(stride(v), 32_032);
        assert_eq!(row, 2 * 32_032 + 4 * 1001 + 4);
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

    #[test]
    fn encode_keeps_q_to_fp16_and_the_label_logit_exactly() {
        let (v, scale2) = (70, std::f32::consts::LOG2_E / 0.7);
        let logits: Vec<f32> = (0..2 * v).map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.173).collect();
        let labels = [Some(5), None];
        let k = encode(&logits, v, &labels, scale2);
        assert_eq!(k.len(), rows_len(2, v));
        for r in 0..2 {
            for j in 0..v {
                let (q, g) = decode(&k, 2, v, r, j);
                let group = &logits[r * v + j / GROUP * GROUP..r * v + ((j / GROUP + 1) * GROUP).min(v)];
                let gmax = group.iter().fold(f32::NEG_INFINITY, |m, &a| m.max(a));
                assert_eq!(g, gmax * scale2);
                let want = (logits[r * v + j] as f64 * scale2 as f64 - g as f64).exp2();
                assert!((q as f64 - want).abs() <= want * 2f64.powi(-11) + 2f64.powi(-25), "q[{r}][{j}] = {q}, want {want}");
                if logits[r * v + j] == gmax {
                    assert_eq!(q, 1.0, "a group's maximum is exactly 1");
                }
            }
        }
        assert_eq!(label_logit(&k, 2, v, 0), logits[5]);
    }
}
