//! The kernel bodies written once over the [`Mainloop`] trait, which the `sm80` (`MmaSync`) and
//! `sm90` (TMA + `wgmma`) mainloops implement: a body asks the mainloop which output tiles its
//! block computes, starts it on the operands, and hands every finished accumulator tile the
//! mainloop yields (as the epilogue's [`Acc`] / [`WarpPos`] views) to the shared epilogue
//! (`crate::epilogue`). A new mainloop (an `sm100/` beside the others) implements the trait and
//! gets these bodies.
//!
//! One file per pass: the backward d-logits ([`dlogits`]) and the backward GEMMs ([`gemm`]). The
//! forward is written per mainloop (`sm80::fwd`, `sm90::fwd`), and so are the `Sm90` d-logits
//! and `dh` with the TMA store (`sm90::dlogits`, `sm90::gemm`).

pub mod dlogits;
pub mod gemm;

use crate::epilogue::{Acc, WarpPos};
use crate::sm80::mainloop::Operand;

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
