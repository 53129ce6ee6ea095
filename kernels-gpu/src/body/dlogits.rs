//! The backward d-logits of one vocab chunk over any [`Mainloop`], stored by
//! `epilogue::dlogits`.

use super::{Grid, Job, Mainloop, Operands};
use crate::epilogue::dlogits::{row_coeffs, store_dlogits};
use crate::epilogue::Acc;
use crate::sm80::mainloop::Operand;
use lmhead_core::params::LogitsParams;

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
