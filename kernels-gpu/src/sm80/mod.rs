//! The portable mainloop (`MmaSync`: `cp.async` ring, `ldmatrix`, `mma.sync.m16n8k16`, in
//! [`mainloop`]) and its three kernel bodies: the fused forward, the backward d-logits of one
//! vocab chunk, and the two backward GEMMs. Each body sets up its operands, runs the pipeline
//! and hands every finished accumulator tile to the shared epilogue (`crate::epilogue`).
//!
//! `T≙M, V≙N, D≙K`. A block of `WM × WN` warps computes a `BM × BN` tile, each warp `MI × NI`
//! `m16n8` fragments ([`Acc`], placed by [`WarpPos`]).
//!
//! **Forward.** Grid: `x` = token tile (`BM` rows), `y` = vocab split (`tiles_per_split`
//! consecutive `BN`-wide vocab tiles). Each thread keeps the state of the rows it holds in its
//! accumulator fragments across every vocab tile of the split (`epilogue::lse::fold_tile`); at
//! the end the block reduces them (quad shuffles, then shared memory across the warps along N)
//! and writes one [`Partial`](lmhead_core::params::Partial) per (split, row)
//! (`epilogue::lse::store_partials`). `fwd_merge` combines the splits. Nothing of size `t × v` is
//! written.
//!
//! **d-logits.** One `BM × BN` logits tile of the chunk per block, turned into bf16 d-logits in
//! the staging buffer (`epilogue::dlogits`, which derives the gradient).
//!
//! **GEMMs.** `dh[t, d] (+)= Σ_v dl[t, v] · W[v, d]` (A = staging, K-major; B = `W` chunk,
//! N-major) and `dW[v, d] = Σ_t dl[t, v] · h[t, d]` (A = stagingᵀ, M-major; B = `h`, N-major),
//! stored by `epilogue::gemm`.
//!
//! The bodies are written per mainloop, not through a shared `Mainloop` trait: what the two
//! share is the epilogue calls, which live once in `crate::epilogue` (the `Sm90` bodies split each
//! 128-column block into `Acc<1, 8>` halves and run a warp-specialised pipeline whose producer
//! warpgroup never reaches the epilogue). A trait was not tried: the PTX of the `MmaSync` forward
//! already changed when only the epilogue functions' module path changed (see
//! `epilogue/mod.rs`), and trait methods would rename the functions the bodies instantiate.

pub mod mainloop;

use crate::body::{self, Job, Operands, Tiles};
use crate::epilogue::lse::{fold_tile, load_label, local_column, store_partials};
use crate::epilogue::{Acc, WarpPos};
use crate::intrinsics;
use lmhead_core::lse::Lse2;
use lmhead_core::params::LogitsParams;
use mainloop::Operand;

/// The forward mainloop kernel.
///
/// # Safety
/// Launched with `WM·WN·32` threads, a grid of `(ceil(t/BM), n_splits)` blocks and
/// `max(ring, reduction)` bytes of dynamic shared memory; `p` describes valid device buffers:
/// `h [t][d]`, `W [v][d]` (bf16), labels `[t]`, partials `[n_splits][t]`.
#[inline(always)]
pub unsafe fn fwd<
    const BM: usize,
    const BN: usize,
    const BK: usize,
    const ST: usize,
    const WM: usize,
    const WN: usize,
    const MI: usize,
    const NI: usize,
    const ENT: bool,
>(
    p: &LogitsParams,
) {
    const {
        assert!(MI * 16 * WM == BM && NI * 8 * WN == BN && NI % 2 == 0);
        assert!(BK == 32 || BK == 64);
        assert!(BM <= WM * WN * 32, "one thread per row in the final reduction");
    }
    let w = WarpPos::new::<BM, BN, WM, WN>();
    let m0 = intrinsics::block_idx_x() * BM as u32;
    let split = intrinsics::block_idx_y();
    let v_tiles = p.v.div_ceil(BN as u32);
    let tile_begin = split * p.tiles_per_split;
    let n_tiles = (v_tiles - tile_begin).min(p.tiles_per_split);
    let kt = p.d.div_ceil(BK as u32);

    // ---- Prologue: per-row state and labels ------------------------------------------------
    let mut st = [[Lse2::<f32>::EMPTY; 2]; MI];
    let mut z_label = [[0.0f32; 2]; MI];
    let mut label = [[-1i32; 2]; MI];
    unroll!(MI, |mi| {
        unroll!(2, |h| {
            let row = m0 + w.row(mi, h);
            if row < p.t {
                // SAFETY: row < t and labels holds t elements (kernel contract).
                label[mi][h] = local_column(p, unsafe { load_label(p.labels, p.label_kind, row) });
            }
        });
    });

    let a = Operand { ptr: p.h as *const u16, stride: p.h_row_stride, mn_bound: p.t, k_bound: p.d };
    let b = Operand { ptr: p.w as *const u16, stride: p.w_row_stride, mn_bound: p.v, k_bound: p.d };
    let ring = intrinsics::smem_base();
    let threads = WM * WN * 32;
    let a_bytes = (BM * BK * 2) as u32;
    let stage_bytes = ((BM + BN) * BK * 2) as u32;
    let mut acc: Acc<MI, NI> = [[[0.0; 4]; NI]; MI];

    // ---- Main loop --------------------------------------------------------------------------
    let load = #[inline(always)]
    |s: u32, tile: u32, k: u32| {
        let n0 = (tile_begin + tile) * BN as u32;
        let k0 = k * BK as u32;
        // SAFETY: stage `s` holds BM·BK + BN·BK bf16; operands are bounds-checked per chunk;
        // every thread of the block runs this with its own tid.
        unsafe {
            mainloop::load_tile::<BM, BK, true>(s, a, m0, k0, w.tid, threads);
            mainloop::load_tile::<BN, BK, true>(s + a_bytes, b, n0, k0, w.tid, threads);
        }
    };
    let compute = #[inline(always)]
    |s: u32, acc: &mut Acc<MI, NI>| {
        // SAFETY: the warp is converged; `s` holds a landed stage.
        unsafe { mainloop::mma_stage::<BM, BN, BK, MI, NI, true, true>(s, s + a_bytes, acc, w.wm0, w.wn0, w.lane) };
    };
    let finish = #[inline(always)]
    |tile: u32, acc: &mut Acc<MI, NI>| {
        let n0 = (tile_begin + tile) * BN as u32;
        fold_tile::<BN, MI, NI, ENT>(p, &w, n0, acc, &mut st, &mut z_label, &label);
    };
    // SAFETY: all threads call with the same trip counts; the ring is the dynamic shared memory.
    unsafe { mainloop::pipeline::<ST, Acc<MI, NI>>(ring, stage_bytes, n_tiles, kt, &mut acc, load, compute, finish) };

    // ---- Epilogue: reduce the row states of the block and write the partials ---------------
    // SAFETY: all threads reach this with the ring drained (the pipeline ends behind a barrier).
    unsafe { store_partials::<BM, WN, MI, ENT>(p, &w, &mut st, &mut z_label, m0, split, ring, threads as u32) };
}

/// The `MmaSync` mainloop as a [`body::Mainloop`]: a `BM × BN` block tile of `WM × WN` warps,
/// each holding `MI × NI` `m16n8` fragments, `ST` stages of `BK`; A K-major when `AK` (else
/// M-major), B K-major when `BK_MAJ` (else N-major). One output tile per block of an
/// `(m tiles, n tiles)` grid, yielded whole as one `Acc<MI, NI>`.
pub struct Sm80<
    const BM: usize,
    const BN: usize,
    const BK: usize,
    const ST: usize,
    const WM: usize,
    const WN: usize,
    const MI: usize,
    const NI: usize,
    const AK: bool,
    const BK_MAJ: bool,
> {
    w: WarpPos,
    m0: u32,
    n0: u32,
}

impl<
        const BM: usize,
        const BN: usize,
        const BK: usize,
        const ST: usize,
        const WM: usize,
        const WN: usize,
        const MI: usize,
        const NI: usize,
        const AK: bool,
        const BK_MAJ: bool,
    > body::Mainloop<MI, NI> for Sm80<BM, BN, BK, ST, WM, WN, MI, NI, AK, BK_MAJ>
{
    const BN: usize = BN;

    #[inline(always)]
    fn new() -> Self {
        const {
            assert!(MI * 16 * WM == BM && NI * 8 * WN == BN && NI % 2 == 0);
        }
        Self { w: WarpPos::new::<BM, BN, WM, WN>(), m0: 0, n0: 0 }
    }

    #[inline(always)]
    fn tiles(&mut self, _: &impl Job) -> Tiles {
        self.m0 = intrinsics::block_idx_x() * BM as u32;
        self.n0 = intrinsics::block_idx_y() * BN as u32;
        Tiles { m0: self.m0, n0: self.n0, count: 1 }
    }

    #[inline(always)]
    unsafe fn start(&mut self, _: &impl Job, _: Tiles) -> WarpPos {
        self.w
    }

    type Acc = Acc<MI, NI>;

    #[inline(always)]
    fn zero() -> Acc<MI, NI> {
        [[[0.0; 4]; NI]; MI]
    }

    #[inline(always)]
    unsafe fn run(self, job: &impl Job, acc: &mut Acc<MI, NI>, mut each: impl FnMut(u32, &mut Acc<MI, NI>)) {
        let Self { w, m0, n0 } = self;
        let Operands { a, b, b_row0 } = job.operands();
        let ring = intrinsics::smem_base();
        let threads = WM * WN * 32;
        let a_bytes = (BM * BK * 2) as u32;
        let stage_bytes = ((BM + BN) * BK * 2) as u32;
        let kt = job.k().div_ceil(BK as u32);

        let load = #[inline(always)]
        |s: u32, _: u32, k: u32| {
            let k0 = k * BK as u32;
            // SAFETY: stage `s` holds both tiles; chunks are bounds-checked; every thread of the
            // block runs this with its own tid.
            unsafe {
                mainloop::load_tile::<BM, BK, AK>(s, a, m0, k0, w.tid, threads);
                mainloop::load_tile::<BN, BK, BK_MAJ>(s + a_bytes, b, b_row0 + n0, k0, w.tid, threads);
            }
        };
        let compute = #[inline(always)]
        |s: u32, acc: &mut Acc<MI, NI>| {
            // SAFETY: the warp is converged; `s` holds a landed stage.
            unsafe { mainloop::mma_stage::<BM, BN, BK, MI, NI, AK, BK_MAJ>(s, s + a_bytes, acc, w.wm0, w.wn0, w.lane) };
        };
        let finish = #[inline(always)]
        |_: u32, acc: &mut Acc<MI, NI>| each(n0, acc);
        // SAFETY: all threads call with the same trip counts; the ring is the dynamic shared memory.
        unsafe { mainloop::pipeline::<ST, Acc<MI, NI>>(ring, stage_bytes, 1, kt, acc, load, compute, finish) };
    }
}
