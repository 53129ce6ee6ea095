//! The backward pass: `dh [t, d]` and `dW [v, d]` from the upstream gradients of log-prob and/or
//! entropy, without the `t × v` matrix.
//!
//! The vocab is walked in chunks of width `S = min(v, chunk)` (default [`auto_chunk`]'s width
//! spread evenly, [`balanced_chunk`]). Per
//! chunk, three launches on one stream:
//! 1. `dlogits`: recompute the `t × S` logits on the tensor cores and write bf16 d-logits into
//!    the staging buffer `[t][S₈]` (`S₈` = S rounded up to 8; padding columns are zeros);
//! 2. `dh (+)= dlogits · W_chunk` (f32 accumulator across chunks; the last chunk writes the
//!    caller's `dh`, rounding to bf16 if asked; a `tma_store` config adds every chunk into the
//!    accumulator by TMA and a bf16 `dh` is cast once at the end);
//! 3. `dW_chunk = dlogitsᵀ · h`, written straight into the caller's `dW` rows of the chunk.
//!
//! The staging buffer is sized for the actual chunk width (`t · S₈` bf16), lives in the
//! workspace and is reused across chunks and calls ([`LmHead::release_workspace`] frees it).
//! With an f32 `dh` the caller's buffer is the accumulator; with bf16 `dh` an f32 `t × d`
//! accumulator is added to the workspace.
//!
//! **Determinism.** No atomics: every output element is written by one thread in a fixed order,
//! so `dh` and `dW` are bitwise identical across runs of the same config and chunk width
//! (changing either changes the summation order).

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use lmhead_core::config::{Family, TileConfig};
use lmhead_core::Problem;

use crate::error::{Context as _, Error, Result};
use crate::launch::{self, dev_in, dev_out, Chunk, Dev, Dims, DlogitsIn, GemmC, GemmIn, GemmOut, LogitsIn, Scalars};
use crate::tp::{Communicator, ReduceDh, Shard, TpBackward};
use crate::tune::{Choice, TuneKey};
use crate::validate;
use crate::workspace::{zeros, Side};
use crate::{bf16, LabelType, LmHead};

/// The staging buffer the automatic chunk width aims for: `t · S` bf16 within 512 MiB.
pub const STAGING_BUDGET_BYTES: usize = 512 << 20;
/// The narrowest automatic chunk: below it the chunk's launches and `dh` accumulator passes
/// cost more than a few percent (docs/PERFORMANCE.md), so long sequences go over the budget
/// rather than below this (`t · 16 KiB`: 1 GiB at t = 65536).
pub const MIN_AUTO_CHUNK: usize = 8192;
/// The widest automatic chunk (32768 columns: fwd+bwd 4–9% faster than 8192 at t ≤ 8192 in the
/// bench; 65536, measured once at t = 4096, landed within the spread of the 32768 runs).
pub const MAX_AUTO_CHUNK: usize = 32768;

/// The chunk width a backward of `t` tokens and hidden size `d` uses unless `BwdOptions::chunk`
/// says otherwise. For `d` a power of two: the widest power of two whose staging fits
/// [`STAGING_BUDGET_BYTES`], clamped to [`MIN_AUTO_CHUNK`] ..= [`MAX_AUTO_CHUNK`] (32768 up to
/// t = 8192, 16384 at 16384, 8192 from 32768 tokens on): fewer, wider chunks mean fewer passes
/// over `dh`'s f32 accumulator and larger GEMMs per launch. For any other `d`: 8192.
///
/// An empirical rule, from fwd+bwd on the H200 (docs/PERFORMANCE.md, "What limits each kernel"): the wide
/// chunk ran 4–9% faster than 8192 at d = 4096 and 8192 (several runs), but 11–15% slower at
/// d = 5120 (t = 8192, local v = 38016: 5.25× and 5.31× a GEMM against 4.45–4.62×; t = 16384:
/// 4.76–4.93× against 4.54–4.65×), for a reason not found yet. Choosing by the autotuner's
/// kernel timings was tried and measured wrong (short trials run at burst clocks and favour the
/// narrow width).
pub fn auto_chunk(t: usize, d: usize) -> usize {
    if !d.is_power_of_two() {
        return MIN_AUTO_CHUNK;
    }
    let fit = STAGING_BUDGET_BYTES / (2 * t.max(1));
    let pow2 = if fit == 0 { 1 } else { 1usize << fit.ilog2() };
    pow2.clamp(MIN_AUTO_CHUNK, MAX_AUTO_CHUNK)
}

/// The chunk width a backward over `v` columns uses when the caller gave none and
/// [`auto_chunk`] says `width`: the `ceil(v / width)` chunks that width needs, made equal up to a
/// multiple of 256 columns (the widest tile), never wider than `width`. A narrow last chunk runs
/// its GEMMs as a short tail: at 131072 × 19008 × 5120, chunks of 8192, 8192 and 2624 columns
/// took the training step 177 ms, three of 6400 160 ms (docs/PERFORMANCE.md).
pub fn balanced_chunk(v: usize, width: usize) -> usize {
    if v <= width {
        return v;
    }
    v.div_ceil(v.div_ceil(width)).next_multiple_of(256).min(width)
}

/// Inputs of a backward call.
pub struct BwdInputs<'a, L: LabelType> {
    pub h: &'a dyn DevicePtr<bf16>,
    pub w: &'a dyn DevicePtr<bf16>,
    pub labels: &'a dyn DevicePtr<L>,
    /// Saved by the forward: log-sum-exp `[t]`.
    pub lse: &'a dyn DevicePtr<f32>,
    /// Saved by the forward: entropy `[t]` (needed when `grad_entropy` is given).
    pub entropy: Option<&'a dyn DevicePtr<f32>>,
    /// Upstream gradient of log-prob `[t]`.
    pub grad_logprob: Option<&'a dyn DevicePtr<f32>>,
    /// Upstream gradient of entropy `[t]`.
    pub grad_entropy: Option<&'a dyn DevicePtr<f32>>,
    pub problem: Problem,
}

/// A gradient output in bf16 or f32.
pub enum GradOut<'a> {
    Bf16(&'a mut dyn DevicePtrMut<bf16>),
    F32(&'a mut dyn DevicePtrMut<f32>),
}

/// Options of the backward pass.
#[derive(Clone, Debug)]
pub struct BwdOptions {
    /// Must match the forward's.
    pub temperature: f32,
    pub ignore_index: i64,
    /// Vocab chunk width (staging columns); `None` (the default): [`auto_chunk`] of the token
    /// count and hidden size, spread evenly over the chunks it needs ([`balanced_chunk`]).
    pub chunk: Option<usize>,
    /// Config choices of the d-logits kernel and the two GEMMs.
    pub config: BwdConfigs,
}

/// How each backward kernel's config is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BwdConfigs {
    pub dlogits: Choice,
    pub dh: Choice,
    pub dw: Choice,
}

impl BwdConfigs {
    /// The same choice for all three (`Auto` or `Fallback`).
    pub const fn all(c: Choice) -> Self {
        Self { dlogits: c, dh: c, dw: c }
    }
}

impl Default for BwdOptions {
    fn default() -> Self {
        Self { temperature: 1.0, ignore_index: lmhead_reference::IGNORE_INDEX, chunk: None, config: BwdConfigs::all(Choice::Auto) }
    }
}

/// What a backward call did.
#[derive(Clone, Debug, PartialEq)]
pub struct BwdReport {
    pub dlogits: TileConfig,
    pub dh: TileConfig,
    /// `None` when `dW` was not asked for.
    pub dw: Option<TileConfig>,
    pub chunk: usize,
    pub chunks: usize,
    /// Each chunk's `dW` GEMM ran on the library's side stream beside its `dh` GEMM (the
    /// default when `dW` is asked for; `LMHEAD_BWD_OVERLAP=0` runs it after `dh`).
    pub dw_beside_dh: bool,
    /// Bytes of workspace the call used (staging + accumulator).
    pub workspace_bytes: usize,
}

/// Staging stride for a chunk width: a multiple of 8 (16-byte rows).
fn stride_of(chunk: usize) -> usize {
    chunk.next_multiple_of(8)
}

struct Out<'a> {
    dev: Dev<'a>,
    f32: bool,
}

/// The validated inputs of a backward call, as device buffers: the logits operands and what the
/// d-logits read besides.
#[derive(Clone, Copy)]
struct BwdDev<'a, 'b> {
    p: Problem,
    x: LogitsIn<'a, 'b>,
    g: DlogitsIn<'a, 'b>,
}

fn grad_out<'a>(g: &'a mut GradOut<'_>, stream: &'a CudaStream, what: &'static str) -> Result<Out<'a>> {
    Ok(match g {
        GradOut::Bf16(b) => Out { dev: dev_out(&mut **b, stream, what)?, f32: false },
        GradOut::F32(b) => Out { dev: dev_out(&mut **b, stream, what)?, f32: true },
    })
}

impl LmHead {
    /// The backward. Either upstream gradient may be absent (both absent: zero gradients).
    /// `dw: None` skips the `dW` GEMM and its tuning (a frozen output embedding, LoRA).
    pub fn backward<L: LabelType>(
        &self,
        stream: &Arc<CudaStream>,
        x: &BwdInputs<'_, L>,
        opts: &BwdOptions,
        dh: GradOut<'_>,
        dw: Option<GradOut<'_>>,
    ) -> Result<BwdReport> {
        self.backward_impl(stream, x, None, opts, dh, dw)
    }

    /// The backward on the whole vocabulary, or with `tp` on this rank's shard
    /// ([`LmHead::backward_tp`], whose steps are in [`crate::tp`]).
    pub(crate) fn backward_impl<L: LabelType>(
        &self,
        stream: &Arc<CudaStream>,
        x: &BwdInputs<'_, L>,
        tp: Option<TpBackward<'_>>,
        opts: &BwdOptions,
        mut dh: GradOut<'_>,
        mut dw: Option<GradOut<'_>>,
    ) -> Result<BwdReport> {
        let p = x.problem;
        let shard = tp.map_or(Shard::whole(p.v), |tp| tp.shard);
        let reduce_dh = tp.and_then(|tp| (tp.reduce == ReduceDh::AllReduce).then_some(tp.comm));
        self.check_stream(stream)?;
        let h = dev_in(x.h, stream, "h")?;
        let w = dev_in(x.w, stream, "W")?;
        let labels = L::labels(x.labels, stream)?;
        let lse = dev_in(x.lse, stream, "lse")?;
        let entropy = x.entropy.map(|e| dev_in(e, stream, "entropy")).transpose()?;
        let gl = x.grad_logprob.map(|g| dev_in(g, stream, "grad_logprob")).transpose()?;
        let ge = x.grad_entropy.map(|g| dev_in(g, stream, "grad_entropy")).transpose()?;
        let dh = grad_out(&mut dh, stream, "dh")?;
        let dw = match dw.as_mut() {
            Some(g) => Some(grad_out(g, stream, "dW")?),
            None => None,
        };
        // Everything about the call is checked here, before the tuner or any launch.
        let call = validate::BwdCall {
            problem: p,
            shard,
            h: h.buf(2),
            w: w.buf(2),
            labels: labels.buf(),
            lse: lse.buf(4),
            entropy: entropy.as_ref().map(|e| e.buf(4)),
            grad_logprob: gl.as_ref().map(|g| g.buf(4)),
            grad_entropy: ge.as_ref().map(|g| g.buf(4)),
            dh: dh.dev.buf(if dh.f32 { 4 } else { 2 }),
            dw: dw.as_ref().map(|o| o.dev.buf(if o.f32 { 4 } else { 2 })),
        };
        let inv_temp = validate::bwd(&call, opts)?;
        let sc = Scalars { inv_temp, ignore_index: opts.ignore_index, v_begin: shard.v_begin as i64 };
        let ent = match (ge, entropy) {
            (Some(g), Some(e)) => Some((g, e)),
            _ => None,
        };
        let x = BwdDev {
            p,
            x: LogitsIn { dims: Dims { t: p.t, v: p.v, d: p.d }, sc, h: &h, w: &w, labels: &labels },
            g: DlogitsIn { lse: &lse, grad_logprob: gl.as_ref(), ent: ent.as_ref().map(|(a, b)| (a, b)) },
        };
        self.backward_dev(stream, opts, reduce_dh, &x, &dh, dw.as_ref())
    }

    fn backward_dev(
        &self,
        stream: &Arc<CudaStream>,
        opts: &BwdOptions,
        reduce_dh: Option<&dyn Communicator>,
        x: &BwdDev,
        dh: &Out,
        dw: Option<&Out>,
    ) -> Result<BwdReport> {
        let p = x.p;
        let (h, w) = (x.x.h, x.x.w);
        // The configs are tuned (and looked up) at the nominal width, the table's keys; the
        // automatic width is then spread evenly over the chunks it needs.
        let nominal = opts.chunk.unwrap_or_else(|| auto_chunk(p.t, p.d)).min(p.v);
        let tp = x.x.sc.v_begin != 0 || reduce_dh.is_some();
        let (cfg_dl, cfg_dh, cfg_dw) = self.bwd_configs(stream, opts.config, nominal, tp, x, dw.is_some())?;
        let chunk = match opts.chunk {
            Some(_) => nominal,
            None => balanced_chunk(p.v, nominal),
        };
        let stride = stride_of(chunk);
        let chunks = p.v.div_ceil(chunk);
        let capture = crate::capture::capturing(stream)?;
        let mut guard = self.call_ws(capture);
        let overlap = dw.is_some() && crate::plan::overrides::Overrides::get().bwd_overlap != Some(false);
        {
            let ws = &mut *guard;
            // dW beside dh (one chunk's two GEMMs read the same staging and write disjoint
            // outputs): on the side stream after the chunk's d-logits, joined back before the
            // next chunk's d-logits overwrite the staging buffer.
            let side = if overlap { Some(Side::of(&mut ws.side, stream)?) } else { None };
            if let (true, Some(s)) = (capture, side) {
                // Under capture the side stream joins the capture here, before its first tensor
                // maps are copied (`launch::bwd_gemm_after` copies them before it waits for the
                // chunk's d-logits): the copies are recorded into the graph too.
                s.ready.record(stream).during(|| "recording the capture's fork event".into())?;
                s.stream.wait(&s.ready).during(|| "joining the dW stream to the capture".into())?;
            }
            let src = &mut ws.src;
            let staging = ws.staging.get(src, stream, p.t * stride)?;
            let staging = dev_out(staging, stream, "staging")?;
            let g = Gemms { gpu: &self.gpu, stream, p, stride, w, h };
            // The f32 accumulator of dh: the caller's buffer when f32, else the workspace's
            // (not needed for a single chunk written straight to bf16 without reduction).
            let reduce_bf16 = reduce_dh.is_some() && !dh.f32;
            let acc_buf;
            let acc: &Dev = if dh.f32 || (chunks == 1 && !reduce_bf16) {
                &dh.dev
            } else {
                acc_buf = dev_out(ws.dh_acc.get(src, stream, p.t * p.d)?, stream, "dh accumulator")?;
                &acc_buf
            };
            // A `tma_store` dh adds each chunk into the f32 accumulator by TMA; the last chunk of a
            // bf16 dh is added too and the sum cast once (cheaper than that chunk's register
            // epilogue, which reads the accumulator: `lmhead-bench dh-probe`).
            let cast_at_end = !dh.f32 && !reduce_bf16 && chunks > 1 && cfg_dh.mainloop.tma_store();
            let looped = (0..chunks).try_for_each(|c| -> Result<()> {
                let c0 = c * chunk;
                let cw = chunk.min(p.v - c0);
                launch::bwd_dlogits(&self.gpu, stream, cfg_dl, &x.x, Chunk { begin: c0, width: cw, stride }, &x.g, &staging)?;
                // dW[c0 .. c0 + cw] = staging[:, :cw]ᵀ · h, queued first: on the side stream
                // its blocks take the SMs first, and dh's fill those its last wave leaves.
                if let Some(dw) = dw {
                    let elem = if dw.f32 { 4 } else { 2 };
                    let dw_chunk = dw.dev.sub(c0 * p.d, cw * p.d, elem)?;
                    let mode = GemmOut { accumulate: false, write_acc: false, out_f32: dw.f32 };
                    match side {
                        Some(s) => {
                            s.ready.record(stream).during(|| "recording the d-logits event".into())?;
                            g.dw_on(&s.stream, Some(&s.ready), cfg_dw, cw, &staging, &dw_chunk, mode)?;
                            s.done.record(&s.stream).during(|| "recording the dW event".into())?;
                        }
                        None => g.dw(cfg_dw, cw, &staging, &dw_chunk, mode)?,
                    }
                }
                // dh (+)= staging[:, :cw] · W[c0 .. c0 + cw]
                let first = c == 0;
                let last = c + 1 == chunks;
                // With a reduction, bf16 dh stays in the f32 accumulator until after the SUM.
                let straight_to_bf16 = !dh.f32 && last && !reduce_bf16 && !cast_at_end;
                let mode = GemmOut { accumulate: !first, write_acc: !straight_to_bf16, out_f32: dh.f32 };
                let out = straight_to_bf16.then_some(&dh.dev);
                g.dh(cfg_dh, (c0, cw), &staging, Some(acc), out, mode)?;
                if let Some(s) = side {
                    stream.wait(&s.done).during(|| "joining the dW stream".into())?;
                }
                Ok(())
            });
            if let (Err(_), Some(s)) = (&looped, side) {
                // The call's stream may not have joined a dW that reads the staging buffer (which
                // goes back to a caller's allocator ordered on the call's stream only): wait here.
                let _ = s.stream.synchronize();
            }
            looped?;
            if cast_at_end {
                launch::cast_f32_bf16(&self.gpu, stream, p.t * p.d, acc, &dh.dev)?;
            }
            if let Some(comm) = reduce_dh {
                crate::tp::reduce_dh(&self.gpu, stream, comm, p.t * p.d, acc, reduce_bf16.then_some(&dh.dev))?;
            }
        }
        let workspace_bytes = guard.staging.bytes() + guard.dh_acc.bytes();
        Ok(BwdReport { dlogits: cfg_dl, dh: cfg_dh, dw: dw.map(|_| cfg_dw), chunk, chunks, dw_beside_dh: overlap, workspace_bytes })
    }

    /// Configs of the three backward kernels (the `dW` one is the fallback, untuned, when
    /// `with_dw` is false). Tuning trials write only scratch buffers.
    fn bwd_configs(
        &self,
        stream: &Arc<CudaStream>,
        choice: BwdConfigs,
        chunk: usize,
        tp: bool,
        x: &BwdDev,
        with_dw: bool,
    ) -> Result<(TileConfig, TileConfig, TileConfig)> {
        let p = x.p;
        let (h, w) = (x.x.h, x.x.w);
        let fam_dl = if x.g.ent.is_some() { Family::BwdDlogitsEnt } else { Family::BwdDlogits };
        let choice = if with_dw { choice } else { BwdConfigs { dw: Choice::Fallback, ..choice } };
        let stride = stride_of(chunk);
        let whole = Chunk { begin: 0, width: chunk, stride };
        // The keys: the caller's token count. The trials, in table mode: its first rows only,
        // as the forward's (`crate::fwd::TRIAL_ROWS`): 32768 rows are already two waves of
        // tiles, and the GEMMs' time per row (or, for dW, per k step) does not change beyond
        // that. Exhaustive tuning (how the table is made) times the real shape.
        let chunk_problem = Problem::new(p.t, chunk, p.d);
        let rows = if self.tuner.mode() == crate::tune::Mode::Table { p.t.min(crate::fwd::TRIAL_ROWS) } else { p.t };
        let sliced = rows < p.t;
        let p = Problem::new(rows, p.v, p.d);
        let h = &h.sub(0, p.t * p.d, 2)?;
        let labels = &x.x.labels.rows(p.t)?;
        let lse = &x.g.lse.sub(0, p.t, 4)?;
        let gl = x.g.grad_logprob.map(|g| g.sub(0, p.t, 4)).transpose()?;
        let ent = x.g.ent.map(|(e, g)| Ok::<_, Error>((e.sub(0, p.t, 4)?, g.sub(0, p.t, 4)?))).transpose()?;
        let x = &BwdDev {
            p,
            x: LogitsIn { dims: Dims { t: p.t, v: p.v, d: p.d }, sc: x.x.sc, h, w, labels },
            g: DlogitsIn { lse, grad_logprob: gl.as_ref(), ent: ent.as_ref().map(|(e, g)| (e, g)) },
        };
        let needs_tuning = self.tuner.enabled()
            && [(fam_dl, choice.dlogits), (Family::BwdDh, choice.dh), (Family::BwdDw, choice.dw)]
                .iter()
                .any(|&(f, c)| c == Choice::Auto && self.tuner.entry(&TuneKey::new(f, chunk_problem, tp)).is_none());
        // Scratch for the trials (allocated only when something is tuned).
        let mut scratch = if needs_tuning {
            Some((
                zeros::<bf16>(stream, p.t * stride, "tuning staging")?,
                zeros::<f32>(stream, p.t * p.d, "tuning dh")?,
                zeros::<bf16>(stream, if with_dw { chunk * p.d } else { 1 }, "tuning dW")?,
            ))
        } else {
            None
        };
        let cfg_dl = self.tuner.pick_sliced(&TuneKey::new(fam_dl, chunk_problem, tp), choice.dlogits, sliced, &mut |cfg| {
            let (st, _, _) = scratch.as_mut().ok_or_else(|| Error::Config("no tuning scratch".into()))?;
            let ms = crate::tune::bench::time_ms(stream, || {
                let sd = dev_out(&mut *st, stream, "tuning staging")?;
                launch::bwd_dlogits(&self.gpu, stream, cfg, &x.x, whole, &x.g, &sd)
            })?;
            Ok(crate::tune::Trial { ms, check: sample_dtoh(stream, &*st, "tuning staging", |x| x.to_f64())? })
        })?;
        // The GEMM trials read the staging buffer the fallback d-logits left in scratch.
        if let Some((st, _, _)) = scratch.as_mut() {
            let sd = dev_out(&mut *st, stream, "tuning staging")?;
            launch::bwd_dlogits(&self.gpu, stream, cfg_dl, &x.x, whole, &x.g, &sd)?;
        }
        let cfg_dh = self.tuner.pick_sliced(&TuneKey::new(Family::BwdDh, chunk_problem, tp), choice.dh, sliced, &mut |cfg| {
            let (st, acc, _) = scratch.as_mut().ok_or_else(|| Error::Config("no tuning scratch".into()))?;
            let ms = crate::tune::bench::time_ms(stream, || {
                let sd = dev_in(&*st, stream, "tuning staging")?;
                let ad = dev_out(&mut *acc, stream, "tuning dh")?;
                let g = Gemms { gpu: &self.gpu, stream, p, stride, w, h };
                g.dh(cfg, (0, chunk), &sd, Some(&ad), None, GemmOut { accumulate: false, write_acc: true, out_f32: true })
            })?;
            Ok(crate::tune::Trial { ms, check: sample_dtoh(stream, &*acc, "tuning dh", f64::from)? })
        })?;
        let cfg_dw = self.tuner.pick_sliced(&TuneKey::new(Family::BwdDw, chunk_problem, tp), choice.dw, sliced, &mut |cfg| {
            let (st, _, out) = scratch.as_mut().ok_or_else(|| Error::Config("no tuning scratch".into()))?;
            let ms = crate::tune::bench::time_ms(stream, || {
                let sd = dev_in(&*st, stream, "tuning staging")?;
                let od = dev_out(&mut *out, stream, "tuning dW")?;
                let g = Gemms { gpu: &self.gpu, stream, p, stride, w, h };
                g.dw(cfg, chunk, &sd, &od, GemmOut { accumulate: false, write_acc: false, out_f32: false })
            })?;
            Ok(crate::tune::Trial { ms, check: sample_dtoh(stream, &*out, "tuning dW", |x| x.to_f64())? })
        })?;
        Ok((cfg_dl, cfg_dh, cfg_dw))
    }
}

/// Runs of consecutive elements [`sample_dtoh`] reads, and their length.
const SAMPLE_RUNS: usize = 64;
const SAMPLE_RUN: usize = 64;

/// What a tuning trial's output is checked by: [`SAMPLE_RUNS`] runs of [`SAMPLE_RUN`] consecutive
/// elements at evenly spaced offsets of `buf` (all of it when smaller), as f64. Read with that
/// many small copies: the whole buffer is hundreds of MiB at wide chunks (the staging buffer is
/// 512 MiB at t = 8192, S = 32768), and copying and converting it per candidate took longer
/// than the candidate's timing.
fn sample_dtoh<T: cudarc::driver::DeviceRepr + Copy>(
    stream: &Arc<CudaStream>,
    buf: &cudarc::driver::CudaSlice<T>,
    what: &'static str,
    to_f64: impl Fn(T) -> f64,
) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(SAMPLE_RUNS * SAMPLE_RUN);
    for run in sample_runs(buf.len()) {
        let host = stream.clone_dtoh(&buf.slice(run)).during(|| format!("reading {what}"))?;
        out.extend(host.into_iter().map(&to_f64));
    }
    Ok(out)
}

/// The element ranges [`sample_dtoh`] reads from a buffer of `n`: one range over everything
/// when `n ≤ SAMPLE_RUNS · SAMPLE_RUN`, else [`SAMPLE_RUNS`] disjoint runs from the first
/// element to the last.
fn sample_runs(n: usize) -> Vec<std::ops::Range<usize>> {
    if n <= SAMPLE_RUNS * SAMPLE_RUN {
        return std::iter::once(0..n).collect();
    }
    let gap = (n - SAMPLE_RUN) / (SAMPLE_RUNS - 1);
    (0..SAMPLE_RUNS).map(|r| r * gap..r * gap + SAMPLE_RUN).collect()
}

/// The two backward GEMMs of a chunk, on the operands as stored: the staging buffer, `W` and
/// `h` (the `mma.sync` configs through their own bounds-checked loads, the sm90 ones through
/// tensor maps).
struct Gemms<'a> {
    gpu: &'a crate::device::Gpu,
    stream: &'a Arc<CudaStream>,
    p: Problem,
    stride: usize,
    w: &'a Dev<'a>,
    h: &'a Dev<'a>,
}

impl Gemms<'_> {
    /// `dh (+)= staging[:, :cw] · W[c0 .. c0 + cw]`.
    fn dh(
        &self,
        cfg: TileConfig,
        (c0, cw): (usize, usize),
        staging: &Dev,
        acc: Option<&Dev>,
        out: Option<&Dev>,
        mode: GemmOut,
    ) -> Result<()> {
        let (p, stride) = (self.p, self.stride);
        let w_chunk = self.w.sub(c0 * p.d, cw * p.d, 2)?;
        let g = GemmIn { m: p.t, n: p.d, k: cw, a: staging, a_stride: stride, b: &w_chunk, b_stride: p.d };
        launch::bwd_gemm(self.gpu, self.stream, Family::BwdDh, cfg, &g, &GemmC { acc, out, mode })
    }

    /// `dW_chunk = staging[:, :cw]ᵀ · h` into `out` (`[cw][d]`), on `stream` (the call's, or
    /// the side stream after the event `after`).
    #[allow(clippy::too_many_arguments)]
    fn dw_on(
        &self,
        stream: &Arc<CudaStream>,
        after: Option<&CudaEvent>,
        cfg: TileConfig,
        cw: usize,
        staging: &Dev,
        out: &Dev,
        mode: GemmOut,
    ) -> Result<()> {
        let (p, stride) = (self.p, self.stride);
        let g = GemmIn { m: cw, n: p.d, k: p.t, a: staging, a_stride: stride, b: self.h, b_stride: p.d };
        launch::bwd_gemm_after(self.gpu, stream, Family::BwdDw, cfg, &g, &GemmC { acc: None, out: Some(out), mode }, after)
    }

    /// [`Gemms::dw_on`] on the call's stream.
    fn dw(&self, cfg: TileConfig, cw: usize, staging: &Dev, out: &Dev, mode: GemmOut) -> Result<()> {
        self.dw_on(self.stream, None, cfg, cw, staging, out, mode)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_samples_span_the_buffer_in_disjoint_runs() {
        assert_eq!(sample_runs(10), std::iter::once(0..10).collect::<Vec<_>>());
        assert_eq!(sample_runs(SAMPLE_RUNS * SAMPLE_RUN), std::iter::once(0..SAMPLE_RUNS * SAMPLE_RUN).collect::<Vec<_>>());
        for n in [SAMPLE_RUNS * SAMPLE_RUN + 1, 100_000, 8192 * 32768] {
            let runs = sample_runs(n);
            assert_eq!(runs.len(), SAMPLE_RUNS);
            assert_eq!(runs[0].start, 0);
            assert!(runs.iter().all(|r| r.len() == SAMPLE_RUN && r.end <= n));
            assert!(runs.windows(2).all(|w| w[0].end <= w[1].start), "disjoint, in order");
            assert!(runs[SAMPLE_RUNS - 1].end + SAMPLE_RUNS > n, "the last run reaches the end: {n}");
        }
    }

    #[test]
    fn automatic_chunk_fits_the_staging_budget_within_its_bounds() {
        let d = 4096;
        assert_eq!(auto_chunk(1, d), MAX_AUTO_CHUNK);
        assert_eq!(auto_chunk(4096, d), 32768);
        assert_eq!(auto_chunk(8192, d), 32768, "512 MiB of staging at t = 8192");
        assert_eq!(auto_chunk(8193, d), 16384);
        assert_eq!(auto_chunk(16384, d), 16384);
        assert_eq!(auto_chunk(32768, d), 8192);
        assert_eq!(auto_chunk(1 << 20, d), MIN_AUTO_CHUNK, "never narrower than the minimum");
        for t in [1, 100, 5000, 8192, 12345, 16384, 20000] {
            let s = auto_chunk(t, d);
            assert!(s.is_power_of_two() && (MIN_AUTO_CHUNK..=MAX_AUTO_CHUNK).contains(&s));
            assert!(2 * t * s <= STAGING_BUDGET_BYTES || s == MIN_AUTO_CHUNK, "t {t}: {s}");
        }
        // Hidden sizes other than powers of two keep the narrow chunk (measured faster at 5120).
        for d in [5120, 3072, 1000] {
            assert_eq!(auto_chunk(8192, d), MIN_AUTO_CHUNK, "d {d}");
        }
        assert_eq!(auto_chunk(8192, 2048), 32768);
        assert_eq!(auto_chunk(8192, 8192), 32768);
    }

    #[test]
    fn balanced_chunks_are_as_many_and_nearly_equal() {
        assert_eq!(balanced_chunk(19008, 8192), 6400, "8192 + 8192 + 2624 → 6400 + 6400 + 6208");
        assert_eq!(balanced_chunk(38016, 8192), 7680);
        assert_eq!(balanced_chunk(4 * 8192, 8192), 8192);
        assert_eq!(balanced_chunk(5000, 8192), 5000);
        for width in [8192, 16384, 32768] {
            for v in (1..400_000).step_by(997) {
                let c = balanced_chunk(v, width);
                assert!(c <= width && c <= v, "v {v} width {width}: {c}");
                assert_eq!(v.div_ceil(c), v.div_ceil(width), "v {v} width {width}: {c}");
                let last = v - (v.div_ceil(c) - 1) * c;
                assert!(v <= width || last + 256 * v.div_ceil(c) > c, "v {v} width {width}: last {last} of {c}");
            }
        }
    }
}
