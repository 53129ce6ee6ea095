//! Launches of the tuned tile kernels — the forward mainloop, the backward d-logits and the two
//! backward GEMMs — with the bounds each relies on and the order their blocks walk the tiles in.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaStream};
use lmhead_core::config::{fixed, keep_kernel_name, kernel_name, Family, TileConfig};
use lmhead_core::params::{GemmParams, LogitsParams};

use super::tmap::{tma_maps_for, TmaOperand};
use super::{launch, Dev, Labels};
use crate::device::Gpu;
use crate::error::{Context as _, Error, Result};

/// Scalars shared by the logits kernels.
#[derive(Clone, Copy, Debug)]
pub struct Scalars {
    pub inv_temp: f32,
    pub ignore_index: i64,
    pub v_begin: i64,
}

impl Scalars {
    fn fill(&self, p: &mut LogitsParams) {
        p.inv_temp = self.inv_temp;
        p.scale2 = (lmhead_core::lse::LOG2_E as f32) * self.inv_temp;
        p.ignore_index = self.ignore_index;
        p.v_begin = self.v_begin;
    }
}

/// Shape of a logits launch: `t` tokens, `v` local vocab rows, `d` hidden.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub t: usize,
    pub v: usize,
    pub d: usize,
}

/// The operands every logits kernel reads: the shape, the scalars, `h [t][d]`, `W [v][d]` and
/// the labels `[t]`.
#[derive(Clone, Copy)]
pub struct LogitsIn<'a, 'b> {
    pub dims: Dims,
    pub sc: Scalars,
    pub h: &'b Dev<'a>,
    pub w: &'b Dev<'a>,
    pub labels: &'b Labels<'a>,
}

impl LogitsIn<'_, '_> {
    /// The checked addresses of `h`, `W` and the labels.
    pub(super) fn check(&self) -> Result<(u64, u64, u64)> {
        let dims = self.dims;
        // cp.async reads 16-byte chunks: rows of h and W must start 16-byte aligned (d % 8 == 0
        // is checked by the shape check; the base address here).
        let hp = self.h.check_exact(dims.t * dims.d, 16)?;
        let wp = self.w.check_exact(dims.v * dims.d, 16)?;
        let lp = self.labels.dev.check_exact(dims.t, self.labels.elem())?;
        Ok((hp, wp, lp))
    }
}

/// The kept logits of a call (`crate::keep`): `buf` holds the planes of `rows` rows of the
/// caller's call (`lmhead_core::kept`, row stride `keep::stride(v)`); a launch on compacted rows
/// maps its row `i` to the caller's row `map[i]` (u32 `[launch rows]`; `None`: the identity). In
/// the backward, the launch's rows `[0, prefix)` are read from it (their caller rows are below
/// `rows`); the forward ignores `prefix`.
#[derive(Clone, Copy)]
pub struct KeptOut<'a, 'b> {
    pub buf: &'b Dev<'a>,
    pub rows: usize,
    pub map: Option<&'b Dev<'a>>,
}

impl KeptOut<'_, '_> {
    /// The kept fields of a launch over `t` rows: the buffer holds `keep::rows_len` elements
    /// (16-byte aligned), the map `t` rows.
    fn fill(&self, t: usize, v: usize, p: &mut LogitsParams) -> Result<()> {
        if self.rows > u32::MAX as usize || self.rows == 0 {
            return Err(Error::Config(format!("kept logits: {} rows for v = {v}", self.rows)));
        }
        p.kept = self.buf.check(crate::keep::rows_len(self.rows, v), 16)?;
        p.kept_stride = crate::keep::stride(v) as u64;
        p.kept_rows = self.rows as u32;
        p.kept_map = match self.map {
            Some(m) => m.check(t, 4)?,
            None => 0,
        };
        Ok(())
    }
}

/// The forward mainloop: writes `partials[slot][row]` for every slot of `plan` (a split's main
/// block, then its filler: [`lmhead_core::split::SplitPlan::blocks_per_row`]) and row `< t`;
/// with `kept`, the config's `_keep` twin, which also writes the kept logits of every row whose
/// caller row is below `kept.rows` (columns `< v`, and padding columns up to the stride).
/// Returns the plan as launched (`n_splits` from `tiles_per_split`).
pub fn fwd_mainloop(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    x: &LogitsIn,
    entropy: bool,
    (cfg, plan): (TileConfig, lmhead_core::split::SplitPlan),
    partials: &Dev,
    kept: Option<&KeptOut>,
) -> Result<lmhead_core::split::SplitPlan> {
    let family = if entropy { Family::FwdEnt } else { Family::Fwd };
    let (dims, sc, labels) = (x.dims, x.sc, x.labels);
    let (hp, wp, lp) = x.check()?;
    let v_tiles = dims.v.div_ceil(cfg.bn as usize) as u32;
    let tiles_per_split = plan.tiles_per_split;
    if tiles_per_split == 0 {
        return Err(Error::Config("tiles_per_split must be ≥ 1".into()));
    }
    check_fill(cfg, plan, v_tiles)?;
    let plan = lmhead_core::split::SplitPlan { n_splits: v_tiles.div_ceil(tiles_per_split), ..plan };
    let n_slots = plan.blocks_per_row();
    let pp = partials.check(n_slots as usize * dims.t, 16)?;
    let mut p = LogitsParams {
        h: hp,
        w: wp,
        labels: lp,
        partials: pp,
        h_row_stride: dims.d as u64,
        w_row_stride: dims.d as u64,
        t: dims.t as u32,
        v: dims.v as u32,
        d: dims.d as u32,
        label_kind: labels.kind,
        tiles_per_split,
        // Only the Hopper forward reads the raster order and the fill.
        raster_group: if cfg.is_sm90() { plan.raster_group } else { 0 },
        fill: plan.fill,
        ..Default::default()
    };
    sc.fill(&mut p);
    let mut ops = vec![TmaOperand::k_major(hp, dims.t, dims.d, dims.d, cfg.bm), TmaOperand::k_major(wp, dims.v, dims.d, dims.d, cfg.bn)];
    let (name, smem) = match kept {
        Some(k) => {
            k.fill(dims.t, dims.v, &mut p)?;
            // The sm90 twin stores the q plane of rows in the caller's order (no map) by TMA,
            // through a third map over the plane's first `min(rows, t)` rows (16-bit elements:
            // the copy moves bytes), which clips the rest of the rows and the columns past the
            // stride.
            if cfg.is_sm90() && k.map.is_none() {
                ops.push(TmaOperand::k_major(p.kept, k.rows.min(dims.t), crate::keep::stride(dims.v), crate::keep::stride(dims.v), 64));
            }
            (keep_kernel_name(family, cfg), cfg.keep_smem_bytes())
        }
        None => (kernel_name(family, cfg), cfg.smem_bytes()),
    };
    let (maps, tmaps) = tma_maps_for(cfg, stream, &ops)?;
    p.tmaps = tmaps;
    let grid = (dims.t.div_ceil(cfg.bm as usize) as u32, n_slots);
    launch(gpu, stream, &name, smem as u32, grid, cfg.threads(), p)?;
    drop(maps);
    Ok(plan)
}

/// The kernels' contract on a plan's fill over `n_tiles` tiles: only the `Sm90` kernels read it,
/// and it stays below the last split's length, so that no block is left without a tile.
fn check_fill(cfg: TileConfig, plan: lmhead_core::split::SplitPlan, n_tiles: u32) -> Result<()> {
    if plan.fill > 0 && (!cfg.is_sm90() || plan.fill >= lmhead_core::split::last_split_len(plan, n_tiles)) {
        return Err(Error::Config(format!("plan {plan:?}: a fill needs an sm90 config and must be below the last split's length")));
    }
    Ok(())
}

/// A vocab chunk of the backward: columns `[begin, begin + width)` of the local vocab, staged
/// with `stride` columns per row.
#[derive(Clone, Copy, Debug)]
pub struct Chunk {
    pub begin: usize,
    pub width: usize,
    pub stride: usize,
}

/// What the d-logits read besides the logits operands: the forward's `lse [t]`, the upstream
/// log-prob gradient `[t]`, and for the entropy gradient the pair (gradient, saved entropy).
#[derive(Clone, Copy)]
pub struct DlogitsIn<'a, 'b> {
    pub lse: &'b Dev<'a>,
    pub grad_logprob: Option<&'b Dev<'a>>,
    pub ent: Option<(&'b Dev<'a>, &'b Dev<'a>)>,
}

/// Backward d-logits of `chunk` of the local vocab into `staging [t][chunk.stride]`.
pub fn bwd_dlogits(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    cfg: TileConfig,
    x: &LogitsIn,
    chunk: Chunk,
    g: &DlogitsIn,
    staging: &Dev,
) -> Result<()> {
    let (dims, sc, labels) = (x.dims, x.sc, x.labels);
    let Chunk { begin: chunk_begin, width: chunk, stride } = chunk;
    let DlogitsIn { lse, grad_logprob, ent } = *g;
    let (hp, wp, lp) = x.check()?;
    if chunk == 0 || chunk_begin + chunk > dims.v || stride % 8 != 0 || stride < chunk {
        return Err(Error::Config(format!("bad vocab chunk {chunk_begin}+{chunk} (stride {stride}) of v = {}", dims.v)));
    }
    let mut p = LogitsParams {
        h: hp,
        w: wp,
        labels: lp,
        lse: lse.check_exact(dims.t, 4)?,
        staging: staging.check(dims.t * stride, 16)?,
        h_row_stride: dims.d as u64,
        w_row_stride: dims.d as u64,
        staging_stride: stride as u64,
        t: dims.t as u32,
        v: dims.v as u32,
        d: dims.d as u32,
        label_kind: labels.kind,
        v_chunk_begin: chunk_begin as u32,
        v_chunk: chunk as u32,
        ..Default::default()
    };
    if let Some(g) = grad_logprob {
        p.grad_logprob = g.check_exact(dims.t, 4)?;
    }
    let family = match ent {
        Some((g, e)) => {
            p.grad_entropy = g.check_exact(dims.t, 4)?;
            p.entropy = e.check_exact(dims.t, 4)?;
            Family::BwdDlogitsEnt
        }
        None => Family::BwdDlogits,
    };
    sc.fill(&mut p);
    let m_tiles = dims.t.div_ceil(cfg.bm as usize) as u32;
    let n_tiles = stride.div_ceil(cfg.bn as usize) as u32;
    let plan = crate::plan::bwd(gpu, cfg, m_tiles, n_tiles, dims.d);
    check_fill(cfg, plan, n_tiles)?;
    (p.tiles_per_split, p.raster_group, p.fill) = (plan.tiles_per_split, plan.raster_group, plan.fill);
    let grid = (m_tiles, plan.blocks_per_row());
    // The B map ends at the chunk: rows beyond it load as zeros, as the `cp.async` path's bound.
    // A `tma_store` config stores through a third map over the staging buffer, which clips rows
    // ≥ t and columns ≥ stride as the other epilogue's guards do.
    let a_map = TmaOperand::k_major(hp, dims.t, dims.d, dims.d, cfg.bm);
    let b_map = TmaOperand::k_major(wp, chunk_begin + chunk, dims.d, dims.d, cfg.bn);
    let store_map = TmaOperand::k_major(p.staging, dims.t, stride, stride, 64);
    let ops: &[TmaOperand] = if cfg.mainloop.tma_store() { &[a_map, b_map, store_map] } else { &[a_map, b_map] };
    let (maps, tmaps) = tma_maps_for(cfg, stream, ops)?;
    p.tmaps = tmaps;
    // Columns beyond the chunk up to a whole tile are written only below `stride`.
    launch(gpu, stream, &kernel_name(family, cfg), cfg.smem_bytes() as u32, grid, cfg.threads(), p)?;
    drop(maps);
    Ok(())
}

/// Columns of a chunk one block of [`bwd_dlogits_kept`] covers.
pub const KEPT_BLOCK_COLS: usize = lmhead_core::kept::READ_COLS * fixed::THREADS as usize;

/// Backward d-logits of `chunk` for the launch's rows `[0, kept.prefix)` from the kept logits
/// into `staging [prefix][chunk.stride]` (columns past the chunk zero), the same function as
/// [`bwd_dlogits`]'s recompute of the logits as kept. Reads `lse`, the gradients and the labels of
/// those rows (`x.labels`, `g` may be longer); `h` and `W` are not read.
pub fn bwd_dlogits_kept(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    x: &LogitsIn,
    chunk: Chunk,
    g: &DlogitsIn,
    (kept, prefix): (&KeptOut, usize),
    staging: &Dev,
) -> Result<()> {
    let (dims, sc, labels) = (x.dims, x.sc, x.labels);
    let Chunk { begin: chunk_begin, width: chunk, stride } = chunk;
    let DlogitsIn { lse, grad_logprob, ent } = *g;
    if chunk == 0 || chunk_begin + chunk > dims.v || stride % 8 != 0 || stride < chunk || prefix == 0 || prefix > dims.t {
        return Err(Error::Config(format!("bad kept chunk {chunk_begin}+{chunk} (stride {stride}, {prefix} rows) of v = {}", dims.v)));
    }
    if prefix > u32::MAX as usize {
        return Err(Error::Config(format!("{prefix} kept rows: the grid indexes rows with 32 bits")));
    }
    let mut p = LogitsParams {
        labels: labels.dev.check(prefix, labels.elem())?,
        lse: lse.check(prefix, 4)?,
        staging: staging.check(prefix * stride, 16)?,
        staging_stride: stride as u64,
        t: prefix as u32,
        v: dims.v as u32,
        d: dims.d as u32,
        label_kind: labels.kind,
        v_chunk_begin: chunk_begin as u32,
        v_chunk: chunk as u32,
        ..Default::default()
    };
    if let Some(g) = grad_logprob {
        p.grad_logprob = g.check(prefix, 4)?;
    }
    let name = match ent {
        Some((g, e)) => {
            p.grad_entropy = g.check(prefix, 4)?;
            p.entropy = e.check(prefix, 4)?;
            fixed::DLOGITS_KEPT_ENT
        }
        None => fixed::DLOGITS_KEPT,
    };
    sc.fill(&mut p);
    kept.fill(prefix, dims.v, &mut p)?;
    if kept.map.is_none() && prefix > kept.rows {
        return Err(Error::Config(format!("{prefix} rows read from {} kept rows", kept.rows)));
    }
    let grid = (prefix as u32, stride.div_ceil(KEPT_BLOCK_COLS) as u32);
    launch(gpu, stream, name, 0, grid, fixed::THREADS, p)
}

/// How a backward GEMM treats its f32 accumulator and output.
#[derive(Clone, Copy, Debug)]
pub struct GemmOut {
    /// Add the accumulator's current contents.
    pub accumulate: bool,
    /// Write the sum back to the accumulator.
    pub write_acc: bool,
    /// Write the sum to `out` as f32 (else bf16), when `out` is given.
    pub out_f32: bool,
}

/// The operands of a backward GEMM: `C[m][n] (+)= Σ_k A · B`, A with rows `a_stride` apart and
/// B `[k][n]` with rows `b_stride` apart.
#[derive(Clone, Copy)]
pub struct GemmIn<'a, 'b> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: &'b Dev<'a>,
    pub a_stride: usize,
    pub b: &'b Dev<'a>,
    pub b_stride: usize,
}

/// Where a backward GEMM's sum goes: the f32 accumulator and/or the output, as `mode` says.
#[derive(Clone, Copy)]
pub struct GemmC<'a, 'b> {
    pub acc: Option<&'b Dev<'a>>,
    pub out: Option<&'b Dev<'a>>,
    pub mode: GemmOut,
}

/// Which backward GEMM a launch runs: `family` is `BwdDh` (A `[m][k]` K-major) or `BwdDw` (A
/// `[k][m]` M-major, i.e. the staging buffer read transposed), at `cfg`, queued after the event
/// `after` of another stream when there is one.
#[derive(Clone, Copy)]
pub struct GemmLaunch<'e> {
    pub family: Family,
    pub cfg: TileConfig,
    pub after: Option<&'e CudaEvent>,
}

/// `C[m][n] (+)= Σ_k A · B` for the backward, on the operands as stored: `family` is `BwdDh`
/// (A `[m][k]` K-major) or `BwdDw` (A `[k][m]` M-major, i.e. the staging buffer read
/// transposed); B is `[k][n]`. `cfg` is an `mma.sync` config or an sm90 one (which reads the
/// operands in place through tensor maps).
pub fn bwd_gemm(gpu: &Gpu, stream: &Arc<CudaStream>, family: Family, cfg: TileConfig, g: &GemmIn, c: &GemmC) -> Result<()> {
    bwd_gemm_after(gpu, stream, &GemmLaunch { family, cfg, after: None }, g, c)
}

/// [`bwd_gemm`] of `l` on `stream` after `l.after` (an event of another stream): the tensor maps
/// are copied first, so that the kernel is ready to run the moment the event completes.
pub(crate) fn bwd_gemm_after(gpu: &Gpu, stream: &Arc<CudaStream>, l: &GemmLaunch, g: &GemmIn, c: &GemmC) -> Result<()> {
    let GemmIn { m, n, k, a, a_stride, b, b_stride } = *g;
    let (family, cfg) = (l.family, l.cfg);
    if n % 8 != 0 || a_stride % 8 != 0 || b_stride % 8 != 0 || b_stride < n {
        return Err(Error::Config(format!("gemm needs n, strides multiples of 8 (n {n}, strides {a_stride}, {b_stride})")));
    }
    // A is read in whole 16-byte chunks up to its column bound rounded up to 8.
    let a_need = match family {
        Family::BwdDh => {
            if a_stride < k.next_multiple_of(8) {
                return Err(Error::Config("dh: A stride below k".into()));
            }
            m * a_stride
        }
        Family::BwdDw => {
            if a_stride < m.next_multiple_of(8) {
                return Err(Error::Config("dW: A stride below m".into()));
            }
            k * a_stride
        }
        _ => return Err(Error::Config(format!("{family:?} is not a GEMM family"))),
    };
    let (a, b) = (a.check(a_need, 16)?, b.check(k * b_stride, 16)?);
    // The tensor maps of an in-place TMA config: B, and dW's A, are MN-major.
    let a_map = match family {
        Family::BwdDh => TmaOperand::k_major(a, m, k, a_stride, cfg.bm),
        _ => TmaOperand::mn_major(a, k, m, a_stride),
    };
    launch_gemm(gpu, stream, l, g, [a_map, TmaOperand::mn_major(b, k, n, b_stride)], c)
}

/// The launch shared by both GEMM kinds, after each checked its operands and described them as
/// tensor maps (`maps`: A, B, whose `ptr` are the checked addresses; only a TMA config loads
/// through the maps): the C buffers' bounds for `mode`, then the grid of `(bm × bn)` tiles,
/// launched once `stream` has waited for `l.after`.
fn launch_gemm(gpu: &Gpu, stream: &Arc<CudaStream>, l: &GemmLaunch, g: &GemmIn, maps: [TmaOperand; 2], c: &GemmC) -> Result<()> {
    let (family, cfg, after) = (l.family, l.cfg, l.after);
    let (GemmIn { m, n, k, a_stride, b_stride, .. }, GemmC { acc, out, mode }) = (*g, *c);
    let mut p = GemmParams {
        a: maps[0].ptr,
        b: maps[1].ptr,
        a_stride: a_stride as u64,
        b_stride: b_stride as u64,
        c_stride: n as u64,
        m: m as u32,
        n: n as u32,
        k: k as u32,
        accumulate: mode.accumulate as u32,
        write_acc: mode.write_acc as u32,
        out_f32: mode.out_f32 as u32,
        ..Default::default()
    };
    if mode.accumulate || mode.write_acc {
        p.c_acc = acc.ok_or_else(|| Error::Config("gemm: accumulator missing".into()))?.check(m * n, 8)?;
    }
    if let Some(o) = out {
        p.c_out = o.check(m * n, if mode.out_f32 { 8 } else { 4 })?;
    }
    // A `tma_store` dh writes a sum that goes to the accumulator alone through a third map over
    // it (stored or added by TMA). Any other sum (the last chunk's, with the output), and one
    // into an accumulator only 8-byte aligned (a caller's f32 view; a tensor map needs 16),
    // takes the config's register twin (the same tile; the `tma_store` kernel serves only the
    // accumulator-alone case and traps on any other).
    let mut cfg = cfg;
    let mut acc_map = None;
    if cfg.mainloop.tma_store() {
        if mode.write_acc && out.is_none() && p.c_acc.is_multiple_of(16) {
            acc_map = Some(TmaOperand::f32_acc(p.c_acc, m, n, n));
        } else {
            cfg = cfg.register_twin();
        }
    }
    let ops: Vec<TmaOperand> = maps.into_iter().chain(acc_map).collect();
    let (maps, tmaps) = tma_maps_for(cfg, stream, &ops)?;
    p.tmaps = tmaps;
    let m_tiles = m.div_ceil(cfg.bm as usize) as u32;
    let n_tiles = n.div_ceil(cfg.bn as usize) as u32;
    let plan = crate::plan::bwd(gpu, cfg, m_tiles, n_tiles, k);
    check_fill(cfg, plan, n_tiles)?;
    (p.tiles_per_block, p.raster_group, p.fill) = (plan.tiles_per_split, plan.raster_group, plan.fill);
    let grid = (m_tiles, plan.blocks_per_row());
    if let Some(e) = after {
        stream.wait(e).during(|| format!("ordering `{}` after the d-logits", kernel_name(family, cfg)))?;
    }
    launch(gpu, stream, &kernel_name(family, cfg), cfg.smem_bytes() as u32, grid, cfg.threads(), p)?;
    drop(maps);
    Ok(())
}
