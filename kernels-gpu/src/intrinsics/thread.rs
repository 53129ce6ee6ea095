//! Threads, warps and the block: the shared-memory base, thread and block indices, block-wide
//! and named barriers, the warp shuffle and ballot, the async-proxy fence, `exit` and `trap`.

use super::SmemAddr;
use core::arch::asm;

core::arch::global_asm!(".extern .shared .align 1024 .b8 lmhead_smem[];");

/// Base address of the block's dynamic shared memory.
#[inline(always)]
pub fn smem_base() -> SmemAddr {
    let r: u32;
    // SAFETY: reading the address of a symbol has no preconditions.
    unsafe { asm!("mov.u32 {r}, lmhead_smem;", r = out(reg32) r, options(pure, nomem, nostack)) };
    r
}

#[inline(always)]
pub fn thread_idx() -> u32 {
    let r: u32;
    // SAFETY: reading a special register has no preconditions.
    unsafe { asm!("mov.u32 {r}, %tid.x;", r = out(reg32) r, options(pure, nomem, nostack)) };
    r
}

#[inline(always)]
pub fn block_idx_x() -> u32 {
    let r: u32;
    // SAFETY: reading a special register has no preconditions.
    unsafe { asm!("mov.u32 {r}, %ctaid.x;", r = out(reg32) r, options(pure, nomem, nostack)) };
    r
}

#[inline(always)]
pub fn block_idx_y() -> u32 {
    let r: u32;
    // SAFETY: reading a special register has no preconditions.
    unsafe { asm!("mov.u32 {r}, %ctaid.y;", r = out(reg32) r, options(pure, nomem, nostack)) };
    r
}

#[inline(always)]
pub fn grid_dim_y() -> u32 {
    let r: u32;
    // SAFETY: reading a special register has no preconditions.
    unsafe { asm!("mov.u32 {r}, %nctaid.y;", r = out(reg32) r, options(pure, nomem, nostack)) };
    r
}

#[inline(always)]
pub fn grid_dim_x() -> u32 {
    let r: u32;
    // SAFETY: reading a special register has no preconditions.
    unsafe { asm!("mov.u32 {r}, %nctaid.x;", r = out(reg32) r, options(pure, nomem, nostack)) };
    r
}

/// `bar.sync 0`: block-wide barrier, also ordering shared-memory accesses.
///
/// # Safety
/// Every thread of the block must reach this call the same number of times (no call under a
/// condition that differs between threads), or the block deadlocks.
#[inline(always)]
pub unsafe fn sync_threads() {
    // SAFETY: the caller upholds uniform arrival.
    unsafe { asm!("bar.sync 0;", options(nostack)) };
}

/// Butterfly shuffle across the full warp (`shfl.sync.bfly.b32`, mask all lanes).
///
/// # Safety
/// All 32 lanes of the warp must execute it together.
#[inline(always)]
pub unsafe fn shfl_xor(x: f32, lane_mask: u32) -> f32 {
    let r: f32;
    // SAFETY: the caller guarantees the full warp is converged.
    unsafe {
        asm!(
            "shfl.sync.bfly.b32 {r}, {x}, {m}, 31, -1;",
            r = out(reg32) r, x = in(reg32) x, m = in(reg32) lane_mask,
            options(nostack, nomem)
        )
    };
    r
}

/// `fence.proxy.async.shared::cta`: makes this thread's generic-proxy shared-memory writes
/// (including landed `cp.async` copies) visible to the async proxy (`wgmma` operand reads).
#[inline(always)]
pub fn fence_proxy_async_shared() {
    // SAFETY: a fence has no preconditions.
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) };
}

/// `barrier.sync ID, COUNT`: a named barrier for `COUNT` threads (whole warps) of the block,
/// also ordering their shared-memory accesses. Lets the consumer warpgroups of a
/// warp-specialised kernel synchronise without the producer. The non-`.aligned` form: threads of
/// one warp may arrive from different branches (LLVM may duplicate a barrier that follows an
/// `if` into both arms; with `bar.sync`, which is `.aligned`, that is undefined and can hang).
///
/// # Safety
/// Exactly `COUNT` threads (a multiple of 32) must reach barrier `ID` the same number of times.
#[inline(always)]
pub unsafe fn named_barrier<const ID: u32>(count: u32) {
    // SAFETY: the caller upholds the arrival count.
    unsafe { asm!("barrier.sync {id}, {n};", id = const ID, n = in(reg32) count, options(nostack)) };
}

/// `barrier.sync 0`: block-wide barrier for code that follows divergent branches (the
/// non-`.aligned` form of [`sync_threads`]; see [`named_barrier`]).
///
/// # Safety
/// Every thread of the block must reach this call the same number of times.
#[inline(always)]
pub unsafe fn sync_threads_divergent() {
    // SAFETY: the caller upholds uniform arrival.
    unsafe { asm!("barrier.sync 0;", options(nostack)) };
}

/// `exit`: ends this thread. Named barriers keep working for the threads that remain (their
/// counts never include exited threads), and asynchronous copies it issued still complete on
/// their mbarriers.
#[inline(always)]
pub fn exit() -> ! {
    // SAFETY: ending a thread has no preconditions; nothing after this runs.
    unsafe { asm!("exit;", options(noreturn, nostack)) }
}

/// `barrier.sync id, COUNT` with a run-time barrier id (as [`named_barrier`]).
///
/// # Safety
/// `id` < 16; exactly `count` threads (a multiple of 32) must reach barrier `id` the same number
/// of times.
#[inline(always)]
pub unsafe fn named_barrier_id(id: u32, count: u32) {
    // SAFETY: the caller upholds the id and the arrival count.
    unsafe { asm!("barrier.sync {id}, {n};", id = in(reg32) id, n = in(reg32) count, options(nostack)) };
}

/// `trap`: aborts the kernel (used by the panic handler; a panic in a kernel is a bug).
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` ends the kernel with an error the host sees at the next synchronisation.
    unsafe { asm!("trap;", options(noreturn, nostack)) }
}

/// `vote.sync.ballot.b32` over the full warp: bit `i` of the result is lane `i`'s `pred`.
///
/// # Safety
/// All 32 lanes of the warp must execute it (member mask: every lane).
#[inline(always)]
pub unsafe fn ballot(pred: bool) -> u32 {
    let r: u32;
    // SAFETY: the caller guarantees that the whole warp executes it.
    unsafe {
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.u32 p, {x}, 0;",
            "vote.sync.ballot.b32 {r}, p, -1;",
            "}}",
            x = in(reg32) pred as u32, r = out(reg32) r,
            options(nostack, nomem)
        )
    };
    r
}
