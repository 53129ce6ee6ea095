//! The library's callback traits implemented with Python callables: the tensor-parallel
//! all-reduce on device memory ([`lmhead::tp::Communicator`]) and on host memory
//! ([`lmhead::cpu::HostComm`]), and workspace allocation ([`lmhead::ScratchAlloc`]).
//!
//! Each callback takes the GIL for its duration (the library runs without it) and turns a
//! Python exception into a library error, keeping the exception itself to be re-raised when the
//! call returns (`errors::stash`).

use std::sync::Arc;

use lmhead::cudarc::driver::CudaStream;
use lmhead::tp::Communicator;
use lmhead::tp::Dev;
use lmhead::tp::ReduceOp;
use lmhead::{Error, Result};
use pyo3::prelude::*;

use crate::errors::stash;

/// The op code the Python callbacks receive: 0 MAX, 1 SUM.
fn op_code(op: ReduceOp) -> u8 {
    match op {
        ReduceOp::Max => 0,
        ReduceOp::Sum => 1,
    }
}

fn raw_stream(stream: &Arc<CudaStream>) -> u64 {
    stream.cu_stream() as usize as u64
}

/// A `torch.distributed` group seen through `all_reduce(address, len, op, stream)`: the Python
/// side wraps `len` f32 at `address` in a zero-copy tensor and all-reduces it in place on the
/// current stream (the call's stream).
pub struct PyComm {
    rank: usize,
    size: usize,
    cb: Py<PyAny>,
}

impl PyComm {
    pub fn new(rank: usize, size: usize, cb: Py<PyAny>) -> Self {
        Self { rank, size, cb }
    }
}

impl Communicator for PyComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce(&self, stream: &Arc<CudaStream>, buf: &Dev, op: ReduceOp) -> Result<()> {
        Python::attach(|py| {
            self.cb.call1(py, (buf.ptr, buf.len, op_code(op), raw_stream(stream))).map(|_| ()).map_err(|e| {
                let msg = format!("all-reduce of {} ({} f32) failed: {e}", buf.what, buf.len);
                stash(e);
                Error::Comm(msg)
            })
        })
    }
}

/// One rank alone: every all-reduce is the identity. Used for the tensor-parallel entry points
/// with a vocabulary larger than the rows held (labels that match no row).
pub struct NoComm;

impl Communicator for NoComm {
    fn rank(&self) -> usize {
        0
    }

    fn size(&self) -> usize {
        1
    }

    fn all_reduce(&self, _stream: &Arc<CudaStream>, _buf: &Dev, _op: ReduceOp) -> Result<()> {
        Ok(())
    }
}

/// A `torch.distributed` group for the CPU backend: `all_reduce(address, len, op)` over host
/// f64 memory (the Python side wraps it zero-copy with `torch.frombuffer`).
pub struct HostPyComm {
    #[allow(dead_code)]
    rank: usize,
    #[allow(dead_code)]
    size: usize,
    cb: Py<PyAny>,
}

impl HostPyComm {
    pub fn new(rank: usize, size: usize, cb: Py<PyAny>) -> Self {
        Self { rank, size, cb }
    }
}

impl lmhead::cpu::HostComm for HostPyComm {
    fn all_reduce(&self, buf: &mut [f64], op: ReduceOp) -> Result<()> {
        let (ptr, len) = (buf.as_mut_ptr() as usize as u64, buf.len());
        Python::attach(|py| {
            self.cb.call1(py, (ptr, len, op_code(op))).map(|_| ()).map_err(|e| {
                let msg = format!("host all-reduce of {len} f64 failed: {e}");
                stash(e);
                Error::Comm(msg)
            })
        })
    }
}

/// One host rank alone (identity all-reduce).
pub struct SingleHost;

impl lmhead::cpu::HostComm for SingleHost {
    fn all_reduce(&self, _buf: &mut [f64], _op: ReduceOp) -> Result<()> {
        Ok(())
    }
}

/// Workspace memory from PyTorch: `alloc(nbytes, stream) -> address`, a tensor the Python side
/// keeps until the library calls `free(address)`.
pub struct PyScratch {
    cb: Py<PyAny>,
}

impl PyScratch {
    pub fn new(cb: Py<PyAny>) -> Self {
        Self { cb }
    }
}

impl lmhead::ScratchAlloc for PyScratch {
    fn alloc(&self, bytes: usize, stream: &Arc<CudaStream>) -> Result<u64> {
        Python::attach(|py| {
            self.cb.call1(py, (bytes, raw_stream(stream))).and_then(|r| r.extract::<u64>(py)).map_err(|e| {
                stash(e);
                Error::OutOfMemory { what: "workspace (PyTorch allocator)", bytes }
            })
        })
    }

    fn free(&self, ptr: u64) {
        Python::attach(|py| {
            // Dropping a tensor cannot fail; an exception here would be a bug in `_TorchScratch`.
            if let Err(e) = self.cb.call_method1(py, "free", (ptr,)) {
                e.print(py);
            }
        })
    }
}
