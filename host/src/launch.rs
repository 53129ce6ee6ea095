//! The only place that launches kernels. Every launch function here is safe: it receives its
//! buffers as [`Dev`] arguments (address, element count, cudarc's sync guard), checks every
//! bound the kernel relies on against the shape, and only then launches. The SAFETY notes answer
//! cudarc's three launch hazards:
//! - **types**: the kernel's single parameter is the `#[repr(C)]` struct from `lmhead_core::params`
//!   that the device entry takes by value (the same definition on both sides);
//! - **writes**: outputs come from `DevicePtrMut` (exclusive borrows), and cudarc's guards order
//!   them after earlier work on other streams;
//! - **bounds**: the length checks in each function cover every element the kernel touches for
//!   the launched grid (the kernels mask rows ≥ t, columns ≥ v and K tails).

use std::sync::Arc;

use cudarc::driver::{sys, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig, PushKernelArg, SyncOnDrop};
use lmhead_core::config::{fixed, kernel_name, Family, TileConfig};
use lmhead_core::params::{CastParams, GemmParams, LogitsParams, MergeParams, NaiveParams, UnitParams, LABELS_I32, LABELS_I64};
use lmhead_core::split;

use crate::device::Gpu;
use crate::error::{Context as _, Error, Result};
use crate::overrides::Overrides;

/// A device buffer argument, checked to belong to the stream's context.
pub struct Dev<'a> {
    pub ptr: u64,
    pub len: usize,
    pub what: &'static str,
    _sync: Option<SyncOnDrop<'a>>,
}

fn same_context(a: &CudaStream, b: &CudaStream) -> bool {
    a.context().cu_ctx() == b.context().cu_ctx()
}

/// A buffer the kernel reads.
pub fn dev_in<'a, T>(buf: &'a (impl DevicePtr<T> + ?Sized), stream: &'a CudaStream, what: &'static str) -> Result<Dev<'a>> {
    if !same_context(buf.stream(), stream) {
        return Err(Error::WrongContext { what });
    }
    let len = buf.len();
    let (ptr, sync) = buf.device_ptr(stream);
    Ok(Dev { ptr, len, what, _sync: Some(sync) })
}

/// A buffer the kernel writes.
pub fn dev_out<'a, T>(buf: &'a mut (impl DevicePtrMut<T> + ?Sized), stream: &'a CudaStream, what: &'static str) -> Result<Dev<'a>> {
    if !same_context(buf.stream(), stream) {
        return Err(Error::WrongContext { what });
    }
    let len = buf.len();
    let (ptr, sync) = buf.device_ptr_mut(stream);
    Ok(Dev { ptr, len, what, _sync: Some(sync) })
}

impl Dev<'_> {
    /// What validation sees of this buffer (`elem` bytes per element).
    pub fn buf(&self, elem: usize) -> crate::validate::Buf {
        crate::validate::Buf::new(self.what, self.ptr, self.len, elem)
    }

    /// Elements `[start, start + len)` of this buffer (`elem` bytes each), for a kernel that
    /// writes or reads part of it. The parent's guard keeps ordering the whole buffer.
    pub fn sub(&self, start: usize, len: usize, elem: usize) -> Result<Dev<'_>> {
        if start + len > self.len {
            return Err(Error::Length { what: self.what, expected: start + len, got: self.len });
        }
        Ok(Dev { ptr: self.ptr + (start * elem) as u64, len, what: self.what, _sync: None })
    }

    /// At least `n` elements, and aligned to `align` bytes.
    pub fn check(&self, n: usize, align: usize) -> Result<u64> {
        if self.len < n {
            return Err(Error::Length { what: self.what, expected: n, got: self.len });
        }
        if !self.ptr.is_multiple_of(align as u64) {
            return Err(Error::Misaligned { what: self.what, align });
        }
        Ok(self.ptr)
    }

    /// Exactly `n` elements (user-facing buffers: a longer buffer is usually a shape mistake).
    pub fn check_exact(&self, n: usize, align: usize) -> Result<u64> {
        if self.len != n {
            return Err(Error::Length { what: self.what, expected: n, got: self.len });
        }
        self.check(n, align)
    }
}

/// Token labels, `i32` or `i64`.
pub struct Labels<'a> {
    pub dev: Dev<'a>,
    pub kind: u32,
}

impl Labels<'_> {
    pub fn buf(&self) -> crate::validate::Buf {
        self.dev.buf(self.elem())
    }

    pub fn elem(&self) -> usize {
        if self.kind == LABELS_I64 {
            8
        } else {
            4
        }
    }
}

pub fn labels_i32<'a>(buf: &'a (impl DevicePtr<i32> + ?Sized), s: &'a CudaStream) -> Result<Labels<'a>> {
    Ok(Labels { dev: dev_in(buf, s, "labels")?, kind: LABELS_I32 })
}

pub fn labels_i64<'a>(buf: &'a (impl DevicePtr<i64> + ?Sized), s: &'a CudaStream) -> Result<Labels<'a>> {
    Ok(Labels { dev: dev_in(buf, s, "labels")?, kind: LABELS_I64 })
}

/// A kernel parameter struct passed by value.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct Arg<T>(T);
// SAFETY: each of these is a `#[repr(C)]` plain-old-data struct of integers and floats, the exact
// type the device entry point declares as its one by-value parameter.
unsafe impl DeviceRepr for Arg<LogitsParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<GemmParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<MergeParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<CastParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<NaiveParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<UnitParams> {}
// SAFETY: `Partial` is `#[repr(C, align(16))]` of four f32; any bit pattern is valid.
unsafe impl DeviceRepr for crate::workspace::PartialRepr {}
// SAFETY: zero bits are four 0.0 f32.
unsafe impl cudarc::driver::ValidAsZeroBits for crate::workspace::PartialRepr {}

fn launch<T: Copy>(gpu: &Gpu, stream: &CudaStream, name: &str, smem: u32, grid: (u32, u32), threads: u32, p: T) -> Result<()>
where
    Arg<T>: DeviceRepr,
{
    let f = gpu.function(name, smem)?;
    let cfg = LaunchConfig { grid_dim: (grid.0, grid.1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
    let arg = Arg(p);
    let mut b = stream.launch_builder(&f);
    b.arg(&arg);
    // SAFETY: see the module docs; every caller checked the bounds of the buffers in `p` for
    // this grid, and `name`'s entry takes exactly `T` by value.
    unsafe { b.launch(cfg) }.during(|| format!("launching `{name}` grid {grid:?}"))?;
    Ok(())
}

/// A bf16 operand of a TMA config: `rows` rows of `cols` contiguous elements, `stride` elements
/// apart, loaded in boxes of 64 columns × `box_rows` rows. K-major operands have K along the
/// columns (boxes 64 × the tile's rows); MN-major ones (`TileConfig::mn`) have K along the rows
/// and M or N along the columns (boxes 64 × 64, one per 64-wide slab of the tile).
#[derive(Clone, Copy, Debug)]
struct TmaOperand {
    ptr: u64,
    rows: usize,
    cols: usize,
    stride: usize,
    box_rows: u32,
}

impl TmaOperand {
    /// `[rows][k]` read K-major by tiles of `box_rows` rows.
    fn k_major(ptr: u64, rows: usize, k: usize, stride: usize, box_rows: u16) -> Self {
        Self { ptr, rows, cols: k, stride, box_rows: box_rows.into() }
    }

    /// `[k][mn]` read MN-major, 64 × 64 boxes.
    fn mn_major(ptr: u64, k: usize, mn: usize, stride: usize) -> Self {
        Self { ptr, rows: k, cols: mn, stride, box_rows: 64 }
    }
}

/// The tensor map of one operand: 2-D, bf16, 128-byte swizzle (the layout the `wgmma`
/// descriptors read), out-of-bounds elements zero-filled, 256-byte L2 promotion.
fn encode_tmap(op: TmaOperand) -> Result<[u8; 128]> {
    let elem = 2usize;
    if !op.ptr.is_multiple_of(16) || !(op.stride * elem).is_multiple_of(16) || op.stride < op.cols || op.rows == 0 || op.cols == 0 {
        return Err(Error::Config(format!("no tensor map for {op:?}: 16-byte aligned rows and base needed")));
    }
    if op.rows > u32::MAX as usize || op.cols > u32::MAX as usize || op.box_rows == 0 || op.box_rows > 256 {
        return Err(Error::Config(format!("no tensor map for {op:?}: dimensions out of range")));
    }
    let dims: [u64; 2] = [op.cols as u64, op.rows as u64];
    let strides: [u64; 1] = [(op.stride * elem) as u64];
    let boxes: [u32; 2] = [64, op.box_rows];
    let elem_strides: [u32; 2] = [1, 1];
    let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
    // SAFETY: every pointer argument points to a live local array of the length the rank (2)
    // implies (`strides` has rank − 1 entries); `map` is writable, 64-byte aligned storage for
    // one CUtensorMap; the global address is only recorded here, not dereferenced.
    let r = unsafe {
        sys::cuTensorMapEncodeTiled(
            map.as_mut_ptr(),
            sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            op.ptr as *mut std::ffi::c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            elem_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    if r != sys::CUresult::CUDA_SUCCESS {
        return Err(Error::Config(format!("cuTensorMapEncodeTiled failed ({r:?}) for {op:?}")));
    }
    // SAFETY: the call succeeded, so it initialised the map (and `zeroed` covered it before).
    let map = unsafe { map.assume_init() };
    let mut bytes = [0u8; 128];
    for (chunk, word) in bytes.chunks_exact_mut(8).zip(map.opaque.iter()) {
        chunk.copy_from_slice(&word.to_le_bytes());
    }
    Ok(bytes)
}

/// The tensor maps of a TMA launch (A, then B, then for a `tma_store` d-logits the staging
/// buffer) in device memory, 128 bytes apart, stream-ordered before the kernel, and their device
/// address. Keep the returned buffer until the launch is queued: dropping it frees it on the same
/// stream, after the kernel.
fn tma_maps(stream: &Arc<CudaStream>, ops: &[TmaOperand]) -> Result<(CudaSlice<u8>, u64)> {
    let mut all = vec![0u8; 128 * ops.len()];
    for (slot, &op) in all.chunks_exact_mut(128).zip(ops) {
        slot.copy_from_slice(&encode_tmap(op)?);
    }
    let dev = stream.clone_htod(&all).during(|| "copying tensor maps to the device".to_string())?;
    let addr = dev.device_ptr(stream).0;
    if !addr.is_multiple_of(64) {
        return Err(Error::Config("tensor-map buffer is not 64-byte aligned".into()));
    }
    Ok((dev, addr))
}

/// [`tma_maps`] for a TMA `cfg`; for any other config no buffer and address 0 (the kernel's
/// `tmaps` parameter is then unused).
fn tma_maps_for(cfg: TileConfig, stream: &Arc<CudaStream>, ops: &[TmaOperand]) -> Result<(Option<CudaSlice<u8>>, u64)> {
    if !cfg.is_sm90() {
        return Ok((None, 0));
    }
    let (buf, addr) = tma_maps(stream, ops)?;
    Ok((Some(buf), addr))
}

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

fn check_hw(h: &Dev, w: &Dev, labels: &Labels, dims: Dims) -> Result<(u64, u64, u64)> {
    // cp.async reads 16-byte chunks: rows of h and W must start 16-byte aligned (d % 8 == 0 is
    // checked by the shape check; the base address here).
    let hp = h.check_exact(dims.t * dims.d, 16)?;
    let wp = w.check_exact(dims.v * dims.d, 16)?;
    let lp = labels.dev.check_exact(dims.t, labels.elem())?;
    Ok((hp, wp, lp))
}

/// The forward mainloop: writes `partials[split][row]` for every split of `plan` and row `< t`.
#[allow(clippy::too_many_arguments)]
pub fn fwd_mainloop(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    entropy: bool,
    cfg: TileConfig,
    plan: lmhead_core::split::SplitPlan,
    dims: Dims,
    sc: Scalars,
    h: &Dev,
    w: &Dev,
    labels: &Labels,
    partials: &Dev,
) -> Result<u32> {
    let family = if entropy { Family::FwdEnt } else { Family::Fwd };
    let (hp, wp, lp) = check_hw(h, w, labels, dims)?;
    let v_tiles = dims.v.div_ceil(cfg.bn as usize) as u32;
    let tiles_per_split = plan.tiles_per_split;
    if tiles_per_split == 0 {
        return Err(Error::Config("tiles_per_split must be ≥ 1".into()));
    }
    let n_splits = v_tiles.div_ceil(tiles_per_split);
    let pp = partials.check(n_splits as usize * dims.t, 16)?;
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
        // Only the Hopper forward reads the raster order.
        raster_group: if cfg.is_sm90() { plan.raster_group } else { 0 },
        ..Default::default()
    };
    sc.fill(&mut p);
    let (maps, tmaps) = tma_maps_for(
        cfg,
        stream,
        &[TmaOperand::k_major(hp, dims.t, dims.d, dims.d, cfg.bm), TmaOperand::k_major(wp, dims.v, dims.d, dims.d, cfg.bn)],
    )?;
    p.tmaps = tmaps;
    let grid = (dims.t.div_ceil(cfg.bm as usize) as u32, n_splits);
    launch(gpu, stream, &kernel_name(family, cfg), cfg.smem_bytes() as u32, grid, cfg.threads(), p)?;
    drop(maps);
    Ok(n_splits)
}

/// How a Hopper backward grid of `m_tiles × n_tiles` output tiles (`k`-deep) is walked: the
/// forward's split planner ([`split::plan_l2`], with A's `BM × k` rows as the resident tile)
/// gives the consecutive n tiles per block and the raster group. With one tile per block, as
/// the `cp.async` kernels take them, every tile pays a pipeline fill and an exposed epilogue
/// (measured on the H200 at t = 8192, d = 4096, chunks of 8192: d-logits ≈ 1.5× and `dh` ≈ 1.3×
/// the time per FLOP of the whole-vocab cuBLAS GEMM). `LMHEAD_BWD_TILES`
/// and `LMHEAD_BWD_RASTER` override the plan ([`crate::overrides`]).
fn bwd_plan(gpu: &Gpu, cfg: TileConfig, m_tiles: u32, n_tiles: u32, k: usize) -> split::SplitPlan {
    if !cfg.is_sm90() {
        return split::SplitPlan { tiles_per_split: 1, n_splits: n_tiles, raster_group: 0 };
    }
    let info = gpu.info();
    let l2 = split::L2Model::of(cfg.bm.into(), k as u64, info.l2_bytes);
    Overrides::get().bwd.apply(split::plan_l2(m_tiles, n_tiles, info.sm_count, l2), n_tiles)
}

/// Backward d-logits of the chunk `[chunk_begin, chunk_begin + chunk)` of the local vocab into
/// `staging [t][stride]`.
#[allow(clippy::too_many_arguments)]
pub fn bwd_dlogits(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    cfg: TileConfig,
    dims: Dims,
    sc: Scalars,
    (chunk_begin, chunk, stride): (usize, usize, usize),
    h: &Dev,
    w: &Dev,
    labels: &Labels,
    lse: &Dev,
    grad_logprob: Option<&Dev>,
    ent: Option<(&Dev, &Dev)>,
    staging: &Dev,
) -> Result<()> {
    let (hp, wp, lp) = check_hw(h, w, labels, dims)?;
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
    let plan = bwd_plan(gpu, cfg, m_tiles, stride.div_ceil(cfg.bn as usize) as u32, dims.d);
    (p.tiles_per_split, p.raster_group) = (plan.tiles_per_split, plan.raster_group);
    let grid = (m_tiles, plan.n_splits);
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

/// `C[m][n] (+)= Σ_k A · B` for the backward, on the operands as stored: `family` is `BwdDh`
/// (A `[m][k]` K-major) or `BwdDw` (A `[k][m]` M-major, i.e. the staging buffer read
/// transposed); B is `[k][n]`. `cfg` is an `mma.sync` config or an sm90 one (which reads the
/// operands in place through tensor maps).
#[allow(clippy::too_many_arguments)]
pub fn bwd_gemm(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    family: Family,
    cfg: TileConfig,
    (m, n, k): (usize, usize, usize),
    (a, a_stride): (&Dev, usize),
    (b, b_stride): (&Dev, usize),
    acc: Option<&Dev>,
    out: Option<&Dev>,
    mode: GemmOut,
) -> Result<()> {
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
    let maps = (a_map, TmaOperand::mn_major(b, k, n, b_stride));
    launch_gemm(gpu, stream, family, cfg, (m, n, k), (a, a_stride), (b, b_stride), maps, acc, out, mode)
}

/// The launch shared by both GEMM kinds, after each checked its operands (and described them
/// as tensor maps, which only a TMA config loads through): the C buffers' bounds for `mode`,
/// then the grid of `(bm × bn)` tiles.
#[allow(clippy::too_many_arguments)]
fn launch_gemm(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    family: Family,
    cfg: TileConfig,
    (m, n, k): (usize, usize, usize),
    (a, a_stride): (u64, usize),
    (b, b_stride): (u64, usize),
    (a_map, b_map): (TmaOperand, TmaOperand),
    acc: Option<&Dev>,
    out: Option<&Dev>,
    mode: GemmOut,
) -> Result<()> {
    let mut p = GemmParams {
        a,
        b,
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
    let (maps, tmaps) = tma_maps_for(cfg, stream, &[a_map, b_map])?;
    p.tmaps = tmaps;
    let m_tiles = m.div_ceil(cfg.bm as usize) as u32;
    let plan = bwd_plan(gpu, cfg, m_tiles, n.div_ceil(cfg.bn as usize) as u32, k);
    (p.tiles_per_block, p.raster_group) = (plan.tiles_per_split, plan.raster_group);
    let grid = (m_tiles, plan.n_splits);
    launch(gpu, stream, &kernel_name(family, cfg), cfg.smem_bytes() as u32, grid, cfg.threads(), p)?;
    drop(maps);
    Ok(())
}

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

/// One per-row merge step over `t` rows.
#[allow(clippy::too_many_arguments)]
pub fn merge(
    gpu: &Gpu,
    stream: &CudaStream,
    step: MergeStep,
    t: usize,
    n_splits: u32,
    (v_total, v_begin, ignore_index): (i64, i64, i64),
    labels: &Labels,
    partials: Option<&Dev>,
    row_state: Option<&Dev>,
    outs: Option<MergeOuts>,
) -> Result<()> {
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
#[allow(clippy::too_many_arguments)]
pub fn naive_fwd(
    gpu: &Gpu,
    stream: &CudaStream,
    dims: Dims,
    sc: Scalars,
    h: &Dev,
    w: &Dev,
    labels: &Labels,
    logprob: &Dev,
    lse: &Dev,
    entropy: Option<&Dev>,
) -> Result<()> {
    let (hp, wp, lp) = check_hw(h, w, labels, dims)?;
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

/// Unit kernel `UNIT_TMA_COPY`: the box at `(k0, row0)` (`rows` rows × 64 bf16) of the bf16
/// matrix `src` (`src_rows` rows of `k` elements, `stride` apart), as the tensor memory
/// accelerator lays it out in shared memory, written to `out` (`rows · 64` bf16).
#[allow(clippy::too_many_arguments)]
pub fn unit_tma_copy(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    (src, src_rows, k, stride): (&Dev, usize, usize, usize),
    (k0, row0, rows): (u32, u32, u32),
    out: &Dev,
) -> Result<()> {
    if rows == 0 || rows > 256 || rows % 8 != 0 {
        return Err(Error::Config(format!("unit TMA box of {rows} rows (1..=256, multiple of 8)")));
    }
    let a = TmaOperand { ptr: src.check(src_rows * stride, 16)?, rows: src_rows, cols: k, stride, box_rows: rows };
    let (maps, tmaps) = tma_maps(stream, &[a])?;
    let p = UnitParams { tmaps, out: out.check(rows as usize * 64, 16)?, k0, row0, rows, _pad: 0 };
    launch(gpu, stream, fixed::UNIT_TMA_COPY, rows * 128 + 8, (1, 1), 128, p)?;
    drop(maps);
    Ok(())
}

/// Unit kernels `UNIT_WGMMA_N128` / `UNIT_WGMMA_N256`: `out[64][n] = a[64][64] · b[n][64]ᵀ` (bf16
/// in, f32 out) by one warpgroup, for `n` = 128 or 256.
pub fn unit_wgmma(gpu: &Gpu, stream: &Arc<CudaStream>, a: &Dev, b: &Dev, n: usize, out: &Dev) -> Result<()> {
    let name = match n {
        128 => fixed::UNIT_WGMMA_N128,
        256 => fixed::UNIT_WGMMA_N256,
        _ => return Err(Error::Config(format!("unit wgmma tile of {n} columns (128 or 256)"))),
    };
    let ta = unit_a_operand(a)?;
    let tb = TmaOperand::k_major(b.check(n * 64, 16)?, n, 64, 64, n as u16);
    let (maps, tmaps) = tma_maps(stream, &[ta, tb])?;
    let p = UnitParams { tmaps, out: out.check(64 * n, 8)?, ..Default::default() };
    launch(gpu, stream, name, ((64 + n) * 128 + 16) as u32, (1, 1), 128, p)?;
    drop(maps);
    Ok(())
}

/// Unit kernel: `C [64][128] = A · B` with `A [64][64]` K-major and `B [64][128]` stored
/// MN-major (`B[k][n]`), read by `wgmma` with `imm-trans-b`; the B descriptor gets the leading
/// and stride byte offsets `(lbo, sbo)`. `out`: `64 × 128` f32.
pub fn unit_wgmma_mn(gpu: &Gpu, stream: &Arc<CudaStream>, a: &Dev, b: &Dev, (lbo, sbo): (u32, u32), out: &Dev) -> Result<()> {
    let ta = unit_a_operand(a)?;
    let tb = TmaOperand::mn_major(b.check(64 * 128, 16)?, 64, 128, 128);
    let (maps, tmaps) = tma_maps(stream, &[ta, tb])?;
    let p = UnitParams { tmaps, out: out.check(64 * 128, 8)?, k0: lbo, row0: sbo, ..Default::default() };
    launch(gpu, stream, fixed::UNIT_WGMMA_MN_N128, 3 * 8192 + 16, (1, 1), 128, p)?;
    drop(maps);
    Ok(())
}

/// Unit kernel `UNIT_TMA_STORE`: one warpgroup stores two 64 × 64 tiles of 16-bit patterns
/// (element (r, c) of tile `i` is `4096·i + 64·r + c`) through the `tma_store` d-logits
/// epilogue into `out` (`rows × cols`, 16-bit), tile `i` at column `col0 + 64i`, row `row0`;
/// what falls outside `out` is clipped.
pub fn unit_tma_store(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &Dev,
    (rows, cols): (usize, usize),
    (col0, row0): (u32, u32),
) -> Result<()> {
    let map = TmaOperand::k_major(out.check(rows * cols, 16)?, rows, cols, cols, 64);
    let (maps, tmaps) = tma_maps(stream, &[map])?;
    let p = UnitParams { tmaps, k0: col0, row0, ..Default::default() };
    launch(gpu, stream, fixed::UNIT_TMA_STORE, 2 * 8192, (1, 1), 128, p)?;
    drop(maps);
    Ok(())
}

/// The unit `wgmma` kernels' A: one `[64][64]` K-major tile, one box.
fn unit_a_operand(a: &Dev) -> Result<TmaOperand> {
    Ok(TmaOperand::k_major(a.check(64 * 64, 16)?, 64, 64, 64, 64))
}
