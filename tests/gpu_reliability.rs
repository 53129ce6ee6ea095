//! Reliability on the GPU (skipped without a CUDA driver): every bad input answered by a typed
//! error with the caller's buffers untouched, NaN propagation confined to the affected rows,
//! out-of-memory as an error, 64-bit indexing past 2³¹ elements, and the `sanitizer_*` tests that
//! `compute-sanitizer` runs over every kernel at tail shapes (docs/run-gpu.sh, step `sanitize`).

use std::sync::Arc;

use lmhead::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use lmhead::testing::{download_f32, poison, upload, upload_bf16};
use lmhead::{
    bf16, BwdConfigs, BwdInputs, BwdOptions, Choice, Error, Family, FwdInputs, FwdOptions, FwdOutputs, GradOut, LmHead, LocalComm, Problem,
    Shard,
};
use lmhead_reference::rng::Rng;
use lmhead_reference::{backward_dw_rows, forward_rows, Case, Grads, Inputs, Structure};
use lmhead_tests::{check_rel_l2, gpu_or_skip, run_seed};

struct Setup {
    case: Case,
    h: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    labels: CudaSlice<i64>,
}

fn setup(stream: &Arc<CudaStream>, t: usize, v: usize, d: usize, seed: u64) -> Setup {
    let case = Case::generate(seed, t, v, d, &Structure { huge: 0.0, all_negative: 0.0, ..Default::default() });
    let h = upload_bf16(stream, &case.h).unwrap();
    let w = upload_bf16(stream, &case.w).unwrap();
    let labels = upload(stream, &case.labels).unwrap();
    Setup { case, h, w, labels }
}

/// Run the forward with poisoned outputs; return the result and the output bytes.
#[allow(clippy::too_many_arguments)]
fn fwd_raw(
    head: &LmHead,
    stream: &Arc<CudaStream>,
    h: &dyn DevicePtr<bf16>,
    w: &dyn DevicePtr<bf16>,
    labels: &dyn DevicePtr<i64>,
    p: Problem,
    opts: &FwdOptions,
    t_out: usize,
) -> (lmhead::Result<lmhead::FwdReport>, Vec<f64>, Vec<f64>) {
    let mut lp: CudaSlice<f32> = stream.alloc_zeros(t_out).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(t_out).unwrap();
    let mut ent: CudaSlice<f32> = stream.alloc_zeros(t_out).unwrap();
    for b in [&mut lp, &mut lse, &mut ent] {
        poison(stream, b).unwrap();
    }
    let r = head.forward(
        stream,
        &FwdInputs { h, w, labels, problem: p },
        opts,
        FwdOutputs { logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) },
    );
    (r, download_f32(stream, &lp).unwrap(), download_f32(stream, &ent).unwrap())
}

fn untouched(x: &[f64]) -> bool {
    x.iter().all(|v| v.is_nan())
}

/// The bad-input matrix: each case a typed error, and the outputs still hold their poison.
#[test]
fn bad_inputs_are_typed_errors_and_leave_buffers_untouched() {
    let Some((head, stream)) = gpu_or_skip("gpu_reliability::bad_inputs") else { return };
    let (t, v, d) = (33, 257, 64);
    let s = setup(&stream, t, v, d, 11);
    let p = Problem::new(t, v, d);
    let o = FwdOptions { config: Choice::Fallback, ..Default::default() };
    let run = |h: &dyn DevicePtr<bf16>, w: &dyn DevicePtr<bf16>, l: &dyn DevicePtr<i64>, p: Problem, o: &FwdOptions| {
        fwd_raw(&head, &stream, h, w, l, p, o, t)
    };

    // Mismatched hidden size between h and W: W holds v·(d+8) elements.
    let w_wide: CudaSlice<bf16> = stream.alloc_zeros(v * (d + 8)).unwrap();
    let (r, lp, _) = run(&s.h, &w_wide, &s.labels, p, &o);
    assert!(matches!(r, Err(Error::Length { what: "W", .. })), "{r:?}");
    assert!(untouched(&lp));
    // Lengths that do not match t.
    let short: CudaSlice<i64> = stream.alloc_zeros(t - 1).unwrap();
    let (r, lp, _) = run(&s.h, &s.w, &short, p, &o);
    assert!(matches!(r, Err(Error::Length { what: "labels", .. })), "{r:?}");
    assert!(untouched(&lp));
    let (r, _, _) = run(&s.h, &s.w, &s.labels, Problem::new(t, v + 1, d), &o);
    assert!(matches!(r, Err(Error::Length { what: "W", .. })), "{r:?}");
    // Empty and odd shapes.
    for (bad, want) in [(Problem::new(0, v, d), "NoTokens"), (Problem::new(t, 0, d), "NoVocab"), (Problem::new(t, v, 60), "Hidden")] {
        let (r, lp, _) = run(&s.h, &s.w, &s.labels, bad, &o);
        assert!(format!("{r:?}").contains(want), "{bad:?}: {r:?}");
        assert!(untouched(&lp));
    }
    // Misaligned pointer: h starting one element into a buffer.
    let h_big: CudaSlice<bf16> = stream.alloc_zeros(t * d + 8).unwrap();
    let h_off = h_big.slice(1..1 + t * d);
    let (r, lp, _) = run(&h_off, &s.w, &s.labels, p, &o);
    assert!(matches!(r, Err(Error::Misaligned { what: "h", .. })), "{r:?}");
    assert!(untouched(&lp));
    // Temperatures.
    for temp in [0.0f32, -1.0, f32::NAN, f32::INFINITY] {
        let (r, lp, _) = run(&s.h, &s.w, &s.labels, p, &FwdOptions { temperature: temp, ..o.clone() });
        assert!(matches!(r, Err(Error::Temperature(_))), "{temp}: {r:?}");
        assert!(untouched(&lp));
    }
    // A fixed config that is not a compiled candidate.
    let bogus = lmhead::TileConfig { bm: 96, bn: 96, bk: 32, stages: 2, warps_m: 2, warps_n: 2, mainloop: lmhead::Mainloop::MmaSync };
    let (r, _, _) = run(&s.h, &s.w, &s.labels, p, &FwdOptions { config: Choice::Fixed(bogus), ..o.clone() });
    assert!(matches!(r, Err(Error::Config(_))), "{r:?}");
    // Tensor-parallel shard outside the vocabulary.
    let comm = LocalComm::group(1).pop().unwrap();
    let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let r = head.forward_tp(
        &comm,
        &stream,
        &FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: p },
        Shard { v_begin: 10, v_total: v },
        &o,
        FwdOutputs { logprob: &mut lp, lse: &mut lse, entropy: None },
    );
    assert!(matches!(r, Err(Error::Invalid(_))), "{r:?}");
    // Backward: entropy gradient without the saved entropy; bad chunk width.
    let lse_d = upload(&stream, &vec![1.0f32; t]).unwrap();
    let g = upload(&stream, &vec![1.0f32; t]).unwrap();
    let mut dh: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
    let mut dw: CudaSlice<bf16> = stream.alloc_zeros(v * d).unwrap();
    poison(&stream, &mut dh).unwrap();
    let bx = BwdInputs {
        h: &s.h,
        w: &s.w,
        labels: &s.labels,
        lse: &lse_d,
        entropy: None,
        grad_logprob: None,
        grad_entropy: Some(&g),
        problem: p,
    };
    let r = head.backward(&stream, &bx, &BwdOptions::default(), GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw)));
    assert!(matches!(r, Err(Error::Invalid(_))), "{r:?}");
    let bx = BwdInputs { grad_entropy: None, grad_logprob: Some(&g), ..bx };
    let r = head.backward(
        &stream,
        &bx,
        &BwdOptions { chunk: Some(0), ..Default::default() },
        GradOut::Bf16(&mut dh),
        Some(GradOut::Bf16(&mut dw)),
    );
    assert!(matches!(r, Err(Error::Invalid(_))), "{r:?}");
    let host = stream.clone_dtoh(&dh).unwrap();
    assert!(host.iter().all(|x| x.is_nan()), "dh written by a failed call");
    // dh of the wrong length.
    let mut dh_short: CudaSlice<bf16> = stream.alloc_zeros(t * d - 1).unwrap();
    let r = head.backward(&stream, &bx, &BwdOptions::default(), GradOut::Bf16(&mut dh_short), Some(GradOut::Bf16(&mut dw)));
    assert!(matches!(r, Err(Error::Length { what: "dh", .. })), "{r:?}");
}

/// Buffers from another CUDA context are refused.
#[test]
fn buffers_from_another_context_are_refused() {
    let Some((head, stream)) = gpu_or_skip("gpu_reliability::another_context") else { return };
    let (t, v, d) = (8, 64, 64);
    let s = setup(&stream, t, v, d, 3);
    let ctx2 = lmhead::cudarc::driver::CudaContext::new_non_primary(0, 0).unwrap();
    let stream2 = ctx2.default_stream();
    let h2: CudaSlice<bf16> = stream2.alloc_zeros(t * d).unwrap();
    let (r, lp, _) = fwd_raw(&head, &stream, &h2, &s.w, &s.labels, Problem::new(t, v, d), &FwdOptions::default(), t);
    assert!(matches!(r, Err(Error::WrongContext { .. })), "{r:?}");
    assert!(untouched(&lp));
    // A stream of the other context.
    let mut lp: CudaSlice<f32> = stream2.alloc_zeros(t).unwrap();
    let mut lse: CudaSlice<f32> = stream2.alloc_zeros(t).unwrap();
    let r = head.forward(
        &stream2,
        &FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: Problem::new(t, v, d) },
        &FwdOptions::default(),
        FwdOutputs { logprob: &mut lp, lse: &mut lse, entropy: None },
    );
    assert!(matches!(r, Err(Error::WrongContext { what: "stream" })), "{r:?}");
}

/// NaN (or ±∞) in a row of `h`: that row's outputs are NaN, every other row is bitwise unchanged.
/// NaN in a row of `W` reaches every token (each row of logits includes that column): all NaN.
#[test]
fn nan_propagates_to_the_affected_rows_only() {
    let Some((head, stream)) = gpu_or_skip("gpu_reliability::nan") else { return };
    let (t, v, d) = (40, 500, 64);
    let s = setup(&stream, t, v, d, 5);
    let p = Problem::new(t, v, d);
    let o = FwdOptions { config: Choice::Fallback, ..Default::default() };
    let (r, clean_lp, clean_ent) = fwd_raw(&head, &stream, &s.h, &s.w, &s.labels, p, &o, t);
    r.unwrap();
    for bad in [f32::NAN, f32::INFINITY] {
        let mut hb = s.case.h.clone();
        hb[3 * d + 5] = lmhead_reference::bf16::from_f32(bad);
        let h = upload_bf16(&stream, &hb).unwrap();
        let (r, lp, ent) = fwd_raw(&head, &stream, &h, &s.w, &s.labels, p, &o, t);
        r.unwrap();
        for i in 0..t {
            if i == 3 {
                if s.case.labels[i] != s.case.ignore_index {
                    assert!(lp[i].is_nan() && ent[i].is_nan(), "{bad} in h row 3 must give NaN there, got {} {}", lp[i], ent[i]);
                }
            } else {
                assert_eq!(lp[i].to_bits(), clean_lp[i].to_bits(), "row {i} disturbed by {bad} in row 3");
                assert_eq!(ent[i].to_bits(), clean_ent[i].to_bits(), "row {i} disturbed by {bad} in row 3");
            }
        }
    }
    let mut wb = s.case.w.clone();
    wb[7 * d] = lmhead_reference::bf16::from_f32(f32::NAN);
    let w = upload_bf16(&stream, &wb).unwrap();
    let (r, lp, _) = fwd_raw(&head, &stream, &s.h, &w, &s.labels, p, &o, t);
    r.unwrap();
    for i in 0..t {
        if s.case.labels[i] != s.case.ignore_index {
            assert!(lp[i].is_nan(), "row {i}: NaN in W must reach every token");
        }
    }
}

/// Out of memory while allocating the backward staging buffer: a typed error, not a crash.
#[test]
fn out_of_memory_is_an_error() {
    let Some((head, stream)) = gpu_or_skip("gpu_reliability::oom") else { return };
    let (t, v, d) = (4096, 8192, 64);
    let s = setup(&stream, t, v, d, 9);
    let (free, _) = head.gpu().context().mem_get_info().unwrap();
    // Leave ~16 MiB free; the staging buffer needs t·chunk·2 = 64 MiB.
    let hog: CudaSlice<u8> = stream.alloc_zeros(free.saturating_sub(16 << 20)).unwrap();
    let lse = upload(&stream, &vec![1.0f32; t]).unwrap();
    let g = upload(&stream, &vec![1.0f32; t]).unwrap();
    let mut dh: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
    let mut dw: CudaSlice<bf16> = stream.alloc_zeros(v * d).unwrap();
    let bx = BwdInputs {
        h: &s.h,
        w: &s.w,
        labels: &s.labels,
        lse: &lse,
        entropy: None,
        grad_logprob: Some(&g),
        grad_entropy: None,
        problem: Problem::new(t, v, d),
    };
    let bo = BwdOptions { config: BwdConfigs::all(Choice::Fallback), ..Default::default() };
    let r = head.backward(&stream, &bx, &bo, GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw)));
    assert!(matches!(r, Err(Error::OutOfMemory { .. })), "{r:?}");
    drop(hog);
    head.backward(&stream, &bx, &bo, GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw))).expect("works again once memory is free");
}

/// Fast random bf16 in parallel (large shapes): N(0,1)·scale approximately.
fn random_bits(n: usize, scale: f64, seed: u64) -> Vec<u16> {
    let mut out = vec![0u16; n];
    std::thread::scope(|s| {
        let chunks: Vec<&mut [u16]> = out.chunks_mut(n.div_ceil(16).max(1)).collect();
        for (ci, c) in chunks.into_iter().enumerate() {
            s.spawn(move || {
                let mut r = Rng::new(seed ^ (ci as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
                for x in c.iter_mut() {
                    *x = lmhead_reference::bf16::from_f32((r.normal() * scale) as f32);
                }
            });
        }
    });
    out
}

/// 64-bit indexing: `t·v > 2³¹` (the backward staging buffer of one chunk spanning the whole
/// vocab holds 2.5e9 elements) and `v·d > 2³¹` (`W` of 2.5e9 elements). Sampled rows are checked
/// against the f64 reference, including the last rows where offsets pass 2³¹.
#[test]
fn large_indices_past_2_pow_31() {
    let test = "gpu_reliability::large_indices";
    let Some((head, stream)) = gpu_or_skip(test) else { return };
    let seed = run_seed(test);
    for &(t, v, d, chunk) in &[(16_384usize, 151_936usize, 64usize, 151_936usize), (64, 151_936, 16_384, 8192)] {
        let desc = format!("t={t} v={v} d={d} chunk={chunk} seed={seed}");
        let hs = random_bits(t * d, 4.0 / (d as f64).sqrt(), seed);
        let ws = random_bits(v * d, 0.5, seed ^ 1);
        let mut rng = Rng::new(seed ^ 2);
        let mut labels: Vec<i64> = (0..t).map(|_| rng.below(v as u64) as i64).collect();
        labels[t - 1] = v as i64 - 1; // the last vocab row, at the largest offsets
        let inp = Inputs { h: &hs, w: &ws, labels: &labels, t, v, d, v_begin: 0, v_total: v as i64, temperature: 1.0, ignore_index: -100 };
        let h = upload_bf16(&stream, &hs).unwrap();
        let w = upload_bf16(&stream, &ws).unwrap();
        let lab = upload(&stream, &labels).unwrap();
        let p = Problem::new(t, v, d);
        let o = FwdOptions { config: Choice::Fallback, ..Default::default() };
        let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
        let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
        let mut ent: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
        head.forward(
            &stream,
            &FwdInputs { h: &h, w: &w, labels: &lab, problem: p },
            &o,
            FwdOutputs { logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) },
        )
        .unwrap();
        let glp = download_f32(&stream, &lp).unwrap();
        let glse = download_f32(&stream, &lse).unwrap();
        let gent = download_f32(&stream, &ent).unwrap();
        let rows = [0, 1, t / 2, t - 2, t - 1];
        let r = forward_rows(&inp, &rows);
        for (&i, r) in rows.iter().zip(&r) {
            let tol = 1e-4 + r.lse.abs().max(1.0) * f64::powi(2.0, -22) * (d as f64 / 16.0 + 4.0);
            assert!((glp[i] - r.logprob).abs() <= tol, "logprob row {i}: {} vs {} [{desc}]", glp[i], r.logprob);
            // Entropy: a per-logit error moves H by up to `spread` times it (tests/gpu_fwd.rs).
            let ent_tol = 1e-4 + (tol - 1e-4) * (1.0 + r.spread) + 1e-4 * r.entropy;
            assert!((gent[i] - r.entropy).abs() <= ent_tol, "entropy row {i} [{desc}]");
        }
        // Backward: dW rows at the end of the vocab (the largest offsets), f32 output.
        let g = upload(&stream, &vec![1.0f32; t]).unwrap();
        let mut dh: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
        let mut dw: CudaSlice<f32> = stream.alloc_zeros(v * d).unwrap();
        poison(&stream, &mut dw).unwrap();
        let bx = BwdInputs { h: &h, w: &w, labels: &lab, lse: &lse, entropy: None, grad_logprob: Some(&g), grad_entropy: None, problem: p };
        let bo = BwdOptions { chunk: Some(chunk), config: BwdConfigs::all(Choice::Fallback), ..Default::default() };
        head.backward(&stream, &bx, &bo, GradOut::Bf16(&mut dh), Some(GradOut::F32(&mut dw))).unwrap();
        let gdw = download_f32(&stream, &dw).unwrap();
        let vrows = [0, v / 2, v - 2, v - 1];
        let ones = vec![1.0f64; t];
        let zeros = vec![0.0f64; t];
        let rdw = backward_dw_rows(&inp, &glse, &zeros, &Grads { logprob: Some(&ones), entropy: None }, &vrows);
        let got: Vec<f64> = vrows.iter().flat_map(|&j| gdw[j * d..(j + 1) * d].iter().copied()).collect();
        check_rel_l2("dW (last rows)", &desc, &got, &rdw.concat(), 4e-3);
        println!("[{test}] rel {desc}: forward rows {rows:?} and dW rows {vrows:?} match the f64 reference");
        head.release_workspace();
    }
}

/// Small tail shapes through every compiled kernel, for compute-sanitizer (memcheck, racecheck,
/// initcheck, synccheck): every forward and backward candidate, the merges, the tensor-parallel
/// steps, the cast and the naive kernel, and one autotuning pass (which launches every candidate).
#[test]
fn sanitizer_every_kernel_at_tail_shapes() {
    let Some((head, stream)) = gpu_or_skip("gpu_reliability::sanitizer") else { return };
    for fam in [Family::Fwd, Family::FwdEnt] {
        for &c in fam.candidates() {
            let (t, v, d) = (c.bm as usize + 1, 2 * c.bn as usize + 3, c.bk as usize + 8);
            let s = setup(&stream, t, v, d, 1);
            let o = FwdOptions { config: Choice::Fixed(c), ..Default::default() };
            let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
            let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
            let mut ent: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
            let e = (fam == Family::FwdEnt).then_some(&mut ent);
            let x = FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: Problem::new(t, v, d) };
            head.forward(&stream, &x, &o, FwdOutputs { logprob: &mut lp, lse: &mut lse, entropy: e.map(|e| e as _) }).unwrap();
        }
    }
    // Backward: every d-logits candidate (with entropy) and every GEMM candidate, bf16 and f32.
    let bwd = |cfg: BwdConfigs, t: usize, v: usize, d: usize, chunk: usize, f32_out: bool| {
        let s = setup(&stream, t, v, d, 2);
        let lse = upload(&stream, &vec![3.0f32; t]).unwrap();
        let ent = upload(&stream, &vec![1.0f32; t]).unwrap();
        let g = upload(&stream, &vec![1.0f32; t]).unwrap();
        let bx = BwdInputs {
            h: &s.h,
            w: &s.w,
            labels: &s.labels,
            lse: &lse,
            entropy: Some(&ent),
            grad_logprob: Some(&g),
            grad_entropy: Some(&g),
            problem: Problem::new(t, v, d),
        };
        let bo = BwdOptions { chunk: Some(chunk), config: cfg, ..Default::default() };
        if f32_out {
            let mut dh: CudaSlice<f32> = stream.alloc_zeros(t * d).unwrap();
            let mut dw: CudaSlice<f32> = stream.alloc_zeros(v * d).unwrap();
            head.backward(&stream, &bx, &bo, GradOut::F32(&mut dh), Some(GradOut::F32(&mut dw))).unwrap();
        } else {
            let mut dh: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
            let mut dw: CudaSlice<bf16> = stream.alloc_zeros(v * d).unwrap();
            head.backward(&stream, &bx, &bo, GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw))).unwrap();
        }
    };
    for &c in Family::BwdDlogitsEnt.candidates() {
        let cfg = BwdConfigs { dlogits: Choice::Fixed(c), ..BwdConfigs::all(Choice::Fallback) };
        bwd(cfg, c.bm as usize + 1, 2 * c.bn as usize + 3, c.bk as usize + 8, c.bn as usize + 5, false);
    }
    for &c in Family::BwdDh.candidates() {
        let cfg = BwdConfigs { dh: Choice::Fixed(c), dw: Choice::Fixed(c), ..BwdConfigs::all(Choice::Fallback) };
        bwd(cfg, c.bm as usize + 1, 4 * c.bk as usize + 6, c.bn as usize + 8, 2 * c.bk as usize + 3, c.bm % 128 == 0);
    }
    // Tensor-parallel merge steps (two ranks, one thread each) and the bf16 dh reduction + cast.
    let comms = LocalComm::group(2);
    std::thread::scope(|sc| {
        for (r, comm) in comms.iter().enumerate() {
            sc.spawn(move || {
                let head = LmHead::new(0).unwrap();
                let stream = head.gpu().context().new_stream().unwrap();
                let (t, v_total, d) = (65, 301, 72);
                let case = Case::generate(4, t, v_total, d, &Structure::default());
                let (shard, len) = Shard::even(r, 2, v_total);
                let h = upload_bf16(&stream, &case.h).unwrap();
                let w = upload_bf16(&stream, &case.w[shard.v_begin * d..(shard.v_begin + len) * d]).unwrap();
                let labels = upload(&stream, &case.labels).unwrap();
                let p = Problem::new(t, len, d);
                let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
                let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
                let mut ent: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
                let x = FwdInputs { h: &h, w: &w, labels: &labels, problem: p };
                let o = FwdOptions { config: Choice::Fallback, ..Default::default() };
                head.forward_tp(comm, &stream, &x, shard, &o, FwdOutputs { logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) })
                    .unwrap();
                let g = upload(&stream, &vec![1.0f32; t]).unwrap();
                let mut dh: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
                let mut dw: CudaSlice<bf16> = stream.alloc_zeros(len * d).unwrap();
                let bx = BwdInputs {
                    h: &h,
                    w: &w,
                    labels: &labels,
                    lse: &lse,
                    entropy: Some(&ent),
                    grad_logprob: Some(&g),
                    grad_entropy: Some(&g),
                    problem: p,
                };
                let bo = BwdOptions { chunk: Some(64), config: BwdConfigs::all(Choice::Fallback), ..Default::default() };
                head.backward_tp(
                    comm,
                    &stream,
                    &bx,
                    shard,
                    lmhead::ReduceDh::AllReduce,
                    &bo,
                    GradOut::Bf16(&mut dh),
                    Some(GradOut::Bf16(&mut dw)),
                )
                .unwrap();
                stream.synchronize().unwrap();
            });
        }
    });
    // Naive kernel, and one autotuning pass over every forward candidate (cache kept in memory).
    let s = setup(&stream, 9, 300, 64, 3);
    let (r, _, _) =
        fwd_raw(&head, &stream, &s.h, &s.w, &s.labels, Problem::new(9, 300, 64), &FwdOptions { naive: true, ..Default::default() }, 9);
    r.unwrap();
    let tuner = lmhead::Tuner::new(true, Some(head.gpu().info().clone()), lmhead::tune::cache::Cache::open(None, "sanitizer"));
    let tuned = LmHead::with_tuner(head.gpu().clone(), tuner);
    let (r, _, _) = fwd_raw(&tuned, &stream, &s.h, &s.w, &s.labels, Problem::new(9, 300, 64), &FwdOptions::default(), 9);
    r.unwrap();
    stream.synchronize().unwrap();
    println!("[gpu_reliability::sanitizer] every kernel ran at its tail shapes");
}

/// Tuning (through the warm-up API) runs on the library's own scratch buffers: the caller's
/// poisoned outputs stay poisoned and its inputs keep their bytes; later calls reuse the cached
/// winners; and the tuned configs give the fallback's answer within tolerance.
#[test]
fn tuning_never_touches_caller_buffers_and_agrees_with_fallback() {
    let test = "gpu_reliability::tuning";
    let Some((plain, stream)) = gpu_or_skip(test) else { return };
    let tuner = lmhead::Tuner::new(true, Some(plain.gpu().info().clone()), lmhead::tune::cache::Cache::open(None, "tuning-test"));
    let head = LmHead::with_tuner(plain.gpu().clone(), tuner);
    let (t, v, d) = (1000, 5003, 512);
    let s = setup(&stream, t, v, d, run_seed(test));
    let before = (stream.clone_dtoh(&s.h).unwrap(), stream.clone_dtoh(&s.w).unwrap(), stream.clone_dtoh(&s.labels).unwrap());
    let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut ent: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    for b in [&mut lp, &mut lse, &mut ent] {
        poison(&stream, b).unwrap();
    }
    head.warm_up(&[t], v, d, true, true).unwrap();
    stream.synchronize().unwrap();
    for (name, b) in [("logprob", &lp), ("lse", &lse), ("entropy", &ent)] {
        assert!(untouched(&download_f32(&stream, b).unwrap()), "tuning wrote the caller's {name}");
    }
    let after = (stream.clone_dtoh(&s.h).unwrap(), stream.clone_dtoh(&s.w).unwrap(), stream.clone_dtoh(&s.labels).unwrap());
    assert!(before.0.iter().zip(&after.0).all(|(a, b)| a.to_bits() == b.to_bits()), "h changed");
    assert!(before.1.iter().zip(&after.1).all(|(a, b)| a.to_bits() == b.to_bits()), "W changed");
    assert_eq!(before.2, after.2, "labels changed");
    let tuned = head.tuner().entries().len();
    assert!(tuned >= 4, "warm-up tuned the forward and the three backward kernels ({tuned} entries)");
    // The tuned call: no retuning, and the fallback's answer.
    let p = Problem::new(t, v, d);
    let x = FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: p };
    let r =
        head.forward(&stream, &x, &FwdOptions::default(), FwdOutputs { logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) }).unwrap();
    assert_eq!(head.tuner().entries().len(), tuned, "a call in a warmed-up bucket must not retune");
    let (mut lp2, mut lse2, mut ent2): (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<f32>) =
        (stream.alloc_zeros(t).unwrap(), stream.alloc_zeros(t).unwrap(), stream.alloc_zeros(t).unwrap());
    let fb = FwdOptions { config: Choice::Fallback, ..Default::default() };
    head.forward(&stream, &x, &fb, FwdOutputs { logprob: &mut lp2, lse: &mut lse2, entropy: Some(&mut ent2) }).unwrap();
    let (a, b) = (download_f32(&stream, &lp).unwrap(), download_f32(&stream, &lp2).unwrap());
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f64, f64::max);
    assert!(worst < 1e-4, "tuned {:?} vs fallback log-probs differ by {worst}", r.config);
    let (a, b) = (download_f32(&stream, &ent).unwrap(), download_f32(&stream, &ent2).unwrap());
    let worst_ent = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f64, f64::max);
    assert!(worst_ent < 1e-4, "tuned vs fallback entropy differ by {worst_ent}");
    // Backward: tuned vs fallback.
    let g = upload(&stream, &vec![1.0f32; t]).unwrap();
    let run = |cfg: BwdConfigs| {
        let mut dh: CudaSlice<f32> = stream.alloc_zeros(t * d).unwrap();
        let mut dw: CudaSlice<f32> = stream.alloc_zeros(v * d).unwrap();
        let bx = BwdInputs {
            h: &s.h,
            w: &s.w,
            labels: &s.labels,
            lse: &lse,
            entropy: Some(&ent),
            grad_logprob: Some(&g),
            grad_entropy: Some(&g),
            problem: p,
        };
        let rep = head
            .backward(&stream, &bx, &BwdOptions { config: cfg, ..Default::default() }, GradOut::F32(&mut dh), Some(GradOut::F32(&mut dw)))
            .unwrap();
        (download_f32(&stream, &dh).unwrap(), download_f32(&stream, &dw).unwrap(), rep)
    };
    let (dh_t, dw_t, rep) = run(BwdConfigs::all(Choice::Auto));
    assert_eq!(head.tuner().entries().len(), tuned, "the backward in a warmed-up bucket must not retune");
    let (dh_f, dw_f, _) = run(BwdConfigs::all(Choice::Fallback));
    check_rel_l2("dh tuned vs fallback", test, &dh_t, &dh_f, 3e-3);
    check_rel_l2("dW tuned vs fallback", test, &dw_t, &dw_f, 3e-3);
    println!(
        "[{test}] rel tuned configs fwd {:?} bwd {:?}/{:?}/{:?}: |Δ logprob| ≤ {worst:.1e}, |Δ entropy| ≤ {worst_ent:.1e} vs fallback; caller buffers untouched by tuning",
        r.config, rep.dlogits, rep.dh, rep.dw
    );
}

/// A fresh `LmHead` on the same device with autotuning on and an empty in-memory cache: a bad
/// call must be refused before the tuner runs (the reliability tests above pin a fixed config,
/// which skips the tuner and so could not see a call that tuned first and failed later).
fn cold_head(head: &LmHead) -> LmHead {
    let tuner = lmhead::Tuner::new(true, Some(head.gpu().info().clone()), lmhead::tune::cache::Cache::open(None, "cold"));
    LmHead::with_tuner(head.gpu().clone(), tuner)
}

/// One refused call: its name, its result, whether an output was written, and the error it
/// must be.
type Refusal<R> = (&'static str, lmhead::Result<R>, bool, Want);
/// The error a refused call must answer.
type Want = fn(&Error) -> bool;

/// Regression: on a cold cache, a wrong-length or misaligned buffer used to run the autotuner
/// first (every trial failed on the bad buffer, after seconds) and come back as `Error::Config`
/// ("no candidate ran"), and an out-of-range label was reported only after the outputs were
/// written. Now every buffer and option is checked before anything runs: each case below is its
/// typed error, nothing is tuned or cached, and the outputs keep their poison.
#[test]
fn cold_cache_bad_inputs_are_refused_before_tuning() {
    let Some((head, stream)) = gpu_or_skip("gpu_reliability::cold_cache_bad_inputs") else { return };
    let head = cold_head(&head);
    let (t, v, d) = (300, 1000, 128);
    let s = setup(&stream, t, v, d, 5);
    let p = Problem::new(t, v, d);
    let auto = FwdOptions::default();
    let f32s = |n: usize| -> CudaSlice<f32> { stream.alloc_zeros(n).unwrap() };
    let bf16s = |n: usize| -> CudaSlice<bf16> { stream.alloc_zeros(n).unwrap() };
    let no_tuning = |what: &str| assert!(head.tuner().entries().is_empty(), "{what}: the tuner ran for an invalid call");
    // Forward: one bad buffer or option at a time.
    let fwd = |h: &dyn DevicePtr<bf16>,
               w: &dyn DevicePtr<bf16>,
               l: &dyn DevicePtr<i64>,
               (lp, lse, ent): (&mut CudaSlice<f32>, &mut CudaSlice<f32>, &mut CudaSlice<f32>),
               o: &FwdOptions| {
        for b in [&mut *lp, &mut *lse, &mut *ent] {
            poison(&stream, b).unwrap();
        }
        let r = head.forward(&stream, &FwdInputs { h, w, labels: l, problem: p }, o, FwdOutputs { logprob: lp, lse, entropy: Some(ent) });
        let written = [&*lp, &*lse, &*ent].iter().any(|b| !untouched(&download_f32(&stream, b).unwrap()));
        (r, written)
    };
    let (mut lp, mut lse, mut ent) = (f32s(t), f32s(t), f32s(t));
    let h_big = bf16s(t * d + 8);
    let h_off = h_big.slice(1..1 + t * d);
    let labels_big: CudaSlice<i64> = stream.alloc_zeros(t + 1).unwrap();
    let (h_short, w_short, l_short): (CudaSlice<bf16>, CudaSlice<bf16>, CudaSlice<i64>) =
        (bf16s(t * d - 8), bf16s((v - 1) * d), stream.alloc_zeros(t - 1).unwrap());
    let cases: Vec<Refusal<lmhead::FwdReport>> = vec![
        {
            let (r, wr) = fwd(&h_short, &s.w, &s.labels, (&mut lp, &mut lse, &mut ent), &auto);
            ("h length", r, wr, |e| matches!(e, Error::Length { what: "h", .. }))
        },
        {
            let (r, wr) = fwd(&h_off, &s.w, &s.labels, (&mut lp, &mut lse, &mut ent), &auto);
            ("h alignment", r, wr, |e| matches!(e, Error::Misaligned { what: "h", .. }))
        },
        {
            let (r, wr) = fwd(&s.h, &w_short, &s.labels, (&mut lp, &mut lse, &mut ent), &auto);
            ("W length", r, wr, |e| matches!(e, Error::Length { what: "W", .. }))
        },
        {
            let (r, wr) = fwd(&s.h, &s.w, &l_short, (&mut lp, &mut lse, &mut ent), &auto);
            ("labels length", r, wr, |e| matches!(e, Error::Length { what: "labels", .. }))
        },
        {
            // SAFETY: `labels_big` holds t + 1 i64 (8t + 8 bytes) and outlives the call; the view
            // of t elements starts 4 bytes in, misaligned for i64 on purpose.
            let l_off = unsafe { lmhead::Borrowed::<i64>::new(labels_big.device_ptr(&stream).0 + 4, t, &stream) };
            let (r, wr) = fwd(&s.h, &s.w, &l_off, (&mut lp, &mut lse, &mut ent), &auto);
            ("labels alignment", r, wr, |e| matches!(e, Error::Misaligned { what: "labels", .. }))
        },
        {
            let (r, wr) = fwd(&s.h, &s.w, &s.labels, (&mut lp, &mut lse, &mut ent), &FwdOptions { temperature: 0.0, ..auto.clone() });
            ("temperature", r, wr, |e| matches!(e, Error::Temperature(_)))
        },
    ];
    for (what, r, written, want) in cases {
        match &r {
            Err(e) if want(e) => {}
            other => panic!("{what}: expected its typed error, got {other:?}"),
        }
        assert!(!written, "{what}: an output was written by a refused call");
        no_tuning(what);
    }
    // Outputs of the wrong length.
    for (which, n) in [("logprob", 0usize), ("lse", 1), ("entropy", 2)] {
        let mut bufs = [f32s(t), f32s(t), f32s(t)];
        bufs[n] = f32s(t + 1);
        let [mut a, mut b, mut c] = bufs;
        let r = head.forward(
            &stream,
            &FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: p },
            &auto,
            FwdOutputs { logprob: &mut a, lse: &mut b, entropy: Some(&mut c) },
        );
        assert!(matches!(r, Err(Error::Length { what, .. }) if what == which), "{which}: {r:?}");
        no_tuning(which);
    }
    // A label out of range: refused before tuning, nothing written, the row and label named.
    let mut bad = s.case.labels.clone();
    bad[123] = v as i64 + 5;
    let bad_d = upload(&stream, &bad).unwrap();
    let (r, written) = fwd(&s.h, &s.w, &bad_d, (&mut lp, &mut lse, &mut ent), &auto);
    assert!(matches!(r, Err(Error::BadLabel { row: Some(123), label: Some(l) }) if l == v as i64 + 5), "{r:?}");
    assert!(!written, "a bad label let the forward write its outputs");
    no_tuning("bad label");
    // Overlapping outputs (only possible with borrowed memory).
    let both = f32s(2 * t);
    let ptr = both.device_ptr(&stream).0;
    // SAFETY: `both` holds 2t f32 and outlives the call below; the views overlap on purpose.
    let (mut o1, mut o2) =
        unsafe { (lmhead::Borrowed::<f32>::new(ptr, t, &stream), lmhead::Borrowed::<f32>::new(ptr + 4 * 8, t, &stream)) };
    let r = head.forward(
        &stream,
        &FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: p },
        &auto,
        FwdOutputs { logprob: &mut o1, lse: &mut o2, entropy: None },
    );
    assert!(matches!(r, Err(Error::Invalid(ref m)) if m.contains("overlaps")), "{r:?}");
    no_tuning("overlap");
    // Backward: each buffer and option.
    let lse_d = upload(&stream, &vec![1.0f32; t]).unwrap();
    let g = upload(&stream, &vec![1.0f32; t]).unwrap();
    let g_short = upload(&stream, &vec![1.0f32; t - 1]).unwrap();
    let bx = BwdInputs {
        h: &s.h,
        w: &s.w,
        labels: &s.labels,
        lse: &lse_d,
        entropy: Some(&lse_d),
        grad_logprob: Some(&g),
        grad_entropy: Some(&g),
        problem: p,
    };
    let bwd = |x: &BwdInputs<i64>, o: &BwdOptions, dh_len: usize, dw_len: usize| {
        let (mut dh, mut dw) = (bf16s(dh_len), bf16s(dw_len));
        poison(&stream, &mut dh).unwrap();
        poison(&stream, &mut dw).unwrap();
        let r = head.backward(&stream, x, o, GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw)));
        let written =
            !stream.clone_dtoh(&dh).unwrap().iter().all(|x| x.is_nan()) || !stream.clone_dtoh(&dw).unwrap().iter().all(|x| x.is_nan());
        (r, written)
    };
    let bo = BwdOptions::default();
    // A tile config compiled for no family (GEMM candidates serve dh and dW alike, so a dW
    // candidate is a valid dh config).
    let not_compiled =
        lmhead::TileConfig { bm: 96, bn: 96, bk: 32, stages: 2, warps_m: 2, warps_n: 2, mainloop: lmhead::Mainloop::MmaSync };
    assert!(Family::ALL.iter().all(|f| !f.candidates().contains(&not_compiled)));
    let bogus_dh = BwdOptions { config: BwdConfigs { dh: Choice::Fixed(not_compiled), ..BwdConfigs::all(Choice::Auto) }, ..bo.clone() };
    // Each case is checked right after its call, so a case that tunes is named.
    let check_b = |what: &str, (r, written): (lmhead::Result<lmhead::BwdReport>, bool), want: Want| {
        match &r {
            Err(e) if want(e) => {}
            other => panic!("backward {what}: expected its typed error, got {other:?}"),
        }
        assert!(!written, "backward {what}: an output was written by a refused call");
        no_tuning(what);
    };
    let full = (t * d, v * d);
    let run = |x: &BwdInputs<i64>, o: &BwdOptions, (dh_len, dw_len): (usize, usize)| bwd(x, o, dh_len, dw_len);
    check_b("h", run(&BwdInputs { h: &h_short, ..bx }, &bo, full), |e| matches!(e, Error::Length { what: "h", .. }));
    check_b("h align", run(&BwdInputs { h: &h_off, ..bx }, &bo, full), |e| matches!(e, Error::Misaligned { what: "h", .. }));
    check_b("W", run(&BwdInputs { w: &w_short, ..bx }, &bo, full), |e| matches!(e, Error::Length { what: "W", .. }));
    check_b("labels", run(&BwdInputs { labels: &l_short, ..bx }, &bo, full), |e| matches!(e, Error::Length { what: "labels", .. }));
    check_b("lse", run(&BwdInputs { lse: &g_short, ..bx }, &bo, full), |e| matches!(e, Error::Length { what: "lse", .. }));
    check_b("entropy", run(&BwdInputs { entropy: Some(&g_short), ..bx }, &bo, full), |e| {
        matches!(e, Error::Length { what: "entropy", .. })
    });
    check_b("grad_logprob", run(&BwdInputs { grad_logprob: Some(&g_short), ..bx }, &bo, full), |e| {
        matches!(e, Error::Length { what: "grad_logprob", .. })
    });
    check_b("grad_entropy", run(&BwdInputs { grad_entropy: Some(&g_short), ..bx }, &bo, full), |e| {
        matches!(e, Error::Length { what: "grad_entropy", .. })
    });
    check_b("entropy missing", run(&BwdInputs { entropy: None, ..bx }, &bo, full), |e| matches!(e, Error::Invalid(_)));
    check_b("dh", run(&bx, &bo, (t * d - 2, v * d)), |e| matches!(e, Error::Length { what: "dh", .. }));
    check_b("dW", run(&bx, &bo, (t * d, v * d + 2)), |e| matches!(e, Error::Length { what: "dW", .. }));
    check_b("chunk 0", run(&bx, &BwdOptions { chunk: Some(0), ..bo.clone() }, full), |e| matches!(e, Error::Invalid(_)));
    check_b("temperature", run(&bx, &BwdOptions { temperature: -1.0, ..bo.clone() }, full), |e| matches!(e, Error::Temperature(_)));
    check_b("dh config", run(&bx, &bogus_dh, full), |e| matches!(e, Error::Config(_)));
    // warm_up with one bad shape among good ones tunes nothing.
    let r = head.warm_up(&[t, 4 * t], v, d + 4, true, true);
    assert!(matches!(r, Err(Error::Shape(_))), "{r:?}");
    no_tuning("warm_up");
    println!("[cold_cache_bad_inputs] forward 13 cases, backward 14 cases, warm_up 1: typed errors, nothing tuned or written");
}
