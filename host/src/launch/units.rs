//! Launches of the unit kernels the GPU tests check the sm90 building blocks with: one TMA box,
//! one `wgmma` tile of each width (and with an MN-major B), one TMA-store epilogue.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use lmhead_core::config::fixed;
use lmhead_core::params::UnitParams;

use super::tmap::{tma_maps, TmaOperand};
use super::{launch, Dev};
use crate::device::Gpu;
use crate::error::{Error, Result};

/// Unit kernel `UNIT_TMA_COPY`: the box at `(k0, row0)` (`rows` rows × 64 bf16) of the bf16
/// matrix `src` (`src_rows` rows of `k` elements, `stride` apart), as the tensor memory
/// accelerator lays it out in shared memory, written to `out` (`rows · 64` bf16).
pub fn unit_tma_copy(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    (src, src_rows, k, stride): (&Dev, usize, usize, usize),
    (k0, row0, rows): (u32, u32, u32),
    out: &Dev,
) -> Result<()> {
    if rows == 0 || rows > 256 || rows % 8 != 0 {
        return Err(Error::Config(format!("unit TMA box of {rows} rows (1..=256, multiple of 8)")));
    }
    let a = TmaOperand { ptr: src.check(src_rows * stride, 16)?, rows: src_rows, cols: k, stride, box_rows: rows, f32: false };
    let (maps, tmaps) = tma_maps(stream, &[a])?;
    let p = UnitParams { tmaps, out: out.check(rows as usize * 64, 16)?, k0, row0, rows, _pad: 0 };
    launch(gpu, stream, fixed::UNIT_TMA_COPY, rows * 128 + 8, (1, 1), 128, p)?;
    drop(maps);
    Ok(())
}

/// Unit kernels `UNIT_WGMMA_N128` / `UNIT_WGMMA_N256`: `out[64][n] = a[64][64] · b[n][64]ᵀ` (bf16
/// in, f32 out) by one warpgroup, for `n` = 128 or 256.
pub fn unit_wgmma(gpu: &Gpu, stream: &Arc<CudaStream>, a: &Dev, b: &Dev, n: usize, out: &Dev) -> Result<()> {
    let name = match n {
        128 => fixed::UNIT_WGMMA_N128,
        256 => fixed::UNIT_WGMMA_N256,
        _ => return Err(Error::Config(format!("unit wgmma tile of {n} columns (128 or 256)"))),
    };
    let ta = unit_a_operand(a)?;
    let tb = TmaOperand::k_major(b.check(n * 64, 16)?, n, 64, 64, n as u16);
    let (maps, tmaps) = tma_maps(stream, &[ta, tb])?;
    let p = UnitParams { tmaps, out: out.check(64 * n, 8)?, ..Default::default() };
    launch(gpu, stream, name, ((64 + n) * 128 + 16) as u32, (1, 1), 128, p)?;
    drop(maps);
    Ok(())
}

/// Unit kernel: `C [64][128] = A · B` with `A [64][64]` K-major and `B [64][128]` stored
/// MN-major (`B[k][n]`), read by `wgmma` with `imm-trans-b`; the B descriptor gets the leading
/// and stride byte offsets `(lbo, sbo)`. `out`: `64 × 128` f32.
pub fn unit_wgmma_mn(gpu: &Gpu, stream: &Arc<CudaStream>, a: &Dev, b: &Dev, (lbo, sbo): (u32, u32), out: &Dev) -> Result<()> {
    let ta = unit_a_operand(a)?;
    let tb = TmaOperand::mn_major(b.check(64 * 128, 16)?, 64, 128, 128);
    let (maps, tmaps) = tma_maps(stream, &[ta, tb])?;
    let p = UnitParams { tmaps, out: out.check(64 * 128, 8)?, k0: lbo, row0: sbo, ..Default::default() };
    launch(gpu, stream, fixed::UNIT_WGMMA_MN_N128, 3 * 8192 + 16, (1, 1), 128, p)?;
    drop(maps);
    Ok(())
}

/// Unit kernel `UNIT_TMA_STORE`: one warpgroup stores two 64 × 64 tiles of 16-bit patterns
/// (element (r, c) of tile `i` is `4096·i + 64·r + c`) through the `tma_store` d-logits
/// epilogue into `out` (`rows × cols`, 16-bit), tile `i` at column `col0 + 64i`, row `row0`;
/// what falls outside `out` is clipped.
pub fn unit_tma_store(
    gpu: &Gpu,
    stream: &Arc<CudaStream>,
    out: &Dev,
    (rows, cols): (usize, usize),
    (col0, row0): (u32, u32),
) -> Result<()> {
    let map = TmaOperand::k_major(out.check(rows * cols, 16)?, rows, cols, cols, 64);
    let (maps, tmaps) = tma_maps(stream, &[map])?;
    let p = UnitParams { tmaps, k0: col0, row0, ..Default::default() };
    launch(gpu, stream, fixed::UNIT_TMA_STORE, 2 * 8192, (1, 1), 128, p)?;
    drop(maps);
    Ok(())
}

/// The unit `wgmma` kernels' A: one `[64][64]` K-major tile, one box.
fn unit_a_operand(a: &Dev) -> Result<TmaOperand> {
    Ok(TmaOperand::k_major(a.check(64 * 64, 16)?, 64, 64, 64, 64))
}
