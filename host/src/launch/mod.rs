//! The only place that launches kernels. Every launch function here is safe: it receives its
//! buffers as [`Dev`] arguments (address, element count, cudarc's sync guard), checks every
//! bound the kernel relies on against the shape, and only then launches. The SAFETY notes answer
//! cudarc's three launch hazards:
//! - **types**: the kernel's single parameter is the `#[repr(C)]` struct from `lmhead_core::params`
//!   that the device entry takes by value (the same definition on both sides);
//! - **writes**: outputs come from `DevicePtrMut` (exclusive borrows), and cudarc's guards order
//!   them after earlier work on other streams;
//! - **bounds**: the length checks in each function cover every element the kernel touches for
//!   the launched grid (the kernels mask rows ≥ t, columns ≥ v and K tails).
//!
//! Files by job: `buffers` (the checked buffer arguments every launch takes), `tmap` (tensor maps
//! of the sm90 configs), `tiles` (the tuned tile kernels: forward mainloop, d-logits, backward
//! GEMMs, and their launch plans), `rows` (per-row kernels: label check, merges, cast, the naive
//! forward), `compact` (the active rows' count, placement and row maps), `units` (unit kernels
//! for the GPU tests, with the `testing` feature).

mod buffers;
mod compact;
mod rows;
mod tiles;
mod tmap;
// The unit kernels exist for the GPU tests only.
#[cfg(feature = "testing")]
mod units;

pub use buffers::*;
pub use compact::*;
pub use rows::*;
pub use tiles::*;
#[cfg(feature = "testing")]
pub use units::*;

use cudarc::driver::{CudaStream, DeviceRepr, LaunchConfig, PushKernelArg};
use lmhead_core::params::{CastParams, CompactParams, GemmParams, LogitsParams, MergeParams, NaiveParams, RowMapParams, UnitParams};

use crate::device::Gpu;
use crate::error::{Context as _, Result};

/// A kernel parameter struct passed by value.
#[repr(transparent)]
#[derive(Clone, Copy)]
pub(crate) struct Arg<T>(T);
// SAFETY: each of these is a `#[repr(C)]` plain-old-data struct of integers and floats, the exact
// type the device entry point declares as its one by-value parameter.
unsafe impl DeviceRepr for Arg<LogitsParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<GemmParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<MergeParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<CastParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<NaiveParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<UnitParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<CompactParams> {}
// SAFETY: as above.
unsafe impl DeviceRepr for Arg<RowMapParams> {}
// SAFETY: `Partial` is `#[repr(C, align(16))]` of four f32; any bit pattern is valid.
unsafe impl DeviceRepr for crate::workspace::PartialRepr {}
// SAFETY: zero bits are four 0.0 f32.
unsafe impl cudarc::driver::ValidAsZeroBits for crate::workspace::PartialRepr {}

pub(crate) fn launch<T: Copy>(gpu: &Gpu, stream: &CudaStream, name: &str, smem: u32, grid: (u32, u32), threads: u32, p: T) -> Result<()>
where
    Arg<T>: DeviceRepr,
{
    let f = gpu.function(name, smem)?;
    let cfg = LaunchConfig { grid_dim: (grid.0, grid.1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: smem };
    let arg = Arg(p);
    let mut b = stream.launch_builder(&f);
    b.arg(&arg);
    // SAFETY: see the module docs; every caller checked the bounds of the buffers in `p` for
    // this grid, and `name`'s entry takes exactly `T` by value.
    unsafe { b.launch(cfg) }.during(|| format!("launching `{name}` grid {grid:?}"))?;
    Ok(())
}
