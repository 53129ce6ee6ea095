//! The backward `dh` GEMM with its f32 sum stored or added by TMA (`Store::Tma`, [`AccBoxes`]).
//! (The register store is the generic `body::gemm::gemm` on [`Sm90`].)

use super::pipeline::TmaRing;
use super::store::BOX_BYTES;
use super::{AccBoxes, Sm90};
use crate::body::gemm::GemmJob;
use crate::body::Mainloop as _;
use crate::epilogue::Acc;
use crate::intrinsics;
use lmhead_core::config::TMA_STORE_BYTES;
use lmhead_core::params::GemmParams;

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
