//! The buffer arguments of every launch: a device address, an element count and cudarc's sync
//! guard ([`Dev`]), checked to belong to the stream's context; token labels of either width.

use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use lmhead_core::params::{LABELS_I32, LABELS_I64};

use crate::error::{Error, Result};

/// A device buffer argument, checked to belong to the stream's context.
pub struct Dev<'a> {
    pub ptr: u64,
    pub len: usize,
    pub what: &'static str,
    _sync: Option<SyncOnDrop<'a>>,
}

fn same_context(a: &CudaStream, b: &CudaStream) -> bool {
    a.context().cu_ctx() == b.context().cu_ctx()
}

/// A buffer the kernel reads.
pub fn dev_in<'a, T>(buf: &'a (impl DevicePtr<T> + ?Sized), stream: &'a CudaStream, what: &'static str) -> Result<Dev<'a>> {
    if !same_context(buf.stream(), stream) {
        return Err(Error::WrongContext { what });
    }
    let len = buf.len();
    let (ptr, sync) = buf.device_ptr(stream);
    Ok(Dev { ptr, len, what, _sync: Some(sync) })
}

/// A buffer the kernel writes.
pub fn dev_out<'a, T>(buf: &'a mut (impl DevicePtrMut<T> + ?Sized), stream: &'a CudaStream, what: &'static str) -> Result<Dev<'a>> {
    if !same_context(buf.stream(), stream) {
        return Err(Error::WrongContext { what });
    }
    let len = buf.len();
    let (ptr, sync) = buf.device_ptr_mut(stream);
    Ok(Dev { ptr, len, what, _sync: Some(sync) })
}

impl Dev<'_> {
    /// What validation sees of this buffer (`elem` bytes per element).
    pub fn buf(&self, elem: usize) -> crate::validate::Buf {
        crate::validate::Buf::new(self.what, self.ptr, self.len, elem)
    }

    /// Elements `[start, start + len)` of this buffer (`elem` bytes each), for a kernel that
    /// writes or reads part of it. The parent's guard keeps ordering the whole buffer.
    pub fn sub(&self, start: usize, len: usize, elem: usize) -> Result<Dev<'_>> {
        if start + len > self.len {
            return Err(Error::Length { what: self.what, expected: start + len, got: self.len });
        }
        Ok(Dev { ptr: self.ptr + (start * elem) as u64, len, what: self.what, _sync: None })
    }

    /// At least `n` elements, and aligned to `align` bytes.
    pub fn check(&self, n: usize, align: usize) -> Result<u64> {
        if self.len < n {
            return Err(Error::Length { what: self.what, expected: n, got: self.len });
        }
        if !self.ptr.is_multiple_of(align as u64) {
            return Err(Error::Misaligned { what: self.what, align });
        }
        Ok(self.ptr)
    }

    /// Exactly `n` elements (user-facing buffers: a longer buffer is usually a shape mistake).
    pub fn check_exact(&self, n: usize, align: usize) -> Result<u64> {
        // The element size plays no part in a length and alignment check.
        self.buf(1).exact(n, align)?;
        Ok(self.ptr)
    }
}

/// Token labels, `i32` or `i64`.
pub struct Labels<'a> {
    pub dev: Dev<'a>,
    pub kind: u32,
}

impl Labels<'_> {
    pub fn buf(&self) -> crate::validate::Buf {
        self.dev.buf(self.elem())
    }

    /// The labels of the first `n` rows.
    pub fn rows(&self, n: usize) -> Result<Labels<'_>> {
        Ok(Labels { dev: self.dev.sub(0, n, self.elem())?, kind: self.kind })
    }

    pub fn elem(&self) -> usize {
        if self.kind == LABELS_I64 {
            8
        } else {
            4
        }
    }
}

pub fn labels_i32<'a>(buf: &'a (impl DevicePtr<i32> + ?Sized), s: &'a CudaStream) -> Result<Labels<'a>> {
    Ok(Labels { dev: dev_in(buf, s, "labels")?, kind: LABELS_I32 })
}

pub fn labels_i64<'a>(buf: &'a (impl DevicePtr<i64> + ?Sized), s: &'a CudaStream) -> Result<Labels<'a>> {
    Ok(Labels { dev: dev_in(buf, s, "labels")?, kind: LABELS_I64 })
}
