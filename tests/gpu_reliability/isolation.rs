//! Every kernel at tail shapes for compute-sanitizer (the `sanitizer_*` test), tuning that runs
//! on the library's own scratch buffers only, and the check that keeps tuning off a stream being
//! captured into a CUDA graph.

use lmhead::tune::cache::Cache;
use lmhead::tune::Policy;

use super::*;

/// Small tail shapes through every compiled kernel, for compute-sanitizer (memcheck, racecheck,
/// initcheck, synccheck): every forward and backward candidate, the merges, the tensor-parallel
/// steps, the cast and the naive kernel, and one exhaustive tuning pass (which launches every
/// candidate).
#[test]
fn sanitizer_every_kernel_at_tail_shapes() {
    let Some((head, stream)) = gpu_or_skip("gpu_reliability::sanitizer") else { return };
    for fam in [Family::Fwd, Family::FwdEnt] {
        // Each candidate at tail shapes; each sm90 one also with one token tile per SM (one
        // vocab split: several tiles per block) and 5 K steps.
        let sms = head.gpu().info().sm_count as usize;
        let shapes = |c: lmhead::TileConfig| {
            let (bm, bn, bk) = (c.bm as usize, c.bn as usize, c.bk as usize);
            let tail = (bm + 1, 2 * bn + 3, bk + 8);
            [Some(tail), c.is_sm90().then_some((sms * bm - 5, 4 * bn + 3, 4 * bk + 8))]
        };
        for (c, (t, v, d)) in
            fam.candidates().iter().filter(|c| held(c)).flat_map(|&c| shapes(c).into_iter().flatten().map(move |s| (c, s)))
        {
            let s = setup(&stream, t, v, d, 1);
            let o = FwdOptions { config: Choice::Fixed(c), ..Default::default() };
            let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
            let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
            let mut ent: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
            let e = (fam == Family::FwdEnt).then_some(&mut ent);
            let x = FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: Problem::new(t, v, d) };
            head.forward(&stream, &x, &o, FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: e.map(|e| e as _) }).unwrap();
        }
    }
    // Backward: every d-logits candidate (with entropy) and every GEMM candidate, bf16 and f32.
    let bwd = |cfg: BwdConfigs, t: usize, v: usize, d: usize, chunk: usize, f32_out: bool| {
        let s = setup(&stream, t, v, d, 2);
        let lse = upload(&stream, &vec![3.0f32; t]).unwrap();
        let ent = upload(&stream, &vec![1.0f32; t]).unwrap();
        let g = upload(&stream, &vec![1.0f32; t]).unwrap();
        let bx = BwdInputs {
            kept: None,
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
    for &c in Family::BwdDlogitsEnt.candidates().iter().filter(|c| held(c)) {
        let cfg = BwdConfigs { dlogits: Choice::Fixed(c), ..BwdConfigs::all(Choice::Fallback) };
        bwd(cfg, c.bm as usize + 1, 2 * c.bn as usize + 3, c.bk as usize + 8, c.bn as usize + 5, false);
    }
    for &c in Family::BwdDh.candidates().iter().filter(|c| held(c)) {
        // dW at the same tile (for a dh-only `tma_store` config, its register twin).
        let cfg = BwdConfigs { dh: Choice::Fixed(c), dw: Choice::Fixed(c.register_twin()), ..BwdConfigs::all(Choice::Fallback) };
        bwd(cfg, c.bm as usize + 1, 4 * c.bk as usize + 6, c.bn as usize + 8, 2 * c.bk as usize + 3, c.bm % 128 == 0);
        if c.mainloop.tma_store() {
            // Four chunks into bf16: the TMA store, two TMA adds, then the register epilogue.
            bwd(cfg, c.bm as usize + 1, 4 * c.bk as usize + 6, c.bn as usize + 8, c.bk as usize + 3, false);
        }
    }
    // Kept logits (`lmhead::keep`): every forward candidate's `_keep` twin at a tail shape with
    // a partial budget (256 of 300 rows) and compacted ignored rows, then the backward reading
    // them (the kept kernel's vector loads at chunk starts that are multiples of 8, its scalar
    // loads at starts that are not, the rest of the rows recomputed).
    for (i, &c) in Family::FwdEnt.candidates().iter().filter(|c| held(c)).enumerate() {
        let (t, v, d) = (300, 2 * c.bn as usize + 3, c.bk as usize + 8);
        let mut s = setup(&stream, t, v, d, 3);
        let labels: Vec<i64> = (0..t).map(|r| if r % 5 == 0 { lmhead_reference::IGNORE_INDEX } else { (r * 31 % v) as i64 }).collect();
        s.labels = upload(&stream, &labels).unwrap();
        let budget = 299 * lmhead::keep::row_bytes(v);
        let mut kept: CudaSlice<f32> = stream.alloc_zeros(lmhead::keep::len(t, v, budget)).unwrap();
        let compaction = if i % 2 == 0 { lmhead::Compaction::Always } else { lmhead::Compaction::Off };
        let o = FwdOptions { config: Choice::Fixed(c), keep_logits: budget, compaction, ..Default::default() };
        let (mut lp, mut lse, mut ent): (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<f32>) =
            (stream.alloc_zeros(t).unwrap(), stream.alloc_zeros(t).unwrap(), stream.alloc_zeros(t).unwrap());
        let x = FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: Problem::new(t, v, d) };
        let r = head
            .forward(&stream, &x, &o, FwdOutputs { kept: Some(&mut kept), logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) })
            .unwrap();
        assert_eq!(r.kept_rows, 256);
        let g = upload(&stream, &vec![1.0f32; t]).unwrap();
        for chunk in [v / 2 + 1, 64] {
            let bx = BwdInputs {
                kept: Some(lmhead::keep::Kept { logits: &kept, rows: r.kept_rows }),
                h: &s.h,
                w: &s.w,
                labels: &s.labels,
                lse: &lse,
                entropy: Some(&ent),
                grad_logprob: Some(&g),
                grad_entropy: Some(&g),
                problem: Problem::new(t, v, d),
            };
            let bo = BwdOptions { chunk: Some(chunk), config: BwdConfigs::all(Choice::Fallback), compaction, ..Default::default() };
            let mut dh: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
            let mut dw: CudaSlice<bf16> = stream.alloc_zeros(v * d).unwrap();
            head.backward(&stream, &bx, &bo, GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw))).unwrap();
        }
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
                head.forward_tp(
                    comm,
                    &stream,
                    &x,
                    shard,
                    &o,
                    FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) },
                )
                .unwrap();
                let g = upload(&stream, &vec![1.0f32; t]).unwrap();
                let mut dh: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
                let mut dw: CudaSlice<bf16> = stream.alloc_zeros(len * d).unwrap();
                let bx = BwdInputs {
                    kept: None,
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
                    lmhead::tp::TpBackward { comm, shard, reduce: lmhead::tp::ReduceDh::AllReduce },
                    &stream,
                    &bx,
                    &bo,
                    GradOut::Bf16(&mut dh),
                    Some(GradOut::Bf16(&mut dw)),
                )
                .unwrap();
                stream.synchronize().unwrap();
            });
        }
    });
    compaction_at_tail_shapes(&head, &stream);
    // Naive kernel, and one exhaustive tuning pass over every forward candidate (cache kept in
    // memory).
    let s = setup(&stream, 9, 300, 64, 3);
    let (r, _, _) = fwd_raw(
        &head,
        &stream,
        &FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: Problem::new(9, 300, 64) },
        &FwdOptions { naive: true, ..Default::default() },
        9,
    );
    r.unwrap();
    let tuner = lmhead::Tuner::new(Policy::Exhaustive, Some(head.gpu().info().clone()), Cache::open(None, "sanitizer"));
    let tuned = LmHead::with_tuner(head.gpu().clone(), tuner);
    let (r, _, _) = fwd_raw(
        &tuned,
        &stream,
        &FwdInputs { h: &s.h, w: &s.w, labels: &s.labels, problem: Problem::new(9, 300, 64) },
        &FwdOptions::default(),
        9,
    );
    r.unwrap();
    stream.synchronize().unwrap();
    println!("[gpu_reliability::sanitizer] every kernel ran at its tail shapes");
}

/// The active rows' kernels (count, placement, row copies in 16-byte chunks and in words, value
/// map) at tail shapes: two count blocks and a partial third of rows, half of them active, `i32`
/// and `i64` labels; the backward into bf16 and into an f32 `dh` 8 bytes into its allocation;
/// and two tensor-parallel ranks (the flags written, MAX-reduced and counted).
fn compaction_at_tail_shapes(head: &LmHead, stream: &Arc<CudaStream>) {
    let (t, v, d) = (2 * 2048 + 77, 301, 72);
    let s = setup(stream, t, v, d, 6);
    let mask = lmhead_reference::masks::random(t, 0.5, 6);
    let labels = lmhead_reference::masks::apply(&s.case.labels, &mask, s.case.ignore_index);
    let l64 = upload(stream, &labels).unwrap();
    let l32 = upload(stream, &labels.iter().map(|&l| l as i32).collect::<Vec<_>>()).unwrap();
    let fo = FwdOptions { config: Choice::Fallback, compaction: Compaction::Always, ..Default::default() };
    let p = Problem::new(t, v, d);
    let outs = |n: usize| -> Vec<CudaSlice<f32>> { (0..3).map(|_| stream.alloc_zeros(n).unwrap()).collect() };
    let mut o = outs(t);
    let [lp, lse, ent] = &mut o[..] else { unreachable!() };
    head.forward(
        stream,
        &FwdInputs { h: &s.h, w: &s.w, labels: &l32, problem: p },
        &fo,
        FwdOutputs { kept: None, logprob: lp, lse, entropy: None },
    )
    .unwrap();
    let r = head.forward(
        stream,
        &FwdInputs { h: &s.h, w: &s.w, labels: &l64, problem: p },
        &fo,
        FwdOutputs { kept: None, logprob: lp, lse, entropy: Some(ent) },
    );
    assert!(r.unwrap().rows < t, "the forward compacted");
    let g = upload(stream, &vec![1.0f32; t]).unwrap();
    let bx = BwdInputs {
        kept: None,
        h: &s.h,
        w: &s.w,
        labels: &l32,
        lse: &o[1],
        entropy: Some(&o[2]),
        grad_logprob: Some(&g),
        grad_entropy: Some(&g),
        problem: p,
    };
    let bo = BwdOptions { config: BwdConfigs::all(Choice::Fallback), compaction: Compaction::Always, ..Default::default() };
    let mut dh16: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
    let mut dw16: CudaSlice<bf16> = stream.alloc_zeros(v * d).unwrap();
    head.backward(stream, &bx, &bo, GradOut::Bf16(&mut dh16), Some(GradOut::Bf16(&mut dw16))).unwrap();
    let mut dh32: CudaSlice<f32> = stream.alloc_zeros(t * d + 2).unwrap();
    let mut dw32: CudaSlice<f32> = stream.alloc_zeros(v * d).unwrap();
    let mut dh_view = dh32.slice_mut(2..);
    let bx = BwdInputs {
        kept: None,
        h: &s.h,
        w: &s.w,
        labels: &l64,
        lse: &o[1],
        entropy: Some(&o[2]),
        grad_logprob: Some(&g),
        grad_entropy: None,
        problem: p,
    };
    let r = head.backward(stream, &bx, &bo, GradOut::F32(&mut dh_view), Some(GradOut::F32(&mut dw32)));
    assert!(r.unwrap().rows < t, "the backward compacted");
    let comms = LocalComm::group(2);
    std::thread::scope(|sc| {
        for (r, comm) in comms.iter().enumerate() {
            let (case, labels) = (&s.case, &labels);
            sc.spawn(move || {
                let head = LmHead::new(0).unwrap();
                let stream = head.gpu().context().new_stream().unwrap();
                let (shard, len) = Shard::even(r, 2, v);
                let h = upload_bf16(&stream, &case.h).unwrap();
                let w = upload_bf16(&stream, &case.w[shard.v_begin * d..(shard.v_begin + len) * d]).unwrap();
                let lab = upload(&stream, labels).unwrap();
                let p = Problem::new(t, len, d);
                let mut o: Vec<CudaSlice<f32>> = (0..3).map(|_| stream.alloc_zeros(t).unwrap()).collect();
                let [lp, lse, ent] = &mut o[..] else { unreachable!() };
                let x = FwdInputs { h: &h, w: &w, labels: &lab, problem: p };
                let fo = FwdOptions { config: Choice::Fallback, compaction: Compaction::Always, ..Default::default() };
                head.forward_tp(comm, &stream, &x, shard, &fo, FwdOutputs { kept: None, logprob: lp, lse, entropy: Some(ent) }).unwrap();
                let g = upload(&stream, &vec![1.0f32; t]).unwrap();
                let bx = BwdInputs {
                    kept: None,
                    h: &h,
                    w: &w,
                    labels: &lab,
                    lse: &o[1],
                    entropy: Some(&o[2]),
                    grad_logprob: Some(&g),
                    grad_entropy: Some(&g),
                    problem: p,
                };
                let bo = BwdOptions { config: BwdConfigs::all(Choice::Fallback), compaction: Compaction::Always, ..Default::default() };
                let mut dh: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
                let mut dw: CudaSlice<bf16> = stream.alloc_zeros(len * d).unwrap();
                let tp = lmhead::tp::TpBackward { comm, shard, reduce: lmhead::tp::ReduceDh::AllReduce };
                head.backward_tp(tp, &stream, &bx, &bo, GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw))).unwrap();
                stream.synchronize().unwrap();
            });
        }
    });
}

/// Tuning (through the warm-up API) runs on the library's own scratch buffers: the caller's
/// poisoned outputs stay poisoned and its inputs keep their bytes; later calls reuse the cached
/// winners; and the tuned configs give the fallback's answer within tolerance.
#[test]
fn tuning_never_touches_caller_buffers_and_agrees_with_fallback() {
    let test = "gpu_reliability::tuning";
    let Some((plain, stream)) = gpu_or_skip(test) else { return };
    let tuner = lmhead::Tuner::new(Policy::Shortlist, Some(plain.gpu().info().clone()), Cache::open(None, "tuning-test"));
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
    let r = head
        .forward(&stream, &x, &FwdOptions::default(), FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) })
        .unwrap();
    assert_eq!(head.tuner().entries().len(), tuned, "a call in a warmed-up bucket must not retune");
    let (mut lp2, mut lse2, mut ent2): (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<f32>) =
        (stream.alloc_zeros(t).unwrap(), stream.alloc_zeros(t).unwrap(), stream.alloc_zeros(t).unwrap());
    let fb = FwdOptions { config: Choice::Fallback, ..Default::default() };
    head.forward(&stream, &x, &fb, FwdOutputs { kept: None, logprob: &mut lp2, lse: &mut lse2, entropy: Some(&mut ent2) }).unwrap();
    let (a, b) = (download_f32(&stream, &lp).unwrap(), download_f32(&stream, &lp2).unwrap());
    let worst = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f64, f64::max);
    assert!(worst < 1e-4, "tuned {:?} vs fallback log-probs differ by {worst}", r.kernel);
    let (a, b) = (download_f32(&stream, &ent).unwrap(), download_f32(&stream, &ent2).unwrap());
    let worst_ent = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0f64, f64::max);
    assert!(worst_ent < 1e-4, "tuned vs fallback entropy differ by {worst_ent}");
    // Backward: tuned vs fallback.
    let g = upload(&stream, &vec![1.0f32; t]).unwrap();
    let run = |cfg: BwdConfigs| {
        let mut dh: CudaSlice<f32> = stream.alloc_zeros(t * d).unwrap();
        let mut dw: CudaSlice<f32> = stream.alloc_zeros(v * d).unwrap();
        let bx = BwdInputs {
            kept: None,
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
        r.kernel, rep.dlogits, rep.dh, rep.dw
    );
}

/// The check that keeps tuning trials off a stream being captured into a CUDA graph (a trial
/// queued there would be recorded, not run, and its timing read back would fail the capture):
/// false on a fresh stream, true between the capture's begin and end, false again after.
#[test]
fn a_stream_being_captured_is_seen_as_captured() {
    use lmhead::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    use lmhead::testing::stream_capturing;
    let test = "gpu_reliability::capture";
    let Some((head, _)) = gpu_or_skip(test) else { return };
    let stream = head.context().new_stream().unwrap();
    assert!(!stream_capturing(&stream).unwrap(), "a fresh stream is not being captured");
    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED).unwrap();
    let during = stream_capturing(&stream);
    let ended = stream.end_capture(CUgraphInstantiate_flags(0));
    assert!(during.unwrap(), "between begin and end of a capture the stream is being captured");
    ended.unwrap();
    assert!(!stream_capturing(&stream).unwrap(), "after the capture ended it is not");
    println!("[{test}] capture seen as such: before false, during true, after false");
}
