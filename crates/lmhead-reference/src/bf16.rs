//! bf16 bit patterns: rounding (round to nearest even, like the GPU's `cvt.rn.bf16`) and widening.

/// Round an f32 to bf16 (nearest even; NaN stays NaN).
pub fn from_f32(x: f32) -> u16 {
    half::bf16::from_f32(x).to_bits()
}

/// Widen a bf16 to f32 (exact).
#[inline(always)]
pub fn to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// Widen a bf16 to f64 (exact).
#[inline(always)]
pub fn to_f64(b: u16) -> f64 {
    to_f32(b) as f64
}

/// Round a slice of f32 to bf16.
pub fn quantize(xs: &[f32]) -> Vec<u16> {
    xs.iter().map(|&x| from_f32(x)).collect()
}

/// `Σ_k a_k · b_k` over bf16 rows: exact f32 products, f64 sums (8 lanes for vectorisation).
#[inline]
pub fn dot(a: &[u16], b: &[u16]) -> f64 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f64; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += (to_f32(x[i]) * to_f32(y[i])) as f64;
        }
    }
    let mut s: f64 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += (to_f32(*x) * to_f32(*y)) as f64;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_is_nearest_even() {
        assert_eq!(to_f32(from_f32(1.0)), 1.0);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(to_f32(from_f32(1.0 + 1.0 / 256.0)), 1.0);
        assert_eq!(to_f32(from_f32(1.0 + 3.0 / 256.0)), 1.0 + 4.0 / 256.0);
        assert!(to_f32(from_f32(f32::NAN)).is_nan());
    }

    #[test]
    fn dot_matches_f64() {
        let a: Vec<u16> = (0..37).map(|i| from_f32((i as f32 * 0.37).sin())).collect();
        let b: Vec<u16> = (0..37).map(|i| from_f32((i as f32 * 0.11).cos())).collect();
        let want: f64 = a.iter().zip(&b).map(|(&x, &y)| to_f64(x) * to_f64(y)).sum();
        assert!((dot(&a, &b) - want).abs() < 1e-12);
    }
}
