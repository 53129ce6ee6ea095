//! Problem inputs: a borrowed view ([`Inputs`]) and generated test cases ([`Case`]) with the
//! structure the numerics tests need (scaled `h`, flat to peaked `W`, planted rows, huge and
//! all-negative rows, ignored labels).

use crate::bf16;
use crate::rng::Rng;
use crate::IGNORE_INDEX;

/// One problem on the CPU: bf16 bit patterns, row-major, `d` contiguous.
#[derive(Clone, Copy, Debug)]
pub struct Inputs<'a> {
    /// `[t][d]`
    pub h: &'a [u16],
    /// `[v][d]`: the local vocab shard, global ids `[v_begin, v_begin + v)`.
    pub w: &'a [u16],
    /// `[t]` global vocab ids or `ignore_index`.
    pub labels: &'a [i64],
    pub t: usize,
    pub v: usize,
    pub d: usize,
    pub v_begin: i64,
    /// Global vocab size: labels outside `[0, v_total)` (other than `ignore_index`) are errors.
    pub v_total: i64,
    pub temperature: f64,
    pub ignore_index: i64,
}

/// How a generated case is shaped.
#[derive(Clone, Debug)]
pub struct Structure {
    /// Standard deviation of the logits from random rows: 0.08 is flat, 4 peaked.
    pub logit_std: f64,
    /// Fraction of tokens whose label row of `W` is planted to make the label dominate.
    pub planted: f64,
    /// Fraction of tokens whose logits are all near −1e4.
    pub all_negative: f64,
    /// Fraction of tokens whose logits are all near +1e4.
    pub huge: f64,
    /// Fraction of tokens labelled `ignore_index`.
    pub ignored: f64,
    pub temperature: f64,
}

impl Default for Structure {
    fn default() -> Self {
        Self { logit_std: 2.0, planted: 0.05, all_negative: 0.02, huge: 0.02, ignored: 0.05, temperature: 1.0 }
    }
}

/// A generated problem that owns its data.
#[derive(Clone, Debug)]
pub struct Case {
    pub seed: u64,
    pub h: Vec<u16>,
    pub w: Vec<u16>,
    pub labels: Vec<i64>,
    pub t: usize,
    pub v: usize,
    pub d: usize,
    pub temperature: f64,
    pub ignore_index: i64,
}

impl Case {
    /// Random inputs for `(t, v, d)` from `seed`, shaped by `s`.
    ///
    /// `h` rows are `N(0, 1) · 4/√d` and `W` rows `N(0, (logit_std/4)²)`, so random logits have
    /// standard deviation ≈ `logit_std`. Column 0 of `W` is a constant 1 ("bias" column) so that
    /// setting `h[t][0] = ±1e4` shifts a whole row of logits to ±1e4.
    pub fn generate(seed: u64, t: usize, v: usize, d: usize, s: &Structure) -> Self {
        let mut rng = Rng::new(seed);
        let hs = 4.0 / (d as f64).sqrt();
        let ws = s.logit_std / 4.0;
        let mut h: Vec<f32> = (0..t * d).map(|_| (rng.normal() * hs) as f32).collect();
        let mut w: Vec<f32> = (0..v * d).map(|_| (rng.normal() * ws) as f32).collect();
        for r in 0..v {
            w[r * d] = 1.0;
        }
        let mut labels: Vec<i64> = (0..t).map(|_| rng.below(v as u64) as i64).collect();
        for i in 0..t {
            let u = rng.uniform();
            let row = &mut h[i * d..(i + 1) * d];
            if u < s.all_negative {
                row[0] = -1.0e4;
            } else if u < s.all_negative + s.huge {
                row[0] = 1.0e4;
            } else {
                row[0] = 0.0;
            }
        }
        for i in 0..t {
            if rng.uniform() < s.planted && d > 1 {
                // W[label] := c · h[i] (except the bias column): the label's logit ≈ 12 while
                // random logits stay ≈ N(0, logit_std).
                let y = labels[i] as usize;
                let hr: Vec<f32> = h[i * d + 1..(i + 1) * d].to_vec();
                let norm2: f64 = hr.iter().map(|&x| (x as f64) * (x as f64)).sum::<f64>().max(1e-12);
                let c = 12.0 / norm2;
                for (k, &x) in hr.iter().enumerate() {
                    w[y * d + 1 + k] = (x as f64 * c) as f32;
                }
            }
        }
        for l in labels.iter_mut() {
            if rng.uniform() < s.ignored {
                *l = IGNORE_INDEX;
            }
        }
        Self { seed, h: bf16::quantize(&h), w: bf16::quantize(&w), labels, t, v, d, temperature: s.temperature, ignore_index: IGNORE_INDEX }
    }

    /// The whole case as one unsharded problem.
    pub fn inputs(&self) -> Inputs<'_> {
        Inputs {
            h: &self.h,
            w: &self.w,
            labels: &self.labels,
            t: self.t,
            v: self.v,
            d: self.d,
            v_begin: 0,
            v_total: self.v as i64,
            temperature: self.temperature,
            ignore_index: self.ignore_index,
        }
    }

    /// The vocab shard `[v0, v1)` of the case (tensor parallelism): labels stay global.
    pub fn shard(&self, v0: usize, v1: usize) -> Inputs<'_> {
        Inputs { w: &self.w[v0 * self.d..v1 * self.d], v: v1 - v0, v_begin: v0 as i64, ..self.inputs() }
    }
}
