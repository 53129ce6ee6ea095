//! Arithmetic and conversions: `ex2` / `lg2`, `fma`, the NaN-propagating max, the bf16x2 and
//! f16x2 packing conversions and the f16 unpacking one.

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

/// Two f32 rounded to fp16 (round to nearest even; below fp16's range, 0) and packed: `lo` in
/// bits 0..16, `hi` in 16..32.
#[inline(always)]
pub fn pack_f16x2(lo: f32, hi: f32) -> u32 {
    let r: u32;
    // SAFETY: a pure conversion instruction.
    unsafe { asm!("cvt.rn.f16x2.f32 {r}, {h}, {l};", r = out(reg32) r, h = in(reg32) hi, l = in(reg32) lo, options(pure, nomem, nostack)) };
    r
}

/// The two fp16 of a packed pair as f32 (exact): `(bits 0..16, bits 16..32)`.
#[inline(always)]
pub fn unpack_f16x2(x: u32) -> (f32, f32) {
    let (lo, hi): (f32, f32);
    // SAFETY: pure conversion instructions.
    unsafe {
        asm!(
            "{{ .reg .b16 l, h; mov.b32 {{l, h}}, {x}; cvt.f32.f16 {lo}, l; cvt.f32.f16 {hi}, h; }}",
            x = in(reg32) x, lo = out(reg32) lo, hi = out(reg32) hi, options(pure, nomem, nostack)
        )
    };
    (lo, hi)
}
