//! Reliability on the GPU (skipped without a CUDA driver): every bad input answered by a typed
//! error with the caller's buffers untouched, NaN propagation confined to the affected rows,
//! out-of-memory as an error, 64-bit indexing past 2³¹ elements, and the `sanitizer_*` tests that
//! `compute-sanitizer` runs over every kernel at tail shapes (docs/run-gpu.sh, step `sanitize`).
//!
//! Files by concern: `bad_inputs` (typed errors with untouched buffers, foreign contexts, bad
//! calls refused before tuning on a cold cache), `limits` (NaN confinement, out-of-memory,
//! 64-bit indexing), `isolation` (the sanitizer pass over every kernel, tuning that never touches
//! the caller's buffers, the stream-capture check that keeps trials off a captured stream); here,
//! the setup they share.

mod bad_inputs;
mod isolation;
mod limits;

use std::sync::Arc;

use lmhead::cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use lmhead::testing::{download_f32, poison, upload, upload_bf16};
use lmhead::tp::{LocalComm, Shard};
use lmhead::{
    bf16, BwdConfigs, BwdInputs, BwdOptions, Choice, Compaction, Error, Family, FwdInputs, FwdOptions, FwdOutputs, GradOut, LmHead, Problem,
};
use lmhead_reference::rng::Rng;
use lmhead_reference::{backward_dw_rows, forward_rows, Case, Grads, Inputs, Structure};
use lmhead_tests::{check_rel_l2, gpu_or_skip, held, run_seed};

struct Setup {
    case: Case,
    h: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    labels: CudaSlice<i64>,
}

fn setup(stream: &Arc<CudaStream>, t: usize, v: usize, d: usize, seed: u64) -> Setup {
    let case = Case::generate(seed, t, v, d, &Structure { huge: 0.0, all_negative: 0.0, ..Default::default() });
    let h = upload_bf16(stream, &case.h).unwrap();
    let w = upload_bf16(stream, &case.w).unwrap();
    let labels = upload(stream, &case.labels).unwrap();
    Setup { case, h, w, labels }
}

/// Run the forward with poisoned outputs; return the result and the output bytes.
fn fwd_raw(
    head: &LmHead,
    stream: &Arc<CudaStream>,
    x: &FwdInputs<'_, i64>,
    opts: &FwdOptions,
    t_out: usize,
) -> (lmhead::Result<lmhead::FwdReport>, Vec<f64>, Vec<f64>) {
    let mut lp: CudaSlice<f32> = stream.alloc_zeros(t_out).unwrap();
    let mut lse: CudaSlice<f32> = stream.alloc_zeros(t_out).unwrap();
    let mut ent: CudaSlice<f32> = stream.alloc_zeros(t_out).unwrap();
    for b in [&mut lp, &mut lse, &mut ent] {
        poison(stream, b).unwrap();
    }
    let r = head.forward(stream, x, opts, FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: Some(&mut ent) });
    (r, download_f32(stream, &lp).unwrap(), download_f32(stream, &ent).unwrap())
}

fn untouched(x: &[f64]) -> bool {
    x.iter().all(|v| v.is_nan())
}
