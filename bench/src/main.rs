//! `lmhead-bench`: the fused kernels side by side with a cuBLAS bf16 GEMM of the same shape, in
//! the same run. Prints a markdown table, appends JSON lines to a results file.
//!
//! ```text
//! lmhead-bench [quick|sweep|probe|entropy|tp|tune-table|dh-probe|config-probe]
//!              [--filter SUBSTR] [--budget-s N]
//!              [--reps N] [--out results.jsonl] [--fallback | --fixed | --versus-fixed]
//!              [--no-check] [--skip N]
//!              [--bwd-chunk N] [--check-labels] [--fixed-order] [--resume FILE]
//! ```
//!
//! `--fixed` runs without tuning on each family's best fixed config from the shipped table (the
//! fair baseline of the autotuned run: `cargo xtask bench-report` pairs the two);
//! `--versus-fixed` times both in one process, in the same rounds on the same inputs (the
//! steady-state comparison; two records per shape); `--fallback` on the `mma.sync` fallback
//! configs.
//!
//! `tune-table` tunes exhaustively (whatever `LMHEAD_TUNE` says) at every sweep shape not in
//! the `--resume` files and records every candidate (see `table.rs`).
//!
//! `dh-probe --filter T,K,D` times one `dh` chunk per epilogue (`dh_probe.rs`); `config-probe
//! --filter T,V,D[;T,V,D…]` each sm90 forward and `dh` candidate in the steady state
//! (`config_probe.rs`).
//!
//! `--check-labels` times the forwards with `FwdOptions::check_labels` on (the label check
//! kernel and its synchronous 8-byte read before each forward); by default it is off, so the
//! forward's times are the kernels' alone.
//!
//! Measurement hygiene: random inputs (never zeros); tuning and warm-up of every operation before
//! any timing; then `--reps` rounds, each timing cuBLAS, the forward, the forward with entropy
//! and (first 5 rounds) forward+backward once in turn with CUDA events, in orders that spread
//! what runs right before each operation over the others ([`RoundOrders`]; `--fixed-order`:
//! always in that order, which measured the forwards 0.2–1.6% faster against cuBLAS than
//! shuffled rounds, docs/PERFORMANCE.md), so that all see the same clock and temperature (the
//! H200 runs these shapes at its power limit) and none always follows the same one; the median of the
//! rounds (p20/p80 kept); operands are not rotated, but `W` is at least twice the 60 MB L2 at
//! every suite shape; and a check of the timed runs' log-probs on sampled rows against the f64
//! reference, so a fast wrong kernel cannot win. Records name the forwards' launch plans
//! (`fwd_plan`, `fwd_ent_plan`) and the plan overrides set in the environment
//! (`plan_overrides`). FLOPs: one logits GEMM is `2·t·v·d`; forward+backward does four (logits,
//! recompute, dh, dW).

mod config_probe;
mod cublas;
mod dh_probe;
mod suites;
mod table;
mod tp;

use std::io::Write as _;
use std::sync::Arc;
use std::time::Instant;

use lmhead::cudarc::driver::{CudaSlice, CudaStream};
use lmhead::tune::bench::{median, percentile};
use lmhead::{bf16, BwdConfigs, BwdInputs, BwdOptions, Choice, FwdInputs, FwdOptions, FwdOutputs, GradOut, LabelCheck, LmHead, Problem};
use lmhead_reference::rng::Rng;
use serde_json::json;

pub use lmhead_core::record::{Case, Plan, Row, Timing};
pub use suites::Suite;

/// Command-line options.
#[derive(Clone, Debug)]
pub struct Args {
    pub suite: String,
    pub filter: Option<String>,
    pub budget_s: f64,
    pub reps: usize,
    pub out: String,
    pub fallback: bool,
    /// `--fixed`: no tuning; each family's best fixed config from the shipped table
    /// (`LMHEAD_AUTOTUNE=0`), the fair baseline of the autotuned run.
    pub fixed: bool,
    /// `--versus-fixed`: every shape also on a second head with the fixed configs, timed in
    /// the same rounds (two records per shape: `auto` and `fixed`).
    pub versus_fixed: bool,
    pub check: bool,
    /// Skip the suite's first `skip` shapes (the sweep runs cheapest first: resume a budgeted run).
    pub skip: usize,
    /// The backward's vocab chunk width (`BwdOptions::chunk`); `None`: the library's default.
    pub bwd_chunk: Option<usize>,
    /// Time the forwards with the label check on.
    pub check_labels: bool,
    /// Each round times cuBLAS and the fused operations in an order of its own
    /// ([`RoundOrders`]); `--fixed-order` turns it off (always cuBLAS,
    /// then each head's forward, entropy and step), as the records before 2026-12-01 were
    /// measured.
    pub balanced: bool,
    /// `tune-table`: result files of earlier runs whose shapes are skipped.
    pub resume: Vec<String>,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        suite: "quick".into(),
        filter: None,
        budget_s: f64::INFINITY,
        reps: 10,
        out: "bench-results.jsonl".into(),
        fallback: false,
        fixed: false,
        versus_fixed: false,
        check: true,
        skip: 0,
        bwd_chunk: None,
        check_labels: false,
        balanced: true,
        resume: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(x) = it.next() {
        match x.as_str() {
            "--filter" => a.filter = Some(it.next().ok_or("--filter needs a value")?),
            "--budget-s" => a.budget_s = it.next().ok_or("--budget-s needs a value")?.parse().map_err(|e| format!("--budget-s: {e}"))?,
            "--reps" => a.reps = it.next().ok_or("--reps needs a value")?.parse().map_err(|e| format!("--reps: {e}"))?,
            "--out" => a.out = it.next().ok_or("--out needs a value")?,
            "--fallback" => a.fallback = true,
            "--fixed" => a.fixed = true,
            "--versus-fixed" => a.versus_fixed = true,
            "--no-check" => a.check = false,
            "--check-labels" => a.check_labels = true,
            "--fixed-order" => a.balanced = false,
            // The default rounds (once shuffled, now balanced); kept so that older commands still run.
            "--shuffle" => a.balanced = true,
            "--bwd-chunk" => {
                a.bwd_chunk = Some(it.next().ok_or("--bwd-chunk needs a value")?.parse().map_err(|e| format!("--bwd-chunk: {e}"))?)
            }
            "--resume" => a.resume.push(it.next().ok_or("--resume needs a file")?),
            "--skip" => a.skip = it.next().ok_or("--skip needs a value")?.parse().map_err(|e| format!("--skip: {e}"))?,
            "-h" | "--help" => return Err(String::new()),
            s if !s.starts_with('-') => a.suite = s.to_string(),
            s => return Err(format!("unknown option {s}")),
        }
    }
    if [a.fallback, a.fixed, a.versus_fixed].iter().filter(|&&x| x).count() > 1 {
        return Err("--fallback, --fixed and --versus-fixed exclude each other".into());
    }
    Ok(a)
}

/// The launch-plan overrides ([`lmhead::PLAN_OVERRIDE_VARS`]) that `lookup` finds set, as a record's `plan_overrides`; `None` when the library chose every plan itself.
pub fn plan_overrides(lookup: impl Fn(&str) -> Option<String>) -> Option<serde_json::Value> {
    let set: serde_json::Map<String, serde_json::Value> =
        lmhead::PLAN_OVERRIDE_VARS.iter().filter_map(|&k| lookup(k).map(|v| (k.to_string(), json!(v.trim())))).collect();
    (!set.is_empty()).then_some(serde_json::Value::Object(set))
}

/// The order of each round of timings, chosen so that what runs right before each operation
/// (whose after-effect on the clock its time carries) is spread over the others as evenly as
/// the rounds allow, counting the step from one round into the next and from the warm-up into
/// the first. Greedy: each position takes, among the operations left in the round, the one that
/// has followed the previous operation least often, then the one least often at this position,
/// then the lowest index; never the previous operation itself. Deterministic (no seed), so runs
/// compared A/B time the same order. A seeded shuffle per round, used before, was not balanced
/// over a few rounds: at `--reps 3` it timed the forward with entropy right after
/// forward+backward in all three rounds (the first after the warm-up's step).
pub struct RoundOrders {
    prev: usize,
    /// `after[p][x]`: how often operation `x` ran right after `p`.
    after: Vec<Vec<u32>>,
    /// `at[x][i]`: how often operation `x` ran at position `i` of a round.
    at: Vec<Vec<u32>>,
}

impl RoundOrders {
    /// `n` operations; `last` ran right before the first round.
    pub fn new(n: usize, last: usize) -> RoundOrders {
        RoundOrders { prev: last, after: vec![vec![0; n]; n], at: vec![vec![0; n]; n] }
    }

    /// The next round: the operations `present` marks, in the order to time them.
    pub fn next(&mut self, present: &[bool]) -> Vec<usize> {
        let mut left: Vec<usize> = (0..present.len()).filter(|&x| present[x]).collect();
        let mut order = Vec::with_capacity(left.len());
        while !left.is_empty() {
            let (p, pos) = (self.prev, order.len());
            let pick = left
                .iter()
                .copied()
                .filter(|&x| x != p || left.len() == 1)
                .min_by_key(|&x| (self.after[p][x], self.at[x][pos], x))
                .expect("an operation is left");
            self.after[p][pick] += 1;
            self.at[pick][pos] += 1;
            self.prev = pick;
            left.retain(|&x| x != pick);
            order.push(pick);
        }
        order
    }
}

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
fn sample(stream: &CudaStream, f: &mut dyn FnMut() -> lmhead::Result<()>) -> lmhead::Result<f64> {
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
fn timing(mut ts: Vec<f64>) -> Timing {
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
                let r = head.forward(stream, &d.x, &d.fo, FwdOutputs { logprob: &mut self.lp, lse: &mut self.lse, entropy: None })?;
                self.fwd_cfg = r.config.map(|c| c.suffix(lmhead::Family::Fwd)).unwrap_or_default();
                self.fwd_plan = Some(plan_of(&r));
            }
            Op::FwdEnt => {
                let out = FwdOutputs { logprob: &mut self.lp_ent, lse: &mut self.lse_ent, entropy: Some(&mut self.ent) };
                let r = head.forward(stream, &d.x, &d.fo, out)?;
                self.fwd_ent_cfg = r.config.map(|c| c.suffix(lmhead::Family::FwdEnt)).unwrap_or_default();
                self.fwd_ent_plan = Some(plan_of(&r));
            }
            Op::FwdBwd => {
                let Some((dh, dw)) = self.grads.as_mut() else { return Ok(()) };
                let (lp_b, lse_b, ent_b) = &mut self.fb;
                head.forward(stream, &d.x, &d.fo, FwdOutputs { logprob: lp_b, lse: lse_b, entropy: Some(ent_b) })?;
                let bx = BwdInputs {
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
                    r.dlogits.suffix(lmhead::Family::BwdDlogitsEnt),
                    r.dh.suffix(lmhead::Family::BwdDh),
                    r.dw.expect("dW asked for").suffix(lmhead::Family::BwdDw),
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
fn measure(heads: &[&LmHead], stream: &Arc<CudaStream>, c: &Case, args: &Args, seed: u64) -> lmhead::Result<Vec<Row>> {
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
    let mut bo = BwdOptions { config: BwdConfigs::all(choice), ..Default::default() };
    if let Some(chunk) = args.bwd_chunk {
        bo.chunk = Some(chunk);
    }
    let data = Data {
        x: FwdInputs { h: &h, w: &w, labels: &lab, problem: p },
        fo: FwdOptions {
            config: choice,
            check_labels: if args.check_labels { LabelCheck::Sync } else { LabelCheck::Off },
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
fn lmhead_timing_flags() -> lmhead::cudarc::driver::sys::CUevent_flags {
    lmhead::cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT
}

fn tflops(flop: f64, ms: f64) -> f64 {
    flop / (ms * 1e-3) / 1e12
}

/// Seconds since the Unix epoch (the records' `timestamp`).
pub(crate) fn unix_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub(crate) fn commit() -> String {
    std::env::var("LMHEAD_COMMIT").unwrap_or_else(|_| option_env!("LMHEAD_BUILD_COMMIT").unwrap_or("unknown").to_string())
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}\nusage: lmhead-bench [quick|sweep|probe|entropy|tp|tune-table|dh-probe|config-probe] [--filter S] [--budget-s N] [--reps N] [--out FILE] [--fallback | --fixed | --versus-fixed] [--no-check] [--skip N] [--bwd-chunk N] [--check-labels] [--fixed-order] [--resume FILE]");
            std::process::exit(2);
        }
    };
    if args.suite == "tune-table" {
        // Read by LmHead::new: the table's records are exhaustive tunings, never table picks.
        std::env::set_var("LMHEAD_TUNE", "exhaustive");
    }
    if args.fixed {
        // Read by LmHead::new: no tuning, the table's best fixed configs.
        std::env::set_var("LMHEAD_AUTOTUNE", "0");
    }
    if !lmhead::driver_present() {
        eprintln!("lmhead-bench: no CUDA driver on this machine; the benchmark needs an H100/H200 (see docs/PERFORMANCE.md)");
        std::process::exit(1);
    }
    let head = LmHead::new(0).unwrap_or_else(|e| {
        eprintln!("lmhead-bench: {e}");
        std::process::exit(1)
    });
    let stream = head.gpu().context().default_stream();
    // `--versus-fixed`: a second head on the table's fixed configs (read by LmHead::new).
    let fixed_head = args.versus_fixed.then(|| {
        std::env::set_var("LMHEAD_AUTOTUNE", "0");
        let f = LmHead::new(0).unwrap_or_else(|e| {
            eprintln!("lmhead-bench: {e}");
            std::process::exit(1)
        });
        std::env::remove_var("LMHEAD_AUTOTUNE");
        f
    });
    let info = head.gpu().info().clone();
    let report = (args.suite != "probe-child").then(|| head.kernel_report());
    if let Some(r) = report.as_ref().filter(|r| !r.cubin) {
        eprintln!("lmhead-bench: warning: the kernels are JIT-compiled ({}): first calls are slower", r.source);
    }
    if args.suite == "probe-child" {
        suites::probe_child(&head, &stream, args.filter.as_deref().unwrap_or_default());
        return;
    }
    if args.suite == "tp" {
        tp::run(&args, &info.name, &commit());
        return;
    }
    if args.suite == "tune-table" {
        table::run(&head, &args, &info.name, &commit());
        return;
    }
    // The single-kernel probes: one shape from `--filter`, a report on stdout.
    type Probe = fn(&LmHead, &Arc<CudaStream>, &Args) -> lmhead::Result<()>;
    let probe: Option<Probe> = match args.suite.as_str() {
        "config-probe" => Some(config_probe::run),
        "dh-probe" => Some(dh_probe::run),
        _ => None,
    };
    if let Some(run) = probe {
        if let Err(e) = run(&head, &stream, &args) {
            eprintln!("lmhead-bench {}: {e}", args.suite);
            std::process::exit(1);
        }
        return;
    }
    let suite = Suite::named(&args.suite).unwrap_or_else(|| {
        eprintln!("unknown suite `{}` (quick, sweep, probe, entropy, tp)", args.suite);
        std::process::exit(2)
    });
    if let Suite::Probe = suite {
        suites::probe(&head, &stream, &args);
        return;
    }
    let cases: Vec<Case> =
        suite.cases().into_iter().filter(|c| args.filter.as_ref().is_none_or(|f| c.name().contains(f.as_str()))).skip(args.skip).collect();
    let (logical, unique) = suite.counts();
    println!(
        "# lmhead-bench {} on {} (driver {}), commit {}: {} shapes ({} logical cases → {} unique local shapes in the suite)",
        args.suite,
        info.name,
        info.driver_version,
        commit(),
        cases.len(),
        logical,
        unique
    );
    if let Some(r) = &report {
        println!("\n{r}");
    }
    println!();
    println!(
        "| case | T | V | D | GEMM ms | fwd ms (x GEMM) | fwd+ent ms (x GEMM) | fwd+bwd ms (x GEMM) | fwd TFLOP/s | ws MiB | configs |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&args.out).ok();
    let start = Instant::now();
    for (i, c) in cases.iter().enumerate() {
        if start.elapsed().as_secs_f64() > args.budget_s {
            eprintln!("budget of {} s reached after {i} of {} shapes", args.budget_s, cases.len());
            break;
        }
        eprintln!("[{}/{}] {} ({:.0} s elapsed)", i + 1, cases.len(), c.name(), start.elapsed().as_secs_f64());
        let heads: Vec<(&LmHead, &str)> = match &fixed_head {
            Some(f) => vec![(&head, "auto"), (f, "fixed")],
            None => vec![(
                &head,
                if args.fallback {
                    "fallback"
                } else if args.fixed {
                    "fixed"
                } else {
                    "auto"
                },
            )],
        };
        let hs: Vec<&LmHead> = heads.iter().map(|h| h.0).collect();
        let seed = 0x5EED ^ i as u64;
        let measured = match measure(&hs, &stream, c, &args, seed) {
            // Two heads' workspaces beside cuBLAS's logits may not fit where one does: then one
            // head at a time (same inputs, no longer in the same rounds).
            Err(lmhead::Error::OutOfMemory { .. }) if hs.len() > 1 => {
                eprintln!("{}: out of memory with both heads; measuring them one after the other", c.name());
                hs.iter()
                    .map(|&h| {
                        h.release_workspace();
                        let r = measure(&[h], &stream, c, &args, seed).map(|mut v| v.remove(0));
                        h.release_workspace();
                        r
                    })
                    .collect::<lmhead::Result<Vec<Row>>>()
            }
            r => r,
        };
        match measured {
            Ok(rows) => {
                for (r, (_, tuning)) in rows.iter().zip(&heads) {
                    let f = 2.0 * c.t as f64 * c.v as f64 * c.d as f64;
                    let fb = r.fwd_bwd.as_ref().map(|t| format!("{:.2} ({:.2}x)", t.p50, t.p50 / r.gemm.p50)).unwrap_or_else(|| "-".into());
                    let name = if heads.len() > 1 { format!("{} ({tuning})", c.name()) } else { c.name() };
                    println!(
                        "| {} | {} | {} | {} | {:.3} | {:.3} ({:.2}x) | {:.3} ({:.2}x) | {} | {:.0} | {:.0} | {} / {} / {} |",
                        name,
                        c.t,
                        c.v,
                        c.d,
                        r.gemm.p50,
                        r.fwd.p50,
                        r.fwd.p50 / r.gemm.p50,
                        r.fwd_ent.p50,
                        r.fwd_ent.p50 / r.gemm.p50,
                        fb,
                        tflops(f, r.fwd.p50),
                        r.workspace_mib,
                        r.fwd_cfg,
                        r.fwd_ent_cfg,
                        r.bwd_cfg
                    );
                    if let Some(o) = out.as_mut() {
                        let mut rec = json!({
                            "gpu": info.name, "driver": info.driver_version, "commit": commit(), "suite": args.suite,
                            "timestamp": crate::unix_now(),
                            "tuning": tuning,
                            "row": r,
                        });
                        rec["order"] = json!(if args.balanced { "balanced" } else { "fixed" });
                        if let Some(o) = plan_overrides(|k| std::env::var(k).ok()) {
                            rec["plan_overrides"] = o;
                        }
                        if let Some(chunk) = args.bwd_chunk {
                            rec["bwd_chunk"] = json!(chunk);
                        }
                        let _ = writeln!(o, "{rec}");
                    }
                }
            }
            Err(e) => println!("| {} | {} | {} | {} | error: {e} |", c.name(), c.t, c.v, c.d),
        }
        for (h, _) in &heads {
            h.release_workspace();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{plan_overrides, RoundOrders};

    #[test]
    fn plan_overrides_name_the_variables_set() {
        assert_eq!(plan_overrides(|_| None), None);
        let env = |k: &str| match k {
            "LMHEAD_FWD_SPLITS" => Some("12".to_string()),
            "LMHEAD_FWD_RASTER" => Some(" 11 ".to_string()),
            _ => None,
        };
        assert_eq!(plan_overrides(env), Some(serde_json::json!({"LMHEAD_FWD_SPLITS": "12", "LMHEAD_FWD_RASTER": "11"})));
    }

    /// Runs `rounds` rounds of `n` operations (all present) after `last`: the orders and, per
    /// operation, how often each other one ran right before it.
    fn run_rounds(n: usize, rounds: usize, last: usize) -> (Vec<Vec<usize>>, Vec<Vec<u32>>) {
        let mut o = RoundOrders::new(n, last);
        let orders: Vec<Vec<usize>> = (0..rounds).map(|_| o.next(&vec![true; n])).collect();
        let mut before = vec![vec![0u32; n]; n];
        let mut prev = last;
        for x in orders.iter().flatten() {
            before[*x][prev] += 1;
            prev = *x;
        }
        (orders, before)
    }

    #[test]
    fn round_orders_spread_each_predecessor() {
        for n in 1..=10usize {
            for rounds in 1..=3 * n {
                let (orders, before) = run_rounds(n, rounds, n - 1);
                for o in &orders {
                    let mut s = o.clone();
                    s.sort_unstable();
                    assert_eq!(s, (0..n).collect::<Vec<_>>(), "n {n}: {o:?} is not a permutation");
                }
                for (x, b) in before.iter().enumerate() {
                    let others: Vec<u32> = (0..n).filter(|&y| y != x).map(|y| b[y]).collect();
                    if n > 1 {
                        assert_eq!(b[x], 0, "n {n} rounds {rounds}: {x} ran right after itself");
                        let (lo, hi) = (others.iter().min().unwrap(), others.iter().max().unwrap());
                        assert!(hi - lo <= 2, "n {n} rounds {rounds}: before {x}: {b:?}");
                    }
                }
            }
        }
        // The bench's round of one head with the backward (cuBLAS, forward, entropy, step) at
        // --reps 3 after the warm-up's step: each operation after three different ones.
        let (orders, before) = run_rounds(4, 3, 3);
        for (x, b) in before.iter().enumerate() {
            assert!(b.iter().all(|&c| c <= 1), "{x} after {b:?} in {orders:?}");
        }
    }

    #[test]
    fn absent_operations_are_left_out() {
        let mut o = RoundOrders::new(4, 3);
        let full = o.next(&[true; 4]);
        assert_eq!(full.len(), 4);
        for _ in 0..5 {
            let r = o.next(&[true, true, true, false]);
            let mut s = r.clone();
            s.sort_unstable();
            assert_eq!(s, vec![0, 1, 2]);
        }
    }
}
