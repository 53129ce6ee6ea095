//! Error metrics, in f64: `rel_l2 = ‖x − r‖₂ / ‖r‖₂` and `max_rel = max |x − r| / (|r| + floor)`,
//! plus the guards that make a check able to fail (non-finite values, an all-zero reference).

/// Summary of one output compared with its reference.
#[derive(Clone, Debug, PartialEq)]
pub struct Compare {
    pub rel_l2: f64,
    pub max_abs: f64,
    pub max_rel: f64,
    /// Index of the largest `|x − r|`.
    pub worst: usize,
    /// Entries of `x` that are NaN or ±∞ where the reference is finite.
    pub nonfinite: usize,
    /// ‖r‖₂: a check against an all-zero reference proves nothing.
    pub ref_norm: f64,
}

pub fn compare(x: &[f64], r: &[f64], floor: f64) -> Compare {
    assert_eq!(x.len(), r.len(), "compare: lengths differ");
    let (mut num, mut den, mut max_abs, mut max_rel, mut worst, mut nonfinite) = (0.0, 0.0, 0.0f64, 0.0f64, 0, 0);
    for (i, (&a, &b)) in x.iter().zip(r).enumerate() {
        if !b.is_finite() {
            // A non-finite reference must be matched exactly in kind (NaN ↔ NaN, ±∞ ↔ ±∞).
            let same = (a.is_nan() && b.is_nan()) || a == b;
            if !same {
                nonfinite += 1;
            }
            continue;
        }
        if !a.is_finite() {
            nonfinite += 1;
            continue;
        }
        let e = (a - b).abs();
        num += e * e;
        den += b * b;
        if e > max_abs {
            max_abs = e;
            worst = i;
        }
        max_rel = max_rel.max(e / (b.abs() + floor));
    }
    Compare { rel_l2: if den > 0.0 { (num / den).sqrt() } else { num.sqrt() }, max_abs, max_rel, worst, nonfinite, ref_norm: den.sqrt() }
}
