//! Whether a stream is being captured into a CUDA graph: work queued on it then is recorded, not
//! run, so nothing that needs a result back (a tuning trial's timing, a synchronous read) may
//! be queued on it.

use cudarc::driver::sys::{cuStreamIsCapturing, CUstreamCaptureStatus};

use crate::error::Context as _;

/// `true` while `stream` is being captured (also when its capture was invalidated and not yet
/// ended).
pub(crate) fn capturing(stream: &cudarc::driver::CudaStream) -> crate::Result<bool> {
    stream.context().bind_to_thread().during(|| "binding the context to ask about stream capture".into())?;
    let mut status = CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    // SAFETY: `stream.cu_stream()` is the live stream `stream` owns (it outlives this call), its
    // context is bound to this thread above, and `status` is a valid, writable
    // `CUstreamCaptureStatus` for the driver to store its answer in.
    unsafe { cuStreamIsCapturing(stream.cu_stream(), &mut status) }
        .result()
        .during(|| "asking whether the stream is being captured".into())?;
    Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}
