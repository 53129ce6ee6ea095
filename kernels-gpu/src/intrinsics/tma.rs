//! The tensor memory accelerator (sm90): mbarriers, `cp.async.bulk.tensor` loads and stores,
//! `prefetch.tensormap`, bulk reductions, and bulk groups.

use super::SmemAddr;
use core::arch::asm;

/// `mbarrier.init.shared::cta.b64`: an mbarrier at `addr` that completes a phase after `count`
/// arrivals (and all expected transaction bytes).
///
/// # Safety
/// `addr` must be an 8-byte aligned shared address that no other thread uses until a
/// [`fence_mbarrier_init`] and a block barrier follow.
#[inline(always)]
pub unsafe fn mbar_init(addr: SmemAddr, count: u32) {
    // SAFETY: the caller guarantees the address and exclusive use.
    unsafe { asm!("mbarrier.init.shared::cta.b64 [{a}], {n};", a = in(reg32) addr, n = in(reg32) count, options(nostack)) };
}

/// `fence.mbarrier_init.release.cluster`: makes this thread's `mbarrier.init`s visible to the
/// async proxy (the tensor-memory accelerator completes transactions on them).
#[inline(always)]
pub fn fence_mbarrier_init() {
    // SAFETY: a fence has no preconditions.
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack)) };
}

/// `mbarrier.arrive.expect_tx.shared::cta.b64`: arrive once and add `bytes` to the transaction
/// count that the current phase waits for.
///
/// # Safety
/// `addr` must be an initialised mbarrier; the arrivals of the phase must not exceed its count.
#[inline(always)]
pub unsafe fn mbar_arrive_expect_tx(addr: SmemAddr, bytes: u32) {
    // SAFETY: the caller guarantees an initialised barrier.
    unsafe { asm!("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{a}], {b};", a = in(reg32) addr, b = in(reg32) bytes, options(nostack)) };
}

/// `mbarrier.arrive.shared::cta.b64`: arrive once.
///
/// # Safety
/// `addr` must be an initialised mbarrier; the arrivals of the phase must not exceed its count.
#[inline(always)]
pub unsafe fn mbar_arrive(addr: SmemAddr) {
    // SAFETY: the caller guarantees an initialised barrier.
    unsafe { asm!("mbarrier.arrive.shared::cta.b64 _, [{a}];", a = in(reg32) addr, options(nostack)) };
}

/// Wait until the phase of parity `parity` of the mbarrier at `addr` has completed
/// (`mbarrier.try_wait.parity` in a loop). A fresh barrier is in phase 0, so waiting on parity 1
/// returns at once. Completion also makes the memory operations the phase tracked (the TMA
/// writes of a full barrier) visible to this thread.
///
/// # Safety
/// `addr` must be an initialised mbarrier.
#[inline(always)]
pub unsafe fn mbar_wait(addr: SmemAddr, parity: u32) {
    loop {
        let done: u32;
        // SAFETY: the caller guarantees an initialised barrier.
        unsafe {
            asm!(
                "{{",
                ".reg .pred p;",
                "mbarrier.try_wait.parity.shared::cta.b64 p, [{a}], {ph};",
                "selp.u32 {d}, 1, 0, p;",
                "}}",
                a = in(reg32) addr, ph = in(reg32) parity, d = out(reg32) done,
                options(nostack)
            )
        };
        if done != 0 {
            return;
        }
    }
}

/// `prefetch.tensormap`: brings a tensor map (in global memory) into the descriptor cache.
///
/// # Safety
/// `tmap` must be the generic address of a 64-byte aligned tensor map in global memory.
#[inline(always)]
pub unsafe fn prefetch_tensormap(tmap: *const u8) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("prefetch.tensormap [{t}];", t = in(reg64) tmap, options(nostack, readonly)) };
}

/// An L2 cache policy (`createpolicy.fractional`, the whole access): evict-last, for the
/// operand rows a block reads again at every tile of its walk ([`tma_load_2d_hint`]).
#[inline(always)]
pub fn l2_evict_last() -> u64 {
    let pol: u64;
    // SAFETY: creates a policy value in a register; no memory access.
    unsafe { asm!("createpolicy.fractional.L2::evict_last.b64 {p}, 1.0;", p = out(reg64) pol, options(nostack, nomem, pure)) };
    pol
}

/// [`tma_load_2d`] with the L2 cache policy `pol` ([`l2_evict_last`]) on the loaded lines.
///
/// # Safety
/// As [`tma_load_2d`]; `pol` a policy made by `createpolicy`.
#[inline(always)]
pub unsafe fn tma_load_2d_hint(dst: SmemAddr, tmap: *const u8, c0: i32, c1: i32, mbar: SmemAddr, pol: u64) {
    // SAFETY: the caller guarantees the map, the destination and the barrier.
    unsafe {
        asm!(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [{d}], [{t}, {{{c0}, {c1}}}], [{b}], {p};",
            d = in(reg32) dst, t = in(reg64) tmap, c0 = in(reg32) c0, c1 = in(reg32) c1, b = in(reg32) mbar, p = in(reg64) pol,
            options(nostack)
        )
    };
}

/// `cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes`: the tensor
/// memory accelerator copies the box at coordinates `(c0, c1)` (innermost first) of the tensor
/// described by `tmap` into shared memory at `dst`, zero-filling out-of-bounds elements, and
/// completes the box's byte count on the mbarrier at `mbar`.
///
/// # Safety
/// `tmap` must be the generic address of a valid tensor map in global memory whose tensor is
/// readable; `dst` must be a shared address aligned as the map's swizzle needs (1024 bytes for
/// the 128-byte swizzle) with the box's bytes free for writing until `mbar` completes; `mbar`
/// must be an initialised mbarrier whose current phase expects these bytes.
#[inline(always)]
pub unsafe fn tma_load_2d(dst: SmemAddr, tmap: *const u8, c0: i32, c1: i32, mbar: SmemAddr) {
    // SAFETY: the caller guarantees the map, the destination and the barrier.
    unsafe {
        asm!(
            "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [{d}], [{t}, {{{c0}, {c1}}}], [{b}];",
            d = in(reg32) dst, t = in(reg64) tmap, c0 = in(reg32) c0, c1 = in(reg32) c1, b = in(reg32) mbar,
            options(nostack)
        )
    };
}

/// `cp.async.bulk.tensor.2d.global.shared::cta.bulk_group`, issued only by the threads whose
/// `issue` is set (a predicate inside the instruction, not a branch: LLVM may duplicate the
/// code after a branch into both arms, which would split a warp across two copies of the next
/// `.aligned` instruction): the tensor memory accelerator copies the box at `src` in shared
/// memory (laid out as the map's swizzle says) to coordinates `(c0, c1)` (innermost first) of
/// the tensor described by `tmap`, skipping out-of-bounds elements. The copy joins the issuing
/// thread's current bulk group ([`bulk_commit`]); the box may be rewritten only after
/// [`bulk_wait_read`] covers that group.
///
/// # Safety
/// For an issuing thread: `tmap` must be the generic address of a valid tensor map in global
/// memory whose tensor's in-bounds part is writable and written by nothing else while the copy
/// runs; `src` must be a shared address aligned as the map's swizzle needs (1024 bytes for the
/// 128-byte swizzle) with the box's bytes, written before a `fence.proxy.async.shared::cta` by
/// each writing thread (ordered before this call by a barrier), and not rewritten until the
/// group's reads complete; the block must not exit before [`bulk_wait`] covers the group.
///
/// `EVICT_FIRST`: the copy's lines carry an L2 evict-first policy (`createpolicy.fractional`,
/// `.L2::cache_hint`), for an output nothing reads again soon, so that it does not push the
/// operands other blocks are about to load out of L2.
#[inline(always)]
pub unsafe fn tma_store_2d<const EVICT_FIRST: bool>(tmap: *const u8, src: SmemAddr, c0: i32, c1: i32, issue: bool) {
    if EVICT_FIRST {
        // SAFETY: as below; the policy only changes how long the lines stay in L2.
        unsafe {
            asm!(
                "{{",
                ".reg .pred p;",
                ".reg .b64 pol;",
                "setp.ne.u32 p, {i}, 0;",
                "createpolicy.fractional.L2::evict_first.b64 pol, 1.0;",
                "@p cp.async.bulk.tensor.2d.global.shared::cta.bulk_group.L2::cache_hint [{t}, {{{c0}, {c1}}}], [{s}], pol;",
                "}}",
                t = in(reg64) tmap, c0 = in(reg32) c0, c1 = in(reg32) c1, s = in(reg32) src, i = in(reg32) issue as u32,
                options(nostack)
            )
        };
        return;
    }
    // SAFETY: the caller guarantees the map, the source box and its lifetime.
    unsafe {
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.u32 p, {i}, 0;",
            "@p cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [{t}, {{{c0}, {c1}}}], [{s}];",
            "}}",
            t = in(reg64) tmap, c0 = in(reg32) c0, c1 = in(reg32) c1, s = in(reg32) src, i = in(reg32) issue as u32,
            options(nostack)
        )
    };
}

/// `cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group`, issued only by the
/// threads whose `issue` is set (a predicate, as in [`tma_store_2d`]): the tensor memory
/// accelerator adds the box at `src` in shared memory (laid out as the map's swizzle says)
/// element-wise into coordinates `(c0, c1)` (innermost first) of the tensor described by `tmap`
/// (in its element type), skipping out-of-bounds elements. Each element's add is atomic; the
/// copy joins the issuing thread's current bulk group ([`bulk_commit`]), and the box may be
/// rewritten only after [`bulk_wait_read`] covers that group.
///
/// # Safety
/// As [`tma_store_2d`], except that other writers may add to the same elements concurrently.
#[inline(always)]
pub unsafe fn tma_reduce_add_2d(tmap: *const u8, src: SmemAddr, c0: i32, c1: i32, issue: bool) {
    // SAFETY: the caller guarantees the map, the source box and its lifetime.
    unsafe {
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.u32 p, {i}, 0;",
            "@p cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [{t}, {{{c0}, {c1}}}], [{s}];",
            "}}",
            t = in(reg64) tmap, c0 = in(reg32) c0, c1 = in(reg32) c1, s = in(reg32) src, i = in(reg32) issue as u32,
            options(nostack)
        )
    };
}

/// `cp.async.bulk.commit_group`: closes the bulk group of this thread's bulk copies so far (an
/// empty group for a thread that issued none; waiting on it returns at once).
#[inline(always)]
pub fn bulk_commit() {
    // SAFETY: committing (possibly empty) groups has no preconditions.
    unsafe { asm!("cp.async.bulk.commit_group;", options(nostack)) };
}

/// `cp.async.bulk.wait_group.read N`: waits until at most `N` of this thread's bulk groups
/// still read their shared-memory sources (their global writes may still be in flight).
#[inline(always)]
pub fn bulk_wait_read<const N: u32>() {
    // SAFETY: waiting has no preconditions.
    unsafe { asm!("cp.async.bulk.wait_group.read {n};", n = const N, options(nostack)) };
}

/// `cp.async.bulk.wait_group N`: waits until at most `N` of this thread's bulk groups are
/// pending, their global writes complete.
#[inline(always)]
pub fn bulk_wait<const N: u32>() {
    // SAFETY: waiting has no preconditions.
    unsafe { asm!("cp.async.bulk.wait_group {n};", n = const N, options(nostack)) };
}
