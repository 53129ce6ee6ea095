//! The backward pass: `dh [t, d]` and `dW [v, d]` from the upstream gradients of log-prob and/or
//! entropy, without the `t × v` matrix.
//!
//! The vocab is walked in chunks of width `S` (by default `lmhead_core::heuristics::chunk`: a
//! width by the token count and hidden size, spread evenly over the chunks it needs). Per chunk:
//! 1. `dlogits`: recompute the `t × S` logits on the tensor cores and write bf16 d-logits into
//!    the staging buffer `[t][S₈]` (`S₈` = S rounded up to 8; padding columns are zeros);
//! 2. `dW_chunk = dlogitsᵀ · h`, written straight into the caller's `dW` rows of the chunk — by
//!    default on the library's side stream, after an event that follows the d-logits, beside
//!    step 3 (`BwdOptions::dw_beside_dh`); the call's stream waits for it before the next chunk's
//!    d-logits overwrite the staging buffer;
//! 3. `dh (+)= dlogits · W_chunk` on the call's stream (f32 accumulator across chunks; the last
//!    chunk writes the caller's `dh`, rounding to bf16 if asked; a `tma_store` config adds every
//!    chunk into the accumulator with a TMA reduction and a bf16 `dh` is cast once at the end).
//!
//! The staging buffer is sized for the actual chunk width (`t · S₈` bf16), lives in the
//! workspace and is reused across chunks and calls ([`LmHead::release_workspace`] frees it).
//! With an f32 `dh` the caller's buffer is the accumulator; with bf16 `dh` an f32 `t × d`
//! accumulator is added to the workspace.
//!
//! **Determinism.** Every output element is written (or, by a `tma_store` `dh`, added with one
//! TMA reduction) by one block per chunk, in a fixed order within the block, and the chunks'
//! `dh` GEMMs run in order on one stream, so `dh` and `dW` are bitwise identical across runs of
//! the same configs and chunk width (changing either changes the summation order).

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream, DevicePtr, DevicePtrMut};
use lmhead_core::config::{Family, TileConfig};
use lmhead_core::heuristics;
use lmhead_core::Problem;

use crate::active::Compaction;
use crate::error::{Context as _, Error, Result};
use crate::launch::{self, dev_in, dev_out, Chunk, Dev, Dims, DlogitsIn, GemmC, GemmIn, GemmOut, KeptOut, Labels, LogitsIn, Scalars};
use crate::tp::{Communicator, ReduceDh, Shard, TpBackward};
use crate::tune::{Choice, TuneKey};
use crate::validate;
use crate::workspace::{zeros, Side};
use crate::{bf16, LabelType, LmHead};

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
    /// The logits the forward kept ([`crate::keep`]): the d-logits of those rows are formed from
    /// them instead of a recompute on the tensor cores. `None`: every row is recomputed.
    pub kept: Option<crate::keep::Kept<'a>>,
}

/// A gradient output in bf16 or f32.
pub enum GradOut<'a> {
    Bf16(&'a mut dyn DevicePtrMut<bf16>),
    F32(&'a mut dyn DevicePtrMut<f32>),
}

/// Options of the backward pass. Build them with `..Default::default()`: with the `testing`
/// feature (the workspace's tests and benches) they have a field of their own.
#[derive(Clone, Debug)]
pub struct BwdOptions {
    /// Must match the forward's.
    pub temperature: f32,
    pub ignore_index: i64,
    /// Vocab chunk width (staging columns); `None` (the default): the library's width for the
    /// token count and hidden size (32768 columns up to 8192 tokens for a power-of-two `d`, less
    /// beyond, by a 512 MiB staging budget; 8192 for other `d`), spread evenly over the chunks it
    /// needs.
    pub chunk: Option<usize>,
    /// Run each chunk's `dW` GEMM on the library's side stream beside its `dh` GEMM (default
    /// true: 0.5–1% of a training step faster on an H200). While a `dW` grid has blocks waiting,
    /// the GPU hands free SMs to them before the blocks of kernels on streams of the call's
    /// priority or lower, including work the caller overlaps with the backward on such streams;
    /// `false` runs `dW` after `dh` on the call's stream. Either way every output is ordered on
    /// the call's stream when the call returns.
    pub dw_beside_dh: bool,
    /// Config choices of the d-logits kernel and the two GEMMs.
    #[cfg(feature = "testing")]
    pub config: BwdConfigs,
    /// Whether only the active rows (label not `ignore_index` and a non-zero given upstream
    /// gradient) are computed, compacted into the workspace ([`Compaction`]; one small
    /// synchronous read for their count). Inactive rows get a zero `dh` row and no `dW`
    /// contribution, as in the dense call; but a non-finite input in a row whose gradients are
    /// zero no longer reaches `dh` and `dW` as NaN. Default [`Compaction::Auto`].
    pub compaction: Compaction,
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
        Self {
            temperature: 1.0,
            ignore_index: lmhead_reference::IGNORE_INDEX,
            chunk: None,
            dw_beside_dh: heuristics::DW_BESIDE_DH,
            #[cfg(feature = "testing")]
            config: BwdConfigs::all(Choice::Auto),
            compaction: Compaction::Auto,
        }
    }
}

impl BwdOptions {
    /// How the three configs are chosen: [`Choice::Auto`] unless a test says otherwise.
    pub(crate) fn configs(&self) -> BwdConfigs {
        #[cfg(feature = "testing")]
        return self.config;
        #[cfg(not(feature = "testing"))]
        BwdConfigs::all(Choice::Auto)
    }
}

/// What a backward call did.
#[derive(Clone, Debug, PartialEq)]
pub struct BwdReport {
    /// The kernels that ran (entry names, which spell their tile configs): the d-logits, `dh`,
    /// and `dW` (`None` when `dW` was not asked for); empty names when no row was active.
    pub dlogits: String,
    pub dh: String,
    pub dw: Option<String>,
    /// The chunk width and how many chunks the vocab took.
    pub chunk: usize,
    pub chunks: usize,
    /// Each chunk's `dW` GEMM ran on the library's side stream beside its `dh` GEMM.
    pub dw_beside_dh: bool,
    /// Bytes of workspace the call used (staging + accumulator).
    pub workspace_bytes: usize,
    /// Rows the kernels ran: the active rows when the call compacted them ([`Compaction`];
    /// 0 when none was active: then nothing ran and `chunks` is 0), else `t`.
    pub rows: usize,
    /// Of those rows, how many had their d-logits formed from the kept logits ([`crate::keep`])
    /// instead of recomputed (the first `kept_rows` rows that ran).
    pub kept_rows: usize,
}

/// Staging stride for a chunk width: a multiple of 8 (16-byte rows).
fn stride_of(chunk: usize) -> usize {
    chunk.next_multiple_of(8)
}

/// A gradient output as a device buffer: its element type is f32 or bf16.
pub(crate) struct Out<'a> {
    pub dev: Dev<'a>,
    pub f32: bool,
}

/// The validated inputs of a backward call, as device buffers: the logits operands and what the
/// d-logits read besides.
#[derive(Clone, Copy)]
pub(crate) struct BwdDev<'a, 'b> {
    pub p: Problem,
    pub x: LogitsIn<'a, 'b>,
    pub g: DlogitsIn<'a, 'b>,
    /// The kept logits and how many of the first rows of `x` read them (`(kept, prefix)`).
    pub kept: Option<(KeptOut<'a, 'b>, usize)>,
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
        let kept = x.kept.map(|k| dev_in(k.logits, stream, "kept logits").map(|d| (d, k.rows))).transpose()?;
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
            kept: kept.as_ref().map(|(k, rows)| (k.buf(4), *rows)),
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
            kept: match &kept {
                Some((k, rows)) if *rows > 0 => Some((KeptOut { buf: k, rows: *rows, map: None }, *rows)),
                _ => None,
            },
        };
        // Under CUDA-graph capture nothing may wait for the device (see `capture.rs`).
        let capture = crate::capture::capturing(stream)?;
        let mut guard = self.call_ws(capture);
        let ws = &mut *guard;
        if crate::active::counts_bwd(opts, capture) {
            return crate::active::backward(self, ws, stream, (opts, reduce_dh, shard.v_total), &x, (&dh, dw.as_ref()));
        }
        self.backward_dev(ws, stream, opts, reduce_dh, &x, (&dh, dw.as_ref()))
    }

    /// The backward of a validated call on its device buffers, every row of `x` computed (the
    /// dense call; the active-row compaction (`active.rs`) calls it on the compacted rows).
    pub(crate) fn backward_dev(
        &self,
        ws: &mut crate::workspace::Workspace,
        stream: &Arc<CudaStream>,
        opts: &BwdOptions,
        reduce_dh: Option<&dyn Communicator>,
        x: &BwdDev,
        (dh, dw): (&Out, Option<&Out>),
    ) -> Result<BwdReport> {
        let p = x.p;
        let (h, w) = (x.x.h, x.x.w);
        // The configs are tuned (and looked up) at the nominal width, the tuning keys' (so that
        // the vocabularies of one model's shards share keys); the automatic width is then
        // spread evenly over the chunks it needs.
        let nominal = opts.chunk.map_or_else(|| heuristics::nominal_chunk(p), |c| c.min(p.v));
        let tp = x.x.sc.v_begin != 0 || reduce_dh.is_some();
        let (cfg_dl, cfg_dh, cfg_dw) = self.bwd_configs(stream, opts.configs(), nominal, tp, x, dw.is_some())?;
        let chunk = match opts.chunk {
            Some(_) => nominal,
            None => heuristics::balanced_chunk(p.v, nominal),
        };
        let stride = stride_of(chunk);
        let chunks = p.v.div_ceil(chunk);
        let capture = crate::capture::capturing(stream)?;
        let overlap = dw.is_some() && opts.dw_beside_dh;
        {
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
            // Rows [0, prefix) read their logits from the kept buffer, the rest are recomputed
            // (as a problem of their own, on views of the inputs and the staging buffer).
            let prefix = x.kept.map_or(0, |(_, n)| n);
            let rest = if prefix > 0 && prefix < p.t { Some(RestRows::of(x, prefix, &staging, stride)?) } else { None };
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
                let ch = Chunk { begin: c0, width: cw, stride };
                match (&x.kept, &rest) {
                    (None, _) => launch::bwd_dlogits(&self.gpu, stream, cfg_dl, &x.x, ch, &x.g, &staging)?,
                    (Some((k, n)), rest) => {
                        launch::bwd_dlogits_kept(&self.gpu, stream, &x.x, ch, &x.g, (k, *n), &staging)?;
                        if let Some(r) = rest {
                            r.dlogits(&self.gpu, stream, cfg_dl, x, ch)?;
                        }
                    }
                }
                // dW[c0 .. c0 + cw] = staging[:, :cw]ᵀ · h, queued first: on the side stream
                // its blocks take the SMs first, and dh's fill those its last wave leaves.
                if let Some(dw) = dw {
                    let elem = if dw.f32 { 4 } else { 2 };
                    let dw_chunk = dw.dev.sub(c0 * p.d, cw * p.d, elem)?;
                    let mode = GemmOut { accumulate: false, write_acc: false, out_f32: dw.f32 };
                    match side {
                        Some(s) => {
                            s.ready.record(stream).during(|| "recording the d-logits event".into())?;
                            g.dw_on(&s.stream, Some(&s.ready), &DwChunk { cfg: cfg_dw, cw, staging: &staging, out: &dw_chunk, mode })?;
                            s.done.record(&s.stream).during(|| "recording the dW event".into())?;
                        }
                        None => g.dw_on(stream, None, &DwChunk { cfg: cfg_dw, cw, staging: &staging, out: &dw_chunk, mode })?,
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
        let workspace_bytes = ws.staging.bytes() + ws.dh_acc.bytes();
        let fam_dl = if x.g.ent.is_some() { Family::BwdDlogitsEnt } else { Family::BwdDlogits };
        let name = lmhead_core::config::kernel_name;
        Ok(BwdReport {
            dlogits: name(fam_dl, cfg_dl),
            dh: name(Family::BwdDh, cfg_dh),
            dw: dw.map(|_| name(Family::BwdDw, cfg_dw)),
            chunk,
            chunks,
            dw_beside_dh: overlap,
            workspace_bytes,
            rows: p.t,
            kept_rows: x.kept.map_or(0, |(_, n)| n),
        })
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
        // The keys and the trials: the caller's whole problem at the nominal chunk width.
        let chunk_problem = Problem::new(p.t, chunk, p.d);
        let keys = [fam_dl, Family::BwdDh, Family::BwdDw].map(|f| TuneKey::new(f, chunk_problem, tp));
        let choices = [choice.dlogits, choice.dh, choice.dw];
        let asks: Vec<(&TuneKey, Choice)> = keys.iter().zip(choices).collect();
        let can_time = self.can_time(stream, &asks, p.t, p.t * chunk * p.d)?;
        let needs_tuning = keys.iter().zip(choices).any(|(k, c)| self.tuner.would_time(k, c, can_time));
        // Scratch for the trials (allocated only when something is timed).
        let mut scratch = if needs_tuning {
            Some((
                zeros::<bf16>(stream, p.t * stride, "tuning staging")?,
                zeros::<f32>(stream, p.t * p.d, "tuning dh")?,
                zeros::<bf16>(stream, if with_dw { chunk * p.d } else { 1 }, "tuning dW")?,
            ))
        } else {
            None
        };
        let cfg_dl = self.tuner.pick(&keys[0], choice.dlogits, can_time, &mut |cfg| {
            let (st, _, _) = scratch.as_mut().ok_or_else(|| Error::Config("no tuning scratch".into()))?;
            let ms = crate::tune::bench::time_ms(stream, || {
                let sd = dev_out(&mut *st, stream, "tuning staging")?;
                launch::bwd_dlogits(&self.gpu, stream, cfg, &x.x, whole, &x.g, &sd)
            })?;
            Ok(crate::tune::Trial { ms, check: sample_dtoh(stream, &*st, "tuning staging", |x| x.to_f64())? })
        })?;
        // The GEMM trials read the staging buffer the chosen d-logits leave in scratch.
        if let Some((st, _, _)) = scratch.as_mut() {
            let sd = dev_out(&mut *st, stream, "tuning staging")?;
            launch::bwd_dlogits(&self.gpu, stream, cfg_dl, &x.x, whole, &x.g, &sd)?;
        }
        let cfg_dh = self.tuner.pick(&keys[1], choice.dh, can_time, &mut |cfg| {
            let (st, acc, _) = scratch.as_mut().ok_or_else(|| Error::Config("no tuning scratch".into()))?;
            let ms = crate::tune::bench::time_ms(stream, || {
                let sd = dev_in(&*st, stream, "tuning staging")?;
                let ad = dev_out(&mut *acc, stream, "tuning dh")?;
                let g = Gemms { gpu: &self.gpu, stream, p, stride, w, h };
                g.dh(cfg, (0, chunk), &sd, Some(&ad), None, GemmOut { accumulate: false, write_acc: true, out_f32: true })
            })?;
            Ok(crate::tune::Trial { ms, check: sample_dtoh(stream, &*acc, "tuning dh", f64::from)? })
        })?;
        let cfg_dw = self.tuner.pick(&keys[2], choice.dw, can_time, &mut |cfg| {
            let (st, _, out) = scratch.as_mut().ok_or_else(|| Error::Config("no tuning scratch".into()))?;
            let ms = crate::tune::bench::time_ms(stream, || {
                let sd = dev_in(&*st, stream, "tuning staging")?;
                let od = dev_out(&mut *out, stream, "tuning dW")?;
                let g = Gemms { gpu: &self.gpu, stream, p, stride, w, h };
                let mode = GemmOut { accumulate: false, write_acc: false, out_f32: false };
                g.dw_on(stream, None, &DwChunk { cfg, cw: chunk, staging: &sd, out: &od, mode })
            })?;
            Ok(crate::tune::Trial { ms, check: sample_dtoh(stream, &*out, "tuning dW", |x| x.to_f64())? })
        })?;
        Ok((cfg_dl, cfg_dh, cfg_dw))
    }
}

/// The rows `[prefix, t)` of a backward whose first `prefix` rows read kept logits: views of the
/// inputs the recompute reads and of the staging rows it writes.
struct RestRows<'a> {
    h: Dev<'a>,
    labels: Labels<'a>,
    lse: Dev<'a>,
    gl: Option<Dev<'a>>,
    ge: Option<(Dev<'a>, Dev<'a>)>,
    staging: Dev<'a>,
    t: usize,
}

impl<'a> RestRows<'a> {
    fn of<'b>(x: &'b BwdDev<'a, 'b>, prefix: usize, staging: &'b Dev<'a>, stride: usize) -> Result<RestRows<'b>> {
        let (t, d) = (x.p.t, x.p.d);
        let n = t - prefix;
        let lab = x.x.labels;
        Ok(RestRows {
            h: x.x.h.sub(prefix * d, n * d, 2)?,
            labels: Labels { dev: lab.dev.sub(prefix, n, lab.elem())?, kind: lab.kind },
            lse: x.g.lse.sub(prefix, n, 4)?,
            gl: x.g.grad_logprob.map(|g| g.sub(prefix, n, 4)).transpose()?,
            ge: match x.g.ent {
                Some((g, e)) => Some((g.sub(prefix, n, 4)?, e.sub(prefix, n, 4)?)),
                None => None,
            },
            staging: staging.sub(prefix * stride, n * stride, 2)?,
            t: n,
        })
    }

    /// The recomputed d-logits of these rows for one chunk.
    fn dlogits(&self, gpu: &crate::device::Gpu, stream: &Arc<CudaStream>, cfg: TileConfig, x: &BwdDev, ch: Chunk) -> Result<()> {
        let xr = LogitsIn { dims: Dims { t: self.t, ..x.x.dims }, sc: x.x.sc, h: &self.h, w: x.x.w, labels: &self.labels };
        let g = DlogitsIn { lse: &self.lse, grad_logprob: self.gl.as_ref(), ent: self.ge.as_ref().map(|(a, b)| (a, b)) };
        launch::bwd_dlogits(gpu, stream, cfg, &xr, ch, &g, &self.staging)
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
    fn dw_on(&self, stream: &Arc<CudaStream>, after: Option<&CudaEvent>, c: &DwChunk) -> Result<()> {
        let (p, stride) = (self.p, self.stride);
        let g = GemmIn { m: c.cw, n: p.d, k: p.t, a: c.staging, a_stride: stride, b: self.h, b_stride: p.d };
        let launch = launch::GemmLaunch { family: Family::BwdDw, cfg: c.cfg, after };
        launch::bwd_gemm_after(self.gpu, stream, &launch, &g, &GemmC { acc: None, out: Some(c.out), mode: c.mode })
    }
}

/// One chunk's `dW` GEMM: its config, the chunk's width `cw`, the staging buffer it reads and the
/// `[cw][d]` rows of `dW` it writes, as `mode` says.
struct DwChunk<'a, 'b> {
    cfg: TileConfig,
    cw: usize,
    staging: &'b Dev<'a>,
    out: &'b Dev<'a>,
    mode: GemmOut,
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
}
