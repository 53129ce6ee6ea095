//! The sm90 mainloop: a warp-specialised pipeline in which a producer warpgroup loads 64-deep
//! stages with the tensor memory accelerator (tensor maps made by the host) into an mbarrier
//! full/empty ring, and the consumer warpgroups issue `wgmma.mma_async` on the stages
//! (128-byte swizzle, descriptors from `lmhead_core::wgmma`) and run the epilogue; and the three
//! kernels built on it: the fused forward, the backward d-logits, and the backward GEMMs.
//!
//! `T≙M, V≙N, D≙K`. A block has `WGM` consumer warpgroups (4 warps each) stacked along M, each
//! owning 64 rows of the `BM = 64·WGM` token tile and all `BN = 128·NW` vocab columns (NW
//! `m64n128k16` instructions per k16 step), plus the producer warpgroup ([`tma_split`],
//! `setmaxnreg` moves registers from it to the consumers).
//!
//! The forward and the d-logits read `h` and `W` K-major. The GEMMs read their operands as
//! stored: `dh`'s B (the `W` chunk `[k][n]`) and `dW`'s A (the staging buffer `[k][m]`) and B
//! (`h`, `[k][n]`) are MN-major tiles loaded as 64-wide slabs and read with `wgmma`'s transpose
//! bits (`AMN`/`BMN`; [`tma_operand`], [`wgmma_k16`]).
//!
//! The epilogue folds each 64-column half of a 128-column block with `fwd::fold_tile` (the
//! accumulator layout of `m64n128k16` is the `mma.sync` m16n8 layout per 8 columns, one m16 tile
//! per warp), and the block reduction is `fwd::store_partials` with one warp along N; the
//! d-logits epilogue can instead store through shared memory by TMA ([`StoreBoxes`]).

use crate::bwd::{dlogits_pair, row_coeffs, store_dlogits, store_gemm};
use crate::fwd::{fold_tile, load_label, local_column, store_partials};
use crate::intrinsics::{self, SmemAddr};
use crate::mainloop::{Acc, WarpPos};
use lmhead_core::config::{TMA_STORE_BYTES, TMA_STORE_GAP};
use lmhead_core::lse::Lse2;
use lmhead_core::params::{GemmParams, LogitsParams};
use lmhead_core::wgmma::{desc_k_major_sw128, desc_mn_major_sw128};

const BK: usize = 64;

/// Accumulators of one warp: `NW` blocks of 128 columns, each two halves of one m16 × eight n8
/// tiles (the `wgmma_m64n128k16_bf16` operand).
pub type WgAcc<const NW: usize> = [[[[f32; 4]; 8]; 2]; NW];

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
struct TmaRing {
    ring: SmemAddr,
    stage_bytes: u32,
    a_bytes: u32,
    bars: SmemAddr,
    stages: u32,
}

impl TmaRing {
    #[inline(always)]
    fn new<const BM: usize, const BN: usize, const ST: usize>() -> Self {
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
    fn store_boxes(&self) -> SmemAddr {
        self.bars + TMA_STORE_GAP as u32
    }
}

/// Start of a warp-specialised TMA kernel: initialise the ring's mbarriers, then split the
/// block. The last warpgroup is the producer: its first thread walks the same `(tile, k)`
/// sequence as the consumers and, for each, waits until the stage is free, then has the tensor
/// memory accelerator load A's rows `m0 ..` and B's rows `n0_first + tile·BN ..` at depth `k·64`
/// into it ([`tma_operand`]; `AMN` / `BMN`: that operand is MN-major); the producer threads then
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
pub unsafe fn tma_split<const BM: usize, const BN: usize, const ST: usize, const WGM: usize, const AMN: bool, const BMN: bool>(
    tid: u32,
    tmaps: u64,
    m0: u32,
    n0_first: u32,
    n_tiles: u32,
    kt: u32,
) {
    const { assert!(BM == 64 * WGM && (BN == 128 || BN == 256) && ST >= 2 && ST <= 8) };
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
                tma_operand::<AMN, BM>(dst, ta, m0, k * BK as u32, r.full(s));
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

/// Bytes of one MN-major slab: 64 MN elements (one 128-byte line) × 64 K rows.
const SLAB_BYTES: u32 = 64 * 128;

/// Bytes a k16 step advances an operand's shared-memory address: 16 bf16 along a K-major
/// operand's 128-byte rows, 16 rows of an MN-major operand's slabs.
const fn k16_bytes(mn: bool) -> u32 {
    if mn {
        16 * 128
    } else {
        32
    }
}

/// The `wgmma` descriptor of a 128B-swizzled operand tile at `addr`, K-major or (`MN`) MN-major
/// in [`SLAB_BYTES`] slabs (`lmhead_core::wgmma`).
#[inline(always)]
fn operand_desc<const MN: bool>(addr: SmemAddr) -> u64 {
    if MN {
        desc_mn_major_sw128(addr, SLAB_BYTES)
    } else {
        desc_k_major_sw128(addr)
    }
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
pub unsafe fn tma_pipeline<
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

/// One k16 step of the warpgroup's `64 × 128·NW` tile: a single `m64n256k16` for two column
/// blocks (A read once), else one `m64n128k16` per block. `AMN` / `BMN`: that operand is
/// MN-major ([`SLAB_BYTES`] slabs, read with `imm-trans`), else K-major.
///
/// # Safety
/// As [`intrinsics::wgmma_m64n128k16_bf16`]: `a_s`/`b_s` address the k16 slice of a loaded
/// 128B-swizzled A (64 rows) and B (`128·NW` rows) tile of the named layouts.
#[inline(always)]
pub(crate) unsafe fn wgmma_k16<const NW: usize, const AMN: bool, const BMN: bool>(
    acc: &mut WgAcc<NW>,
    a_s: SmemAddr,
    b_s: SmemAddr,
    accumulate: bool,
) {
    let ad = operand_desc::<AMN>(a_s);
    if NW == 2 {
        let pair: &mut [[[[f32; 4]; 8]; 2]; 2] = (&mut acc[..]).try_into().unwrap_or_else(|_| intrinsics::trap());
        // SAFETY: forwarded contract; B's 256 rows are consecutive 128-byte lines (K-major) or
        // four consecutive slabs (MN-major), 8-row atoms 1024 bytes apart either way.
        unsafe { intrinsics::wgmma_m64n256k16_bf16::<AMN, BMN>(pair, ad, operand_desc::<BMN>(b_s), accumulate) };
    } else {
        // SAFETY: forwarded contract.
        unsafe { wgmma_k16_n128::<NW, AMN, BMN>(acc, a_s, b_s, accumulate) };
    }
}

/// One k16 step as `NW` `m64n128k16` instructions, one per 128-column block.
///
/// # Safety
/// As [`wgmma_k16`].
#[inline(always)]
unsafe fn wgmma_k16_n128<const NW: usize, const AMN: bool, const BMN: bool>(
    acc: &mut WgAcc<NW>,
    a_s: SmemAddr,
    b_s: SmemAddr,
    accumulate: bool,
) {
    let ad = operand_desc::<AMN>(a_s);
    unroll!(NW, |nb| {
        // SAFETY: forwarded contract; block `nb` of B starts 16 KiB further in both layouts (128
        // lines, or two slabs).
        unsafe {
            intrinsics::wgmma_m64n128k16_bf16::<AMN, BMN>(&mut acc[nb], ad, operand_desc::<BMN>(b_s + (nb * 128 * 128) as u32), accumulate)
        };
    });
}

/// This thread's warp position: warp `w` holds rows `16w .. 16w + 16` of the block tile and
/// every column.
#[inline(always)]
fn warp_pos(tid: u32) -> WarpPos {
    WarpPos { tid, lane: tid & 31, wm0: 16 * (tid >> 5), wn0: 0, warp_n: 0 }
}

/// One 64-column half of a 128-column block as the `Acc<1, 8>` of the shared epilogues.
#[inline(always)]
fn half<const NW: usize>(acc: &mut WgAcc<NW>, nb: usize, h: usize) -> &mut Acc<1, 8> {
    core::array::from_mut(&mut acc[nb][h])
}

/// The fused forward on the Hopper mainloop. Same contract and outputs as `fwd::fwd`.
///
/// # Safety
/// Launched with `(WGM + 1)·128` threads (the last warpgroup is the producer), a grid of
/// `(ceil(t/BM), n_splits)` blocks and `(BM + BN)·64·2·ST` bytes of dynamic shared memory (plus
/// `16·ST` for the mbarriers, and `p.tmaps` set); `p` describes valid device buffers as for
/// `fwd::fwd`.
#[inline(always)]
pub unsafe fn fwd_wg<const BM: usize, const BN: usize, const ST: usize, const WGM: usize, const NW: usize, const ENT: bool>(
    p: &LogitsParams,
) {
    let tid = intrinsics::thread_idx();
    let (m_tile, split) = lmhead_core::split::raster(
        intrinsics::block_idx_x(),
        intrinsics::block_idx_y(),
        intrinsics::grid_dim_x(),
        intrinsics::grid_dim_y(),
        p.raster_group,
    );
    let m0 = m_tile * BM as u32;
    let v_tiles = p.v.div_ceil(BN as u32);
    let tile_begin = split * p.tiles_per_split;
    let n_tiles = (v_tiles - tile_begin).min(p.tiles_per_split);
    let kt = p.d.div_ceil(BK as u32);
    let n0_first = tile_begin * BN as u32;
    // SAFETY: first call, by every thread; the kernel contract provides the maps.
    unsafe { tma_split::<BM, BN, ST, WGM, false, false>(tid, p.tmaps, m0, n0_first, n_tiles, kt) };
    let w = warp_pos(tid);

    // ---- Prologue: per-row state and labels ------------------------------------------------
    let mut st = [[Lse2::<f32>::EMPTY; 2]; 1];
    let mut z_label = [[0.0f32; 2]; 1];
    let mut label = [[-1i32; 2]; 1];
    unroll!(2, |h| {
        let row = m0 + w.row(0, h);
        if row < p.t {
            // SAFETY: row < t and labels holds t elements (kernel contract).
            label[0][h] = local_column(p, unsafe { load_label(p.labels, p.label_kind, row) });
        }
    });
    let mut acc: WgAcc<NW> = [[[[0.0; 4]; 8]; 2]; NW];

    // ---- Main loop, each tile folded into the row states ------------------------------------
    let finish = #[inline(always)]
    |tile: u32, acc: &mut WgAcc<NW>| {
        let n0 = n0_first + tile * BN as u32;
        unroll!(NW, |nb| {
            unroll!(2, |h| {
                fold_tile::<64, 1, 8, ENT>(p, &w, n0 + (nb * 128 + h * 64) as u32, half(acc, nb, h), &mut st, &mut z_label, &label);
            });
        });
    };
    // SAFETY: every thread calls with the same arguments; smem and operands per the contract.
    unsafe { tma_pipeline::<BM, BN, ST, WGM, NW, false, false>(tid, n_tiles, kt, &mut acc, finish) };

    // ---- Epilogue ---------------------------------------------------------------------------
    // SAFETY: all consumer threads, ring drained behind the pipeline's last barrier; BM·16 bytes
    // fit.
    unsafe { store_partials::<BM, 1, 1, ENT>(p, &w, &mut st, &mut z_label, m0, split, intrinsics::smem_base(), (WGM * 128) as u32) };
}

/// Bytes of one output box of a `tma_store` epilogue: 64 rows × 64 bf16.
const BOX_BYTES: u32 = 64 * 128;

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

/// This block's output tiles in a grid of `(m tiles, n groups)` blocks, taken in
/// [`lmhead_core::split::raster`] order with groups of `group` m tiles (0 = plain): the first
/// row, the first column and the count of the `per` consecutive `BN`-wide tiles (of `n_total`)
/// the block walks. The pipeline runs on from one tile into the next, so a block pays one fill
/// and its epilogues overlap the producer's loads; the raster keeps the rows resident blocks
/// read together within L2 (`split::plan_l2`, which also picks `per`).
#[inline(always)]
fn block_tiles<const BM: usize, const BN: usize>(group: u32, per: u32, n_total: u32) -> (u32, u32, u32) {
    let (mt, ng) = lmhead_core::split::raster(
        intrinsics::block_idx_x(),
        intrinsics::block_idx_y(),
        intrinsics::grid_dim_x(),
        intrinsics::grid_dim_y(),
        group,
    );
    let per = if per == 0 { 1 } else { per };
    let first = ng * per;
    // The host launches `ceil(n_total / per)` groups, so `first < n_total`; saturate anyway.
    let count = n_total.saturating_sub(first).min(per);
    (mt * BM as u32, first * BN as u32, count)
}

/// Backward d-logits of one vocab chunk on the Hopper mainloop. Same contract as
/// `bwd::dlogits`. `TS`: the tile is stored through [`StoreBoxes`] by the tensor
/// memory accelerator, with a third tensor map over the staging buffer.
///
/// # Safety
/// Launched with `(WGM + 1)·128` threads, grid
/// `(ceil(t/BM), ceil(ceil(staging_stride/BN) / max(1, p.tiles_per_split)))`, the ring's
/// dynamic shared memory (with the mbarriers and `p.tmaps`; for `TS` 1024 bytes after the
/// ring, then `TMA_STORE_BYTES`, and a third map in `p.tmaps`: the staging buffer
/// `[t][staging_stride]`, 64 × 64 boxes, 128-byte swizzle); buffers as for `bwd::dlogits`.
#[inline(always)]
pub unsafe fn dlogits_wg<
    const BM: usize,
    const BN: usize,
    const ST: usize,
    const WGM: usize,
    const NW: usize,
    const ENT: bool,
    const TS: bool,
>(
    p: &LogitsParams,
) {
    let tid = intrinsics::thread_idx();
    let n_total = (p.staging_stride as u32).div_ceil(BN as u32);
    let (m0, n0_first, n_tiles) = block_tiles::<BM, BN>(p.raster_group, p.tiles_per_split, n_total);
    let kt = p.d.div_ceil(BK as u32);
    // SAFETY: first call, by every thread; the kernel contract provides the maps.
    unsafe { tma_split::<BM, BN, ST, WGM, false, false>(tid, p.tmaps, m0, p.v_chunk_begin + n0_first, n_tiles, kt) };
    let w = warp_pos(tid);
    // SAFETY: buffers per the kernel contract.
    let coeffs = unsafe { row_coeffs::<1, ENT>(p, &w, m0) };
    let mut acc: WgAcc<NW> = [[[[0.0; 4]; 8]; 2]; NW];
    if TS {
        // The host's `TileConfig::smem_bytes` reserves exactly these boxes for the block.
        const { assert!(!TS || WGM as u32 * 2 * BOX_BYTES == TMA_STORE_BYTES as u32) };
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
                    unsafe { out.store(&v, c0, row) };
                });
            });
        };
        // SAFETY: every thread calls with the same arguments; smem and operands per the
        // contract.
        unsafe { tma_pipeline::<BM, BN, ST, WGM, NW, false, false>(tid, n_tiles, kt, &mut acc, finish) };
        out.drain();
        return;
    }
    let finish = #[inline(always)]
    |tile: u32, acc: &mut WgAcc<NW>| {
        let n0 = n0_first + tile * BN as u32;
        unroll!(NW, |nb| {
            unroll!(2, |h| {
                // SAFETY: staging per the kernel contract.
                unsafe { store_dlogits::<1, 8, ENT>(p, &w, m0, n0 + (nb * 128 + h * 64) as u32, half(acc, nb, h), &coeffs) };
            });
        });
    };
    // SAFETY: every thread calls with the same arguments; smem and operands per the contract.
    unsafe { tma_pipeline::<BM, BN, ST, WGM, NW, false, false>(tid, n_tiles, kt, &mut acc, finish) };
}

/// Backward GEMM `C[m, n] (+)= Σ_k A[m, k] · B[k, n]` on the sm90 mainloop, operands read as
/// stored: `dh`'s A is the staging buffer `[m][k]` (K-major) and B the `W` chunk `[k][n]`
/// (`BMN`); `dW`'s A is the staging buffer read as `[k][m]` (`AMN`) and B is `h` `[k][n]`
/// (`BMN`). `wgmma` reads MN-major tiles with its transpose bits; the layouts and bounds are in
/// `p.tmaps` (`p.a`, `p.b` unused).
///
/// # Safety
/// Launched with `(WGM + 1)·128` threads, grid
/// `(ceil(m/BM), ceil(ceil(n/BN) / max(1, p.tiles_per_block)))`, the ring's dynamic shared
/// memory with the mbarriers, and `p.tmaps`, whose maps have the layouts `AMN` and `BMN` name;
/// C buffers as for `bwd::gemm`.
#[inline(always)]
pub unsafe fn gemm_wg<
    const BM: usize,
    const BN: usize,
    const ST: usize,
    const WGM: usize,
    const NW: usize,
    const AMN: bool,
    const BMN: bool,
>(
    p: &GemmParams,
) {
    let tid = intrinsics::thread_idx();
    let (m0, n0_first, n_tiles) = block_tiles::<BM, BN>(p.raster_group, p.tiles_per_block, p.n.div_ceil(BN as u32));
    let kt = p.k.div_ceil(BK as u32);
    // SAFETY: first call, by every thread; the kernel contract provides the maps.
    unsafe { tma_split::<BM, BN, ST, WGM, AMN, BMN>(tid, p.tmaps, m0, n0_first, n_tiles, kt) };
    let w = warp_pos(tid);
    let mut acc: WgAcc<NW> = [[[[0.0; 4]; 8]; 2]; NW];
    let finish = #[inline(always)]
    |tile: u32, acc: &mut WgAcc<NW>| {
        let n0 = n0_first + tile * BN as u32;
        unroll!(NW, |nb| {
            unroll!(2, |h| {
                // SAFETY: C buffers per the kernel contract.
                unsafe { store_gemm::<1, 8>(p, &w, m0, n0 + (nb * 128 + h * 64) as u32, half(acc, nb, h)) };
            });
        });
    };
    // SAFETY: every thread calls with the same arguments; smem and operands per the contract.
    unsafe { tma_pipeline::<BM, BN, ST, WGM, NW, AMN, BMN>(tid, n_tiles, kt, &mut acc, finish) };
}
