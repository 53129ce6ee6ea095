//! `lmhead-bench active`: the forward and forward+backward on masked batches, where only some
//! rows' labels are read (`lmhead::Compaction`), against the dense call on all rows and the dense call
//! on only the active rows, compacted beforehand (the ideal), in the same rounds.
//!
//! Cases: the first three heads of [`MODELS`] (d = 2048, 4096, 5120 at their real vocabularies),
//! [`TOKENS`] tokens, active fractions [`FRACTIONS`], two mask layouts: `suffix` (one prompt, then
//! one response) and `multi-turn` (8 packed turns of a 100–3000-token observation and a
//! 50–2000-token response, seeded, scaled to the fraction; `lmhead_reference::masks`); the
//! fraction 1 once per head (every row active). Each round times, in a balanced order
//! ([`crate::RoundOrders`]): cuBLAS's logits GEMM of the dense shape; the log-prob forward dense
//! (`Compaction::Off`), the library's (`Compaction::Auto`) and the ideal; the same three steps
//! (forward with entropy, backward of both, bf16 `dh` and `dW`; the first 5 rounds). All run with
//! the label check on (the library's count rides on it). The table gives each time and the
//! fixed cost, the library's time less the ideal's, also as a share of the dense call.
//!
//! Checks after the rounds: the library's log-probs equal the ideal's bitwise on the active rows
//! (the same kernels at the same configs) and, with the dense call's, are within 1e-3 of the f64
//! reference on the first, middle and last active rows.

use std::io::Write as _;
use std::sync::Arc;

use lmhead::cudarc::driver::{CudaSlice, CudaStream};
use lmhead::{bf16, BwdInputs, BwdOptions, Compaction, DeviceInfo, FwdInputs, FwdOptions, FwdOutputs, GradOut, LmHead, Problem};
use lmhead_core::record::ActiveRow;
use lmhead_reference::{masks, IGNORE_INDEX};
use serde_json::json;

use crate::suites::MODELS;
use crate::{cublas, random_bf16, sample, timing, Args, RoundOrders};

/// Tokens of every case (the 8K-token batch).
pub const TOKENS: usize = 8192;
/// Active fractions.
pub const FRACTIONS: [f64; 5] = [1.0, 0.75, 0.5, 0.25, 0.1];
/// Rounds that time the steps (as the other suites).
const STEP_REPS: usize = 5;

/// One case: a head, a layout and a fraction.
#[derive(Clone, Debug)]
pub struct ActiveCase {
    pub model: &'static str,
    pub d: usize,
    pub v: usize,
    pub layout: &'static str,
    pub fraction: f64,
}

impl ActiveCase {
    pub fn name(&self) -> String {
        format!("{}/tok{}k/{}/f{}", self.model, TOKENS / 1024, self.layout, self.fraction)
    }

    /// The mask of this case over [`TOKENS`] rows (`seed` for the turns' lengths).
    pub fn mask(&self, seed: u64) -> Vec<bool> {
        match self.layout {
            "multi-turn" => masks::multi_turn(TOKENS, self.fraction, seed),
            _ => masks::suffix(TOKENS, self.fraction),
        }
    }
}

/// Every case of the suite, heads in [`MODELS`] order.
pub fn cases() -> Vec<ActiveCase> {
    let mut out = Vec::new();
    for &(model, d, v) in &MODELS[..3] {
        for layout in ["suffix", "multi-turn"] {
            for &fraction in &FRACTIONS {
                if fraction == 1.0 && layout != "suffix" {
                    continue; // every row active: one layout
                }
                out.push(ActiveCase { model, d, v, layout, fraction });
            }
        }
    }
    out
}

/// The operations of a round.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Op {
    Gemm,
    Fwd(Way),
    Step(Way),
}

/// The three ways each operation is timed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Way {
    Dense,
    Active,
    Ideal,
}

const WAYS: [Way; 3] = [Way::Dense, Way::Active, Way::Ideal];

/// One problem's device inputs and outputs (the whole batch, or the ideal's compacted rows).
struct Batch {
    p: Problem,
    h: CudaSlice<bf16>,
    labels: CudaSlice<i64>,
    g: CudaSlice<f32>,
    lp: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    ent: CudaSlice<f32>,
    dh: CudaSlice<bf16>,
}

impl Batch {
    fn new(stream: &Arc<CudaStream>, (h, labels): (&[u16], &[i64]), v: usize, d: usize) -> lmhead::Result<Batch> {
        let t = labels.len();
        let z = |n: usize| lmhead::testing::zeros::<f32>(stream, n, "bench outputs");
        Ok(Batch {
            p: Problem::new(t, v, d),
            h: lmhead::testing::upload_bf16(stream, h)?,
            labels: lmhead::testing::upload(stream, labels)?,
            g: lmhead::testing::upload(stream, &vec![1.0f32; t])?,
            lp: z(t)?,
            lse: z(t)?,
            ent: z(t)?,
            dh: lmhead::testing::zeros(stream, t * d, "bench dh")?,
        })
    }
}

/// What the timed calls report (the library's way).
#[derive(Default)]
struct Seen {
    fwd_rows: usize,
    bwd_rows: usize,
    fwd_cfg: String,
    bwd_cfg: String,
}

fn run_op(
    head: &LmHead,
    stream: &Arc<CudaStream>,
    b: &mut Batch,
    w: &CudaSlice<bf16>,
    dw: &mut CudaSlice<bf16>,
    (op, c): (Op, Compaction),
    seen: &mut Seen,
) -> lmhead::Result<()> {
    let fo = FwdOptions { compaction: c, ..Default::default() };
    let x = FwdInputs { h: &b.h, w, labels: &b.labels, problem: b.p };
    match op {
        Op::Gemm => unreachable!("cuBLAS is timed by the caller"),
        Op::Fwd(way) => {
            let r = head.forward(stream, &x, &fo, FwdOutputs { kept: None, logprob: &mut b.lp, lse: &mut b.lse, entropy: None })?;
            if way == Way::Active {
                seen.fwd_rows = r.rows;
                seen.fwd_cfg = r.kernel.as_deref().map(|k| crate::measure::config_of(k, lmhead::Family::Fwd)).unwrap_or_default();
            }
        }
        Op::Step(way) => {
            head.forward(stream, &x, &fo, FwdOutputs { kept: None, logprob: &mut b.lp, lse: &mut b.lse, entropy: Some(&mut b.ent) })?;
            let bx = BwdInputs {
                kept: None,
                h: &b.h,
                w,
                labels: &b.labels,
                lse: &b.lse,
                entropy: Some(&b.ent),
                grad_logprob: Some(&b.g),
                grad_entropy: Some(&b.g),
                problem: b.p,
            };
            let bo = BwdOptions { compaction: c, ..Default::default() };
            let r = head.backward(stream, &bx, &bo, GradOut::Bf16(&mut b.dh), Some(GradOut::Bf16(dw)))?;
            if way == Way::Active {
                seen.bwd_rows = r.rows;
                seen.bwd_cfg = format!(
                    "{}|{}|{}",
                    crate::measure::config_of(&r.dlogits, lmhead::Family::BwdDlogitsEnt),
                    crate::measure::config_of(&r.dh, lmhead::Family::BwdDh),
                    r.dw.as_deref().map(|k| crate::measure::config_of(k, lmhead::Family::BwdDw)).unwrap_or_default()
                );
            }
        }
    }
    Ok(())
}

/// The batch of one head: `h` and `W` on the host (for the reference) and `W` on the device,
/// and a label for every row.
struct HeadBatch {
    model: &'static str,
    hs: Vec<u16>,
    ws: Vec<u16>,
    w: CudaSlice<bf16>,
    labels: Vec<i64>,
}

/// Times one case on its head's batch and checks it.
fn measure(head: &LmHead, stream: &Arc<CudaStream>, c: &ActiveCase, hb: &HeadBatch, args: &Args) -> lmhead::Result<ActiveRow> {
    let (hs, w, labels) = (&hb.hs[..], &hb.w, &hb.labels[..]);
    let (t, v, d) = (TOKENS, c.v, c.d);
    let mask = c.mask(0xAC71 ^ c.fraction.to_bits());
    let masked = masks::apply(labels, &mask, IGNORE_INDEX);
    let rows: Vec<usize> = (0..t).filter(|&r| mask[r]).collect();
    let n = rows.len();
    let hc: Vec<u16> = rows.iter().flat_map(|&r| hs[r * d..(r + 1) * d].iter().copied()).collect();
    let lc: Vec<i64> = rows.iter().map(|&r| masked[r]).collect();
    let mut whole = Batch::new(stream, (hs, &masked), v, d)?;
    let mut ideal = Batch::new(stream, (&hc, &lc), v, d)?;
    let mut dw = lmhead::testing::zeros::<bf16>(stream, v * d, "bench dW")?;
    let mut blas = cublas::Gemm::new(stream.clone(), t, v, d)?;
    let mut seen = Seen::default();
    let mut run = |op: Op, seen: &mut Seen| -> lmhead::Result<()> {
        let way = match op {
            Op::Gemm => return blas.run(&whole.h, w),
            Op::Fwd(w) | Op::Step(w) => w,
        };
        let (batch, comp) = match way {
            Way::Dense => (&mut whole, Compaction::Off),
            Way::Active => (&mut whole, Compaction::Auto),
            Way::Ideal => (&mut ideal, Compaction::Off),
        };
        run_op(head, stream, batch, w, &mut dw, (op, comp), seen)
    };
    let ops: Vec<Op> = std::iter::once(Op::Gemm).chain(WAYS.map(Op::Fwd)).chain(WAYS.map(Op::Step)).collect();
    // Tuning (new token buckets) and warm-up before any timing.
    for _ in 0..2 {
        for &op in &ops {
            run(op, &mut seen)?;
        }
    }
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); ops.len()];
    let mut orders = RoundOrders::new(ops.len(), ops.len() - 1);
    for r in 0..args.reps {
        let present: Vec<bool> = ops.iter().map(|op| !matches!(op, Op::Step(_)) || r < STEP_REPS).collect();
        let order: Vec<usize> = if args.balanced { orders.next(&present) } else { (0..ops.len()).filter(|&j| present[j]).collect() };
        for j in order {
            times[j].push(sample(stream, &mut || run(ops[j], &mut seen))?);
        }
    }
    // The library's log-probs: bitwise the ideal's on the active rows; the reference on three.
    let check_max_abs = if args.check {
        run_op(head, stream, &mut whole, w, &mut dw, (Op::Fwd(Way::Active), Compaction::Auto), &mut seen)?;
        let got = stream.clone_dtoh(&whole.lp).map_err(|e| lmhead::Error::Invalid(format!("reading log-probs: {e:?}")))?;
        run_op(head, stream, &mut ideal, w, &mut dw, (Op::Fwd(Way::Ideal), Compaction::Off), &mut seen)?;
        let want = stream.clone_dtoh(&ideal.lp).map_err(|e| lmhead::Error::Invalid(format!("reading log-probs: {e:?}")))?;
        if let Some(k) = (0..n).find(|&k| got[rows[k]].to_bits() != want[k].to_bits()) {
            return Err(lmhead::Error::Invalid(format!(
                "{}: row {} differs from the ideal's ({} vs {})",
                c.name(),
                rows[k],
                got[rows[k]],
                want[k]
            )));
        }
        let picks = [0, n / 2, n - 1].map(|k| rows[k]);
        let inp = lmhead_reference::Inputs {
            h: hs,
            w: &hb.ws,
            labels: &masked,
            t,
            v,
            d,
            v_begin: 0,
            v_total: v as i64,
            temperature: 1.0,
            ignore_index: IGNORE_INDEX,
        };
        Some(reference_check(&inp, &picks, &got)?)
    } else {
        None
    };
    let tm = |j: usize| timing(times[j].clone());
    Ok(ActiveRow {
        model: c.model.into(),
        t,
        v,
        d,
        layout: c.layout.into(),
        fraction: c.fraction,
        active: n,
        gemm: tm(0),
        fwd_dense: tm(1),
        fwd_active: tm(2),
        fwd_ideal: tm(3),
        step_dense: tm(4),
        step_active: tm(5),
        step_ideal: tm(6),
        fwd_rows: seen.fwd_rows,
        bwd_rows: seen.bwd_rows,
        fwd_cfg: seen.fwd_cfg,
        bwd_cfg: seen.bwd_cfg,
        check_max_abs,
    })
}

/// Largest |Δ| of `got` (log-probs of every row) against the f64 reference on `picks`.
fn reference_check(inp: &lmhead_reference::Inputs, picks: &[usize], got: &[f32]) -> lmhead::Result<f64> {
    let r = lmhead_reference::forward_rows(inp, picks);
    let e = picks.iter().zip(&r).map(|(&k, r)| (got[k] as f64 - r.logprob).abs()).fold(0.0f64, f64::max);
    if e.is_nan() || e >= 1e-3 {
        return Err(lmhead::Error::Invalid(format!("the library's forward disagrees with the reference: max |Δ logprob| = {e}")));
    }
    Ok(e)
}

/// The suite: every case (`--filter` on the name), a table on stdout, records to `--out`.
pub fn run(head: &LmHead, stream: &Arc<CudaStream>, args: &Args, info: &DeviceInfo) {
    let cases: Vec<ActiveCase> =
        cases().into_iter().filter(|c| args.filter.as_ref().is_none_or(|f| c.name().contains(f.as_str()))).collect();
    println!(
        "# lmhead-bench active on {} (driver {}), commit {}: {} cases, {TOKENS} tokens\n",
        info.name,
        info.driver_version,
        crate::commit(),
        cases.len()
    );
    println!("| case | active | GEMM ms | fwd dense | fwd ideal | fwd | fwd fixed ms (% dense) | step dense | step ideal | step | step fixed ms (% dense) | rows fwd/bwd |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut out = std::fs::OpenOptions::new().create(true).append(true).open(&args.out).ok();
    // One batch per head.
    let mut current: Option<HeadBatch> = None;
    for (i, c) in cases.iter().enumerate() {
        eprintln!("[{}/{}] {}", i + 1, cases.len(), c.name());
        if current.as_ref().is_none_or(|b| b.model != c.model) {
            current = None;
            let seed = 0xAC7 ^ c.d as u64;
            let hs = random_bf16(TOKENS * c.d, 4.0 / (c.d as f32).sqrt(), seed);
            let ws = random_bf16(c.v * c.d, 0.5, seed ^ 1);
            let mut rng = lmhead_reference::rng::Rng::new(seed ^ 2);
            let labels: Vec<i64> = (0..TOKENS).map(|_| rng.below(c.v as u64) as i64).collect();
            match lmhead::testing::upload_bf16(stream, &ws) {
                Ok(w) => current = Some(HeadBatch { model: c.model, hs, ws, w, labels }),
                Err(e) => {
                    println!("| {} | error: {e} |", c.name());
                    continue;
                }
            }
        }
        match measure(head, stream, c, current.as_ref().expect("the head's batch"), args) {
            Ok(r) => {
                let x = |a: &lmhead_core::record::Timing, b: &lmhead_core::record::Timing| a.p50 / b.p50;
                let fixed = |a: &lmhead_core::record::Timing, i: &lmhead_core::record::Timing, d: &lmhead_core::record::Timing| {
                    format!("{:.3} ({:.1}%)", a.p50 - i.p50, 100.0 * (a.p50 - i.p50) / d.p50)
                };
                println!(
                    "| {} | {} | {:.3} | {:.3} | {:.3} | {:.3} ({:.3}x ideal) | {} | {:.2} | {:.2} | {:.2} ({:.3}x ideal) | {} | {}/{} |",
                    c.name(),
                    r.active,
                    r.gemm.p50,
                    r.fwd_dense.p50,
                    r.fwd_ideal.p50,
                    r.fwd_active.p50,
                    x(&r.fwd_active, &r.fwd_ideal),
                    fixed(&r.fwd_active, &r.fwd_ideal, &r.fwd_dense),
                    r.step_dense.p50,
                    r.step_ideal.p50,
                    r.step_active.p50,
                    x(&r.step_active, &r.step_ideal),
                    fixed(&r.step_active, &r.step_ideal, &r.step_dense),
                    r.fwd_rows,
                    r.bwd_rows
                );
                if let Some(o) = out.as_mut() {
                    let rec = json!({
                        "gpu": info.name, "driver": info.driver_version, "commit": crate::commit(), "suite": "active",
                        "timestamp": crate::unix_now(), "tuning": "auto", "active_row": r,
                    });
                    let _ = writeln!(o, "{rec}");
                }
            }
            Err(e) => println!("| {} | error: {e} |", c.name()),
        }
        head.release_workspace();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_suite_covers_every_head_layout_and_fraction() {
        let cs = cases();
        assert_eq!(cs.len(), 3 * 9, "three heads × (suffix at 5 fractions + multi-turn at 4)");
        for &(m, d, _) in &MODELS[..3] {
            for f in FRACTIONS {
                assert!(cs.iter().any(|c| c.model == m && c.d == d && c.layout == "suffix" && c.fraction == f));
                assert_eq!(cs.iter().any(|c| c.model == m && c.layout == "multi-turn" && c.fraction == f), f < 1.0);
            }
        }
        assert_eq!([2048, 4096, 5120], [cs[0].d, cs[9].d, cs[18].d]);
        let names: std::collections::HashSet<String> = cs.iter().map(|c| c.name()).collect();
        assert_eq!(names.len(), cs.len());
        for c in &cs {
            let m = c.mask(7);
            assert_eq!(m.len(), TOKENS);
            assert_eq!(m.iter().filter(|&&x| x).count(), (c.fraction * TOKENS as f64).round() as usize, "{}", c.name());
        }
    }
}
