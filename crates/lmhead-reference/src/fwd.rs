//! Forward reference: per token, the log-sum-exp of its logits, the log-prob of its label and the
//! entropy, all in f64 on the bf16-quantised inputs. Also the vocab-sharded partials and their
//! merge, the same math tensor parallelism uses on the GPU.

use crate::bf16;
use crate::inputs::Inputs;
use lmhead_core::lse::{Lse2, LN_2, LOG2_E};
use rayon::prelude::*;

/// One token's outputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RowOut {
    pub lse: f64,
    pub logprob: f64,
    pub entropy: f64,
    /// `Σ_j p_j·|z_j − μ|` with `μ = Σ_j p_j·z_j`: how far the logits spread under the row's own
    /// distribution. The entropy's sensitivity to logit errors: `∂H/∂z_j = −p_j·(z_j − μ)`, so
    /// errors of at most `ε` per logit move `H` by at most `ε·spread` (to first order).
    pub spread: f64,
}

/// Every token's outputs.
#[derive(Clone, Debug, PartialEq)]
pub struct FwdRef {
    pub lse: Vec<f64>,
    pub logprob: Vec<f64>,
    pub entropy: Vec<f64>,
}

/// Tokens handled together by one task: each `W` row is read once per block.
const ROW_BLOCK: usize = 4;

/// Logits `z[r][j] = h[rows[r]] · W[j] / T` for a block of rows (`j` walks W's rows and z's
/// columns together, so the range loop is the clear form).
#[allow(clippy::needless_range_loop)]
fn logits_block(inp: &Inputs, rows: &[usize]) -> Vec<Vec<f64>> {
    let d = inp.d;
    let inv_t = 1.0 / inp.temperature;
    let mut z = vec![vec![0.0f64; inp.v]; rows.len()];
    for j in 0..inp.v {
        let wr = &inp.w[j * d..(j + 1) * d];
        for (r, &row) in rows.iter().enumerate() {
            z[r][j] = bf16::dot(&inp.h[row * d..(row + 1) * d], wr) * inv_t;
        }
    }
    z
}

/// Outputs of one row from its full logits (the label must be in this shard or ignored).
/// `lse = m + ln Σ e^{z−m}`; `entropy = Σ_j p_j (lse − z_j)` (each term ≥ 0, no cancellation).
/// NaN anywhere in the row gives NaN outputs.
pub fn row_from_logits(z: &[f64], label: i64, inp: &Inputs) -> RowOut {
    let nan = z.iter().any(|x| x.is_nan());
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let s: f64 = z.iter().map(|&x| (x - m).exp()).sum();
    let lse = if nan { f64::NAN } else { m + s.ln() };
    let entropy: f64 = if nan {
        f64::NAN
    } else {
        z.iter()
            .map(|&x| {
                let p = (x - lse).exp();
                if p > 0.0 {
                    p * (lse - x)
                } else {
                    0.0
                }
            })
            .sum()
    };
    // μ = Σ p z = lse − H.
    let mu = lse - entropy;
    let spread: f64 = if nan { f64::NAN } else { z.iter().map(|&x| (x - lse).exp() * (x - mu).abs()).sum() };
    if label == inp.ignore_index {
        return RowOut { lse, logprob: 0.0, entropy: 0.0, spread };
    }
    let local = label - inp.v_begin;
    if label < 0 || label >= inp.v_total || local < 0 || local >= inp.v as i64 {
        return RowOut { lse, logprob: f64::NAN, entropy: f64::NAN, spread };
    }
    RowOut { lse, logprob: z[local as usize] - lse, entropy, spread }
}

/// The outputs of the given rows (any order, repeats allowed).
pub fn forward_rows(inp: &Inputs, rows: &[usize]) -> Vec<RowOut> {
    rows.par_chunks(ROW_BLOCK)
        .flat_map_iter(|blk| {
            let z = logits_block(inp, blk);
            blk.iter().zip(z).map(|(&row, zr)| row_from_logits(&zr, inp.labels[row], inp)).collect::<Vec<_>>()
        })
        .collect()
}

/// The outputs of every row. Rows with a label outside `[0, v_total)` (not `ignore_index`) get
/// NaN log-prob and entropy, as on the GPU; callers that want an error check labels first.
pub fn forward(inp: &Inputs) -> FwdRef {
    let rows: Vec<usize> = (0..inp.t).collect();
    let out = forward_rows(inp, &rows);
    FwdRef {
        lse: out.iter().map(|r| r.lse).collect(),
        logprob: out.iter().map(|r| r.logprob).collect(),
        entropy: out.iter().map(|r| r.entropy).collect(),
    }
}

/// Rows whose label is neither `ignore_index` nor in `[0, v_total)`.
pub fn bad_labels(inp: &Inputs) -> Vec<usize> {
    (0..inp.t)
        .filter(|&i| {
            let l = inp.labels[i];
            l != inp.ignore_index && (l < 0 || l >= inp.v_total)
        })
        .collect()
}

/// One row's partial over a vocab shard: the base-2 `(m, s, t)` state and the label's logit
/// (0 when the label is not in the shard).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShardPartial {
    pub state: Lse2<f64>,
    pub z_label: f64,
}

/// Partials of every row over this shard (`inp.w` is the shard, `inp.v_begin` its first id).
pub fn shard_partials(inp: &Inputs) -> Vec<ShardPartial> {
    let rows: Vec<usize> = (0..inp.t).collect();
    rows.par_chunks(ROW_BLOCK)
        .flat_map_iter(|blk| {
            let z = logits_block(inp, blk);
            blk.iter()
                .zip(z)
                .map(|(&row, zr)| {
                    let state = zr.iter().fold(Lse2::EMPTY, |st, &x| st.push(x * LOG2_E, f64::exp2));
                    let local = inp.labels[row] - inp.v_begin;
                    let z_label =
                        if inp.labels[row] != inp.ignore_index && local >= 0 && local < inp.v as i64 { zr[local as usize] } else { 0.0 };
                    ShardPartial { state, z_label }
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Merge the partials of all shards (any order) into the outputs, as the tensor-parallel
/// all-reduce does: states merge, label logits add (exactly one shard holds each label).
pub fn merge_shards(shards: &[Vec<ShardPartial>], labels: &[i64], v_total: i64, ignore_index: i64) -> FwdRef {
    let t = labels.len();
    let mut out = FwdRef { lse: vec![0.0; t], logprob: vec![0.0; t], entropy: vec![0.0; t] };
    for i in 0..t {
        let mut st = Lse2::EMPTY;
        let mut z = 0.0;
        for s in shards {
            st = st.merge(s[i].state, f64::exp2);
            z += s[i].z_label;
        }
        let lse = st.lse2(f64::log2) * LN_2;
        let ent = st.entropy2(f64::log2) * LN_2;
        out.lse[i] = lse;
        let l = labels[i];
        if l == ignore_index {
            continue;
        }
        if l < 0 || l >= v_total {
            out.logprob[i] = f64::NAN;
            out.entropy[i] = f64::NAN;
            continue;
        }
        out.logprob[i] = z - lse;
        out.entropy[i] = ent;
    }
    out
}
