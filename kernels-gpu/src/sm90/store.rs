//! The TMA-store epilogue of the sm90 d-logits: per consumer warpgroup, two swizzled output boxes
//! in shared memory, written by `stmatrix` and stored to global memory by the tensor memory
//! accelerator ([`StoreBoxes`]).

use crate::intrinsics::{self, SmemAddr};

/// Bytes of one output box of a `tma_store` epilogue: 64 rows × 64 bf16.
pub(super) const BOX_BYTES: u32 = 64 * 128;

/// The output boxes of a `tma_store` epilogue (`lmhead_core::config::TMA_STORE_BYTES`): two
/// 64 × 64 bf16 boxes with the 128-byte swizzle per consumer warpgroup, used in turn. Each
/// 64-column half of the warpgroup's tile is written into one by `stmatrix` and stored to global
/// memory by the tensor memory accelerator, whole 128-byte lines, rows and columns outside the
/// tensor clipped by the map.
pub(crate) struct StoreBoxes {
    /// This warpgroup's first box.
    first: SmemAddr,
    /// The output's tensor map (64 × 64 boxes, 128-byte swizzle).
    map: *const u8,
    /// The warpgroup's named barrier (2 + warpgroup; 0 and 1 are the block's and the
    /// consumers').
    bar: u32,
    leader: bool,
    /// Warp within the warpgroup, and lane.
    warp: u32,
    lane: u32,
    /// Half tiles stored so far (box `next % 2` is the next one written).
    next: u32,
}

impl StoreBoxes {
    /// The boxes of consumer thread `tid`'s warpgroup; `boxes` is the first box of the block
    /// (1024-byte aligned), `map` the output's tensor map.
    #[inline(always)]
    pub(crate) fn new(boxes: SmemAddr, map: *const u8, tid: u32) -> Self {
        let wg = tid >> 7;
        Self { first: boxes + wg * 2 * BOX_BYTES, map, bar: 2 + wg, leader: tid & 127 == 0, warp: (tid >> 5) & 3, lane: tid & 31, next: 0 }
    }

    /// Store one 64 × 64 half tile at `(col, row)` of the map: `v[j][hh]` is this thread's
    /// packed bf16 pair of n8 tile `j`, rows `16·warp + lane/4 + 8·hh`, columns
    /// `8j + 2·(lane % 4)` and `+1` of the box (the `wgmma` / `mma` accumulator layout).
    ///
    /// Order: each thread waits until its store that last read this box has read it
    /// (`wait_group.read 1`: the other box's store may still run; only the leader has bulk
    /// groups, the others return at once), a warpgroup barrier frees the box, each warp writes
    /// its 16 rows with four `stmatrix.x4` (8 × 8 matrices: tiles `2j`, `2j + 1` × row halves;
    /// the 16-byte chunk `c` of row `r` at `(c ^ r % 8)·16`, the 128-byte swizzle the map names),
    /// each thread fences its writes into the async proxy, a second barrier, and the leader
    /// issues the store (a predicated instruction) and every thread commits its bulk group.
    /// Nothing here branches on the leader: LLVM duplicated the code after such a branch into
    /// both arms, splitting warp 0 across two copies of the `.aligned` `stmatrix` (a hang on the
    /// H200 at `e00f6d5`).
    ///
    /// # Safety
    /// Called by all 128 threads of the warpgroup together, the same number of times; the boxes
    /// lie in the block's dynamic shared memory and nothing else uses them or barrier `2 + wg`;
    /// `map` is a valid tensor map of a bf16 tensor with 64 × 64 boxes and the 128-byte swizzle
    /// whose in-bounds part only this block writes at these coordinates; [`Self::drain`] runs
    /// before the block exits.
    #[inline(always)]
    pub(crate) unsafe fn store(&mut self, v: &[[u32; 2]; 8], col: u32, row: u32) {
        let bx = self.first + (self.next & 1) * BOX_BYTES;
        intrinsics::bulk_wait_read::<1>();
        let i = self.lane >> 3;
        let r = 16 * self.warp + 8 * (i & 1) + (self.lane & 7);
        // SAFETY: 128 threads of this warpgroup, same count (caller); the box is free (the
        // leader's `wait_group.read` before the first barrier); every address is a 16-byte chunk of a row of
        // this 8 KiB box; the store reads the box only after every writer's proxy fence and the
        // second barrier.
        unsafe {
            intrinsics::named_barrier_id(self.bar, 128);
            unroll!(4, |j| {
                let chunk = 2 * j as u32 + (i >> 1);
                let addr = bx + r * 128 + ((chunk ^ (r & 7)) << 4);
                intrinsics::stmatrix_x4(addr, [v[2 * j][0], v[2 * j][1], v[2 * j + 1][0], v[2 * j + 1][1]]);
            });
            intrinsics::fence_proxy_async_shared();
            intrinsics::named_barrier_id(self.bar, 128);
            intrinsics::tma_store_2d(self.map, bx, col as i32, row as i32, self.leader);
        }
        intrinsics::bulk_commit();
        self.next += 1;
    }

    /// Wait until every store has written global memory (before the block exits; threads
    /// other than the leader have only empty groups).
    #[inline(always)]
    pub(crate) fn drain(&self) {
        intrinsics::bulk_wait::<0>();
    }
}
