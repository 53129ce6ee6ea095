//! Launches of the per-row kernels: the label check, the forward's merges (single device and the
//! tensor-parallel steps), the f32 → bf16 cast, and the naive (level 00) forward.

use cudarc::driver::CudaStream;
use lmhead_core::config::fixed;
use lmhead_core::params::{CastParams, MergeParams, NaiveParams};

use super::{launch, Dev, Labels, LogitsIn};
use crate::device::Gpu;
use crate::error::{Error, Result};

/// Which per-row merge kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MergeStep {
    /// Partials → outputs (one device).
    Full,
    /// Partials → row states (tensor parallel).
    RowState,
    /// Row states → rescaled to the reduced maximum.
    Rescale,
    /// Reduced row states → outputs.
    Finish,
}

/// Outputs of the merge steps that write them.
pub struct MergeOuts<'a, 'b> {
    pub logprob: &'b Dev<'a>,
    pub lse: &'b Dev<'a>,
    pub entropy: Option<&'b Dev<'a>>,
    pub status: &'b Dev<'a>,
}

/// What the merge steps read: `t` rows, each with `n_splits` partials (steps that read them),
/// its label and the vocab numbering (`v_total` ids, this shard from `v_begin`,
/// `ignore_index`), and the tensor-parallel row states `[5][t]` (steps that use them).
#[derive(Clone, Copy)]
pub struct MergeRows<'a, 'b> {
    pub t: usize,
    pub n_splits: u32,
    pub v_total: i64,
    pub v_begin: i64,
    pub ignore_index: i64,
    pub labels: &'b Labels<'a>,
    pub partials: Option<&'b Dev<'a>>,
    pub row_state: Option<&'b Dev<'a>>,
}

/// One per-row merge step over `rows.t` rows.
pub fn merge(gpu: &Gpu, stream: &CudaStream, step: MergeStep, rows: &MergeRows, outs: Option<MergeOuts>) -> Result<()> {
    let MergeRows { t, n_splits, v_total, v_begin, ignore_index, labels, partials, row_state } = *rows;
    let mut p = MergeParams {
        t: t as u32,
        n_splits,
        v_total,
        v_begin,
        ignore_index,
        label_kind: labels.kind,
        labels: labels.dev.check_exact(t, labels.elem())?,
        ..Default::default()
    };
    let need_partials = matches!(step, MergeStep::Full | MergeStep::RowState);
    let need_state = step != MergeStep::Full;
    let need_outs = matches!(step, MergeStep::Full | MergeStep::Finish);
    if need_partials {
        p.partials = partials.ok_or_else(|| Error::Config("merge: partials missing".into()))?.check(n_splits as usize * t, 16)?;
    }
    if need_state {
        p.row_state = row_state.ok_or_else(|| Error::Config("merge: row state missing".into()))?.check(5 * t, 4)?;
    }
    if need_outs {
        let o = outs.ok_or_else(|| Error::Config("merge: outputs missing".into()))?;
        p.logprob = o.logprob.check_exact(t, 4)?;
        p.lse = o.lse.check_exact(t, 4)?;
        p.status = o.status.check(1, 4)?;
        if let Some(e) = o.entropy {
            p.entropy = e.check_exact(t, 4)?;
        }
    }
    let name = match step {
        MergeStep::Full => fixed::FWD_MERGE,
        MergeStep::RowState => fixed::FWD_ROW_STATE,
        MergeStep::Rescale => fixed::FWD_RESCALE,
        MergeStep::Finish => fixed::FWD_FINISH,
    };
    let grid = ((t as u32).div_ceil(fixed::THREADS), 1);
    launch(gpu, stream, name, 0, grid, fixed::THREADS, p)
}

/// The label check: `status[0]` gets [`lmhead_core::params::STATUS_BAD_LABEL`] and `status[1]`
/// the lowest row whose label is neither `ignore_index` nor in `[0, v_total)` (the caller sets
/// the two words to 0 and `u32::MAX` first). Reads only the labels.
pub fn check_labels(
    gpu: &Gpu,
    stream: &CudaStream,
    t: usize,
    (v_total, ignore_index): (i64, i64),
    labels: &Labels,
    status: &Dev,
) -> Result<()> {
    let p = MergeParams {
        t: t as u32,
        v_total,
        ignore_index,
        label_kind: labels.kind,
        labels: labels.dev.check_exact(t, labels.elem())?,
        status: status.check(2, 4)?,
        ..Default::default()
    };
    let grid = ((t as u32).div_ceil(fixed::THREADS), 1);
    launch(gpu, stream, fixed::CHECK_LABELS, 0, grid, fixed::THREADS, p)
}

/// `dst = bf16(src)` over `n` elements.
pub fn cast_f32_bf16(gpu: &Gpu, stream: &CudaStream, n: usize, src: &Dev, dst: &Dev) -> Result<()> {
    let p = CastParams { src: src.check(n, 4)?, dst: dst.check(n, 2)?, n: n as u64 };
    let blocks = (n.div_ceil(fixed::THREADS as usize)).clamp(1, 65_535 * 8) as u32;
    launch(gpu, stream, fixed::CAST_F32_BF16, 0, (blocks, 1), fixed::THREADS, p)
}

/// Level 00: the naive forward (one block per token).
pub fn naive_fwd(gpu: &Gpu, stream: &CudaStream, x: &LogitsIn, logprob: &Dev, lse: &Dev, entropy: Option<&Dev>) -> Result<()> {
    let (dims, sc, labels) = (x.dims, x.sc, x.labels);
    let (hp, wp, lp) = x.check()?;
    if sc.v_begin != 0 {
        return Err(Error::Config("the naive kernel has no tensor-parallel mode".into()));
    }
    let mut p = NaiveParams {
        h: hp,
        w: wp,
        labels: lp,
        logprob: logprob.check_exact(dims.t, 4)?,
        lse: lse.check_exact(dims.t, 4)?,
        ignore_index: sc.ignore_index,
        t: dims.t as u32,
        v: dims.v as u32,
        d: dims.d as u32,
        label_kind: labels.kind,
        inv_temp: sc.inv_temp,
        ..Default::default()
    };
    if let Some(e) = entropy {
        p.entropy = e.check_exact(dims.t, 4)?;
    }
    launch(gpu, stream, fixed::NAIVE_FWD, fixed::THREADS * 16, (dims.t as u32, 1), fixed::THREADS, p)
}
