//! Memory and streams owned by someone else (PyTorch, JAX, a caller's allocator), used in place.
//!
//! [`Borrowed<T>`] is a device pointer, an element count and the stream it is used on. It
//! implements cudarc's `DeviceSlice`, `DevicePtr` and `DevicePtrMut`, so it goes wherever a
//! `CudaSlice` goes in this library's API, but it frees nothing and records no events: ordering
//! is the owner's business, by stream. [`borrowed_stream`] wraps a raw `CUstream` (e.g.
//! `torch.cuda.current_stream().cuda_stream`; 0 is the legacy default stream) without taking
//! ownership.
//!
//! The library's own workspace stays correct when calls come on different streams: it lives on
//! a stream of the library's own, and cudarc orders every use of it by events (see
//! `workspace.rs`).

use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::{sys, CudaContext, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};

/// `len` elements of `T` at device address `ptr`, owned elsewhere, used on `stream`.
pub struct Borrowed<T> {
    ptr: u64,
    len: usize,
    stream: Arc<CudaStream>,
    _t: PhantomData<*const T>,
}

// SAFETY: `Borrowed` holds a device address (an integer) and an `Arc<CudaStream>`, which is
// Send + Sync; it never dereferences the address on the host.
unsafe impl<T> Send for Borrowed<T> {}
// SAFETY: as above; shared references only read the address and the length.
unsafe impl<T> Sync for Borrowed<T> {}

impl<T> Borrowed<T> {
    /// A view of `len` elements at `ptr`.
    ///
    /// # Safety
    /// `ptr` must address `len` elements of `T` (`len · size_of::<T>()` bytes) of device memory
    /// in `stream`'s context that stay allocated, and are not used by anyone else in a way that
    /// races with work queued on `stream`, for as long as this value (or work queued with it) is
    /// alive. `ptr` may be 0 only when `len` is 0.
    pub unsafe fn new(ptr: u64, len: usize, stream: &Arc<CudaStream>) -> Self {
        Self { ptr, len, stream: stream.clone(), _t: PhantomData }
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl<T> DeviceSlice<T> for Borrowed<T> {
    fn len(&self) -> usize {
        self.len
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<T> DevicePtr<T> for Borrowed<T> {
    fn device_ptr<'a>(&'a self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        // No event: the owner orders its memory by stream (the contract of `new`).
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

impl<T> DevicePtrMut<T> for Borrowed<T> {
    fn device_ptr_mut<'a>(&'a mut self, _stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        (self.ptr, SyncOnDrop::Sync(None))
    }
}

/// Wrap the raw stream `raw` of `ctx` (0: the legacy default stream) without owning it.
///
/// # Safety
/// `raw` must be a stream of `ctx` (or 0) that its owner keeps alive while the returned value
/// or work queued through it is in use.
pub unsafe fn borrowed_stream(ctx: &Arc<CudaContext>, raw: u64) -> Arc<CudaStream> {
    // SAFETY: forwarded to the caller (the contract above is cudarc's).
    unsafe { ctx.wrap_borrowed_stream(raw as sys::CUstream) }
}
