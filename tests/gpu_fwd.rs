//! GPU parity of the forward against the f64 reference (skipped without a CUDA driver).
//!
//! Every case draws fresh inputs from the run seed (printed; `LMHEAD_SEED` replays), poisons
//! the outputs with NaN before the launch, and checks every output element (or, for shapes whose
//! reference would take minutes, a sample of rows that always includes the first and last).
//!
//! Tolerances. Products of bf16 values are exact; the tensor cores add them into f32
//! accumulators, and each `mma` step rounds its sum toward zero (measured on the H200: the error
//! grows linearly with `d`, ~2 ulp per k16 step, not as `√d`). A logit of magnitude `|z|`
//! therefore carries up to `2·(d/16)·ulp(|z|)` error with `ulp(|z|) ≤ |z|·2⁻²³`, and every output
//! of a row inherits it from the logits near its lse. Per row, with `mag = max(|lse|, |z_label|)`:
//! - log-prob, lse: `1e-4 + mag·2⁻²²·(d/16 + 4)` (at d = 4096 and logits ~ 10: 7e-4; rows near
//!   ±1e4 get ~0.6, relative 6e-5);
//! - entropy: `1e-4·max(1, H) + |lse|·2⁻²²·(d/16 + 4)·(1 + spread)`, where
//!   `spread = Σ p_j·|z_j − μ|` (the reference's `RowOut::spread`): `∂H/∂z_j = −p_j·(z_j − μ)`, so
//!   a per-logit error `ε` moves `H` by up to `ε·spread`. Without the factor, a row near −1e4
//!   with entropy 5.44 and spread 4.15 at d = 2048 was off by 0.46 against a bound of 0.31
//!   (seed 14636981504786164461, `t128_v256_d64_s4_w8x1_tma`, row 515; now 1.6);
//! - ignored rows: log-prob and entropy exactly 0, and lse `+∞` where the call skipped them
//!   (`FwdReport::rows < t`; `lmhead::Compaction`).

use lmhead::cudarc::driver::{CudaSlice, CudaStream};
use lmhead::testing::{download_f32, poison, upload, upload_bf16};
use lmhead::{Choice, Family, FwdInputs, FwdOptions, FwdOutputs, LabelCheck, LmHead, Problem};
use lmhead_reference::{forward_rows, Case, Structure, IGNORE_INDEX};
use lmhead_tests::{case_seed, check, fixed_or_auto, gpu_or_skip, held, run_seed, skip_sm90_only};
use std::sync::Arc;

/// One forward case.
#[derive(Clone, Debug)]
struct FwdCase {
    t: usize,
    v: usize,
    d: usize,
    s: Structure,
    entropy: bool,
    i64_labels: bool,
    choice: Choice,
    naive: bool,
}

impl FwdCase {
    fn new(t: usize, v: usize, d: usize) -> Self {
        Self { t, v, d, s: Structure::default(), entropy: true, i64_labels: false, choice: Choice::Fallback, naive: false }
    }
}

/// Rows checked against the reference: all of them when cheap, else a sample (first, last,
/// and random rows).
fn rows_to_check(t: usize, v: usize, d: usize, seed: u64) -> Vec<usize> {
    let budget = 4.0e9;
    if (t * v * d) as f64 <= budget {
        return (0..t).collect();
    }
    let n = ((budget / (v * d) as f64) as usize).clamp(8, t);
    let mut rng = lmhead_reference::rng::Rng::new(seed);
    let mut rows: Vec<usize> = vec![0, t - 1];
    rows.extend((0..n).map(|_| rng.below(t as u64) as usize));
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Whether a row's logits are of magnitude ~1e4 (reported separately).
fn extreme(lse: f64) -> bool {
    lse.abs() >= 100.0
}

/// Accumulation tolerance of a row whose relevant logits have magnitude `mag` (module docs).
fn acc_tol(mag: f64, d: usize) -> f64 {
    lmhead_tests::fwd_acc_tol(mag, d)
}

/// Largest error over normal rows (absolute) and over ±1e4 rows (relative to |lse|).
fn split_err(x: &[f64], r: &[f64], lse: &[f64]) -> (f64, f64) {
    let (mut normal, mut ext) = (0.0f64, 0.0f64);
    for i in 0..x.len() {
        let e = (x[i] - r[i]).abs();
        if extreme(lse[i]) {
            ext = ext.max(e / lse[i].abs());
        } else {
            normal = normal.max(e);
        }
    }
    (normal, ext)
}

/// Run one case; returns a summary line for the record and the launch's vocab split count.
fn run(head: &LmHead, stream: &Arc<CudaStream>, c: &FwdCase, seed: u64) -> (String, lmhead::FwdReport) {
    let case = Case::generate(seed, c.t, c.v, c.d, &c.s);
    let desc = format!(
        "t={} v={} d={} ent={} i64={} choice={:?} naive={} seed={seed} {:?}",
        c.t, c.v, c.d, c.entropy, c.i64_labels, c.choice, c.naive, c.s
    );
    let h = upload_bf16(stream, &case.h).unwrap();
    let w = upload_bf16(stream, &case.w).unwrap();
    let mut logprob: CudaSlice<f32> = stream.alloc_zeros(c.t).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(c.t).unwrap();
    let mut ent: CudaSlice<f32> = stream.alloc_zeros(c.t).unwrap();
    for b in [&mut logprob, &mut lse, &mut ent] {
        poison(stream, b).unwrap();
    }
    let opts = FwdOptions { temperature: c.s.temperature as f32, config: c.choice, naive: c.naive, ..Default::default() };
    let problem = Problem::new(c.t, c.v, c.d);
    let outs = FwdOutputs { kept: None, logprob: &mut logprob, lse: &mut lse, entropy: if c.entropy { Some(&mut ent) } else { None } };
    let report = if c.i64_labels {
        let labels = upload(stream, &case.labels).unwrap();
        head.forward(stream, &FwdInputs { h: &h, w: &w, labels: &labels, problem }, &opts, outs)
    } else {
        let l32: Vec<i32> = case.labels.iter().map(|&l| l as i32).collect();
        let labels = upload(stream, &l32).unwrap();
        head.forward(stream, &FwdInputs { h: &h, w: &w, labels: &labels, problem }, &opts, outs)
    }
    .unwrap_or_else(|e| panic!("forward failed [{desc}]: {e}"));
    let (glp, glse, gent) =
        (download_f32(stream, &logprob).unwrap(), download_f32(stream, &lse).unwrap(), download_f32(stream, &ent).unwrap());

    let rows = rows_to_check(c.t, c.v, c.d, seed);
    let r = forward_rows(&case.inputs(), &rows);
    let pick = |g: &[f64]| rows.iter().map(|&i| g[i]).collect::<Vec<f64>>();
    let (rlp, rlse, rent): (Vec<f64>, Vec<f64>, Vec<f64>) =
        (r.iter().map(|x| x.logprob).collect(), r.iter().map(|x| x.lse).collect(), r.iter().map(|x| x.entropy).collect());
    let spread: Vec<f64> = r.iter().map(|x| x.spread).collect();
    let naive_slack = if c.naive { 10.0 } else { 1.0 };
    let d = c.d;
    let mag = |i: usize| rlse[i].abs().max((rlse[i] + rlp[i]).abs());
    let lp_tol = |i: usize, _: f64| naive_slack * (1e-4 + acc_tol(mag(i), d));
    check("logprob", &desc, &pick(&glp), &rlp, &lp_tol);
    // A call that skipped the ignored rows (fewer rows ran than t) leaves their lse at +∞.
    let skipped = |i: usize| report.rows < c.t && case.labels[i] == IGNORE_INDEX;
    let rlse_out: Vec<f64> = rows.iter().zip(&rlse).map(|(&i, &x)| if skipped(i) { f64::INFINITY } else { x }).collect();
    check("lse", &desc, &pick(&glse), &rlse_out, &lp_tol);
    let cent = if c.entropy {
        let ent_tol = |i: usize, r: f64| naive_slack * (1e-4 * r.abs().max(1.0) + acc_tol(rlse[i].abs(), d) * (1.0 + spread[i]));
        check("entropy", &desc, &pick(&gent), &rent, &ent_tol);
        Some(split_err(&pick(&gent), &rent, &rlse))
    } else {
        // No entropy requested: the poisoned entropy buffer must be untouched.
        assert!(gent.iter().all(|x| x.is_nan()), "entropy written although not requested [{desc}]");
        None
    };
    for &i in &rows {
        if case.labels[i] == IGNORE_INDEX {
            assert_eq!(glp[i], 0.0, "ignored row {i} log-prob [{desc}]");
            if c.entropy {
                assert_eq!(gent[i], 0.0, "ignored row {i} entropy [{desc}]");
            }
        }
    }
    let (lp_n, lp_x) = split_err(&pick(&glp), &rlp, &rlse);
    // Skipped rows' lse (+∞, checked above) out of the summary: the reference's value there.
    let glse_summary: Vec<f64> = rows.iter().zip(&rlse).map(|(&i, &x)| if skipped(i) { x } else { glse[i] }).collect();
    let (lse_n, lse_x) = split_err(&glse_summary, &rlse, &rlse);
    let line = format!(
        "fwd t={:<5} v={:<6} d={:<5} ent={} cfg={:?} splits={} fill={} rows={} max_abs(normal rows) lp={:.1e} lse={:.1e} ent={} | max_rel(±1e4 rows) lp={:.1e} lse={:.1e}",
        c.t,
        c.v,
        c.d,
        c.entropy as u8,
        report.kernel.as_deref().unwrap_or(if c.naive { "naive" } else { "none (no active row)" }),
        report.n_splits,
        report.fill,
        rows.len(),
        lp_n,
        lse_n,
        cent.map(|x| format!("{:.1e}", x.0)).unwrap_or_else(|| "-".into()),
        lp_x,
        lse_x
    );
    (line, report)
}

fn run_all(test: &str, cases: &[FwdCase]) {
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let seed = run_seed(test);
    for (i, c) in cases.iter().enumerate() {
        let (line, _) = run(&head, &stream, c, case_seed(seed, i));
        println!("[{test}] {line}");
    }
}

/// The first compiled sm90 (warp-specialised TMA + `wgmma`) candidate of the forward.
/// (`Choice::Auto` under the portable module: [`fixed_or_auto`].)
fn tma_cfg() -> Choice {
    fixed_or_auto(*Family::Fwd.candidates().iter().find(|c| c.is_sm90()).expect("an sm90 candidate"))
}

/// The shape list (not the full cross product: each M, V and H value appears), with
/// entropy on and off, both label widths, and both mainloops (`mma.sync` fallback, sm90
/// warp-specialised TMA + `wgmma`).
#[test]
fn shapes() {
    let mut cases = Vec::new();
    for (i, &(t, v, d)) in [
        (1, 1, 8),
        (7, 3, 64),
        (64, 1000, 1000),
        (1000, 32000, 2048),
        (4097, 50257, 4096),
        (64, 151936, 4096),
        (1, 151936, 8),
        (7, 32000, 1000),
        (1000, 3, 4096),
        (4097, 1, 64),
    ]
    .iter()
    .enumerate()
    {
        let mut c = FwdCase::new(t, v, d);
        c.entropy = i % 2 == 0;
        c.i64_labels = i % 3 == 0;
        cases.push(c.clone());
        c.entropy = !c.entropy;
        c.choice = tma_cfg();
        cases.push(c.clone());
        c.entropy = !c.entropy;
        cases.push(c);
    }
    run_all("gpu_fwd::shapes", &cases);
}

/// Input structures: flat and peaked logits, planted labels, rows near −1e4 and +1e4, ignored
/// labels, temperatures ≠ 1.
#[test]
fn structures() {
    let base = Structure::default();
    let variants = [
        Structure { logit_std: 0.08, ..base.clone() },
        Structure { logit_std: 4.0, ..base.clone() },
        Structure { planted: 0.5, ..base.clone() },
        Structure { all_negative: 0.5, ..base.clone() },
        Structure { huge: 0.5, ..base.clone() },
        Structure { ignored: 0.5, ..base.clone() },
        Structure { temperature: 0.7, ..base.clone() },
        Structure { temperature: 1.6, logit_std: 4.0, ..base.clone() },
    ];
    let mut cases = Vec::new();
    for s in variants {
        for entropy in [false, true] {
            let mut c = FwdCase::new(300, 5003, 512);
            c.s = s.clone();
            c.entropy = entropy;
            // Both on the fallback and on the sm90 mainloop.
            cases.push(c.clone());
            c.choice = tma_cfg();
            cases.push(c);
        }
    }
    run_all("gpu_fwd::structures", &cases);
}

/// Every compiled candidate at its own tile boundaries: `t ∈ {bm − 1, bm, bm + 1}`,
/// `v = 3·bn + 3`, and `d` not a multiple of `bk`.
#[test]
fn tile_boundaries_every_config() {
    let mut cases = Vec::new();
    for &cfg in Family::Fwd.candidates().iter().filter(|c| held(c)) {
        let (bm, bn, bk) = (cfg.bm as usize, cfg.bn as usize, cfg.bk as usize);
        for (j, t) in [bm - 1, bm, bm + 1].into_iter().enumerate() {
            let mut c = FwdCase::new(t, 3 * bn + 3, 2 * bk + 8);
            // Every row active: the kernels run at exactly these shapes (gpu_active covers masks).
            c.s.ignored = 0.0;
            c.choice = Choice::Fixed(cfg);
            c.entropy = j != 1;
            cases.push(c);
        }
    }
    run_all("gpu_fwd::tile_boundaries_every_config", &cases);
}

/// Every sm90 candidate with many vocab tiles per block (one token tile per SM, so the plan takes
/// one split: asserted), odd and even tile counts, masked and unmasked last tiles, and `d` at 3
/// and 5 K steps.
#[test]
fn sm90_tile_loop() {
    if skip_sm90_only("gpu_fwd::sm90_tile_loop") {
        return;
    }
    let Some((head, stream)) = gpu_or_skip("gpu_fwd::sm90_tile_loop") else { return };
    let seed = run_seed("gpu_fwd::sm90_tile_loop");
    let sms = head.gpu().info().sm_count as usize;
    let mut i = 0;
    for &cfg in Family::Fwd.candidates().iter().filter(|c| c.is_sm90()) {
        let (bm, bn, bk) = (cfg.bm as usize, cfg.bn as usize, cfg.bk as usize);
        for (v, d) in [(4 * bn + 3, 4 * bk + 8), (6 * bn, 4 * bk + 8), (5 * bn, 3 * bk), (7 * bn + 1, 3 * bk)] {
            let mut c = FwdCase::new(sms * bm - 5, v, d);
            c.s.ignored = 0.0;
            c.choice = Choice::Fixed(cfg);
            c.entropy = i % 2 == 0;
            let (line, report) = run(&head, &stream, &c, case_seed(seed, i));
            println!("[gpu_fwd::sm90_tile_loop] {line}");
            assert_eq!(report.n_splits, 1, "the plan split the vocab: the tile loop is not exercised [{line}]");
            i += 1;
        }
    }
}

/// Every sm90 candidate where the plan cuts fillers off its splits (64 token tiles, the last
/// masked, × 2 splits: 128 main blocks on 132 SMs; asserted), with a masked last vocab tile, so
/// that the fillers write their own partial slots and take the masked tile.
#[test]
fn sm90_fillers() {
    if skip_sm90_only("gpu_fwd::sm90_fillers") {
        return;
    }
    let Some((head, stream)) = gpu_or_skip("gpu_fwd::sm90_fillers") else { return };
    let seed = run_seed("gpu_fwd::sm90_fillers");
    for (i, &cfg) in Family::Fwd.candidates().iter().filter(|c| c.is_sm90()).enumerate() {
        let mut c = FwdCase::new(64 * cfg.bm as usize - 5, 40_000 + 17, 1024);
        c.s.ignored = 0.0;
        c.choice = Choice::Fixed(cfg);
        c.entropy = i % 2 == 0;
        let (line, report) = run(&head, &stream, &c, case_seed(seed, i));
        println!("[gpu_fwd::sm90_fillers] {line}");
        assert!(report.fill > 0, "the plan took no fillers: the filler blocks are not exercised [{line}]");
    }
}

/// Many waves of blocks: `t = 2.5 · 132 · bm + 7` with the fallback config.
#[test]
fn waves() {
    let bm = Family::Fwd.fallback().bm as usize;
    let c = FwdCase::new(132 * bm * 5 / 2 + 7, 4099, 256);
    run_all("gpu_fwd::waves", &[c]);
}

/// Level 00, the naive kernel, against the same reference.
#[test]
fn naive_level00() {
    let mut cases = Vec::new();
    for &(t, v, d) in &[(1, 1, 8), (7, 1000, 64), (33, 5000, 256)] {
        let mut c = FwdCase::new(t, v, d);
        c.naive = true;
        cases.push(c);
    }
    run_all("gpu_fwd::naive_level00", &cases);
}

/// A label outside `[0, v)` that is not ignore_index: with the synchronous label check (the
/// default) a typed error naming the row and label before anything runs, so the outputs keep
/// their poison; with the deferred check, NaN in that row, the other rows computed, and the row
/// reported by `take_label_status` (once: the read clears it); with the check off, NaN in that
/// row and nothing reported.
#[test]
fn bad_label_is_an_error() {
    let Some((head, stream)) = gpu_or_skip("gpu_fwd::bad_label_is_an_error") else { return };
    let (t, v, d) = (5, 100, 64);
    let case = Case::generate(1, t, v, d, &Structure::default());
    let mut labels: Vec<i32> = case.labels.iter().map(|&l| l as i32).collect();
    labels[3] = -7;
    labels[2] = v as i32;
    labels[0] = 0;
    labels[4] = 1;
    let h = upload_bf16(&stream, &case.h).unwrap();
    let w = upload_bf16(&stream, &case.w).unwrap();
    let lab = upload(&stream, &labels).unwrap();
    let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    assert!(head.take_label_status(&stream).is_ok(), "no deferred check ran yet");
    for check_labels in [LabelCheck::Sync, LabelCheck::Deferred, LabelCheck::Off] {
        poison(&stream, &mut lp).unwrap();
        poison(&stream, &mut lse).unwrap();
        let r = head.forward(
            &stream,
            &FwdInputs { h: &h, w: &w, labels: &lab, problem: Problem::new(t, v, d) },
            &FwdOptions { check_labels, ..Default::default() },
            FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: None },
        );
        let got = download_f32(&stream, &lp).unwrap();
        let status = head.take_label_status(&stream);
        if check_labels == LabelCheck::Sync {
            assert!(matches!(r, Err(lmhead::Error::BadLabel { row: Some(2), label: Some(l) }) if l == v as i64), "{r:?}");
            assert!(got.iter().all(|x| x.is_nan()), "a refused call wrote its outputs: {got:?}");
        } else {
            assert!(r.is_ok(), "{check_labels:?}: {r:?}");
            assert!(got[2].is_nan() && got[3].is_nan(), "{check_labels:?}: bad-label rows must be NaN, got {got:?}");
            assert!(got[0].is_finite() && got[4].is_finite(), "{check_labels:?}: {got:?}");
        }
        if check_labels == LabelCheck::Deferred {
            assert!(matches!(status, Err(lmhead::Error::BadLabel { row: Some(2), label: None })), "{status:?}");
        } else {
            assert!(status.is_ok(), "{check_labels:?} recorded a deferred status: {status:?}");
        }
        assert!(head.take_label_status(&stream).is_ok(), "the read clears the status");
    }
    // Good labels under the deferred check report nothing.
    let good: Vec<i32> = (0..t as i32).collect();
    let good = upload(&stream, &good).unwrap();
    head.forward(
        &stream,
        &FwdInputs { h: &h, w: &w, labels: &good, problem: Problem::new(t, v, d) },
        &FwdOptions { check_labels: LabelCheck::Deferred, ..Default::default() },
        FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: None },
    )
    .unwrap();
    assert!(head.take_label_status(&stream).is_ok());
}
