//! Backward reference: `dh = dlogits · W` and `dW = dlogitsᵀ · h` in f64, with
//!
//! ```text
//! dlogits[t, j] = (1/T) · [ g_ℓ[t] (onehot_j − p_j) − g_H[t] p_j (z_j − μ_t) ],
//! p_j = e^{z_j − lse_t},   μ_t = Σ_j p_j z_j = lse_t − H_t,
//! ```
//!
//! derived from `∂ℓ/∂z_j = onehot_j − p_j` and `∂H/∂z_j = −p_j (z_j − μ)` (see
//! `kernels-gpu/src/epilogue/dlogits.rs`); `1/T` is `∂z/∂(h·w)`. Rows labelled `ignore_index` get 0.

use crate::bf16;
use crate::inputs::Inputs;
use rayon::prelude::*;

/// Upstream gradients; either may be absent.
#[derive(Clone, Copy, Debug, Default)]
pub struct Grads<'a> {
    pub logprob: Option<&'a [f64]>,
    pub entropy: Option<&'a [f64]>,
}

/// Full backward outputs.
#[derive(Clone, Debug)]
pub struct BwdRef {
    /// `[t][d]`
    pub dh: Vec<f64>,
    /// `[v][d]`
    pub dw: Vec<f64>,
}

/// d-logits of row `row` at local vocab `j`, given the row's saved lse and entropy.
pub fn dlogit(inp: &Inputs, row: usize, j: usize, lse: f64, ent: f64, g: &Grads) -> f64 {
    let label = inp.labels[row];
    if label == inp.ignore_index {
        return 0.0;
    }
    let d = inp.d;
    let inv_t = 1.0 / inp.temperature;
    let z = bf16::dot(&inp.h[row * d..(row + 1) * d], &inp.w[j * d..(j + 1) * d]) * inv_t;
    let p = (z - lse).exp();
    let mut x = 0.0;
    if let Some(gl) = g.logprob {
        let onehot = if label - inp.v_begin == j as i64 { 1.0 } else { 0.0 };
        x += gl[row] * (onehot - p);
    }
    if let Some(ge) = g.entropy {
        x -= ge[row] * p * (z - (lse - ent));
    }
    x * inv_t
}

/// Rows of `dh` (each `[d]`) for the given tokens.
pub fn backward_dh_rows(inp: &Inputs, lse: &[f64], entropy: &[f64], g: &Grads, rows: &[usize]) -> Vec<Vec<f64>> {
    dh_rows::<false>(inp, lse, entropy, g, rows).0
}

/// Rows of `dh` and, per element, the root sum of squares of its terms,
/// `sqrt(Σ_v (dl_v · W_vj)²)`: the scale of the error that rounding each d-logit (relative
/// error ≤ 2⁻⁸ in bf16) puts into `dh_j`. When the terms cancel, that scale can be far above
/// `|dh_j|` (a column of `W` constant over the vocabulary has `dh_j = 0` exactly, since the
/// d-logits of a row sum to 0), so staged-precision errors must be judged against it.
pub fn backward_dh_rows_rss(inp: &Inputs, lse: &[f64], entropy: &[f64], g: &Grads, rows: &[usize]) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    dh_rows::<true>(inp, lse, entropy, g, rows)
}

fn dh_rows<const RSS: bool>(inp: &Inputs, lse: &[f64], entropy: &[f64], g: &Grads, rows: &[usize]) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let d = inp.d;
    rows.par_iter()
        .map(|&row| sum_terms::<RSS>(d, (0..inp.v).map(|j| (dlogit(inp, row, j, lse[row], entropy[row], g), &inp.w[j * d..(j + 1) * d]))))
        .unzip()
}

/// Rows of `dW` (each `[d]`) for the given local vocab rows.
pub fn backward_dw_rows(inp: &Inputs, lse: &[f64], entropy: &[f64], g: &Grads, vrows: &[usize]) -> Vec<Vec<f64>> {
    dw_rows::<false>(inp, lse, entropy, g, vrows).0
}

/// Rows of `dW` and the root sum of squares of their terms over tokens (as
/// [`backward_dh_rows_rss`]).
pub fn backward_dw_rows_rss(inp: &Inputs, lse: &[f64], entropy: &[f64], g: &Grads, vrows: &[usize]) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    dw_rows::<true>(inp, lse, entropy, g, vrows)
}

fn dw_rows<const RSS: bool>(inp: &Inputs, lse: &[f64], entropy: &[f64], g: &Grads, vrows: &[usize]) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    let d = inp.d;
    vrows
        .par_iter()
        .map(|&j| {
            sum_terms::<RSS>(d, (0..inp.t).map(|row| (dlogit(inp, row, j, lse[row], entropy[row], g), &inp.h[row * d..(row + 1) * d])))
        })
        .unzip()
}

/// `Σ a·x` over `(a, x)` terms, element-wise over the `d` entries of `x`, and with `RSS` also
/// `sqrt(Σ (a·x)²)` (empty otherwise: the plain gradients, which are also the CPU backend's, do
/// not pay for it).
fn sum_terms<'a, const RSS: bool>(d: usize, terms: impl Iterator<Item = (f64, &'a [u16])>) -> (Vec<f64>, Vec<f64>) {
    let mut sum = vec![0.0f64; d];
    let mut sq = if RSS { vec![0.0f64; d] } else { Vec::new() };
    for (a, x) in terms {
        if a == 0.0 {
            continue;
        }
        if RSS {
            for ((s, q), &xk) in sum.iter_mut().zip(sq.iter_mut()).zip(x) {
                let term = a * bf16::to_f64(xk);
                *s += term;
                *q += term * term;
            }
        } else {
            for (s, &xk) in sum.iter_mut().zip(x) {
                *s += a * bf16::to_f64(xk);
            }
        }
    }
    sq.iter_mut().for_each(|q| *q = q.sqrt());
    (sum, sq)
}

/// Full `dh` and `dW`.
pub fn backward(inp: &Inputs, lse: &[f64], entropy: &[f64], g: &Grads) -> BwdRef {
    let rows: Vec<usize> = (0..inp.t).collect();
    let vrows: Vec<usize> = (0..inp.v).collect();
    BwdRef { dh: backward_dh_rows(inp, lse, entropy, g, &rows).concat(), dw: backward_dw_rows(inp, lse, entropy, g, &vrows).concat() }
}
