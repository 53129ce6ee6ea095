//! One shape's measurement: random inputs, cuBLAS and each head's forward, forward with entropy
//! and forward+backward timed in turn in every round ([`crate::rounds::RoundOrders`]), and the
//! timed runs' log-probs checked against the f64 reference on sampled rows.

use std::sync::Arc;

use lmhead::cudarc::driver::{CudaSlice, CudaStream};
use lmhead::tune::bench::{median, percentile};
use lmhead::{bf16, BwdConfigs, BwdInputs, BwdOptions, Choice, Family, FwdInputs, FwdOptions, FwdOutputs, GradOut, LmHead, Problem};
use lmhead_core::record::{Case, Plan, Row, Timing};
use lmhead_reference::rng::Rng;

use crate::args::Args;
use crate::cublas;
use crate::rounds::RoundOrders;

/// Random bf16 data in parallel (SplitMix per chunk): `N(0, scale²)`-ish via a sum of uniforms.
pub fn random_bf16(n: usize, scale: f32, seed: u64) -> Vec<u16> {
    use rayon::prelude::*;
    let mut out = vec![0u16; n];
    out.par_chunks_mut(1 << 16).enumerate().for_each(|(ci, chunk)| {
        let mut r = Rng::new(seed ^ (ci as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        for x in chunk.iter_mut() {
            let u = r.next_u64();
            // Sum of four 16-bit uniforms: mean 2, roughly normal; centred and scaled.
            let s = ((u & 0xFFFF) + ((u >> 16) & 0xFFFF) + ((u >> 32) & 0xFFFF) + (u >> 48)) as f32 / 65536.0 - 2.0;
            *x = lmhead_reference::bf16::from_f32(s * scale * 1.732);
        }
    });
    out
}

/// One CUDA-event-timed call of `f` on an idle stream, in ms.
pub fn sample(stream: &CudaStream, f: &mut dyn FnMut() -> lmhead::Result<()>) -> lmhead::Result<f64> {
    let ctx = stream.context();
    let a = ctx.new_event(Some(lmhead_timing_flags())).unwrap();
    let b = ctx.new_event(Some(lmhead_timing_flags())).unwrap();
    a.record(stream).unwrap();
    f()?;
    b.record(stream).unwrap();
    b.synchronize().unwrap();
    Ok(a.elapsed_ms(&b).unwrap() as f64)
}

/// The p20 / median / p80 of `ts`.
pub fn timing(mut ts: Vec<f64>) -> Timing {
    let p50 = median(&mut ts.clone());
    Timing { p20: percentile(&mut ts.clone(), 0.2), p50, p80: percentile(&mut ts, 0.8) }
}

/// One head's buffers and last configs inside [`measure`].
struct Ops<'a> {
    head: &'a LmHead,
    lp: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    lp_ent: CudaSlice<f32>,
    lse_ent: CudaSlice<f32>,
    ent: CudaSlice<f32>,
    /// dh and dW, only for cases with a backward pass.
    grads: Option<(CudaSlice<bf16>, CudaSlice<bf16>)>,
    /// The forward+backward's own forward outputs (log-prob, lse, entropy).
    fb: (CudaSlice<f32>, CudaSlice<f32>, CudaSlice<f32>),
    fwd_cfg: String,
    fwd_ent_cfg: String,
    bwd_cfg: String,
    fwd_plan: Option<Plan>,
    fwd_ent_plan: Option<Plan>,
    t: Timings,
}

#[derive(Default)]
struct Timings {
    fwd: Vec<f64>,
    ent: Vec<f64>,
    bwd: Vec<f64>,
}

/// The operations [`measure`] times.
#[derive(Clone, Copy)]
enum Op {
    Fwd,
    FwdEnt,
    FwdBwd,
}

/// The config part of a kernel's entry name (`lm_head_fwd_t128_…` → `t128_…`), as the records
/// keep it.
pub fn config_of(kernel: &str, family: Family) -> String {
    kernel.strip_prefix(family.stem()).and_then(|s| s.strip_prefix('_')).unwrap_or(kernel).to_string()
}

/// The launch plan a forward reported, as the records keep it.
fn plan_of(r: &lmhead::FwdReport) -> Plan {
    Plan { splits: r.n_splits, raster: r.raster_group, fill: r.fill }
}

/// The shared inputs of one shape.
struct Data<'a> {
    x: FwdInputs<'a, i64>,
    fo: FwdOptions,
    bo: BwdOptions,
    gl: &'a CudaSlice<f32>,
    ge: &'a CudaSlice<f32>,
}

impl<'a> Ops<'a> {
    fn new(head: &'a LmHead, stream: &Arc<CudaStream>, c: &Case) -> Self {
        let z = |n: usize| -> CudaSlice<f32> { stream.alloc_zeros(n).unwrap() };
        Ops {
            head,
            lp: z(c.t),
            lse: z(c.t),
            lp_ent: z(c.t),
            lse_ent: z(c.t),
            ent: z(c.t),
            grads: c.backward.then(|| (stream.alloc_zeros(c.t * c.d).unwrap(), stream.alloc_zeros(c.v * c.d).unwrap())),
            fb: (z(c.t), z(c.t), z(c.t)),
            fwd_cfg: String::new(),
            fwd_ent_cfg: String::new(),
            bwd_cfg: String::new(),
            fwd_plan: None,
            fwd_ent_plan: None,
            t: Timings::default(),
        }
    }

    fn run(&mut self, stream: &Arc<CudaStream>, d: &Data<'_>, op: Op) -> lmhead::Result<()> {
        let head = self.head;
        match op {
            Op::Fwd => {
                let r =
                    head.forward(stream, &d.x, &d.fo, FwdOutputs { kept: None, logprob: &mut self.lp, lse: &mut self.lse, entropy: None })?;
                self.fwd_cfg = r.kernel.as_deref().map(|k| config_of(k, Family::Fwd)).unwrap_or_default();
                self.fwd_plan = Some(plan_of(&r));
            }
            Op::FwdEnt => {
                let out = FwdOutputs { kept: None, logprob: &mut self.lp_ent, lse: &mut self.lse_ent, entropy: Some(&mut self.ent) };
                let r = head.forward(stream, &d.x, &d.fo, out)?;
                self.fwd_ent_cfg = r.kernel.as_deref().map(|k| config_of(k, Family::FwdEnt)).unwrap_or_default();
                self.fwd_ent_plan = Some(plan_of(&r));
            }
            Op::FwdBwd => {
                let Some((dh, dw)) = self.grads.as_mut() else { return Ok(()) };
                let (lp_b, lse_b, ent_b) = &mut self.fb;
                head.forward(stream, &d.x, &d.fo, FwdOutputs { kept: None, logprob: lp_b, lse: lse_b, entropy: Some(ent_b) })?;
                let bx = BwdInputs {
                    kept: None,
                    h: d.x.h,
                    w: d.x.w,
                    labels: d.x.labels,
                    lse: &*lse_b,
                    entropy: Some(&*ent_b),
                    grad_logprob: Some(d.gl),
                    grad_entropy: Some(d.ge),
                    problem: d.x.problem,
                };
                let r = head.backward(stream, &bx, &d.bo, GradOut::Bf16(dh), Some(GradOut::Bf16(dw)))?;
                self.bwd_cfg = format!(
                    "{}|{}|{}{}{}",
                    config_of(&r.dlogits, Family::BwdDlogitsEnt),
                    config_of(&r.dh, Family::BwdDh),
                    config_of(r.dw.as_deref().expect("dW asked for"), Family::BwdDw),
                    // The chunk width, when the vocab took more than one (records before the
                    // automatic width only named widths other than 8192).
                    if r.chunks == 1 { String::new() } else { format!(" chunk {}", r.chunk) },
                    // dW on the side stream beside dh (records without it ran dW after dh).
                    if r.dw_beside_dh { " dW beside dh" } else { "" }
                );
            }
        }
        Ok(())
    }
}

/// Times `heads` (usually one; with `--versus-fixed` the autotuned head and the fixed one) on
/// one shape's inputs: every round times cuBLAS once, then each head's forward, forward with
/// entropy and forward+backward in turn (the heads taking turns going first), so that all see
/// the same clock and temperature. One [`Row`] per head, in order.
pub fn measure(heads: &[&LmHead], stream: &Arc<CudaStream>, c: &Case, args: &Args, seed: u64) -> lmhead::Result<Vec<Row>> {
    let p = Problem::new(c.t, c.v, c.d);
    let hs = random_bf16(c.t * c.d, 4.0 / (c.d as f32).sqrt(), seed);
    let ws = random_bf16(c.v * c.d, 0.5, seed ^ 1);
    let mut rng = Rng::new(seed ^ 2);
    let labels: Vec<i64> = (0..c.t).map(|_| rng.below(c.v as u64) as i64).collect();
    let h = lmhead::testing::upload_bf16(stream, &hs)?;
    let w = lmhead::testing::upload_bf16(stream, &ws)?;
    let lab = lmhead::testing::upload(stream, &labels)?;
    let choice = if args.fallback { Choice::Fallback } else { Choice::Auto };
    let gl = lmhead::testing::upload(stream, &vec![1.0f32; c.t])?;
    let ge = lmhead::testing::upload(stream, &vec![0.1f32; c.t])?;
    let mut bo = BwdOptions { config: BwdConfigs::all(choice), dw_beside_dh: !args.dw_after_dh, ..Default::default() };
    if let Some(chunk) = args.bwd_chunk {
        bo.chunk = Some(chunk);
    }
    let data = Data {
        x: FwdInputs { h: &h, w: &w, labels: &lab, problem: p },
        fo: FwdOptions {
            config: choice,
            check_labels: if args.check_labels { lmhead::LabelCheck::Sync } else { lmhead::LabelCheck::Off },
            ..Default::default()
        },
        bo,
        gl: &gl,
        ge: &ge,
    };

    // cuBLAS: logits = h · Wᵀ (bf16 out, f32 compute).
    let mut blas = cublas::Gemm::new(stream.clone(), c.t, c.v, c.d)?;
    let mut ops: Vec<Ops> = heads.iter().map(|&hd| Ops::new(hd, stream, c)).collect();
    // Tuning (the first call of each family in a new bucket) and warm-up happen before any
    // timing; then every round times each operation once, in turn, so that cuBLAS and the
    // fused kernels see the same clock and temperature (the H200 runs these shapes at its power
    // limit: its SM clock moves between ≈ 1.4 and 1.6 GHz with the load's power draw).
    for _ in 0..2 {
        blas.run(&h, &w)?;
        for o in ops.iter_mut() {
            o.run(stream, &data, Op::Fwd)?;
            o.run(stream, &data, Op::FwdEnt)?;
        }
    }
    for o in ops.iter_mut() {
        o.run(stream, &data, Op::FwdBwd)?;
    }
    let bwd_reps = args.reps.clamp(1, 5);
    let mut t_gemm = Vec::new();
    // The round's operations: cuBLAS, then each head's forward, entropy and (first rounds) step.
    let mut items: Vec<Option<(usize, Op)>> = vec![None];
    for i in 0..ops.len() {
        items.extend([Some((i, Op::Fwd)), Some((i, Op::FwdEnt))]);
        if c.backward {
            items.push(Some((i, Op::FwdBwd)));
        }
    }
    // The warm-up above ended with the last item (the last head's step, or its entropy forward).
    let mut orders = RoundOrders::new(items.len(), items.len() - 1);
    for r in 0..args.reps {
        // In the fixed order several heads take turns going first, so that none always runs
        // right after cuBLAS (at identical configs a fixed order showed a bias of about ±0.5%).
        if !args.balanced && r > 0 {
            ops.rotate_left(1);
        }
        // The round's timings: in an order of the round's own (so that no operation always runs
        // right after the same one: a kernel's clock depends on what ran before it) or, with
        // `--fixed-order`, in the listed one.
        let present: Vec<bool> = items.iter().map(|it| !matches!(it, Some((_, Op::FwdBwd))) || r < bwd_reps).collect();
        let order: Vec<usize> = if args.balanced { orders.next(&present) } else { (0..items.len()).filter(|&j| present[j]).collect() };
        for j in order {
            match items[j] {
                None => t_gemm.push(sample(stream, &mut || blas.run(&h, &w))?),
                Some((i, op)) => {
                    let o = &mut ops[i];
                    let ms = sample(stream, &mut || o.run(stream, &data, op))?;
                    match op {
                        Op::Fwd => o.t.fwd.push(ms),
                        Op::FwdEnt => o.t.ent.push(ms),
                        Op::FwdBwd => o.t.bwd.push(ms),
                    }
                }
            }
        }
    }
    drop(blas);
    let gemm = timing(t_gemm);
    // Back to the callers' order (in the fixed order each round rotated by one).
    if !args.balanced {
        let n = ops.len();
        ops.rotate_right(args.reps.saturating_sub(1) % n);
    }
    let mut rows = Vec::new();
    for o in ops {
        // Check the timed runs' outputs on sampled rows: log-prob of both forwards.
        let check_max_abs = if args.check {
            let got = lmhead::testing::download_f32(stream, &o.lp)?;
            let got_ent = lmhead::testing::download_f32(stream, &o.lp_ent)?;
            Some(check_sampled_logprobs("timed forward", (&hs, &ws, &labels), (c.t, c.v, c.d), &[&got, &got_ent])?)
        } else {
            None
        };
        rows.push(Row {
            case: c.clone(),
            gemm: gemm.clone(),
            fwd: timing(o.t.fwd),
            fwd_ent: timing(o.t.ent),
            fwd_bwd: c.backward.then(|| timing(o.t.bwd)),
            fwd_cfg: o.fwd_cfg,
            fwd_ent_cfg: o.fwd_ent_cfg,
            bwd_cfg: o.bwd_cfg,
            fwd_plan: o.fwd_plan,
            fwd_ent_plan: o.fwd_ent_plan,
            workspace_mib: o.head.workspace_bytes() as f64 / (1 << 20) as f64,
            check_max_abs,
        });
    }
    Ok(rows)
}

/// Largest |Δ log-prob| of `outputs` (each `[t]` log-probs of the whole problem
/// `(h, w, labels)`) against the f64 reference on rows 0, t/3 and t − 1; an error when it is NaN
/// or reaches 1e-3, so that a fast wrong kernel cannot win.
pub fn check_sampled_logprobs(
    what: &str,
    (h, w, labels): (&[u16], &[u16], &[i64]),
    (t, v, d): (usize, usize, usize),
    outputs: &[&[f64]],
) -> lmhead::Result<f64> {
    let rows: Vec<usize> = vec![0, t / 3, t - 1];
    let inp = lmhead_reference::Inputs {
        h,
        w,
        labels,
        t,
        v,
        d,
        v_begin: 0,
        v_total: v as i64,
        temperature: 1.0,
        ignore_index: lmhead_reference::IGNORE_INDEX,
    };
    let r = lmhead_reference::forward_rows(&inp, &rows);
    let e = rows.iter().zip(&r).flat_map(|(&i, r)| outputs.iter().map(move |o| (o[i] - r.logprob).abs())).fold(0.0f64, f64::max);
    if e.is_nan() || e >= 1e-3 {
        return Err(lmhead::Error::Invalid(format!("{what} disagrees with the reference: max |Δ logprob| = {e}")));
    }
    Ok(e)
}

/// Events that record timing (cudarc's default disables it).
pub fn lmhead_timing_flags() -> lmhead::cudarc::driver::sys::CUevent_flags {
    lmhead::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT
}

pub fn tflops(flop: f64, ms: f64) -> f64 {
    flop / (ms * 1e-3) / 1e12
}
