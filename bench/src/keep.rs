//! `lmhead-bench keep`: the training step (forward, then the backward of its outputs, bf16 `dh`
//! and `dW`) with the kept-logits mode on (`FwdOptions::keep_logits`, `lmhead::keep`) and off,
//! each against one cuBLAS GEMM `h·Wᵀ` of the same shape, in the same rounds.
//!
//! Cases: the peers' seven shapes ([`PEERS`]) and the sweep's large shapes (the heads of
//! [`MODELS`] at [`LARGE_TOKENS`] tokens, TP = CP = 1). Each round times, in a balanced order
//! ([`crate::RoundOrders`]): the GEMM; the log-prob step off and on; the step with entropy (the
//! backward of both outputs) off and on. "On" keeps every row when the buffer fits
//! [`FREE_FRACTION`] of the device memory free after the case's inputs are allocated, else the
//! whole tiles that fit (the record's `kept_rows` says how many). Device memory in use
//! (`total − free`) is read after a warm-up step each way: `mem_off` without the kept buffer,
//! `mem_on` with it (both include the case's inputs and outputs and the library's workspace).
//!
//! Checks after the rounds (unless `--no-check`): the log-probs on and off are bitwise equal
//! (the `_keep` forward folds exactly what the plain one does), and `dh` on and off agree to
//! within 1e-2 relative L2 (the d-logits are the same function of the kept or recomputed f32
//! logits; the parity against the f64 reference is `tests/gpu_keep.rs`'s).
//!
//! Records: one JSON line per case with `"suite": "keep"` and the case under `keep_logits`.

use std::io::Write as _;
use std::sync::Arc;

use lmhead::cudarc::driver::{CudaSlice, CudaStream};
use lmhead::{bf16, BwdInputs, BwdOptions, DeviceInfo, FwdInputs, FwdOptions, FwdOutputs, GradOut, LmHead, Problem};
use serde_json::json;

use crate::suites::{MODELS, PEERS};
use crate::{cublas, sample, timing, Args, RoundOrders};

/// Tokens of the sweep's large shapes.
pub const LARGE_TOKENS: [usize; 2] = [65_536, 131_072];
/// Share of the free device memory (after the case's inputs) the kept buffer may take.
pub const FREE_FRACTION: f64 = 0.8;

/// One case: a name and its `(t, d, v)`.
#[derive(Clone, Debug)]
pub struct KeepCase {
    pub name: String,
    pub t: usize,
    pub d: usize,
    pub v: usize,
}

/// Every case of the suite: the peers' seven shapes, then the large shapes.
pub fn cases() -> Vec<KeepCase> {
    let mut out: Vec<KeepCase> = PEERS.iter().map(|&(m, t, d, v)| KeepCase { name: m.into(), t, d, v }).collect();
    for &(m, d, v) in MODELS {
        for &t in &LARGE_TOKENS {
            out.push(KeepCase { name: format!("{m}/tok{}k", t / 1024), t, d, v });
        }
    }
    out
}

/// The timed operations of a round.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    Gemm,
    /// A step: (entropy, keep).
    Step(bool, bool),
}

const OPS: [Op; 5] = [Op::Gemm, Op::Step(false, false), Op::Step(false, true), Op::Step(true, false), Op::Step(true, true)];

/// A case's device buffers.
struct Bufs {
    p: Problem,
    h: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    labels: CudaSlice<i32>,
    g: CudaSlice<f32>,
    lp: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    ent: CudaSlice<f32>,
    dh: CudaSlice<bf16>,
    dw: CudaSlice<bf16>,
}

/// What the steps report.
#[derive(Default, Clone, Debug)]
struct Seen {
    kept_rows: usize,
    bwd_kept_rows: usize,
    workspace_bytes: usize,
}

/// One step: forward (entropy when `ent`), backward of its outputs (vocab chunks of `chunk`
/// columns when given: `--bwd-chunk`); with `kept` (buffer, budget in bytes) the kept-logits
/// mode.
fn step(
    head: &LmHead,
    stream: &Arc<CudaStream>,
    chunk: Option<usize>,
    b: &mut Bufs,
    ent: bool,
    mut kept: Option<(&mut CudaSlice<f32>, usize)>,
) -> lmhead::Result<Seen> {
    let budget = kept.as_ref().map_or(0, |k| k.1);
    let fo = FwdOptions { keep_logits: budget, ..Default::default() };
    let x = FwdInputs { h: &b.h, w: &b.w, labels: &b.labels, problem: b.p };
    let out = FwdOutputs {
        logprob: &mut b.lp,
        lse: &mut b.lse,
        entropy: ent.then_some(&mut b.ent),
        kept: kept.as_mut().map(|(k, _)| &mut **k as &mut dyn lmhead::cudarc::driver::DevicePtrMut<f32>),
    };
    let fr = head.forward(stream, &x, &fo, out)?;
    let bx = BwdInputs {
        h: &b.h,
        w: &b.w,
        labels: &b.labels,
        lse: &b.lse,
        entropy: ent.then_some(&b.ent as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        grad_logprob: Some(&b.g),
        grad_entropy: ent.then_some(&b.g as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        problem: b.p,
        kept: kept.as_ref().map(|(k, _)| lmhead::keep::Kept { logits: &**k, rows: fr.kept_rows }),
    };
    let br =
        head.backward(stream, &bx, &BwdOptions { chunk, ..Default::default() }, GradOut::Bf16(&mut b.dh), Some(GradOut::Bf16(&mut b.dw)))?;
    Ok(Seen { kept_rows: fr.kept_rows, bwd_kept_rows: br.kept_rows, workspace_bytes: br.workspace_bytes })
}

/// Device memory in use now (`total − free`), after the stream's work.
fn mem_used(stream: &Arc<CudaStream>) -> lmhead::Result<usize> {
    stream.synchronize().map_err(|e| lmhead::Error::Invalid(format!("synchronising: {e:?}")))?;
    let (free, total) =
        lmhead::cudarc::driver::result::mem_get_info().map_err(|e| lmhead::Error::Invalid(format!("cuMemGetInfo: {e:?}")))?;
    Ok(total - free)
}

fn free_bytes() -> usize {
    lmhead::cudarc::driver::result::mem_get_info().map(|(f, _)| f).unwrap_or(0)
}

/// Times one case and checks it; the record's fields.
fn measure(head: &LmHead, stream: &Arc<CudaStream>, c: &KeepCase, args: &Args) -> lmhead::Result<serde_json::Value> {
    let (t, v, d) = (c.t, c.v, c.d);
    let p = Problem::new(t, v, d);
    let z = |n: usize| lmhead::testing::zeros::<f32>(stream, n, "bench outputs");
    let labels: Vec<i32> = (0..t).map(|i| (i * 7919 % v) as i32).collect();
    let mut b = Bufs {
        p,
        h: lmhead::testing::random_bf16_tiled(stream, t * d, 4.0 / (d as f64).sqrt(), 1)?,
        w: lmhead::testing::random_bf16_tiled(stream, v * d, 0.5, 2)?,
        labels: lmhead::testing::upload(stream, &labels)?,
        g: lmhead::testing::upload(stream, &vec![1.0f32; t])?,
        lp: z(t)?,
        lse: z(t)?,
        ent: z(t)?,
        dh: lmhead::testing::zeros(stream, t * d, "bench dh")?,
        dw: lmhead::testing::zeros(stream, v * d, "bench dW")?,
    };
    let mut blas = cublas::Gemm::new(stream.clone(), t, v, d)?;
    // Warm-up (tuning where on) without the mode, then the memory without the kept buffer.
    for ent in [false, true] {
        step(head, stream, args.bwd_chunk, &mut b, ent, None)?;
    }
    let mem_off = mem_used(stream)?;
    let full = t * lmhead::keep::row_bytes(v);
    let budget = full.min((free_bytes() as f64 * FREE_FRACTION) as usize);
    let kept_len = lmhead::keep::len(t, v, budget);
    if kept_len == 0 {
        return Err(lmhead::Error::Invalid(format!("{}: not one 128-row tile of kept logits fits in {budget} bytes", c.name)));
    }
    let mut kept = lmhead::testing::zeros::<f32>(stream, kept_len, "bench kept logits")?;
    let mut seen = Seen::default();
    for ent in [false, true] {
        seen = step(head, stream, args.bwd_chunk, &mut b, ent, Some((&mut kept, budget)))?;
    }
    let mem_on = mem_used(stream)?;
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); OPS.len()];
    let mut orders = RoundOrders::new(OPS.len(), OPS.len() - 1);
    for _ in 0..args.reps {
        let present = vec![true; OPS.len()];
        let order: Vec<usize> = if args.balanced { orders.next(&present) } else { (0..OPS.len()).collect() };
        for j in order {
            let ms = sample(stream, &mut || match OPS[j] {
                Op::Gemm => blas.run(&b.h, &b.w),
                Op::Step(ent, false) => step(head, stream, args.bwd_chunk, &mut b, ent, None).map(|_| ()),
                Op::Step(ent, true) => step(head, stream, args.bwd_chunk, &mut b, ent, Some((&mut kept, budget))).map(|_| ()),
            })?;
            times[j].push(ms);
        }
    }
    let check = if args.check {
        let read = |x: &CudaSlice<f32>| stream.clone_dtoh(x).map_err(|e| lmhead::Error::Invalid(format!("reading: {e:?}")));
        step(head, stream, args.bwd_chunk, &mut b, true, None)?;
        let (lp0, dh0) = (read(&b.lp)?, lmhead::testing::download_bf16(stream, &b.dh)?);
        step(head, stream, args.bwd_chunk, &mut b, true, Some((&mut kept, budget)))?;
        let (lp1, dh1) = (read(&b.lp)?, lmhead::testing::download_bf16(stream, &b.dh)?);
        if let Some(i) = (0..t).find(|&i| lp0[i].to_bits() != lp1[i].to_bits()) {
            return Err(lmhead::Error::Invalid(format!(
                "{}: log-prob of row {i} differs with the mode ({} vs {})",
                c.name, lp1[i], lp0[i]
            )));
        }
        let num: f64 = dh0.iter().zip(&dh1).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        let den: f64 = dh0.iter().map(|a| a * a).sum::<f64>().sqrt();
        let rel = num / den.max(f64::MIN_POSITIVE);
        if rel.is_nan() || rel > 1e-2 {
            return Err(lmhead::Error::Invalid(format!("{}: dh with the mode is {rel:.3e} (relative L2) from dh without", c.name)));
        }
        Some(rel)
    } else {
        None
    };
    let tm: Vec<lmhead_core::record::Timing> = times.into_iter().map(timing).collect();
    let x = |j: usize| tm[j].p50 / tm[0].p50;
    Ok(json!({
        "case": c.name, "t": t, "v": v, "d": d,
        "gemm": tm[0], "step_off": tm[1], "step_on": tm[2], "step_ent_off": tm[3], "step_ent_on": tm[4],
        "x_off": x(1), "x_on": x(2), "x_ent_off": x(3), "x_ent_on": x(4),
        "budget_bytes": budget, "kept_bytes": 4 * kept_len, "kept_rows": seen.kept_rows, "bwd_kept_rows": seen.bwd_kept_rows,
        "workspace_bytes": seen.workspace_bytes, "mem_off": mem_off, "mem_on": mem_on,
        "check_dh_rel_l2": check, "bwd_chunk": args.bwd_chunk,
    }))
}

/// The suite: every case (`--filter` on the name, after `--skip`), a table on stdout, records to
/// `--out`; with `--budget-s`, no case starts once that many seconds are spent.
pub fn run(head: &LmHead, stream: &Arc<CudaStream>, args: &Args, info: &DeviceInfo) {
    let cases: Vec<KeepCase> =
        cases().into_iter().filter(|c| args.filter.as_ref().is_none_or(|f| c.name.contains(f.as_str()))).skip(args.skip).collect();
    let start = std::time::Instant::now();
    println!("# lmhead-bench keep on {} (driver {}), commit {}: {} cases\n", info.name, info.driver_version, crate::commit(), cases.len());
    println!("| case | t | d | v | GEMM ms | step off | step on | step+ent off | step+ent on | kept rows | kept GiB | mem off / on GiB |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&args.out).ok();
    let gib = |b: &serde_json::Value| b.as_f64().unwrap_or(0.0) / (1u64 << 30) as f64;
    for (i, c) in cases.iter().enumerate() {
        if start.elapsed().as_secs_f64() > args.budget_s {
            eprintln!("budget of {} s reached after {i} of {} cases (resume with --skip {})", args.budget_s, cases.len(), args.skip + i);
            break;
        }
        eprintln!("[{}/{}] {}", i + 1, cases.len(), c.name);
        match measure(head, stream, c, args) {
            Ok(r) => {
                let ms = |k: &str| r[k]["p50"].as_f64().unwrap_or(f64::NAN);
                let x = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
                println!(
                    "| {} | {} | {} | {} | {:.3} | {:.2} ({:.2}x) | {:.2} ({:.2}x) | {:.2} ({:.2}x) | {:.2} ({:.2}x) | {} | {:.2} | {:.2} / {:.2} |",
                    c.name, c.t, c.d, c.v, ms("gemm"),
                    ms("step_off"), x("x_off"), ms("step_on"), x("x_on"), ms("step_ent_off"), x("x_ent_off"), ms("step_ent_on"), x("x_ent_on"),
                    r["kept_rows"], gib(&r["kept_bytes"]), gib(&r["mem_off"]), gib(&r["mem_on"]),
                );
                if let Some(o) = out.as_mut() {
                    let rec = json!({
                        "gpu": info.name, "driver": info.driver_version, "commit": crate::commit(), "suite": "keep",
                        "timestamp": crate::unix_now(), "tuning": "auto", "keep_logits": r,
                    });
                    let _ = writeln!(o, "{rec}");
                }
            }
            Err(e) => println!("| {} | error: {e} |", c.name),
        }
        head.release_workspace();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suite_covers_the_peers_and_the_large_shapes() {
        let cs = cases();
        assert_eq!(cs.len(), PEERS.len() + MODELS.len() * LARGE_TOKENS.len());
        for &(m, t, d, v) in PEERS {
            assert!(cs.iter().any(|c| c.name == m && (c.t, c.d, c.v) == (t, d, v)));
        }
        let names: std::collections::HashSet<&str> = cs.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names.len(), cs.len());
    }
}
