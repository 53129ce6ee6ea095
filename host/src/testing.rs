//! Helpers for tests and benchmarks: poisoning buffers, uploading generated cases.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, DeviceRepr};

use crate::error::{Context as _, Result};

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
