//! CUDA-graph capture of a forward and a backward (skipped without a CUDA driver).
//!
//! One eager call on the inputs' buffers (it tunes and loads the kernels), then a forward and a
//! backward captured on that stream in global capture mode, then replays: each round copies
//! fresh random inputs (seed printed; `LMHEAD_SEED` replays) into the captured buffers, poisons
//! the outputs, replays the graph and checks every output against the f64 reference, and
//! bitwise against an eager call on the same inputs with the same configs. One round plants a
//! bad label: under capture the label check is deferred, so that row comes out NaN and
//! `take_label_status` reports it after the replay. Each case runs with the library's own
//! workspace and with a caller's `ScratchAlloc`, on the tuned configs and on forced `Sm90`
//! configs with TMA stores (every launch then reads its tensor maps through the capture arena).
//!
//! Thresholds (per output, as `gpu_fwd.rs` and `gpu_bwd.rs` derive them): log-prob and lse
//! `1e-4 + mag·2⁻²²·(d/16 + 4)` with `mag = max(|lse|, |z_label|)`; entropy
//! `1e-4·max(1, H) + |lse|·2⁻²²·(d/16 + 4)·(1 + spread)`; bf16 `dh` and `dW` within
//! `6e-3 · max(‖ref‖, ‖rss‖)` in L2; ignored rows exactly 0.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use lmhead::cudarc::driver::{sys, CudaGraph, CudaSlice, CudaStream, DevicePtr};
use lmhead::testing::{download_bf16, download_f32, poison};
use lmhead::{
    bf16, BwdConfigs, BwdInputs, BwdOptions, Choice, Family, FwdInputs, FwdOptions, FwdOutputs, GradOut, LabelCheck, LmHead, Problem,
    ScratchAlloc,
};
use lmhead_reference::rng::Rng;
use lmhead_reference::{backward_dh_rows_rss, backward_dw_rows_rss, forward_rows, Case, Grads, Structure, IGNORE_INDEX};
use lmhead_tests::{case_seed, check, check_rel_l2_terms, fixed_or_auto, gpu_or_skip, run_seed};

const BF16_REL_L2: f64 = 6e-3;

/// A caller's allocator: cudarc allocations on the stream the library names (under capture, the
/// graph records them), held until `free`.
#[derive(Default)]
struct StreamAlloc {
    held: Mutex<HashMap<u64, CudaSlice<u8>>>,
}

impl ScratchAlloc for StreamAlloc {
    fn alloc(&self, bytes: usize, stream: &Arc<CudaStream>) -> lmhead::Result<u64> {
        let b = stream.alloc_zeros::<u8>(bytes).map_err(|_| lmhead::Error::OutOfMemory { what: "test scratch", bytes })?;
        let ptr = b.device_ptr(stream).0;
        self.held.lock().unwrap().insert(ptr, b);
        Ok(ptr)
    }

    fn free(&self, ptr: u64) {
        self.held.lock().unwrap().remove(&ptr);
    }
}

/// The buffers the graph captures: inputs, upstream gradients and outputs.
struct Bufs {
    h: CudaSlice<bf16>,
    w: CudaSlice<bf16>,
    labels: CudaSlice<i64>,
    gl: CudaSlice<f32>,
    ge: CudaSlice<f32>,
    lp: CudaSlice<f32>,
    lse: CudaSlice<f32>,
    ent: CudaSlice<f32>,
    dh: CudaSlice<bf16>,
    dw: CudaSlice<bf16>,
}

/// One round's inputs: a generated case and its upstream gradients.
struct Round {
    case: Case,
    gl: Vec<f32>,
    ge: Vec<f32>,
}

fn round(seed: u64, t: usize, v: usize, d: usize) -> Round {
    let s = Structure { all_negative: 0.0, huge: 0.0, ..Structure::default() };
    let case = Case::generate(seed, t, v, d, &s);
    let mut rng = Rng::new(seed ^ 0xD1CE);
    let gl = (0..t).map(|_| rng.normal() as f32).collect();
    let ge = (0..t).map(|_| rng.normal() as f32).collect();
    Round { case, gl, ge }
}

impl Bufs {
    fn new(stream: &Arc<CudaStream>, t: usize, v: usize, d: usize) -> Self {
        Self {
            h: stream.alloc_zeros(t * d).unwrap(),
            w: stream.alloc_zeros(v * d).unwrap(),
            labels: stream.alloc_zeros(t).unwrap(),
            gl: stream.alloc_zeros(t).unwrap(),
            ge: stream.alloc_zeros(t).unwrap(),
            lp: stream.alloc_zeros(t).unwrap(),
            lse: stream.alloc_zeros(t).unwrap(),
            ent: stream.alloc_zeros(t).unwrap(),
            dh: stream.alloc_zeros(t * d).unwrap(),
            dw: stream.alloc_zeros(v * d).unwrap(),
        }
    }

    /// Copy `r` into the input buffers (in place: the graph keeps their addresses) and poison the
    /// outputs.
    fn load(&mut self, stream: &Arc<CudaStream>, r: &Round) {
        let hb: Vec<bf16> = r.case.h.iter().map(|&b| bf16::from_bits(b)).collect();
        let wb: Vec<bf16> = r.case.w.iter().map(|&b| bf16::from_bits(b)).collect();
        stream.memcpy_htod(&hb, &mut self.h).unwrap();
        stream.memcpy_htod(&wb, &mut self.w).unwrap();
        stream.memcpy_htod(&r.case.labels, &mut self.labels).unwrap();
        stream.memcpy_htod(&r.gl, &mut self.gl).unwrap();
        stream.memcpy_htod(&r.ge, &mut self.ge).unwrap();
        self.poison(stream);
    }

    fn poison(&mut self, stream: &Arc<CudaStream>) {
        poison(stream, &mut self.lp).unwrap();
        poison(stream, &mut self.lse).unwrap();
        poison(stream, &mut self.ent).unwrap();
        poison(stream, &mut self.dh).unwrap();
        poison(stream, &mut self.dw).unwrap();
    }

    /// The step the graph captures: forward with entropy, backward of both upstream gradients.
    fn step(&mut self, head: &LmHead, stream: &Arc<CudaStream>, fo: &FwdOptions, bo: &BwdOptions, p: Problem) -> lmhead::Result<()> {
        head.forward(
            stream,
            &FwdInputs { h: &self.h, w: &self.w, labels: &self.labels, problem: p },
            fo,
            FwdOutputs { kept: None, logprob: &mut self.lp, lse: &mut self.lse, entropy: Some(&mut self.ent) },
        )?;
        let x = BwdInputs {
            kept: None,
            h: &self.h,
            w: &self.w,
            labels: &self.labels,
            lse: &self.lse,
            entropy: Some(&self.ent),
            grad_logprob: Some(&self.gl),
            grad_entropy: Some(&self.ge),
            problem: p,
        };
        head.backward(stream, &x, bo, GradOut::Bf16(&mut self.dh), Some(GradOut::Bf16(&mut self.dw)))?;
        Ok(())
    }

    /// Every output, downloaded as f64 (bits of NaN included: compared with `to_bits`).
    fn outputs(&self, stream: &Arc<CudaStream>) -> [Vec<f64>; 5] {
        [
            download_f32(stream, &self.lp).unwrap(),
            download_f32(stream, &self.lse).unwrap(),
            download_f32(stream, &self.ent).unwrap(),
            download_bf16(stream, &self.dh).unwrap(),
            download_bf16(stream, &self.dw).unwrap(),
        ]
    }
}

fn acc_tol(mag: f64, d: usize) -> f64 {
    mag * 2f64.powi(-22) * (d as f64 / 16.0 + 4.0)
}

/// The outputs of a round against the f64 reference (forward always; the backward unless a bad
/// label made its rows NaN).
fn check_reference(out: &[Vec<f64>; 5], r: &Round, desc: &str, backward: bool) {
    let c = &r.case;
    let (t, d) = (c.t, c.d);
    let inp = c.inputs();
    let good: Vec<usize> = (0..t).filter(|&i| c.labels[i] == IGNORE_INDEX || (0..c.v as i64).contains(&c.labels[i])).collect();
    let rows = forward_rows(&inp, &good);
    let rlp: Vec<f64> = rows.iter().map(|x| x.logprob).collect();
    let rlse: Vec<f64> = rows.iter().map(|x| x.lse).collect();
    let rent: Vec<f64> = rows.iter().map(|x| x.entropy).collect();
    let pick = |g: &[f64]| good.iter().map(|&i| g[i]).collect::<Vec<f64>>();
    let mag = |k: usize| rlse[k].abs().max((rlse[k] + rlp[k]).abs());
    check("logprob", desc, &pick(&out[0]), &rlp, &|k, _| 1e-4 + acc_tol(mag(k), d));
    check("lse", desc, &pick(&out[1]), &rlse, &|k, _| 1e-4 + acc_tol(mag(k), d));
    check("entropy", desc, &pick(&out[2]), &rent, &|k, r| 1e-4 * r.abs().max(1.0) + acc_tol(rlse[k].abs(), d) * (1.0 + rows[k].spread));
    for i in 0..t {
        if c.labels[i] == IGNORE_INDEX {
            assert!(out[0][i] == 0.0 && out[2][i] == 0.0, "ignored row {i} [{desc}]");
        } else if !good.contains(&i) {
            assert!(out[0][i].is_nan() && out[2][i].is_nan(), "bad-label row {i} must be NaN [{desc}]");
        }
    }
    if !backward {
        return;
    }
    let lse64: Vec<f64> = rlse.clone();
    let ent64: Vec<f64> = rent.clone();
    let gl: Vec<f64> = r.gl.iter().map(|&x| x as f64).collect();
    let ge: Vec<f64> = r.ge.iter().map(|&x| x as f64).collect();
    let g = Grads { logprob: Some(&gl), entropy: Some(&ge) };
    let all: Vec<usize> = (0..t).collect();
    let vall: Vec<usize> = (0..c.v).collect();
    let (rdh, sdh) = backward_dh_rows_rss(&inp, &lse64, &ent64, &g, &all);
    let (rdw, sdw) = backward_dw_rows_rss(&inp, &lse64, &ent64, &g, &vall);
    check_rel_l2_terms("dh", desc, &out[3], &rdh.concat(), &sdh.concat(), BF16_REL_L2);
    check_rel_l2_terms("dW", desc, &out[4], &rdw.concat(), &sdw.concat(), BF16_REL_L2);
    for i in 0..t {
        if c.labels[i] == IGNORE_INDEX {
            assert!(out[3][i * d..(i + 1) * d].iter().all(|&x| x == 0.0), "ignored row {i} of dh [{desc}]");
        }
    }
}

fn same_bits(a: &[Vec<f64>; 5], b: &[Vec<f64>; 5], desc: &str) {
    for (k, name) in ["logprob", "lse", "entropy", "dh", "dW"].iter().enumerate() {
        let bad = a[k].iter().zip(&b[k]).position(|(x, y)| x.to_bits() != y.to_bits());
        assert!(bad.is_none(), "{name} of the replay differs from the eager call at [{}] [{desc}]", bad.unwrap());
    }
}

/// The first `Sm90` candidates with TMA stores where a family has them (d-logits, `dh`), else the
/// first `Sm90` one (`dW`, the forward).
fn tma_configs() -> (Choice, BwdConfigs) {
    let first = |f: Family, store: bool| {
        // (`Choice::Auto` under the portable module: `fixed_or_auto`.)
        fixed_or_auto(*f.candidates().iter().find(|c| c.is_sm90() && (!store || c.mainloop.tma_store())).expect("an sm90 candidate"))
    };
    (
        first(Family::FwdEnt, false),
        BwdConfigs { dlogits: first(Family::BwdDlogitsEnt, true), dh: first(Family::BwdDh, true), dw: first(Family::BwdDw, false) },
    )
}

#[test]
fn forward_and_backward_replay_from_a_graph() {
    let test = "gpu_capture::forward_and_backward_replay_from_a_graph";
    let Some((head, _)) = gpu_or_skip(test) else { return };
    let seed = run_seed(test);
    // A capturable stream (the legacy default stream cannot capture).
    let stream = head.gpu().context().new_stream().unwrap();
    // cudarc's event tracking makes every use of a `CudaSlice` wait on the event of its last
    // write; under capture that wait is on an event recorded before the capture, which CUDA
    // refuses (CUDA_ERROR_STREAM_CAPTURE_ISOLATION). A caller that captures turns it off (or
    // passes `Borrowed` buffers, as the PyTorch package does), as here before any test buffer.
    // SAFETY: every buffer below is written and read on `stream` only (the test allocator's on
    // the stream the library names, which the library orders by its own events), so nothing
    // relies on cudarc's per-slice events.
    unsafe { head.gpu().context().disable_event_tracking() };
    // Three vocab chunks (the backward's side stream joins the capture), t and v off the tiles.
    let (t, v, d) = (300, 2900, 256);
    let p = Problem::new(t, v, d);
    let (tma_fwd, tma_bwd) = tma_configs();
    let variants = [("tuned", Choice::Auto, BwdConfigs::all(Choice::Auto)), ("sm90-tma-store", tma_fwd, tma_bwd)];
    let mut case_i = 0;
    for scratch in [false, true] {
        head.set_scratch(scratch.then(|| Arc::new(StreamAlloc::default()) as Arc<dyn ScratchAlloc>));
        for (name, fwd_cfg, bwd_cfg) in variants {
            let fo = FwdOptions { config: fwd_cfg, ..Default::default() };
            let bo = BwdOptions { chunk: Some(1024), config: bwd_cfg, ..Default::default() };
            let mut bufs = Bufs::new(&stream, t, v, d);
            let mut eager = Bufs::new(&stream, t, v, d);
            bufs.load(&stream, &round(case_seed(seed, case_i), t, v, d));
            case_i += 1;
            bufs.step(&head, &stream, &fo, &bo, p).unwrap();
            stream.synchronize().unwrap();
            stream.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL).unwrap();
            let captured = bufs.step(&head, &stream, &fo, &bo, p);
            let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            captured.unwrap_or_else(|e| panic!("captured step failed [{name}, scratch {scratch}]: {e}"));
            let graph = graph.unwrap().expect("a graph");
            for k in 0..3 {
                let s = case_seed(seed, case_i);
                case_i += 1;
                let mut r = round(s, t, v, d);
                let bad = k == 1;
                if bad {
                    r.case.labels[7] = v as i64;
                }
                let desc = format!("{name} scratch={scratch} round {k} seed {s}");
                bufs.load(&stream, &r);
                // (A graph launch, not a kernel launch: `tidy` keeps `.launch(` to launch/mod.rs.)
                CudaGraph::launch(&graph).unwrap();
                stream.synchronize().unwrap();
                let got = bufs.outputs(&stream);
                let status = head.take_label_status(&stream);
                if bad {
                    assert!(matches!(status, Err(lmhead::Error::BadLabel { row: Some(7), label: None })), "{status:?} [{desc}]");
                } else {
                    assert!(status.is_ok(), "{status:?} [{desc}]");
                }
                check_reference(&got, &r, &desc, !bad);
                // The same step eagerly (deferred check: the bad round must not fail), bitwise.
                eager.load(&stream, &r);
                let efo = FwdOptions { check_labels: LabelCheck::Deferred, ..fo.clone() };
                eager.step(&head, &stream, &efo, &bo, p).unwrap();
                let want = eager.outputs(&stream);
                assert_eq!(head.take_label_status(&stream).is_err(), bad, "[{desc}]");
                same_bits(&got, &want, &desc);
                println!("[{test}] {desc}: replay matches the f64 reference and the eager call");
            }
        }
    }
    head.set_scratch(None);
}
