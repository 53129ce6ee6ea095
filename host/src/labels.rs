//! The label check of a forward, and the status it reports on the device when the host may not
//! wait for it (under CUDA-graph capture, or on request).
//!
//! Three modes ([`LabelCheck`]):
//! - **`Sync`** (the default): one small kernel over the labels, then an 8-byte read of its
//!   verdict (a host synchronisation with the call's stream). A label outside `[0, v_total)`
//!   that is not `ignore_index` fails the call with [`Error::BadLabel`] (row and label) before
//!   anything is tuned or written.
//! - **`Deferred`**: the same kernel, writing its verdict into the `LmHead`'s label status, a
//!   small device buffer that lives as long as the `LmHead` (so a captured graph may write it at
//!   every replay); nothing waits for it. The call goes on: the merge writes NaN log-prob and
//!   entropy for every bad row (never a plausible number). [`LmHead::take_label_status`] reads the
//!   status later, on the host, and clears it. A call on a capturing stream runs `Sync` as
//!   `Deferred`.
//! - **`Off`**: no check; bad rows are NaN and nothing records them.
//!
//! The status is two words: a flag ([`lmhead_core::params::STATUS_BAD_LABEL`]) and the lowest
//! bad row, over every deferred check since the last [`LmHead::take_label_status`] (kept as an
//! atomic minimum, so several calls fold into one report). The bad label itself is not kept: a
//! read long after the call could not name it reliably (the labels may have changed since).

use std::sync::{Arc, Mutex};

use cudarc::driver::{sys, CudaStream};

use crate::borrowed::Borrowed;
use crate::error::{Context as _, Error, Result};
use crate::launch::{self, dev_out, Labels};
use crate::LmHead;

/// How a forward checks its labels (see the module docs of `labels.rs`; [`LmHead::take_label_status`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LabelCheck {
    /// Check before anything runs and fail the call with [`Error::BadLabel`]: one small kernel
    /// and an 8-byte synchronous read. Under CUDA-graph capture: [`LabelCheck::Deferred`].
    #[default]
    Sync,
    /// Check on the device without waiting: bad rows come out NaN and the lowest bad row is kept
    /// in the `LmHead`'s label status for [`LmHead::take_label_status`].
    Deferred,
    /// No check: bad rows come out NaN, nothing is recorded.
    Off,
}

impl LabelCheck {
    /// The mode a call runs: `Sync` becomes `Deferred` on a capturing stream.
    pub(crate) fn under(self, capturing: bool) -> Self {
        match self {
            LabelCheck::Sync if capturing => LabelCheck::Deferred,
            m => m,
        }
    }
}

/// Words of the label status: the flag word, the lowest bad row (`u32::MAX`: none), and two
/// spare words.
const WORDS: usize = 4;

/// The `LmHead`'s label status on the device, allocated on first use and freed with the
/// `LmHead`.
#[derive(Default)]
pub(crate) struct Status {
    ptr: Mutex<Option<u64>>,
}

/// Queue `status = [0, u32::MAX]` (no bad row) on the raw stream `stream`.
///
/// # Safety
/// `ptr` must be a live status buffer of [`WORDS`] words in the stream's context, not used by
/// anything that races with work queued on `stream`.
unsafe fn clear(ptr: u64, stream: sys::CUstream) -> std::result::Result<(), cudarc::driver::DriverError> {
    // SAFETY: forwarded to the caller: both words are inside the buffer.
    unsafe {
        sys::cuMemsetD32Async(ptr, 0, 1, stream).result()?;
        sys::cuMemsetD32Async(ptr + 4, u32::MAX, 1, stream).result()
    }
}

impl Status {
    /// The buffer's address, allocated and cleared on first use. The allocation runs in relaxed
    /// capture mode and clears on a private stream it then waits for, so that it also works when
    /// the first deferred check is captured (the clear must not become part of the graph, which
    /// would clear the status at every replay).
    fn get(&self, stream: &CudaStream) -> Result<u64> {
        let mut slot = self.ptr.lock().unwrap();
        if let Some(p) = *slot {
            return Ok(p);
        }
        stream.context().bind_to_thread().during(|| "binding the context".into())?;
        let ptr = crate::capture::relaxed(|| {
            // SAFETY: a plain allocation of WORDS u32 in the bound context.
            let ptr = unsafe { cudarc::driver::result::malloc_sync(WORDS * 4) }.during(|| "allocating the label status".into())?;
            let init = || -> std::result::Result<(), cudarc::driver::DriverError> {
                let s = cudarc::driver::result::stream::create(cudarc::driver::result::stream::StreamKind::NonBlocking)?;
                // SAFETY: `ptr` was just allocated with WORDS words and nothing else knows it;
                // `s` is a live stream of the bound context, waited for and destroyed here.
                unsafe {
                    let r = clear(ptr, s).and_then(|_| cudarc::driver::result::stream::synchronize(s));
                    cudarc::driver::result::stream::destroy(s)?;
                    r
                }
            };
            if let Err(source) = init() {
                // SAFETY: `ptr` is ours and unused (its clear failed or completed).
                let _ = unsafe { cudarc::driver::result::free_sync(ptr) };
                return Err(Error::Driver { during: "clearing the label status".into(), source });
            }
            Ok(ptr)
        })?;
        *slot = Some(ptr);
        Ok(ptr)
    }

    /// The allocated buffer, if any.
    fn current(&self) -> Option<u64> {
        *self.ptr.lock().unwrap()
    }
}

impl Drop for Status {
    fn drop(&mut self) {
        if let Some(p) = self.ptr.get_mut().ok().and_then(|p| p.take()) {
            // SAFETY: the buffer was allocated by `get` and is freed once, here; `cuMemFree`
            // waits for the work that may still write it.
            let _ = unsafe { cudarc::driver::result::free_sync(p) };
        }
    }
}

impl LmHead {
    /// The deferred label check of a forward: the check kernel over `t` labels into the label
    /// status, nothing read back (see the module docs of `labels.rs`).
    pub(crate) fn check_labels_deferred(
        &self,
        stream: &Arc<CudaStream>,
        labels: &Labels,
        t: usize,
        v_total: usize,
        ignore_index: i64,
    ) -> Result<()> {
        let ptr = self.label_status.get(stream)?;
        // SAFETY: `ptr` is the label status (WORDS u32 of this head's context), alive as long as
        // `self`; the check kernel only ORs the flag and lowers the row with atomics, so calls
        // on other streams that write it concurrently do not race.
        let mut status = unsafe { Borrowed::<u32>::new(ptr, 2, stream) };
        let sd = dev_out(&mut status, stream, "label status")?;
        launch::check_labels(&self.gpu, stream, t, (v_total as i64, ignore_index), labels, &sd)
    }

    /// Read and clear what the deferred label checks found since the last call: `Ok(())` when
    /// every label was good, [`Error::BadLabel`] with the lowest bad row (and no label) when one
    /// was not. The read is ordered after the work queued on `stream` (order calls on other
    /// streams before it, e.g. by a device synchronisation) and waits for it: not on a
    /// capturing stream ([`Error::Capture`]).
    pub fn take_label_status(&self, stream: &Arc<CudaStream>) -> Result<()> {
        self.check_stream(stream)?;
        let Some(ptr) = self.label_status.current() else { return Ok(()) };
        if crate::capture::capturing(stream)? {
            return Err(Error::Capture("the label status cannot be read under CUDA-graph capture (read it after a replay)".into()));
        }
        // SAFETY: as in `check_labels_deferred`; read here and cleared after the read.
        let words = unsafe { Borrowed::<u32>::new(ptr, 2, stream) };
        let flags = stream.clone_dtoh(&words).during(|| "reading the label status".into())?;
        // SAFETY: the status buffer (above); the clear is queued after the read on `stream`.
        unsafe { clear(ptr, stream.cu_stream()) }.during(|| "clearing the label status".into())?;
        if flags[0] & lmhead_core::params::STATUS_BAD_LABEL == 0 {
            return Ok(());
        }
        Err(Error::BadLabel { row: (flags[1] != u32::MAX).then_some(flags[1] as usize), label: None })
    }
}
