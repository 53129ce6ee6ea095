//! `lmhead-bench tp`: vocab-parallel tensor parallelism measured for real, one rank per GPU
//! (one thread each, NCCL across them), against TP = 1 on the same whole problem.
//!
//! For each head and each TP ∈ {1, 2, 4, 8} up to the GPU count, every rank holds `v_total / TP`
//! rows of `W` (the first ranks one more when it does not divide) and all tokens, and times on its
//! own stream, all ranks starting each sample together (a barrier):
//! - cuBLAS on the rank-local shape;
//! - the TP forward with entropy through [`NoComm`] (the rank's fused kernels alone);
//! - the TP forward with entropy, and log-prob only, over NCCL, end to end;
//! - forward with entropy + backward with `dh` all-reduced (bf16 outputs), end to end;
//! - the all-reduces inside those, by CUDA events around each ([`TimedComm`]).
//!
//! TP = 1 runs the plain `forward`/`backward` on GPU 0 (no communicator). Each rank's timings
//! are medians over the rounds; a TP row reports the slowest rank's. Rank 0's TP log-probs are
//! checked against the f64 reference on sampled rows.

use std::sync::{Arc, Barrier, Mutex};
use std::time::Instant;

use lmhead::cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream};
use lmhead::tp::Dev;
use lmhead::tp::{Communicator, NcclComm, ReduceDh, ReduceOp, Shard, TpBackward};
use lmhead::{bf16, BwdConfigs, BwdInputs, BwdOptions, Choice, FwdInputs, FwdOptions, FwdOutputs, GradOut, LabelCheck, LmHead, Problem};
use lmhead_core::record::{Timing, TpRow};
use lmhead_reference::rng::Rng;

use crate::{check_sampled_logprobs, cublas, random_bf16, sample, timing, Args};

/// Whole problems: (name, tokens, hidden D, vocab V).
pub const CASES: &[(&str, usize, usize, usize)] =
    &[("llama-3.1-8b", 8192, 4096, 128_256), ("qwen2.5-14b", 8192, 5120, 152_064), ("h8192-v131072", 8192, 8192, 131_072)];

/// A communicator that reduces nothing. `forward_tp` through it launches exactly the kernels of a
/// TP rank without communication, which times the rank's fused work alone; its outputs are not
/// the TP result (each rank keeps its local row states).
struct NoComm {
    rank: usize,
    size: usize,
}

impl Communicator for NoComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce(&self, _: &Arc<CudaStream>, _: &Dev, _: ReduceOp) -> lmhead::Result<()> {
        Ok(())
    }
}

/// A communicator that records a pair of CUDA events around every all-reduce of `inner`, on the
/// caller's stream: their elapsed time is what the rank's stream spends in the collective,
/// waiting for the slowest rank included.
struct TimedComm<'a> {
    inner: &'a dyn Communicator,
    spans: Mutex<Vec<(CudaEvent, CudaEvent)>>,
}

impl TimedComm<'_> {
    /// The summed milliseconds of the spans recorded since the last call; the caller has
    /// synchronised on an event recorded after them.
    fn take_ms(&self) -> f64 {
        let spans = std::mem::take(&mut *self.spans.lock().unwrap());
        spans.iter().map(|(a, b)| a.elapsed_ms(b).unwrap_or(f32::NAN) as f64).sum()
    }
}

impl Communicator for TimedComm<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce(&self, stream: &Arc<CudaStream>, buf: &Dev, op: ReduceOp) -> lmhead::Result<()> {
        let ev = || {
            stream
                .context()
                .new_event(Some(crate::measure::lmhead_timing_flags()))
                .map_err(|e| lmhead::Error::Comm(format!("event: {e:?}")))
        };
        let (a, b) = (ev()?, ev()?);
        a.record(stream).map_err(|e| lmhead::Error::Comm(format!("event: {e:?}")))?;
        self.inner.all_reduce(stream, buf, op)?;
        b.record(stream).map_err(|e| lmhead::Error::Comm(format!("event: {e:?}")))?;
        self.spans.lock().unwrap().push((a, b));
        Ok(())
    }
}

/// One whole problem's host data, shared by the ranks.
struct Problem0<'a> {
    t: usize,
    v: usize,
    d: usize,
    h: &'a [u16],
    w: &'a [u16],
    labels: &'a [i64],
}

fn ent_out<'a>(lp: &'a mut CudaSlice<f32>, lse: &'a mut CudaSlice<f32>, ent: &'a mut CudaSlice<f32>) -> FwdOutputs<'a> {
    FwdOutputs { kept: None, logprob: lp, lse, entropy: Some(ent) }
}

/// One rank's per-round samples.
#[derive(Default)]
struct RankTimes {
    gemm: Vec<f64>,
    fused: Vec<f64>,
    fwd_ent: Vec<f64>,
    fwd_lp: Vec<f64>,
    fwd_bwd: Vec<f64>,
    ar_fwd: Vec<f64>,
    ar_fwd_bwd: Vec<f64>,
    cfg: String,
    logprob: Vec<f64>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Gemm,
    Fused,
    FwdEnt,
    FwdLp,
    FwdBwd,
}

/// One rank's place in the group: its communicator (none for a single GPU), its index among the
/// `n` ranks, and the barrier that starts each sample together.
#[derive(Clone, Copy)]
struct Rank<'a> {
    comm: Option<&'a dyn Communicator>,
    rank: usize,
    n: usize,
    barrier: &'a Barrier,
}

/// Rank `r.rank` of `r.n` (on `head`'s GPU): uploads its shard, tunes and warms up every
/// operation, then `reps` rounds, each sample started together with the other ranks.
fn run_rank(head: &LmHead, stream: &Arc<CudaStream>, r: &Rank, pb: &Problem0<'_>, reps: usize) -> lmhead::Result<RankTimes> {
    let Rank { comm, rank, n, barrier } = *r;
    let (t, d) = (pb.t, pb.d);
    let (shard, v) = Shard::even(rank, n, pb.v);
    let p = Problem::new(t, v, d);
    let h = lmhead::testing::upload_bf16(stream, pb.h)?;
    let w = lmhead::testing::upload_bf16(stream, &pb.w[shard.v_begin * d..(shard.v_begin + v) * d])?;
    let lab = lmhead::testing::upload(stream, pb.labels)?;
    let alloc = |n: usize| lmhead::testing::zeros::<f32>(stream, n, "bench outputs");
    let (mut lp, mut lse, mut ent, mut lp2, mut lse2) = (alloc(t)?, alloc(t)?, alloc(t)?, alloc(t)?, alloc(t)?);
    let gl = lmhead::testing::upload(stream, &vec![1.0f32; t])?;
    let ge = lmhead::testing::upload(stream, &vec![0.1f32; t])?;
    let mut dh = lmhead::testing::zeros::<bf16>(stream, t * d, "dh")?;
    let mut dw = lmhead::testing::zeros::<bf16>(stream, v * d, "dW")?;
    let mut blas = cublas::Gemm::new(stream.clone(), t, v, d)?;
    let fo = FwdOptions { config: Choice::Auto, check_labels: LabelCheck::Off, ..Default::default() };
    let bo = BwdOptions { config: BwdConfigs::all(Choice::Auto), ..Default::default() };
    let x = FwdInputs { h: &h, w: &w, labels: &lab, problem: p };
    let none = NoComm { rank, size: n };
    let timed = comm.map(|c| TimedComm { inner: c, spans: Mutex::new(Vec::new()) });
    // The TP entry points through `comm`, or the plain ones for TP = 1 (no communicator).
    let fwd = |comm: Option<&dyn Communicator>, out: FwdOutputs<'_>| match comm {
        Some(c) => head.forward_tp(c, stream, &x, shard, &fo, out),
        None => head.forward(stream, &x, &fo, out),
    };
    let tp = timed.as_ref().map(|c| c as &dyn Communicator);
    let mut cfg = String::new();
    let mut run = |op: Op| -> lmhead::Result<()> {
        match op {
            Op::Gemm => blas.run(&h, &w),
            Op::Fused => fwd(tp.map(|_| &none as &dyn Communicator), ent_out(&mut lp2, &mut lse2, &mut ent)).map(drop),
            Op::FwdEnt | Op::FwdBwd => {
                let r = fwd(tp, ent_out(&mut lp, &mut lse, &mut ent))?;
                cfg = r.kernel.as_deref().map(|k| crate::measure::config_of(k, lmhead::Family::FwdEnt)).unwrap_or_default();
                if op == Op::FwdEnt {
                    return Ok(());
                }
                let bx = BwdInputs {
                    kept: None,
                    h: &h,
                    w: &w,
                    labels: &lab,
                    lse: &lse,
                    entropy: Some(&ent),
                    grad_logprob: Some(&gl),
                    grad_entropy: Some(&ge),
                    problem: p,
                };
                match tp {
                    Some(c) => head.backward_tp(
                        TpBackward { comm: c, shard, reduce: ReduceDh::AllReduce },
                        stream,
                        &bx,
                        &bo,
                        GradOut::Bf16(&mut dh),
                        Some(GradOut::Bf16(&mut dw)),
                    ),
                    None => head.backward(stream, &bx, &bo, GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw))),
                }
                .map(drop)
            }
            Op::FwdLp => fwd(tp, FwdOutputs { kept: None, logprob: &mut lp2, lse: &mut lse2, entropy: None }).map(drop),
        }
    };
    let ops = [Op::Gemm, Op::Fused, Op::FwdEnt, Op::FwdLp, Op::FwdBwd];
    // Tuning (first call of each family in the rank's bucket) and warm-up, in the same order on
    // every rank so that the collectives match.
    for _ in 0..2 {
        for op in ops {
            barrier.wait();
            run(op)?;
        }
    }
    stream.synchronize().map_err(|e| lmhead::Error::Comm(format!("{e:?}")))?;
    let take = || timed.as_ref().map_or(0.0, |c| c.take_ms());
    take();
    let mut rt = RankTimes::default();
    for r in 0..reps {
        for op in ops {
            if op == Op::FwdBwd && r >= reps.clamp(1, 5) {
                continue;
            }
            barrier.wait();
            let ms = sample(stream, &mut || run(op))?;
            match op {
                Op::Gemm => rt.gemm.push(ms),
                Op::Fused => rt.fused.push(ms),
                Op::FwdEnt => {
                    rt.fwd_ent.push(ms);
                    rt.ar_fwd.push(take());
                }
                Op::FwdLp => {
                    rt.fwd_lp.push(ms);
                    take();
                }
                Op::FwdBwd => {
                    rt.fwd_bwd.push(ms);
                    rt.ar_fwd_bwd.push(take());
                }
            }
        }
    }
    rt.cfg = cfg;
    rt.logprob = lmhead::testing::download_f32(stream, &lp)?;
    Ok(rt)
}

/// The slowest rank's timing of one operation (by median).
fn slowest(ranks: &[RankTimes], f: impl Fn(&RankTimes) -> &Vec<f64>) -> Timing {
    ranks.iter().map(|r| timing(f(r).clone())).max_by(|a, b| a.p50.total_cmp(&b.p50)).unwrap()
}

/// One whole problem at one TP degree.
fn measure(name: &str, pb: &Problem0<'_>, n: usize, reps: usize) -> lmhead::Result<TpRow> {
    let heads: Vec<LmHead> = (0..n).map(LmHead::new).collect::<lmhead::Result<_>>()?;
    let streams: Vec<Arc<CudaStream>> = heads
        .iter()
        .map(|h| h.gpu().context().new_stream().map_err(|e| lmhead::Error::Invalid(format!("stream: {e:?}"))))
        .collect::<lmhead::Result<_>>()?;
    let comms: Vec<NcclComm> = if n > 1 { NcclComm::from_streams(streams.clone())? } else { Vec::new() };
    let barrier = Barrier::new(n);
    let results: Vec<lmhead::Result<RankTimes>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (head, stream, comm, barrier) = (&heads[r], &streams[r], comms.get(r).map(|c| c as &dyn Communicator), &barrier);
                s.spawn(move || {
                    let res = run_rank(head, stream, &Rank { comm, rank: r, n, barrier }, pb, reps);
                    if let Err(e) = &res {
                        // The other ranks would wait for this one at the next barrier or
                        // collective forever: report and stop the whole benchmark.
                        eprintln!("lmhead-bench tp: {name} TP={n} rank {r}: {e}");
                        std::process::exit(1);
                    }
                    res
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    let ranks: Vec<RankTimes> = results.into_iter().collect::<lmhead::Result<_>>()?;
    for (r, t) in ranks.iter().enumerate() {
        let m = |x: &Vec<f64>| timing(x.clone()).p50;
        eprintln!(
            "  rank {r}: gemm {:.3} fused {:.3} fwd+ent {:.3} (all-reduce {:.3}) log-prob {:.3} fwd+bwd {:.2} (all-reduce {:.3}) ms, {}",
            m(&t.gemm),
            m(&t.fused),
            m(&t.fwd_ent),
            m(&t.ar_fwd),
            m(&t.fwd_lp),
            m(&t.fwd_bwd),
            m(&t.ar_fwd_bwd),
            t.cfg
        );
    }
    // Rank 0's TP log-probs against the f64 reference on sampled rows.
    let e = check_sampled_logprobs(&format!("TP={n} log-prob"), (pb.h, pb.w, pb.labels), (pb.t, pb.v, pb.d), &[&ranks[0].logprob])?;
    Ok(TpRow {
        model: name.into(),
        tokens: pb.t,
        v_total: pb.v,
        d: pb.d,
        tp: n,
        v_local: Shard::even(0, n, pb.v).1,
        gemm: slowest(&ranks, |r| &r.gemm),
        fused: slowest(&ranks, |r| &r.fused),
        fwd_ent: slowest(&ranks, |r| &r.fwd_ent),
        fwd_lp: slowest(&ranks, |r| &r.fwd_lp),
        fwd_bwd: slowest(&ranks, |r| &r.fwd_bwd),
        ar_fwd: slowest(&ranks, |r| &r.ar_fwd),
        ar_fwd_bwd: slowest(&ranks, |r| &r.ar_fwd_bwd),
        per_rank_fwd_ent: ranks.iter().map(|r| timing(r.fwd_ent.clone()).p50).collect(),
        fwd_ent_cfg: ranks[0].cfg.clone(),
        check_max_abs: Some(e),
    })
}

/// The `tp` suite: prints a markdown table and appends `{gpu, commit, suite: "tp", tp_row}`
/// JSON lines to `--out`.
pub fn run(args: &Args, gpu: &str, commit: &str) {
    use std::io::Write as _;
    let devices = CudaContext::device_count().unwrap_or(0).max(0) as usize;
    if devices > 1 && !NcclComm::available() {
        eprintln!("lmhead-bench tp: {devices} GPUs but libnccl is not on the library path; only TP = 1 runs");
    }
    let max_tp = if NcclComm::available() { devices } else { 1 };
    let tps: Vec<usize> = [1usize, 2, 4, 8].into_iter().filter(|&n| n <= max_tp).collect();
    println!("# lmhead-bench tp on {devices} x {gpu}, commit {commit}: TP {tps:?}, one rank per GPU over NCCL");
    println!();
    println!("Per rank, slowest rank's median ms; ×TP1: the TP = 1 time of the same op divided by this row's.");
    println!();
    println!("| case | TP | V local | GEMM local | fused (no comm) | all-reduce fwd | fwd+ent (×TP1) | fwd log-prob (×TP1) | fwd+bwd (×TP1) | all-reduce fwd+bwd | config |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&args.out).ok();
    let start = Instant::now();
    for (ci, &(name, t, d, v)) in CASES.iter().enumerate() {
        if args.filter.as_ref().is_some_and(|f| !name.contains(f.as_str())) {
            continue;
        }
        let seed = 0x7E57 ^ ci as u64;
        let hs = random_bf16(t * d, 4.0 / (d as f32).sqrt(), seed);
        let ws = random_bf16(v * d, 0.5, seed ^ 1);
        let mut rng = Rng::new(seed ^ 2);
        let labels: Vec<i64> = (0..t).map(|_| rng.below(v as u64) as i64).collect();
        let pb = Problem0 { t, v, d, h: &hs, w: &ws, labels: &labels };
        let mut base: Option<TpRow> = None;
        for &n in &tps {
            if start.elapsed().as_secs_f64() > args.budget_s {
                eprintln!("budget of {} s reached", args.budget_s);
                return;
            }
            eprintln!("[{name} TP={n}] ({:.0} s elapsed)", start.elapsed().as_secs_f64());
            match measure(name, &pb, n, args.reps) {
                Ok(row) => {
                    let x = |f: fn(&TpRow) -> f64| base.as_ref().map_or(1.0, |b| f(b) / f(&row));
                    println!(
                        "| {name}/tok{}k | {n} | {} | {:.3} | {:.3} | {:.3} | {:.3} ({:.2}x) | {:.3} ({:.2}x) | {:.2} ({:.2}x) | {:.3} | {} |",
                        t / 1024,
                        row.v_local,
                        row.gemm.p50,
                        row.fused.p50,
                        row.ar_fwd.p50,
                        row.fwd_ent.p50,
                        x(|r| r.fwd_ent.p50),
                        row.fwd_lp.p50,
                        x(|r| r.fwd_lp.p50),
                        row.fwd_bwd.p50,
                        x(|r| r.fwd_bwd.p50),
                        row.ar_fwd_bwd.p50,
                        row.fwd_ent_cfg
                    );
                    if let Some(o) = out.as_mut() {
                        let rec = serde_json::json!({"gpu": gpu, "gpus": n, "commit": commit, "suite": "tp", "tp_row": row});
                        let _ = writeln!(o, "{rec}");
                    }
                    if n == 1 {
                        base = Some(row);
                    }
                }
                Err(e) => println!("| {name}/tok{}k | {n} | error: {e} |", t / 1024),
            }
        }
    }
}
