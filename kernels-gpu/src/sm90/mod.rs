//! The sm90 mainloop: a warp-specialised pipeline in which a producer warpgroup loads 64-deep
//! stages with the tensor memory accelerator (tensor maps made by the host) into an mbarrier
//! full/empty ring, and the consumer warpgroups issue `wgmma.mma_async` on the stages
//! (128-byte swizzle, descriptors from `lmhead_core::wgmma`) and run the epilogue; and what is
//! its own of the kernels built on it.
//!
//! `T≙M, V≙N, D≙K`. A block has `WGM` consumer warpgroups (4 warps each) stacked along M, each
//! owning 64 rows of the `BM = 64·WGM` token tile and all `BN = 128·NW` vocab columns (NW
//! `m64n128k16` instructions per k16 step), plus the producer warpgroup
//! ([`pipeline::tma_split`], `setmaxnreg` moves registers from it to the consumers).
//!
//! The forward and the d-logits read `h` and `W` K-major. The GEMMs read their operands as
//! stored: `dh`'s B (the `W` chunk `[k][n]`) and `dW`'s A (the staging buffer `[k][m]`) and B
//! (`h`, `[k][n]`) are MN-major tiles loaded as 64-wide slabs and read with `wgmma`'s transpose
//! bits (`AMN`/`BMN`; `pipeline::tma_operand`, [`wgmma_k16`]).
//!
//! Files, by pass and by part of the mainloop:
//!
//! - [`fwd`]: the fused forward (`fwd_wg`), ending in `epilogue::fwd`;
//! - [`dlogits`]: the backward d-logits stored by TMA (`dlogits_tma_store`);
//! - [`gemm`]: the backward `dh` added into its accumulator by TMA (`dh_tma_acc`);
//! - [`pipeline`]: the mbarrier ring, the producer's TMA loads and the consumers' K loop
//!   (`tma_split` / `tma_pipeline`);
//! - [`wgmma`]: accumulators, operand descriptors, the k16 step;
//! - [`store`]: the TMA-store epilogues ([`StoreBoxes`], [`AccBoxes`]);
//! - here: [`Sm90`], the mainloop as a [`body::Mainloop`] (which gives it the generic d-logits
//!   and GEMM bodies with the register store), and the block's work and warp position.

pub mod dlogits;
pub mod fwd;
pub mod gemm;
mod pipeline;
mod store;
mod wgmma;

use crate::body::{self, Grid, Job, Tiles};
use crate::epilogue::{Acc, WarpPos};
use crate::intrinsics;
use pipeline::{tma_pipeline, tma_split, BK};
pub(crate) use store::{AccBoxes, StoreBoxes};
pub(crate) use wgmma::{wgmma_k16, WgAcc};

/// This thread's warp position: warp `w` holds rows `16w .. 16w + 16` of the block tile and
/// every column.
#[inline(always)]
pub(super) fn warp_pos(tid: u32) -> WarpPos {
    WarpPos { tid, lane: tid & 31, wm0: 16 * (tid >> 5), wn0: 0, warp_n: 0 }
}

/// One 64-column half of a 128-column block as the `Acc<1, 8>` of the shared epilogues.
#[inline(always)]
pub(super) fn half<const NW: usize>(acc: &mut WgAcc<NW>, nb: usize, h: usize) -> &mut Acc<1, 8> {
    core::array::from_mut(&mut acc[nb][h])
}

/// This block's work in `g` ([`lmhead_core::split::block_work`]): its m tile, its slot, and the
/// `count ≥ 1` consecutive `BN`-wide tiles from `first` it walks. The pipeline runs on from one
/// tile into the next, so a block pays one fill and its epilogues overlap the producer's loads;
/// the raster keeps the rows resident blocks read together within L2 (`split::plan_l2`, which
/// also picks `per`), and the fillers use the SMs the last wave leaves idle (`split::with_fill`).
#[inline(always)]
pub(super) fn block_work(g: Grid) -> lmhead_core::split::BlockWork {
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
pub(super) fn block_tiles<const BM: usize, const BN: usize>(g: Grid) -> (u32, u32, u32) {
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
        unsafe { tma_split::<BM, BN, ST, WGM, AMN, BMN, false>(self.tid, job.tmaps(), t.m0, job.operands().b_row0 + t.n0, t.count, kt) };
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
