//! Tensor parallelism on one GPU with the in-process communicator (one thread per rank), a
//! single-rank NCCL communicator when libnccl is present, and NCCL across 2, 4 and 8 GPUs when
//! the machine has them (one rank per device). Skipped without a CUDA driver; the multi-GPU test
//! also skips, saying so, with fewer than two devices.
//!
//! Each TP result is compared with the unsharded GPU run on the same inputs (and the forward also
//! with the f64 reference). Sharding changes only the merge order of the row states and of the
//! `dh` partial sums, so the thresholds are tight: log-prob / lse / entropy within `2e-5` of the
//! unsharded run; `dW` and `dh` (f32) within relative L2 `1e-4`: the global lse differs from the
//! unsharded one by f32 rounding (merge order), which moves `p` by ~1e-7 relative and flips the
//! bf16 rounding of a few staged d-logits by one ulp (measured on the H200: 2.1e-5 for dW at
//! n = 8, once; 1e-5 had been too tight).

use std::sync::Arc;

use lmhead::cudarc::driver::{CudaSlice, CudaStream};
use lmhead::testing::{download_f32, poison, upload, upload_bf16};
use lmhead::tp::{Communicator, LocalComm, ReduceDh, Shard, TpBackward};
use lmhead::{BwdConfigs, BwdInputs, BwdOptions, Choice, FwdInputs, FwdOptions, FwdOutputs, GradOut, LmHead, Problem};
use lmhead_reference::{forward, Case, Structure};
use lmhead_tests::{check, check_rel_l2, gpu_or_skip, run_seed};

struct Outs {
    lp: Vec<f64>,
    lse: Vec<f64>,
    ent: Option<Vec<f64>>,
    dh: Vec<f64>,
    dw: Vec<f64>,
}

/// What every run of one TP case does: the forward with or without entropy, what happens to
/// `dh`, the upstream gradients (log-prob, entropy) and how the kernels are chosen.
#[derive(Clone, Copy)]
struct Mode<'a> {
    entropy: bool,
    reduce: ReduceDh,
    grads: (&'a [f32], &'a [f32]),
    config: Choice,
}

/// One rank's (or the unsharded) run on the vocab rows `[v0, v1)`: forward (entropy optional)
/// and backward with f32 outputs.
fn run_rank(
    head: &LmHead,
    stream: &Arc<CudaStream>,
    case: &Case,
    (v0, v1): (usize, usize),
    comm: Option<&dyn Communicator>,
    m: &Mode,
) -> Outs {
    let Mode { entropy, reduce, grads, config } = *m;
    let (t, d) = (case.t, case.d);
    let v = v1 - v0;
    let p = Problem::new(t, v, d);
    let h = upload_bf16(stream, &case.h).unwrap();
    let w = upload_bf16(stream, &case.w[v0 * d..v1 * d]).unwrap();
    let labels = upload(stream, &case.labels).unwrap();
    let shard = Shard { v_begin: v0, v_total: case.v };
    let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut ent: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    for b in [&mut lp, &mut lse, &mut ent] {
        poison(stream, b).unwrap();
    }
    let fo = FwdOptions { config, ..Default::default() };
    let x = FwdInputs { h: &h, w: &w, labels: &labels, problem: p };
    let outs = FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: if entropy { Some(&mut ent) } else { None } };
    match comm {
        Some(c) => head.forward_tp(c, stream, &x, shard, &fo, outs),
        None => head.forward(stream, &x, &fo, outs),
    }
    .unwrap();
    let gl = upload(stream, grads.0).unwrap();
    let ge = upload(stream, grads.1).unwrap();
    let mut dh: CudaSlice<f32> = stream.alloc_zeros(t * d).unwrap();
    let mut dw: CudaSlice<f32> = stream.alloc_zeros(v * d).unwrap();
    poison(stream, &mut dh).unwrap();
    poison(stream, &mut dw).unwrap();
    let bx = BwdInputs {
        kept: None,
        h: &h,
        w: &w,
        labels: &labels,
        lse: &lse,
        entropy: entropy.then_some(&ent as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        grad_logprob: Some(&gl),
        grad_entropy: entropy.then_some(&ge as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        problem: p,
    };
    // The fallback runs with a small chunk so that shards are walked in several chunks; the
    // autotuned runs with the default chunk.
    let bo = match config {
        Choice::Fallback => BwdOptions { chunk: Some(96), config: BwdConfigs::all(config), ..Default::default() },
        _ => BwdOptions { config: BwdConfigs::all(config), ..Default::default() },
    };
    match comm {
        Some(c) => {
            head.backward_tp(TpBackward { comm: c, shard, reduce }, stream, &bx, &bo, GradOut::F32(&mut dh), Some(GradOut::F32(&mut dw)))
        }
        None => head.backward(stream, &bx, &bo, GradOut::F32(&mut dh), Some(GradOut::F32(&mut dw))),
    }
    .unwrap();
    Outs {
        lp: download_f32(stream, &lp).unwrap(),
        lse: download_f32(stream, &lse).unwrap(),
        ent: entropy.then(|| download_f32(stream, &ent).unwrap()),
        dh: download_f32(stream, &dh).unwrap(),
        dw: download_f32(stream, &dw).unwrap(),
    }
}

/// A TP test problem: ordinary rows (no ±1e4 or all-negative rows: sharding only reorders
/// merges, which the tight thresholds below measure) and normal upstream gradients; the entropy
/// gradient is zero when entropy is not computed.
fn tp_inputs(seed: u64, t: usize, v: usize, d: usize, entropy: bool) -> (Case, Vec<f32>, Vec<f32>) {
    let case = Case::generate(seed, t, v, d, &Structure { huge: 0.0, all_negative: 0.0, ..Default::default() });
    let mut rng = lmhead_reference::rng::Rng::new(seed ^ 7);
    let gl: Vec<f32> = (0..t).map(|_| rng.normal() as f32).collect();
    let ge: Vec<f32> = (0..t).map(|_| rng.normal() as f32).collect();
    (case, gl, gl_or(&ge, entropy))
}

/// Every rank's outputs against the unsharded run: log-prob, lse (and entropy) within `2e-5`, its
/// `dW` shard and `dh` (all-reduced, or the sum of the ranks' partials) within relative L2 `1e-4`
/// when every run used the same (fallback) kernels. Autotuned runs may pick other tiles or the
/// other mainloop for a shard than for the whole vocabulary (a different rounding of each logit,
/// measured at ≈ 1e-5 per log-prob at d = 1024 against the f64 reference): `1e-4` and `1e-3`.
fn check_ranks(desc: &str, d: usize, shards: &[(usize, usize)], ranks: &[Outs], whole: &Outs, m: &Mode) {
    let Mode { entropy, reduce, config, .. } = *m;
    let (fwd_tol, grad_tol) = if config == Choice::Fallback { (2e-5, 1e-4) } else { (1e-4, 1e-3) };
    let tol = |_: usize, _: f64| fwd_tol;
    let mut dh_sum = vec![0.0f64; whole.dh.len()];
    for (r, o) in ranks.iter().enumerate() {
        let what = format!("{desc} rank {r}");
        check("logprob", &what, &o.lp, &whole.lp, &tol);
        check("lse", &what, &o.lse, &whole.lse, &tol);
        if entropy {
            check("entropy", &what, o.ent.as_ref().unwrap(), whole.ent.as_ref().unwrap(), &tol);
        } else {
            assert!(o.ent.is_none());
        }
        let (a, b) = shards[r];
        check_rel_l2("dW shard", &what, &o.dw, &whole.dw[a * d..b * d], grad_tol);
        match reduce {
            ReduceDh::AllReduce => {
                check_rel_l2("dh (all-reduced)", &what, &o.dh, &whole.dh, grad_tol);
            }
            ReduceDh::Caller => dh_sum.iter_mut().zip(&o.dh).for_each(|(s, x)| *s += x),
        }
    }
    if reduce == ReduceDh::Caller {
        check_rel_l2("dh (sum of partials)", desc, &dh_sum, &whole.dh, grad_tol);
    }
}

fn tp_case(test: &str, n: usize, v: usize, entropy: bool, reduce: ReduceDh, seed: u64) -> String {
    let (t, d) = (300, 256);
    let (case, gl, ge) = tp_inputs(seed, t, v, d, entropy);
    let desc = format!("{test} n={n} t={t} v={v} d={d} entropy={entropy} {reduce:?} seed={seed}");
    // Unsharded reference run on the GPU.
    let head = LmHead::new(0).unwrap();
    let stream = head.gpu().context().default_stream();
    let mode = Mode { entropy, reduce, grads: (&gl, &ge), config: Choice::Fallback };
    let whole = run_rank(&head, &stream, &case, (0, v), None, &mode);
    // Every shard holds some label (so every rank's label path is exercised).
    let shards: Vec<(usize, usize)> = (0..n).map(|r| Shard::even(r, n, v)).map(|(s, len)| (s.v_begin, s.v_begin + len)).collect();
    for &(a, b) in &shards {
        assert!(case.labels.iter().any(|&l| l >= a as i64 && l < b as i64), "no label in shard [{a}, {b}) [{desc}]");
    }
    // One thread per rank, each with its own LmHead and stream.
    let comms = LocalComm::group(n);
    let ranks: Vec<Outs> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .iter()
            .zip(&shards)
            .map(|(comm, &range)| {
                let case = &case;
                s.spawn(move || {
                    let head = LmHead::new(0).unwrap();
                    let stream = head.gpu().context().new_stream().unwrap();
                    run_rank(&head, &stream, case, range, Some(comm as &dyn Communicator), &mode)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    check_ranks(&desc, d, &shards, &ranks, &whole, &mode);
    // And the unsharded forward against the f64 reference, as a sanity anchor.
    let r = forward(&case.inputs());
    check("logprob vs f64", &desc, &whole.lp, &r.logprob, &|_, _| 2e-4);
    format!("tp n={n} v={v} entropy={entropy} {reduce:?}: OK ({} ranks agree with the unsharded run)", ranks.len())
}

/// The entropy gradient is only passed when entropy is computed.
fn gl_or(ge: &[f32], entropy: bool) -> Vec<f32> {
    if entropy {
        ge.to_vec()
    } else {
        vec![0.0; ge.len()]
    }
}

#[test]
fn in_process_tp_matches_unsharded() {
    let test = "tp::in_process_tp_matches_unsharded";
    if gpu_or_skip(test).is_none() {
        return;
    }
    let seed = run_seed(test);
    for (i, &(n, v, entropy, reduce)) in [
        (1, 1000, true, ReduceDh::AllReduce),
        (2, 1000, true, ReduceDh::AllReduce),
        (4, 1003, true, ReduceDh::Caller),
        (8, 4099, true, ReduceDh::AllReduce),
        // The log-prob-only TP path has its own specialisation and its own coverage.
        (2, 1001, false, ReduceDh::AllReduce),
        (8, 2053, false, ReduceDh::Caller),
    ]
    .iter()
    .enumerate()
    {
        let line = tp_case(test, n, v, entropy, reduce, lmhead_tests::case_seed(seed, i));
        println!("[{test}] {line}");
    }
}

/// [`gpu_or_skip`], and a SKIP line when libnccl cannot be loaded.
fn nccl_or_skip(test: &str) -> Option<(LmHead, Arc<CudaStream>)> {
    let gpu = gpu_or_skip(test)?;
    if !lmhead::tp::NcclComm::available() {
        println!("SKIP {test}: libnccl is not on the library path");
        return None;
    }
    Some(gpu)
}

#[test]
fn nccl_single_rank_matches_unsharded() {
    let test = "tp::nccl_single_rank_matches_unsharded";
    let Some((head, stream)) = nccl_or_skip(test) else { return };
    let seed = run_seed(test);
    let comm = lmhead::tp::NcclComm::from_streams(vec![stream.clone()]).unwrap().pop().unwrap();
    let case = Case::generate(seed, 129, 777, 64, &Structure { huge: 0.0, all_negative: 0.0, ..Default::default() });
    let zeros = vec![0.0f32; case.t];
    let ones = vec![1.0f32; case.t];
    let mode = Mode { entropy: true, reduce: ReduceDh::AllReduce, grads: (&ones, &zeros), config: Choice::Fallback };
    let whole = run_rank(&head, &stream, &case, (0, case.v), None, &mode);
    let tp = run_rank(&head, &stream, &case, (0, case.v), Some(&comm), &mode);
    let tol = |_: usize, _: f64| 2e-5;
    check("logprob", test, &tp.lp, &whole.lp, &tol);
    check("entropy", test, tp.ent.as_ref().unwrap(), whole.ent.as_ref().unwrap(), &tol);
    check_rel_l2("dh", test, &tp.dh, &whole.dh, 1e-5);
    check_rel_l2("dW", test, &tp.dw, &whole.dw, 1e-5);
    println!("[{test}] tp nccl single rank: OK");
}

/// NCCL across GPUs: rank `r` on device `r` with its own `LmHead` and stream, `W` sharded by vocab
/// (uneven shards), forward and backward against the unsharded run on device 0. For each group
/// size up to the device count (2, 4, 8): entropy with `dh` all-reduced and log-prob only with
/// `dh` left to the caller on the fallback kernels (small shape, several backward chunks per
/// shard), and entropy with `dh` all-reduced on the autotuned (Hopper) kernels at a larger shape.
#[test]
fn nccl_multi_gpu_matches_unsharded() {
    let test = "tp::nccl_multi_gpu_matches_unsharded";
    let Some((head, stream)) = nccl_or_skip(test) else { return };
    let devices = lmhead::cudarc::driver::CudaContext::device_count().unwrap() as usize;
    if devices < 2 {
        println!("SKIP {test}: {devices} GPU(s) visible, this test needs at least 2");
        return;
    }
    let seed = run_seed(test);
    let mut i = 0;
    for n in [2usize, 4, 8] {
        if n > devices {
            println!("[{test}] n={n}: not run, {devices} GPUs visible");
            continue;
        }
        for &(entropy, reduce, config, (t, v, d)) in &[
            (true, ReduceDh::AllReduce, Choice::Fallback, (300, 4099, 256)),
            (false, ReduceDh::Caller, Choice::Fallback, (300, 4099, 256)),
            (true, ReduceDh::AllReduce, Choice::Auto, (1000, 32_003, 1024)),
        ] {
            let case_seed = lmhead_tests::case_seed(seed, i);
            i += 1;
            let (case, gl, ge) = tp_inputs(case_seed, t, v, d, entropy);
            let desc = format!("{test} n={n} t={t} v={v} d={d} entropy={entropy} {reduce:?} {config:?} seed={case_seed}");
            let mode = Mode { entropy, reduce, grads: (&gl, &ge), config };
            let whole = run_rank(&head, &stream, &case, (0, v), None, &mode);
            let heads: Vec<LmHead> = (0..n).map(|r| LmHead::new(r).unwrap()).collect();
            let streams: Vec<Arc<CudaStream>> = heads.iter().map(|h| h.gpu().context().new_stream().unwrap()).collect();
            let comms = lmhead::tp::NcclComm::from_streams(streams.clone()).unwrap();
            let shards: Vec<(usize, usize)> = (0..n).map(|r| Shard::even(r, n, v)).map(|(s, len)| (s.v_begin, s.v_begin + len)).collect();
            let ranks: Vec<Outs> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..n)
                    .map(|r| {
                        let (head, stream, comm, range) = (&heads[r], &streams[r], &comms[r], shards[r]);
                        let case = &case;
                        s.spawn(move || run_rank(head, stream, case, range, Some(comm as &dyn Communicator), &mode))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            check_ranks(&desc, d, &shards, &ranks, &whole, &mode);
            println!("[{test}] tp nccl n={n} t={t} v={v} d={d} entropy={entropy} {reduce:?} {config:?}: OK ({n} GPUs agree with the unsharded run)");
        }
    }
}
