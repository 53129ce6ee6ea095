//! GPU parity of the backward (`dh`, `dW`) against the f64 reference (skipped without a driver).
//!
//! Cases use inputs without ±1e4 rows except `structures`' extreme case: for such rows the f32
//! tensor-core logits carry up to `(d/16)·ulp(1e4)` error (see gpu_fwd.rs), so `p = e^{z−lse}`
//! is only good to a few percent there; that case is held to `EXTREME_REL_L2`.
//!
//! Upstream gradients are random N(0, 1) for log-prob only, entropy only, and both. Outputs are
//! poisoned before the call. Thresholds (L2 over the checked rows): the d-logits are staged in
//! bf16 (relative rounding ≤ 2⁻⁸, ~2⁻⁹ typical, per term) and bf16 outputs round once more, so
//! the error must stay within `6e-3` (bf16 outputs) or `4e-3` (f32) of `max(‖ref‖, ‖rss‖)`, where
//! `rss` is each element's root sum of squared terms (`backward_dh_rows_rss`): rounding a term
//! moves the sum by a fraction of the term, so when the terms cancel the error is relative to
//! them, not to the small sum (seen on the H200 at `1ff40f0`: t = 1, v = 151936, d = 8, seed
//! 7051947941513986546, where a `W` column constant over the vocabulary has `dh_j = 0` exactly;
//! `‖Δ‖/‖ref‖` = 1.16e-2 from an exact `mma.sync` kernel, and bf16 staging emulated on the CPU
//! gives 1.23e-2: `tests/reference.rs::staged_dlogits_error_scales_with_the_terms`). Ordinary
//! rows have `‖rss‖ ≲ ‖ref‖` (public fused kernels land near 2.4e-3 relative). Rows labelled
//! `ignore_index` must be exactly zero in `dh`.

use std::sync::Arc;

use lmhead::cudarc::driver::{CudaSlice, CudaStream};
use lmhead::testing::{download_bf16, download_f32, poison, upload, upload_bf16};
use lmhead::{bf16, BwdConfigs, BwdInputs, BwdOptions, Choice, Family, FwdInputs, FwdOptions, FwdOutputs, GradOut, LmHead, Problem};
use lmhead_reference::rng::Rng;
use lmhead_reference::{backward_dh_rows_rss, backward_dw_rows_rss, forward, Case, Grads, Structure, IGNORE_INDEX};
use lmhead_tests::{case_seed, check_rel_l2_terms, fixed_or_auto, gpu_or_skip, held, run_seed};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Upstream {
    LogProb,
    Entropy,
    Both,
}

#[derive(Clone, Debug)]
struct BwdCase {
    t: usize,
    v: usize,
    d: usize,
    s: Structure,
    up: Upstream,
    dh_f32: bool,
    dw_f32: bool,
    /// `None`: the library's automatic width.
    chunk: Option<usize>,
    config: BwdConfigs,
    /// Threshold override (extreme inputs).
    max_rel_l2: Option<f64>,
    /// No `dW` asked for (a frozen head): `dW` must stay untouched.
    frozen_w: bool,
    /// An f32 `dh` that starts 8 bytes into its allocation (no tensor map can address it).
    dh_offset8: bool,
}

impl BwdCase {
    fn new(t: usize, v: usize, d: usize, up: Upstream) -> Self {
        let s = Structure { all_negative: 0.0, huge: 0.0, ..Structure::default() };
        Self {
            t,
            v,
            d,
            s,
            up,
            dh_f32: false,
            dw_f32: false,
            chunk: None,
            config: BwdConfigs::all(Choice::Fallback),
            max_rel_l2: None,
            frozen_w: false,
            dh_offset8: false,
        }
    }
}

const BF16_REL_L2: f64 = 6e-3;
const F32_REL_L2: f64 = 4e-3;
/// Inputs with 30% of rows at logits ±1e4 (see the module docs).
const EXTREME_REL_L2: f64 = 0.1;

fn sample(n: usize, cost_per: usize, seed: u64) -> Vec<usize> {
    let budget = 3.0e9;
    if (n * cost_per) as f64 <= budget {
        return (0..n).collect();
    }
    let k = ((budget / cost_per as f64) as usize).clamp(4, n);
    let mut rng = Rng::new(seed);
    let mut v: Vec<usize> = vec![0, n - 1];
    v.extend((0..k).map(|_| rng.below(n as u64) as usize));
    v.sort_unstable();
    v.dedup();
    v
}

fn run(head: &LmHead, stream: &Arc<CudaStream>, c: &BwdCase, seed: u64) -> String {
    let case = Case::generate(seed, c.t, c.v, c.d, &c.s);
    let desc = format!(
        "t={} v={} d={} {:?} dh_f32={} dw_f32={} chunk={:?} {:?} seed={seed} {:?}",
        c.t, c.v, c.d, c.up, c.dh_f32, c.dw_f32, c.chunk, c.config, c.s
    );
    let p = Problem::new(c.t, c.v, c.d);
    let h = upload_bf16(stream, &case.h).unwrap();
    let w = upload_bf16(stream, &case.w).unwrap();
    let labels = upload(stream, &case.labels).unwrap();
    let temp = c.s.temperature as f32;
    // Forward on the GPU for the saved lse / entropy (checked by gpu_fwd).
    let mut lp: CudaSlice<f32> = stream.alloc_zeros(c.t).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(c.t).unwrap();
    let mut ent: CudaSlice<f32> = stream.alloc_zeros(c.t).unwrap();
    head.forward(
        stream,
        &FwdInputs { h: &h, w: &w, labels: &labels, problem: p },
        &FwdOptions { temperature: temp, config: Choice::Fallback, ..Default::default() },
        FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) },
    )
    .unwrap();
    let mut rng = Rng::new(seed ^ 0xD1CE);
    let gl: Vec<f32> = (0..c.t).map(|_| rng.normal() as f32).collect();
    let ge: Vec<f32> = (0..c.t).map(|_| rng.normal() as f32).collect();
    let (gl_d, ge_d) = (upload(stream, &gl).unwrap(), upload(stream, &ge).unwrap());
    let use_lp = c.up != Upstream::Entropy;
    let use_ent = c.up != Upstream::LogProb;

    let mut dh16: CudaSlice<bf16> = stream.alloc_zeros(c.t * c.d).unwrap();
    let off = if c.dh_offset8 { 2 } else { 0 };
    let mut dh32: CudaSlice<f32> = stream.alloc_zeros(c.t * c.d + off).unwrap();
    let mut dw16: CudaSlice<bf16> = stream.alloc_zeros(c.v * c.d).unwrap();
    let mut dw32: CudaSlice<f32> = stream.alloc_zeros(c.v * c.d).unwrap();
    poison(stream, &mut dh16).unwrap();
    poison(stream, &mut dh32).unwrap();
    poison(stream, &mut dw16).unwrap();
    poison(stream, &mut dw32).unwrap();
    let x = BwdInputs {
        kept: None,
        h: &h,
        w: &w,
        labels: &labels,
        lse: &lse,
        entropy: use_ent.then_some(&ent as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        grad_logprob: use_lp.then_some(&gl_d as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        grad_entropy: use_ent.then_some(&ge_d as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        problem: p,
    };
    let opts = BwdOptions { temperature: temp, chunk: c.chunk, config: c.config, ..Default::default() };
    let mut dh32_view = dh32.slice_mut(off..);
    let dh_out = if c.dh_f32 { GradOut::F32(&mut dh32_view) } else { GradOut::Bf16(&mut dh16) };
    let dw_out = if c.dw_f32 { GradOut::F32(&mut dw32) } else { GradOut::Bf16(&mut dw16) };
    let dw_out = (!c.frozen_w).then_some(dw_out);
    let rep = head.backward(stream, &x, &opts, dh_out, dw_out).unwrap_or_else(|e| panic!("backward failed [{desc}]: {e}"));
    let gdh = if c.dh_f32 { download_f32(stream, &dh32).unwrap()[off..].to_vec() } else { download_bf16(stream, &dh16).unwrap() };
    let gdw = if c.dw_f32 { download_f32(stream, &dw32).unwrap() } else { download_bf16(stream, &dw16).unwrap() };

    // Reference: saved statistics from the f64 forward (small shapes) or the GPU's (large).
    let inp = case.inputs();
    let (rlse, rent): (Vec<f64>, Vec<f64>) = if c.t * c.v * c.d <= 2_000_000_000 {
        let r = forward(&inp);
        (r.lse, r.entropy)
    } else {
        (download_f32(stream, &lse).unwrap(), download_f32(stream, &ent).unwrap())
    };
    let gl64: Vec<f64> = gl.iter().map(|&x| x as f64).collect();
    let ge64: Vec<f64> = ge.iter().map(|&x| x as f64).collect();
    let g = Grads { logprob: use_lp.then_some(&gl64[..]), entropy: use_ent.then_some(&ge64[..]) };
    let rows = sample(c.t, c.v * c.d, seed);
    let vrows = sample(c.v, c.t * c.d, seed ^ 1);
    let (rdh, sdh) = backward_dh_rows_rss(&inp, &rlse, &rent, &g, &rows);
    let (rdw, sdw) = backward_dw_rows_rss(&inp, &rlse, &rent, &g, &vrows);
    let pick = |x: &[f64], rs: &[usize]| rs.iter().flat_map(|&i| x[i * c.d..(i + 1) * c.d].iter().copied()).collect::<Vec<f64>>();
    let lim = |f32: bool| c.max_rel_l2.unwrap_or(if f32 { F32_REL_L2 } else { BF16_REL_L2 });
    // Ignored rows have exactly zero gradients. Where every sampled row (dh) or every row (dW) is
    // ignored — a batch of one ignored token — the reference is all zeros and the relative check
    // would prove nothing: the outputs, poisoned before the launch, must then be exactly zero.
    let ignored = |i: usize| case.labels[i] == IGNORE_INDEX;
    let dh_rel_l2 = if rows.iter().all(|&i| ignored(i)) {
        f64::NAN
    } else {
        check_rel_l2_terms("dh", &desc, &pick(&gdh, &rows), &rdh.concat(), &sdh.concat(), lim(c.dh_f32)).0.rel_l2
    };
    for &i in &rows {
        if ignored(i) {
            assert!(gdh[i * c.d..(i + 1) * c.d].iter().all(|&x| x == 0.0), "ignored row {i} of dh is not exactly zero [{desc}]");
        }
    }
    let dw_rel_l2 = if c.frozen_w {
        assert!(rep.dw.is_none() && gdw.iter().all(|x| x.is_nan()), "dW written without being asked for [{desc}]");
        f64::NAN
    } else if (0..c.t).all(ignored) {
        assert!(gdw.iter().all(|&x| x == 0.0), "dW of a batch whose every row is ignored is not exactly zero [{desc}]");
        f64::NAN
    } else {
        check_rel_l2_terms("dW", &desc, &pick(&gdw, &vrows), &rdw.concat(), &sdw.concat(), lim(c.dw_f32)).0.rel_l2
    };
    format!(
        "bwd t={:<5} v={:<6} d={:<5} {:?} chunk={} chunks={} dl={} dh={} dw={} dh_rel_l2={:.2e} dw_rel_l2={:.2e} (dh {} / dW {} rows) ws={}MiB",
        c.t,
        c.v,
        c.d,
        c.up,
        rep.chunk,
        rep.chunks,
        rep.dlogits,
        rep.dh,
        rep.dw.as_deref().unwrap_or("none"),
        dh_rel_l2,
        dw_rel_l2,
        rows.len(),
        vrows.len(),
        rep.workspace_bytes >> 20
    )
}

fn run_all(test: &str, cases: &[BwdCase]) {
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let seed = run_seed(test);
    for (i, c) in cases.iter().enumerate() {
        let line = run(&head, &stream, c, case_seed(seed, i));
        println!("[{test}] {line}");
    }
}

/// The first candidate of each backward family that `pick` accepts.
fn first_configs(pick: impl Fn(&lmhead::TileConfig) -> bool) -> BwdConfigs {
    // (`Choice::Auto` for an Sm90 config under the portable module: `fixed_or_auto`.)
    let first = |f: Family| fixed_or_auto(*f.candidates().iter().find(|c| pick(c)).expect("a matching candidate"));
    BwdConfigs { dlogits: first(Family::BwdDlogits), dh: first(Family::BwdDh), dw: first(Family::BwdDw) }
}

/// The first sm90 candidates of the backward families: the d-logits storing from the
/// registers, the GEMMs reading the staging buffer, `W` and `h` in place (MN-major operands).
fn sm90_configs() -> BwdConfigs {
    first_configs(|c| c.is_sm90() && !c.mainloop.tma_store())
}

/// The first d-logits and dh candidates that write their tiles through shared memory by TMA
/// (dh: its f32 accumulator stored, then added in place), with the sm90 dW.
fn tma_store_configs() -> BwdConfigs {
    let st = |f: Family| fixed_or_auto(*f.candidates().iter().find(|c| c.mainloop.tma_store()).expect("a TMA-store candidate"));
    BwdConfigs { dlogits: st(Family::BwdDlogits), dh: st(Family::BwdDh), ..sm90_configs() }
}

/// Shapes and upstream-gradient combinations; several chunks with a tail; f32 and bf16 outputs;
/// the large shapes on both mainloops.
#[test]
fn shapes_and_upstreams() {
    let mut cases = Vec::new();
    for up in [Upstream::LogProb, Upstream::Entropy, Upstream::Both] {
        cases.push(BwdCase::new(7, 3, 64, up));
        let mut c = BwdCase::new(64, 1000, 1000, up);
        c.chunk = Some(300);
        c.dh_f32 = up == Upstream::Both;
        cases.push(c);
    }
    let mut c = BwdCase::new(1000, 32000, 2048, Upstream::Both);
    c.dw_f32 = true;
    cases.push(c.clone());
    c.config = sm90_configs();
    cases.push(c);
    let mut c = BwdCase::new(4097, 50257, 4096, Upstream::LogProb);
    cases.push(c.clone());
    c.up = Upstream::Both;
    cases.push(c.clone());
    c.config = sm90_configs();
    cases.push(c.clone());
    c.config = tma_store_configs();
    cases.push(c);
    cases.push(BwdCase::new(1, 151936, 8, Upstream::Both));
    // A wide chunk (32768 columns ran fwd+bwd 3.5–5% faster in the bench at `ed589ae`): three
    // chunks, the last a tail, on the sm90 kernels.
    let mut c = BwdCase::new(4097, 70001, 1024, Upstream::Both);
    c.chunk = Some(32768);
    c.config = sm90_configs();
    cases.push(c.clone());
    c.config = tma_store_configs();
    cases.push(c.clone());
    // The TMA dh into an f32 output: stored, then added in place, every chunk; and the same
    // into an output only 8-byte aligned (the register twin runs).
    c.dh_f32 = true;
    cases.push(c.clone());
    c.dh_offset8 = true;
    cases.push(c);
    let mut c = BwdCase::new(64, 1000, 1000, Upstream::Entropy);
    c.chunk = Some(300);
    c.config = sm90_configs();
    cases.push(c.clone());
    // A frozen head: no dW asked for, on both mainloops (dh must not change).
    c.frozen_w = true;
    cases.push(c.clone());
    c.config = BwdConfigs::all(Choice::Fallback);
    cases.push(c);
    run_all("gpu_bwd::shapes_and_upstreams", &cases);
}

/// Temperature, ignored rows, planted labels, rows near ±1e4.
#[test]
fn structures() {
    let base = BwdCase::new(300, 5003, 512, Upstream::Both).s;
    let mut cases = Vec::new();
    for s in [
        Structure { temperature: 0.7, ..base.clone() },
        Structure { ignored: 0.5, ..base.clone() },
        Structure { planted: 0.5, ..base.clone() },
        Structure { all_negative: 0.3, huge: 0.3, ..base.clone() },
        Structure { logit_std: 0.08, ..base.clone() },
        Structure { logit_std: 6.0, ..base.clone() },
    ] {
        let mut c = BwdCase::new(300, 5003, 512, Upstream::Both);
        c.max_rel_l2 = (s.huge > 0.0).then_some(EXTREME_REL_L2);
        c.s = s;
        c.chunk = Some(2048);
        cases.push(c.clone());
        c.config = sm90_configs();
        cases.push(c.clone());
        c.config = tma_store_configs();
        cases.push(c);
    }
    run_all("gpu_bwd::structures", &cases);
}

/// Every compiled candidate of each backward family at its tile boundaries.
#[test]
fn tile_boundaries_every_config() {
    let mut cases = Vec::new();
    for &cfg in Family::BwdDlogits.candidates().iter().filter(|c| held(c)) {
        let (bm, bn, bk) = (cfg.bm as usize, cfg.bn as usize, cfg.bk as usize);
        let mut c = BwdCase::new(bm + 1, 2 * bn + 3, 2 * bk + 8, Upstream::Both);
        // Every row active: the kernels run at exactly these shapes (gpu_active covers masks).
        c.s.ignored = 0.0;
        c.chunk = Some(bn + 5);
        c.config.dlogits = Choice::Fixed(cfg);
        cases.push(c);
    }
    for &cfg in Family::BwdDh.candidates().iter().filter(|c| held(c)) {
        let (bm, bn, bk) = (cfg.bm as usize, cfg.bn as usize, cfg.bk as usize);
        let mut c = BwdCase::new(bm + 1, 4 * bk + 6, bn + 8, Upstream::LogProb);
        c.s.ignored = 0.0;
        c.chunk = Some(2 * bk + 3);
        c.config.dh = Choice::Fixed(cfg);
        // dW at the same tile (a dh-only `tma_store` config: its register twin).
        c.config.dw = Choice::Fixed(cfg.register_twin());
        c.dh_f32 = bm % 128 == 0;
        cases.push(c);
    }
    run_all("gpu_bwd::tile_boundaries_every_config", &cases);
}

/// The same inputs twice give bitwise identical gradients, for each kind of config.
#[test]
fn deterministic() {
    let Some((head, stream)) = gpu_or_skip("gpu_bwd::deterministic") else { return };
    let seed = run_seed("gpu_bwd::deterministic");
    let (t, v, d) = (257, 3001, 256);
    let case = Case::generate(seed, t, v, d, &Structure::default());
    let p = Problem::new(t, v, d);
    let h = upload_bf16(&stream, &case.h).unwrap();
    let w = upload_bf16(&stream, &case.w).unwrap();
    let labels = upload(&stream, &case.labels).unwrap();
    let lse = upload(&stream, &vec![5.0f32; t]).unwrap();
    let gl = upload(&stream, &vec![1.0f32; t]).unwrap();
    let run = |config: BwdConfigs| {
        let mut dh: CudaSlice<f32> = stream.alloc_zeros(t * d).unwrap();
        let mut dw: CudaSlice<bf16> = stream.alloc_zeros(v * d).unwrap();
        let x = BwdInputs {
            kept: None,
            h: &h,
            w: &w,
            labels: &labels,
            lse: &lse,
            entropy: None,
            grad_logprob: Some(&gl),
            grad_entropy: None,
            problem: p,
        };
        let opts = BwdOptions { chunk: Some(1000), config, ..Default::default() };
        head.backward(&stream, &x, &opts, GradOut::F32(&mut dh), Some(GradOut::Bf16(&mut dw))).unwrap();
        (stream.clone_dtoh(&dh).unwrap(), stream.clone_dtoh(&dw).unwrap())
    };
    let same = |a: &(Vec<f32>, Vec<bf16>), b: &(Vec<f32>, Vec<bf16>)| {
        (a.0.iter().zip(&b.0).all(|(x, y)| x.to_bits() == y.to_bits()), a.1.iter().zip(&b.1).all(|(x, y)| x.to_bits() == y.to_bits()))
    };
    // Each config twice, among them the TMA dh, whose adds into the accumulator are atomic
    // but one per element and chunk, in chunk order.
    for config in [BwdConfigs::all(Choice::Fallback), sm90_configs(), tma_store_configs()] {
        let (a, b) = (run(config), run(config));
        assert_eq!(same(&a, &b), (true, true), "dh, dW differ between runs of {config:?} (seed {seed})");
    }
    // The TMA dh adds as the register epilogue does: bitwise the same dh as its register twin.
    let st = tma_store_configs();
    let (a, b) = (run(st), run(BwdConfigs { dlogits: st.dlogits, ..sm90_configs() }));
    assert!(same(&a, &b).0, "the TMA dh differs from its register twin (seed {seed})");
}
