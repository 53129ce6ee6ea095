//! CUDA-graph capture: whether a call's stream is capturing, and the one-off allocations a
//! capture may still need.
//!
//! A stream that is capturing records its work into a graph instead of running it, and the
//! graph replays that work later, as recorded: every kernel parameter, memcpy source and device
//! address is baked in. So under capture the library must not read anything back to the host
//! (the label check's verdict, a tuning trial's timing), must not copy from host memory that
//! will not hold the same bytes at every replay (a tensor map in a temporary `Vec`), and must not
//! hand a graph memory it may later free or move (the forward's buffers kept across calls).

use cudarc::driver::{sys, CudaStream};

use crate::error::{Error, Result};

/// Whether `stream` is capturing a CUDA graph (also when the capture was invalidated by an
/// earlier error: nothing may run on it then either).
pub(crate) fn capturing(stream: &CudaStream) -> Result<bool> {
    stream.context().bind_to_thread().map_err(|source| Error::Driver { during: "binding the context".into(), source })?;
    let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `stream` is a live stream of its context (bound above), `status` a writable
    // capture-status cell the driver fills.
    let r = unsafe { sys::cuStreamIsCapturing(stream.cu_stream(), &mut status) };
    r.result().map_err(|source| Error::Driver { during: "asking whether the stream is capturing".into(), source })?;
    Ok(status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Run `f` with this thread's capture mode set to relaxed, then restore it: the one-off
/// allocations a capture may need (pinned host memory, `cuMemAlloc`) are "potentially unsafe"
/// calls, which a capture begun in global or thread-local mode refuses. `f` must not touch a
/// capturing stream: what it allocates is used by later, captured work only.
pub(crate) fn relaxed<T>(f: impl FnOnce() -> Result<T>) -> Result<T> {
    let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
    // SAFETY: `mode` is a writable cell; the call swaps this thread's mode with it.
    unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }
        .result()
        .map_err(|source| Error::Driver { during: "relaxing the capture mode".into(), source })?;
    let out = f();
    // SAFETY: as above; this puts the thread's previous mode back.
    let restored = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result();
    let out = out?;
    restored.map_err(|source| Error::Driver { during: "restoring the capture mode".into(), source })?;
    Ok(out)
}
