//! `lmhead-bench dh-probe --filter T,K,D`: the backward's `dh` GEMM alone at one chunk shape
//! (`dh[T][D] (+)= staging[T][K] · W[K][D]`), each sm90 candidate with its epilogue varied — no
//! write (the mainloop alone), the first chunk's store, a middle chunk's add into the f32
//! accumulator, the last chunk's add with the bf16 output — beside a cuBLAS GEMM of the same
//! size. What a chunk's epilogue costs, separated from its mainloop. A `tma_store` config runs
//! only the modes it serves (the first and middle chunks; the others run on its register twin).

use std::sync::Arc;

use lmhead::cudarc::driver::CudaStream;
use lmhead::launch::{bwd_gemm, dev_in, dev_out, GemmC, GemmIn, GemmOut};
use lmhead::tune::bench::median;
use lmhead::{bf16, Family, LmHead};

use crate::{random_bf16, sample, Args};

pub fn run(head: &LmHead, stream: &Arc<CudaStream>, args: &Args) -> lmhead::Result<()> {
    let dims: Vec<usize> = args.filter.as_deref().unwrap_or("16384,8192,4096").split(',').filter_map(|x| x.trim().parse().ok()).collect();
    let [t, k, d] = dims[..] else { return Err(lmhead::Error::Invalid("dh-probe: --filter T,K,D".into())) };
    let reps = args.reps.max(5);
    let a = lmhead::testing::upload_bf16(stream, &random_bf16(t * k, 0.02, 1))?;
    let b = lmhead::testing::upload_bf16(stream, &random_bf16(k * d, 0.02, 2))?;
    let mut acc = lmhead::testing::zeros::<f32>(stream, t * d, "dh-probe acc")?;
    let mut out = lmhead::testing::zeros::<bf16>(stream, t * d, "dh-probe out")?;
    let (ad, bd) = (dev_in(&a, stream, "a")?, dev_in(&b, stream, "b")?);
    let (accd, outd) = (dev_out(&mut acc, stream, "acc")?, dev_out(&mut out, stream, "out")?);
    let g = GemmIn { m: t, n: d, k, a: &ad, a_stride: k, b: &bd, b_stride: d };
    let time = |f: &mut dyn FnMut() -> lmhead::Result<()>| -> lmhead::Result<f64> {
        for _ in 0..2 {
            f()?;
        }
        let mut ts = (0..reps).map(|_| sample(stream, f)).collect::<lmhead::Result<Vec<f64>>>()?;
        Ok(median(&mut ts))
    };
    let mut gemm = crate::cublas::Gemm::new(stream.clone(), t, d, k)?;
    let a_kd = lmhead::testing::upload_bf16(stream, &random_bf16(d * k, 0.02, 3))?;
    let cublas = time(&mut || gemm.run(&a, &a_kd))?;
    println!("# dh-probe t={t} k={k} d={d} reps={reps}: cuBLAS {cublas:.3} ms");
    let modes = [
        ("none", GemmOut { accumulate: false, write_acc: false, out_f32: true }, false),
        ("first", GemmOut { accumulate: false, write_acc: true, out_f32: true }, false),
        ("mid", GemmOut { accumulate: true, write_acc: true, out_f32: true }, false),
        ("last-bf16", GemmOut { accumulate: true, write_acc: false, out_f32: false }, true),
    ];
    for &cfg in Family::BwdDh.candidates().iter().filter(|c| c.is_sm90()) {
        let name = lmhead::Family::BwdDh.stem().to_string() + "_" + &cfg.suffix(Family::BwdDh);
        for (mode_name, mode, with_out) in modes.into_iter().filter(|m| !cfg.mainloop.tma_store() || (m.1.write_acc && !m.2)) {
            let c = GemmC { acc: Some(&accd), out: with_out.then_some(&outd), mode };
            let ms = time(&mut || bwd_gemm(head.gpu(), stream, Family::BwdDh, cfg, &g, &c))?;
            println!("{name:<52} {mode_name:<9} {ms:8.3} ms {:6.3}x", ms / cublas);
        }
    }
    Ok(())
}
