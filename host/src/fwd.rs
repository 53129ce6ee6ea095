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

use crate::error::{Context as _, Error, Result};
use crate::launch::{self, dev_in, dev_out, Dims, Labels, LogitsIn, MergeOuts, MergeRows, MergeStep, Scalars};
use crate::tp::{Communicator, Shard};
use crate::tune::{Choice, Mode, TuneKey};
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
}

/// Options of the forward (and backward) pass.
#[derive(Clone, Debug)]
pub struct FwdOptions {
    /// Logits are divided by this (finite, > 0). Default 1.
    pub temperature: f32,
    /// Rows with this label report log-prob 0 and entropy 0 (and get no gradient). Default −100.
    pub ignore_index: i64,
    /// How the labels are checked ([`LabelCheck`]). `Sync` (the default): every label before
    /// anything runs (one small kernel and an 8-byte synchronous read), failing with
    /// [`Error::BadLabel`] (first offending row and its label) when one is outside `[0, v)` and
    /// not `ignore_index`; nothing is tuned or written then. `Deferred` (what `Sync` becomes on a
    /// stream that is capturing a CUDA graph): no host read, such rows come out NaN and
    /// [`LmHead::take_label_status`] reports them later. `Off`: NaN rows, nothing recorded.
    pub check_labels: LabelCheck,
    /// How the tile config is chosen. Default [`Choice::Auto`].
    pub config: Choice,
    /// Run the level-00 kernel (no tensor cores) instead: a second GPU reference.
    pub naive: bool,
}

impl Default for FwdOptions {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            ignore_index: lmhead_reference::IGNORE_INDEX,
            check_labels: LabelCheck::Sync,
            config: Choice::Auto,
            naive: false,
        }
    }
}

/// What a forward call did.
#[derive(Clone, Debug, PartialEq)]
pub struct FwdReport {
    pub config: Option<TileConfig>,
    /// Vocab splits of the plan (0 for the naive path).
    pub n_splits: u32,
    /// Token tiles per raster group of the launch order (0 = plain order; see
    /// [`lmhead_core::split::raster`]).
    pub raster_group: u32,
    /// Tiles of every split that a filler block took (0 = no fillers; see
    /// [`lmhead_core::split::with_fill`]).
    pub fill: u32,
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
        };
        let inv_temp = validate::fwd(&call, opts)?;
        let sc = Scalars { inv_temp, ignore_index: opts.ignore_index, v_begin: shard.v_begin as i64 };
        let dims = Dims { t: p.t, v: p.v, d: p.d };
        let x = LogitsIn { dims, sc, h: &h, w: &w, labels: &labels };
        // Under CUDA-graph capture nothing may wait for the device (see `capture.rs`).
        let capture = crate::capture::capturing(stream)?;
        let mut ws = self.call_ws(capture);
        let ws = &mut *ws;
        match opts.check_labels.under(capture) {
            LabelCheck::Sync => self.check_labels(ws, stream, &labels, p.t, shard.v_total, opts.ignore_index)?,
            LabelCheck::Deferred => self.check_labels_deferred(stream, &labels, p.t, shard.v_total, opts.ignore_index)?,
            LabelCheck::Off => {}
        }
        if opts.naive {
            launch::naive_fwd(&self.gpu, stream, &x, &logprob, &lse, entropy.as_ref())?;
            return Ok(FwdReport { config: None, n_splits: 0, raster_group: 0, fill: 0 });
        }
        let family = if entropy.is_some() { Family::FwdEnt } else { Family::Fwd };
        let cfg = self.fwd_config(stream, family, opts.config, p, &x, comm.is_some())?;
        let plan = self.plan_split(family, cfg, p)?;
        let plan = {
            let partials = ws.partials.get(&mut ws.src, stream, plan.blocks_per_row() as usize * p.t)?;
            let pd = dev_out(partials, stream, "partials")?;
            launch::fwd_mainloop(&self.gpu, stream, &x, entropy.is_some(), cfg, plan, &pd)?
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
            ignore_index: opts.ignore_index,
            labels: &labels,
            partials: Some(&pd),
            row_state: None,
        };
        {
            let sd = dev_out(status, stream, "status")?;
            let outs = MergeOuts { logprob: &logprob, lse: &lse, entropy: entropy.as_ref(), status: &sd };
            match comm {
                None => launch::merge(&self.gpu, stream, MergeStep::Full, &rows, Some(outs))?,
                Some(comm) => {
                    let rs = dev_out(row_state.get(src, stream, 5 * p.t)?, stream, "row states")?;
                    crate::tp::merge_tp(&self.gpu, stream, comm, &MergeRows { row_state: Some(&rs), ..rows }, outs)?;
                }
            }
        }
        Ok(FwdReport { config: Some(cfg), n_splits: plan.n_splits, raster_group: plan.raster_group, fill: plan.fill })
    }

    /// Check every label before anything of the forward runs (so a bad label writes nothing and
    /// tunes nothing): one small kernel over the labels, then an 8-byte read of its verdict (a
    /// synchronisation with the stream), and on failure 8 bytes more for the offending label.
    fn check_labels(
        &self,
        ws: &mut crate::workspace::Workspace,
        stream: &Arc<CudaStream>,
        labels: &Labels,
        t: usize,
        v_total: usize,
        ignore_index: i64,
    ) -> Result<()> {
        let status = ws.status.get(&mut ws.src, stream, 2)?;
        stream.memcpy_htod(&[0u32, u32::MAX], &mut *status).during(|| "clearing the label status".into())?;
        {
            let sd = dev_out(&mut *status, stream, "status")?;
            launch::check_labels(&self.gpu, stream, t, (v_total as i64, ignore_index), labels, &sd)?;
        }
        let flags = stream.clone_dtoh(&*status).during(|| "reading the label status".into())?;
        if flags[0] & lmhead_core::params::STATUS_BAD_LABEL == 0 {
            return Ok(());
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

    /// The vocab split and launch order for `cfg` on this device ([`crate::plan::fwd`]), with
    /// the plan the tuning table measured for this key and config when it holds one and timed
    /// these kernels.
    pub(crate) fn plan_split(&self, family: Family, cfg: TileConfig, p: Problem) -> Result<split::SplitPlan> {
        let measured = self
            .tuner
            .table()
            .filter(|(_, fit)| fit.exact_for(family))
            .and_then(|(table, _)| table.plan(family, p, cfg).map(|e| (e.splits, e.raster)));
        Ok(crate::plan::fwd(&self.gpu, self.slots(family, cfg)?, cfg, p, measured))
    }

    /// Choose the forward config (tuning on first use of a key when `choice` is `Auto`). Trials
    /// write only the tuner's own scratch (partials and outputs), never the caller's buffers.
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
        // Table mode: trials run on a slice, the first rows of h and of W (labels beyond the
        // slice's vocabulary find no column, identically for every candidate). Exhaustive
        // tuning (how the table is made) times the real shape.
        let whole = p;
        let p = if self.tuner.mode() == Mode::Table { trial_slice(p) } else { p };
        let sliced = p != whole;
        let (h, w) = (&x.h.sub(0, p.t * p.d, 2)?, &x.w.sub(0, p.v * p.d, 2)?);
        let labels = &x.labels.rows(p.t)?;
        let x = &LogitsIn { dims: Dims { t: p.t, v: p.v, d: p.d }, sc, h, w, labels };
        self.tuner.pick_sliced(&key, choice, sliced, &mut |cfg| {
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
                launch::fwd_mainloop(&self.gpu, stream, x, family == Family::FwdEnt, cfg, plan, &pd)?;
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

/// Largest forward trial, in multiply-adds `t·v·d`: about 3.5 ms of tensor-core time on an
/// H200, so that a shortlist of three with a confirmation round stays well under 0.5 s.
pub(crate) const TRIAL_MACS: usize = 1 << 40;

/// Rows a tuning trial runs (forward and backward).
pub(crate) const TRIAL_ROWS: usize = 32_768;

/// The shape a forward trial runs: `t` up to 32768 rows (256 tiles of 128 rows: two waves of
/// 132 SMs, the steady state every candidate sees alike, since all tile 128 rows), and `v`
/// cut to [`TRIAL_MACS`] (at least 8192 columns: 32–64 tiles per block, as at full size),
/// rounded to whole 256-column tiles.
pub(crate) fn trial_slice(p: Problem) -> Problem {
    let t = p.t.min(TRIAL_ROWS);
    let v = (TRIAL_MACS / (t * p.d).max(1)).max(8192).next_multiple_of(256).min(p.v);
    Problem::new(t, v, p.d)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trial_slices_cap_the_work_and_keep_small_shapes_whole() {
        for (t, v, d) in [(1, 1, 8), (7, 3, 64), (4097, 50_257, 4096), (20_000, 248_320, 2048), (262_144, 131_072, 8192), (65_536, 8, 5120)]
        {
            let s = trial_slice(Problem::new(t, v, d));
            assert_eq!(s.d, d);
            assert!(s.t == t.min(TRIAL_ROWS) && s.v <= v && s.v > 0, "{s:?}");
            assert!(s.v == v || s.v.is_multiple_of(256), "{s:?}");
            assert!(s.v == v || s.t * s.v * s.d <= (TRIAL_MACS + s.t * 256 * s.d).max(s.t * 8192 * s.d), "{s:?}");
        }
        assert_eq!(trial_slice(Problem::new(4096, 32_000, 4096)).v, 32_000, "a small vocabulary is tried whole");
    }
}
