//! Arithmetic and conversions: `ex2` / `lg2`, `fma`, the NaN-propagating max, and the bf16x2
//! packing conversion.

use core::arch::asm;

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
