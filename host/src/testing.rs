//! Helpers for tests and benchmarks: poisoning buffers, uploading generated cases, and the
//! launch plans' measurement overrides (which only a bench or a test sets).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, DeviceRepr};

use crate::error::{Context as _, Error, Result};
#[cfg(feature = "testing")]
pub use crate::plan::overrides::{set_plan_overrides, PlanOverrides, PLAN_OVERRIDE_VARS};

/// Whether `stream` is being captured into a CUDA graph, as the tuner asks before it times
/// anything (`capture::capturing`).
#[cfg(feature = "testing")]
pub fn stream_capturing(stream: &CudaStream) -> Result<bool> {
    crate::capture::capturing(stream)
}

/// Fill a buffer with 0xFF bytes: NaN as f32 and as bf16, −1 as integers. An element a kernel
/// fails to write stays NaN and fails the checks.
pub fn poison<T>(stream: &CudaStream, buf: &mut (impl DevicePtrMut<T> + ?Sized)) -> Result<()> {
    let bytes = buf.num_bytes();
    let (ptr, _sync) = buf.device_ptr_mut(stream);
    // SAFETY: `ptr` addresses `bytes` bytes of a live allocation (the slice), written in stream
    // order; every bit pattern is valid for the float and integer element types used here.
    unsafe { cudarc::driver::result::memset_d8_async(ptr, 0xFF, bytes, stream.cu_stream()) }.during(|| "poisoning a buffer".into())
}

/// Upload bf16 bit patterns as a `CudaSlice<bf16>`.
pub fn upload_bf16(stream: &Arc<CudaStream>, bits: &[u16]) -> Result<CudaSlice<half::bf16>> {
    let v: Vec<half::bf16> = bits.iter().map(|&b| half::bf16::from_bits(b)).collect();
    stream.clone_htod(&v).during(|| "uploading bf16 data".into())
}

/// `n` bf16 values `N(0, scale²)`-ish from `seed`, generated on the host for one block of at
/// most 2²⁰ values and repeated on the device by doubling copies: scratch data for tuning and
/// warm-up (hundreds of millions of values) in milliseconds rather than the tens of seconds a
/// host generator takes. Rows repeat with period 2²⁰ values, irrelevant to a kernel's speed.
pub fn random_bf16_tiled(stream: &Arc<CudaStream>, n: usize, scale: f64, seed: u64) -> Result<CudaSlice<half::bf16>> {
    const BLOCK: usize = 1 << 20;
    let mut r = lmhead_reference::rng::Rng::new(seed);
    let block: Vec<half::bf16> = (0..n.min(BLOCK)).map(|_| half::bf16::from_f64(r.normal() * scale)).collect();
    let mut buf = stream.alloc_zeros::<half::bf16>(n.max(1)).map_err(|_| Error::OutOfMemory { what: "scratch data", bytes: 2 * n })?;
    if n == 0 {
        return Ok(buf);
    }
    stream.memcpy_htod(&block, &mut buf.slice_mut(0..block.len())).during(|| "uploading scratch data".into())?;
    let mut filled = block.len();
    while filled < n {
        let len = filled.min(n - filled);
        let (done, mut rest) = buf.split_at_mut(filled);
        stream.memcpy_dtod(&done.slice(0..len), &mut rest.slice_mut(0..len)).during(|| "repeating scratch data".into())?;
        filled += len;
    }
    Ok(buf)
}

/// `n` zeroed elements on the device; an allocation failure is [`Error::OutOfMemory`] naming
/// `what`.
pub fn zeros<T: DeviceRepr + cudarc::driver::ValidAsZeroBits>(stream: &Arc<CudaStream>, n: usize, what: &'static str) -> Result<CudaSlice<T>> {
    crate::workspace::zeros(stream, n, what)
}

/// Upload any plain slice.
pub fn upload<T: DeviceRepr + Clone>(stream: &Arc<CudaStream>, x: &[T]) -> Result<CudaSlice<T>> {
    stream.clone_htod(x).during(|| "uploading data".into())
}

/// Download to f64.
pub fn download_f32(stream: &Arc<CudaStream>, x: &CudaSlice<f32>) -> Result<Vec<f64>> {
    Ok(stream.clone_dtoh(x).during(|| "downloading f32 data".into())?.into_iter().map(|v| v as f64).collect())
}

/// Download bf16 to f64.
pub fn download_bf16(stream: &Arc<CudaStream>, x: &CudaSlice<half::bf16>) -> Result<Vec<f64>> {
    Ok(stream.clone_dtoh(x).during(|| "downloading bf16 data".into())?.into_iter().map(|v| v.to_f64()).collect())
}
