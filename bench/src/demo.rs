//! `lmhead-demo`, the main job: one fused LM-head forward (log-prob, entropy) and backward, with
//! a result check. On a machine with an H100/H200 it runs the GPU kernels at t=4096, v=32000,
//! d=2048 and checks sampled rows against the f64 reference; without a GPU it runs the CPU
//! backend at t=64, v=4096, d=256 and checks it against the vocab-sharded merge (an independent
//! path through the same math) and the basic invariants.

use std::time::Instant;

use lmhead::cudarc::driver::CudaSlice;
use lmhead::{bf16, cpu, BwdInputs, BwdOptions, FwdInputs, FwdOptions, FwdOutputs, GradOut, LmHead, Problem};
use lmhead_reference::{forward_rows, merge_shards, shard_partials, Case, Structure};

fn gpu_demo(head: &LmHead) -> Result<(), String> {
    let (t, v, d) = (4096, 32_000, 2048);
    let stream = head.gpu().context().default_stream();
    println!("GPU: {:?}", head.gpu().info());
    println!("{}", head.kernel_report());
    let case = Case::generate(42, t, v, d, &Structure::default());
    let p = Problem::new(t, v, d);
    let e = |x: lmhead::Error| x.to_string();
    let h = lmhead::testing::upload_bf16(&stream, &case.h).map_err(e)?;
    let w = lmhead::testing::upload_bf16(&stream, &case.w).map_err(e)?;
    let labels = lmhead::testing::upload(&stream, &case.labels).map_err(e)?;
    let mut lp: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    let mut ent: CudaSlice<f32> = stream.alloc_zeros(t).unwrap();
    for b in [&mut lp, &mut lse, &mut ent] {
        lmhead::testing::poison(&stream, b).map_err(e)?;
    }
    let t0 = Instant::now();
    let x = FwdInputs { h: &h, w: &w, labels: &labels, problem: p };
    let rep = head
        .forward(&stream, &x, &FwdOptions::default(), FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) })
        .map_err(e)?;
    stream.synchronize().unwrap();
    println!(
        "forward t={t} v={v} d={d}: {:.1} ms wall (first call: kernel loading and any tuning included), kernel {}",
        t0.elapsed().as_secs_f64() * 1e3,
        rep.kernel.as_deref().unwrap_or("naive")
    );
    let gl = lmhead::testing::upload(&stream, &vec![1.0f32; t]).map_err(e)?;
    let mut dh: CudaSlice<bf16> = stream.alloc_zeros(t * d).unwrap();
    let mut dw: CudaSlice<bf16> = stream.alloc_zeros(v * d).unwrap();
    let bx = BwdInputs {
        kept: None,
        h: &h,
        w: &w,
        labels: &labels,
        lse: &lse,
        entropy: Some(&ent),
        grad_logprob: Some(&gl),
        grad_entropy: None,
        problem: p,
    };
    let t1 = Instant::now();
    let brep = head.backward(&stream, &bx, &BwdOptions::default(), GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw))).map_err(e)?;
    stream.synchronize().unwrap();
    println!(
        "backward: {:.1} ms wall, {} chunk(s) of {} columns, workspace {} MiB",
        t1.elapsed().as_secs_f64() * 1e3,
        brep.chunks,
        brep.chunk,
        brep.workspace_bytes >> 20
    );
    let glp = lmhead::testing::download_f32(&stream, &lp).map_err(e)?;
    let gent = lmhead::testing::download_f32(&stream, &ent).map_err(e)?;
    let rows = [0, 1, t / 2, t - 1];
    let r = forward_rows(&case.inputs(), &rows);
    let mut worst: f64 = 0.0;
    for (&i, r) in rows.iter().zip(&r) {
        worst = worst.max((glp[i] - r.logprob).abs()).max((gent[i] - r.entropy).abs());
    }
    let dhv = lmhead::testing::download_bf16(&stream, &dh).map_err(e)?;
    if dhv.iter().any(|x| !x.is_finite()) {
        return Err("dh has non-finite values".into());
    }
    println!("check vs f64 reference on rows {rows:?}: max |Δ| = {worst:.2e} (log-prob, entropy)");
    if worst > 1e-3 {
        return Err(format!("GPU result disagrees with the reference: {worst}"));
    }
    println!("OK");
    Ok(())
}

fn cpu_demo() -> Result<(), String> {
    let (t, v, d) = (64, 4096, 256);
    println!("no GPU: running the CPU backend (f64 reference) at t={t} v={v} d={d}");
    let case = Case::generate(42, t, v, d, &Structure::default());
    let p = Problem::new(t, v, d);
    let h: Vec<bf16> = case.h.iter().map(|&b| bf16::from_bits(b)).collect();
    let w: Vec<bf16> = case.w.iter().map(|&b| bf16::from_bits(b)).collect();
    let t0 = Instant::now();
    let f = cpu::forward(&cpu::CpuInputs { h: &h, w: &w, labels: &case.labels, problem: p }, &FwdOptions::default(), true)
        .map_err(|e| e.to_string())?;
    let gl = vec![1.0f32; t];
    let (dh, dw) = cpu::backward(
        &cpu::CpuInputs { h: &h, w: &w, labels: &case.labels, problem: p },
        &cpu::CpuGrads { lse: &f.lse, entropy: f.entropy.as_deref(), grad_logprob: Some(&gl), grad_entropy: None, kept: None },
        &BwdOptions::default(),
    )
    .map_err(|e| e.to_string())?;
    println!("forward + backward: {:.1} ms", t0.elapsed().as_secs_f64() * 1e3);
    // Independent path: four vocab shards, merged.
    let shards: Vec<_> = (0..4).map(|k| shard_partials(&case.shard(k * v / 4, (k + 1) * v / 4))).collect();
    let m = merge_shards(&shards, &case.labels, v as i64, case.ignore_index);
    let ent = f.entropy.as_ref().unwrap();
    let mut worst: f64 = 0.0;
    for i in 0..t {
        worst = worst.max((f.logprob[i] as f64 - m.logprob[i]).abs()).max((ent[i] as f64 - m.entropy[i]).abs());
        if f.logprob[i] > 0.0 || ent[i] < 0.0 || ent[i] as f64 > (v as f64).ln() + 1e-5 {
            return Err(format!("row {i}: log-prob {} / entropy {} out of range", f.logprob[i], ent[i]));
        }
    }
    if dh.iter().chain(&dw).any(|x| !x.is_finite()) {
        return Err("non-finite gradient".into());
    }
    println!("check vs the 4-shard merge: max |Δ| = {worst:.2e}; log-probs ≤ 0, 0 ≤ entropy ≤ ln v");
    if worst > 1e-5 {
        return Err(format!("the CPU paths disagree: {worst}"));
    }
    println!("OK");
    Ok(())
}

fn main() {
    let r = if lmhead::driver_present() {
        match LmHead::new(0) {
            Ok(head) => gpu_demo(&head),
            Err(e) => {
                println!("GPU unavailable ({e}); falling back to the CPU backend");
                cpu_demo()
            }
        }
    } else {
        cpu_demo()
    };
    if let Err(e) = r {
        eprintln!("lmhead-demo: FAILED: {e}");
        std::process::exit(1);
    }
}
