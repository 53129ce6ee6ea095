//! The TMA epilogues of the sm90 kernels: per consumer warpgroup, two swizzled boxes in shared
//! memory, used in turn, whose contents the tensor memory accelerator writes to global memory —
//! the d-logits' bf16 tile, written by `stmatrix` ([`StoreBoxes`]), and `dh`'s f32 tile, stored
//! or added into the accumulator ([`AccBoxes`]).

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
    pub(crate) unsafe fn store<const EVICT_FIRST: bool>(&mut self, v: &[[u32; 2]; 8], col: u32, row: u32) {
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
            intrinsics::tma_store_2d::<EVICT_FIRST>(self.map, bx, col as i32, row as i32, self.leader);
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

/// The f32 accumulator boxes of a `tma_store` `dh` GEMM: per consumer warpgroup, two 64 × 32 f32
/// boxes (128-byte rows) with the 128-byte swizzle, in the place and size of [`StoreBoxes`]'
/// (`lmhead_core::config::TMA_STORE_BYTES`), used in turn. Each 32-column quarter of the
/// warpgroup's 64 × 128 accumulator block is written into one with `st.shared.v2` and stored
/// to the f32 accumulator by the tensor memory accelerator, or added into it
/// (`cp.reduce.async.bulk.tensor … .add`): the epilogue neither reads the accumulator nor
/// waits for its writes; rows and columns outside the tensor are clipped by the map.
pub(crate) struct AccBoxes {
    /// This warpgroup's first box.
    first: SmemAddr,
    /// The accumulator's tensor map (f32, 32 × 64 boxes, 128-byte swizzle).
    map: *const u8,
    /// The warpgroup's named barrier (2 + warpgroup).
    bar: u32,
    /// The leader issues stores (`store`) or adds (`add`): predicates, not branches.
    store: bool,
    add: bool,
    /// Warp within the warpgroup, and lane.
    warp: u32,
    lane: u32,
    /// Quarters written so far (box `next % 2` is the next one written).
    next: u32,
}

impl AccBoxes {
    /// The boxes of consumer thread `tid`'s warpgroup; `boxes` is the first box of the block
    /// (1024-byte aligned), `map` the accumulator's tensor map; `add`: add into the accumulator
    /// rather than overwrite it.
    #[inline(always)]
    pub(crate) fn new(boxes: SmemAddr, map: *const u8, tid: u32, add: bool) -> Self {
        let wg = tid >> 7;
        let leader = tid & 127 == 0;
        Self {
            first: boxes + wg * 2 * BOX_BYTES,
            map,
            bar: 2 + wg,
            store: leader && !add,
            add: leader && add,
            warp: (tid >> 5) & 3,
            lane: tid & 31,
            next: 0,
        }
    }

    /// Store or add one 64 × 32 quarter at `(col, row)` of the map: `x[j]` is this thread's
    /// accumulator of n8 tile `j` (`x[j][2·hh]`, `x[j][2·hh + 1]` in row
    /// `16·warp + lane/4 + 8·hh`, columns `8j + 2·(lane % 4)` and `+1` of the box; the
    /// `m16n8` layout).
    ///
    /// Order as [`StoreBoxes::store`]: wait until this box's last copy has read it, a barrier,
    /// the writes (the 8-byte pair of row `r`, column `c` in 16-byte chunk `c / 4` at
    /// `(c/4 ^ r % 8)·16 + 4·(c % 4)`, the 128-byte swizzle; a warp's store covers 8 rows × 32
    /// bytes, two wavefronts), a proxy fence per thread, a second barrier, the leader's copy,
    /// every thread's commit.
    ///
    /// # Safety
    /// Called by all 128 threads of the warpgroup together, the same number of times; the boxes
    /// lie in the block's dynamic shared memory and nothing else uses them or barrier `2 + wg`;
    /// `map` is a valid tensor map of an f32 tensor with 32 × 64 boxes and the 128-byte swizzle
    /// whose in-bounds part at these coordinates only this block writes during the kernel;
    /// [`Self::drain`] runs before the block exits.
    #[inline(always)]
    pub(crate) unsafe fn put(&mut self, x: &[[f32; 4]; 4], col: u32, row: u32) {
        let bx = self.first + (self.next & 1) * BOX_BYTES;
        intrinsics::bulk_wait_read::<1>();
        // SAFETY: 128 threads of this warpgroup, same count (caller); the box is free (the
        // leader's `wait_group.read` before the first barrier); every address is an 8-byte pair
        // inside a row of this 8 KiB box; the copy reads the box only after every writer's
        // proxy fence and the second barrier.
        unsafe {
            intrinsics::named_barrier_id(self.bar, 128);
            unroll!(4, |j| {
                unroll!(2, |hh| {
                    let r = 16 * self.warp + 8 * hh as u32 + (self.lane >> 2);
                    let chunk = 2 * j as u32 + ((self.lane & 3) >> 1);
                    let addr = bx + r * 128 + ((chunk ^ (r & 7)) << 4) + 8 * (self.lane & 1);
                    intrinsics::st_shared_v2(addr, x[j][2 * hh], x[j][2 * hh + 1]);
                });
            });
            intrinsics::fence_proxy_async_shared();
            intrinsics::named_barrier_id(self.bar, 128);
            intrinsics::tma_store_2d::<false>(self.map, bx, col as i32, row as i32, self.store);
            intrinsics::tma_reduce_add_2d(self.map, bx, col as i32, row as i32, self.add);
        }
        intrinsics::bulk_commit();
        self.next += 1;
    }

    /// Wait until every copy has written global memory (before the block exits).
    #[inline(always)]
    pub(crate) fn drain(&self) {
        intrinsics::bulk_wait::<0>();
    }
}
