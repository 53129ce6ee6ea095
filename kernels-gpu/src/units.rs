//! Unit kernels: each checks one piece of the Hopper mainloop in isolation against the host, so
//! that a wrong swizzle, descriptor or accumulator layout shows up as a named failure rather than
//! as a wrong log-prob somewhere in a full kernel (`tests/gpu_units.rs`).
//!
//! Both run one warpgroup (128 threads) and use the same wrappers as the mainloop: the mbarrier
//! and TMA wrappers of `intrinsics`, `lmhead_core::wgmma` descriptors and `sm90::wgmma_k16`.

use crate::intrinsics::{self, SmemAddr};
use crate::sm90::{wgmma_k16, StoreBoxes, WgAcc};
use lmhead_core::params::UnitParams;

/// Initialise one mbarrier at `bar` (thread 0), make it visible, and have thread 0 start the TMA
/// load of box `(k0, row0)` of the map at `tmap` into `dst`, expecting `bytes`.
///
/// # Safety
/// All threads of the block call this once with the same arguments; `bar` and `dst` lie in the
/// dynamic shared memory (8- and 1024-byte aligned), `tmap` is a valid map whose box is `bytes`.
#[inline(always)]
unsafe fn load_box(tid: u32, bar: SmemAddr, dst: SmemAddr, tmap: *const u8, k0: u32, row0: u32, bytes: u32) {
    if tid == 0 {
        // SAFETY: the caller guarantees the barrier slot; no other thread uses it before the
        // block barrier below.
        unsafe { intrinsics::mbar_init(bar, 1) };
        intrinsics::fence_mbarrier_init();
    }
    // SAFETY: every thread calls this once.
    unsafe { intrinsics::sync_threads_divergent() };
    if tid == 0 {
        // SAFETY: initialised barrier expecting exactly the box's bytes; the caller guarantees
        // the map and the destination.
        unsafe {
            intrinsics::mbar_arrive_expect_tx(bar, bytes);
            intrinsics::tma_load_2d(dst, tmap, k0 as i32, row0 as i32, bar);
        }
    }
}

/// Copy box `(p.k0, p.row0)` of `p.rows` rows × 64 bf16 into shared memory with the first tensor
/// map of `p`, then write the shared bytes unchanged to `p.out` (`rows · 128` bytes).
///
/// # Safety
/// Launched with 128 threads, one block, `rows · 128 + 8` bytes of dynamic shared memory
/// (`rows` ≤ 256 and a multiple of 8); `p.tmaps` holds a bf16 map with a 64 × `rows` box;
/// `p.out` has `rows · 128` writable bytes, 16-byte aligned.
pub unsafe fn tma_copy(p: &UnitParams) {
    let tid = intrinsics::thread_idx();
    let smem = intrinsics::smem_base();
    let bytes = p.rows * 128;
    let bar = smem + bytes;
    // SAFETY: forwarded contract; `bar` follows the box (8-byte aligned as rows·128 is).
    unsafe {
        load_box(tid, bar, smem, p.tmaps as *const u8, p.k0, p.row0, bytes);
        intrinsics::mbar_wait(bar, 0);
    }
    let mut c = tid;
    while c < bytes / 16 {
        // SAFETY: chunk `c` lies inside the box in shared memory and inside `out`.
        unsafe {
            let v = intrinsics::ld_shared_v4(smem + 16 * c);
            intrinsics::st_global_v4((p.out as *mut f32).add(4 * c as usize), v);
        }
        c += 128;
    }
}

/// `C = A · Bᵀ` for one 64 × 64 A tile and one `128·NW` × 64 B tile (both loaded by TMA from the
/// two maps of `p` at coordinates (0, 0)), accumulated over the four k16 steps of the stage by
/// `sm90::wgmma_k16`; thread `t` writes its accumulators to `out [64][128·NW]` (f32) at the
/// positions the mainloop's epilogues assume (`intrinsics::wgmma_m64n128k16_bf16`).
///
/// # Safety
/// Launched with 128 threads, one block, `(64 + 128·NW)·128 + 16` bytes of dynamic shared memory;
/// `p.tmaps` holds two bf16 maps with boxes 64 × 64 (A) and 64 × `128·NW` (B), 128-byte swizzle;
/// `p.out` has `64 · 128·NW` writable f32, 8-byte aligned.
pub unsafe fn wgmma_tile<const NW: usize>(p: &UnitParams) {
    let tid = intrinsics::thread_idx();
    let smem = intrinsics::smem_base();
    let a_bytes = 64 * 128u32;
    let b_bytes = (128 * NW * 128) as u32;
    let bar_a = smem + a_bytes + b_bytes;
    let bar_b = bar_a + 8;
    let ta = p.tmaps as *const u8;
    // SAFETY: forwarded contract; two barriers after both tiles, each 1024-byte aligned tile.
    unsafe {
        load_box(tid, bar_a, smem, ta, 0, 0, a_bytes);
        load_box(tid, bar_b, smem + a_bytes, ta.wrapping_add(128), 0, 0, b_bytes);
        intrinsics::mbar_wait(bar_a, 0);
        intrinsics::mbar_wait(bar_b, 0);
    }
    let mut acc: WgAcc<NW> = [[[[0.0; 4]; 8]; 2]; NW];
    // SAFETY: the warpgroup is converged; both tiles landed (barriers); the accumulators are read
    // after `wgmma_wait::<0>`.
    unsafe {
        intrinsics::wgmma_fence();
        unroll!(4, |kk| {
            let koff = (kk * 32) as u32;
            wgmma_k16::<NW, false, false>(&mut acc, smem + koff, smem + a_bytes + koff, kk > 0);
        });
        intrinsics::wgmma_commit();
        intrinsics::wgmma_wait::<0>();
    }
    // SAFETY: forwarded contract (`out` holds 64 × 128·NW f32).
    unsafe { store_acc::<NW>(&acc, tid, p.out as *mut f32) };
}

/// `C = A · B` for one 64 × 64 A tile (K-major, as in [`wgmma_tile`]) and one 64 × 128 B tile
/// stored **MN-major** (`B[k][n]`, N contiguous), loaded by TMA as two 64-column slabs of 64
/// K rows (map 2 of `p`, boxes at (0, 0) and (64, 0)) and read by `m64n128k16` with
/// `imm-trans-b = 1`. The B descriptor's leading and stride byte offsets are `p.k0` and `p.row0`,
/// so that the host can check the layout `lmhead_core::wgmma::desc_mn_major_sw128` claims and
/// its alternative in one run. Output as [`wgmma_tile`].
///
/// # Safety
/// Launched with 128 threads, one block, `3 · 8192 + 16` bytes of dynamic shared memory;
/// `p.tmaps` holds two bf16 maps with 64 × 64 boxes, 128-byte swizzle (A: 64 rows of K = 64;
/// B: 64 rows (K) of 128 columns); `p.out` has `64 · 128` writable f32, 8-byte aligned.
pub unsafe fn wgmma_tile_mn(p: &UnitParams) {
    let tid = intrinsics::thread_idx();
    let smem = intrinsics::smem_base();
    let slab = 64 * 128u32;
    let b_s = smem + slab;
    let bar_a = b_s + 2 * slab;
    let bar_b = bar_a + 8;
    let ta = p.tmaps as *const u8;
    let tb = ta.wrapping_add(128);
    // SAFETY: forwarded contract; A's box, then both B slabs on one barrier expecting both.
    unsafe {
        load_box(tid, bar_a, smem, ta, 0, 0, slab);
        load_box(tid, bar_b, b_s, tb, 0, 0, 2 * slab);
        if tid == 0 {
            intrinsics::tma_load_2d(b_s + slab, tb, 64, 0, bar_b);
        }
        intrinsics::mbar_wait(bar_a, 0);
        intrinsics::mbar_wait(bar_b, 0);
    }
    let mut acc: WgAcc<1> = [[[[0.0; 4]; 8]; 2]; 1];
    // SAFETY: as in `wgmma_tile`; B's k16 step `kk` starts 16 K rows (2048 bytes) into slab 0.
    unsafe {
        intrinsics::wgmma_fence();
        unroll!(4, |kk| {
            let ad = lmhead_core::wgmma::desc_k_major_sw128(smem + (kk * 32) as u32);
            let bd = lmhead_core::wgmma::desc_sw128(b_s + (kk * 2048) as u32, p.k0, p.row0);
            intrinsics::wgmma_m64n128k16_bf16::<false, true>(&mut acc[0], ad, bd, kk > 0);
        });
        intrinsics::wgmma_commit();
        intrinsics::wgmma_wait::<0>();
    }
    // SAFETY: forwarded contract (`out` holds 64 × 128 f32).
    unsafe { store_acc::<1>(&acc, tid, p.out as *mut f32) };
}

/// Two 64 × 64 bf16 tiles of known bit patterns stored by one warpgroup through
/// `sm90::StoreBoxes`, as the `tma_store` d-logits store theirs (`stmatrix` into the swizzled
/// boxes, then a TMA store with the first map of `p`): tile `i` at `(p.k0 + 64i, p.row0)`, its
/// element (r, c) the raw 16-bit pattern `4096·i + 64·r + c`.
///
/// # Safety
/// Launched with 128 threads, one block, `2 · 8192` bytes of dynamic shared memory; `p.tmaps`
/// holds one map of a writable 16-bit tensor with 64 × 64 boxes and the 128-byte swizzle.
pub unsafe fn tma_store(p: &UnitParams) {
    let tid = intrinsics::thread_idx();
    let mut out = StoreBoxes::new(intrinsics::smem_base(), p.tmaps as *const u8, tid);
    let (warp, lane) = (tid >> 5, tid & 31);
    unroll!(2, |i| {
        let mut v = [[0u32; 2]; 8];
        unroll!(8, |j| {
            unroll!(2, |hh| {
                let r = 16 * warp + (lane >> 2) + 8 * hh as u32;
                let c = 8 * j as u32 + 2 * (lane & 3);
                let code = |c: u32| 4096 * i as u32 + 64 * r + c;
                v[j][hh] = code(c) | (code(c + 1) << 16);
            });
        });
        // SAFETY: the whole warpgroup, twice; the two boxes are the launch's 16 KiB; the map per
        // the contract.
        unsafe { out.store::<false>(&v, p.k0 + 64 * i as u32, p.row0) };
    });
    out.drain();
}

/// Thread `tid`'s accumulators of a 64 × `128·NW` tile to `out [64][128·NW]` (f32) at the
/// positions the mainloop's epilogues assume.
///
/// # Safety
/// `out` has `64 · 128·NW` writable f32, 8-byte aligned; `tid` < 128.
#[inline(always)]
unsafe fn store_acc<const NW: usize>(acc: &WgAcc<NW>, tid: u32, out: *mut f32) {
    let n = (128 * NW) as u32;
    let (warp, lane) = (tid >> 5, tid & 31);
    unroll!(NW, |nb| {
        unroll!(2, |h| {
            unroll!(8, |j| {
                let col = (nb * 128 + h * 64 + j * 8) as u32 + 2 * (lane & 3);
                unroll!(2, |half| {
                    let row = 16 * warp + (lane >> 2) + 8 * half as u32;
                    let v = acc[nb][h][j];
                    // SAFETY: row < 64 and col + 1 < n: inside `out`; 8-byte aligned (col even).
                    unsafe { intrinsics::st_global_v2(out.add((row * n + col) as usize), v[2 * half], v[2 * half + 1]) };
                });
            });
        });
    });
}
