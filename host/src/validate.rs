//! Validation of a whole call before anything runs: shape, shard, options, and every buffer's
//! length, alignment and overlap. `forward`, `backward` (and their `_tp` forms) call these first,
//! before the tuner, the label check or any launch, so a bad call is a typed [`Error`] that has
//! tuned nothing, cached nothing and written nothing.
//!
//! The checks work on plain [`Buf`] descriptions (address and element count), so they are
//! tested without a GPU (`tests/validation.rs`); the launch functions check the same bounds
//! again next to each launch (defence in depth, see `launch/`).

use lmhead_core::config::Family;
use lmhead_core::Problem;

use crate::bwd::BwdOptions;
use crate::error::{Error, Result};
use crate::fwd::FwdOptions;
use crate::tp::Shard;
use crate::tune::Choice;

/// One buffer argument as validation sees it: its name in errors, device address, element count
/// and element size in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Buf {
    pub what: &'static str,
    pub ptr: u64,
    pub len: usize,
    pub elem: usize,
}

impl Buf {
    pub const fn new(what: &'static str, ptr: u64, len: usize, elem: usize) -> Self {
        Self { what, ptr, len, elem }
    }

    /// Exactly `n` elements, the address a multiple of `align` bytes (also the check of
    /// `launch::Dev::check_exact` next to each launch).
    pub(crate) fn exact(&self, n: usize, align: usize) -> Result<()> {
        if self.len != n {
            return Err(Error::Length { what: self.what, expected: n, got: self.len });
        }
        if !self.ptr.is_multiple_of(align as u64) {
            return Err(Error::Misaligned { what: self.what, align });
        }
        Ok(())
    }

    fn bytes(&self) -> std::ops::Range<u64> {
        self.ptr..self.ptr + (self.len * self.elem) as u64
    }
}

/// Outputs must not overlap each other or any input: a kernel would read what another writes,
/// or two kernels race on one element. (Owned `CudaSlice`s never alias; borrowed memory from
/// another framework can.)
fn no_overlap(outputs: &[Buf], inputs: &[Buf]) -> Result<()> {
    for (i, o) in outputs.iter().enumerate() {
        for other in outputs[i + 1..].iter().chain(inputs) {
            let (a, b) = (o.bytes(), other.bytes());
            if a.start < b.end && b.start < a.end {
                return Err(Error::Invalid(format!("{} overlaps {} in memory", o.what, other.what)));
            }
        }
    }
    Ok(())
}

/// A `Fixed` config must be a compiled candidate of its family.
fn check_choice(family: Family, choice: Choice) -> Result<()> {
    match choice {
        Choice::Fixed(c) if !family.candidates().contains(&c) => {
            Err(Error::Config(format!("{c:?} is not a compiled candidate of {family:?}")))
        }
        _ => Ok(()),
    }
}

/// Temperature finite and > 0; returns its inverse.
pub(crate) fn temperature(t: f32) -> Result<f32> {
    if !(t.is_finite() && t > 0.0) {
        return Err(Error::Temperature(t));
    }
    Ok(1.0 / t)
}

/// Everything a forward call is given.
#[derive(Clone, Debug)]
pub struct FwdCall {
    pub problem: Problem,
    pub shard: Shard,
    /// Called through `forward_tp` (a communicator is given).
    pub tp: bool,
    pub h: Buf,
    pub w: Buf,
    pub labels: Buf,
    pub logprob: Buf,
    pub lse: Buf,
    pub entropy: Option<Buf>,
    /// The kept logits' buffer (f32, [`crate::keep`]).
    pub kept: Option<Buf>,
}

/// Rows a forward call keeps ([`crate::keep::rows`] of its budget and local vocabulary), with
/// its buffer checked: given where rows are kept, at least [`crate::keep::rows_len`] elements,
/// 16-byte aligned.
pub fn kept_rows(c: &FwdCall, opts: &FwdOptions) -> Result<usize> {
    let p = c.problem;
    let rows = crate::keep::rows(p.t, p.v, opts.keep_logits);
    if rows == 0 {
        return Ok(0);
    }
    if opts.naive() {
        return Err(Error::Invalid("the naive forward keeps no logits (keep_logits must be 0)".into()));
    }
    let Some(k) = &c.kept else {
        return Err(Error::Invalid(format!(
            "keep_logits = {} bytes keeps {rows} rows: give the kept-logits buffer ({} f32, lmhead::keep::len)",
            opts.keep_logits,
            crate::keep::rows_len(rows, p.v)
        )));
    };
    kept_buf(k, rows, p.v)?;
    Ok(rows)
}

/// A kept-logits buffer of `rows` rows over a local vocabulary of `v`: long enough, 16-byte
/// aligned (the backward reads it in 16-byte vectors).
fn kept_buf(k: &Buf, rows: usize, v: usize) -> Result<()> {
    let need = crate::keep::rows_len(rows, v);
    if k.len < need {
        return Err(Error::Length { what: k.what, expected: need, got: k.len });
    }
    if !k.ptr.is_multiple_of(16) {
        return Err(Error::Misaligned { what: k.what, align: 16 });
    }
    Ok(())
}

/// Validate a forward call; returns `1 / temperature`.
pub fn fwd(c: &FwdCall, opts: &FwdOptions) -> Result<f32> {
    let p = c.problem;
    p.check()?;
    c.shard.check(p.v)?;
    let inv_temp = temperature(opts.temperature)?;
    if opts.naive() && (c.tp || c.shard.v_begin != 0 || c.shard.v_total != p.v) {
        return Err(Error::Invalid("the naive kernel has no tensor-parallel mode".into()));
    }
    let family = if c.entropy.is_some() { Family::FwdEnt } else { Family::Fwd };
    check_choice(family, opts.choice())?;
    inputs(p, &c.h, &c.w, &c.labels)?;
    c.logprob.exact(p.t, 4)?;
    c.lse.exact(p.t, 4)?;
    if let Some(e) = &c.entropy {
        e.exact(p.t, 4)?;
    }
    let kept = kept_rows(c, opts)?;
    let kept_buf = if kept > 0 { c.kept.map(|k| Buf { len: crate::keep::rows_len(kept, p.v), ..k }) } else { None };
    let outs: Vec<Buf> = [Some(c.logprob), Some(c.lse), c.entropy, kept_buf].into_iter().flatten().collect();
    no_overlap(&outs, &[c.h, c.w, c.labels])?;
    Ok(inv_temp)
}

/// `h [t][d]`, `W [v][d]` (16-byte aligned rows for `cp.async` and TMA) and labels `[t]`.
fn inputs(p: Problem, h: &Buf, w: &Buf, labels: &Buf) -> Result<()> {
    h.exact(p.t * p.d, 16)?;
    w.exact(p.v * p.d, 16)?;
    labels.exact(p.t, labels.elem)
}

/// Everything a backward call is given. `dw: None` skips the `dW` GEMM (a frozen head).
#[derive(Clone, Debug)]
pub struct BwdCall {
    pub problem: Problem,
    pub shard: Shard,
    pub h: Buf,
    pub w: Buf,
    pub labels: Buf,
    pub lse: Buf,
    pub entropy: Option<Buf>,
    pub grad_logprob: Option<Buf>,
    pub grad_entropy: Option<Buf>,
    /// `dh` (element size 2 for bf16, 4 for f32).
    pub dh: Buf,
    pub dw: Option<Buf>,
    /// The forward's kept logits and how many rows they hold ([`crate::keep::Kept`]).
    pub kept: Option<(Buf, usize)>,
}

/// Validate a backward call; returns `1 / temperature`.
pub fn bwd(c: &BwdCall, opts: &BwdOptions) -> Result<f32> {
    let p = c.problem;
    p.check()?;
    c.shard.check(p.v)?;
    let inv_temp = temperature(opts.temperature)?;
    if c.grad_entropy.is_some() && c.entropy.is_none() {
        return Err(Error::Invalid("an entropy gradient needs the entropy saved by the forward".into()));
    }
    if opts.chunk == Some(0) {
        return Err(Error::Invalid("chunk width must be ≥ 1".into()));
    }
    let fam_dl = if c.grad_entropy.is_some() { Family::BwdDlogitsEnt } else { Family::BwdDlogits };
    let configs = opts.configs();
    check_choice(fam_dl, configs.dlogits)?;
    check_choice(Family::BwdDh, configs.dh)?;
    check_choice(Family::BwdDw, configs.dw)?;
    inputs(p, &c.h, &c.w, &c.labels)?;
    c.lse.exact(p.t, 4)?;
    for b in [c.grad_logprob, c.entropy, c.grad_entropy].iter().flatten() {
        b.exact(p.t, 4)?;
    }
    // f32 gradients are read and written as pairs (8 bytes), bf16 ones as pairs (4 bytes).
    c.dh.exact(p.t * p.d, 2 * c.dh.elem)?;
    if let Some(dw) = &c.dw {
        dw.exact(p.v * p.d, 2 * dw.elem)?;
    }
    let mut kept_in = None;
    if let Some((k, rows)) = c.kept {
        if rows > p.t {
            return Err(Error::Invalid(format!("the kept logits hold {rows} rows, the call has {}", p.t)));
        }
        if rows != p.t && !rows.is_multiple_of(crate::keep::ROW_ALIGN) {
            return Err(Error::Invalid(format!(
                "kept rows ({rows}) must be all t = {} rows or a multiple of {} (a forward's FwdReport::kept_rows)",
                p.t,
                crate::keep::ROW_ALIGN
            )));
        }
        kept_buf(&k, rows, p.v)?;
        kept_in = (rows > 0).then_some(Buf { len: crate::keep::rows_len(rows, p.v), ..k });
    }
    let outs: Vec<Buf> = [Some(c.dh), c.dw].into_iter().flatten().collect();
    let ins: Vec<Buf> = [Some(c.h), Some(c.w), Some(c.labels), Some(c.lse), c.entropy, c.grad_logprob, c.grad_entropy, kept_in]
        .into_iter()
        .flatten()
        .collect();
    no_overlap(&outs, &ins)?;
    Ok(inv_temp)
}

/// Token counts, vocab and hidden size of a warm-up: every shape valid before any is tuned.
pub fn warm_up(token_counts: &[usize], v: usize, d: usize) -> Result<()> {
    for &t in token_counts {
        Problem::new(t, v, d).check()?;
    }
    Ok(())
}
