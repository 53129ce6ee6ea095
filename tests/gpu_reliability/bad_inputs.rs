//! Bad calls on the GPU: each a typed error with the caller's outputs still poisoned, buffers of
//! another context refused, and (on a cold tuning cache) every bad call refused before the tuner
//! runs.

use super::*;

/// The bad-input matrix: each case a typed error, and the outputs still hold their poison.
#[test]
fn bad_inputs_are_typed_errors_and_leave_buffers_untouched() {
    let Some((head, stream)) = gpu_or_skip("gpu_reliability::bad_inputs") else { return };
    let (t, v, d) = (33, 257, 64);
    let s = setup(&stream, t, v, d, 11);
    let p = Problem::new(t, v, d);
    let o = FwdOptions { config: Choice::Fallback, ..Default::default() };
    let run = |h: &dyn DevicePtr<bf16>, w: &dyn DevicePtr<bf16>, l: &dyn DevicePtr<i64>, p: Problem, o: &FwdOptions| {
        fwd_raw(&head, &stream, &FwdInputs { h, w, labels: l, problem: p }, o, t)
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
        FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: None },
    );
    assert!(matches!(r, Err(Error::Invalid(_))), "{r:?}");
    // Backward: entropy gradient without the saved entropy; bad chunk width.
    let lse_d = upload(&stream, &vec![1.0f32; t]).unwrap();
    let g = upload(&stream, &vec![1.0f32; t]).unwrap();
    let mut dh: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
    let mut dw: CudaSlice<bf16> = stream.alloc_zeros(v * d).unwrap();
    poison(&stream, &mut dh).unwrap();
    let bx = BwdInputs {
        kept: None,
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
    let bx = BwdInputs { kept: None, grad_entropy: None, grad_logprob: Some(&g), ..bx };
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
    let (r, lp, _) = fwd_raw(
        &head,
        &stream,
        &FwdInputs { h: &h2, w: &s.w, labels: &s.labels, problem: Problem::new(t, v, d) },
        &FwdOptions::default(),
        t,
    );
    assert!(matches!(r, Err(Error::WrongContext { .. })), "{r:?}");
    assert!(untouched(&lp));
    // A stream of the other context.
    let mut lp: CudaSlice<f32> = stream2.alloc_zeros(t).unwrap();
    let mut lse: CudaSlice<f32> = stream2.alloc_zeros(t).unwrap();
    let r = head.forward(
        &stream2,
        &FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: Problem::new(t, v, d) },
        &FwdOptions::default(),
        FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: None },
    );
    assert!(matches!(r, Err(Error::WrongContext { what: "stream" })), "{r:?}");
}

/// A fresh `LmHead` on the same device with autotuning on and an empty in-memory cache: a bad
/// call must be refused before the tuner runs (the reliability tests above pin a fixed config,
/// which skips the tuner and so could not see a call that tuned first and failed later).
fn cold_head(head: &LmHead) -> LmHead {
    let tuner = lmhead::Tuner::new(
        lmhead::tune::Policy::Shortlist,
        Some(head.gpu().info().clone()),
        lmhead::tune::cache::Cache::open(None, "cold"),
    );
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
        let r = head.forward(
            &stream,
            &FwdInputs { h, w, labels: l, problem: p },
            o,
            FwdOutputs { kept: None, logprob: lp, lse, entropy: Some(ent) },
        );
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
            FwdOutputs { kept: None, logprob: &mut a, lse: &mut b, entropy: Some(&mut c) },
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
        FwdOutputs { kept: None, logprob: &mut o1, lse: &mut o2, entropy: None },
    );
    assert!(matches!(r, Err(Error::Invalid(ref m)) if m.contains("overlaps")), "{r:?}");
    no_tuning("overlap");
    // Backward: each buffer and option.
    let lse_d = upload(&stream, &vec![1.0f32; t]).unwrap();
    let g = upload(&stream, &vec![1.0f32; t]).unwrap();
    let g_short = upload(&stream, &vec![1.0f32; t - 1]).unwrap();
    let bx = BwdInputs {
        kept: None,
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
    check_b("h", run(&BwdInputs { kept: None, h: &h_short, ..bx }, &bo, full), |e| matches!(e, Error::Length { what: "h", .. }));
    check_b("h align", run(&BwdInputs { kept: None, h: &h_off, ..bx }, &bo, full), |e| matches!(e, Error::Misaligned { what: "h", .. }));
    check_b("W", run(&BwdInputs { kept: None, w: &w_short, ..bx }, &bo, full), |e| matches!(e, Error::Length { what: "W", .. }));
    check_b("labels", run(&BwdInputs { kept: None, labels: &l_short, ..bx }, &bo, full), |e| {
        matches!(e, Error::Length { what: "labels", .. })
    });
    check_b("lse", run(&BwdInputs { kept: None, lse: &g_short, ..bx }, &bo, full), |e| matches!(e, Error::Length { what: "lse", .. }));
    check_b("entropy", run(&BwdInputs { kept: None, entropy: Some(&g_short), ..bx }, &bo, full), |e| {
        matches!(e, Error::Length { what: "entropy", .. })
    });
    check_b("grad_logprob", run(&BwdInputs { kept: None, grad_logprob: Some(&g_short), ..bx }, &bo, full), |e| {
        matches!(e, Error::Length { what: "grad_logprob", .. })
    });
    check_b("grad_entropy", run(&BwdInputs { kept: None, grad_entropy: Some(&g_short), ..bx }, &bo, full), |e| {
        matches!(e, Error::Length { what: "grad_entropy", .. })
    });
    check_b("entropy missing", run(&BwdInputs { kept: None, entropy: None, ..bx }, &bo, full), |e| matches!(e, Error::Invalid(_)));
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
