//! The library's one error type. Every bad input is answered with one of these before anything
//! is launched; device failures are wrapped with what was being done.

use lmhead_core::ShapeError;

/// Everything that can go wrong in a call.
#[derive(Debug)]
pub enum Error {
    /// No CUDA driver library on this machine (use the CPU backend).
    NoDriver,
    /// The device is older than the kernels support (compute capability below 8.0: the
    /// tensor-core instructions, `cp.async` and bf16 need sm_80).
    UnsupportedDevice { name: String, cc: (i32, i32) },
    /// A bad problem shape.
    Shape(ShapeError),
    /// A buffer's length does not match the shape.
    Length { what: &'static str, expected: usize, got: usize },
    /// A device pointer is not aligned as the kernels need.
    Misaligned { what: &'static str, align: usize },
    /// Temperature must be finite and > 0.
    Temperature(f32),
    /// Labels outside `[0, v_total)` that are not `ignore_index` (first offending row, if known).
    BadLabel { row: Option<usize>, label: Option<i64> },
    /// An option or combination of arguments that makes no sense (e.g. an entropy gradient
    /// without the saved entropy).
    Invalid(String),
    /// A buffer belongs to another CUDA context than the stream.
    WrongContext { what: &'static str },
    /// A config that was not compiled, or that this device cannot run for this problem.
    Config(String),
    /// Out of device memory while allocating a workspace of `bytes`.
    OutOfMemory { what: &'static str, bytes: usize },
    /// A CUDA driver call failed.
    Driver { during: String, source: cudarc::driver::DriverError },
    /// The tensor-parallel communicator failed.
    Comm(String),
    /// Something a call on a stream that is capturing a CUDA graph cannot do (a host read, a
    /// tuning trial); it says what to do instead.
    Capture(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Error::NoDriver => write!(f, "no CUDA driver found (libcuda); use the CPU backend"),
            Error::UnsupportedDevice { name, cc } => {
                write!(
                    f,
                    "{name} (compute capability {}.{}) is not supported: the kernels need compute capability 8.0 or later \
                     (Ampere, Ada, Hopper, Blackwell: bf16 mma.sync, cp.async); use the CPU backend or another implementation",
                    cc.0, cc.1
                )
            }
            Error::Shape(e) => write!(f, "bad shape: {e}"),
            Error::Length { what, expected, got } => write!(f, "{what} has {got} elements, the shape needs {expected}"),
            Error::Misaligned { what, align } => write!(f, "{what} is not {align}-byte aligned"),
            Error::Temperature(t) => write!(f, "temperature must be finite and > 0, got {t}"),
            Error::BadLabel { row, label } => match (row, label) {
                (Some(r), Some(l)) => write!(f, "label {l} of row {r} is outside [0, vocab) and is not ignore_index"),
                (Some(r), None) => write!(
                    f,
                    "the label of row {r} (the lowest such row) is outside [0, vocab) and is not ignore_index (those rows are NaN)"
                ),
                _ => write!(f, "some label is outside [0, vocab) and is not ignore_index (those rows are NaN)"),
            },
            Error::Invalid(s) => write!(f, "invalid arguments: {s}"),
            Error::WrongContext { what } => write!(f, "{what} lives in another CUDA context than the stream"),
            Error::Config(s) => write!(f, "config: {s}"),
            Error::OutOfMemory { what, bytes } => write!(f, "out of device memory allocating {what} ({bytes} bytes)"),
            Error::Driver { during, source } => {
                write!(f, "CUDA error while {during}: {source}")?;
                match driver_hint(source) {
                    Some(h) => write!(f, " ({h})"),
                    None => Ok(()),
                }
            }
            Error::Comm(s) => write!(f, "communicator: {s}"),
            Error::Capture(s) => write!(f, "under CUDA-graph capture: {s}"),
        }
    }
}

/// What to change, for a driver error whose cause is the caller's set-up.
fn driver_hint(e: &cudarc::driver::DriverError) -> Option<&'static str> {
    // cudarc's per-slice event tracking waits, on every use of a `CudaSlice`, for the event of
    // its last write; recorded before a capture, CUDA refuses that wait from the capturing stream.
    (e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION).then_some(
        "a stream being captured waited on work outside the capture: with `CudaSlice` buffers, turn the context's \
         event tracking off before allocating them (`CudaContext::disable_event_tracking`), or pass `lmhead::Borrowed` buffers",
    )
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Driver { source, .. } => Some(source),
            _ => None,
        }
    }
}

impl From<ShapeError> for Error {
    fn from(e: ShapeError) -> Self {
        Error::Shape(e)
    }
}

/// Attach what was being done to a driver error.
pub(crate) trait Context<T> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T>;
}

impl<T> Context<T> for std::result::Result<T, cudarc::driver::DriverError> {
    fn during(self, what: impl FnOnce() -> String) -> Result<T> {
        self.map_err(|source| Error::Driver { during: what(), source })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_capture_isolation_error_says_what_to_change() {
        // (The error's own text comes from the driver, absent here: only the hint is checked.)
        use cudarc::driver::{sys::CUresult, DriverError};
        let h = driver_hint(&DriverError(CUresult::CUDA_ERROR_STREAM_CAPTURE_ISOLATION)).unwrap();
        assert!(h.contains("disable_event_tracking") && h.contains("lmhead::Borrowed"), "{h}");
        assert_eq!(driver_hint(&DriverError(CUresult::CUDA_ERROR_INVALID_VALUE)), None);
    }

    #[test]
    fn an_unsupported_device_says_what_is_needed() {
        // What `Gpu::from_context` returns below compute capability 8.0 (`Module::for_device`).
        assert_eq!(lmhead_core::config::Module::for_device((7, 0)), None);
        let e = Error::UnsupportedDevice { name: "Tesla V100-SXM2-16GB".into(), cc: (7, 0) };
        let msg = e.to_string();
        assert!(msg.contains("Tesla V100") && msg.contains("7.0") && msg.contains("8.0 or later"), "{msg}");
    }
}
