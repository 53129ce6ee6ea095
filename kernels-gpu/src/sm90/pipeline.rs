//! The sm90 TMA pipeline: the mbarrier ring of 64-deep stages ([`TmaRing`]), the warp-specialised
//! split of a block into a producer warpgroup that loads the stages with the tensor memory
//! accelerator ([`tma_split`], [`tma_operand`]) and consumer warpgroups that run the `wgmma` K
//! loop on them ([`tma_pipeline`]), and the `setmaxnreg` register budgets of the two sides.

use super::wgmma::{k16_bytes, wgmma_k16, WgAcc, SLAB_BYTES};
use crate::intrinsics::{self, SmemAddr};
use lmhead_core::config::TMA_STORE_GAP;

pub(super) const BK: usize = 64;

/// Registers per thread of the producer warpgroup of a TMA kernel after `setmaxnreg.dec`.
const PRODUCER_REGS: u32 = 40;

/// Registers per thread of each consumer warpgroup after `setmaxnreg.inc`: what the block was
/// launched with (ptxas gives each of the `(WGM + 1)·128` threads at most 65 536 / threads,
/// rounded down to a multiple of 8) minus the producer's, shared by the consumers, at most 232.
/// Two consumer warpgroups: 168 at launch, 232 after (`128·40 + 256·232 = 64 512`).
const fn consumer_regs(wgm: usize) -> u32 {
    let threads = (wgm as u32 + 1) * 128;
    let launch = (65536 / threads) / 8 * 8;
    let launch = if launch > 255 { 248 } else { launch };
    let pool = launch * threads - 128 * PRODUCER_REGS;
    let per = pool / (wgm as u32 * 128) / 8 * 8;
    if per > 232 {
        232
    } else {
        per
    }
}

/// The mbarriers of a TMA ring, after the `ST` stages in shared memory: `full[s]` completes when
/// stage `s` has landed (one arrival by the producer plus the stage's bytes), `empty[s]` when
/// every consumer warpgroup has finished reading it (`WGM` arrivals).
#[derive(Clone, Copy)]
pub(super) struct TmaRing {
    ring: SmemAddr,
    stage_bytes: u32,
    a_bytes: u32,
    bars: SmemAddr,
    stages: u32,
}

impl TmaRing {
    #[inline(always)]
    pub(super) fn new<const BM: usize, const BN: usize, const ST: usize>() -> Self {
        let ring = intrinsics::smem_base();
        let stage_bytes = ((BM + BN) * BK * 2) as u32;
        Self { ring, stage_bytes, a_bytes: (BM * BK * 2) as u32, bars: ring + ST as u32 * stage_bytes, stages: ST as u32 }
    }

    #[inline(always)]
    fn full(&self, s: u32) -> SmemAddr {
        self.bars + 8 * s
    }

    #[inline(always)]
    fn empty(&self, s: u32) -> SmemAddr {
        self.bars + 8 * (self.stages + s)
    }

    #[inline(always)]
    fn stage(&self, s: u32) -> SmemAddr {
        self.ring + s * self.stage_bytes
    }

    /// The first output box of a `tma_store` kernel (`lmhead_core::config::TMA_STORE_GAP`
    /// after the ring, past the mbarriers; 1024-byte aligned since the stages are).
    #[inline(always)]
    pub(super) fn store_boxes(&self) -> SmemAddr {
        self.bars + TMA_STORE_GAP as u32
    }
}

/// Start of a warp-specialised TMA kernel: initialise the ring's mbarriers, then split the
/// block. The last warpgroup is the producer: its first thread walks the same `(tile, k)`
/// sequence as the consumers and, for each, waits until the stage is free, then has the tensor
/// memory accelerator load A's rows `m0 ..` and B's rows `n0_first + tile·BN ..` at depth `k·64`
/// into it ([`tma_operand`]; `AMN` / `BMN`: that operand is MN-major; `A_STAYS`: A's K-major
/// loads carry an L2 evict-last policy, for the rows a block re-reads at every tile of its walk
/// while an output stream passes through L2); the producer threads then
/// exit (they never return from this function). The first `WGM`
/// warpgroups return, with more registers, to run the prologue, [`tma_pipeline`] and the
/// epilogue.
///
/// # Safety
/// Called first thing by all `(WGM + 1)·128` threads of the block with the same arguments except
/// `tid`; the dynamic shared memory holds the ring and `2·ST` mbarriers after it; `tmaps` points
/// to two tensor maps in global memory (A, then B, 128 bytes each) of bf16 operands with the
/// 128-byte swizzle: a K-major operand's map has 64 (K) × BM (or BN) boxes over `[rows][K]`, an
/// MN-major one's 64 (MN) × 64 (K) boxes over `[K][MN]`.
#[inline(always)]
pub(super) unsafe fn tma_split<
    const BM: usize,
    const BN: usize,
    const ST: usize,
    const WGM: usize,
    const AMN: bool,
    const BMN: bool,
    const A_STAYS: bool,
>(
    tid: u32,
    tmaps: u64,
    m0: u32,
    n0_first: u32,
    n_tiles: u32,
    kt: u32,
) {
    const { assert!(BM == 64 * WGM && (BN == 128 || BN == 256) && ST >= 2 && ST <= 8) };
    // The evict-last load is the K-major box of `tma_operand`.
    const { assert!(!(A_STAYS && AMN)) };
    let r = TmaRing::new::<BM, BN, ST>();
    if tid == 0 {
        for s in 0..ST as u32 {
            // SAFETY: 8-byte aligned slots after the ring (stage sizes are multiples of 1024),
            // inside the launch's dynamic shared memory; no other thread touches them before the
            // barrier below.
            unsafe {
                intrinsics::mbar_init(r.full(s), 1);
                intrinsics::mbar_init(r.empty(s), WGM as u32);
            }
        }
        intrinsics::fence_mbarrier_init();
    }
    // SAFETY: every thread of the block calls this function once, before any other barrier.
    unsafe { intrinsics::sync_threads_divergent() };
    let consumers = (WGM * 128) as u32;
    if tid < consumers {
        const R1: u32 = consumer_regs(1);
        const R2: u32 = consumer_regs(2);
        const R4: u32 = consumer_regs(4);
        // SAFETY: whole consumer warpgroups execute this together; `consumer_regs` keeps the
        // block within the registers it was launched with.
        unsafe {
            match WGM {
                1 => intrinsics::setmaxnreg_inc::<R1>(),
                2 => intrinsics::setmaxnreg_inc::<R2>(),
                4 => intrinsics::setmaxnreg_inc::<R4>(),
                _ => intrinsics::trap(),
            }
        }
        return;
    }
    // SAFETY: the whole producer warpgroup executes this together.
    unsafe { intrinsics::setmaxnreg_dec::<PRODUCER_REGS>() };
    if tid == consumers {
        let ta = tmaps as *const u8;
        let tb = ta.wrapping_add(128);
        // SAFETY: the caller passes two tensor maps at `tmaps`.
        unsafe {
            intrinsics::prefetch_tensormap(ta);
            intrinsics::prefetch_tensormap(tb);
        }
        let pol = intrinsics::l2_evict_last();
        let (mut s, mut phase, mut tile, mut k) = (0u32, 0u32, 0u32, 0u32);
        let total = n_tiles * kt;
        let mut i = 0u32;
        while i < total {
            let dst = r.stage(s);
            // SAFETY: initialised barriers; the wait on `empty[s]` (parity of the previous round,
            // immediate in round 0) orders these TMA writes after every consumer's last read of
            // the stage; the stage is 1024-byte aligned; `full[s]` expects exactly the two boxes'
            // bytes (out-of-bounds elements are zero-filled and still counted).
            unsafe {
                intrinsics::mbar_wait(r.empty(s), phase ^ 1);
                intrinsics::mbar_arrive_expect_tx(r.full(s), r.stage_bytes);
                if A_STAYS {
                    intrinsics::tma_load_2d_hint(dst, ta, (k * BK as u32) as i32, m0 as i32, r.full(s), pol);
                } else {
                    tma_operand::<AMN, BM>(dst, ta, m0, k * BK as u32, r.full(s));
                }
                tma_operand::<BMN, BN>(dst + r.a_bytes, tb, n0_first + tile * BN as u32, k * BK as u32, r.full(s));
            }
            k += 1;
            if k == kt {
                k = 0;
                tile += 1;
            }
            s += 1;
            if s == ST as u32 {
                s = 0;
                phase ^= 1;
            }
            i += 1;
        }
    }
    intrinsics::exit()
}

/// The TMA loads of one operand's stage tile: `ROWS` rows (M or N) from `row0`, 64 deep from
/// `k0`. K-major: one box `(k0, row0)` of 64 × `ROWS`, landing as `ROWS` 128-byte K lines.
/// MN-major (`MN`): `ROWS / 64` boxes `(row0 + 64i, k0)` of 64 × 64, slab `i` at
/// `dst + i·SLAB_BYTES`. Either way `ROWS · 128` bytes complete on `bar`.
///
/// # Safety
/// As [`intrinsics::tma_load_2d`] for each box: `map` is a tensor map of the layout `MN` names
/// with boxes of those sizes, `dst` a 1024-byte-aligned free stage region of `ROWS · 128` bytes,
/// `bar` an initialised mbarrier expecting the bytes.
#[inline(always)]
unsafe fn tma_operand<const MN: bool, const ROWS: usize>(dst: SmemAddr, map: *const u8, row0: u32, k0: u32, bar: SmemAddr) {
    if MN {
        unroll!(ROWS / 64, |i| {
            // SAFETY: forwarded contract; slab `i` is the i-th 8 KiB of the region.
            unsafe { intrinsics::tma_load_2d(dst + i as u32 * SLAB_BYTES, map, (row0 + 64 * i as u32) as i32, k0 as i32, bar) };
        });
    } else {
        // SAFETY: forwarded contract.
        unsafe { intrinsics::tma_load_2d(dst, map, k0 as i32, row0 as i32, bar) };
    }
}

/// The consumer side of a TMA kernel: the K loop over `n_tiles` consecutive `BN`-wide output
/// tiles of one block, fed by the producer of [`tma_split`] through the mbarrier ring;
/// `finish(tile, acc)` runs after the last K step of each tile, with every `wgmma` of the tile
/// retired. Per stage:
/// wait for `full[s]`, issue the `wgmma`s, commit, `wgmma.wait_group 1` (the previous stage's
/// group has retired) and let one thread per warpgroup arrive on that stage's `empty` barrier.
/// No block-wide barrier in the loop: the two warpgroups drift freely within the ring, so one's
/// epilogue overlaps the other's MMAs. Ends with a consumer-only barrier, after which the ring
/// may be reused.
///
/// # Safety
/// Called by the `WGM·128` consumer threads that [`tma_split`] returned to, with the arguments
/// the producer was given.
#[inline(always)]
pub(super) unsafe fn tma_pipeline<
    const BM: usize,
    const BN: usize,
    const ST: usize,
    const WGM: usize,
    const NW: usize,
    const AMN: bool,
    const BMN: bool,
>(
    tid: u32,
    n_tiles: u32,
    kt: u32,
    acc: &mut WgAcc<NW>,
    mut finish: impl FnMut(u32, &mut WgAcc<NW>),
) {
    let r = TmaRing::new::<BM, BN, ST>();
    let wg_row0 = 64 * (tid >> 7);
    let leader = tid & 127 == 0;
    let (mut s, mut phase) = (0u32, 0u32);
    let mut tile = 0u32;
    while tile < n_tiles {
        let mut prev = 0u32;
        let mut k = 0u32;
        while k < kt {
            let a_s = r.stage(s) + wg_row0 * 128;
            let b_s = r.stage(s) + r.a_bytes;
            // SAFETY: `full[s]` of this round completing means the TMA writes of the stage are
            // visible; the stage is not overwritten before this warpgroup arrives on `empty[s]`,
            // which happens only after a `wgmma_wait` retired the group reading it; the
            // warpgroup is converged; accumulators are read only after `wgmma_wait::<0>`.
            unsafe {
                intrinsics::mbar_wait(r.full(s), phase);
                intrinsics::wgmma_fence();
                unroll!(4, |kk| {
                    let kk = kk as u32;
                    wgmma_k16::<NW, AMN, BMN>(acc, a_s + kk * k16_bytes(AMN), b_s + kk * k16_bytes(BMN), k > 0 || kk > 0);
                });
                intrinsics::wgmma_commit();
                intrinsics::wgmma_wait::<1>();
                if k > 0 && leader {
                    intrinsics::mbar_arrive(r.empty(prev));
                }
            }
            prev = s;
            s += 1;
            if s == ST as u32 {
                s = 0;
                phase ^= 1;
            }
            k += 1;
        }
        // SAFETY: the warpgroup is converged; all of this tile's groups retire here, so the last
        // stage is free.
        unsafe {
            intrinsics::wgmma_wait::<0>();
            if leader {
                intrinsics::mbar_arrive(r.empty(prev));
            }
        }
        finish(tile, acc);
        tile += 1;
    }
    // SAFETY: exactly the WGM·128 consumer threads reach this once.
    unsafe { intrinsics::named_barrier::<1>((WGM * 128) as u32) };
}
