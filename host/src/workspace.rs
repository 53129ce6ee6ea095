//! Scratch device buffers owned by the library: forward partials, row states, the status word,
//! the backward staging buffer and the f32 `dh` accumulator. They grow on demand, are reused
//! across calls, and are never the caller's buffers. `LmHead::release_workspace` frees them.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use lmhead_core::params::Partial;

use crate::error::{Error, Result};

/// Device representation of a forward partial (16 bytes, 16-byte aligned).
#[repr(transparent)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PartialRepr(pub Partial);

/// One growable buffer.
pub struct Grow<T> {
    buf: Option<CudaSlice<T>>,
    what: &'static str,
}

impl<T: DeviceRepr + ValidAsZeroBits> Grow<T> {
    pub const fn new(what: &'static str) -> Self {
        Self { buf: None, what }
    }

    /// A buffer of at least `len` elements (zeroed when newly allocated).
    pub fn get(&mut self, stream: &Arc<CudaStream>, len: usize) -> Result<&mut CudaSlice<T>> {
        let len = len.max(1);
        if self.buf.as_ref().is_none_or(|b| b.len() < len) {
            self.buf = None; // free the old one first
            let b =
                stream.alloc_zeros::<T>(len).map_err(|_| Error::OutOfMemory { what: self.what, bytes: len * std::mem::size_of::<T>() })?;
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
}

/// All scratch buffers of one `LmHead`.
pub struct Workspace {
    pub partials: Grow<PartialRepr>,
    pub row_state: Grow<f32>,
    pub status: Grow<u32>,
    pub staging: Grow<half::bf16>,
    pub dh_acc: Grow<f32>,
    /// K-major copies for the Hopper backward GEMMs: stagingᵀ, the `W` chunk ᵀ, `h`ᵀ.
    pub staging_t: Grow<half::bf16>,
    pub w_chunk_t: Grow<half::bf16>,
    pub h_t: Grow<half::bf16>,
}

impl Workspace {
    pub const fn new() -> Self {
        Self {
            partials: Grow::new("forward partials"),
            row_state: Grow::new("row states"),
            status: Grow::new("status word"),
            staging: Grow::new("backward d-logits staging"),
            dh_acc: Grow::new("dh f32 accumulator"),
            staging_t: Grow::new("transposed staging"),
            w_chunk_t: Grow::new("transposed W chunk"),
            h_t: Grow::new("transposed h"),
        }
    }

    /// Bytes currently held.
    pub fn bytes(&self) -> usize {
        self.partials.bytes()
            + self.row_state.bytes()
            + self.status.bytes()
            + self.staging.bytes()
            + self.dh_acc.bytes()
            + self.staging_t.bytes()
            + self.w_chunk_t.bytes()
            + self.h_t.bytes()
    }

    pub fn release(&mut self) {
        self.partials.release();
        self.row_state.release();
        self.status.release();
        self.staging.release();
        self.dh_acc.release();
        self.staging_t.release();
        self.w_chunk_t.release();
        self.h_t.release();
    }
}

impl Default for Workspace {
    fn default() -> Self {
        Self::new()
    }
}
