//! Limits on the GPU: NaN confined to the rows it reaches, out-of-memory as an error, and 64-bit
//! indexing past 2³¹ elements.

use super::*;

/// NaN (or ±∞) in a row of `h`: that row's outputs are NaN, every other row is bitwise unchanged.
/// NaN in a row of `W` reaches every token (each row of logits includes that column): all NaN.
#[test]
fn nan_propagates_to_the_affected_rows_only() {
    let Some((head, stream)) = gpu_or_skip("gpu_reliability::nan") else { return };
    let (t, v, d) = (40, 500, 64);
    let s = setup(&stream, t, v, d, 5);
    let p = Problem::new(t, v, d);
    let o = FwdOptions { config: Choice::Fallback, ..Default::default() };
    let (r, clean_lp, clean_ent) = fwd_raw(&head, &stream, &FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: p }, &o, t);
    r.unwrap();
    for bad in [f32::NAN, f32::INFINITY] {
        let mut hb = s.case.h.clone();
        hb[3 * d + 5] = lmhead_reference::bf16::from_f32(bad);
        let h = upload_bf16(&stream, &hb).unwrap();
        let (r, lp, ent) = fwd_raw(&head, &stream, &FwdInputs { h: &h, w: &s.w, labels: &s.labels, problem: p }, &o, t);
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
    let (r, lp, _) = fwd_raw(&head, &stream, &FwdInputs { h: &s.h, w: &w, labels: &s.labels, problem: p }, &o, t);
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
        kept: None,
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
            FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) },
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
        let bx = BwdInputs {
            kept: None,
            h: &h,
            w: &w,
            labels: &lab,
            lse: &lse,
            entropy: None,
            grad_logprob: Some(&g),
            grad_entropy: None,
            problem: p,
        };
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
