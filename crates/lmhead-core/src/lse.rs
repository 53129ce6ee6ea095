//! The online log-sum-exp and entropy state, in base-2 units, and its merge.
//!
//! For one row of logits `z_j` (already divided by the temperature) let `y_j = z_j · log2(e)`.
//! The state of a subset of columns is `(m, s, t)` with
//!
//! ```text
//! m = max_j y_j,    u_j = y_j − m  (≤ 0),    s = Σ_j 2^{u_j},    t = Σ_j 2^{u_j} · u_j .
//! ```
//!
//! From the state of the whole row:
//!
//! ```text
//! lse     = ln Σ_j e^{z_j}            = (m + log2 s) · ln 2
//! p_j     = e^{z_j − lse}             = 2^{u_j} / s
//! entropy = −Σ_j p_j ln p_j           = ln 2 · (log2 s − t / s)
//! Σ_j p_j z_j = lse − entropy         = (m + t / s) · ln 2
//! ```
//!
//! Keeping `t` relative to the running maximum (rather than `Σ p z`) avoids the catastrophic
//! cancellation of `lse − Σ p z` when logits are huge (|z| ~ 1e4) and the entropy is small.
//!
//! **Merge.** Two states `(m1, s1, t1)`, `(m2, s2, t2)` combine with `m = max(m1, m2)` and
//! `δ_i = m_i − m ≤ 0`: every `u_j` of part `i` becomes `u_j + δ_i`, so
//!
//! ```text
//! s = Σ_i 2^{δ_i} s_i,    t = Σ_i 2^{δ_i} (t_i + δ_i s_i).
//! ```
//!
//! **Empty parts and padding.** An empty part is `(−∞, 0, 0)`. A part with `m_i = −∞` gives
//! `δ_i = −∞` and `δ_i · s_i = −∞ · 0 = NaN`, so every `δ` is clamped to `≥ −f32::MAX` first: then
//! `2^δ = 0` and `δ · 0 = 0`, and an empty part contributes exactly nothing. Padding columns have
//! `y = −∞` and contribute `2^{−∞} = 0`; they never contribute `2^0 = 1`. The maximum starts at the
//! true row maximum, so rows whose logits are all near −1e4 stay finite.
//!
//! **NaN.** `max` ignores NaN (IEEE maxNum, the PTX `max.f32`), but a NaN logit still reaches
//! `s` through `2^{NaN − m} = NaN`, so NaN in a row gives NaN in its lse, log-prob and entropy.
//!
//! The same functions run on the device (f32, with `ex2.approx`) and in the CPU reference (f64),
//! which is why the exponential is passed in rather than called.

use core::ops::{Add, Mul, Sub};

/// The arithmetic the merge needs; implemented for `f32` and `f64` without `std`.
pub trait Real: Copy + PartialEq + PartialOrd + Add<Output = Self> + Sub<Output = Self> + Mul<Output = Self> {
    const ZERO: Self;
    const ONE: Self;
    const NEG_INF: Self;
    /// The most negative finite value; δ is clamped to it (see the module docs).
    const MIN_FINITE: Self;
    /// `max` that returns the non-NaN operand (maxNum), like PTX `max.f32`.
    fn max_num(self, other: Self) -> Self;
    fn div(self, other: Self) -> Self;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INF: Self = f32::NEG_INFINITY;
    const MIN_FINITE: Self = f32::MIN;
    #[inline(always)]
    fn max_num(self, other: Self) -> Self {
        self.max(other)
    }
    #[inline(always)]
    fn div(self, other: Self) -> Self {
        self / other
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    const NEG_INF: Self = f64::NEG_INFINITY;
    const MIN_FINITE: Self = f64::MIN;
    #[inline(always)]
    fn max_num(self, other: Self) -> Self {
        self.max(other)
    }
    #[inline(always)]
    fn div(self, other: Self) -> Self {
        self / other
    }
}

/// `ln 2`, for turning base-2 results into natural units.
pub const LN_2: f64 = core::f64::consts::LN_2;
/// `log2(e)`, for turning natural logits into base-2 ones.
pub const LOG2_E: f64 = core::f64::consts::LOG2_E;

/// Online softmax state `(m, s, t)` in base-2 units (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Lse2<F> {
    pub m: F,
    pub s: F,
    pub t: F,
}

impl<F: Real> Lse2<F> {
    /// The state of no columns at all.
    pub const EMPTY: Self = Self { m: F::NEG_INF, s: F::ZERO, t: F::ZERO };

    /// The state moved to a new reference maximum `m_new ≥ self.m` (δ clamped, see module docs).
    #[inline(always)]
    pub fn rescale(self, m_new: F, exp2: impl Fn(F) -> F) -> Self {
        let delta = (self.m - m_new).max_num(F::MIN_FINITE);
        let scale = exp2(delta);
        Self { m: m_new, s: scale * self.s, t: scale * (self.t + delta * self.s) }
    }

    /// Merge two states: the state of the union of their columns.
    #[inline(always)]
    pub fn merge(self, other: Self, exp2: impl Fn(F) -> F + Copy) -> Self {
        let m = self.m.max_num(other.m);
        if m == F::NEG_INF {
            // Both parts are empty (or all their columns are −∞): nothing to add, and subtracting
            // −∞ from −∞ below would make NaN.
            return Self { m, s: self.s + other.s, t: self.t + other.t };
        }
        let a = self.rescale(m, exp2);
        let b = other.rescale(m, exp2);
        Self { m, s: a.s + b.s, t: a.t + b.t }
    }

    /// Add one column with base-2 logit `y` (used by the reference and the tests; the kernels fold
    /// a whole tile at once with [`Lse2::absorb_max`] and [`Lse2::absorb_term`]).
    #[inline(always)]
    pub fn push(self, y: F, exp2: impl Fn(F) -> F + Copy) -> Self {
        if y == F::NEG_INF {
            // Padding: contributes 2^−∞ = 0.
            return self;
        }
        // For y = NaN, `m` stays −∞ and the NaN reaches `s` through `absorb_term`.
        let mut st = self.rescale(self.m.max_num(y), exp2);
        st.absorb_term(y, exp2);
        st
    }

    /// First half of folding a tile: move to the new maximum `max(m, tile_max)`. Skipping tiles
    /// whose maximum is exactly −∞ is the caller's job (they hold only padding).
    #[inline(always)]
    pub fn absorb_max(self, tile_max: F, exp2: impl Fn(F) -> F) -> Self {
        self.rescale(self.m.max_num(tile_max), exp2)
    }

    /// Second half: add one column `y` relative to the (already updated) maximum. `s` receives
    /// `2^{y−m}` unclamped so that NaN propagates; `t` clamps `u` so that padding (`u = −∞`,
    /// `2^u = 0`) adds `0 · (−f32::MAX) = 0` instead of NaN.
    #[inline(always)]
    pub fn absorb_term(&mut self, y: F, exp2: impl Fn(F) -> F) {
        let u = y - self.m;
        let e = exp2(u);
        self.s = self.s + e;
        self.t = self.t + e * u.max_num(F::MIN_FINITE);
    }

    /// `log2 Σ 2^{y}` of the row: `m + log2 s` (−∞ for an empty row, NaN if `s` is NaN).
    #[inline(always)]
    pub fn lse2(self, log2: impl Fn(F) -> F) -> F {
        if self.s == F::ZERO {
            return F::NEG_INF;
        }
        self.m + log2(self.s)
    }

    /// Entropy in bits: `log2 s − t / s` (0 for an empty row, NaN if `s` is NaN).
    #[inline(always)]
    pub fn entropy2(self, log2: impl Fn(F) -> F) -> F {
        if self.s == F::ZERO {
            return F::ZERO;
        }
        log2(self.s) - self.t.div(self.s)
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::vec::Vec;

    fn exp2(x: f64) -> f64 {
        x.exp2()
    }
    fn log2(x: f64) -> f64 {
        x.log2()
    }

    fn dense(z: &[f64]) -> (f64, f64) {
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = z.iter().map(|&x| (x - m).exp()).sum();
        let lse = m + s.ln();
        let ent = -z
            .iter()
            .map(|&x| {
                let p = (x - lse).exp();
                if p > 0.0 {
                    p * (x - lse)
                } else {
                    0.0
                }
            })
            .sum::<f64>();
        (lse, ent)
    }

    fn fold(z: &[f64]) -> Lse2<f64> {
        z.iter().fold(Lse2::EMPTY, |st, &x| st.push(x * LOG2_E, exp2))
    }

    fn rows() -> Vec<Vec<f64>> {
        let mut r = Vec::new();
        let mut x: u64 = 0x9E3779B97F4A7C15;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64 - 0.5
        };
        for n in [1usize, 2, 5, 17, 100] {
            r.push((0..n).map(|_| next() * 10.0).collect());
            r.push((0..n).map(|_| next() * 3.0 - 1.0e4).collect());
            r.push((0..n).map(|_| next() + 1.0e4).collect());
        }
        r
    }

    #[test]
    fn push_matches_dense() {
        for z in rows() {
            let st = fold(&z);
            let (lse, ent) = dense(&z);
            let got_lse = st.lse2(log2) * LN_2;
            let got_ent = st.entropy2(log2) * LN_2;
            assert!((got_lse - lse).abs() <= 1e-9 * lse.abs().max(1.0), "{got_lse} vs {lse}");
            assert!((got_ent - ent).abs() <= 1e-9, "{got_ent} vs {ent}");
        }
    }

    #[test]
    fn merge_of_pieces_matches_whole() {
        for z in rows() {
            let whole = fold(&z);
            for pieces in [1usize, 2, 3, 8] {
                let chunk = z.len().div_ceil(pieces).max(1);
                let mut st = Lse2::EMPTY;
                // Merge in reverse order too, so associativity is exercised.
                for part in z.chunks(chunk).rev() {
                    st = st.merge(fold(part), exp2);
                }
                // Empty pieces (vocab shards past the end) must be neutral.
                st = st.merge(Lse2::EMPTY, exp2);
                assert!((st.lse2(log2) - whole.lse2(log2)).abs() < 1e-9 * whole.m.abs().max(1.0));
                assert!((st.entropy2(log2) - whole.entropy2(log2)).abs() < 1e-9);
            }
        }
    }

    #[test]
    fn padding_contributes_nothing() {
        let z = [1.0, -2.0, 0.5];
        let mut st = fold(&z);
        let before = st;
        st = st.absorb_max(f64::NEG_INFINITY, exp2);
        st.absorb_term(f64::NEG_INFINITY, exp2);
        assert_eq!(st, before);
        let empty: Lse2<f64> = Lse2::EMPTY.merge(Lse2::EMPTY, exp2);
        assert_eq!(empty, Lse2::EMPTY);
        assert_eq!(empty.lse2(log2), f64::NEG_INFINITY);
        assert_eq!(empty.entropy2(log2), 0.0);
    }

    #[test]
    fn all_negative_rows_stay_finite() {
        let z = [-1.0e4, -1.0e4 - 1.0, -1.0e4 + 0.5];
        let st = fold(&z);
        let (lse, ent) = dense(&z);
        assert!(st.lse2(log2).is_finite());
        assert!((st.lse2(log2) * LN_2 - lse).abs() < 1e-9 * 1e4);
        assert!((st.entropy2(log2) * LN_2 - ent).abs() < 1e-9);
    }

    #[test]
    fn nan_propagates() {
        let st = fold(&[1.0, f64::NAN, 2.0]);
        assert!(st.lse2(log2).is_nan());
        let a = fold(&[1.0]);
        let b = fold(&[f64::NAN]);
        assert!(a.merge(b, exp2).lse2(log2).is_nan());
    }

    #[test]
    fn f32_state_is_close() {
        let z: Vec<f64> = (0..1000).map(|i| ((i * 7919) % 1000) as f64 / 100.0 - 5.0).collect();
        let st64 = fold(&z);
        let st32 = z.iter().fold(Lse2::<f32>::EMPTY, |st, &x| st.push((x * LOG2_E) as f32, |v: f32| v.exp2()));
        let a = st32.lse2(|v: f32| v.log2()) as f64;
        assert!((a - st64.lse2(log2)).abs() < 1e-4);
    }
}
