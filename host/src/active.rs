//! Work only on the rows the loss reads: the active rows, compacted into the workspace.
//!
//! **Active rows.** In the forward, a row is active when its label is not `ignore_index`; in the
//! backward, when in addition at least one given upstream gradient of the row is non-zero (a
//! row whose given gradients are exactly zero adds exactly zero to `dh` and `dW`; a NaN gradient
//! is not zero). Inactive rows get what the dense call gives them: log-prob 0, entropy 0, a zero
//! `dh` row and no `dW` contribution. Where a call skips them (its report's `rows` is below `t`),
//! two things differ: the forward does not compute their log-sum-exp and writes `+∞` there, and
//! a non-finite input (`h` row, saved lse or entropy) in a row whose gradients are zero no longer
//! reaches `dh` and `dW` as NaN.
//!
//! *Why `+∞` for the lse:* the backward's d-logits form `p = e^{z − lse}` in every row they run
//! and multiply it by the row's coefficients, which are zero in an ignored row. A backward that
//! runs every row ([`Compaction::Off`], or on a stream being captured) would,
//! with lse 0, overflow `p` to `∞` for a logit above 88 (in units of the temperature) and make
//! `0 · ∞ = NaN` in `dh` and `dW`; with `+∞`, `p = 0` and the row's gradient is exactly zero on
//! every path. (The lse is kept for the backward; a caller that reads it for ignored rows must
//! mask them.)
//!
//! *No row mask in the API.* A caller that wants a row's log-prob gives its label, one that does
//! not gives `ignore_index`: a mask is `labels.masked_fill(~mask, ignore_index)`, made on the
//! device (capture-safe), and it is what the Python package's `active_mask` does. A second
//! mask would be a second way to say the same thing, with a combination (labelled but masked)
//! whose meaning would have to be invented.
//!
//! **How.** The count needs the host (the grids are planned for the rows that run: a plan for
//! `t` rows run on `n` would leave most SMs idle): the forward counts the active rows with the
//! label check, in its one read (`FwdOptions::check_labels`; the status words are the verdict,
//! the first bad row, and the count), so the default forward makes no extra host round trip;
//! the backward makes one small read of its own. Then:
//! 1. `n == t`: the dense call, nothing compacted; `n == 0`: the outputs are written (zeros;
//!    lse `+∞`) and nothing else runs; otherwise the cost model ([`plan`]) decides.
//! 2. `ACTIVE_PLACE` writes the index list (slot → row) and the row → slot map in row order
//!    (per-block counts from the count kernel, each block's offset their sum before it, its rows
//!    ranked by warp ballots: no atomics, the same order every run; `lmhead_core::compact`) and
//!    gathers the per-row values (labels in their width, and in the backward lse, entropy and
//!    the upstream gradients) into compact buffers; `COPY_ROWS` gathers the rows of `h`.
//! 3. The dense forward or backward runs unchanged on the compact problem of `n` rows (its
//!    configs are those of `n` rows' token bucket, tuned on first use like any other bucket:
//!    [`LmHead::warm_up`](crate::LmHead::warm_up) with the active counts covers them; `dW` sums
//!    over the compact rows).
//! 4. `MAP_VALUES` writes the forward's outputs for every row (the compact values, or 0, `+∞`,
//!    0 for inactive rows); `COPY_ROWS` writes `dh` for every row (the compact rows, or zeros),
//!    in the caller's element type.
//!
//! The result is bitwise the dense call on the compacted inputs (the same kernels, configs and
//! order), and within the kernels' tolerances of the dense call on all rows (whose configs are
//! those of `t` rows' token bucket).
//!
//! **Where no host read is allowed, every row runs** (correct, not faster): the forward with the
//! label check off, and either pass on a stream being captured into a CUDA graph (its capture
//! status is read first); also the naive forward.
//!
//! **When compaction pays** ([`plan`]): it moves `n·d·(2 + 2)` bytes (the gather of `h`, read and
//! written) and in the backward `n·d·2·e` more (`dh`'s compact rows written by the GEMM and read
//! by the scatter, `e` bytes each), at [`COPY_BYTES_PER_S`], plus [`FIXED_S`] for its launches;
//! it saves the GEMM work of the token tiles it removes, `g · 2 · (T(t) − T(n)) · v · d` FLOPs
//! at [`GEMM_FLOPS`] (`T(x)` = `x` rounded up to whole [`TILE_ROWS`]-row tiles; `g` = 1 GEMM in
//! the forward, 3 in the backward). Ignoring the tile rounding and the launches, it pays when the
//! inactive fraction `1 − f` satisfies `(1 − f)/f > 2·GEMM_FLOPS/(v·COPY_BYTES_PER_S)` in the
//! forward (`≈ 395/v`: 0.3% of the rows at v = 128K, 1.2% at v = 32K) and `(4 + 2e)·GEMM_FLOPS /
//! (6·v·COPY_BYTES_PER_S)` in the backward (`≈ 263/v` for a bf16 `dh`); at the vocabularies of
//! real models it pays as soon as it removes one token tile. The backward's threshold is below
//! the forward's, so a backward on the forward's labels compacts whenever the forward did.
//!
//! **Tensor parallelism.** Labels are global and the upstream gradients the same on every rank
//! (each computes the loss from the same all-reduced log-probs), so every rank should find the
//! same rows; but a rank that did not would compact other rows, and its collectives would
//! disagree in length (a hang under NCCL). So where the call has collectives (the forward, and
//! the backward that all-reduces `dh`), each rank writes its rows' flags, the group MAX-reduces
//! them (one all-reduce of `t` floats), and every rank counts and compacts the union: always the
//! same rows. The decision uses `v_total / ranks` for `v`, the same on every rank; every rank must
//! pass the same options. The all-reduces then run over the compact rows. A backward that leaves
//! `dh` to the caller has no collective and decides per rank. Context parallelism needs nothing:
//! each rank's call sees its own token slice.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use lmhead_core::compact::blocks;
use lmhead_core::Problem;

use crate::bwd::{BwdDev, BwdOptions, BwdReport, Out};
use crate::error::{Context as _, Result};
use crate::fwd::{FwdDev, FwdOptions, FwdReport};
use crate::launch::{self, dev_in, dev_out, ActiveRows, Dev, Dims, DlogitsIn, Flags, Gathers, Labels, LogitsIn};
use crate::tp::{Communicator, ReduceOp};
use crate::workspace::{Grow, Source, Workspace};
use crate::{bf16, LmHead};

/// Tensor-core rate the cost model assumes: a bf16 GEMM through cuBLAS on the H200 (8192³ on
/// random data, docs/PERFORMANCE.md).
pub const GEMM_FLOPS: f64 = 790e12;
/// Copy bandwidth the cost model assumes (the H200 copied device to device at about 4.3 TB/s).
pub const COPY_BYTES_PER_S: f64 = 4.0e12;
/// The compaction's own launches (placement, gather, scatter), back to back on the stream.
pub const FIXED_S: f64 = 8e-6;
/// Rows of a token tile, the unit of the GEMMs' work in the cost model (`bm` of the tuned
/// configs; the `mma.sync` fallbacks of 64 and 256 rows round differently, which the model
/// ignores).
pub const TILE_ROWS: usize = 128;

/// Whether a call computes only its active rows ([`crate::FwdOptions::compaction`],
/// [`crate::BwdOptions::compaction`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Compaction {
    /// Every row is computed.
    Off,
    /// The active rows alone when the cost model says that pays (the time the skipped rows
    /// save against the gather and scatter), else every row.
    #[default]
    Auto,
    /// The active rows alone whenever a row is inactive (also where the model says it does not
    /// pay: for tests and measurements).
    Always,
}

/// Which pass the cost model judges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    /// The backward, with `dh`'s element size in bytes (2 or 4).
    Backward {
        dh_bytes: usize,
    },
}

/// What a call does with its `n` active rows of `t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Plan {
    /// Every row, as stored (all rows are active, or compaction would not pay).
    Dense,
    /// No row is active: the outputs are written, nothing else runs.
    Nothing,
    /// The active rows, compacted.
    Compact,
}

/// The module docs' cost model: the seconds compaction saves and costs for `n` active rows of
/// `t` (the local vocabulary `v`, hidden size `d`).
pub fn model(pass: Pass, t: usize, n: usize, v: usize, d: usize) -> (f64, f64) {
    let tiles = |x: usize| x.div_ceil(TILE_ROWS) * TILE_ROWS;
    let (gemms, moved) = match pass {
        Pass::Forward => (1.0, 4 * n * d),
        Pass::Backward { dh_bytes } => (3.0, (4 + 2 * dh_bytes) * n * d),
    };
    let saved = gemms * 2.0 * (tiles(t) - tiles(n)) as f64 * v as f64 * d as f64 / GEMM_FLOPS;
    (saved, moved as f64 / COPY_BYTES_PER_S + FIXED_S)
}

/// [`plan_for`] under [`Compaction::Auto`] (module docs).
#[cfg(test)]
pub fn plan(pass: Pass, t: usize, n: usize, v: usize, d: usize) -> Plan {
    plan_for(Compaction::Auto, pass, t, n, v, d)
}

/// What to do with `n` active rows of `t` under `c` (`Off`: decided before any count).
fn plan_for(c: Compaction, pass: Pass, t: usize, n: usize, v: usize, d: usize) -> Plan {
    if n >= t || c == Compaction::Off {
        return Plan::Dense;
    }
    if n == 0 {
        return Plan::Nothing;
    }
    let (saved, cost) = model(pass, t, n, v, d);
    if c == Compaction::Always || saved > cost {
        Plan::Compact
    } else {
        Plan::Dense
    }
}

/// Whether a forward with `opts` counts its active rows (in the `Sync` label check's read; the
/// caller runs that check only where a host read is allowed, never under capture).
pub(crate) fn counts_fwd(opts: &FwdOptions) -> bool {
    opts.compaction != Compaction::Off && !opts.naive()
}

/// Whether a backward with `opts` on `capturing` stream counts its active rows (one small
/// synchronous read, which a stream being captured into a CUDA graph must not see).
pub(crate) fn counts_bwd(opts: &BwdOptions, capturing: bool) -> bool {
    opts.compaction != Compaction::Off && !capturing
}

/// How a call counts: with its communicator when it has collectives (the ranks' flags are
/// MAX-reduced first, module docs).
#[derive(Clone, Copy)]
pub(crate) struct Count<'c> {
    pub comm: Option<&'c dyn Communicator>,
}

/// The workspace buffers of the compaction. The small ones (counts, flags, maps, per-row values)
/// are kept across calls; the rows of `h` and `dh` are per call (handed back to a
/// [`crate::ScratchAlloc`] when the call returns).
pub struct ActiveWs {
    block_counts: Grow<u32>,
    /// The block counts of the active rows among the kept ones ([`count_prefix`]).
    block_counts_kept: Grow<u32>,
    flags: Grow<f32>,
    idx: Grow<u32>,
    slot: Grow<u32>,
    /// Compact labels, `i64` slots (`i32` labels use the first half).
    labels: Grow<i64>,
    /// Compact per-row values: the forward's outputs, the backward's inputs.
    values: Grow<f32>,
    h: Grow<bf16>,
    dh16: Grow<bf16>,
    dh32: Grow<f32>,
}

impl Default for ActiveWs {
    fn default() -> Self {
        Self {
            block_counts: Grow::new("active-row block counts"),
            block_counts_kept: Grow::new("kept-row block counts"),
            flags: Grow::new("active-row flags"),
            idx: Grow::new("active-row index list"),
            slot: Grow::new("active-row slots"),
            labels: Grow::new("compact labels"),
            values: Grow::new("compact per-row values"),
            h: Grow::per_call("compact h"),
            dh16: Grow::per_call("compact dh"),
            dh32: Grow::per_call("compact dh"),
        }
    }
}

impl ActiveWs {
    fn grows(&mut self) -> [&mut dyn GrowDyn; 10] {
        [
            &mut self.block_counts,
            &mut self.block_counts_kept,
            &mut self.flags,
            &mut self.idx,
            &mut self.slot,
            &mut self.labels,
            &mut self.values,
            &mut self.h,
            &mut self.dh16,
            &mut self.dh32,
        ]
    }

    pub fn bytes(&self) -> usize {
        let small = self.block_counts.bytes() + self.block_counts_kept.bytes() + self.flags.bytes() + self.idx.bytes() + self.slot.bytes();
        small + self.labels.bytes() + self.values.bytes() + self.h.bytes() + self.dh16.bytes() + self.dh32.bytes()
    }

    pub fn release(&mut self) {
        self.grows().into_iter().for_each(|g| g.release());
    }

    pub fn end_call(&mut self) {
        self.grows().into_iter().for_each(|g| g.end_call());
    }
}

/// [`Grow`]'s bookkeeping, whatever its element type.
trait GrowDyn {
    fn release(&mut self);
    fn end_call(&mut self);
}

impl<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits> GrowDyn for Grow<T> {
    fn release(&mut self) {
        Grow::release(self)
    }
    fn end_call(&mut self) {
        Grow::end_call(self)
    }
}

/// Count the active rows of `rows` into `count` (one u32, zeroed by the caller) and each block's
/// into the workspace; with `comm`, of the union of the ranks' active rows (flags MAX-reduced).
pub(crate) fn count(
    gpu: &crate::device::Gpu,
    (src, act): (&mut Source, &mut ActiveWs),
    stream: &Arc<CudaStream>,
    rows: &ActiveRows,
    comm: Option<&dyn Communicator>,
    count: &Dev,
) -> Result<()> {
    let t = rows.t;
    let bc = dev_out(act.block_counts.get(src, stream, blocks(t))?, stream, "active-row block counts")?;
    match comm {
        None => launch::active_count(gpu, stream, rows, Flags::None, &bc, count),
        Some(c) => {
            let all = dev_out(act.flags.get(src, stream, t)?, stream, "active-row flags")?;
            let flags = all.sub(0, t, 4)?;
            launch::active_count(gpu, stream, rows, Flags::Write(&flags), &bc, count)?;
            c.all_reduce(stream, &flags, ReduceOp::Max)?;
            launch::active_count(gpu, stream, rows, Flags::Read(&flags), &bc, count)
        }
    }
}

/// Count the active rows of `rows` among its first `prefix` rows into `count` (one u32, zeroed
/// by the caller), into block counts of their own (the placement reads the whole count's);
/// with `union`, from the flags the whole count left (the ranks' MAX-reduced flags).
fn count_prefix(
    gpu: &crate::device::Gpu,
    (src, act): (&mut Source, &mut ActiveWs),
    stream: &Arc<CudaStream>,
    rows: &ActiveRows,
    prefix: usize,
    union: bool,
    count: &Dev,
) -> Result<()> {
    let bc = dev_out(act.block_counts_kept.get(src, stream, blocks(prefix))?, stream, "kept-row block counts")?;
    let labels = rows.labels.rows(prefix)?;
    let gl = rows.grad_logprob.map(|g| g.sub(0, prefix, 4)).transpose()?;
    let ge = rows.grad_entropy.map(|g| g.sub(0, prefix, 4)).transpose()?;
    let r =
        ActiveRows { t: prefix, labels: &labels, ignore_index: rows.ignore_index, grad_logprob: gl.as_ref(), grad_entropy: ge.as_ref() };
    if union {
        let all = dev_in(act.flags.get(src, stream, rows.t)?, stream, "active-row flags")?;
        let flags = all.sub(0, prefix, 4)?;
        launch::active_count(gpu, stream, &r, Flags::Read(&flags), &bc, count)
    } else {
        launch::active_count(gpu, stream, &r, Flags::None, &bc, count)
    }
}

/// The `v` the cost model uses: with collectives the same on every rank.
fn model_v(v: usize, v_total: usize, comm: Option<&dyn Communicator>) -> usize {
    match comm {
        Some(c) => v_total.div_ceil(c.size().max(1)),
        None => v,
    }
}

/// The forward of a call whose active rows were counted (`n` of them): dense, nothing, or
/// compacted (module docs).
pub(crate) fn forward(
    head: &LmHead,
    ws: &mut Workspace,
    stream: &Arc<CudaStream>,
    f: &FwdDev,
    opts: &FwdOptions,
    n: usize,
) -> Result<FwdReport> {
    let Dims { t, v, d } = f.x.dims;
    match plan_for(opts.compaction, Pass::Forward, t, n, model_v(v, f.shard.v_total, f.comm), d) {
        Plan::Dense => head.forward_dev(ws, stream, f, opts),
        Plan::Nothing => {
            launch::zero_fill(stream, f.logprob, t, 4)?;
            launch::fill_f32(stream, f.lse, t, f32::INFINITY)?;
            if let Some(e) = f.entropy {
                launch::zero_fill(stream, e, t, 4)?;
            }
            Ok(FwdReport { kernel: None, n_splits: 0, raster_group: 0, fill: 0, rows: 0, kept_rows: 0 })
        }
        Plan::Compact => {
            let mut act = std::mem::take(&mut ws.active);
            let r = forward_compact(head, (ws, &mut act), stream, f, opts, n);
            ws.active = act;
            r
        }
    }
}

fn forward_compact(
    head: &LmHead,
    (ws, act): (&mut Workspace, &mut ActiveWs),
    stream: &Arc<CudaStream>,
    f: &FwdDev,
    opts: &FwdOptions,
    n: usize,
) -> Result<FwdReport> {
    let (gpu, Dims { t, v, d }) = (&*head.gpu, f.x.dims);
    let src = &mut ws.src;
    let bc = dev_in(act.block_counts.get(src, stream, blocks(t))?, stream, "active-row block counts")?;
    let flags_all = match f.comm {
        Some(_) => Some(dev_in(act.flags.get(src, stream, t)?, stream, "active-row flags")?),
        None => None,
    };
    let idx = dev_out(act.idx.get(src, stream, n)?, stream, "active-row index list")?;
    let slot = dev_out(act.slot.get(src, stream, t)?, stream, "active-row slots")?;
    let lab = dev_out(act.labels.get(src, stream, n)?, stream, "compact labels")?;
    let vals = dev_out(act.values.get(src, stream, 3 * n)?, stream, "compact outputs")?;
    let hc = dev_out(act.h.get(src, stream, n * d)?, stream, "compact h")?;
    let flags = match &flags_all {
        Some(fl) => Flags::Read(fl),
        None => Flags::None,
    };
    let rows = ActiveRows { t, labels: f.x.labels, ignore_index: f.x.sc.ignore_index, grad_logprob: None, grad_entropy: None };
    let gathers = Gathers { labels: Some(&lab), values: Vec::new() };
    let (gather, scatter) = launch::active_place(gpu, stream, (&rows, flags), &bc, n, (&idx, &slot), &gathers)?;
    let h = hc.sub(0, n * d, 2)?;
    launch::copy_rows(gpu, stream, &gather, 2 * d, f.x.h, 2, &h)?;
    let labels = Labels { dev: lab.sub(0, n, f.x.labels.elem())?, kind: f.x.labels.kind };
    let (lp, lse, ent) = (vals.sub(0, n, 4)?, vals.sub(n, n, 4)?, vals.sub(2 * n, n, 4)?);
    let x = LogitsIn { dims: Dims { t: n, v, d }, sc: f.x.sc, h: &h, w: f.x.w, labels: &labels };
    // The kept logits stay in the caller's rows: each compact row is written at its own row.
    let kept = f.kept.map(|k| launch::KeptOut { map: Some(&idx), ..k });
    let fc = FwdDev { x, shard: f.shard, comm: f.comm, logprob: &lp, lse: &lse, entropy: f.entropy.map(|_| &ent), kept };
    let report = head.forward_dev(ws, stream, &fc, opts)?;
    let mut outs = vec![(&lp, f.logprob, 0.0), (&lse, f.lse, f32::INFINITY)];
    if let Some(e) = f.entropy {
        outs.push((&ent, e, 0.0));
    }
    launch::map_values(gpu, stream, &scatter, &outs)?;
    Ok(report)
}

/// The backward with its active rows: counted (one small read), then dense, nothing, or
/// compacted (module docs).
pub(crate) fn backward(
    head: &LmHead,
    ws: &mut Workspace,
    stream: &Arc<CudaStream>,
    (opts, reduce_dh, v_total): (&BwdOptions, Option<&dyn Communicator>, usize),
    x: &BwdDev,
    (dh, dw): (&Out, Option<&Out>),
) -> Result<BwdReport> {
    let p = x.p;
    let gl = x.g.grad_logprob;
    let ge = x.g.ent.map(|(g, _)| g);
    // Rows the kept logits cover (a prefix of the caller's rows).
    let kept = x.kept.map_or(0, |(k, _)| k.rows);
    // Without an upstream gradient every row's is zero: no row is active, nothing is counted.
    // With kept logits of part of the rows, the same read also brings back how many of the
    // active rows are among them (a compacted call reads those from the kept logits).
    let (n, n_kept) = if gl.is_none() && ge.is_none() {
        (0, 0)
    } else {
        let status = ws.status.get(&mut ws.src, stream, 3)?;
        stream.memset_zeros(&mut *status).during(|| "clearing the active-row count".into())?;
        {
            let sd = dev_out(&mut *status, stream, "status")?;
            let rows = ActiveRows { t: p.t, labels: x.x.labels, ignore_index: x.x.sc.ignore_index, grad_logprob: gl, grad_entropy: ge };
            count(&head.gpu, (&mut ws.src, &mut ws.active), stream, &rows, reduce_dh, &sd.sub(0, 1, 4)?)?;
            if kept > 0 && kept < p.t {
                count_prefix(&head.gpu, (&mut ws.src, &mut ws.active), stream, &rows, kept, reduce_dh.is_some(), &sd.sub(1, 1, 4)?)?;
            }
        }
        let words = stream.clone_dtoh(&*status).during(|| "reading the active-row count".into())?;
        let n = words[0] as usize;
        (
            n,
            if kept >= p.t {
                n
            } else if kept == 0 {
                0
            } else {
                words[1] as usize
            },
        )
    };
    let dh_bytes = if dh.f32 { 4 } else { 2 };
    match plan_for(opts.compaction, Pass::Backward { dh_bytes }, p.t, n, model_v(p.v, v_total, reduce_dh), p.d) {
        Plan::Compact => {
            let mut act = std::mem::take(&mut ws.active);
            let r = backward_compact(head, (ws, &mut act), stream, (opts, reduce_dh), x, (dh, dw), (n, n_kept));
            ws.active = act;
            r
        }
        Plan::Nothing => {
            launch::zero_fill(stream, &dh.dev, p.t * p.d, dh_bytes)?;
            if let Some(o) = dw {
                launch::zero_fill(stream, &o.dev, p.v * p.d, if o.f32 { 4 } else { 2 })?;
            }
            // No kernel of the backward ran: the report names none.
            Ok(BwdReport {
                dlogits: String::new(),
                dh: String::new(),
                dw: dw.map(|_| String::new()),
                chunk: 0,
                chunks: 0,
                dw_beside_dh: false,
                workspace_bytes: 0,
                rows: 0,
                kept_rows: 0,
            })
        }
        Plan::Dense => head.backward_dev(ws, stream, opts, reduce_dh, x, (dh, dw)),
    }
}

fn backward_compact(
    head: &LmHead,
    (ws, act): (&mut Workspace, &mut ActiveWs),
    stream: &Arc<CudaStream>,
    (opts, reduce_dh): (&BwdOptions, Option<&dyn Communicator>),
    x: &BwdDev,
    (dh, dw): (&Out, Option<&Out>),
    (n, n_kept): (usize, usize),
) -> Result<BwdReport> {
    let (gpu, p) = (&*head.gpu, x.p);
    let (t, v, d) = (p.t, p.v, p.d);
    let src = &mut ws.src;
    let bc = dev_in(act.block_counts.get(src, stream, blocks(t))?, stream, "active-row block counts")?;
    let flags_all = match reduce_dh {
        Some(_) => Some(dev_in(act.flags.get(src, stream, t)?, stream, "active-row flags")?),
        None => None,
    };
    let idx = dev_out(act.idx.get(src, stream, n)?, stream, "active-row index list")?;
    let slot = dev_out(act.slot.get(src, stream, t)?, stream, "active-row slots")?;
    let lab = dev_out(act.labels.get(src, stream, n)?, stream, "compact labels")?;
    let vals = dev_out(act.values.get(src, stream, 4 * n)?, stream, "compact per-row values")?;
    let hc = dev_out(act.h.get(src, stream, n * d)?, stream, "compact h")?;
    let dhc = if dh.f32 {
        dev_out(act.dh32.get(src, stream, n * d)?, stream, "compact dh")?
    } else {
        dev_out(act.dh16.get(src, stream, n * d)?, stream, "compact dh")?
    };
    let flags = match &flags_all {
        Some(fl) => Flags::Read(fl),
        None => Flags::None,
    };
    let gl = x.g.grad_logprob;
    let ent = x.g.ent;
    let rows = ActiveRows { t, labels: x.x.labels, ignore_index: x.x.sc.ignore_index, grad_logprob: gl, grad_entropy: ent.map(|(g, _)| g) };
    // Compact values: lse, then the entropy gradient and saved entropy, then the log-prob gradient.
    let (lse_c, ge_c, ent_c, gl_c) = (vals.sub(0, n, 4)?, vals.sub(n, n, 4)?, vals.sub(2 * n, n, 4)?, vals.sub(3 * n, n, 4)?);
    let mut values = vec![(x.g.lse, &lse_c)];
    if let Some((g, e)) = ent {
        values.extend([(g, &ge_c), (e, &ent_c)]);
    }
    if let Some(g) = gl {
        values.push((g, &gl_c));
    }
    let gathers = Gathers { labels: Some(&lab), values };
    let (gather, scatter) = launch::active_place(gpu, stream, (&rows, flags), &bc, n, (&idx, &slot), &gathers)?;
    let h = hc.sub(0, n * d, 2)?;
    launch::copy_rows(gpu, stream, &gather, 2 * d, x.x.h, 2, &h)?;
    let labels = Labels { dev: lab.sub(0, n, x.x.labels.elem())?, kind: x.x.labels.kind };
    let xc = BwdDev {
        p: Problem::new(n, v, d),
        x: LogitsIn { dims: Dims { t: n, v, d }, sc: x.x.sc, h: &h, w: x.x.w, labels: &labels },
        g: DlogitsIn { lse: &lse_c, grad_logprob: gl.map(|_| &gl_c), ent: ent.map(|_| (&ge_c, &ent_c)) },
        // The first `n_kept` compact rows are caller rows below the kept prefix (the index list
        // keeps row order): they read the kept logits at their caller rows.
        kept: match x.kept {
            Some((k, _)) if n_kept > 0 => Some((launch::KeptOut { map: Some(&idx), ..k }, n_kept)),
            _ => None,
        },
    };
    let e = if dh.f32 { 4 } else { 2 };
    let dh_c = Out { dev: dhc.sub(0, n * d, e)?, f32: dh.f32 };
    let report = head.backward_dev(ws, stream, opts, reduce_dh, &xc, (&dh_c, dw))?;
    launch::copy_rows(gpu, stream, &scatter, e * d, &dh_c.dev, e, &dh.dev)?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    const V: usize = 128_256;

    #[test]
    fn every_row_or_none_skips_the_model() {
        for pass in [Pass::Forward, Pass::Backward { dh_bytes: 2 }] {
            assert_eq!(plan(pass, 8192, 8192, V, 4096), Plan::Dense);
            assert_eq!(plan(pass, 8192, 0, V, 4096), Plan::Nothing);
            assert_eq!(plan(pass, 1, 1, 1, 8), Plan::Dense);
            assert_eq!(plan(pass, 1, 0, 1, 8), Plan::Nothing);
        }
    }

    #[test]
    fn compaction_pays_once_a_token_tile_goes_at_real_vocabularies() {
        for pass in [Pass::Forward, Pass::Backward { dh_bytes: 2 }, Pass::Backward { dh_bytes: 4 }] {
            for (v, d) in [(V, 4096), (248_320, 2048), (152_064, 5120), (32_000, 4096)] {
                // One tile fewer pays; fewer inactive rows than a tile rounds to the same tiles.
                assert_eq!(plan(pass, 8192, 8192 - 128, v, d), Plan::Compact, "{pass:?} v {v} d {d}");
                assert_eq!(plan(pass, 8192, 8192 - 100, v, d), Plan::Dense, "{pass:?} v {v} d {d}");
                for f in [0.75, 0.5, 0.25, 0.1] {
                    assert_eq!(plan(pass, 8192, (8192.0 * f) as usize, v, d), Plan::Compact, "{pass:?} v {v} f {f}");
                }
            }
        }
    }

    #[test]
    fn small_vocabularies_keep_the_dense_call_above_the_stated_fraction() {
        // The module docs' threshold: (1 − f)/f > 2·GEMM_FLOPS/(v·COPY_BYTES_PER_S) in the forward.
        let (t, d) = (1 << 20, 4096);
        for v in [1000usize, 4000, 32_000] {
            let k = 2.0 * GEMM_FLOPS / (v as f64 * COPY_BYTES_PER_S);
            let f_star = 1.0 / (1.0 + k);
            let below = ((f_star - 0.02).max(0.01) * t as f64) as usize;
            let above = ((f_star + 0.02).min(0.999) * t as f64) as usize;
            assert_eq!(plan(Pass::Forward, t, below, v, d), Plan::Compact, "v {v}: f* {f_star}");
            if f_star + 0.02 < 0.999 {
                assert_eq!(plan(Pass::Forward, t, above, v, d), Plan::Dense, "v {v}: f* {f_star}");
            }
        }
        // A tiny problem: the launches cost more than the GEMM work saved.
        assert_eq!(plan(Pass::Forward, 256, 128, 64, 64), Plan::Dense);
    }

    /// The CPU backend: a row whose upstream gradients are zero gets exactly what the same row
    /// labelled `ignore_index` gets (a zero `dh` row, nothing in `dW`), which is what lets the GPU
    /// backward drop such rows.
    #[test]
    fn zero_gradient_rows_match_ignored_rows_on_the_cpu() {
        use crate::cpu::{self, CpuGrads, CpuInputs};
        let (t, v, d) = (37, 101, 24);
        let s = lmhead_reference::Structure { huge: 0.0, all_negative: 0.0, ignored: 0.1, ..Default::default() };
        let case = lmhead_reference::Case::generate(11, t, v, d, &s);
        let (h, w): (Vec<bf16>, Vec<bf16>) =
            (case.h.iter().map(|&b| bf16::from_bits(b)).collect(), case.w.iter().map(|&b| bf16::from_bits(b)).collect());
        let x = CpuInputs { h: &h, w: &w, labels: &case.labels, problem: Problem::new(t, v, d) };
        let f = cpu::forward(&x, &FwdOptions::default(), true).unwrap();
        let mut rng = lmhead_reference::rng::Rng::new(3);
        let zero = |i: usize| i % 3 == 1;
        let gl: Vec<f32> = (0..t).map(|i| if zero(i) { 0.0 } else { rng.normal() as f32 }).collect();
        let ge: Vec<f32> = (0..t).map(|i| if zero(i) { 0.0 } else { rng.normal() as f32 }).collect();
        let g = CpuGrads { lse: &f.lse, entropy: f.entropy.as_deref(), grad_logprob: Some(&gl), grad_entropy: Some(&ge), kept: None };
        let (dh, dw) = cpu::backward(&x, &g, &BwdOptions::default()).unwrap();
        let ignored: Vec<i64> = (0..t).map(|i| if zero(i) { lmhead_reference::IGNORE_INDEX } else { case.labels[i] }).collect();
        let gl2: Vec<f32> = (0..t).map(|i| if zero(i) { 1.0 } else { gl[i] }).collect();
        let ge2: Vec<f32> = (0..t).map(|i| if zero(i) { 1.0 } else { ge[i] }).collect();
        let g2 = CpuGrads { grad_logprob: Some(&gl2), grad_entropy: Some(&ge2), ..g };
        let (dh2, dw2) = cpu::backward(&CpuInputs { labels: &ignored, ..x }, &g2, &BwdOptions::default()).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&dh), bits(&dh2));
        assert_eq!(bits(&dw), bits(&dw2));
        assert!((0..t).filter(|&i| zero(i)).all(|i| dh[i * d..(i + 1) * d].iter().all(|&x| x == 0.0)));
        assert!(dw.iter().any(|&x| x != 0.0));
    }

    #[test]
    fn always_compacts_where_auto_does_not_and_off_never() {
        assert_eq!(plan(Pass::Forward, 256, 128, 64, 64), Plan::Dense);
        assert_eq!(plan_for(Compaction::Always, Pass::Forward, 256, 128, 64, 64), Plan::Compact);
        assert_eq!(plan_for(Compaction::Always, Pass::Forward, 256, 0, 64, 64), Plan::Nothing);
        assert_eq!(plan_for(Compaction::Always, Pass::Forward, 256, 256, 64, 64), Plan::Dense);
        assert_eq!(plan_for(Compaction::Off, Pass::Forward, 8192, 1000, V, 4096), Plan::Dense);
    }

    #[test]
    fn the_backward_compacts_whenever_the_forward_does() {
        for v in [1000usize, 5003, 32_000, V] {
            for d in [64, 512, 4096] {
                for t in [129, 1000, 8192, 65_536] {
                    for n in (1..t).step_by((t / 97).max(1)) {
                        if plan(Pass::Forward, t, n, v, d) == Plan::Compact {
                            for dh_bytes in [2, 4] {
                                assert_eq!(plan(Pass::Backward { dh_bytes }, t, n, v, d), Plan::Compact, "t {t} n {n} v {v} d {d}");
                            }
                        }
                    }
                }
            }
        }
    }
}
