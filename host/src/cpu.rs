//! The CPU backend: the f64 reference behind the same validation as the GPU path, for machines
//! without a GPU (and as the oracle of the tests). Results are returned in f32 like the GPU's.
//!
//! Kept logits ([`crate::keep`]): the forward keeps the rows `FwdOptions::keep_logits` says, in
//! the GPU's format ([`crate::keep::encode`] of the f64 dot products rounded to f32, in
//! [`CpuFwd::kept`]); the backward checks what it is given ([`CpuGrads::kept`]) as the GPU does
//! and then computes every row in f64 (the kept values are not read: the f64 recompute is exact
//! where they are not).

use lmhead_core::Problem;
use lmhead_reference as reference;

use crate::bwd::BwdOptions;
use crate::error::{Error, Result};
use crate::fwd::FwdOptions;
use crate::tp::{ReduceOp, Shard};
use crate::validate::temperature as check_temperature;

/// The inputs of a CPU call: `h [t][d]` and `w [v][d]` in bf16 (under tensor parallelism, this
/// rank's vocab rows), the global labels `[t]`, and the shape.
#[derive(Clone, Copy, Debug)]
pub struct CpuInputs<'a> {
    pub h: &'a [half::bf16],
    pub w: &'a [half::bf16],
    pub labels: &'a [i64],
    pub problem: Problem,
}

/// What a CPU backward reads besides its inputs, `[t]` each: the forward's `lse` and `entropy`
/// (the entropy is needed with `grad_entropy`), and the upstream gradients of log-prob and
/// entropy (either may be absent).
#[derive(Clone, Copy, Debug)]
pub struct CpuGrads<'a> {
    pub lse: &'a [f32],
    pub entropy: Option<&'a [f32]>,
    pub grad_logprob: Option<&'a [f32]>,
    pub grad_entropy: Option<&'a [f32]>,
    /// The forward's kept logits and their rows ([`CpuFwd::kept`], [`CpuFwd::kept_rows`]):
    /// validated as on the GPU, not read.
    pub kept: Option<(&'a [f32], usize)>,
}

/// Forward outputs on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuFwd {
    pub logprob: Vec<f32>,
    pub lse: Vec<f32>,
    pub entropy: Option<Vec<f32>>,
    /// The kept logits ([`crate::keep`]): the planes of rows `[0, kept_rows)`
    /// ([`crate::keep::encode`]); empty without the mode.
    pub kept: Vec<f32>,
    pub kept_rows: usize,
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<()> {
    if got != expected {
        return Err(Error::Length { what, expected, got });
    }
    Ok(())
}

fn bits(x: &[half::bf16]) -> Vec<u16> {
    x.iter().map(|b| b.to_bits()).collect()
}

fn validate(x: &CpuInputs, shard: Shard, temperature: f32, ignore_index: i64) -> Result<()> {
    let CpuInputs { h, w, labels, problem: p } = *x;
    p.check()?;
    shard.check(p.v)?;
    check_temperature(temperature)?;
    check_len("h", h.len(), p.t * p.d)?;
    check_len("W", w.len(), p.v * p.d)?;
    check_len("labels", labels.len(), p.t)?;
    let v_total = shard.v_total as i64;
    if let Some((row, &l)) = labels.iter().enumerate().find(|(_, &l)| l != ignore_index && (l < 0 || l >= v_total)) {
        return Err(Error::BadLabel { row: Some(row), label: Some(l) });
    }
    Ok(())
}

fn inputs<'a>(
    h: &'a [u16],
    w: &'a [u16],
    labels: &'a [i64],
    p: Problem,
    shard: Shard,
    temperature: f32,
    ignore_index: i64,
) -> reference::Inputs<'a> {
    reference::Inputs {
        h,
        w,
        labels,
        t: p.t,
        v: p.v,
        d: p.d,
        v_begin: shard.v_begin as i64,
        v_total: shard.v_total as i64,
        temperature: temperature as f64,
        ignore_index,
    }
}

/// Forward on the CPU (`entropy`: also return the entropy).
pub fn forward(x: &CpuInputs, opts: &FwdOptions, entropy: bool) -> Result<CpuFwd> {
    let shard = Shard::whole(x.problem.v);
    validate(x, shard, opts.temperature, opts.ignore_index)?;
    let (hb, wb) = (bits(x.h), bits(x.w));
    let r = reference::forward(&inputs(&hb, &wb, x.labels, x.problem, shard, opts.temperature, opts.ignore_index));
    let f = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
    let (kept, kept_rows) = keep(x, shard, opts)?;
    Ok(CpuFwd { logprob: f(&r.logprob), lse: f(&r.lse), entropy: entropy.then(|| f(&r.entropy)), kept, kept_rows })
}

/// The kept logits of a forward (`crate::keep`): the raw dot products of the rows the budget
/// keeps, accumulated in f64, rounded to f32 and encoded as the GPU writes them (the label
/// logit of rows whose label is one of this shard's columns).
fn keep(x: &CpuInputs, shard: Shard, opts: &FwdOptions) -> Result<(Vec<f32>, usize)> {
    let p = x.problem;
    let rows = crate::keep::rows(p.t, p.v, opts.keep_logits);
    if rows > 0 && opts.naive() {
        return Err(Error::Invalid("the naive forward keeps no logits (keep_logits must be 0)".into()));
    }
    let mut logits = vec![0.0f32; rows * p.v];
    for (r, row) in logits.chunks_mut(p.v.max(1)).enumerate().take(rows) {
        let h = &x.h[r * p.d..(r + 1) * p.d];
        for (j, o) in row.iter_mut().enumerate() {
            let w = &x.w[j * p.d..(j + 1) * p.d];
            *o = h.iter().zip(w).map(|(a, b)| a.to_f64() * b.to_f64()).sum::<f64>() as f32;
        }
    }
    let local = |l: i64| {
        let j = l - shard.v_begin as i64;
        (l != opts.ignore_index && j >= 0 && (j as usize) < p.v).then_some(j as usize)
    };
    let labels: Vec<Option<usize>> = x.labels[..rows].iter().map(|&l| local(l)).collect();
    let scale2 = (lmhead_core::lse::LOG2_E as f32) * (1.0 / opts.temperature);
    Ok((crate::keep::encode(&logits, p.v, &labels, scale2), rows))
}

/// What a backward is given of kept logits, checked as the GPU checks it (`validate::bwd`).
fn check_kept(p: Problem, kept: Option<(&[f32], usize)>) -> Result<()> {
    let Some((k, rows)) = kept else { return Ok(()) };
    if rows > p.t {
        return Err(Error::Invalid(format!("the kept logits hold {rows} rows, the call has {}", p.t)));
    }
    if rows != p.t && !rows.is_multiple_of(crate::keep::ROW_ALIGN) {
        return Err(Error::Invalid(format!("kept rows ({rows}) must be all t = {} rows or a multiple of {}", p.t, crate::keep::ROW_ALIGN)));
    }
    let need = crate::keep::rows_len(rows, p.v);
    if k.len() < need {
        return Err(Error::Length { what: "kept logits", expected: need, got: k.len() });
    }
    Ok(())
}

/// Backward on the CPU: `(dh [t][d], dW [v][d])` in f32.
pub fn backward(x: &CpuInputs, g: &CpuGrads, opts: &BwdOptions) -> Result<(Vec<f32>, Vec<f32>)> {
    let r = backward_shard(x, Shard::whole(x.problem.v), g, opts)?;
    Ok((to_f32(r.dh), to_f32(r.dw)))
}

fn to_f32(v: Vec<f64>) -> Vec<f32> {
    v.into_iter().map(|x| x as f32).collect()
}

/// The backward over one vocab shard in f64: the shard's `dW` rows and its partial `dh` (the
/// whole `dh` for the whole vocabulary).
fn backward_shard(x: &CpuInputs, shard: Shard, g: &CpuGrads, opts: &BwdOptions) -> Result<reference::BwdRef> {
    let CpuGrads { lse, entropy, grad_logprob, grad_entropy, kept } = *g;
    let p = x.problem;
    validate(x, shard, opts.temperature, opts.ignore_index)?;
    check_kept(p, kept)?;
    check_len("lse", lse.len(), p.t)?;
    if grad_entropy.is_some() && entropy.is_none() {
        return Err(Error::Invalid("an entropy gradient needs the entropy saved by the forward".into()));
    }
    for (what, x) in [("entropy", entropy), ("grad_logprob", grad_logprob), ("grad_entropy", grad_entropy)] {
        if let Some(x) = x {
            check_len(what, x.len(), p.t)?;
        }
    }
    let (hb, wb) = (bits(x.h), bits(x.w));
    let inp = inputs(&hb, &wb, x.labels, p, shard, opts.temperature, opts.ignore_index);
    let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let lse = f64s(lse);
    let ent = entropy.map(f64s).unwrap_or_else(|| vec![0.0; p.t]);
    let (gl, ge) = (grad_logprob.map(f64s), grad_entropy.map(f64s));
    let g = reference::Grads { logprob: gl.as_deref(), entropy: ge.as_deref() };
    Ok(reference::backward(&inp, &lse, &ent, &g))
}

/// An all-reduce over host `f64` buffers, for [`forward_tp`] and [`backward_tp`] (the Python
/// package implements it with `torch.distributed`; tests with threads).
pub trait HostComm {
    /// In-place all-reduce of `buf` across the group; every rank calls it with the same length
    /// and op.
    fn all_reduce(&self, buf: &mut [f64], op: ReduceOp) -> Result<()>;
}

/// The tensor-parallel forward on the CPU, with the GPU's protocol: this rank's `w` holds the
/// vocab rows `[shard.v_begin, shard.v_begin + p.v)`, labels are global. Each row's base-2
/// state `(m, s, t)` and label logit over the shard; all-reduce MAX of `m`; rescale; all-reduce
/// SUM of `(s, t, z_label)`; finish. Every rank returns the same outputs.
pub fn forward_tp(comm: &dyn HostComm, x: &CpuInputs, shard: Shard, opts: &FwdOptions, entropy: bool) -> Result<CpuFwd> {
    validate(x, shard, opts.temperature, opts.ignore_index)?;
    let CpuInputs { h, w, labels, problem: p } = *x;
    let (hb, wb) = (bits(h), bits(w));
    let parts = reference::fwd::shard_partials(&inputs(&hb, &wb, labels, p, shard, opts.temperature, opts.ignore_index));
    let t = p.t;
    let mut m: Vec<f64> = parts.iter().map(|x| x.state.m).collect();
    comm.all_reduce(&mut m, ReduceOp::Max)?;
    // [s; t; z_label], each rescaled to the global maximum.
    let mut sums = vec![0.0f64; 3 * t];
    for (i, x) in parts.iter().enumerate() {
        let st = if m[i] == f64::NEG_INFINITY { x.state } else { x.state.rescale(m[i], f64::exp2) };
        sums[i] = st.s;
        sums[t + i] = st.t;
        sums[2 * t + i] = x.z_label;
    }
    comm.all_reduce(&mut sums, ReduceOp::Sum)?;
    let merged: Vec<reference::fwd::ShardPartial> = (0..t)
        .map(|i| reference::fwd::ShardPartial {
            state: lmhead_core::lse::Lse2 { m: m[i], s: sums[i], t: sums[t + i] },
            z_label: sums[2 * t + i],
        })
        .collect();
    let r = reference::fwd::merge_shards(&[merged], labels, shard.v_total as i64, opts.ignore_index);
    let f = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
    // Each rank keeps its shard's columns.
    let (kept, kept_rows) = keep(x, shard, opts)?;
    Ok(CpuFwd { logprob: f(&r.logprob), lse: f(&r.lse), entropy: entropy.then(|| f(&r.entropy)), kept, kept_rows })
}

/// The tensor-parallel backward on the CPU: `lse` and `entropy` are the global values from
/// [`forward_tp`]. Returns the full `dh` (the ranks' partial sums, all-reduced with SUM when
/// `reduce_dh`, else this rank's partial sum) and this shard's `dW` rows, in f32.
pub fn backward_tp(
    comm: &dyn HostComm,
    x: &CpuInputs,
    shard: Shard,
    g: &CpuGrads,
    opts: &BwdOptions,
    reduce_dh: bool,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut r = backward_shard(x, shard, g, opts)?;
    if reduce_dh {
        comm.all_reduce(&mut r.dh, ReduceOp::Sum)?;
    }
    Ok((to_f32(r.dh), to_f32(r.dw)))
}
