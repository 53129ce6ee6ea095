//! CPU checks of the f64 reference (these run in CI): against a naive dense computation, the
//! sharded merge, extreme rows, ignore_index, temperature, finite differences of the backward,
//! and the CPU backend's typed errors.

use lmhead::{bf16, cpu, BwdOptions, Error, FwdOptions, Problem};
use lmhead_core::ShapeError;
use lmhead_reference::bf16 as b16;
use lmhead_reference::{backward, forward, merge_shards, shard_partials, Case, Grads, Inputs, Structure, IGNORE_INDEX};
use lmhead_tests::{case_seed, run_seed};

/// The most direct f64 implementation: logits matrix, then max, sums and logs per row.
fn dense(inp: &Inputs) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (t, v, d) = (inp.t, inp.v, inp.d);
    let mut lse = vec![0.0; t];
    let mut lp = vec![0.0; t];
    let mut ent = vec![0.0; t];
    for i in 0..t {
        let z: Vec<f64> = (0..v)
            .map(|j| (0..d).map(|k| b16::to_f64(inp.h[i * d + k]) * b16::to_f64(inp.w[j * d + k])).sum::<f64>() / inp.temperature)
            .collect();
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let l = m + z.iter().map(|&x| (x - m).exp()).sum::<f64>().ln();
        lse[i] = l;
        if inp.labels[i] == IGNORE_INDEX {
            continue;
        }
        lp[i] = z[inp.labels[i] as usize] - l;
        ent[i] = -z.iter().map(|&x| (x - l).exp() * (x - l)).sum::<f64>();
    }
    (lse, lp, ent)
}

fn close(a: &[f64], b: &[f64], tol: f64, what: &str, seed: u64) {
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!((x - y).abs() <= tol * y.abs().max(1.0), "{what}[{i}]: {x} vs {y} (seed {seed})");
    }
}

#[test]
fn reference_matches_dense() {
    let seed = run_seed("reference_matches_dense");
    let shapes = [(1, 1, 8), (3, 7, 8), (17, 33, 24), (40, 100, 64), (5, 300, 16)];
    let structures = [
        Structure::default(),
        Structure { logit_std: 0.08, ..Default::default() },
        Structure { logit_std: 6.0, planted: 0.5, ..Default::default() },
        Structure { temperature: 0.6, ignored: 0.3, ..Default::default() },
    ];
    let mut i = 0;
    for &(t, v, d) in &shapes {
        for s in &structures {
            let cs = case_seed(seed, i);
            i += 1;
            let c = Case::generate(cs, t, v, d, s);
            let r = forward(&c.inputs());
            let (lse, lp, ent) = dense(&c.inputs());
            close(&r.lse, &lse, 1e-12, "lse", cs);
            close(&r.logprob, &lp, 1e-10, "logprob", cs);
            close(&r.entropy, &ent, 1e-10, "entropy", cs);
        }
    }
}

/// Sharding the vocab in 1, 2, 3 and 8 pieces and merging the partials reproduces the
/// unsharded result — the math tensor parallelism uses.
#[test]
fn sharded_merge_matches_unsharded() {
    let seed = run_seed("sharded_merge_matches_unsharded");
    let c =
        Case::generate(seed, 23, 101, 32, &Structure { planted: 0.3, all_negative: 0.1, huge: 0.1, ignored: 0.1, ..Default::default() });
    let whole = forward(&c.inputs());
    for pieces in [1usize, 2, 3, 8] {
        let bounds: Vec<usize> = (0..=pieces).map(|k| k * c.v / pieces).collect();
        let mut shards: Vec<_> = bounds.windows(2).map(|b| shard_partials(&c.shard(b[0], b[1]))).collect();
        shards.reverse(); // merge order must not matter
        let m = merge_shards(&shards, &c.labels, c.v as i64, IGNORE_INDEX);
        close(&m.lse, &whole.lse, 1e-12, "lse", seed);
        close(&m.logprob, &whole.logprob, 1e-10, "logprob", seed);
        close(&m.entropy, &whole.entropy, 1e-10, "entropy", seed);
    }
}

#[test]
fn extreme_rows_stay_finite() {
    let seed = run_seed("extreme_rows_stay_finite");
    let c = Case::generate(seed, 30, 50, 16, &Structure { all_negative: 0.5, huge: 0.5, ..Default::default() });
    let r = forward(&c.inputs());
    let (lse, lp, ent) = dense(&c.inputs());
    for i in 0..c.t {
        assert!(r.lse[i].is_finite() && r.logprob[i].is_finite() && r.entropy[i].is_finite(), "row {i} (seed {seed})");
    }
    assert!(r.lse.iter().any(|&x| x < -5000.0), "some rows should sit near -1e4 (seed {seed})");
    assert!(r.lse.iter().any(|&x| x > 5000.0), "some rows should sit near +1e4 (seed {seed})");
    close(&r.lse, &lse, 1e-12, "lse", seed);
    close(&r.logprob, &lp, 1e-9, "logprob", seed);
    close(&r.entropy, &ent, 1e-9, "entropy", seed);
}

/// `RowOut::spread` is the entropy's first-order sensitivity to logit errors (the GPU tests'
/// entropy tolerance rests on it): moving each logit by `ε` against the sign of `p_j·(z_j − μ)`
/// raises `H` by `ε·spread`, and random `±ε` moves never exceed it.
#[test]
fn entropy_spread_bounds_logit_errors() {
    let seed = run_seed("entropy_spread_bounds_logit_errors");
    let c = Case::generate(seed, 8, 300, 32, &Structure { huge: 0.25, ..Default::default() });
    let inp = c.inputs();
    let mut rng = lmhead_reference::rng::Rng::new(seed);
    for i in 0..c.t {
        let z: Vec<f64> = (0..c.v).map(|j| b16::dot(&c.h[i * c.d..(i + 1) * c.d], &c.w[j * c.d..(j + 1) * c.d])).collect();
        let r = lmhead_reference::fwd::row_from_logits(&z, 0, &inp);
        let mu = r.lse - r.entropy;
        let eps = 1e-7 * r.lse.abs().max(1.0);
        let worst: Vec<f64> = z.iter().map(|&x| x - eps * (x - mu).signum()).collect();
        let dh = lmhead_reference::fwd::row_from_logits(&worst, 0, &inp).entropy - r.entropy;
        assert!(
            (dh - eps * r.spread).abs() <= 1e-2 * eps * r.spread + 1e-9,
            "row {i}: dH {dh:e} vs eps*spread {:e} (seed {seed})",
            eps * r.spread
        );
        for _ in 0..4 {
            let noisy: Vec<f64> = z.iter().map(|&x| x + if rng.below(2) == 0 { eps } else { -eps }).collect();
            let dn = lmhead_reference::fwd::row_from_logits(&noisy, 0, &inp).entropy - r.entropy;
            assert!(dn.abs() <= 1.01 * eps * r.spread + 1e-9, "row {i}: random dH {dn:e} > eps*spread (seed {seed})");
        }
    }
}

/// The backward stages each d-logit in bf16 (relative rounding ≤ 2⁻⁸). Emulated here in f64:
/// the resulting `dh` error stays within the GPU test's bf16 bound `6e-3 · max(‖ref‖, ‖rss‖)`
/// (`rss`: each element's root sum of squared terms) on random cases and on the case seen on the
/// H200, where the terms cancel (a `W` column constant over the vocabulary makes `dh_j = 0`) and
/// the error is 1.2e-2 of `‖ref‖`: a bound relative to `‖ref‖` alone calls exact staging wrong.
#[test]
fn staged_dlogits_error_scales_with_the_terms() {
    let seed = run_seed("staged_dlogits_error_scales_with_the_terms");
    let to_bf16 = |x: f64| b16::to_f64(b16::from_f32(x as f32));
    let s = Structure { logit_std: 2.0, planted: 0.05, all_negative: 0.0, huge: 0.0, ignored: 0.05, temperature: 1.0 };
    let mut cases = vec![(7051947941513986546u64, 1usize, 151_936usize, 8usize, true)];
    for i in 0..3 {
        cases.push((case_seed(seed, i), 4, 20_000, 16, false));
    }
    for (cs, t, v, d, seen) in cases {
        let c = Case::generate(cs, t, v, d, &s);
        let inp = c.inputs();
        let r = forward(&inp);
        let mut rng = lmhead_reference::rng::Rng::new(cs ^ 0xD1CE);
        let gl: Vec<f64> = (0..t).map(|_| rng.normal() as f32 as f64).collect();
        let ge: Vec<f64> = (0..t).map(|_| rng.normal() as f32 as f64).collect();
        let g = Grads { logprob: Some(&gl), entropy: Some(&ge) };
        let rows: Vec<usize> = (0..t).collect();
        let (exact, rss) = lmhead_reference::backward_dh_rows_rss(&inp, &r.lse, &r.entropy, &g, &rows);
        let (exact, rss) = (exact.concat(), rss.concat());
        let mut staged = vec![0.0f64; t * d];
        for row in 0..t {
            for j in 0..v {
                let a = to_bf16(lmhead_reference::dlogit(&inp, row, j, r.lse[row], r.entropy[row], &g));
                for k in 0..d {
                    staged[row * d + k] += a * b16::to_f64(c.w[j * d + k]);
                }
            }
        }
        let staged: Vec<f64> = staged.into_iter().map(to_bf16).collect();
        let norm = |x: &mut dyn Iterator<Item = f64>| x.map(|y| y * y).sum::<f64>().sqrt();
        let err = norm(&mut staged.iter().zip(&exact).map(|(a, b)| a - b));
        let (nref, nrss) = (norm(&mut exact.iter().copied()), norm(&mut rss.iter().copied()));
        println!("seed {cs} t {t} v {v} d {d}: ‖Δ‖/‖ref‖ {:.2e}, ‖Δ‖/‖rss‖ {:.2e}", err / nref, err / nrss);
        assert!(err <= 6e-3 * nref.max(nrss), "seed {cs}: ‖Δ‖ {err:e} > 6e-3 · max({nref:e}, {nrss:e})");
        if seen {
            assert!(err > 6e-3 * nref, "the case seen on the H200 should need the terms' scale");
        }
    }
}

#[test]
fn ignore_index_and_bad_labels() {
    let mut c = Case::generate(7, 4, 10, 8, &Structure::default());
    c.labels = vec![IGNORE_INDEX, 3, 10, -5];
    let r = forward(&c.inputs());
    assert_eq!((r.logprob[0], r.entropy[0]), (0.0, 0.0));
    assert!(r.lse[0].is_finite());
    assert!(r.logprob[1].is_finite());
    assert!(r.logprob[2].is_nan() && r.logprob[3].is_nan(), "bad labels must be NaN, not plausible numbers");
    assert_eq!(lmhead_reference::bad_labels(&c.inputs()), vec![2, 3]);
}

#[test]
fn temperature_scales_logits() {
    let c = Case::generate(3, 5, 20, 8, &Structure { ignored: 0.0, ..Default::default() });
    let mut hot = c.clone();
    hot.temperature = 2.0;
    let (a, b) = (forward(&c.inputs()), forward(&hot.inputs()));
    assert!(a.entropy.iter().zip(&b.entropy).all(|(x, y)| y > x), "a higher temperature flattens the distribution");
}

/// The backward reference equals central finite differences of the dense forward objective
/// `L = Σ_t g_ℓ[t] ℓ_t + g_H[t] H_t` (checks the derivation of both gradient terms). Ordinary
/// rows only: with the ±1e4-logit rows of the default structure the 1e-6 central difference
/// itself is off by ~1e-5 relative (seed 14920421091709048799 failed CI that way); those rows
/// are covered by the GPU suites against this reference.
#[test]
fn backward_matches_finite_differences() {
    let seed = run_seed("backward_matches_finite_differences");
    let (t, v, d) = (3, 7, 8);
    let s = Structure { logit_std: 1.5, ignored: 0.0, temperature: 0.8, huge: 0.0, all_negative: 0.0, ..Default::default() };
    let c = Case::generate(seed, t, v, d, &s);
    let gl = [0.7, -1.3, 0.4];
    let ge = [-0.5, 0.9, 1.1];
    let obj = |h: &[f64], w: &[f64]| -> f64 {
        let mut total = 0.0;
        for i in 0..t {
            let z: Vec<f64> = (0..v).map(|j| (0..d).map(|k| h[i * d + k] * w[j * d + k]).sum::<f64>() / c.temperature).collect();
            let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let l = m + z.iter().map(|&x| (x - m).exp()).sum::<f64>().ln();
            let ent = -z.iter().map(|&x| (x - l).exp() * (x - l)).sum::<f64>();
            total += gl[i] * (z[c.labels[i] as usize] - l) + ge[i] * ent;
        }
        total
    };
    let h: Vec<f64> = c.h.iter().map(|&b| b16::to_f64(b)).collect();
    let w: Vec<f64> = c.w.iter().map(|&b| b16::to_f64(b)).collect();
    let fwd = forward(&c.inputs());
    let g = Grads { logprob: Some(&gl), entropy: Some(&ge) };
    let r = backward(&c.inputs(), &fwd.lse, &fwd.entropy, &g);
    let eps = 1e-6;
    for k in 0..t * d {
        let (mut hp, mut hm) = (h.clone(), h.clone());
        hp[k] += eps;
        hm[k] -= eps;
        let num = (obj(&hp, &w) - obj(&hm, &w)) / (2.0 * eps);
        assert!((num - r.dh[k]).abs() < 1e-6 * num.abs().max(1.0), "dh[{k}]: fd {num} vs {} (seed {seed})", r.dh[k]);
    }
    for k in 0..v * d {
        let (mut wp, mut wm) = (w.clone(), w.clone());
        wp[k] += eps;
        wm[k] -= eps;
        let num = (obj(&h, &wp) - obj(&h, &wm)) / (2.0 * eps);
        assert!((num - r.dw[k]).abs() < 1e-6 * num.abs().max(1.0), "dW[{k}]: fd {num} vs {} (seed {seed})", r.dw[k]);
    }
}

/// The CPU backend rejects bad input with typed errors.
#[test]
fn cpu_backend_typed_errors() {
    let c = Case::generate(1, 4, 10, 8, &Structure::default());
    let h: Vec<bf16> = c.h.iter().map(|&b| bf16::from_bits(b)).collect();
    let w: Vec<bf16> = c.w.iter().map(|&b| bf16::from_bits(b)).collect();
    let p = Problem::new(4, 10, 8);
    let o = FwdOptions::default();
    assert!(cpu::forward(&cpu::CpuInputs { h: &h, w: &w, labels: &c.labels, problem: p }, &o, true).is_ok());
    let e = |r: lmhead::Result<cpu::CpuFwd>| r.unwrap_err();
    assert!(matches!(
        e(cpu::forward(&cpu::CpuInputs { h: &h, w: &w, labels: &c.labels, problem: Problem::new(0, 10, 8) }, &o, true)),
        Error::Shape(ShapeError::NoTokens)
    ));
    assert!(matches!(
        e(cpu::forward(&cpu::CpuInputs { h: &h, w: &w, labels: &c.labels, problem: Problem::new(4, 0, 8) }, &o, true)),
        Error::Shape(ShapeError::NoVocab)
    ));
    assert!(matches!(
        e(cpu::forward(&cpu::CpuInputs { h: &h, w: &w, labels: &c.labels, problem: Problem::new(4, 10, 12) }, &o, true)),
        Error::Shape(ShapeError::Hidden { d: 12 })
    ));
    assert!(matches!(
        e(cpu::forward(&cpu::CpuInputs { h: &h[..8], w: &w, labels: &c.labels, problem: p }, &o, true)),
        Error::Length { what: "h", .. }
    ));
    assert!(matches!(
        e(cpu::forward(&cpu::CpuInputs { h: &h, w: &w[..8], labels: &c.labels, problem: p }, &o, true)),
        Error::Length { what: "W", .. }
    ));
    assert!(matches!(
        e(cpu::forward(&cpu::CpuInputs { h: &h, w: &w, labels: &c.labels[..3], problem: p }, &o, true)),
        Error::Length { what: "labels", .. }
    ));
    for bad in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
        let o = FwdOptions { temperature: bad, ..Default::default() };
        assert!(matches!(
            e(cpu::forward(&cpu::CpuInputs { h: &h, w: &w, labels: &c.labels, problem: p }, &o, true)),
            Error::Temperature(_)
        ));
    }
    let mut labels = c.labels.clone();
    labels[1] = 10;
    assert!(matches!(
        e(cpu::forward(&cpu::CpuInputs { h: &h, w: &w, labels: &labels, problem: p }, &o, true)),
        Error::BadLabel { row: Some(1), label: Some(10) }
    ));
    let lse = vec![0.0f32; 4];
    let g = vec![1.0f32; 4];
    let r = cpu::backward(
        &cpu::CpuInputs { h: &h, w: &w, labels: &c.labels, problem: p },
        &cpu::CpuGrads { lse: &lse, entropy: None, grad_logprob: None, grad_entropy: Some(&g), kept: None },
        &BwdOptions::default(),
    );
    assert!(matches!(r, Err(Error::Invalid(_))), "entropy gradient without saved entropy");
}
