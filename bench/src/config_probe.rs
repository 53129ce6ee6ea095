//! `lmhead-bench config-probe --filter T,V,D[;T,V,D…]`, at each shape in turn: each sm90 forward
//! candidate (log-prob, and with entropy) and the tuned forward of both, then the backward with
//! each sm90 `dh` candidate (the d-logits and `dW` tuned) and the tuned backward, beside a cuBLAS
//! GEMM of the same shape and four of them back to back (the training step's FLOP as one
//! sustained load: what the GEMM baseline itself loses to the clock when it runs as long as the
//! step). The variants take turns within each round (in orders that spread what runs before
//! each one, `RoundOrders`), so all see the same clock: what a config costs in the steady state,
//! without editing a tuning cache. Unless `--no-check`, each forward variant's log-probs are then
//! checked against the f64 reference on sampled rows.

use std::sync::Arc;

use lmhead::cudarc::driver::{CudaSlice, CudaStream};
use lmhead::tune::bench::median;
use lmhead::{
    bf16, BwdConfigs, BwdInputs, BwdOptions, Choice, Family, FwdInputs, FwdOptions, FwdOutputs, GradOut, LabelCheck, LmHead, Problem,
};

use crate::{random_bf16, sample, Args};

pub fn run(head: &LmHead, stream: &Arc<CudaStream>, args: &Args) -> lmhead::Result<()> {
    let mut shapes = Vec::new();
    for shape in args.filter.as_deref().unwrap_or("16384,131072,4096").split(';') {
        let dims: Vec<usize> = shape.split(',').filter_map(|x| x.trim().parse().ok()).collect();
        let [t, v, d] = dims[..] else {
            return Err(lmhead::Error::Invalid(format!("config-probe: --filter T,V,D[;T,V,D…], not {shape:?}")));
        };
        shapes.push((t, v, d));
    }
    // Every shape parsed before the first one runs.
    shapes.into_iter().try_for_each(|s| probe(head, stream, args, s))
}

/// The probe at one shape.
fn probe(head: &LmHead, stream: &Arc<CudaStream>, args: &Args, (t, v, d): (usize, usize, usize)) -> lmhead::Result<()> {
    let reps = args.reps.max(3);
    let up = |x: &[u16]| lmhead::testing::upload_bf16(stream, x);
    let (hs, ws) = (random_bf16(t * d, 1.0, 11), random_bf16(v * d, 0.02, 12));
    let (h, w) = (up(&hs)?, up(&ws)?);
    let label_host: Vec<i64> = (0..t).map(|i| ((i as u64).wrapping_mul(2_654_435_761) % v as u64) as i64).collect();
    let labels = lmhead::testing::upload(stream, &label_host)?;
    let z = |n: usize| lmhead::testing::zeros::<f32>(stream, n, "config-probe");
    let (mut lp, mut lse, mut ent) = (z(t)?, z(t)?, z(t)?);
    let (gl, ge) = (lmhead::testing::upload(stream, &vec![1.0f32; t])?, lmhead::testing::upload(stream, &vec![0.5f32; t])?);
    let mut dh = lmhead::testing::zeros::<bf16>(stream, t * d, "dh")?;
    let mut dw = lmhead::testing::zeros::<bf16>(stream, v * d, "dW")?;
    let problem = Problem::new(t, v, d);
    let x = FwdInputs { h: &h, w: &w, labels: &labels, problem };
    let mut gemm = crate::cublas::Gemm::new(stream.clone(), t, v, d)?;

    // The variants: each forward (label, family, config; `Auto`: the tuned one), then each
    // backward (label, choices).
    let sm90 = |f: Family| f.candidates().iter().copied().filter(|c| c.is_sm90()).collect::<Vec<_>>();
    let mut fwd: Vec<(String, Family, Choice)> = Vec::new();
    for f in [Family::Fwd, Family::FwdEnt] {
        fwd.extend(sm90(f).into_iter().map(|c| (format!("{}_{}", f.stem(), c.suffix(f)), f, Choice::Fixed(c))));
        fwd.push((format!("{} tuned", f.stem()), f, Choice::Auto));
    }
    let mut bwd: Vec<(String, BwdConfigs)> = Vec::new();
    for c in sm90(Family::BwdDh) {
        let label = format!("bwd dh {}", c.suffix(Family::BwdDh));
        bwd.push((label, BwdConfigs { dh: Choice::Fixed(c), ..BwdConfigs::all(Choice::Auto) }));
    }
    bwd.push(("bwd tuned".into(), BwdConfigs::all(Choice::Auto)));

    // The forward with entropy once (tuned), for the backward's saved lse and entropy.
    let fo = FwdOptions { check_labels: LabelCheck::Off, ..Default::default() };
    head.forward(stream, &x, &fo, FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) })?;
    let (lse_s, ent_s) = (lse.clone(), ent.clone());
    let bx = BwdInputs {
        kept: None,
        h: &h,
        w: &w,
        labels: &labels,
        lse: &lse_s,
        entropy: Some(&ent_s),
        grad_logprob: Some(&gl),
        grad_entropy: Some(&ge),
        problem,
    };

    // Variant 0: one GEMM; then the forwards, the backwards; last, four GEMMs back to back.
    let n = 2 + fwd.len() + bwd.len();
    let mut ts: Vec<Vec<f64>> = vec![Vec::new(); n];
    // Each round runs the variants in an order of its own (`RoundOrders`), so that no
    // variant always follows the same one: a variant's time depends on the one before it
    // (a slow kernel leaves the board cooler, and the next one clocks higher), by up to 5% here.
    let mut orders = crate::RoundOrders::new(n, n - 1);
    let all = vec![true; n];
    for round in 0..reps + 2 {
        for i in orders.next(&all) {
            let ms = if i == 0 {
                sample(stream, &mut || gemm.run(&h, &w))?
            } else if i == n - 1 {
                sample(stream, &mut || (0..4).try_for_each(|_| gemm.run(&h, &w)))?
            } else if let Some(&(_, f, c)) = fwd.get(i - 1) {
                sample(stream, &mut || forward(head, stream, &x, (f, c), &mut lp, &mut lse, &mut ent).map(|_| ()))?
            } else {
                let bo = BwdOptions { config: bwd[i - 1 - fwd.len()].1, ..Default::default() };
                sample(stream, &mut || head.backward(stream, &bx, &bo, GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw))).map(|_| ()))?
            };
            if round >= 2 {
                ts[i].push(ms);
            }
        }
    }
    let med: Vec<f64> = ts.iter_mut().map(|x| median(x)).collect();
    let g = med[0];
    println!("# config-probe t={t} v={v} d={d} rounds={reps} (order balanced over rounds): cuBLAS {g:.3} ms");
    // The tuned forwards' labels name the config and plan they ran.
    let mut fwd_labels = Vec::new();
    for (label, f, c) in &fwd {
        let r = forward(head, stream, &x, (*f, *c), &mut lp, &mut lse, &mut ent)?;
        fwd_labels.push(match (c, r.kernel) {
            (Choice::Auto, Some(k)) => format!("{label}: {} splits {} fill {}", crate::measure::config_of(&k, *f), r.n_splits, r.fill),
            _ => format!("{label}: splits {} fill {}", r.n_splits, r.fill),
        });
    }
    let labels = fwd_labels.into_iter().chain(bwd.iter().map(|b| b.0.clone())).chain(["cuBLAS x4 back to back".into()]);
    for (label, ms) in labels.zip(&med[1..]) {
        println!("{label:<88} {ms:9.3} ms {:7.3}x", ms / g);
    }
    if args.check {
        let mut worst = 0.0f64;
        for (label, f, c) in &fwd {
            forward(head, stream, &x, (*f, *c), &mut lp, &mut lse, &mut ent)?;
            let got = lmhead::testing::download_f32(stream, &lp)?;
            worst = worst.max(crate::check_sampled_logprobs(label, (&hs, &ws, &label_host), (t, v, d), &[&got])?);
        }
        println!("# every forward variant checked against the f64 reference (rows 0, t/3, t - 1): max |Δ log-prob| {worst:.1e}");
    }
    Ok(())
}

/// One forward of `family` (log-prob, or with entropy) at `config`, the labels unchecked.
fn forward(
    head: &LmHead,
    stream: &Arc<CudaStream>,
    x: &FwdInputs<'_, i64>,
    (family, config): (Family, Choice),
    lp: &mut CudaSlice<f32>,
    lse: &mut CudaSlice<f32>,
    ent: &mut CudaSlice<f32>,
) -> lmhead::Result<lmhead::FwdReport> {
    let o = FwdOptions { config, check_labels: LabelCheck::Off, ..Default::default() };
    let entropy = (family == Family::FwdEnt).then_some(ent as _);
    head.forward(stream, x, &o, FwdOutputs { kept: None, logprob: lp, lse, entropy })
}
