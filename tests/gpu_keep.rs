//! GPU parity of the kept-logits mode (`lmhead::keep`; skipped without a CUDA driver): a forward
//! that keeps the logits (`FwdOptions::keep_logits`) and a backward that forms the d-logits of
//! the kept rows from them (`BwdInputs::kept`), against the f64 reference and against the same
//! calls without the mode.
//!
//! Cases from the run seed (printed; `LMHEAD_SEED` replays): tile edges (t = 1, 127, 128, 129,
//! 300; v = 128k + 3; d not a multiple of 64), budgets that keep every row, whole tiles of them
//! (256 of 700, 128 of 129) or none, chunk widths whose starts are and are not multiples of 8
//! (the kept kernel's vector and scalar loads), ignored rows (dense and compacted, `Compaction`
//! `Off` and `Always`, so that a compacted forward leaves their kept rows unwritten), zero
//! upstream gradients on labelled rows, temperatures, the log-prob and entropy gradients alone
//! and together, peaked rows (`logit_std` 4, planted labels) and rows shifted to logits ±290,
//! the `mma.sync` and sm90 forwards and d-logits and bf16 / f32 outputs. TP = 2 in process: each
//! rank keeps its shard's logits.
//!
//! Every output, and the kept buffer, is poisoned (NaN bytes) before each call. Per case:
//! 1. the forward's log-prob, lse and entropy with the mode are bitwise those without (the
//!    `_keep` entry folds what the plain one folds); `kept_rows` is `keep::rows` of the budget;
//! 2. the kept logits of sampled computed rows, decoded (`keep::decode`, the format of
//!    `lmhead_core::kept`): each group maximum the f64 maximum within the tensor cores'
//!    accumulation bound `2⁻²²·(d/16 + 4)·Σ|h_k w_k|` (`tests/gpu_fwd.rs`), each `q` within
//!    fp16's rounding of `2^{y − g}` at that bound, exactly 1 at its group's maximum, and the
//!    label's raw logit within the bound;
//! 3. `dh` and `dW` with the mode, and without, each within `gpu_bwd`'s thresholds of the f64
//!    reference (6e-3 bf16 / 4e-3 f32 of `max(‖ref‖, ‖rss‖)`), and the two within that of each
//!    other; ignored rows of `dh` exactly zero; the backward's `kept_rows` as expected.
//!
//! The d-logits of a kept row are the same function (`RowCoeffs::dlogit`) as the recompute's, of
//! `p` within fp16's rounding of the f32 one, so most of them round to the same bf16 as the
//! recompute's; the line of each case prints the share of equal bits (`dh_same`).

use std::sync::Arc;

use lmhead::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use lmhead::keep::{self, Kept};
use lmhead::testing::{download_bf16, poison, upload, upload_bf16};
use lmhead::tp::{Communicator, LocalComm, ReduceDh, Shard, TpBackward};
use lmhead::{
    bf16, BwdConfigs, BwdInputs, BwdOptions, Choice, Compaction, Family, FwdInputs, FwdOptions, FwdOutputs, GradOut, LmHead, Problem,
};
use lmhead_reference::rng::Rng;
use lmhead_reference::{backward_dh_rows_rss, backward_dw_rows_rss, forward, Case, Grads, Structure, IGNORE_INDEX};
use lmhead_tests::{case_seed, check_rel_l2, check_rel_l2_terms, fixed_or_auto, gpu_or_skip, run_seed};

const BF16_REL_L2: f64 = 6e-3;
const F32_REL_L2: f64 = 4e-3;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Upstream {
    LogProb,
    Entropy,
    Both,
}

#[derive(Clone, Copy, Debug)]
enum Budget {
    All,
    /// Bytes for this many rows (the call keeps the whole tiles of them).
    Rows(usize),
}

#[derive(Clone, Debug)]
struct KeepCase {
    t: usize,
    v: usize,
    d: usize,
    s: Structure,
    budget: Budget,
    up: Upstream,
    fwd: Choice,
    bwd: BwdConfigs,
    chunk: Option<usize>,
    compaction: Compaction,
    /// Fraction of labelled rows whose upstream gradients are exactly zero.
    zero_grads: f64,
    /// Fraction of rows shifted to logits ±290 (`h[r][0] = ±290`, `W`'s column 0 is 1).
    shifted: f64,
    f32_out: bool,
}

impl KeepCase {
    fn new(t: usize, v: usize, d: usize) -> Self {
        Self {
            t,
            v,
            d,
            s: Structure { all_negative: 0.0, huge: 0.0, ..Structure::default() },
            budget: Budget::All,
            up: Upstream::Both,
            fwd: Choice::Fallback,
            bwd: BwdConfigs::all(Choice::Fallback),
            chunk: None,
            compaction: Compaction::Off,
            zero_grads: 0.0,
            shifted: 0.0,
            f32_out: false,
        }
    }
}

/// The first candidate of `f` that `pick` accepts, where the module under test holds it (an
/// `Sm90` config under `LMHEAD_TEST_MODULE=portable` becomes `Choice::Auto`: [`fixed_or_auto`]).
fn first(f: Family, pick: impl Fn(&lmhead::TileConfig) -> bool) -> Choice {
    fixed_or_auto(*f.candidates().iter().find(|c| pick(c)).expect("a matching candidate"))
}

fn sm90_fwd() -> Choice {
    first(Family::Fwd, |c| c.is_sm90())
}

fn sm90_bwd() -> BwdConfigs {
    let reg = |c: &lmhead::TileConfig| c.is_sm90() && !c.mainloop.tma_store();
    BwdConfigs { dlogits: first(Family::BwdDlogits, reg), dh: first(Family::BwdDh, reg), dw: first(Family::BwdDw, reg) }
}

fn tma_store_bwd() -> BwdConfigs {
    let st = |c: &lmhead::TileConfig| c.mainloop.tma_store();
    BwdConfigs { dlogits: first(Family::BwdDlogits, st), dh: first(Family::BwdDh, st), ..sm90_bwd() }
}

/// bf16 bits of `x` (exact for ±290).
fn bf16_bits(x: f32) -> u16 {
    bf16::from_f32(x).to_bits()
}

/// Forward outputs on the host.
struct Fwd {
    lp: Vec<f32>,
    lse: Vec<f32>,
    ent: Vec<f32>,
    kept_rows: usize,
}

struct Grad {
    dh: Vec<f64>,
    dw: Vec<f64>,
    kept_rows: usize,
    rows: usize,
}

fn f32_out(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<f32> {
    let mut b = stream.alloc_zeros(n.max(1)).unwrap();
    poison(stream, &mut b).unwrap();
    b
}

/// The inputs of one case on the device.
struct Dev {
    h: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    labels: CudaSlice<i64>,
    gl: CudaSlice<f32>,
    ge: CudaSlice<f32>,
}

fn fwd_call(
    (head, stream): (&LmHead, &Arc<CudaStream>),
    x: &Dev,
    p: Problem,
    opts: &FwdOptions,
    kept: Option<&mut CudaSlice<f32>>,
    tp: Option<(&dyn Communicator, Shard)>,
) -> Fwd {
    let (mut lp, mut lse, mut ent) = (f32_out(stream, p.t), f32_out(stream, p.t), f32_out(stream, p.t));
    let inp = FwdInputs { h: &x.h, w: &x.w, labels: &x.labels, problem: p };
    let out = FwdOutputs {
        logprob: &mut lp,
        lse: &mut lse,
        entropy: Some(&mut ent),
        kept: kept.map(|k| k as &mut dyn lmhead::cudarc::driver::DevicePtrMut<f32>),
    };
    let r = match tp {
        Some((c, shard)) => head.forward_tp(c, stream, &inp, shard, opts, out),
        None => head.forward(stream, &inp, opts, out),
    }
    .unwrap();
    let get = |b: &CudaSlice<f32>| stream.clone_dtoh(b).unwrap()[..p.t].to_vec();
    Fwd { lp: get(&lp), lse: get(&lse), ent: get(&ent), kept_rows: r.kept_rows }
}

fn bwd_call(
    (head, stream): (&LmHead, &Arc<CudaStream>),
    x: &Dev,
    p: Problem,
    f: &Fwd,
    (up, opts, f32_out): (Upstream, &BwdOptions, bool),
    kept: Option<(&CudaSlice<f32>, usize)>,
    tp: Option<(&dyn Communicator, Shard)>,
) -> Grad {
    let (lse, ent) = (upload(stream, &f.lse).unwrap(), upload(stream, &f.ent).unwrap());
    let (use_lp, use_ent) = (up != Upstream::Entropy, up != Upstream::LogProb);
    let bx = BwdInputs {
        h: &x.h,
        w: &x.w,
        labels: &x.labels,
        lse: &lse,
        entropy: use_ent.then_some(&ent as &dyn DevicePtr<f32>),
        grad_logprob: use_lp.then_some(&x.gl as &dyn DevicePtr<f32>),
        grad_entropy: use_ent.then_some(&x.ge as &dyn DevicePtr<f32>),
        problem: p,
        kept: kept.map(|(k, rows)| Kept { logits: k, rows }),
    };
    let (mut dh32, mut dw32) = (f32_out_buf(stream, p.t * p.d), f32_out_buf(stream, p.v * p.d));
    let (mut dh16, mut dw16): (CudaSlice<bf16>, CudaSlice<bf16>) =
        (stream.alloc_zeros(p.t * p.d).unwrap(), stream.alloc_zeros(p.v * p.d).unwrap());
    poison(stream, &mut dh16).unwrap();
    poison(stream, &mut dw16).unwrap();
    let (dh, dw) =
        if f32_out { (GradOut::F32(&mut dh32), GradOut::F32(&mut dw32)) } else { (GradOut::Bf16(&mut dh16), GradOut::Bf16(&mut dw16)) };
    let r = match tp {
        Some((c, shard)) => head.backward_tp(TpBackward { comm: c, shard, reduce: ReduceDh::AllReduce }, stream, &bx, opts, dh, Some(dw)),
        None => head.backward(stream, &bx, opts, dh, Some(dw)),
    }
    .unwrap();
    let (dh, dw) = if f32_out {
        let g = |b: &CudaSlice<f32>| stream.clone_dtoh(b).unwrap().into_iter().map(f64::from).collect::<Vec<_>>();
        (g(&dh32), g(&dw32))
    } else {
        (download_bf16(stream, &dh16).unwrap(), download_bf16(stream, &dw16).unwrap())
    };
    Grad { dh, dw, kept_rows: r.kept_rows, rows: r.rows }
}

fn f32_out_buf(stream: &Arc<CudaStream>, n: usize) -> CudaSlice<f32> {
    f32_out(stream, n)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The case's inputs with the ±290 rows planted (returns the case and those rows).
fn generate(c: &KeepCase, seed: u64) -> Case {
    let mut case = Case::generate(seed, c.t, c.v, c.d, &c.s);
    let mut rng = Rng::new(seed ^ 0x290);
    for r in 0..c.t {
        if rng.uniform() < c.shifted {
            case.h[r * c.d] = bf16_bits(if rng.uniform() < 0.5 { 290.0 } else { -290.0 });
        }
    }
    case
}

fn run(head: &LmHead, stream: &Arc<CudaStream>, c: &KeepCase, seed: u64) -> String {
    let case = generate(c, seed);
    let (t, v, d) = (c.t, c.v, c.d);
    let temp = c.s.temperature as f32;
    let desc = format!("{c:?} seed={seed}");
    let p = Problem::new(t, v, d);
    let mut rng = Rng::new(seed ^ 0xD1CE);
    let mut gl: Vec<f32> = (0..t).map(|_| rng.normal() as f32).collect();
    let mut ge: Vec<f32> = (0..t).map(|_| rng.normal() as f32).collect();
    for i in 0..t {
        if rng.uniform() < c.zero_grads {
            (gl[i], ge[i]) = (0.0, 0.0);
        }
    }
    let x = Dev {
        h: upload_bf16(stream, &case.h).unwrap(),
        w: upload_bf16(stream, &case.w).unwrap(),
        labels: upload(stream, &case.labels).unwrap(),
        gl: upload(stream, &gl).unwrap(),
        ge: upload(stream, &ge).unwrap(),
    };
    let budget = match c.budget {
        Budget::All => usize::MAX,
        Budget::Rows(n) => n * keep::row_bytes(v),
    };
    let want_rows = keep::rows(t, v, budget);
    let fo = FwdOptions { temperature: temp, config: c.fwd, compaction: c.compaction, ..Default::default() };
    let f0 = fwd_call((head, stream), &x, p, &fo, None, None);
    let mut kept = f32_out(stream, keep::len(t, v, budget));
    let f1 = fwd_call((head, stream), &x, p, &FwdOptions { keep_logits: budget, ..fo.clone() }, Some(&mut kept), None);
    assert_eq!((f0.kept_rows, f1.kept_rows), (0, want_rows), "kept rows [{desc}]");
    assert_eq!(bits(&f1.lp), bits(&f0.lp), "log-prob with the mode [{desc}]");
    assert_eq!(bits(&f1.lse), bits(&f0.lse), "lse with the mode [{desc}]");
    assert_eq!(bits(&f1.ent), bits(&f0.ent), "entropy with the mode [{desc}]");
    // 2. The kept logits of sampled computed rows, decoded (`keep::decode`): each group's
    //    maximum the f64 maximum within the accumulation bound, each q within fp16's rounding of
    //    2^{y − g} at that bound, 1 at a group's maximum, and the label's raw logit.
    let kh = stream.clone_dtoh(&kept).unwrap();
    let computed = |r: usize| c.compaction == Compaction::Off || case.labels[r] != IGNORE_INDEX;
    let sample_rows: Vec<usize> =
        [0, want_rows / 2, want_rows.saturating_sub(1)].into_iter().filter(|&r| r < want_rows && computed(r)).collect();
    let hf = |r: usize, k: usize| bf16::from_bits(case.h[r * d + k]).to_f64();
    let wf = |j: usize, k: usize| bf16::from_bits(case.w[j * d + k]).to_f64();
    let scale2 = (std::f32::consts::LOG2_E * (1.0 / temp)) as f64;
    for &r in &sample_rows {
        let dots: Vec<(f64, f64)> = (0..v)
            .map(|j| {
                let (dot, mag) = (0..d).fold((0.0, 0.0), |(s, m), k| (s + hf(r, k) * wf(j, k), m + (hf(r, k) * wf(j, k)).abs()));
                (dot, f64::powi(2.0, -22) * (d as f64 / 16.0 + 4.0) * mag + 1e-30)
            })
            .collect();
        for g0 in (0..v).step_by(keep::GROUP) {
            let group = g0..(g0 + keep::GROUP).min(v);
            let (gmax, gtol) = group.clone().map(|j| dots[j]).fold((f64::NEG_INFINITY, 0.0f64), |(m, t), (x, e)| (m.max(x), t.max(e)));
            let (_, g2) = keep::decode(&kh, want_rows, v, r, g0);
            let g2 = g2 as f64;
            let tol = gtol * scale2 + g2.abs() * f64::powi(2.0, -23);
            assert!((g2 - gmax * scale2).abs() <= tol, "kept group max [{r}][{g0}] = {g2:e}, want {:e} ± {tol:e} [{desc}]", gmax * scale2);
            let mut top = 0.0f32;
            for j in group {
                let (q, _) = keep::decode(&kh, want_rows, v, r, j);
                let want = (dots[j].0 * scale2 - g2).exp2();
                let rel = f64::powi(2.0, -11) + 2.0 * dots[j].1 * scale2 + f64::powi(2.0, -19);
                let tol = want * rel + f64::powi(2.0, -24);
                assert!((q as f64 - want).abs() <= tol, "kept q [{r}][{j}] = {q:e}, want {want:e} ± {tol:e} [{desc}]");
                top = top.max(q);
            }
            assert_eq!(top, 1.0, "kept q of group [{r}][{g0}]: its maximum is 1 [{desc}]");
        }
        let l = case.labels[r];
        if l != IGNORE_INDEX {
            let (dot, tol) = dots[l as usize];
            let got = keep::label_logit(&kh, want_rows, v, r) as f64;
            assert!((got - dot).abs() <= tol, "kept label logit [{r}] = {got:e}, want {dot:e} ± {tol:e} [{desc}]");
        }
    }
    // 3. The backward with the mode and without, against the reference and each other.
    let bo = BwdOptions { temperature: temp, chunk: c.chunk, config: c.bwd, compaction: c.compaction, ..Default::default() };
    let g0 = bwd_call((head, stream), &x, p, &f0, (c.up, &bo, c.f32_out), None, None);
    let g1 = bwd_call((head, stream), &x, p, &f1, (c.up, &bo, c.f32_out), Some((&kept, want_rows)), None);
    assert_eq!(g0.kept_rows, 0, "[{desc}]");
    if c.compaction == Compaction::Off {
        assert_eq!(g1.kept_rows, want_rows.min(g1.rows), "backward kept rows [{desc}]");
    } else {
        assert!(g1.kept_rows <= want_rows && g1.kept_rows <= g1.rows, "backward kept rows {} [{desc}]", g1.kept_rows);
    }
    let inp = case.inputs();
    let r = forward(&inp);
    let (use_lp, use_ent) = (c.up != Upstream::Entropy, c.up != Upstream::LogProb);
    let (gl64, ge64): (Vec<f64>, Vec<f64>) = (gl.iter().map(|&x| x as f64).collect(), ge.iter().map(|&x| x as f64).collect());
    let g = Grads { logprob: use_lp.then_some(&gl64[..]), entropy: use_ent.then_some(&ge64[..]) };
    let rows: Vec<usize> = (0..t).collect();
    let vrows: Vec<usize> = (0..v).collect();
    let (rdh, sdh) = backward_dh_rows_rss(&inp, &r.lse, &r.entropy, &g, &rows);
    let (rdw, sdw) = backward_dw_rows_rss(&inp, &r.lse, &r.entropy, &g, &vrows);
    let (rdh, sdh, rdw, sdw) = (rdh.concat(), sdh.concat(), rdw.concat(), sdw.concat());
    let lim = if c.f32_out { F32_REL_L2 } else { BF16_REL_L2 };
    let active = |i: usize| case.labels[i] != IGNORE_INDEX && ((use_lp && gl[i] != 0.0) || (use_ent && ge[i] != 0.0));
    let any_active = (0..t).any(active);
    let mut line = String::new();
    for (name, gr) in [("off", &g0), ("on", &g1)] {
        for i in 0..t {
            if case.labels[i] == IGNORE_INDEX {
                assert!(gr.dh[i * d..(i + 1) * d].iter().all(|&x| x == 0.0), "ignored row {i} of dh ({name}) is not zero [{desc}]");
            }
        }
        if any_active {
            let a = check_rel_l2_terms("dh", &format!("{name} {desc}"), &gr.dh, &rdh, &sdh, lim).0.rel_l2;
            let b = check_rel_l2_terms("dW", &format!("{name} {desc}"), &gr.dw, &rdw, &sdw, lim).0.rel_l2;
            line += &format!(" {name}: dh {a:.2e} dW {b:.2e};");
        } else {
            assert!(gr.dh.iter().chain(&gr.dw).all(|&x| x == 0.0), "no active row: gradients must be zero ({name}) [{desc}]");
        }
    }
    if any_active {
        check_rel_l2("dh on vs off", &desc, &g1.dh, &g0.dh, lim);
        check_rel_l2("dW on vs off", &desc, &g1.dw, &g0.dw, lim);
    }
    let same = g1.dh.iter().zip(&g0.dh).filter(|(a, b)| a == b).count() as f64 / g0.dh.len().max(1) as f64;
    format!(
        "keep t={t} v={v} d={d} {:?} budget={:?} kept={want_rows} bwd_kept={} rows={} chunk={:?} {:?}{line} dh_same={same:.3}",
        c.up, c.budget, g1.kept_rows, g1.rows, c.chunk, c.compaction
    )
}

fn run_all(test: &str, cases: &[KeepCase]) {
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let seed = run_seed(test);
    for (i, c) in cases.iter().enumerate() {
        let line = run(&head, &stream, c, case_seed(seed, i));
        println!("[{test}] {line}");
    }
}

/// Tile edges of the token and vocab tiles, with and without the mode, every upstream.
#[test]
fn tile_edges() {
    let mut cases = Vec::new();
    for (i, &t) in [1usize, 127, 128, 129, 300].iter().enumerate() {
        for (j, &(fwd, bwd)) in
            [(Choice::Fallback, BwdConfigs::all(Choice::Fallback)), (sm90_fwd(), sm90_bwd()), (sm90_fwd(), tma_store_bwd())]
                .iter()
                .enumerate()
        {
            let mut c = KeepCase::new(t, 128 * 9 + 3, if i % 2 == 0 { 200 } else { 128 });
            c.fwd = fwd;
            c.bwd = bwd;
            c.up = [Upstream::LogProb, Upstream::Entropy, Upstream::Both][(i + j) % 3];
            c.f32_out = (i + j) % 2 == 1;
            cases.push(c);
        }
    }
    run_all("gpu_keep::tile_edges", &cases);
}

/// Budgets that keep whole tiles of the rows (the rest recomputed) or none, and chunks whose
/// starts are not multiples of 8 (the kept kernel's scalar loads) beside ones that are.
#[test]
fn partial_budgets_and_chunks() {
    let mut cases = Vec::new();
    for (i, budget) in [Budget::Rows(300), Budget::Rows(640), Budget::Rows(127), Budget::Rows(699), Budget::All].into_iter().enumerate() {
        for (j, chunk) in [None, Some(1000), Some(1001)].into_iter().enumerate() {
            let mut c = KeepCase::new(700, 4099, 136);
            c.budget = budget;
            c.chunk = chunk;
            if (i + j) % 2 == 1 {
                (c.fwd, c.bwd) = (sm90_fwd(), sm90_bwd());
            }
            c.up = [Upstream::Both, Upstream::LogProb, Upstream::Entropy][(i + j) % 3];
            cases.push(c);
        }
    }
    let mut c = KeepCase::new(129, 1031, 64);
    c.budget = Budget::Rows(128);
    cases.push(c);
    run_all("gpu_keep::partial_budgets_and_chunks", &cases);
}

/// Ignored rows and zero upstream gradients, dense and compacted, with whole and partial budgets
/// (a compacted forward does not write its ignored rows' kept logits; a compacted backward reads
/// its kept rows through its row map).
#[test]
fn ignored_rows_and_compaction() {
    let mut cases = Vec::new();
    for (i, compaction) in [Compaction::Off, Compaction::Always].into_iter().enumerate() {
        for (j, budget) in [Budget::All, Budget::Rows(512), Budget::Rows(128)].into_iter().enumerate() {
            let mut c = KeepCase::new(1100, 2053, 128);
            c.s.ignored = 0.3;
            c.zero_grads = 0.1;
            c.compaction = compaction;
            c.budget = budget;
            c.chunk = if j == 1 { Some(777) } else { None };
            if (i + j) % 2 == 0 {
                (c.fwd, c.bwd) = (sm90_fwd(), tma_store_bwd());
            }
            cases.push(c);
        }
    }
    // Every row ignored: nothing is written, nothing read.
    let mut c = KeepCase::new(200, 1024, 64);
    c.s.ignored = 1.0;
    cases.push(c);
    let mut c = KeepCase::new(200, 1024, 64);
    c.s.ignored = 1.0;
    c.compaction = Compaction::Always;
    cases.push(c);
    run_all("gpu_keep::ignored_rows_and_compaction", &cases);
}

/// Temperatures, peaked rows (`logit_std` 4, a fifth of the labels planted) and rows shifted to
/// logits ±290.
#[test]
fn temperature_peaked_and_shifted_rows() {
    let mut cases = Vec::new();
    for (i, temp) in [0.7, 1.0, 1.6].into_iter().enumerate() {
        let mut c = KeepCase::new(384, 3001, 128);
        c.s = Structure { logit_std: 4.0, planted: 0.2, all_negative: 0.0, huge: 0.0, ignored: 0.05, temperature: temp };
        c.shifted = 0.2;
        c.budget = if i == 1 { Budget::Rows(256) } else { Budget::All };
        if i != 0 {
            (c.fwd, c.bwd) = (sm90_fwd(), sm90_bwd());
        }
        c.f32_out = i == 2;
        cases.push(c);
    }
    run_all("gpu_keep::temperature_peaked_and_shifted_rows", &cases);
}

/// TP = 2 in process: each rank keeps its shard's logits (whole and partial budgets); the ranks'
/// outputs with the mode equal those without, and `dh` (all-reduced) and the `dW` shards agree
/// with the unsharded call without the mode within 1e-3 relative L2 (f32 outputs; `gpu_active`
/// holds the same comparison without the mode to 1e-4, and a kept logit that differs in its
/// last bit from the recompute's may round its bf16 d-logit the other way).
#[test]
fn tp_two_ranks_keep_their_shards() {
    let test = "gpu_keep::tp_two_ranks_keep_their_shards";
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let seed = run_seed(test);
    let (t, v, d) = (640, 2003, 128);
    for (i, (budget_rows, compaction)) in
        [(usize::MAX, Compaction::Off), (256, Compaction::Off), (usize::MAX, Compaction::Always)].into_iter().enumerate()
    {
        let s = case_seed(seed, i);
        let case = Case::generate(s, t, v, d, &Structure { huge: 0.0, all_negative: 0.0, ignored: 0.2, ..Default::default() });
        let mut rng = Rng::new(s ^ 7);
        let gl: Vec<f32> = (0..t).map(|_| rng.normal() as f32).collect();
        let desc = format!("t={t} v={v} d={d} budget rows {budget_rows} {compaction:?} seed={s}");
        let fo = FwdOptions { compaction, ..Default::default() };
        let bo = BwdOptions { compaction, chunk: Some(600), ..Default::default() };
        let whole = {
            let x = Dev {
                h: upload_bf16(&stream, &case.h).unwrap(),
                w: upload_bf16(&stream, &case.w).unwrap(),
                labels: upload(&stream, &case.labels).unwrap(),
                gl: upload(&stream, &gl).unwrap(),
                ge: upload(&stream, &gl).unwrap(),
            };
            let p = Problem::new(t, v, d);
            let f = fwd_call((&head, &stream), &x, p, &fo, None, None);
            (bwd_call((&head, &stream), &x, p, &f, (Upstream::Both, &bo, true), None, None), f)
        };
        let comms = LocalComm::group(2);
        let shards: Vec<Shard> = (0..2).map(|r| Shard::even(r, 2, v).0).collect();
        let outs: Vec<(Fwd, Fwd, Grad, usize, usize)> = std::thread::scope(|sc| {
            let hs: Vec<_> = comms
                .iter()
                .zip(&shards)
                .enumerate()
                .map(|(r, (comm, &shard))| {
                    let (case, gl, fo, bo) = (&case, &gl, &fo, &bo);
                    sc.spawn(move || {
                        let head = LmHead::new(0).unwrap();
                        let stream = head.gpu().context().new_stream().unwrap();
                        let len = Shard::even(r, 2, v).1;
                        let (v0, v1) = (shard.v_begin, shard.v_begin + len);
                        let x = Dev {
                            h: upload_bf16(&stream, &case.h).unwrap(),
                            w: upload_bf16(&stream, &case.w[v0 * d..v1 * d]).unwrap(),
                            labels: upload(&stream, &case.labels).unwrap(),
                            gl: upload(&stream, gl).unwrap(),
                            ge: upload(&stream, gl).unwrap(),
                        };
                        let p = Problem::new(t, len, d);
                        let budget = if budget_rows == usize::MAX { usize::MAX } else { budget_rows * keep::row_bytes(len) };
                        let tp = Some((comm as &dyn Communicator, shard));
                        let f0 = fwd_call((&head, &stream), &x, p, fo, None, tp);
                        let mut kept = f32_out(&stream, keep::len(t, len, budget));
                        let f1 = fwd_call((&head, &stream), &x, p, &FwdOptions { keep_logits: budget, ..fo.clone() }, Some(&mut kept), tp);
                        let k = f1.kept_rows;
                        let g = bwd_call((&head, &stream), &x, p, &f1, (Upstream::Both, bo, true), Some((&kept, k)), tp);
                        (f0, f1, g, v0, v1)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let (gw, fw) = whole;
        for (r, (f0, f1, g, v0, v1)) in outs.iter().enumerate() {
            let what = format!("{desc} rank {r}");
            let want = if budget_rows == usize::MAX { t } else { budget_rows };
            assert_eq!(f1.kept_rows, want, "[{what}]");
            assert_eq!(bits(&f1.lp), bits(&f0.lp), "log-prob with the mode [{what}]");
            assert_eq!(bits(&f1.ent), bits(&f0.ent), "entropy with the mode [{what}]");
            let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 2e-5 || (x == y));
            assert!(close(&f1.lp, &fw.lp), "log-prob against the unsharded call [{what}]");
            check_rel_l2("dh", &what, &g.dh, &gw.dh, 1e-3);
            check_rel_l2("dW shard", &what, &g.dw, &gw.dw[v0 * d..v1 * d], 1e-3);
        }
        println!(
            "[{test}] tp=2 {desc}: kept {:?} bwd kept {:?}",
            outs.iter().map(|o| o.1.kept_rows).collect::<Vec<_>>(),
            outs.iter().map(|o| o.2.kept_rows).collect::<Vec<_>>()
        );
    }
}

/// Bad kept-logits arguments on the device path are typed errors before anything runs (the
/// buffers stay poisoned).
#[test]
fn bad_kept_arguments_are_refused() {
    let test = "gpu_keep::bad_kept_arguments_are_refused";
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let (t, v, d) = (256, 1000, 64);
    let case = Case::generate(run_seed(test), t, v, d, &Structure::default());
    let x = Dev {
        h: upload_bf16(&stream, &case.h).unwrap(),
        w: upload_bf16(&stream, &case.w).unwrap(),
        labels: upload(&stream, &case.labels).unwrap(),
        gl: upload(&stream, &vec![1.0f32; t]).unwrap(),
        ge: upload(&stream, &vec![1.0f32; t]).unwrap(),
    };
    let p = Problem::new(t, v, d);
    let all = FwdOptions { keep_logits: usize::MAX, ..Default::default() };
    let (mut lp, mut lse) = (f32_out(&stream, t), f32_out(&stream, t));
    let inp = FwdInputs { h: &x.h, w: &x.w, labels: &x.labels, problem: p };
    let r = head.forward(&stream, &inp, &all, FwdOutputs { logprob: &mut lp, lse: &mut lse, entropy: None, kept: None });
    assert!(matches!(r, Err(lmhead::Error::Invalid(_))), "keep without a buffer: {r:?}");
    let mut short = f32_out(&stream, keep::len(t, v, usize::MAX) - 1);
    let r = head.forward(&stream, &inp, &all, FwdOutputs { logprob: &mut lp, lse: &mut lse, entropy: None, kept: Some(&mut short) });
    assert!(matches!(r, Err(lmhead::Error::Length { .. })), "short buffer: {r:?}");
    assert!(stream.clone_dtoh(&lp).unwrap().iter().all(|x| x.is_nan()), "a refused call wrote its outputs");
    let kept = f32_out(&stream, keep::len(t, v, usize::MAX));
    let lse_d = upload(&stream, &vec![0.0f32; t]).unwrap();
    for rows in [t + 128, 200] {
        let bx = BwdInputs {
            h: &x.h,
            w: &x.w,
            labels: &x.labels,
            lse: &lse_d,
            entropy: None,
            grad_logprob: Some(&x.gl),
            grad_entropy: None,
            problem: p,
            kept: Some(Kept { logits: &kept, rows }),
        };
        let mut dh = f32_out(&stream, t * d);
        let r = head.backward(&stream, &bx, &BwdOptions::default(), GradOut::F32(&mut dh), None);
        assert!(r.is_err(), "kept rows {rows}: {r:?}");
        assert!(stream.clone_dtoh(&dh).unwrap().iter().all(|x| x.is_nan()), "a refused backward wrote dh");
    }
}
