//! GPU parity of the active rows (`lmhead::Compaction`; skipped without a CUDA driver): forward and
//! backward that compute only the rows the loss reads, under masks of every layout — all rows,
//! none, one row, spans on tile and block edges (127, 128, 129 rows at 64-row boundaries, a span
//! across the count kernel's 2048-row block edge, the last row), a suffix, packed multi-turn
//! turns, scattered rows — with `i32` and `i64` labels, with and without entropy, bf16 and f32
//! `dh`/`dW`, and (backward) zero upstream gradients on some labelled rows.
//!
//! Each case, from the run seed (printed; `LMHEAD_SEED` replays), outputs poisoned before every
//! call, runs with `Compaction::Always` (so that the small test shapes compact too; the report's
//! `rows` must be the active count) and is checked three ways:
//! 1. against the f64 reference on the active rows (thresholds of `gpu_fwd` per row and of
//!    `gpu_bwd` in L2, see their module docs); skipped rows exactly: log-prob 0, entropy 0, lse
//!    `+∞`, `dh` 0, and with no active row `dW` 0;
//! 2. bitwise against the dense call on the compacted inputs (the rows gathered on the host: the
//!    same kernels at the same configs must give the same bits);
//! 3. against the dense call on all rows (`Compaction::Off`, the masked rows' labels ignored):
//!    forward within twice the per-row reference tolerance (both are within it; the plans
//!    differ), backward each against the reference and the two within twice the L2 threshold.
//!
//! Tensor parallelism (TP = 2 in process, `LocalComm`) against the unsharded run, including ranks
//! whose zero-gradient rows differ (they compact the union); context parallelism (two token
//! slices) against the whole call.

use std::sync::Arc;

use lmhead::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use lmhead::testing::{poison, upload, upload_bf16};
use lmhead::tp::{Communicator, LocalComm, ReduceDh, Shard, TpBackward};
use lmhead::{
    bf16, BwdConfigs, BwdInputs, BwdOptions, BwdReport, Choice, Compaction, Family, FwdInputs, FwdOptions, FwdOutputs, FwdReport, GradOut,
    LabelType, LmHead, Problem,
};
use lmhead_reference::rng::Rng;
use lmhead_reference::{backward_dh_rows_rss, backward_dw_rows_rss, forward, forward_rows, masks, Case, Grads, Structure, IGNORE_INDEX};
use lmhead_tests::{case_seed, check, check_rel_l2, check_rel_l2_terms, fixed_or_auto, fwd_acc_tol, gpu_or_skip, run_seed};

/// The masks of every test, over `t` rows (`t` above 2048 + 20, so that a span crosses the count
/// kernel's block edge).
fn layouts(t: usize, seed: u64) -> Vec<(&'static str, Vec<bool>)> {
    vec![
        ("all", masks::all(t)),
        ("none", vec![false; t]),
        ("one", masks::spans(t, &[(t / 2 + 3, 1)])),
        ("tile edges", masks::spans(t, &[(64, 127), (256, 128), (1024, 129), (2040, 20), (t - 1, 1)])),
        ("suffix", masks::suffix(t, 0.6)),
        ("multi-turn", masks::packed_turns(t, 0.4, 8, (100, 400), (50, 300), seed)),
        ("scattered", masks::random(t, 0.3, seed ^ 5)),
    ]
}

fn active_rows(mask: &[bool]) -> Vec<usize> {
    (0..mask.len()).filter(|&i| mask[i]).collect()
}

/// Rows `rows` of `x` (rows of `d` elements).
fn gather<T: Copy>(x: &[T], rows: &[usize], d: usize) -> Vec<T> {
    rows.iter().flat_map(|&r| x[r * d..(r + 1) * d].iter().copied()).collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

/// The first compiled sm90 forward candidate.
fn sm90_fwd() -> Choice {
    // (`Choice::Auto` under the portable module: `fixed_or_auto`.)
    fixed_or_auto(*Family::Fwd.candidates().iter().find(|c| c.is_sm90()).expect("an sm90 candidate"))
}

/// Forward outputs on the host and the report.
struct Fwd {
    lp: Vec<f32>,
    lse: Vec<f32>,
    ent: Vec<f32>,
    report: FwdReport,
}

/// One forward on `(h, w, labels)` with poisoned outputs (entropy only when `entropy`; its
/// buffer must then stay poisoned otherwise).
fn fwd_on<L: LabelType>(
    gpu: (&LmHead, &Arc<CudaStream>),
    (h, w): (&[u16], &[u16]),
    labels: &CudaSlice<L>,
    p: Problem,
    opts: &FwdOptions,
    entropy: bool,
) -> Fwd {
    let (head, stream) = gpu;
    let (hd, wd) = (upload_bf16(stream, h).unwrap(), upload_bf16(stream, w).unwrap());
    let mut out: Vec<CudaSlice<f32>> = (0..3).map(|_| stream.alloc_zeros(p.t.max(1)).unwrap()).collect();
    out.iter_mut().for_each(|b| poison(stream, b).unwrap());
    let [lp, lse, ent] = &mut out[..] else { unreachable!() };
    let report = head
        .forward(
            stream,
            &FwdInputs { h: &hd, w: &wd, labels, problem: p },
            opts,
            FwdOutputs { kept: None, logprob: lp, lse, entropy: entropy.then_some(ent) },
        )
        .unwrap();
    let get = |b: &CudaSlice<f32>| stream.clone_dtoh(b).unwrap()[..p.t].to_vec();
    Fwd { lp: get(&out[0]), lse: get(&out[1]), ent: get(&out[2]), report }
}

/// [`fwd_on`] with the labels uploaded as `i64` or `i32`.
fn fwd(
    gpu: (&LmHead, &Arc<CudaStream>),
    hw: (&[u16], &[u16]),
    labels: &[i64],
    p: Problem,
    opts: &FwdOptions,
    (i64_labels, entropy): (bool, bool),
) -> Fwd {
    if i64_labels {
        fwd_on(gpu, hw, &upload(gpu.1, labels).unwrap(), p, opts, entropy)
    } else {
        let l32: Vec<i32> = labels.iter().map(|&l| l as i32).collect();
        fwd_on(gpu, hw, &upload(gpu.1, &l32).unwrap(), p, opts, entropy)
    }
}

#[test]
fn forward_active_rows() {
    let test = "gpu_active::forward_active_rows";
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let seed = run_seed(test);
    let gpu = (&head, &stream);
    let (t, v, d) = (2300, 3001, 256);
    for (i, (name, mask)) in layouts(t, seed).into_iter().enumerate() {
        let s = case_seed(seed, i);
        let case = Case::generate(s, t, v, d, &Structure { ignored: 0.0, ..Default::default() });
        let labels = masks::apply(&case.labels, &mask, IGNORE_INDEX);
        let rows = active_rows(&mask);
        let n = rows.len();
        let (i64_labels, entropy) = (i % 2 == 0, i % 3 != 1);
        let config = if i % 2 == 1 { sm90_fwd() } else { Choice::Fallback };
        let desc = format!("{name}: t={t} v={v} d={d} active={n} i64={i64_labels} ent={entropy} {config:?} seed={s}");
        let p = Problem::new(t, v, d);
        let opts = |c: Compaction| FwdOptions { config, compaction: c, ..Default::default() };
        let flags = (i64_labels, entropy);
        let a = fwd(gpu, (&case.h, &case.w), &labels, p, &opts(Compaction::Always), flags);
        assert_eq!(a.report.rows, n, "rows computed [{desc}]");
        // 1. The reference on the active rows, and the skipped rows exactly.
        let inp = lmhead_reference::Inputs { labels: &labels, ..case.inputs() };
        let r = forward_rows(&inp, &rows);
        let (rlp, rlse): (Vec<f64>, Vec<f64>) = (r.iter().map(|x| x.logprob).collect(), r.iter().map(|x| x.lse).collect());
        let mag = |k: usize| rlse[k].abs().max((rlse[k] + rlp[k]).abs());
        let lp_tol = |k: usize, _: f64| 1e-4 + fwd_acc_tol(mag(k), d);
        let ent_tol = |k: usize, x: f64| 1e-4 * x.abs().max(1.0) + fwd_acc_tol(rlse[k].abs(), d) * (1.0 + r[k].spread);
        let pick = |x: &[f32]| rows.iter().map(|&k| x[k] as f64).collect::<Vec<f64>>();
        if n > 0 {
            check("logprob", &desc, &pick(&a.lp), &rlp, &lp_tol);
            check("lse", &desc, &pick(&a.lse), &rlse, &lp_tol);
            if entropy {
                check("entropy", &desc, &pick(&a.ent), &r.iter().map(|x| x.entropy).collect::<Vec<_>>(), &ent_tol);
            }
        }
        for k in (0..t).filter(|&k| !mask[k]) {
            assert!(a.lp[k] == 0.0 && a.lse[k] == f32::INFINITY, "skipped row {k}: lp {} lse {} [{desc}]", a.lp[k], a.lse[k]);
            assert!(!entropy || a.ent[k] == 0.0, "skipped row {k}: entropy {} [{desc}]", a.ent[k]);
        }
        if !entropy {
            assert!(a.ent.iter().all(|x| x.is_nan()), "entropy written although not asked for [{desc}]");
        }
        // 2. Bitwise the dense call on the compacted inputs.
        if n > 0 {
            let lc: Vec<i64> = rows.iter().map(|&k| labels[k]).collect();
            let b = fwd(gpu, (&gather(&case.h, &rows, d), &case.w), &lc, Problem::new(n, v, d), &opts(Compaction::Always), flags);
            assert_eq!((b.report.rows, &b.report.kernel), (n, &a.report.kernel), "[{desc}]");
            assert_eq!(bits(&pick32(&a.lp, &rows)), bits(&b.lp), "logprob: compacted ≠ dense on the compacted rows [{desc}]");
            assert_eq!(bits(&pick32(&a.lse, &rows)), bits(&b.lse), "lse [{desc}]");
            if entropy {
                assert_eq!(bits(&pick32(&a.ent, &rows)), bits(&b.ent), "entropy [{desc}]");
            }
        }
        // 3. The dense call on all rows.
        let c = fwd(gpu, (&case.h, &case.w), &labels, p, &opts(Compaction::Off), flags);
        assert_eq!(c.report.rows, t, "[{desc}]");
        if n > 0 {
            let lp2 = |k: usize, x: f64| 2.0 * lp_tol(k, x);
            check("logprob vs dense", &desc, &pick(&a.lp), &pick(&c.lp), &lp2);
            check("lse vs dense", &desc, &pick(&a.lse), &pick(&c.lse), &lp2);
            if entropy {
                check("entropy vs dense", &desc, &pick(&a.ent), &pick(&c.ent), &|k, x| 2.0 * ent_tol(k, x));
            }
        }
        assert!((0..t).filter(|&k| !mask[k]).all(|k| c.lp[k] == 0.0 && (!entropy || c.ent[k] == 0.0)), "[{desc}]");
        println!("[{test}] fwd {desc}: rows {} kernel {:?}", a.report.rows, a.report.kernel);
    }
}

fn pick32(x: &[f32], rows: &[usize]) -> Vec<f32> {
    rows.iter().map(|&k| x[k]).collect()
}

/// The inputs of one backward case (host side).
struct BwdCase<'a> {
    case: &'a Case,
    labels: &'a [i64],
    lse: &'a [f32],
    ent: Option<&'a [f32]>,
    gl: Option<&'a [f32]>,
    ge: Option<&'a [f32]>,
}

/// `(dh, dW)` as f64 and the report of one backward with poisoned outputs.
fn bwd(
    gpu: (&LmHead, &Arc<CudaStream>),
    x: &BwdCase,
    p: Problem,
    opts: &BwdOptions,
    (i64_labels, f32_out): (bool, bool),
) -> (Vec<f64>, Vec<f64>, BwdReport) {
    if i64_labels {
        bwd_on(gpu, x, &upload(gpu.1, x.labels).unwrap(), p, opts, f32_out)
    } else {
        let l32: Vec<i32> = x.labels.iter().map(|&l| l as i32).collect();
        bwd_on(gpu, x, &upload(gpu.1, &l32).unwrap(), p, opts, f32_out)
    }
}

fn bwd_on<L: LabelType>(
    (head, stream): (&LmHead, &Arc<CudaStream>),
    x: &BwdCase,
    labels: &CudaSlice<L>,
    p: Problem,
    opts: &BwdOptions,
    f32_out: bool,
) -> (Vec<f64>, Vec<f64>, BwdReport) {
    let h = upload_bf16(stream, &x.case.h[..p.t * p.d]).unwrap();
    let w = upload_bf16(stream, &x.case.w).unwrap();
    let f = |v: Option<&[f32]>| v.map(|v| upload(stream, v).unwrap());
    let (lse, ent, gl, ge) = (upload(stream, x.lse).unwrap(), f(x.ent), f(x.gl), f(x.ge));
    let bx = BwdInputs {
        kept: None,
        h: &h,
        w: &w,
        labels,
        lse: &lse,
        entropy: dyn_ref(&ent),
        grad_logprob: dyn_ref(&gl),
        grad_entropy: dyn_ref(&ge),
        problem: p,
    };
    let (td, vd) = (p.t * p.d, p.v * p.d);
    if f32_out {
        let (mut dh, mut dw): (CudaSlice<f32>, CudaSlice<f32>) = (stream.alloc_zeros(td).unwrap(), stream.alloc_zeros(vd).unwrap());
        poison(stream, &mut dh).unwrap();
        poison(stream, &mut dw).unwrap();
        let r = head.backward(stream, &bx, opts, GradOut::F32(&mut dh), Some(GradOut::F32(&mut dw))).unwrap();
        let g = |b: &CudaSlice<f32>| stream.clone_dtoh(b).unwrap().into_iter().map(f64::from).collect();
        (g(&dh), g(&dw), r)
    } else {
        let (mut dh, mut dw): (CudaSlice<bf16>, CudaSlice<bf16>) = (stream.alloc_zeros(td).unwrap(), stream.alloc_zeros(vd).unwrap());
        poison(stream, &mut dh).unwrap();
        poison(stream, &mut dw).unwrap();
        let r = head.backward(stream, &bx, opts, GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw))).unwrap();
        let g = |b: &CudaSlice<bf16>| stream.clone_dtoh(b).unwrap().into_iter().map(|x| x.to_f64()).collect();
        (g(&dh), g(&dw), r)
    }
}

fn dyn_ref(b: &Option<CudaSlice<f32>>) -> Option<&dyn DevicePtr<f32>> {
    b.as_ref().map(|b| b as &dyn DevicePtr<f32>)
}

fn same_bits(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

#[test]
fn backward_active_rows() {
    let test = "gpu_active::backward_active_rows";
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let seed = run_seed(test);
    let gpu = (&head, &stream);
    let (t, v, d) = (2300, 3001, 256);
    for (i, (name, mask)) in layouts(t, seed).into_iter().enumerate() {
        let s = case_seed(seed, i);
        let case = Case::generate(s, t, v, d, &Structure { huge: 0.0, all_negative: 0.0, ignored: 0.0, ..Default::default() });
        let labels = masks::apply(&case.labels, &mask, IGNORE_INDEX);
        let both = i % 2 == 0;
        let (i64_labels, f32_out) = (i % 3 == 0, i % 2 == 1);
        // Upstream gradients: zero (both) on every 4th labelled row, which drops it; the log-prob
        // gradient alone zero on every 7th, which keeps it when the entropy's is given.
        let mut rng = Rng::new(s ^ 0xD1CE);
        let labelled = active_rows(&mask);
        let zero: Vec<bool> = (0..t).map(|k| mask[k] && labelled.binary_search(&k).unwrap() % 4 == 1).collect();
        let gl: Vec<f32> = (0..t).map(|k| if zero[k] || (both && mask[k] && k % 7 == 0) { 0.0 } else { rng.normal() as f32 }).collect();
        let ge: Vec<f32> = (0..t).map(|k| if zero[k] { 0.0 } else { rng.normal() as f32 }).collect();
        let live: Vec<bool> = (0..t).map(|k| mask[k] && (gl[k] != 0.0 || (both && ge[k] != 0.0))).collect();
        let rows = active_rows(&live);
        let n = rows.len();
        // The saved statistics from the compacted forward (skipped rows: lse +∞, entropy 0).
        let p = Problem::new(t, v, d);
        let f = fwd(
            gpu,
            (&case.h, &case.w),
            &labels,
            p,
            &FwdOptions { config: Choice::Fallback, compaction: Compaction::Always, ..Default::default() },
            (true, true),
        );
        let x = BwdCase {
            case: &case,
            labels: &labels,
            lse: &f.lse,
            ent: both.then_some(&f.ent[..]),
            gl: Some(&gl),
            ge: both.then_some(&ge[..]),
        };
        let desc = format!("{name}: t={t} v={v} d={d} active={n} both={both} i64={i64_labels} f32={f32_out} seed={s}");
        let opts = |c: Compaction| BwdOptions { config: BwdConfigs::all(Choice::Fallback), compaction: c, ..Default::default() };
        let out = (i64_labels, f32_out);
        let (dh, dw, rep) = bwd(gpu, &x, p, &opts(Compaction::Always), out);
        assert_eq!(rep.rows, n, "rows computed [{desc}]");
        // 1. The reference (saved statistics of the f64 forward), the skipped rows exactly.
        let inp = lmhead_reference::Inputs { labels: &labels, ..case.inputs() };
        let rf = forward(&inp);
        let (gl64, ge64): (Vec<f64>, Vec<f64>) = (gl.iter().map(|&x| x as f64).collect(), ge.iter().map(|&x| x as f64).collect());
        let g = Grads { logprob: Some(&gl64), entropy: both.then_some(&ge64[..]) };
        let lim = if f32_out { 4e-3 } else { 6e-3 };
        let vrows: Vec<usize> = (0..v).step_by(7).collect();
        for k in (0..t).filter(|&k| !live[k]) {
            assert!(dh[k * d..(k + 1) * d].iter().all(|&x| x == 0.0), "skipped row {k} of dh is not exactly zero [{desc}]");
        }
        if n == 0 {
            assert!(dw.iter().all(|&x| x == 0.0), "dW without an active row is not exactly zero [{desc}]");
        } else {
            let (rdh, sdh) = backward_dh_rows_rss(&inp, &rf.lse, &rf.entropy, &g, &rows);
            let (rdw, sdw) = backward_dw_rows_rss(&inp, &rf.lse, &rf.entropy, &g, &vrows);
            let ref_check = |what: &str, dh: &[f64], dw: &[f64]| {
                check_rel_l2_terms(&format!("dh {what}"), &desc, &gather(dh, &rows, d), &rdh.concat(), &sdh.concat(), lim);
                check_rel_l2_terms(&format!("dW {what}"), &desc, &gather(dw, &vrows, d), &rdw.concat(), &sdw.concat(), lim);
            };
            ref_check("compacted", &dh, &dw);
            // 2. Bitwise the dense call on the compacted inputs.
            let pc = |x: &[f32]| rows.iter().map(|&k| x[k]).collect::<Vec<f32>>();
            let (lc, lsec, entc, glc, gec) =
                (rows.iter().map(|&k| labels[k]).collect::<Vec<_>>(), pc(&f.lse), pc(&f.ent), pc(&gl), pc(&ge));
            let hc = Case { h: gather(&case.h, &rows, d), t: n, ..case.clone() };
            let xc = BwdCase {
                case: &hc,
                labels: &lc,
                lse: &lsec,
                ent: both.then_some(&entc[..]),
                gl: Some(&glc),
                ge: both.then_some(&gec[..]),
            };
            let (dh_b, dw_b, rep_b) = bwd(gpu, &xc, Problem::new(n, v, d), &opts(Compaction::Always), out);
            assert_eq!((rep_b.rows, rep_b.chunk), (n, rep.chunk), "[{desc}]");
            assert!(same_bits(&gather(&dh, &rows, d), &dh_b), "dh: compacted ≠ dense on the compacted rows [{desc}]");
            assert!(same_bits(&dw, &dw_b), "dW: compacted ≠ dense on the compacted rows [{desc}]");
            // 3. The dense call on all rows.
            let (dh_c, dw_c, rep_c) = bwd(gpu, &x, p, &opts(Compaction::Off), out);
            assert_eq!(rep_c.rows, t, "[{desc}]");
            ref_check("dense", &dh_c, &dw_c);
            check_rel_l2("dh vs dense", &desc, &dh, &dh_c, 2.0 * lim);
            check_rel_l2("dW vs dense", &desc, &dw, &dw_c, 2.0 * lim);
        }
        println!("[{test}] bwd {desc}: rows {} chunks {}", rep.rows, rep.chunks);
    }
}

/// One rank's forward and backward (f32 outputs, the fallback kernels, `Compaction` `c`) on the
/// vocab rows `[v0, v1)`; `comm: None` is the unsharded run. Returns the forward outputs, `dh`,
/// this shard's `dW` and the two reports' rows.
#[allow(clippy::type_complexity)]
fn tp_rank(
    (head, stream): (&LmHead, &Arc<CudaStream>),
    case: &Case,
    (labels, gl): (&[i64], &[f32]),
    (v0, v1): (usize, usize),
    comm: Option<&dyn Communicator>,
    c: Compaction,
) -> (Fwd, Vec<f32>, Vec<f32>, usize) {
    let (t, d) = (case.t, case.d);
    let p = Problem::new(t, v1 - v0, d);
    let shard = Shard { v_begin: v0, v_total: case.v };
    let (h, w) = (upload_bf16(stream, &case.h).unwrap(), upload_bf16(stream, &case.w[v0 * d..v1 * d]).unwrap());
    let lab = upload(stream, labels).unwrap();
    let mut out: Vec<CudaSlice<f32>> = (0..3).map(|_| stream.alloc_zeros(t).unwrap()).collect();
    out.iter_mut().for_each(|b| poison(stream, b).unwrap());
    let fo = FwdOptions { config: Choice::Fallback, compaction: c, ..Default::default() };
    let x = FwdInputs { h: &h, w: &w, labels: &lab, problem: p };
    let [lp, lse, ent] = &mut out[..] else { unreachable!() };
    let o = FwdOutputs { kept: None, logprob: lp, lse, entropy: Some(ent) };
    let report = match comm {
        Some(cm) => head.forward_tp(cm, stream, &x, shard, &fo, o),
        None => head.forward(stream, &x, &fo, o),
    }
    .unwrap();
    let g = upload(stream, gl).unwrap();
    let (mut dh, mut dw): (CudaSlice<f32>, CudaSlice<f32>) = (stream.alloc_zeros(t * d).unwrap(), stream.alloc_zeros(p.v * d).unwrap());
    poison(stream, &mut dh).unwrap();
    poison(stream, &mut dw).unwrap();
    let bx = BwdInputs {
        kept: None,
        h: &h,
        w: &w,
        labels: &lab,
        lse: &out[1],
        entropy: Some(&out[2]),
        grad_logprob: Some(&g),
        grad_entropy: Some(&g),
        problem: p,
    };
    let bo = BwdOptions { chunk: Some(700), config: BwdConfigs::all(Choice::Fallback), compaction: c, ..Default::default() };
    let rep = match comm {
        Some(cm) => head.backward_tp(
            TpBackward { comm: cm, shard, reduce: ReduceDh::AllReduce },
            stream,
            &bx,
            &bo,
            GradOut::F32(&mut dh),
            Some(GradOut::F32(&mut dw)),
        ),
        None => head.backward(stream, &bx, &bo, GradOut::F32(&mut dh), Some(GradOut::F32(&mut dw))),
    }
    .unwrap();
    let get = |b: &CudaSlice<f32>| stream.clone_dtoh(b).unwrap();
    (Fwd { lp: get(&out[0]), lse: get(&out[1]), ent: get(&out[2]), report }, get(&dh), get(&dw), rep.rows)
}

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// TP = 2 in process: both ranks compact the same rows, and their outputs match the unsharded
/// compacted run (tight thresholds of `tests/tp.rs`: 2e-5 per output, relative L2 1e-4 for
/// `dh` and the `dW` shards). With ranks whose zero-gradient rows differ (a caller error the
/// library absorbs), the ranks compact the union of their rows and match the dense TP call.
#[test]
fn tp_two_ranks_active_rows() {
    let test = "gpu_active::tp_two_ranks_active_rows";
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let seed = run_seed(test);
    let (t, v, d) = (2300, 2003, 128);
    let shards: Vec<(usize, usize)> = (0..2).map(|r| Shard::even(r, 2, v)).map(|(s, len)| (s.v_begin, s.v_begin + len)).collect();
    for (i, (name, mask)) in layouts(t, seed).into_iter().enumerate().filter(|(i, _)| [1, 2, 3, 5].contains(i)) {
        let s = case_seed(seed, i);
        let case = Case::generate(s, t, v, d, &Structure { huge: 0.0, all_negative: 0.0, ignored: 0.0, ..Default::default() });
        let labels = masks::apply(&case.labels, &mask, IGNORE_INDEX);
        let mut rng = Rng::new(s ^ 7);
        let gl: Vec<f32> = (0..t).map(|_| rng.normal() as f32).collect();
        let n = mask.iter().filter(|&&m| m).count();
        let desc = format!("{name}: t={t} v={v} d={d} active={n} seed={s}");
        let (whole, dh_w, dw_w, rows_w) = tp_rank((&head, &stream), &case, (&labels, &gl), (0, v), None, Compaction::Always);
        assert_eq!((whole.report.rows, rows_w), (n, n), "[{desc}]");
        // Per rank: the gradients (the same on both, or zeroed on rows of its own) and the mode.
        let run = |grads: [Vec<f32>; 2], c: Compaction| -> Vec<(Fwd, Vec<f32>, Vec<f32>, usize)> {
            let comms = LocalComm::group(2);
            std::thread::scope(|sc| {
                let hs: Vec<_> = comms
                    .iter()
                    .zip(&shards)
                    .zip(&grads)
                    .map(|((comm, &range), g)| {
                        let (case, labels) = (&case, &labels);
                        sc.spawn(move || {
                            let head = LmHead::new(0).unwrap();
                            let stream = head.gpu().context().new_stream().unwrap();
                            tp_rank((&head, &stream), case, (labels, g), range, Some(comm as &dyn Communicator), c)
                        })
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let tol = |_: usize, _: f64| 2e-5;
        for (r, (f, dh, dw, rows)) in run([gl.clone(), gl.clone()], Compaction::Always).iter().enumerate() {
            let what = format!("{desc} rank {r}");
            assert_eq!((f.report.rows, *rows), (n, n), "[{what}]");
            check("logprob", &what, &f64s(&f.lp), &f64s(&whole.lp), &tol);
            check("lse", &what, &f64s(&f.lse), &f64s(&whole.lse), &tol);
            check("entropy", &what, &f64s(&f.ent), &f64s(&whole.ent), &tol);
            if n > 0 {
                check_rel_l2("dh", &what, &f64s(dh), &f64s(&dh_w), 1e-4);
                let (a, b) = shards[r];
                check_rel_l2("dW shard", &what, &f64s(dw), &f64s(&dw_w[a * d..b * d]), 1e-4);
            } else {
                assert!(dh.iter().chain(dw).all(|&x| x == 0.0), "no active row: dh, dW exactly zero [{what}]");
            }
        }
        if n == 0 {
            continue;
        }
        // Zero-gradient rows that differ between the ranks: each compacts the union.
        let zeroed = |rank: usize| -> Vec<f32> { (0..t).map(|k| if k % 5 == rank { 0.0 } else { gl[k] }).collect() };
        let union = (0..t).filter(|&k| mask[k]).count();
        let compacted = run([zeroed(0), zeroed(1)], Compaction::Always);
        let dense = run([zeroed(0), zeroed(1)], Compaction::Off);
        for (r, ((_, dh, dw, rows), (_, dh_d, dw_d, _))) in compacted.iter().zip(&dense).enumerate() {
            let what = format!("{desc} rank {r} (zero-gradient rows differ)");
            assert_eq!(*rows, union, "[{what}]");
            check_rel_l2("dh vs dense TP", &what, &f64s(dh), &f64s(dh_d), 1e-4);
            check_rel_l2("dW vs dense TP", &what, &f64s(dw), &f64s(dw_d), 1e-4);
        }
        println!("[{test}] tp n=2 {desc}: OK");
    }
}

/// Context parallelism: two token slices, each called on its own, give the whole call's rows
/// (2e-5 per output; `dh` relative L2 1e-4) and `dW`s that sum to the whole call's (1e-4).
#[test]
fn cp_slices_match_the_whole_call() {
    let test = "gpu_active::cp_slices_match_the_whole_call";
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let seed = run_seed(test);
    let (t, v, d) = (2300, 2003, 128);
    let mask = masks::packed_turns(t, 0.4, 8, (100, 400), (50, 300), seed);
    let case = Case::generate(seed, t, v, d, &Structure { huge: 0.0, all_negative: 0.0, ignored: 0.0, ..Default::default() });
    let labels = masks::apply(&case.labels, &mask, IGNORE_INDEX);
    let mut rng = Rng::new(seed ^ 9);
    let gl: Vec<f32> = (0..t).map(|_| rng.normal() as f32).collect();
    let desc = format!("t={t} v={v} d={d} seed={seed}");
    let (whole, dh_w, dw_w, _) = tp_rank((&head, &stream), &case, (&labels, &gl), (0, v), None, Compaction::Always);
    let cut = 1100;
    let mut dw_sum = vec![0.0f64; v * d];
    for (a, b) in [(0, cut), (cut, t)] {
        let part = Case { h: case.h[a * d..b * d].to_vec(), labels: labels[a..b].to_vec(), t: b - a, ..case.clone() };
        let (f, dh, dw, rows) = tp_rank((&head, &stream), &part, (&labels[a..b], &gl[a..b]), (0, v), None, Compaction::Always);
        let what = format!("{desc} slice [{a}, {b})");
        assert_eq!(rows, mask[a..b].iter().filter(|&&m| m).count(), "[{what}]");
        let tol = |_: usize, _: f64| 2e-5;
        check("logprob", &what, &f64s(&f.lp), &f64s(&whole.lp[a..b]), &tol);
        check("entropy", &what, &f64s(&f.ent), &f64s(&whole.ent[a..b]), &tol);
        check_rel_l2("dh", &what, &f64s(&dh), &f64s(&dh_w[a * d..b * d]), 1e-4);
        dw_sum.iter_mut().zip(&dw).for_each(|(s, &x)| *s += x as f64);
    }
    check_rel_l2("dW (sum of slices)", &desc, &dw_sum, &f64s(&dw_w), 1e-4);
    println!("[{test}] cp 2 slices {desc}: OK");
}
