//! `lmhead_torch._native`: the Rust side of the PyTorch package.
//!
//! Every entry point takes plain integers — a device ordinal, a raw `CUstream`, device or host
//! addresses, sizes and flags — and calls the `lmhead` library on that memory in place
//! ([`lmhead::Borrowed`], [`lmhead::borrowed_stream`]); nothing here knows about tensors. The
//! Python package (`lmhead_torch/_core.py`) checks dtypes, shapes, contiguity and alignment,
//! allocates the outputs, drives autograd, and guarantees the contract every `unsafe` block
//! below relies on: each address names a live allocation of at least the stated number of
//! elements, on the stated device (or the host for the `cpu_*` entries), that stays alive and
//! is not written by anyone else until the call returns (GPU: until the work queued on the
//! stream is done, which PyTorch's stream semantics guarantee for tensors it keeps alive).
//!
//! The GIL is released while the library runs; the two callbacks that need Python
//! (tensor-parallel all-reduce through `torch.distributed`, workspace allocation through
//! PyTorch's caching allocator) take it back for their duration. A Python exception raised in a
//! callback is kept and re-raised as the call's exception.
//!
//! The entries that take many numbers take them grouped in tuples, one per argument struct
//! below (the call's target, its buffers, its scalars), as `_core.py` builds them.

mod comm;
mod errors;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use half::bf16;
use lmhead::cpu::{CpuGrads, CpuInputs};
use lmhead::cudarc::driver::CudaStream;
use lmhead::tp::{Communicator, ReduceDh, Shard};
use lmhead::{Borrowed, BwdInputs, BwdOptions, FwdInputs, FwdOptions, FwdOutputs, GradOut, LabelCheck, LabelType, LmHead, Problem};
use pyo3::prelude::*;

use crate::comm::{HostPyComm, NoComm, PyComm, PyScratch, SingleHost};
use crate::errors::{into_pyerr, take_pending};

/// One `LmHead` per device ordinal, created on first use and kept for the process (its tuner
/// cache and kernels are per device).
static HEADS: Mutex<Option<HashMap<usize, Arc<LmHead>>>> = Mutex::new(None);

fn head(py: Python<'_>, ordinal: usize) -> PyResult<Arc<LmHead>> {
    if let Some(h) = HEADS.lock().unwrap().as_ref().and_then(|m| m.get(&ordinal)) {
        return Ok(h.clone());
    }
    // Opening the device loads the driver and reads the tuning cache: without the GIL.
    let h = py.detach(|| LmHead::new(ordinal)).map_err(|e| into_pyerr(py, e))?;
    let h = Arc::new(h);
    let mut g = HEADS.lock().unwrap();
    let m = g.get_or_insert_with(HashMap::new);
    Ok(m.entry(ordinal).or_insert(h).clone())
}

/// Bytes one kept row takes over a local vocabulary of `v` (`lmhead::keep::row_bytes`: the
/// Python side sizes the kept buffer from the library's own format).
#[pyfunction]
fn keep_row_bytes(v: usize) -> usize {
    lmhead::keep::row_bytes(v)
}

/// Whether a CUDA driver library can be loaded (no device is touched).
#[pyfunction]
fn driver_present() -> bool {
    lmhead::driver_present()
}

/// Whether the library runs on device `ordinal`: `(True, "")`, or `(False, reason)` when it has
/// no driver or does not support the device (the library's own answer: it opens the device).
#[pyfunction]
fn device_supported(py: Python<'_>, ordinal: usize) -> PyResult<(bool, String)> {
    if !lmhead::driver_present() {
        return Ok((false, lmhead::Error::NoDriver.to_string()));
    }
    match head(py, ordinal) {
        Ok(_) => Ok((true, String::new())),
        Err(e) if e.is_instance_of::<errors::UnavailableError>(py) => Ok((false, e.value(py).to_string())),
        Err(e) => Err(e),
    }
}

/// Open device `ordinal` (idempotent) and describe it and its kernels: a dict with `name`,
/// `cc` (major, minor), `sm_count`, `driver_version`, `l2_bytes`, `module` (the kernel module
/// loaded: `"hopper"` on compute capability 9.0, `"portable"` on any other from 8.0). Raises the `UnavailableError` of a missing driver or unsupported GPU.
#[pyfunction]
fn device_info(py: Python<'_>, ordinal: usize) -> PyResult<Py<PyAny>> {
    let h = head(py, ordinal)?;
    let info = h.device_info().clone();
    let d = pyo3::types::PyDict::new(py);
    d.set_item("name", info.name)?;
    d.set_item("cc", info.cc)?;
    d.set_item("sm_count", info.sm_count)?;
    d.set_item("driver_version", info.driver_version)?;
    d.set_item("l2_bytes", info.l2_bytes)?;
    d.set_item("module", info.module.name())?;
    Ok(d.into_any().unbind())
}

/// Where the kernels come from and how many of each family load (loads them all).
#[pyfunction]
fn kernel_report(py: Python<'_>, ordinal: usize) -> PyResult<String> {
    let h = head(py, ordinal)?;
    Ok(py.detach(|| h.kernel_report().to_string()))
}

/// Take the device's workspace from `alloc(nbytes, stream) -> address` (a Python callable that
/// allocates through PyTorch), or with `None` from the library's own reused buffers.
#[pyfunction]
#[pyo3(signature = (ordinal, alloc))]
fn set_scratch(py: Python<'_>, ordinal: usize, alloc: Option<Py<PyAny>>) -> PyResult<()> {
    let h = head(py, ordinal)?;
    let scratch: Option<Arc<dyn lmhead::ScratchAlloc>> = alloc.map(|cb| Arc::new(PyScratch::new(cb)) as Arc<dyn lmhead::ScratchAlloc>);
    py.detach(|| h.set_scratch(scratch));
    Ok(())
}

/// Free the library-owned workspace of every opened device.
#[pyfunction]
fn release_workspace(py: Python<'_>) {
    let heads: Vec<Arc<LmHead>> = HEADS.lock().unwrap().as_ref().map(|m| m.values().cloned().collect()).unwrap_or_default();
    py.detach(|| heads.iter().for_each(|h| h.release_workspace()));
}

/// Bytes of library-owned workspace the device holds now (0 when PyTorch allocates it).
#[pyfunction]
fn workspace_bytes(py: Python<'_>, ordinal: usize) -> PyResult<usize> {
    Ok(head(py, ordinal)?.workspace_bytes())
}

/// Tune ahead of time for these token counts (see `LmHead::warm_up`).
#[pyfunction]
fn warm_up(py: Python<'_>, ordinal: usize, token_counts: Vec<usize>, v: usize, d: usize, entropy: bool, backward: bool) -> PyResult<()> {
    let h = head(py, ordinal)?;
    let r = py.detach(|| h.warm_up(&token_counts, v, d, entropy, backward));
    finish(py, r)
}

/// Turn a library result into a Python one: the library's error mapped to its exception class,
/// with the exception a callback raised (if any) as its `__cause__`.
fn finish<T>(py: Python<'_>, r: lmhead::Result<T>) -> PyResult<T> {
    let pending = take_pending();
    match r {
        Ok(v) => match pending {
            // A callback failed but the library carried on (it should not): report it.
            Some(e) => Err(e),
            None => Ok(v),
        },
        // The library's error, typed by its variant, caused by the callback's exception.
        Err(e) => {
            let err = into_pyerr(py, e);
            if let Some(p) = pending {
                err.set_cause(py, Some(p));
            }
            Err(err)
        }
    }
}

/// The tensor-parallel arguments of a call: `(rank, size, all_reduce callback)` or none.
type CommArg = Option<(usize, usize, Py<PyAny>)>;

/// Where a GPU call runs: `(device ordinal, raw CUstream)`.
#[derive(FromPyObject)]
struct Target(usize, u64);

/// The operands of a call: `(h, w, labels, labels are i64, t, v, d)`, device (or, for the CPU
/// backend, host) addresses.
#[derive(FromPyObject, Clone, Copy)]
struct Operands(u64, u64, u64, bool, usize, usize, usize);

/// The forward's buffers: the operands and `(logprob, lse, entropy)`; entropy 0 = not asked for.
#[derive(FromPyObject, Clone, Copy)]
struct FwdBufs(Operands, (u64, u64, u64));

/// The backward's buffers: the operands, the saved `(lse, entropy)` and upstream
/// `(grad_logprob, grad_entropy)`, and the outputs `(dh, dh is f32, dw, dw is f32)`; 0 = absent.
#[derive(FromPyObject, Clone, Copy)]
struct BwdBufs(Operands, (u64, u64, u64, u64), (u64, bool, u64, bool));

/// The scalars of a call: `(temperature, ignore_index, v_begin, v_total, label check)` with the
/// label check 0 `Sync`, 1 `Deferred`, 2 `Off` (forward on the GPU only).
#[derive(FromPyObject, Clone, Copy)]
struct Scalars(f32, i64, usize, usize, u8);

impl Scalars {
    fn shard(&self) -> Shard {
        Shard { v_begin: self.2, v_total: self.3 }
    }

    fn fwd_options(&self) -> PyResult<FwdOptions> {
        let check_labels = match self.4 {
            0 => LabelCheck::Sync,
            1 => LabelCheck::Deferred,
            2 => LabelCheck::Off,
            m => return Err(pyo3::exceptions::PyValueError::new_err(format!("label check mode {m} (0, 1 or 2)"))),
        };
        Ok(FwdOptions { temperature: self.0, ignore_index: self.1, check_labels, ..FwdOptions::default() })
    }

    fn bwd_options(&self) -> BwdOptions {
        BwdOptions { temperature: self.0, ignore_index: self.1, ..BwdOptions::default() }
    }
}

/// Forward arguments of the GPU entry points.
struct FwdArgs {
    b: FwdBufs,
    opts: FwdOptions,
    shard: Shard,
    /// The kept logits' buffer `(address, f32 elements)` (`FwdOptions::keep_logits` > 0).
    kept: Option<(u64, usize)>,
}

impl Operands {
    fn problem(&self) -> Problem {
        Problem::new(self.4, self.5, self.6)
    }
}

fn fwd_on<L: LabelType>(head: &LmHead, stream: &Arc<CudaStream>, a: &FwdArgs, comm: Option<&dyn Communicator>) -> lmhead::Result<()> {
    let FwdBufs(Operands(h, w, labels, ..), (logprob, lse, entropy)) = a.b;
    let p = a.b.0.problem();
    // SAFETY: the Python caller's contract (module docs): `h` holds t·d bf16, `w` v·d bf16,
    // `labels` t labels of type `L`, the outputs t f32 each, all device memory of this head's
    // device, alive and not raced until the work queued on `stream` is done.
    let (h, w, labels, mut lp, mut lse, mut ent) = unsafe {
        (
            Borrowed::<bf16>::new(h, p.t * p.d, stream),
            Borrowed::<bf16>::new(w, p.v * p.d, stream),
            Borrowed::<L>::new(labels, p.t, stream),
            Borrowed::<f32>::new(logprob, p.t, stream),
            Borrowed::<f32>::new(lse, p.t, stream),
            Borrowed::<f32>::new(entropy, if entropy == 0 { 0 } else { p.t }, stream),
        )
    };
    // SAFETY: as above: the kept buffer holds `len` f32 of this device (the Python caller's
    // contract), written only by this call.
    let mut kept = a.kept.map(|(ptr, len)| unsafe { Borrowed::<f32>::new(ptr, len, stream) });
    let x = FwdInputs { h: &h, w: &w, labels: &labels, problem: p };
    let out = FwdOutputs {
        kept: kept.as_mut().map(|k| k as &mut dyn lmhead::cudarc::driver::DevicePtrMut<f32>),
        logprob: &mut lp,
        lse: &mut lse,
        entropy: if entropy == 0 { None } else { Some(&mut ent) },
    };
    match comm {
        None if a.shard == Shard::whole(p.v) => head.forward(stream, &x, &a.opts, out).map(|_| ()),
        None => head.forward_tp(&NoComm, stream, &x, a.shard, &a.opts, out).map(|_| ()),
        Some(c) => head.forward_tp(c, stream, &x, a.shard, &a.opts, out).map(|_| ()),
    }
}

fn forward_dispatch(head: &LmHead, stream: &Arc<CudaStream>, a: &FwdArgs, comm: Option<&dyn Communicator>) -> lmhead::Result<()> {
    if a.b.0 .3 {
        fwd_on::<i64>(head, stream, a, comm)
    } else {
        fwd_on::<i32>(head, stream, a, comm)
    }
}

fn make_comm(comm: CommArg) -> Option<PyComm> {
    comm.map(|(rank, size, cb)| PyComm::new(rank, size, cb))
}

/// The raw stream of `head`'s context.
fn stream_of(head: &LmHead, raw: u64) -> Arc<CudaStream> {
    // SAFETY: `raw` is PyTorch's current stream of this device (or 0, the legacy default
    // stream), which PyTorch keeps alive for the duration of the call (module docs).
    unsafe { lmhead::borrowed_stream(head.context(), raw) }
}

/// The fused forward on the GPU, on stream `target.1` of device `target.0`: writes `logprob`,
/// `lse` and (when `entropy` is not 0) `entropy`, f32 `[t]` each (see [`FwdBufs`],
/// [`Scalars`]). With `comm`, the vocab-parallel forward over this rank's shard
/// `[v_begin, v_begin + v)` of `v_total`. With `kept = (address, f32 elements, budget bytes)`,
/// the kept-logits mode (`lmhead::keep`; the buffer holds at least `keep::len` elements).
#[pyfunction]
#[pyo3(signature = (target, bufs, sc, comm, kept=None))]
fn gpu_forward(
    py: Python<'_>,
    target: Target,
    bufs: FwdBufs,
    sc: Scalars,
    comm: CommArg,
    kept: Option<(u64, usize, usize)>,
) -> PyResult<()> {
    let hd = head(py, target.0)?;
    let mut opts = sc.fwd_options()?;
    opts.keep_logits = kept.map_or(0, |k| k.2);
    let a = FwdArgs { b: bufs, opts, shard: sc.shard(), kept: kept.map(|k| (k.0, k.1)) };
    let comm = make_comm(comm);
    let r = py.detach(|| {
        let s = stream_of(&hd, target.1);
        forward_dispatch(&hd, &s, &a, comm.as_ref().map(|c| c as &dyn Communicator))
    });
    finish(py, r)
}

/// Read and clear what the deferred label checks on device `target.0` found, ordered after the
/// work queued on stream `target.1` (see `LmHead::take_label_status`): returns when every label
/// was good, raises `InputError` (`kind` "bad_label", `row` the lowest bad row, `label` None)
/// when one was not.
#[pyfunction]
fn label_status(py: Python<'_>, target: Target) -> PyResult<()> {
    let hd = head(py, target.0)?;
    let r = py.detach(|| hd.take_label_status(&stream_of(&hd, target.1)));
    finish(py, r)
}

/// Backward arguments of the GPU entry points.
struct BwdArgs {
    b: BwdBufs,
    opts: BwdOptions,
    shard: Shard,
    /// 0: single device; 1: tensor parallel, `dh` all-reduced; 2: tensor parallel, partial `dh`.
    reduce: u8,
    /// The forward's kept logits `(address, f32 elements, rows)`.
    kept: Option<(u64, usize, usize)>,
}

fn bwd_on<L: LabelType>(head: &LmHead, stream: &Arc<CudaStream>, a: &BwdArgs, comm: Option<&dyn Communicator>) -> lmhead::Result<()> {
    let BwdBufs(ops, (lse, entropy, grad_logprob, grad_entropy), (dh, dh_f32, dw, dw_f32)) = a.b;
    let Operands(h, w, labels, ..) = ops;
    let p = ops.problem();
    let opt = |ptr: u64| if ptr == 0 { 0 } else { p.t };
    // SAFETY: the Python caller's contract (module docs): inputs as in the forward, `lse` and
    // the optional `[t]` f32 vectors (0 = absent), `dh` t·d and `dw` v·d elements of bf16 or f32
    // as flagged (0 = absent), all device memory of this head's device, alive and not raced
    // until the work queued on `stream` is done.
    let (h, w, labels, lse, ent, gl, ge) = unsafe {
        (
            Borrowed::<bf16>::new(h, p.t * p.d, stream),
            Borrowed::<bf16>::new(w, p.v * p.d, stream),
            Borrowed::<L>::new(labels, p.t, stream),
            Borrowed::<f32>::new(lse, p.t, stream),
            Borrowed::<f32>::new(entropy, opt(entropy), stream),
            Borrowed::<f32>::new(grad_logprob, opt(grad_logprob), stream),
            Borrowed::<f32>::new(grad_entropy, opt(grad_entropy), stream),
        )
    };
    let dw_len = if dw == 0 { 0 } else { p.v * p.d };
    // SAFETY: as above (gradient outputs).
    let (mut dh16, mut dh32, mut dw16, mut dw32) = unsafe {
        (
            Borrowed::<bf16>::new(dh, p.t * p.d, stream),
            Borrowed::<f32>::new(dh, p.t * p.d, stream),
            Borrowed::<bf16>::new(dw, dw_len, stream),
            Borrowed::<f32>::new(dw, dw_len, stream),
        )
    };
    // SAFETY: as above: the kept logits hold `len` f32 of this device, unwritten meanwhile.
    let kept = a.kept.map(|(ptr, len, rows)| (unsafe { Borrowed::<f32>::new(ptr, len, stream) }, rows));
    let x = BwdInputs {
        kept: kept.as_ref().map(|(k, rows)| lmhead::keep::Kept { logits: k, rows: *rows }),
        h: &h,
        w: &w,
        labels: &labels,
        lse: &lse,
        entropy: (entropy != 0).then_some(&ent as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        grad_logprob: (grad_logprob != 0).then_some(&gl as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        grad_entropy: (grad_entropy != 0).then_some(&ge as &dyn lmhead::cudarc::driver::DevicePtr<f32>),
        problem: p,
    };
    let dh = if dh_f32 { GradOut::F32(&mut dh32) } else { GradOut::Bf16(&mut dh16) };
    let dw = match (dw, dw_f32) {
        (0, _) => None,
        (_, true) => Some(GradOut::F32(&mut dw32)),
        (_, false) => Some(GradOut::Bf16(&mut dw16)),
    };
    match a.reduce {
        0 if a.shard == Shard::whole(p.v) => head.backward(stream, &x, &a.opts, dh, dw).map(|_| ()),
        _ => {
            let reduce = if a.reduce == 2 { ReduceDh::Caller } else { ReduceDh::AllReduce };
            let c: &dyn Communicator = comm.unwrap_or(&NoComm);
            head.backward_tp(lmhead::tp::TpBackward { comm: c, shard: a.shard, reduce }, stream, &x, &a.opts, dh, dw).map(|_| ())
        }
    }
}

fn backward_dispatch(head: &LmHead, stream: &Arc<CudaStream>, a: &BwdArgs, comm: Option<&dyn Communicator>) -> lmhead::Result<()> {
    if a.b.0 .3 {
        bwd_on::<i64>(head, stream, a, comm)
    } else {
        bwd_on::<i32>(head, stream, a, comm)
    }
}

/// The fused backward on the GPU: `dh` (`[t, d]`, bf16 or f32) and, when `dw` is not 0, `dW`
/// (`[v, d]`) (see [`BwdBufs`], [`Scalars`]). `reduce`: 0 single device, 1 tensor parallel with
/// `dh` all-reduced over `comm`, 2 tensor parallel leaving this rank's partial `dh` (Megatron's
/// convention). A `v_total` above the ranks' vocabulary makes labels in `[Σ v, v_total)` match
/// no row (their d-logits are `−p`). `kept = (address, f32 elements, rows)`: the logits the
/// forward kept (`lmhead::keep::Kept`).
#[pyfunction]
#[pyo3(signature = (target, bufs, sc, reduce, comm, kept=None))]
fn gpu_backward(
    py: Python<'_>,
    target: Target,
    bufs: BwdBufs,
    sc: Scalars,
    reduce: u8,
    comm: CommArg,
    kept: Option<(u64, usize, usize)>,
) -> PyResult<()> {
    let hd = head(py, target.0)?;
    let a = BwdArgs { b: bufs, opts: sc.bwd_options(), shard: sc.shard(), reduce, kept };
    let comm = make_comm(comm);
    let r = py.detach(|| {
        let s = stream_of(&hd, target.1);
        backward_dispatch(&hd, &s, &a, comm.as_ref().map(|c| c as &dyn Communicator))
    });
    finish(py, r)
}

/// Wall-clock seconds of each of `reps` runs of `call` on the raw stream `stream`, each followed
/// by a stream synchronisation.
fn time_reps(hd: &LmHead, stream: u64, reps: usize, call: impl Fn(&Arc<CudaStream>) -> lmhead::Result<()>) -> lmhead::Result<Vec<f64>> {
    let s = stream_of(hd, stream);
    let mut out = Vec::with_capacity(reps);
    for _ in 0..reps {
        let t0 = Instant::now();
        call(&s)?;
        s.synchronize().map_err(|source| lmhead::Error::Driver { during: "timing".into(), source })?;
        out.push(t0.elapsed().as_secs_f64());
    }
    Ok(out)
}

/// Wall-clock seconds of each of `reps` raw library forwards on the given buffers (each
/// followed by a stream synchronisation): the benchmark's baseline for the binding's overhead.
#[pyfunction]
fn time_forward(py: Python<'_>, target: Target, bufs: FwdBufs, sc: Scalars, reps: usize) -> PyResult<Vec<f64>> {
    let hd = head(py, target.0)?;
    let a = FwdArgs { b: bufs, opts: sc.fwd_options()?, shard: Shard::whole(bufs.0 .5), kept: None };
    let r = py.detach(|| time_reps(&hd, target.1, reps, |s| forward_dispatch(&hd, s, &a, None)));
    finish(py, r)
}

/// Wall-clock seconds of each of `reps` raw library backwards, each followed by a stream
/// synchronisation.
#[pyfunction]
fn time_backward(py: Python<'_>, target: Target, bufs: BwdBufs, sc: Scalars, reps: usize) -> PyResult<Vec<f64>> {
    let hd = head(py, target.0)?;
    let a = BwdArgs { b: bufs, opts: sc.bwd_options(), shard: Shard::whole(bufs.0 .5), reduce: 0, kept: None };
    let r = py.detach(|| time_reps(&hd, target.1, reps, |s| backward_dispatch(&hd, s, &a, None)));
    finish(py, r)
}

/// A no-op with the forward's argument list: the cost of crossing into the native module.
#[pyfunction]
#[pyo3(signature = (*_args))]
fn noop(_args: &Bound<'_, pyo3::types::PyTuple>) {}

/// Host slices from the addresses the Python side gives for the CPU backend.
///
/// # Safety
/// `ptr` must address `len` initialised `T` in host memory that stays alive and unwritten by
/// others for `'a` (0 is allowed only with `len == 0`).
unsafe fn host<'a, T>(ptr: u64, len: usize) -> &'a [T] {
    if len == 0 {
        return &[];
    }
    // SAFETY: forwarded to the caller.
    unsafe { std::slice::from_raw_parts(ptr as *const T, len) }
}

/// Copy `src` to the host f32 buffer at `dst` (`src.len()` elements).
///
/// # Safety
/// `dst` must address `src.len()` writable f32 of host memory that nobody else uses meanwhile.
unsafe fn write_host(dst: u64, src: &[f32]) {
    // SAFETY: forwarded to the caller; `src` is a separate Rust allocation, so no overlap.
    unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut f32, src.len()) }
}

/// The forward on the CPU backend (f64 reference): host addresses in `bufs` (bf16 bits for `h`
/// and `W`, i64 labels whatever the flag says, f32 outputs). The label check is always
/// synchronous. With `comm` (`(rank, size, all_reduce(address, len, op))` over host f64
/// buffers), the vocab-parallel forward with the GPU's protocol.
#[pyfunction]
fn cpu_forward(py: Python<'_>, bufs: FwdBufs, sc: Scalars, comm: CommArg) -> PyResult<()> {
    let FwdBufs(ops, (logprob, lse, entropy)) = bufs;
    let Operands(h, w, labels, ..) = ops;
    let p = ops.problem();
    let opts = FwdOptions { temperature: sc.0, ignore_index: sc.1, ..FwdOptions::default() };
    let shard = sc.shard();
    let hc = comm.map(|(rank, size, cb)| HostPyComm::new(rank, size, cb));
    let r = py.detach(|| {
        // SAFETY: the Python caller's contract (module docs): host tensors of t·d and v·d bf16,
        // t i64 labels, alive and unchanged for the call.
        let (hs, ws, ls) = unsafe { (host::<bf16>(h, p.t * p.d), host::<bf16>(w, p.v * p.d), host::<i64>(labels, p.t)) };
        let want_ent = entropy != 0;
        let x = CpuInputs { h: hs, w: ws, labels: ls, problem: p };
        let out = match &hc {
            None if shard == Shard::whole(p.v) => lmhead::cpu::forward(&x, &opts, want_ent)?,
            None => lmhead::cpu::forward_tp(&SingleHost, &x, shard, &opts, want_ent)?,
            Some(c) => lmhead::cpu::forward_tp(c, &x, shard, &opts, want_ent)?,
        };
        // SAFETY: the outputs are host f32 tensors of t elements (module docs).
        unsafe {
            write_host(logprob, &out.logprob);
            write_host(lse, &out.lse);
            if let Some(e) = &out.entropy {
                write_host(entropy, e);
            }
        }
        Ok(())
    });
    finish(py, r)
}

/// The backward on the CPU backend: writes f32 `dh` (`[t, d]`) and, when `dw` is not 0, f32
/// `dW` (`[v, d]`) (the flags of `bufs` must say f32). `reduce_dh` (tensor parallel only):
/// all-reduce `dh` over `comm`, else leave this rank's partial sum. A `v_total` above the
/// ranks' vocabulary makes labels in `[Σ v, v_total)` match no row.
#[pyfunction]
fn cpu_backward(py: Python<'_>, bufs: BwdBufs, sc: Scalars, reduce_dh: bool, comm: CommArg) -> PyResult<()> {
    let BwdBufs(ops, (lse, entropy, grad_logprob, grad_entropy), (dh, dh_f32, dw, dw_f32)) = bufs;
    let Operands(h, w, labels, ..) = ops;
    if !dh_f32 || (dw != 0 && !dw_f32) {
        return Err(pyo3::exceptions::PyValueError::new_err("the CPU backend writes f32 gradients"));
    }
    let p = ops.problem();
    let opts = sc.bwd_options();
    let shard = sc.shard();
    let hc = comm.map(|(rank, size, cb)| HostPyComm::new(rank, size, cb));
    let r = py.detach(|| {
        let opt = |ptr: u64| if ptr == 0 { 0 } else { p.t };
        // SAFETY: the Python caller's contract (module docs): host tensors of the stated sizes
        // (0 = absent), alive and unchanged for the call.
        let (hs, ws, ls, lse_s, ent, gl, ge) = unsafe {
            (
                host::<bf16>(h, p.t * p.d),
                host::<bf16>(w, p.v * p.d),
                host::<i64>(labels, p.t),
                host::<f32>(lse, p.t),
                host::<f32>(entropy, opt(entropy)),
                host::<f32>(grad_logprob, opt(grad_logprob)),
                host::<f32>(grad_entropy, opt(grad_entropy)),
            )
        };
        fn some(ptr: u64, s: &[f32]) -> Option<&[f32]> {
            (ptr != 0).then_some(s)
        }
        let (ent, gl, ge) = (some(entropy, ent), some(grad_logprob, gl), some(grad_entropy, ge));
        let x = CpuInputs { h: hs, w: ws, labels: ls, problem: p };
        let g = CpuGrads { lse: lse_s, entropy: ent, grad_logprob: gl, grad_entropy: ge, kept: None };
        let (dhv, dwv) = match &hc {
            None if shard == Shard::whole(p.v) => lmhead::cpu::backward(&x, &g, &opts)?,
            None => lmhead::cpu::backward_tp(&SingleHost, &x, shard, &g, &opts, false)?,
            Some(c) => lmhead::cpu::backward_tp(c, &x, shard, &g, &opts, reduce_dh)?,
        };
        // SAFETY: `dh` is a host f32 tensor of t·d elements, `dw` (if given) of v·d.
        unsafe {
            write_host(dh, &dhv);
            if dw != 0 {
                write_host(dw, &dwv);
            }
        }
        Ok(())
    });
    finish(py, r)
}

/// The native module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(keep_row_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(driver_present, m)?)?;
    m.add_function(wrap_pyfunction!(device_supported, m)?)?;
    m.add_function(wrap_pyfunction!(device_info, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_report, m)?)?;
    m.add_function(wrap_pyfunction!(set_scratch, m)?)?;
    m.add_function(wrap_pyfunction!(release_workspace, m)?)?;
    m.add_function(wrap_pyfunction!(workspace_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(warm_up, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_forward, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_backward, m)?)?;
    m.add_function(wrap_pyfunction!(label_status, m)?)?;
    m.add_function(wrap_pyfunction!(time_forward, m)?)?;
    m.add_function(wrap_pyfunction!(time_backward, m)?)?;
    m.add_function(wrap_pyfunction!(noop, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_forward, m)?)?;
    m.add_function(wrap_pyfunction!(cpu_backward, m)?)?;
    errors::register(py, m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
