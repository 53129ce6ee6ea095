//! The CPU backend: the f64 reference behind the same validation as the GPU path, for machines
//! without a GPU (and as the oracle of the tests). Results are returned in f32 like the GPU's.

use lmhead_core::Problem;
use lmhead_reference as reference;

use crate::bwd::BwdOptions;
use crate::error::{Error, Result};
use crate::fwd::{check_temperature, FwdOptions};

/// Forward outputs on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuFwd {
    pub logprob: Vec<f32>,
    pub lse: Vec<f32>,
    pub entropy: Option<Vec<f32>>,
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

fn validate(h: &[half::bf16], w: &[half::bf16], labels: &[i64], p: Problem, temperature: f32, ignore_index: i64) -> Result<()> {
    p.check()?;
    check_temperature(temperature)?;
    check_len("h", h.len(), p.t * p.d)?;
    check_len("W", w.len(), p.v * p.d)?;
    check_len("labels", labels.len(), p.t)?;
    if let Some((row, &l)) = labels.iter().enumerate().find(|(_, &l)| l != ignore_index && (l < 0 || l >= p.v as i64)) {
        return Err(Error::BadLabel { row: Some(row), label: Some(l) });
    }
    Ok(())
}

fn inputs<'a>(h: &'a [u16], w: &'a [u16], labels: &'a [i64], p: Problem, temperature: f32, ignore_index: i64) -> reference::Inputs<'a> {
    reference::Inputs {
        h,
        w,
        labels,
        t: p.t,
        v: p.v,
        d: p.d,
        v_begin: 0,
        v_total: p.v as i64,
        temperature: temperature as f64,
        ignore_index,
    }
}

/// Forward on the CPU (`entropy`: also return the entropy).
pub fn forward(h: &[half::bf16], w: &[half::bf16], labels: &[i64], p: Problem, opts: &FwdOptions, entropy: bool) -> Result<CpuFwd> {
    validate(h, w, labels, p, opts.temperature, opts.ignore_index)?;
    let (hb, wb) = (bits(h), bits(w));
    let r = reference::forward(&inputs(&hb, &wb, labels, p, opts.temperature, opts.ignore_index));
    let f = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
    Ok(CpuFwd { logprob: f(&r.logprob), lse: f(&r.lse), entropy: entropy.then(|| f(&r.entropy)) })
}

/// Backward on the CPU: `(dh [t][d], dW [v][d])` in f32.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    h: &[half::bf16],
    w: &[half::bf16],
    labels: &[i64],
    p: Problem,
    lse: &[f32],
    entropy: Option<&[f32]>,
    grad_logprob: Option<&[f32]>,
    grad_entropy: Option<&[f32]>,
    opts: &BwdOptions,
) -> Result<(Vec<f32>, Vec<f32>)> {
    validate(h, w, labels, p, opts.temperature, opts.ignore_index)?;
    check_len("lse", lse.len(), p.t)?;
    if grad_entropy.is_some() && entropy.is_none() {
        return Err(Error::Invalid("an entropy gradient needs the entropy saved by the forward".into()));
    }
    for (what, x) in [("entropy", entropy), ("grad_logprob", grad_logprob), ("grad_entropy", grad_entropy)] {
        if let Some(x) = x {
            check_len(what, x.len(), p.t)?;
        }
    }
    let (hb, wb) = (bits(h), bits(w));
    let inp = inputs(&hb, &wb, labels, p, opts.temperature, opts.ignore_index);
    let f64s = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<_>>();
    let lse = f64s(lse);
    let ent = entropy.map(f64s).unwrap_or_else(|| vec![0.0; p.t]);
    let gl = grad_logprob.map(f64s);
    let ge = grad_entropy.map(f64s);
    let g = reference::Grads { logprob: gl.as_deref(), entropy: ge.as_deref() };
    let r = reference::backward(&inp, &lse, &ent, &g);
    let f = |v: Vec<f64>| v.into_iter().map(|x| x as f32).collect::<Vec<_>>();
    Ok((f(r.dh), f(r.dw)))
}
