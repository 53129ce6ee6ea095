//! Every PTX instruction the kernels use, each behind a small `unsafe fn` (or a safe one where no
//! precondition exists). This is the only file with `asm!`; each wrapper's `# Safety` lists the
//! exact conditions under which the instruction is undefined behaviour.
//!
//! Shared-memory addresses are 32-bit offsets in the shared window (`SmemAddr`), as `ld.shared`,
//! `cp.async`, `ldmatrix` take them.

use core::arch::asm;

/// An address in the shared-memory window of the block (bytes).
pub type SmemAddr = u32;

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

/// `cp.async.cg.shared.global` of 16 bytes, zero-filling when `valid` is false.
///
/// # Safety
/// `dst` must be a 16-byte aligned address inside the block's shared memory. When `valid`,
/// `src` must point to 16 readable, 16-byte aligned bytes of global memory; when not, nothing is
/// read from `src` (source size 0), but it must still be a global address.
#[inline(always)]
pub unsafe fn cp_async_16(dst: SmemAddr, src: *const u8, valid: bool) {
    let size: u32 = if valid { 16 } else { 0 };
    // SAFETY: the caller guarantees both addresses; `size` ≤ 16.
    unsafe {
        asm!(
            "cp.async.cg.shared.global [{d}], [{s}], 16, {n};",
            d = in(reg32) dst,
            s = in(reg64) src,
            n = in(reg32) size,
            options(nostack)
        )
    };
}

/// `cp.async.commit_group`: closes the group of `cp.async` issued by this thread so far.
#[inline(always)]
pub fn cp_async_commit() {
    // SAFETY: committing a (possibly empty) group has no preconditions.
    unsafe { asm!("cp.async.commit_group;", options(nostack)) };
}

/// `cp.async.wait_group N`: waits until at most `N` of this thread's groups are pending.
#[inline(always)]
pub fn cp_async_wait<const N: usize>() {
    // SAFETY: waiting has no preconditions.
    unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack)) };
}

/// `ldmatrix.sync.aligned.m8n8.x4.shared.b16`: four 8×8 b16 matrices, one row address per lane.
///
/// # Safety
/// Must be executed by all 32 lanes of the warp together; each lane's `addr` must be a 16-byte
/// aligned shared address with 16 readable bytes.
#[inline(always)]
pub unsafe fn ldmatrix_x4(addr: SmemAddr) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees warp convergence and the address.
    unsafe {
        asm!(
            "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg32) addr,
            options(nostack, readonly)
        )
    };
    [a, b, c, d]
}

/// `ldmatrix ... .x4.trans`: as [`ldmatrix_x4`], each 8×8 matrix transposed.
///
/// # Safety
/// As [`ldmatrix_x4`].
#[inline(always)]
pub unsafe fn ldmatrix_x4_trans(addr: SmemAddr) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees warp convergence and the address.
    unsafe {
        asm!(
            "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            p = in(reg32) addr,
            options(nostack, readonly)
        )
    };
    [a, b, c, d]
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`: `c += a · b` on one warp.
///
/// # Safety
/// Must be executed by all 32 lanes of the warp together (`.aligned`).
#[inline(always)]
pub unsafe fn mma_bf16_16816(c: &mut [f32; 4], a: &[u32; 4], b: &[u32; 2]) {
    // SAFETY: the caller guarantees warp convergence; operands are plain registers.
    unsafe {
        asm!(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{d0}, {d1}, {d2}, {d3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{d0}, {d1}, {d2}, {d3}}};",
            d0 = inout(reg32) c[0], d1 = inout(reg32) c[1], d2 = inout(reg32) c[2], d3 = inout(reg32) c[3],
            a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
            b0 = in(reg32) b[0], b1 = in(reg32) b[1],
            options(pure, nomem, nostack)
        )
    };
}

/// `2^x` (`ex2.approx.ftz.f32`: about 2 ulp, subnormal results flushed to 0; `2^−∞ = 0`).
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    let r: f32;
    // SAFETY: a pure arithmetic instruction.
    unsafe { asm!("ex2.approx.ftz.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x, options(pure, nomem, nostack)) };
    r
}

/// `a · b + c` with one rounding (`fma.rn.f32`).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    let r: f32;
    // SAFETY: a pure arithmetic instruction.
    unsafe {
        asm!("fma.rn.f32 {r}, {a}, {b}, {c};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b, c = in(reg32) c, options(pure, nomem, nostack))
    };
    r
}

/// `max(a, b)` that returns NaN when either is NaN (`max.NaN.f32`), unlike `f32::max`.
#[inline(always)]
pub fn max_nan(a: f32, b: f32) -> f32 {
    let r: f32;
    // SAFETY: a pure arithmetic instruction (sm_80+, PTX 7.0+).
    unsafe { asm!("max.NaN.f32 {r}, {a}, {b};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b, options(pure, nomem, nostack)) };
    r
}

/// `log2 x` (`lg2.approx.ftz.f32`).
#[inline(always)]
pub fn log2(x: f32) -> f32 {
    let r: f32;
    // SAFETY: a pure arithmetic instruction.
    unsafe { asm!("lg2.approx.ftz.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x, options(pure, nomem, nostack)) };
    r
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

/// `st.shared.v4.f32`.
///
/// # Safety
/// `addr` must be a 16-byte aligned shared address with 16 writable bytes.
#[inline(always)]
pub unsafe fn st_shared_v4(addr: SmemAddr, v: [f32; 4]) {
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "st.shared.v4.f32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg32) addr, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack)
        )
    };
}

/// `ld.shared.v4.f32`.
///
/// # Safety
/// `addr` must be a 16-byte aligned shared address with 16 readable bytes.
#[inline(always)]
pub unsafe fn ld_shared_v4(addr: SmemAddr) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "ld.shared.v4.f32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            p = in(reg32) addr, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            options(nostack, readonly)
        )
    };
    [a, b, c, d]
}

/// `st.shared.u16`.
///
/// # Safety
/// `addr` must be a 2-byte aligned shared address with 2 writable bytes.
#[inline(always)]
pub unsafe fn st_shared_u16(addr: SmemAddr, v: u16) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("st.shared.u16 [{p}], {v};", p = in(reg32) addr, v = in(reg16) v, options(nostack)) };
}

/// `ld.shared.u16`.
///
/// # Safety
/// `addr` must be a 2-byte aligned shared address with 2 readable bytes.
#[inline(always)]
pub unsafe fn ld_shared_u16(addr: SmemAddr) -> u16 {
    let v: u16;
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("ld.shared.u16 {v}, [{p}];", p = in(reg32) addr, v = out(reg16) v, options(nostack, readonly)) };
    v
}

/// `st.global.v4.f32`.
///
/// # Safety
/// `p` must be a 16-byte aligned global address with 16 writable bytes.
#[inline(always)]
pub unsafe fn st_global_v4(p: *mut f32, v: [f32; 4]) {
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "st.global.v4.f32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack)
        )
    };
}

/// `ld.global.v4.f32`.
///
/// # Safety
/// `p` must be a 16-byte aligned global address with 16 readable bytes.
#[inline(always)]
pub unsafe fn ld_global_v4(p: *const f32) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "ld.global.v4.f32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            p = in(reg64) p, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            options(nostack, readonly)
        )
    };
    [a, b, c, d]
}

/// `ld.global.v4.b32`: 16 bytes as four raw 32-bit words (bit patterns kept as they are).
///
/// # Safety
/// `p` must be a 16-byte aligned global address with 16 readable bytes.
#[inline(always)]
pub unsafe fn ld_global_v4_b32(p: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "ld.global.v4.b32 {{{a}, {b}, {c}, {d}}}, [{p}];",
            p = in(reg64) p, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            options(nostack, readonly)
        )
    };
    [a, b, c, d]
}

/// `st.global.v4.b32`: four raw 32-bit words.
///
/// # Safety
/// `p` must be a 16-byte aligned global address with 16 writable bytes.
#[inline(always)]
pub unsafe fn st_global_v4_b32(p: *mut u32, v: [u32; 4]) {
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "st.global.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg64) p, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack)
        )
    };
}

/// `st.shared.v4.b32`: four raw 32-bit words.
///
/// # Safety
/// `addr` must be a 16-byte aligned shared address with 16 writable bytes.
#[inline(always)]
pub unsafe fn st_shared_v4_b32(addr: SmemAddr, v: [u32; 4]) {
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!(
            "st.shared.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};",
            p = in(reg32) addr, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3],
            options(nostack)
        )
    };
}

/// `st.global.v2.f32`.
///
/// # Safety
/// `p` must be an 8-byte aligned global address with 8 writable bytes.
#[inline(always)]
pub unsafe fn st_global_v2(p: *mut f32, a: f32, b: f32) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("st.global.v2.f32 [{p}], {{{a}, {b}}};", p = in(reg64) p, a = in(reg32) a, b = in(reg32) b, options(nostack)) };
}

/// `ld.global.v2.f32`.
///
/// # Safety
/// `p` must be an 8-byte aligned global address with 8 readable bytes.
#[inline(always)]
pub unsafe fn ld_global_v2(p: *const f32) -> (f32, f32) {
    let (a, b): (f32, f32);
    // SAFETY: the caller guarantees the address.
    unsafe {
        asm!("ld.global.v2.f32 {{{a}, {b}}}, [{p}];", p = in(reg64) p, a = out(reg32) a, b = out(reg32) b, options(nostack, readonly))
    };
    (a, b)
}

/// Two f32 rounded to bf16 (round to nearest even) and packed: `lo` in bits 0..16, `hi` in 16..32.
#[inline(always)]
pub fn pack_bf16x2(lo: f32, hi: f32) -> u32 {
    let r: u32;
    // SAFETY: a pure conversion instruction.
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {r}, {h}, {l};", r = out(reg32) r, h = in(reg32) hi, l = in(reg32) lo, options(pure, nomem, nostack))
    };
    r
}

/// `atom.global.or.b32`.
///
/// # Safety
/// `p` must be a 4-byte aligned global address.
#[inline(always)]
pub unsafe fn atomic_or(p: *mut u32, v: u32) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("red.global.or.b32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack)) };
}

/// `red.global.min.u32`: atomically lowers the `u32` at `p` to `v` if `v` is smaller.
///
/// # Safety
/// `p` is a valid, 4-byte aligned global address.
#[inline(always)]
pub unsafe fn atomic_min(p: *mut u32, v: u32) {
    // SAFETY: the caller guarantees the address.
    unsafe { asm!("red.global.min.u32 [{p}], {v};", p = in(reg64) p, v = in(reg32) v, options(nostack)) };
}

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

/// `fence.proxy.async.shared::cta`: makes this thread's generic-proxy shared-memory writes
/// (including landed `cp.async` copies) visible to the async proxy (`wgmma` operand reads).
#[inline(always)]
pub fn fence_proxy_async_shared() {
    // SAFETY: a fence has no preconditions.
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) };
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
#[inline(always)]
pub unsafe fn tma_store_2d(tmap: *const u8, src: SmemAddr, c0: i32, c1: i32, issue: bool) {
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

/// `stmatrix.sync.aligned.m8n8.x4.shared.b16`: the warp stores four 8 × 8 b16 matrices. Lane
/// `l` holds row `l/4`, columns `2·(l%4)`, `+1` of matrix `i` packed in `v[i]` (the `mma`
/// accumulator fragment layout, as `ldmatrix` returns it); lanes `8i .. 8i + 7` give the
/// addresses of rows 0–7 of matrix `i`.
///
/// # Safety
/// Must be executed by all 32 lanes of the warp together; each lane's `addr` must be a 16-byte
/// aligned shared address with 16 writable bytes.
#[inline(always)]
pub unsafe fn stmatrix_x4(addr: SmemAddr, v: [u32; 4]) {
    // SAFETY: the caller guarantees convergence and the addresses.
    unsafe {
        asm!(
            "stmatrix.sync.aligned.m8n8.x4.shared.b16 [{a}], {{{r0}, {r1}, {r2}, {r3}}};",
            a = in(reg32) addr, r0 = in(reg32) v[0], r1 = in(reg32) v[1], r2 = in(reg32) v[2], r3 = in(reg32) v[3],
            options(nostack)
        )
    };
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

/// `trap`: aborts the kernel (used by the panic handler; a panic in a kernel is a bug).
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` ends the kernel with an error the host sees at the next synchronisation.
    unsafe { asm!("trap;", options(noreturn, nostack)) }
}
