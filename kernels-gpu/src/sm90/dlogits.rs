//! The backward d-logits with the tile stored by TMA (`Store::Tma`): the shared d-logits maths
//! (`epilogue::dlogits`) packed into the swizzled store boxes of [`super::store`]. (The register
//! store is the generic `body::dlogits::dlogits` on [`Sm90`].)

use super::pipeline::{tma_pipeline, tma_split, TmaRing, BK};
use super::store::BOX_BYTES;
use super::{block_tiles, warp_pos, Sm90, StoreBoxes, WgAcc};
use crate::body::Grid;
use crate::epilogue::dlogits::{dlogits_pair, row_coeffs};
use crate::intrinsics;
use lmhead_core::config::TMA_STORE_BYTES;
use lmhead_core::params::LogitsParams;

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
    unsafe { tma_split::<BM, BN, ST, WGM, false, false, true>(tid, p.tmaps, m0, p.v_chunk_begin + n0_first, n_tiles, kt) };
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
                unsafe { out.store::<true>(&v, c0, row) };
            });
        });
    };
    // SAFETY: every thread calls with the same arguments; smem and operands per the contract.
    unsafe { tma_pipeline::<BM, BN, ST, WGM, NW, false, false>(tid, n_tiles, kt, &mut acc, finish) };
    out.drain();
}
