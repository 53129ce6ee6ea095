//! The portable mainloop (`MmaSync`: `cp.async` ring, `ldmatrix`, `mma.sync.m16n8k16`; only
//! sm_80 instructions) and what is its own of the kernels built on it. One file per pass:
//!
//! - [`mainloop`]: the pipeline (ring, fragment loads, the MMA step);
//! - [`fwd`]: the fused forward (logits tiles folded into row states, one partial per split);
//! - here: [`Sm80`], the mainloop as a [`body::Mainloop`], which gives it the generic backward
//!   bodies: the d-logits (`body::dlogits`) and the two GEMMs (`body::gemm`).
//!
//! `T≙M, V≙N, D≙K`. A block of `WM × WN` warps computes a `BM × BN` tile, each warp `MI × NI`
//! `m16n8` fragments ([`Acc`], placed by [`WarpPos`]); every finished accumulator tile goes to
//! the shared epilogue (`crate::epilogue`).
//!
//! **d-logits.** One `BM × BN` logits tile of the chunk per block, turned into bf16 d-logits in
//! the staging buffer (`epilogue::dlogits`, which derives the gradient).
//!
//! **GEMMs.** `dh[t, d] (+)= Σ_v dl[t, v] · W[v, d]` (A = staging, K-major; B = `W` chunk,
//! N-major) and `dW[v, d] = Σ_t dl[t, v] · h[t, d]` (A = stagingᵀ, M-major; B = `h`, N-major),
//! stored by `epilogue::gemm`.

pub mod fwd;
pub mod mainloop;

use crate::body::{self, Job, Operands, Tiles};
use crate::epilogue::{Acc, WarpPos};
use crate::intrinsics;

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
