//! The forward pass: per-token log-prob of the label, optional entropy, and log-sum-exp.
//!
//! Two launches: the fused mainloop (`(token tiles) × (vocab splits)` blocks, each writing one
//! partial per row) and the merge (one thread per row). Partials live in the library's
//! workspace, outputs in the caller's buffers, so rerunning either kernel (the tuner does) never
//! corrupts the other's input.

use std::sync::Arc;

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut};
use lmhead_core::config::{Family, TileConfig};
use lmhead_core::split;
use lmhead_core::Problem;

use crate::active::Compaction;
use crate::error::{Context as _, Error, Result};
use crate::launch::{self, dev_in, dev_out, Dev, Dims, Labels, LogitsIn, MergeOuts, MergeRows, MergeStep, Scalars};
use crate::tp::{Communicator, Shard};
use crate::tune::{Choice, TuneKey};
use crate::validate;
use crate::workspace::zeros;
use crate::{bf16, LabelCheck, LabelType, LmHead};

/// Inputs of a forward call. `h` is `[t][d]`, `W` is `[v][d]` (bf16, rows contiguous), labels `[t]`.
pub struct FwdInputs<'a, L: LabelType> {
    pub h: &'a dyn DevicePtr<bf16>,
    pub w: &'a dyn DevicePtr<bf16>,
    pub labels: &'a dyn DevicePtr<L>,
    pub problem: Problem,
}

/// Outputs of a forward call, f32 `[t]` each. Entropy is computed only when its buffer is given
/// (the kernel without entropy does none of its arithmetic).
pub struct FwdOutputs<'a> {
    pub logprob: &'a mut dyn DevicePtrMut<f32>,
    pub lse: &'a mut dyn DevicePtrMut<f32>,
    pub entropy: Option<&'a mut dyn DevicePtrMut<f32>>,
    /// The kept logits ([`FwdOptions::keep_logits`], [`crate::keep`]): f32, at least
    /// [`crate::keep::len`] elements, 16-byte aligned; needed when the budget keeps any row.
    pub kept: Option<&'a mut dyn DevicePtrMut<f32>>,
}

/// Options of the forward pass. Build them with `..Default::default()`: with the `testing`
/// feature (the workspace's tests and benches) they have fields of their own.
#[derive(Clone, Debug)]
pub struct FwdOptions {
    /// Logits are divided by this (finite, > 0). Default 1.
    pub temperature: f32,
    /// Rows with this label report log-prob 0 and entropy 0 (and get no gradient). Default −100.
    pub ignore_index: i64,
    /// How the labels are checked ([`LabelCheck`]). `Sync` (the default): every label before
    /// anything runs (one small kernel and a 12-byte synchronous read, which also brings back
    /// the active rows' count, [`Compaction`]), failing with [`Error::BadLabel`] (first
    /// offending row and its label) when one is outside `[0, v)` and not `ignore_index`; nothing
    /// is tuned or written then. `Deferred` (what `Sync` becomes on a stream that is capturing a
    /// CUDA graph): no host read, such rows come out NaN and [`LmHead::take_label_status`]
    /// reports them later. `Off`: NaN rows, nothing recorded. Without the `Sync` read every row
    /// is computed (nothing is compacted).
    pub check_labels: LabelCheck,
    /// How the tile config is chosen. Default [`Choice::Auto`].
    #[cfg(feature = "testing")]
    pub config: Choice,
    /// Run the level-00 kernel (no tensor cores) instead: a second GPU reference.
    #[cfg(feature = "testing")]
    pub naive: bool,
    /// Whether only the active rows (label not `ignore_index`) are computed, compacted into the
    /// workspace (`active.rs`). They are counted by the label check, so compaction needs
    /// `check_labels`. Rows a call skips report log-prob 0, entropy 0 and lse `+∞`
    /// ([`FwdReport::rows`] says how many ran). Default [`Compaction::Auto`].
    pub compaction: Compaction,
    /// Bytes of kept logits the call may write into [`FwdOutputs::kept`] for the backward
    /// ([`crate::keep`]: `4 · rows · stride`, `stride = v` rounded up to 8): all rows when the
    /// budget covers them, else a prefix of whole 128-row tiles ([`crate::keep::rows`]); the
    /// backward recomputes the rest. Default 0: nothing is kept, and the call runs exactly the
    /// kernels and memory of a forward without the mode. A forward whose result needs no
    /// gradient should keep nothing.
    pub keep_logits: usize,
}

impl Default for FwdOptions {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            ignore_index: lmhead_reference::IGNORE_INDEX,
            check_labels: LabelCheck::Sync,
            #[cfg(feature = "testing")]
            config: Choice::Auto,
            #[cfg(feature = "testing")]
            naive: false,
            compaction: Compaction::Auto,
            keep_logits: 0,
        }
    }
}

impl FwdOptions {
    /// How the config is chosen: [`Choice::Auto`] unless a test says otherwise.
    pub(crate) fn choice(&self) -> Choice {
        #[cfg(feature = "testing")]
        return self.config;
        #[cfg(not(feature = "testing"))]
        Choice::Auto
    }

    /// Whether the level-00 kernel runs instead (tests only).
    pub(crate) fn naive(&self) -> bool {
        #[cfg(feature = "testing")]
        return self.naive;
        #[cfg(not(feature = "testing"))]
        false
    }
}

/// What a forward call did.
#[derive(Clone, Debug, PartialEq)]
pub struct FwdReport {
    /// The mainloop kernel that ran (its entry name, which spells its tile config, e.g.
    /// `lm_head_fwd_t128_v256_d64_s3_w8x1_tma`); `None` for the naive path.
    pub kernel: Option<String>,
    /// Vocab splits of the plan (0 for the naive path).
    pub n_splits: u32,
    /// Token tiles per raster group of the launch order (0 = plain order).
    pub raster_group: u32,
    /// Tiles of every split that a filler block took (0 = no fillers).
    pub fill: u32,
    /// Rows the kernels ran: the active rows when the call compacted them ([`Compaction`];
    /// 0 when none was active and nothing ran), else `t`.
    pub rows: usize,
    /// Rows `[0, kept_rows)` of the call whose logits the kept buffer holds ([`crate::keep`];
    /// pass it to the backward's [`crate::keep::Kept`]). 0 without the mode.
    pub kept_rows: usize,
}

/// A validated forward call as device buffers: the logits operands, the vocab shard, the
/// communicator (tensor parallelism) and the outputs `[t]`.
#[derive(Clone, Copy)]
pub(crate) struct FwdDev<'a, 'b> {
    pub x: LogitsIn<'a, 'b>,
    pub shard: Shard,
    pub comm: Option<&'b dyn Communicator>,
    pub logprob: &'b Dev<'a>,
    pub lse: &'b Dev<'a>,
    pub entropy: Option<&'b Dev<'a>>,
    /// Where the mainloop writes the kept logits (none without the mode).
    pub kept: Option<launch::KeptOut<'a, 'b>>,
}

impl LmHead {
    pub(crate) fn check_stream(&self, stream: &CudaStream) -> Result<()> {
        if stream.context().cu_ctx() != self.gpu.context().cu_ctx() {
            return Err(Error::WrongContext { what: "stream" });
        }
        Ok(())
    }

    /// Concurrent blocks per SM of a config (from the driver's occupancy calculator).
    pub(crate) fn slots(&self, family: Family, cfg: TileConfig) -> Result<u32> {
        let name = lmhead_core::config::kernel_name(family, cfg);
        let f = self.gpu.function(&name, cfg.smem_bytes() as u32)?;
        let per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(cfg.threads(), cfg.smem_bytes(), None)
            .during(|| format!("occupancy of `{name}`"))?;
        if per_sm == 0 {
            return Err(Error::Config(format!("`{name}` cannot run on this device (0 blocks per SM)")));
        }
        Ok(per_sm * self.gpu.info().sm_count)
    }

    /// The fused forward. See [`FwdInputs`], [`FwdOutputs`], [`FwdOptions`].
    pub fn forward<L: LabelType>(
        &self,
        stream: &Arc<CudaStream>,
        x: &FwdInputs<'_, L>,
        opts: &FwdOptions,
        out: FwdOutputs<'_>,
    ) -> Result<FwdReport> {
        self.forward_impl(stream, x, Shard::whole(x.problem.v), None, opts, out)
    }

    /// The forward on `shard` of the vocabulary; with `comm`, the tensor-parallel one
    /// ([`LmHead::forward_tp`], whose steps are in [`crate::tp`]).
    pub(crate) fn forward_impl<L: LabelType>(
        &self,
        stream: &Arc<CudaStream>,
        x: &FwdInputs<'_, L>,
        shard: Shard,
        comm: Option<&dyn Communicator>,
        opts: &FwdOptions,
        out: FwdOutputs<'_>,
    ) -> Result<FwdReport> {
        let p = x.problem;
        self.check_stream(stream)?;
        let h = dev_in(x.h, stream, "h")?;
        let w = dev_in(x.w, stream, "W")?;
        let labels = L::labels(x.labels, stream)?;
        let logprob = dev_out(out.logprob, stream, "logprob")?;
        let lse = dev_out(out.lse, stream, "lse")?;
        let entropy = match out.entropy {
            Some(e) => Some(dev_out(e, stream, "entropy")?),
            None => None,
        };
        let kept = match out.kept {
            Some(k) => Some(dev_out(k, stream, "kept logits")?),
            None => None,
        };
        // Everything about the call is checked here, before the label check, the tuner or any
        // launch: a bad call tunes, caches and writes nothing.
        let call = validate::FwdCall {
            problem: p,
            shard,
            tp: comm.is_some(),
            h: h.buf(2),
            w: w.buf(2),
            labels: labels.buf(),
            logprob: logprob.buf(4),
            lse: lse.buf(4),
            entropy: entropy.as_ref().map(|e| e.buf(4)),
            kept: kept.as_ref().map(|k| k.buf(4)),
        };
        let inv_temp = validate::fwd(&call, opts)?;
        let kept_rows = validate::kept_rows(&call, opts)?;
        let sc = Scalars { inv_temp, ignore_index: opts.ignore_index, v_begin: shard.v_begin as i64 };
        let dims = Dims { t: p.t, v: p.v, d: p.d };
        let x = LogitsIn { dims, sc, h: &h, w: &w, labels: &labels };
        let kept = match (&kept, kept_rows) {
            (Some(k), rows) if rows > 0 => Some(launch::KeptOut { buf: k, rows, map: None }),
            _ => None,
        };
        let f = FwdDev { x, shard, comm, logprob: &logprob, lse: &lse, entropy: entropy.as_ref(), kept };
        // Under CUDA-graph capture nothing may wait for the device (see `capture.rs`).
        let capture = crate::capture::capturing(stream)?;
        let mut ws = self.call_ws(capture);
        let ws = &mut *ws;
        let active = match opts.check_labels.under(capture) {
            // The active rows are counted in the label check's one read (`crate::active`).
            LabelCheck::Sync => {
                let count = crate::active::counts_fwd(opts).then_some(crate::active::Count { comm });
                self.check_labels(ws, stream, &labels, p.t, (shard.v_total, opts.ignore_index), count)?
            }
            LabelCheck::Deferred => {
                self.check_labels_deferred(stream, &labels, p.t, shard.v_total, opts.ignore_index)?;
                None
            }
            LabelCheck::Off => None,
        };
        let report = match active {
            Some(n) => crate::active::forward(self, ws, stream, &f, opts, n),
            None => self.forward_dev(ws, stream, &f, opts),
        };
        report.map(|r| FwdReport { kept_rows, ..r })
    }

    /// The forward of a validated call on its device buffers, every row of `f` computed (the
    /// dense call; the active-row compaction (`active.rs`) calls it on the compacted rows).
    pub(crate) fn forward_dev(
        &self,
        ws: &mut crate::workspace::Workspace,
        stream: &Arc<CudaStream>,
        f: &FwdDev,
        opts: &FwdOptions,
    ) -> Result<FwdReport> {
        let FwdDev { x, shard, comm, logprob, lse, entropy, kept } = *f;
        let p = Problem::new(x.dims.t, x.dims.v, x.dims.d);
        let x = &x;
        if opts.naive() {
            launch::naive_fwd(&self.gpu, stream, x, logprob, lse, entropy)?;
            return Ok(FwdReport { kernel: None, n_splits: 0, raster_group: 0, fill: 0, rows: p.t, kept_rows: 0 });
        }
        let family = if entropy.is_some() { Family::FwdEnt } else { Family::Fwd };
        let cfg = self.fwd_config(stream, family, opts.choice(), p, x, comm.is_some())?;
        let plan = self.plan_split(family, cfg, p)?;
        let plan = {
            let partials = ws.partials.get(&mut ws.src, stream, plan.blocks_per_row() as usize * p.t)?;
            let pd = dev_out(partials, stream, "partials")?;
            launch::fwd_mainloop(&self.gpu, stream, x, entropy.is_some(), (cfg, plan), &pd, kept.as_ref())?
        };
        let n_slots = plan.blocks_per_row();
        let (src, partials, status, row_state) = (&mut ws.src, &mut ws.partials, &mut ws.status, &mut ws.row_state);
        // The merge still flags bad labels in this word; nothing reads it any more (the label
        // check runs before the forward and sets its own words), so it is not cleared.
        let status = status.get(src, stream, 1)?;
        let partials = partials.get(src, stream, n_slots as usize * p.t)?;
        let pd = dev_in(&*partials, stream, "partials")?;
        let rows = MergeRows {
            t: p.t,
            n_splits: n_slots,
            v_total: shard.v_total as i64,
            v_begin: shard.v_begin as i64,
            ignore_index: x.sc.ignore_index,
            labels: x.labels,
            partials: Some(&pd),
            row_state: None,
        };
        {
            let sd = dev_out(status, stream, "status")?;
            let outs = MergeOuts { logprob, lse, entropy, status: &sd };
            match comm {
                None => launch::merge(&self.gpu, stream, MergeStep::Full, &rows, Some(outs))?,
                Some(comm) => {
                    let rs = dev_out(row_state.get(src, stream, 5 * p.t)?, stream, "row states")?;
                    crate::tp::merge_tp(&self.gpu, stream, comm, &MergeRows { row_state: Some(&rs), ..rows }, outs)?;
                }
            }
        }
        Ok(FwdReport {
            kernel: Some(lmhead_core::config::kernel_name(family, cfg)),
            n_splits: plan.n_splits,
            raster_group: plan.raster_group,
            fill: plan.fill,
            rows: p.t,
            kept_rows: kept.map_or(0, |k| k.rows),
        })
    }

    /// Check every label before anything of the forward runs (so a bad label writes nothing and
    /// tunes nothing): one small kernel over the labels, then a 12-byte read of its verdict (a
    /// synchronisation with the stream), and on failure 8 bytes more for the offending label.
    /// With `count`, the active rows are counted before the read (`active::count`) and
    /// their number is returned from the same read.
    fn check_labels(
        &self,
        ws: &mut crate::workspace::Workspace,
        stream: &Arc<CudaStream>,
        labels: &Labels,
        t: usize,
        (v_total, ignore_index): (usize, i64),
        count: Option<crate::active::Count>,
    ) -> Result<Option<usize>> {
        // Words: the flags, the lowest bad row, the active rows.
        let status = ws.status.get(&mut ws.src, stream, 3)?;
        stream.memcpy_htod(&[0u32, u32::MAX, 0], &mut *status).during(|| "clearing the label status".into())?;
        {
            let sd = dev_out(&mut *status, stream, "status")?;
            launch::check_labels(&self.gpu, stream, t, (v_total as i64, ignore_index), labels, &sd)?;
            if let Some(c) = count {
                let rows = launch::ActiveRows { t, labels, ignore_index, grad_logprob: None, grad_entropy: None };
                crate::active::count(&self.gpu, (&mut ws.src, &mut ws.active), stream, &rows, c.comm, &sd.sub(2, 1, 4)?)?;
            }
        }
        let flags = stream.clone_dtoh(&*status).during(|| "reading the label status".into())?;
        if flags[0] & lmhead_core::params::STATUS_BAD_LABEL == 0 {
            return Ok(count.map(|_| flags[2] as usize));
        }
        let row = flags[1] as usize;
        let label = if row < t {
            let mut bytes = [0u8; 8];
            let elem = labels.elem();
            // SAFETY: `row < t` and the labels buffer was validated to hold exactly `t` elements
            // of `elem` bytes, so `[ptr + row·elem, + elem)` is inside it; the copy is ordered on
            // `stream` after the check kernel, and `bytes` outlives it (synchronised below).
            unsafe {
                cudarc::driver::result::memcpy_dtoh_async(&mut bytes[..elem], labels.dev.ptr + (row * elem) as u64, stream.cu_stream())
            }
            .during(|| "reading the bad label".into())?;
            stream.synchronize().during(|| "reading the bad label".into())?;
            Some(if elem == 8 { i64::from_le_bytes(bytes) } else { i32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]) as i64 })
        } else {
            None
        };
        Err(Error::BadLabel { row: (row < t).then_some(row), label })
    }

    /// The vocab split and launch order for `cfg` on this device ([`crate::plan::fwd`]).
    pub(crate) fn plan_split(&self, family: Family, cfg: TileConfig, p: Problem) -> Result<split::SplitPlan> {
        Ok(crate::plan::fwd(&self.gpu, self.slots(family, cfg)?, cfg, p))
    }

    /// Choose the forward config (by the tuner's policy when `choice` is `Auto`). Trials run the
    /// whole problem and write only the tuner's own scratch (partials and outputs), never the
    /// caller's buffers.
    fn fwd_config(
        &self,
        stream: &Arc<CudaStream>,
        family: Family,
        choice: Choice,
        p: Problem,
        x: &LogitsIn,
        tp: bool,
    ) -> Result<TileConfig> {
        let key = TuneKey::new(family, p, tp);
        let sc = x.sc;
        let can_time = self.can_time(stream, &[(&key, choice)], p.t, p.t * p.v * p.d)?;
        self.tuner.pick(&key, choice, can_time, &mut |cfg| {
            let plan = self.plan_split(family, cfg, p)?;
            let n = plan.blocks_per_row() as usize;
            let mut partials = zeros::<crate::workspace::PartialRepr>(stream, n * p.t, "tuning partials")?;
            let mut outs = zeros::<f32>(stream, 3 * p.t, "tuning outputs")?;
            let mut status = zeros::<u32>(stream, 1, "tuning status")?;
            let run = |partials: &mut cudarc::driver::CudaSlice<crate::workspace::PartialRepr>,
                       outs: &mut cudarc::driver::CudaSlice<f32>,
                       status: &mut cudarc::driver::CudaSlice<u32>|
             -> Result<()> {
                let pd = dev_out(partials, stream, "tuning partials")?;
                launch::fwd_mainloop(&self.gpu, stream, x, family == Family::FwdEnt, (cfg, plan), &pd, None)?;
                let od = dev_out(outs, stream, "tuning outputs")?;
                let (lp, lse, ent) = (od.sub(0, p.t, 4)?, od.sub(p.t, p.t, 4)?, od.sub(2 * p.t, p.t, 4)?);
                let sd = dev_out(status, stream, "tuning status")?;
                let mo = MergeOuts { logprob: &lp, lse: &lse, entropy: (family == Family::FwdEnt).then_some(&ent), status: &sd };
                let rows = MergeRows {
                    t: p.t,
                    n_splits: n as u32,
                    v_total: p.v as i64,
                    v_begin: sc.v_begin,
                    ignore_index: sc.ignore_index,
                    labels: x.labels,
                    partials: Some(&pd),
                    row_state: None,
                };
                launch::merge(&self.gpu, stream, MergeStep::Full, &rows, Some(mo))
            };
            let ms = crate::tune::bench::time_ms(stream, || run(&mut partials, &mut outs, &mut status))?;
            let check = stream.clone_dtoh(&outs).during(|| "reading tuning outputs".into())?;
            Ok(crate::tune::Trial { ms, check: check.into_iter().map(|x| x as f64).collect() })
        })
    }
}

/// Largest trial, in multiply-adds (`t·v·d` of a forward, `t·chunk·d` of a backward kernel):
/// about 3.5 ms of tensor-core time on an H200, so that a short list of three with a confirmation
/// round costs each family at most ≈ 0.13 s of a cold call.
pub(crate) const TRIAL_MACS: usize = 1 << 40;

/// Most rows a trial runs (forward and backward): 256 tiles of 128 rows, two waves of 132 SMs.
pub(crate) const TRIAL_ROWS: usize = 32_768;
