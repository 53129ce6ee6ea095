//! The sm90 mainloop: a warp-specialised pipeline in which a producer warpgroup loads 64-deep
//! stages with the tensor memory accelerator (tensor maps made by the host) into an mbarrier
//! full/empty ring, and the consumer warpgroups issue `wgmma.mma_async` on the stages
//! (128-byte swizzle, descriptors from `lmhead_core::wgmma`) and run the epilogue; and the three
//! kernels built on it: the fused forward, the backward d-logits, and the backward GEMMs.
//!
//! `T≙M, V≙N, D≙K`. A block has `WGM` consumer warpgroups (4 warps each) stacked along M, each
//! owning 64 rows of the `BM = 64·WGM` token tile and all `BN = 128·NW` vocab columns (NW
//! `m64n128k16` instructions per k16 step), plus the producer warpgroup ([`tma_split`],
//! `setmaxnreg` moves registers from it to the consumers).
//!
//! The forward and the d-logits read `h` and `W` K-major. The GEMMs read their operands as
//! stored: `dh`'s B (the `W` chunk `[k][n]`) and `dW`'s A (the staging buffer `[k][m]`) and B
//! (`h`, `[k][n]`) are MN-major tiles loaded as 64-wide slabs and read with `wgmma`'s transpose
//! bits (`AMN`/`BMN`; [`pipeline::tma_operand`], [`wgmma_k16`]).
//!
//! The kernels end in the epilogues shared with the `sm80` mainloop (`crate::epilogue`): the
//! forward folds each 64-column half of a 128-column block with `epilogue::lse::fold_tile` (the
//! accumulator layout of `m64n128k16` is the `mma.sync` m16n8 layout per 8 columns, one m16 tile
//! per warp), and the block reduction is `epilogue::lse::store_partials` with one warp along N;
//! the d-logits epilogue can instead store through shared memory by TMA ([`StoreBoxes`]).
//!
//! Layout: `pipeline` (the mbarrier ring, the producer's TMA loads and the consumers' K loop,
//! [`tma_split`] / [`tma_pipeline`]), `wgmma` (accumulators, operand descriptors, the k16 step),
//! `store` (the TMA-store epilogue, [`StoreBoxes`]); here, the three kernel bodies and the small
//! helpers they share.

mod pipeline;
mod store;
mod wgmma;

use crate::body::{self, GemmJob, Grid, Job, Mainloop as _, Tiles};
use crate::epilogue::dlogits::{dlogits_pair, row_coeffs};
use crate::epilogue::lse::{fold_tile, load_label, local_column, store_partials};
use crate::epilogue::{Acc, WarpPos};
use crate::intrinsics;
use lmhead_core::config::TMA_STORE_BYTES;
use lmhead_core::lse::Lse2;
use lmhead_core::params::{GemmParams, LogitsParams};
use pipeline::{tma_pipeline, tma_split, TmaRing, BK};
use store::BOX_BYTES;
pub(crate) use store::{AccBoxes, StoreBoxes};
pub(crate) use wgmma::{wgmma_k16, WgAcc};

/// This thread's warp position: warp `w` holds rows `16w .. 16w + 16` of the block tile and
/// every column.
#[inline(always)]
fn warp_pos(tid: u32) -> WarpPos {
    WarpPos { tid, lane: tid & 31, wm0: 16 * (tid >> 5), wn0: 0, warp_n: 0 }
}

/// One 64-column half of a 128-column block as the `Acc<1, 8>` of the shared epilogues.
#[inline(always)]
fn half<const NW: usize>(acc: &mut WgAcc<NW>, nb: usize, h: usize) -> &mut Acc<1, 8> {
    core::array::from_mut(&mut acc[nb][h])
}

/// The fused forward on the Hopper mainloop. Same contract and outputs as `sm80::fwd`.
///
/// # Safety
/// Launched with `(WGM + 1)·128` threads (the last warpgroup is the producer), a grid of
/// `(ceil(t/BM), n_splits)` blocks, or `2·n_splits` with `p.fill > 0` (less than the last
/// split's length; partials `[2·n_splits][t]`), and `(BM + BN)·64·2·ST` bytes of dynamic shared
/// memory (plus `16·ST` for the mbarriers, and `p.tmaps` set); `p` describes valid device
/// buffers as for `sm80::fwd`.
#[inline(always)]
pub unsafe fn fwd_wg<const BM: usize, const BN: usize, const ST: usize, const WGM: usize, const NW: usize, const ENT: bool>(
    p: &LogitsParams,
) {
    let tid = intrinsics::thread_idx();
    let v_tiles = p.v.div_ceil(BN as u32);
    let work = block_work(Grid { group: p.raster_group, per: p.tiles_per_split, n_total: v_tiles, fill: p.fill });
    let (m0, split, n_tiles) = (work.m_tile * BM as u32, work.slot, work.count);
    let kt = p.d.div_ceil(BK as u32);
    let n0_first = work.first * BN as u32;
    // SAFETY: first call, by every thread; the kernel contract provides the maps.
    unsafe { tma_split::<BM, BN, ST, WGM, false, false>(tid, p.tmaps, m0, n0_first, n_tiles, kt) };
    let w = warp_pos(tid);

    // ---- Prologue: per-row state and labels ------------------------------------------------
    let mut st = [[Lse2::<f32>::EMPTY; 2]; 1];
    let mut z_label = [[0.0f32; 2]; 1];
    let mut label = [[-1i32; 2]; 1];
    unroll!(2, |h| {
        let row = m0 + w.row(0, h);
        if row < p.t {
            // SAFETY: row < t and labels holds t elements (kernel contract).
            label[0][h] = local_column(p, unsafe { load_label(p.labels, p.label_kind, row) });
        }
    });
    let mut acc: WgAcc<NW> = [[[[0.0; 4]; 8]; 2]; NW];

    // ---- Main loop, each tile folded into the row states ------------------------------------
    let finish = #[inline(always)]
    |tile: u32, acc: &mut WgAcc<NW>| {
        let n0 = n0_first + tile * BN as u32;
        unroll!(NW, |nb| {
            unroll!(2, |h| {
                fold_tile::<64, 1, 8, ENT>(p, &w, n0 + (nb * 128 + h * 64) as u32, half(acc, nb, h), &mut st, &mut z_label, &label);
            });
        });
    };
    // SAFETY: every thread calls with the same arguments; smem and operands per the contract.
    unsafe { tma_pipeline::<BM, BN, ST, WGM, NW, false, false>(tid, n_tiles, kt, &mut acc, finish) };

    // ---- Epilogue ---------------------------------------------------------------------------
    // SAFETY: all consumer threads, ring drained behind the pipeline's last barrier; BM·16 bytes
    // fit.
    unsafe { store_partials::<BM, 1, 1, ENT>(p, &w, &mut st, &mut z_label, m0, split, intrinsics::smem_base(), (WGM * 128) as u32) };
}

/// This block's work in `g` ([`lmhead_core::split::block_work`]): its m tile, its slot, and the
/// `count ≥ 1` consecutive `BN`-wide tiles from `first` it walks. The pipeline runs on from one
/// tile into the next, so a block pays one fill and its epilogues overlap the producer's loads;
/// the raster keeps the rows resident blocks read together within L2 (`split::plan_l2`, which
/// also picks `per`), and the fillers use the SMs the last wave leaves idle (`split::with_fill`).
#[inline(always)]
fn block_work(g: Grid) -> lmhead_core::split::BlockWork {
    lmhead_core::split::block_work(
        intrinsics::block_idx_x(),
        intrinsics::block_idx_y(),
        intrinsics::grid_dim_x(),
        g.n_total,
        g.per,
        g.group,
        g.fill,
    )
}

/// [`block_work`] as the first row, the first column and the tile count.
#[inline(always)]
fn block_tiles<const BM: usize, const BN: usize>(g: Grid) -> (u32, u32, u32) {
    let w = block_work(g);
    (w.m_tile * BM as u32, w.first * BN as u32, w.count)
}

/// The Hopper mainloop as a [`body::Mainloop`]: `WGM` consumer warpgroups and a producer
/// warpgroup ([`tma_split`]), a `BM × BN` block tile with `BM = 64·WGM`, `BN = 128·NW`, `ST`
/// stages; A MN-major when `AMN`, B when `BMN` (else K-major). A block walks `count` consecutive
/// tiles ([`block_tiles`]); each finished tile is yielded as `Acc<1, 8>` views, one per 64-column
/// half of each 128-column block ([`half`]).
pub struct Sm90<const BM: usize, const BN: usize, const ST: usize, const WGM: usize, const NW: usize, const AMN: bool, const BMN: bool> {
    tid: u32,
    n0_first: u32,
    n_tiles: u32,
    kt: u32,
}

impl<const BM: usize, const BN: usize, const ST: usize, const WGM: usize, const NW: usize, const AMN: bool, const BMN: bool>
    body::Mainloop<1, 8> for Sm90<BM, BN, ST, WGM, NW, AMN, BMN>
{
    const BN: usize = BN;

    #[inline(always)]
    fn new() -> Self {
        Self { tid: intrinsics::thread_idx(), n0_first: 0, n_tiles: 0, kt: 0 }
    }

    #[inline(always)]
    fn tiles(&mut self, job: &impl Job) -> Tiles {
        let (m0, n0, count) = block_tiles::<BM, BN>(job.grid::<BN>());
        Tiles { m0, n0, count }
    }

    #[inline(always)]
    unsafe fn start(&mut self, job: &impl Job, t: Tiles) -> WarpPos {
        let kt = job.k().div_ceil(BK as u32);
        // SAFETY: first call, by every thread; the caller provides the maps.
        unsafe { tma_split::<BM, BN, ST, WGM, AMN, BMN>(self.tid, job.tmaps(), t.m0, job.operands().b_row0 + t.n0, t.count, kt) };
        (self.n0_first, self.n_tiles, self.kt) = (t.n0, t.count, kt);
        warp_pos(self.tid)
    }

    type Acc = WgAcc<NW>;

    #[inline(always)]
    fn zero() -> WgAcc<NW> {
        [[[[0.0; 4]; 8]; 2]; NW]
    }

    #[inline(always)]
    unsafe fn run(self, _: &impl Job, acc: &mut WgAcc<NW>, mut each: impl FnMut(u32, &mut Acc<1, 8>)) {
        let Self { tid, n0_first, n_tiles, kt } = self;
        let finish = #[inline(always)]
        |tile: u32, acc: &mut WgAcc<NW>| {
            let n0 = n0_first + tile * BN as u32;
            unroll!(NW, |nb| {
                unroll!(2, |h| {
                    each(n0 + (nb * 128 + h * 64) as u32, half(acc, nb, h));
                });
            });
        };
        // SAFETY: every consumer thread calls with the same arguments; smem and operands per
        // `start`'s contract.
        unsafe { tma_pipeline::<BM, BN, ST, WGM, NW, AMN, BMN>(tid, n_tiles, kt, acc, finish) };
    }
}

/// Backward d-logits of one vocab chunk on the Hopper mainloop with the tile stored through
/// [`StoreBoxes`] by the tensor memory accelerator, with a third tensor map over the staging
/// buffer (`Store::Tma`; the register store is the generic `body::dlogits` on [`Sm90`]). Same
/// contract as `body::dlogits`.
///
/// # Safety
/// Launched with `(WGM + 1)·128` threads, grid
/// `(ceil(t/BM), ceil(ceil(staging_stride/BN) / max(1, p.tiles_per_split)))` (twice that with
/// `p.fill > 0`, less than the last group's length), the ring's
/// dynamic shared memory (with the mbarriers and `p.tmaps`), 1024 bytes after the ring, then
/// `TMA_STORE_BYTES`, and a third map in `p.tmaps`: the staging buffer
/// `[t][staging_stride]`, 64 × 64 boxes, 128-byte swizzle; buffers as for `body::dlogits`.
#[inline(always)]
pub unsafe fn dlogits_tma_store<const BM: usize, const BN: usize, const ST: usize, const WGM: usize, const NW: usize, const ENT: bool>(
    p: &LogitsParams,
) {
    let tid = intrinsics::thread_idx();
    let n_total = (p.staging_stride as u32).div_ceil(BN as u32);
    let (m0, n0_first, n_tiles) = block_tiles::<BM, BN>(Grid { group: p.raster_group, per: p.tiles_per_split, n_total, fill: p.fill });
    let kt = p.d.div_ceil(BK as u32);
    // SAFETY: first call, by every thread; the kernel contract provides the maps.
    unsafe { tma_split::<BM, BN, ST, WGM, false, false>(tid, p.tmaps, m0, p.v_chunk_begin + n0_first, n_tiles, kt) };
    let w = warp_pos(tid);
    // SAFETY: buffers per the kernel contract.
    let coeffs = unsafe { row_coeffs::<1, ENT>(p, &w, m0) };
    let mut acc: WgAcc<NW> = [[[[0.0; 4]; 8]; 2]; NW];
    // The host's `TileConfig::smem_bytes` reserves exactly these boxes for the block.
    const { assert!(WGM as u32 * 2 * BOX_BYTES == TMA_STORE_BYTES as u32) };
    let boxes = TmaRing::new::<BM, BN, ST>().store_boxes();
    let mut out = StoreBoxes::new(boxes, (p.tmaps as *const u8).wrapping_add(256), tid);
    let row = m0 + 64 * (tid >> 7);
    let lane = tid & 31;
    let finish = #[inline(always)]
    |tile: u32, acc: &mut WgAcc<NW>| {
        let n0 = n0_first + tile * BN as u32;
        unroll!(NW, |nb| {
            unroll!(2, |h| {
                let c0 = n0 + (nb * 128 + h * 64) as u32;
                let mut v = [[0u32; 2]; 8];
                unroll!(8, |j| {
                    unroll!(2, |hh| {
                        let x = acc[nb][h][j];
                        v[j][hh] =
                            dlogits_pair::<1, ENT>(p, &coeffs, 0, hh, c0 + (8 * j) as u32 + 2 * (lane & 3), [x[2 * hh], x[2 * hh + 1]]);
                    });
                });
                // SAFETY: every consumer thread of the warpgroup runs each finish; the
                // boxes follow the ring per the kernel contract; the staging map is the
                // third one; this block alone writes these rows and columns of the chunk.
                unsafe { out.store(&v, c0, row) };
            });
        });
    };
    // SAFETY: every thread calls with the same arguments; smem and operands per the contract.
    unsafe { tma_pipeline::<BM, BN, ST, WGM, NW, false, false>(tid, n_tiles, kt, &mut acc, finish) };
    out.drain();
}

/// Backward `dh` GEMM of one vocab chunk (`body::gemm` on [`Sm90`] with the staging buffer
/// K-major and the `W` chunk MN-major) whose sum goes to the f32 accumulator alone, written
/// through [`AccBoxes`] by the tensor memory accelerator: stored for the first chunk
/// (`accumulate` 0), added in place (`cp.reduce.async.bulk.tensor … .add`) for the others, so
/// the epilogue never reads the accumulator. (The host runs a sum that also goes to an output
/// on the config's register twin, `body::gemm`.)
///
/// # Safety
/// As `body::gemm` for `Sm90<BM, BN, ST, WGM, NW, false, true>` with `write_acc` set and no
/// output (`c_out` 0; otherwise the kernel traps), 1024 bytes after the ring and then
/// `TMA_STORE_BYTES` of dynamic shared memory, and a third map in `p.tmaps`: the f32
/// accumulator `[m][c_stride]` (extent `n` columns), 32 × 64 boxes, 128-byte swizzle.
#[inline(always)]
pub unsafe fn dh_tma_acc<const BM: usize, const BN: usize, const ST: usize, const WGM: usize, const NW: usize>(p: &GemmParams) {
    if p.write_acc == 0 || p.c_out != 0 {
        intrinsics::trap();
    }
    let job = GemmJob { p };
    let mut ml = Sm90::<BM, BN, ST, WGM, NW, false, true>::new();
    let t = ml.tiles(&job);
    // SAFETY: every thread, right after `tiles`; launch and operands per the kernel contract.
    let w = unsafe { ml.start(&job, t) };
    // The host's `TileConfig::smem_bytes` reserves exactly these boxes for the block.
    const { assert!(WGM as u32 * 2 * BOX_BYTES == TMA_STORE_BYTES as u32) };
    let mut out =
        AccBoxes::new(TmaRing::new::<BM, BN, ST>().store_boxes(), (p.tmaps as *const u8).wrapping_add(256), w.tid, p.accumulate != 0);
    let row = t.m0 + 64 * (w.tid >> 7);
    let mut acc = Sm90::<BM, BN, ST, WGM, NW, false, true>::zero();
    let each = #[inline(always)]
    |n0: u32, a: &mut Acc<1, 8>| {
        unroll!(2, |q| {
            let x = [a[0][4 * q], a[0][4 * q + 1], a[0][4 * q + 2], a[0][4 * q + 3]];
            // SAFETY: every consumer thread of the warpgroup runs each tile's quarters; the
            // boxes follow the ring and the accumulator's map is the third one (kernel
            // contract); this block alone writes these rows and columns.
            unsafe { out.put(&x, n0 + 32 * q as u32, row) };
        });
    };
    // SAFETY: every thread `start` returned to, once, with the same job.
    unsafe { ml.run(&job, &mut acc, each) };
    out.drain();
}
