//! Scratch device buffers owned by the library: forward partials, row states, the status words,
//! the backward staging buffer and the f32 `dh` accumulator. They are never the caller's
//! buffers. Two sources:
//!
//! - **Owned** (the default): allocated through cudarc on a stream of the library's own, grown
//!   on demand and reused across calls until `LmHead::release_workspace`. Creating that stream
//!   puts the CUDA context in cudarc's multi-stream mode, so every use of these buffers records
//!   and waits on events: calls may come on different (also borrowed) streams, and a buffer is
//!   freed only after the last stream that used it is done with it.
//! - **A caller's allocator** ([`ScratchAlloc`], set with `LmHead::set_scratch`): each call asks
//!   it for fresh memory, usable on the call's stream until the call returns, and forgets it
//!   then (the Python package allocates through PyTorch's caching allocator, so its accounting
//!   and `empty_cache` see the workspace).
//!
//! Either way a buffer handed out is zero-filled when it is new, as the kernels' padding
//! columns expect.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop, ValidAsZeroBits};
use lmhead_core::params::Partial;

use crate::borrowed::Borrowed;
use crate::error::{Context as _, Error, Result};

/// Device representation of a forward partial (16 bytes, 16-byte aligned).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PartialRepr(pub Partial);

/// Scratch memory from the caller's allocator.
pub trait ScratchAlloc: Send + Sync {
    /// At least `bytes` of device memory on the `LmHead`'s device, 256-byte aligned, usable by
    /// work queued on `stream` until the current `LmHead` call returns; returns its address.
    fn alloc(&self, bytes: usize, stream: &Arc<CudaStream>) -> Result<u64>;
}

/// A workspace buffer: the library's own or borrowed from a [`ScratchAlloc`] for one call.
pub enum WsBuf<T> {
    Owned(CudaSlice<T>),
    Borrowed(Borrowed<T>),
}

impl<T> DeviceSlice<T> for WsBuf<T> {
    fn len(&self) -> usize {
        match self {
            WsBuf::Owned(b) => b.len(),
            WsBuf::Borrowed(b) => b.len(),
        }
    }

    fn stream(&self) -> &Arc<CudaStream> {
        match self {
            WsBuf::Owned(b) => b.stream(),
            WsBuf::Borrowed(b) => b.stream(),
        }
    }
}

impl<T> DevicePtr<T> for WsBuf<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            WsBuf::Owned(b) => b.device_ptr(stream),
            WsBuf::Borrowed(b) => b.device_ptr(stream),
        }
    }
}

impl<T> DevicePtrMut<T> for WsBuf<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            WsBuf::Owned(b) => b.device_ptr_mut(stream),
            WsBuf::Borrowed(b) => b.device_ptr_mut(stream),
        }
    }
}

/// Where a workspace's buffers come from (kept apart from the buffers so that one can be passed
/// while another is borrowed mutably).
#[derive(Default)]
pub struct Source {
    scratch: Option<Arc<dyn ScratchAlloc>>,
    /// The library's own allocation stream (created on first use).
    own: Option<Arc<CudaStream>>,
}

impl Source {
    fn own_stream(&mut self, call: &Arc<CudaStream>) -> Result<Arc<CudaStream>> {
        if self.own.is_none() {
            self.own = Some(call.context().new_stream().during(|| "creating the workspace stream".into())?);
        }
        Ok(self.own.clone().unwrap())
    }
}

/// One growable buffer.
pub struct Grow<T> {
    buf: Option<WsBuf<T>>,
    what: &'static str,
}

impl<T: DeviceRepr + ValidAsZeroBits> Grow<T> {
    pub const fn new(what: &'static str) -> Self {
        Self { buf: None, what }
    }

    /// A buffer of at least `len` elements for a call on `stream` (zeroed when new).
    pub fn get(&mut self, src: &mut Source, stream: &Arc<CudaStream>, len: usize) -> Result<&mut WsBuf<T>> {
        let len = len.max(1);
        if self.buf.as_ref().is_none_or(|b| b.len() < len) {
            self.buf = None; // free the old one first
            let bytes = len * std::mem::size_of::<T>();
            let oom = || Error::OutOfMemory { what: self.what, bytes };
            let b = match &src.scratch {
                Some(alloc) => {
                    let ptr = alloc.alloc(bytes, stream)?;
                    if ptr == 0 || !ptr.is_multiple_of(256) {
                        return Err(Error::Invalid(format!("the scratch allocator returned address {ptr:#x} for {}", self.what)));
                    }
                    // SAFETY: the allocator's contract: `bytes` of device memory at `ptr`, usable
                    // on `stream` until this call returns; `end_call` drops this view before.
                    let mut b = WsBuf::Borrowed(unsafe { Borrowed::new(ptr, len, stream) });
                    stream.memset_zeros(&mut b).during(|| format!("zeroing {}", self.what))?;
                    b
                }
                None => WsBuf::Owned(src.own_stream(stream)?.alloc_zeros::<T>(len).map_err(|_| oom())?),
            };
            self.buf = Some(b);
        }
        Ok(self.buf.as_mut().unwrap())
    }

    pub fn bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.len() * std::mem::size_of::<T>())
    }

    pub fn release(&mut self) {
        self.buf = None;
    }

    /// Forget a borrowed buffer (its memory belongs to the caller's allocator).
    fn end_call(&mut self) {
        if matches!(self.buf, Some(WsBuf::Borrowed(_))) {
            self.buf = None;
        }
    }
}

/// All scratch buffers of one `LmHead`.
pub struct Workspace {
    pub src: Source,
    pub partials: Grow<PartialRepr>,
    pub row_state: Grow<f32>,
    pub status: Grow<u32>,
    pub staging: Grow<half::bf16>,
    pub dh_acc: Grow<f32>,
}

impl Workspace {
    pub fn new() -> Self {
        Self {
            src: Source::default(),
            partials: Grow::new("forward partials"),
            row_state: Grow::new("row states"),
            status: Grow::new("status word"),
            staging: Grow::new("backward d-logits staging"),
            dh_acc: Grow::new("dh f32 accumulator"),
        }
    }

    /// Use `alloc` for every later call's buffers (`None`: the library's own, reused). Frees
    /// what the workspace holds now.
    pub fn set_scratch(&mut self, alloc: Option<Arc<dyn ScratchAlloc>>) {
        self.release();
        self.src.scratch = alloc;
    }

    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        self.partials.bytes() + self.row_state.bytes() + self.status.bytes() + self.staging.bytes() + self.dh_acc.bytes()
    }

    pub fn release(&mut self) {
        self.partials.release();
        self.row_state.release();
        self.status.release();
        self.staging.release();
        self.dh_acc.release();
    }

    /// The end of a call: buffers from the caller's allocator are forgotten.
    pub fn end_call(&mut self) {
        self.partials.end_call();
        self.row_state.end_call();
        self.status.end_call();
        self.staging.end_call();
        self.dh_acc.end_call();
    }
}

impl Default for Workspace {
    fn default() -> Self {
        Self::new()
    }
}

/// The workspace of one call: holds the lock for the whole call (calls on one `LmHead` are
/// serialised) and forgets borrowed buffers when the call ends, also on error.
pub struct CallWs<'a>(pub std::sync::MutexGuard<'a, Workspace>);

impl Drop for CallWs<'_> {
    fn drop(&mut self) {
        self.0.end_call();
    }
}

impl std::ops::Deref for CallWs<'_> {
    type Target = Workspace;
    fn deref(&self) -> &Workspace {
        &self.0
    }
}

impl std::ops::DerefMut for CallWs<'_> {
    fn deref_mut(&mut self) -> &mut Workspace {
        &mut self.0
    }
}
