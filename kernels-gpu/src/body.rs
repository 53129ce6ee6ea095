//! The kernel bodies written once over the [`Mainloop`] trait, which the `sm80` (`MmaSync`) and
//! `sm90` (TMA + `wgmma`) mainloops implement: a body asks the mainloop which output tiles its
//! block computes, starts it on the operands, and hands every finished accumulator tile the
//! mainloop yields (as the epilogue's [`Acc`] / [`WarpPos`] views) to the shared epilogue
//! (`crate::epilogue`). A new mainloop (an `sm100/` beside the others) implements the trait and
//! gets these bodies.
//!
//! Generic here: the backward d-logits ([`dlogits`]) and the backward GEMMs ([`gemm`]). The
//! forward is still written per mainloop (`sm80::fwd`, `sm90::fwd_wg`), and so is the `Sm90`
//! d-logits with the TMA store (`sm90::dlogits_tma_store`).

use crate::epilogue::dlogits::{row_coeffs, store_dlogits};
use crate::epilogue::gemm::store_gemm;
use crate::epilogue::{Acc, WarpPos};
use crate::sm80::mainloop::Operand;
use lmhead_core::params::{GemmParams, LogitsParams};

/// The output tiles of one block: rows `m0 .. m0 + BM` of `count` consecutive `BN`-wide tiles,
/// the first at column `n0`.
#[derive(Clone, Copy)]
pub struct Tiles {
    pub m0: u32,
    pub n0: u32,
    pub count: u32,
}

/// A grid of `(m tiles, n groups)` blocks over `n_total` `BN`-wide tiles along N, `per`
/// consecutive tiles per group, taken in groups of `group` m tiles
/// ([`lmhead_core::split::raster`]), with the last `fill` tiles of every group in a filler
/// block launched after the others ([`lmhead_core::split::block_work`]).
#[derive(Clone, Copy)]
pub struct Grid {
    pub group: u32,
    pub per: u32,
    pub n_total: u32,
    pub fill: u32,
}

/// The two operands of `C[m, n] = Σ_k A[m, k] · B[k, n]` in global memory (their layouts are the
/// mainloop's parameters); `b`'s rows start at `b_row0` (the vocab chunk's first row for the
/// d-logits).
#[derive(Clone, Copy)]
pub struct Operands {
    pub a: Operand,
    pub b: Operand,
    pub b_row0: u32,
}

/// What a mainloop reads of a kernel's problem. Each is read where the mainloop needs it (the
/// methods load from the kernel parameters), so a mainloop keeps its own order of work.
pub trait Job {
    /// The block grid along N, for `BN`-wide tiles.
    fn grid<const BN: usize>(&self) -> Grid;
    /// The operands as stored.
    fn operands(&self) -> Operands;
    /// The K extent.
    fn k(&self) -> u32;
    /// The device pointer to the operands' tensor maps (A, then B, 128 bytes each).
    fn tmaps(&self) -> u64;
}

/// A mainloop as the kernel bodies see it: it picks a block's output tiles, computes them, and
/// yields each finished tile as `Acc<MI, NI>` views (placed by the [`WarpPos`] it returns), one
/// or more per tile.
pub trait Mainloop<const MI: usize, const NI: usize>: Sized {
    /// The block tile's width (columns of one output tile).
    const BN: usize;

    /// First thing in a body: this thread's place in the block.
    fn new() -> Self;

    /// This block's output tiles (a mainloop may ignore `job.grid` and compute one tile per
    /// block of an `(m tiles, n tiles)` grid).
    fn tiles(&mut self, job: &impl Job) -> Tiles;

    /// Start the block on `job`'s operands: returns this thread's warp position, to threads that
    /// hold accumulators only (a producer warp never returns).
    ///
    /// # Safety
    /// Called once by every thread of a block launched with the mainloop's threads, grid and
    /// dynamic shared memory, right after [`Mainloop::tiles`], with the same arguments; `job`
    /// describes valid operands (and their tensor maps, where the mainloop loads by TMA).
    unsafe fn start(&mut self, job: &impl Job, tiles: Tiles) -> WarpPos;

    /// The block's accumulators as this thread holds them; the body owns them ([`Mainloop::zero`])
    /// and lends them to [`Mainloop::run`]. (Owned by the body, as they were by the per-mainloop
    /// bodies before: LLVM's always-inliner places a function's allocas by the order in which it
    /// inlines the callees, and the accumulators' place among them decides the order of the
    /// accumulator registers in the PTX.)
    type Acc;

    /// Zeroed accumulators, made by the body right before [`Mainloop::run`].
    fn zero() -> Self::Acc;

    /// Run the pipeline over the block's tiles into `acc`; after each tile, `each(n0, view)` for
    /// each `Acc<MI, NI>` view of it, whose columns start at `n0` (relative to `b_row0`).
    ///
    /// # Safety
    /// Called once by every thread that [`Mainloop::start`] returned to, with the same `job`.
    unsafe fn run(self, job: &impl Job, acc: &mut Self::Acc, each: impl FnMut(u32, &mut Acc<MI, NI>));
}

/// The d-logits' problem: A = `h [t][d]`, B = the `W` rows of the vocab chunk, output columns
/// over the staging buffer.
#[derive(Clone, Copy)]
pub struct DlogitsJob<'a> {
    pub p: &'a LogitsParams,
    /// `v_chunk_begin + v_chunk`: B's row bound.
    pub chunk_end: u32,
}

impl Job for DlogitsJob<'_> {
    #[inline(always)]
    fn grid<const BN: usize>(&self) -> Grid {
        let n_total = (self.p.staging_stride as u32).div_ceil(BN as u32);
        Grid { group: self.p.raster_group, per: self.p.tiles_per_split, n_total, fill: self.p.fill }
    }

    #[inline(always)]
    fn operands(&self) -> Operands {
        let p = self.p;
        Operands {
            a: Operand { ptr: p.h as *const u16, stride: p.h_row_stride, mn_bound: p.t, k_bound: p.d },
            b: Operand { ptr: p.w as *const u16, stride: p.w_row_stride, mn_bound: self.chunk_end, k_bound: p.d },
            b_row0: p.v_chunk_begin,
        }
    }

    #[inline(always)]
    fn k(&self) -> u32 {
        self.p.d
    }

    #[inline(always)]
    fn tmaps(&self) -> u64 {
        self.p.tmaps
    }
}

/// The backward GEMMs' problem: `C[m, n] (+)= Σ_k A[m, k] · B[k, n]` as `p` describes it.
#[derive(Clone, Copy)]
pub struct GemmJob<'a> {
    pub p: &'a GemmParams,
}

impl Job for GemmJob<'_> {
    #[inline(always)]
    fn grid<const BN: usize>(&self) -> Grid {
        Grid { group: self.p.raster_group, per: self.p.tiles_per_block, n_total: self.p.n.div_ceil(BN as u32), fill: self.p.fill }
    }

    #[inline(always)]
    fn operands(&self) -> Operands {
        let p = self.p;
        Operands {
            a: Operand { ptr: p.a as *const u16, stride: p.a_stride, mn_bound: p.m, k_bound: p.k },
            b: Operand { ptr: p.b as *const u16, stride: p.b_stride, mn_bound: p.n, k_bound: p.k },
            b_row0: 0,
        }
    }

    #[inline(always)]
    fn k(&self) -> u32 {
        self.p.k
    }

    #[inline(always)]
    fn tmaps(&self) -> u64 {
        self.p.tmaps
    }
}

/// Backward d-logits of one vocab chunk: every logits tile of the block turned into bf16
/// d-logits in the staging buffer (`epilogue::dlogits`).
///
/// # Safety
/// Launched as the mainloop `M` requires (threads, grid over `ceil(t/BM)` m tiles and the
/// staging buffer's `BN`-wide tiles, dynamic shared memory, `p.tmaps` for a TMA mainloop); `p`
/// describes valid buffers: `h`, `W`, labels, `lse`, the gradients that are non-null (and
/// `entropy` when `ENT`), and `staging [t][staging_stride]` with `staging_stride ≥ v_chunk`
/// rounded up to 8.
#[inline(always)]
pub unsafe fn dlogits<M: Mainloop<MI, NI>, const MI: usize, const NI: usize, const ENT: bool>(p: &LogitsParams) {
    let mut ml = M::new();
    // (`tiles` reads only the grid; building the job with its chunk bound after it keeps the
    // emitted PTX as it was measured: building it first reorders instructions.)
    let t = ml.tiles(&DlogitsJob { p, chunk_end: 0 });
    let job = DlogitsJob { p, chunk_end: p.v_chunk_begin + p.v_chunk };
    // SAFETY: every thread, right after `tiles`; launch and operands per the kernel contract.
    let w = unsafe { ml.start(&job, t) };
    // SAFETY: buffers per the kernel contract.
    let coeffs = unsafe { row_coeffs::<MI, ENT>(p, &w, t.m0) };
    let mut acc = M::zero();
    let each = #[inline(always)]
    |n0: u32, acc: &mut Acc<MI, NI>| {
        // SAFETY: staging per the kernel contract.
        unsafe { store_dlogits::<MI, NI, ENT>(p, &w, t.m0, n0, acc, &coeffs) };
    };
    // SAFETY: every thread `start` returned to, once, with the same job.
    unsafe { ml.run(&job, &mut acc, each) };
}

/// Backward GEMM `C[m, n] (+)= Σ_k A[m, k] · B[k, n]` (the operand layouts are the mainloop's),
/// stored by `epilogue::gemm`.
///
/// # Safety
/// Launched as the mainloop `M` requires (threads, grid over `ceil(m/BM)` m tiles and the
/// `BN`-wide tiles of `n`, dynamic shared memory, `p.tmaps` for a TMA mainloop); `p` describes
/// valid buffers (A readable over whole 16-byte chunks up to its column bound rounded up to 8,
/// `n % 8 == 0`, 8-byte aligned accumulator and output rows).
#[inline(always)]
pub unsafe fn gemm<M: Mainloop<MI, NI>, const MI: usize, const NI: usize>(p: &GemmParams) {
    let job = GemmJob { p };
    let mut ml = M::new();
    let t = ml.tiles(&job);
    // SAFETY: every thread, right after `tiles`; launch and operands per the kernel contract.
    let w = unsafe { ml.start(&job, t) };
    let mut acc = M::zero();
    let each = #[inline(always)]
    |n0: u32, acc: &mut Acc<MI, NI>| {
        // SAFETY: C buffers per the kernel contract.
        unsafe { store_gemm::<MI, NI>(p, &w, t.m0, n0, acc) };
    };
    // SAFETY: every thread `start` returned to, once, with the same job.
    unsafe { ml.run(&job, &mut acc, each) };
}
