//! # lmhead: the fused LM head
//!
//! For tokens `h [t, d]` and an output embedding `W [v, d]` (bf16), the log-probability of each
//! token's label under `softmax(h Wᵀ / T)`, optionally the entropy of that distribution, and the
//! log-sum-exp; and the gradients `dh`, `dW` of any combination of those. The `t × v` logits are
//! never materialised: the forward folds each tensor-core tile into an online log-sum-exp, the
//! backward recomputes tiles in vocab chunks.
//!
//! - [`LmHead`] runs the Rust-written kernels on an H100/H200 through `cudarc`:
//!   [`LmHead::forward`] ([`FwdInputs`], [`FwdOptions`], [`FwdOutputs`] → [`FwdReport`]),
//!   [`LmHead::backward`] ([`BwdInputs`], [`BwdOptions`], [`GradOut`] → [`BwdReport`]),
//!   [`LmHead::warm_up`], and the scratch memory's source ([`ScratchAlloc`]).
//! - [`cpu`] is the f64 reference, the backend on machines without a GPU.
//! - [`tp`] adds vocab-parallel tensor parallelism (and documents context parallelism).
//! - Buffers of other frameworks enter as [`Borrowed`] memory on a [`borrowed_stream`].
//! - [`Compaction`]: both passes compute only the rows the loss reads (labels not `ignore_index`;
//!   in the backward also a non-zero upstream gradient), compacted into the workspace.
//!
//! Every call validates its shapes, lengths, alignment, options and (by default) labels, and
//! answers bad input with an [`Error`], never a panic or a plausible wrong number.
//!
//! The launch decisions (tile configs, plans, chunk widths) are the rules of
//! `lmhead_core::heuristics`; where they were not measured (any device but the H200) the
//! library also times their short list on the first call of each token bucket and caches the
//! winner (`LMHEAD_AUTOTUNE=0` / `1` turns that off / on anywhere).
//!
//! With the cargo feature `testing` (enabled by the workspace's tests and benches) the internals
//! those need are public too: `launch`, `ptx`, `tune`, `validate`, `testing`, the configs
//! (`TileConfig`, `Family`, `Mainloop`, `Store`, `Choice`, `BwdConfigs`), `Gpu`, `TokenBucket`,
//! and the options' `config` and `naive` fields; they are not part of the stable API.
#![deny(unsafe_op_in_unsafe_fn, clippy::undocumented_unsafe_blocks)]

/// Declares internal modules: public with the `testing` feature, crate-private without it (then
/// what only the tests reach is unused, so dead code is allowed there).
macro_rules! internal_mod {
    ($($m:ident;)*) => {$(
        #[cfg(feature = "testing")]
        pub mod $m;
        #[cfg(not(feature = "testing"))]
        #[allow(dead_code)]
        mod $m;
    )*};
}

mod active;
mod borrowed;
mod bwd;
mod capture;
pub mod cpu;
pub mod keep;
// `Gpu`'s helpers for the tests (registers, loaded kernels) are used only with `testing`.
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
mod device;
mod error;
mod fwd;
mod labels;
mod plan;
pub mod tp;
mod workspace;

internal_mod! {
    launch;
    ptx;
    testing;
    tune;
    validate;
}

use std::sync::{Arc, Mutex};

/// The CUDA driver bindings the API's streams and buffers come from (`CudaStream`,
/// `DevicePtr`, `DevicePtrMut`, `CudaSlice`, `CudaContext`): the same version as the library's.
pub use cudarc;
pub use device::{driver_present, DeviceInfo, KernelReport};
pub use error::{Error, Result};
pub use half::bf16;
pub use lmhead_core::Problem;

pub use active::Compaction;
pub use borrowed::{borrowed_stream, Borrowed};
pub use bwd::{BwdInputs, BwdOptions, BwdReport, GradOut};
pub use fwd::{FwdInputs, FwdOptions, FwdOutputs, FwdReport};
pub use labels::LabelCheck;
pub use workspace::ScratchAlloc;

#[cfg(feature = "testing")]
pub use bwd::BwdConfigs;
#[cfg(feature = "testing")]
pub use device::Gpu;
#[cfg(not(feature = "testing"))]
use device::Gpu;
#[cfg(feature = "testing")]
pub use lmhead_core::config::{Mainloop, Store};
#[cfg(feature = "testing")]
pub use lmhead_core::{Family, TileConfig, TokenBucket};
#[cfg(not(feature = "testing"))]
use tune::Tuner;
#[cfg(feature = "testing")]
pub use tune::{Choice, Tuner};

/// Label element types the kernels read: `i32` and `i64`.
pub trait LabelType: cudarc::driver::DeviceRepr + Copy + Into<i64> {
    #[doc(hidden)]
    fn labels<'a>(
        buf: &'a (impl cudarc::driver::DevicePtr<Self> + ?Sized),
        s: &'a cudarc::driver::CudaStream,
    ) -> Result<launch::Labels<'a>>;
}

impl LabelType for i32 {
    fn labels<'a>(
        buf: &'a (impl cudarc::driver::DevicePtr<Self> + ?Sized),
        s: &'a cudarc::driver::CudaStream,
    ) -> Result<launch::Labels<'a>> {
        launch::labels_i32(buf, s)
    }
}

impl LabelType for i64 {
    fn labels<'a>(
        buf: &'a (impl cudarc::driver::DevicePtr<Self> + ?Sized),
        s: &'a cudarc::driver::CudaStream,
    ) -> Result<launch::Labels<'a>> {
        launch::labels_i64(buf, s)
    }
}

/// The fused LM head on one GPU: the device, the tuner (with its cache) and the scratch
/// workspace. Calls on one `LmHead` are serialised by its internal lock; use one per stream for
/// concurrency.
pub struct LmHead {
    gpu: Arc<Gpu>,
    tuner: Tuner,
    ws: Mutex<workspace::Workspace>,
    /// What deferred label checks found ([`LmHead::take_label_status`]).
    label_status: labels::Status,
}

impl LmHead {
    /// Open device `ordinal`. Tuning follows `LMHEAD_AUTOTUNE` (`0` off, `1` on; unset: off on
    /// the H200, where the rules were measured, on elsewhere), its cache in the user's cache
    /// directory unless `LMHEAD_TUNE_CACHE` names a file (or `off`: in memory only).
    pub fn new(ordinal: usize) -> Result<Self> {
        let gpu = Gpu::new(ordinal)?;
        Ok(Self::with_tuner(gpu.clone(), Tuner::from_env(gpu.info())))
    }

    /// The head on `gpu` with `tuner`.
    #[cfg(feature = "testing")]
    pub fn with_tuner(gpu: Arc<Gpu>, tuner: Tuner) -> Self {
        Self::with_tuner_impl(gpu, tuner)
    }

    #[cfg(not(feature = "testing"))]
    fn with_tuner(gpu: Arc<Gpu>, tuner: Tuner) -> Self {
        Self::with_tuner_impl(gpu, tuner)
    }

    fn with_tuner_impl(gpu: Arc<Gpu>, mut tuner: Tuner) -> Self {
        let g = gpu.clone();
        tuner.set_loads(Arc::new(move |f, c| g.tuned_function(f, c).is_ok()));
        Self { gpu, tuner, ws: Mutex::new(workspace::Workspace::new()), label_status: labels::Status::default() }
    }

    /// The device handle (kernels, limits).
    #[cfg(feature = "testing")]
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The tuner (its policy and cache).
    #[cfg(feature = "testing")]
    pub fn tuner(&self) -> &Tuner {
        &self.tuner
    }

    /// The CUDA context the head runs in: streams for its calls come from it
    /// (`context().default_stream()`, `context().new_stream()`).
    pub fn context(&self) -> &Arc<cudarc::driver::CudaContext> {
        self.gpu.context()
    }

    /// The device: name, compute capability, SMs, shared memory, L2, driver.
    pub fn device_info(&self) -> &DeviceInfo {
        self.gpu.info()
    }

    /// Bytes of device memory the workspace holds now.
    pub fn workspace_bytes(&self) -> usize {
        self.ws.lock().unwrap().bytes()
    }

    /// Where the kernels come from (cubin or JIT) and how many of each family load (loads them
    /// all).
    pub fn kernel_report(&self) -> KernelReport {
        self.gpu.kernel_report()
    }

    /// Free the workspace, or hand it back to the [`ScratchAlloc`] it came from, after the last
    /// work that used it (it is allocated again on the next call).
    pub fn release_workspace(&self) {
        self.ws.lock().unwrap().release();
    }

    /// Take every later call's scratch memory from `alloc` (the forward's small buffers kept
    /// across calls until [`LmHead::release_workspace`], the backward's large ones handed back
    /// when each call returns), or, with `None`, from the library's own reused workspace (the
    /// default). Hands back what the workspace holds now. See [`ScratchAlloc`] for what the
    /// allocator must provide.
    pub fn set_scratch(&self, alloc: Option<Arc<dyn ScratchAlloc>>) {
        self.ws.lock().unwrap().set_scratch(alloc);
    }

    /// The workspace for one call (held until the call returns); `capture`: the call's stream
    /// is capturing a CUDA graph, so every buffer is the call's own (see `workspace.rs`).
    pub(crate) fn call_ws(&self, capture: bool) -> workspace::CallWs<'_> {
        let mut ws = self.ws.lock().unwrap();
        ws.src.capture = capture;
        workspace::CallWs(ws)
    }

    /// Whether a call on `stream` may time trials of `rows` rows and `macs` multiply-adds for any
    /// of `asks` (keys and how their configs are chosen): not while the stream is being captured
    /// into a CUDA graph, and, under the short-list policy, only for at most [`fwd::TRIAL_ROWS`]
    /// rows and [`fwd::TRIAL_MACS`] multiply-adds. The driver is asked only when some key may be
    /// timed at all (tuning on, a config chosen automatically, the key not cached).
    pub(crate) fn can_time(
        &self,
        stream: &cudarc::driver::CudaStream,
        asks: &[(&tune::TuneKey, tune::Choice)],
        rows: usize,
        macs: usize,
    ) -> Result<tune::CanTime> {
        use tune::{CanTime, Policy};
        let policy = self.tuner.policy();
        let may_time = policy != Policy::Off && asks.iter().any(|&(k, c)| c == tune::Choice::Auto && self.tuner.entry(k).is_none());
        if !may_time {
            return Ok(CanTime::Yes);
        }
        if capture::capturing(stream)? {
            return Ok(CanTime::Capturing);
        }
        let fits = rows <= fwd::TRIAL_ROWS && macs <= fwd::TRIAL_MACS;
        Ok(if policy == Policy::Exhaustive || fits { CanTime::Yes } else { CanTime::TooLarge })
    }
}

impl LmHead {
    /// Tune ahead of time: for each distinct token bucket among `token_counts`, run the forward
    /// (with or without entropy) and, if `backward`, the backward once on scratch inputs of that
    /// shape (random bf16, labels in range), so that later calls with those counts find their
    /// configs in the cache (where tuning is on) and their kernels loaded. Nothing of the
    /// caller's is read or written. Warm up before capturing calls into a CUDA graph: a captured
    /// call never times anything, so a bucket first met under capture runs the rules' pick.
    pub fn warm_up(&self, token_counts: &[usize], v: usize, d: usize, entropy: bool, backward: bool) -> Result<()> {
        validate::warm_up(token_counts, v, d)?;
        let stream = self.gpu.context().default_stream();
        self.tuner.warm_up(token_counts, |t| {
            let p = Problem::new(t, v, d);
            p.check()?;
            let h = testing::random_bf16_tiled(&stream, t * d, 0.05, 1)?;
            let w = testing::random_bf16_tiled(&stream, v * d, 0.05, 2)?;
            let labels = testing::upload(&stream, &(0..t).map(|i| (i % v) as i32).collect::<Vec<_>>())?;
            let alloc = |n: usize| workspace::zeros::<f32>(&stream, n, "warm-up outputs");
            let (mut lp, mut lse, mut ent) = (alloc(t)?, alloc(t)?, alloc(t)?);
            let x = FwdInputs { h: &h, w: &w, labels: &labels, problem: p };
            self.forward(
                &stream,
                &x,
                &FwdOptions::default(),
                FwdOutputs { kept: None, logprob: &mut lp, lse: &mut lse, entropy: entropy.then_some(&mut ent) },
            )?;
            if backward {
                let g = testing::upload(&stream, &vec![1.0f32; t])?;
                let mut dh = workspace::zeros::<bf16>(&stream, t * d, "warm-up dh")?;
                let mut dw = workspace::zeros::<bf16>(&stream, v * d, "warm-up dW")?;
                let bx = BwdInputs {
                    kept: None,
                    h: &h,
                    w: &w,
                    labels: &labels,
                    lse: &lse,
                    entropy: entropy.then_some(&ent as &dyn cudarc::driver::DevicePtr<f32>),
                    grad_logprob: Some(&g),
                    grad_entropy: entropy.then_some(&g as &dyn cudarc::driver::DevicePtr<f32>),
                    problem: p,
                };
                self.backward(&stream, &bx, &BwdOptions::default(), GradOut::Bf16(&mut dh), Some(GradOut::Bf16(&mut dw)))?;
            }
            stream.synchronize().map_err(|source| Error::Driver { during: "warm-up".into(), source })
        })
    }
}
