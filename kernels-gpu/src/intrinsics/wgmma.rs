//! Warpgroup instructions (sm90): the `wgmma` fence, commit and wait, the `m64n128k16` and
//! `m64n256k16` bf16 `wgmma.mma_async` wrappers, and `setmaxnreg`.

use core::arch::asm;

/// `wgmma.fence.sync.aligned`: orders register accesses before the following `wgmma`s.
///
/// # Safety
/// Executed by all threads of the warpgroup together.
#[inline(always)]
pub unsafe fn wgmma_fence() {
    // SAFETY: the caller guarantees warpgroup convergence.
    unsafe { asm!("wgmma.fence.sync.aligned;", options(nostack)) };
}

/// `wgmma.commit_group.sync.aligned`: closes the group of `wgmma`s issued so far.
///
/// # Safety
/// Executed by all threads of the warpgroup together.
#[inline(always)]
pub unsafe fn wgmma_commit() {
    // SAFETY: the caller guarantees warpgroup convergence.
    unsafe { asm!("wgmma.commit_group.sync.aligned;", options(nostack)) };
}

/// `wgmma.wait_group.sync.aligned N`: waits until at most `N` groups are pending; their
/// accumulators may then be read and their shared-memory operands overwritten.
///
/// # Safety
/// Executed by all threads of the warpgroup together.
#[inline(always)]
pub unsafe fn wgmma_wait<const N: usize>() {
    // SAFETY: the caller guarantees warpgroup convergence.
    unsafe { asm!("wgmma.wait_group.sync.aligned {n};", n = const N, options(nostack)) };
}

/// `wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16`: `c (+)= A · B` for the warpgroup's
/// 64 × 128 tile, A and B K-major in shared memory (descriptors, see
/// `lmhead_core::wgmma`). `accumulate = false` ignores `c`'s old value. Thread `t` of the
/// warpgroup holds rows `16·(t/32) + (t%32)/4 (+8)` and columns `64h + 8j + 2·(t%4) (+1)` as
/// `c[h][j] = [r, r+1 column; r+8, r+8 +1 column]`, like `mma.sync`'s m16n8 fragments (two
/// halves of 64 columns, so that the epilogue's loops stay at 8 n8 tiles).
///
/// # Safety
/// Executed by all 128 threads of a warpgroup together, between `wgmma_fence` and
/// `wgmma_commit`; both descriptors must address loaded, 1024-byte-aligned 128B-swizzled tiles
/// (64 rows for A, 128 for B) that nothing writes until a `wgmma_wait` covers this group; `c`
/// must not be read before that wait. With `TRANS_B` (`imm-trans-b = 1`), B is MN-major instead:
/// its descriptor addresses 64-column slabs of 128-byte K rows (`lmhead_core::wgmma`); likewise
/// A with `TRANS_A` (`imm-trans-a = 1`, one 64-row slab).
#[inline(always)]
pub unsafe fn wgmma_m64n128k16_bf16<const TRANS_A: bool, const TRANS_B: bool>(
    c: &mut [[[f32; 4]; 8]; 2],
    a_desc: u64,
    b_desc: u64,
    accumulate: bool,
) {
    let scale_d: u32 = accumulate as u32;
    // SAFETY: the caller guarantees convergence, operand validity and the wait before reuse.
    unsafe {
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.b32 p, {sd}, 0;",
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {{{d0}, {d1}, {d2}, {d3}, {d4}, {d5}, {d6}, {d7}, {d8}, {d9}, {d10}, {d11}, {d12}, {d13}, {d14}, {d15}, {d16}, {d17}, {d18}, {d19}, {d20}, {d21}, {d22}, {d23}, {d24}, {d25}, {d26}, {d27}, {d28}, {d29}, {d30}, {d31}, {d32}, {d33}, {d34}, {d35}, {d36}, {d37}, {d38}, {d39}, {d40}, {d41}, {d42}, {d43}, {d44}, {d45}, {d46}, {d47}, {d48}, {d49}, {d50}, {d51}, {d52}, {d53}, {d54}, {d55}, {d56}, {d57}, {d58}, {d59}, {d60}, {d61}, {d62}, {d63}}}, {a}, {b}, p, 1, 1, {ta}, {tb};",
            "}}",
            d0 = inout(reg32) c[0][0][0],
            d1 = inout(reg32) c[0][0][1],
            d2 = inout(reg32) c[0][0][2],
            d3 = inout(reg32) c[0][0][3],
            d4 = inout(reg32) c[0][1][0],
            d5 = inout(reg32) c[0][1][1],
            d6 = inout(reg32) c[0][1][2],
            d7 = inout(reg32) c[0][1][3],
            d8 = inout(reg32) c[0][2][0],
            d9 = inout(reg32) c[0][2][1],
            d10 = inout(reg32) c[0][2][2],
            d11 = inout(reg32) c[0][2][3],
            d12 = inout(reg32) c[0][3][0],
            d13 = inout(reg32) c[0][3][1],
            d14 = inout(reg32) c[0][3][2],
            d15 = inout(reg32) c[0][3][3],
            d16 = inout(reg32) c[0][4][0],
            d17 = inout(reg32) c[0][4][1],
            d18 = inout(reg32) c[0][4][2],
            d19 = inout(reg32) c[0][4][3],
            d20 = inout(reg32) c[0][5][0],
            d21 = inout(reg32) c[0][5][1],
            d22 = inout(reg32) c[0][5][2],
            d23 = inout(reg32) c[0][5][3],
            d24 = inout(reg32) c[0][6][0],
            d25 = inout(reg32) c[0][6][1],
            d26 = inout(reg32) c[0][6][2],
            d27 = inout(reg32) c[0][6][3],
            d28 = inout(reg32) c[0][7][0],
            d29 = inout(reg32) c[0][7][1],
            d30 = inout(reg32) c[0][7][2],
            d31 = inout(reg32) c[0][7][3],
            d32 = inout(reg32) c[1][0][0],
            d33 = inout(reg32) c[1][0][1],
            d34 = inout(reg32) c[1][0][2],
            d35 = inout(reg32) c[1][0][3],
            d36 = inout(reg32) c[1][1][0],
            d37 = inout(reg32) c[1][1][1],
            d38 = inout(reg32) c[1][1][2],
            d39 = inout(reg32) c[1][1][3],
            d40 = inout(reg32) c[1][2][0],
            d41 = inout(reg32) c[1][2][1],
            d42 = inout(reg32) c[1][2][2],
            d43 = inout(reg32) c[1][2][3],
            d44 = inout(reg32) c[1][3][0],
            d45 = inout(reg32) c[1][3][1],
            d46 = inout(reg32) c[1][3][2],
            d47 = inout(reg32) c[1][3][3],
            d48 = inout(reg32) c[1][4][0],
            d49 = inout(reg32) c[1][4][1],
            d50 = inout(reg32) c[1][4][2],
            d51 = inout(reg32) c[1][4][3],
            d52 = inout(reg32) c[1][5][0],
            d53 = inout(reg32) c[1][5][1],
            d54 = inout(reg32) c[1][5][2],
            d55 = inout(reg32) c[1][5][3],
            d56 = inout(reg32) c[1][6][0],
            d57 = inout(reg32) c[1][6][1],
            d58 = inout(reg32) c[1][6][2],
            d59 = inout(reg32) c[1][6][3],
            d60 = inout(reg32) c[1][7][0],
            d61 = inout(reg32) c[1][7][1],
            d62 = inout(reg32) c[1][7][2],
            d63 = inout(reg32) c[1][7][3],
            a = in(reg64) a_desc,
            b = in(reg64) b_desc,
            sd = in(reg32) scale_d,
            ta = const TRANS_A as u32,
            tb = const TRANS_B as u32,
            options(nostack)
        )
    };
}

/// `setmaxnreg.dec.sync.aligned.u32 N`: this warpgroup gives registers back (producer side).
///
/// # Safety
/// Executed by all threads of the warpgroup together; `N` is a multiple of 8 in 24..=256 and
/// not above the current per-thread count; live values must fit in `N` registers (ptxas checks).
#[inline(always)]
pub unsafe fn setmaxnreg_dec<const N: u32>() {
    // SAFETY: the caller guarantees warpgroup convergence and the bound.
    unsafe { asm!("setmaxnreg.dec.sync.aligned.u32 {n};", n = const N, options(nostack)) };
}

/// `setmaxnreg.inc.sync.aligned.u32 N`: this warpgroup takes registers from the block's pool
/// (consumer side; blocks until another warpgroup released enough).
///
/// # Safety
/// Executed by all threads of the warpgroup together; `N` is a multiple of 8 in 24..=256, and
/// the block's warpgroups together never ask for more than the registers it was launched with.
#[inline(always)]
pub unsafe fn setmaxnreg_inc<const N: u32>() {
    // SAFETY: the caller guarantees warpgroup convergence and the budget.
    unsafe { asm!("setmaxnreg.inc.sync.aligned.u32 {n};", n = const N, options(nostack)) };
}

/// `wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16`: as [`wgmma_m64n128k16_bf16`] for a
/// 64 × 256 tile in one instruction (A is read from shared memory once for all 256 columns,
/// where two n128 instructions read it twice). `c[nb]` holds columns `128·nb ..`, in the n128
/// layout.
///
/// # Safety
/// As [`wgmma_m64n128k16_bf16`], with a 256-row B tile.
#[inline(always)]
pub unsafe fn wgmma_m64n256k16_bf16<const TRANS_A: bool, const TRANS_B: bool>(
    c: &mut [[[[f32; 4]; 8]; 2]; 2],
    a_desc: u64,
    b_desc: u64,
    accumulate: bool,
) {
    let scale_d: u32 = accumulate as u32;
    // SAFETY: the caller guarantees convergence, operand validity and the wait before reuse.
    unsafe {
        asm!(
            "{{",
            ".reg .pred p;",
            "setp.ne.b32 p, {sd}, 0;",
            "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {{{d0}, {d1}, {d2}, {d3}, {d4}, {d5}, {d6}, {d7}, {d8}, {d9}, {d10}, {d11}, {d12}, {d13}, {d14}, {d15}, {d16}, {d17}, {d18}, {d19}, {d20}, {d21}, {d22}, {d23}, {d24}, {d25}, {d26}, {d27}, {d28}, {d29}, {d30}, {d31}, {d32}, {d33}, {d34}, {d35}, {d36}, {d37}, {d38}, {d39}, {d40}, {d41}, {d42}, {d43}, {d44}, {d45}, {d46}, {d47}, {d48}, {d49}, {d50}, {d51}, {d52}, {d53}, {d54}, {d55}, {d56}, {d57}, {d58}, {d59}, {d60}, {d61}, {d62}, {d63}, {d64}, {d65}, {d66}, {d67}, {d68}, {d69}, {d70}, {d71}, {d72}, {d73}, {d74}, {d75}, {d76}, {d77}, {d78}, {d79}, {d80}, {d81}, {d82}, {d83}, {d84}, {d85}, {d86}, {d87}, {d88}, {d89}, {d90}, {d91}, {d92}, {d93}, {d94}, {d95}, {d96}, {d97}, {d98}, {d99}, {d100}, {d101}, {d102}, {d103}, {d104}, {d105}, {d106}, {d107}, {d108}, {d109}, {d110}, {d111}, {d112}, {d113}, {d114}, {d115}, {d116}, {d117}, {d118}, {d119}, {d120}, {d121}, {d122}, {d123}, {d124}, {d125}, {d126}, {d127}}}, {a}, {b}, p, 1, 1, {ta}, {tb};",
            "}}",
            d0 = inout(reg32) c[0][0][0][0],
            d1 = inout(reg32) c[0][0][0][1],
            d2 = inout(reg32) c[0][0][0][2],
            d3 = inout(reg32) c[0][0][0][3],
            d4 = inout(reg32) c[0][0][1][0],
            d5 = inout(reg32) c[0][0][1][1],
            d6 = inout(reg32) c[0][0][1][2],
            d7 = inout(reg32) c[0][0][1][3],
            d8 = inout(reg32) c[0][0][2][0],
            d9 = inout(reg32) c[0][0][2][1],
            d10 = inout(reg32) c[0][0][2][2],
            d11 = inout(reg32) c[0][0][2][3],
            d12 = inout(reg32) c[0][0][3][0],
            d13 = inout(reg32) c[0][0][3][1],
            d14 = inout(reg32) c[0][0][3][2],
            d15 = inout(reg32) c[0][0][3][3],
            d16 = inout(reg32) c[0][0][4][0],
            d17 = inout(reg32) c[0][0][4][1],
            d18 = inout(reg32) c[0][0][4][2],
            d19 = inout(reg32) c[0][0][4][3],
            d20 = inout(reg32) c[0][0][5][0],
            d21 = inout(reg32) c[0][0][5][1],
            d22 = inout(reg32) c[0][0][5][2],
            d23 = inout(reg32) c[0][0][5][3],
            d24 = inout(reg32) c[0][0][6][0],
            d25 = inout(reg32) c[0][0][6][1],
            d26 = inout(reg32) c[0][0][6][2],
            d27 = inout(reg32) c[0][0][6][3],
            d28 = inout(reg32) c[0][0][7][0],
            d29 = inout(reg32) c[0][0][7][1],
            d30 = inout(reg32) c[0][0][7][2],
            d31 = inout(reg32) c[0][0][7][3],
            d32 = inout(reg32) c[0][1][0][0],
            d33 = inout(reg32) c[0][1][0][1],
            d34 = inout(reg32) c[0][1][0][2],
            d35 = inout(reg32) c[0][1][0][3],
            d36 = inout(reg32) c[0][1][1][0],
            d37 = inout(reg32) c[0][1][1][1],
            d38 = inout(reg32) c[0][1][1][2],
            d39 = inout(reg32) c[0][1][1][3],
            d40 = inout(reg32) c[0][1][2][0],
            d41 = inout(reg32) c[0][1][2][1],
            d42 = inout(reg32) c[0][1][2][2],
            d43 = inout(reg32) c[0][1][2][3],
            d44 = inout(reg32) c[0][1][3][0],
            d45 = inout(reg32) c[0][1][3][1],
            d46 = inout(reg32) c[0][1][3][2],
            d47 = inout(reg32) c[0][1][3][3],
            d48 = inout(reg32) c[0][1][4][0],
            d49 = inout(reg32) c[0][1][4][1],
            d50 = inout(reg32) c[0][1][4][2],
            d51 = inout(reg32) c[0][1][4][3],
            d52 = inout(reg32) c[0][1][5][0],
            d53 = inout(reg32) c[0][1][5][1],
            d54 = inout(reg32) c[0][1][5][2],
            d55 = inout(reg32) c[0][1][5][3],
            d56 = inout(reg32) c[0][1][6][0],
            d57 = inout(reg32) c[0][1][6][1],
            d58 = inout(reg32) c[0][1][6][2],
            d59 = inout(reg32) c[0][1][6][3],
            d60 = inout(reg32) c[0][1][7][0],
            d61 = inout(reg32) c[0][1][7][1],
            d62 = inout(reg32) c[0][1][7][2],
            d63 = inout(reg32) c[0][1][7][3],
            d64 = inout(reg32) c[1][0][0][0],
            d65 = inout(reg32) c[1][0][0][1],
            d66 = inout(reg32) c[1][0][0][2],
            d67 = inout(reg32) c[1][0][0][3],
            d68 = inout(reg32) c[1][0][1][0],
            d69 = inout(reg32) c[1][0][1][1],
            d70 = inout(reg32) c[1][0][1][2],
            d71 = inout(reg32) c[1][0][1][3],
            d72 = inout(reg32) c[1][0][2][0],
            d73 = inout(reg32) c[1][0][2][1],
            d74 = inout(reg32) c[1][0][2][2],
            d75 = inout(reg32) c[1][0][2][3],
            d76 = inout(reg32) c[1][0][3][0],
            d77 = inout(reg32) c[1][0][3][1],
            d78 = inout(reg32) c[1][0][3][2],
            d79 = inout(reg32) c[1][0][3][3],
            d80 = inout(reg32) c[1][0][4][0],
            d81 = inout(reg32) c[1][0][4][1],
            d82 = inout(reg32) c[1][0][4][2],
            d83 = inout(reg32) c[1][0][4][3],
            d84 = inout(reg32) c[1][0][5][0],
            d85 = inout(reg32) c[1][0][5][1],
            d86 = inout(reg32) c[1][0][5][2],
            d87 = inout(reg32) c[1][0][5][3],
            d88 = inout(reg32) c[1][0][6][0],
            d89 = inout(reg32) c[1][0][6][1],
            d90 = inout(reg32) c[1][0][6][2],
            d91 = inout(reg32) c[1][0][6][3],
            d92 = inout(reg32) c[1][0][7][0],
            d93 = inout(reg32) c[1][0][7][1],
            d94 = inout(reg32) c[1][0][7][2],
            d95 = inout(reg32) c[1][0][7][3],
            d96 = inout(reg32) c[1][1][0][0],
            d97 = inout(reg32) c[1][1][0][1],
            d98 = inout(reg32) c[1][1][0][2],
            d99 = inout(reg32) c[1][1][0][3],
            d100 = inout(reg32) c[1][1][1][0],
            d101 = inout(reg32) c[1][1][1][1],
            d102 = inout(reg32) c[1][1][1][2],
            d103 = inout(reg32) c[1][1][1][3],
            d104 = inout(reg32) c[1][1][2][0],
            d105 = inout(reg32) c[1][1][2][1],
            d106 = inout(reg32) c[1][1][2][2],
            d107 = inout(reg32) c[1][1][2][3],
            d108 = inout(reg32) c[1][1][3][0],
            d109 = inout(reg32) c[1][1][3][1],
            d110 = inout(reg32) c[1][1][3][2],
            d111 = inout(reg32) c[1][1][3][3],
            d112 = inout(reg32) c[1][1][4][0],
            d113 = inout(reg32) c[1][1][4][1],
            d114 = inout(reg32) c[1][1][4][2],
            d115 = inout(reg32) c[1][1][4][3],
            d116 = inout(reg32) c[1][1][5][0],
            d117 = inout(reg32) c[1][1][5][1],
            d118 = inout(reg32) c[1][1][5][2],
            d119 = inout(reg32) c[1][1][5][3],
            d120 = inout(reg32) c[1][1][6][0],
            d121 = inout(reg32) c[1][1][6][1],
            d122 = inout(reg32) c[1][1][6][2],
            d123 = inout(reg32) c[1][1][6][3],
            d124 = inout(reg32) c[1][1][7][0],
            d125 = inout(reg32) c[1][1][7][1],
            d126 = inout(reg32) c[1][1][7][2],
            d127 = inout(reg32) c[1][1][7][3],
            a = in(reg64) a_desc,
            b = in(reg64) b_desc,
            sd = in(reg32) scale_d,
            ta = const TRANS_A as u32,
            tb = const TRANS_B as u32,
            options(nostack)
        )
    };
}
