//! From `lmhead::Error` to Python exceptions, and the callbacks' pending exception.
//!
//! Five native classes, each a subclass of the built-in a caller expects, with a `kind`
//! attribute naming the library's variant (`"shape"`, `"length"`, `"misaligned"`,
//! `"temperature"`, `"bad_label"`, `"invalid"`, `"wrong_context"`, `"config"`, `"oom"`,
//! `"driver"`, `"comm"`, `"capture"`, `"no_driver"`, `"unsupported_device"`):
//!
//! | class | base | variants |
//! |---|---|---|
//! | `InputError` | `ValueError` | `Shape`, `Length`, `Misaligned`, `Temperature`, `BadLabel`, `Invalid`, `WrongContext` |
//! | `DeviceMemoryError` | `MemoryError` | `OutOfMemory`, a driver call failing with `CUDA_ERROR_OUT_OF_MEMORY` |
//! | `UnavailableError` | `RuntimeError` | `NoDriver`, `UnsupportedDevice` (fall back to another implementation) |
//! | `DeviceError` | `RuntimeError` | `Driver`, `Config`, `Capture` (something a call under CUDA-graph capture cannot do) |
//! | `CommError` | `RuntimeError` | `Comm` |
//!
//! The Python package re-raises `DeviceMemoryError` as `torch.cuda.OutOfMemoryError`.

use std::cell::RefCell;

use lmhead::Error;
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(lmhead_torch._native, InputError, PyValueError, "A bad shape, length, alignment, option or label.");
pyo3::create_exception!(lmhead_torch._native, DeviceMemoryError, PyMemoryError, "Out of device memory.");
pyo3::create_exception!(
    lmhead_torch._native,
    UnavailableError,
    PyRuntimeError,
    "No CUDA driver, or a GPU the library does not support: use another implementation."
);
pyo3::create_exception!(lmhead_torch._native, DeviceError, PyRuntimeError, "A CUDA driver call or kernel config failed.");
pyo3::create_exception!(lmhead_torch._native, CommError, PyRuntimeError, "The tensor-parallel all-reduce failed.");

pub fn register(py: Python<'_>, m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("InputError", py.get_type::<InputError>())?;
    m.add("DeviceMemoryError", py.get_type::<DeviceMemoryError>())?;
    m.add("UnavailableError", py.get_type::<UnavailableError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("CommError", py.get_type::<CommError>())?;
    Ok(())
}

/// The variant's name, as the `kind` attribute carries it.
pub fn kind(e: &Error) -> &'static str {
    match e {
        Error::NoDriver => "no_driver",
        Error::UnsupportedDevice { .. } => "unsupported_device",
        Error::Shape(_) => "shape",
        Error::Length { .. } => "length",
        Error::Misaligned { .. } => "misaligned",
        Error::Temperature(_) => "temperature",
        Error::BadLabel { .. } => "bad_label",
        Error::Invalid(_) => "invalid",
        Error::WrongContext { .. } => "wrong_context",
        Error::Config(_) => "config",
        Error::OutOfMemory { .. } => "oom",
        Error::Driver { source, .. } if is_oom(source) => "oom",
        Error::Driver { .. } => "driver",
        Error::Comm(_) => "comm",
        Error::Capture(_) => "capture",
    }
}

fn is_oom(e: &lmhead::cudarc::driver::DriverError) -> bool {
    e.0 == lmhead::cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

/// The Python exception for a library error.
pub fn into_pyerr(py: Python<'_>, e: Error) -> PyErr {
    let k = kind(&e);
    let msg = format!("lmhead: {e}");
    let err = match k {
        "no_driver" | "unsupported_device" => UnavailableError::new_err(msg),
        "shape" | "length" | "misaligned" | "temperature" | "bad_label" | "invalid" | "wrong_context" => InputError::new_err(msg),
        "oom" => DeviceMemoryError::new_err(msg),
        "comm" => CommError::new_err(msg),
        _ => DeviceError::new_err(msg),
    };
    let _ = err.value(py).setattr("kind", k);
    if let Error::BadLabel { row, label } = e {
        let _ = err.value(py).setattr("row", row);
        let _ = err.value(py).setattr("label", label);
    }
    err
}

thread_local! {
    /// The first exception a Python callback raised during the current call on this thread
    /// (callbacks run on the calling thread: the library calls them synchronously).
    static PENDING: RefCell<Option<PyErr>> = const { RefCell::new(None) };
}

/// Keep a callback's exception for the end of the call (the first one wins).
pub fn stash(e: PyErr) {
    PENDING.with(|p| {
        let mut p = p.borrow_mut();
        if p.is_none() {
            *p = Some(e);
        }
    });
}

/// The pending callback exception, if any (clears it).
pub fn take_pending() -> Option<PyErr> {
    PENDING.with(|p| p.borrow_mut().take())
}
