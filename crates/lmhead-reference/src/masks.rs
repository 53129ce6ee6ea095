//! Row masks of the layouts a loss reads (true: the row's label is read), for the active-row
//! tests and the bench: a suffix (one prompt, then one response), packed multi-turn rollouts
//! (observations and responses in turns), spans at tile edges, and masks applied to labels.

use crate::rng::Rng;

/// Every row: `true`.
pub fn all(t: usize) -> Vec<bool> {
    vec![true; t]
}

/// One prompt of `t − round(f·t)` rows, then a response of `round(f·t)` rows.
pub fn suffix(t: usize, f: f64) -> Vec<bool> {
    let n = ((f.clamp(0.0, 1.0) * t as f64).round() as usize).min(t);
    (0..t).map(|r| r >= t - n).collect()
}

/// Packed multi-turn rollouts: `turns` turns, each an observation of `obs` rows (uniform in the
/// range, from `seed`) followed by a response of `resp` rows, the lengths then scaled so that the
/// turns fill `t` rows and the responses are `round(f·t)` of them (the last turn takes the
/// rounding). `f = 1`: every row; `f = 0`: none.
pub fn packed_turns(t: usize, f: f64, turns: usize, obs: (usize, usize), resp: (usize, usize), seed: u64) -> Vec<bool> {
    let mut rng = Rng::new(seed);
    let mut draw = |(lo, hi): (usize, usize)| lo as f64 + rng.below((hi - lo + 1) as u64) as f64;
    let turns = turns.max(1);
    let lens: Vec<(f64, f64)> = (0..turns).map(|_| (draw(obs), draw(resp))).collect();
    let n_active = ((f.clamp(0.0, 1.0) * t as f64).round() as usize).min(t);
    let (sum_o, sum_r) = lens.iter().fold((0.0, 0.0), |(a, b), &(o, r)| (a + o, b + r));
    let (scale_o, scale_r) = ((t - n_active) as f64 / sum_o, n_active as f64 / sum_r);
    let mut mask = Vec::with_capacity(t);
    let (mut done_o, mut done_r) = (0.0f64, 0.0f64);
    for (i, &(o, r)) in lens.iter().enumerate() {
        // Cumulative rounding: the turns' lengths add up to exactly the totals.
        let last = i + 1 == turns;
        let to = if last { t - n_active } else { ((done_o + o) * scale_o).round() as usize };
        let tr = if last { n_active } else { ((done_r + r) * scale_r).round() as usize };
        let (from_o, from_r) = ((done_o * scale_o).round() as usize, (done_r * scale_r).round() as usize);
        mask.extend(std::iter::repeat_n(false, to - from_o));
        mask.extend(std::iter::repeat_n(true, tr - from_r));
        done_o += o;
        done_r += r;
    }
    mask
}

/// The packed layout: 8 turns, observations of 100–3000 rows, responses of 50–2000,
/// scaled to `t` rows of which `round(f·t)` are responses.
pub fn multi_turn(t: usize, f: f64, seed: u64) -> Vec<bool> {
    packed_turns(t, f, 8, (100, 3000), (50, 2000), seed)
}

/// Spans of active rows `[start, start + len)` (clipped to `t`).
pub fn spans(t: usize, spans: &[(usize, usize)]) -> Vec<bool> {
    let mut m = vec![false; t];
    for &(s, len) in spans {
        for r in s..(s + len).min(t) {
            m[r] = true;
        }
    }
    m
}

/// Each row active with probability `p`, from `seed`.
pub fn random(t: usize, p: f64, seed: u64) -> Vec<bool> {
    let mut rng = Rng::new(seed);
    (0..t).map(|_| rng.uniform() < p).collect()
}

/// `labels` with every row the mask leaves out set to `ignore_index` (what a caller's mask
/// becomes: `labels.masked_fill(~mask, ignore_index)`).
pub fn apply(labels: &[i64], mask: &[bool], ignore_index: i64) -> Vec<i64> {
    labels.iter().zip(mask).map(|(&l, &m)| if m { l } else { ignore_index }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(m: &[bool]) -> usize {
        m.iter().filter(|&&x| x).count()
    }

    #[test]
    fn layouts_have_their_length_and_fraction() {
        for t in [1usize, 100, 4096, 8192, 16_384] {
            for f in [0.0, 0.1, 0.25, 0.5, 0.75, 1.0] {
                let want = (f * t as f64).round() as usize;
                let s = suffix(t, f);
                assert_eq!((s.len(), count(&s)), (t, want));
                assert!(s.windows(2).all(|w| w[0] <= w[1]), "one prompt, then one response");
                for seed in [1, 2, 3] {
                    let m = multi_turn(t, f, seed);
                    assert_eq!((m.len(), count(&m)), (t, want), "t {t} f {f} seed {seed}");
                }
            }
        }
    }

    #[test]
    fn packed_turns_alternate_observations_and_responses() {
        let m = multi_turn(8192, 0.5, 7);
        let runs = m.windows(2).filter(|w| w[0] != w[1]).count() + 1;
        // 8 turns of (observation, response): up to 16 runs, the first an observation.
        assert!(!m[0] && (9..=16).contains(&runs), "{runs} runs");
        assert_ne!(multi_turn(8192, 0.5, 7), multi_turn(8192, 0.5, 8), "seeded");
    }

    #[test]
    fn spans_and_masks_on_labels() {
        let m = spans(10, &[(1, 2), (8, 5)]);
        assert_eq!(m, [false, true, true, false, false, false, false, false, true, true]);
        assert_eq!(apply(&[5, 6, 7], &[true, false, true], -100), vec![5, -100, 7]);
        let r = random(10_000, 0.3, 9);
        assert!((2700..3300).contains(&count(&r)));
    }
}
