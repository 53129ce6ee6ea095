//! Scratch device buffers owned by the library: forward partials, row states, the status words,
//! the backward staging buffer, the f32 `dh` accumulator and the active rows' compaction. They are never the caller's
//! buffers. Two sources:
//!
//! - **Owned** (the default): allocated through cudarc on a stream of the library's own, grown
//!   on demand and reused across calls until `LmHead::release_workspace`. Creating that stream
//!   puts the CUDA context in cudarc's multi-stream mode, so every use of these buffers records
//!   and waits on events: calls may come on different (also borrowed) streams, and a buffer is
//!   freed only after the last stream that used it is done with it.
//! - **A caller's allocator** ([`ScratchAlloc`], set with `LmHead::set_scratch`). The small
//!   buffers of the forward (partials, row states, status words) are kept across calls, grown
//!   on demand, and handed back ([`ScratchAlloc::free`]) on `LmHead::release_workspace`, on
//!   growth or on `set_scratch`, each after the last work that used it is done. Every call
//!   waits (on the device) for the previous call's use of them, so calls may come on different
//!   streams. The backward's large buffers (staging, `dh` accumulator) are asked for fresh in
//!   each call and handed back when it returns, so that the caller's allocator can lend that
//!   memory to others between calls. (The Python package allocates through PyTorch's caching
//!   allocator, so its accounting and `empty_cache` see the workspace; keeping the forward's
//!   buffers saves two allocator callbacks per forward.)
//!
//! **Under CUDA-graph capture** a graph bakes in every address it uses and may replay long after
//! the call, so a captured call takes none of the buffers kept across calls (they may be grown,
//! handed back or used by an eager call meanwhile) and waits on no event recorded outside the
//! capture: every buffer it needs is its own, asked for fresh (from the [`ScratchAlloc`], which
//! for PyTorch allocates from the graph's private pool, or else on the call's stream through the
//! stream-ordered allocator, which a graph records as its own allocation) and handed back
//! stream-ordered when the call ends. The kept buffers stay as they were for the next eager call.
//!
//! A new buffer is zero-filled only where a kernel may read what no kernel of the call wrote:
//! the backward's staging buffer (its padding columns). The forward partials, the row states,
//! the status words and the `dh` accumulator are written before they are read in every call
//! (the owned buffers are reused across calls of other shapes without clearing, and the tests
//! compare those calls with the reference), so borrowed ones are handed out uncleared: a memset
//! of the partials per call would be device time for nothing.

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop, ValidAsZeroBits};
use lmhead_core::params::Partial;

use crate::borrowed::Borrowed;
use crate::error::{Context as _, Error, Result};

/// `n` zeroed elements on `stream`, for scratch and outputs the library allocates itself (tuning
/// trials, warm-up); an allocation failure is [`Error::OutOfMemory`] naming `what`.
pub(crate) fn zeros<T: DeviceRepr + ValidAsZeroBits>(stream: &Arc<CudaStream>, n: usize, what: &'static str) -> Result<CudaSlice<T>> {
    stream.alloc_zeros::<T>(n).map_err(|_| Error::OutOfMemory { what, bytes: std::mem::size_of::<T>() * n })
}

/// Device representation of a forward partial (16 bytes, 16-byte aligned).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PartialRepr(pub Partial);

/// Scratch memory from the caller's allocator.
pub trait ScratchAlloc: Send + Sync {
    /// At least `bytes` of device memory on the `LmHead`'s device, 256-byte aligned, usable by
    /// work queued on `stream` (and, after the library orders it, on other streams of the
    /// device) until the library calls [`ScratchAlloc::free`] with the returned address.
    fn alloc(&self, bytes: usize, stream: &Arc<CudaStream>) -> Result<u64>;

    /// Take back the memory at `ptr` (an address `alloc` returned). Either no work queued by
    /// the library uses it any more (a buffer kept across calls: the library synchronises with
    /// its last use first), or only work queued on the stream it was allocated on does (a
    /// per-call buffer, handed back as its call returns): the allocator must then reuse it only
    /// for work ordered after that stream's queued work, as a stream-ordered allocator such as
    /// PyTorch's caching allocator does.
    fn free(&self, ptr: u64);
}

/// A buffer from a [`ScratchAlloc`]: handed back when dropped, after its last use is done.
pub struct Lent<T> {
    view: Borrowed<T>,
    alloc: Arc<dyn ScratchAlloc>,
    last_use: LastUse,
}

/// What a [`Lent`] buffer's next user (or its drop) must wait for.
enum LastUse {
    /// The current call uses it (on the view's stream, alive until the call returns): set by
    /// every call that asks for the buffer, so it also marks the buffers a call used.
    ThisCall,
    /// Recorded on the stream of the call that last used it, when that call ended.
    Event(CudaEvent),
    /// Nothing to wait for: that call's stream was synchronised (no event could be recorded),
    /// or the buffer is handed back stream-ordered (see [`ScratchAlloc::free`]).
    Done,
}

impl<T> Lent<T> {
    /// The view for a call on `stream`, ordered after the buffer's use by earlier calls.
    fn for_call(&mut self, stream: &Arc<CudaStream>) -> Result<&mut Borrowed<T>> {
        if let LastUse::Event(e) = &self.last_use {
            stream.wait(e).during(|| "ordering the workspace after its last use".into())?;
        }
        // SAFETY: the same memory, now used on `stream` (ordered after its earlier uses above).
        self.view = unsafe { Borrowed::new(self.view.ptr(), self.view.len(), stream) };
        self.last_use = LastUse::ThisCall;
        Ok(&mut self.view)
    }

    /// The end of a call that used the buffer (on the view's stream, the call's).
    fn end_call(&mut self) {
        let stream = self.view.stream();
        self.last_use = match stream.record_event(None) {
            Ok(e) => LastUse::Event(e),
            // Without an event the next use cannot be ordered: wait for this one instead.
            Err(_) => {
                let _ = stream.synchronize();
                LastUse::Done
            }
        };
    }
}

impl<T> Drop for Lent<T> {
    fn drop(&mut self) {
        match &self.last_use {
            LastUse::Event(e) => {
                let _ = e.synchronize();
            }
            LastUse::ThisCall => {
                let _ = self.view.stream().synchronize();
            }
            LastUse::Done => {}
        }
        self.alloc.free(self.view.ptr());
    }
}

/// A workspace buffer: the library's own, or lent by a [`ScratchAlloc`].
pub enum WsBuf<T> {
    Owned(CudaSlice<T>),
    Lent(Lent<T>),
}

impl<T> DeviceSlice<T> for WsBuf<T> {
    fn len(&self) -> usize {
        match self {
            WsBuf::Owned(b) => b.len(),
            WsBuf::Lent(b) => b.view.len(),
        }
    }

    fn stream(&self) -> &Arc<CudaStream> {
        match self {
            WsBuf::Owned(b) => b.stream(),
            WsBuf::Lent(b) => b.view.stream(),
        }
    }
}

impl<T> DevicePtr<T> for WsBuf<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            WsBuf::Owned(b) => b.device_ptr(stream),
            WsBuf::Lent(b) => b.view.device_ptr(stream),
        }
    }
}

impl<T> DevicePtrMut<T> for WsBuf<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (cudarc::driver::sys::CUdeviceptr, SyncOnDrop<'a>) {
        match self {
            WsBuf::Owned(b) => b.device_ptr_mut(stream),
            WsBuf::Lent(b) => b.view.device_ptr_mut(stream),
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
    /// The current call's stream is capturing a CUDA graph: every buffer is the call's own.
    pub capture: bool,
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
    /// The buffer of a captured call (see the module docs), handed back when the call ends.
    call_only: Option<WsBuf<T>>,
    what: &'static str,
    /// Zero a new buffer (one whose unwritten parts a kernel may read).
    zero: bool,
    /// Keep a lent buffer across calls (else it is handed back when the call ends).
    keep: bool,
}

impl<T: DeviceRepr + ValidAsZeroBits> Grow<T> {
    /// A small buffer written before it is read in every call (lent ones kept across calls).
    pub const fn new(what: &'static str) -> Self {
        Self { buf: None, call_only: None, what, zero: false, keep: true }
    }

    /// A large buffer some kernel reads beyond what the call writes: zeroed when new, lent
    /// ones handed back when the call ends.
    pub const fn per_call_zeroed(what: &'static str) -> Self {
        Self { buf: None, call_only: None, what, zero: true, keep: false }
    }

    /// A large buffer written before it is read in every call, lent ones handed back when the
    /// call ends.
    pub const fn per_call(what: &'static str) -> Self {
        Self { buf: None, call_only: None, what, zero: false, keep: false }
    }

    /// A buffer of at least `len` elements for a call on `stream` (zeroed when new if
    /// [`Grow::per_call_zeroed`]; the library's own buffers are always zeroed when new).
    pub fn get(&mut self, src: &mut Source, stream: &Arc<CudaStream>, len: usize) -> Result<&mut WsBuf<T>> {
        let len = len.max(1);
        if src.capture {
            return self.get_captured(src, stream, len);
        }
        if self.buf.as_ref().is_none_or(|b| b.len() < len) {
            self.buf = None; // hand the old one back first
            let bytes = len * std::mem::size_of::<T>();
            let oom = || Error::OutOfMemory { what: self.what, bytes };
            let b = match &src.scratch {
                Some(alloc) => {
                    let ptr = alloc.alloc(bytes, stream)?;
                    if ptr == 0 || !ptr.is_multiple_of(256) {
                        return Err(Error::Invalid(format!("the scratch allocator returned address {ptr:#x} for {}", self.what)));
                    }
                    // SAFETY: the allocator's contract: `bytes` of device memory at `ptr`, usable
                    // on `stream` until `free(ptr)`, which `Lent`'s drop calls after the last use
                    // (or, for a per-call buffer used only on `stream`, stream-ordered).
                    let view = unsafe { Borrowed::new(ptr, len, stream) };
                    let mut b = Lent { view, alloc: alloc.clone(), last_use: LastUse::ThisCall };
                    if self.zero {
                        stream.memset_zeros(&mut b.view).during(|| format!("zeroing {}", self.what))?;
                    }
                    WsBuf::Lent(b)
                }
                None => WsBuf::Owned(src.own_stream(stream)?.alloc_zeros::<T>(len).map_err(|_| oom())?),
            };
            self.buf = Some(b);
        }
        if let Some(WsBuf::Lent(b)) = self.buf.as_mut() {
            b.for_call(stream)?;
        }
        Ok(self.buf.as_mut().unwrap())
    }

    /// [`Grow::get`] for a call on a capturing stream: a buffer of the call's own (see the
    /// module docs), zeroed when new like the others.
    fn get_captured(&mut self, src: &mut Source, stream: &Arc<CudaStream>, len: usize) -> Result<&mut WsBuf<T>> {
        if self.call_only.as_ref().is_none_or(|b| b.len() < len) {
            self.end_captured();
            let bytes = len * std::mem::size_of::<T>();
            let b = match &src.scratch {
                Some(alloc) => {
                    let ptr = alloc.alloc(bytes, stream)?;
                    if ptr == 0 || !ptr.is_multiple_of(256) {
                        return Err(Error::Invalid(format!("the scratch allocator returned address {ptr:#x} for {}", self.what)));
                    }
                    // SAFETY: the allocator's contract (as in `get`); used only on `stream` in
                    // this call and handed back stream-ordered when it ends (`end_captured`).
                    let view = unsafe { Borrowed::new(ptr, len, stream) };
                    let mut b = Lent { view, alloc: alloc.clone(), last_use: LastUse::ThisCall };
                    if self.zero {
                        stream.memset_zeros(&mut b.view).during(|| format!("zeroing {}", self.what))?;
                    }
                    WsBuf::Lent(b)
                }
                // On the call's stream: the graph records the allocation and the free.
                None => WsBuf::Owned(stream.alloc_zeros::<T>(len).map_err(|_| Error::OutOfMemory { what: self.what, bytes })?),
            };
            self.call_only = Some(b);
        }
        Ok(self.call_only.as_mut().unwrap())
    }

    /// Hand back a captured call's buffer, stream-ordered (it was used on that call's stream only).
    fn end_captured(&mut self) {
        if let Some(WsBuf::Lent(b)) = self.call_only.as_mut() {
            b.last_use = LastUse::Done;
        }
        self.call_only = None;
    }

    /// Bytes held now: the kept or per-call buffer, and a captured call's own.
    pub fn bytes(&self) -> usize {
        [&self.buf, &self.call_only].iter().map(|b| b.as_ref().map_or(0, |b| b.len() * std::mem::size_of::<T>())).sum()
    }

    pub fn release(&mut self) {
        self.buf = None;
    }

    /// The end of a call: a lent buffer this call used records its last use, and is handed back
    /// unless kept.
    pub(crate) fn end_call(&mut self) {
        self.end_captured();
        let Some(WsBuf::Lent(b)) = self.buf.as_mut() else { return };
        if !matches!(b.last_use, LastUse::ThisCall) {
            return; // not used in this call
        }
        if self.keep {
            b.end_call();
        } else {
            // Used only in this call, on the stream it was allocated on: handed back
            // stream-ordered, without waiting for the call's work (the host runs ahead).
            b.last_use = LastUse::Done;
            self.buf = None;
        }
    }
}

/// The backward's second stream, on which each chunk's `dW` GEMM runs beside its `dh` GEMM,
/// and the two events that order it against the call's stream: `ready` (the chunk's d-logits
/// are written) and `done` (its `dW` is). The stream has a priority one step above the call's
/// stream ([`priority_above`]), so that the block scheduler hands free SMs to `dW`'s blocks
/// first and `dh`'s blocks take the SMs that `dW`'s last wave leaves idle, while a caller's
/// streams of higher priority (a collective's, say) stay ahead of both.
///
/// The stream is created through the driver and wrapped as a borrowed cudarc stream, which
/// `Side` destroys when dropped: a stream made by cudarc would switch a context that has none
/// (a caller's allocator in place of the library's workspace stream, as in the Python package)
/// into cudarc's multi-stream mode, with an event recorded at every later use of a cudarc
/// buffer. The ordering the side stream needs is the two events'.
pub struct Side {
    pub stream: Arc<CudaStream>,
    pub ready: CudaEvent,
    pub done: CudaEvent,
    /// The stream's priority.
    priority: i32,
}

/// The priority one step above `caller`'s (CUDA: a lower number is a higher priority), but no
/// higher than `greatest`, the device's highest.
pub fn priority_above(caller: i32, greatest: i32) -> i32 {
    caller.saturating_sub(1).max(greatest)
}

impl Side {
    /// The side stream kept in `slot` for a call on `call` (the call's stream): created there on
    /// first use, and again when a call comes on a stream of another priority.
    pub fn of<'a>(slot: &'a mut Option<Side>, call: &Arc<CudaStream>) -> Result<&'a Side> {
        use cudarc::driver::result::stream;
        let ctx = call.context();
        let priority = (|| -> std::result::Result<i32, cudarc::driver::DriverError> {
            ctx.bind_to_thread()?;
            let (_, greatest) = stream::get_priority_range()?;
            let mut caller = 0;
            // SAFETY: `call` is a live stream of `ctx` (the call's, validated to belong to the
            // device's context); `caller` is a writable i32 the driver fills.
            unsafe { cudarc::driver::sys::cuStreamGetPriority(call.cu_stream(), &mut caller) }.result()?;
            Ok(priority_above(caller, greatest))
        })()
        .during(|| "reading the call stream's priority".into())?;
        if slot.as_ref().is_some_and(|s| s.priority != priority) {
            // Queued work on the old stream still completes (see `Drop`).
            *slot = None;
        }
        if slot.is_none() {
            let create = || -> std::result::Result<Side, cudarc::driver::DriverError> {
                let (ready, done) = (ctx.new_event(None)?, ctx.new_event(None)?);
                let raw = stream::create_with_priority(stream::StreamKind::NonBlocking, priority)?;
                // SAFETY: `raw` is a live stream of `ctx` (bound above), just created; `Side`
                // owns it and destroys it only in its `Drop`, and every wrapper of it (this one
                // and the clones cudarc buffers keep while queued on it) lives in `Side` or is
                // dropped within the backward call that queued it. Work on it is ordered against
                // the call's stream by `ready` and `done`.
                let stream = unsafe { ctx.wrap_borrowed_stream(raw) };
                Ok(Side { stream, ready, done, priority })
            };
            *slot = Some(create().during(|| "creating the backward's dW stream".into())?);
        }
        Ok(slot.as_ref().unwrap())
    }
}

impl Drop for Side {
    fn drop(&mut self) {
        let _ = self.stream.context().bind_to_thread();
        // SAFETY: the stream was created by `Side::of` and is destroyed only here; the wrapper
        // does not destroy it. Work still queued on it completes first (the driver releases the
        // stream's resources after it).
        let _ = unsafe { cudarc::driver::result::stream::destroy(self.stream.cu_stream()) };
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
    /// The active rows' compaction (`active.rs`).
    pub active: crate::active::ActiveWs,
    /// Created by the first backward that overlaps `dW` with `dh` ([`Side::of`]); kept for the
    /// `LmHead`'s life.
    pub side: Option<Side>,
}

impl Workspace {
    pub fn new() -> Self {
        Self {
            src: Source::default(),
            partials: Grow::new("forward partials"),
            row_state: Grow::new("row states"),
            status: Grow::new("status word"),
            staging: Grow::per_call_zeroed("backward d-logits staging"),
            dh_acc: Grow::per_call("dh f32 accumulator"),
            active: Default::default(),
            side: None,
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
        self.partials.bytes()
            + self.row_state.bytes()
            + self.status.bytes()
            + self.staging.bytes()
            + self.dh_acc.bytes()
            + self.active.bytes()
    }

    pub fn release(&mut self) {
        self.partials.release();
        self.row_state.release();
        self.status.release();
        self.staging.release();
        self.dh_acc.release();
        self.active.release();
    }

    /// The end of a call: lent buffers record their last use; the per-call ones (and every
    /// buffer of a captured call) go back.
    pub fn end_call(&mut self) {
        self.src.capture = false;
        self.partials.end_call();
        self.row_state.end_call();
        self.status.end_call();
        self.staging.end_call();
        self.dh_acc.end_call();
        self.active.end_call();
    }
}

impl Default for Workspace {
    fn default() -> Self {
        Self::new()
    }
}

/// The workspace of one call: holds the lock for the whole call (calls on one `LmHead` are
/// serialised) and ends the call for lent buffers when dropped, also on error.
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

#[cfg(test)]
mod tests {
    use super::priority_above;

    #[test]
    fn the_side_stream_is_one_step_above_the_callers_and_no_higher_than_the_device_allows() {
        // The H200's range: 0 (least, the default) to -5 (greatest).
        assert_eq!(priority_above(0, -5), -1);
        assert_eq!(priority_above(-3, -5), -4);
        assert_eq!(priority_above(-5, -5), -5);
        // A device without priorities (range 0 … 0).
        assert_eq!(priority_above(0, 0), 0);
        assert_eq!(priority_above(i32::MIN, -5), -5);
    }
}
