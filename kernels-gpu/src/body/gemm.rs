//! The backward GEMMs (`dh`, `dW`) over any [`Mainloop`], stored by `epilogue::gemm`.

use super::{Grid, Job, Mainloop, Operands};
use crate::epilogue::gemm::store_gemm;
use crate::epilogue::Acc;
use crate::sm80::mainloop::Operand;
use lmhead_core::params::GemmParams;

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
