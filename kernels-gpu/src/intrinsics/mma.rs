//! Warp-level matrix instructions: `ldmatrix`, `mma.sync` m16n8k16 and `stmatrix`.

use super::SmemAddr;
use core::arch::asm;

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
